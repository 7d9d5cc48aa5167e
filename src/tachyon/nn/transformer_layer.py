"""``TransformerLayer`` (Transformer Engine's module and arguments) and HF GPT-2 / Llama interop.

    layer = tachyon.nn.TransformerLayer(4096, 16384, 32)             # GPT: LayerNorm, tanh GELU
    y = layer(x)                                                      # x [seq, batch, 4096] (sbhd)

    llama = tachyon.nn.TransformerLayer(4096, 11008, 32, num_gqa_groups=8, normalization="RMSNorm",
                                        activation="swiglu", bias=False, attn_input_format="bshd")
    y = llama(x, rotary_pos_emb=tachyon.nn.RotaryPositionEmbedding(128)(seq_len))

Structure (pre-LN, the default; TE's order of operations):

    a, a_bias = MultiheadAttention(x)          norm inside LayerNormLinear -> QKV -> RoPE -> attention -> proj
    h = x + dropout(a + a_bias)                 one fused kernel (bias_dropout_add)
    m, m_bias = LayerNormMLP(h)                 norm -> fc1 -> bias + activation (fused) -> fc2
    y = h + dropout(m + m_bias)                 fused again

How it runs (one forward + backward: 28 launches for GPT-2's configuration, 25 for Llama's;
tests/profiling/test_traffic_layers.py lists them):

- norm1 returns x as a residual branch (``return_input_branch``): x's two gradients are summed
  by the norm's backward kernel, not by an add.
- The QKV GEMM runs without its bias and the packed attention op (``attention_qkvpacked``) adds
  it as it loads q, k, v and sums its gradient; with RoPE (and the bias in the GEMM) the op
  rotates q and k itself. Its backward writes dq, dk, dv into one packed gradient (no
  concatenation) in one kernel (``one_kernel_backward``).
- h = x + dropout(a + a_bias) and the MLP's norm are one kernel each way
  (``bias_dropout_add_layer_norm``, returning h and norm(h)); LayerNormMLP then skips its norm.
- The dropout seeds of one forward (attention probabilities, both hidden dropouts; and the
  cross-attention's in a decoder) are one ``torch.randint`` draw on the data's device.
- Eager calls of the common configuration (encoder, pre-LN, causal or no mask, no FP8 / RoPE /
  progressive layer drop) run all of the above as ONE autograd node (transformer_layer_fused.py):
  the same kernels and GEMMs with the same arguments, bit for bit, with the host time of one
  module call; ``layer.one_node_eager = False`` runs the submodules (what torch.compile traces).
- Tensor parallelism's layer (tachyon.parallel.tensor.fused) runs this same fused path: its
  submodules' forwards take the same keyword arguments (``attention.takes_fused_calls``) and
  its ``_seed_draw`` gives the sites whose data is split across ranks per-rank seeds, still in
  one draw. A subclass that replaces ``_bda`` / ``_bda_norm`` or a submodule's forward otherwise
  gets the same math as separate calls: each module's own norm, unpacked attention, one seed
  draw per dropout.

- ``apply_residual_connection_post_layernorm``: the residuals are the norms' outputs instead of
  their inputs.
- ``output_layernorm=True`` (post-LN, BERT): the attention block gets no input norm and the last
  bias + dropout + residual runs fused with a final norm (``bias_dropout_add_layer_norm``):
  y = norm(h + dropout(m + m_bias)). With apply_residual_connection_post_layernorm this is BERT's
  layer (the MLP's norm plays the role of BERT's attention-output LayerNorm).
- ``layer_type="decoder"`` (T5-style) adds a cross-attention block after self-attention:
  i, i_bias = inter_attention(h, encoder_output); h = h + dropout(i + i_bias) (residual from its
  norm's output with apply_residual_connection_post_layernorm), before the MLP.
- Dropout seeds (attention, the hidden dropouts) are drawn per call as 0-dim tensors (views of
  one draw) from the data device's default generator, so torch.manual_seed reproduces runs and
  torch.compile traces them (no graph break, no recompile); masks are regenerated in backward.
- The GEMMs are LayerNormLinear / Linear / LayerNormMLP, so ``tachyon.fp8_autocast`` runs them in FP8.
- Progressive layer drop (DeepSpeed's ``progressive_layer_drop=True, pld_theta=...`` forward
  arguments, pre-LN layers only): in training, layer l of L (``layer_number``, ``num_layers``)
  is kept with probability p = 1 - (l / L) * (1 - pld_theta), drawn from torch's default CPU
  generator; a dropped layer returns its input (the identity: no compute, no gradient for its
  parameters), a kept one scales each residual branch by 1 / p (the PLD paper's
  h = x + a(x) / p, y = h + m(h) / p), so each branch's expected contribution is unchanged.
  See :func:`pld_keep_probability` and docs/progressive_layer_drop.md.

HF interop: :meth:`TransformerLayer.from_hf` copies an HF ``GPT2Block`` or ``LlamaDecoderLayer``
(weights and settings) into a bshd TransformerLayer; :class:`HFLayerAdapter` wraps one so that it
accepts the HF layer's call signature (transformers 5.x) and can replace the HF layer inside the
HF model::

    for i, block in enumerate(model.transformer.h):          # GPT2LMHeadModel
        model.transformer.h[i] = HFLayerAdapter.from_hf(block)
    for i, layer in enumerate(model.model.layers):           # LlamaForCausalLM
        model.model.layers[i] = HFLayerAdapter.from_hf(layer)
    out = model(input_ids, use_cache=False)                  # no KV cache: training / scoring
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tachyon.kernels.dropout import bias_dropout_add, bias_dropout_add_layer_norm
from tachyon.nn.attention import (
    ATTN_MASK_TYPES, QKV_FORMATS, MultiheadAttention, check_choice, check_dropout, check_hidden_states, draw_seed,
    own_forward, te_default_init,
)
from tachyon.nn.layernorm_linear import check_normalization, norm_weight
from tachyon.nn.layernorm_mlp import ACTIVATIONS, LayerNormMLP
from tachyon.nn.linear import compute_dtype
from tachyon.nn.norm import LayerNorm, RMSNorm
from tachyon.nn.rope import RotaryTables
from tachyon.nn import transformer_layer_fused as one_node

LAYER_TYPES = ("encoder", "decoder")

# dropout sites of one forward (indices into TransformerLayer._draw_seeds)
_SITE_ATTN_PROBS, _SITE_ATTN_OUT, _SITE_MLP_OUT, _SITE_INTER_PROBS, _SITE_INTER_OUT = range(5)

# HF activation name -> TE / tachyon activation ("gelu" is TE's tanh approximation)
_HF_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "relu": "relu",
                   "silu": "silu", "swish": "silu", "quick_gelu": "qgelu"}


def pld_keep_probability(owner: str, progressive_layer_drop: object, pld_theta: object, layer_number: object,
                         num_layers: object) -> float | None:
    """Progressive layer drop: the probability that layer ``layer_number`` (1-based) of
    ``num_layers`` runs, ``1 - (layer_number / num_layers) * (1 - pld_theta)``, or None when
    ``progressive_layer_drop`` is False. Layer 1 keeps with 1 - (1 - theta) / L, the last layer
    with theta (the PLD paper's p_l; DeepSpeed's BERT example draws with the 0-based index, so
    its first layer never drops, but scales by the 1-based probability). Raises ValueError,
    naming ``owner``, for a bad theta or a missing / impossible layer position."""
    if progressive_layer_drop is None or progressive_layer_drop is False:
        return None
    if progressive_layer_drop is not True:
        raise ValueError(f"{owner}: progressive_layer_drop must be True or False; got {progressive_layer_drop!r}")
    if isinstance(pld_theta, bool) or not isinstance(pld_theta, (int, float)) or not 0.0 < pld_theta <= 1.0:
        raise ValueError(f"{owner}: progressive_layer_drop=True needs pld_theta, a number in (0, 1]; got {pld_theta!r}")
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (layer_number, num_layers))
    if not ok or not 1 <= layer_number <= num_layers:  # type: ignore[operator]
        raise ValueError(
            f"{owner}: progressive layer drop needs the layer's position in its stack: layer_number (1-based) and "
            f"num_layers with 1 <= layer_number <= num_layers; got layer_number={layer_number!r}, "
            f"num_layers={num_layers!r}. Set them when building the stack, e.g. "
            "`for i, layer in enumerate(layers, 1): layer.layer_number, layer.num_layers = i, len(layers)`"
        )
    return 1.0 - (layer_number / num_layers) * (1.0 - float(pld_theta))  # type: ignore[operator]


def pld_draw_keep(keep: float) -> bool:
    """One Bernoulli(keep) draw from torch's default CPU generator (torch.manual_seed reproduces
    it; activation checkpointing's preserve_rng_state replays it in the recompute)."""
    return keep >= 1.0 or float(torch.rand(())) < keep


class TransformerLayer(nn.Module):
    """One transformer layer: attention block + MLP block, TE's arguments and parameter names.

    hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups (key/value heads, default
    all), kv_channels (head dim, default hidden / heads): sizes. layernorm_epsilon,
    normalization ("LayerNorm" / "RMSNorm"), zero_centered_gamma: every norm. hidden_dropout:
    after the projection and fc2; attention_dropout: on the attention probabilities.
    init_method (QKV, fc1) / output_layer_init_method (proj, fc2): callable(weight), default TE's
    normal(0, 0.023). self_attn_mask_type: "causal" | "padding" | "no_mask" | "padding_causal"
    (overridable per call). activation: "gelu" (tanh approximation, as TE and GPT-2), "geglu",
    "swiglu", "relu", "silu", "qgelu". bias: every linear bias. apply_residual_connection_post_layernorm,
    output_layernorm: see the module docstring. layer_type: "encoder" or "decoder" (adds
    cross-attention). fuse_qkv_params: accepted for TE compatibility (QKV is always one fused
    weight). attn_input_format: "sbhd" (x is [seq, batch, hidden]) or "bshd".
    params_dtype, device: of the parameters. backend: pins every kernel's backend.
    layer_number (TE's, 1-based) and num_layers (keyword-only, the stack's depth): the layer's
    position, used only by progressive layer drop (both attributes can be set after building).

    Submodules (TE's names): ``self_attention`` (MultiheadAttention: ``layernorm_qkv`` or
    ``qkv``, ``core_attention``, ``proj``), ``inter_attention`` (decoder only: ``layernorm_query``,
    ``key_value``, ``core_attention``, ``proj``), ``layernorm_mlp`` (LayerNormMLP), ``layernorm``
    (LayerNorm / RMSNorm, only with output_layernorm).

    forward(hidden_states, attention_mask=None, self_attn_mask_type=None, rotary_pos_emb=None,
    encoder_output=None, enc_dec_attn_mask=None, is_first_microbatch=None, progressive_layer_drop=False,
    pld_theta=None):
    hidden_states [s, b, hidden] / [b, s, hidden] -> same shape, in the params dtype (or
    torch.autocast's; the input is cast to it). attention_mask: TE's bool mask, True = masked out,
    [b, 1, 1, s], for the padding mask types only. rotary_pos_emb: TE's angles [s, 1, 1, r], a
    (query, key) pair of them, or (cos, sin) [s, r] (tachyon.nn.rope). Decoder only:
    encoder_output [s_kv, b, hidden] / [b, s_kv, hidden] (required); enc_dec_attn_mask: None (no
    mask) or TE's padding masks (query mask [b, 1, 1, s], key mask [b, 1, 1, s_kv]) as a tuple.
    is_first_microbatch: passed to every GEMM of the layer (TE's FP8 weight cache across
    gradient-accumulation micro-batches, see :class:`tachyon.nn.Linear`: None no caching, True
    cast and cache, False reuse the cache; no effect outside an enabled fp8_autocast).
    progressive_layer_drop, pld_theta: DeepSpeed's progressive layer drop (module docstring);
    ignored in eval mode, where every layer runs. A layer dropped on the first micro-batch
    (is_first_microbatch=True) caches its FP8 weights on its next kept micro-batch instead.
    Saved for backward: what the submodules' kernels save; the hidden dropouts save nothing
    (masks regenerated). A dropped layer returns its input (cast to the compute dtype).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        layer_number: int | None = None,
        self_attn_mask_type: str = "causal",
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        bias: bool = True,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        layer_type: str = "encoder",
        fuse_qkv_params: bool = True,
        attn_input_format: str = "sbhd",
        kv_channels: int | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        zero_centered_gamma: bool = False,
        *,
        num_layers: int | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        name = "TransformerLayer"
        check_choice(name, "layer_type", layer_type, LAYER_TYPES)
        check_choice(name, "activation", activation, ACTIVATIONS)
        check_choice(name, "attn_input_format", attn_input_format, QKV_FORMATS)
        check_choice(name, "self_attn_mask_type", self_attn_mask_type, ATTN_MASK_TYPES)
        check_normalization(name, normalization)
        self.hidden_dropout = check_dropout(name, "hidden_dropout", hidden_dropout)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.self_attn_mask_type, self.attn_input_format = self_attn_mask_type, attn_input_format
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.output_layernorm, self.layer_type, self.layer_number = bool(output_layernorm), layer_type, layer_number
        self.normalization, self.layernorm_epsilon, self.zero_centered_gamma = normalization, layernorm_epsilon, zero_centered_gamma
        self.backend = backend
        self.num_layers = num_layers
        self._pld_stale_fp8_cache = False  # dropped on a first micro-batch: the FP8 weight cache is stale
        # eager calls of the common configuration run as one autograd node (transformer_layer_fused.py);
        # False: through the submodules, as torch.compile traces the layer
        self.one_node_eager = True
        init_method = init_method or te_default_init
        output_layer_init_method = output_layer_init_method or te_default_init
        attn_post_ln = self.apply_residual_connection_post_layernorm and not self.output_layernorm
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon, init_method,
            output_layer_init_method, layer_number, self_attn_mask_type, num_gqa_groups,
            input_layernorm=not self.output_layernorm, normalization=normalization, bias=bias,
            qkv_format=attn_input_format, fuse_qkv_params=fuse_qkv_params, params_dtype=params_dtype, device=device,
            return_layernorm_output=attn_post_ln, return_bias=True, zero_centered_gamma=zero_centered_gamma,
            backend=backend,
        )
        if layer_type == "decoder":  # cross-attention over encoder_output, always with its input norm
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon, init_method,
                output_layer_init_method, layer_number, "no_mask", num_gqa_groups, input_layernorm=True,
                normalization=normalization, bias=bias, qkv_format=attn_input_format, params_dtype=params_dtype,
                device=device, return_layernorm_output=self.apply_residual_connection_post_layernorm, return_bias=True,
                zero_centered_gamma=zero_centered_gamma, attention_type="cross", backend=backend,
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, bias=bias, normalization=normalization,
            activation=activation, return_layernorm_output=self.apply_residual_connection_post_layernorm,
            init_method=init_method, output_layer_init_method=output_layer_init_method, params_dtype=params_dtype,
            device=device, zero_centered_gamma=zero_centered_gamma, return_bias=True, backend=backend,
        )
        if self.output_layernorm:
            dtype = params_dtype or torch.get_default_dtype()
            if normalization == "RMSNorm":
                self.layernorm = RMSNorm(hidden_size, eps=layernorm_epsilon, device=device, params_dtype=dtype, backend=backend)
            else:
                self.layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon, device=device, params_dtype=dtype, backend=backend)
            if zero_centered_gamma:
                nn.init.zeros_(self.layernorm.weight)

    def _draw_seeds(self, x: Tensor) -> list[Tensor | None]:
        """The dropout seeds of one training forward, indexed by the _SITE_* constants: 0-dim int64
        views of ONE ``torch.randint`` draw on x's device (one launch; torch.manual_seed reproduces
        it, torch.compile traces it), None where that dropout is off (or in eval mode)."""
        sites = 5 if self.layer_type == "decoder" else 3
        if not self.training:
            return [None] * sites
        probs = [self.self_attention.core_attention.attention_dropout, self.hidden_dropout, self.hidden_dropout]
        if self.layer_type == "decoder":
            probs += [self.inter_attention.core_attention.attention_dropout, self.hidden_dropout]
        if not any(p > 0 for p in probs):
            return [None] * sites
        seeds = self._seed_draw(x.device, sites)
        return [seed if p > 0 else None for seed, p in zip(seeds, probs)]

    def _seed_draw(self, device: torch.device, sites: int) -> list[Tensor]:
        """``sites`` Philox seeds, 0-dim int64 views of one ``torch.randint`` draw on ``device``
        (tensor parallelism's layer replaces it to give split data per-rank seeds)."""
        return list(torch.randint(0, 2**62, (sites,), dtype=torch.int64, device=device).unbind(0))

    def _draw_hidden_seed(self, device: torch.device) -> Tensor:
        """The seed of a hidden dropout called without one (the separate-calls path)."""
        return draw_seed(device)

    def _bda(self, x: Tensor, bias: Tensor | None, residual: Tensor, scale: float = 1.0,
             seed: Tensor | None = None) -> Tensor:
        """residual + dropout(x + bias) (x and bias times ``scale`` first: progressive layer drop's
        1 / p); ``seed``: the dropout seed, drawn here when None and dropout is on."""
        if scale != 1.0:  # progressive layer drop: the residual branch of a kept layer, over p
            x = x * scale
            bias = bias * scale if bias is not None else None
        p = self.hidden_dropout if self.training else 0.0
        if p > 0 and seed is None:
            seed = self._draw_hidden_seed(x.device)
        return bias_dropout_add(x, bias, residual, p, seed, training=self.training, backend=self.backend)

    def _bda_norm(self, x: Tensor, bias: Tensor | None, residual: Tensor, seed: Tensor | None = None) -> Tensor:
        """The output layernorm of residual + dropout(x + bias), fused (output_layernorm)."""
        return self._bda_into_norm(x, bias, residual, self.layernorm, False, seed=seed)

    def _bda_into_norm(self, x: Tensor, bias: Tensor | None, residual: Tensor, norm: nn.Module, return_residual: bool,
                       scale: float = 1.0, seed: Tensor | None = None):
        """norm(residual + dropout(x + bias)) with ``norm``'s parameters (LayerNormMLP's own norm, or
        the output layernorm), and the sum when ``return_residual``: one kernel each way."""
        if scale != 1.0:
            x = x * scale
            bias = bias * scale if bias is not None else None
        p = self.hidden_dropout if self.training else 0.0
        if p > 0 and seed is None:
            seed = self._draw_hidden_seed(x.device)
        if isinstance(norm, LayerNormMLP):
            weight, ln_bias, eps = norm.layer_norm_weight, norm.layer_norm_bias, norm.eps
        else:
            weight, ln_bias, eps = norm.weight, getattr(norm, "bias", None), self.layernorm_epsilon
        return bias_dropout_add_layer_norm(
            x, bias, residual, norm_weight(weight, self.zero_centered_gamma, x.dtype),
            ln_bias.to(x.dtype) if ln_bias is not None else None, eps, p, seed, training=self.training,
            rms=self.normalization == "RMSNorm", return_residual=return_residual, backend=self.backend,
        )

    def _fusable(self) -> bool:
        """True when the layer and its submodules run tachyon.nn's own methods (or forwards that
        take their keyword arguments: tensor parallelism's, see ``attention.takes_fused_calls``),
        whose fused calls (one seed draw, norm2 inside the residual add, residual branches out of
        the norms) the forward uses; a subclass that replaces them gets the plain composition."""
        cls = type(self)
        if cls._bda is not TransformerLayer._bda or cls._bda_norm is not TransformerLayer._bda_norm:
            return False
        attn = self.self_attention
        return (own_forward(attn, MultiheadAttention) and own_forward(self.layernorm_mlp, LayerNormMLP)
                and attn.fused_calls_supported()
                and (self.layer_type != "decoder" or self.inter_attention.fused_calls_supported()))

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, self_attn_mask_type: str | None = None,
        rotary_pos_emb: object = None, encoder_output: Tensor | None = None,
        enc_dec_attn_mask: Tensor | tuple[Tensor, Tensor] | None = None, is_first_microbatch: bool | None = None,
        progressive_layer_drop: bool = False, pld_theta: float | None = None,
    ) -> Tensor:
        check_hidden_states("TransformerLayer", "hidden_states", hidden_states, self.hidden_size, self.attn_input_format)
        if self.layer_type == "encoder" and (encoder_output is not None or enc_dec_attn_mask is not None):
            raise ValueError("TransformerLayer: encoder_output / enc_dec_attn_mask need layer_type='decoder'")
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError("TransformerLayer: layer_type='decoder' needs encoder_output")
        keep = pld_keep_probability("TransformerLayer", progressive_layer_drop, pld_theta, self.layer_number,
                                    self.num_layers)
        if keep is not None and (self.output_layernorm or self.apply_residual_connection_post_layernorm):
            raise ValueError(
                "TransformerLayer: progressive layer drop needs a pre-LN layer (output_layernorm=False, "
                "apply_residual_connection_post_layernorm=False): a post-LN layer normalizes its residual, so "
                "skipping it is not the identity the PLD schedule assumes"
            )
        weight = self.layernorm_mlp.fc1_weight
        x = hidden_states.to(compute_dtype(weight, hidden_states))
        scale = 1.0
        if keep is not None and self.training:
            if not pld_draw_keep(keep):
                if is_first_microbatch:
                    self._pld_stale_fp8_cache = True
                return x
            scale = 1.0 / keep
            if is_first_microbatch is False and self._pld_stale_fp8_cache:
                is_first_microbatch = True  # the first micro-batch skipped this layer: cache the weights now
        if is_first_microbatch is not None:
            self._pld_stale_fp8_cache = False
        if self.one_node_eager and type(self) is TransformerLayer:
            plan = one_node.plan_for(self, x, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
                                     is_first_microbatch, scale)
            if plan is not None:
                return one_node.run(self, plan, x, self._draw_seeds(x))
        if self._fusable():
            return self._forward_fused(x, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
                                       enc_dec_attn_mask, is_first_microbatch, scale)
        return self._forward_composed(x, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
                                      enc_dec_attn_mask, is_first_microbatch, scale)

    def _forward_fused(self, x, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
                       enc_dec_attn_mask, is_first_microbatch, scale) -> Tensor:
        """The layer with its residual adds fused into the norms around them (module docstring)."""
        seeds = self._draw_seeds(x)
        post_ln = self.apply_residual_connection_post_layernorm
        # pre-LN: x feeds the input norm and the residual; the norm's backward sums x's two gradients
        branch = not self.output_layernorm and not post_ln
        attn = self.self_attention(x, attention_mask, attn_mask_type=self_attn_mask_type, rotary_pos_emb=rotary_pos_emb,
                                   is_first_microbatch=is_first_microbatch, dropout_seed=seeds[_SITE_ATTN_PROBS],
                                   return_input_branch=branch)
        if branch or (post_ln and not self.output_layernorm):  # the residual: x's branch, or norm1's output
            attn_out, attn_bias, residual = attn
        else:
            (attn_out, attn_bias), residual = attn, x
        mlp_residual = None  # the MLP block's residual when it is not the MLP norm's output
        if self.layer_type == "decoder":
            h = self._bda(attn_out, attn_bias, residual, scale, seeds[_SITE_ATTN_OUT])
            inter = self.inter_attention(
                h, enc_dec_attn_mask, encoder_output.to(x.dtype),
                attn_mask_type="padding" if enc_dec_attn_mask is not None else "no_mask",
                is_first_microbatch=is_first_microbatch, dropout_seed=seeds[_SITE_INTER_PROBS],
            )
            if post_ln:
                inter_out, inter_bias, residual = inter
            else:
                (inter_out, inter_bias), residual = inter, h
            site = _SITE_INTER_OUT
        else:
            inter_out, inter_bias, site = attn_out, attn_bias, _SITE_ATTN_OUT
        # the residual add before the MLP runs fused with the MLP's norm (bias_dropout_add_layer_norm)
        if post_ln:  # the MLP's residual is its norm's output
            ln2 = self._bda_into_norm(inter_out, inter_bias, residual, self.layernorm_mlp, False, scale, seeds[site])
        else:
            ln2, mlp_residual = self._bda_into_norm(inter_out, inter_bias, residual, self.layernorm_mlp, True, scale,
                                                    seeds[site])
        mlp_out, mlp_bias = self.layernorm_mlp(ln2, is_first_microbatch, input_is_normalized=True)[:2]
        residual = ln2 if post_ln else mlp_residual
        if self.output_layernorm:
            return self._bda_norm(mlp_out, mlp_bias, residual, seeds[_SITE_MLP_OUT])
        return self._bda(mlp_out, mlp_bias, residual, scale, seeds[_SITE_MLP_OUT])

    def _forward_composed(self, x, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
                          enc_dec_attn_mask, is_first_microbatch, scale) -> Tensor:
        """The blocks as separate calls (each module's own norm; each dropout draws its seed)."""
        attn = self.self_attention(x, attention_mask, attn_mask_type=self_attn_mask_type, rotary_pos_emb=rotary_pos_emb,
                                   is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attn_out, attn_bias, residual = attn
        else:
            (attn_out, attn_bias), residual = attn, x
        h = self._bda(attn_out, attn_bias, residual, scale)
        if self.layer_type == "decoder":
            inter = self.inter_attention(
                h, enc_dec_attn_mask, encoder_output.to(x.dtype),
                attn_mask_type="padding" if enc_dec_attn_mask is not None else "no_mask",
                is_first_microbatch=is_first_microbatch,
            )
            if self.apply_residual_connection_post_layernorm:
                inter_out, inter_bias, residual = inter
            else:
                (inter_out, inter_bias), residual = inter, h
            h = self._bda(inter_out, inter_bias, residual, scale)
        mlp = self.layernorm_mlp(h, is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            mlp_out, mlp_bias, residual = mlp
        else:
            (mlp_out, mlp_bias), residual = mlp, h
        if self.output_layernorm:
            return self._bda_norm(mlp_out, mlp_bias, residual)
        return self._bda(mlp_out, mlp_bias, residual, scale)

    @classmethod
    def from_hf(cls, hf_layer: nn.Module, hf_config: object = None, *, backend: str | None = None) -> TransformerLayer:
        """A bshd TransformerLayer with the weights and settings of an HF ``GPT2Block`` or
        ``LlamaDecoderLayer`` (config from the layer, or ``hf_config``); parameters in the HF
        weights' dtype and device, copied (not shared).

        GPT-2: LayerNorm, "gelu" (HF gelu_new / gelu_pytorch_tanh), biases, causal; the Conv1D
        weights [in, out] are transposed; c_attn's [Q | K | V] columns are the QKV layout.
        Llama: RMSNorm, "swiglu" with fc1 = [gate_proj; up_proj] (silu(gate) * up), GQA, no bias
        (or zero-initialized biases where only one of attention_bias / mlp_bias is set). RoPE
        comes from the caller (``rotary_pos_emb``; :class:`HFLayerAdapter` passes HF's cos/sin).
        """
        kind = _hf_kind(hf_layer)
        if kind == "gpt2":
            return _from_gpt2(cls, hf_layer, hf_config or hf_layer.attn.config, backend)
        return _from_llama(cls, hf_layer, hf_config or hf_layer.self_attn.config, backend)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"attn_input_format={self.attn_input_format!r}, output_layernorm={self.output_layernorm}")


def _hf_kind(hf_layer: nn.Module) -> str:
    attn = getattr(hf_layer, "attn", None)
    if attn is not None and hasattr(attn, "c_attn") and hasattr(hf_layer, "ln_1"):
        return "gpt2"
    self_attn = getattr(hf_layer, "self_attn", None)
    mlp = getattr(hf_layer, "mlp", None)
    if self_attn is not None and hasattr(self_attn, "q_proj") and mlp is not None and hasattr(mlp, "gate_proj"):
        return "llama"
    raise ValueError(
        f"TransformerLayer.from_hf: {type(hf_layer).__name__} is not a supported HF layer; allowed: GPT2Block "
        "(ln_1, attn.c_attn, mlp.c_fc) or LlamaDecoderLayer-shaped layers (self_attn.q_proj, mlp.gate_proj)"
    )


def _copy(dst: Tensor | None, src: Tensor | None, what: str) -> None:
    if dst is None:
        if src is not None:
            raise ValueError(f"TransformerLayer.from_hf: the HF layer has {what} but the TransformerLayer has none")
        return
    with torch.no_grad():
        if src is None:
            dst.zero_()
        elif tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"TransformerLayer.from_hf: {what} has shape {tuple(src.shape)}; expected {tuple(dst.shape)}")
        else:
            dst.copy_(src)


def _gpt2_softmax_scale(attn: nn.Module) -> float:
    """GPT2Attention's score scale: its ``scaling`` attribute (transformers >= 5.3), else built from
    scale_attn_weights (1/sqrt(head_dim)) and scale_attn_by_inverse_layer_idx (1/(layer_idx+1))."""
    if hasattr(attn, "scaling"):
        return float(attn.scaling)
    scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= float(attn.layer_idx + 1)
    return scale


def _from_gpt2(cls, block: nn.Module, config: object, backend: str | None) -> TransformerLayer:
    if getattr(block, "crossattention", None) is not None:
        raise ValueError("TransformerLayer.from_hf: GPT2Block with cross-attention (add_cross_attention) is not supported yet")
    act = getattr(config, "activation_function", "gelu_new")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"TransformerLayer.from_hf: GPT-2 activation_function={act!r} is not supported; allowed: "
                         f"{', '.join(map(repr, _HF_ACTIVATIONS))} (TE's 'gelu' is the tanh approximation)")
    hidden = block.ln_1.weight.shape[0]
    heads = block.attn.num_heads
    weight = block.attn.c_attn.weight
    layer = cls(
        hidden, block.mlp.c_fc.weight.shape[1], heads, layernorm_epsilon=block.ln_1.eps,
        hidden_dropout=float(getattr(config, "resid_pdrop", 0.0)), attention_dropout=float(getattr(config, "attn_pdrop", 0.0)),
        activation=_HF_ACTIVATIONS[act], bias=True, attn_input_format="bshd", params_dtype=weight.dtype,
        device=weight.device, backend=backend,
    )
    layer.self_attention.core_attention.softmax_scale = _gpt2_softmax_scale(block.attn)
    attn = layer.self_attention
    _copy(attn.layernorm_qkv.layer_norm_weight, block.ln_1.weight, "ln_1.weight")
    _copy(attn.layernorm_qkv.layer_norm_bias, block.ln_1.bias, "ln_1.bias")
    _copy(attn.layernorm_qkv.weight, block.attn.c_attn.weight.t(), "attn.c_attn.weight (transposed)")
    _copy(attn.layernorm_qkv.bias, block.attn.c_attn.bias, "attn.c_attn.bias")
    _copy(attn.proj.weight, block.attn.c_proj.weight.t(), "attn.c_proj.weight (transposed)")
    _copy(attn.proj.bias, block.attn.c_proj.bias, "attn.c_proj.bias")
    mlp = layer.layernorm_mlp
    _copy(mlp.layer_norm_weight, block.ln_2.weight, "ln_2.weight")
    _copy(mlp.layer_norm_bias, block.ln_2.bias, "ln_2.bias")
    _copy(mlp.fc1_weight, block.mlp.c_fc.weight.t(), "mlp.c_fc.weight (transposed)")
    _copy(mlp.fc1_bias, block.mlp.c_fc.bias, "mlp.c_fc.bias")
    _copy(mlp.fc2_weight, block.mlp.c_proj.weight.t(), "mlp.c_proj.weight (transposed)")
    _copy(mlp.fc2_bias, block.mlp.c_proj.bias, "mlp.c_proj.bias")
    return layer


def _from_llama(cls, hf: nn.Module, config: object, backend: str | None) -> TransformerLayer:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"TransformerLayer.from_hf: Llama hidden_act={act!r} is not supported; allowed: 'silu' (-> 'swiglu')")
    sa, mlp_hf = hf.self_attn, hf.mlp
    head_dim = sa.head_dim
    heads = sa.q_proj.weight.shape[0] // head_dim
    kv_heads = sa.k_proj.weight.shape[0] // head_dim
    hidden = sa.q_proj.weight.shape[1]
    has_bias = any(m.bias is not None for m in (sa.q_proj, sa.o_proj, mlp_hf.gate_proj, mlp_hf.down_proj))
    weight = sa.q_proj.weight
    layer = cls(
        hidden, mlp_hf.gate_proj.weight.shape[0], heads, num_gqa_groups=kv_heads,
        layernorm_epsilon=float(hf.input_layernorm.variance_epsilon), hidden_dropout=0.0,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0)), normalization="RMSNorm",
        activation="swiglu", bias=has_bias, attn_input_format="bshd", kv_channels=head_dim,
        params_dtype=weight.dtype, device=weight.device, backend=backend,
    )
    layer.self_attention.core_attention.softmax_scale = float(sa.scaling)
    attn = layer.self_attention

    _copy(attn.layernorm_qkv.layer_norm_weight, hf.input_layernorm.weight, "input_layernorm.weight")
    _copy(attn.layernorm_qkv.weight, torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]), "q/k/v_proj.weight")
    qkv_bias = None
    if sa.q_proj.bias is not None:
        qkv_bias = torch.cat([sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias])
    _copy(attn.layernorm_qkv.bias, qkv_bias, "q/k/v_proj.bias")
    _copy(attn.proj.weight, sa.o_proj.weight, "o_proj.weight")
    _copy(attn.proj.bias, sa.o_proj.bias, "o_proj.bias")
    mlp = layer.layernorm_mlp
    _copy(mlp.layer_norm_weight, hf.post_attention_layernorm.weight, "post_attention_layernorm.weight")
    _copy(mlp.fc1_weight, torch.cat([mlp_hf.gate_proj.weight, mlp_hf.up_proj.weight]), "gate_proj/up_proj.weight")
    fc1_bias = None
    if mlp_hf.gate_proj.bias is not None or mlp_hf.up_proj.bias is not None:
        f = mlp_hf.gate_proj.weight.shape[0]
        zeros = mlp_hf.gate_proj.weight.new_zeros(f)
        fc1_bias = torch.cat([mlp_hf.gate_proj.bias if mlp_hf.gate_proj.bias is not None else zeros,
                              mlp_hf.up_proj.bias if mlp_hf.up_proj.bias is not None else zeros])
    _copy(mlp.fc1_bias, fc1_bias, "gate_proj/up_proj.bias")
    _copy(mlp.fc2_weight, mlp_hf.down_proj.weight, "down_proj.weight")
    _copy(mlp.fc2_bias, mlp_hf.down_proj.bias, "down_proj.bias")
    return layer


def hf_key_padding(mask: Tensor | None, seq: int) -> Tensor | None:
    """TE's bool key mask [b, 1, 1, seq] (True = padded) from the mask an HF decoder passes its
    layers, or None when nothing is padded. HF masks: None; [b, seq] (1 = keep); [b, 1, q, seq]
    additive (finfo.min / -inf = masked) or bool (True = keep) causal masks, whose last query row
    lists the keys every query may see apart from causality."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() not in (2, 4):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"HFLayerAdapter: attention_mask must be None, [batch, seq] or [batch, 1, q, seq]; got {got}")
    if mask.dim() == 2:
        masked = mask == 0
    else:
        row = mask[:, 0, -1, :]
        masked = ~row if row.dtype == torch.bool else row <= torch.finfo(row.dtype).min / 2
    if masked.shape[-1] != seq:
        raise ValueError(f"HFLayerAdapter: attention_mask covers {masked.shape[-1]} keys but the input has {seq} "
                         "tokens (KV caches are not supported: call the model with use_cache=False)")
    if not bool(masked.any()):
        return None
    return masked[:, None, None, :]


class HFLayerAdapter(nn.Module):
    """A TransformerLayer behind an HF GPT2Block / LlamaDecoderLayer call signature (transformers 5.x).

    ``HFLayerAdapter.from_hf(hf_layer)`` converts the layer (TransformerLayer.from_hf) and wraps it;
    ``.layer`` is the TransformerLayer. forward takes what the HF model passes its layers, bound by
    name to the HF layer class's own forward signature (its positional order moved across
    transformers 5.x releases):

    - GPT-2: hidden_states, attention_mask, and a cache / encoder_hidden_states that must be None.
    - Llama: hidden_states plus keywords attention_mask, position_embeddings=(cos, sin) [b, s, d]
      (required; the rows must agree across the batch), position_ids, cache, use_cache.

    hidden_states [b, s, hidden] -> [b, s, hidden] (HF 5.x layers return a tensor). The causal HF
    mask becomes TE's padding_causal mask when it pads any key (see :func:`hf_key_padding`), else
    plain causal. Refused with a ValueError, never ignored: a KV cache under any name HF has used
    for it (``cache`` from transformers 5.24, ``past_key_values`` before, ``past_key_value`` /
    ``layer_past`` in 4.x), positional or keyword, and ``use_cache=True`` (call the model with
    ``use_cache=False``); cross-attention (encoder_hidden_states); any other keyword that is not
    None/False (packed-sequence ``cu_seq_lens_*``, ``output_attentions=True``, ...), since running
    the layer without it would give different numbers. ``position_ids`` and ``cache_position`` are
    ignored: positions reach a Llama layer through ``position_embeddings``, and GPT-2 adds them
    before its first layer.
    """

    # every name under which an HF model has passed its layers a KV cache
    _CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
    _IGNORED = ("position_ids", "cache_position")
    _USED = ("attention_mask", "position_embeddings")

    def __init__(self, layer: TransformerLayer, kind: str, hf_class: type | None = None) -> None:
        """``hf_class``: the HF layer class whose call signature positional arguments follow (its
        parameter order changed across transformers 5.x); default: the installed transformers'
        GPT2Block or LlamaDecoderLayer."""
        super().__init__()
        self.layer, self.kind = layer, check_choice("HFLayerAdapter", "kind", kind, ("gpt2", "llama"))
        self.hf_class = hf_class

    @classmethod
    def from_hf(cls, hf_layer: nn.Module, hf_config: object = None, *, backend: str | None = None) -> HFLayerAdapter:
        return cls(TransformerLayer.from_hf(hf_layer, hf_config, backend=backend), _hf_kind(hf_layer), type(hf_layer))

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        call = self._bind(args, kwargs)
        rotary = None
        if self.kind == "llama":
            rotary = _hf_rotary(call.get("position_embeddings"))
        key_mask = hf_key_padding(call.get("attention_mask"), hidden_states.shape[1])
        mask_type = "padding_causal" if key_mask is not None else "causal"
        out = self.layer(hidden_states, attention_mask=key_mask, self_attn_mask_type=mask_type, rotary_pos_emb=rotary)
        return out.to(hidden_states.dtype)

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name; raises for anything the layer cannot honour."""
        signature = _hf_signature(self.hf_class or _default_hf_class(self.kind))
        try:
            bound = signature.bind(None, None, *args, **kwargs)  # (self, hidden_states, ...)
        except TypeError as err:
            raise ValueError(f"HFLayerAdapter: the call does not fit {signature}: {err}") from None
        call = {}
        for name, value in list(bound.arguments.items())[2:]:
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if any(v is not None for v in value):
                    raise ValueError(f"HFLayerAdapter: {len(value)} extra positional arguments; {signature} takes fewer")
            else:
                call[name] = value
        for key in self._CACHE_NAMES:
            if call.get(key) is not None:
                raise ValueError(f"HFLayerAdapter: a KV cache ({key}={type(call[key]).__name__}) is not supported; "
                                 "call the model with use_cache=False")
        if call.get("use_cache"):
            raise ValueError("HFLayerAdapter: use_cache=True is not supported (the layer keeps no KV cache); "
                             "call the model with use_cache=False")
        if call.get("encoder_hidden_states") is not None:
            raise ValueError("HFLayerAdapter: cross-attention (encoder_hidden_states) is not supported yet")
        for key, value in call.items():
            if key in self._USED or key in self._IGNORED or key in self._CACHE_NAMES or key == "use_cache":
                continue
            if value is not None and value is not False:
                raise ValueError(f"HFLayerAdapter: {key}={type(value).__name__} is not supported; the adapted "
                                 f"{self.kind} layer takes hidden_states, attention_mask"
                                 f"{', position_embeddings' if self.kind == 'llama' else ''}, and {key} must be None or False")
        return call


_SIGNATURES: dict[type, inspect.Signature] = {}


def _hf_signature(hf_class: type) -> inspect.Signature:
    """The HF layer's forward signature (through transformers' deprecate_kwarg wrappers)."""
    if hf_class not in _SIGNATURES:
        _SIGNATURES[hf_class] = inspect.signature(hf_class.forward)
    return _SIGNATURES[hf_class]


def _default_hf_class(kind: str) -> type:
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _hf_rotary(position_embeddings: object) -> RotaryTables:
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2):
        raise ValueError("HFLayerAdapter: a Llama layer needs position_embeddings=(cos, sin) from the HF model's rotary_emb")
    cos, sin = position_embeddings
    if cos.dim() == 3:
        if cos.shape[0] > 1 and not (torch.equal(cos, cos[:1].expand_as(cos)) and torch.equal(sin, sin[:1].expand_as(sin))):
            raise ValueError("HFLayerAdapter: position_embeddings differ across the batch (per-row position_ids); "
                             "tachyon's RoPE kernel takes one table for all rows")
        cos, sin = cos[0], sin[0]
    return RotaryTables(cos.float(), sin.float())


__all__ = ["HFLayerAdapter", "TransformerLayer", "hf_key_padding", "pld_draw_keep", "pld_keep_probability"]
