"""What ``tachyon train`` measures on held-out text: the validation loss, the unigram baseline it is
compared with, fill-mask predictions (BERT) and generated lines (GPT).

The unigram baseline: the cross-entropy of the validation targets under the training split's
token frequencies (add-one smoothed over every id), i.e. the best loss a model can reach
without looking at the context. For the masked LM the validation inputs hold [MASK] at *every*
scored position (see :func:`tachyon.data.build_lm_datasets`), so a validation loss below the
baseline is context the model has learned to use, not a copy of its own input token. Both are
measured on the same targets, in nats per token; perplexity = exp(loss).

Evaluation runs the model itself (``engine.module``) under ``torch.no_grad()`` on a disjoint share
of the validation samples per rank, and sums (loss, correct top-1, count) over the ranks, so the
result is the per-token mean over the whole evaluated set, whatever the world size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tachyon.data import IGNORE_INDEX, NUM_SPECIAL_TOKENS, collate

__all__ = ["Evaluation", "evaluate", "evaluate_pipeline", "evaluation_indices", "fill_mask_examples", "generate_lines",
           "unigram_baseline", "unigram_log_probs"]


@dataclass
class Evaluation:
    """Per-token means over the evaluated validation targets (``tokens`` of them)."""

    loss: float
    accuracy: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def unigram_log_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 [vocab_size] log-frequencies of the ids in ``tokens``, add-one smoothed (no id has
    probability 0, so any target has a finite loss)."""
    counts = torch.bincount(tokens.flatten().to(torch.int64), minlength=vocab_size).double() + 1.0
    return torch.log(counts / counts.sum()).float()


def _targets(dataset, indices: list[int]) -> torch.Tensor:
    labels = torch.cat([dataset[i]["labels"] for i in indices])
    return labels[labels != IGNORE_INDEX]


def unigram_baseline(log_probs: torch.Tensor, dataset, indices: list[int]) -> Evaluation:
    """The loss and top-1 accuracy of always predicting the ``log_probs`` distribution, on the
    targets of ``dataset``'s samples ``indices`` (the same targets :func:`evaluate` scores)."""
    targets = _targets(dataset, indices)
    if targets.numel() == 0:
        raise ValueError("the evaluated validation samples hold no target to score")
    regular = log_probs.clone()
    regular[:NUM_SPECIAL_TOKENS] = -math.inf  # never a target
    best = int(regular.argmax())
    return Evaluation(loss=float(-log_probs[targets].double().mean()),
                      accuracy=float((targets == best).double().mean()), tokens=int(targets.numel()))


def evaluation_indices(dataset_length: int, batches: int | None, micro_batch: int, world: int) -> list[int]:
    """The validation samples one evaluation scores: all of them (``batches`` None), else the
    first ``batches`` micro-batches' worth per rank."""
    if batches is None:
        return list(range(dataset_length))
    return list(range(min(dataset_length, batches * micro_batch * world)))


def _logits_and_targets(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX
    if hasattr(model, "logits_at"):  # BertMLM: the head runs at the scored positions only
        logits = model.logits_at(batch["input_ids"], scored, batch.get("attention_mask"))
    else:
        logits = model.logits(batch["input_ids"])[scored]
    return logits, labels[scored]


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, indices: list[int], micro_batch: int, device: torch.device,
             rank: int = 0, world: int = 1, group: Any = None) -> Evaluation:
    """Loss and top-1 accuracy of ``model`` on the targets of ``dataset``'s samples ``indices``;
    rank ``r`` of ``world`` scores ``indices[r::world]`` and the sums are all-reduced over
    ``group`` (default: every process; collective when world > 1). With tensor parallelism,
    ``rank`` / ``world`` / ``group`` are the data-parallel ones: the ranks of one model copy
    score the same samples together (the model's forward is collective over them)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    mine = indices[rank::world]
    # a generator of its own: iterating a DataLoader draws from it, and the default one is the
    # training's stream of random decisions (see tachyon.train.helpers.epoch_loader)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=mine, collate_fn=collate, generator=torch.Generator())
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits, targets = _logits_and_targets(model, batch)
        totals[0] += F.cross_entropy(logits, targets, reduction="sum").double().cpu()
        totals[1] += (logits.argmax(-1) == targets).sum().double().cpu()
        totals[2] += targets.numel()
    model.train(was_training)
    if world > 1 and dist.is_available() and dist.is_initialized():
        totals = totals.to(device)
        dist.all_reduce(totals, group=group)
        totals = totals.cpu()
    return _evaluation(totals)


def _evaluation(totals: torch.Tensor) -> Evaluation:
    loss, correct, count = totals.tolist()
    if count == 0:
        raise ValueError("the evaluated validation samples hold no target to score")
    return Evaluation(loss=loss / count, accuracy=correct / count, tokens=int(count))


@torch.no_grad()
def evaluate_pipeline(engine: Any, dataset, indices: list[int], micro_batch: int) -> Evaluation:
    """:func:`evaluate` for a pipeline-parallel engine (a PipelineModule whose last stage returns
    the logits): collective over every rank of the job.

    Data-parallel rank ``r`` of ``dp`` scores ``indices[r::dp]`` with ``engine.eval_batch``
    (``gradient_accumulation_steps`` micro-batches per call, the stages in eval mode). A pipeline
    needs every micro-batch of the same size and every rank to make the same number of calls,
    so the shares are padded with copies of a sample, whose rows are left out of the sums. The
    rank holding the last stage (tensor-parallel rank 0 of it) sums the loss, the correct top-1
    predictions and the targets from the logits; the sums are all-reduced over every rank."""
    dp, rank, gas = engine.data_parallel_world_size, engine.data_parallel_rank, engine.gradient_accumulation_steps()
    device = engine.device
    mine = indices[rank::dp]
    longest = -(-len(indices) // dp)
    calls = -(-longest // (micro_batch * gas))
    padded = mine + [indices[0]] * (calls * micro_batch * gas - len(mine))
    real = torch.arange(len(padded)) < len(mine)
    mesh = engine.mesh
    counts = engine.is_last_stage() and (mesh is None or mesh.size("tp") == 1 or mesh.rank("tp") == 0)
    totals = torch.zeros(3, dtype=torch.float64)
    per_call = micro_batch * gas
    for call in range(calls):
        chunk = padded[call * per_call:(call + 1) * per_call]
        batch = collate([dataset[i] for i in chunk])
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        items = list(zip(ids.split(micro_batch), labels.split(micro_batch)))
        _, logits = engine.eval_batch(iter(items), return_logits=True)
        if not counts:
            continue
        keep = real[call * per_call:(call + 1) * per_call].to(device)
        scored = (labels != IGNORE_INDEX) & keep[:, None]
        logits, targets = logits.float()[scored], labels[scored]
        totals[0] += F.cross_entropy(logits, targets, reduction="sum").double().cpu()
        totals[1] += (logits.argmax(-1) == targets).sum().double().cpu()
        totals[2] += targets.numel()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    return _evaluation(totals)


_WORD = re.compile(r"[A-Za-z]{3,}")


def _line_around(tokenizer, ids: list[int], position: int) -> str:
    """The text of the line of ``ids`` that holds ``position``, that token shown as "____"."""
    newline = [i for i, t in enumerate(ids) if "\n" in tokenizer.decode([t])]
    start = max([i + 1 for i in newline if i < position], default=0)
    end = min([i for i in newline if i > position], default=len(ids))
    before = tokenizer.decode(ids[start:position]).lstrip()
    after = tokenizer.decode(ids[position + 1:end]).rstrip()
    return f"{before} ____{after}" if before else f"____{after}"


@torch.no_grad()
def fill_mask_examples(model: torch.nn.Module, tokenizer, tokens: torch.Tensor, seq_len: int, count: int = 5,
                       device: torch.device | str = "cpu") -> list[dict]:
    """``count`` fill-mask predictions on held-out text (``tokens``: the validation stream).

    The examples are not picked by hand: the k-th is the first token at or after (k + 0.5) /
    count of the stream that is a whole word of 3+ letters (a leading space, and the next token
    does not go on with a letter). It is replaced
    by [MASK] in a window of ``seq_len - 2`` tokens centred on it ([CLS] window [SEP], as in
    training). Returns dicts with "line" (its text line, the word as "____"), "answer" and
    "top" (the model's 3 most likely tokens as (text, probability))."""
    ids = tokens.tolist()
    n = seq_len - 2
    examples: list[dict] = []
    was_training = model.training
    model.eval()
    for k in range(count):
        position = int((k + 0.5) / count * len(ids))
        while position < len(ids) - 1 and not _is_word(tokenizer, ids[position], ids[position + 1]):
            position += 1
        if position >= len(ids) - 1:
            break
        start = min(max(0, position - n // 2), max(0, len(ids) - n))
        window = ids[start:start + n]
        local = position - start
        inputs = [tokenizer.cls_id, *window, tokenizer.sep_id]
        inputs[local + 1] = tokenizer.mask_id
        input_ids = torch.tensor([inputs], device=device)
        scored = torch.zeros_like(input_ids, dtype=torch.bool)
        scored[0, local + 1] = True
        probs = model.logits_at(input_ids, scored).softmax(-1)[0]
        top = torch.topk(probs, 3)
        examples.append({
            "line": _line_around(tokenizer, window, local),
            "answer": tokenizer.decode([window[local]]).strip(),
            "top": [(tokenizer.decode([int(i)]).strip() or repr(tokenizer.decode([int(i)])), float(p))
                    for p, i in zip(top.values, top.indices)],
        })
    model.train(was_training)
    return examples


def _is_word(tokenizer, token_id: int, next_id: int) -> bool:
    """``token_id`` is a whole word: " " + 3+ letters, and the next token does not go on with letters."""
    if token_id < NUM_SPECIAL_TOKENS:
        return False
    text, after = tokenizer.decode([token_id]), tokenizer.decode([next_id])
    return text.startswith(" ") and _WORD.fullmatch(text[1:]) is not None and not after[:1].isalpha()


@torch.no_grad()
def generate_lines(model: torch.nn.Module, tokenizer, prompts: list[str], max_new_tokens: int = 48,
                   temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                   device: torch.device | str = "cpu") -> list[str]:
    """Sampled continuations (top-k, temperature) of each prompt by a causal LM with a
    ``logits(input_ids) -> [b, s, vocab]`` method; returns prompt + continuation as text."""
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-model.max_seq_len:]], device=device)
            logits = model.logits(context)[0, -1, :tokenizer.vocab_size].float().cpu()
            logits[:NUM_SPECIAL_TOKENS] = -math.inf
            values, indices = torch.topk(logits / temperature, top_k)
            choice = torch.multinomial(values.softmax(-1), 1, generator=generator)
            ids.append(int(indices[choice]))
        outputs.append(tokenizer.decode(ids))
    model.train(was_training)
    return outputs
