"""Four gloo ranks: the mesh's groups and mpu getters, a user's mpu read as a mesh, layouts refused
before any group exists, and the 2x2 layouts (dp x tp, dp x pp, and pp x tp with sequence
parallelism) trained 5 steps against single-process training of the same GPT.

One launch runs everything (spawning ranks costs seconds); each test reads its part.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.parallel._pp_training import CFG
from tests.parallel._tp_checks import assert_matches_reference
from tests.utils import run_distributed

pytestmark = pytest.mark.distributed


def _groups_now() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _mesh_facts(mesh) -> dict:
    mpu = mesh.mpu
    return {
        "sizes": mesh.sizes, "coordinate": mesh.coordinate,
        "ranks": {axis: mesh.ranks(axis) for axis in ("pp", "dp", "tp", "mp")},
        "group_ranks": {axis: dist.get_process_group_ranks(mesh.group(axis)) for axis in ("pp", "dp", "tp", "mp")},
        "mpu": {
            "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                   dist.get_process_group_ranks(mpu.get_data_parallel_group())),
            "tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                   dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group())),
            "slice": (mpu.get_slice_parallel_rank(), mpu.get_slice_parallel_world_size()),
            "pp": (mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size(),
                   dist.get_process_group_ranks(mpu.get_pipe_parallel_group())),
            "megatron_pp": (mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()),
            "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                   dist.get_process_group_ranks(mpu.get_model_parallel_group())),
            "first_last": (mpu.is_first_stage(), mpu.is_last_stage()),
            "src": (mpu.get_tensor_model_parallel_src_rank(), mpu.get_data_parallel_src_rank()),
        },
    }


class MegatronMpu:
    """What Megatron-LM's parallel_state offers, over another mesh's groups."""

    def __init__(self, mesh) -> None:
        self.m = mesh

    def get_data_parallel_rank(self): return self.m.rank("dp")  # noqa: E704
    def get_data_parallel_world_size(self): return self.m.size("dp")  # noqa: E704
    def get_data_parallel_group(self): return self.m.group("dp")  # noqa: E704
    def get_tensor_model_parallel_rank(self): return self.m.rank("tp")  # noqa: E704
    def get_tensor_model_parallel_world_size(self): return self.m.size("tp")  # noqa: E704
    def get_tensor_model_parallel_group(self): return self.m.group("tp")  # noqa: E704
    def get_pipeline_model_parallel_rank(self): return self.m.rank("pp")  # noqa: E704
    def get_pipeline_model_parallel_world_size(self): return self.m.size("pp")  # noqa: E704
    def get_pipeline_model_parallel_group(self): return self.m.group("pp")  # noqa: E704


class DeepSpeedGrid(MegatronMpu):
    """DeepSpeed's PipelineParallelGrid names: slice (tp), pipe (pp), model (pp x tp)."""

    get_tensor_model_parallel_rank = get_tensor_model_parallel_world_size = get_tensor_model_parallel_group = None
    get_pipeline_model_parallel_rank = get_pipeline_model_parallel_world_size = get_pipeline_model_parallel_group = None

    def get_slice_parallel_rank(self): return self.m.rank("tp")  # noqa: E704
    def get_slice_parallel_world_size(self): return self.m.size("tp")  # noqa: E704
    def get_slice_parallel_group(self): return self.m.group("tp")  # noqa: E704
    def get_pipe_parallel_rank(self): return self.m.rank("pp")  # noqa: E704
    def get_pipe_parallel_world_size(self): return self.m.size("pp")  # noqa: E704
    def get_pipe_parallel_group(self): return self.m.group("pp")  # noqa: E704
    def get_model_parallel_rank(self): return self.m.rank("mp")  # noqa: E704
    def get_model_parallel_world_size(self): return self.m.size("mp")  # noqa: E704
    def get_model_parallel_group(self): return self.m.group("mp")  # noqa: E704


class OldMegatronMpu:
    """Megatron before pipelines: "model parallel" meant tensor parallel."""

    def __init__(self, mesh) -> None:
        self.m = mesh

    def get_data_parallel_rank(self): return self.m.rank("dp")  # noqa: E704
    def get_data_parallel_world_size(self): return self.m.size("dp")  # noqa: E704
    def get_data_parallel_group(self): return self.m.group("dp")  # noqa: E704
    def get_model_parallel_rank(self): return self.m.rank("tp")  # noqa: E704
    def get_model_parallel_world_size(self): return self.m.size("tp")  # noqa: E704
    def get_model_parallel_group(self): return self.m.group("tp")  # noqa: E704


class WrongSizes(OldMegatronMpu):
    def get_model_parallel_world_size(self): return 1  # noqa: E704


def _view_facts(view) -> dict:
    return {"sizes": view.sizes, "ranks": {a: (view.rank(a), view.ranks(a)) for a in ("pp", "dp", "tp")}}


def _refusal(fn) -> tuple[str, int]:
    before = _groups_now()
    try:
        fn()
    except ValueError as err:
        return str(err), _groups_now() - before
    return "not refused", _groups_now() - before


def _rank() -> dict:
    from tachyon.parallel import Mesh
    from tachyon.parallel.mpu import mesh_from_mpu
    from tachyon.parallel.tensor import parallelize
    from tests.parallel import _pp_training as T

    out: dict = {"refused": {
        "dp3_tp2": _refusal(lambda: Mesh(dp=3, tp=2)),
        "2x2x2": _refusal(lambda: Mesh(dp=2, pp=2, tp=2)),
        "pp3": _refusal(lambda: Mesh(pp=3)),
    }}
    meshes = {"dp2_tp2": Mesh(dp=2, tp=2), "pp2_tp2": Mesh(pp=2, tp=2), "pp2_dp2": Mesh(pp=2, dp=2)}
    out["facts"] = {name: _mesh_facts(mesh) for name, mesh in meshes.items()}
    pp_tp = meshes["pp2_tp2"]
    out["views"] = {
        "megatron": _view_facts(mesh_from_mpu(MegatronMpu(pp_tp))),
        "deepspeed": _view_facts(mesh_from_mpu(DeepSpeedGrid(pp_tp))),
        "old_megatron": _view_facts(mesh_from_mpu(OldMegatronMpu(meshes["dp2_tp2"]))),
        "own": mesh_from_mpu(pp_tp.mpu) is pp_tp,
    }
    out["refused"]["wrong_mpu"] = _refusal(lambda: mesh_from_mpu(WrongSizes(meshes["dp2_tp2"])))

    # tensor parallelism driven by a Megatron mpu: the loss of the first batch equals the reference's
    model = T.build_gpt()
    ids, labels = T.batch(0)
    reference_loss = float(T.build_gpt()(ids, labels=labels))
    parallelize(model, mesh_from_mpu(MegatronMpu(meshes["dp2_tp2"])))
    out["mpu_tp_loss"] = (float(model(ids, labels=labels)), reference_loss)

    # the acceptance layouts
    out["reference"] = T.reference_state()
    out["initial"] = {k: p.detach().clone() for k, p in T.build_gpt().named_parameters()}
    out["dp2_tp2"] = T.train_tensor_parallel(meshes["dp2_tp2"])
    state, tied, losses = T.train_pipeline(meshes["pp2_dp2"], "1f1b", micro_batches=2)
    out["dp2_pp2"] = {"state": state, "tied": tied, "losses": losses}
    state, tied, losses = T.train_pipeline(pp_tp, "1f1b", micro_batches=2, tensor_parallel=True)
    out["pp2_tp2"] = {"state": state, "tied": tied, "losses": losses}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_rank, 4, timeout=600)


def test_mesh_groups_follow_the_pp_dp_tp_layout(ranks):
    """rank = pp * (dp * tp) + dp * tp_size + tp: tensor-parallel ranks adjacent."""
    for rank, result in enumerate(ranks):
        dp_tp = result["facts"]["dp2_tp2"]
        assert dp_tp["sizes"] == {"pp": 1, "dp": 2, "tp": 2}
        assert dp_tp["coordinate"] == {"pp": 0, "dp": rank // 2, "tp": rank % 2}
        assert dp_tp["ranks"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp_tp["ranks"]["dp"] == [rank % 2, rank % 2 + 2]
        pp_tp = result["facts"]["pp2_tp2"]
        assert pp_tp["coordinate"] == {"pp": rank // 2, "dp": 0, "tp": rank % 2}
        assert pp_tp["ranks"]["pp"] == [rank % 2, rank % 2 + 2]
        assert pp_tp["ranks"]["mp"] == [0, 1, 2, 3], "model parallel = pp x tp, all four ranks"
        for facts in result["facts"].values():
            assert facts["group_ranks"] == facts["ranks"], f"rank {rank}: groups disagree with the grid: {facts}"


def test_mpu_getters_speak_deepspeed_and_megatron(ranks):
    for rank, result in enumerate(ranks):
        mpu = result["facts"]["pp2_tp2"]["mpu"]
        assert mpu["tp"] == (rank % 2, 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert mpu["slice"] == mpu["tp"][:2]
        assert mpu["pp"] == (rank // 2, 2, [rank % 2, rank % 2 + 2])
        assert mpu["megatron_pp"] == mpu["pp"][:2]
        assert mpu["dp"] == (0, 1, [rank])
        assert mpu["mp"] == (rank, 4, [0, 1, 2, 3])
        assert mpu["first_last"] == (rank < 2, rank >= 2)
        assert mpu["src"] == (rank - rank % 2, rank)


def test_a_users_mpu_reads_as_the_same_mesh(ranks):
    for rank, result in enumerate(ranks):
        views = result["views"]
        expected = {"sizes": {"pp": 2, "dp": 1, "tp": 2},
                    "ranks": {"pp": (rank // 2, [rank % 2, rank % 2 + 2]), "dp": (0, [rank]),
                              "tp": (rank % 2, [rank - rank % 2, rank - rank % 2 + 1])}}
        assert views["megatron"] == expected
        assert views["deepspeed"] == expected
        assert views["old_megatron"]["sizes"] == {"pp": 1, "dp": 2, "tp": 2}
        assert views["own"] is True
        loss, reference = result["mpu_tp_loss"]
        assert abs(loss - reference) <= 1e-6 * abs(reference), (loss, reference)


def test_bad_layouts_are_refused_before_any_group_exists(ranks):
    for result in ranks:
        refused = result["refused"]
        message, new_groups = refused["dp3_tp2"]
        assert "dp * pp * tp = 3 * 1 * 2 = 6 does not match the world size 4" in message and new_groups == 0
        message, new_groups = refused["2x2x2"]
        assert "2 * 2 * 2 = 8 does not match the world size 4" in message and new_groups == 0
        message, new_groups = refused["pp3"]
        assert "pp * tp = 3 * 1 = 3 does not divide the world size 4" in message and new_groups == 0
        message, new_groups = refused["wrong_mpu"]
        assert "the mpu's sizes dp=2, pp=1, tp=1 multiply to 2, not the world size 4" in message and new_groups == 0


def test_dp2_tp2_trains_like_one_process(ranks):
    """Data parallel x tensor parallel, 5 SGD steps: the gathered parameters are the reference's."""
    for rank, result in enumerate(ranks):
        assert_matches_reference(result["dp2_tp2"], result["reference"], result["initial"], f"dp2 x tp2, rank {rank}")


def test_dp2_pp2_trains_like_one_process_with_tied_weights_bit_identical(ranks):
    for rank, result in enumerate(ranks):
        got = result["dp2_pp2"]
        assert_matches_reference(got["state"], result["reference"], result["initial"], f"dp2 x pp2 (1F1B), rank {rank}")
        for key, copies in got["tied"].items():
            assert len(copies) == 2 and torch.equal(copies[0], copies[1]), f"rank {rank}: {key} differs across stages"
    dp_replicas = [ranks[0]["dp2_pp2"]["losses"], ranks[1]["dp2_pp2"]["losses"]]  # ranks 0, 1: stage 0, dp 0 and 1
    assert dp_replicas[0] != dp_replicas[1], "the two dp replicas should see different halves of each batch"
    assert CFG["num_layers"] == 4


def test_pp2_tp2_with_sequence_parallel_trains_like_one_process(ranks):
    """Not in the issue's list, but what a 3-D layout runs: tensor (and sequence) parallel stages."""
    for rank, result in enumerate(ranks):
        got = result["pp2_tp2"]
        assert_matches_reference(got["state"], result["reference"], result["initial"], f"pp2 x tp2 (sp), rank {rank}")
        for key, copies in got["tied"].items():
            assert torch.equal(copies[0], copies[1]), f"rank {rank}: {key} differs across stages"
