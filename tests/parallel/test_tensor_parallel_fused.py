"""A tensor-parallel TransformerLayer runs the single-device layer's fused path: one training step
(forward + backward) of a tp=2 layer on 2 gloo ranks launches exactly the single-device layer's
kernels (tests/profiling/test_traffic_layers.py: one seed draw, norm1 returning the residual
branch, packed attention with the QKV bias or RoPE inside, bias + dropout + add fused with the
MLP's norm, the one-kernel attention backward) plus Megatron's collectives: two all-reduces
forward and two backward, or with sequence parallelism a reduce-scatter / all-gather pair in
their place (and the all-reduces of the norms' and biases' gradients). Triton kernels under the
interpreter, GPT and Llama configurations, with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from tests.profiling.test_traffic_layers import (
    BATCH, GPT_BACKWARD, GPT_FFN, GPT_FORWARD, HEADS, HIDDEN, LLAMA_BACKWARD, LLAMA_FFN, LLAMA_FORWARD, LLAMA_KV_HEADS,
    SEQ,
)
from tests.utils import run_distributed

# the copies the collectives make around themselves (contiguous buffers, the all-reduce's output)
COPIES = ("aten.clone.default", "aten.copy_.default")
AR, AG, RS = "c10d.allreduce_.default", "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"

CONFIGS = {
    "gpt": dict(ffn=GPT_FFN, kw=dict(hidden_dropout=0.1, attention_dropout=0.1)),
    "llama": dict(ffn=LLAMA_FFN, kw=dict(num_gqa_groups=LLAMA_KV_HEADS, normalization="RMSNorm", activation="swiglu",
                                         bias=False, hidden_dropout=0.0, attention_dropout=0.0), rope=True),
}
SINGLE_DEVICE = {"gpt": (GPT_FORWARD, GPT_BACKWARD), "llama": (LLAMA_FORWARD, LLAMA_BACKWARD)}

# the collectives of one step, in order. Without sequence parallelism: the row-parallel outputs'
# all-reduces (proj, fc2) forward, the column-parallel inputs' gradient all-reduces (fc1, QKV)
# backward. With it: all-gather before each column-parallel GEMM and reduce-scatter after each
# row-parallel one (swapped in backward), the stack's exit all-gather forward and its entry
# scatter's all-gather backward, and the all-reduces of the gradients of the parameters applied to this rank's
# tokens only (fc2 bias; proj bias, norm2 weight and bias; norm1 weight and bias).
COLLECTIVES = {
    ("gpt", False): ([AR, AR], [AR, AR]),
    ("llama", False): ([AR, AR], [AR, AR]),
    ("gpt", True): ([AG, RS, AG, RS, AG], [AR, AG, RS, AR, AR, AR, AG, RS, AR, AR, AG]),
    ("llama", True): ([AG, RS, AG, RS, AG], [AG, RS, AR, AG, RS, AR, AG]),
}


def _step(name: str, sp: bool) -> tuple[list[str], list[str]]:
    from tachyon.nn import TransformerLayer
    from tachyon.nn.rope import RotaryTables
    from tachyon.parallel import Mesh
    from tachyon.parallel.tensor import parallelize
    from tachyon.profiling import TrafficCounter

    config = CONFIGS[name]
    torch.manual_seed(0)
    layer = TransformerLayer(HIDDEN, config["ffn"], HEADS, attn_input_format="bshd", backend="triton",
                             **config["kw"]).train()
    stack = torch.nn.ModuleList([layer])
    parallelize(stack, Mesh(tp=2), sequence_parallel=sp)
    extra = {}
    if config.get("rope"):
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), torch.rand(HIDDEN // HEADS // 2)).repeat(1, 2)
        extra["rotary_pos_emb"] = RotaryTables(angles.cos(), angles.sin())
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, HIDDEN)
    with TrafficCounter() as counter:
        stack[0](x, **extra).backward(grad)
    return ([e.label for e in counter.events if not e.backward], [e.label for e in counter.events if e.backward])


def _seeds(sp: bool) -> tuple[list[int], torch.Tensor]:
    """A tp=2 decoder layer's dropout seeds of one forward (its five sites) and the default
    generator's state after the draw."""
    from tachyon.nn import TransformerLayer
    from tachyon.parallel import Mesh
    from tachyon.parallel.tensor import parallelize

    torch.manual_seed(0)
    stack = torch.nn.ModuleList([TransformerLayer(HIDDEN, GPT_FFN, HEADS, layer_type="decoder", hidden_dropout=0.1,
                                                  attention_dropout=0.1, attn_input_format="bshd").train()])
    parallelize(stack, Mesh(tp=2), sequence_parallel=sp)
    torch.manual_seed(7)
    seeds = stack[0]._draw_seeds(torch.zeros(BATCH, SEQ, HIDDEN))
    return [int(s) for s in seeds], torch.get_rng_state()


def _ranks() -> dict:
    torch.set_num_threads(1)
    out: dict = {(name, sp): _step(name, sp) for name in CONFIGS for sp in (False, True)}
    out["seeds"] = {sp: _seeds(sp) for sp in (False, True)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_ranks, 2, timeout=600)


def _with_all_reduces(single: list[str], after: tuple[int, ...]) -> list[str]:
    """The single-device launch list with a copy + all-reduce after the launches at ``after``."""
    out = []
    for i, label in enumerate(single):
        out.append(label)
        if i in after:
            out += ["aten.clone.default", AR]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_layer_launches_the_single_device_kernels_plus_two_all_reduces_each_way(ranks, name):
    forward, backward = SINGLE_DEVICE[name]
    mm = "aten.mm.default"
    fwd_mms = [i for i, label in enumerate(forward) if label == mm]
    bwd_mms = [i for i, label in enumerate(backward) if label == mm]
    # the cuBLAS GEMMs (fc1 and fc2's dX are the MLP's epilogue GEMMs): forward QKV, proj, fc2;
    # backward fc2 dW, fc1 dX and dW, proj dX and dW, QKV dX and dW. All-reduces: forward after proj
    # and fc2; backward after fc1's dX, dW and QKV's dX, dW
    assert len(fwd_mms) == 3 and len(bwd_mms) == 7, (forward, backward)
    expected_fwd = _with_all_reduces(forward, (fwd_mms[1], fwd_mms[2]))
    expected_bwd = _with_all_reduces(backward, (bwd_mms[2], bwd_mms[6]))
    for rank, result in enumerate(ranks):
        fwd, bwd = result[(name, False)]
        assert fwd == expected_fwd, f"{name}, rank {rank}: forward launches\n" + "\n".join(fwd)
        assert bwd == expected_bwd, f"{name}, rank {rank}: backward launches\n" + "\n".join(bwd)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sp", [False, True])
def test_tp_layer_kernels_are_the_single_device_layers_and_collectives_megatrons(ranks, name, sp):
    forward, backward = SINGLE_DEVICE[name]
    coll_fwd, coll_bwd = COLLECTIVES[(name, sp)]
    for rank, result in enumerate(ranks):
        for where, launches, single, collectives in (("forward", result[(name, sp)][0], forward, coll_fwd),
                                                      ("backward", result[(name, sp)][1], backward, coll_bwd)):
            kernels = [label for label in launches if label not in COPIES and not label.startswith("c10d.")]
            comm = [label for label in launches if label.startswith("c10d.")]
            what = f"{name}, sp={sp}, rank {rank}, {where}"
            assert kernels == single, f"{what}: kernels differ from the single-device layer's\n" + "\n".join(launches)
            assert comm == collectives, f"{what}: collectives\n" + "\n".join(launches)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True])
def test_one_seed_draw_gives_split_data_per_rank_seeds(ranks, sp):
    """Sites (attention probabilities, attention output, MLP output, cross-attention probabilities,
    cross-attention output): the attention probabilities (other heads on each rank) get per-rank
    seeds; the hidden dropouts get one seed on both ranks without sequence parallelism (replicated
    activations) and per-rank seeds with it (other tokens on each rank); the default generators
    stay in step."""
    (seeds0, state0), (seeds1, state1) = (result["seeds"][sp] for result in ranks)
    assert len(seeds0) == len(seeds1) == 5 and all(0 <= s < 2**62 for s in seeds0 + seeds1)
    assert len(set(seeds0)) == 5, f"two sites of one forward share a seed: {seeds0}"
    same = [a == b for a, b in zip(seeds0, seeds1)]
    assert same == [False, not sp, not sp, False, not sp], (seeds0, seeds1)
    assert torch.equal(state0, state1), "the default generators of the tp ranks diverged"
