"""The tokenizers: the shipped BPE tokenizer.json (loads with tokenizers and transformers alike,
reproducible from the corpus) and the byte tokenizer: exact round trips for any Unicode text,
special tokens that text cannot forge, and errors that name the bad argument."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, trainers

from tachyon.data import (
    BOS_ID, EOS_ID, MASK_ID, NUM_SPECIAL_TOKENS, SPECIAL_TOKENS, load_corpus, load_tokenizer, load_works,
    padded_vocab_size, train_bpe,
)
from tachyon.data.tokenizer import BPE_VOCAB_SIZE, bpe_path, byte_tokenizer_backend

BPE = load_tokenizer("bpe")
BYTE = load_tokenizer("byte")
SAMPLES = [
    "",
    "To be, or not to be: that is the question.",
    "caf\u00e9 na\u00efve \u00c6sir \u00df",            # Latin-1 range, 2-byte UTF-8
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e",     # CJK, 3 bytes each
    "\U0001f600 \U0001f3f3\ufe0f\u200d\U0001f308",     # emoji with ZWJ sequence, 4-byte UTF-8
    "e\u0301 \u0915\u094d\u0937",                       # combining marks, Devanagari conjunct
    "\x00\x01\t\n\r\x0c\x7f tabs and controls",
    "  leading spaces,\n\n\nblank lines   and trailing spaces  ",
    "[PAD][MASK][CLS] look like special tokens",
]


@pytest.mark.parametrize("tok", [BPE, BYTE], ids=["bpe", "byte"])
def test_vocab_layout(tok):
    assert [tok.id_to_token(i) for i in range(NUM_SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert [tok.pad_id, tok.mask_id, tok.cls_id, tok.sep_id, tok.bos_id, tok.eos_id] == list(range(6))
    assert tok.num_regular_tokens == tok.vocab_size - 6 == len(tok) - 6
    assert tok.is_special(MASK_ID) and not tok.is_special(NUM_SPECIAL_TOKENS)
    assert BPE.vocab_size == BPE_VOCAB_SIZE == 2048 and BYTE.vocab_size == 262


def test_byte_tokenizer_gives_one_token_per_utf8_byte():
    text = "caf\u00e9 \U0001f600"
    assert BYTE.encode(text) == [b + NUM_SPECIAL_TOKENS for b in text.encode("utf-8")]


@pytest.mark.parametrize("tok", [BPE, BYTE], ids=["bpe", "byte"])
@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact_and_never_special(tok, text):
    ids = tok.encode(text)
    assert all(i >= NUM_SPECIAL_TOKENS for i in ids), f"plain text produced a special id: {ids}"
    assert tok.decode(ids) == text
    tensor = tok.encode_tensor(text)
    assert tensor.dtype == torch.int64 and tensor.tolist() == ids and tok.decode(tensor) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(text):
    for tok in (BPE, BYTE):
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode_tensor(text, add_bos=True, add_eos=True), skip_special_tokens=True) == text


def test_bpe_round_trips_the_validation_split_in_fewer_tokens():
    text = load_corpus("validation")
    ids = BPE.encode_tensor(text)
    assert BPE.decode(ids) == text
    chars_per_token = len(text) / ids.numel()
    assert 2.5 < chars_per_token < 3.0, f"{chars_per_token:.2f} characters per BPE token on held-out text"
    for word in (" lord", " the", " love", "\n"):
        assert len(BPE.encode(word)) == 1, f"{word!r} should be one token of the 2048"


def test_shipped_file_loads_with_tokenizers_and_transformers_alike():
    text = "My lord, I have [MASK] news.\nWhat, ho! caf\u00e9"
    plain = HFTokenizer.from_file(str(bpe_path()))
    assert plain.encode(text, add_special_tokens=False).ids[:4] == BPE.encode(text)[:4]
    transformers = pytest.importorskip("transformers", reason="transformers (the hf extra) is not installed")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_path()))
    assert fast.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(6))
    ours = BPE.to_transformers()
    assert ours.mask_token_id == MASK_ID and ours.pad_token_id == 0 and ours.cls_token_id == 2
    assert ours(text, add_special_tokens=False)["input_ids"] == fast(text, add_special_tokens=False)["input_ids"]
    safe = "My lord, I have good news.\nWhat, ho! caf\u00e9"  # no special-token text: every loader agrees
    assert fast(safe, add_special_tokens=False)["input_ids"] == BPE.encode(safe)
    assert fast.decode(BPE.encode(safe)) == safe


@pytest.mark.slow
def test_shipped_tokenizer_is_reproducible_from_the_corpus():
    rebuilt = json.loads(train_bpe(load_works("train")).to_str())
    shipped = json.loads(bpe_path().read_text())
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"], "the BPE vocabulary changed"
    assert rebuilt == shipped, "same vocabulary, but another part of tokenizer.json changed"


def test_special_token_flags_and_decoding():
    for tok in (BPE, BYTE):
        ids = tok.encode("hi", add_bos=True, add_eos=True)
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID and tok.decode(ids[1:-1]) == "hi"
        assert tok.decode(ids) == "[BOS]hi[EOS]" and tok.decode(ids, skip_special_tokens=True) == "hi"
        assert tok.encode_tensor("hi", add_bos=True, add_eos=True).tolist() == ids
    # a special token between the bytes of one multi-byte character: both halves decode, lossy
    e_acute = BYTE.encode("\u00e9")
    assert BYTE.decode([e_acute[0], MASK_ID, e_acute[1]]) == "\ufffd[MASK]\ufffd"


def test_encode_documents():
    docs = ["ab", "\u00e9"]
    a, b, c3, a9 = (x + NUM_SPECIAL_TOKENS for x in (97, 98, 0xC3, 0xA9))
    assert BYTE.encode_documents(docs).tolist() == [a, b, EOS_ID, c3, a9, EOS_ID]
    assert BYTE.encode_documents(docs, separator="bos").tolist() == [BOS_ID, a, b, BOS_ID, c3, a9]
    assert BYTE.encode_documents(docs, separator="none").tolist() == [a, b, c3, a9]
    assert BYTE.encode_documents([]).numel() == 0
    works = load_works("validation")[:3]
    assert BPE.encode_documents(works).tolist() == [i for w in works for i in BPE.encode(w) + [EOS_ID]]


def test_padded_vocab_size():
    assert padded_vocab_size(262) == 320 and padded_vocab_size(2048) == 2048 and padded_vocab_size(262, 8) == 264
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        padded_vocab_size(262, 0)


def test_a_tokenizer_json_path_loads_and_a_bad_layout_is_refused(tmp_path):
    path = tmp_path / "byte.json"
    byte_tokenizer_backend().save(str(path))
    assert load_tokenizer(str(path)).encode("hi") == BYTE.encode("hi")
    wrong = tmp_path / "wrong.json"
    backend = HFTokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=["[MASK]", "[PAD]"])
    backend.train_from_iterator(["to be or not to be"], trainer)
    backend.save(str(wrong))
    with pytest.raises(ValueError, match=r"must have ids 0-5; they have \[1, 0, None"):
        load_tokenizer(str(wrong))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        load_tokenizer(str(tmp_path / "junk.json"))


@pytest.mark.parametrize("call, message", [
    (lambda: BYTE.decode([6, 262]), r"ids must be ints in \[0, 262\); ids\[1\] is 262"),
    (lambda: BYTE.decode([-1]), r"ids\[0\] is -1"),
    (lambda: BYTE.decode([1.0]), r"ids\[0\] is 1.0"),
    (lambda: BYTE.decode(torch.zeros(2, 2, dtype=torch.long)), "ids must be a 1-D integer tensor"),
    (lambda: BYTE.decode(torch.zeros(3)), "ids must be a 1-D integer tensor"),
    (lambda: BPE.encode(b"bytes"), "text must be a str, got bytes"),
    (lambda: BPE.encode_tensor(None), "text must be a str, got NoneType"),
    (lambda: BPE.encode_documents(["a"], separator="sep"), "separator must be one of"),
    (lambda: BPE.encode_documents(["a", 3]), r"documents\[1\] is a int"),
    (lambda: BPE.token_to_id("not a token"), "is not a token"),
    (lambda: BPE.id_to_token(4096), r"ids\[0\] is 4096"),
    (lambda: load_tokenizer("wordpiece"), "must be one of .'bpe', 'byte'. or the path of a tokenizer.json"),
])
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_without_the_tokenizers_package_the_error_names_the_extra(monkeypatch):
    import sys

    from tachyon.data.tokenizer import _tokenizers

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"tokenizers package is not installed.*pip install 'tachyon\[train\]'"):
        _tokenizers()
