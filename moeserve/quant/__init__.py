"""Weight quantisation: block-FP8 (e4m3, 128x128 weight blocks, 1x128 dynamic activation groups).

``fp8``: the quantisers and the torch reference linear layer; ``moe_ref``: the torch reference for FP8
experts; ``config``: which format an engine runs (engine config plus the checkpoint's
``quantization_config``); ``loading``: putting checkpoint tensors into FP8 parameters.
"""
from moeserve.quant.config import QuantizationError, checkpoint_quantization, engine_quantization, resolve_quantization
from moeserve.quant.fp8 import (BLOCK, FP8_DTYPE, FP8_MAX, block_dequant_fp8, block_quant_fp8, block_scale_shape,
                                fp8_linear_reference, per_token_group_dequant, per_token_group_quant_fp8)

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "QuantizationError", "block_dequant_fp8", "block_quant_fp8",
           "block_scale_shape", "checkpoint_quantization", "engine_quantization", "fp8_linear_reference",
           "per_token_group_dequant", "per_token_group_quant_fp8", "resolve_quantization"]
