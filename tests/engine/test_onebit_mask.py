"""1-bit Adam's ``exp_avg_mask`` through ``initialize``: a param group's mask, given for its
parameters' shape, is laid out as the engine's flat fp32 master (ZeRO stage 0 and the stage-1
partition), so the masked elements' momentum stays exactly zero after the compressed steps and
those elements stop moving, as with DeepSpeed's OnebitAdam."""

from __future__ import annotations

import pytest
import torch

import tachyon
from tachyon.compat.deepspeed.utils import safe_get_full_optimizer_state

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _engine(stage: int, mask: torch.Tensor):
    torch.manual_seed(0)
    model = Net()
    groups = [{"params": [model.fc1.weight], "exp_avg_mask": mask},
              {"params": [model.fc1.bias, *model.fc2.parameters()]}]
    config = {"train_batch_size": 2, "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = tachyon.initialize(model=model, model_parameters=groups, config=config)
    return engine, model


@pytest.mark.parametrize("stage", [0, 1])
def test_exp_avg_mask_applies_through_initialize(stage):
    mask = torch.ones(8, 6)
    mask[:3] = 0  # the first three output rows of fc1
    engine, model = _engine(stage, mask)
    group = engine.optimizer.param_groups[0]
    assert group["exp_avg_mask"] is mask  # kept as given (DeepSpeed's scripts read and replace it)
    master = group["params"][0]
    assert engine.optimizer.group_mask(0, group, master).shape == master.shape  # applied as the master is laid out
    frozen = None
    for step in range(5):
        torch.manual_seed(step)
        engine.backward(engine(torch.randn(2, 6)).square().mean())
        engine.step()
        if step == 1:  # the last warm-up step: from here on the masked rows have no momentum
            frozen = model.fc1.weight.detach().clone()
    assert engine.optimizer.in_compression_stage
    momentum = safe_get_full_optimizer_state(model.fc1.weight, "exp_avg")
    assert not momentum[:3].any() and momentum[3:].abs().min() > 0
    assert torch.equal(model.fc1.weight.detach()[:3], frozen[:3])
    assert not torch.equal(model.fc1.weight.detach()[3:], frozen[3:])
    assert safe_get_full_optimizer_state(model.fc2.weight, "exp_avg").abs().min() > 0


def _train(engine, steps: int = 4) -> None:
    for step in range(steps):
        torch.manual_seed(step)
        engine.backward(engine(torch.randn(2, 6)).square().mean())
        engine.step()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_flattened_group_mask_is_the_shaped_one(stage):
    """DeepSpeed's fp16 optimizer masks each group flattened into one tensor, so its scripts give the
    mask flattened: the same mask, cut into the group's parameters in order."""
    mask = torch.ones(8, 6)
    mask[:3] = 0
    shaped, shaped_model = _engine(stage, mask)
    flat, flat_model = _engine(stage, mask.flatten())
    laid = [e.optimizer.group_mask(0, e.optimizer.param_groups[0], e.optimizer.param_groups[0]["params"][0])
            for e in (shaped, flat)]
    assert torch.equal(laid[0], laid[1])
    _train(shaped)
    _train(flat)
    assert shaped.optimizer.in_compression_stage
    for a, b in zip(shaped_model.parameters(), flat_model.parameters()):
        assert torch.equal(a, b)
    # a group of two parameters: the mask is their 48 + 8 elements flattened, in the group's order
    torch.manual_seed(0)
    model = Net()
    bias_mask = torch.tensor([1.0, 0.0] * 4)
    groups = [{"params": [model.fc1.weight, model.fc1.bias], "exp_avg_mask": torch.cat([mask.flatten(), bias_mask])},
              {"params": list(model.fc2.parameters())}]
    config = {"train_batch_size": 2, "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = tachyon.initialize(model=model, model_parameters=groups, config=config)
    _train(engine)
    assert not safe_get_full_optimizer_state(model.fc1.weight, "exp_avg")[:3].any()
    bias_momentum = safe_get_full_optimizer_state(model.fc1.bias, "exp_avg")
    assert not bias_momentum[1::2].any() and bias_momentum[0::2].abs().min() > 0


def test_exp_avg_mask_that_fits_no_parameter_is_refused_at_initialize():
    with pytest.raises(ValueError, match=r"'exp_avg_mask' of shape \(6, 8\) does not broadcast.*own param group"):
        _engine(0, torch.ones(6, 8))
    with pytest.raises(ValueError, match=r"shape \(47,\) does not broadcast.*not their 48 elements flattened"):
        _engine(0, torch.ones(47))


def test_a_mask_replaced_or_changed_after_initialize_applies_from_the_next_step():
    """DeepSpeed's workflow: a script sets ``optimizer.param_groups[i]["exp_avg_mask"]`` (e.g. after
    loading a checkpoint, which keeps the current mask); an in-place change counts too."""
    mask = torch.ones(8, 6)
    engine, model = _engine(1, mask)
    _train(engine, 2)  # warm-up: the mask takes effect with the compressed steps
    new = torch.ones(8, 6)
    new[5:] = 0
    engine.optimizer.param_groups[0]["exp_avg_mask"] = new
    _train(engine, 2)
    assert not safe_get_full_optimizer_state(model.fc1.weight, "exp_avg")[5:].any()
    new[:2] = 0  # in place: rows 0-1 too from the next step on
    _train(engine, 1)
    momentum = safe_get_full_optimizer_state(model.fc1.weight, "exp_avg")
    assert not momentum[:2].any() and not momentum[5:].any() and momentum[2:5].abs().min() > 0
