"""moeserve: a FlashInfer-native inference engine and benchmark harness for mixture-of-experts LLMs."""
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
