"""A DeepSpeedExamples-style CIFAR training script (training/cifar/cifar10_deepspeed.py's shape):
argparse + add_config_arguments, init_distributed, initialize with training_data, the engine's
rank / precision queries, train with backward / step, evaluate in eval mode. The data are small
synthetic images whose class a fixed random "teacher" convnet decides (no download).

DeepSpeed features used: add_config_arguments, init_distributed, initialize(args=, model=,
model_parameters=, training_data=), engine.local_rank / bfloat16_enabled / fp16_enabled /
train_micro_batch_size_per_gpu / get_global_grad_norm / was_step_applied, deepspeed.accelerator,
the engine-built DataLoader, gradients read from param.grad after backward (ZeRO stage 0),
gradient_clipping, WarmupLR, model_engine.eval().
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=4, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def synthetic_cifar(n, seed):
    """Images of 10 classes: a fixed random pattern per class plus noise."""
    prototypes = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = prototypes[labels] + 0.8 * torch.randn(n, 3, 8, 8, generator=gen)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = synthetic_cifar(512, seed=1)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss, batches = 0.0, 0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            grad_norm = torch.norm(torch.stack([p.grad.norm() for p in net.parameters() if p.grad is not None]))
            assert torch.isfinite(grad_norm)
            model_engine.step()
            assert model_engine.was_step_applied()
            running_loss += loss.item()
            batches += 1
        if local_rank == 0:
            print(f"epoch {epoch} loss: {running_loss / batches:.4f} grad_norm: {model_engine.get_global_grad_norm():.4f}")

    model_engine.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in torch.utils.data.DataLoader(synthetic_cifar(128, seed=2), batch_size=32):
            predicted = model_engine(inputs.to(local_device)).argmax(1)
            correct += (predicted == labels.to(local_device)).sum().item()
            total += labels.size(0)
    if local_rank == 0:
        print(f"accuracy: {correct / total:.3f}")


if __name__ == "__main__":
    main()
