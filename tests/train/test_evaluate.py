"""What the train job measures: the unigram baseline and the validation loss (against plain
computations on the same targets), fill-mask picks and generation, the final table and summary."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tachyon.data import IGNORE_INDEX, NUM_SPECIAL_TOKENS, CausalLMDataset, MaskedLMDataset, load_tokenizer
from tachyon.train.evaluate import (
    Evaluation, evaluate, evaluation_indices, fill_mask_examples, generate_lines, unigram_baseline, unigram_log_probs,
)
from tachyon.train.models import GPT, BertMLM
from tachyon.train.report import final_table, summary_text
from tests.utils import assert_close

BPE = load_tokenizer("bpe")
TEXT = ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\nRough winds do shake the "
        "darling buds of May,\nAnd summer's lease hath all too short a date;\n") * 6
TOKENS = BPE.encode_tensor(TEXT)


def _validation(seq_len: int = 24) -> MaskedLMDataset:
    return MaskedLMDataset(TOKENS, seq_len, mask_prob=0.15, seed=1, tokenizer=BPE, mask_token_prob=1.0,
                           random_token_prob=0.0)


def _bert(**kw) -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(BPE.vocab_size, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=32, max_batch_size=8, **kw)


def test_unigram_log_probs_are_add_one_smoothed_frequencies():
    log_probs = unigram_log_probs(torch.tensor([7, 7, 7, 9]), vocab_size=12)
    assert log_probs.shape == (12,) and log_probs.dtype == torch.float32
    assert_close(log_probs.exp().sum(), torch.tensor(1.0), name="probabilities sum to 1")
    assert_close(log_probs[7], torch.tensor(math.log(4 / 16)), name="seen 3 times")
    assert_close(log_probs[0], torch.tensor(math.log(1 / 16)), name="never seen")


def test_unigram_baseline_is_the_cross_entropy_of_the_same_targets():
    val = _validation()
    prior = unigram_log_probs(TOKENS, BPE.vocab_size)
    indices = list(range(len(val)))
    base = unigram_baseline(prior, val, indices)
    targets = torch.cat([val[i]["labels"] for i in indices])
    targets = targets[targets != IGNORE_INDEX]
    assert base.tokens == targets.numel() > 0
    assert base.loss == pytest.approx(float(-prior[targets].double().mean()), rel=1e-6)
    best = int(prior[NUM_SPECIAL_TOKENS:].argmax()) + NUM_SPECIAL_TOKENS
    assert base.accuracy == pytest.approx(float((targets == best).double().mean()))
    assert base.perplexity == pytest.approx(math.exp(base.loss))


def test_evaluate_is_the_per_token_mean_over_every_scored_target():
    val = _validation()
    model = _bert()
    indices = list(range(len(val)))
    result = evaluate(model, val, indices, micro_batch=3, device=torch.device("cpu"))
    losses, correct = [], 0
    with torch.no_grad():
        for i in indices:
            sample = val[i]
            scored = sample["labels"] != IGNORE_INDEX
            logits = model.logits_at(sample["input_ids"][None], scored[None])
            losses.append(F.cross_entropy(logits, sample["labels"][scored], reduction="none"))
            correct += int((logits.argmax(-1) == sample["labels"][scored]).sum())
    losses = torch.cat(losses)
    assert result.tokens == losses.numel()
    assert result.loss == pytest.approx(float(losses.double().mean()), rel=1e-5)
    assert result.accuracy == pytest.approx(correct / losses.numel())
    assert model.training, "evaluate puts the model back in training mode"


def test_a_model_started_at_the_prior_scores_about_the_baseline():
    val = _validation()
    prior = unigram_log_probs(TOKENS, BPE.vocab_size)
    indices = list(range(len(val)))
    result = evaluate(_bert(output_bias=prior), val, indices, 4, torch.device("cpu"))
    base = unigram_baseline(prior, val, indices)
    assert abs(result.loss - base.loss) < 0.05, (result.loss, base.loss)


def test_evaluate_gpt_scores_every_next_token():
    data = CausalLMDataset(TOKENS, 16, tokenizer=BPE)
    torch.manual_seed(0)
    model = GPT(BPE.vocab_size, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=16)
    result = evaluate(model, data, [0, 1, 2], 2, torch.device("cpu"))
    batch = torch.stack([data[i]["input_ids"] for i in range(3)]), torch.stack([data[i]["labels"] for i in range(3)])
    with torch.no_grad():
        want = model(batch[0], None, batch[1])
    assert result.tokens == 48 and result.loss == pytest.approx(float(want), rel=1e-5)


def test_evaluation_indices():
    assert evaluation_indices(10, None, 4, 2) == list(range(10))
    assert evaluation_indices(100, 2, 4, 2) == list(range(16))
    assert evaluation_indices(10, 2, 4, 2) == list(range(10))


def test_fill_mask_picks_whole_words_evenly_and_reports_the_top_3():
    examples = fill_mask_examples(_bert(), BPE, TOKENS, seq_len=32, count=4)
    assert len(examples) == 4
    for example in examples:
        assert example["answer"].isalpha() and len(example["answer"]) >= 3
        assert example["line"].count("____") == 1 and "\n" not in example["line"]
        assert example["line"].replace("____", example["answer"]) in TEXT, example
        assert len(example["top"]) == 3 and all(0.0 <= p <= 1.0 for _, p in example["top"])
        assert [p for _, p in example["top"]] == sorted((p for _, p in example["top"]), reverse=True)
    assert examples == fill_mask_examples(_bert(), BPE, TOKENS, seq_len=32, count=4), "not deterministic"


def test_generate_lines_continue_each_prompt():
    torch.manual_seed(0)
    model = GPT(BPE.vocab_size, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=16)
    lines = generate_lines(model, BPE, ["ROMEO.\n", "JULIET.\n"], max_new_tokens=20, seed=3)
    assert [line.split("\n")[0] for line in lines] == ["ROMEO.", "JULIET."]
    assert all(line.startswith(p) and len(line) > len(p) + 10 for line, p in zip(lines, ["ROMEO.\n", "JULIET.\n"]))
    assert lines == generate_lines(model, BPE, ["ROMEO.\n", "JULIET.\n"], max_new_tokens=20, seed=3)
    assert "[MASK]" not in "".join(lines), "special tokens are never sampled"


def test_final_table_and_summary():
    metrics = [{"step": s, "loss": 6.0 - s / 100, "lr": 1e-3, "tokens_per_s": 1000.0 + s} for s in range(1, 101)]
    validation = [{"step": 50, "loss": 5.9}, {"step": 100, "loss": 5.5}]
    table = final_table(metrics, validation).splitlines()
    assert table[0].split() == ["step", "train", "loss", "val", "loss", "val", "ppl", "lr", "tokens/s"]
    assert table[2].split() == ["50", f"{sum(6.0 - s / 100 for s in range(1, 51)) / 50:.3f}", "5.900",
                                f"{math.exp(5.9):.1f}", "1.00e-03", f"{1000 + 25.5:.0f}"]
    assert table[3].split()[0] == "100"
    text = summary_text({"lines": ["job line"]}, {"model": Evaluation(5.0, 0.2, 100),
                                                  "baseline": Evaluation(6.0, 0.1, 100), "what": "masked"},
                        ["sample line"], [{"peak_rss": 2**20}], ["files line"])
    assert "model            5.000 nats/token, perplexity   148.4, top-1 accuracy 20.0 %" in text
    assert "unigram baseline 6.000 nats/token, perplexity   403.4, top-1 accuracy 10.0 %" in text
    assert "1.000 nats/token below the baseline (perplexity 2.72x lower)" in text
    assert text.splitlines()[0] == "job line" and "sample line" in text and "rank 0: peak_rss 1.0" in text
