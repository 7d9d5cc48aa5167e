"""Tokenizers for ``tachyon train``: Hugging Face ``tokenizers`` objects behind a small adapter.

Two tokenizers come with the package, both byte-level (any Unicode text encodes, nothing is
unknown, and ``decode(encode(text)) == text`` exactly):

- "bpe" (the default): byte-level BPE with 2048 ids, trained once on the corpus' train split by
  :func:`train_bpe` and shipped as ``assets/tokenizer.json`` (the standard ``tokenizers`` file,
  so ``tokenizers.Tokenizer.from_file`` and ``transformers.PreTrainedTokenizerFast`` load it as
  it is). Most frequent words are one token; text needs ~2.7 characters per token.
- "byte": one token per UTF-8 byte (262 ids), built in code as a BPE model with no merges.

Any other ``tokenizer.json`` that keeps the layout below can be named by its path.

Layout (what the datasets rely on): ids 0-5 are the special tokens, regular tokens follow.

=====  =========  ==============================================================
id     token      used by
=====  =========  ==============================================================
0      [PAD]      collate padding (attention_mask 0, label -100)
1      [MASK]     masked-LM inputs (BERT's 80 % case)
2      [CLS]      first token of a masked-LM sample
3      [SEP]      last token of a masked-LM sample
4      [BOS]      optional start of a causal-LM document
5      [EOS]      end of a document in the training stream
=====  =========  ==============================================================

Special tokens are only produced by the ``add_*`` flags and the datasets: ``encode`` treats the
text "[MASK]" as plain text (``tokenizers``' ``encode_special_tokens``), so no input text can
inject one. Models pad the embedding table to a multiple of 64 themselves
(:func:`padded_vocab_size`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[CLS]", "[SEP]", "[BOS]", "[EOS]")
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)
PAD_ID, MASK_ID, CLS_ID, SEP_ID, BOS_ID, EOS_ID = range(NUM_SPECIAL_TOKENS)
TOKENIZER_NAMES = ("bpe", "byte")
BPE_RESOURCE = ("assets", "tokenizer.json")
BPE_VOCAB_SIZE = 2048
"""Ids of the shipped BPE tokenizer (examples/README.md says why 2048)."""


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (for the embedding / LM head)."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size and multiple must be >= 1, got {vocab_size} and {multiple}")
    return -(-vocab_size // multiple) * multiple


def _tokenizers() -> Any:
    """The ``tokenizers`` package (imported on first use: ``import tachyon.data`` works without it)."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("the tokenizers package is not installed; the tachyon tokenizers need it: "
                          "pip install 'tachyon[train]'") from None
    return tokenizers


def _byte_level(backend: HFTokenizer) -> HFTokenizer:
    """GPT-2's byte-level pre-tokenizer (no added prefix space, so round trips are exact) and decoder."""
    tk = _tokenizers()
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    return backend


def train_bpe(texts: Iterable[str], vocab_size: int = BPE_VOCAB_SIZE) -> HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids learned from ``texts``.

    The shipped ``assets/tokenizer.json`` is ``train_bpe(load_works("train")).save(path)``
    (``tests/data/test_tokenizer.py`` checks, in a slow test, that it still comes out the same):
    the special tokens first (ids 0-5), then the 256 byte symbols, then the merges."""
    tk = _tokenizers()
    backend = _byte_level(tk.Tokenizer(tk.models.BPE()))
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return backend


def byte_tokenizer_backend() -> HFTokenizer:
    """The "byte" tokenizer as a ``tokenizers.Tokenizer``: a BPE model whose vocabulary is the 6
    special tokens and the 256 byte symbols, with no merges (one token per byte)."""
    tk = _tokenizers()
    symbols = sorted(tk.pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _BYTE_OF_SYMBOL[ch])
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: NUM_SPECIAL_TOKENS + i for i, symbol in enumerate(symbols)})
    backend = _byte_level(tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[])))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return backend


def _bytes_to_symbols() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte value (what ByteLevel maps bytes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[chr(byte)] = byte
        else:
            symbols[chr(256 + extra)] = byte
            extra += 1
    return symbols


_BYTE_OF_SYMBOL = _bytes_to_symbols()


class Tokenizer:
    """A ``tokenizers.Tokenizer`` (``self.backend``) with what the datasets and the train job use:
    the special ids by name, ``encode`` to ``list[int]`` or ``torch.int64`` tensors, whole
    documents as one stream, and ``decode``.

    Raises ValueError when ``backend`` does not hold the special tokens at ids 0-5.
    """

    special_tokens = SPECIAL_TOKENS
    pad_id, mask_id, cls_id, sep_id, bos_id, eos_id = PAD_ID, MASK_ID, CLS_ID, SEP_ID, BOS_ID, EOS_ID

    def __init__(self, backend: HFTokenizer, name: str = "custom") -> None:
        found = [backend.token_to_id(token) for token in SPECIAL_TOKENS]
        if found != list(range(NUM_SPECIAL_TOKENS)):
            raise ValueError(f"tokenizer {name!r}: the special tokens {list(SPECIAL_TOKENS)} must have ids 0-5; "
                             f"they have {found} (None: missing)")
        backend.encode_special_tokens = True  # "[MASK]" in a text is text, not the mask token
        self.backend, self.name = backend, name

    @property
    def vocab_size(self) -> int:
        """Number of token ids: ids are in ``[0, vocab_size)``."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def num_regular_tokens(self) -> int:
        """How many ids are not special tokens (``vocab_size - 6``)."""
        return self.vocab_size - NUM_SPECIAL_TOKENS

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"

    def token_to_id(self, token: str) -> int:
        """Id of a token as the vocabulary writes it ("[MASK]", "Ġlord" for " lord")."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a token of {self!r} (byte-level tokens write a leading space as 'Ġ')")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's name of one id (a special token's name, or e.g. "Ġlord")."""
        self._check_ids([token_id])
        return self.backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < NUM_SPECIAL_TOKENS

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """``text`` as token ids, optionally between [BOS] and [EOS]."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def encode_tensor(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> torch.Tensor:
        """Like :meth:`encode`, as a 1-D ``torch.int64`` tensor."""
        return torch.tensor(self.encode(text, add_bos=add_bos, add_eos=add_eos), dtype=torch.int64)

    def encode_documents(self, documents: Iterable[str], *, separator: str = "eos") -> torch.Tensor:
        """Many documents as one 1-D ``torch.int64`` stream (encoded in parallel by ``tokenizers``).

        ``separator`` is "eos" (each document followed by [EOS]), "bos" (each preceded by [BOS])
        or "none" (documents simply concatenated)."""
        if separator not in ("eos", "bos", "none"):
            raise ValueError(f"separator must be one of ('eos', 'bos', 'none'), got {separator!r}")
        documents = list(documents)
        for position, doc in enumerate(documents):
            if not isinstance(doc, str):
                raise ValueError(f"documents must be strs; documents[{position}] is a {type(doc).__name__}")
        ids: list[int] = []
        for encoding in self.backend.encode_batch(documents, add_special_tokens=False):
            ids += ([BOS_ID] if separator == "bos" else []) + encoding.ids + ([EOS_ID] if separator == "eos" else [])
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special_tokens: bool = False) -> str:
        """Token ids back to text; the exact inverse of :meth:`encode`. Special tokens become their
        names ("[MASK]") or, with ``skip_special_tokens``, nothing. Byte runs that are not valid
        UTF-8 (possible for sampled ids, never for ids from ``encode``) decode to U+FFFD."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dim()}-D {ids.dtype}")
            ids = ids.tolist()
        ids = list(ids)
        self._check_ids(ids)
        if skip_special_tokens:
            return self.backend.decode(ids, skip_special_tokens=True)
        # the byte-level decoder would glue special tokens' names to the text around them: decode runs apart
        pieces, run = [], []
        for token_id in ids:
            if token_id >= NUM_SPECIAL_TOKENS:
                run.append(token_id)
                continue
            if run:
                pieces.append(self.backend.decode(run))
                run = []
            pieces.append(SPECIAL_TOKENS[token_id])
        if run:
            pieces.append(self.backend.decode(run))
        return "".join(pieces)

    def to_transformers(self) -> Any:
        """This tokenizer as a ``transformers.PreTrainedTokenizerFast`` (needs the ``hf`` extra),
        with its pad/mask/cls/sep/bos/eos tokens named."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.backend, pad_token="[PAD]", mask_token="[MASK]",
                                       cls_token="[CLS]", sep_token="[SEP]", bos_token="[BOS]", eos_token="[EOS]")

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab_size = self.vocab_size
        for position, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"ids must be ints in [0, {vocab_size}); ids[{position}] is {token_id!r}")


def bpe_path() -> Path:
    """Where the shipped BPE ``tokenizer.json`` is (inside the installed package)."""
    return Path(str(resources.files("tachyon.data").joinpath(*BPE_RESOURCE)))


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str = "bpe") -> Tokenizer:
    """A tokenizer by name: "bpe" (the shipped tokenizer.json, 2048 ids), "byte" (262 ids), or
    the path of a ``tokenizer.json`` with the special tokens at ids 0-5. Cached: the same
    object for the same name."""
    if not isinstance(name, str):
        raise ValueError(f"tokenizer must be one of {TOKENIZER_NAMES} or a tokenizer.json path, got {name!r}")
    tk = _tokenizers()
    if name == "bpe":
        return Tokenizer(tk.Tokenizer.from_file(str(bpe_path())), "bpe")
    if name == "byte":
        return Tokenizer(byte_tokenizer_backend(), "byte")
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"tokenizer must be one of {TOKENIZER_NAMES} or the path of a tokenizer.json file; "
                         f"got {name!r}, which is neither")
    try:
        backend = tk.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"tokenizer {name!r}: not a tokenizers JSON file ({error})") from None
    return Tokenizer(backend, str(path))
