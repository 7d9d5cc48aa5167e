"""3-D layouts through ``tachyon.initialize`` on 4 gloo ranks: DPxTP = 2x2 with ZeRO-1, ZeRO-2
and ZeRO-3 (FSDP2 over dp, tensor parallelism over tp), DPxPP = 2x2 with ZeRO-1 (1F1B and
GPipe), PPxTP = 2x2, each equal to single-process training after 5 steps (1e-5 relative, fp32); the data-parallel bytes of a DPxPP step; and
checkpoints saved with one (dp, pp, tp) layout and loaded with another: 2x2 saved after 3 steps,
loaded at 4x1x1 (4 ranks, another ZeRO stage) and at 1x1x1 (this process), then trained to
step 5, ending where uninterrupted single-process training ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parallel import _engine_training as E
from tests.parallel import _pp_training as T
from tests.parallel._tp_checks import PARALLEL_REL, assert_matches_reference
from tests.utils import assert_close, run_distributed

pytestmark = pytest.mark.distributed

MICRO = 4
SAVED_AT = 3  # steps trained before the checkpoint


def _save(engine, directory: str) -> dict:
    engine.save_checkpoint(directory, tag="step3")
    return json.loads((Path(directory) / "step3" / "meta.json").read_text())["layout"]


def _resume_gpt(directory: str, **kw) -> dict:
    model, engine = E.gpt_engine(**kw)
    engine.load_checkpoint(directory)
    assert engine.global_steps == SAVED_AT
    return E.run_gpt(model, engine, range(SAVED_AT, T.STEPS))


def _resume_pipeline(directory: str, gas: int, **kw) -> dict:
    net, engine = E.pipeline_engine(1, "1F1B", gas=gas, **kw)
    engine.load_checkpoint(directory)
    assert engine.global_steps == SAVED_AT
    return E.run_pipeline(net, engine, range(SAVED_AT, T.STEPS))


def _four_ranks(directory: str) -> dict:
    out: dict = {}
    for stage in (1, 2, 3):
        out[f"dp2_tp2_zero{stage}"] = E.train_gpt(tp=2, stage=stage)
    for schedule in ("1F1B", "GPipe"):
        out[f"dp2_pp2_{schedule}"] = E.train_pipeline(2, schedule, gas=MICRO, stage=1)
    out["pp2_tp2"] = E.train_pipeline(2, "1F1B", tp=2, gas=MICRO, stage=1)
    out["bytes_dp2_pp2"] = E.pipeline_bytes(2, "1F1B", gas=MICRO, stage=1)
    # checkpoints: DPxTP 2x2 (ZeRO-1) of the GPT, PPxTP 2x2 of the pipeline GPT
    model, engine = E.gpt_engine(tp=2, stage=1)
    E.run_gpt(model, engine, range(SAVED_AT))
    out["saved_gpt"] = _save(engine, f"{directory}/gpt")
    out["weights_gpt"] = engine.save_16bit_model(f"{directory}/gpt_weights", "model.pt")
    net, engine = E.pipeline_engine(2, "1F1B", tp=2, stage=1, gas=MICRO)
    E.run_pipeline(net, engine, range(SAVED_AT))
    out["saved_pipeline"] = _save(engine, f"{directory}/pipeline")
    out["weights_pipeline"] = engine.save_16bit_model(f"{directory}/pipeline_weights", "model.pt")
    out["gpt_at_4x1x1"] = _resume_gpt(f"{directory}/gpt", tp=1, stage=2)
    out["pipeline_at_4x1x1"] = _resume_pipeline(f"{directory}/pipeline", 2, stage=0)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def ranks(checkpoints):
    return run_distributed(_four_ranks, 4, checkpoints, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return E.reference_run("fp32")


@pytest.fixture(scope="module")
def initial():
    return E.initial_state()


@pytest.mark.parametrize(("layout", "sizes"), [("dp2_tp2_zero1", (2, 1, 2)), ("dp2_tp2_zero2", (2, 1, 2)),
                                               ("dp2_tp2_zero3", (2, 1, 2)),
                                               ("dp2_pp2_1F1B", None), ("dp2_pp2_GPipe", None), ("pp2_tp2", None)])
def test_2x2_layouts_train_like_one_process(ranks, reference, initial, layout, sizes):
    """Same parameters and global gradient norms as single-process training after 5 steps; the
    pipelines' tied embedding bit-identical on both stages."""
    for rank, result in enumerate(ranks):
        got = result[layout]
        if sizes is not None:
            assert got["sizes"] == sizes and got["batch"] == (T.GLOBAL_BATCH, 2, 2)
        assert_matches_reference(got["state"], reference["state"], initial, f"{layout} rank {rank}")
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=PARALLEL_REL, atol=0.0,
                     name=f"{layout} rank {rank}: global grad norms")
        for key, copies in got.get("tied", {}).items():
            assert len(copies) == 2 and torch.equal(copies[0], copies[1]), f"{layout} rank {rank}: {key} differs"


def test_dp2_tp2_stage3_shards_each_tensor_parallel_slice_over_dp(ranks):
    """ZeRO-3 on the 2x2 DPxTP layout: FSDP2 shards each tensor-parallel rank's slice of the model
    over the data-parallel axis, so the 4 ranks hold every tp slice's parameters exactly once per
    tp rank (2 x one tp rank's count in all), each about half of a tp rank's count."""
    per_tp_rank = E.split_parameter_count(2)
    held = [result["dp2_tp2_zero3"]["local_numel"] for result in ranks]
    assert all(result["dp2_tp2_zero3"]["stage"] == 3 for result in ranks)
    assert sum(held) == 2 * per_tp_rank, (held, per_tp_rank)
    assert all(0.4 * per_tp_rank < n < 0.6 * per_tp_rank for n in held), (held, per_tp_rank)


def test_dp2_pp2_step_moves_the_analytic_bytes(ranks):
    """Per train_batch on each rank: 2 x micro-batches P2P messages of one [1, seq, hidden] fp32
    activation (micro-batch 1 = 8 samples / (2 copies x 4 micro-batches)); over dp ZeRO-1's
    reduce-scatter of the stage's whole padded flat gradient, the all-gather of this rank's half
    of the updated parameters, and two scalars."""
    activation = 1 * T.SEQ * E.H * 4
    for rank, result in enumerate(ranks):
        got = result["bytes_dp2_pp2"]
        p2p = [payload for kind, _, payload in got["calls"] if kind in ("send", "recv")]
        assert p2p == [activation] * (2 * MICRO), f"rank {rank}: {p2p}"
        dp = {}
        for kind, axis, payload in got["calls"]:
            if axis == "dp":
                dp[kind] = dp.get(kind, 0) + payload
        # all_reduce: the squared grad norm of the partitions and the batch loss, one fp32 each
        assert dp == {"reduce_scatter": 4 * got["padded"], "all_gather": 4 * got["padded"] // 2,
                      "all_reduce": 8}, f"rank {rank}: {dp}"


def test_checkpoints_record_the_layout_they_were_saved_with(ranks):
    assert ranks[0]["saved_gpt"] == {"dp": 2, "pp": 1, "tp": 2}
    assert ranks[0]["saved_pipeline"] == {"dp": 1, "pp": 2, "tp": 2}


@pytest.mark.parametrize("model", ["gpt", "pipeline"])
def test_2x2_checkpoint_and_weights_export_whole(ranks, checkpoints, initial, model):
    """export_model_state_dict (offline, one process) rebuilds the whole model of step 3 from the
    2x2 checkpoint (full shapes, the module's names), equal to single-process training's step 3;
    save_16bit_model at 2x2 wrote the same weights (gathered over tp and pp) on rank 0 only."""
    from tachyon.engine.checkpoint import export_model_state_dict
    from tachyon.parallel.pipeline.gpt import pipeline_state_dict_to_gpt

    exported = export_model_state_dict(f"{checkpoints}/{model}")
    written = torch.load(ranks[0][f"weights_{model}"], weights_only=True)
    assert [r[f"weights_{model}"] for r in ranks[1:]] == [None] * 3
    assert written.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(written[key], value), f"save_16bit_model and the checkpoint differ in {key}"
    if model == "pipeline":
        exported = pipeline_state_dict_to_gpt(exported, E.L)
    at_step3 = E.reference_run("fp32", steps=SAVED_AT)["state"]
    assert_matches_reference({k: exported[k] for k in at_step3}, at_step3, initial, f"{model} exported")


@pytest.mark.parametrize("model", ["gpt", "pipeline"])
def test_2x2_checkpoint_resumes_at_4x1x1(ranks, reference, initial, model):
    """A DPxTP (GPT) or PPxTP (pipeline GPT) checkpoint of step 3 loaded by 4 data-parallel
    ranks (ZeRO-2 / ZeRO-0: the optimizer states resharded too), trained to step 5: the
    single-process result."""
    for rank, result in enumerate(ranks):
        got = result[f"{model}_at_4x1x1"]
        assert got["global_steps"] == T.STEPS
        assert_matches_reference(got["state"], reference["state"], initial, f"{model} resumed at 4x1x1, rank {rank}")
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"][SAVED_AT:]), rtol=PARALLEL_REL,
                     atol=0.0, name=f"{model} resumed at 4x1x1, rank {rank}: grad norms")


@pytest.mark.parametrize("model", ["gpt", "pipeline"])
def test_2x2_checkpoint_resumes_in_one_process(ranks, checkpoints, reference, initial, model):
    """The same checkpoints loaded at 1x1x1 (this process, no process group)."""
    del ranks  # the checkpoints exist once the 4-rank launch ran
    directory = f"{checkpoints}/{model}"
    got = _resume_gpt(directory, tp=1, stage=0) if model == "gpt" else _resume_pipeline(directory, MICRO, stage=0)
    assert got["global_steps"] == T.STEPS
    assert_matches_reference(got["state"], reference["state"], initial, f"{model} resumed at 1x1x1")
