"""Building and touching models too large for one rank, for ZeRO stage 3 (docs/zero.md).

    with tachyon.zero.Init():                  # every rank runs the same construction
        model = GPT(vocab_size=50304, hidden_size=4096, num_layers=48)
    engine, *_ = tachyon.initialize(model=model, config={"zero_optimization": {"stage": 3}, ...})

    with tachyon.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        model.lm_head.weight.data.zero_()      # the whole parameter; rank 0's values are kept

`Init` lets each module be built normally, one at a time, and as soon as the constructor of a
sharding unit returns (the modules stage 3 shards: tachyon's ``TransformerLayer`` /
``TransformerKernelLayer``, the classes named in ``unit_classes`` or the config's
``zero_optimization.shard_module_classes``, and the layer classes HF model classes list in
``_no_split_modules`` / ``_can_record_outputs``: `tachyon.engine.zero.hf_units`), keeps only this
rank's shard of each of its parameters (the rows FSDP2 will give this rank: ``torch.chunk`` of
dim 0 over the data-parallel ranks) in host memory, and turns the parameter itself into a meta
tensor (shape and dtype, no storage). The units' ``__init__`` is wrapped for the block's
duration (classes defined inside the block too) and restored after it. Whatever is left
(embeddings, the final norm, the head: the root's own parameters, and every module of a model
with no unit class) is sharded the same way when the block ends, after the root's constructor
has finished initializing it. So a rank holds at most one unit (plus the root's own parameters)
whole at a time and then 1/N of the model, and every shard holds exactly the values a plain
construction with the same seed gives (every rank runs the same construction: seed them
alike). `tachyon.initialize` at stage 3 then shards the meta model with FSDP2, allocates only
this rank's shards on the device and copies the kept values in.

As with DeepSpeed's ``zero.Init``, code that changes a unit's parameter after the unit's
constructor returned (a parent's constructor re-initializing a child's weights) sees a meta
tensor and changes nothing: do it inside ``GatheredParameters(param, modifier_rank=0)``. HF's
``post_init`` is handled: its weight initialization runs on each unit gathered, one at a time.
Module buffers are not sharded (they are small and every rank needs them whole).

`GatheredParameters(params, modifier_rank=None)`: inside the block each given parameter is whole
on every rank -- of a model built under `Init` before ``initialize`` (its shards are gathered),
or of a stage-3 engine's model (FSDP2's shards; the module attribute then holds a plain
fp32 parameter with the whole value). On exit, with ``modifier_rank`` given, that rank's values
are broadcast and every rank keeps its shard of them (the fp32 master too); with None the
changes are dropped. Parameters that are whole anyway (stages 0-2) are left alone: nothing to
gather. Collective over the ranks that hold the shards.

`register_forward_method(module, name)`: a method other than ``forward`` that runs the model
(``logits``, ``generate``) gathers the module's sharded parameters as ``forward`` does.

`register_external_parameter(module, param)`: ``param`` (registered in another module) is used
in ``module``'s forward; stage 3 then keeps ``param``'s unit out of the sharding units, so the
parameter stays gathered with the root's from the forward to the backward.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tachyon.engine.zero.hf_units import UNIT_MARK, hf_layer_names, patch_hf_init_weights

_LOCAL = "_tachyon_local"
"""Attribute of a meta parameter built under `Init`: this rank's shard (a flat host tensor)."""
_SHARDS = "_tachyon_init_shards"
"""(rank, world size, process group) it was sharded for."""


def _unit_class_names(unit_classes: Any, config: Any) -> set[str]:
    names = {c if isinstance(c, str) else c.__name__ for c in (unit_classes or ())}
    if config is not None:
        if isinstance(config, (str, Path)):
            config = json.loads(Path(config).read_text())
        zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
        names |= set(zero.get("shard_module_classes") or ())
    return names


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


class Init(contextlib.ContextDecorator):
    """Build a model shard by shard (module docstring).

    Args:
        unit_classes: more module classes (or class names) to treat as sharding units.
        data_parallel_group: the process group stage 3 will shard over (default: every rank).
        config: a DeepSpeed-style config (dict or JSON path): its ``zero_optimization``'s
            ``shard_module_classes`` are units too.
        enabled: False makes the block do nothing.
        discover_hf_layers: also treat as units the layer classes HF model classes list
            (``_no_split_modules``, ``_can_record_outputs["hidden_states"]``) and initialize HF
            models' weights layer by layer (`tachyon.engine.zero.hf_units`).
    """

    def __init__(self, unit_classes: Any = None, data_parallel_group: Any = None, config: Any = None,
                 enabled: bool = True, discover_hf_layers: bool = True) -> None:
        self.enabled = enabled
        self.names = _unit_class_names(unit_classes, config)
        self.group = data_parallel_group
        self._handle = None
        self._parents: list[nn.Module] = []
        self._patched: list[tuple[type, Any]] = []
        self._subclass_hook: Any = None
        self.discover = discover_hf_layers
        self._restore_hf: Any = None

    def _is_unit_class(self, cls: type) -> bool:
        from tachyon.engine.zero.fsdp import _known_unit_classes

        return issubclass(cls, _known_unit_classes()) or cls.__name__ in self.names

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("tachyon.zero.Init keeps each rank's shard of the parameters, so it needs "
                               "torch.distributed started first: call tachyon.init_distributed() before the block")
        if self._handle is not None:
            raise RuntimeError("this tachyon.zero.Init block is already active; nest a new Init() instead")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        from torch.nn.modules.module import register_module_module_registration_hook

        self._handle = register_module_module_registration_hook(self._on_child)
        classes = _subclasses(nn.Module)
        if self.discover:  # the layer classes HF model classes list (tachyon.engine.zero.hf_units)
            for cls in classes:
                self.names |= hf_layer_names(cls)
            self._restore_hf = patch_hf_init_weights(self._gathered_for_init)
        for cls in classes:
            if self._is_unit_class(cls):
                self._patch(cls)
        # unit classes defined (or lazily imported) inside the block
        init = self
        self._subclass_hook = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(nn.Module, cls).__init_subclass__(**kwargs)
            if init.discover and init._restore_hf is None:  # transformers imported inside the block
                init._restore_hf = patch_hf_init_weights(init._gathered_for_init)
            listed = hf_layer_names(cls) - init.names if init.discover else set()
            if listed:  # an HF model class defined in the block: its layer classes (defined before it) too
                init.names |= listed
                for other in _subclasses(nn.Module):
                    if other.__name__ in listed:
                        init._patch(other)
            if init._is_unit_class(cls):
                init._patch(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def _gathered_for_init(self, params: list) -> GatheredParameters:
        """``params`` whole, the first rank of the group's values kept (every rank ran the same
        seeded construction): HF's weight initialization of a unit (`patch_hf_init_weights`)."""
        first = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        return GatheredParameters(params, modifier_rank=first)

    def _patch(self, cls: type) -> None:
        """Wrap ``cls.__init__`` so a unit's parameters are sharded as soon as its (outermost)
        constructor returns -- before it is put in a list or attached anywhere."""
        if any(cls is done for done, _ in self._patched):
            return
        original = cls.__dict__.get("__init__")
        inherited = cls.__init__
        init = self

        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_tachyon_init_depth", 0)
            object.__setattr__(module, "_tachyon_init_depth", depth + 1)
            try:
                inherited(module, *args, **kwargs)
            finally:
                if depth:
                    object.__setattr__(module, "_tachyon_init_depth", depth)
                else:
                    module.__dict__.pop("_tachyon_init_depth", None)
            if depth == 0:
                shard_parameters(module, init.rank, init.world, init.group)
                object.__setattr__(module, UNIT_MARK, True)

        __init__.__wrapped__ = inherited
        cls.__init__ = __init__
        self._patched.append((cls, original))

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        del name
        if child is not None and not any(parent is p for p in self._parents):
            self._parents.append(parent)

    def __exit__(self, *exc: Any) -> bool:
        if self._handle is None:
            return False
        self._handle.remove()
        self._handle = None
        for cls, original in reversed(self._patched):
            if original is None:
                del cls.__init__
            else:
                cls.__init__ = original
        self._patched = []
        if self._restore_hf is not None:
            self._restore_hf()
            self._restore_hf = None
        if self._subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._subclass_hook
        if exc[0] is None:
            for parent in self._parents:
                shard_parameters(parent, self.rank, self.world, self.group)
        self._parents = []
        return False


def _replace_storage(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``param`` (same object, same attributes) hold ``value`` -- also across device types
    (host <-> meta), which ``param.data = value`` refuses."""
    attributes = dict(param.__dict__)
    fresh = nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, fresh)
    param.__dict__.update(attributes)


@torch.no_grad()
def shard_parameters(module: nn.Module, rank: int, world: int, group: Any = None) -> None:
    """Keep ``rank``'s dim-0 shard of every parameter of ``module`` (recursively) that is still
    whole, as a flat host tensor on the parameter, and make the parameter a meta tensor."""
    from tachyon.engine.zero.fsdp import dim0_range

    for param in module.parameters():
        if param.is_meta:
            continue
        lo, hi = dim0_range(tuple(param.shape), rank, world)
        local = param.detach().reshape(-1)[lo:hi].to("cpu", copy=True)
        _replace_storage(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        setattr(param, _LOCAL, local)
        setattr(param, _SHARDS, (rank, world, group))


def built_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a meta parameter holding its shard from `Init`."""
    return param.is_meta and hasattr(param, _LOCAL)


def local_values(param: torch.Tensor) -> torch.Tensor:
    """The shard `Init` kept for ``param`` (flat, host)."""
    return getattr(param, _LOCAL)


def sharded_for(param: torch.Tensor) -> tuple[int, int]:
    """(rank, number of ranks) `Init` kept ``param``'s shard for."""
    rank, world, _ = getattr(param, _SHARDS)
    return rank, world


def release_local(param: torch.Tensor) -> torch.Tensor:
    """Take the shard `Init` kept off ``param`` (which then holds nothing) and return it."""
    local = getattr(param, _LOCAL)
    delattr(param, _LOCAL)
    delattr(param, _SHARDS)
    return local


def _gather_built(param: torch.Tensor) -> torch.Tensor:
    """The whole value of an `Init`-built parameter (all-gather of the kept shards)."""
    from tachyon.engine.zero.fsdp import dim0_range

    _, world, group = getattr(param, _SHARDS)
    shape = tuple(param.shape)
    chunk = max(hi - lo for lo, hi in (dim0_range(shape, r, world) for r in range(world)))
    local = local_values(param)
    padded = torch.zeros(chunk, dtype=local.dtype)
    padded[: local.numel()] = local
    out = torch.empty(chunk * world, dtype=local.dtype)
    dist.all_gather_into_tensor(out, padded, group=group)
    pieces = [out[r * chunk: r * chunk + (hi - lo)] for r, (lo, hi) in
              enumerate(dim0_range(shape, r, world) for r in range(world))]
    return torch.cat(pieces).view(shape)


def _stage3_of(param: torch.Tensor) -> Any:
    from tachyon.engine.zero.stage3 import stage3_of

    return stage3_of(param)


class GatheredParameters(contextlib.ContextDecorator):
    """Whole parameters inside the block (module docstring). ``params``: a parameter or an
    iterable of them; ``modifier_rank``: the global rank whose changes are kept (None: dropped);
    ``fwd_module``: accepted for DeepSpeed's signature (unused)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        del fwd_module
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._restore: list[Any] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for param in self.params:
            if built_sharded(param):
                _replace_storage(param, _gather_built(param))
                self._restore.append(("built", param))
            else:
                strategy = _stage3_of(param)
                if strategy is not None:
                    self._restore.append(("stage3", param, strategy, strategy.gather_full(param)))
        return self

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> bool:
        from tachyon.engine.zero.fsdp import dim0_range

        for entry in self._restore:
            if entry[0] == "built":
                param = entry[1]
                rank, world, group = getattr(param, _SHARDS)
                full = param.detach()
                if self.modifier_rank is not None:
                    full = full.contiguous()
                    dist.broadcast(full, src=self.modifier_rank, group=group)
                    lo, hi = dim0_range(tuple(param.shape), rank, world)
                    setattr(param, _LOCAL, full.reshape(-1)[lo:hi].to("cpu", copy=True))
                _replace_storage(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))
            else:
                _, param, strategy, whole = entry
                strategy.scatter_full(param, whole, self.modifier_rank)
        self._restore = []
        return False


def register_forward_method(module: nn.Module, name: str) -> None:
    """Make ``module.<name>`` (a method other than ``forward`` that runs the model, as a
    ``logits`` or ``generate`` method) gather and free ``module``'s own sharded parameters the way
    its ``forward`` does at stage 3 (FSDP2's ``register_fsdp_forward_method``). Nothing to do for a
    module that stage 3 did not shard; a missing method raises ValueError."""
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{type(module).__name__} has no method {name!r} to register")
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(module, name)


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """``parameter`` is used in ``module``'s forward although another module registers it: stage 3
    keeps the unit holding it out of the sharding units (module docstring)."""
    del module
    parameter._tachyon_external = True


__all__ = ["GatheredParameters", "Init", "built_sharded", "local_values", "register_external_parameter",
           "register_forward_method", "release_local", "shard_parameters", "sharded_for"]
