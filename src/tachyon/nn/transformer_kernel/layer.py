"""TransformerKernelLayer: one BERT encoder layer from tachyon's fused kernels (DeepSpeed's
transformer kernel, same names and meaning).

Post-LN (``pre_layer_norm=False``) computes exactly HF's ``BertLayer``::

    a   = attention(x @ Wqkv + bqkv)                  # one GEMM for Q, K and V; flash attention
    y1  = LN_attn(x + dropout(a @ Wo + bo))           # attn_nw / attn_nb
    out = LN_out(y1 + dropout(gelu(y1 @ Wi + bi) @ Wout + bout))   # norm_w / norm_b

Pre-LN (``pre_layer_norm=True``, the default), DeepSpeed's pre-LN BERT layer
(csrc/transformer/ds_transformer_cuda.cpp, ``BertTransformerLayer::Forward``)::

    z1  = x + dropout(attention(LN_in(x)) @ Wo + bo)  # LN_in uses norm_w / norm_b
    out = z1 + dropout(gelu(LN_attn(z1) @ Wi + bi) @ Wout + bout)  # LN_attn: attn_nw / attn_nb

so in pre-LN the *first* LayerNorm is ``norm_w/norm_b`` and the one before the FFN is
``attn_nw/attn_nb``; the final LayerNorm of a pre-LN stack is outside the layer (as in DeepSpeed).

The ops, in order: the QKV GEMM without its bias -> ``attention_qkvpacked`` (flash-style, on the
packed [batch, seq, 3 * hidden] GEMM output: adds attn_qkvb as it loads q, k, v and sums its
gradient; writes the context in [batch, seq, hidden] and dq, dk, dv into one packed gradient;
saves the packed qkv, the context and the row logsumexp; the [seq, seq] probabilities and their
dropout mask are never stored) -> F.linear (Wo, no bias) -> ``bias_dropout_add_layer_norm`` (bias
+ dropout + residual + LN in one op; the dropout mask is regenerated from its Philox seed in
backward) -> ``mlp`` (the Wi GEMM with bias + erf-GELU in its epilogue, then the Wout GEMM; in
backward the Wout dX GEMM applies GELU's derivative in its epilogue) -> ``bias_dropout_add[_layer_norm]``. Tensors that feed a residual and something else get
one gradient, not two added afterwards: in post-LN x and y1 feed a GEMM (``linear_with_residual``:
the dX GEMM accumulates the residual's gradient), in pre-LN x feeds LN_in (``layer_norm(...,
return_residual=True)``: its backward kernel adds it). Bytes and launches of a step:
docs/traffic.md.

Dropout is reproducible: every dropout site (attention probabilities, attention output, FFN
output) of every training forward gets its own Philox seed, a hash of (the layer's seed,
``layer_id``, the layer's forward counter ``dropout_calls``, the site). The counter advances on
each training forward, except a forward run during backward (an activation-checkpointing
recompute reuses the masks of the last forward). Seed and counter are in the state_dict
(``_extra_state``), so restoring a checkpoint continues the same dropout streams.

Progressive layer drop (pre-LN only): ``forward(..., progressive_layer_drop=True, pld_theta=t)``,
as DeepSpeed's engine passes it, keeps layer ``layer_number`` (1-based) of ``num_layers``
(default ``config.num_hidden_layers``) with probability p = 1 - (layer_number / num_layers) *
(1 - t) in training; a dropped layer returns its input, a kept one divides both residual
branches by p (see `tachyon.nn.transformer_layer.pld_keep_probability`)::

    z1  = x + (dropout(attention(LN_in(x)) @ Wo + bo)) / p
    out = z1 + (dropout(gelu(LN_attn(z1) @ Wi + bi) @ Wout + bout)) / p

The counter and the (seed, layer_id) hash prefix live in int64 buffers on the layer's device
(non-persistent: the state_dict keeps ``_extra_state``); the counter is advanced in place by a
small custom op and the three seeds are computed from it with tensor ops, passed to the kernels
as 0-dim tensors. Nothing is read on the host, and ``torch.compile(layer)`` compiles once: the
seeds are values in the graph, not constants that change every step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from tachyon.backend import resolve
from tachyon.kernels.attention.reference import masked_bias
from tachyon.kernels.linear.mlp import gemm_backend
from tachyon.kernels.registry import eager_call
from tachyon.nn.transformer_kernel import _kernels as K
from tachyon.nn.transformer_kernel import fused
from tachyon.nn.transformer_kernel.config import TransformerKernelConfig
from tachyon.nn.transformer_layer import pld_draw_keep, pld_keep_probability

# dropout sites of one forward
_SITE_ATTN_PROBS, _SITE_ATTN_OUT, _SITE_FFN_OUT = 0, 1, 2

# extra arguments HF's BertEncoder (transformers 4.x and 5.x) may pass that do not change a BERT
# encoder layer's result; any other extra argument must be None or False
_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "return_dict", "output_hidden_states"})

_PARAM_NAMES = ("attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb",
                "inter_w", "inter_b", "output_w", "output_b", "norm_w", "norm_b")


def _eager(x: Tensor, params: Sequence[Tensor]) -> bool:
    """True where the layer may run as one autograd node (fused.py): plain eager execution on
    plain tensors (not under torch.compile, a dispatch mode or a functorch transform)."""
    return eager_call((x, *params))


_mask_cache: list[Any] = []  # [mask tensor, its _version, batch, seq, bias]: the layers of one model share a mask


def _check_keep_values(mask: Tensor) -> None:
    """A [batch, seq] mask is a keep mask: bool, or 0/1 values (1 = keep). Refuses other values,
    naming an additive mask (0 keep, negative pad) passed in this shape. One host read of the
    device's answer, when a new mask arrives (the result is cached for the other layers)."""
    if mask.dtype == torch.bool:
        return
    if mask.is_complex():
        raise ValueError(f"attention_mask [batch, seq] must be bool or 0/1 (1 = keep); got dtype {mask.dtype}")
    other, negative = torch.stack([((mask != 0) & (mask != 1)).any(), (mask < 0).any()]).tolist()
    if not other:
        return
    if negative:
        raise ValueError(
            "attention_mask [batch, seq] is a keep mask (1 = keep, 0 = pad) but has negative values: an additive "
            "mask (0 keep, -10000 or -inf pad)? Pass an additive mask in HF's shape [batch, 1, 1, seq], or as a "
            "keep mask, (mask == 0)")
    raise ValueError("attention_mask [batch, seq] is a keep mask and takes the values 0 and 1 (1 = keep) or bool; "
                     "it has other values")


def _check_additive_values(mask: Tensor) -> None:
    """A float 4-D mask is HF's additive mask: 0 keep, negative masked; bool is a keep mask (True =
    keep). Refuses positive values, naming a 0/1 keep mask passed in the additive shape."""
    if mask.dtype == torch.bool:
        return
    if not mask.is_floating_point():
        raise ValueError(f"attention_mask of HF's 4-D shape must be float (additive: 0 keep, negative masked) or bool "
                         f"(True = keep); got {mask.dtype}")
    positive, keep_like = torch.stack([(mask > 0).any(), ((mask == 0) | (mask == 1)).all()]).tolist()
    if not positive:
        return
    if keep_like:
        raise ValueError(
            "attention_mask of HF's 4-D shape is read as an additive mask (0 keep, large negative masked) but has "
            "0/1 values: a keep mask (1 = keep)? Pass a keep mask as [batch, seq], or as bool, or convert it with "
            "(1.0 - mask) * torch.finfo(dtype).min")
    raise ValueError("attention_mask of HF's 4-D shape is an additive mask (0 keep, negative masked) and must have no "
                     "positive values")


def key_padding_bias(mask: Tensor | None, batch: int, seq: int, device: torch.device) -> Tensor | None:
    """The additive fp32 key bias [batch, seq] (0 keep, -inf masked) for any mask the layer accepts.

    Accepted: None; [batch, seq] bool or 0/1 (1/True = keep); HF's extended additive mask
    [batch, 1, 1, seq] (float, 0 keep / large negative masked) or its bool form; HF 5.x's 4D masks
    [batch, 1, seq, seq] (eager: additive float; SDPA: bool, True = keep) whose rows are all equal,
    i.e. key padding masks (a mask that differs per query, such as a causal one, is refused). A
    batch dim of 1 broadcasts. Other shapes raise ValueError, and so do values the shape does not
    take: a [batch, seq] mask with values other than 0/1 (an additive mask in the keep mask's
    shape) or a float 4-D mask with positive values (a 0/1 keep mask in the additive shape);
    checked when a new mask arrives in eager mode (one host read), trusted under torch.compile.

    Eager calls cache the last result (the layers of one model share one mask); under
    torch.compile the cache is skipped (dynamo would guard on it and recompile per new mask).
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ValueError(f"attention_mask must be a tensor or None; got {type(mask).__name__}")
    compiling = torch.compiler.is_compiling()
    if not compiling and _mask_cache and _mask_cache[0] is mask and _mask_cache[1:4] == [mask._version, batch, seq]:
        return _mask_cache[4]
    shape = tuple(mask.shape)
    allowed = (f"allowed: [batch, seq] = {(batch, seq)} (bool or 0/1, 1 = keep), HF's extended mask "
               f"[batch, 1, 1, seq] = {(batch, 1, 1, seq)}, or HF's 4D mask {(batch, 1, seq, seq)} with equal rows")
    if mask.device != device:
        raise ValueError(f"attention_mask is on {mask.device} but hidden_states is on {device}")
    if mask.dim() == 2 and shape[0] in (1, batch) and shape[1] == seq:
        if not compiling:
            _check_keep_values(mask)
        bias = K.padding_bias_from_mask(mask, torch.float32)
    elif mask.dim() == 4 and shape[0] in (1, batch) and shape[1] == 1 and shape[2] in (1, seq) and shape[3] == seq:
        if not compiling:
            _check_additive_values(mask)
        first = mask[:, :, :1, :]
        if shape[2] > 1 and not torch.equal(mask, first.expand_as(mask)):
            raise ValueError(
                f"attention_mask of shape {shape} differs between query rows (a causal or custom mask); the "
                "BERT kernel layer takes key padding masks only, where every query row is the same"
            )
        bias = K.padding_bias_from_mask(first, torch.float32)
    else:
        raise ValueError(f"attention_mask has shape {shape}; {allowed}")
    bias = bias.expand(batch, seq).contiguous()
    if not compiling:
        _mask_cache[:] = [mask, mask._version, batch, seq, bias]
    return bias


class TransformerKernelLayer(nn.Module):
    """A BERT encoder layer (DeepSpeed's ``DeepSpeedTransformerLayer``) from fused kernels.

    Args:
        config: a :class:`TransformerKernelConfig`; the layer keeps its own copy (``self.config``)
            with ``layer_id`` set.
        initial_weights, initial_biases: optional lists of 8 tensors each, DeepSpeed's order:
            ``[q, k, v, attn_out, attn_layernorm, intermediate, output, layernorm]``, i.e.
            weights ``[Wq [H, H], Wk [H, H], Wv [H, H], attn_ow [H, H], attn_nw [H],
            inter_w [I, H], output_w [H, I], norm_w [H]]`` and biases ``[bq, bk, bv, attn_ob,
            attn_nb, inter_b, output_b, norm_b]``. q, k, v are concatenated into ``attn_qkvw``
            [3H, H] (and ``attn_qkvb`` [3H]). The values are copied (DeepSpeed uses the tensors
            themselves and zeroes attn_qkvb; tachyon takes bq, bk, bv as given). Either list may
            be None: weights are then initialized as below, biases set to zero. Which LayerNorm is
            which: see the module docstring (post-LN: attn_nw after attention, norm_w last;
            pre-LN: norm_w first, attn_nw before the FFN).

    Initialization (no initial weights): weights ~ normal(0, initializer_range), biases 0, LN
    weights 1 and biases 0; with ``adjust_init_range`` the attn_ow and output_w std is
    ``initializer_range / sqrt(2 * num_hidden_layers)``. Parameters are created in the config's
    dtype (fp16 / bf16 / fp32) on the device of ``initial_weights`` (else the default device).

    Class attribute ``layer_id`` counts the layers built (from 0); each instance stores its own
    ``self.layer_id`` and ``self.config.layer_id``. ``copy.deepcopy`` of a layer takes a new id
    (the DeepSpeed tutorial builds a stack by deep-copying one layer, "with different IDs").

    ``backend`` ("auto", "triton", "torch" or None = the global choice) pins the kernels'
    backend for this layer.

    ``layer_number`` (1-based position in the stack, default None) and ``num_layers`` (default
    ``config.num_hidden_layers``) place the layer for progressive layer drop; set
    ``layer_number`` on each layer of a stack before training with PLD.
    """

    layer_id = 0

    def __init__(self, config: TransformerKernelConfig, initial_weights: Sequence[Tensor] | None = None,
                 initial_biases: Sequence[Tensor] | None = None, *, backend: str | None = None) -> None:
        super().__init__()
        if not isinstance(config, TransformerKernelConfig):
            raise ValueError(f"config must be a TransformerKernelConfig; got {type(config).__name__}")
        self.config = copy.copy(config)
        self._take_layer_id()
        if config.local_rank >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)
        self.backend = backend
        # eager calls run the layer as one autograd node (fused.py); False: op by op, as traced
        self.fused_eager = True
        self.hf_config = None  # the HF BertConfig of from_hf, used by to_hf
        self.layer_number: int | None = None  # progressive layer drop: 1-based position in the stack
        self.num_layers: int = config.num_hidden_layers
        h, i, dtype = config.hidden_size, config.intermediate_size, config.dtype
        w_shapes = [(h, h), (h, h), (h, h), (h, h), (h,), (i, h), (h, i), (h,)]
        b_shapes = [(h,), (h,), (h,), (h,), (h,), (i,), (h,), (h,)]
        weights = _check_initial("initial_weights", initial_weights, w_shapes)
        biases = _check_initial("initial_biases", initial_biases, b_shapes)
        given = (weights or []) + (biases or [])
        device = given[0].device if given else None
        # dropout state on the layer's device: dropout_key(seed, layer_id) and the forward counter
        self.register_buffer("_dropout_key", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("_dropout_calls", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.dropout_seed = config.seed if config.seed >= 0 else int(torch.randint(0, 2**62, ()).item())
        shapes = {"attn_qkvw": (3 * h, h), "attn_qkvb": (3 * h,), "attn_ow": (h, h), "attn_ob": (h,),
                  "attn_nw": (h,), "attn_nb": (h,), "inter_w": (i, h), "inter_b": (i,), "output_w": (h, i),
                  "output_b": (h,), "norm_w": (h,), "norm_b": (h,)}
        for name in _PARAM_NAMES:
            setattr(self, name, nn.Parameter(torch.empty(shapes[name], dtype=dtype, device=device)))
        self.init_transformer_weights(config.adjust_init_range)
        with torch.no_grad():
            if weights is not None:
                self.attn_qkvw.copy_(torch.cat([w.detach().to(dtype) for w in weights[:3]]))
                for name, w in zip(("attn_ow", "attn_nw", "inter_w", "output_w", "norm_w"), weights[3:]):
                    getattr(self, name).copy_(w.detach())
            if biases is not None:
                self.attn_qkvb.copy_(torch.cat([b.detach().to(dtype) for b in biases[:3]]))
                for name, b in zip(("attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"), biases[3:]):
                    getattr(self, name).copy_(b.detach())

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("dropout_seed", "layer_id") and "_dropout_key" in self.__dict__.get("_buffers", {}) \
                and "dropout_seed" in self.__dict__:
            with torch.no_grad():
                self._dropout_key.fill_(K.dropout_key(self.dropout_seed, self.layer_id))

    @property
    def dropout_calls(self) -> int:
        """The forward counter (training forwards so far), read from its device buffer."""
        return int(self._dropout_calls.item())

    @dropout_calls.setter
    def dropout_calls(self, value: int) -> None:
        with torch.no_grad():
            self._dropout_calls.fill_(int(value))

    def _take_layer_id(self) -> None:
        self.layer_id = TransformerKernelLayer.layer_id
        self.config.layer_id = self.layer_id
        TransformerKernelLayer.layer_id += 1

    def __deepcopy__(self, memo: dict) -> TransformerKernelLayer:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._take_layer_id()
        return new

    @torch.no_grad()
    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """DeepSpeed's initialization (see the class docstring); overwrites every parameter."""
        c = self.config
        std = c.initializer_range
        out_std = std / math.sqrt(2.0 * c.num_hidden_layers) if adjust_init_range else std
        for name, value in (("attn_qkvw", std), ("attn_ow", out_std), ("inter_w", std), ("output_w", out_std)):
            getattr(self, name).normal_(0.0, value)
        for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
            getattr(self, name).zero_()
        self.attn_nw.fill_(1.0)
        self.norm_w.fill_(1.0)

    def get_extra_state(self) -> Tensor:
        """[dropout seed, forward counter] (int64), so a restored layer continues the same streams."""
        return torch.tensor([self.dropout_seed, self.dropout_calls], dtype=torch.int64)

    def set_extra_state(self, state: Tensor) -> None:
        seed, calls = (int(v) for v in state.tolist())
        self.dropout_seed = seed  # refreshes the key buffer
        self.dropout_calls = calls

    def extra_repr(self) -> str:
        c = self.config
        kind = "pre-LN" if c.pre_layer_norm else "post-LN"
        flags = [f for f in ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint") if getattr(c, f)]
        return (f"layer_id={self.layer_id}, {kind}, hidden={c.hidden_size}, heads={c.heads}, "
                f"intermediate={c.intermediate_size}, dtype={c.dtype}, flags={flags}")

    # --- forward -----------------------------------------------------------------------------

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args: Any,
                progressive_layer_drop: bool = False, pld_theta: float | None = None, **kwargs: Any):
        """hidden_states [batch, seq, hidden] in the config's dtype -> the same shape and dtype
        (``(out,)`` with ``return_tuple``).

        attention_mask: None, [batch, seq] bool/0-1 (1 = keep), HF's extended additive
        [batch, 1, 1, seq], or HF 5.x's [batch, 1, seq, seq] (eager float or SDPA bool) key padding
        mask; see :func:`key_padding_bias`. Padded query positions are computed like HF does (only
        keys are masked).

        Extra arguments HF's BertEncoder passes (encoder_hidden_states, encoder_attention_mask,
        past_key_values, head_mask, output_attentions, ...) are accepted when None/False;
        position_ids, cache_position, use_cache are ignored. Anything else raises ValueError.

        Training (``config.training`` and ``module.training``): dropout on, autograd graph built
        when grad is enabled. Otherwise (``config.training=False`` or ``eval()``): no dropout and
        the forward runs under ``torch.no_grad()``, so nothing is saved for backward and the output
        does not require grad (DeepSpeed's inference behaviour). For gradients without dropout,
        keep ``train()`` and set the dropout ratios to 0.

        progressive_layer_drop, pld_theta: progressive layer drop (module docstring; pre-LN only,
        ignored when not training). A dropped layer returns ``hidden_states`` itself and does not
        advance the dropout counter.
        """
        _check_extra_args(args, kwargs)
        x = hidden_states
        self._check_input(x)
        keep = pld_keep_probability("TransformerKernelLayer", progressive_layer_drop, pld_theta, self.layer_number,
                                    self.num_layers)
        if keep is not None and not self.config.pre_layer_norm:
            raise ValueError(
                "TransformerKernelLayer: progressive layer drop needs pre_layer_norm=True (DeepSpeed's pre-LN BERT); "
                "a post-LN layer normalizes its residual, so skipping it is not the identity PLD assumes"
            )
        batch, seq, _ = x.shape
        bias = key_padding_bias(attention_mask, batch, seq, x.device)
        active = self.config.training and self.training
        scale = 1.0
        if keep is not None and active:
            if not pld_draw_keep(keep):
                return (x,) if self.config.return_tuple else x
            scale = 1.0 / keep
        if active:
            # advance the counter (not in a recompute during backward) and derive the three seeds,
            # 0-dim int64 tensors indexed by _SITE_ATTN_PROBS, _SITE_ATTN_OUT, _SITE_FFN_OUT
            seeds = K.next_dropout_seeds(self._dropout_key, self._dropout_calls, backend=self.backend).unbind(0)
            if self.fused_eager and _eager(x, self._params()):
                out = self._fused(x, bias, seeds, scale)
            else:
                out = self._forward(x, bias, True, seeds, scale)
        else:
            with torch.no_grad():
                if self.fused_eager and _eager(x, ()):
                    out = self._fused(x, bias, None, 1.0)
                else:
                    out = self._forward(x, bias, False, [0, 0, 0])
        return (out,) if self.config.return_tuple else out

    def _params(self) -> tuple[Tensor, ...]:
        p = self._parameters
        return (p["attn_qkvw"], p["attn_qkvb"], p["attn_ow"], p["attn_ob"], p["attn_nw"], p["attn_nb"], p["inter_w"],
                p["inter_b"], p["output_w"], p["output_b"], p["norm_w"], p["norm_b"])

    def _fused(self, x: Tensor, bias: Tensor | None, seeds: Sequence[Tensor] | None, scale: float) -> Tensor:
        """The layer as one autograd node (fused.py): the eager path; ``seeds`` None: no dropout."""
        c = self.config
        batch, seq, hidden = x.shape
        p_attn = c.attn_dropout_ratio if seeds is not None else 0.0
        p_hidden = c.hidden_dropout_ratio if seeds is not None else 0.0
        training = seeds is not None and torch.is_grad_enabled()
        plan = fused.Plan(batch, seq, c.heads, c.pre_layer_norm, c.layer_norm_eps, p_attn, p_hidden,
                          1.0 / math.sqrt(hidden // c.heads), not c.stochastic_mode, c.normalize_invertible,
                          c.gelu_checkpoint, c.attn_dropout_checkpoint and training, scale, resolve(x, self.backend),
                          gemm_backend(x, self.backend, self.output_w.shape[1], *self._params()))
        x2 = x.reshape(batch * seq, hidden)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        bias = masked_bias(bias)
        s0 = seeds[_SITE_ATTN_PROBS] if p_attn > 0 else None
        s1, s2 = (seeds[_SITE_ATTN_OUT], seeds[_SITE_FFN_OUT]) if p_hidden > 0 else (None, None)
        params = self._params()
        if training and (x.requires_grad or any(p.requires_grad for p in params)):
            out = fused.apply(plan, x2, bias, s0, s1, s2, *params)
        else:
            out, _ = fused.forward(plan, x2, bias, (s0, s1, s2), params, False)
        return out.view(batch, seq, hidden)

    def _check_input(self, x: Tensor) -> None:
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"hidden_states must be [batch, seq, hidden_size={c.hidden_size}]; got {shape}")
        if x.dtype != c.dtype:
            raise ValueError(
                f"hidden_states has dtype {x.dtype} but the layer is configured for {c.dtype} "
                f"(fp16={c.fp16}, bf16={c.bf16}); pass {c.dtype} inputs or build the config for {x.dtype}"
            )
        if self.attn_qkvw.dtype != c.dtype:
            raise ValueError(
                f"the layer's parameters have dtype {self.attn_qkvw.dtype} but the config says {c.dtype} "
                f"(fp16={c.fp16}, bf16={c.bf16}); build the layer from a config with the dtype you want"
            )
        batch, seq = x.shape[0], x.shape[1]
        if not 1 <= batch <= c.batch_size:
            raise ValueError(f"hidden_states has batch size {batch}; allowed: 1 to config.batch_size={c.batch_size}")
        if not 1 <= seq <= c.max_seq_length:
            raise ValueError(f"hidden_states has sequence length {seq}; allowed: 1 to config.max_seq_length={c.max_seq_length}")

    def _attention(self, x: Tensor, bias: Tensor | None, dropout_p: float, seed: int | Tensor) -> tuple[Tensor, Tensor]:
        """[LN_in ->] QKV GEMM -> flash attention -> (the context [batch, seq, hidden] (before Wo),
        x as a view for the residual branch: from K.linear_with_residual (post-LN) or from LN_in
        (pre-LN), so that x's two gradients are summed inside a GEMM or a kernel, not by an add).

        The GEMM runs without its bias: the attention kernels add attn_qkvb as they load q, k, v
        from the packed [batch, seq, 3 * hidden] output, and sum its gradient; they write the
        context in [batch, seq, hidden] and dq, dk, dv into one packed gradient (no copies)."""
        c = self.config
        if c.pre_layer_norm:  # x is also LN_attn's residual: its two gradients are summed by LN_in's backward
            x, residual = K.layer_norm(x, self.norm_w, self.norm_b, eps=c.layer_norm_eps, return_residual=True,
                                       invertible=c.normalize_invertible, backend=self.backend)
            qkv = F.linear(x, self.attn_qkvw)
        else:  # x is also LN_attn's residual: its two gradients are summed by the QKV dX GEMM
            qkv, residual = K.linear_with_residual(x, self.attn_qkvw)
        ctx = K.attention_qkvpacked(qkv, c.heads, qkv_bias=self.attn_qkvb, key_padding_bias=bias, dropout_p=dropout_p,
                                    seed=seed, deterministic=not c.stochastic_mode, one_kernel_backward=True,
                                    backend=self.backend)
        return ctx, residual

    def _forward(self, x: Tensor, bias: Tensor | None, active: bool, seeds: list[int] | list[Tensor],
                 scale: float = 1.0) -> Tensor:
        """``scale``: progressive layer drop's 1 / p on both residual branches (pre-LN only)."""
        c = self.config
        p_attn = c.attn_dropout_ratio if active else 0.0
        p_hidden = c.hidden_dropout_ratio if active else 0.0
        eps, inv, be = c.layer_norm_eps, c.normalize_invertible, self.backend
        if c.attn_dropout_checkpoint and active and torch.is_grad_enabled():
            # keep only the region's input (the layer input, saved anyway); the packed QKV and
            # the logsumexp are recomputed in backward with the same seed
            seed = seeds[_SITE_ATTN_PROBS] if p_attn > 0 else 0  # a region input is saved: no unused seed
            ctx, x_res = torch.utils.checkpoint.checkpoint(self._attention, x, bias, p_attn, seed,
                                                           use_reentrant=False, preserve_rng_state=False)
        else:
            ctx, x_res = self._attention(x, bias, p_attn, seeds[_SITE_ATTN_PROBS])
        a, attn_ob = F.linear(ctx, self.attn_ow), self.attn_ob
        if scale != 1.0:
            a, attn_ob = a * scale, attn_ob * scale
        pre = c.pre_layer_norm  # pre-LN: z1 is the residual stream; post-LN: only y1 is used (with
        # normalize_invertible, z1 is then never written)
        normed = K.bias_dropout_add_layer_norm(a, attn_ob, x_res, self.attn_nw, self.attn_nb,
                                               eps, p_hidden, seeds[_SITE_ATTN_OUT], training=active, invertible=inv,
                                               return_residual=pre, backend=be)
        y1, z1 = normed if pre else (normed, None)
        # Wi GEMM + bias + GELU (one Triton GEMM: its epilogue writes the pre-activation and the
        # GELU output) -> Wout GEMM; in backward the Wout dX GEMM's epilogue applies GELU's derivative.
        # Post-LN: y1 is also LN_out's residual, its two gradients summed by the Wi dX GEMM.
        ffn = K.mlp(y1, self.inter_w, self.inter_b, "gelu", self.output_w, None, checkpoint_activation=c.gelu_checkpoint,
                    return_residual=not pre, backend=be)
        f, y1_res = (ffn, None) if pre else ffn
        if c.pre_layer_norm:
            output_b = self.output_b
            if scale != 1.0:
                f, output_b = f * scale, output_b * scale
            return K.bias_dropout_add(f, output_b, z1, p_hidden, seeds[_SITE_FFN_OUT], training=active, backend=be)
        return K.bias_dropout_add_layer_norm(f, self.output_b, y1_res, self.norm_w, self.norm_b, eps, p_hidden,
                                             seeds[_SITE_FFN_OUT], training=active, invertible=inv,
                                             return_residual=False, backend=be)

    # --- Hugging Face interop (implemented in hf.py) -----------------------------------------

    @classmethod
    def from_hf(cls, bert_layer: nn.Module, config: TransformerKernelConfig | None = None,
                **config_overrides: Any) -> TransformerKernelLayer:
        """A post-LN kernel layer with the weights of an HF ``BertLayer`` (see hf.layer_from_hf)."""
        from tachyon.nn.transformer_kernel.hf import layer_from_hf

        return layer_from_hf(bert_layer, config, cls=cls, **config_overrides)

    def to_hf(self) -> nn.Module:
        """A new HF ``BertLayer`` holding this layer's weights (see hf.layer_to_hf)."""
        from tachyon.nn.transformer_kernel.hf import layer_to_hf

        return layer_to_hf(self)


def _check_initial(name: str, tensors: Sequence[Tensor] | None, shapes: list[tuple[int, ...]]) -> list[Tensor] | None:
    if tensors is None:
        return None
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or len(tensors) != len(shapes):
        raise ValueError(f"{name} must be a list of {len(shapes)} tensors in DeepSpeed's order "
                         "[q, k, v, attn_out, attn_layernorm, intermediate, output, layernorm]")
    for index, (t, shape) in enumerate(zip(tensors, shapes)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}[{index}] has shape {got}; expected {shape}")
    return list(tensors)


def _check_extra_args(args: tuple, kwargs: dict) -> None:
    for index, value in enumerate(args):
        if value is not None and value is not False:
            raise ValueError(
                f"TransformerKernelLayer.forward: positional argument {index + 2} (HF's encoder_hidden_states / "
                f"DeepSpeed's head_mask) must be None; got {type(value).__name__}: cross-attention and head masks "
                "are not supported"
            )
    for key, value in kwargs.items():
        if key in _IGNORED_KWARGS or value is None or value is False:
            continue
        raise ValueError(
            f"TransformerKernelLayer.forward: {key}={type(value).__name__} is not supported (an encoder BERT layer "
            f"takes hidden_states and attention_mask; {key} must be None or False)"
        )


__all__ = ["TransformerKernelLayer", "key_padding_bias"]
