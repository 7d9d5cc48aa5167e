"""Pipeline parallelism: partitions, specs, refusals and the single-stage path in one process; one
2-rank launch for GPipe / 1F1B / interleaved 1F1B against single-process training, P2P bytes per
micro-batch and the activations each schedule keeps alive."""

from __future__ import annotations

import pytest
import torch

from tachyon.nn import TransformerLayer
from tachyon.parallel.pipeline import LayerSpec, PipelineModule, PipelineSchedule, TiedLayerSpec
from tachyon.parallel.pipeline.gpt import (
    GPTBlock, gpt_layer_specs, gpt_loss, gpt_state_dict_to_pipeline, pipeline_state_dict_to_gpt,
)
from tachyon.parallel.pipeline.partition import partition_balanced, partition_layers, partition_uniform
from tachyon.parallel.pipeline.schedule import check_schedule
from tests.parallel import _pp_training as T
from tests.parallel._tp_checks import assert_matches_reference
from tests.utils import assert_close, run_distributed

# ---------------------------------------------------------------------------------- one process


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models here are tiny: one intra-op thread is fastest (and fair on a shared 2-core CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def test_uniform_and_balanced_partitions():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_balanced([1, 1, 1, 1, 1], 2) == [0, 3, 5]
    assert partition_balanced([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5, 6]
    assert partition_balanced([0, 5, 5, 5, 5, 0], 2) == [0, 3, 6]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 non-empty stages"):
        partition_balanced([1, 1], 3)


def test_partition_methods_on_the_gpt_layers():
    """embed, positions, 4 blocks, norm, head: "parameters" balances counts (the blocks dominate),
    "type:GPTBlock" puts two blocks on each stage, "uniform" four layers each."""
    layers = gpt_layer_specs(**T.CFG)
    assert len(layers) == 8
    assert partition_layers(layers, 2, "uniform") == [0, 4, 8]
    assert partition_layers(layers, 2, "type:gptblock") == [0, 4, 8]
    by_params = partition_layers(layers, 2, "parameters")
    counts = [sum(p.numel() for p in spec.build().parameters()) for spec in layers]
    worst = max(sum(counts[by_params[s]:by_params[s + 1]]) for s in range(2))
    assert worst == min(max(sum(counts[:k]), sum(counts[k:])) for k in range(1, 8)), "not the best split"
    for bad in ("params", "type:", "type:[", 3):
        with pytest.raises(ValueError, match="partition_method"):
            partition_layers(layers, 2, bad)


def test_refusals_before_anything_is_built():
    layers = gpt_layer_specs(**T.CFG)
    with pytest.raises(ValueError, match=r"PipelineModule needs loss_fn, a callable\(outputs, labels\)"):
        PipelineModule(layers, num_stages=1)
    with pytest.raises(ValueError, match="12 stages .* but only 8 layers; every stage needs at least one layer"):
        PipelineModule(layers, num_stages=12, loss_fn=gpt_loss)
    with pytest.raises(ValueError, match=r"8 stages \(4 pipeline ranks x 2 per rank\) but only 3 layers"):
        PipelineModule(layers[:3], num_stages=4, loss_fn=gpt_loss, stages_per_rank=2)
    with pytest.raises(ValueError, match="layers\\[1\\] is int; allowed: LayerSpec"):
        PipelineModule([layers[0], 3], loss_fn=gpt_loss)
    with pytest.raises(ValueError, match="LayerSpec: typename must be an nn.Module subclass"):
        LayerSpec(len)
    with pytest.raises(ValueError, match="TiedLayerSpec: key must be a non-empty string"):
        TiedLayerSpec("", torch.nn.Linear, 2, 2)


@pytest.mark.parametrize(
    ("name", "per_rank", "micro", "stages", "message"),
    [("zero-bubble", 1, 4, 2, "allowed: 'GPipe', '1F1B', 'interleaved_1F1B'"),
     ("interleaved_1F1B", 1, 4, 2, "needs a PipelineModule with stages_per_rank >= 2"),
     ("GPipe", 2, 4, 2, "use schedule='interleaved_1F1B'"),
     ("1F1B", 1, 3, 4, "needs micro_batches >= pipeline stages \\(4\\)"),
     ("interleaved", 2, 5, 2, "micro_batches divisible by max\\(1, micro_batches // pp\\) = 2"),
     ("GPipe", 1, 0, 2, "micro_batches must be an int >= 1")],
)
def test_schedules_that_do_not_fit_are_refused(name, per_rank, micro, stages, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(name, per_rank, micro, stages)
    assert check_schedule("gpipe", 1, 2, 4) == "gpipe" and check_schedule("Interleaved1F1B", 2, 4, 2) == "interleaved_1f1b"


@pytest.mark.parametrize("kw", [{}, {"position": "rope", "tie_embeddings": False, "normalization": "RMSNorm"}])
def test_gpt_state_dict_maps_to_pipeline_names_and_back(kw):
    from tachyon.train.models import GPT

    gpt = GPT(**T.CFG, **kw)
    state = gpt.state_dict()
    net = PipelineModule(gpt_layer_specs(**T.CFG, **kw), loss_fn=gpt_loss)
    mapped = gpt_state_dict_to_pipeline(state, T.CFG["num_layers"])
    assert mapped.keys() == net.state_dict().keys()
    net.load_full_state_dict(mapped)
    back = pipeline_state_dict_to_gpt(net.state_dict(), T.CFG["num_layers"], learned="position" not in kw)
    assert back.keys() == state.keys()
    ids, labels = T.batch(0)
    assert_close(gpt_loss(net(ids), labels), gpt(ids, labels=labels), name="pipeline layers vs GPT")
    with pytest.raises(ValueError, match="missing 1 keys of this rank's stages"):
        net.load_full_state_dict({k: v for k, v in mapped.items() if not k.startswith("3.self_attention.proj.weight")})


def test_seed_layers_makes_a_layer_independent_of_its_position():
    spec = LayerSpec(TransformerLayer, 32, 64, 4)
    net = PipelineModule([spec, spec, spec], loss_fn=gpt_loss, seed_layers=True, base_seed=7)
    state = torch.random.get_rng_state()
    torch.manual_seed(7 + 2)
    alone = spec.build()
    torch.random.set_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(getattr(net, "2").parameters(), alone.parameters()))
    assert not torch.equal(getattr(net, "0").self_attention.proj.weight, getattr(net, "1").self_attention.proj.weight)


def _single_stage_training(checkpoint_interval: int) -> dict:
    net = PipelineModule(gpt_layer_specs(**T.CFG), loss_fn=gpt_loss, activation_checkpoint_interval=checkpoint_interval)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(T.build_gpt().state_dict(), T.CFG["num_layers"]))
    runner = PipelineSchedule(net, micro_batches=4, schedule="1F1B")
    opt = T.optimizer(net.parameters())
    for step in range(T.STEPS):
        opt.zero_grad()
        runner.train_batch(iter(list(zip(*(t.chunk(4) for t in T.batch(step))))))
        opt.step()
    ids, labels = T.batch(T.STEPS)
    loss, logits = runner.eval_batch(iter(list(zip(ids.chunk(4), labels.chunk(4)))), return_logits=True)
    return {"state": pipeline_state_dict_to_gpt(dict(net.named_parameters()), T.CFG["num_layers"]),
            "eval": (loss, logits), "net": net}


@pytest.mark.parametrize("checkpoint_interval", [0, 2])
def test_one_stage_accumulates_micro_batches_like_one_step(checkpoint_interval):
    """num_stages=1: no process group; train_batch accumulates the micro-batches' gradients of the
    mean loss, with or without activation checkpointing every 2 layers; eval_batch is GPT's loss."""
    reference = T.reference_state()
    initial = {k: p.detach().clone() for k, p in T.build_gpt().named_parameters()}
    got = _single_stage_training(checkpoint_interval)
    state = {k: v.detach() for k, v in got["state"].items()}
    assert_matches_reference(state, reference, initial, f"one stage, checkpoint every {checkpoint_interval}")
    gpt = T.build_gpt()
    gpt.load_state_dict({**gpt.state_dict(), **state})  # lm_head.weight is the trained embedding (tied)
    ids, labels = T.batch(T.STEPS)
    loss, logits = got["eval"]
    assert_close(loss, gpt.eval()(ids, labels=labels).detach(), name="eval_batch loss")
    assert logits.shape == (T.GLOBAL_BATCH, T.SEQ, 64) and got["net"].training, "eval_batch restores train mode"


def test_loss_scale_scales_the_gradients_not_the_returned_loss():
    """fp16 loss scaling: the engine passes its scaler; the backward inside the schedule starts
    from the scaled loss."""
    grads, losses = [], []
    for scale in (None, lambda: 1024.0):
        net = PipelineModule(gpt_layer_specs(**T.CFG), loss_fn=gpt_loss, seed_layers=True)
        runner = PipelineSchedule(net, micro_batches=2, schedule="GPipe", loss_scale=scale)
        losses.append(runner.train_batch(iter(list(zip(*(t.chunk(2) for t in T.batch(0)))))))
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    assert_close(losses[1], losses[0], name="returned loss")
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad * 1024.0, name=f"scaled gradient of {name}")
    with pytest.raises(ValueError, match="loss_scale must be a callable"):
        PipelineSchedule(net, micro_batches=2, loss_scale=2.0)


# ---------------------------------------------------------------------------------- two ranks

MICRO = 4


def _pp_rank() -> dict:
    from tachyon.parallel import Mesh

    mesh = Mesh(pp=2)
    out: dict = {"reference": T.reference_state(),
                 "initial": {k: p.detach().clone() for k, p in T.build_gpt().named_parameters()}}
    for name, schedule, per_rank, kw in (("gpipe", "GPipe", 1, {}), ("1f1b", "1F1B", 1, {}),
                                         ("interleaved", "interleaved_1F1B", 2, {}),
                                         ("1f1b_checkpointed", "1F1B", 1, {"checkpoint_interval": 1})):
        state, tied, losses = T.train_pipeline(mesh, schedule, MICRO, per_rank, **kw)
        out[name] = {"state": state, "tied": tied, "losses": losses}
    for name, schedule, per_rank in (("gpipe", "GPipe", 1), ("1f1b", "1F1B", 1), ("interleaved", "interleaved_1F1B", 2)):
        out[f"comm/{name}"] = [(c.kind, c.axis, c.payload) for c in T.pipeline_step_comm(mesh, schedule, MICRO, per_rank)]
    out["in_flight"] = {name: T.pipeline_in_flight(mesh, name, MICRO) for name in ("GPipe", "1F1B")}
    net, runner = T.build_pipeline(mesh, "1F1B", MICRO)
    ids, labels = T.batch(0)
    loss, logits = runner.eval_batch(iter(list(zip(ids.chunk(MICRO), labels.chunk(MICRO)))), return_logits=True)
    out["eval"] = (float(loss), None if logits is None else tuple(logits.shape), float(T.build_gpt()(ids, labels=labels)))
    out["stage_ids"], out["parts"] = net.stage_ids, net.parts
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_pp_rank, 2, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "1f1b_checkpointed"])
def test_pp2_trains_like_one_process_with_tied_weights_bit_identical(ranks, schedule):
    for rank, result in enumerate(ranks):
        got = result[schedule]
        assert_matches_reference(got["state"], result["reference"], result["initial"], f"pp2 {schedule}, rank {rank}")
        assert list(got["tied"]) == ["tied_modules.embed.weight"]
        first, last = got["tied"]["tied_modules.embed.weight"]
        assert torch.equal(first, last), f"{schedule}: the tied embedding differs between its two stages"
    assert ranks[0][schedule]["losses"] == ranks[1][schedule]["losses"], "every stage reports the batch loss"


@pytest.mark.distributed
def test_interleaved_1f1b_equals_1f1b(ranks):
    """Same layers, same micro-batches, same accumulation order: the parameters are bit-identical
    (and GPipe's too)."""
    one, inter, gpipe = ranks[0]["1f1b"], ranks[0]["interleaved"], ranks[0]["gpipe"]
    assert one["losses"] == inter["losses"] == gpipe["losses"]
    for key, value in one["state"].items():
        assert torch.equal(inter["state"][key], value), f"interleaved 1F1B vs 1F1B differ in {key}"
        assert torch.equal(gpipe["state"][key], value), f"GPipe vs 1F1B differ in {key}"


@pytest.mark.distributed
def test_p2p_bytes_per_micro_batch_are_one_activation(ranks):
    """Each stage boundary carries one [micro_batch, seq, hidden] fp32 activation forward and its
    gradient backward per micro-batch; nothing else crosses the pipeline but the tied embedding's
    gradient all-reduce and the loss broadcast. Interleaved (4 virtual stages on 2 ranks): 3
    boundaries, each rank sends across 3 of the 6 directed crossings."""
    activation = (T.GLOBAL_BATCH // MICRO) * T.SEQ * T.CFG["hidden_size"] * 4
    embedding = 64 * T.CFG["hidden_size"] * 4
    for rank, result in enumerate(ranks):
        for name, sends in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3)):
            calls = result[f"comm/{name}"]
            assert {axis for _, axis, _ in calls} == {"pp"}, calls
            p2p = [payload for kind, _, payload in calls if kind in ("send", "recv")]
            assert p2p == [activation] * (2 * sends * MICRO), f"rank {rank} {name}: {p2p}"
            assert sorted((k, p) for k, _, p in calls if k not in ("send", "recv")) == [("all_reduce", embedding),
                                                                                     ("broadcast", 4)]


@pytest.mark.distributed
def test_1f1b_holds_at_most_stages_micro_batches_while_gpipe_holds_all(ranks):
    for rank, result in enumerate(ranks):
        for schedule, expected in (("GPipe", MICRO), ("1F1B", 2 - rank)):
            [(stage, peak, per_forward)] = result["in_flight"][schedule]
            assert stage == rank and len(per_forward) == MICRO and len(set(per_forward)) == 1, per_forward
            assert peak == expected * per_forward[0], (
                f"{schedule} stage {stage}: peak {peak} B of saved activations = {peak / per_forward[0]:g} micro-batches, "
                f"expected {expected}")
            if schedule == "1F1B":
                assert peak <= 2 * per_forward[0]


@pytest.mark.distributed
def test_eval_batch_and_placement(ranks):
    for rank, result in enumerate(ranks):
        loss, logits_shape, reference = result["eval"]
        assert abs(loss - reference) <= 1e-6 * reference
        assert logits_shape == ((T.GLOBAL_BATCH, T.SEQ, 64) if rank == 1 else None)
        assert result["stage_ids"] == [rank] and result["parts"] == [0, 4, 8]
    assert isinstance(GPTBlock(32, 64, 4), TransformerLayer)


@pytest.mark.parametrize("tie", [True, False])
def test_a_padded_vocabulary_is_cut_from_the_logits_as_gpt_does(tie):
    """GPT pads its vocabulary to a multiple of 64 rows and scores only the real ids; the layer
    list's head does the same, so a pipeline computes GPT's loss for any vocabulary size."""
    from tachyon.train.models import GPT

    cfg = {**T.CFG, "vocab_size": 70, "tie_embeddings": tie}  # padded to 128 rows
    torch.manual_seed(0)
    gpt = GPT(**cfg)
    net = PipelineModule(gpt_layer_specs(**cfg), loss_fn=gpt_loss)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(gpt.state_dict(), cfg["num_layers"]))
    ids = torch.randint(0, 70, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = net(ids)
    assert logits.shape == (2, 8, 70)
    torch.testing.assert_close(logits, gpt.logits(ids), rtol=1e-6, atol=1e-6)
    labels = torch.roll(ids, -1, dims=1)
    torch.testing.assert_close(gpt_loss(logits, labels), gpt(ids, labels=labels), rtol=1e-6, atol=1e-6)
