"""Progressive layer drop at ZeRO stage 3 (FSDP2) on 2 gloo ranks against stage 2 with the same
keep draws (tests/engine/pld_zero3_cases.py runs the comparisons, one launch per fixture; the
tests read the results). Default suite: gradient accumulation with clipping, activation
checkpointing, a model that does not call its dropped layers, the BERT job's
TransformerKernelLayer, and a checkpoint resume; slow:
without accumulation, bf16, and ZeRO-Offload of the optimizer and of the parameters. In every
comparison both ranks drop the same layers although seeded apart, layers are dropped, dropped
layers keep their weights and moments bit for bit, no unit is left gathered after a step, and the
parameters equal stage 2's (fp32 within 1e-5; bf16 within its tolerance, norm-wise)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.pld_zero3_cases import CLIP, DEPTH, STEPS, scenarios
from tests.utils import assert_close, run_distributed, tolerance

pytestmark = pytest.mark.distributed

DEFAULT = ["fp32-gas2", "checkpointing", "skipped-calls-gas2", "kernel-layer-gas2"]
SLOW = ["fp32", "bf16-gas2", "offload-optimizer-gas2", "offload-param-gas2"]
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


def _launch(tmp_path_factory, names: list[str], with_resume: bool) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_distributed(scenarios, 2, str(tmp_path_factory.mktemp("pld3")), names, with_resume, timeout=400)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pld3(tmp_path_factory):
    return _launch(tmp_path_factory, DEFAULT, True)


@pytest.fixture(scope="module")
def pld3_slow(tmp_path_factory):
    return _launch(tmp_path_factory, SLOW, False)


def check_against_stage_2(results: list[dict], name: str) -> None:
    rtol, atol = tolerance(torch.bfloat16) if name.startswith("bf16") else (FP32_RTOL, FP32_ATOL)
    for rank, result in enumerate(results):
        two, three = result[name][2], result[name][3]
        assert three["forwards"] == two["forwards"], f"rank {rank}: stage 3 drew other decisions than stage 2"
        assert three["forwards"] == results[1 - rank][name][3]["forwards"], "the ranks ran different layers"
        assert len(three["forwards"]) == STEPS * (2 if "gas2" in name else 1)
        assert three["dropped"] >= 1 and three["kept"] >= 3, f"not enough of both cases: {three}"
        assert any(not all(f) for f in three["forwards"]) and any(all(f) for f in three["forwards"])
        assert three["own_generator_untouched"], "the keep draws at stage 3 used this rank's own generator"
        assert max(three["norms"]) > CLIP, "clipping never engaged; its global norm was not exercised"
        assert_close(torch.tensor(three["norms"]), torch.tensor(two["norms"]), rtol=max(rtol, FP32_RTOL), atol=atol,
                     name=f"rank {rank} {name} global gradient norms")
        assert two["params"].keys() == three["params"].keys()
        for key, want in two["params"].items():
            got = three["params"][key]
            if key.endswith("attn_qkvb"):  # the kernel layer's packed [q; k; v] bias: without k (see PLDStack)
                keep = torch.ones_like(want, dtype=torch.bool).view(3, -1)
                keep[1] = False
                want, got = want[keep.flatten()], got[keep.flatten()]
            if name.startswith("bf16"):  # both stages reduce in bf16, in another order: norm-wise, as test_zero3
                error = float((got - want).norm() / want.norm())
                assert error <= rtol, f"rank {rank} {name} {key}: relative error {error:.3g} > {rtol} (norm-wise)"
            else:
                assert_close(got, want, rtol=rtol, atol=atol, name=f"rank {rank} {name} {key}")


@pytest.mark.parametrize("name", DEFAULT)
def test_pld_at_stage_3_trains_to_stage_2s_parameters(pld3, name):
    """The same layers run at both stages and on both ranks (stage 3's ranks seeded apart, stage
    2's alike), at least one layer is dropped everywhere in some step, and the parameters after 5
    steps agree within 1e-5."""
    check_against_stage_2(pld3, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_pld_at_stage_3_trains_to_stage_2s_parameters_more(pld3_slow, name):
    """As above without accumulation, in bf16 (within bf16's tolerance relative to each tensor's
    norm) and with ZeRO-Offload of the optimizer, and of the parameters too, at stage 3."""
    check_against_stage_2(pld3_slow, name)


def test_stage_3_resumes_the_keep_draws_from_a_checkpoint(pld3):
    """Save after 2 steps at stage 3, then a fresh engine loads it with every rank's generator
    reseeded: the next 3 steps drop the same layers and end at the same parameters (exactly). A
    checkpoint whose shared state is malformed is refused before anything changes."""
    for result in pld3:
        straight, resumed = result["resume"]["straight"], result["resume"]["resumed"]
        assert "CheckpointError" in resumed["refused"], resumed["refused"]
        assert "shared progressive-layer-drop generator state" in resumed["refused"], resumed["refused"]
        assert resumed["untouched"], "the refused load changed the engine"
        assert resumed["global_steps"] == straight["global_steps"] == STEPS
        assert resumed["forwards"] == straight["forwards"]
        assert any(not all(f) for f in resumed["forwards"]), "no layer dropped after the resume"
        for key, want in straight["params"].items():
            assert torch.equal(resumed["params"][key], want), key
    assert pld3[0]["resume"]["resumed"]["forwards"] == pld3[1]["resume"]["resumed"]["forwards"]
    assert len(pld3[0]["resume"]["resumed"]["forwards"][0]) == DEPTH
