"""A DeepSpeedExamples-style pipeline-parallel training script (training/pipeline_parallelism/
train.py's shape): a layer list in a PipelineModule split over 2 stages, trained with
engine.train_batch() from the engine's own data loader, and the data-parallel baseline in the
same file. The data are synthetic (a linear teacher decides the class; no download).

DeepSpeed features used: deepspeed.pipe.PipelineModule(layers=, loss_fn=, num_stages=,
partition_method=, activation_checkpoint_interval=), initialize(args=, model=, model_parameters=,
training_data=), engine.train_batch(), gradient_accumulation_steps as the micro-batch count,
is_first_stage / is_last_stage, deepspeed.runtime.utils.set_random_seed, init_distributed(dist_backend=).
"""

import argparse

import torch
import torch.nn as nn

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.pipe import PipelineModule


def get_args():
    parser = argparse.ArgumentParser(description="pipeline")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=12)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--seed", type=int, default=1138)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def dataset(n=1024):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    teacher = torch.randn(16, 4, generator=gen)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(1))


def layers():
    return [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]


def train_pipe(args):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = PipelineModule(layers=layers(), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=args.pipeline_parallel_size,
                         partition_method="parameters", activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=dataset())
    for step in range(args.steps):
        loss = engine.train_batch()
        if engine.global_rank == 0 and (step == 0 or step == args.steps - 1):
            print(f"step: {step:3d} / {args.steps:3d} loss: {loss:.4f}")
    assert engine.is_first_stage() != engine.is_last_stage()


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    train_pipe(args)


if __name__ == "__main__":
    main()
