"""Current and block scaling on 2 gloo ranks.

Tensor parallel: a TransformerLayer parallelized over tp=2 (with and without sequence
parallelism) runs its GEMMs under each recipe. With hidden 256 every shard is a whole number of
128-blocks, so under block scaling each rank quantizes exactly the blocks the single-device layer
does: outputs and gradients equal the single-device FP8 layer's up to fp32 summation order. Under
current scaling a row-parallel GEMM scales its input shard by the shard's own amax (as Transformer
Engine does), so the results differ from one device by FP8 rounding only: no more than the
single-device FP8 layer differs from high precision.

Composition: ZeRO-2 + bf16 + gradient accumulation + activation checkpointing + the FP8 weight
cache under each recipe, against the same training in one process that runs each rank's
micro-batch as its own (so each GEMM is scaled from the same data), gradients accumulated and
reduced in fp32: the parameters are identical, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import run_distributed

pytestmark = pytest.mark.distributed

HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 512, 4, 16, 2
RECIPES = ("current", "block")


def _recipe(name: str):
    from tachyon.fp8 import Float8BlockScaling, Float8CurrentScaling

    return Float8CurrentScaling() if name == "current" else Float8BlockScaling()


def _layer():
    import tachyon.nn as tnn

    torch.manual_seed(0)
    return tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd")


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)


def _single(recipe: str | None) -> list[torch.Tensor]:
    import tachyon

    layer = _layer()
    x, g = _data()
    x.requires_grad_()
    with tachyon.autocast(enabled=recipe is not None, recipe=_recipe(recipe or "current")):
        y = layer(x)
    y.backward(g)
    return [y.detach(), x.grad, *(p.grad for _, p in sorted(layer.named_parameters()))]


def _tensor_parallel() -> dict:
    import tachyon
    from tachyon.parallel import Mesh
    from tachyon.parallel.tensor import parallelize
    from tachyon.parallel.tensor.comm import tp_group
    from tests.parallel._tp_checks import gather_full_grads

    out = {}
    mesh = Mesh(tp=2)
    for recipe in RECIPES:
        for sp in (False, True):
            stack = torch.nn.ModuleList([_layer()])
            parallelize(stack, mesh, sequence_parallel=sp)
            x, g = _data()  # with sequence parallelism the stack's hooks split and gather the sequence
            x.requires_grad_()
            with tachyon.autocast(recipe=_recipe(recipe)):
                y = stack[0](x)
            y.backward(g)
            grads = gather_full_grads(stack, tp_group(mesh))
            y_full, dx = y.detach(), x.grad
            out[(recipe, sp)] = [y_full, dx, *(grads[f"0.{n}"] for n, _ in sorted(_layer().named_parameters()))]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _on_the_ranks() -> dict:
    """Both halves of this file on one pair of ranks (one spawn: most of the cost is starting them)."""
    return {"tp": _tensor_parallel(), "engine": _train(2)}


@pytest.fixture(scope="module")
def runs():
    """The 2-rank results of both halves, and their single-process references."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ranks = run_distributed(_on_the_ranks, 2, timeout=300)
        single = {recipe: _single(recipe) for recipe in RECIPES}
        high = _single(None)
        one = _train(2)
    finally:
        torch.set_num_threads(threads)
    return {"tp": ([r["tp"] for r in ranks], single, high), "engine": ([r["engine"] for r in ranks], one)}


@pytest.fixture(scope="module")
def tp_runs(runs):
    return runs["tp"]


@pytest.fixture(scope="module")
def engine_runs(runs):
    return runs["engine"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tensor_parallel_layer_runs_each_recipe(tp_runs, recipe, sp):
    ranks, single, high = tp_runs
    got, want = ranks[0][(recipe, sp)], single[recipe]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(ranks[1][(recipe, sp)], got)):
        assert torch.equal(a, b), f"tensor {i} differs between the ranks"
    for i, (a, b, h) in enumerate(zip(got, want, high)):
        err = _rel(a, b)
        if recipe == "block":  # the same blocks as one device: fp32 summation order only
            assert err < 1e-5, f"tensor {i}: {err:.3g} from the single-device block-scaled layer"
        else:  # shards scaled by their own amax: FP8 rounding, no more than FP8 itself makes
            assert err <= max(2 * _rel(b, h), 1e-5), f"tensor {i}: {err:.3g} vs FP8's own {_rel(b, h):.3g}"
    assert not torch.equal(want[0], high[0])


# ---------------------------------------------------------------- ZeRO-2 + bf16 + GA + AC + cache
MICRO, GAS, STEPS, SMALL, SMALL_FFN = 2, 2, 2, 32, 64


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import tachyon.nn

        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            tachyon.nn.TransformerLayer(SMALL, SMALL_FFN, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                        params_dtype=torch.bfloat16, attn_input_format="bshd")
            for _ in range(2))
        self.head = torch.nn.Linear(SMALL, 1, dtype=torch.bfloat16)

    def forward(self, x, recipe, is_first_microbatch=None):
        import tachyon

        with tachyon.autocast(recipe=_recipe(recipe)):
            for layer in self.layers:
                x = tachyon.checkpointing.checkpoint(layer, x, is_first_microbatch=is_first_microbatch)
        return self.head(x).float().squeeze(-1)


def _train(world: int) -> dict:
    """STEPS steps of GAS micro-batches per rank. world 1 on more ranks' data: one process runs
    each rank's micro-batch as a micro-batch of its own (GAS * world per step), so every GEMM
    scales the same tensors as on the ranks (current and block scales come from the data a
    GEMM multiplies) and the engine averages the same gradients."""
    import torch.distributed as dist

    import tachyon

    distributed = dist.is_initialized()
    ranks = [dist.get_rank()] if distributed else list(range(world))
    out = {}
    for recipe in RECIPES:
        model = Model()
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS * len(ranks),
                  "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096},
                  "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32",
                  "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
        engine, _, _, _ = tachyon.initialize(model=model, config=config)
        losses = []
        for _ in range(STEPS):
            for i, (micro, rank) in enumerate((m, r) for m in range(GAS) for r in ranks):
                gen = torch.Generator().manual_seed(10 * micro + rank)
                x = torch.randn(MICRO, 8, SMALL, generator=gen).to(torch.bfloat16)
                y = torch.randn(MICRO, 8, generator=gen)
                loss = torch.nn.functional.mse_loss(engine(x, recipe, is_first_microbatch=i == 0), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        ran = all(s.ran_fp8 for m in model.modules() for s in getattr(m, "fp8_scaling", {}).values())
        out[recipe] = {"params": [p.detach().float().clone() for p in model.parameters()], "losses": losses,
                       "ran_fp8": ran}
        engine.destroy()
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero2_bf16_accumulation_checkpointing_and_cache_match_one_process(engine_runs, recipe):
    ranks, single = engine_runs
    r0, r1, one = ranks[0][recipe], ranks[1][recipe], single[recipe]
    assert r0["ran_fp8"] and one["ran_fp8"]
    initial = [p.detach().float() for p in Model().parameters()]
    moved = 0
    for i, (a, b, want, start) in enumerate(zip(r0["params"], r1["params"], one["params"], initial)):
        assert torch.equal(a, b), f"parameter {i} differs between the ranks"
        assert torch.equal(a, want), f"parameter {i} differs from one process's: {(a - want).abs().max().item():.3g}"
        moved += int(not torch.equal(want, start))
    assert moved >= 0.75 * len(initial), f"only {moved} of {len(initial)} parameters moved"
    assert r0["losses"][-1] < r0["losses"][0]
