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

``host_step`` (set by ZeRO-Offload, `tachyon.engine.zero.offload`): the fp32 host tensors of a
group are updated by torch's fused CPU Adam kernel (``torch._fused_adam(w)_``, one call per group;
DeepSpeed's DeepSpeedCPUAdam role) instead of the multi-tensor reference.

CPUAdam: FusedAdam over host tensors only (``host_step`` always on), the optimizer the config's
Adam / AdamW builds under ZeRO-Offload (DeepSpeed's DeepSpeedCPUAdam: the same update, its
parameters must be on the CPU).
"""

from __future__ import annotations

import torch

from tachyon.backend import BACKENDS
from tachyon.engine.optim._state import advance_adam_state, check_adam_hyperparameters, restore_fp32_states
from tachyon.kernels.adam import multi_tensor_adam


def _host_fused(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, group: dict,
                adam_w_mode: bool) -> bool:
    """torch's fused CPU Adam over fp32 host tensors (steps already advanced); False when it does
    not apply (other dtypes, no bias correction, a torch without the kernel)."""
    fused = getattr(torch, "_fused_adamw_" if adam_w_mode else "_fused_adam_", None)
    if fused is None or not group["bias_correction"] or not all(
            t.dtype == torch.float32 for t in (*params, *grads)):
        return False
    beta1, beta2 = group["betas"]
    with torch.no_grad():
        fused(params, grads, exp_avgs, exp_avg_sqs, [], [s.detach() for s in steps], amsgrad=False, lr=group["lr"],
              beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
              grad_scale=None, found_inf=None)
    return True


def adam_group_step(state: dict, group: dict, *, adam_w_mode: bool, backend: str | None, owner: str,
                    host_step: bool = False) -> None:
    """One fused Adam update of the parameters of ``group`` that have a gradient (one
    multi-tensor launch per device); ``state``: the optimizer's per-parameter state.
    ``host_step``: CPU tensors go through torch's fused CPU Adam kernel."""
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
    for device, idx in by_device.items():
        if host_step and device.type == "cpu" and _host_fused(
                [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx], [state[params[i]]["step"] for i in idx], group, adam_w_mode):
            continue
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
        self.host_step = False
        """Set by ZeRO-Offload: CPU tensors step through torch's fused CPU Adam (module docstring)."""
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
            adam_group_step(self.state, group, adam_w_mode=group["adam_w_mode"], backend=self.backend, owner="FusedAdam",
                            host_step=self.host_step)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, keeping exp_avg / exp_avg_sq fp32 for fp16/bf16 params."""
        super().load_state_dict(state_dict)
        restore_fp32_states(self, state_dict, ("exp_avg", "exp_avg_sq"))


class CPUAdam(FusedAdam):
    """FusedAdam for host-resident fp32 masters (ZeRO-Offload; DeepSpeed's DeepSpeedCPUAdam):
    each param group is stepped by torch's fused CPU Adam kernel. A parameter with a gradient
    that is not on the CPU is refused at ``step`` (enable ``zero_optimization.offload_optimizer``
    or use FusedAdam)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adam_w_mode: bool = True, bias_correction: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                         bias_correction=bias_correction)
        self.host_step = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.device.type != "cpu":
                    raise ValueError(
                        f"CPUAdam steps host tensors; a parameter of shape {tuple(p.shape)} is on {p.device}: enable "
                        "zero_optimization.offload_optimizer ({\"device\": \"cpu\"}) or use FusedAdam")
        return super().step(closure)
