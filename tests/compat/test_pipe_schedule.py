"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's instruction-list schedules. The lists of a
small case are DeepSpeed's own (read from deepspeed/runtime/pipe/schedule.py at 0.19.6); the
simulation runs every stage's list side by side and checks that the pipeline they describe is
sound: sends meet receives, each micro-batch goes forward then backward once on every stage in
dependency order, and no buffer is overwritten while its micro-batch is in flight."""

from __future__ import annotations

import pytest

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.runtime.pipe import schedule


def _reprs(sched):
    return [[repr(cmd) for cmd in cmds] for cmds in sched]


def test_train_and_inference_lists_are_deepspeeds():
    assert _reprs(schedule.TrainSchedule(micro_batches=3, stages=2, stage_id=0)) == [
        ["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"], ["SendActivation(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
        ["RecvGrad(buffer_id=0)", "SendActivation(buffer_id=1)", "BackwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["RecvGrad(buffer_id=1)", "SendActivation(buffer_id=0)", "BackwardPass(buffer_id=1)"], [],
        ["RecvGrad(buffer_id=0)", "BackwardPass(buffer_id=0)", "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]]
    assert _reprs(schedule.TrainSchedule(micro_batches=3, stages=2, stage_id=1)) == [
        [], ["RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["BackwardPass(buffer_id=0)"],
        ["SendGrad(buffer_id=0)", "RecvActivation(buffer_id=1)", "LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
        ["BackwardPass(buffer_id=1)"],
        ["SendGrad(buffer_id=1)", "RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["BackwardPass(buffer_id=0)"], ["SendGrad(buffer_id=0)", "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]]
    assert _reprs(schedule.InferenceSchedule(micro_batches=2, stages=2, stage_id=1)) == [
        [], ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "RecvActivation(buffer_id=1)", "ForwardPass(buffer_id=1)"]]
    assert _reprs(schedule.DataParallelSchedule(micro_batches=2, stages=1, stage_id=0))[-1] == [
        "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)", "BackwardPass(buffer_id=0)", "ReduceGrads()",
        "OptimizerStep()"]


def _simulate(make, micro_batches: int, stages: int, train: bool) -> None:
    scheds = [make(micro_batches=micro_batches, stages=stages, stage_id=k) for k in range(stages)]
    lists = [list(s) for s in scheds]
    assert len({len(steps) for steps in lists}) == 1
    fwd_at = [[None] * micro_batches for _ in range(stages)]
    bwd_at = [[None] * micro_batches for _ in range(stages)]
    held = [dict() for _ in range(stages)]  # buffer -> micro-batch in flight
    for step in range(len(lists[0])):
        for k in range(stages):
            kinds = [type(cmd) for cmd in lists[k][step]]
            if k + 1 < stages:  # what k sends, k + 1 receives in the same step
                assert kinds.count(schedule.SendActivation) == \
                    [type(c) for c in lists[k + 1][step]].count(schedule.RecvActivation), (step, k)
                assert [type(c) for c in lists[k + 1][step]].count(schedule.SendGrad) == \
                    kinds.count(schedule.RecvGrad), (step, k)
            for cmd in lists[k][step]:
                if isinstance(cmd, schedule.BufferOpInstruction):
                    assert 0 <= cmd.buffer_id < scheds[k].num_pipe_buffers()
                if isinstance(cmd, schedule.ForwardPass):
                    micro = sum(x is not None for x in fwd_at[k])
                    assert train is False or cmd.buffer_id not in held[k], f"stage {k} overwrites a buffer in flight"
                    held[k][cmd.buffer_id] = micro
                    fwd_at[k][micro] = step
                    assert k == 0 or fwd_at[k - 1][micro] < step
                elif isinstance(cmd, schedule.BackwardPass):
                    micro = sum(x is not None for x in bwd_at[k])
                    assert held[k].pop(cmd.buffer_id) == micro
                    bwd_at[k][micro] = step
                    assert fwd_at[k][micro] < step and (k == stages - 1 or bwd_at[k + 1][micro] < step)
    assert all(x is not None for row in fwd_at for x in row)
    assert all((x is not None) == train for row in bwd_at for x in row)
    if train:
        for steps in lists:
            assert [type(c) for c in steps[-1][-3:]] == [schedule.ReduceTiedGrads, schedule.ReduceGrads,
                                                         schedule.OptimizerStep]


@pytest.mark.parametrize("micro_batches, stages", [(1, 1), (4, 1), (1, 3), (3, 2), (5, 3), (8, 4), (2, 5)])
def test_train_schedule_describes_a_sound_1f1b_pipeline(micro_batches, stages):
    _simulate(schedule.TrainSchedule, micro_batches, stages, train=True)
    _simulate(schedule.InferenceSchedule, micro_batches, stages, train=False)


def test_schedule_object_api():
    sched = schedule.TrainSchedule(micro_batches=8, stages=4, stage_id=1)
    assert (sched.stage, sched.num_stages, sched.num_micro_batches, sched.prev_stage, sched.next_stage) == (1, 4, 8, 0, 2)
    assert not sched.is_first_stage and not sched.is_last_stage and sched.num_pipe_buffers() == 3
    assert schedule.TrainSchedule(micro_batches=1, stages=4, stage_id=0).num_pipe_buffers() == 2
    first = next(iter(sched))
    assert list(iter(sched))[0] == [] and first == []  # iter() restarts the schedule
    cmd = schedule.SendGrad(buffer_id=2, extra="x")
    assert (cmd.name, cmd.buffer_id, cmd.extra, repr(cmd)) == ("SendGrad", 2, "x", "SendGrad(buffer_id=2, extra='x')")
    with pytest.raises(TypeError):
        schedule.PipeSchedule(micro_batches=1, stages=1, stage_id=0)
    with pytest.raises(ValueError, match="micro-batch 9"):
        sched._buffer_idx(9)
    assert deepspeed.runtime.pipe.schedule is schedule
