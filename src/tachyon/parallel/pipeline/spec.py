"""``LayerSpec`` and ``TiedLayerSpec``: layers described, built only on the stage that runs them.

    layers = [
        TiedLayerSpec("embed", Embedding, vocab, hidden, tied_weight_attr="weight"),
        *[LayerSpec(tachyon.nn.TransformerLayer, hidden, 4 * hidden, heads) for _ in range(24)],
        TiedLayerSpec("embed", Embedding, vocab, hidden, forward_fn=lambda emb, x: x @ emb.weight.T),
    ]

DeepSpeed's classes and arguments. A spec holds the class and its constructor arguments; the
pipeline builds a layer only on the rank whose stage runs it, so a model too large for one
device is never materialized whole. TiedLayerSpecs with the same ``key`` share one module per
rank (its ``forward_fn(module, x)`` replaces ``module(x)`` where given); across stages the copies
are kept equal (PipelineModule broadcasts them at build time and sums their gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)`` (typename: an nn.Module class)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec: typename must be an nn.Module subclass; got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose module is shared by every spec with the same ``key``.

    forward_fn: callable(module, inputs) used instead of module(inputs) (e.g. the LM head that
    reuses the embedding's weight). tied_weight_attr: name (or names) of the parameters kept
    equal across stages (DeepSpeed's default "weight").
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] | tuple[str, ...] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string; got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise ValueError(f"TiedLayerSpec: forward_fn must be callable(module, inputs) or None; got {forward_fn!r}")
        attrs = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(f"TiedLayerSpec: tied_weight_attr must be a parameter name or a list of them; got {tied_weight_attr!r}")
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, attrs

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def layer_type_name(layer: object) -> str:
    """The class name partitioning by "type:<regex>" matches against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


__all__ = ["LayerSpec", "TiedLayerSpec", "layer_type_name"]
