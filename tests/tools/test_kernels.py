"""FlashInfer kernel artifacts: the modules a config loads, the kernel cache's checks and layout, the JIT
hook, precompile's and install-kernels' command lines. Everything here runs on the CPU without compiling,
except one test marked slow that builds a small module when nvcc and the headers are present."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moeserve.config import make_config
from moeserve.hardware import GPUInfo, HardwareInfo
from moeserve.kernel_cache import jit_hook
from moeserve.kernel_cache.layout import (MANIFEST_FORMAT, KernelCacheError, cached_status, check_compatible,
                                     compiled_modules, flashinfer_git_version, flashinfer_version, module_so,
                                     parse_arch, read_manifest, sha256_file, write_manifest)
from moeserve.kernel_cache.modules import DECODE_GEN, PREFILL_GEN
from moeserve.tools.modules import modules_for_config, select_modules
from moeserve.backends import BackendUnavailable

REPO = Path(__file__).resolve().parents[2]
FI_VERSION = flashinfer_version()
needs_flashinfer = pytest.mark.skipif(FI_VERSION is None, reason="flashinfer-python is not installed")


def by_key(mods):
    return {m.key: m for m in mods}


# --- which modules a configuration loads -----------------------------------------------------------

@needs_flashinfer
def test_qwen15_moe_on_hopper_loads_fa3_prefill_cuda_core_decode_and_the_basic_ops():
    mods = by_key(modules_for_config(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16"), "9.0a"))
    assert set(mods) == {"prefill", "decode", "page", "norm", "rope", "silu_and_mul", "sampling"}
    bf16 = ("torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.int32", 128, 128, 0, False, False)
    assert mods["prefill"].gen == PREFILL_GEN and mods["prefill"].args == ("fa3",) + bf16 + (False,)
    assert mods["decode"].gen == DECODE_GEN and mods["decode"].args == bf16  # 16 q heads / 16 kv heads: CUDA cores
    assert mods["silu_and_mul"].args == ("silu",)
    assert mods["norm"].gen == "flashinfer.jit.norm:gen_norm_module"


@needs_flashinfer
def test_flashinfer_moe_backend_adds_the_sm90_cutlass_module():
    cfg = make_config(model="qwen1.5-moe-a2.7b", backends={"moe": "flashinfer"})
    moe = by_key(modules_for_config(cfg, "9.0a"))["fused_moe"]
    assert moe.gen == "moeserve.tools.specs:gen_cutlass_fused_moe_fast_build"
    assert moe.args == ("gen_cutlass_fused_moe_sm90_module",)


@needs_flashinfer
def test_fast_build_cutlass_moe_spec_keeps_flashinfers_name_and_passes_the_macro_to_nvcc(tmp_path):
    """FlashInfer's own use_fast_build=True only reaches the host compiler; ours reaches nvcc too, and the
    module keeps the name FlashInfer's cutlass_fused_moe asks the kernel cache for."""
    code = ("import json\n"
            "from flashinfer.jit import fused_moe\n"
            "from moeserve.tools.specs import gen_cutlass_fused_moe_fast_build\n"
            "t = fused_moe.gen_cutlass_fused_moe_sm90_module(True)\n"
            "o = gen_cutlass_fused_moe_fast_build('gen_cutlass_fused_moe_sm90_module')\n"
            "print(json.dumps([[s.name, s.extra_cflags, s.extra_cuda_cflags, [str(x) for x in s.sources]]"
            " for s in (t, o)]))\n")
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(tmp_path), FLASHINFER_CUDA_ARCH_LIST="9.0a")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    (name_t, cflags_t, cuda_t, src_t), (name_o, cflags_o, cuda_o, src_o) = json.loads(out.stdout.splitlines()[-1])
    assert "-DFAST_BUILD" in cflags_t and "-DFAST_BUILD" not in cuda_t
    assert name_o == name_t == "fused_moe_90"
    assert cuda_o == [*cuda_t, "-DFAST_BUILD"] and cflags_o == cflags_t
    # the non-grouped gemm/ instantiations (fpA_intB launchers) are left out; the mixed-input grouped ones are
    # compiled in one file against the stub launcher; the other sm90 grouped ones in a few merged units; the
    # rest (sm80 grouped files included) is kept, in order
    left_out = [x for x in src_t if x not in src_o]
    unused = [x for x in left_out if "/gemm/90/" in x]
    mixed = [x for x in left_out if "/gemm_grouped/90/" in x and "_Mixed_" in x]
    grouped = [x for x in left_out if "/gemm_grouped/90/" in x and "_Mixed_" not in x]
    assert unused and mixed and grouped and sorted(unused + mixed + grouped) == sorted(left_out)
    kept = [x for x in src_t if x not in left_out]
    assert any("/gemm_grouped/80/" in x for x in kept)
    stub, units = Path(src_o[len(kept)]), [Path(x) for x in src_o[len(kept) + 1:]]
    assert src_o[:len(kept)] == kept and stub.name == "mixed_input_launcher_stubs.cu" and 1 < len(units) <= 4
    text = stub.read_text()
    assert text.startswith('#include "mixed_input_launcher_stub.inl"')
    assert (stub.parent / "mixed_input_launcher_stub.inl").read_text().count("TLLM_THROW") == 1
    wanted = sum(Path(x).read_text().count("template void sm90_generic_mixed_moe_gemm_kernelLauncher") for x in mixed)
    assert wanted > 0 and text.count("template void sm90_generic_mixed_moe_gemm_kernelLauncher") == wanted
    assert "moe_gemm_tma_ws_mixed_input_launcher.inl" not in text
    included = [line.split('"')[1] for u in units for line in u.read_text().splitlines()]
    assert sorted(included) == sorted(grouped)


@needs_flashinfer
def test_qwen3_gqa_group_of_8_decodes_with_the_fa2_prefill_module():
    mods = by_key(modules_for_config(make_config(model="qwen3-30b-a3b"), "9.0a"))
    assert mods["prefill"].args[0] == "fa3"
    assert mods["decode"].gen == PREFILL_GEN and mods["decode"].args[0] == "fa2"


@needs_flashinfer
def test_on_ampere_prefill_is_fa2_shared_with_decode_and_there_is_no_fused_moe():
    mods = modules_for_config(make_config(model="qwen3-30b-a3b"), "8.0")
    keys = [m.key for m in mods]
    assert keys.count("prefill") == 1 and "decode" not in keys and "fused_moe" not in keys
    assert by_key(mods)["prefill"].args[0] == "fa2"
    with pytest.raises(BackendUnavailable, match="sm80"):
        modules_for_config(make_config(model="qwen3-30b-a3b", backends={"moe": "flashinfer"}), "8.0")


@needs_flashinfer
def test_torch_backends_load_no_flashinfer_modules_and_unknown_module_names_are_refused():
    cfg = make_config(model="tiny", backends={op: "torch" for op in ("attention", "moe", "sampling", "norm", "rope",
                                                                     "activation")})
    assert modules_for_config(cfg, "9.0a") == []
    mods = modules_for_config(make_config(model="qwen1.5-moe-a2.7b"), "9.0a")
    assert [m.key for m in select_modules(mods, "norm,page")] == ["page", "norm"]
    with pytest.raises(ValueError, match="--modules: bogus"):
        select_modules(mods, "norm,bogus")


@pytest.mark.parametrize("text,name,dir_name", [("9.0a", "9.0a", "90a"), ("9.0", "9.0a", "90a"), ("sm90", "9.0a", "90a"),
                                                ("8.0", "8.0", "80"), ("sm_89", "8.9", "89"), ("100a", "10.0a", "100a"),
                                                ("12.0", "12.0f", "120f")])
def test_arch_names_follow_flashinfer(text, name, dir_name):
    a = parse_arch(text)
    assert (a.name, a.dir_name) == (name, dir_name)


def test_bad_arch_is_refused_with_an_example():
    with pytest.raises(ValueError, match="9.0a"):
        parse_arch("hopper")


# --- the kernel cache: manifest checks and layout ---------------------------------------------------

def fake_cache(base: Path, version="0.6.14", arch="9.0a", names=("norm", "page"), git="abc123") -> dict:
    modules = []
    for name in names:
        so = module_so(base, version, parse_arch(arch), name)
        so.parent.mkdir(parents=True, exist_ok=True)
        so.write_bytes(b"\x7fELF fake " + name.encode())
        modules.append({"key": name, "name": name, "so": str(so.relative_to(base)), "bytes": so.stat().st_size,
                        "sha256": sha256_file(so), "seconds": 1.0})
    manifest = {"format": MANIFEST_FORMAT, "flashinfer_version": version, "flashinfer_git": git, "arch": arch,
                "nvcc_version": "13.0", "modules": modules}
    write_manifest(base, manifest)
    return manifest


def test_version_mismatch_names_both_versions(tmp_path):
    manifest = fake_cache(tmp_path, version="0.6.9")
    with pytest.raises(KernelCacheError, match=r"0\.6\.9.*0\.6\.14"):
        check_compatible(manifest, str(tmp_path), "0.6.14", None, (9, 0))


def test_same_version_other_git_commit_is_refused(tmp_path):
    manifest = fake_cache(tmp_path, git="aaaaaaaaaaaa")
    with pytest.raises(KernelCacheError, match="git aaaaaaaaaaaa.*git bbbbbbbbbbbb"):
        check_compatible(manifest, str(tmp_path), "0.6.14", "bbbbbbbbbbbbbbbb", (9, 0))


def test_arch_mismatch_names_both_architectures(tmp_path):
    manifest = fake_cache(tmp_path, arch="9.0a")
    with pytest.raises(KernelCacheError, match=r"9\.0a \(sm90\).*8\.0 \(sm80\).*--arch 8\.0"):
        check_compatible(manifest, str(tmp_path), "0.6.14", None, (8, 0), "NVIDIA A100")
    check_compatible(manifest, str(tmp_path), "0.6.14", None, (9, 0))  # the right GPU passes


def test_fake_modules_in_the_expected_places_are_already_cached(tmp_path):
    manifest = fake_cache(tmp_path, names=("norm", "rope"))
    arch = parse_arch("9.0a")
    jit = tmp_path / ".cache/flashinfer/0.6.14/90a/cached_ops"
    assert compiled_modules(jit) == ["norm", "rope"]
    entries = {m["name"]: m for m in manifest["modules"]}
    assert cached_status(module_so(tmp_path, "0.6.14", arch, "norm"), entries["norm"], None) == "cached"
    assert cached_status(module_so(tmp_path, "0.6.14", arch, "page"), None, None) == "missing"
    module_so(tmp_path, "0.6.14", arch, "rope").write_bytes(b"changed")
    assert cached_status(module_so(tmp_path, "0.6.14", arch, "rope"), entries["rope"], None) == "stale"
    # without a manifest entry, ninja's dry run decides
    assert cached_status(module_so(tmp_path, "0.6.14", arch, "norm"), None, True) == "cached"
    assert cached_status(module_so(tmp_path, "0.6.14", arch, "norm"), None, False) == "stale"


@needs_flashinfer
def test_artifact_report_counts_the_cache_modules(tmp_path, monkeypatch):
    from moeserve.kernel_cache import artifact_report
    fake_cache(tmp_path, version=FI_VERSION, names=("norm", "page", "rope"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    rep = artifact_report(HardwareInfo("cpu"))
    assert rep["flashinfer-python"] == FI_VERSION
    assert rep["jit cache modules"] == 3
    assert rep["jit cache dir"].endswith(f"{FI_VERSION}/90a/cached_ops")
    assert "3 modules" in rep["kernel cache"]


@pytest.fixture
def clean_hook(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer.jit.env", raising=False)
    for var in ("FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CUDA_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    jit_hook.clear_kernel_cache()
    jit_hook.clear_jit_events()
    yield
    jit_hook.clear_kernel_cache()
    jit_hook.clear_jit_events()


def hopper() -> HardwareInfo:
    return HardwareInfo("cuda", gpus=[GPUInfo(0, "NVIDIA H200", (9, 0), 143 << 30, 132)])


@needs_flashinfer
def test_use_kernel_cache_sets_flashinfer_env_and_serves_the_manifest(tmp_path, clean_hook):
    from moeserve.kernel_cache import use_kernel_cache
    fake_cache(tmp_path, version=FI_VERSION, git=flashinfer_git_version())
    summary = use_kernel_cache(tmp_path, hopper())
    assert summary["modules"] == 2 and summary["missing"] == [] and summary["arch"] == "9.0a"
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path.resolve())
    assert os.environ["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a"
    assert jit_hook.active_kernel_cache()["modules"] == ["norm", "page"]


@needs_flashinfer
def test_use_kernel_cache_refuses_other_versions_archs_and_a_missing_manifest(tmp_path, clean_hook):
    from moeserve.kernel_cache import use_kernel_cache
    with pytest.raises(KernelCacheError, match="no manifest.json.*moeserve precompile"):
        use_kernel_cache(tmp_path, hopper())
    fake_cache(tmp_path, version="0.5.0")
    with pytest.raises(KernelCacheError, match=f"0.5.0 but flashinfer {FI_VERSION}"):
        use_kernel_cache(tmp_path, hopper())
    fake_cache(tmp_path, version=FI_VERSION, arch="10.0a", git=None)
    with pytest.raises(KernelCacheError, match=r"10\.0a \(sm100\) but NVIDIA H200 is 9\.0a"):
        use_kernel_cache(tmp_path, hopper())
    assert "FLASHINFER_WORKSPACE_BASE" not in os.environ and jit_hook.active_kernel_cache() is None


@needs_flashinfer
def test_use_kernel_cache_after_flashinfer_was_imported_elsewhere_is_an_error(tmp_path, clean_hook, monkeypatch):
    from moeserve.kernel_cache import use_kernel_cache
    fake_cache(tmp_path, version=FI_VERSION, git=None)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", types.SimpleNamespace(FLASHINFER_BASE_DIR=Path.home()))
    with pytest.raises(KernelCacheError, match="already imported"):
        use_kernel_cache(tmp_path, hopper())


def test_a_broken_manifest_is_reported(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(KernelCacheError, match="cannot be read"):
        read_manifest(tmp_path)


# --- the JIT hook ----------------------------------------------------------------------------------

class FakeSpec:
    """Stands in for flashinfer.jit.core.JitSpec: a name, a .so path, and a load that records its path."""

    def __init__(self, name: str, jit_dir: Path, aot: bool = False):
        self.name = name
        self.jit_library_path = jit_dir / name / f"{name}.so"
        self.is_aot = aot
        self.sources = []
        self.loaded = None

    def load(self, path):
        self.loaded = Path(path)
        return f"module:{self.name}"


def test_hook_loads_cache_modules_and_names_a_module_before_compiling(tmp_path, clean_hook, caplog):
    manifest = fake_cache(tmp_path, names=("norm",))
    jit_hook.set_kernel_cache(tmp_path, manifest)
    built = []

    def original(spec):
        built.append(spec.name)
        if spec.name == "broken":
            raise RuntimeError("nvcc failed")
        return f"built:{spec.name}"

    wrapped = jit_hook.wrap_build_and_load(original)
    norm = FakeSpec("norm", tmp_path / "elsewhere")
    assert wrapped(norm) == "module:norm" and norm.loaded == tmp_path / manifest["modules"][0]["so"]
    with caplog.at_level(logging.INFO, logger="moeserve.kernel_cache"):
        assert wrapped(FakeSpec("rope", tmp_path / "jit")) == "built:rope"
    assert "FlashInfer: compiling rope (not in the kernel cache)..." in caplog.text
    assert "FlashInfer: compiled rope in" in caplog.text
    assert wrapped(FakeSpec("aot_mod", tmp_path / "jit", aot=True)) == "built:aot_mod"
    with pytest.raises(RuntimeError, match="nvcc failed"):
        wrapped(FakeSpec("broken", tmp_path / "jit"))
    assert built == ["rope", "aot_mod", "broken"]
    ev = {e["name"]: e for e in jit_hook.jit_events()}
    assert ev["norm"]["source"] == "kernel cache" and not ev["norm"]["compiled"]
    assert ev["rope"]["compiled"] and ev["rope"]["source"] == "compiled"
    assert ev["aot_mod"]["source"] == "flashinfer-jit-cache"
    assert ev["broken"]["source"] == "failed"
    summary = jit_hook.startup_summary()
    assert "1 compiled" in summary and "rope" in summary and "1 failed (broken)" in summary


def test_hook_ignores_a_cache_entry_whose_sha256_does_not_match(tmp_path, clean_hook):
    manifest = fake_cache(tmp_path, names=("norm",))
    so = tmp_path / manifest["modules"][0]["so"]
    so.write_bytes(b"X" * so.stat().st_size)  # same size, other bytes
    jit_hook.set_kernel_cache(tmp_path, manifest)
    assert jit_hook.cache_lookup("norm") is None


def test_startup_summary_for_a_complete_cache(tmp_path, clean_hook):
    for name in ("a", "b", "c"):
        jit_hook.record(name, False, 0.01, "kernel cache")
    assert jit_hook.startup_summary() == "FlashInfer: 3 modules loaded from the kernel cache, 0 compiled"


@needs_flashinfer
def test_importing_flashinfer_after_flashinfer_env_installs_the_hook_and_adopts_a_workspace_cache(tmp_path):
    fake_cache(tmp_path, version=FI_VERSION, git=flashinfer_git_version(), names=("norm",))
    code = ("import moeserve.kernel_cache.flashinfer_env, flashinfer.jit.core as c\n"
            "from moeserve.kernel_cache import jit_hook\n"
            "print(getattr(c.JitSpec.build_and_load, 'moeserve_wrapper', False), jit_hook.active_kernel_cache())\n")
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(tmp_path), FLASHINFER_CUDA_ARCH_LIST="9.0a")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True {'root': '" + str(tmp_path)) and "['norm']" in out.stdout


@needs_flashinfer
def test_flashinfer_imported_after_use_kernel_cache_loads_through_the_hook(tmp_path):
    """A process that points FlashInfer at the cache and then imports FlashInfer itself (as a test calling
    ``flashinfer.norm`` does) must go through the hook: FlashInfer's own loader would run ninja in the cache
    for the module and compile it again over the cache's copy."""
    manifest = fake_cache(tmp_path, version=FI_VERSION, git=flashinfer_git_version(), names=("norm",))
    code = ("from moeserve.hardware import GPUInfo, HardwareInfo\n"
            "from moeserve.kernel_cache import use_kernel_cache, jit_hook\n"
            "h200 = GPUInfo(0, 'NVIDIA H200', (9, 0), 1 << 37, 132)\n"
            "use_kernel_cache(sys.argv[1], HardwareInfo('cuda', gpus=[h200]))\n"
            "import flashinfer.jit.core as c\n"
            "print(getattr(c.JitSpec.build_and_load, 'moeserve_wrapper', False), jit_hook.cache_lookup('norm'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_")}
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code, str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(tmp_path.resolve() / manifest["modules"][0]["so"])]


# --- precompile and install-kernels command lines --------------------------------------------------

def test_precompile_without_gpu_or_arch_asks_for_arch(monkeypatch, capsys):
    import moeserve.hardware
    from moeserve.cli import main
    monkeypatch.setattr(moeserve.hardware, "probe", lambda: HardwareInfo("cpu"))
    assert main(["precompile", "--model", "qwen1.5-moe-a2.7b"]) == 2
    assert "give --arch" in capsys.readouterr().err


def test_precompile_refuses_an_out_dir_made_for_another_arch(tmp_path):
    from moeserve.tools.precompile import check_existing
    fake_cache(tmp_path, version="0.6.14", arch="10.0a", git=None)
    with pytest.raises(KernelCacheError, match="10.0a, not 9.0a"):
        check_existing(tmp_path, parse_arch("9.0a"), "0.6.14", None)


def test_missing_cuda_headers_say_what_to_install(tmp_path):
    from moeserve.tools.toolchain import ToolchainError, find_header_dirs
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    with pytest.raises(ToolchainError, match="pip install nvidia-cublas nvidia-cuda-nvrtc nvidia-curand"):
        find_header_dirs(home, "13", [])
    extra = tmp_path / "inc"
    extra.mkdir()
    for h in ("cublasLt.h", "curand_kernel.h", "nvrtc.h"):
        (extra / h).write_text("")
    assert find_header_dirs(home, "13", [str(extra)]) == [extra]


@pytest.mark.skipif(not any(Path(d, "gcc").exists() for d in os.environ.get("PATH", "").split(os.pathsep)),
                    reason="no gcc")
def test_libcuda_stub_has_the_driver_soname(tmp_path):
    from moeserve.tools.toolchain import make_libcuda_stub
    stub = make_libcuda_stub(tmp_path)
    assert stub.is_file() and b"libcuda.so.1" in stub.read_bytes()


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None, reason="no gcc/readelf")
def test_module_linked_against_the_stub_needs_the_real_driver(tmp_path):
    """A module calling the driver API must keep libcuda.so.1 in its NEEDED list (the linker drops a library
    that defines nothing the module uses), or its driver calls stay unresolved on the GPU machine."""
    import subprocess
    from moeserve.tools.toolchain import make_libcuda_stub
    header = tmp_path / "cuda.h"
    header.write_text("CUresult CUDAAPI cuLibraryLoadData(CUlibrary *l);\n#define cuMemAlloc cuMemAlloc_v2\n")
    make_libcuda_stub(tmp_path / "lib", header)
    src = tmp_path / "mod.c"
    src.write_text("int cuLibraryLoadData(void*); int cuMemAlloc_v2(void*);\n"
                   "int f(void) { return cuLibraryLoadData(0) + cuMemAlloc_v2(0); }\n")
    mod = tmp_path / "mod.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,--as-needed", str(src), "-o", str(mod),
                    f"-L{tmp_path / 'lib'}", "-lcuda"], check=True, capture_output=True)
    needed = subprocess.run(["readelf", "-d", str(mod)], capture_output=True, text=True).stdout
    assert "libcuda.so.1" in needed


def test_install_kernels_commands(tmp_path):
    from moeserve.tools.install import cuda_tag, install_commands
    assert cuda_tag("13.0") == "cu130" and cuda_tag("12.9") == "cu129"
    with pytest.raises(ValueError, match="12.8, 12.9 and 13.0"):
        cuda_tag("12.4")
    cmds = install_commands("0.6.14", "cu130", python="python")
    assert cmds[0] == ["python", "-m", "pip", "install", "--no-deps", "flashinfer-cubin==0.6.14",
                       "--extra-index-url", "https://flashinfer.ai/whl"]
    assert cmds[1][-3:] == ["flashinfer-jit-cache==0.6.14+cu130", "--extra-index-url", "https://flashinfer.ai/whl/cu130"]


@needs_flashinfer
def test_install_kernels_dry_run_prints_and_unreachable_index_points_to_precompile(capsys):
    from moeserve.cli import main
    assert main(["install-kernels", "--arch", "9.0a", "--cuda", "13.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"flashinfer-jit-cache=={FI_VERSION}+cu130" in out and f"flashinfer-cubin=={FI_VERSION}" in out
    assert main(["install-kernels", "--arch", "9.0a", "--cuda", "13.0", "--index-url", "http://127.0.0.1:9/whl",
                 "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "not reachable" in err and "nothing was installed" in err and "moeserve precompile" in err


# --- the start-up bench's bookkeeping --------------------------------------------------------------

def test_startup_entry_counts_compiled_modules():
    from moeserve.bench.startup import entry_from_state
    state = {"status": "done", "ready_seconds": 100.0, "first_token_seconds": 101.5, "ttft_seconds": 1.5,
             "jit_events": [{"name": "norm", "compiled": True, "seconds": 40.0, "source": "compiled"},
                            {"name": "page", "compiled": False, "seconds": 0.1, "source": "kernel cache"},
                            {"name": "norm", "compiled": False, "seconds": 0.0, "source": "jit cache"}]}
    entry = entry_from_state("cold", state, 103.0, None, 16, {})
    row = entry["results"][0]
    assert entry["available"] and row["ready_s"] == 100.0 and row["first_token_s"] == 101.5
    assert row["fi_modules_compiled"] == 1 and row["fi_compile_s"] == 40.0
    stopped = entry_from_state("cache", {"status": "starting"}, 900.0, "stopped after 900 s (--timeout)", 16, {})
    assert not stopped["available"] and "900 s" in stopped["reason"]


# --- one real compile ------------------------------------------------------------------------------

@pytest.mark.slow
@needs_flashinfer
def test_precompile_builds_silu_and_mul_and_a_second_run_finds_it_cached(tmp_path):
    from moeserve.tools.toolchain import ToolchainError, prepare_toolchain
    try:
        prepare_toolchain(tmp_path / "support")
    except ToolchainError as e:
        pytest.skip(f"no toolchain: {e}")
    cmd = [sys.executable, "-m", "moeserve.cli", "precompile", "--model", "qwen1.5-moe-a2.7b", "--arch", "9.0a",
           "--out", str(tmp_path / "kc"), "--modules", "silu_and_mul"]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    manifest = json.loads((tmp_path / "kc" / "manifest.json").read_text())
    entry = manifest["modules"][0]
    assert manifest["arch"] == "9.0a" and entry["name"] == "silu_and_mul" and entry["bytes"] > 1000
    assert sha256_file(tmp_path / "kc" / entry["so"]) == entry["sha256"]
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert second.returncode == 0 and "already cached" in second.stdout


def test_export_copies_only_the_manifest_and_the_libraries(tmp_path):
    from moeserve.tools.precompile import export_cache
    src, dest = tmp_path / "build", tmp_path / "ship"
    manifest = fake_cache(src, names=("norm", "page"))
    (src / ".cache/flashinfer/0.6.14/90a/cached_ops/norm/norm.cuda.o").write_bytes(b"object file")
    export_cache(src, dest)
    assert read_manifest(dest)["modules"] == manifest["modules"]
    assert sorted(p.name for p in dest.rglob("*") if p.is_file()) == ["manifest.json", "norm.so", "page.so"]
    other = tmp_path / "other"
    fake_cache(other, arch="8.0", names=("rope",))
    with pytest.raises(KernelCacheError, match="9.0a, not 8.0"):
        export_cache(other, dest)


def test_a_module_with_many_sources_leaves_slots_for_the_others():
    from moeserve.tools.build_worker import JobSlots
    slots = JobSlots(16)
    assert slots.take(182, reserve=4) == 12  # the CUTLASS MoE
    assert slots.take(10) == 4 and slots.free == 0  # FA3 prefill gets what is left
    slots.give(4)
    assert slots.take(2) == 2 and slots.take(1) == 1


@needs_flashinfer
def test_fp8_weights_add_the_blockscale_gemm_and_deepseek_routing_adds_the_fused_topk():
    from moeserve.kernel_cache.modules import Target
    from moeserve.ops.moe.flashinfer_backend import flashinfer_modules as moe_flashinfer
    from moeserve.ops.moe.routing import RoutingConfig
    from moeserve.ops.moe.routing import flashinfer_modules as routing_fused
    keys = [m.key for m in modules_for_config(make_config(model="qwen1.5-moe-a2.7b", quantization="fp8"), "9.0a")]
    assert "fp8_gemm" in keys and "routing" not in keys  # Qwen routes with softmax, through Triton
    ds = RoutingConfig(method="deepseek_v3", top_k=8, renormalize=True, n_group=8, topk_group=4)
    hopper_target = Target(parse_arch("9.0a"), torch.bfloat16, torch.bfloat16, 128, 8, 128, "none", 256, ds)
    assert [m.key for m in moe_flashinfer(hopper_target)] == ["fused_moe"]
    assert [(m.key, m.op, m.backend) for m in routing_fused(hopper_target)] == [("routing", "routing", "fused")]
    ampere_target = Target(parse_arch("8.0"), torch.bfloat16, torch.bfloat16, 128, 8, 128, "none", 256, ds)
    assert routing_fused(ampere_target) == []
    glm = [m.key for m in modules_for_config(make_config(model="glm-4.5-air"), "9.0a")]
    assert "routing" in glm
    glm_torch = make_config(model="glm-4.5-air", backends={"routing": "torch"})
    assert "routing" not in [m.key for m in modules_for_config(glm_torch, "9.0a")]


def test_flashinfer_attention_is_refused_for_head_sizes_its_kernels_do_not_serve():
    """FlashInfer's FA3 prefill static-asserts its head size (64, 128 or 256): ``auto`` takes the torch
    attention for the tiny model's head_dim 16, and naming flashinfer fails with both sizes."""
    from moeserve.tools.modules import hardware_for_arch
    from moeserve.kernel_cache.layout import parse_arch
    from moeserve import backends as registry
    hw, cuda = hardware_for_arch(parse_arch("9.0a")), torch.device("cuda", 0)
    assert registry.resolve("attention", "auto", hw, cuda, torch.bfloat16, head_dim=128).name == "flashinfer"
    assert registry.resolve("attention", "auto", hw, cuda, torch.bfloat16, head_dim=16).name == "torch"
    with pytest.raises(registry.BackendUnavailable,
                       match=r"backends\.attention: 'flashinfer' is not available: serves head_dim 64, 128, 256; "
                             r"the model's is 16"):
        registry.resolve("attention", "flashinfer", hw, cuda, torch.bfloat16, head_dim=16)
    keys = [m.key for m in modules_for_config(make_config(model="tiny"), "9.0a")]
    assert "prefill" not in keys and "decode" not in keys and "norm" in keys


def test_a_flashinfer_module_missing_from_the_cache_is_refused_by_name_when_jit_is_not_allowed(tmp_path, clean_hook):
    manifest = fake_cache(tmp_path, names=("norm",))
    jit_hook.set_kernel_cache(tmp_path, manifest)
    wrapped = jit_hook.wrap_build_and_load(lambda spec: f"built:{spec.name}")
    jit_hook.set_allow_jit(False)
    try:
        assert wrapped(FakeSpec("norm", tmp_path / "elsewhere")) == "module:norm"  # in the cache: loads
        with pytest.raises(KernelCacheError, match="FlashInfer module rope is not in the kernel cache and allow_jit is false"):
            wrapped(FakeSpec("rope", tmp_path / "jit"))
    finally:
        jit_hook.set_allow_jit(True)
    assert wrapped(FakeSpec("rope", tmp_path / "jit")) == "built:rope"
