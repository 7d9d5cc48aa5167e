"""OneBitLamb: the warm-up is tachyon's Lamb, the compression stage's update math (DeepSpeed's
frozen coefficient and variance-drift factor), flat partitions with segments, arguments and
config, state dicts; and on 2 and 4 gloo ranks the scenario of test_onebit_adam.py (identical
ranks, bytes on the wire, convergence close to uncompressed LAMB, checkpoint resume)."""

from __future__ import annotations

import pytest
import torch

from tachyon.config.optim import check_typed_section
from tachyon.engine.optim import Lamb, OneBitLamb, build_optimizer
from tests.engine.test_onebit_adam import (
    _grads, _params, check_gpt, check_scenario, gpt_rank_main, onebit_rank_main, round_trip_mid_compression,
)
from tests.utils import assert_close, run_distributed


# The 4-rank run (about a CPU-minute) takes the same code paths as the 2-rank one; the
# compressed all-reduce on 4 ranks (uneven chunks, four server chunks) stays in the default run
# in tests/parallel/test_compression.py and tests/parallel/test_onebit_parallel.py.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def lamb_world(request):
    return request.param, run_distributed(onebit_rank_main, request.param, "lamb", 240, 160, 1e-2, 200, timeout=600)


@pytest.mark.distributed
def test_onebit_lamb_data_parallel(lamb_world):
    world, results = lamb_world
    check_scenario("OneBitLamb", world, results, exact_warmup=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_onebit_lamb_small_gpt_on_the_embedded_corpus():
    check_gpt("LAMB", run_distributed(gpt_rank_main, 2, "lamb", 1000, 250, 2e-2, timeout=1800))


# ---------------------------------------------------------------------- single process
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_warmup_is_lamb(weight_decay):
    ours, plain = _params(), _params()
    onebit = OneBitLamb(ours, lr=1e-2, freeze_step=100, weight_decay=weight_decay)
    lamb = Lamb(plain, lr=1e-2, weight_decay=weight_decay)
    for step in range(4):
        _grads(ours, step)
        _grads(plain, step)
        onebit.step()
        lamb.step()
    for i, (a, b) in enumerate(zip(ours, plain)):
        assert_close(a.detach(), b.detach(), name=f"parameter {i}")


def _reference_onebit_lamb(params, steps: int, *, lr, freeze, wd, betas=(0.9, 0.999), eps=1e-8, max_coeff=10.0,
                           min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, threshold=0.1):
    """DeepSpeed's OnebitLamb update per parameter, written out in float64 with plain Python
    control flow (here with bias correction, tachyon's default); one rank, so the compressed
    all-reduce is the identity. Returns the parameters and the coefficients of the last step."""
    b1, b2 = betas
    p = [q.detach().double().clone() for q in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    fresh = [None] * len(p)
    frozen_coeff = [0.0] * len(p)
    last_factor = [1.0] * len(p)
    coeffs = []
    for step in range(1, steps + 1):
        _grads(params, step)
        coeffs = []
        for i in range(len(p)):
            g = params[i].grad.double()
            if step <= freeze:
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                if step == freeze:
                    fresh[i] = v[i].clone()
                u = m[i] / (v[i].sqrt() + eps) + wd * p[i]
                w_norm, u_norm = p[i].norm().item(), u.norm().item()
                ratio = 1.0
                if w_norm > 0 and u_norm > 0:
                    ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
                    frozen_coeff[i] = coeff_beta * frozen_coeff[i] + (1 - coeff_beta) * ratio
                size = lr * (1 - b2**step) ** 0.5 / (1 - b1**step)
                p[i] = p[i] - size * ratio * u
                coeffs.append(ratio)
            else:
                previous = m[i].clone()
                m[i] = b1 * m[i] + (1 - b1) * g
                implied = (m[i] - b1 * previous) / (1 - b1)
                fresh[i] = b2 * fresh[i] + (1 - b2) * implied * implied
                denom = v[i].sqrt() + eps
                prelim = m[i] / denom
                u = prelim + wd * p[i]
                factor = (denom / (fresh[i].sqrt() + eps)).max().item()
                if wd > 0:
                    kept = min(1.0, (prelim.norm() / u.norm()).item())
                    factor = factor * kept + (1 - kept)
                factor = min(max(factor, factor_min), factor_max)
                factor = min(max(factor, last_factor[i] * (1 - threshold)), last_factor[i] * (1 + threshold))
                last_factor[i] = factor
                coeff = frozen_coeff[i] * factor
                size = lr * (1 - b2**step) ** 0.5 / (1 - b1**step)  # LAMB's schedule goes on
                p[i] = p[i] - size * coeff * u
                coeffs.append(coeff)
    return p, coeffs


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_compression_stage_math_on_one_process(weight_decay):
    params = _params()
    opt = OneBitLamb(params, lr=1e-2, freeze_step=3, weight_decay=weight_decay)
    for step in range(1, 8):
        _grads(params, step)
        opt.step()
    expected, coeffs = _reference_onebit_lamb(_params(), 7, lr=1e-2, freeze=3, wd=weight_decay)
    for i, (actual, want) in enumerate(zip(params, expected)):
        assert_close(actual.detach(), want.float(), name=f"parameter {i}")
    assert_close(torch.tensor(opt.get_lamb_coeffs()), torch.tensor(coeffs, dtype=torch.float32), name="coefficients")
    assert opt.lamb_freeze_key and all(c != 1.0 for c in coeffs)


def test_flat_partition_with_segments_equals_whole_parameters():
    """The ZeRO layout: one flat tensor (with padding) holding every parameter, ``segments``
    naming them; coefficients stay per original parameter, in both stages."""
    whole = _params()
    sizes = [p.numel() for p in whole]
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in whole] + [torch.zeros(3)]))
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    segments = torch.tensor([[s, n, i] for i, (s, n) in enumerate(zip(starts, sizes))], dtype=torch.int64)
    a = OneBitLamb(whole, lr=1e-2, freeze_step=3, weight_decay=0.01)
    b = OneBitLamb([{"params": [flat], "segments": segments, "num_segments": 3}], lr=1e-2, freeze_step=3,
                   weight_decay=0.01)
    for step in range(6):
        _grads(whole, step)
        flat.grad = torch.cat([p.grad.reshape(-1) for p in whole] + [torch.zeros(3)])
        a.step()
        b.step()
        assert_close(torch.tensor(b.get_lamb_coeffs()), torch.tensor(a.get_lamb_coeffs()), name=f"step {step}")
    got = flat.detach()[: sum(sizes)]
    assert_close(got, torch.cat([p.detach().reshape(-1) for p in whole]), name="parameters")
    assert not flat.detach()[sum(sizes):].any(), "padding moved"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_coeff": -1.0}, "max_coeff must be a number >= 0"),
    ({"min_coeff": 2.0, "max_coeff": 1.0}, "need min_coeff <= max_coeff"),
    ({"factor_min": 5.0}, "need factor_min <= factor_max"),
    ({"coeff_beta": 1.0}, "coeff_beta must be a number in [0, 1)"),
    ({"factor_threshold": "x"}, "factor_threshold must be a number >= 0"),
    ({"freeze_step": 0}, "freeze_step must be an int >= 1"),
    ({"comm_backend_name": "hccl"}, "comm_backend_name='hccl' is not supported"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        OneBitLamb(_params(), **kwargs)


def test_state_dict_round_trip_mid_compression():
    again, params, resumed = round_trip_mid_compression(OneBitLamb, torch.bfloat16)
    state = resumed.state[again[0]]
    assert state["exp_avg_sq_fresh"].dtype == torch.float32 and state["lamb_coeff_freeze"].dtype == torch.float32
    for a, b in zip(again, params):
        assert torch.equal(a, b)


def test_config_defaults_are_deepspeeds_and_build():
    section, problems = check_typed_section("optimizer", {"type": "OneBitLamb", "params": {"freeze_step": 5}})
    assert not problems
    params = section["params"]
    assert {k: params[k] for k in ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                                   "factor_threshold")} == {"max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9,
                                                            "factor_max": 4.0, "factor_min": 0.5,
                                                            "factor_threshold": 0.1}
    opt = build_optimizer(section, _params())
    assert isinstance(opt, OneBitLamb) and opt.freeze_step == 5 and opt.factor_max == 4.0


@pytest.mark.parametrize("params, message", [
    ({"factor_min": 5.0}, "`optimizer.params.factor_min` (5.0) must not exceed `optimizer.params.factor_max` (4.0)"),
    ({"min_coeff": 20.0}, "`optimizer.params.min_coeff` (20.0) must not exceed `optimizer.params.max_coeff` (10.0)"),
    ({"coeff_beta": 1.0}, "`optimizer.params.coeff_beta` should be less than 1"),
    ({"factor_threshold": -0.1}, "`optimizer.params.factor_threshold` should be greater than or equal to 0"),
    ({"factor_threshld": 0.1}, "did you mean 'optimizer.params.factor_threshold'"),
])
def test_config_refuses_bad_values(params, message):
    section, problems = check_typed_section("optimizer", {"type": "OneBitLamb", "params": params})
    assert section is None and any(message in p for p in problems), problems
