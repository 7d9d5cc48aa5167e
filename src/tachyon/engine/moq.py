"""MoQ quantize-aware training inside the engine: the ``quantize_training`` config section.

    engine, *_ = tachyon.initialize(model=model, config={..., "quantize_training": {"enabled": true, ...}})
    loss = engine(batch); engine.backward(loss); engine.step()     # weights snapped after each step
    engine.quantizer.bits                                           # the current grid
    tachyon.init_inference(engine.module, quant=engine.quantizer.inference_quant(), dtype=torch.float32)

The schedule and the grid are the standalone ``MoQ``'s (`tachyon.inference.moq.MoQSchedule`):
after every optimizer step that was taken (not an fp16 overflow; on the accumulation boundary
only) the schedule counts a step and, once ``schedule_offset`` has passed, every trained
GEMM weight the model holds (``nn.Linear``, HF ``Conv1D``, tachyon.nn's fused modules;
`tachyon.inference.moq.quantizable_weights`) is replaced by the snap of its
full-precision value. Forward and backward see the snapped weights; the optimizer keeps updating
the full-precision values (straight-through). Where those live depends on the ZeRO strategy
(`tachyon.engine.zero`):

- the master is a separate fp32 tensor (bf16 / fp16, or fp32 masters the flat buffer cannot
  alias): the optimizer steps it and it is never overwritten; the snap is written into the
  model's copy only. At stages 1/2 a rank holds one partition of each master, and a scale needs
  whole rows, so the fp32 partitions of the quantized weights' regions are all-gathered into a
  temporary buffer first (one fp32 all-gather of those regions per step);
- the master aliases the model buffer (fp32, stage 0, or stages 1/2 with one contiguous
  partition): the model parameter is the optimizer's, so a full-precision copy of each quantized
  weight is kept (4 bytes per element, as ``MoQ.step`` does) and written back into the buffer
  before ``optimizer.step()``.

Checkpoints (`tachyon.engine.checkpoint`) write the full-precision values as the masters (never
the snapped ones) and the schedule state in meta.json; loading restores both and snaps again, so
a resumed run continues bit-identically, and a checkpoint loads into any engine (with or without
MoQ, another ZeRO stage) as ordinary fp32 masters.
"""

from __future__ import annotations

from typing import Any

import torch

from tachyon.config import ConfigError, MoQConfig, TachyonConfig
from tachyon.inference.moq import MoQSchedule, quantizable_weights

from .zero import ZeroStrategy
from .zero.layout import ParamSlot


def check_moq_inputs(model: torch.nn.Module, config: TachyonConfig, tp_size: int = 1) -> None:
    """With ``quantize_training`` enabled: refuse a model without trainable linear weights, and
    tensor parallelism (row-parallel shards would each scale part of a row), before any state
    is created."""
    if not config.quantize_training.enabled:
        return
    if tp_size > 1:
        raise ConfigError(
            f"`quantize_training.enabled: true` with a tensor-parallel size of {tp_size}: MoQ scales each output "
            "channel by its largest weight, and a row-parallel shard holds only part of each row; train MoQ "
            "without tensor parallelism"
        )
    if not any(p.requires_grad for _, p, _ in quantizable_weights(model)):
        raise ConfigError(
            f"`quantize_training.enabled: true`, but {type(model).__name__} has no trainable GEMM weight to quantize "
            "(nn.Linear, HF Conv1D, tachyon.nn's Linear / LayerNormLinear / LayerNormMLP / TransformerKernelLayer; "
            "embeddings, norms and a tied LM head stay float); disable quantize_training"
        )


class EngineMoQ:
    """The engine's MoQ (``engine.quantizer``): the schedule over the trained linear weights of
    ``model``, kept in step with ``zero``'s masters (see the module docstring).

    Attributes: ``schedule`` (`MoQSchedule`), ``weights`` ([(name, param, transposed)]).
    """

    def __init__(self, model: torch.nn.Module, config: TachyonConfig, zero: ZeroStrategy) -> None:
        self.schedule = MoQSchedule(config.quantize_training.moq_config())
        self.zero = zero
        slots = {id(slot.param): slot for slot in zero.flat.slots}
        self._targets: list[tuple[str, ParamSlot, bool]] = [
            (name, slots[id(p)], transposed) for name, p, transposed in quantizable_weights(model) if id(p) in slots
        ]
        self.weights = [(name, slot.param, transposed) for name, slot, transposed in self._targets]
        alias = zero._master_alias
        self._copies: dict[int, torch.Tensor] = {
            i: slot.param.detach().reshape(-1).float().clone()
            for i, (_, slot, _) in enumerate(self._targets) if alias[slot.group]
        }
        """Target index -> full-precision copy (flat fp32) where the master aliases the model buffer."""
        self._snapped = False

    # ------------------------------------------------------------------ schedule
    @property
    def config(self) -> MoQConfig:
        return self.schedule.config

    @property
    def bits(self) -> int:
        """The grid the model's linear weights are on (after the offset)."""
        return self.schedule.bits

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps do not count)."""
        return self.schedule.steps

    def inference_quant(self) -> dict[str, Any]:
        """The ``quant=`` for `tachyon.init_inference` that rebuilds this grid (bits <= 8)."""
        return self.schedule.inference_quant()

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)

    # ------------------------------------------------------------------ around optimizer.step()
    @torch.no_grad()
    def before_step(self) -> None:
        """Put the full-precision values back where the optimizer's parameter is the model's."""
        if not self._snapped:
            return
        for i, copy in self._copies.items():
            self._targets[i][1].param.data.view(-1).copy_(copy)
        self._snapped = False

    @torch.no_grad()
    def after_step(self) -> None:
        """After ``optimizer.step()`` and the masters' write-back / all-gather: count the step
        and snap the model's linear weights from their full-precision values."""
        self.schedule.advance()
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        """Refresh the full-precision copies from the model buffer (which holds the masters
        unsnapped now: after a step or a checkpoint load) and, once the schedule quantizes,
        write the snapped weights into the model."""
        for i, copy in self._copies.items():
            copy.copy_(self._targets[i][1].param.data.view(-1))
        if not self.schedule.quantizing:
            return
        for (_, slot, transposed), full in zip(self._targets, self._full_precision()):
            param = slot.param
            param.data.copy_(self.schedule.snap(full.view(param.shape), transposed))
        self._snapped = True

    def _full_precision(self) -> list[torch.Tensor]:
        """Per target: its full-precision values (flat fp32 [numel])."""
        zero = self.zero
        gathered = self._gather_partitions()
        out = []
        for i, (_, slot, _) in enumerate(self._targets):
            if i in self._copies:
                out.append(self._copies[i])
            elif gathered is not None and slot.group in gathered:
                out.append(gathered[slot.group].narrow(0, slot.offset, slot.numel))
            else:
                start = zero.flat.regions[slot.group].start
                out.append(zero.masters[slot.group].detach().narrow(0, slot.offset - start, slot.numel))
        return out

    def _gather_partitions(self) -> dict[int, torch.Tensor] | None:
        """Regions whose fp32 master is partitioned (and not the model buffer) -> a flat fp32
        buffer holding every rank's partition (flat-buffer offsets), or None when there are none."""
        zero = self.zero
        if not zero.partitioned_masters:
            return None
        groups = {slot.group for _, slot, _ in self._targets if not zero._master_alias[slot.group]}
        if not groups:
            return None
        full = torch.zeros(zero.flat.numel, dtype=torch.float32, device=zero.flat.buffer.device)
        for g in groups:
            zero.shards.partition_to_flat(zero.masters[g].detach(), full, zero.flat.regions[g], zero.rank)
        if zero.world_size > 1:
            pending = []
            for bucket in zero.buckets.buckets:
                if bucket.region.index in groups:
                    out = full.narrow(0, bucket.begin, bucket.numel)
                    c = bucket.chunk(zero.world_size)
                    pending.append(zero.comm.all_gather_into(out, out.narrow(0, zero.rank * c, c), async_op=True))
            for p in pending:
                p.wait()
        return {g: full for g in groups}

    def memory_bytes(self) -> int:
        """Bytes of the full-precision copies this rank keeps (none where the masters are separate)."""
        return sum(copy.numel() * copy.element_size() for copy in self._copies.values())

    # ------------------------------------------------------------------ checkpoints
    def after_load(self) -> None:
        """After a checkpoint's masters were written into the engine (the model buffer holds
        them unsnapped) and the schedule state restored: snap again."""
        self._snapped = False
        self.requantize()

    @torch.no_grad()
    def checkpoint_masters(self) -> list[torch.Tensor]:
        """Per region: the master with the full-precision values in place of snapped ones (a
        temporary copy only where the master aliases the snapped model buffer)."""
        zero = self.zero
        out = list(zero.masters)
        if not self._snapped:
            return out
        for g, (region, master) in enumerate(zip(zero.flat.regions, zero.masters)):
            mine = [i for i in self._copies if self._targets[i][1].group == g]
            if not mine:
                continue
            begin = zero._master_start(region)
            end = begin + master.numel()
            patched = master.detach().clone()
            for i in mine:
                slot = self._targets[i][1]
                lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
                if lo < hi:
                    patched.narrow(0, lo - begin, hi - lo).copy_(self._copies[i].narrow(0, lo - slot.offset, hi - lo))
            out[g] = patched
        return out


__all__ = ["EngineMoQ", "check_moq_inputs"]
