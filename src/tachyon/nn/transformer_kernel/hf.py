"""Hugging Face interop: BertLayer <-> TransformerKernelLayer, and swapping a model's layers.

    layer = TransformerKernelLayer.from_hf(model.encoder.layer[0])     # post-LN, HF's weights
    bert_layer = layer.to_hf()                                         # back to a BertLayer
    model = tachyon.nn.replace_bert_layers(model, attn_dropout_ratio=0.0)   # every BertLayer

Weight mapping (HF -> kernel): attention.self.{query,key,value} -> attn_qkvw/attn_qkvb (rows
[q; k; v]), attention.output.dense -> attn_ow/attn_ob, attention.output.LayerNorm -> attn_nw/
attn_nb, intermediate.dense -> inter_w/inter_b, output.dense -> output_w/output_b,
output.LayerNorm -> norm_w/norm_b.

What HF's BertEncoder passes to each layer (transformers 5.x): ``layer(hidden_states,
attention_mask, encoder_hidden_states, encoder_attention_mask=..., past_key_values=...,
position_ids=..., **kwargs)`` and it takes a tensor back (4.x: a tuple). attention_mask is what
``BertModel`` built for its attention implementation: eager, a float [batch, 1, seq, seq] with
finfo.min at padded keys; SDPA, a bool [batch, 1, seq, seq] (True = keep) or None when nothing is
padded. The kernel layer reduces either to its [batch, seq] key bias; the rest must be None.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tachyon.nn.transformer_kernel.config import TransformerKernelConfig
from tachyon.nn.transformer_kernel.layer import TransformerKernelLayer

DEFAULT_BATCH_SIZE = 1024  # from_hf's batch_size when not overridden: a generous upper bound


def _bert_layer_class() -> type:
    from transformers.models.bert.modeling_bert import BertLayer

    return BertLayer


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _hf_config_of(bert_layer: nn.Module) -> Any:
    return getattr(bert_layer.attention.self, "config", None)


def config_from_hf(bert_layer: nn.Module, **overrides: Any) -> TransformerKernelConfig:
    """The post-LN config matching an HF BertLayer: sizes, eps and dropouts from its modules,
    max_seq_length = max_position_embeddings, fp16/bf16 from its weights, then ``overrides``."""
    attn = bert_layer.attention.self
    hf = _hf_config_of(bert_layer)
    act = getattr(hf, "hidden_act", "gelu") if hf is not None else "gelu"
    act_fn = bert_layer.intermediate.intermediate_act_fn
    if act != "gelu" or (type(act_fn).__name__ != "GELUActivation" and act_fn is not torch.nn.functional.gelu):
        raise ValueError(f"hidden_act={act!r} ({type(act_fn).__name__}) is not supported; "
                         "the BERT kernel layer uses the exact (erf) 'gelu'")
    if getattr(hf, "position_embedding_type", "absolute") not in ("absolute", None):
        raise ValueError(f"position_embedding_type={hf.position_embedding_type!r} is not supported; allowed: 'absolute'")
    if getattr(bert_layer, "add_cross_attention", False) or getattr(bert_layer, "is_decoder", False):
        raise ValueError("BertLayer with is_decoder / add_cross_attention is not supported; the kernel layer is an encoder layer")
    dtype = attn.query.weight.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"BertLayer weights have dtype {dtype}; allowed: float32, float16, bfloat16")
    eps_attn, eps_out = bert_layer.attention.output.LayerNorm.eps, bert_layer.output.LayerNorm.eps
    if eps_attn != eps_out:
        raise ValueError(f"the two LayerNorms of the BertLayer have different eps ({eps_attn}, {eps_out}); the kernel layer uses one")
    values: dict[str, Any] = {
        "batch_size": DEFAULT_BATCH_SIZE,
        "max_seq_length": getattr(hf, "max_position_embeddings", 512),
        "hidden_size": attn.query.in_features,
        "intermediate_size": bert_layer.intermediate.dense.out_features,
        "heads": attn.num_attention_heads,
        "attn_dropout_ratio": float(attn.dropout.p),
        "hidden_dropout_ratio": float(bert_layer.attention.output.dropout.p),
        "num_hidden_layers": getattr(hf, "num_hidden_layers", 1),
        "initializer_range": getattr(hf, "initializer_range", 0.02),
        "layer_norm_eps": eps_attn,
        "fp16": dtype == torch.float16,
        "bf16": dtype == torch.bfloat16,
        "pre_layer_norm": False,
        "return_tuple": _transformers_major() < 5,
    }
    if overrides.get("pre_layer_norm"):
        raise ValueError("pre_layer_norm=True cannot be used with BertLayer weights; HF's BertLayer is post-LN")
    return TransformerKernelConfig.from_dict({**values, **overrides})  # unknown keys raise, naming them


def layer_from_hf(bert_layer: nn.Module, config: TransformerKernelConfig | None = None, *,
                  cls: type = TransformerKernelLayer, **config_overrides: Any) -> TransformerKernelLayer:
    """A post-LN kernel layer computing what ``bert_layer`` computes, with its weights copied.

    ``config``: None derives one (``config_from_hf`` with ``config_overrides``); a given config
    must match the layer's sizes and be post-LN. The layer's parameters live on the BertLayer's
    device, in its dtype; its training mode is copied.
    """
    if not isinstance(bert_layer, _bert_layer_class()):
        raise ValueError(f"bert_layer must be a transformers BertLayer; got {type(bert_layer).__name__}")
    derived = config_from_hf(bert_layer, **config_overrides)
    if config is None:
        config = derived
    else:
        if config_overrides:
            raise ValueError("give either config or config overrides, not both")
        for name in ("hidden_size", "intermediate_size", "heads", "layer_norm_eps", "pre_layer_norm"):
            if getattr(config, name) != getattr(derived, name):
                raise ValueError(f"config.{name}={getattr(config, name)!r} but the BertLayer has {getattr(derived, name)!r}")
        if config.dtype != derived.dtype:
            raise ValueError(f"config's dtype is {config.dtype} but the BertLayer's weights are {derived.dtype}")
    attn, out = bert_layer.attention, bert_layer.output
    weights = [attn.self.query.weight, attn.self.key.weight, attn.self.value.weight, attn.output.dense.weight,
               attn.output.LayerNorm.weight, bert_layer.intermediate.dense.weight, out.dense.weight, out.LayerNorm.weight]
    biases = [attn.self.query.bias, attn.self.key.bias, attn.self.value.bias, attn.output.dense.bias,
              attn.output.LayerNorm.bias, bert_layer.intermediate.dense.bias, out.dense.bias, out.LayerNorm.bias]
    layer = cls(config, initial_weights=weights, initial_biases=biases)
    layer.hf_config = copy.deepcopy(_hf_config_of(bert_layer))
    layer.train(bert_layer.training)
    return layer


def layer_to_hf(layer: TransformerKernelLayer) -> nn.Module:
    """A new HF BertLayer with ``layer``'s weights (the BertConfig kept by from_hf, or one built
    from the kernel config). Only post-LN layers have a BertLayer equivalent."""
    from transformers import BertConfig

    c = layer.config
    if c.pre_layer_norm:
        raise ValueError("to_hf needs a post-LN layer (pre_layer_norm=False); HF's BertLayer is post-LN")
    hf_config = copy.deepcopy(layer.hf_config)
    if hf_config is None:
        hf_config = BertConfig(
            hidden_size=c.hidden_size, num_attention_heads=c.heads, intermediate_size=c.intermediate_size,
            hidden_act="gelu", hidden_dropout_prob=c.hidden_dropout_ratio,
            attention_probs_dropout_prob=c.attn_dropout_ratio, layer_norm_eps=c.layer_norm_eps,
            max_position_embeddings=c.max_seq_length, num_hidden_layers=c.num_hidden_layers,
            initializer_range=c.initializer_range,
        )
    bert = _bert_layer_class()(hf_config).to(device=layer.attn_qkvw.device, dtype=c.dtype)
    hf_params = dict(bert.named_parameters())
    with torch.no_grad():
        for ours, (theirs, rows) in hf_parameter_map(layer).items():
            src = getattr(layer, ours.split(".")[0])
            hf_params[theirs].copy_(src if rows is None else src[rows])
    bert.train(layer.training)
    return bert


def hf_parameter_map(layer: TransformerKernelLayer) -> dict[str, tuple[str, slice | None]]:
    """kernel parameter name -> (HF BertLayer parameter name, row slice of the kernel parameter),
    for every parameter of a BertLayer (used by :func:`layer_to_hf` and to compare gradients);
    q/k/v map to thirds of attn_qkvw / attn_qkvb, named ``attn_qkvw.query`` etc."""
    h = layer.config.hidden_size
    thirds = {"query": slice(0, h), "key": slice(h, 2 * h), "value": slice(2 * h, 3 * h)}
    mapping: dict[str, tuple[str, slice | None]] = {}
    for part, rows in thirds.items():
        mapping[f"attn_qkvw.{part}"] = (f"attention.self.{part}.weight", rows)
        mapping[f"attn_qkvb.{part}"] = (f"attention.self.{part}.bias", rows)
    for ours, theirs in (("attn_ow", "attention.output.dense.weight"), ("attn_ob", "attention.output.dense.bias"),
                         ("attn_nw", "attention.output.LayerNorm.weight"), ("attn_nb", "attention.output.LayerNorm.bias"),
                         ("inter_w", "intermediate.dense.weight"), ("inter_b", "intermediate.dense.bias"),
                         ("output_w", "output.dense.weight"), ("output_b", "output.dense.bias"),
                         ("norm_w", "output.LayerNorm.weight"), ("norm_b", "output.LayerNorm.bias")):
        mapping[ours] = (theirs, None)
    return mapping


def _record_hidden_states(layer: nn.Module) -> None:
    """transformers >= 5 collects ``output_hidden_states`` with forward hooks on BertLayer modules;
    give the kernel layer the same hook so ``model(..., output_hidden_states=True)`` still works."""
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:  # transformers 4.x: BertEncoder collects hidden states itself
        return
    install_output_capuring_hook(layer, "hidden_states", 0)


def replace_bert_layers(model: nn.Module, **config_overrides: Any) -> nn.Module:
    """Swap every BertLayer of an HF BERT model (BertModel, BertForMaskedLM, BertForPreTraining,
    ...: any ModuleList of BertLayers, e.g. ``model.encoder.layer`` or ``model.bert.encoder.layer``)
    for a post-LN TransformerKernelLayer with the same weights, in place; returns ``model``.

    ``config_overrides`` go to every layer's config (e.g. ``batch_size=64``,
    ``attn_dropout_ratio=0.0``, ``normalize_invertible=True``, ``seed=1234``). ``model(input_ids,
    attention_mask=...)`` works unchanged. Not carried over: HF's gradient checkpointing of its
    layers (the kernel layer has its own memory flags) and ``output_attentions`` (the attention
    probabilities are never materialized). ``output_hidden_states=True`` works (transformers 5.x
    records it with a forward hook, which is installed on each kernel layer).
    """
    if _transformers_major() >= 5 and config_overrides.get("return_tuple"):
        raise ValueError("return_tuple=True breaks transformers >= 5, whose BertEncoder takes a tensor from each layer")
    bert_layer = _bert_layer_class()
    replaced = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for index, child in enumerate(module):
                if isinstance(child, bert_layer):
                    module[index] = layer_from_hf(child, **config_overrides)
                    _record_hidden_states(module[index])
                    replaced += 1
    if not replaced:
        raise ValueError(f"no BertLayer found in {type(model).__name__}; replace_bert_layers takes an HF BERT model")
    return model


__all__ = ["config_from_hf", "hf_parameter_map", "layer_from_hf", "layer_to_hf", "replace_bert_layers"]
