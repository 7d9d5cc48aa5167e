"""FusedAdam: Adam/AdamW over ordinary parameters or one flat fp32 ZeRO partition.

    opt = FusedAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                    adam_w_mode=True, bias_correction=True)

``adam_w_mode=True`` is AdamW (decoupled decay: p -= lr * wd * p); ``False`` is classic Adam (L2:
wd * p added to the gradient). Each step updates every parameter of a group with one call of
tachyon.kernels.adam.multi_tensor_adam: on CUDA tensors the Triton multi-tensor kernel (one
launch for a whole flat partition), elsewhere the PyTorch reference. ``backend`` pins that choice.

State per parameter, laid out as torch.optim.AdamW's so checkpoints move between the two:
``step`` (a float32 CPU scalar tensor), ``exp_avg`` and ``exp_avg_sq`` (fp32, the param's shape).
In fp32 the updates equal torch.optim.AdamW / torch.optim.Adam (foreach=False) to rounding.
"""

from __future__ import annotations

import torch

from tachyon.backend import BACKENDS
from tachyon.engine.optim._state import advance_adam_state, check_adam_hyperparameters, restore_fp32_states
from tachyon.kernels.adam import multi_tensor_adam


def adam_group_step(state: dict, group: dict, *, adam_w_mode: bool, backend: str | None, owner: str) -> None:
    """One fused Adam update of the parameters of ``group`` that have a gradient (one
    multi-tensor launch per device); ``state``: the optimizer's per-parameter state."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ValueError(f"{owner}: sparse gradients are not supported")
        entry = state[p]
        steps.append(advance_adam_state(entry, p))
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(entry["exp_avg"])
        exp_avg_sqs.append(entry["exp_avg_sq"])
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for idx in by_device.values():
        multi_tensor_adam(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], [steps[i] for i in idx],
            lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
            adam_w_mode=adam_w_mode, bias_correction=group["bias_correction"], backend=backend,
        )


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with a fused multi-tensor step. Params: fp32 (fp16/bf16 are updated in fp32 and
    rounded back; the states are always fp32); grads fp32, fp16 or bf16. No AMSGrad."""

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, adam_w_mode: bool = True, bias_correction: bool = True,
        *, backend: str | None = None,
    ) -> None:
        check_adam_hyperparameters("FusedAdam", lr, betas, eps, weight_decay)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"FusedAdam: backend={backend!r} is not a tachyon backend; allowed: {BACKENDS}")
        self.backend = backend
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adam_group_step(self.state, group, adam_w_mode=group["adam_w_mode"], backend=self.backend, owner="FusedAdam")
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, keeping exp_avg / exp_avg_sq fp32 for fp16/bf16 params."""
        super().load_state_dict(state_dict)
        restore_fp32_states(self, state_dict, ("exp_avg", "exp_avg_sq"))
