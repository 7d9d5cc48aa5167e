"""Training one small GPT the same way under every (dp, pp, tp) layout, for the acceptance tests.

The reference is tachyon.train.models.GPT trained in one process on the whole global batch. Each
layout starts from that model's initial state dict (sharded by tensor parallelism, or mapped to
pipeline layer names and cut into stages), reads the same batches (a data-parallel rank reads its
contiguous share of each batch), and steps a plain torch optimizer; the gradient all-reduce over
the dp axis is done here, by hand, where the engine would do it. After STEPS steps every layout
gathers its parameters back into GPT's names, full shapes, so they compare with the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CFG = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, intermediate_size=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 5
LR, MOMENTUM = 0.5, 0.9


def build_gpt():
    from tachyon.train.models import GPT

    torch.manual_seed(0)
    return GPT(**CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ids and labels [GLOBAL_BATCH, SEQ] (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
    return ids, torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def reference_state() -> dict[str, torch.Tensor]:
    """GPT's parameters after STEPS single-process steps on the global batches."""
    model = build_gpt()
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad()
        model(ids, labels=labels).backward()
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def dp_share(t: torch.Tensor, mesh) -> torch.Tensor:
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    return t.chunk(dp)[rank]


def all_reduce_dp_grads(params, mesh) -> None:
    """What the engine does between backward and step: average gradients over the dp axis."""
    if mesh.size("dp") == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=mesh.group("dp"))
            p.grad.div_(mesh.size("dp"))


def train_tensor_parallel(mesh, sequence_parallel: bool = False) -> dict[str, torch.Tensor]:
    """GPT under parallelize(mesh); returns the full state dict after STEPS steps (every rank)."""
    from tachyon.parallel.tensor import full_state_dict, parallelize, tp_group

    model = build_gpt()
    parallelize(model, mesh, sequence_parallel=sequence_parallel)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad()
        model(dp_share(ids, mesh), labels=dp_share(labels, mesh)).backward()
        all_reduce_dp_grads(model.parameters(), mesh)
        opt.step()
    return full_state_dict(model, tp_group(mesh))


def build_pipeline(mesh, schedule: str, micro_batches: int, stages_per_rank: int = 1, *,
                   checkpoint_interval: int = 0, tensor_parallel: bool = False):
    """GPT as a PipelineModule over ``mesh`` starting from build_gpt()'s weights (tensor parallel
    with sequence parallelism inside the stages when ``tensor_parallel``)."""
    from tachyon.parallel.pipeline import PipelineModule, PipelineSchedule
    from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss, gpt_state_dict_to_pipeline
    from tachyon.parallel.tensor import parallelize

    net = PipelineModule(gpt_layer_specs(**CFG), topology=mesh, loss_fn=gpt_loss, partition_method="parameters",
                         stages_per_rank=stages_per_rank, activation_checkpoint_interval=checkpoint_interval)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(build_gpt().state_dict(), CFG["num_layers"]))
    if tensor_parallel:
        parallelize(net, mesh, sequence_parallel=True)
    return net, PipelineSchedule(net, micro_batches=micro_batches, schedule=schedule)


def micro_batch_iter(step: int, mesh, micro_batches: int):
    ids, labels = batch(step)
    ids, labels = dp_share(ids, mesh), dp_share(labels, mesh)
    return iter(list(zip(ids.chunk(micro_batches), labels.chunk(micro_batches))))


def gather_pipeline_state(net) -> dict[str, torch.Tensor]:
    """The union of every stage's state dict (this dp replica's pipeline), in GPT's names; and
    {tied key: [the tied weight on each pipeline rank holding it]}."""
    from tachyon.parallel.pipeline.gpt import pipeline_state_dict_to_gpt

    from tachyon.parallel.tensor import full_state_dict, tp_group

    group = net.mesh.group("pp")
    full = full_state_dict(net, tp_group(net.mesh))  # gathers tensor-parallel shards (no-op at tp 1)
    mine = {k: full[k].detach().clone() for k, _ in net.named_parameters()}
    every: list = [None] * net.mesh.size("pp")
    dist.all_gather_object(every, mine, group=group)
    merged, tied = {}, {}
    for state in every:
        for key, value in state.items():
            if key.startswith("tied_modules."):
                tied.setdefault(key, []).append(value)
            merged.setdefault(key, value)
    return pipeline_state_dict_to_gpt(merged, CFG["num_layers"]), tied


def train_pipeline(mesh, schedule: str, micro_batches: int, stages_per_rank: int = 1, **kw):
    """GPT as a PipelineModule; returns (GPT-named full state, tied copies, losses per step)."""
    net, runner = build_pipeline(mesh, schedule, micro_batches, stages_per_rank, **kw)
    opt = optimizer(net.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(float(runner.train_batch(micro_batch_iter(step, mesh, micro_batches))))
        all_reduce_dp_grads(net.parameters(), mesh)
        opt.step()
    state, tied = gather_pipeline_state(net)
    return state, tied, losses


def pipeline_step_comm(mesh, schedule: str, micro_batches: int, stages_per_rank: int = 1) -> list:
    """The CommCalls of one steady-state train_batch (after a first batch that sets the stages up)."""
    from tachyon.parallel import CommCounter

    net, runner = build_pipeline(mesh, schedule, micro_batches, stages_per_rank)
    runner.train_batch(micro_batch_iter(0, mesh, micro_batches))
    with CommCounter(mesh) as comm:
        runner.train_batch(micro_batch_iter(1, mesh, micro_batches))
    return comm.calls


class LiveActivations:
    """Bytes of activations saved for backward and still alive, counted by saved_tensors_hooks
    around a stage's forward (parameters excluded): ``peak`` over a batch, ``per_forward`` the
    bytes one micro-batch's forward saves."""

    def __init__(self, params) -> None:
        self.params = {p.data_ptr() for p in params}
        self.live = self.peak = 0
        self.per_forward: list[int] = []

    def pack(self, t: torch.Tensor):
        if t.data_ptr() in self.params:
            return t
        import weakref

        box = _Box(t)
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.per_forward[-1] += nbytes
        weakref.finalize(box, self._free, nbytes)
        return box

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    @staticmethod
    def unpack(box):
        return box.t if isinstance(box, _Box) else box

    def wrap(self, stage) -> None:
        forward = stage.forward

        def counted(*args):
            self.per_forward.append(0)
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward(*args)

        stage.forward = counted


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def pipeline_in_flight(mesh, schedule: str, micro_batches: int) -> list[tuple[int, int, list[int]]]:
    """Per local stage: (stage index, peak live activation bytes, bytes saved by each forward) over
    one steady-state train_batch."""
    net, runner = build_pipeline(mesh, schedule, micro_batches)
    runner.train_batch(micro_batch_iter(0, mesh, micro_batches))
    counters = []
    for stage in net.stage_modules:
        counter = LiveActivations(net.parameters())
        counter.wrap(stage)
        counters.append((stage.index, counter))
    runner.train_batch(micro_batch_iter(1, mesh, micro_batches))
    return [(index, c.peak, c.per_forward) for index, c in counters]
