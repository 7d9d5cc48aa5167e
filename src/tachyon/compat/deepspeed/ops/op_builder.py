"""``deepspeed.ops.op_builder``: DeepSpeed's extension builders, as far as scripts ask them.

DeepSpeed compiles C++/CUDA extensions at first use; tachyon compiles nothing (its kernels are
Triton and PyTorch). A builder here answers ``NAME`` and ``is_compatible()`` -- True for the ops
tachyon provides in Python (fused Adam, LAMB, the transformer kernel, inference kernels, 1-bit
compression), False for the rest -- and ``load()`` refuses, naming the tachyon module to use.
``deepspeed.ops.__compatible_ops__`` is the same table.
"""

from __future__ import annotations

from typing import Any


class OpBuilder:
    NAME = "op"
    compatible = False
    instead = "tachyon has no compiled extensions"

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.compatible

    def load(self, verbose: bool = True) -> Any:
        raise NotImplementedError(f"op_builder {self.NAME}: tachyon builds no extension; {self.instead}")

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}"

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """DeepSpeed's ROCm check: (major, minor) of the ROCm torch was built for, (0, 0) without."""
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return 0, 0
        major, minor = (hip.split(".") + ["0"])[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _builder(class_name: str, name: str, compatible: bool, instead: str) -> type:
    return type(class_name, (OpBuilder,), {"NAME": name, "compatible": compatible, "instead": instead})


_BUILDERS = [
    ("FusedAdamBuilder", "fused_adam", True, "use deepspeed.ops.adam.FusedAdam"),
    ("FusedLambBuilder", "fused_lamb", True, "use deepspeed.ops.lamb.FusedLamb"),
    ("TransformerBuilder", "transformer", True, "use deepspeed.ops.transformer.DeepSpeedTransformerLayer"),
    ("InferenceBuilder", "transformer_inference", True, "use deepspeed.init_inference"),
    ("QuantizerBuilder", "quantizer", True, "use tachyon.inference's INT8 weights"),
    ("CPUAdamBuilder", "cpu_adam", True, "use deepspeed.ops.adam.DeepSpeedCPUAdam"),
    ("CPUAdagradBuilder", "cpu_adagrad", False, "Adagrad is not implemented"),
    ("CPULionBuilder", "cpu_lion", False, "Lion is not implemented"),
    ("FusedLionBuilder", "fused_lion", False, "Lion is not implemented"),
    ("AsyncIOBuilder", "async_io", False, "NVMe offload is not implemented"),
    ("SparseAttnBuilder", "sparse_attn", False, "sparse attention is not implemented"),
    ("StochasticTransformerBuilder", "stochastic_transformer", True,
     "use DeepSpeedTransformerLayer with stochastic_mode=True"),
    ("UtilsBuilder", "utils", True, "tensor flattening is torch._utils._flatten_dense_tensors"),
]
globals().update({class_name: _builder(class_name, name, ok, instead) for class_name, name, ok, instead in _BUILDERS})
ALL_OPS = {name: globals()[class_name]() for class_name, name, _, _ in _BUILDERS}
COMPATIBLE_OPS = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}

__all__ = ["ALL_OPS", "COMPATIBLE_OPS", "OpBuilder", *(class_name for class_name, *_ in _BUILDERS)]
