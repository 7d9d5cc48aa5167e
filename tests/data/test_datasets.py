"""Causal- and masked-LM datasets: shapes and dtypes, correct labels, BERT's masking rates within
statistical bounds, determinism per (seed, epoch, index), collation and DistributedSampler use."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tachyon.data import (
    CLS_ID, EOS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL_TOKENS, PAD_ID, SEP_ID, VALIDATION_MASK_PROB, CausalLMDataset,
    MaskedLMDataset, build_lm_datasets, collate, load_tokenizer, load_works, sample_seed,
)

KEYS = {"input_ids", "attention_mask", "labels"}
BYTE = load_tokenizer("byte")  # 256 regular ids (6-261): random replacements hit the original with p = 1/256


def _stream(n: int, seed: int = 0) -> torch.Tensor:
    """Random regular byte-tokenizer ids."""
    return torch.randint(NUM_SPECIAL_TOKENS, BYTE.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _mlm(tokens, seq_len, **kwargs) -> MaskedLMDataset:
    return MaskedLMDataset(tokens, seq_len, tokenizer=BYTE, **kwargs)


def _check_sample(sample, seq_len):
    assert set(sample) == KEYS
    for key, value in sample.items():
        assert value.dtype == torch.int64 and value.shape == (seq_len,), f"{key}: {value.dtype} {tuple(value.shape)}"
    assert bool((sample["attention_mask"] == 1).all())


# ----------------------------------------------------------------------------- causal LM

@pytest.mark.parametrize("n, seq_len, stride", [(1000, 16, None), (1001, 16, None), (97, 7, 3), (17, 16, None)])
def test_causal_windows_and_shifted_labels(n, seq_len, stride):
    tokens = _stream(n).to(torch.int16)  # any integer storage dtype; samples come out int64
    ds = CausalLMDataset(tokens, seq_len, stride=stride)
    step = stride or seq_len
    assert len(ds) == (n - seq_len - 1) // step + 1
    for i in (0, 1 % len(ds), len(ds) - 1):
        sample = ds[i]
        _check_sample(sample, seq_len)
        start = i * step
        assert sample["input_ids"].tolist() == tokens[start:start + seq_len].tolist()
        assert sample["labels"].tolist() == tokens[start + 1:start + seq_len + 1].tolist()
        assert sample["labels"][:-1].tolist() == sample["input_ids"][1:].tolist()
    assert ds[-1]["input_ids"].tolist() == ds[len(ds) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_causal_samples_do_not_alias_the_stream():
    tokens = _stream(100)
    sample = CausalLMDataset(tokens, 10)[0]
    sample["input_ids"].zero_()
    sample["labels"].zero_()
    assert tokens[:11].tolist() == _stream(100)[:11].tolist()


def test_causal_loss_with_labels_as_given():
    """Labels are already shifted: a model that outputs the next token exactly has zero loss."""
    tokens = _stream(200)
    sample = CausalLMDataset(tokens, 32)[2]
    logits = torch.full((32, 262), -1e4).scatter_(1, sample["labels"][:, None], 1e4)
    assert torch.nn.functional.cross_entropy(logits, sample["labels"]).item() == 0.0


# ----------------------------------------------------------------------------- masked LM

def _mlm_counts(ds, indices):
    selected = masked = randomized = unchanged = 0
    for i in indices:
        sample = ds[i]
        n = ds.content_len
        original = ds.tokens[i * n:(i + 1) * n]
        inputs, labels = sample["input_ids"][1:-1], sample["labels"][1:-1]
        chosen = labels != IGNORE_INDEX
        assert labels[chosen].tolist() == original[chosen].tolist(), "labels must be the original tokens"
        assert inputs[~chosen].tolist() == original[~chosen].tolist(), "unselected tokens must be untouched"
        assert int((inputs[chosen] < NUM_SPECIAL_TOKENS).sum()) == int((inputs[chosen] == MASK_ID).sum()), \
            "a replaced token is [MASK] or a regular byte, never another special token"
        selected += int(chosen.sum())
        masked += int((inputs[chosen] == MASK_ID).sum())
        randomized += int(((inputs != original) & (inputs != MASK_ID) & chosen).sum())
        unchanged += int(((inputs == original) & chosen).sum())
    return selected, masked, randomized, unchanged


def _within(count, total, p, sigmas=5.0):
    """``count`` of ``total`` Bernoulli(p) draws lies within ``sigmas`` standard deviations."""
    sd = math.sqrt(total * p * (1 - p))
    message = f"{count}/{total} = {count / total:.4f}, expected {p:.4f} +- {sigmas * sd / total:.4f}"
    return abs(count - total * p) <= sigmas * sd, message


@pytest.mark.parametrize("mask_prob", [0.15, 0.4])
def test_masking_rate_and_80_10_10_split(mask_prob):
    seq_len = 130
    ds = _mlm(_stream(128 * 200 + 5), seq_len, mask_prob=mask_prob, seed=1234)
    assert len(ds) == 200
    positions = len(ds) * ds.content_len
    selected, masked, randomized, unchanged = _mlm_counts(ds, range(len(ds)))
    ok, msg = _within(selected, positions, mask_prob)
    assert ok, f"selection rate: {msg}"
    # a random replacement equals the original byte with probability 1/256 and then looks unchanged
    for name, count, p in (("[MASK]", masked, 0.8), ("random", randomized, 0.1 * 255 / 256),
                           ("unchanged", unchanged, 0.1 + 0.1 / 256)):
        ok, msg = _within(count, selected, p)
        assert ok, f"{name} share of the selected tokens: {msg}"


def test_masked_sample_layout():
    ds = _mlm(_stream(1000), 64, seed=0)
    assert len(ds) == 1000 // 62
    for i in (0, len(ds) - 1):
        sample = ds[i]
        _check_sample(sample, 64)
        assert sample["input_ids"][0] == CLS_ID and sample["input_ids"][-1] == SEP_ID
        assert sample["labels"][0] == IGNORE_INDEX and sample["labels"][-1] == IGNORE_INDEX
        assert int((sample["labels"] != IGNORE_INDEX).sum()) >= 1


def test_special_tokens_in_the_stream_are_never_selected():
    tokens = _stream(2000)
    tokens[::7] = EOS_ID
    ds = _mlm(tokens, 50, mask_prob=0.9, seed=3)
    for i in range(len(ds)):
        original = tokens[i * 48:(i + 1) * 48]
        sample = ds[i]
        is_eos = original == EOS_ID
        assert bool((sample["labels"][1:-1][is_eos] == IGNORE_INDEX).all())
        assert bool((sample["input_ids"][1:-1][is_eos] == EOS_ID).all())


def test_at_least_one_prediction_per_sample():
    ds = _mlm(_stream(300), 3, mask_prob=0.01, seed=5)
    assert all(int((ds[i]["labels"] != IGNORE_INDEX).sum()) == 1 for i in range(len(ds)))


def test_masks_are_deterministic_per_seed_epoch_index():
    tokens = _stream(5000)
    a, b = _mlm(tokens, 40, seed=7), _mlm(tokens.clone(), 40, seed=7)
    from_a = {i: a[i] for i in (5, 3, 90, 0)}
    from_b = {i: b[i] for i in (0, 90, 3, 5)}  # another instance, another access order
    for i in from_a:
        assert all(torch.equal(from_a[i][k], from_b[i][k]) for k in KEYS), f"sample {i} differs between instances"
    assert not torch.equal(a[3]["labels"], _mlm(tokens, 40, seed=8)[3]["labels"])
    b.set_epoch(1)
    assert not torch.equal(a[3]["labels"], b[3]["labels"]), "a new epoch draws new masks"
    a.set_epoch(1)
    assert torch.equal(a[3]["input_ids"], b[3]["input_ids"])
    assert len({sample_seed(s, e, i) for s in range(4) for e in range(4) for i in range(64)}) == 4 * 4 * 64


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_len": 2}, "seq_len must be an int >= 3"),
    ({"seq_len": 8.0}, "seq_len must be an int >= 3"),
    ({"mask_prob": 0.0}, r"mask_prob must be a number in \(0, 1\]"),
    ({"mask_prob": 1.5}, "mask_prob must be a number"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"mask_token_prob": 0.95, "random_token_prob": 0.1}, "mask_token_prob \\+ random_token_prob must be <= 1"),
    ({"seq_len": 1000}, "tokens must hold at least seq_len - 2 = 998 tokens"),
])
def test_masked_bad_arguments(kwargs, message):
    args = {"seq_len": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        MaskedLMDataset(_stream(100), **args)


@pytest.mark.parametrize("tokens, seq_len, message", [
    (torch.zeros(2, 50, dtype=torch.long), 8, "tokens must be a 1-D integer tensor"),
    (torch.zeros(50), 8, "tokens must be a 1-D integer tensor"),
    (torch.zeros(8, dtype=torch.long), 8, "at least seq_len \\+ 1 = 9 tokens"),
    (torch.zeros(50, dtype=torch.long), 0, "seq_len must be an int >= 1"),
])
def test_causal_bad_arguments(tokens, seq_len, message):
    with pytest.raises(ValueError, match=message):
        CausalLMDataset(tokens, seq_len)


def test_mask_set_epoch_rejects_negative():
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        MaskedLMDataset(_stream(100), 16).set_epoch(-1)


# ----------------------------------------------------------------------------- collate, loaders

def test_collate_stacks_and_pads():
    ds = CausalLMDataset(_stream(100), 8)
    batch = collate([ds[0], ds[1], ds[2]])
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (3, 8) for k in KEYS}
    assert torch.equal(batch["input_ids"][1], ds[1]["input_ids"])
    short = {k: v[:5] for k, v in ds[3].items()}
    padded = collate([ds[0], short])
    assert padded["input_ids"][1, 5:].tolist() == [PAD_ID] * 3
    assert padded["attention_mask"][1].tolist() == [1] * 5 + [0] * 3
    assert padded["labels"][1, 5:].tolist() == [IGNORE_INDEX] * 3
    assert collate([ds[0], short], pad_id=0)["input_ids"][1, 5:].tolist() == [0] * 3
    with pytest.raises(ValueError, match="samples must be a non-empty list"):
        collate([])
    with pytest.raises(ValueError, match="samples must all have the keys"):
        collate([ds[0], {"input_ids": ds[1]["input_ids"]}])


def test_distributed_ranks_see_disjoint_deterministic_batches():
    ds = _mlm(_stream(4000), 32, seed=11)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
        batches = list(DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate))
        again = list(DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate))
        assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again))
        indices = list(sampler)
        assert torch.equal(batches[0]["labels"], torch.stack([ds[i]["labels"] for i in indices[:4]]))
        seen.append(set(indices))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == len(ds) // 2 * 2


def test_build_lm_datasets_on_the_corpus():
    train, val = build_lm_datasets("causal", 256)
    assert isinstance(train, CausalLMDataset) and len(train) == (train.tokens.numel() - 257) // 256 + 1
    assert train.tokenizer is load_tokenizer("bpe") and 1.0e6 < train.tokens.numel() < 1.1e6
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.07
    assert train.tokenizer.decode(train[0]["input_ids"]).startswith("ANTONY AND CLEOPATRA")
    assert int((train.tokens == EOS_ID).sum()) == 24 and int((val.tokens == EOS_ID).sum()) == 24
    assert train.tokens.tolist()[:50] == train.tokenizer.encode(load_works("train")[0])[:50]
    with pytest.raises(ValueError, match="objective must be one of"):
        build_lm_datasets("seq2seq", 128)


def test_masked_validation_hides_every_scored_token():
    """Training keeps BERT's 80/10/10 at its own mask_prob; validation masks 15 % and shows [MASK]
    at every scored position, so its loss can only use the context."""
    train, val = build_lm_datasets("masked", 128, seed=3, mask_prob=0.3)
    assert train.tokenizer.name == "bpe" and isinstance(train, MaskedLMDataset) and train.seed == val.seed == 3
    assert (train.mask_prob, train.mask_token_prob, train.random_token_prob) == (0.3, 0.8, 0.1)
    assert (val.mask_prob, val.mask_token_prob, val.random_token_prob) == (VALIDATION_MASK_PROB, 1.0, 0.0)
    scored = inputs = 0
    for i in range(len(val)):
        sample = val[i]
        _check_sample(sample, 128)
        chosen = sample["labels"] != IGNORE_INDEX
        scored += int(chosen.sum())
        inputs += int((sample["input_ids"][chosen] == MASK_ID).sum())
    assert scored == inputs > 0, f"{scored - inputs} of {scored} scored validation inputs are not [MASK]"
    ok, msg = _within(scored, len(val) * 126 - 24, VALIDATION_MASK_PROB)
    assert ok, f"validation selection rate: {msg}"
