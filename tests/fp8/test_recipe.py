"""FP8 recipes and delayed-scaling state: formats, recipe validation, amax history rolling, the
amax algorithms, margin, scale / scale_inv values, and the amax reduction over a 2-rank group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tachyon.fp8 import FP8_MAX, DelayedScaling, Format, GemmScaling, ScalingState, update_scales

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _step(state: ScalingState, amax: float, recipe: DelayedScaling) -> None:
    """One step: record a tensor whose amax is ``amax``, then update the scale."""
    state.record(torch.tensor([0.25 * amax, -amax, 0.5 * amax]))
    update_scales([(state, recipe, None)])


def test_fp8_max_values_are_the_dtypes_largest_finite_values():
    assert FP8_MAX == {E4M3: 448.0, E5M2: 57344.0}
    assert FP8_MAX[E4M3] == torch.finfo(E4M3).max and FP8_MAX[E5M2] == torch.finfo(E5M2).max


def test_formats_choose_forward_and_backward_dtypes():
    assert (Format.HYBRID.forward_dtype, Format.HYBRID.backward_dtype) == (E4M3, E5M2)
    assert (Format.E4M3.forward_dtype, Format.E4M3.backward_dtype) == (E4M3, E4M3)
    recipe = DelayedScaling()
    assert (recipe.forward_max, recipe.backward_max) == (448.0, 57344.0)


def test_delayed_scaling_defaults_match_transformer_engine_and_are_frozen():
    recipe = DelayedScaling()
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo, recipe.reduce_amax) == (
        0, Format.HYBRID, 16, "max", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.margin = 1


def test_e5m2_only_recipe_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="forward tensors .* need E4M3.*allowed: Format.HYBRID .* or Format.E4M3"):
        DelayedScaling(fp8_format=Format.E5M2)


@pytest.mark.parametrize("kwargs,message", [
    ({"margin": -1}, "margin must be an int >= 0; got -1"),
    ({"amax_history_len": 0}, "amax_history_len must be an int >= 1; got 0"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo='mean' is not allowed; use 'max', 'most_recent' or a callable"),
    ({"fp8_format": "HYBRID"}, "fp8_format must be a tachyon.fp8.Format"),
    ({"reduce_amax": 1}, "reduce_amax must be a bool"),
])
def test_bad_recipe_arguments_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(**kwargs)


def test_amax_history_rolls_newest_first_and_forgets_the_oldest():
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    state = ScalingState(3)
    for amax, expected in [(2.0, [0, 2, 0]), (8.0, [0, 8, 2]), (4.0, [0, 4, 8])]:
        _step(state, amax, recipe)
        assert state.amax_history.tolist() == expected  # [0] is the fresh slot of the next step


def test_record_keeps_the_running_max_within_a_step():
    state = ScalingState(4)
    state.record(torch.tensor([1.0, -3.0]))
    state.record(torch.tensor([2.0]))
    assert state.amax_history.tolist() == [3.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("algo,expected_amax", [
    ("max", 8.0),
    ("most_recent", 1.0),
    (lambda history: history[:3].mean(), (1.0 + 8.0 + 4.0) / 3),  # a callable sees the history, newest first
], ids=["max", "most_recent", "callable"])
def test_amax_compute_algorithms(algo, expected_amax):
    state = ScalingState(5)
    for amax in (4.0, 8.0):
        _step(state, amax, DelayedScaling(amax_history_len=5))
    state.record(torch.tensor([1.0]))
    assert state.amax_history.tolist() == [1.0, 8.0, 4.0, 0.0, 0.0]
    update_scales([(state, DelayedScaling(amax_history_len=5, amax_compute_algo=algo), None)])
    assert state.scale.item() == pytest.approx(448.0 / expected_amax, rel=1e-6)
    assert state.scale_inv.item() == pytest.approx(expected_amax / 448.0, rel=1e-6)


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_scale_and_scale_inv_values(margin):
    recipe = DelayedScaling(margin=margin)
    state = ScalingState()
    _step(state, 3.5, recipe)
    assert state.scale.item() == pytest.approx(448.0 / 3.5 / 2**margin, rel=1e-6)
    assert state.scale_inv.item() == pytest.approx(3.5 * 2**margin / 448.0, rel=1e-6)
    assert state.scale.dtype == state.scale_inv.dtype == state.amax_history.dtype == torch.float32


@pytest.mark.parametrize("fmt,grad_max", [(Format.HYBRID, 57344.0), (Format.E4M3, 448.0)])
def test_grad_output_state_scales_to_the_backward_format(fmt, grad_max):
    recipe = DelayedScaling(fp8_format=fmt)
    gemm = GemmScaling()
    for state in (gemm.input, gemm.grad_output):
        _step(state, 2.0, recipe)
    assert gemm.input.scale.item() == 224.0
    assert gemm.grad_output.scale.item() == grad_max / 2.0


@pytest.mark.parametrize("bad_amax", [0.0, float("inf"), float("nan")])
def test_zero_or_non_finite_amax_keeps_the_previous_scale(bad_amax):
    recipe = DelayedScaling(amax_compute_algo="most_recent")
    state = ScalingState()
    _step(state, 7.0, recipe)
    scale = state.scale.item()
    state.record(torch.tensor([bad_amax]))
    update_scales([(state, recipe, None)])
    assert state.scale.item() == scale and state.scale_inv.item() == pytest.approx(1 / scale)


def test_prepare_follows_a_new_history_length_keeping_the_newest_entries():
    state = ScalingState(4)
    state.amax_history.copy_(torch.tensor([0.0, 5.0, 6.0, 7.0]))
    state.prepare(2, torch.device("cpu"))
    assert state.amax_history.tolist() == [0.0, 5.0]
    state.prepare(3, torch.device("cpu"))
    assert state.amax_history.tolist() == [0.0, 5.0, 0.0]


def _on_two_ranks():
    """Both checks in one spawn (starting ranks is the expensive part)."""
    import tachyon
    import tachyon.nn as tnn

    rank = dist.get_rank()
    # update_scales directly: one state reduced, one with reduce_amax=False
    reduced, local = ScalingState(4), ScalingState(4)
    for state in (reduced, local):
        state.record(torch.tensor([[3.0, 12.0][rank]]))
    update_scales([(reduced, DelayedScaling(), dist.group.WORLD), (local, DelayedScaling(reduce_amax=False), dist.group.WORLD)])
    # through fp8_autocast and a module
    torch.manual_seed(0)
    layer = tnn.Linear(32, 16)  # same weights on both ranks
    x = torch.randn(16, 32) * (1 + 3 * rank)  # rank 1's input amax is 4x larger
    with tachyon.fp8_autocast(fp8_group=dist.group.WORLD):
        out = layer(x)
    (out * (1 + rank)).sum().backward()  # rank 1's grad_output amax is 2x larger
    gemm = layer.fp8_scaling["gemm"]
    return {
        "reduced_scale": reduced.scale.item(), "reduced_history": reduced.amax_history.tolist(),
        "local_scale": local.scale.item(), "input_scale": gemm.input.scale.item(),
        "grad_scale": gemm.grad_output.scale.item(), "x_amax": x.abs().max().item(),
    }


@pytest.mark.distributed
def test_amax_is_reduced_over_the_fp8_group_on_two_ranks():
    from tests.utils import run_distributed

    r0, r1 = run_distributed(_on_two_ranks, 2, timeout=120)
    assert [r0["reduced_scale"], r1["reduced_scale"]] == pytest.approx([448.0 / 12.0] * 2, rel=1e-6)
    assert r0["reduced_history"] == r1["reduced_history"] == [0.0, 12.0, 0.0, 0.0]  # identical histories
    assert [r0["local_scale"], r1["local_scale"]] == pytest.approx([448.0 / 3.0, 448.0 / 12.0], rel=1e-6)
    # fp8_autocast(fp8_group=...) at exit (input) and the backward (grad_output) use the group's max
    x_amax = max(r0["x_amax"], r1["x_amax"])
    assert r0["input_scale"] == r1["input_scale"] == pytest.approx(448.0 / x_amax, rel=1e-6)
    assert r0["grad_scale"] == r1["grad_scale"] == 57344.0 / 2.0


def _states_with_histories(n: int, backward: bool, length: int) -> list[ScalingState]:
    gen = torch.Generator().manual_seed(n)
    specials = [0.0, float("inf"), float("nan"), 1e-45, 3e38]
    states = []
    for i in range(n):
        s = ScalingState(length, backward=backward)
        s.amax_history.copy_(torch.rand(length, generator=gen) * 10 ** (i % 5 - 2))
        if i % 3 == 1:
            s.amax_history[:] = specials[i % len(specials)]  # every entry: no usable amax, or an extreme one
        s.scale.fill_(0.5 + i)
        s.scale_inv.copy_(1.0 / s.scale)
        states.append(s)
    return states


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_scales_together_matches_one_by_one(algo, margin):
    """update_scales updates the states of one recipe and role together (stacked): the same
    scales, inverses and rolled histories bit for bit as ScalingState.update one at a time,
    including histories of zeros, inf, NaN and extreme values (the scale is kept there)."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=margin)
    together = _states_with_histories(6, False, 4) + _states_with_histories(5, True, 4)
    alone = _states_with_histories(6, False, 4) + _states_with_histories(5, True, 4)
    update_scales((s, recipe, None) for s in together)
    for s in alone:
        s.update(recipe)
    for a, b in zip(together, alone):
        for name in ("scale", "scale_inv", "amax_history"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0, equal_nan=True)
    assert together[0].amax_history[0] == 0 and together[1].scale == 1.5  # rolled; an inf history keeps its scale


def test_update_scales_launches_do_not_grow_with_states():
    """The 8 states a TransformerLayer's four GEMMs update at fp8_autocast's exit cost about as
    many ops as one state alone did, not 8 times as many."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in (torch.ops.aten.unbind.int, torch.ops.aten.select.int, torch.ops.aten.view.default):
                Count.ops += 1  # views move no data and launch nothing
            return func(*args, **(kwargs or {}))

    recipe = DelayedScaling()
    one = _states_with_histories(1, False, 16)
    with Count():
        update_scales([(one[0], recipe, None)])
    single, Count.ops = Count.ops, 0
    eight = _states_with_histories(8, False, 16)
    with Count():
        update_scales((s, recipe, None) for s in eight)
    assert Count.ops <= single + 6, (Count.ops, single)


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_new_scales_is_the_delayed_scaling_formula(fp8_max, margin):
    """The scale update's short form (3 ops for the test) equals, bit for bit, the recipe's
    definition: fp8_max / amax / 2**margin where amax and that are finite and positive, else the
    old scale; over amaxes from 1e-45 to 1e38 and 0, inf, NaN, negatives."""
    from tachyon.fp8.scaling import _new_scales

    gen = torch.Generator().manual_seed(margin)
    exponents = torch.randint(-45, 39, (4000,), generator=gen).float()
    amax = torch.cat([torch.rand(4000, generator=gen) * 10 ** exponents,
                      torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 3.4e38, -1.0, -float("inf")])])
    old = torch.full_like(amax, 0.37)
    candidate = fp8_max / amax / (2.0 ** margin)
    usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(candidate) & (candidate > 0)
    expected = torch.where(usable, candidate, old)
    scale, scale_inv = _new_scales(amax, old, fp8_max, margin)
    assert torch.equal(scale, expected) and torch.equal(scale_inv, 1.0 / expected)
    assert (~usable).sum() > 8  # the kept-scale branch is exercised
