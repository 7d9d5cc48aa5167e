"""What `tachyon plan` knows of a model: its architecture, its parameter count, where the
parameters sit when it is split over tensor- and pipeline-parallel ranks.

Three families, each the layer tachyon trains them with:

- ``gpt``: `tachyon.nn.TransformerLayer` (LayerNorm, tanh GELU, biases, learned positions),
  as `tachyon.train.models.GPT` builds it (GPT-2);
- ``llama``: the same layer with RMSNorm, SwiGLU, no biases, rotary positions, grouped KV heads;
- ``bert``: `tachyon.nn.TransformerKernelLayer` (DeepSpeed's fused BERT layer) with its memory
  flags, as `tachyon.train.models.BertMLM` builds it (the LM head runs at the masked positions only).

Parameter counts follow those modules exactly (the tests compare them with the real modules):

    per layer (gpt/llama):  norms        (2 or 1) * hidden, twice
                            QKV          (heads + 2 kv_heads) * head_dim * hidden  (+ bias)
                            projection   hidden * heads * head_dim                 (+ bias)
                            fc1          ffn (x2 gated) * hidden                   (+ bias)
                            fc2          hidden * ffn                              (+ bias)
    per layer (bert):       QKV 3h*h + 3h, out h*h + h, two LayerNorms 4h, intermediate I*h + I,
                            output h*I + h
    embedding:              padded_vocab * hidden (+ positions * hidden when learned; bert: + LN)
    head:                   final norm; untied LM head padded_vocab * hidden; bert: transform
                            h*h + h, its LayerNorm, the LM bias

The vocabulary is padded to a multiple of 64 * tp (`tachyon.data.padded_vocab_size`, and
divisible by the tensor-parallel size). With tensor parallelism (Megatron-style), QKV, fc1 and
their biases, the projection and fc2 weights and the vocabulary are split tp ways; norms and the
row-parallel biases (projection, fc2) are replicated.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from tachyon.data import padded_vocab_size

FAMILIES = ("gpt", "llama", "bert")
NORMS = ("LayerNorm", "RMSNorm")
GATED = ("swiglu", "geglu")
KERNEL_FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


class PlanError(ValueError):
    """An impossible or unknown input to the planner; the message names it and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A transformer's shape. ``seq`` is the training sequence length; ``max_positions`` the rows
    of a learned position table (default ``seq``). ``head_dim`` defaults to hidden / heads,
    ``kv_heads`` to heads, ``ffn`` to 4 * hidden. bert only: ``pre_layer_norm``, the kernel's
    memory flags, ``mlm_fraction`` (share of tokens the LM head runs at) and ``dropout`` (the
    embedding dropout, whose mask is saved)."""

    family: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    max_positions: int | None = None
    tied_embeddings: bool = True
    name: str = "custom"
    pre_layer_norm: bool = True
    normalize_invertible: bool = False
    gelu_checkpoint: bool = False
    attn_dropout_checkpoint: bool = False
    mlm_fraction: float = 0.15
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise PlanError(f"model family must be one of {FAMILIES}; got {self.family!r}")
        for key in ("layers", "hidden", "heads", "seq", "vocab"):
            _check_positive(key, getattr(self, key))
        for key in ("ffn", "kv_heads", "head_dim", "max_positions"):
            if getattr(self, key) is not None:
                _check_positive(key, getattr(self, key))
        if self.head_dim is None and self.hidden % self.heads:
            raise PlanError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); or give head_dim")
        if self.num_kv_heads > self.heads or self.heads % self.num_kv_heads:
            raise PlanError(f"kv_heads ({self.num_kv_heads}) must divide heads ({self.heads})")
        if self.family == "bert" and self.num_kv_heads != self.heads:
            raise PlanError("the bert family (TransformerKernelLayer) has no grouped KV heads; leave kv_heads unset")
        if self.family != "bert" and any(getattr(self, f) for f in KERNEL_FLAGS):
            raise PlanError(f"{', '.join(KERNEL_FLAGS)} are memory flags of the bert family's kernel layer; "
                            f"model family is {self.family!r}")
        if not 0.0 < self.mlm_fraction <= 1.0:
            raise PlanError(f"mlm_fraction must be in (0, 1]; got {self.mlm_fraction!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise PlanError(f"dropout must be in [0, 1); got {self.dropout!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def positions(self) -> int:
        return self.max_positions if self.max_positions is not None else self.seq

    @property
    def norm(self) -> str:
        return "RMSNorm" if self.family == "llama" else "LayerNorm"

    @property
    def norm_params(self) -> int:
        """Parameters per hidden element of one norm: weight and bias (LayerNorm) or weight."""
        return 1 if self.norm == "RMSNorm" else 2

    @property
    def activation(self) -> str:
        return {"gpt": "gelu", "llama": "swiglu", "bert": "gelu"}[self.family]

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def bias(self) -> bool:
        return self.family != "llama"

    @property
    def learned_positions(self) -> bool:
        return self.family != "llama"

    @property
    def causal(self) -> bool:
        return self.family != "bert"

    @property
    def qkv_width(self) -> int:
        """Outputs of the fused QKV projection: (heads + 2 kv_heads) * head_dim."""
        return (self.heads + 2 * self.num_kv_heads) * self.kv_channels

    @property
    def fc1_width(self) -> int:
        return 2 * self.ffn_size if self.gated else self.ffn_size

    def padded_vocab(self, tp: int = 1) -> int:
        """The embedding / LM-head rows: vocab rounded up to a multiple of 64 * tp."""
        return padded_vocab_size(self.vocab, 64 * tp)

    # ------------------------------------------------------------------ parameters
    def layer_gemm_weights(self) -> int:
        """Elements of one layer's GEMM weights (the FLOPs are 2 per element per token)."""
        h, attn = self.hidden, self.heads * self.kv_channels
        return self.qkv_width * h + h * attn + self.fc1_width * h + h * self.ffn_size

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one layer on one tensor-parallel rank."""
        h = self.hidden
        if self.family == "bert":
            i = self.ffn_size
            sharded = 3 * h * h + 3 * h + h * h + i * h + i + h * i
            replicated = h + 4 * h + h  # attention-output bias, two LayerNorms, output bias
        else:
            b = 1 if self.bias else 0
            sharded = self.layer_gemm_weights() + b * (self.qkv_width + self.fc1_width)
            replicated = 2 * self.norm_params * h + b * 2 * h  # two norms, projection and fc2 biases
        return sharded // tp + replicated

    def embedding_params(self, tp: int = 1) -> int:
        """The first stage's non-layer parameters on one tensor-parallel rank."""
        h = self.hidden
        n = self.padded_vocab(tp) * h // tp
        if self.learned_positions:
            n += self.positions * h
        if self.family == "bert":
            n += 2 * h  # embedding LayerNorm
        return n

    def head_params(self, tp: int = 1, pipeline: bool = False) -> int:
        """The last stage's non-layer parameters on one tensor-parallel rank. With a pipeline
        (``pipeline=True``) a tied LM head is a copy of the embedding on the last stage (kept
        equal by an all-reduce of its gradient), as Megatron and DeepSpeed's TiedLayerSpec do."""
        h, vocab = self.hidden, self.padded_vocab(tp) // tp
        n = self.norm_params * h
        if self.family == "bert":
            n += h * h + h + 2 * h + vocab  # transform dense, its LayerNorm, the LM bias
        if not self.tied_embeddings or pipeline:
            n += vocab * h
        return n

    def total_params(self) -> int:
        """Distinct parameters of the whole model (one process, a tied weight once)."""
        return self.embedding_params() + self.layers * self.layer_params() + self.head_params()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(ffn=self.ffn_size, kv_heads=self.num_kv_heads, head_dim=self.kv_channels,
                   max_positions=self.positions, norm=self.norm, activation=self.activation, bias=self.bias,
                   padded_vocab=self.padded_vocab(), params=self.total_params())
        if self.family != "bert":
            for key in (*KERNEL_FLAGS, "pre_layer_norm", "mlm_fraction", "dropout"):
                out.pop(key)
        return out


def _check_positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{key} must be an integer >= 1; got {value!r}")


# ---------------------------------------------------------------------- presets
# Sizes from the models' published Hugging Face configs (config.json of gpt2, gpt2-medium,
# gpt2-large, gpt2-xl, meta-llama/Llama-2-{7,13,70}b-hf, meta-llama/Meta-Llama-3-{8,70}B,
# bert-base-uncased, bert-large-uncased). bert-large is the DeepSpeed BERT tutorial's pre-LN
# BERT-Large (seed: seq 128 there; 512 is its longer phase).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(family="gpt", layers=12, hidden=768, heads=12, seq=1024, vocab=50257),
    "gpt2-medium": dict(family="gpt", layers=24, hidden=1024, heads=16, seq=1024, vocab=50257),
    "gpt2-large": dict(family="gpt", layers=36, hidden=1280, heads=20, seq=1024, vocab=50257),
    "gpt2-xl": dict(family="gpt", layers=48, hidden=1600, heads=25, seq=1024, vocab=50257),
    "llama-7b": dict(family="llama", layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn=11008,
                     tied_embeddings=False),
    "llama-13b": dict(family="llama", layers=40, hidden=5120, heads=40, seq=4096, vocab=32000, ffn=13824,
                      tied_embeddings=False),
    "llama-70b": dict(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, seq=4096, vocab=32000,
                      ffn=28672, tied_embeddings=False),
    "llama3-8b": dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=8, seq=8192, vocab=128256,
                      ffn=14336, tied_embeddings=False),
    "llama3-70b": dict(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, seq=8192, vocab=128256,
                       ffn=28672, tied_embeddings=False),
    "bert-base": dict(family="bert", layers=12, hidden=768, heads=12, seq=512, vocab=30522),
    "bert-large": dict(family="bert", layers=24, hidden=1024, heads=16, seq=512, vocab=30522),
}

_HF_KEYS = {
    # model_type -> (family, {our field: HF key or keys in order})
    "gpt2": ("gpt", {"layers": ("n_layer",), "hidden": ("n_embd",), "heads": ("n_head",), "ffn": ("n_inner",),
                     "vocab": ("vocab_size",), "max_positions": ("n_positions",)}),
    "llama": ("llama", {"layers": ("num_hidden_layers",), "hidden": ("hidden_size",),
                        "heads": ("num_attention_heads",), "kv_heads": ("num_key_value_heads",),
                        "ffn": ("intermediate_size",), "vocab": ("vocab_size",), "head_dim": ("head_dim",),
                        "max_positions": ("max_position_embeddings",)}),
    "bert": ("bert", {"layers": ("num_hidden_layers",), "hidden": ("hidden_size",),
                      "heads": ("num_attention_heads",), "ffn": ("intermediate_size",), "vocab": ("vocab_size",),
                      "max_positions": ("max_position_embeddings",)}),
}
_HF_ALIASES = {"mistral": "llama", "roberta": "bert"}


def preset(name: str, **overrides: Any) -> ModelSpec:
    """A named model (``PRESETS``), with fields overridden (None values are ignored)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PlanError(f"unknown model {name!r}: known models are {sorted(PRESETS)} or a path to an HF "
                        f"config.json{hint}")
    fields = dict(PRESETS[name], name=name)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(**fields)


def from_hf_config(path: str | Path, **overrides: Any) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (model_type gpt2, llama, mistral, bert or
    roberta). ``seq`` defaults to the config's position limit. HF BERT is post-LN."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read model config {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{str(path)!r} is not valid JSON: {exc}") from None
    model_type = config.get("model_type")
    kind = _HF_ALIASES.get(model_type, model_type)
    if kind not in _HF_KEYS:
        supported = sorted([*_HF_KEYS, *_HF_ALIASES])
        raise PlanError(f"{str(path)!r}: model_type {model_type!r} is not supported; supported: {supported}")
    family, keys = _HF_KEYS[kind]
    fields: dict[str, Any] = {"family": family, "name": config.get("_name_or_path") or path.parent.name or "hf"}
    for field, candidates in keys.items():
        for key in candidates:
            if config.get(key) is not None:
                fields[field] = config[key]
                break
    missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in fields]
    if missing:
        raise PlanError(f"{str(path)!r} lacks {[keys[f][0] for f in missing]} (needed for a {model_type} model)")
    if fields.get("head_dim") == fields["hidden"] // fields["heads"]:
        fields.pop("head_dim")
    fields["tied_embeddings"] = bool(config.get("tie_word_embeddings", family != "llama"))
    if family == "bert":
        fields["pre_layer_norm"] = False
    fields["seq"] = fields.get("max_positions", 2048)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(**fields)


def resolve_model(model: str | None, **fields: Any) -> ModelSpec:
    """``model`` is a preset name, a path to an HF config.json, or None (then ``fields`` must hold
    family, layers, hidden, heads, seq and vocab). Fields given override the named model's."""
    if model is None:
        missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab") if fields.get(k) is None]
        if missing:
            raise PlanError("describe the model with --model NAME|config.json, or give all of "
                            f"--layers --hidden --heads --seq --vocab (missing: {', '.join('--' + m for m in missing)})")
        fields.setdefault("family", "gpt")
        if fields["family"] is None:
            fields["family"] = "gpt"
        return ModelSpec(**{k: v for k, v in fields.items() if v is not None})
    if model.endswith(".json") or Path(model).is_file():
        return from_hf_config(model, **fields)
    return preset(model, **fields)


__all__ = ["FAMILIES", "KERNEL_FLAGS", "PRESETS", "ModelSpec", "PlanError", "from_hf_config", "preset",
           "resolve_model"]
