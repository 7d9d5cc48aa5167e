"""A DeepSpeedExamples-style BERT pretraining loop (training/HelloDeepSpeed/train_bert_ds.py's
shape): a small transformer encoder trained on masked-token prediction, bf16, ZeRO stage 1,
gradient accumulation, a warm-up schedule, checkpoints saved with client state every few steps,
then a second run that resumes from the latest checkpoint and goes on from its step. The data are
synthetic token sequences in which every masked token can be read off the visible ones (no
download, no tokenizer).

DeepSpeed features used: initialize(model=, model_parameters=, config=dict), bf16, ZeRO-1,
gradient_accumulation_steps with backward / step on every micro-batch, is_gradient_accumulation_boundary,
global_steps / global_samples, WarmupDecayLR, save_checkpoint(save_dir, client_state=),
load_checkpoint(load_dir) -> (path, client_state), deepspeed.utils.log_dist / RepeatingLoader,
engine attribute pass-through to the model (model.vocab_size).
"""

import argparse
import logging

import torch
import torch.nn as nn

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.utils import RepeatingLoader, log_dist

VOCAB, SEQ, MASK = 32, 16, 0


class TinyBert(nn.Module):
    def __init__(self, vocab_size=VOCAB, hidden=32, layers=2, heads=4):
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.position = nn.Parameter(torch.zeros(SEQ, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, src_tokens, tgt_tokens):
        hidden = self.encoder(self.embed(src_tokens) + self.position)
        logits = self.head(hidden).float()
        mask = tgt_tokens != -100
        return nn.functional.cross_entropy(logits[mask], tgt_tokens[mask])


def masked_batches(n, seed):
    """Sequences that repeat one topic token; 30% of the positions are masked."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, 1), generator=gen).expand(n, SEQ)
    masked = torch.rand(n, SEQ, generator=gen) < 0.3
    src = tokens.masked_fill(masked, MASK)
    tgt = tokens.masked_fill(~masked, -100)
    return [{"src_tokens": s, "tgt_tokens": t} for s, t in zip(src, tgt)]


def collate(items):
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def train(checkpoint_dir, load_checkpoint_dir=None, num_iterations=24, checkpoint_every=8, batch_size=4):
    torch.manual_seed(42)
    model = TinyBert()
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 3, "total_num_steps": 40}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1000,
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
        log_dist(f"resumed at step {start_step}", ranks=[0], level=logging.INFO)
    assert model.vocab_size == VOCAB  # the model's own attribute, through the engine
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    data = torch.utils.data.DataLoader(masked_batches(512, seed=rank), batch_size=batch_size, collate_fn=collate)
    data_iterator = iter(RepeatingLoader(data))
    model.train()
    losses = []
    last = start_step - 1
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= start_step + num_iterations:
            break
        last = step
        batch = {key: value.to(model.device) for key, value in batch.items()}
        loss = model(**batch)
        model.backward(loss)
        boundary = model.is_gradient_accumulation_boundary()
        model.step()
        losses.append(loss.item())
        if boundary and rank == 0:
            print(f"step {step} global_steps {model.global_steps} samples {model.global_samples} "
                  f"loss: {sum(losses[-2:]) / 2:.4f}")
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=checkpoint_dir, client_state={"checkpoint_step": step})
    return last


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    last = train(args.checkpoint_dir)
    train(args.checkpoint_dir, load_checkpoint_dir=args.checkpoint_dir, num_iterations=8)
    if torch.distributed.get_rank() == 0:
        print(f"first run ended at step {last}")


if __name__ == "__main__":
    main()
