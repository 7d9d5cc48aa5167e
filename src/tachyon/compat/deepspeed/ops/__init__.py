"""``deepspeed.ops``: the fused kernels' Python side (transformer layer, Adam, LAMB), from tachyon."""

from __future__ import annotations

from tachyon.compat._names import module_getattr, unsupported

_SUBMODULES = ("adam", "lamb", "op_builder", "transformer")
_TABLE = {
    "sparse_attention": unsupported("block-sparse attention is not implemented by tachyon (its attention is "
                                    "dense flash attention: tachyon.nn.DotProductAttention)"),
    "deepspeed4science": unsupported("DeepSpeed4Science kernels are not implemented by tachyon"),
}
_lookup = module_getattr(__name__, "deepspeed.ops", _TABLE, submodules=_SUBMODULES)


def __getattr__(name: str):
    if name == "__compatible_ops__":
        from tachyon.compat.deepspeed.ops.op_builder import COMPATIBLE_OPS

        return COMPATIBLE_OPS
    return _lookup(name)


__all__ = list(_SUBMODULES)
