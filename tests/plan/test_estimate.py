"""Memory, communication, time and ranking of `tachyon.plan`, against the ZeRO paper and the formulas."""

from __future__ import annotations

import pytest

from tachyon.hardware import GIB, get_gpu
from tachyon.plan import Assumptions, Choices, Layout, PlanError, check_layout, estimate, preset, rank_layouts
from tachyon.plan import activations as act
from tachyon.plan.estimate import model_flops_per_token, padded
from tachyon.plan.model import ModelSpec

H100 = get_gpu("h100")


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6)])
def test_zero_paper_model_states_7_5b_on_64_gpus(stage, paper_gb):
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, 64 GPUs, Adam, fp16 mixed precision.
    # The paper's stage 1 keeps whole gradients: tachyon's does between micro-steps (gradient
    # accumulation), and holds only its gradient partition without accumulation (below).
    plan = estimate(None, Layout(dp=64, zero=stage, dtype="fp16", grad_accum=4), H100, params=7_500_000_000)
    states = plan.binding_stage.memory["model_states"]
    assert round(states / 1e9, 1) == paper_gb, f"stage {stage}: {states / 1e9:.3f} GB"
    if stage == 1:
        single = estimate(None, Layout(dp=64, zero=1, dtype="fp16"), H100, params=7_500_000_000)
        assert round(single.binding_stage.memory["model_states"] / 1e9, 1) == 16.6


def test_model_states_follow_the_engines_layout_exactly():
    # bf16 (bf16 accumulation, the engine's default): 2 (params) + 2 (grads) + 4 (masters) + 8 (Adam)
    # bytes per element; stage 1/2 shards everything but the parameters; padding to N*8 elements
    n, psi = 4, 1_000_003
    flat = padded(psi, n)
    assert flat % (n * 8) == 0 and flat - psi < n * 8
    for stage in (0, 1, 2):
        mem = estimate(None, Layout(dp=n, zero=stage), H100, params=psi).binding_stage.memory
        shard = flat if stage == 0 else flat // n
        assert mem["parameters"] == 2 * flat and mem["gradients"] == 2 * shard
        assert mem["master_weights"] == 4 * shard and mem["optimizer_states"] == 8 * shard + 4
        assert mem["step_master_gradients"] == 4 * shard  # the fp32 gradient the step converts to


def test_pipeline_stages_hold_their_micro_batches_in_flight():
    spec = preset("gpt2")
    one_f_one_b = estimate(spec, Layout(pp=4, dp=1, micro_batch=1, grad_accum=8), H100)
    gpipe = estimate(spec, Layout(pp=4, dp=1, micro_batch=1, grad_accum=8, schedule="gpipe"), H100)
    tokens = spec.seq
    per_layer = act.layer_bytes_per_token(spec, "bf16") * tokens
    stage0 = one_f_one_b.stages[0]
    assert stage0.layers == 3
    embedding = act.embedding_bytes_per_token(spec, "bf16") * tokens + 8 * spec.seq
    assert stage0.memory["activations"] == pytest.approx(4 * (3 * per_layer + embedding))  # pp=4 in flight
    assert one_f_one_b.stages[3].memory["activations"] > 0
    assert gpipe.stages[0].memory["activations"] == pytest.approx(8 * (3 * per_layer + embedding))  # all 8
    # a tied LM head is a copy on the last stage with a pipeline
    assert one_f_one_b.stages[3].params > one_f_one_b.stages[1].params + spec.padded_vocab() * spec.hidden - 1


def test_tensor_parallelism_splits_activations_and_layers():
    spec = preset("llama-7b")
    one = estimate(spec, Layout(tp=1, dp=8, zero=1), H100)
    four = estimate(spec, Layout(tp=4, dp=2, zero=1), H100)
    assert sum(four.activation_items.values()) == pytest.approx(sum(one.activation_items.values()) / 4)
    assert four.stages[0].params < one.stages[0].params / 3.9


def test_full_checkpointing_keeps_layer_inputs_and_one_recomputed_layer():
    spec = preset("gpt2")
    none = estimate(spec, Layout(micro_batch=4), H100).stages[0].memory["activations"]
    full = estimate(spec, Layout(micro_batch=4, checkpointing="full"), H100).stages[0].memory["activations"]
    tokens = 4 * spec.seq
    layer_inputs = spec.layers * 2 * spec.hidden * tokens
    recompute = act.layer_bytes_per_token(spec, "bf16") * tokens
    rest = none - spec.layers * recompute
    assert full == pytest.approx(layer_inputs + recompute + rest)


def test_communication_bytes_per_axis():
    spec = preset("gpt2")
    for stage in (0, 1, 2):  # bf16 gradients, 4 micro-batches per step
        plan = estimate(spec, Layout(dp=8, zero=stage, micro_batch=2, grad_accum=4), H100)
        flat = padded(plan.stages[0].params, 8)
        dp = plan.communication["dp"]
        expected = {0: 2 * 7 / 8 * flat * 2,  # one all-reduce per step
                    1: 7 / 8 * flat * 2,  # one reduce-scatter per step
                    2: 7 / 8 * flat * 2 * 4}[stage]  # a reduce-scatter per micro-batch
        assert dp["gradient_reduction"] == pytest.approx(expected)
        assert dp["parameter_allgather"] == (0 if stage == 0 else pytest.approx(7 / 8 * flat * 2))
    fp32_accum = estimate(spec, Layout(dp=8, zero=1, grad_accum=4), H100, Assumptions(grad_accum_dtype="fp32"))
    flat = padded(fp32_accum.stages[0].params, 8)
    assert fp32_accum.communication["dp"]["gradient_reduction"] == pytest.approx(7 / 8 * flat * 2 * 4)
    tp = estimate(spec, Layout(tp=2, dp=4, micro_batch=1), H100).communication["tp"]["total"]
    activation = spec.seq * spec.hidden * 2
    assert tp == pytest.approx(2 * 1 / 2 * activation * (4 * spec.layers + 2))
    pp = estimate(spec, Layout(pp=3, dp=1, micro_batch=1, grad_accum=6), H100).communication["pp"]
    assert pp["activations"] == pytest.approx(2 * activation * 6)


def test_time_and_mfu_follow_the_flops_and_the_efficiency():
    spec = preset("bert-large")  # no causal discount: hardware FLOPs = model FLOPs without recomputation
    fast = estimate(spec, Layout(micro_batch=8), H100, Assumptions(compute_efficiency=0.6))
    slow = estimate(spec, Layout(micro_batch=8), H100, Assumptions(compute_efficiency=0.3))
    assert slow.time["pipeline_s"] == pytest.approx(2 * fast.time["pipeline_s"])
    t = fast.time
    assert t["mfu"] == pytest.approx(0.6 * t["pipeline_s"] / t["step_s"])
    gpt2 = preset("gpt2")
    n_weights = gpt2.layers * gpt2.layer_gemm_weights() + gpt2.padded_vocab() * gpt2.hidden
    palm = 6 * n_weights + 12 * gpt2.layers * gpt2.seq * gpt2.hidden
    assert model_flops_per_token(gpt2) == pytest.approx(palm)


def test_impossible_layouts_are_refused_naming_the_problem():
    spec = preset("gpt2")  # 12 layers, 12 heads
    cases = [
        (Layout(tp=8, dp=1), 8, "tp = 8 must divide the 12 attention heads; allowed tp: \\[1, 2, 4\\]"),
        (Layout(pp=16), 16, "pp = 16 pipeline stages but the model has 12 layers"),
        (Layout(pp=2, dp=2, zero=2), 4, "ZeRO stage 2 does not combine with pipeline parallelism"),
        (Layout(dp=3), 4, "tp \\* pp \\* dp = 3 but there are 4 GPUs"),
        (Layout(zero=4), 1, "must be 0, 1, 2 or 3; got 4"),
        (Layout(pp=2, dp=2, zero=3), 4, "ZeRO stage 3 does not combine with pipeline parallelism"),
        (Layout(offload=True), 1, "offload .* needs ZeRO stage 1, 2 or 3"),
    ]
    for layout, gpus, message in cases:
        with pytest.raises(PlanError, match=message):
            check_layout(spec, layout, gpus, 8)
    llama = preset("llama-70b")
    with pytest.raises(PlanError, match="tp = 16 must divide the 8 key/value heads"):
        check_layout(llama, Layout(tp=16, dp=1), 16, 16)
    with pytest.raises(PlanError, match="fp8 needs the gpt or llama family"):
        check_layout(preset("bert-large"), Layout(dtype="fp8"), 1, 8)
    with pytest.raises(PlanError, match="'selective' is not defined for the bert family"):
        act.layer_items(preset("bert-large"), "bf16", "selective")
    with pytest.raises(ValueError, match="A100 SXM4 80GB has no fp8 peak"):
        get_gpu("a100").peak_flops("fp8")
    with pytest.raises(ValueError, match="did you mean 'h200'"):
        get_gpu("h20")


def test_ranking_puts_fitting_and_faster_layouts_first():
    spec = preset("llama-7b")
    plans = rank_layouts(spec, 16, H100, Choices(global_batch=256))
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True), "every fitting layout comes before every other"
    fitting = [p for p in plans if p.fits]
    speeds = [p.time["tokens_per_s"] for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for plan in plans:
        check_layout(spec, plan.layout, 16, 8)
        assert plan.layout.global_batch == 256
    assert {p.layout.zero for p in plans} == {0, 1, 2} and {p.layout.checkpointing for p in plans} == {
        "none", "selective", "full"}
    assert all(p.memory_per_gpu <= p.usable_memory for p in fitting)


def test_ranking_respects_fixed_choices_and_refuses_impossible_ones():
    spec = preset("gpt2")
    plans = rank_layouts(spec, 8, H100, Choices(tp=2, zero=1))
    assert {(p.layout.tp, p.layout.zero) for p in plans} == {(2, 1)}
    with pytest.raises(PlanError, match="tp = 8 must divide the 12 attention heads"):
        rank_layouts(spec, 8, H100, Choices(tp=8))


def test_a_model_too_big_for_the_gpus_fits_nowhere():
    spec = ModelSpec(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=4096,
                     vocab=128256, tied_embeddings=False)
    plans = rank_layouts(spec, 8, H100, Choices(global_batch=8))
    assert plans and not any(p.fits for p in plans)
    smallest = min(p.memory_per_gpu for p in plans)
    assert smallest > H100.memory_bytes - 3 * GIB


def test_stage_3_and_offload_predict_the_bytes_bench_zero3_measured():
    """benchmarks/results/2026-11-28-cpu-zero3-bytes.md measured, per rank, the model states and
    the part in host memory of 8 x Linear(1024, 1024) (Psi = 8,396,800) at stages 1, 2 and 3 with
    and without optimizer offload on 2 and 4 ranks, and the bytes each rank sends per step. The plan of the same parameter count predicts each within the table's rounding
    (0.01 MB); its per-GPU memory counts the device part only."""
    import re
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "2026-11-28-cpu-zero3-bytes.md").read_text()
    rows = re.findall(r"^\| (\d) \| (\d)\s+\| (none|optimizer)\s+\| 8396800 \| ([\d.]+)\s+\| [\d.]+\s+\| ([\d.]+)\s+\|"
                      r" [\d.]+\s+\| ([\d.]+)", table, re.M)
    assert len(rows) == 12, rows  # stages 1-3, with and without optimizer offload, on 2 and 4 ranks
    for n, stage, offload, states_mb, host_mb, sent_mb in rows:
        layout = Layout(dp=int(n), zero=int(stage), offload=offload == "optimizer")
        plan = estimate(None, layout, H100, params=8_396_800)
        memory = plan.stages[0].memory
        assert abs(memory["model_states"] / 1e6 - float(states_mb)) <= 0.01, (n, stage, offload, memory)
        assert abs(memory.get("offloaded", 0.0) / 1e6 - float(host_mb)) <= 0.01, (n, stage, offload, memory)
        if stage == "3":  # no bucket buffers, fp32 gradient shards already: per GPU, the device part alone
            assert plan.stages[0].total == memory["model_states"] - memory.get("offloaded", 0.0)
        assert abs(plan.communication["dp"]["total"] / 1e6 - float(sent_mb)) <= 0.01, (n, stage, plan.communication)
