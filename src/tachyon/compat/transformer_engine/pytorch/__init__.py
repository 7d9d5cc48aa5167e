"""``import tachyon.compat.transformer_engine.pytorch as te``: Transformer Engine's PyTorch modules on tachyon.

``te.Linear``, ``te.LayerNorm``, ``te.RMSNorm``, ``te.LayerNormLinear``, ``te.LayerNormMLP``,
``te.DotProductAttention``, ``te.MultiheadAttention``, ``te.TransformerLayer`` are `tachyon.nn`'s
modules (TE's arguments and parameter names), ``te.autocast`` is `tachyon.autocast` (and
``te.fp8_autocast`` `tachyon.fp8_autocast`), ``te.is_fp8_available`` /
``is_fp8_block_scaling_available`` / ``is_mxfp8_available`` are `tachyon.fp8`'s,
``te.RotaryPositionEmbedding`` is `tachyon.nn.RotaryPositionEmbedding`, ``te.make_graphed_callables``
is `tachyon.make_graphed_callables` (CUDA graphs, FP8 included), and ``te.checkpoint`` (also
``te.distributed.checkpoint``) runs tachyon's activation checkpoint after checking TE's keywords.
FP8 parameters (``fp8_model_init``), grouped GEMMs, ONNX export and userbuffers overlap are not
implemented and raise NotImplementedError saying what to use.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr, unsupported

_NN = ("Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "DotProductAttention",
       "MultiheadAttention", "TransformerLayer", "RotaryPositionEmbedding")
_TABLE = {name: Target((("tachyon.nn", name),)) for name in _NN}
_TABLE.update({
    "autocast": Target((("tachyon.fp8", "autocast"),)),
    "fp8_autocast": Target((("tachyon.fp8", "fp8_autocast"),)),
    "is_fp8_available": Target((("tachyon.fp8", "is_fp8_available"),)),
    "is_fp8_block_scaling_available": Target((("tachyon.fp8", "is_fp8_block_scaling_available"),)),
    "is_mxfp8_available": Target((("tachyon.fp8", "is_mxfp8_available"),)),
    "checkpoint": Target((("tachyon.compat.transformer_engine.pytorch.distributed", "checkpoint"),)),
    "fp8_model_init": unsupported("FP8 parameters are not implemented by tachyon: weights stay in bf16/fp16/fp32 "
                                  "and are cast in each FP8 GEMM (cached across micro-batches with "
                                  "is_first_microbatch); use fp8_autocast"),
    "GroupedLinear": unsupported("grouped GEMMs (mixture of experts) are not implemented by tachyon; use one Linear "
                                 "per expert"),
    "make_graphed_callables": Target((("tachyon.cuda_graphs", "make_graphed_callables"),)),
    "onnx_export": unsupported("ONNX export is not implemented by tachyon; use torch.onnx.export on the modules"),
    "initialize_ub": unsupported("userbuffers communication overlap needs tensor parallelism, which is not in "
                                 "this version of tachyon"),
    "Fp8Padding": unsupported("FP8 padding for grouped GEMMs is not implemented by tachyon"),
    "Fp8Unpadding": unsupported("FP8 padding for grouped GEMMs is not implemented by tachyon"),
})
_SUBMODULES = ("attention", "distributed")
__getattr__ = module_getattr(__name__, "transformer_engine.pytorch", _TABLE, submodules=_SUBMODULES)


def __dir__() -> list[str]:
    return sorted({*globals(), *_TABLE, *_SUBMODULES})


__all__ = [*_TABLE]
