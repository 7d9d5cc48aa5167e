"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: DeepSpeed's constructor over tachyon's CPUAdam, and the
optimizer the engine builds from a config Adam / AdamW under ZeRO-Offload."""

from __future__ import annotations

import pytest
import torch

import tachyon.compat.deepspeed as deepspeed
from tachyon.engine.optim import CPUAdam, FusedAdam
from tests.utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_cpu_adam_takes_deepspeeds_arguments_and_steps_like_fused_adam(adamw_mode):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    # DeepSpeed's positional order: model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode
    ours = deepspeed.ops.adam.DeepSpeedCPUAdam(a.parameters(), 1e-2, True, (0.8, 0.99), 1e-6, 0.1, False, adamw_mode)
    theirs = FusedAdam(b.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, adam_w_mode=adamw_mode)
    assert isinstance(ours, CPUAdam) and ours.host_step and ours.adam_w_mode is adamw_mode
    assert ours.fp32_optimizer_states is True
    x = torch.randn(4, 5)
    for model, opt in ((a, ours), (b, theirs)):
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p.detach(), q.detach(), name=f"DeepSpeedCPUAdam(adamw_mode={adamw_mode}) vs FusedAdam")
    assert ours.state[a.weight]["exp_avg"].dtype == torch.float32


def test_deepspeed_cpu_adam_refuses_what_it_cannot_do():
    model = torch.nn.Linear(5, 3)
    with pytest.raises(NotImplementedError, match="amsgrad=True"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(model.parameters(), amsgrad=True)
    with pytest.raises(NotImplementedError, match="fp32_optimizer_states=False"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(torch.nn.Linear(5, 3).to(torch.bfloat16).parameters(),
                                            fp32_optimizer_states=False)
    # fp32 parameters: states in the parameter dtype are fp32 states
    assert deepspeed.ops.adam.DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=False)
    # a parameter that is not on the host is refused at the step, before anything changes
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    p.grad = torch.zeros(3, device="meta")
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    opt = deepspeed.ops.adam.DeepSpeedCPUAdam([q, p])
    with pytest.raises(ValueError, match="offload_optimizer"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(2)) and not opt.state


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(kind: str, offload: bool):
    torch.manual_seed(0)
    config = {"train_batch_size": 2, "optimizer": {"type": kind, "params": {"lr": 0.01, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 2, "cpu_offload": offload}}
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    for seed in range(2):
        torch.manual_seed(seed)
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    return engine


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_offloaded_config_adam_is_a_deepspeed_cpu_adam(kind):
    offloaded, on_device = _train(kind, True), _train(kind, False)
    assert isinstance(offloaded.optimizer, deepspeed.ops.adam.DeepSpeedCPUAdam)
    assert isinstance(offloaded.optimizer.optimizer, CPUAdam)
    assert not isinstance(on_device.optimizer, deepspeed.ops.adam.DeepSpeedCPUAdam)
    assert isinstance(on_device.optimizer, deepspeed.ops.adam.FusedAdam)
    assert offloaded.optimizer.adam_w_mode is True  # DeepSpeed's Adam default is AdamW-style decay
    for p, q in zip(offloaded.module.parameters(), on_device.module.parameters()):
        assert_close(p.detach(), q.detach(), name=f"{kind} offloaded vs on the device")


def test_cpu_adam_op_builder_is_compatible():
    from tachyon.compat.deepspeed.ops import op_builder

    assert op_builder.CPUAdamBuilder().is_compatible() and op_builder.COMPATIBLE_OPS["cpu_adam"]
    with pytest.raises(NotImplementedError, match="DeepSpeedCPUAdam"):
        op_builder.CPUAdamBuilder().load()
