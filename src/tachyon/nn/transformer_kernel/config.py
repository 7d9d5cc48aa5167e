"""TransformerKernelConfig: the settings of the fused BERT layer, DeepSpeed's names and defaults.

The fields, their order and defaults are those of DeepSpeed's ``DeepSpeedTransformerConfig`` plus
``max_seq_length`` (from the DeepSpeed tutorial) and ``bf16``. Sizes left at -1 are "not given"
and rejected; ``intermediate_size`` None or -1 means ``4 * hidden_size``. Everything is checked at
construction and a bad value raises a ValueError naming the field and what is allowed.

    config = TransformerKernelConfig(batch_size=64, max_seq_length=128, hidden_size=1024, heads=16,
                                     attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                     num_hidden_layers=24, initializer_range=0.02, seed=1234,
                                     fp16=True, pre_layer_norm=True)
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch


@dataclasses.dataclass
class TransformerKernelConfig:
    """Settings of one :class:`TransformerKernelLayer` (a BERT encoder layer).

    General: ``batch_size`` (the largest micro-batch a forward accepts), ``max_seq_length`` (the
    longest sequence), ``hidden_size``, ``intermediate_size`` (FFN width; None/-1 -> 4 * hidden),
    ``heads``, ``attn_dropout_ratio`` (dropout on the attention probabilities),
    ``hidden_dropout_ratio`` (dropout on the attention-output and FFN-output projections),
    ``num_hidden_layers`` (only used by ``adjust_init_range``), ``initializer_range`` (std of the
    normal weight init), ``layer_norm_eps``, ``pre_layer_norm`` (Pre-LN or Post-LN/BERT).

    Environment: ``local_rank`` (>= 0: ``torch.cuda.set_device(local_rank)`` at layer
    construction when CUDA is there), ``seed`` (dropout seed; -1: each layer draws one from
    torch's default generator when it is built), ``fp16`` / ``bf16`` (parameter and input dtype;
    neither: fp32), ``training`` (False: the layer is inference-only: no dropout, no autograd graph).

    Memory flags (each strictly lowers what one layer saves for backward; see
    docs/transformer_kernel.md for measured bytes): ``normalize_invertible`` (LayerNorms save
    their output instead of their input and backpropagate from it), ``gelu_checkpoint`` (the GELU
    output is not saved; recomputed from the pre-activation in backward), ``attn_dropout_checkpoint``
    (the attention probabilities are never stored anyway, flash attention; this flag also drops the
    QKV projection output and the attention's logsumexp, recomputing them from the layer input in
    backward; the attention output is the output projection's input, kept by that GEMM).

    ``stochastic_mode``: DeepSpeed's speed-for-reproducibility trade. True makes the attention
    backward on the Triton backend use its non-deterministic variant (``attention(...,
    deterministic=False)``): the dK/dV kernel also accumulates dQ with fp32 atomics, so the
    probabilities are recomputed once instead of twice. On a GPU the order of those additions
    varies, so dQ (and every gradient upstream of it) can differ in the last bits run to run;
    the forward outputs, the dropout masks and dK/dV stay deterministic. The torch backend (CPU)
    ignores it: runs there are bit-reproducible either way.

    ``return_tuple``: forward returns ``(out,)`` instead of ``out``. ``adjust_init_range``: the
    attention-output and FFN-output weights use ``initializer_range / sqrt(2 * num_hidden_layers)``.

    ``layer_id`` is not an argument: each layer sets it on its own copy of the config.
    """

    batch_size: int = -1
    max_seq_length: int = -1
    hidden_size: int = -1
    intermediate_size: int | None = None
    heads: int = -1
    attn_dropout_ratio: float = -1
    hidden_dropout_ratio: float = -1
    num_hidden_layers: int = -1
    initializer_range: float = -1
    layer_norm_eps: float = 1e-12
    local_rank: int = -1
    seed: int = -1
    fp16: bool = False
    bf16: bool = False
    pre_layer_norm: bool = True
    normalize_invertible: bool = False
    gelu_checkpoint: bool = False
    adjust_init_range: bool = True
    attn_dropout_checkpoint: bool = False
    stochastic_mode: bool = False
    return_tuple: bool = False
    training: bool = True
    layer_id: int = dataclasses.field(default=-1, init=False)

    def __post_init__(self) -> None:
        if self.intermediate_size is None or (_is_int(self.intermediate_size) and self.intermediate_size == -1):
            if _is_int(self.hidden_size) and self.hidden_size > 0:
                self.intermediate_size = 4 * self.hidden_size
        problems = list(self._problems())
        if problems:
            raise ValueError("TransformerKernelConfig: " + "; ".join(problems))

    def _problems(self):
        for name in ("batch_size", "max_seq_length", "hidden_size", "intermediate_size", "heads", "num_hidden_layers"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                yield f"{name} must be a positive int; got {value!r}"
        if _is_int(self.hidden_size) and _is_int(self.heads) and self.hidden_size > 0 and self.heads > 0:
            if self.hidden_size % self.heads:
                yield (f"hidden_size ({self.hidden_size}) must be divisible by heads ({self.heads}); "
                       f"allowed heads divide {self.hidden_size}")
        for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value < 1.0:
                yield f"{name} must be a number in [0, 1); got {value!r}"
        if not _is_number(self.initializer_range) or not self.initializer_range > 0:
            yield f"initializer_range must be a number > 0; got {self.initializer_range!r}"
        if not _is_number(self.layer_norm_eps) or not self.layer_norm_eps > 0:
            yield f"layer_norm_eps must be a number > 0; got {self.layer_norm_eps!r}"
        if not _is_int(self.local_rank) or self.local_rank < -1:
            yield f"local_rank must be an int >= -1 (-1: do not set the device); got {self.local_rank!r}"
        if not _is_int(self.seed) or not -1 <= self.seed < 2**63:
            yield f"seed must be an int in [0, 2**63), or -1 to draw one from torch's generator; got {self.seed!r}"
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                yield f"{f.name} must be True or False; got {getattr(self, f.name)!r}"
        if self.fp16 is True and self.bf16 is True:
            yield "fp16 and bf16 cannot both be True; allowed: at most one of them (neither: fp32)"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's parameters and inputs: float16, bfloat16 or float32."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    def to_dict(self) -> dict[str, Any]:
        """All fields, ``layer_id`` included (``from_dict`` accepts the result)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerKernelConfig:
        """Build from a dict of field names; an unknown key raises a ValueError (with a did-you-mean)."""
        if not isinstance(values, dict):
            raise ValueError(f"TransformerKernelConfig.from_dict takes a dict; got {type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in known:
                guess = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {guess[0]!r}?" if guess else f"; allowed keys: {', '.join(known)}"
                raise ValueError(f"TransformerKernelConfig: unknown key {key!r}{hint}")
        args = {k: v for k, v in values.items() if k != "layer_id"}
        config = cls(**args)
        if "layer_id" in values:
            config.layer_id = values["layer_id"]
        return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
