"""FlashInfer kernel artifacts: what is installed, an ahead-of-time kernel cache, and which modules compiled.

- ``artifact_report(hw)``: FlashInfer's packages and caches (shown by ``moeserve env``).
- ``use_kernel_cache(path, hw)``: point FlashInfer at a cache made by ``moeserve precompile`` (the engine
  calls it when ``kernel_cache_dir`` is set, before FlashInfer is imported).
- ``jit_events()`` / ``startup_summary()``: every FlashInfer module this process loaded, and whether it
  had to compile (recorded by the hook ``moeserve.ops.flashinfer_env`` installs).
- ``moeserve precompile`` and ``moeserve install-kernels`` (``register``).

Importing this package does not import FlashInfer or torch.
"""
from __future__ import annotations

from moeserve.kernels.jit_hook import clear_jit_events, jit_events, startup_summary
from moeserve.kernels.layout import KernelCacheError, parse_arch

__all__ = ["artifact_report", "use_kernel_cache", "jit_events", "clear_jit_events", "startup_summary",
           "KernelCacheError", "parse_arch", "register", "modules_for_config"]


def artifact_report(hw) -> dict:
    from moeserve.kernels.cache import artifact_report as report
    return report(hw)


def use_kernel_cache(path, hw) -> dict:
    from moeserve.kernels.cache import use_kernel_cache as use
    return use(path, hw)


def modules_for_config(cfg, arch):
    from moeserve.kernels.modules import modules_for_config as modules
    return modules(cfg, arch)


def register(subparsers, name: str, help_text: str) -> None:
    """Add ``precompile`` or ``install-kernels`` to the ``moeserve`` command line."""
    if name == "precompile":
        from moeserve.kernels import precompile as cmd
    elif name == "install-kernels":
        from moeserve.kernels import install as cmd
    else:
        raise ValueError(f"moeserve.kernels.register: unknown command {name!r}")
    p = subparsers.add_parser(name, help=help_text, description=(cmd.__doc__ or "").split("\n\n")[0])
    cmd.add_args(p)
    p.set_defaults(func=cmd.run)
