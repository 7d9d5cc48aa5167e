"""``deepspeed.runtime.pipe.topology.PipelineParallelGrid`` over tachyon's Mesh on 2 gloo ranks:
DeepSpeed's default split, a data-parallel and a model-parallel topology, each group checked by an
all-reduce of the ranks, and what is refused. Slow (2 spawned ranks, about 10 s): DeepSpeed's own
runtime/pipe/test_topology.py checks the grid on 4 ranks in the deepspeed_upstream run too."""

from __future__ import annotations

import pytest

from tests.compat import _grid_ranks
from tests.utils import run_distributed


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_parallel_grid_groups_on_two_ranks():
    results = run_distributed(_grid_ranks.rank_main, 2, timeout=120)
    for rank, out in enumerate(results):
        default = out["default"]
        assert (default["stage"], default["first"], default["last"]) == (rank, rank == 0, rank == 1)
        assert default["dp"] == [rank] and default["pp"] == [0, 1] and default["pipe_groups"] == [[0, 1]]
        assert default["p2p"] == [[0, 1], [1, 0]] and default["other"] == 1 - rank
        assert (default["pp_sum"], default["dp_sum"]) == (1, rank)
        assert default["model"] == (rank, 2) and default["model_sum"] == 1 and default["sizes"] == (2, 1, 1)
        data = out["data"]
        assert (data["stage"], data["first"], data["last"], data["dp"], data["dp_rank"]) == (0, True, True, [0, 1], rank)
        assert (data["dp_sum"], data["pp_sum"], data["model"]) == (1, rank, 1)
        model = out["model"]
        assert (model["slice_rank"], model["slice"], model["slice_sum"]) == (rank, [0, 1], 1)
        assert model["model_groups"] == [[0, 1]] and model["model"] == 2
        assert out["bad_size"].startswith("ValueError") and "holds 4 ranks, the job has 2" in out["bad_size"]
        assert out["bad_axes"].startswith("ValueError") and "pipe, data" in out["bad_axes"]
        assert out["group"].startswith("NotImplementedError") and "process_group" in out["group"]
