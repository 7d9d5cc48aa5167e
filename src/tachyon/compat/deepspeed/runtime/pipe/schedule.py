"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline schedules as instruction lists.

A schedule describes what one pipeline stage does for one batch: iterating it yields one list of
`PipeInstruction` per step (load a micro-batch, forward, backward, send / receive activations or
gradients, reduce, step), and every stage's step ``i`` can be separated from its step ``i + 1`` by
a barrier without deadlock. The classes follow DeepSpeed's (same names, arguments, step counts,
instruction order and buffer numbering), for code that builds, inspects or drives them.

tachyon's own pipeline engine does not execute these lists: `tachyon.parallel.pipeline` runs
torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved; ``pipeline.schedule`` in the
config), whose 1F1B order is the one `TrainSchedule` describes.

    sched = TrainSchedule(micro_batches=4, stages=2, stage_id=1)
    for step in sched:            # e.g. [RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)]
        ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


# ---------------------------------------------------------------------- instructions
class PipeInstruction:
    """One thing a stage does; the keyword arguments become attributes (``buffer_id``, ...)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({args})"


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after `ReduceGrads` and `ReduceTiedGrads`)."""


class ReduceGrads(PipeInstruction):
    """Average the gradients over the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied modules over the stages that hold a copy."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer ``buffer_id``."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into the buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs (with the received gradients), accumulating grads."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (pairs with its `RecvActivation`)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs into the buffer (pairs with its `SendActivation`)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's received inputs to the previous stage (pairs with its `RecvGrad`)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage (pairs with its `SendGrad`)."""


# ---------------------------------------------------------------------- schedules
class PipeSchedule(ABC):
    """The instruction lists of stage ``stage_id`` of ``stages`` for a batch of ``micro_batches``;
    subclasses define `steps` (a generator of lists) and `num_pipe_buffers`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator | None = None

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One list of instructions per step."""

    def num_pipe_buffers(self) -> int:
        """How many buffers the stage needs (default: one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer of a micro-batch: buffers are reused cyclically."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is not in [0, {self.micro_batches})")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only: ``micro_batches + stages - 1`` steps; stage ``k`` runs micro-batch
    ``step - k``. Two buffers, alternating, so a stage receives into one while the other is sent;
    even stages send before they receive, odd stages receive first (the pairs never wait on each
    other)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        loads = self.is_first_stage or self.is_last_stage
        for step in range(self.micro_batches + self.stages - 1):
            micro = step - self.stage_id
            recv_buf, send_buf = (step + self.stage_id) % 2, (step + self.stage_id + 1) % 2
            runs, sends = self._valid_micro_batch(micro), self._valid_micro_batch(micro - 1)
            cmds: list[PipeInstruction] = []
            if loads and runs:
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if has_next and sends else []
            recv = [RecvActivation(recv_buf)] if has_prev and runs else []
            cmds.extend(send + recv if self.stage_id % 2 == 0 else recv + send)
            if runs:
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B training: ``2 * (micro_batches + stages - 1)`` steps. At a step whose
    parity equals the stage's parity the stage runs a forward (micro-batch ``step//2 - stage//2``),
    otherwise a backward (micro-batch ``step//2 + stage//2 + 1 - stages``); out-of-range
    micro-batches are idle. A forward step first sends the previous step's input gradients back
    and receives this micro-batch's activations; a backward step first receives this
    micro-batch's output gradients and sends the previous step's activations on. The last step
    ends with `ReduceTiedGrads`, `ReduceGrads`, `OptimizerStep`."""

    def _micro_batch(self, step: int) -> tuple[int, bool]:
        """(micro-batch id, whether the step is a forward) of ``step`` on this stage."""
        forward = step % 2 == self.stage_id % 2
        if forward:
            return step // 2 - self.stage_id // 2, True
        return step // 2 + self.stage_id // 2 + 1 - self.stages, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        loads = self.is_first_stage or self.is_last_stage
        total = 2 * (self.micro_batches + self.stages - 1)
        prev_micro = -1
        for step in range(total):
            micro, forward = self._micro_batch(step)
            runs, ran = self._valid_micro_batch(micro), self._valid_micro_batch(prev_micro)
            cmds: list[PipeInstruction] = []
            if forward:
                if ran and has_prev:
                    cmds.append(SendGrad(self._buffer_idx(prev_micro)))
                if runs and has_prev:
                    cmds.append(RecvActivation(self._buffer_idx(micro)))
            else:
                if runs and has_next:
                    cmds.append(RecvGrad(self._buffer_idx(micro)))
                if ran and has_next:
                    cmds.append(SendActivation(self._buffer_idx(prev_micro)))
            if runs:
                buffer = self._buffer_idx(micro)
                if forward and loads:
                    cmds.append(LoadMicroBatch(buffer))
                cmds.append(ForwardPass(buffer) if forward else BackwardPass(buffer))
            if step == total - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            prev_micro = micro
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The forwards in flight on this stage: ``stages - stage_id`` (at most ``micro_batches``), at least 2."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """No pipeline: load, forward and backward each micro-batch in buffer 0; the last step ends
    with `ReduceGrads` and `OptimizerStep` (gradient accumulation)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


__all__ = [
    "BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass", "InferenceSchedule", "LoadMicroBatch",
    "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads",
    "SendActivation", "SendGrad", "TrainSchedule",
]
