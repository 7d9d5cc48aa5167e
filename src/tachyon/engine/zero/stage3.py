"""`Stage3`: the engine's ZeRO strategy at stage 3, on the FSDP2-sharded model of
`tachyon.engine.zero.fsdp` (read that module's docstring first).

The engine calls it exactly as it calls stages 0-2 (`tachyon.engine.zero.base.ZeroStrategy`):
``begin_backward`` / ``end_backward`` around each backward (FSDP2's hooks do the reduce-scatter
inside it, every micro-step, accumulating into the fp32 sharded gradient), then on the boundary
``master_grads`` (this rank's gradient shards, fp32), ``grad_norm`` (one SUM all-reduce of the
squared local norms over the data-parallel group, and over the model-parallel ranks with tensor
parallelism), the optimizer step on the masters (views of the sharded fp32 parameters: the step
writes the parameters themselves), ``after_step`` (nothing to gather: FSDP2 gathers before the
next forward) and ``zero_grad``.

The optimizer sees one fp32 tensor per trained parameter per param group -- this rank's shard,
flattened -- so Adam's moments are sharded too. ``slot.index`` is a parameter's master index
(stages 0-2 have one master per param group: `master_index`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .base import _OWNER
from .comm import DataParallelComm
from .fsdp import (
    Stage3Layout,
    Stage3Region,
    Stage3Slot,
    data_parallel_group,
    local_shard,
    shard_model,
    shard_range,
)
from .offload import OffloadPlan, host_empty, host_zeros, offloaded_bytes, pinned_bytes


_STAGE3: dict[int, weakref.ref] = {}
"""id(sharded parameter) -> the stage-3 strategy holding it (trained or frozen)."""


def stage3_of(param: torch.Tensor) -> Stage3 | None:
    """The live stage-3 strategy whose model holds ``param`` (a sharded parameter), or None."""
    ref = _STAGE3.get(id(param))
    strategy = ref() if ref is not None else None
    if strategy is None or not any(p is param for p in strategy.module.parameters()):
        return None
    return strategy


class Stage3:
    """ZeRO stage 3 over FSDP2 (module docstring).

    Args:
        model: the model (sharded in place by `tachyon.engine.zero.fsdp.shard_model`).
        param_groups: torch-optimizer-style groups over the model's (unsharded) parameters.
        model_dtype: the compute dtype (fp32, bf16 or fp16).
        comm: the data-parallel collectives; its group is the one the parameters are sharded over.
        device: the training device.
        mesh: the tachyon Mesh (tensor parallelism), or None.
        comm_dtype: the dtype gradients are reduce-scattered in (None: the model dtype).
        unit_classes: ``zero_optimization.shard_module_classes``.
        prefetch: whether each unit's forward prefetches the next unit's all-gather.
        offload: ZeRO-Offload (`tachyon.engine.zero.offload`): ``optimizer`` alone keeps the
            sharded parameters on the device in the model dtype and fp32 master copies, their
            states and an fp32 gradient accumulator on the host; ``params`` keeps the fp32 shards
            themselves (the masters) and their gradients on the host (FSDP2's CPU offload policy).
    """

    stage = 3
    partitioned_masters = True
    exposes_param_grads = False

    def __init__(self, model: nn.Module, param_groups: list[dict], *, model_dtype: torch.dtype,
                 comm: DataParallelComm, device: torch.device, mesh: Any = None,
                 comm_dtype: torch.dtype | None = None, unit_classes: list[str] | None = None,
                 prefetch: bool = True, offload: OffloadPlan | None = None) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        plan = []
        seen: set[int] = set()
        for group in param_groups:
            entries = []
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one optimizer param group")
                seen.add(id(p))
                if id(p) not in names:
                    raise ValueError("a parameter to train is not a parameter of the model; ZeRO stage 3 shards the "
                                     "model's own parameters (pass model_parameters from model.parameters())")
                entries.append((names[id(p)], p.requires_grad))
            plan.append((entries, {k: v for k, v in group.items() if k != "params"}))
        self.comm, self.world_size, self.rank = comm, comm.world_size, comm.rank
        self.model_dtype = model_dtype
        self.grad_accum_dtype = torch.float32
        self.comm_dtype = comm_dtype or model_dtype
        self.device = device
        self.module = model
        self.offload = offload or OffloadPlan()
        self.host_masters = self.offload.optimizer and not self.offload.params
        """Masters are host copies (not the shards): ZeRO-Offload of the optimizer alone."""
        self.units = shard_model(model, group=data_parallel_group(comm, mesh), device=device,
                                 model_dtype=model_dtype, reduce_dtype=self.comm_dtype,
                                 extra_classes=unit_classes, prefetch=prefetch, offload_params=self.offload.params,
                                 shard_dtype=model_dtype if self.host_masters else torch.float32)
        sharded = dict(model.named_parameters())
        regions, frozen, index = [], [], 0
        for g, (entries, options) in enumerate(plan):
            slots = []
            for name, trained in entries:
                if not trained:
                    frozen.append(sharded[name])
                    continue
                slots.append(Stage3Slot(sharded[name], name, g, index, len(slots)))
                index += 1
            regions.append(Stage3Region(g, slots, options))
        self.flat = Stage3Layout(regions, frozen)
        self.masters = [self._make_master(slot) for slot in self.flat.slots]
        self._host_grads: list[torch.Tensor | None] = [None] * len(self.masters)
        """ZeRO-Offload: each parameter's fp32 gradient shard accumulated on the host."""
        self._slot_of = {id(slot.param): slot for slot in self.flat.slots}
        self._model_parallel_sum: Callable[[torch.Tensor], object] | None = None
        self._duplicates: set[int] = set()
        for slot in self.flat.slots:
            _OWNER[id(slot.param)] = weakref.ref(self)
        for param in model.parameters():
            _STAGE3[id(param)] = weakref.ref(self)

    # ------------------------------------------------------------------ masters
    def _make_master(self, slot: Stage3Slot) -> torch.Tensor:
        local = local_shard(slot.param)
        if self.host_masters:
            master = host_empty(local.numel(), torch.float32, self.offload)
            master.copy_(local.reshape(-1))
            return master.requires_grad_(True)
        return local.view(-1).requires_grad_(True)

    def _check_alias(self, slot: Stage3Slot) -> None:
        """Re-point the master at the parameter's shard if something replaced its storage
        (``load_state_dict(assign=True)``, ``module.to()``): the optimizer state stays keyed by the master."""
        if self.host_masters:
            return
        master, local = self.masters[slot.index], local_shard(slot.param)
        if local.numel() and master.data_ptr() != local.data_ptr():
            master.data = local.view(-1)

    def master_index(self, slot: Stage3Slot) -> int:
        """Index in ``masters`` of ``slot``'s master (one per parameter at stage 3)."""
        return slot.index

    def group_masters(self, group: int) -> list[torch.Tensor]:
        """The masters of optimizer param group ``group``."""
        return [self.masters[slot.index] for slot in self.flat.regions[group].slots]

    def optimizer_param_groups(self, *, with_segments: bool = True) -> list[dict]:
        """One group per given group: its hyperparameters and this rank's fp32 master shards."""
        del with_segments  # LAMB (the one reader of segments) is refused at stage 3
        return [dict(region.options, params=self.group_masters(region.index)) for region in self.flat.regions]

    def master_pieces(self, rank: int, *, whole: bool = False) -> list[list[tuple[int, int, int]]]:
        """Per slot: ``[(lo, hi, 0)]``, the range of the flattened parameter ``rank``'s master holds
        (its FSDP2 shard; ``whole`` needs one rank)."""
        if whole and self.world_size > 1:
            raise ValueError(f"stage 3 on {self.world_size} ranks holds shards; whole=True needs one rank")
        out = []
        for slot in self.flat.slots:
            lo, hi = (0, slot.numel) if whole else shard_range(slot, rank, self.world_size)
            out.append([(lo, hi, 0)] if hi > lo else [])
        return out

    def norm_reducer(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM all-reduce of a fp32 tensor over the data-parallel ranks (the shards' owners); a host
        tensor travels through the training device."""
        if tensor.device != self.device:
            tensor.copy_(self.comm.sum_(tensor.to(self.device)))
        else:
            self.comm.sum_(tensor)
        return tensor

    def set_model_parallel(self, sum_: Callable[[torch.Tensor], object], duplicates: set[int]) -> None:
        """As `ZeroStrategy.set_model_parallel`: the norm also sums over the model-parallel ranks,
        leaving out the parameters another rank counts."""
        self._model_parallel_sum, self._duplicates = sum_, set(duplicates)

    def set_local_gradients(self, predicate: Callable[[], bool]) -> None:
        del predicate
        raise RuntimeError("ZeRO stage 3 reduce-scatters every gradient inside the backward; an optimizer that "
                           "averages gradients itself (1-bit Adam / LAMB) cannot run on it: use stage 0")

    # ------------------------------------------------------------------ backward
    def begin_backward(self, boundary: bool) -> None:
        """FSDP2's hooks reduce-scatter during every backward (DeepSpeed's stage 3 does too)."""
        del boundary

    @torch.no_grad()
    def end_backward(self) -> None:
        """FSDP2 waited for its reduce-scatters at the end of the backward. With ZeRO-Offload of the
        optimizer alone, each gradient shard is now added into its fp32 host accumulator and freed
        on the device."""
        if not self.host_masters:
            return
        for slot in self.flat.slots:
            grad = slot.param.grad
            if grad is None:
                continue
            local = local_shard(grad).reshape(-1)
            acc = self._host_grads[slot.index]
            if acc is None:
                acc = self._host_grads[slot.index] = host_zeros(local.numel(), torch.float32, self.offload)
            acc.add_(local.to(acc.device, dtype=torch.float32, non_blocking=self.offload.pin))
            slot.param.grad = None
        if self.offload.pin and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def _reduces(self, boundary: bool) -> bool:
        del boundary
        return True

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        raise RuntimeError("ZeRO stage 3 reduces inside every backward; deferring the reduction (a pipeline "
                           "schedule, engine.no_sync) is not available at stage 3")
        yield  # pragma: no cover

    def reduce_param_grads(self) -> None:
        raise RuntimeError("ZeRO stage 3 reduce-scatters the gradients inside every backward (FSDP2's hooks); "
                           "there is nothing left to reduce by hand")

    def release(self) -> None:
        """Nothing to remove: FSDP2's hooks belong to the sharded model."""

    # ------------------------------------------------------------------ step
    def master_grads(self) -> list[torch.Tensor]:
        """``master.grad`` for every parameter: the flat view of its fp32 gradient shard (zeros
        for a parameter no rank got a gradient for). Returns them in ``masters`` order."""
        grads = []
        for slot, master in zip(self.flat.slots, self.masters):
            self._check_alias(slot)
            grad = self._host_grads[slot.index] if self.host_masters else slot.param.grad
            if grad is None:
                master.grad = torch.zeros_like(master)
            else:
                master.grad = grad if self.host_masters else local_shard(grad).reshape(-1)
            grads.append(master.grad)
        return grads

    def slots_with_grad(self) -> list[bool]:
        """Per trained parameter (``flat.slots`` order): whether a gradient shard exists in this
        accumulation window. FSDP2 reduce-scatters only the parameters that got a gradient in a
        backward, so a parameter of a layer no micro-batch ran (progressive layer drop) has
        none; `tachyon.engine.pld.UnusedParameterGuard` then keeps it as at stages 0-2. Local."""
        if self.host_masters:  # end_backward moved every gradient shard into a host accumulator
            return [self._host_grads[slot.index] is not None for slot in self.flat.slots]
        return [slot.param.grad is not None for slot in self.flat.slots]

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the averaged gradient (0-dim fp32), every parameter counted once."""
        squares = [torch.linalg.vector_norm(g, dtype=torch.float32).square()
                   for slot, g in zip(self.flat.slots, grads) if id(slot.param) not in self._duplicates and g.numel()]
        total = torch.stack(squares).sum().reshape(1) if squares else torch.zeros(1, device=self.device)
        total = total.to(self.device)  # host shards (offload): reduced on the training device
        self.norm_reducer(total)
        if self._model_parallel_sum is not None:
            self._model_parallel_sum(total)
        return total.sqrt().reshape(())

    @torch.no_grad()
    def after_step(self) -> None:
        """Nothing when the masters are the sharded parameters (FSDP2 gathers them before the next
        forward); host masters (ZeRO-Offload) are copied into the device shards."""
        if not self.host_masters:
            return
        for slot, master in zip(self.flat.slots, self.masters):
            local = local_shard(slot.param)
            local.copy_(master.view_as(local), non_blocking=self.offload.pin)

    def zero_grad(self) -> None:
        for slot, master in zip(self.flat.slots, self.masters):
            slot.param.grad = None
            master.grad = None
        self._host_grads = [None] * len(self.masters)

    # ------------------------------------------------------------------ whole parameters
    def _owners(self, param: torch.Tensor) -> list[tuple[nn.Module, str]]:
        return [(m, n) for m in self.module.modules() for n, p in m._parameters.items() if p is param]

    def gather_full(self, param: nn.Parameter) -> nn.Parameter:
        """``param`` whole (fp32), registered in its place on its modules until `scatter_full`
        (`tachyon.zero.GatheredParameters`). Collective over the data-parallel ranks."""
        whole = nn.Parameter(param.full_tensor().detach().float().clone(), requires_grad=param.requires_grad)
        for module, name in self._owners(param):
            module._parameters[name] = whole
        return whole

    @torch.no_grad()
    def scatter_full(self, param: nn.Parameter, whole: nn.Parameter, modifier_rank: int | None) -> None:
        """Put ``param`` back on its modules; with ``modifier_rank``, that rank's ``whole`` values
        are broadcast and every rank keeps its shard of them (and of its fp32 master)."""
        from .fsdp import dim0_range

        for module, name in self._owners(whole):
            module._parameters[name] = param
        if modifier_rank is None:
            return
        values = whole.detach().to(self.device).contiguous()
        if self.comm.enabled:
            torch.distributed.broadcast(values, src=modifier_rank, group=self.comm.group)
        lo, hi = dim0_range(tuple(param.shape), self.rank, self.world_size)
        local = local_shard(param)
        local.copy_(values.reshape(-1)[lo:hi].view(local.shape))
        slot = self._slot_of.get(id(param))
        if slot is not None and self.host_masters:
            self.masters[slot.index].copy_(values.reshape(-1)[lo:hi])

    def reshard(self) -> None:
        """Free every parameter FSDP2 still holds gathered, so the module's parameters are the
        sharded ones again: a forward with no backward (evaluation under no_grad, a method
        registered with `tachyon.zero.register_forward_method`) leaves the root's gathered.
        Local (no collective)."""
        for unit in self.units:
            unit.reshard()

    # ------------------------------------------------------------------ memory
    def _gathered(self) -> list[torch.Tensor]:
        """FSDP2's unsharded parameters alive now (during forward / backward)."""
        out = []
        for unit in self.units:
            state = unit._get_fsdp_state() if hasattr(unit, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                tensor = getattr(fsdp_param, "_unsharded_param", None)
                if tensor is not None:
                    out.append(tensor)
        return out

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes this rank holds now, from the tensors allocated (each storage once): parameters
        (the fp32 shards, padding included, and frozen shards), gradients (the gradient shards),
        master_weights (0: the shards are the masters), optimizer_states, their sum model_states;
        gathered (unsharded parameters alive now, only inside forward / backward)."""
        seen: set[int] = set()

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = nbytes([local_shard(s.param) for s in self.flat.slots] + [local_shard(p) for p in self.flat.frozen])
        masters = nbytes(self.masters)
        grads = nbytes([local_shard(s.param.grad) for s in self.flat.slots if s.param.grad is not None]
                       + [m.grad for m in self.masters if m.grad is not None]
                       + [g for g in self._host_grads if g is not None])
        states = 0
        if optimizer is not None:
            states = nbytes(v for m in self.masters for v in optimizer.state.get(m, {}).values() if torch.is_tensor(v))
        out = {"parameters": params, "gradients": grads, "master_weights": masters, "optimizer_states": states}
        out["model_states"] = sum(out.values())
        out["buckets"] = 0
        out["gathered"] = nbytes(self._gathered())
        if self.offload.any:  # bytes per placement: the offloaded states, and how many of them are pinned
            host = [*self.masters, *self._host_grads, *(m.grad for m in self.masters)]
            if self.offload.params:  # FSDP2's CPU offload: the parameter and gradient shards too
                host += [local_shard(s.param) for s in self.flat.slots]
                host += [local_shard(s.param.grad) for s in self.flat.slots if s.param.grad is not None]
            if optimizer is not None:
                host += [v for m in self.masters for v in optimizer.state.get(m, {}).values() if torch.is_tensor(v)]
            out["offloaded"] = offloaded_bytes(host)
            out["pinned"] = pinned_bytes(host)
        return out


def check_built_sharded(model: nn.Module, config: Any) -> None:
    """A model built under `tachyon.zero.Init` holds only this rank's shards: stage 3 alone can train it."""
    from tachyon.zero import built_sharded

    if config.zero_stage != 3 and any(built_sharded(p) for p in model.parameters()):
        raise ValueError(f"the model was built under tachyon.zero.Init (each rank holds only its shard of every "
                         f"parameter), which needs zero_optimization.stage 3; the config says stage {config.zero_stage}")


def check_stage3_inputs(model: nn.Module, config: Any, optimizer: Any) -> None:
    """What stage 3 refuses that the config alone does not show, before anything is built."""
    from tachyon.engine.optim.lamb import Lamb
    from tachyon.parallel.pipeline import PipelineModule

    from .fsdp import check_unit_classes

    if isinstance(model, PipelineModule):
        raise ValueError("ZeRO stage 3 with a PipelineModule: stage 3 reduce-scatters gradients inside every "
                         "micro-batch's backward, which a pipeline schedule interleaves (DeepSpeed refuses it too); "
                         "use zero_optimization.stage 0 or 1 with pipeline parallelism")
    if optimizer is not None and hasattr(optimizer, "in_compression_stage"):
        raise ValueError(f"ZeRO stage 3 with a 1-bit optimizer ({type(optimizer).__name__}): it averages compressed "
                         "gradients itself, and stage 3 reduce-scatters them inside the backward (DeepSpeed does not "
                         "combine them either); use stage 0")
    if isinstance(optimizer, Lamb):
        raise ValueError("ZeRO stage 3 with Lamb: LAMB's trust ratio needs each whole parameter's norm and stage 3 "
                         "steps per-parameter shards; use stage 1 or 2 with Lamb")
    check_unit_classes(model, config.zero_optimization.shard_module_classes)


def build_stage3(model: nn.Module, param_groups: list[dict], *, config: Any, model_dtype: torch.dtype,
                 comm: DataParallelComm, device: torch.device, mesh: Any = None) -> Stage3:
    """The stage-3 strategy for a `tachyon.config.TachyonConfig` (the engine's entry point)."""
    from tachyon.engine.precision import DTYPES

    zero = config.zero_optimization
    comm_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else None
    from .offload import plan_of

    return Stage3(model, param_groups, model_dtype=model_dtype, comm=comm, device=device, mesh=mesh,
                  comm_dtype=comm_dtype, unit_classes=zero.shard_module_classes,
                  prefetch=zero.stage3_prefetch_bucket_size > 0, offload=plan_of(config))


__all__ = ["Stage3", "build_stage3", "check_stage3_inputs", "shard_range", "stage3_of"]
