"""FlashInfer module specs that moeserve builds differently from FlashInfer's defaults.

``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE) compiles every tile shape and cluster shape of every
dtype pair: 182 translation units for the sm90 module, several hours of one core in all. TensorRT-LLM's
``FAST_BUILD`` keeps one tile (CTA 128x128, cluster 1x1x1) per kernel and turns the rest into a clear
runtime error; its heuristic then proposes only that tile. FlashInfer's ``use_fast_build=True`` passes the
macro to the host compiler only, so the kernels are still all built. The spec here passes it to nvcc too.
The module keeps FlashInfer's name (``fused_moe_90``), so FlashInfer's own ``cutlass_fused_moe`` loads it
from moeserve's kernel cache.

FlashInfer's spec also compiles every generated instantiation file it finds, including the non-grouped
``gemm/`` ones: the weight-only mixed-input GEMM launchers (``sm90_generic_mixed_gemm_kernelLauncher``)
of its ``fpA_intB`` GEMM, which none of the MoE module's sources references. The spec here leaves them out
(48 of 182 sources on sm90).

Its mixed-input (W4A8 / W4A16) grouped GEMMs are most of what is left: 52 generated files of about four
minutes of one core each, which ``FAST_BUILD`` does not thin. moeserve runs no mixed-input MoE, so their
explicit instantiations are compiled together in one file against ``cutlass/mixed_input_launcher_stub.inl``:
the same symbols (the dispatch code takes their addresses), with bodies that raise a clear error.

The remaining generated sm90 grouped-GEMM files spend most of their compile time parsing the same CUTLASS
headers (about 80 s of one core each, even when ``FAST_BUILD`` empties every kernel in them); they are
compiled in ``MERGED_UNITS`` translation units that each include a share of them (the launcher they include
is ``#pragma once``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path, PurePath

FAST_BUILD_FLAG = "-DFAST_BUILD"
STUB_INL = Path(__file__).parent / "cutlass" / "mixed_input_launcher_stub.inl"
MERGED_UNITS = 4


def gen_cutlass_fused_moe_fast_build(gen_name: str):
    """The ``JitSpec`` of ``flashinfer.jit.fused_moe.<gen_name>(use_fast_build=True)`` with ``FAST_BUILD``
    in the CUDA flags as well as the host flags."""
    from flashinfer.jit import fused_moe

    spec = getattr(fused_moe, gen_name)(True)
    cuda_flags = list(spec.extra_cuda_cflags or [])
    if FAST_BUILD_FLAG not in cuda_flags:
        cuda_flags.append(FAST_BUILD_FLAG)
    sources = [src for src in spec.sources if not is_weight_only_gemm_instantiation(src)]
    mixed = [src for src in sources if is_mixed_input_grouped_instantiation(src)]
    if mixed:
        stub = write_mixed_input_stubs(mixed, Path(mixed[0]).parents[2] / "moeserve")
        sources = [src for src in sources if src not in mixed] + [stub]
    grouped = [src for src in sources if is_tma_grouped_instantiation(src)]
    if grouped:
        units = write_merged_units(grouped, Path(grouped[0]).parents[2] / "moeserve", MERGED_UNITS)
        sources = [src for src in sources if src not in grouped] + units
    return dataclasses.replace(spec, extra_cuda_cflags=cuda_flags, sources=sources)


def is_tma_grouped_instantiation(path) -> bool:
    """A generated TMA grouped-GEMM file (``gemm_grouped/<arch >= 90>/...``, not mixed-input)."""
    parts = PurePath(path).parts
    return (str(path).endswith(".generated.cu") and len(parts) >= 3 and parts[-3] == "gemm_grouped"
            and parts[-2].isdigit() and int(parts[-2]) >= 90 and "_Mixed_" not in parts[-1])


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_merged_units(sources: list, out_dir: Path, units: int) -> list[Path]:
    """``units`` translation units that ``#include`` ``sources`` between them, in order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(sources, key=str)
    share = -(-len(ordered) // units)
    paths = []
    for i in range(0, len(ordered), share):
        path = out_dir / f"grouped_gemm_unit{i // share}.cu"
        _write_if_changed(path, "".join(f'#include "{src}"\n' for src in ordered[i:i + share]))
        paths.append(path)
    return paths


def is_mixed_input_grouped_instantiation(path) -> bool:
    """A generated grouped-GEMM file of mixed-input launchers (``gemm_grouped/<arch>/..._Mixed_...``)."""
    parts = PurePath(path).parts
    return (str(path).endswith(".generated.cu") and len(parts) >= 3 and parts[-3] == "gemm_grouped"
            and "_Mixed_" in parts[-1])


def write_mixed_input_stubs(sources: list, out_dir: Path) -> Path:
    """One ``.cu`` holding the explicit instantiations of every file in ``sources`` (their first line, the
    include of the real launcher, replaced by the stub's); rewritten only when its text changes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    inl = out_dir / STUB_INL.name
    _write_if_changed(inl, STUB_INL.read_text())
    bodies = []
    for src in sorted(sources, key=str):
        lines = Path(src).read_text().splitlines()
        if not lines or "moe_gemm_tma_ws_mixed_input_launcher.inl" not in lines[0]:
            raise RuntimeError(f"{src}: expected the mixed-input launcher include on its first line")
        bodies.append(f"// from {PurePath(src).name}\n" + "\n".join(lines[1:]))
    text = f'#include "{inl.name}"\n' + "\n".join(bodies) + "\n"
    cu = out_dir / "mixed_input_launcher_stubs.cu"
    _write_if_changed(cu, text)
    return cu


def is_weight_only_gemm_instantiation(path) -> bool:
    """A generated non-grouped ``gemm/<arch>/...generated.cu`` file: fpA_intB weight-only GEMM launchers,
    which the MoE module does not use."""
    parts = PurePath(path).parts
    return str(path).endswith(".generated.cu") and len(parts) >= 3 and parts[-3] == "gemm"
