"""BertMLM and GPT: shapes, the loss against a plain full-vocabulary computation, causality,
gradients, tied weights, dtypes and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tachyon.data import IGNORE_INDEX, CausalLMDataset, MaskedLMDataset, collate, load_tokenizer
from tachyon.train.models import GPT, BertMLM, count_parameters, sinusoidal_positions
from tests.utils import assert_close

VOCAB = 262
TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do "
        "shake the darling buds of May, and summer's lease hath all too short a date.")
BYTE = load_tokenizer("byte")
TOKENS = BYTE.encode_tensor(TEXT)


def _bert(**kw) -> BertMLM:
    args = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=24, max_batch_size=4)
    return BertMLM(**{**args, **kw})


def _gpt(**kw) -> GPT:
    return GPT(**{**dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=24), **kw})


def _masked_batch(batch: int = 3, seq: int = 19) -> dict[str, torch.Tensor]:
    data = MaskedLMDataset(TOKENS, seq, mask_prob=0.3, seed=0, tokenizer=BYTE)
    return collate([data[i] for i in range(batch)])


def _causal_batch(batch: int = 3, seq: int = 19) -> dict[str, torch.Tensor]:
    data = CausalLMDataset(TOKENS, seq, tokenizer=BYTE)
    return collate([data[i] for i in range(batch)])


def _bert_full_logits(model: BertMLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits [b, s, vocab], written from the model's parts in plain torch
    order (head over the whole sequence, as HF's BertForMaskedLM does; the padded rows dropped)."""
    x = model.token_embedding(input_ids) + model.position_embedding(torch.arange(input_ids.shape[1]))
    x = model.embedding_norm(x)
    for layer in model.layers:
        x = layer(x)
    h = model.final_norm(x)
    h = model.transform_norm(F.gelu(model.transform(h)))
    return (model.lm_head(h) + model.lm_bias)[..., :VOCAB]


def test_bert_loss_matches_the_full_sequence_head_and_starts_near_log_vocab():
    model = _bert()
    batch = _masked_batch()
    loss = model(**batch)
    assert loss.shape == () and loss.dtype == torch.float32
    logits = _bert_full_logits(model, batch["input_ids"])
    want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    assert_close(loss, want, name="BertMLM loss vs full-sequence head")
    # small init: close to a uniform guess over the vocabulary (the padded rows are never guessed)
    assert abs(loss.item() - math.log(VOCAB)) < 0.1, loss.item()
    scored = batch["labels"] != IGNORE_INDEX
    assert_close(model.logits_at(batch["input_ids"], scored), logits[scored].float(), name="logits_at")


def test_bert_output_bias_starts_the_model_at_the_given_distribution():
    prior = torch.log_softmax(torch.randn(VOCAB) * 3, dim=0)
    model = _bert(output_bias=prior)
    assert model.lm_bias[VOCAB:].eq(prior.min()).all(), "the padded rows get the smallest given value"
    batch = _masked_batch()
    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]
    unigram = -prior[targets].mean()
    # the embeddings are small at init, so the logits are about the bias alone: the loss is the prior's
    assert abs(model(**batch).item() - unigram.item()) < 0.05, (model(**batch).item(), unigram.item())
    with pytest.raises(ValueError, match=r"output_bias must be a float tensor \[vocab_size=262\]"):
        _bert(output_bias=prior[:10])


def test_bert_backward_reaches_every_parameter_and_ties_the_head():
    model = _bert()
    assert model.lm_head.weight is model.token_embedding.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # the tied weight is one parameter
    model(**_masked_batch()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        if name != "position_embedding.weight":  # rows past seq 19 get no gradient, others must
            assert param.grad.abs().sum() > 0, f"{name} got a zero gradient"
    untied = _bert(tie_embeddings=False)
    assert count_parameters(untied) == count_parameters(model) + untied.lm_head.weight.numel()


def test_bert_padding_mask_only_changes_results_through_masked_keys():
    model = _bert()
    batch = _masked_batch(batch=2)
    mask = batch["attention_mask"].clone()
    mask[:, -3:] = 0  # the last three keys are padding
    labels = batch["labels"].clone()
    labels[:, -3:] = IGNORE_INDEX
    masked = model(batch["input_ids"], mask, labels)
    changed = batch["input_ids"].clone()
    changed[:, -3:] = 7  # padded positions' content must not matter
    assert_close(model(changed, mask, labels), masked, name="loss with changed padding")
    assert (model(changed, None, labels) - masked).abs() > 1e-6  # without the mask it does matter


def test_bert_in_bf16_runs_and_stays_close_to_fp32():
    torch.manual_seed(0)
    fp32 = _bert()
    torch.manual_seed(0)
    bf16 = _bert(dtype=torch.bfloat16)
    state = fp32.state_dict()
    bf16.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()})
    batch = _masked_batch()
    loss = bf16(**batch)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - fp32(**batch).item()) < 0.05
    loss.backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in bf16.parameters())


def _gpt_manual_loss(model: GPT, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    x = model.token_embedding(input_ids)
    x = x + model.position_embedding(torch.arange(input_ids.shape[1]))
    for layer in model.layers:
        x = layer(x)
    logits = model.lm_head(model.final_norm(x))[..., :VOCAB]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_gpt_loss_shape_gradients_and_causality(position):
    model = _gpt(position=position)
    batch = _causal_batch()
    loss = model(**batch)
    assert loss.shape == () and abs(loss.item() - math.log(VOCAB)) < 0.1
    assert model.logits(batch["input_ids"]).shape == (*batch["input_ids"].shape, VOCAB)
    if position == "learned":
        assert_close(loss, _gpt_manual_loss(model, batch["input_ids"], batch["labels"]), name="GPT loss")
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    # the loss at position 9 may not depend on tokens after position 9
    labels = torch.full_like(batch["labels"], IGNORE_INDEX)
    labels[:, 9] = batch["labels"][:, 9]
    future = batch["input_ids"].clone()
    future[:, 10:] = (future[:, 10:] + 1) % 256
    with torch.no_grad():
        assert_close(model(future, None, labels), model(batch["input_ids"], None, labels), name="causal loss")
        past = batch["input_ids"].clone()
        past[:, 3] = (past[:, 3] + 1) % 256
        assert (model(past, None, labels) - model(batch["input_ids"], None, labels)).abs() > 1e-6


def test_gpt_rope_tables_stay_fp32_when_the_model_is_cast():
    model = _gpt(position="rope").to(torch.bfloat16)
    loss = model(**_causal_batch())
    assert torch.isfinite(loss)
    assert all(t.dtype == torch.float32 for t in model._rope_cache.values())


@pytest.mark.parametrize("kind", ["bert", "gpt"])
def test_bad_input_raises_value_error_naming_the_argument(kind):
    model = _bert() if kind == "bert" else _gpt()
    ids = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="labels are required"):
        model(ids)
    with pytest.raises(ValueError, match="input_ids must be an int64"):
        model(ids.int(), None, ids)
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(ids, None, ids[:, :4])
    long = torch.zeros(2, 30, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(long, None, long)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hidden_size=30, num_heads=4), "divisible"),
        (dict(num_layers=0), "num_layers"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(dtype=torch.int32), "dtype"),
    ],
)
def test_bad_model_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _bert(**kwargs)
    with pytest.raises(ValueError, match=message):
        _gpt(**kwargs)
    with pytest.raises(ValueError, match="position"):
        _gpt(position="alibi")


def test_sinusoidal_positions_have_the_requested_scale_and_distinct_rows():
    table = sinusoidal_positions(64, 32, std=0.02)
    assert table.shape == (64, 32) and table.dtype == torch.float32
    assert_close(table.pow(2).mean().sqrt(), torch.tensor(0.02), name="root mean square")  # sin^2 + cos^2 = 1
    assert_close(table[0, 1::2], torch.full((16,), 0.02 * math.sqrt(2)), name="cos(0) columns")
    distances = torch.cdist(table, table) + torch.eye(64)
    assert distances.min() > 1e-3, "two positions share a code"
    assert_close(_bert().position_embedding.weight.detach(), sinusoidal_positions(24, 32, 0.02), name="init")
    assert sinusoidal_positions(5, 7, 1.0).shape == (5, 7)  # odd width
