"""Map-style datasets for causal-LM (GPT) and masked-LM (BERT) training on a token stream.

Both slice one 1-D token tensor into fixed-length, non-overlapping windows, so every sample is
full (no padding, ``attention_mask`` all ones) and sample ``i`` is a pure function of ``i``:
a ``DistributedSampler`` can hand any index to any rank, and a resumed run sees the same samples.
Every sample is a dict of 1-D ``torch.int64`` tensors of length ``seq_len``::

    {"input_ids": [seq_len], "attention_mask": [seq_len], "labels": [seq_len]}

``labels`` is -100 wherever no prediction is scored (``F.cross_entropy(..., ignore_index=-100)``,
the Hugging Face convention). :func:`collate` stacks samples into ``[batch, seq_len]`` tensors.

Masked LM follows BERT (Devlin et al. 2018): each regular (non-special) token is selected with
probability ``mask_prob``; of the selected, 80 % become [MASK], 10 % a uniformly random regular
token, 10 % stay unchanged; labels hold the original token at selected positions only. The
choice is drawn from a generator seeded by (seed, epoch, index), so it is the same on every rank
and every run; :meth:`MaskedLMDataset.set_epoch` gives RoBERTa-style fresh masks per epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from tachyon.data.corpus import DEFAULT_VALIDATION_FRACTION, load_works
from tachyon.data.tokenizer import NUM_SPECIAL_TOKENS, PAD_ID, Tokenizer, load_tokenizer

VALIDATION_MASK_PROB = 0.15
"""Share of the validation tokens scored by masked-LM evaluation (BERT's rate, whatever training uses)."""

IGNORE_INDEX = -100
"""Label value for positions that are not predicted (``ignore_index`` of cross_entropy)."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit generator seed that depends on all of (seed, epoch, index) (splitmix64 mixing)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ epoch) ^ index) >> 1


def _as_token_tensor(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(list(tokens), dtype=torch.int64)
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be a 1-D integer tensor, got {tokens.dim()}-D {tokens.dtype}")
    return tokens.detach().cpu()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_probability(name: str, value: object, allow_zero: bool) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and (value >= 0 if allow_zero else value > 0) and value <= 1.0):
        raise ValueError(f"{name} must be a number in {'[0, 1]' if allow_zero else '(0, 1]'}, got {value!r}")
    return float(value)


def _normalize_index(index: int, length: int) -> int:
    if isinstance(index, torch.Tensor):
        index = int(index)
    if not -length <= index < length:
        raise IndexError(f"index {index} out of range for a dataset of {length} samples")
    return index % length


class CausalLMDataset(Dataset):
    """Next-token prediction windows: ``labels`` are ``input_ids`` shifted left by one.

    Sample ``i`` reads ``tokens[i*stride : i*stride + seq_len + 1]``; ``input_ids`` is its first
    ``seq_len`` tokens and ``labels`` its last ``seq_len`` (already shifted: ``labels[t]`` is the
    target of position ``t``, so the loss is ``cross_entropy(logits.flatten(0, 1), labels.flatten())``
    with no further shift). Length: ``(len(tokens) - seq_len - 1) // stride + 1``.

    Args:
        tokens: 1-D integer tensor (any integer dtype; samples come out as int64).
        seq_len: tokens per sample, >= 1.
        stride: step between windows, default ``seq_len`` (non-overlapping).
        tokenizer: the tokenizer that made ``tokens``, kept as ``self.tokenizer`` for the model's
            ``vocab_size`` and for decoding; default ``load_tokenizer("bpe")``.
    """

    def __init__(self, tokens: torch.Tensor | Sequence[int], seq_len: int, stride: int | None = None, *,
                 tokenizer: Tokenizer | None = None) -> None:
        self.tokens = _as_token_tensor(tokens)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer("bpe")
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.stride = seq_len if stride is None else _check_int("stride", stride, 1)
        if self.tokens.numel() < seq_len + 1:
            raise ValueError(f"tokens must hold at least seq_len + 1 = {seq_len + 1} tokens, "
                             f"got {self.tokens.numel()}")
        self._length = (self.tokens.numel() - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = _normalize_index(index, self._length) * self.stride
        window = self.tokens[start:start + self.seq_len + 1].to(torch.int64)  # a view if already int64
        return {
            "input_ids": window[:-1].clone(),
            "attention_mask": torch.ones(self.seq_len, dtype=torch.int64),
            "labels": window[1:].clone(),
        }


class MaskedLMDataset(Dataset):
    """BERT masked-LM samples: ``[CLS] + seq_len-2 tokens + [SEP]`` with 80/10/10 masking.

    Sample ``i`` reads ``tokens[i*(seq_len-2) : (i+1)*(seq_len-2)]`` (a trailing partial window is
    dropped). Only regular tokens (any id but the special ids 0-5) can be selected;
    special tokens already in the stream (e.g. [EOS] between documents), [CLS] and [SEP] are never
    predicted. If the Bernoulli draw selects nothing in a window that has regular tokens, one of
    them is selected so every sample contributes to the loss (only matters for tiny seq_len).

    Args:
        tokens: 1-D integer tensor of token ids.
        seq_len: length of every sample including [CLS] and [SEP], >= 3.
        mask_prob: probability that a regular token is selected for prediction, in (0, 1].
        seed: base seed (int >= 0); masks are a function of (seed, epoch, index) only.
        tokenizer: supplies ``mask_id``, ``cls_id``, ``sep_id`` and ``num_regular_tokens`` (random
            replacements are uniform over the regular ids); default ``load_tokenizer("bpe")``.
        mask_token_prob, random_token_prob: shares of the selected tokens replaced by [MASK] and
            by a random regular token (BERT: 0.8 and 0.1; the rest stay unchanged).
    """

    def __init__(
        self,
        tokens: torch.Tensor | Sequence[int],
        seq_len: int,
        mask_prob: float = 0.15,
        seed: int = 0,
        *,
        tokenizer: Tokenizer | None = None,
        mask_token_prob: float = 0.8,
        random_token_prob: float = 0.1,
    ) -> None:
        self.tokens = _as_token_tensor(tokens)
        self.seq_len = _check_int("seq_len", seq_len, 3)
        self.seed = _check_int("seed", seed, 0)
        self.mask_prob = _check_probability("mask_prob", mask_prob, allow_zero=False)
        self.mask_token_prob = _check_probability("mask_token_prob", mask_token_prob, allow_zero=True)
        self.random_token_prob = _check_probability("random_token_prob", random_token_prob, allow_zero=True)
        if mask_token_prob + random_token_prob > 1.0:
            raise ValueError("mask_token_prob + random_token_prob must be <= 1, "
                             f"got {mask_token_prob} + {random_token_prob}")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer("bpe")
        self.content_len = seq_len - 2
        if self.tokens.numel() < self.content_len:
            raise ValueError(f"tokens must hold at least seq_len - 2 = {self.content_len} tokens, "
                             f"got {self.tokens.numel()}")
        self._length = self.tokens.numel() // self.content_len
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw different masks for a new epoch (still deterministic per (seed, epoch, index))."""
        self.epoch = _check_int("epoch", epoch, 0)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = _normalize_index(index, self._length)
        n = self.content_len
        original = self.tokens[index * n:(index + 1) * n].to(torch.int64).clone()
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))
        # Fixed number of draws per sample, whatever the outcome, so the stream stays aligned.
        select_draw = torch.rand(n, generator=generator)
        action_draw = torch.rand(n, generator=generator)
        random_tokens = torch.randint(NUM_SPECIAL_TOKENS, self.tokenizer.vocab_size, (n,), generator=generator)
        fallback = int(torch.randint(0, n, (1,), generator=generator))

        candidates = original >= NUM_SPECIAL_TOKENS  # ids 0-5 are the special tokens
        selected = (select_draw < self.mask_prob) & candidates
        if not bool(selected.any()) and bool(candidates.any()):
            candidate_positions = candidates.nonzero().flatten()
            selected[candidate_positions[fallback % candidate_positions.numel()]] = True

        to_mask = selected & (action_draw < self.mask_token_prob)
        random_upper = self.mask_token_prob + self.random_token_prob
        to_random = selected & (action_draw >= self.mask_token_prob) & (action_draw < random_upper)
        tok = self.tokenizer
        content = torch.where(to_mask, torch.full_like(original, tok.mask_id), original)
        content = torch.where(to_random, random_tokens, content)
        content_labels = torch.where(selected, original, torch.full_like(original, IGNORE_INDEX))

        ignore = torch.tensor([IGNORE_INDEX])
        return {
            "input_ids": torch.cat([torch.tensor([tok.cls_id]), content, torch.tensor([tok.sep_id])]),
            "attention_mask": torch.ones(self.seq_len, dtype=torch.int64),
            "labels": torch.cat([ignore, content_labels, ignore]),
        }


def collate(samples: Sequence[dict[str, torch.Tensor]], pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: each key becomes ``[batch, max_len]``.

    Samples of equal length are stacked as they are. Shorter ones are right-padded: input_ids
    with ``pad_id``, attention_mask with 0, labels with -100, any other key with 0. Use as
    ``DataLoader(dataset, batch_size=..., collate_fn=collate)``.
    """
    if len(samples) == 0:
        raise ValueError("samples must be a non-empty list of dicts")
    keys = samples[0].keys()
    for position, sample in enumerate(samples):
        if sample.keys() != keys:
            raise ValueError(f"samples must all have the keys {sorted(keys)}; "
                             f"samples[{position}] has {sorted(sample.keys())}")
    pad_values = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    batch = {}
    for key in keys:
        tensors = [sample[key] for sample in samples]
        max_len = max(t.shape[0] for t in tensors)
        if any(t.shape[0] != max_len for t in tensors):
            fill = pad_values.get(key, 0)
            tensors = [torch.cat([t, t.new_full((max_len - t.shape[0], *t.shape[1:]), fill)]) for t in tensors]
        batch[key] = torch.stack(tensors)
    return batch


@functools.lru_cache(maxsize=8)
def _encoded_split(tokenizer: Tokenizer, split: str, validation_fraction: float) -> torch.Tensor:
    """One split of the corpus as a token stream ([EOS] after every work), encoded once per process
    and tokenizer (a few seconds for the whole corpus; the datasets only read it)."""
    return tokenizer.encode_documents(load_works(split, validation_fraction))


def build_lm_datasets(
    objective: str,
    seq_len: int,
    *,
    seed: int = 0,
    mask_prob: float = 0.15,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    tokenizer: str | Tokenizer = "bpe",
) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets over the embedded corpus for ``objective`` "causal" or "masked".

    Each split's works are tokenized as one stream with [EOS] after every work (see
    :func:`tachyon.data.corpus.load_works` for the split). ``tokenizer`` is a name for
    :func:`~tachyon.data.tokenizer.load_tokenizer` ("bpe", "byte", a tokenizer.json path) or a
    :class:`~tachyon.data.tokenizer.Tokenizer`; the model's vocabulary must hold
    ``tokenizer.vocab_size`` ids (the datasets carry it as ``dataset.tokenizer``). With "bpe",
    "train" holds about 1.06 M tokens and "validation" about 55 k ("byte": 2.9 M and 150 k).

    Masked-LM validation replaces *every* selected token by [MASK] (no 10 % random, no 10 %
    unchanged) and always uses ``mask_prob`` 0.15 with ``seed``'s masks: the scored input is never
    the answer, so a loss below the unigram entropy can only come from the context, and every
    evaluation scores the same positions.
    """
    if objective not in ("causal", "masked"):
        raise ValueError(f"objective must be one of ('causal', 'masked'), got {objective!r}")
    tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    train_tokens, validation_tokens = (_encoded_split(tokenizer, split, validation_fraction)
                                       for split in ("train", "validation"))
    if objective == "causal":
        return (CausalLMDataset(train_tokens, seq_len, tokenizer=tokenizer),
                CausalLMDataset(validation_tokens, seq_len, tokenizer=tokenizer))
    return (MaskedLMDataset(train_tokens, seq_len, mask_prob=mask_prob, seed=seed, tokenizer=tokenizer),
            MaskedLMDataset(validation_tokens, seq_len, mask_prob=VALIDATION_MASK_PROB, seed=seed,
                            tokenizer=tokenizer, mask_token_prob=1.0, random_token_prob=0.0))
