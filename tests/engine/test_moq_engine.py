"""MoQ through the training engine: the ``quantize_training`` config section with
``tachyon.initialize`` / ``engine.backward`` / ``engine.step``.

The schedule switches bits at DeepSpeed's steps; after each step the model's linear weights lie
on the current grid while the optimizer's values stay full precision; stage 0 fp32 matches the
standalone ``MoQ`` exactly; ZeRO-1/2 on 2 gloo ranks and bf16 give the stage-0 fp32 weights to a
stated tolerance; accumulation steps only at boundaries; skipped fp16 steps do not count; a
resumed run is bit-identical; a small GPT-2 ends within 2% of the unquantized loss and loads into
INT8 inference with the trained model's logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tachyon
from tachyon.config import ConfigError
from tachyon.inference.moq import MoQ
from tests.utils import run_distributed

IN, HIDDEN, OUT, BATCH = 16, 32, 8, 8
SCHEDULE = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 6},
            "quantize_schedule": {"quantize_period": 2, "schedule_offset": 1}}
"""Snapped from step 1 at 8 bits, 7 bits from step 3, 6 bits from step 5."""
FP32_ZERO_STEPS = 1e-5
"""fp32 runs that differ only in the order of the gradient sums (ZeRO-1/2 on 2 ranks vs one
process, accumulation vs one micro-batch): every weight on the same grid point, the scales equal
to fp32 rounding (measured up to 5e-6 of a grid step)."""
BF16_STEPS = 1.0
"""bf16 vs fp32 (lr 1e-3, 8 steps): every weight within one grid step (plus bf16 rounding) of
the fp32 run's; measured up to 1.04 including the rounding."""


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))


def batches(steps: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)) for _ in range(steps)]


def config(moq=SCHEDULE, precision: str = "fp32", stage: int = 0, micro: int = BATCH, gas: int = 1,
           bucket: int = 200, **extra) -> dict:
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}, **extra}
    if moq is not None:
        out["quantize_training"] = moq
    if precision != "fp32":
        out[precision] = {"enabled": True}
    return out


def adamw(lr: float = 1e-2):
    return lambda params: torch.optim.AdamW(params, lr=lr)


def train(engine, data, gas: int = 1) -> list[float]:
    losses = []
    dtype = engine.precision.model_dtype
    for x, y in data:
        for xm, ym in zip(x.chunk(gas), y.chunk(gas)):
            loss = F.mse_loss(engine(xm.to(dtype)).float(), ym)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach().float().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def grid_steps(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight / s per element, s = max|row| / (2^(bits-1) - 1): integers when on the grid."""
    return weight / (weight.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1))


def off_grid(weight: torch.Tensor, bits: int) -> float:
    steps = grid_steps(weight.float(), bits)
    return float((steps - steps.round()).abs().max())


def in_grid_steps(actual: torch.Tensor, expected: torch.Tensor, bits: int) -> float:
    """max |actual - expected| in grid steps of ``expected``'s rows."""
    scale = expected.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
    return float(((actual - expected).abs() / scale).max())


# ---------------------------------------------------------------------- schedule and grid
def test_bits_switch_at_p_2p_4p_through_the_engine(one_thread):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    moq = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 4},
           "quantize_schedule": {"quantize_period": 3, "schedule_offset": 2}}
    engine, *_ = tachyon.initialize(model=model, config=config(moq, micro=1),
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    initial = model[0].weight.detach().clone()
    bits = []
    for step in range(30):
        engine.backward(engine(torch.ones(1, 8)).sum())
        engine.step()
        bits.append(engine.quantizer.bits)
        if step == 0:  # before the offset: the weights are untouched
            assert torch.equal(model[0].weight, initial)
    first = {b: bits.index(b) + 1 for b in (7, 6, 5, 4)}
    assert first == {7: 5, 6: 8, 5: 14, 4: 26}, first  # offset 2 + 3, + 6, + 12, + 24
    assert engine.quantizer.steps == engine.global_steps == 30


def test_weights_lie_on_the_current_grid_and_the_masters_stay_full_precision(one_thread):
    model = mlp()
    engine, *_ = tachyon.initialize(model=model, config=config(), optimizer=adamw())
    for step, batch in enumerate(batches(6)):
        train(engine, [batch])
        bits = engine.quantizer.bits
        assert bits == {0: 8, 1: 8, 2: 7, 3: 7}.get(step, 6)
        for w in linear_weights(model):
            assert off_grid(w, bits) < 1e-4, f"step {step + 1}: a weight is off the {bits}-bit grid"
        # fp32 stage 0: the optimizer's parameter is the model's, so MoQ keeps the full-precision copy
        full = engine.quantizer.checkpoint_masters()[0]
        assert not torch.equal(full, engine.zero.masters[0])
        first = full.narrow(0, 0, HIDDEN * IN).view(HIDDEN, IN)
        assert off_grid(first, bits) > 0.1, "the full-precision values should not be on the grid"
    # the copies are counted: 4 bytes per quantized weight element, inside model_states
    breakdown = engine.memory_breakdown()
    assert breakdown["moq_full_precision"] == 4 * (HIDDEN * IN + OUT * HIDDEN)
    parts = ("parameters", "gradients", "master_weights", "optimizer_states", "moq_full_precision")
    assert breakdown["model_states"] == sum(breakdown[k] for k in parts)


@pytest.mark.parametrize("variant", [{}, {"group_size": 8}, {"quantize_groups": 4},
                                     {"fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.3}}])
def test_stage0_fp32_matches_the_standalone_moq_exactly(one_thread, variant):
    schedule = {**SCHEDULE, **variant}
    model, reference = mlp(), mlp()
    engine, *_ = tachyon.initialize(model=model, config=config(schedule), optimizer=adamw())
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    moq = MoQ(reference, schedule)
    for x, y in batches(8):
        train(engine, [(x, y)])
        F.mse_loss(reference(x), y).backward()
        moq.step(optimizer)
        optimizer.zero_grad()
    assert engine.quantizer.bits == moq.bits == 6
    assert engine.quantizer.schedule.real_ratio == moq.real_ratio
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    if "fp16_mixed_quantize" in variant:  # ratio 1 - 3 * 0.3 after the switch at step 5, 3 steps ago
        assert abs(moq.real_ratio - 0.1) < 1e-12 and 0.01 < off_grid(linear_weights(model)[0], 6) <= 0.05 + 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_snaps_the_model_copy_from_the_fp32_master(one_thread, precision):
    """The model holds Q(master) in bf16/fp16; the fp32 master is never overwritten; the run stays
    within one grid step of the fp32 one."""
    model = mlp()
    engine, *_ = tachyon.initialize(model=model, config=config(precision=precision), optimizer=adamw(1e-3))
    reference = mlp()
    ref_engine, *_ = tachyon.initialize(model=reference, config=config(), optimizer=adamw(1e-3))
    data = batches(8)
    train(engine, data)
    train(ref_engine, data)
    bits, quantizer = engine.quantizer.bits, engine.quantizer
    master = engine.zero.masters[0]
    region = engine.zero.flat.regions[0]
    for (_, slot, transposed), w_ref in zip(quantizer._targets, linear_weights(reference)):
        full = master.detach().narrow(0, slot.offset - region.start, slot.numel).view(slot.param.shape)
        expected = quantizer.schedule.snap(full, transposed).to(slot.param.dtype)
        assert torch.equal(slot.param.detach(), expected), "the model copy should be Q(master) in the model dtype"
        assert off_grid(full, bits) > 0.1, "the fp32 master should stay full precision"
        rounding = torch.finfo(slot.param.dtype).eps * w_ref.abs().max()
        assert in_grid_steps(slot.param.detach().float(), w_ref, bits) <= BF16_STEPS + float(rounding) * 2 ** bits


def test_fp16_overflow_steps_do_not_count(one_thread):
    model = mlp()
    cfg = config(precision="fp16")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}
    engine, *_ = tachyon.initialize(model=model, config=cfg, optimizer=adamw())
    data = batches(12)
    train(engine, data[:1])
    assert engine.skipped_steps == 1 and engine.quantizer.steps == 0
    assert off_grid(linear_weights(model)[0], 8) > 0.1, "a skipped step must not snap the weights"
    train(engine, data[1:])
    assert engine.skipped_steps >= 1
    assert engine.quantizer.steps == engine.global_steps - engine.skipped_steps


def test_gradient_accumulation_steps_only_at_boundaries(one_thread):
    model, reference = mlp(), mlp()
    engine, *_ = tachyon.initialize(model=model, config=config(micro=BATCH // 2, gas=2), optimizer=adamw())
    ref_engine, *_ = tachyon.initialize(model=reference, config=config(), optimizer=adamw())
    data = batches(6)
    x, y = data[0]
    before = linear_weights(model)
    engine.backward(F.mse_loss(engine(x[:4]), y[:4]))
    engine.step()
    assert engine.quantizer.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, linear_weights(model)))
    engine.backward(F.mse_loss(engine(x[4:]), y[4:]))
    engine.step()
    assert engine.quantizer.steps == 1
    train(engine, data[1:], gas=2)
    train(ref_engine, data)
    assert engine.quantizer.steps == ref_engine.quantizer.steps == 6
    for ours, theirs in zip(linear_weights(model), linear_weights(reference)):
        assert in_grid_steps(ours, theirs, 6) <= FP32_ZERO_STEPS


@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 0), ("fp32", 2), ("bf16", 1)])
def test_save_load_continue_is_bit_identical(one_thread, tmp_path, precision, stage):
    """fp32 stages 0 and 2 (one process): the master is the model buffer (full-precision copies
    kept); bf16: separate fp32 masters (stage 1: partitioned, gathered to snap)."""
    data = batches(10)

    def fresh():
        model = mlp()
        engine, *_ = tachyon.initialize(model=model, config=config(precision=precision, stage=stage),
                                        optimizer=adamw())
        return model, engine

    model, engine = fresh()
    train(engine, data[:4])  # 7 bits from step 3 on
    engine.save_checkpoint(tmp_path, tag="k")
    at_save = [p.detach().clone() for p in model.parameters()]
    train(engine, data[4:])
    resumed_model, resumed = fresh()
    resumed.load_checkpoint(tmp_path, tag="k")
    assert resumed.quantizer.state_dict() == {"steps": 4, "bits": 7, "period": 4, "real_ratio": 1.0}
    for a, b in zip(resumed_model.parameters(), at_save):  # snapped again on load, as they were
        assert torch.equal(a, b)
    train(resumed, data[4:])
    assert resumed.quantizer.state_dict() == engine.quantizer.state_dict()
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed.quantizer.checkpoint_masters(), engine.quantizer.checkpoint_masters()):
        assert torch.equal(a, b)


def test_checkpoint_masters_are_full_precision(one_thread, tmp_path):
    """The checkpoint stores the full-precision values: exported, they are the optimizer's
    values, and snapping them gives the model's weights."""
    from tachyon.engine.checkpoint import export_model_state_dict

    model = mlp()
    engine, *_ = tachyon.initialize(model=model, config=config(), optimizer=adamw())
    train(engine, batches(3))
    engine.save_checkpoint(tmp_path, tag="t")
    state = export_model_state_dict(tmp_path, tag="t")
    schedule = engine.quantizer.schedule
    for name, p, transposed in engine.quantizer.weights:
        assert off_grid(state[name], schedule.bits) > 0.1
        assert torch.equal(schedule.snap(state[name], transposed), p.detach())


# ---------------------------------------------------------------------- ZeRO on 2 ranks
ZERO_RUNS = [(precision, stage, bucket) for stage in (1, 2)
             for precision, bucket in (("fp32", 200), ("fp32", 10**6), ("bf16", 200))]
"""fp32 with 200-element buckets: each rank's master partition is separate from the model buffer
(several chunks), so the partitions are all-gathered in fp32 to snap; with one bucket the
partition is the model buffer itself and MoQ keeps full-precision copies; bf16: fp32 masters."""
ZERO_LR = {"fp32": 1e-2, "bf16": 1e-3}


SAVE_AT = 4


def _zero_runs(steps: int, save_dir: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    half = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(steps)]
    out = {}
    for run in ZERO_RUNS:
        precision, stage, bucket = run
        model = mlp()
        cfg = config(precision=precision, stage=stage, micro=BATCH // 2, bucket=bucket)
        engine, *_ = tachyon.initialize(model=model, config=cfg, optimizer=adamw(ZERO_LR[precision]))
        train(engine, half[:SAVE_AT])
        engine.save_checkpoint(save_dir, tag="-".join(map(str, run)))
        at_save = [p.detach().clone() for p in model.parameters()]
        train(engine, half[SAVE_AT:])
        out[run] = (engine.quantizer.bits, linear_weights(model), engine.zero._master_alias[0], at_save)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """(per-rank results of `_zero_runs` over 8 steps, the checkpoint root they saved into)."""
    save_dir = tmp_path_factory.mktemp("moq_zero")
    return run_distributed(_zero_runs, 2, 8, str(save_dir), timeout=120), save_dir


@pytest.mark.distributed
def test_zero_1_and_2_on_two_ranks_give_the_stage0_fp32_weights(one_thread, zero_runs):
    """Each rank trains on its half of every batch; the reference is stage 0 fp32 in one process
    on the whole batch. bf16 weights are bf16(Q(master)) (checked exactly in
    test_low_precision_snaps_the_model_copy_from_the_fp32_master): off the fp32 grid by bf16
    rounding, at most 31 * 2^-9 < 0.07 of a step at 6 bits."""
    steps = 8
    results, _ = zero_runs
    expected = {}
    for precision, lr in ZERO_LR.items():
        model = mlp()
        engine, *_ = tachyon.initialize(model=model, config=config(), optimizer=adamw(lr))
        train(engine, batches(steps))
        assert engine.quantizer.bits == 6
        expected[precision] = linear_weights(model)
    for run in ZERO_RUNS:
        precision, stage, _ = run
        for rank in (0, 1):
            bits, weights, aliased, _ = results[rank][run]
            assert bits == 6 and aliased == (run[0] == "fp32" and run[2] == 10**6)
            for w, e in zip(weights, expected[precision]):
                if precision == "fp32":
                    assert off_grid(w, bits) < 1e-4
                worst = in_grid_steps(w, e, bits)
                bound = FP32_ZERO_STEPS if precision == "fp32" else BF16_STEPS + 0.07
                print(f"{run} rank {rank}: {worst:.3g} grid steps from stage 0 fp32")
                assert worst <= bound, f"{run} rank {rank}: {worst} grid steps from stage 0 fp32"


@pytest.mark.distributed
def test_zero_checkpoint_of_two_ranks_loads_into_one_process_snapped_as_saved(one_thread, zero_runs):
    """Saved at step 4 by 2 ranks (ZeRO-1/2, partitioned masters: the model buffer's partition
    or separate fp32 partitions), loaded at stage 0 in one process: the full-precision masters
    come back and snap to the very weights the ranks held."""
    from tachyon.engine.checkpoint import export_model_state_dict

    results, save_dir = zero_runs
    for run in ZERO_RUNS:
        precision = run[0]
        saved = export_model_state_dict(save_dir, tag="-".join(map(str, run)))
        for name in ("0.weight", "2.weight"):
            assert off_grid(saved[name], 7) > 0.1, f"{run}: {name} was saved snapped, not full precision"
        model = mlp()
        engine, *_ = tachyon.initialize(model=model, config=config(precision=precision), optimizer=adamw())
        engine.load_checkpoint(save_dir, tag="-".join(map(str, run)))
        assert engine.quantizer.state_dict() == {"steps": 4, "bits": 7, "period": 4, "real_ratio": 1.0}
        for ours, saved in zip(model.parameters(), results[0][run][3]):
            assert torch.equal(ours, saved), f"{run}: the reloaded weights differ from those saved"


# ---------------------------------------------------------------------- refused configs
@pytest.mark.parametrize("section,match", [
    ({"quantize_bits": {"start_bits": 4, "target_bits": 8}}, "start_bits"),
    ({"quantize_bits": {"start_bits": 17}}, "quantize_training.quantize_bits.start_bits"),
    ({"quantize-algo": {"q_type": "asymmetric"}}, "quantize_training.quantize-algo.q_type"),
    ({"quantize-algo": {"rounding": "stochastic"}}, "quantize_training.quantize-algo.rounding"),
    ({"quantize_schedule": {"quantize_period": 0}}, "quantize_training.quantize_schedule.quantize_period"),
    ({"quantize_grups": 2}, "did you mean 'quantize_training.quantize_groups'"),
    ({"eigenvalue": {"enabled": True}}, "quantize_training.eigenvalue"),
    ({"quantize_groups": 2, "group_size": 8}, "quantize_groups or group_size"),
    ({"fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 2.0}}, "quantize_change_ratio"),
])
def test_bad_sections_are_refused_before_anything_changes(section, match):
    model = mlp()
    before = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        tachyon.initialize(model=model, config=config({"enabled": True, **section}), optimizer=adamw())
    assert all(p.data_ptr() == ptr and torch.equal(p, v) for p, (ptr, v) in zip(model.parameters(), before))


def test_a_model_without_linear_weights_and_tensor_parallelism_are_refused():
    with pytest.raises(ConfigError, match="no trainable GEMM weight to quantize"):
        tachyon.initialize(model=torch.nn.Sequential(torch.nn.Embedding(10, 4)), config=config(), optimizer=adamw())
    with pytest.raises(ConfigError, match="tensor_parallel.tp_size"):
        tachyon.config.load_config(config(tensor_parallel={"tp_size": 2}), world_size=2)


def test_disabled_section_trains_without_moq(one_thread):
    model = mlp()
    engine, *_ = tachyon.initialize(model=model, config=config({**SCHEDULE, "enabled": False}), optimizer=adamw())
    train(engine, batches(3))
    assert engine.quantizer is None
    assert off_grid(linear_weights(model)[0], 8) > 0.1


# ---------------------------------------------------------------------- acceptance: a small GPT
def _gpt_run(moq, train_windows, vocab, steps=None):
    from transformers import GPT2Config, GPT2LMHeadModel, logging

    from tests.inference.test_moq import BATCH as GPT_BATCH, SEQ, STEPS

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=vocab)).train()
    cfg = {"train_micro_batch_size_per_gpu": GPT_BATCH, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    if moq is not None:
        cfg["quantize_training"] = moq
    engine, *_ = tachyon.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS if steps is None else steps):
        batch = train_windows[torch.randint(0, len(train_windows), (GPT_BATCH,), generator=g)]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    return model.eval(), engine


def test_engine_trained_gpt_loads_into_int8_inference_unchanged(one_thread):
    """A few steps straight on the 8-bit grid (the quick form of the acceptance test below)."""
    pytest.importorskip("transformers")
    from tests.inference.test_moq import _data

    train_windows, val, vocab = _data()
    moq = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 8}}
    model, engine = _gpt_run(moq, train_windows, vocab, steps=4)
    with torch.no_grad():
        logits = model(input_ids=val[:4]).logits
    inference = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32, quant=engine.quantizer.inference_quant())
    with torch.no_grad():
        int8_logits = inference(val[:4]).logits
    worst = float((int8_logits - logits).abs().max())
    assert worst <= 1e-4 * float(logits.abs().max()), f"INT8 logits differ from the trained model's by {worst}"


@pytest.mark.slow
def test_small_gpt_trained_with_quantize_training_loads_into_int8_inference():
    pytest.importorskip("transformers")
    from tests.inference.test_moq import LOSS_TOLERANCE, MOQ, _data

    train_windows, val, vocab = _data()
    threads = torch.get_num_threads()
    try:
        base, _ = _gpt_run(None, train_windows, vocab)
        quantized, engine = _gpt_run(MOQ, train_windows, vocab)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        base_loss, moq_loss = (m(input_ids=val, labels=val).loss.item() for m in (base, quantized))
        logits = quantized(input_ids=val).logits
    print(f"engine MoQ: validation loss {moq_loss:.4f} vs {base_loss:.4f} unquantized ({moq_loss / base_loss - 1:+.2%})")
    assert engine.quantizer.bits == 8
    assert moq_loss <= (1 + LOSS_TOLERANCE) * base_loss
    inference = tachyon.init_inference(copy.deepcopy(quantized), dtype=torch.float32,
                                       quant=engine.quantizer.inference_quant())
    with torch.no_grad():
        int8_logits = inference(val).logits
    worst = float((int8_logits - logits).abs().max())
    assert worst <= 1e-4 * float(logits.abs().max()), f"INT8 logits differ from the trained model's by {worst}"


@pytest.mark.parametrize("model_kind", ["gpt", "bert"])
def test_tachyon_layers_are_quantized_too(one_thread, model_kind):
    """tachyon's own modules (TransformerLayer's LayerNormLinear / Linear / LayerNormMLP, the
    fused BERT kernel layer) hold their GEMM weights themselves: MoQ snaps those, not only
    nn.Linear; the tied LM head and the norms stay float."""
    from tachyon.train.models import GPT, BertMLM

    torch.manual_seed(0)
    if model_kind == "gpt":
        model = GPT(64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16)
        names = {"self_attention.layernorm_qkv.weight", "self_attention.proj.weight", "layernorm_mlp.fc1_weight",
                 "layernorm_mlp.fc2_weight"}
    else:
        model = BertMLM(64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, max_batch_size=4)
        names = {"attn_qkvw", "attn_ow", "inter_w", "output_w"}
    engine, *_ = tachyon.initialize(model=model, config=config(micro=4), optimizer=adamw(1e-3))
    quantized = {name for name, _, _ in engine.quantizer.weights}
    extra = {"transform.weight"} if model_kind == "bert" else set()  # the MLM head's dense nn.Linear
    assert quantized == {f"layers.{i}.{n}" for i in range(2) for n in names} | extra, sorted(quantized)
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        ids = torch.randint(4, 64, (4, 16), generator=gen)
        labels = ids.roll(-1, dims=1) if model_kind == "gpt" else torch.where(ids % 3 == 0, ids, -100)
        engine.backward(engine(ids, labels=labels))
        engine.step()
    bits = engine.quantizer.bits
    assert bits < 8
    params = dict(model.named_parameters())
    for name in quantized:
        assert off_grid(params[name].detach(), bits) < 1e-4, f"{name} is off the {bits}-bit grid"
    embedding = model.token_embedding.weight
    assert off_grid(embedding.detach(), bits) > 0.1, "the embedding / tied head must stay float"


def test_tachyon_gpt_trained_with_moq_loads_into_int8_inference_unchanged(one_thread):
    """tachyon's own GPT: MoQ through the engine straight on the 8-bit grid, then INT8 inference
    with the engine's quant config (the tachyon GPT injection policy) gives the trained logits."""
    pytest.importorskip("transformers")
    from tachyon.train.models import GPT

    torch.manual_seed(0)
    model = GPT(100, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, position="rope")
    moq = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 8}}
    engine, *_ = tachyon.initialize(model=model, config=config(moq, micro=4), optimizer=adamw(1e-3))
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        ids = torch.randint(0, 100, (4, 16), generator=gen)
        engine.backward(engine(ids, labels=ids.roll(-1, dims=1)))
        engine.step()
    ids = torch.randint(0, 100, (2, 16), generator=gen)
    with torch.no_grad():
        logits = model.logits(ids)
    inference = tachyon.init_inference(copy.deepcopy(model).eval(), dtype=torch.float32,
                                       quant=engine.quantizer.inference_quant())
    assert any(getattr(m, "quantized", False) for m in inference.module.modules()), "no INT8 layer was built"
    with torch.no_grad():
        int8_logits = inference(ids).logits
    worst = float((int8_logits - logits).abs().max())
    assert worst <= 1e-4 * float(logits.abs().max()), f"INT8 logits differ from the trained model's by {worst}"
