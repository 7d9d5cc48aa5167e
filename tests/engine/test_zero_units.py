"""The ZeRO building blocks in one process: flat layout, buckets and their launch order, who owns
what (shards), LAMB segments, checkpoint pieces, collective error messages, the analytic memory
formulas, and each stage's gradient path against a fake two-rank group (`TwinComm`)."""

from __future__ import annotations

import datetime

import pytest
import torch

from tachyon.engine.zero import (
    BucketScheduler,
    CollectiveError,
    DataParallelComm,
    FlatParameters,
    Pending,
    Shards,
    build_zero_strategy,
    cut_buckets,
    live_tensor_bytes,
    model_state_bytes,
)
from tachyon.engine.zero.layout import ALIGN
from tests.utils import assert_close


def _params(*shapes, requires_grad=True):
    return [torch.nn.Parameter(torch.randn(*s), requires_grad=requires_grad) for s in shapes]


def test_flat_layout_views_and_pads():
    a, b, c = _params((3, 5), (7,), (2, 2))
    frozen = _params((4,), requires_grad=False)[0]
    values = [p.detach().clone() for p in (a, b, c)]
    flat = FlatParameters([{"params": [a, b, frozen]}, {"params": [c], "weight_decay": 0.0}],
                          torch.float32, torch.device("cpu"), world_size=4)
    quantum = 4 * ALIGN
    assert [r.numel for r in flat.regions] == [quantum, quantum] and flat.numel == 2 * quantum
    assert [r.part for r in flat.regions] == [8, 8]
    assert flat.regions[1].options == {"weight_decay": 0.0} and flat.frozen == [frozen]
    for p, v in zip((a, b, c), values):
        assert torch.equal(p, v) and p.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
    with torch.no_grad():
        flat.buffer.narrow(0, 15, 1).fill_(42.0)  # writes through to b[0]
    assert b[0].item() == 42.0
    assert flat.buffer[22:32].abs().sum() == 0


def test_flat_layout_rejects_shared_or_mistyped_parameters():
    (a,) = _params((3,))
    with pytest.raises(ValueError, match="more than one"):
        FlatParameters([{"params": [a]}, {"params": [a]}], torch.float32, torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="model dtype"):
        FlatParameters([{"params": [a]}], torch.float16, torch.device("cpu"), 1)


def test_buckets_are_cut_back_to_front_across_parameter_boundaries():
    params = _params((10,), (30,), (5,), (50,), (7,))  # group 0: 95 elements, group 1: 7
    flat = FlatParameters([{"params": params[:4]}, {"params": params[4:]}], torch.float32, torch.device("cpu"), 2)
    assert [r.numel for r in flat.regions] == [96, 16]
    buckets = cut_buckets(flat, 40)  # rounded down to a multiple of the quantum (16): 32
    # group 1 first (back to front), one bucket sized from the region; group 0: 32, 32, rest 32
    assert [(b.region.index, b.begin, b.end) for b in buckets] == [(1, 96, 112), (0, 64, 96), (0, 32, 64), (0, 0, 32)]
    assert [[s.numel for s in b.slots] for b in buckets] == [[7], [50], [30, 5, 50], [10, 30]]
    assert buckets[0].gaps == [(7, 16)] and buckets[1].gaps == [(31, 32)] and buckets[2].gaps == []
    # the 50-element parameter (offset 45) spans two buckets: its piece in each
    p50 = flat.slots[3]
    assert buckets[2].piece(p50) == (13, 0, 19) and buckets[1].piece(p50) == (0, 19, 31)
    assert all(b.numel % 16 == 0 for b in buckets)
    # a bucket larger than the model: one bucket per region
    assert [b.numel for b in cut_buckets(flat, 500_000_000)] == [16, 96]


def test_buckets_launch_in_order_whatever_order_gradients_arrive():
    params = _params((8,), (8,), (8,))
    flat = FlatParameters([{"params": params}], torch.float32, torch.device("cpu"), 1)
    launched = []
    scheduler = BucketScheduler(cut_buckets(flat, 8), lambda b: launched.append(b.index) or [], overlap=True)
    slots = {id(s.param): s for s in flat.slots}
    scheduler.report(slots[id(params[0])])  # bucket 2 (back to front): must wait for 0 and 1
    assert launched == []
    scheduler.report(slots[id(params[2])])  # bucket 0
    assert launched == [0]
    scheduler.finish()  # param 1 never reported (unused): flushed in order
    assert launched == [0, 1, 2]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_own_every_element_once_and_copy_partitions_both_ways(world):
    params = _params((37,), (5, 3), (64,), (9,))
    flat = FlatParameters([{"params": params[:3]}, {"params": params[3:]}], torch.float32, torch.device("cpu"), world)
    buckets = cut_buckets(flat, 24)
    shards = Shards(flat, buckets)
    values = torch.randn(flat.numel)
    owner = torch.full((flat.numel,), -1)
    rebuilt = torch.zeros(flat.numel)
    for rank in range(world):
        for region in flat.regions:
            part = torch.empty(region.part)
            shards.flat_to_partition(values, part, region, rank)
            shards.partition_to_flat(part, rebuilt, region, rank)
            for b in buckets:
                if b.region is region:
                    lo, hi = shards.chunk_range(b, rank)
                    assert (owner[lo:hi] == -1).all(), "an element has two owners"
                    owner[lo:hi] = rank
                    at = shards.partition_offset[b.index]
                    assert torch.equal(part[at:at + hi - lo], values[lo:hi])
            # pieces and segments describe the same partition positions
            for slot in region.slots:
                for lo, hi, at in shards.partition_pieces(slot, rank):
                    assert torch.equal(part[at:at + hi - lo], values[slot.offset + lo:slot.offset + hi])
            covered = sum(int(row[1]) for row in shards.segments(region, rank))
            assert covered == sum(hi - lo for s in region.slots for lo, hi, _ in shards.partition_pieces(s, rank))
        expected = flat.regions[0].start if world == 1 else None
        assert shards.contiguous_start(flat.regions[0], rank) == expected
    assert (owner >= 0).all() and torch.equal(rebuilt, values)
    for slot in flat.slots:  # every element of every parameter is in exactly one rank's pieces
        seen = sorted((lo, hi) for r in range(world) for lo, hi, _ in shards.partition_pieces(slot, r))
        assert seen[0][0] == 0 and seen[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(seen, seen[1:])), seen


def test_master_pieces_for_checkpoints():
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 2))
    comm = TwinComm()
    zero = build_zero_strategy(2, [{"params": list(model.parameters())}], model_dtype=torch.float32,
                               grad_accum_dtype=torch.float32, comm=comm, device=torch.device("cpu"),
                               reduce_bucket_size=32)
    (master,) = zero.masters
    for slot, pieces in zip(zero.flat.slots, zero.master_pieces(0)):
        for lo, hi, at in pieces:
            assert torch.equal(master.detach()[at:at + hi - lo], slot.param.detach().reshape(-1)[lo:hi])
    with pytest.raises(ValueError, match="whole=True"):
        zero.master_pieces(0, whole=True)
    # LAMB's segment table lists the same pieces; optimizers without per-parameter norms skip it
    (group,) = zero.optimizer_param_groups()
    rows = sorted((at, hi - lo, slot.index_in_group) for slot, pieces in zip(zero.flat.slots, zero.master_pieces(0))
                  for lo, hi, at in pieces)
    assert group["segments"].tolist() == [list(r) for r in rows] and group["num_segments"] == 4
    (plain,) = zero.optimizer_param_groups(with_segments=False)
    assert "segments" not in plain and plain["params"][0] is master


def test_pending_runs_its_continuation_once_and_wraps_failures():
    comm = DataParallelComm(None, datetime.timedelta(seconds=7))
    calls = []
    done = Pending(comm, "all_reduce", None, lambda: calls.append(1))
    done.wait()
    done.wait()
    assert calls == [1]

    class BrokenWork:
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(CollectiveError, match=r"all_reduce failed on rank 0 of 1: .*7 s timeout.*closed by peer"):
        Pending(comm, "all_reduce", BrokenWork()).wait()


def test_single_process_comm_is_a_no_op():
    comm = DataParallelComm(None)
    t = torch.ones(3)
    comm.all_reduce(t)
    assert comm.world_size == 1 and t.tolist() == [1.0, 1.0, 1.0]
    out = torch.zeros(3)
    comm.reduce_scatter(out, t)
    comm.all_gather_into(t, t)
    assert out.tolist() == [1.0, 1.0, 1.0] and t.tolist() == [1.0, 1.0, 1.0]
    assert not comm.any_true(torch.zeros(1)) and comm.any_true(torch.ones(1))


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_model_state_formulas(n):
    psi = 1_000_000
    fp16 = {s: model_state_bytes(psi, n, s)["model_states"] for s in (0, 1, 2)}
    assert fp16[0] == pytest.approx(16 * psi)
    assert fp16[1] == pytest.approx(2 * psi + 14 * psi / n)  # the gradient is partitioned at the boundary
    assert fp16[2] == pytest.approx(2 * psi + 14 * psi / n)
    # ZeRO's stage 1 (4 + 12/N): with accumulation, param.grad holds the whole gradient in between
    gas = model_state_bytes(psi, n, 1, gradient_accumulation_steps=4)["model_states"]
    assert gas == pytest.approx(max(4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n))
    bf16_fp32_accum = {s: model_state_bytes(psi, n, s, grad_accum_bytes=4)["model_states"] for s in (0, 1, 2)}
    assert bf16_fp32_accum[0] == pytest.approx(18 * psi)
    assert bf16_fp32_accum[1] == bf16_fp32_accum[2] == pytest.approx(2 * psi + 16 * psi / n)
    fp32 = model_state_bytes(psi, n, 1, param_bytes=4, grad_accum_bytes=4, fp32_master=False)
    assert fp32["model_states"] == pytest.approx(4 * psi + 12 * psi / n)
    assert model_state_bytes(psi, n, 3)["model_states"] == pytest.approx(16 * psi / n)  # fp32 shards are the masters
    # ZeRO-Offload: masters, fp32 gradient accumulator and Adam's moments on the host
    for stage, device in ((1, 2 * psi), (2, 2 * psi), (3, 2 * psi / n)):
        out = model_state_bytes(psi, n, stage, offload=True)
        assert out["offloaded"] == pytest.approx(16 * psi / n) and out["model_states"] - out["offloaded"] == device
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(psi, n, 4)
    with pytest.raises(ValueError, match="offload needs ZeRO stage 1, 2 or 3"):
        model_state_bytes(psi, n, 0, offload=True)


def test_live_tensor_bytes_counts_each_storage_once_and_leaf_grads():
    before = live_tensor_bytes()
    a = torch.zeros(1000)
    views = [a[:10], a.view(10, 100)]  # same storage: counted once
    p = torch.nn.Parameter(torch.zeros(500))
    (p * 2).sum().backward()  # p.grad: made by autograd, no Python object until read
    assert live_tensor_bytes() - before == 4000 + 2000 + 2000
    del a, views, p


class TwinComm(DataParallelComm):
    """Pretends to be rank 0 of 2 whose peer holds identical gradients: a SUM doubles; records
    the collectives (name, dtype, elements). Gathers are not simulated."""

    def __init__(self):
        super().__init__(None)
        self.world_size, self.rank, self.calls = 2, 0, []

    def all_reduce(self, tensor, op=None, *, async_op=False, then=None):
        self.calls.append(("all_reduce", tensor.dtype, tensor.numel()))
        if op is None or op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)
        return Pending(self, "all_reduce", None, then)

    def reduce_scatter(self, output, tensor, *, async_op=False, then=None):
        self.calls.append(("reduce_scatter", tensor.dtype, tensor.numel()))
        c = output.numel()
        output.copy_(tensor.narrow(0, self.rank * c, c) * 2)
        return Pending(self, "reduce_scatter", None, then)


def _strategy(stage, model, *, comm=None, model_dtype=torch.bfloat16, accum=torch.bfloat16, **kwargs):
    kwargs.setdefault("reduce_bucket_size", 16)
    return build_zero_strategy(stage, [{"params": list(model.parameters())}], model_dtype=model_dtype,
                               grad_accum_dtype=accum, comm=comm or TwinComm(), device=torch.device("cpu"), **kwargs)


def _expected_master_grad(zero, grads):
    """This rank's share of the flat gradient (what master.grad must hold after averaging)."""
    flat = torch.zeros(zero.flat.numel)
    for slot, g in zip(zero.flat.slots, grads):
        flat[slot.offset:slot.offset + slot.numel] = g.float().reshape(-1)
    if not zero.partitioned_masters:
        return flat
    part = torch.zeros(zero.flat.regions[0].part)
    zero.shards.flat_to_partition(flat, part, zero.flat.regions[0], zero.rank)
    return part


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("accum, comm_dtype, pre, prescale", [
    (torch.bfloat16, None, 1.0, False), (torch.float32, None, 1.0, False), (torch.float32, torch.float32, 1.0, False),
    (torch.float32, torch.bfloat16, 1.0, False), (torch.bfloat16, None, 2.0, False), (torch.bfloat16, None, 1.0, True)])
def test_reduction_dtype_collective_and_averaging(stage, accum, comm_dtype, pre, prescale):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    zero = _strategy(stage, model, accum=accum, comm_dtype=comm_dtype, gradient_predivide_factor=pre,
                     prescale_gradients=prescale)
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    expected = torch.autograd.grad(model(x).float().sum(), list(model.parameters()))
    zero.begin_backward(boundary=True)
    model(x).float().sum().backward()
    zero.end_backward()
    # the communication dtype defaults to the model dtype (DeepSpeed's communication_data_type)
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    assert {(c[0], c[1]) for c in zero.comm.calls} == {(kind, comm_dtype or torch.bfloat16)}
    # one collective per bucket, together the whole (padded) flat buffer
    assert len(zero.comm.calls) == len(zero.buckets.buckets) and sum(c[2] for c in zero.comm.calls) == zero.flat.numel
    (grad,) = zero.master_grads()  # the average of two identical gradients is the gradient
    assert grad.dtype == torch.float32 and grad.shape == zero.masters[0].shape
    assert_close(grad, _expected_master_grad(zero, expected), dtype=comm_dtype or torch.bfloat16, name="averaged gradient")
    if accum != torch.float32:
        assert zero._accumulator is None, "the accumulator should be freed once converted to fp32"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_without_gradient_does_not_block_the_reduction(stage):
    import tachyon
    from tests.engine.zero_cases import make_model

    model = make_model()
    model.unused = torch.nn.Linear(3, 3)  # never called in forward: its hook never fires
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}}
    engine, *_ = tachyon.initialize(model=model, config=config, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2))
    before = model.unused.weight.detach().clone()
    engine.backward(engine(torch.randn(2, 6)).square().mean())
    engine.step()
    assert engine.get_global_grad_norm() > 0
    # AdamW's decoupled weight decay still moves it (zero gradient): it took part in the step
    assert not torch.equal(before, model.unused.weight)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_buckets_are_reduced_while_backward_is_still_running(stage):
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    zero = _strategy(stage, model, model_dtype=torch.float32, accum=torch.float32, reduce_bucket_size=80,
                     overlap_comm=True)
    zero.begin_backward(boundary=True)
    launched_when_first_layer_grad_ready = []
    layers[0].weight.register_hook(lambda g: launched_when_first_layer_grad_ready.append(len(zero.comm.calls)))
    model(torch.randn(3, 8)).sum().backward()
    zero.end_backward()
    # 80-element buckets, 72 elements per layer: most of the last three layers' buckets went
    # out before the first layer's gradient even existed
    assert launched_when_first_layer_grad_ready[0] >= 2, launched_when_first_layer_grad_ready


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("comm_dtype", [None, torch.float32], ids=["bf16-comm", "fp32-comm"])
@pytest.mark.parametrize("layout", ["natural", "reversed"])
def test_partitioned_gradients_go_through_bounded_short_lived_bucket_buffers(layout, comm_dtype, overlap):
    """Stage 2 copies every gradient into a bucket buffer in its hook and frees param.grad once
    every bucket it overlaps has its piece (natural order), keeps early gradients (reversed
    layout: their buckets launch last) until their bucket is the next, splits parameters across
    buckets, never holds buffers of more than reduce_bucket_size model-dtype elements' bytes nor
    larger than the largest bucket, frees them when backward ends, and still averages exactly
    (buffer reuse waits for the reductions reading it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 4))
    model = model.to(torch.bfloat16)
    params = list(model.parameters())  # 35, 7, 21, 3, 12, 4 elements
    order = params if layout == "natural" else params[::-1]
    bucket = 32
    zero = build_zero_strategy(2, [{"params": order}], model_dtype=torch.bfloat16, grad_accum_dtype=torch.float32,
                               comm=TwinComm(), device=torch.device("cpu"), reduce_bucket_size=bucket,
                               comm_dtype=comm_dtype, overlap_comm=overlap)
    live_grad, buffers = [], []

    def after_strategy_hook(_):
        live_grad.append(sum(q.grad.numel() for q in params if q.grad is not None))
        buffers.extend(b for b in zero._bucket_buffers() if all(b is not o for o in buffers))

    for p in params:  # registered after the strategy's hook: runs after it
        p.register_post_accumulate_grad_hook(after_strategy_hook)
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    expected = torch.autograd.grad(model(x).float().sum(), order)
    assert zero.memory_breakdown(None)["buckets"] == 0  # nothing before backward
    zero.begin_backward(boundary=True)
    model(x).float().sum().backward()
    zero.end_backward()
    assert len(live_grad) == len(params)
    if layout == "natural":
        # only a parameter that reaches into a bucket still to come keeps its gradient (35 > 32)
        assert max(live_grad) <= 35, live_grad
    else:
        assert max(live_grad) > 35, live_grad  # early gradients wait for their bucket
    assert all(p.grad is None for p in params)
    assert 0 < len(buffers) <= (2 if overlap else 1)
    for buf in buffers:
        assert buf.numel() * buf.element_size() <= bucket * 2, (buf.numel(), buf.dtype)
        assert buf.numel() <= zero.buckets.max_bucket_numel and buf.dtype == (comm_dtype or torch.bfloat16)
    assert zero.memory_breakdown(None)["buckets"] == 0, "bucket buffers should be freed after backward"
    (grad,) = zero.master_grads()
    assert_close(grad, _expected_master_grad(zero, expected), dtype=comm_dtype or torch.bfloat16, name="averaged gradient")
    memory = zero.memory_breakdown(None)
    assert memory["gradients"] == zero.flat.regions[0].part * 4  # the fp32 partition, nothing else


@pytest.mark.parametrize("accum", [torch.bfloat16, torch.float32], ids=["bf16-accum", "fp32-accum"])
def test_stage1_between_boundaries(accum):
    """bf16 accumulation: the gradient accumulates in param.grad (ZeRO-1's full model-dtype
    gradient) and nothing is communicated until the boundary; fp32 accumulation: reduced every
    micro-step into the fp32 partition, so no full-size fp32 gradient ever exists."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    zero = _strategy(1, model, accum=accum)
    xs = [torch.randn(4, 5, dtype=torch.bfloat16) for _ in range(2)]
    for i, x in enumerate(xs):
        zero.begin_backward(boundary=i == 1)
        model(x).float().sum().backward()
        zero.end_backward()
        if i == 0:
            kept = all(p.grad is not None for p in model.parameters())
            assert kept == (accum == torch.bfloat16) and bool(zero.comm.calls) == (accum == torch.float32)
            if accum == torch.float32:
                assert zero._accumulator.numel() == zero.flat.numel // 2 and zero._accumulator.dtype == torch.float32
    assert all(p.grad is None for p in model.parameters())
    (grad,) = zero.master_grads()
    expected = [sum(g) for g in zip(*(torch.autograd.grad(model(x).float().sum(), list(model.parameters())) for x in xs))]
    assert_close(grad, _expected_master_grad(zero, expected), dtype=torch.bfloat16, name="accumulated gradient")


def test_stage0_bounds_the_converted_copies_in_flight():
    """fp32 accumulation reduced in bf16 with overlap_comm: each bucket goes through a bf16 copy
    that lives until its reduction is done; at most two such copies are in flight."""
    layers = [torch.nn.Linear(16, 16) for _ in range(6)]
    model = torch.nn.Sequential(*layers).to(torch.bfloat16)
    zero = _strategy(0, model, accum=torch.float32, reduce_bucket_size=272, overlap_comm=True)
    assert len(zero.buckets.buckets) >= 6
    in_flight = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: in_flight.append(len(zero._converted)))
    zero.begin_backward(boundary=True)
    model(torch.randn(3, 16, dtype=torch.bfloat16)).float().sum().backward()
    zero.end_backward()
    assert max(in_flight) == zero.converted_in_flight and zero._converted == []
    assert {c[1] for c in zero.comm.calls} == {torch.bfloat16}
