"""Rank side of tests/compat/test_pipe_grid.py (kept apart so spawned ranks import little)."""

from __future__ import annotations


def _sum_over(group) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, group=group)
    return int(t.item())


def rank_main() -> dict:
    from tachyon.compat.deepspeed.runtime.pipe.topology import (
        PipeModelDataParallelTopology,
        PipelineParallelGrid,
        ProcessTopology,
    )

    out: dict = {}
    grid = PipelineParallelGrid()  # 2 ranks: DeepSpeed's split gives 2 stages, 1 pipeline
    out["default"] = dict(
        stage=grid.stage_id, first=grid.is_first_stage, last=grid.is_last_stage, dp=grid.dp_group, pp=grid.pp_group,
        pipe_groups=grid.pipe_groups, p2p=grid.p2p_groups, pp_sum=_sum_over(grid.get_pipe_parallel_group()),
        dp_sum=_sum_over(grid.get_data_parallel_group()), model=(grid.get_model_parallel_rank(),
                                                                  grid.get_model_parallel_world_size()),
        model_sum=_sum_over(grid.get_model_parallel_group()), other=grid.stage_to_global(stage_id=1 - grid.stage_id),
        sizes=(grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size(),
               grid.get_slice_parallel_world_size()))
    grid = PipelineParallelGrid(topology=ProcessTopology(axes=["pipe", "data"], dims=[1, 2]))
    out["data"] = dict(stage=grid.stage_id, first=grid.is_first_stage, last=grid.is_last_stage, dp=grid.dp_group,
                       dp_rank=grid.get_data_parallel_rank(), dp_sum=_sum_over(grid.get_data_parallel_group()),
                       pp_sum=_sum_over(grid.get_pipe_parallel_group()), model=grid.get_model_parallel_world_size())
    grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    out["model"] = dict(slice_rank=grid.get_slice_parallel_rank(), slice=grid.slice_group,
                        slice_sum=_sum_over(grid.get_slice_parallel_group()), model_groups=grid.model_groups,
                        model=grid.get_model_parallel_world_size())
    for name, kwargs in (("bad_size", dict(topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 2]))),
                         ("bad_axes", dict(topology=ProcessTopology(axes=["data", "pipe"], dims=[1, 2]))),
                         ("group", dict(process_group=object()))):
        try:
            PipelineParallelGrid(**kwargs)
        except (ValueError, NotImplementedError) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out
