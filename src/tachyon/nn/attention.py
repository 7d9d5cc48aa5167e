"""``DotProductAttention`` and ``MultiheadAttention``, Transformer Engine style, over tachyon's kernels.

    core = tachyon.nn.DotProductAttention(num_attention_heads=16, kv_channels=64, num_gqa_groups=4)
    ctx = core(q, k, v)                  # q [s, b, 16, 64], k/v [s, b, 4, 64] -> ctx [s, b, 1024]

    mha = tachyon.nn.MultiheadAttention(1024, 16, input_layernorm=True, num_gqa_groups=4)
    y = mha(x, rotary_pos_emb=tachyon.nn.RotaryPositionEmbedding(64)(seq_len))    # x [s, b, 1024]

The attention itself is :func:`tachyon.kernels.attention.attention` (flash-style: Triton on GPU,
memory-efficient PyTorch on CPU; GQA native, the [seq, seq] probabilities never stored, dropout
regenerated from a Philox seed in backward). The projections are tachyon's FP8-capable
``LayerNormLinear`` / ``Linear``, so ``tachyon.fp8_autocast`` covers the QKV and output GEMMs.

Mask types (``attn_mask_type``, TE's names):

- ``"causal"``: query i attends keys j <= i.   ``"no_mask"``: every key.
- ``"padding"`` / ``"padding_causal"``: ``attention_mask`` is TE's boolean mask where **True
  means masked out** (a padded token): one tensor [batch, 1, 1, seq] for self-attention, or a
  tuple (query mask [batch, 1, 1, seq_q], key mask [batch, 1, 1, seq_kv]). Masked keys get -inf
  scores (a key padding bias); outputs at masked query positions are zeros (with zero gradient),
  as in TE's fused/flash backends. A row whose keys are all masked returns zeros, never NaN.

``attention_mask`` must be None for "causal" and "no_mask" (a ValueError rather than a mask that
is silently ignored).

Dropout on the attention probabilities draws a fresh Philox seed per call (a 0-dim tensor from the
data device's default generator, ``torch.randint``), unless the caller passes one
(``dropout_seed=``, as TransformerLayer does from its one draw per forward), so
``torch.manual_seed`` reproduces a run exactly; the mask is regenerated in backward, never stored.

Self-attention runs on the packed output of the QKV GEMM (:meth:`DotProductAttention.forward_packed`,
:func:`tachyon.kernels.attention.attention_qkvpacked`): the QKV bias is added by the attention
kernels (the GEMM runs without it) and its gradient summed by them; with RoPE the GEMM keeps its
bias and the op rotates q and k; the gradient comes back as one packed tensor, in one backward
kernel (``one_kernel_backward``). TE's separate (query, key) angle tables and cross-attention
split q, k, v instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tachyon.kernels.attention import attention, attention_qkvpacked
from tachyon.kernels.rope import apply_rotary
from tachyon.nn.layernorm_linear import LayerNormLinear, check_normalization
from tachyon.nn.linear import Linear, check_features
from tachyon.nn.rope import rotary_tables

ATTN_MASK_TYPES = ("causal", "padding", "no_mask", "padding_causal")
QKV_FORMATS = ("sbhd", "bshd")


def te_default_init(weight: Tensor) -> None:
    """Transformer Engine's default weight init: normal(mean 0, std 0.023)."""
    nn.init.normal_(weight, mean=0.0, std=0.023)


def draw_seed(device: torch.device | str) -> Tensor:
    """A Philox seed for one dropout call: a 0-dim int64 tensor on ``device``, drawn from that
    device's default generator (so torch.manual_seed reproduces it). It stays on the device: no
    host synchronization, and torch.compile traces it without a graph break or a recompile."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def takes_fused_calls(forward: Callable) -> Callable:
    """Marks a subclass's replacement forward (tensor parallelism's wrappers in
    tachyon.parallel.tensor) as taking its base class's keyword arguments with the same meaning
    (``return_bias``, ``return_input_branch``, ``input_is_normalized``), so :func:`own_forward`
    accepts it and the callers use the fused calls. A further override is unmarked again."""
    forward.takes_fused_calls = True  # type: ignore[attr-defined]
    return forward


def own_forward(module: nn.Module, cls: type) -> bool:
    """True when ``module`` runs ``cls``'s own forward, or a replacement marked with
    :func:`takes_fused_calls`, so it takes cls's keyword arguments; False for any other
    subclass's forward."""
    forward = type(module).forward
    return forward is cls.forward or getattr(forward, "takes_fused_calls", False)


def check_dropout(module: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{module}: {name} must be a float in [0, 1); got {value!r}")
    return float(value)


def check_choice(module: str, name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{module}: {name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")
    return value  # type: ignore[return-value]


def check_hidden_states(module: str, name: str, t: object, hidden_size: int, qkv_format: str) -> None:
    """ValueError unless ``t`` is a 3-d tensor [seq, batch, hidden] (sbhd) / [batch, seq, hidden] (bshd)."""
    if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != hidden_size:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        layout = "[seq, batch, hidden]" if qkv_format == "sbhd" else "[batch, seq, hidden]"
        raise ValueError(f"{module}: {name} must be {layout} with hidden={hidden_size}; got {got}")


def _check_mask(name: str, mask: object, batch: int, seq: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (batch, 1, 1, seq):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"DotProductAttention: {name} must be a bool tensor [batch, 1, 1, seq] = {(batch, 1, 1, seq)} "
            f"with True = masked out (TE's convention); got {got}"
        )
    return mask[:, 0, 0, :]


def padding_masks(attention_mask: object, batch: int, seq_q: int, seq_k: int) -> tuple[Tensor, Tensor]:
    """(query masked [batch, seq_q], key masked [batch, seq_k]), bool, True = padded, from TE's
    attention_mask: one [batch, 1, 1, seq] tensor (self-attention) or a (query, key) tuple."""
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError(f"DotProductAttention: attention_mask as a tuple must be (query mask, key mask); got {len(attention_mask)} items")
        return (_check_mask("attention_mask[0] (query mask)", attention_mask[0], batch, seq_q),
                _check_mask("attention_mask[1] (key mask)", attention_mask[1], batch, seq_k))
    if seq_q != seq_k:
        raise ValueError(
            f"DotProductAttention: seq_q={seq_q} != seq_kv={seq_k}; pass attention_mask as a (query mask, key mask) tuple"
        )
    masked = _check_mask("attention_mask", attention_mask, batch, seq_q)
    return masked, masked


class DotProductAttention(nn.Module):
    """softmax(scale * q k^T + mask) v over heads, GQA-aware, with TE's layouts and mask types.

    num_attention_heads: query heads h. kv_channels: head dim d. num_gqa_groups: key/value heads g
    (h % g == 0; default h; 1 = MQA). attention_dropout: on the probabilities (training only).
    attn_mask_type: "causal" | "padding" | "no_mask" | "padding_causal" (see the module
    docstring; overridable per call). qkv_format: "sbhd" ([seq, batch, heads, d]) or "bshd".
    softmax_scale: default 1 / sqrt(d). layer_number: kept for TE compatibility (not used).
    backend: pins the attention kernel's backend ("triton" / "torch"; default the global choice).
    one_kernel_backward (default True): the Triton backward runs as one launch instead of two
    (same gradients bit for bit; see :func:`tachyon.kernels.attention.attention`).

    forward(query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
    query [s, b, h, d] / [b, s, h, d], key and value with g heads (any strides with a unit stride
    in d) -> [s, b, h * d] / [b, s, h * d] in the inputs' dtype (fp32, fp16 or bf16). Saved for
    backward (by the kernel): q, k, v, the output, the fp32 logsumexp [b, h, s] and the [b, s_kv]
    key padding bias.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        attn_mask_type: str = "causal",
        qkv_format: str = "sbhd",
        softmax_scale: float | None = None,
        layer_number: int | None = None,
        *,
        one_kernel_backward: bool = True,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        name = "DotProductAttention"
        check_features(name, num_attention_heads=num_attention_heads, kv_channels=kv_channels)
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_features(name, num_gqa_groups=groups)
        if num_attention_heads % groups:
            raise ValueError(f"{name}: num_attention_heads={num_attention_heads} must be a multiple of num_gqa_groups={groups}")
        self.num_gqa_groups = groups
        self.attention_dropout = check_dropout(name, "attention_dropout", attention_dropout)
        self.attn_mask_type = check_choice(name, "attn_mask_type", attn_mask_type, ATTN_MASK_TYPES)
        self.qkv_format = check_choice(name, "qkv_format", qkv_format, QKV_FORMATS)
        if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                          or not math.isfinite(softmax_scale)):
            raise ValueError(f"{name}: softmax_scale must be a finite float or None (1/sqrt(kv_channels)); got {softmax_scale!r}")
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        if not isinstance(one_kernel_backward, bool):
            raise ValueError(f"{name}: one_kernel_backward must be True or False; got {one_kernel_backward!r}")
        self.one_kernel_backward = one_kernel_backward
        self.backend = backend

    def _to_bhsd(self, name: str, t: object, heads: int) -> Tensor:
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[2] != heads or t.shape[3] != self.kv_channels:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            layout = "[seq, batch, heads, d]" if self.qkv_format == "sbhd" else "[batch, seq, heads, d]"
            raise ValueError(
                f"DotProductAttention: {name} must be {layout} ({self.qkv_format}) with heads={heads} and "
                f"d=kv_channels={self.kv_channels}; got {got}"
            )
        return t.permute(1, 2, 0, 3) if self.qkv_format == "sbhd" else t.permute(0, 2, 1, 3)

    def _mask_args(self, attention_mask: object, attn_mask_type: str | None, batch: int, seq_q: int, seq_k: int,
                   device: torch.device) -> tuple[bool, Tensor | None, Tensor | None]:
        """(causal, key padding bias fp32 [b, seq_k] or None, query masked [b, seq_q] or None)."""
        mask_type = self.attn_mask_type if attn_mask_type is None else check_choice(
            "DotProductAttention", "attn_mask_type", attn_mask_type, ATTN_MASK_TYPES)
        bias = q_masked = None
        if mask_type.startswith("padding"):
            if attention_mask is None:
                raise ValueError(f"DotProductAttention: attn_mask_type={mask_type!r} needs attention_mask (bool, True = masked out)")
            q_masked, k_masked = padding_masks(attention_mask, batch, seq_q, seq_k)
            bias = torch.zeros(k_masked.shape, dtype=torch.float32, device=device).masked_fill(k_masked, float("-inf"))
        elif attention_mask is not None:
            raise ValueError(
                f"DotProductAttention: attention_mask is only used with attn_mask_type 'padding' or 'padding_causal'; "
                f"got a mask with attn_mask_type={mask_type!r}"
            )
        return mask_type in ("causal", "padding_causal"), bias, q_masked

    def _seed(self, dropout_seed: Tensor | int | None, device: torch.device) -> tuple[float, Tensor | int | None]:
        p = self.attention_dropout if self.training else 0.0
        if p == 0:
            return 0.0, None
        return p, self._draw_seed(device) if dropout_seed is None else dropout_seed

    def _draw_seed(self, device: torch.device) -> Tensor:
        """The dropout seed of a call that was given none (tensor parallelism's subclass draws a
        per-rank one: its heads differ across ranks)."""
        return draw_seed(device)

    def forward(
        self, query_layer: Tensor, key_layer: Tensor, value_layer: Tensor,
        attention_mask: Tensor | tuple[Tensor, Tensor] | None = None, attn_mask_type: str | None = None, *,
        dropout_seed: Tensor | int | None = None,
    ) -> Tensor:
        q = self._to_bhsd("query_layer", query_layer, self.num_attention_heads)
        k = self._to_bhsd("key_layer", key_layer, self.num_gqa_groups)
        v = self._to_bhsd("value_layer", value_layer, self.num_gqa_groups)
        batch, _, seq_q, _ = q.shape
        seq_k = k.shape[2]
        if k.shape[0] != batch or v.shape != k.shape:
            raise ValueError(
                f"DotProductAttention: key_layer {tuple(key_layer.shape)} and value_layer {tuple(value_layer.shape)} "
                f"must have one shape with query_layer's batch ({tuple(query_layer.shape)}, {self.qkv_format})"
            )
        causal, bias, q_masked = self._mask_args(attention_mask, attn_mask_type, batch, seq_q, seq_k, q.device)
        p, seed = self._seed(dropout_seed, q.device)
        out = attention(q, k, v, causal=causal, key_padding_bias=bias, dropout_p=p, seed=seed,
                        softmax_scale=self.softmax_scale, one_kernel_backward=self.one_kernel_backward,
                        backend=self.backend)
        if q_masked is not None:
            out = out.masked_fill(q_masked[:, None, :, None], 0.0)
        hidden = self.num_attention_heads * self.kv_channels
        if self.qkv_format == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(seq_q, batch, hidden)
        return out.transpose(1, 2).reshape(batch, seq_q, hidden)

    def forward_packed(
        self, qkv: Tensor, qkv_bias: Tensor | None = None, attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        attn_mask_type: str | None = None, *, dropout_seed: Tensor | int | None = None, rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None, rotary_interleaved: bool = False,
    ) -> Tensor:
        """Self-attention on the packed output of one QKV GEMM (:func:`attention_qkvpacked`).

        qkv: [s, b, (h + 2 g) d] (sbhd) / [b, s, (h + 2 g) d] (bshd), laid out [Q heads | K heads |
        V heads]; qkv_bias: None or [(h + 2 g) d], the GEMM's bias (the GEMM then runs without it:
        the kernels add it as they load q, k, v and sum its gradient). Returns the context
        [s, b, h d] / [b, s, h d] as :meth:`forward`; the gradient flows back to qkv as one packed
        tensor (no concatenation of dq, dk, dv, no separate bias-gradient reduction). rotary_cos,
        rotary_sin: RoPE tables fp32 [seq, rotary_dim] (tachyon.nn.rope), applied to q and k inside
        the op (then qkv_bias must be None)."""
        width = (self.num_attention_heads + 2 * self.num_gqa_groups) * self.kv_channels
        if not isinstance(qkv, Tensor) or qkv.dim() != 3 or qkv.shape[-1] != width:
            got = tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
            raise ValueError(f"DotProductAttention: packed qkv must be 3-d with last dim (heads + 2 * kv_heads) * "
                             f"kv_channels = {width} ({self.qkv_format}); got {got}")
        sbhd = self.qkv_format == "sbhd"
        seq, batch = (qkv.shape[0], qkv.shape[1]) if sbhd else (qkv.shape[1], qkv.shape[0])
        causal, bias, q_masked = self._mask_args(attention_mask, attn_mask_type, batch, seq, seq, qkv.device)
        p, seed = self._seed(dropout_seed, qkv.device)
        out = attention_qkvpacked(
            qkv, self.num_attention_heads, self.num_gqa_groups, qkv_bias=qkv_bias, qkv_format=self.qkv_format,
            causal=causal, key_padding_bias=bias, dropout_p=p, seed=seed, softmax_scale=self.softmax_scale,
            one_kernel_backward=self.one_kernel_backward, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, backend=self.backend,
        )
        if q_masked is not None:
            out = out.masked_fill((q_masked.t() if sbhd else q_masked)[:, :, None], 0.0)
        return out

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, attn_mask_type={self.attn_mask_type!r}, "
                f"qkv_format={self.qkv_format!r}, attention_dropout={self.attention_dropout}")


class MultiheadAttention(nn.Module):
    """Attention block: (norm +) fused QKV projection, RoPE, DotProductAttention, output projection.

    hidden_size, num_attention_heads, kv_channels (default hidden_size / heads), num_gqa_groups
    (key/value heads; default all heads): sizes. attention_dropout: on the probabilities.
    layernorm_epsilon, normalization ("LayerNorm" / "RMSNorm"), zero_centered_gamma: the input
    norm, used when ``input_layernorm`` (then the QKV GEMM is a ``LayerNormLinear`` named
    ``layernorm_qkv``, else a ``Linear`` named ``qkv``). init_method: for the QKV weight;
    output_layer_init_method: for ``proj.weight`` (both default to TE's normal(0, 0.023)).
    attn_mask_type, qkv_format ("sbhd" / "bshd"), layer_number: as DotProductAttention. bias: QKV
    and projection biases. params_dtype, device: of the parameters. return_layernorm_output: also
    return the norm's output (needs input_layernorm). return_bias: return the projection bias
    instead of adding it (so TransformerLayer can fuse bias + dropout + residual).
    rotary_pos_interleaved: GPT-J style RoPE pairs. fuse_qkv_params: accepted for TE
    compatibility; tachyon always holds one fused QKV (or KV) weight. backend: pins the norm /
    attention / RoPE kernels' backend.

    attention_type "self": the QKV weight is [(h + 2 g) * d, hidden] laid out [Q heads | K heads |
    V heads] (TE's ``qkv_weight_interleaved=False`` layout; HF's q/k/v_proj weights concatenated).
    attention_type "cross": queries from hidden_states through ``layernorm_query``
    (LayerNormLinear, with input_layernorm) or ``query_layer`` (Linear), keys and values from
    ``encoder_output`` through ``key_value`` (Linear, [2 g d, hidden], [K | V]); no RoPE.

    forward(hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
    rotary_pos_emb=None, is_first_microbatch=None): hidden_states [s, b, hidden] (sbhd) or
    [b, s, hidden] (bshd), encoder_output [s_kv, b, hidden] / [b, s_kv, hidden] (cross only) ->
    out of hidden_states' shape in the params dtype (or torch.autocast's); returns out,
    (out, bias) with return_bias, and the norm output last with return_layernorm_output (TE's
    order). rotary_pos_emb: see tachyon.nn.rope. Cross-attention padding masks are (query mask, key mask) tuples.
    is_first_microbatch: passed to every projection GEMM (QKV / query, key_value, proj): the FP8
    weight cache across gradient-accumulation micro-batches, as in :class:`tachyon.nn.Linear`.
    Keyword-only: dropout_seed (the attention dropout's seed, else drawn here); return_input_branch
    (needs input_layernorm): also return hidden_states as a view, last, for a caller that adds it
    to a residual branch (its gradient is then summed by the input norm's backward kernel).
    Saved for backward: what LayerNormLinear, the attention op (packed qkv, with RoPE also the
    rotated q and k, and cos/sin) and Linear save.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        num_gqa_groups: int | None = None,
        input_layernorm: bool = False,
        normalization: str = "LayerNorm",
        bias: bool = True,
        qkv_format: str = "sbhd",
        fuse_qkv_params: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        zero_centered_gamma: bool = False,
        rotary_pos_interleaved: bool = False,
        attention_type: str = "self",
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        name = "MultiheadAttention"
        check_features(name, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        self.attention_type = check_choice(name, "attention_type", attention_type, ("self", "cross"))
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"{name}: hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}; pass kv_channels")
            kv_channels = hidden_size // num_attention_heads
        check_normalization(name, normalization)
        if return_layernorm_output and not input_layernorm:
            raise ValueError(f"{name}: return_layernorm_output=True needs input_layernorm=True")
        self.hidden_size, self.input_layernorm = hidden_size, bool(input_layernorm)
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        self.qkv_format = check_choice(name, "qkv_format", qkv_format, QKV_FORMATS)
        self.fuse_qkv_params, self.rotary_pos_interleaved, self.backend = fuse_qkv_params, bool(rotary_pos_interleaved), backend
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, attn_mask_type, qkv_format,
            layer_number=layer_number, backend=backend,
        )
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.num_gqa_groups = self.core_attention.num_gqa_groups
        self.layer_number = layer_number
        kv_size = 2 * self.num_gqa_groups * kv_channels
        in_size = num_attention_heads * kv_channels + (kv_size if attention_type == "self" else 0)
        in_name = "qkv" if attention_type == "self" else ("query" if self.input_layernorm else "query_layer")
        init_method = init_method or te_default_init
        if self.input_layernorm:
            setattr(self, f"layernorm_{in_name}", LayerNormLinear(
                hidden_size, in_size, eps=layernorm_epsilon, bias=bias, normalization=normalization,
                return_layernorm_output=self.return_layernorm_output, init_method=init_method,
                params_dtype=params_dtype, device=device, zero_centered_gamma=zero_centered_gamma, backend=backend,
            ))
        else:
            setattr(self, in_name, Linear(hidden_size, in_size, bias=bias, init_method=init_method,
                                          params_dtype=params_dtype, device=device))
        self._input_proj = f"layernorm_{in_name}" if self.input_layernorm else in_name
        if attention_type == "cross":
            self.key_value = Linear(hidden_size, kv_size, bias=bias, init_method=init_method, params_dtype=params_dtype,
                                    device=device)
        self.proj = Linear(
            num_attention_heads * kv_channels, hidden_size, bias=bias, init_method=output_layer_init_method or te_default_init,
            params_dtype=params_dtype, device=device, return_bias=self.return_bias,
        )

    def fused_calls_supported(self) -> bool:
        """Whether the input projection and the core attention run tachyon.nn's own forwards (or
        replacements that take their keyword arguments: tensor parallelism's, see
        :func:`takes_fused_calls`), which the packed path (DotProductAttention.forward_packed,
        return_bias / return_input_branch of the projection) needs; otherwise the unpacked path runs."""
        proj = getattr(self, self._input_proj)
        return own_forward(self.core_attention, DotProductAttention) and own_forward(
            proj, LayerNormLinear if self.input_layernorm else Linear)

    def _rope(self, q: Tensor, k: Tensor, rotary_pos_emb: object) -> tuple[Tensor, Tensor]:
        sbhd = self.qkv_format == "sbhd"
        qb, kb = (q.transpose(0, 1), k.transpose(0, 1)) if sbhd else (q, k)
        q_tab, k_tab = rotary_tables(rotary_pos_emb, qb.shape[1])
        q_cos, q_sin = q_tab.cos.to(q.device), q_tab.sin.to(q.device)
        kw = {"interleaved": self.rotary_pos_interleaved, "backend": self.backend}
        if k_tab is q_tab:
            qo, ko = apply_rotary(qb, kb, q_cos, q_sin, **kw)
        else:  # TE's (query angles, key angles): two launches
            qo, _ = apply_rotary(qb, kb, q_cos, q_sin, **kw)
            _, ko = apply_rotary(qb, kb, k_tab.cos.to(q.device), k_tab.sin.to(q.device), **kw)
        return (qo.transpose(0, 1), ko.transpose(0, 1)) if sbhd else (qo, ko)

    def _check_input(self, name: str, t: object) -> None:
        check_hidden_states("MultiheadAttention", name, t, self.hidden_size, self.qkv_format)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        encoder_output: Tensor | None = None, attn_mask_type: str | None = None, rotary_pos_emb: object = None,
        is_first_microbatch: bool | None = None, *, dropout_seed: Tensor | int | None = None,
        return_input_branch: bool = False,
    ):
        self._check_input("hidden_states", hidden_states)
        cross = self.attention_type == "cross"
        if cross:
            self._check_input("encoder_output", encoder_output)
            if rotary_pos_emb is not None:
                raise ValueError("MultiheadAttention: rotary_pos_emb is not supported for cross-attention")
        elif encoder_output is not None:
            raise ValueError("MultiheadAttention: encoder_output is only used with attention_type='cross'")
        fused = self.fused_calls_supported()
        if return_input_branch and not (self.input_layernorm and fused):
            raise ValueError("MultiheadAttention: return_input_branch=True needs input_layernorm=True and the "
                             "module's own LayerNormLinear forward")
        # self-attention runs on the packed QKV GEMM output (DotProductAttention.forward_packed): the
        # QKV bias is added by the attention kernels, or, with RoPE, by the GEMM and q and k are
        # rotated inside the op; TE's separate (query, key) angles take the unpacked path
        fold_bias = fused and not cross and rotary_pos_emb is None
        kw = {"return_input_branch": True} if return_input_branch else {}
        if fold_bias:
            kw["return_bias"] = True
        outs = getattr(self, self._input_proj)(hidden_states, is_first_microbatch, **kw)
        outs = outs if isinstance(outs, tuple) else (outs,)
        proj_in, qkv_bias = (outs[0], outs[1]) if fold_bias else (outs[0], None)
        rest = outs[2:] if fold_bias else outs[1:]
        ln_out = rest[0] if self.return_layernorm_output else None
        x_branch = rest[-1] if return_input_branch else None
        tables = None
        if fused and not cross and rotary_pos_emb is not None:
            # the projection's sequence: the full one when a sequence-parallel projection gathered it
            q_tab, k_tab = rotary_tables(rotary_pos_emb, proj_in.shape[0 if self.qkv_format == "sbhd" else 1])
            tables = q_tab if k_tab is q_tab else None
        packed = fold_bias or tables is not None
        h, g = self.num_attention_heads, self.num_gqa_groups
        if packed:
            rope = {}
            if tables is not None:
                rope = {"rotary_cos": tables.cos.to(proj_in.device), "rotary_sin": tables.sin.to(proj_in.device),
                        "rotary_interleaved": self.rotary_pos_interleaved}
            context = self.core_attention.forward_packed(proj_in, qkv_bias, attention_mask, attn_mask_type,
                                                         dropout_seed=dropout_seed, **rope)
        else:
            if cross:
                q = proj_in.view(*proj_in.shape[:-1], h, self.kv_channels)
                kv = self.key_value(encoder_output, is_first_microbatch)
                k, v = kv.view(*kv.shape[:-1], 2 * g, self.kv_channels).split([g, g], dim=-2)
            else:
                q, k, v = proj_in.view(*proj_in.shape[:-1], h + 2 * g, self.kv_channels).split([h, g, g], dim=-2)
            if rotary_pos_emb is not None:
                q, k = self._rope(q, k, rotary_pos_emb)
            seed_kw = {"dropout_seed": dropout_seed} if dropout_seed is not None else {}
            context = self.core_attention(q, k, v, attention_mask, attn_mask_type, **seed_kw)
        out = self.proj(context, is_first_microbatch)
        result = out if isinstance(out, tuple) else (out,)
        if ln_out is not None:
            result = (*result, ln_out)
        if x_branch is not None:
            result = (*result, x_branch)
        return result if len(result) > 1 else result[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, attention_type={self.attention_type!r}, "
                f"input_layernorm={self.input_layernorm}, return_bias={self.return_bias}")


__all__ = ["ATTN_MASK_TYPES", "DotProductAttention", "MultiheadAttention", "draw_seed", "own_forward",
           "takes_fused_calls", "te_default_init"]
