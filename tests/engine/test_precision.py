"""Precision objects: DeepSpeed's dynamic loss-scale semantics, the static scale, the builders,
and fp16 training in one process (overflow skipping, equivalence with plain PyTorch)."""

from __future__ import annotations

import pytest
import torch

from tachyon.config import load_config
from tachyon.engine.precision import (
    BF16Precision,
    DynamicLossScaler,
    FP16Precision,
    FP32Precision,
    StaticLossScaler,
    build_precision,
)
from tachyon.engine.zero import DataParallelComm
from tests.engine.zero_cases import FP16_SCALE_POWER, Case, as_tensors, fp16_overflow_on_rank, reference_train, run_cases
from tests.utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")


def _scales(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def _deepspeed_scales(init: float, window: int, overflows: list[bool]) -> list[float]:
    """DeepSpeed's DynamicLossScaler.update_scale (hysteresis 1), step by step: a clean step doubles
    when (cur_iter - last_overflow_iter) - 1 is positive and a multiple of the window."""
    scale, cur_iter, last_overflow, out = init, 0, -1, []
    for overflow in overflows:
        if overflow:
            scale, last_overflow = max(scale / 2, 1.0), cur_iter
        elif (stable := cur_iter - last_overflow - 1) > 0 and stable % window == 0:
            scale *= 2
        cur_iter += 1
        out.append(scale)
    return out


def test_dynamic_scale_doubles_after_each_window_of_clean_steps():
    scaler = DynamicLossScaler(init_scale=8.0, window=3, hysteresis=1)
    assert _scales(scaler, [False] * 7) == [8, 8, 8, 16, 16, 16, 32] == _deepspeed_scales(8.0, 3, [False] * 7)


def test_dynamic_scale_halves_on_overflow_without_hysteresis_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=8.0, window=2, hysteresis=1)
    pattern = [True, False, False, True, True, False, False, False]
    assert _scales(scaler, pattern) == [4, 4, 4, 2, 1, 1, 1, 2] == _deepspeed_scales(8.0, 2, pattern)


def test_dynamic_scale_matches_deepspeeds_unit_test_some_overflow():
    """DeepSpeed's test_dynamic_loss_scale.py::test_some_overflow: two overflows halve twice, then
    window + 1 clean steps double once."""
    scaler = DynamicLossScaler(init_scale=2.0**8, window=2, hysteresis=1)
    _scales(scaler, [True, True])
    assert scaler.scale == 2.0**6
    _scales(scaler, [False, False, False])
    assert scaler.scale == 2.0**7 and scaler.iteration == 5


def test_hysteresis_counts_overflows_even_when_not_consecutive_by_default():
    # hysteresis 2: the first overflow spends it, a later one (clean steps between, but no
    # window completed) lowers the scale; DeepSpeed restores hysteresis only on a window.
    scaler = DynamicLossScaler(init_scale=64.0, window=100, hysteresis=2)
    assert _scales(scaler, [True, False, False, True, True]) == [64, 64, 64, 32, 16]


def test_consecutive_hysteresis_forgives_overflows_separated_by_clean_steps():
    scaler = DynamicLossScaler(init_scale=64.0, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _scales(scaler, [True, False, True, False, True, True, True]) == [64, 64, 64, 64, 64, 32, 16]


def test_scale_never_drops_below_min_scale():
    scaler = DynamicLossScaler(init_scale=4.0, window=100, hysteresis=1, min_scale=1.0)
    assert _scales(scaler, [True] * 4) == [2, 1, 1, 1]


def test_scaler_state_round_trips():
    scaler = DynamicLossScaler(init_scale=64.0, window=3, hysteresis=2)
    _scales(scaler, [True, False, True])
    other = DynamicLossScaler(init_scale=1.0, window=3, hysteresis=2)
    other.load_state_dict(scaler.state_dict())
    assert _scales(other, [False, False, False, True]) == _scales(scaler, [False, False, False, True])


def test_bad_scaler_arguments():
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=0.0)
    with pytest.raises(ValueError, match="window"):
        DynamicLossScaler(window=0)
    with pytest.raises(ValueError, match="loss scale"):
        StaticLossScaler(0.0)


def test_build_precision_from_the_config():
    fp16 = build_precision(load_config({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 5,
                                                                          "hysteresis": 3},
                                        "zero_optimization": {"stage": 1}}))
    assert isinstance(fp16, FP16Precision) and fp16.loss_scale == 32.0 and fp16.scaler.hysteresis == 3
    assert fp16.model_dtype == torch.float16 and fp16.grad_accum_dtype == torch.float16
    static = build_precision(load_config({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 128}}))
    assert isinstance(static.scaler, StaticLossScaler) and static.loss_scale == 128.0
    # bf16 accumulates in bf16 unless told otherwise (DeepSpeed's default; see precision.py for
    # the memory measurement behind it); fp32 accumulation on request
    bf16 = build_precision(load_config({"train_batch_size": 1, "bf16": {"enabled": True}}))
    assert isinstance(bf16, BF16Precision) and bf16.grad_accum_dtype == torch.bfloat16
    bf16_fp32 = build_precision(load_config({"train_batch_size": 1, "bf16": {"enabled": True},
                                             "data_types": {"grad_accum_dtype": "fp32"}}))
    assert bf16_fp32.grad_accum_dtype == torch.float32
    fp32 = build_precision(load_config({"train_batch_size": 1}))
    assert isinstance(fp32, FP32Precision) and not fp32.needs_master_weights and fp32.loss_scale == 1.0


def test_fp16_unscale_and_check():
    precision = FP16Precision(StaticLossScaler(4.0))
    comm = DataParallelComm(None)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0])]
    assert not precision.unscale_and_check(grads, comm)
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [0.5]
    assert precision.unscale_and_check([torch.tensor([1.0, float("nan")])], comm)
    assert precision.unscale_and_check([torch.tensor([float("-inf")])], comm)
    loss = torch.tensor(60000.0, dtype=torch.float16)
    assert precision.scale_loss(loss).dtype == torch.float32  # scaled in fp32: no overflow here


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_skips_the_step_bit_identically_single_process(stage):
    got = fp16_overflow_on_rank(stage, [False, True, True, False, False, False, False])
    scale = 2.0**FP16_SCALE_POWER
    # DeepSpeed doubles on the clean step after a full window of 3 clean steps: the 4th after the overflow.
    # At ZeRO 1/2 the first overflow spends the hysteresis (2); without ZeRO every overflow halves.
    expected = [scale, scale, scale / 2, scale / 2, scale / 2, scale / 2, scale] if stage else \
        [scale, scale / 2, scale / 4, scale / 4, scale / 4, scale / 4, scale / 2]
    assert got["scales"] == expected
    assert got["unchanged"] == [False, True, True, False, False, False, False]
    assert got["skipped_steps"] == 2 and got["global_steps"] == 7 and got["finite"]


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_training_matches_plain_pytorch(stage):
    """fp16 weights, loss scale 2**8 (exact), fp16 gradient accumulation: the parameters after 20
    steps agree with fp32-accumulating plain PyTorch to fp16 tolerance."""
    case = Case(stage=stage, precision="fp16", gas=2, clip=0.5)
    got = run_cases([case])[case.name]
    reference = reference_train(case, 1)
    for i, (actual, expected) in enumerate(zip(as_tensors(got["params"]), reference["params"])):
        assert_close(actual, expected, dtype=torch.float16, name=f"{case.name} parameter {i}")
