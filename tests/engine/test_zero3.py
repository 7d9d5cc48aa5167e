"""ZeRO stage 3 (FSDP2) through tachyon.initialize on 2 gloo ranks against single-process
plain-PyTorch training, and what stage 3 refuses.

One launch runs every configuration (spawning ranks costs seconds): fp32 (one FSDP2 unit per
Linear, or the root alone), gradient accumulation and clipping, two param groups, torch AdamW
and tachyon's FusedAdam from the config, bf16 with fp32 and bf16 reductions, fp16 with loss
scaling. The tests below only read the results.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tachyon.config import ConfigError, load_config
from tests.engine.zero3_cases import ACCOUNT_SHAPES, CKPT, SAVE_AT, Z3Case, rank_main
from tests.engine.zero_cases import (
    LR,
    WEIGHT_DECAY,
    as_tensors,
    batch,
    loss_fn,
    make_model,
    param_groups,
    reference_train,
)
from tests.utils import assert_close, run_distributed, tolerance

EQUIVALENCE = [
    Z3Case(),
    Z3Case(gas=2, clip=0.5, groups=True),
    Z3Case(optimizer="config-adam", units=(), groups=True, prefetch=False),
    Z3Case(precision="bf16", comm="fp32", gas=2, clip=0.5),
    Z3Case(precision="bf16", gas=2, clip=0.5, groups=True),
    Z3Case(precision="fp16", gas=2, clip=0.5),
    # ZeRO-Offload: masters, optimizer states and the step on the host (stages 1-3), parameters too (stage 3)
    Z3Case(offload="optimizer", gas=2, clip=0.5, optimizer="config-adam"),
    Z3Case(offload="optimizer", precision="bf16", comm="fp32", gas=2, clip=0.5),
    Z3Case(offload="param", gas=2, clip=0.5, groups=True, optimizer="config-adam"),
    Z3Case(offload="param", precision="bf16", comm="fp32"),
    Z3Case(stage=1, offload="optimizer", gas=2, clip=0.5, optimizer="config-adam", units=()),
    Z3Case(stage=2, offload="optimizer", precision="bf16", comm="fp32", gas=2, clip=0.5, groups=True, units=()),
]
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def z3world(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("zero3")
    results = run_distributed(rank_main, 2, EQUIVALENCE, str(root), timeout=400)
    yield 2, results, root
    torch.set_num_threads(threads)


@pytest.mark.distributed
@pytest.mark.parametrize("case", EQUIVALENCE, ids=lambda c: c.name)
def test_stage3_matches_single_process_training(z3world, case):
    """The parameters after 5 steps equal plain PyTorch's on the whole batch: fp32 within 1e-5;
    bf16 reduced in fp32 within bf16's tolerance element by element; bf16 and fp16 reduced in
    their own dtype within their tolerance relative to each tensor's norm (a sum rounded to bf16
    can cancel to ~0). The global norm is the single-process one on every rank."""
    world_size, results, _ = z3world
    reference = reference_train(case.as_case(), world_size)
    low = case.precision != "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.precision]
    rtol, _ = tolerance(dtype)
    for rank, result in enumerate(results):
        got = result["cases"][case.name]
        assert got["stage"] == case.stage
        if case.stage == 3:
            assert got["units"] == (3 if case.units else 1)  # two Linear units + the root
        if case.offload:  # everything the optimizer touches is on the host, reported as offloaded
            assert got["devices"] == ["cpu"] and got["memory"]["offloaded"] > 0
            assert got["host_step"] is (True if case.optimizer == "config-adam" else None)
        assert got["global_steps"] == case.steps and got["micro_steps"] == case.steps * case.gas
        for i, (actual, expected) in enumerate(zip(as_tensors(got["params"]), reference["params"])):
            name = f"{case.name} rank {rank} parameter {i}"
            if not low:
                assert_close(actual, expected, rtol=FP32_RTOL, atol=FP32_ATOL, name=name)
            elif case.comm == "fp32":
                assert_close(actual, expected, dtype=torch.bfloat16, name=name)
            else:
                error = float((actual - expected).norm() / expected.norm())
                assert error <= rtol, f"{name}: relative error {error:.3g} > {rtol} (norm-wise)"
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=rtol if low else 1e-5,
                     atol=1e-6, name=f"{case.name}: grad norms on rank {rank}")
    if case.clip:
        assert max(reference["norms"]) > case.clip, "clipping never engaged; the case tests nothing"


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.distributed
def test_stage3_checkpoints_load_across_stages(z3world):
    """Saved at stage 3 after 3 steps on 2 ranks and loaded by fresh engines at stage 3 and at
    stage 2 (and a stage 2 checkpoint loaded at stage 3): the 2 steps after the load end where
    uninterrupted training does (single-process reference, 1e-5). A frozen parameter comes back."""
    world_size, results, _ = z3world
    at_save = reference_train(dataclasses.replace(CKPT, steps=SAVE_AT).as_case(), world_size)["params"]
    final = reference_train(CKPT.as_case(), world_size)["params"]
    for rank, result in enumerate(results):
        got = result["ckpt"]
        for key, expected in [("at_save", at_save), ("3->3 uninterrupted", final), ("3->3", final), ("3->2", final),
                              ("2->3", final)]:
            for i, (actual, want) in enumerate(zip(as_tensors(got[key]), expected)):
                assert_close(actual, want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"{key} rank {rank} parameter {i}")
        assert got["frozen"] == {3: [0.25] * 13, 2: [0.25] * 13}


def test_stage3_checkpoint_loads_in_one_process_and_exports(z3world, tmp_path):
    """The 2-rank stage-3 checkpoint: loaded by a single-process stage 0 engine (training goes on
    to the reference's step 5, the two ranks' batches as two micro-steps), rebuilt offline by
    export_model_state_dict, written by `tachyon export` (bf16 safetensors) and by the live
    engine's save_16bit_model: all equal to the weights at the save."""
    import tachyon
    from tachyon.cli import main
    from tachyon.engine.checkpoint import export_model_state_dict

    world_size, _, root = z3world
    at_save = reference_train(dataclasses.replace(CKPT, steps=SAVE_AT).as_case(), world_size)["params"]
    final = reference_train(CKPT.as_case(), world_size)["params"]
    names = [n for n, _ in make_model().named_parameters()]
    exported = export_model_state_dict(root / "z3")
    for name, want in zip(names, at_save):
        assert_close(exported[name], want, rtol=0, atol=0, name=f"export_model_state_dict {name}")
    from safetensors.torch import load_file

    written = load_file(str(root / "z3-16bit" / "model.safetensors"))
    for name, want in zip(names, at_save):
        assert_close(written[name], want, rtol=0, atol=0, name=f"save_16bit_model {name}")
    assert main(["export", str(root / "z3"), str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    bf16 = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, want in zip(names, at_save):
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], want.to(torch.bfloat16)), name

    model = make_model()
    cfg = CKPT.config(1)
    cfg.update(zero_optimization={"stage": 0}, gradient_accumulation_steps=world_size,
               train_batch_size=cfg["train_batch_size"] * world_size)
    engine, _, _, _ = tachyon.initialize(
        model=model, model_parameters=param_groups(model, CKPT.groups), config=cfg,
        optimizer=lambda g: torch.optim.AdamW(g, lr=LR, weight_decay=WEIGHT_DECAY))
    engine.load_checkpoint(root / "z3")
    for step in range(SAVE_AT, CKPT.steps):
        for rank in range(world_size):
            x, y = batch(step, 0, rank, torch.float32)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    for i, (actual, want) in enumerate(zip(model.parameters(), final)):
        assert_close(actual.detach(), want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"3 -> one process, parameter {i}")


# ---------------------------------------------------------------------- tachyon.zero.Init
@pytest.mark.distributed
def test_models_built_under_zero_init_train_like_plain_ones(z3world):
    """Built under tachyon.zero.Init (every parameter a meta tensor until initialize allocates this
    rank's shard), with the root sharded at the end of the block or each Linear as it is attached
    (values then written inside GatheredParameters(modifier_rank=0)): 5 stage-3 steps equal the
    single-process reference. GatheredParameters on the live engine's parameter: whole inside,
    rank 0's change kept on every rank, the sharded parameter back in place after."""
    world_size, results, _ = z3world
    final = reference_train(Z3Case().as_case(), world_size)["params"]
    for rank, result in enumerate(results):
        got = result["init"]
        for key in ("units0", "units1"):
            assert got[key]["meta"], f"{key}: the model built under Init should hold no parameter storage"
            for i, (actual, want) in enumerate(zip(as_tensors(got[key]["params"]), final)):
                assert_close(actual, want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"Init {key} rank {rank} parameter {i}")
        assert got["gathered"] == {"shape": (13, 6), "after": [1.0], "same_object": True}
        # refused before anything changes: shards kept for 4 ranks, or a stage below 3
        assert "built under tachyon.zero.Init as rank 0 of 4" in got["refused"][3][0] and got["refused"][3][1]
        assert "needs zero_optimization.stage 3" in got["refused"][2][0] and got["refused"][2][1]
        # Linear(5, 3) on 2 ranks: rank 0 keeps rows 0-1 (10 values), rank 1 row 2 (5)
        assert got["patching"] == {"unit_meta": True, "kept": ((10,) if rank == 0 else (5,)), "other_meta": False,
                                   "restored": True}


# ---------------------------------------------------------------------- bytes per rank and on the wire
@pytest.mark.distributed
def test_stage3_holds_16_psi_over_n_and_moves_3_psi_per_step(z3world):
    """Linear(8, 16) + Linear(16, 8) (Psi = 280, each Linear a unit, the root holding none), bf16
    with fp32 masters and AdamW, 2 ranks, after a step's backward: the model states are the ZeRO
    paper's 16 Psi / N to the byte (fp32 parameter shards = the masters 4, fp32 gradient shards
    4, Adam's moments 8) plus the declared extras (Adam's 4-byte step per parameter); every live
    tensor storage of the process is that plus the batch. On the wire per step (ring volumes):
    the forward and backward all-gathers and the reduce-scatter each move (N-1)/N Psi bf16
    values: 3 Psi, 1.5x data parallel's all-reduce (2 Psi), where stages 1 and 2 move 2 Psi;
    besides, only the global norm's and the overflow check's fp32 scalars."""
    world_size, results, _ = z3world
    psi, n, bf16 = sum(math.prod(s) for s in ACCOUNT_SHAPES), world_size, 2
    step_counters = 4 * len(ACCOUNT_SHAPES)
    for rank, result in enumerate(results):
        got = result["accounting"]
        memory = got[3]["memory"]
        assert memory["parameters"] == 4 * psi // n and memory["gradients"] == 4 * psi // n, memory
        assert memory["master_weights"] == 0 and memory["gathered"] == 0, memory
        assert memory["optimizer_states"] == 8 * psi // n + step_counters, memory
        assert memory["model_states"] == 16 * psi // n + step_counters, memory
        assert memory["model_states"] <= got[3]["live"] <= memory["model_states"] + 64, got[3]["live"]
        offloaded = got["3-offload"]["memory"]  # parameters, gradients and optimizer all on the host
        assert offloaded["offloaded"] == offloaded["model_states"] == memory["model_states"], offloaded
        sent = {stage: sum(s for kind, dtype, _, s in got[stage]["calls"] if dtype == "bfloat16") for stage in got}
        scalars = [c for stage in got for c in got[stage]["calls"] if c[1] != "bfloat16"]
        assert all(kind == "all_reduce" and payload <= 8 for kind, _, payload, _ in scalars), scalars
        ring = (n - 1) / n * psi * bf16  # one collective over Psi bf16 values, per rank
        assert sent[3] == 3 * ring, got[3]["calls"]
        kinds = sorted(kind for kind, dtype, _, _ in got[3]["calls"] if dtype == "bfloat16")
        assert kinds == ["all_gather"] * 4 + ["reduce_scatter"] * 2  # 2 units x (forward, backward) + 2
        # data parallel all-reduces its flat gradient, padded to a multiple of N * 8 elements
        padded = -(-psi // (8 * n)) * 8 * n
        assert sent[0] == 2 * (n - 1) / n * padded * bf16 and sent[3] / (2 * ring) == 1.5
        assert sent[1] == sent[2] == sent[0] and sent["3-offload"] == sent[3], sent


@pytest.mark.distributed
def test_zero_init_finds_hf_layer_classes_without_unit_classes(z3world):
    """Tiny HF GPT-2 and BERT (configs built offline) under tachyon.zero.Init() with no unit classes
    named: each GPT2Block / BertLayer is already sharded (meta) when it is attached to its parent,
    the layer classes being read from the HF classes' _no_split_modules / _can_record_outputs;
    HF's own weight initialization still reaches the layers (GPT-2's c_proj at 0.02 / sqrt(2 x 2
    layers) = 0.01, BERT's Linears at 0.02 where torch's default would give ~0.07); and the GPT-2
    trains at stage 3 (GPT2Block as the unit) to what the same weights reach in one process."""
    from tests.engine.zero3_hf_cases import train_plain

    _, results, _ = z3world
    for rank, result in enumerate(results):
        got = result["hf"]
        assert got["gpt2"]["layers_meta_when_attached"] == {"GPT2Block.0": True, "GPT2Block.1": True}
        assert got["bert"]["layers_meta_when_attached"] == {"BertLayer.0": True, "BertLayer.1": True}
        assert got["gpt2"]["all_meta"] and got["bert"]["all_meta"]
        init = got["gpt2"]["init"]
        assert 0.018 < init["c_attn"] < 0.022 and 0.008 < init["c_proj"] < 0.012, init
        init = got["bert"]["init"]
        assert 0.018 < init["query"] < 0.022 and 0.018 < init["dense"] < 0.022, init
        assert "FSDPGPT2Block" in got["gpt2"]["units"]  # FSDP2 names the sharded class FSDP<class>
    initial = results[0]["hf"]["gpt2"]["initial"]
    assert all(torch.equal(initial[k], v) for k, v in results[1]["hf"]["gpt2"]["initial"].items())
    want = train_plain(initial)
    for rank, result in enumerate(results):
        for name, value in result["hf"]["gpt2"]["final"].items():
            assert not torch.equal(value, initial[name]) or name.endswith("bias"), name
            assert_close(value, want[name], rtol=FP32_RTOL, atol=FP32_ATOL, name=f"GPT-2 rank {rank} {name}")


# ---------------------------------------------------------------------- composition
@pytest.mark.distributed
def test_stage3_composes_with_activation_checkpointing_and_the_flops_profiler(z3world):
    """Two TransformerLayers (stage-3 units) and a head, 3 SGD steps on 2 ranks, every layer under
    tachyon.checkpointing.checkpoint (configured from the engine config's activation_checkpointing
    section; FSDP2 gathers each layer again for its recomputation) and the flops profiler on at
    step 1: stage 3 ends with stage 2's parameters (fp32 within 1e-5) and losses, recomputes each
    layer once per step as stage 2 does, and profiles the same parameter count (whole
    parameters, not shards), FLOPs and MACs, forward and backward (the recomputed forwards in
    the backward's count at both stages)."""
    _, results, _ = z3world
    for rank, result in enumerate(results):
        got = result["compose"]
        base, run = got[2], got[3]
        assert (base["stage"], run["stage"]) == (2, 3)
        assert run["recomputes"] == base["recomputes"] == 2 * 3  # 2 layers x 3 steps
        assert base["moved"] > 1e-3  # training changed the parameters
        assert run["params"].keys() == base["params"].keys()
        for key, want in base["params"].items():
            assert_close(run["params"][key], want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"stage 3 rank {rank} {key}")
        assert_close(torch.tensor(run["losses"]), torch.tensor(base["losses"]), rtol=FP32_RTOL, atol=FP32_ATOL,
                     name=f"stage 3 rank {rank} losses")
        if rank != 0:  # the profiler runs on global rank 0
            assert base["profile"] is None and run["profile"] is None
            continue
        assert run["profile"] == base["profile"], (run["profile"], base["profile"])
        assert run["profile"]["params"] == sum(p.numel() for p in base["params"].values())
        # backward ~2x the forward, plus the recomputed forward: ~3x
        assert run["profile"]["fwd_flops"] > 0 and run["profile"]["bwd_flops"] > 2.5 * run["profile"]["fwd_flops"]


# ---------------------------------------------------------------------- refusals
def _config(**zero) -> dict:
    return {"train_batch_size": 4, "zero_optimization": {"stage": 3, **zero}}


@pytest.mark.parametrize("extra, words", [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "1-bit"),
    ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}}, "1-bit"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "trust ratio"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"quantize_training": {"enabled": True}}, "MoQ"),
    ({"cuda_graph": {"enabled": True}}, "captured graph"),
])
def test_stage3_refuses_by_name(extra, words):
    with pytest.raises(ConfigError) as info:
        load_config({**_config(), **extra}, 4)
    assert "zero_optimization.stage: 3" in str(info.value) and words in str(info.value)


def test_stage3_keys_are_mapped_or_reported():
    """DeepSpeed's stage-3 keys: the prefetch size drives FSDP2's forward prefetch (under either
    spelling); the others, and the stage 1/2 bucket keys given at stage 3, are reported with a reason."""
    cfg = load_config(_config(prefetch_bucket_size=0, stage3_param_persistence_threshold=1e5,
                              stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9,
                              stage3_gather_16bit_weights_on_model_save=True, reduce_bucket_size=1000,
                              overlap_comm=True, contiguous_gradients=True, sub_group_size=1e9), 4)
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 0
    from tachyon.config.config import IGNORED_VALUES
    from tachyon.config.keys import ignored_reason

    reported = set(cfg.ignored_keys)
    for key in ("stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "reduce_bucket_size", "overlap_comm",
                "contiguous_gradients", "sub_group_size"):
        path = f"zero_optimization.{key}"
        assert path in reported, path
        assert (ignored_reason(path) or IGNORED_VALUES.get(path)), f"{path} has no reason"
    with pytest.raises(ConfigError, match="name the same setting"):
        load_config(_config(prefetch_bucket_size=0, stage3_prefetch_bucket_size=5), 4)
    assert load_config(_config(), 4).zero_optimization.stage3_prefetch_bucket_size > 0


def test_stage3_refuses_inputs_before_touching_the_model():
    """A PipelineModule, a Lamb or 1-bit optimizer object and an unknown unit class are refused by
    initialize before torch.distributed starts or the model changes."""
    import torch.distributed as dist

    import tachyon
    from tachyon.engine.optim import Lamb

    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    for kwargs, words in (
        ({"optimizer": Lamb(model.parameters())}, "Lamb"),
        ({"config": _config(shard_module_classes=["NoSuchBlock"])}, "NoSuchBlock"),
    ):
        kwargs.setdefault("config", _config())
        with pytest.raises(ValueError, match=words):
            tachyon.initialize(model=model, **kwargs)
    assert not dist.is_initialized()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert type(model) is torch.nn.Sequential


@pytest.mark.slow
@pytest.mark.distributed
def test_stage3_checkpoint_from_4_ranks_resumes_on_2(tmp_path):
    """Stage 3 saved on 4 ranks, loaded at stage 3 on 2 ranks (each taking two of the saving ranks'
    batches as micro-steps): step 5 equals the single-process reference within 1e-5."""
    from tests.engine.zero3_cases import resume_with_fewer_ranks, save_on_ranks

    saved = run_distributed(save_on_ranks, 4, str(tmp_path), timeout=300)
    at_save = reference_train(dataclasses.replace(CKPT, steps=SAVE_AT).as_case(), 4)["params"]
    for i, (actual, want) in enumerate(zip(as_tensors(saved[0]), at_save)):
        assert_close(actual, want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"4 ranks at the save, parameter {i}")
    resumed = run_distributed(resume_with_fewer_ranks, 2, str(tmp_path), 4, timeout=300)
    final = reference_train(CKPT.as_case(), 4)["params"]
    for rank, params in enumerate(resumed):
        for i, (actual, want) in enumerate(zip(as_tensors(params), final)):
            assert_close(actual, want, rtol=FP32_RTOL, atol=FP32_ATOL, name=f"4 -> 2 ranks, rank {rank} parameter {i}")


def test_tachyon_export_writes_an_hf_folder(tmp_path):
    """A checkpoint of an HF model keeps its config: `tachyon export` writes a folder that
    from_pretrained loads with the trained weights (tied embeddings stored once)."""
    transformers = pytest.importorskip("transformers")
    import tachyon
    from tachyon.cli import main

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    engine, _, _, _ = tachyon.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(got, want), name


def test_offload_is_refused_without_host_memory_and_for_nvme(monkeypatch):
    """The offloaded states' host bytes are estimated first (16 bytes per trained parameter per
    shard, times the ranks on the node): too little available memory refuses initialize before
    anything changes; NVMe offload and offload_param below stage 3 are refused by name."""
    import torch.distributed as dist

    import tachyon
    from tachyon.engine.zero import offload

    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 16 * psi - 1)
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="host memory"):
        tachyon.initialize(model=model, config=cfg, optimizer=lambda g: torch.optim.AdamW(g))
    assert not dist.is_initialized() and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 16 * psi)
    offload.check_offload_inputs(model, load_config(cfg, 1))  # exactly enough: accepted
    with pytest.raises(ConfigError, match='offload_optimizer.device: "nvme"'):
        load_config(_config(offload_optimizer={"device": "nvme"}), 4)
    with pytest.raises(ConfigError, match='offload_param.device: "nvme"'):
        load_config(_config(offload_param={"device": "nvme"}), 4)
    with pytest.raises(ConfigError, match="at stage 3"):
        load_config({"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 4)
    with pytest.raises(ConfigError, match="stage 1, 2 or 3"):
        load_config({"train_batch_size": 4, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 4)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_model_larger_than_a_rank_trains_under_zero_init_on_4_ranks():
    """Each rank's private memory is capped (RLIMIT_DATA) at its size after start-up plus 80% of
    the model's fp32 bytes (100 MB): building the model whole fails on every rank, building it
    under tachyon.zero.Init (each Linear sharded as its constructor returns, before the list of
    layers is complete) and training it at stage 3 on 4 ranks works (finite losses). Slow: 4
    ranks on 2 cores with a 100 MB model (about a minute)."""
    from tests.engine.zero3_cases import (
        CAPPED_LAYERS,
        CAPPED_WIDTH,
        train_under_memory_cap,
    )

    full = CAPPED_LAYERS * (CAPPED_WIDTH + 1) * CAPPED_WIDTH * 4
    results = run_distributed(train_under_memory_cap, 4, int(0.8 * full), timeout=600)
    for rank, got in enumerate(results):
        assert got["full_bytes"] > got["budget"], "the cap must be below the model's fp32 size"
        assert got["plain_error"] is not None, f"rank {rank}: building the whole model fit under the cap"
        assert all(math.isfinite(v) for v in got["losses"]), got["losses"]
        assert got["memory"]["parameters"] < full / 3, got["memory"]  # a quarter of the model, plus padding
