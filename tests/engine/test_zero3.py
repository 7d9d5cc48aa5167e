"""ZeRO stage 3 (FSDP2) through tachyon.initialize on 2 gloo ranks against single-process
plain-PyTorch training, and what stage 3 refuses.

One launch runs every configuration (spawning ranks costs seconds): fp32 (one FSDP2 unit per
Linear, or the root alone), gradient accumulation and clipping, two param groups, torch AdamW
and tachyon's FusedAdam from the config, bf16 with fp32 and bf16 reductions, fp16 with loss
scaling. The tests below only read the results.
"""

from __future__ import annotations

import pytest
import torch

from tachyon.config import ConfigError, load_config
from tests.engine.zero3_cases import Z3Case, run_z3_cases
from tests.engine.zero_cases import as_tensors, make_model, reference_train
from tests.utils import assert_close, run_distributed, tolerance

EQUIVALENCE = [
    Z3Case(),
    Z3Case(gas=2, clip=0.5, groups=True),
    Z3Case(optimizer="config-adam", units=(), groups=True, prefetch=False),
    Z3Case(precision="bf16", comm="fp32", gas=2, clip=0.5),
    Z3Case(precision="bf16", gas=2, clip=0.5, groups=True),
    Z3Case(precision="fp16", gas=2, clip=0.5),
]
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def z3world():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = run_distributed(run_z3_cases, 2, EQUIVALENCE, timeout=300)
    yield 2, results
    torch.set_num_threads(threads)


@pytest.mark.distributed
@pytest.mark.parametrize("case", EQUIVALENCE, ids=lambda c: c.name)
def test_stage3_matches_single_process_training(z3world, case):
    """The parameters after 5 steps equal plain PyTorch's on the whole batch: fp32 within 1e-5;
    bf16 reduced in fp32 within bf16's tolerance element by element; bf16 and fp16 reduced in
    their own dtype within their tolerance relative to each tensor's norm (a sum rounded to bf16
    can cancel to ~0). The global norm is the single-process one on every rank."""
    world_size, results = z3world
    reference = reference_train(case.as_case(), world_size)
    low = case.precision != "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.precision]
    rtol, _ = tolerance(dtype)
    for rank, result in enumerate(results):
        got = result[case.name]
        assert got["stage"] == 3 and got["units"] == (3 if case.units else 1)  # two Linear units + the root
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
