"""The operators moeserve dispatches and the backend names each accepts (no heavy imports here)."""

OPERATORS = ("attention", "moe", "routing", "linear", "sampling", "norm", "rope", "activation")

BACKEND_NAMES: dict[str, tuple[str, ...]] = {
    "attention": ("flashinfer", "torch"),
    "moe": ("flashinfer", "triton", "torch"),
    "routing": ("fused", "torch"),
    "linear": ("flashinfer", "torch"),
    "sampling": ("flashinfer", "torch"),
    "norm": ("flashinfer", "torch"),
    "rope": ("flashinfer", "torch"),
    "activation": ("flashinfer", "torch"),
}
