"""ZeRO stage 3 on torch's FSDP2 (``fully_shard``): parameters, gradients and optimizer states
sharded over the data-parallel ranks.

What `shard_model` does to the model (in place, before any training state exists):

1. Every floating buffer is cast to the model dtype (as stages 0-2 cast the whole model), and
   every parameter becomes fp32 -- rounded through the model dtype first, so stage 3 starts
   from exactly the weights stages 0-2 start from. These fp32 parameters are the master
   weights: FSDP2 keeps them sharded and gathers them in the model dtype for compute.
2. `fully_shard` is applied bottom-up: once to every sharding unit (`find_units`: tachyon's
   ``TransformerLayer`` / ``TransformerKernelLayer``, the classes an HF model lists in
   ``_no_split_modules``, the classes named in ``zero_optimization.shard_module_classes``, and
   embeddings whose weight no other module uses), then to the root, which takes every parameter
   left over. Each unit's parameters are gathered in one all-gather before its forward, freed
   after it, gathered again for its backward, and its gradients reduce-scattered in one
   collective: the ZeRO paper's 3 Psi per step (the root's parameters stay gathered from its
   forward to its backward, FSDP2's choice for the root: 2 of them).
3. bf16 / fp16 become FSDP2's `MixedPrecisionPolicy`: ``param_dtype`` the model dtype,
   ``reduce_dtype`` the config's ``communication_data_type`` (default: the model dtype, as
   DeepSpeed reduces), gradients accumulated into the fp32 sharded gradient across micro-steps.

`Stage3` is the strategy object the Engine calls, with the stages 0-2 interface
(`tachyon.engine.zero.base.ZeroStrategy`): one fp32 master per trained parameter -- a flat view
of this rank's shard of it, sharing its storage, so ``optimizer.step()`` updates the sharded
parameter in place -- with its gradient the flat view of FSDP2's sharded gradient; the global
norm over the shards (one SUM all-reduce); `master_pieces` for checkpoints (FSDP2 shards dim 0,
so a rank's shard is one contiguous range of the flattened parameter: rows ``[r*c, (r+1)*c)``,
``c = ceil(rows / N)``, as ``torch.chunk`` splits).

Memory per rank (Psi trained parameters, N ranks, Adam): fp32 parameter shards 4 Psi/N (they are
the masters), fp32 gradient shards 4 Psi/N, Adam's moments 8 Psi/N: the ZeRO paper's 16 Psi/N,
plus FSDP2's padding (each shard padded to ``c`` rows) and, during forward and backward, the
gathered parameters of the running (and prefetched) unit in the model dtype and the
reduce-scatter buffers (`memory_breakdown` reports them as ``gathered``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import DataParallelComm

logger = logging.getLogger("tachyon.engine")


def _fsdp():
    """(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule) from torch's FSDP2."""
    try:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule


# ---------------------------------------------------------------------- units
def _known_unit_classes() -> tuple[type, ...]:
    from tachyon.nn import TransformerLayer
    from tachyon.nn.transformer_kernel import TransformerKernelLayer

    return (TransformerLayer, TransformerKernelLayer)


def _hf_unit_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if isinstance(listed, (list, tuple, set)):
            names.update(str(n) for n in listed)
    return names


def _shared_outside(model: nn.Module, module: nn.Module) -> bool:
    """Whether a parameter of ``module`` is also registered on a module outside it (a tied weight)."""
    inside = {id(m) for m in module.modules()}
    mine = {id(p) for p in module.parameters()}
    for owner in model.modules():
        if id(owner) in inside:
            continue
        if any(id(p) in mine for p in owner.parameters(recurse=False)):
            return True
    return False


def find_units(model: nn.Module, extra_classes: list[str] | None = None) -> list[nn.Module]:
    """The modules stage 3 shards as one unit each, children before parents (module docstring).
    A candidate whose parameter another module outside it also uses (a tied weight, or one given
    to `tachyon.zero.register_external_parameter`) is not a unit: its parameters go to the root."""
    known = _known_unit_classes()
    names = _hf_unit_names(model) | set(extra_classes or ())
    units = []
    for module in model.modules():
        if module is model:
            continue
        candidate = isinstance(module, (*known, nn.Embedding)) or type(module).__name__ in names
        external = any(getattr(p, "_tachyon_external", False) for p in module.parameters())
        if candidate and not external and not _shared_outside(model, module):
            units.append(module)
    order = {id(m): i for i, m in enumerate(model.modules())}
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: (-depth[id(m)], order[id(m)]))


def check_unit_classes(model: nn.Module, extra_classes: list[str] | None) -> None:
    """ValueError naming a class of ``zero_optimization.shard_module_classes`` that is not in the model."""
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in extra_classes or () if name not in present]
    if missing:
        raise ValueError(
            f"zero_optimization.shard_module_classes names {missing}, which no module of the model is; the model's "
            f"classes are {sorted(present)[:20]}"
        )


# ---------------------------------------------------------------------- sharding
def data_parallel_group(comm: DataParallelComm, mesh: Any) -> Any:
    """The process group stage 3 shards over: the engine's data-parallel group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "ZeRO stage 3 shards the parameters over a torch.distributed process group and none is initialized; "
            "launch with torchrun (or `tachyon launch`), or call tachyon.init_distributed() first (one process "
            "works too)"
        )
    if comm.group is not None:
        return comm.group
    if mesh is not None:
        return mesh.group("dp")
    return dist.group.WORLD


def _device_mesh(group: Any, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


@torch.no_grad()
def _prepare(model: nn.Module, model_dtype: torch.dtype, device: torch.device, shard_dtype: torch.dtype) -> None:
    """Buffers in the model dtype, parameters in ``shard_dtype`` (fp32: rounded through the model
    dtype first), on ``device``; parameters on the meta device (`tachyon.zero.Init`) stay there."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                dtype = model_dtype if buf.is_floating_point() else buf.dtype
                module._buffers[name] = buf.to(device=device, dtype=dtype)
    for param in model.parameters():
        if param.is_meta:
            param.data = param.data.to(shard_dtype) if param.is_floating_point() else param.data
            continue
        value = param.data.to(device=device)
        if model_dtype != torch.float32 and value.is_floating_point():
            value = value.to(model_dtype)
        param.data = value.to(shard_dtype) if value.is_floating_point() else value


def shard_model(model: nn.Module, *, group: Any, device: torch.device, model_dtype: torch.dtype,
                reduce_dtype: torch.dtype | None, extra_classes: list[str] | None = None,
                prefetch: bool = True, offload_params: bool = False,
                shard_dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """Apply FSDP2 to ``model`` in place (module docstring); returns the sharding units (root last).
    ``offload_params``: FSDP2's CPU offload policy (sharded parameters and gradients on the host).
    ``shard_dtype``: the sharded parameters' dtype (fp32: they are the masters; the model dtype
    when the masters are host copies, ZeRO-Offload of the optimizer)."""
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, _ = _fsdp()
    built = _built_shards(model, group)
    _prepare(model, model_dtype, torch.device("cpu") if offload_params else device, shard_dtype)
    tp_specs = {name: p._tp_shard for name, p in model.named_parameters() if getattr(p, "_tp_shard", None) is not None}
    reduce_dtype = reduce_dtype or model_dtype
    param_dtype = model_dtype if model_dtype != shard_dtype else None
    # FSDP2 reads reduce_dtype None as "param_dtype": name it whenever it differs from that
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype if reduce_dtype != (param_dtype or shard_dtype) else None,
    )
    kwargs: dict[str, Any] = {"mesh": _device_mesh(group, device), "mp_policy": policy}
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    units = find_units(model, extra_classes)
    for unit in units:
        fully_shard(unit, reshard_after_forward=True, **kwargs)
    fully_shard(model, **kwargs)
    if built:
        _materialize(model, built, torch.device("cpu") if offload_params else device, model_dtype)
    if prefetch and len(units) > 1:  # each unit's forward also starts the next one's all-gather
        ordered = [u for u in model.modules() if any(u is v for v in units)]
        for unit, following in zip(ordered, ordered[1:]):
            unit.set_modules_to_forward_prefetch([following])
    for name, p in model.named_parameters():  # fully_shard made new parameter objects
        if name in tp_specs:
            p._tp_shard = tp_specs[name]
    return [*units, model]


def _built_shards(model: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    """name -> the meta parameter holding the shard `tachyon.zero.Init` kept, for a model built
    under it ({} otherwise). Refused before anything changes: parameters on the meta device with
    no kept shard, and shards kept for another rank or number of ranks than ``group``'s."""
    from tachyon.zero import built_sharded, sharded_for

    import torch.distributed as dist

    here = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    built, bare = {}, []
    for name, param in model.named_parameters():
        if built_sharded(param):
            if sharded_for(param) != here:
                raise ValueError(f"{name} was built under tachyon.zero.Init as rank {sharded_for(param)[0]} of "
                                 f"{sharded_for(param)[1]} and stage 3 trains it as rank {here[0]} of {here[1]}: build "
                                 "the model under Init with the data-parallel group the engine trains over")
            built[name] = param
        elif param.is_meta:
            bare.append(name)
    if bare:
        raise ValueError(f"parameters {bare[:5]} are on the meta device with no values; build the model under "
                         "tachyon.zero.Init (which keeps each rank's shard) or on a real device")
    return built


@torch.no_grad()
def _materialize(model: nn.Module, built: dict[str, torch.Tensor], device: torch.device, model_dtype: torch.dtype) -> None:
    """Allocate this rank's shards of a model built under `tachyon.zero.Init` and copy the kept
    values in (rounded through the model dtype, as `_prepare` does); buffers keep their values.
    Each kept shard is released once copied."""
    from tachyon.zero import release_local

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    for name, param in model.named_parameters():
        local = local_shard(param)
        values = release_local(built.pop(name))
        if values.numel() != local.numel():  # the same dim-0 split as FSDP2's: cannot differ
            raise RuntimeError(f"{name}: tachyon.zero.Init kept {values.numel()} elements for this rank and FSDP2 "
                               f"gives it {local.numel()}")
        if model_dtype != torch.float32 and values.is_floating_point():
            values = values.to(model_dtype)
        local.copy_(values.view(local.shape))


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter or gradient: a plain tensor sharing its storage."""
    local = getattr(param, "_local_tensor", None)
    if local is None:
        local = param.to_local()
    return local.detach()


# ---------------------------------------------------------------------- layout
class Stage3Slot:
    """One trained parameter: the module's sharded parameter and its optimizer param group."""

    __slots__ = ("group", "index", "index_in_group", "name", "numel", "param", "row_numel", "rows")

    def __init__(self, param: nn.Parameter, name: str, group: int, index: int, index_in_group: int):
        self.param, self.name, self.group, self.index, self.index_in_group = param, name, group, index, index_in_group
        shape = tuple(param.shape)
        self.numel = math.prod(shape)
        self.rows = shape[0] if shape else 1
        self.row_numel = math.prod(shape[1:]) if shape else 1


class Stage3Region:
    """One optimizer param group: its slots and hyperparameters."""

    def __init__(self, index: int, slots: list[Stage3Slot], options: dict[str, Any]):
        self.index, self.slots, self.options = index, slots, options


class Stage3Layout:
    """What the engine, checkpoints and the step guard read of a strategy's ``flat`` at stage 3."""

    def __init__(self, regions: list[Stage3Region], frozen: list[nn.Parameter]):
        self.regions = regions
        self.slots = [slot for region in regions for slot in region.slots]
        self.frozen = frozen

    @property
    def num_params(self) -> int:
        return sum(slot.numel for slot in self.slots)

    numel = num_params


def dim0_range(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of a tensor of ``shape``, flattened, that ``rank`` holds when FSDP2 shards its dim 0
    over ``world_size`` ranks (``torch.chunk``'s split: ``ceil(rows / N)`` rows each, the last
    ranks possibly fewer or none)."""
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    chunk = -(-rows // world_size)
    first = min(rank * chunk, rows)
    last = min(first + chunk, rows)
    return first * row_numel, last * row_numel


def shard_range(slot: Stage3Slot, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of ``slot``'s flattened parameter that ``rank`` holds (`dim0_range`)."""
    return dim0_range(tuple(slot.param.shape), rank, world_size)


__all__ = ["Stage3Layout", "Stage3Region", "Stage3Slot", "check_unit_classes", "data_parallel_group", "find_units",
           "dim0_range", "local_shard", "shard_model", "shard_range"]
