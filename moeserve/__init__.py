"""moeserve: a FlashInfer-native inference engine and benchmark harness for mixture-of-experts LLMs.

``from moeserve import LLM, SamplingParams`` gives the offline API; the names load on first use so that
kernel tools (``python -m moeserve.ops.moe.tune_triton``) start without the engine's dependencies.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

_LAZY = {
    "LLM": "moeserve.engine.llm",
    "SamplingParams": "moeserve.engine.sampling_params",
    "RequestOutput": "moeserve.engine.outputs",
    "CompletionOutput": "moeserve.engine.outputs",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
