"""Progressive layer drop through the engine, one process: the schedule's exact values and timing,
the forward arguments (training only), per-layer drop rates over many steps, dropped layers
untouched by the optimizer (with a control showing the check can fail), and checkpoint resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tachyon
from tachyon.config import ConfigError
from tachyon.engine.pld import ProgressiveLayerDrop
from tachyon.nn import TransformerLayer

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN, SEQ, MICRO = 16, 4, 2
SIGMAS = 5  # binomial bounds: a correct implementation fails one with probability below 1e-6


class Stack(nn.Module):
    """``depth`` pre-LN TransformerLayers (positions 1..depth) and a linear head; passes the PLD
    arguments to every layer. ``kept[step]`` records, per forward, which layers ran."""

    def __init__(self, depth: int = 3, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            TransformerLayer(HIDDEN, 2 * HIDDEN, 2, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                             layer_number=i, num_layers=depth, params_dtype=dtype)
            for i in range(1, depth + 1)
        )
        self.head = nn.Linear(HIDDEN, 1, dtype=dtype)
        self.forwards: list[list[bool]] = []
        self.calls: list[dict] = []
        for layer in self.layers:  # the attention block runs only when its layer is kept
            layer.self_attention.register_forward_hook(self._mark)

    def _mark(self, module, args, output) -> None:
        index = [layer.self_attention for layer in self.layers].index(module)
        self.forwards[-1][index] = True

    def forward(self, x, **kwargs):
        self.calls.append(dict(kwargs))
        self.forwards.append([False] * len(self.layers))
        for layer in self.layers:
            x = layer(x, **kwargs)
        return self.head(x).float().squeeze(-1)


def config(**pld) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "progressive_layer_drop": {"enabled": True, **pld},
    }


def data(step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(MICRO, SEQ, HIDDEN, generator=gen).to(dtype), torch.randn(MICRO, SEQ, generator=gen)


def train_step(engine, step: int) -> float:
    x, y = data(step)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_schedule_values_are_exact():
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.001)
    assert pld.theta_at(0) == 1.0
    assert pld.theta_at(1000) == 0.5 * math.exp(-1.0) + 0.5 == 0.6839397205857212
    for t in (1, 7, 250, 10**5):
        assert pld.theta_at(t) == (1 - 0.5) * math.exp(-0.001 * t) + 0.5
    # DeepSpeed's timing: the forwards of the step that starts at global_steps s use theta(s - 1)
    assert [pld.get_theta(s) for s in (0, 1, 2, 3)] == [1.0, 1.0, pld.theta_at(1), pld.theta_at(2)]
    assert pld.get_state(3) == {"progressive_layer_drop": True, "pld_theta": pld.theta_at(2)}
    with pytest.raises(ValueError, match=r"theta must be a number in \(0, 1\]"):
        ProgressiveLayerDrop(theta=0.0)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        ProgressiveLayerDrop(gamma=-1.0)


def test_engine_theta_after_each_step_matches_deepspeeds_test_and_reaches_the_model():
    theta, gamma = 0.4, 0.05
    model = Stack()
    engine, *_ = tachyon.initialize(model=model, config=config(theta=theta, gamma=gamma))
    assert engine.get_pld_theta() == 1.0
    for i in range(5):
        train_step(engine, i)
        # DeepSpeed's unit test: after batch i, get_pld_theta() == (1 - theta) * exp(-gamma * i) + theta
        assert engine.get_pld_theta() == (1.0 - theta) * math.exp(-gamma * i) + theta
    thetas = [call["pld_theta"] for call in model.calls]
    assert thetas == [1.0, 1.0] + [(1 - theta) * math.exp(-gamma * t) + theta for t in (1, 2, 3)]
    assert all(call["progressive_layer_drop"] is True for call in model.calls)

    engine.eval()
    with torch.no_grad():
        engine(data(0)[0])
    assert model.calls[-1] == {} and model.forwards[-1] == [True] * 3, "eval must run every layer, without PLD"
    engine.train()
    with pytest.raises(ValueError, match="which the engine passes itself"):
        engine(data(0)[0], pld_theta=0.5)
    plain, *_ = tachyon.initialize(model=Stack(), config={**config(), "progressive_layer_drop": {"enabled": False}})
    assert plain.get_pld_theta() is None
    train_step(plain, 0)
    assert plain.module.calls == [{}]


def test_each_layer_drops_at_its_scheduled_rate_over_many_steps():
    """Layer l keeps with p_l(t) = 1 - (l / L)(1 - theta(t)); over the steps the kept count has mean
    sum_t p_l(t) and variance sum_t p_l(t)(1 - p_l(t)) (independent draws)."""
    steps, theta, gamma, depth = 120, 0.2, 0.03, 3
    model = Stack(depth)
    engine, *_ = tachyon.initialize(model=model, config=config(theta=theta, gamma=gamma))
    torch.manual_seed(1)
    thetas = []
    for step in range(steps):
        thetas.append(engine.get_pld_theta())
        train_step(engine, step)
    for index in range(depth):
        p = [1 - (index + 1) / depth * (1 - t) for t in thetas]
        mean, sd = sum(p), math.sqrt(sum(q * (1 - q) for q in p))
        kept = sum(forward[index] for forward in model.forwards)
        assert abs(kept - mean) <= SIGMAS * sd, f"layer {index + 1}: kept {kept} times, expected {mean:.1f} +- {SIGMAS * sd:.1f}"
    assert sum(not f[-1] for f in model.forwards) > steps // 3, "the last layer should drop often at theta -> 0.2"


def param_state(engine, param) -> dict[str, torch.Tensor]:
    """Copies of this rank's part of ``param``'s master weights and per-element optimizer states."""
    zero = engine.zero
    index = next(i for i, s in enumerate(zero.flat.slots) if s.param is param)
    pieces = zero.master_pieces(zero.rank, whole=not zero.partitioned_masters)[index]
    master = zero.masters[zero.flat.slots[index].group]
    tensors = {"master": master.detach()}
    for key, value in engine.optimizer.state.get(master, {}).items():
        if torch.is_tensor(value) and value.shape == master.shape:
            tensors[key] = value
    return {key: torch.cat([t[off:off + hi - lo] for lo, hi, off in pieces]).clone() if pieces else t[:0].clone()
            for key, t in tensors.items()}


def layer_states(engine, model) -> list[list[dict[str, torch.Tensor]]]:
    return [[param_state(engine, p) for p in layer.parameters()] for layer in model.layers]


def changed(before: list[dict], after: list[dict]) -> set[str]:
    """Which of master / exp_avg / exp_avg_sq differ anywhere in a layer."""
    return {key for b, a in zip(before, after) for key in a if key not in b or not torch.equal(b[key], a[key])}


def run_and_check_untouched(engine, model, steps: int) -> tuple[int, int]:
    """Train; after each step, layers dropped in every forward of the step must be exactly as before
    (master weights and moments), and kept ones must have moved. Returns (dropped, kept) counts."""
    dropped_events = kept_events = 0
    gas = engine.gradient_accumulation_steps()
    for step in range(steps):
        before = layer_states(engine, model)
        start = len(model.forwards)
        for micro in range(gas):
            x, y = data(100 * step + micro)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if micro == gas - 1:
                grads = engine.zero.master_grads()
            engine.step()
        after = layer_states(engine, model)
        ran = [any(f[i] for f in model.forwards[start:]) for i in range(len(model.layers))]
        for index, was_kept in enumerate(ran):
            diff = changed(before[index], after[index])
            if was_kept:
                kept_events += 1
                assert "master" in diff, f"step {step}: layer {index + 1} ran but its weights did not move"
            elif step > 0:  # from step 1 on the moments are nonzero: AdamW on a zero grad would move them
                dropped_events += 1
                assert not diff, f"step {step}: layer {index + 1} was dropped but its {sorted(diff)} changed"
        del grads
    return dropped_events, kept_events


def test_dropped_layers_keep_their_weights_and_moments_and_the_check_can_fail():
    model = Stack()
    engine, *_ = tachyon.initialize(model=model, config=config(theta=0.1, gamma=1.0))
    torch.manual_seed(3)
    dropped, kept = run_and_check_untouched(engine, model, steps=6)
    assert dropped >= 2 and kept >= 2, (dropped, kept)

    # control: without the engine's guard, a dropped layer's zero gradient still moves AdamW's state
    control = Stack()
    engine, *_ = tachyon.initialize(model=control, config=config(theta=0.1, gamma=1.0))
    engine._unused_guard.release()
    engine._unused_guard = None
    torch.manual_seed(3)
    with pytest.raises(AssertionError, match="was dropped but its"):
        run_and_check_untouched(engine, control, steps=6)


def test_a_dropped_layer_gets_a_zero_master_gradient():
    model = Stack()
    engine, *_ = tachyon.initialize(model=model, config=config(theta=0.1, gamma=1.0))
    torch.manual_seed(3)
    seen = 0
    for step in range(6):
        x, y = data(step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        (grad,) = engine.zero.master_grads()
        pieces = engine.zero.master_pieces(0, whole=True)
        slots = engine.zero.flat.slots
        for index, ran in enumerate(model.forwards[-1]):
            for p in model.layers[index].parameters():
                ((lo, hi, off),) = pieces[next(i for i, s in enumerate(slots) if s.param is p)]
                piece = grad[off:off + hi - lo]
                assert bool(piece.any()) == ran, f"step {step}, layer {index + 1} (ran={ran}): gradient {piece.abs().max()}"
            seen += not ran
        engine.step()
    assert seen >= 2


def test_checkpoint_resumes_the_schedule(tmp_path):
    cfg = config(theta=0.3, gamma=0.2)
    model = Stack()
    engine, *_ = tachyon.initialize(model=model, config=cfg)
    torch.manual_seed(5)
    for step in range(3):
        train_step(engine, step)
    engine.save_checkpoint(tmp_path, tag="ckpt")
    rng = torch.get_rng_state()
    expected_theta = engine.get_pld_theta()
    losses = [train_step(engine, step) for step in range(3, 6)]
    thetas = [call["pld_theta"] for call in model.calls[3:]]

    resumed_model = Stack()
    resumed, *_ = tachyon.initialize(model=resumed_model, config=cfg)
    assert resumed.get_pld_theta() == 1.0
    resumed.load_checkpoint(tmp_path, tag="ckpt")
    assert resumed.global_steps == 3 and resumed.get_pld_theta() == expected_theta
    torch.set_rng_state(rng)
    assert [train_step(resumed, step) for step in range(3, 6)] == losses
    assert [call["pld_theta"] for call in resumed_model.calls] == thetas
    assert resumed_model.forwards == model.forwards[3:]


def test_pld_under_activation_checkpointing_replays_the_same_decisions():
    """The keep draw comes from the CPU generator, which checkpointing saves and restores for the
    recompute: outputs and every gradient equal the run without checkpointing (dropout on too)."""
    import copy

    torch.manual_seed(0)
    layers = [TransformerLayer(HIDDEN, 2 * HIDDEN, 2, hidden_dropout=0.1, attention_dropout=0.1, attn_input_format="bshd",
                               layer_number=i, num_layers=3) for i in (1, 2, 3)]
    plain = copy.deepcopy(layers)
    x = torch.randn(MICRO, SEQ, HIDDEN)
    dropped = 0
    for seed in range(4):
        results = []
        for checkpointed, stack in ((True, layers), (False, plain)):
            for layer in stack:
                layer.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            h = x.clone().requires_grad_()
            y = h
            for layer in stack:
                kw = {"progressive_layer_drop": True, "pld_theta": 0.3}
                y = tachyon.checkpointing.checkpoint(layer, y, **kw) if checkpointed else layer(y, **kw)
            y.square().sum().backward()
            results.append((y.detach(), h.grad, [p.grad for layer in stack for p in layer.parameters()]))
        (y_ck, dx_ck, grads_ck), (y_plain, dx_plain, grads_plain) = results
        assert torch.equal(y_ck, y_plain) and torch.equal(dx_ck, dx_plain)
        for a, b in zip(grads_ck, grads_plain):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        dropped += sum(g is None for g in grads_ck)
    assert dropped > 0


def test_a_model_whose_forward_cannot_take_the_pld_arguments_is_refused_before_anything_is_built():
    model = nn.Linear(HIDDEN, 1)
    before = [(p.detach().clone(), p.data_ptr()) for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"Linear.forward takes no progressive_layer_drop, pld_theta"):
        tachyon.initialize(model=model, config=config())
    # not moved into a flat ZeRO buffer, not changed
    assert all(torch.equal(b, p) and ptr == p.data_ptr() for (b, ptr), p in zip(before, model.parameters()))


def test_theta_is_deepspeeds_numpy_expression_to_the_bit():
    """DeepSpeed: (1. - p) * np.exp(-gamma * x) + p, evaluated with numpy's exp."""
    np = pytest.importorskip("numpy")
    from tachyon.engine.pld import ProgressiveLayerDrop

    for theta, gamma in ((0.5, 0.001), (0.1, 0.0137), (0.9, 1e-4)):
        pld = ProgressiveLayerDrop(theta, gamma)
        for t in range(0, 5000, 13):
            assert pld.theta_at(t) == (1.0 - theta) * np.exp(-gamma * t) + theta, (theta, gamma, t)
