"""Mesh sizes and refusals that need no process group (the 4-rank checks are in test_mesh_layouts.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tachyon.parallel.mesh import ALL_AXES, Mesh, as_mesh, check_axis, resolve_sizes
from tachyon.parallel.mpu import MeshFromMpu, mesh_from_mpu


@pytest.mark.parametrize(
    ("world", "dp", "pp", "tp", "expected"),
    [(8, 2, 2, 2, (2, 2, 2)), (8, None, 2, 2, (2, 2, 2)), (4, None, 1, 4, (1, 1, 4)), (6, None, 3, 1, (2, 3, 1)),
     (1, None, 1, 1, (1, 1, 1))],
)
def test_sizes_multiply_to_the_world_and_dp_is_inferred(world, dp, pp, tp, expected):
    assert resolve_sizes(world, dp, pp, tp) == expected


def test_sizes_that_do_not_multiply_to_the_world_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"dp \* pp \* tp = 2 \* 2 \* 2 = 8 does not match the world size 4"):
        resolve_sizes(4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"pp \* tp = 3 \* 1 = 3 does not divide the world size 4"):
        resolve_sizes(4, None, 3, 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match=r"Mesh: tp must be an int >= 1"):
        resolve_sizes(4, None, 1, bad)


def test_unknown_axis_names_the_allowed_ones():
    assert check_axis("tp") == "tp"
    with pytest.raises(ValueError, match="unknown mesh axis 'model'; allowed: 'pp', 'dp', 'tp', 'mp'"):
        check_axis("model")
    assert ALL_AXES == ("pp", "dp", "tp", "mp")


@pytest.mark.skipif(dist.is_initialized(), reason="this process already has a default group")
def test_mesh_without_torch_distributed_says_how_to_start_it():
    with pytest.raises(RuntimeError, match=r"call tachyon.init_distributed\(\) first"):
        Mesh(tp=1)


class _NotAnMpu:
    def get_data_parallel_rank(self):
        return 0


class _HalfTensorGetters:
    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return None

    def get_tensor_model_parallel_world_size(self):
        return 1


def test_mesh_from_mpu_refuses_objects_without_the_getters():
    with pytest.raises(TypeError, match=r"needs get_data_parallel_rank\(\), get_data_parallel_world_size\(\)"):
        mesh_from_mpu(_NotAnMpu())
    with pytest.raises(ValueError, match="get_tensor_model_parallel_rank, get_tensor_model_parallel_group"):
        mesh_from_mpu(_HalfTensorGetters())
    with pytest.raises(TypeError, match="expected a tachyon.parallel.Mesh, a Megatron / DeepSpeed mpu"):
        as_mesh(object())


class _SingleProcessMpu:
    """A Megatron mpu of a one-process job (every size 1)."""

    def __getattr__(self, name):
        if name.startswith(("get_data_parallel", "get_tensor_model_parallel", "get_pipeline_model_parallel")):
            return {"rank": lambda: 0, "size": lambda: 1, "group": lambda: None}[name.rsplit("_", 1)[1]]
        raise AttributeError(name)


@pytest.mark.skipif(dist.is_initialized(), reason="this process already has a default group")
def test_a_single_process_mpu_is_a_mesh_of_ones():
    view = mesh_from_mpu(_SingleProcessMpu())
    assert isinstance(view, MeshFromMpu) and as_mesh(view) is view
    assert view.sizes == {"pp": 1, "dp": 1, "tp": 1} and view.size("mp") == 1
    assert view.mpu.get_tensor_model_parallel_world_size() == 1
