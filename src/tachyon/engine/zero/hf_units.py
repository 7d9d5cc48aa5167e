"""Hugging Face models' sharding units, for `tachyon.zero.Init` and stage 3's `find_units`.

An HF model class names the modules that must stay whole on one device in ``_no_split_modules``
(accelerate's ``device_map`` and the HF Trainer's FSDP wrapping read it), and, in recent
transformers, its decoder / encoder layer class as ``_can_record_outputs["hidden_states"]``
(a class, or a recorder whose ``target_class`` is one). Both are class attributes, so they are
known before the model is built -- which `tachyon.zero.Init` needs to shard each layer as soon
as its constructor returns.

HF models initialize their weights in ``post_init`` (``init_weights``), after every layer was
built: under `Init` a layer's parameters are meta tensors by then, which that code cannot
change. `hf_init_weights` runs the model's own ``_initialize_weights`` on each layer sharded
under `Init` with the layer gathered (one layer whole at a time; rank 0's values kept, as
DeepSpeed's ``zero.Init`` with transformers does through ``GatheredParameters``), then the
model's usual ``init_weights`` for the rest (which skips the modules already initialized).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

UNIT_MARK = "_tachyon_init_unit"
"""Set (True) on a module `tachyon.zero.Init` sharded as a unit when its constructor returned."""


def hf_layer_names(cls: type) -> set[str]:
    """The module class names an HF model class lists as units (module docstring); empty for
    anything else."""
    names: set[str] = set()
    listed = getattr(cls, "_no_split_modules", None)
    if isinstance(listed, (list, tuple, set)):
        names.update(n for n in listed if isinstance(n, str))
    recorded = getattr(cls, "_can_record_outputs", None)
    if isinstance(recorded, dict):
        layer = recorded.get("hidden_states")
        layer = getattr(layer, "target_class", layer)
        if isinstance(layer, type):
            names.add(layer.__name__)
    return names


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _pretrained_model_class() -> type | None:
    """transformers' PreTrainedModel if transformers is already imported (never imported here)."""
    utils = sys.modules.get("transformers.modeling_utils")
    return getattr(utils, "PreTrainedModel", None)


def patch_hf_init_weights(gathered: Callable[[list[nn.Parameter]], Any]) -> Callable[[], None] | None:
    """Wrap ``PreTrainedModel.init_weights`` (module docstring) while an `Init` block is active;
    returns the function that restores it, or None when transformers is not imported.
    ``gathered(params)``: the context manager that makes ``params`` whole and keeps rank 0's
    changes (`tachyon.zero.GatheredParameters` with ``modifier_rank=0``)."""
    pretrained = _pretrained_model_class()
    if pretrained is None or not hasattr(pretrained, "_initialize_weights"):
        return None
    original = pretrained.__dict__["init_weights"]

    def init_weights(model: nn.Module) -> Any:
        for unit in model.modules():
            if not unit.__dict__.get(UNIT_MARK) or getattr(unit, "_is_hf_initialized", False):
                continue
            with gathered(list(unit.parameters())):
                for module in _post_order(unit):
                    model._initialize_weights(module)
        return original(model)

    init_weights.__wrapped__ = original
    pretrained.init_weights = init_weights

    def restore() -> None:
        pretrained.init_weights = original

    return restore


__all__ = ["UNIT_MARK", "hf_layer_names", "patch_hf_init_weights"]
