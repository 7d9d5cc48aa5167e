"""Stand-in for DeepSpeed's tests/unit/simple_model.py: the models and data helpers its tests
use (a linear layer and cross entropy; random data), written for tachyon's compat layer."""

from __future__ import annotations

import argparse
import json
import os

import torch

from .common import preferred_dtype


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim, empty_grad=False, nlayers=1):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        if empty_grad:
            self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


class PLD_SimpleModel(SimpleModel):
    def forward(self, x, y, **kwargs):
        return super().forward(x, y)


class SimpleOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr=0.11072018):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def random_dataset(total_samples, hidden_dim, device, dtype=preferred_dtype()):
    data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    labels = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.TensorDataset(data, labels)


def random_dataloader(model, total_samples, hidden_dim, device, dtype=preferred_dtype()):
    return torch.utils.data.DataLoader(random_dataset(total_samples, hidden_dim, device, dtype=dtype),
                                       batch_size=model.train_micro_batch_size_per_gpu())


def sequence_dataloader(model, total_samples, hidden_dim, device, seq_len=32, dtype=preferred_dtype()):
    data = torch.randn(total_samples, seq_len, hidden_dim, device=device, dtype=dtype)
    labels = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, labels),
                                       batch_size=model.train_micro_batch_size_per_gpu())


def create_config_from_dict(tmpdir, config_dict):
    path = os.path.join(tmpdir, "temp_config.json")
    with open(path, "w") as handle:
        json.dump(config_dict, handle)
    return path


def create_deepspeed_args():
    args = argparse.ArgumentParser().parse_args(args="")
    args.deepspeed = True
    if torch.distributed.is_initialized():
        args.local_rank = torch.distributed.get_rank()
    return args


def args_from_dict(tmpdir, config_dict):
    args = create_deepspeed_args()
    args.deepspeed_config = create_config_from_dict(tmpdir, config_dict)
    return args
