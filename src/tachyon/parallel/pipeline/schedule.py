"""``PipelineSchedule``: one batch of micro-batches through a PipelineModule, on torch.distributed.pipelining.

    schedule = PipelineSchedule(net, micro_batches=8, schedule="1F1B")
    loss = schedule.train_batch(data_iter)     # forward + backward of 8 micro-batches; gradients in .grad
    optimizer.step()                            # (the engine: data-parallel reduction, ZeRO, clipping, step)
    loss = schedule.eval_batch(eval_iter)

Schedules (torch.distributed.pipelining's implementations, names case-insensitive):

    "GPipe"              all forwards, then all backwards: holds every micro-batch's activations
    "1F1B"               after a warm-up of (stages - stage) forwards, one forward and one
                         backward alternate: stage s holds at most stages - s micro-batches
    "interleaved_1F1B"   1F1B over stages_per_rank > 1 virtual stages per rank (Narayanan et al.
                         2021): the bubble shrinks by that factor, at the cost of more P2P messages

``train_batch(data_iter)`` is DeepSpeed's: it pulls ``micro_batches`` items (inputs, labels) from
``data_iter`` on the ranks holding the first stage (inputs) or the last stage (labels); the other
ranks may pass None. ``inputs`` is a tensor or a tuple of tensors with the micro-batch on dim 0,
the same size every micro-batch. The gradients of the batch are summed into ``.grad`` (each
micro-batch's loss divided by ``micro_batches``, so they are the gradients of the mean loss,
as one step over the whole batch gives); tied weights' gradients are summed over their stages.
Zeroing the gradients before, reducing them over the data-parallel axis and stepping after are
the caller's (the engine's). Returns the batch's mean loss, an fp32 scalar, on every pipeline
rank (broadcast from the last stage, as DeepSpeed does).

P2P traffic per micro-batch and stage boundary (torch.distributed.pipelining sends each stage's
outputs as they are): one activation forward and its gradient backward, micro_batch x seq x
hidden x dtype bytes each for a transformer. The first batch also exchanges shape metadata
(a few hundred bytes) while the stages set up their buffers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tachyon.parallel.pipeline.module import PipelineModule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b", "interleaved1f1b": "interleaved_1f1b",
            "interleaved": "interleaved_1f1b"}


def check_schedule(name: object, stages_per_rank: int, micro_batches: object, num_stages: int) -> str:
    """The canonical schedule name; ValueError naming the problem (unknown name, virtual stages that
    do not fit the schedule, too few micro-batches)."""
    key = _ALIASES.get(str(name).lower().replace("-", "_")) if isinstance(name, str) else None
    if key is None:
        raise ValueError(f"PipelineSchedule: schedule={name!r}; allowed: 'GPipe', '1F1B', 'interleaved_1F1B'")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"PipelineSchedule: micro_batches must be an int >= 1; got {micro_batches!r}")
    if key == "interleaved_1f1b" and stages_per_rank < 2:
        raise ValueError("PipelineSchedule: interleaved_1F1B needs a PipelineModule with stages_per_rank >= 2 "
                         f"(virtual stages per rank); this one has {stages_per_rank}")
    if key != "interleaved_1f1b" and stages_per_rank != 1:
        raise ValueError(f"PipelineSchedule: {name!r} runs one stage per rank; the PipelineModule has stages_per_rank="
                         f"{stages_per_rank} (use schedule='interleaved_1F1B')")
    if key != "gpipe" and micro_batches < num_stages:
        raise ValueError(f"PipelineSchedule: {name!r} needs micro_batches >= pipeline stages ({num_stages}); got "
                         f"{micro_batches} (more micro-batches also shrink the pipeline bubble)")
    if key == "interleaved_1f1b":
        rounds = max(1, micro_batches // num_stages)
        if micro_batches % rounds:
            raise ValueError(f"PipelineSchedule: interleaved_1F1B needs micro_batches divisible by "
                             f"max(1, micro_batches // pp) = {rounds}; got {micro_batches} with pp={num_stages}")
    return key


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cat(items: list[Any], what: str) -> Any:
    first = items[0]
    if isinstance(first, Tensor):
        sizes = {t.shape[0] for t in items}
        if len(sizes) != 1:
            raise ValueError(f"PipelineSchedule: the micro-batches' {what} have different sizes {sorted(sizes)} on dim 0")
        return torch.cat(items, dim=0)
    if isinstance(first, (tuple, list)):
        return tuple(_cat([item[i] for item in items], f"{what}[{i}]") for i in range(len(first)))
    if isinstance(first, (bool, int, float)) and all(type(item) is type(first) for item in items):
        return torch.tensor(items)  # a number per micro-batch (DeepSpeed passes them): loss_fn gets a 1-element tensor
    raise ValueError(f"PipelineSchedule: {what} must be tensors, tuples of tensors or numbers; got {type(first).__name__}")


class PipelineSchedule:
    """Runs a PipelineModule's local stages through a torch.distributed.pipelining schedule.

    module: the PipelineModule (with a mesh when it has more than one stage). micro_batches: per
    batch (DeepSpeed: gradient_accumulation_steps). schedule: "GPipe", "1F1B" or
    "interleaved_1F1B". device: where the stages run (default: the current CUDA device under
    NCCL, else CPU). loss_scale: a callable returning the current loss scale (fp16 loss
    scaling: the backward runs inside the schedule, so the scale is applied to ``loss_fn``'s
    value there; the losses returned are unscaled). ValueError for a schedule that does not fit
    the module (module docstring).
    """

    def __init__(self, module: PipelineModule, micro_batches: int, schedule: str = "1F1B", *,
                 device: torch.device | str | None = None, loss_scale: Callable[[], float] | None = None) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineSchedule: module must be a PipelineModule; got {type(module).__name__}")
        if loss_scale is not None and not callable(loss_scale):
            raise ValueError(f"PipelineSchedule: loss_scale must be a callable returning the scale; got {loss_scale!r}")
        self.name = check_schedule(schedule, module.stages_per_rank, micro_batches, module.num_stages)
        self.module, self.micro_batches, self.loss_scale = module, micro_batches, loss_scale
        self.device = torch.device(device) if device is not None else _device()
        self._factor = 1.0  # what loss_fn's value is multiplied by in the batch in flight
        self._schedule = None if module.num_stages == 1 else self._make_schedule()

    def _loss(self, output: Any, target: Any) -> Tensor:
        """loss_fn times the batch's factor: loss scale / micro-batches in training (what the
        backward starts from: the gradients of the mean loss, scaled), 1 in evaluation."""
        loss = self.module.loss_fn(output, target)
        return loss * self._factor if self._factor != 1.0 else loss

    def _make_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        mesh = self.module.mesh
        stages = [PipelineStage(stage, stage.index, self.module.total_stages, self.device, group=mesh.group("pp"))
                  for stage in self.module.stage_modules]
        # the 1/micro_batches of the mean loss is in _loss, before the backward (as the engine's
        # gradient accumulation does it): with fp16 a sum of scaled micro-batch gradients divided
        # afterwards (torch's default scale_grads) would overflow at a micro_batches times smaller
        # loss scale. torch < 2.6 has no scale_grads and never divides.
        cls = {"interleaved_1f1b": ScheduleInterleaved1F1B, "gpipe": ScheduleGPipe}.get(self.name, Schedule1F1B)
        kw = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
        first = stages if self.name == "interleaved_1f1b" else stages[0]
        return cls(first, self.micro_batches, loss_fn=self._loss, **kw)

    # ------------------------------------------------------------------ data
    def _next_batch(self, data_iter: Iterator | None) -> tuple[Any, Any]:
        """(inputs, labels) of the whole batch, each None where this rank does not need it."""
        need_inputs, need_labels = self.module.is_first_stage, self.module.is_last_stage
        if not (need_inputs or need_labels):
            return None, None
        if data_iter is None:
            raise ValueError("PipelineSchedule: the ranks holding the first or last stage need a data_iter")
        items = [next(data_iter) for _ in range(self.micro_batches)]
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError("PipelineSchedule: data_iter must yield (inputs, labels) pairs (DeepSpeed's format); "
                                 f"got {type(item).__name__}")
        inputs = _cat([item[0] for item in items], "inputs") if need_inputs else None
        labels = _cat([item[1] for item in items], "labels") if need_labels else None
        if isinstance(inputs, Tensor):
            inputs = (inputs,)
        return inputs, labels

    def _broadcast_loss(self, losses: list[Tensor]) -> Tensor:
        loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros((), device=self.device)
        loss = loss.to(self.device) / self._factor
        if self.module.num_stages > 1:
            src = self.module.mesh.ranks("pp")[(self.module.total_stages - 1) % self.module.num_stages]
            dist.broadcast(loss, src=src, group=self.module.mesh.group("pp"))
        return loss

    # ------------------------------------------------------------------ running
    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """Forward and backward of one batch (module docstring); returns the mean loss."""
        self.module.train()
        inputs, labels = self._next_batch(data_iter)
        scale = float(self.loss_scale()) if self.loss_scale is not None else 1.0
        self._factor = scale / self.micro_batches
        losses: list[Tensor] = []
        if self._schedule is None:  # one stage: plain gradient accumulation over the micro-batches
            for args, target in zip(_split(inputs, self.micro_batches), _split(labels, self.micro_batches)):
                loss = self._loss(self.module(*args), target)
                loss.backward()
                losses.append(loss.detach())
        else:
            self._schedule.step(*(inputs or ()), target=labels, losses=losses, return_outputs=False)
            self.module.allreduce_tied_weight_gradients()
        return self._broadcast_loss(losses)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False):
        """Forward only, in eval mode; returns the mean loss on every pipeline rank, and with
        ``return_logits`` also the last stage's outputs for the batch (None on other ranks)."""
        was_training = self.module.training
        self.module.eval()
        self._factor = 1.0
        try:
            inputs, labels = self._next_batch(data_iter)
            losses: list[Tensor] = []
            outputs = None
            if self._schedule is None:
                outs = []
                for args, target in zip(_split(inputs, self.micro_batches), _split(labels, self.micro_batches)):
                    out = self.module(*args)
                    losses.append(self.module.loss_fn(out, target))
                    outs.append(out)
                outputs = torch.cat(outs) if outs and isinstance(outs[0], Tensor) else outs
            else:
                outputs = self._schedule.eval(*(inputs or ()), target=labels, losses=losses)
            loss = self._broadcast_loss(losses)
        finally:
            self.module.train(was_training)
        if return_logits:
            return loss, (outputs if self.module.is_last_stage else None)
        return loss


def _split(batch: Any, n: int) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(batch.chunk(n, dim=0))
    parts = [_split(t, n) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(n)]


__all__ = ["SCHEDULES", "PipelineSchedule", "check_schedule"]
