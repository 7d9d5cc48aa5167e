"""Bytes saved for backward, per token, by tachyon's layers: what `tachyon plan` multiplies out.

The starting point is the Megatron accounting (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"): one GPT layer with 16-bit activations saves
``s*b*h*(34 + 5*a*s/h)`` bytes, ``34/t + 5as/(ht)`` with tensor + sequence parallelism, ``34`` with
selective recomputation (the attention core recomputed), and only its ``2sbh``-byte input with
full recomputation. tachyon's layers save less than that, and differently:

- attention is flash attention: the ``a*s*s`` probabilities, their dropout mask and dropout output
  (the ``5as/h`` term) are never stored; the kernel keeps its output O and one fp32 logsumexp per
  head and query instead;
- dropout masks are regenerated from Philox seeds in backward, never stored (Megatron's 1-byte
  masks, ``2sbh`` per layer, are gone);
- the attention kernel writes O in the memory order of q, so the projection GEMM's [tokens, hidden]
  input is a view of O: O is held once (under FP8 the GEMM keeps its own FP8 copy);
- norms keep fp32 statistics (LayerNorm: mean and rstd; RMSNorm: rstd) per token.

`tachyon.nn.TransformerLayer` (gpt/llama), per token, in bytes, e = activation bytes (4 fp32,
2 bf16/fp16), g = bytes of a GEMM input (1 under FP8, else e), heads a, kv heads k, head dim d:

    e*hidden        layer input (the first norm's input)
    g*hidden        first norm's output (QKV GEMM input)
    e*(a+2k)*d      Q, K, V (attention input)
    e*a*d           attention output O (flash attention backward and projection GEMM input)
    (FP8 only) a*d  O as the projection GEMM's FP8 input
    e*hidden        residual sum (second norm input)
    g*hidden        second norm's output (fc1 input)
    e*fc1           fc1 output (activation input; 2*ffn when gated)
    g*ffn           activation output (fc2 input)
    4*(a + 2*n)     fp32 logsumexp per head, norm statistics (n = 2 LayerNorm, 1 RMSNorm)

With ffn = 4h and MHA that is 16h elements + stats (Megatron's 34 bytes minus the 4 of masks). Under FP8 the four GEMM inputs are stored as FP8 bytes and every FP8
GEMM also saves its FP8 weight (1 byte per weight element per micro-batch in flight).

`tachyon.nn.TransformerKernelLayer` (bert): ``e*(cH*hidden + cI*ffn) + 4*(ca*a + c0)`` with the
coefficients of ``KERNEL_COEFFICIENTS`` for each combination of its memory flags (docs/
transformer_kernel.md explains each flag; 8h + 2I + a + 4 with none, i.e. 16H at I = 4H).

Checkpointing: ``full`` keeps each layer's input (e*hidden per token) and, during the backward,
one recomputed layer's activations for one micro-batch; ``selective`` recomputes the attention
core (Megatron's selective recomputation), which for flash attention only drops the logsumexp
(and, under FP8, the bf16 O the GEMM does not use). With tensor parallelism (Megatron-style, with sequence parallelism) every
per-token term is split tp ways.

All of it is checked against bytes measured with ``torch.autograd.graph.saved_tensors_hooks`` on
CPU (tests/plan/test_activations.py).
"""

from __future__ import annotations

import dataclasses

from tachyon.plan.model import ModelSpec, PlanError

CHECKPOINTING = ("none", "selective", "full")
FP32 = 4
INDEX = 8  # int64 token ids / targets

KERNEL_COEFFICIENTS: dict[tuple[bool, bool, bool, bool], tuple[int, int, int, int]] = {
    # (pre_layer_norm, normalize_invertible, gelu_checkpoint, attn_dropout_checkpoint)
    #   -> (cH, cI, ca, c0): e*(cH*h + cI*I) + 4*(ca*heads + c0) bytes per token
    (True, False, False, False): (8, 2, 1, 4),
    (True, False, False, True): (4, 2, 0, 2),
    (True, False, True, False): (8, 1, 1, 4),
    (True, False, True, True): (4, 1, 0, 2),
    (True, True, False, False): (6, 2, 1, 2),
    (True, True, False, True): (3, 2, 0, 1),
    (True, True, True, False): (6, 1, 1, 2),
    (True, True, True, True): (3, 1, 0, 1),
    (False, False, False, False): (8, 2, 1, 4),
    (False, False, False, True): (5, 2, 0, 4),
    (False, False, True, False): (8, 1, 1, 4),
    (False, False, True, True): (5, 1, 0, 4),
    (False, True, False, False): (6, 2, 1, 2),
    (False, True, False, True): (3, 2, 0, 2),
    (False, True, True, False): (6, 1, 1, 2),
    (False, True, True, True): (3, 1, 0, 2),
}
"""Fitted to measured bytes of every flag combination (one layer in a stack, fp32 and bf16) and
checked at other sizes in the tests. The flags: normalize_invertible drops the LayerNorm inputs
(2h) and means; gelu_checkpoint the GELU output (I); attn_dropout_checkpoint Q, K, V, O and the
logsumexp (and, pre-LN, the first LayerNorm's output)."""


def activation_bytes(dtype: str) -> tuple[int, int]:
    """(e, g): bytes of a stored activation and of a stored GEMM input for a training dtype."""
    if dtype == "fp32":
        return 4, 4
    if dtype in ("bf16", "fp16"):
        return 2, 2
    if dtype == "fp8":
        return 2, 1
    raise PlanError(f"dtype must be one of fp32, bf16, fp16, fp8; got {dtype!r}")


def layer_items(spec: ModelSpec, dtype: str, checkpointing: str = "none") -> dict[str, float]:
    """Bytes per token one layer saves for backward, item by item (tp = 1; see the module
    docstring). With ``full`` checkpointing only the layer input remains."""
    if checkpointing not in CHECKPOINTING:
        raise PlanError(f"checkpointing must be one of {CHECKPOINTING}; got {checkpointing!r}")
    e, g = activation_bytes(dtype)
    h, a, d = spec.hidden, spec.heads, spec.kv_channels
    if checkpointing == "full":
        return {"layer input (checkpoint)": e * h}
    if spec.family == "bert":
        if dtype == "fp8":
            raise PlanError("the bert family's TransformerKernelLayer has no FP8 path; use bf16/fp16/fp32 "
                            "(FP8 is for the gpt and llama families' TransformerLayer)")
        if checkpointing == "selective":
            raise PlanError("checkpointing 'selective' is not defined for the bert family: the kernel layer "
                            "recomputes its attention block with attn_dropout_checkpoint "
                            "(--attn-dropout-checkpoint); choose none or full")
        key = (spec.pre_layer_norm, spec.normalize_invertible, spec.gelu_checkpoint, spec.attn_dropout_checkpoint)
        c_h, c_i, c_a, c_0 = KERNEL_COEFFICIENTS[key]
        return {"hidden-sized tensors": e * c_h * h, "ffn-sized tensors": e * c_i * spec.ffn_size,
                "fp32 logsumexp and LayerNorm statistics": FP32 * (c_a * a + c_0)}
    items = {
        "layer input": e * h,
        "first norm output (QKV GEMM input)": g * h,
        "Q, K, V": e * spec.qkv_width,
        "attention output (flash attention)": e * a * d,
        "residual sum (second norm input)": e * h,
        "second norm output (fc1 input)": g * h,
        "fc1 output (activation input)": e * spec.fc1_width,
        "activation output (fc2 input)": g * spec.ffn_size,
        "fp32 logsumexp": FP32 * a,
        "fp32 norm statistics": FP32 * 2 * (2 if spec.norm == "LayerNorm" else 1),
    }
    if g != e:  # FP8: the projection GEMM saves its own FP8 copy of O
        items["attention output (projection GEMM input)"] = g * a * d
    if checkpointing == "selective":
        del items["fp32 logsumexp"]
        if g != e:  # the bf16 O only the attention backward needed
            del items["attention output (flash attention)"]
    return items


def layer_bytes_per_token(spec: ModelSpec, dtype: str, checkpointing: str = "none", tp: int = 1) -> float:
    """Sum of `layer_items`, split tp ways (sequence parallelism)."""
    return sum(layer_items(spec, dtype, checkpointing).values()) / tp


def fp8_weight_bytes(spec: ModelSpec, dtype: str, tp: int = 1) -> float:
    """Bytes of the FP8 weight copies one layer's GEMMs save per forward (0 unless FP8)."""
    return spec.layer_gemm_weights() / tp if dtype == "fp8" else 0.0


def embedding_bytes_per_token(spec: ModelSpec, dtype: str, tp: int = 1) -> float:
    """What the first stage saves before its first layer: the token ids (int64); bert also the embedding
    LayerNorm's input and statistics and the embedding dropout's mask (a bool per element, as
    CUDA's dropout keeps it; PyTorch's CPU dropout keeps it in the activation dtype)."""
    e, _ = activation_bytes(dtype)
    n = float(INDEX)
    if spec.family == "bert":
        n += (e * spec.hidden + FP32 * 2) / tp
        if spec.dropout > 0:
            n += spec.hidden / tp
    return n


def head_bytes_per_token(spec: ModelSpec, dtype: str, tp: int = 1) -> float:
    """What the last stage saves after its last layer: the final norm's input and statistics,
    the LM head's input, the fp32 log-softmax of the logits over the real vocabulary (the padded
    rows are sliced off before the cross-entropy) and the targets. bert runs its head (final
    norm, transform dense + GELU + LayerNorm, LM head) only at the ``mlm_fraction`` of tokens
    that have labels, and keeps the bool label mask."""
    e, _ = activation_bytes(dtype)
    h, vocab = spec.hidden, spec.vocab / tp
    stats = FP32 * (2 if spec.norm == "LayerNorm" else 1)
    if spec.family == "bert":
        # inputs of the final norm, the transform dense, GELU, the transform norm and the LM head
        scored = (5 * e * h + 2 * stats) / tp + FP32 * vocab + INDEX
        return 1 + spec.mlm_fraction * scored
    return (2 * e * h + stats) / tp + FP32 * vocab + INDEX


def logits_transient_bytes_per_token(spec: ModelSpec, dtype: str, tp: int = 1) -> float:
    """The logits that live around the loss (not saved, but at the peak): the LM head's output in
    the model dtype and its fp32 copy, or their gradients in backward."""
    e, _ = activation_bytes(dtype)
    share = spec.mlm_fraction if spec.family == "bert" else 1.0
    return share * (e + FP32) * spec.padded_vocab(tp) / tp


@dataclasses.dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one pipeline stage for ONE micro-batch of ``tokens`` tokens."""

    layers: float
    embedding: float
    head: float
    fp8_weights: float
    recompute: float
    """With full checkpointing: one layer's activations, recomputed during backward."""

    @property
    def saved(self) -> float:
        return self.layers + self.embedding + self.head + self.fp8_weights


def stage_activations(spec: ModelSpec, dtype: str, checkpointing: str, tokens: int, layers: int, *,
                      first: bool, last: bool, tp: int = 1) -> StageActivations:
    """Saved bytes of a stage holding ``layers`` layers (plus the embedding when ``first``, the
    head when ``last``) for one micro-batch of ``tokens`` tokens."""
    per_layer = layer_bytes_per_token(spec, dtype, checkpointing, tp) * tokens
    full_layer = layer_bytes_per_token(spec, dtype, "none", tp) * tokens
    fp8 = fp8_weight_bytes(spec, dtype, tp)
    # per micro-batch constants: the position ids (int64 [seq]) and the loss's fp32 total weight
    positions = INDEX * spec.seq if spec.learned_positions else 0
    return StageActivations(
        layers=layers * per_layer,
        embedding=embedding_bytes_per_token(spec, dtype, tp) * tokens + positions if first else 0.0,
        head=head_bytes_per_token(spec, dtype, tp) * tokens + FP32 if last else 0.0,
        fp8_weights=(layers if checkpointing != "full" else 0) * fp8,
        recompute=(full_layer + fp8) if checkpointing == "full" and layers else 0.0,
    )


def megatron_layer_bytes(spec: ModelSpec, tokens: int, checkpointing: str = "none", tp: int = 1) -> float:
    """The Megatron paper's per-layer figure for 16-bit activations (for comparison only):
    sbh(34 + 5as/h)/t, 34sbh/t (selective), 2sbh (full)."""
    sbh = tokens * spec.hidden
    if checkpointing == "full":
        return 2.0 * sbh
    attention = 0.0 if checkpointing == "selective" else 5.0 * spec.heads * spec.seq / spec.hidden
    return sbh * (34.0 + attention) / tp


__all__ = [
    "CHECKPOINTING", "KERNEL_COEFFICIENTS", "StageActivations", "activation_bytes", "embedding_bytes_per_token",
    "fp8_weight_bytes", "head_bytes_per_token", "layer_bytes_per_token", "layer_items",
    "logits_transient_bytes_per_token", "megatron_layer_bytes", "stage_activations",
]
