"""OneBitAdam: the warm-up is FusedAdam exactly, the compression stage's update math, arguments
and config, state dicts; and on 2 and 4 gloo ranks with a manual data-parallel loop: ranks stay
identical, bytes on the wire after freeze_step, convergence close to uncompressed Adam, and a
checkpoint taken mid-compression resumes identically.

The rank-side scenario (`onebit_rank_main`) is shared with test_onebit_lamb.py.
"""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
import torch.nn.functional as F

from tachyon.config.optim import check_typed_section
from tachyon.engine.optim import FusedAdam, OneBitAdam, build_optimizer
from tests.utils import assert_close, run_distributed

CONVERGENCE_RTOL = 0.02
"""Issue 11: after N steps the 1-bit optimizer's loss is within 2% of the uncompressed one's."""
WIRE_RATIO_LIMIT = 1 / 30
"""Issue 11: a compressed step sends at most 1/30 of an fp32 all-reduce of the gradients."""


# ---------------------------------------------------------------------- the shared scenario
# A classification problem whose labels come from a (sharpened) teacher network: the loss has a
# floor well above zero (~0.89), so "within 2%" compares what was learned. The global batch of
# every step is the same whatever the world size; rank r takes rows r::n of it.
IN, CLASSES, HIDDEN, GLOBAL_BATCH = 32, 8, 128, 64


def make_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES))
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))
    return teacher, model


def labelled(seed: int, rows: int, teacher: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=gen)
    with torch.no_grad():
        probs = torch.softmax(teacher(x) * 10, dim=-1)
    return x, torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _train(model, optimizer, teacher, steps: range, rank: int, world: int, *, averaged: bool, counter=None,
           count_steps=()) -> dict:
    """Manual data-parallel steps; returns {step: CommCounter sent/payload bytes} for count_steps."""
    from tachyon.engine.onebit_hooks import average_gradients, reduce_gradients
    from tachyon.parallel.tensor.comm_counter import CommCounter

    counted = {}
    for step in steps:
        x, y = labelled(1000 + step, GLOBAL_BATCH, teacher)
        loss = F.cross_entropy(model(x[rank::world]), y[rank::world])
        optimizer.zero_grad()
        loss.backward()
        with CommCounter() if step in count_steps else _nothing() as comm:
            if averaged:
                average_gradients(model.parameters())
            else:
                reduce_gradients(optimizer, model.parameters())
            optimizer.step()
        if step in count_steps:
            counted[step] = {"sent": comm.bytes(field="sent"), "payload": comm.bytes(),
                             "kinds": sorted({c.kind for c in comm.calls})}
    return counted


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def onebit_rank_main(kind: str, steps: int, freeze: int, lr: float, checkpoint_at: int) -> dict:
    """One rank: the uncompressed reference (FusedAdam / Lamb over averaged gradients), then the
    1-bit optimizer over the same data, then a restart from a checkpoint taken at
    ``checkpoint_at`` (mid-compression) replayed to the end."""
    import torch.distributed as dist

    from tachyon.engine.optim import Lamb, OneBitLamb

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    def build(which: str, model):
        if which == "reference":
            return FusedAdam(model.parameters(), lr=lr) if kind == "adam" else Lamb(model.parameters(), lr=lr)
        cls = OneBitAdam if kind == "adam" else OneBitLamb
        return cls(model.parameters(), lr=lr, freeze_step=freeze, comm_backend_name="gloo")

    def evaluate(model, teacher) -> float:
        x, y = labelled(7, 4096, teacher)
        with torch.no_grad():
            return F.cross_entropy(model(x), y).item()

    out: dict = {}
    teacher, model = make_models()
    out["initial_loss"] = evaluate(model, teacher)
    reference = build("reference", model)
    _train(model, reference, teacher, range(freeze), rank, world, averaged=True)
    out["reference_at_freeze"] = _flat(model)
    counted = _train(model, reference, teacher, range(freeze, steps), rank, world, averaged=True,
                     count_steps=(freeze,))
    out["reference_loss"] = evaluate(model, teacher)
    out["fp32_allreduce"] = counted[freeze]

    teacher, model = make_models()
    onebit = build("onebit", model)
    stages = []
    _train(model, onebit, teacher, range(freeze), rank, world, averaged=False)
    out["onebit_at_freeze"] = _flat(model)
    stages.append(onebit.in_compression_stage)
    variance = [onebit.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    counted = _train(model, onebit, teacher, range(freeze, checkpoint_at), rank, world, averaged=False,
                     count_steps=(freeze, freeze + 1))
    out["compressed_step"] = counted
    out["variance_frozen"] = all(torch.equal(v, onebit.state[p]["exp_avg_sq"])
                                 for v, p in zip(variance, model.parameters()))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": onebit.state_dict()}, buffer)
    _train(model, onebit, teacher, range(checkpoint_at, steps), rank, world, averaged=False)
    out["onebit_loss"] = evaluate(model, teacher)
    out["onebit_params"] = _flat(model)
    out["stages"] = stages + [onebit.in_compression_stage]
    saved = onebit.state_dict()
    out["error_norm"] = saved["error_feedback"]["worker_error"].norm().item()

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    teacher, model = make_models()
    resumed = build("onebit", model)
    model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    out["resumed_in_compression"] = resumed.in_compression_stage
    _train(model, resumed, teacher, range(checkpoint_at, steps), rank, world, averaged=False)
    out["resumed_params"] = _flat(model)
    return out


def check_scenario(kind: str, world: int, results: list[dict], *, exact_warmup: bool) -> None:
    """The assertions shared by the Adam and LAMB scenarios (see `onebit_rank_main`)."""
    first = results[0]
    for rank, r in enumerate(results):
        where = f"{kind} on {world} ranks, rank {rank}"
        # warm-up: the plain optimizer
        if exact_warmup:
            assert torch.equal(r["onebit_at_freeze"], r["reference_at_freeze"]), \
                f"{where}: warm-up differs from the plain optimizer"
        else:
            assert_close(r["onebit_at_freeze"], r["reference_at_freeze"], name=f"{where}: warm-up parameters")
        assert r["stages"] == [True, True] and r["variance_frozen"], f"{where}: stages {r['stages']}"
        # every rank holds the same model
        assert torch.equal(r["onebit_params"], first["onebit_params"]), f"{where}: parameters differ from rank 0's"
        # bytes: a compressed step moves sign bits and scales only
        for step, counted in r["compressed_step"].items():
            assert counted["kinds"] == ["all_gather", "all_to_all"], f"{where}, step {step}: {counted}"
            ratio = counted["sent"] / r["fp32_allreduce"]["sent"]
            assert ratio <= WIRE_RATIO_LIMIT, f"{where}, step {step}: sent {ratio:.4f} of an fp32 all-reduce"
        assert r["fp32_allreduce"]["kinds"] == ["all_reduce"]
        # convergence
        learned = r["initial_loss"] - r["reference_loss"]
        assert learned > 0.5, f"{where}: the reference barely learned ({r['initial_loss']} -> {r['reference_loss']})"
        gap = (r["onebit_loss"] - r["reference_loss"]) / r["reference_loss"]
        assert gap <= CONVERGENCE_RTOL, (f"{where}: loss {r['onebit_loss']:.4f} is {100 * gap:.2f}% above the "
                                         f"uncompressed {r['reference_loss']:.4f}")
        # checkpoint mid-compression (error buffers included) resumes bit for bit
        assert r["error_norm"] > 0, f"{where}: no error feedback to save; the checkpoint test proves nothing"
        assert r["resumed_in_compression"]
        assert torch.equal(r["resumed_params"], r["onebit_params"]), f"{where}: the resumed run differs"


def gpt_rank_main(kind: str, steps: int, freeze: int, lr: float, warmup: int = 100, floor: float = 0.1) -> dict:
    """One rank of the issue's own check: a small GPT on the embedded corpus (byte tokens, 64-token
    windows, 16 windows per global batch), uncompressed Adam / LAMB against the 1-bit optimizer,
    both under the same schedule (linear warm-up over ``warmup`` steps, then cosine decay to
    ``floor`` x lr, as a real run has); returns the validation loss (the first 128 validation
    windows) of each."""
    import torch.distributed as dist

    from tachyon.data import build_lm_datasets, collate
    from tachyon.engine.onebit_hooks import average_gradients, reduce_gradients
    from tachyon.engine.optim import Lamb, OneBitLamb
    from tachyon.train.models import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    train, val = build_lm_datasets("causal", 64, tokenizer="byte")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    val_batch = collate([val[i] for i in range(128)])
    out = {}
    for which in ("reference", "onebit"):
        torch.manual_seed(0)
        model = GPT(train.tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=4, max_seq_len=64)
        if which == "reference":
            opt = FusedAdam(model.parameters(), lr=lr) if kind == "adam" else Lamb(model.parameters(), lr=lr)
        else:
            cls = OneBitAdam if kind == "adam" else OneBitLamb
            opt = cls(model.parameters(), lr=lr, freeze_step=freeze, comm_backend_name="gloo")
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_warmup_cosine, warmup, steps, floor))
        per_epoch = len(order) // 16
        for step in range(steps):
            at = step % per_epoch
            rows = order[at * 16:(at + 1) * 16][rank::world].tolist()
            batch = collate([train[i] for i in rows])
            opt.zero_grad()
            model(batch["input_ids"], batch["attention_mask"], batch["labels"]).backward()
            if which == "reference":
                average_gradients(model.parameters())
            else:
                reduce_gradients(opt, model.parameters())
            opt.step()
            schedule.step()
        with torch.no_grad():
            out[which] = model(val_batch["input_ids"], val_batch["attention_mask"], val_batch["labels"]).item()
    return out


def _warmup_cosine(warmup: int, steps: int, floor: float, step: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_gpt(kind: str, results: list[dict]) -> None:
    for rank, r in enumerate(results):
        gap = (r["onebit"] - r["reference"]) / r["reference"]
        assert r["reference"] < 2.2, f"the reference GPT barely learned: validation loss {r['reference']:.3f}"
        assert abs(gap) <= CONVERGENCE_RTOL, (f"rank {rank}: 1-bit {kind} GPT validation loss {r['onebit']:.4f} is "
                                              f"{100 * gap:+.2f}% from the uncompressed {r['reference']:.4f}")


# docs/onebit.md: 1000 steps, variance frozen after 20-25% of them (DeepSpeed's guidance), each
# optimizer at a learning rate it converges with; measured +0.21% (Adam) and +0.64% (LAMB)
@pytest.mark.slow
@pytest.mark.distributed
def test_onebit_adam_small_gpt_on_the_embedded_corpus():
    check_gpt("Adam", run_distributed(gpt_rank_main, 2, "adam", 1000, 200, 3e-3, timeout=1800))


# The 4-rank run (about a CPU-minute) takes the same code paths as the 2-rank one; the
# compressed all-reduce on 4 ranks (uneven chunks, four server chunks) stays in the default run
# in tests/parallel/test_compression.py and tests/parallel/test_onebit_parallel.py.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def adam_world(request):
    return request.param, run_distributed(onebit_rank_main, request.param, "adam", 240, 80, 3e-3, 120, timeout=600)


@pytest.mark.distributed
def test_onebit_adam_data_parallel(adam_world):
    world, results = adam_world
    check_scenario("OneBitAdam", world, results, exact_warmup=True)


# ---------------------------------------------------------------------- single process
def _params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in ((5, 123), (7,), (3, 4))]


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("weight_decay, bias_correction", [(0.0, True), (0.01, True), (0.01, False)])
def test_warmup_is_fused_adam_exactly(weight_decay, bias_correction):
    ours, plain = _params(), _params()
    onebit = OneBitAdam(ours, lr=1e-2, freeze_step=100, weight_decay=weight_decay, bias_correction=bias_correction)
    fused = FusedAdam(plain, lr=1e-2, weight_decay=weight_decay, bias_correction=bias_correction, adam_w_mode=True)
    for step in range(4):
        _grads(ours, step)
        _grads(plain, step)
        onebit.step()
        fused.step()
        assert not onebit.in_compression_stage
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)


def test_compression_stage_math_on_one_process():
    """t > freeze_step: m from the (here: one rank's) gradient, v frozen, bias corrections with the
    variance's last step T; checked against the formula written out in float64."""
    lr, (b1, b2), eps, wd, freeze = 1e-2, (0.9, 0.999), 1e-8, 0.01, 3
    params = _params()
    opt = OneBitAdam(params, lr=lr, freeze_step=freeze, weight_decay=wd)
    ref = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(r) for r in ref]
    v = [torch.zeros_like(r) for r in ref]
    for step in range(1, 7):
        _grads(params, step)
        compressing = opt.in_compression_stage
        assert compressing == (step > freeze)
        opt.step()
        for i, p in enumerate(params):
            g = p.grad.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            if not compressing:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            T = min(step, freeze)
            denom = v[i].sqrt() / math.sqrt(1 - b2**T) + eps
            ref[i] = ref[i] * (1 - lr * wd) - lr / (1 - b1**step) * m[i] / denom
            assert_close(p.detach(), ref[i].float(), name=f"step {step}, parameter {i}")
    assert opt.state[params[0]]["variance_step"] == freeze


def test_stage_names_and_frozen_variance():
    params = _params()
    opt = OneBitAdam(params, freeze_step=2)
    assert opt.adam_freeze_key is False and opt.in_compression_stage is False
    for step in range(2):
        _grads(params, step)
        opt.step()
    assert opt.adam_freeze_key is True and opt.in_compression_stage is True
    frozen = opt.state[params[0]]["exp_avg_sq"].clone()
    _grads(params, 5)
    opt.step()
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], frozen)


@pytest.mark.parametrize("kwargs, message", [
    ({"freeze_step": 0}, "freeze_step must be an int >= 1"),
    ({"freeze_step": 2.5}, "freeze_step must be an int >= 1"),
    ({"comm_backend_name": "mpi"}, "comm_backend_name='mpi' is not supported; allowed: nccl, gloo"),
    ({"amsgrad": True}, "amsgrad=True is not supported"),
    ({"eps_inside_sqrt": True}, "eps_inside_sqrt=True is not supported"),
    ({"max_grad_norm": 1.0}, "max_grad_norm=1.0 is not supported"),
    ({"cuda_aware": "yes"}, "cuda_aware must be a bool"),
    ({"block_size": 16}, "block_size must be an int >= 32"),
    ({"lr": -1.0}, "lr must be a number >= 0"),
    ({"betas": (0.9, 1.0)}, "betas must be a pair"),
    ({"backend": "cuda"}, "backend='cuda' is not a tachyon backend"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OneBitAdam(_params(), **kwargs)


def test_parameter_without_warmup_gradient_is_refused():
    params = _params()
    opt = OneBitAdam(params, freeze_step=1)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    with pytest.raises(RuntimeError, match="got no gradient during the warm-up"):
        opt.step()


def test_elements_never_trained_in_warmup_stay_still():
    """An element whose gradient was zero through the whole warm-up has a frozen variance of 0; a
    momentum there (compression noise, or a first gradient after freeze_step) divided by
    sqrt(0) + eps would throw it away. It is held still instead."""
    params = _params()
    opt = OneBitAdam(params, lr=1e-2, freeze_step=2)
    for step in range(2):
        _grads(params, step)
        params[0].grad[0, :3] = 0
        opt.step()
    before = params[0].detach()[0, :3].clone()
    for step in range(2, 4):
        _grads(params, step)  # now those elements get gradients
        opt.step()
    assert torch.equal(params[0].detach()[0, :3], before)
    assert not opt.state[params[0]]["exp_avg"][0, :3].any()


def test_exp_avg_mask_keeps_masked_momentum_zero():
    params = _params()
    mask = torch.ones(5, 123)
    mask[:, :10] = 0
    opt = OneBitAdam([{"params": [params[0]], "exp_avg_mask": mask}, {"params": params[1:]}], freeze_step=2)
    for step in range(4):
        _grads(params, step)
        opt.step()
    assert not opt.state[params[0]]["exp_avg"][:, :10].any()
    assert opt.state[params[0]]["exp_avg"][:, 10:].abs().min() > 0


def round_trip_mid_compression(cls, dtype) -> tuple[list, list, object]:
    """``cls`` (a 1-bit optimizer, freeze_step 2) steps 4 times, is saved with its parameters,
    steps 3 more; a new one loaded from the save steps the same 3: returns (the resumed run's
    parameters, the uninterrupted run's, the resumed optimizer)."""
    params = _params(dtype=dtype)
    opt = cls(params, lr=1e-2, freeze_step=2)
    for step in range(4):
        _grads(params, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()}, buffer)
    for step in range(4, 7):
        _grads(params, step)
        opt.step()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    again = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed = cls(again, lr=1e-2, freeze_step=2)
    resumed.load_state_dict(saved["optimizer"])
    for step in range(4, 7):
        _grads(again, step)
        resumed.step()
    return again, params, resumed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_mid_compression(dtype):
    again, params, resumed = round_trip_mid_compression(OneBitAdam, dtype)
    assert all(resumed.state[p]["exp_avg"].dtype == torch.float32 for p in again), "states must stay fp32"
    for a, b in zip(again, params):
        assert torch.equal(a, b)


def test_config_defaults_are_deepspeeds_and_build():
    section, problems = check_typed_section("optimizer", {"type": "onebitadam", "params": {"freeze_step": 10}})
    assert not problems
    assert section == {"type": "OneBitAdam", "params": {
        "lr": 1e-3, "freeze_step": 10, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
        "eps_inside_sqrt": False, "weight_decay": 0.0, "max_grad_norm": 0.0, "amsgrad": False, "cuda_aware": False,
        "comm_backend_name": "nccl"}}
    assert check_typed_section("optimizer", {"type": "OneBitAdam"})[0]["params"]["freeze_step"] == 100000
    opt = build_optimizer(section, _params())
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 10 and opt.comm_backend_name == "nccl"


@pytest.mark.parametrize("params, message", [
    ({"freeze_step": 0}, "`optimizer.params.freeze_step` should be greater than 0"),
    ({"comm_backend_name": "mpi"}, "`optimizer.params.comm_backend_name` 'mpi' is not available; allowed: nccl, gloo"),
    ({"max_grad_norm": 1.0}, "use the top-level `gradient_clipping`"),
    ({"eps_inside_sqrt": True}, "`optimizer.params.eps_inside_sqrt: true` is not supported"),
    ({"amsgrad": True}, "`optimizer.params.amsgrad: true`"),
    ({"max_coeff": 1.0}, "unknown key 'optimizer.params.max_coeff'"),
])
def test_config_refuses_bad_values(params, message):
    section, problems = check_typed_section("optimizer", {"type": "OneBitAdam", "params": params})
    assert section is None and any(message in p for p in problems), problems
