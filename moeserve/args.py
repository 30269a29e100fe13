"""Command-line flags shared by every command that builds an engine: ``--config FILE`` (YAML) and flags
that override its fields; ``--set a.b=value`` overrides any field, ``--backend op=name`` picks an operator
backend."""
from __future__ import annotations

import argparse

from moeserve.config import EngineConfig, load_config, parse_override

# (flag, config field, type) for the fields most runs touch; anything else goes through --set.
CONFIG_FLAGS = [
    ("--model", "model", str), ("--weights-dir", "weights_dir", str), ("--load-format", "load_format", str),
    ("--dtype", "dtype", str), ("--device", "device", str), ("--gpu-arch", "gpu_arch", str),
    ("--quantization", "quantization", str), ("--seed", "seed", int),
    ("--max-num-seqs", "max_num_seqs", int), ("--max-num-batched-tokens", "max_num_batched_tokens", int),
    ("--max-model-len", "max_model_len", int), ("--page-size", "page_size", int),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float), ("--kv-cache-gb", "kv_cache_gb", float),
    ("--num-kv-pages", "num_kv_pages", int),
]


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine configuration (flags override the YAML file)")
    g.add_argument("--config", "-c", help="YAML config file")
    for flag, field, typ in CONFIG_FLAGS:
        g.add_argument(flag, dest=f"cfg_{field}", type=typ, default=None, metavar=field.upper())
    g.add_argument("-tp", "--tensor-parallel-size", dest="cfg_tensor_parallel_size", type=int, default=None,
                   metavar="N", help="GPUs (one process each) the model is split across")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None, dest="cfg_enable_expert_parallel",
                   help="place whole routed experts on each rank instead of sharding every expert")
    g.add_argument("--master-addr", dest="cfg_distributed.master_addr", default=None, metavar="HOST",
                   help="address of rank 0 for a run across hosts (default: MASTER_ADDR, else this host)")
    g.add_argument("--master-port", dest="cfg_distributed.master_port", type=int, default=None, metavar="PORT",
                   help="port of rank 0's rendezvous (default: MASTER_PORT, else a free port)")
    g.add_argument("--enforce-eager", action="store_true", default=None, dest="cfg_enforce_eager",
                   help="no CUDA graphs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   dest="cfg_enable_prefix_caching", help="reuse the KV pages of prompt prefixes (default: on)")
    g.add_argument("--allow-jit", action=argparse.BooleanOptionalAction, default=None, dest="cfg_allow_jit",
                   help="compile kernels missing from kernel_cache_dir on first use (default) or refuse them at start")
    g.add_argument("--cuda-graph-batch-sizes", type=int, nargs="*", dest="cfg_cuda_graph_batch_sizes",
                   metavar="N", help="decode batch sizes to capture")
    g.add_argument("--backend", action="append", default=[], metavar="OP=NAME",
                   help="operator backend, e.g. --backend moe=triton (attention, moe, linear, sampling, norm, rope, activation)")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any config field, e.g. --set bench.runs=5")


def overrides_from_args(args: argparse.Namespace) -> dict:
    """``{dotted.field: value}`` from the engine flags, ``--backend op=name`` and ``--set field=value``."""
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    for item in args.backend:
        key, value = parse_override(item)
        overrides[f"backends.{key}"] = value
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    return overrides


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return load_config(args.config, overrides_from_args(args))
