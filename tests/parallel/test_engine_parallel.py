"""Tensor and pipeline parallelism through ONE ``tachyon.initialize`` call, on 2 gloo ranks:
TP=2 (config, DeepSpeed's mpu, a Megatron-style mpu, sequence parallelism) and PP=2 (GPipe,
1F1B, interleaved 1F1B with ``engine.train_batch``) give the parameters single-process training
gives after 5 optimizer steps (1e-5 relative, fp32), and the global gradient norm of every step;
BF16 and FP16 train as close to fp32 as one process does in those dtypes; exact bytes per rank
(parameters per TP rank, P2P bytes per micro-batch, activations each schedule keeps alive);
activation checkpointing's partition_activations over the tensor-parallel group.
The 4-rank layouts (DPxTP, DPxPP, PPxTP, checkpoints across layouts) are in
test_engine_parallel_4.py."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import _engine_training as E
from tests.parallel import _pp_training as T
from tests.parallel._tp_checks import PARALLEL_REL, assert_matches_reference
from tests.utils import assert_close, assert_close_to_reference, run_distributed

pytestmark = pytest.mark.distributed

MICRO = 4  # micro-batches per pipeline batch (gradient_accumulation_steps)


def _partitioned_checkpointing(partition: bool, cpu: bool = False) -> dict:
    """A one-stage PipelineModule over Mesh(tp=2), every layer checkpointed with
    tachyon.checkpointing.checkpoint, configured with engine.mpu (DeepSpeed / Megatron's call);
    the profile after the first step and at the end."""
    import tachyon
    from tachyon.engine import activation_checkpointing as ckpt

    net, engine = E.pipeline_engine(1, "1F1B", tp=2, stage=0, gas=MICRO, checkpoint_func=tachyon.checkpointing.checkpoint,
                                    interval=1)
    ckpt.reset()
    if partition:
        ckpt.configure(engine.mpu, partition_activations=True, contiguous_checkpointing=True, checkpoint_in_cpu=cpu)
    E.run_pipeline(net, engine, range(1))
    first = ckpt.get_profile()
    out = E.run_pipeline(net, engine, range(1, T.STEPS))
    out["profile"], out["first_step"] = ckpt.get_profile(), first
    ckpt.reset()
    return out


def _two_ranks() -> dict:
    out: dict = {"rank": E.world_rank()}
    out["tp2"] = E.train_gpt(tp=2, stage=0)
    out["tp2_mpu"] = E.train_gpt(tp=2, stage=0, gas=1, mpu="tachyon")
    out["tp2_megatron_mpu"] = E.train_gpt(tp=2, stage=1, mpu="megatron")
    out["tp2_sp"] = E.train_gpt(tp=2, stage=0, sequence_parallel=True)
    for name, schedule in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", "interleaved_1F1B")):
        out[f"pp2_{name}"] = E.train_pipeline(2, schedule, gas=MICRO)
    for precision in ("bf16", "fp16"):
        out[f"tp2_{precision}"] = E.train_gpt(tp=2, stage=0, precision=precision)
        out[f"pp2_{precision}"] = E.train_pipeline(2, "1F1B", gas=MICRO, precision=precision)
    out["pp2_fp16_overflow"] = E.train_pipeline(2, "1F1B", gas=MICRO, precision="fp16", scale_power=20)
    for schedule in ("GPipe", "1F1B"):
        out[f"bytes_{schedule}"] = E.pipeline_bytes(2, schedule, gas=MICRO)
    out["checkpointed"] = _partitioned_checkpointing(False)
    out["partitioned"] = _partitioned_checkpointing(True)
    out["partitioned_cpu"] = _partitioned_checkpointing(True, cpu=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_two_ranks, 2, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return E.reference_run("fp32")


@pytest.fixture(scope="module")
def initial():
    return E.initial_state()


@pytest.mark.parametrize("layout", ["tp2", "tp2_mpu", "tp2_megatron_mpu", "tp2_sp"])
def test_tp2_through_initialize_trains_like_one_process(ranks, reference, initial, layout):
    """tensor_parallel.tp_size 2 (or mpu=, DeepSpeed's Mesh(...).mpu or a Megatron-style getter
    object; or with sequence parallelism): same parameters as one process after 5 steps, and the
    engine's global gradient norm (replicated parameters counted once) is the single-process one
    at every step."""
    for rank, result in enumerate(ranks):
        got = result[layout]
        assert got["sizes"] == (1, 1, 2) and got["dp_size"] == 1
        assert got["batch"] == (T.GLOBAL_BATCH, T.GLOBAL_BATCH // (1 if layout == "tp2_mpu" else 2),
                                1 if layout == "tp2_mpu" else 2)
        assert_matches_reference(got["state"], reference["state"], initial, f"{layout} rank {rank}")
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=PARALLEL_REL, atol=0.0,
                     name=f"{layout} rank {rank}: global grad norms")


def test_parameter_bytes_per_tp_rank_are_one_tp_th_of_the_split_layers(ranks):
    """Each TP rank's flat parameter buffer holds exactly 1/tp of every split weight (QKV, proj,
    fc1, fc2, vocabulary) plus the replicated vectors: the count from the architecture, in fp32
    bytes (plus the flat buffer's alignment padding, under 1 KiB)."""
    expected = E.split_parameter_count(2)
    assert expected < 0.55 * E.split_parameter_count(1), "the split layers must dominate for this check to mean much"
    for rank, result in enumerate(ranks):
        for layout in ("tp2", "tp2_megatron_mpu"):
            got = result[layout]
            assert got["num_params"] == expected, f"rank {rank} {layout}: {got['num_params']} parameters, expected {expected}"
            assert got["parameter_bytes"] == 4 * got["padded"] and 0 <= got["padded"] - expected < 256


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pp2_train_batch_trains_like_one_process_with_tied_weights_bit_identical(ranks, reference, initial, schedule):
    for rank, result in enumerate(ranks):
        got = result[f"pp2_{schedule}"]
        assert_matches_reference(got["state"], reference["state"], initial, f"pp2 {schedule} rank {rank}")
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=PARALLEL_REL, atol=0.0,
                     name=f"pp2 {schedule} rank {rank}: global grad norms (the tied embedding counted once)")
        [(key, copies)] = got["tied"].items()
        assert key == "tied_modules.embed.weight" and len(copies) == 2
        assert torch.equal(copies[0], copies[1]), f"{schedule}: the tied embedding differs between its two stages"
        assert got["losses"] == ranks[0][f"pp2_{schedule}"]["losses"], "every stage reports the batch loss"


def test_interleaved_1f1b_equals_1f1b_and_gpipe(ranks):
    one = ranks[0]["pp2_1f1b"]
    for other in ("interleaved", "gpipe"):
        got = ranks[0][f"pp2_{other}"]
        assert got["losses"] == one["losses"]
        for key, value in one["state"].items():
            assert torch.equal(got["state"][key], value), f"{other} vs 1F1B differ in {key}"


def test_eval_batch_returns_the_loss_everywhere_and_logits_on_the_last_stage(ranks):
    gpt = T.build_gpt()
    for rank, result in enumerate(ranks):
        loss, logits = result["pp2_1f1b"]["eval"]
        gpt.load_state_dict({**gpt.state_dict(), **result["pp2_1f1b"]["state"]})
        ids, labels = T.batch(T.STEPS)
        with torch.no_grad():
            assert abs(loss - float(gpt.eval()(ids, labels=labels))) <= 1e-5 * loss
        assert logits == ((T.GLOBAL_BATCH, T.SEQ, T.CFG["vocab_size"]) if rank == 1 else None)
        assert result["pp2_1f1b"]["stage_ids"] == [rank]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_and_fp16_train_as_close_to_fp32_as_one_process(ranks, reference, precision):
    """In bf16 / fp16 a parallel layout differs from one process by rounding: its distance to
    the fp32 result is at most 2x that of single-process training in the same dtype (the
    project's 2x rule), every parameter; no step skipped (fp16 starts at scale 2^8)."""
    single = {layout: E.reference_run(precision, gas=gas) for layout, gas in ((f"tp2_{precision}", 2),
                                                                              (f"pp2_{precision}", MICRO))}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for rank, result in enumerate(ranks):
        for layout, one in single.items():
            assert one["skipped"] == 0
            got = result[layout]
            assert got["skipped"] == 0, f"{layout}: {got['skipped']} skipped steps"
            for key, expected in reference["state"].items():
                assert_close_to_reference(got["state"][key].to(dtype), one["state"][key].to(dtype), expected,
                                          name=f"{layout} rank {rank} {key}")


def test_fp16_overflow_skips_the_step_on_every_stage(ranks):
    """fp16 from a loss scale of 2^20 overflows at first: both stages skip the same steps (the overflow
    is agreed over all ranks), as many as one process at the same ZeRO stage (1, the pipeline
    engine's: its scaler spends the hysteresis of 2 before halving) skips, and the tied copies stay equal."""
    single = E.reference_run("fp16", gas=MICRO, scale_power=20, stage=1)
    skipped = [result["pp2_fp16_overflow"]["skipped"] for result in ranks]
    assert skipped[0] == skipped[1] == single["skipped"] and 0 < skipped[0] < T.STEPS, (skipped, single["skipped"])
    for result in ranks:
        [(_, copies)] = result["pp2_fp16_overflow"]["tied"].items()
        assert torch.equal(copies[0], copies[1])


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_p2p_bytes_per_micro_batch_and_activations_in_flight(ranks, schedule):
    """Through engine.train_batch: each stage boundary carries one [micro_batch, seq, hidden]
    fp32 activation forward and its gradient backward per micro-batch; the other pipeline traffic
    is the tied embedding's gradient all-reduce, the loss broadcast, the squared gradient
    norm's all-reduce (one fp32) and the step verdict's flag all-reduce ([non-finite, stop]: two
    fp32, tachyon.engine.nonfinite); nothing crosses dp (one copy). Saved activations: GPipe holds
    all micro-batches, 1F1B at most stages - stage."""
    activation = (T.GLOBAL_BATCH // MICRO) * T.SEQ * E.H * 4
    for rank, result in enumerate(ranks):
        got = result[f"bytes_{schedule}"]
        p2p = [payload for kind, axis, payload in got["calls"] if kind in ("send", "recv")]
        assert p2p == [activation] * (2 * MICRO), f"rank {rank} {schedule}: {p2p}"
        rest = sorted((kind, axis, payload) for kind, axis, payload in got["calls"] if kind not in ("send", "recv"))
        assert rest == [("all_reduce", "pp", 4), ("all_reduce", "pp", 8), ("all_reduce", "pp", E.V * E.H * 4),
                        ("broadcast", "pp", 4)], rest
        [(stage, peak, per_forward)] = got["in_flight"]
        assert stage == rank and len(per_forward) == MICRO and len(set(per_forward)) == 1, per_forward
        held = MICRO if schedule == "GPipe" else 2 - rank
        assert peak == held * per_forward[0], f"{schedule} stage {stage}: peak {peak} B = {peak / per_forward[0]:g} micro-batches"


def test_partition_activations_over_the_tp_group(ranks, reference, initial):
    """partition_activations with engine.mpu (tp=2): every checkpointed region input [micro, seq,
    hidden] fp32 is stored as this rank's half and all-gathered for the recompute; training is
    bit-identical to the unpartitioned checkpointed run and matches one process. With
    contiguous_memory_optimization the halves live in preallocated buffers of
    ``number_checkpoints`` (default 8) halves each, allocated in the first step and reused in every
    later one; with cpu_checkpointing those buffers are in CPU memory."""
    half = (T.GLOBAL_BATCH // MICRO) * T.SEQ * E.H * 4 // 2
    for rank, result in enumerate(ranks):
        plain, parted = result["checkpointed"], result["partitioned"]
        assert plain["profile"]["partitioned_tensors"] == 0 and plain["profile"]["calls"] > 0
        count = parted["profile"]["partitioned_tensors"]
        assert count >= 5 * MICRO * T.STEPS, f"rank {rank}: {count} inputs partitioned"  # 4 blocks + the norm, at least
        assert parted["profile"]["partitioned_bytes"] == count * half
        for key, value in plain["state"].items():
            assert torch.equal(parted["state"][key], value), f"rank {rank}: partitioning changed {key}"
        assert_matches_reference(parted["state"], reference["state"], initial, f"partitioned rank {rank}")
        buffers, nbytes = parted["first_step"]["contiguous_buffers"], parted["first_step"]["contiguous_bytes"]
        # one stage runs each micro-batch's forward and backward in turn: one micro-batch's slices live at once
        per_micro = count // (T.STEPS * MICRO)
        assert buffers == -(-per_micro // 8) and nbytes == buffers * 8 * half, (per_micro, buffers, nbytes)
        assert (parted["profile"]["contiguous_buffers"], parted["profile"]["contiguous_bytes"]) == (buffers, nbytes), (
            "the buffers grew after the first step: slices were not reused")
        offloaded = result["partitioned_cpu"]  # checkpoint_in_cpu: the same halves, in CPU buffers
        ids = (T.GLOBAL_BATCH // MICRO) * T.SEQ * 8  # the embedding region's input: int64 token ids, kept whole
        assert offloaded["profile"]["offloaded_tensors"] == count + MICRO * T.STEPS
        assert offloaded["profile"]["offloaded_bytes"] == count * half + MICRO * T.STEPS * ids
        assert all(torch.equal(offloaded["state"][k], v) for k, v in plain["state"].items())
