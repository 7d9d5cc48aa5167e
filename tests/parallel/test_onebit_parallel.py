"""1-bit Adam composed with the engine's other features, on 4 gloo ranks (one launch):

- tensor parallelism, dp=2 x tp=2 (the small GPT of `_engine_training`): the compressed
  all-reduce runs over the data-parallel group only (2 ranks, on this rank's tensor-parallel
  shard), every rank ends with the same full model, and the loss is close to uncompressed Adam on
  the same layout;
- pipeline parallelism, dp=2 x pp=2 (an untied LM head): the data-parallel copies of each stage
  stay equal and the loss is close to uncompressed Adam;
- activation checkpointing (torch.utils.checkpoint inside the model) at ZeRO stages 0 and 2 on 4
  data-parallel ranks: bit for bit the run without it (recomputing the forward changes no
  gradient bit on CPU, so nothing the compression sees changes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils import run_distributed

TP_STEPS, TP_FREEZE, TP_LR = 20, 10, 1e-2
AC_STEPS, AC_FREEZE = 6, 3
"""10 compressed steps with tensor / pipeline parallelism (1-bit ends -0.48% / +0.19% / +0.22% from
Adam at tp stage 0 / tp stage 2 / pp); with activation checkpointing 3 warm-up and 3 compressed
steps (bit for bit holds or fails from the first step of each phase on, whatever their length)."""


class _CheckpointedMLP(torch.nn.Module):
    """test_onebit_adam's MLP with its first two layers under torch.utils.checkpoint."""

    def __init__(self, net: torch.nn.Sequential, checkpointed: bool) -> None:
        super().__init__()
        self.net, self.checkpointed = net, checkpointed

    def forward(self, x):
        head, tail = self.net[:3], self.net[3:]
        if self.checkpointed:
            x = torch.utils.checkpoint.checkpoint(head, x, use_reentrant=False)
        else:
            x = head(x)
        return tail(x)


def _activation_checkpointing_runs(rank: int, world: int) -> dict:
    import tachyon
    from tests.engine.test_onebit_adam import GLOBAL_BATCH, labelled, make_models

    out = {}
    for stage in (0, 2):
        for checkpointed in (False, True):
            teacher, net = make_models()
            model = _CheckpointedMLP(net, checkpointed)
            config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                      "steps_per_print": 100_000,
                      "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096},
                      "optimizer": {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": AC_FREEZE,
                                                                     "comm_backend_name": "gloo"}}}
            engine, *_ = tachyon.initialize(model=model, config=config)
            for step in range(AC_STEPS):
                x, y = labelled(1000 + step, GLOBAL_BATCH, teacher)
                engine.backward(F.cross_entropy(engine(x[rank::world]), y[rank::world]))
                engine.step()
            assert engine.optimizer.in_compression_stage
            out[(stage, checkpointed)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    return out


def _tensor_parallel_runs() -> dict:
    from tachyon.parallel.tensor import full_state_dict, tp_group
    from tests.parallel import _engine_training as E
    from tests.parallel import _pp_training as T

    import tachyon

    out = {}
    for stage, kind in ((0, "Adam"), (0, "OneBitAdam"), (2, "Adam"), (2, "OneBitAdam")):
        params = {"lr": TP_LR}
        if kind == "OneBitAdam":
            params.update(freeze_step=TP_FREEZE, comm_backend_name="gloo")
        cfg = E.config(gas=2, stage=stage, tp=2, optimizer={"type": kind, "params": params})
        model = T.build_gpt()
        engine, *_ = tachyon.initialize(model=model, config=cfg)
        dp, dp_rank = engine.data_parallel_world_size, engine.data_parallel_rank
        for step in range(TP_STEPS):
            E._gpt_step(engine, step, dp, dp_rank, 2)
        ids, labels = T.batch(10_000)
        with torch.no_grad():
            loss = float(engine(ids, labels=labels))
        state = full_state_dict(model, tp_group(engine.mesh))
        tensors = {k: v.detach().float().clone() for k, v in state.items() if torch.is_tensor(v)}
        out[stage, kind] = {"loss": loss, "state": tensors, "dp": dp}
        if kind == "OneBitAdam":
            opt = engine.optimizer
            comp = opt._compressor  # stage 0 compresses the momentum; ZeRO-2 the gradients (opt.gradient_reducer)
            out[stage, kind].update(
                compressing=opt.in_compression_stage, group_is_dp=opt.group is engine.data_parallel_group,
                compressor_world=None if comp is None else comp.world_size,
                compressed_numel=None if comp is None else comp.layout.numel,
                local_numel=sum(p.numel() for g in opt.param_groups for p in g["params"]))
    return out


def _pipeline_runs() -> dict:
    """dp=2 x pp=2, the small GPT with an untied LM head (tied weights across stages are refused
    with 1-bit optimizers): Adam and OneBitAdam from the same start, through engine.train_batch."""
    import tachyon
    from tachyon.parallel.pipeline import PipelineModule
    from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss
    from tests.parallel import _engine_training as E
    from tests.parallel import _pp_training as T

    out = {}
    for kind in ("Adam", "OneBitAdam"):
        params = {"lr": TP_LR}
        if kind == "OneBitAdam":
            params.update(freeze_step=TP_FREEZE, comm_backend_name="gloo")
        torch.manual_seed(0)  # the same start on the two data-parallel copies of a stage
        net = PipelineModule(gpt_layer_specs(**T.CFG, tie_embeddings=False), num_stages=2, loss_fn=gpt_loss)
        engine, *_ = tachyon.initialize(model=net, config=E.config(gas=2, stage=0, stages=2, optimizer={
            "type": kind, "params": params}))
        for step in range(TP_STEPS):
            engine.train_batch(E.micro_batch_iter(engine, step))
        loss = float(engine.eval_batch(E.micro_batch_iter(engine, 10_000)))
        state = {k: v.detach().float().clone() for k, v in net.state_dict().items() if torch.is_tensor(v)}
        out[kind] = {"loss": loss, "state": state, "stage": engine.mesh.rank("pp"), "dp": engine.data_parallel_world_size,
                     "compressing": getattr(engine.optimizer, "in_compression_stage", None)}
    return out


def _four_ranks(what: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if what == "tp":
        return {"tp": _tensor_parallel_runs(), "pp": _pipeline_runs()}
    return {"ac": _activation_checkpointing_runs(rank, world)}


@pytest.fixture(scope="module")
def tp_runs():
    return run_distributed(_four_ranks, 4, "tp", timeout=900)


@pytest.fixture(scope="module")
def ac_runs():
    return run_distributed(_four_ranks, 4, "ac", timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_onebit_with_tensor_parallel_compresses_over_data_parallel_only(tp_runs, stage):
    four = tp_runs
    first = four[0]["tp"]
    for rank, r in enumerate(four):
        onebit, adam = r["tp"][stage, "OneBitAdam"], r["tp"][stage, "Adam"]
        where = f"dp=2 x tp=2, ZeRO stage {stage}, rank {rank}"
        assert onebit["compressing"] and onebit["group_is_dp"], f"{where}: {onebit}"
        assert onebit["dp"] == 2, f"{where}: compressed over {onebit}"
        if stage == 0:  # the momentum is compressed: this rank's tensor-parallel shard and the replicated parameters
            assert onebit["compressor_world"] == 2 and onebit["compressed_numel"] == onebit["local_numel"], where
        # every rank holds the same full model: the replicated parameters stay equal across tp
        for key, value in onebit["state"].items():
            assert torch.equal(value, first[stage, "OneBitAdam"]["state"][key]), f"{where}: {key} differs from rank 0's"
        gap = (onebit["loss"] - adam["loss"]) / adam["loss"]
        assert abs(gap) <= 0.02, f"{where}: 1-bit loss {onebit['loss']:.4f} vs Adam {adam['loss']:.4f}"
        moved = max((onebit["state"][k] - adam["state"][k]).abs().max().item() for k in adam["state"])
        assert moved > 0, f"{where}: 1-bit equals Adam exactly; the compression did not run"


@pytest.mark.distributed
def test_onebit_with_an_untied_pipeline_keeps_the_stage_copies_equal(tp_runs):
    by_stage: dict[int, dict] = {}
    for rank, r in enumerate(tp_runs):
        onebit, adam = r["pp"]["OneBitAdam"], r["pp"]["Adam"]
        where = f"dp=2 x pp=2, rank {rank} (stage {onebit['stage']})"
        assert onebit["compressing"] and onebit["dp"] == 2, where
        first = by_stage.setdefault(onebit["stage"], onebit["state"])  # the two data-parallel copies agree
        assert all(torch.equal(v, first[k]) for k, v in onebit["state"].items()), f"{where}: differs from its copy"
        gap = (onebit["loss"] - adam["loss"]) / adam["loss"]
        assert abs(gap) <= 0.02, f"{where}: 1-bit loss {onebit['loss']:.4f} vs Adam {adam['loss']:.4f}"
        assert max((onebit["state"][k] - adam["state"][k]).abs().max().item() for k in adam["state"]) > 0, where
    assert sorted(by_stage) == [0, 1]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_onebit_with_activation_checkpointing_is_bit_for_bit(ac_runs, stage):
    four = ac_runs
    for rank, r in enumerate(four):
        plain, checkpointed = r["ac"][(stage, False)], r["ac"][(stage, True)]
        assert torch.equal(checkpointed, plain), f"stage {stage}, rank {rank}: activation checkpointing changed the run"
        assert torch.equal(plain, four[0]["ac"][(stage, False)]), f"stage {stage}, rank {rank}: ranks differ"
