"""Progressive layer drop (PLD) on the engine side: the keep-ratio schedule, and leaving the
parameters of dropped layers untouched by the optimizer.

Zhang & He, "Accelerating Training of Transformer-Based Language Models with Progressive Layer
Dropping" (NeurIPS 2020). The engine owns the global keep ratio ``theta(t)``; the model's layers
(`tachyon.nn.TransformerLayer`, `tachyon.nn.TransformerKernelLayer`) turn it into their own keep
probability and draw (see docs/progressive_layer_drop.md)::

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar     # 1 at t = 0, -> theta_bar
    keep(l)  = 1 - (l / L) * (1 - theta(t))                       # layer l = 1..L of L

Schedule timing is DeepSpeed's: its engine advances the schedule at each accumulation boundary
with the step's index before the step counter moves (``update_state(global_steps)``), so the
forwards of the step that starts with ``global_steps == s`` use ``theta(max(s - 1, 0))``, and
``engine.get_pld_theta()`` after k optimizer steps is ``theta(k - 1)`` (1.0 before the first).
Here it is a pure function of ``global_steps``, so a checkpoint (which restores ``global_steps``)
resumes the schedule exactly; DeepSpeed restarts it at 1.0 until the first step after loading.

The engine passes ``progressive_layer_drop=True, pld_theta=theta`` to the model's forward in
training mode only (as DeepSpeed does), so evaluation runs every layer.

Dropped layers and the optimizer. A dropped layer takes no part in the step's graph, so its
parameters get no gradient at all. torch.optim skips such a parameter (``grad is None``): no
update, no moment decay, no weight decay. tachyon's ZeRO strategies hand the optimizer one flat
tensor per param group, whose gradient is zero where a parameter got none, and a zero gradient
still decays Adam's moments and moves the weights (through the old momentum and weight decay).
`UnusedParameterGuard` restores torch's semantics on the flat tensors: it records which
parameters received a gradient during the accumulation window, agrees over the data-parallel
ranks on which received none anywhere (one all-reduce of one byte per parameter, PLD only), and
restores their master weights and per-element optimizer states after ``optimizer.step()``.
The optimizer's step counter is per flat tensor, so a skipped parameter's Adam bias correction
uses the global step count rather than its own (torch.optim keeps one per parameter); after the
first few hundred steps the two corrections differ by less than 1e-3 relative.

ZeRO stage 3. FSDP2 all-gathers a layer before its forward and reduce-scatters its gradients in
its backward: collectives every data-parallel rank must join together, so every rank must keep
and drop the same layers. The layers draw from torch's default CPU generator, which the ranks
also use for their own purposes (data order, CPU dropout), so at stage 3 the engine runs each
training forward on `SharedLayerDraws`: a CPU generator state identical on every rank of the job,
swapped in for the forward and out after it. Dropped layers then get no gradient on any rank
(FSDP2 reduce-scatters nothing for them; their gradient shard stays None) and the guard above,
reading which shards received a gradient (`Stage3.slots_with_grad`), keeps them as at stage 2.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

try:  # DeepSpeed computes theta with numpy's exp
    from numpy import exp as _exp
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    _exp = math.exp

PLD_KWARGS = ("progressive_layer_drop", "pld_theta")
"""The keyword arguments the engine adds to the model's forward (DeepSpeed's names)."""


def check_tensor_parallel_generators(tp: Any, device: torch.device) -> None:
    """Refuse PLD over tensor-parallel ranks whose default CPU generators differ.

    The layers draw their keep decisions from torch's default CPU generator inside the model, so
    the ranks of one model copy must draw the same numbers: a rank that keeps a layer its peer
    drops waits in that layer's all-reduce forever. Seeding every rank alike (torch.manual_seed
    with one seed) is the user's part, as in Megatron; this check turns the hang into an error at
    initialize. tp: the TPGroup (group, size, rank); one all-gather of 8 bytes."""
    state = torch.get_rng_state()
    digest = int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(every, mine, group=tp.group)
    differ = [rank for rank, d in enumerate(every) if int(d) != digest]
    if differ:
        from tachyon.config import ConfigError

        raise ConfigError(
            f"progressive_layer_drop with tensor parallelism (tp={tp.size}): torch's default generator on this rank "
            f"(tensor-parallel rank {tp.rank}) differs from tensor-parallel rank(s) {differ}; the layers draw their "
            "keep decisions from it, and ranks of one model copy that draw differently wait for each other forever. "
            "Seed them alike (torch.manual_seed(seed) with the same seed on every rank of a model copy) before "
            "tachyon.initialize")


class ProgressiveLayerDrop:
    """The PLD keep-ratio schedule (DeepSpeed's ``ProgressiveLayerDrop``, as a pure function of
    the engine's ``global_steps``).

    Args:
        theta: theta_bar, the keep ratio the schedule decays to, in (0, 1].
        gamma: the decay rate per optimizer step, >= 0.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < theta <= 1.0:
            raise ValueError(f"progressive_layer_drop.theta must be a number in (0, 1]; got {theta!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (gamma >= 0.0 and math.isfinite(gamma)):
            raise ValueError(f"progressive_layer_drop.gamma must be a finite number >= 0; got {gamma!r}")
        self.theta, self.gamma = float(theta), float(gamma)

    def theta_at(self, t: int) -> float:
        """``theta(t) = (1 - theta) * exp(-gamma * t) + theta`` in float64, evaluated as DeepSpeed
        does (``np.exp`` when numpy is installed: its exp is not libm's on every platform, and the
        keep ratio must be DeepSpeed's to the last bit)."""
        return float((1.0 - self.theta) * _exp(-self.gamma * t) + self.theta)

    def get_theta(self, global_steps: int) -> float:
        """The keep ratio the forwards of the step starting at ``global_steps`` use."""
        return self.theta_at(max(global_steps - 1, 0))

    def get_state(self, global_steps: int) -> dict[str, Any]:
        """The keyword arguments for the model's forward (DeepSpeed's ``get_state``)."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta(global_steps)}

    def __repr__(self) -> str:
        return f"ProgressiveLayerDrop(theta={self.theta}, gamma={self.gamma})"


class SharedLayerDraws:
    """One CPU generator state for the layers' keep draws, the same on every rank of the job
    (ZeRO stage 3: module docstring).

    The first training forward takes global rank 0's default CPU generator state (one all-reduce
    of ~5 kB in which only rank 0 contributes), so ``torch.manual_seed`` before training reproduces the draws as at stages 0-2,
    and a one-process run with the same seed draws the same decisions (when the forwards draw
    nothing else from the CPU generator). Each training forward then runs with this state
    swapped into torch's default CPU generator and stores it back afterwards: the keep draws
    continue one stream, whatever the ranks draw between forwards (their own data, shuffling).
    Activation checkpointing saves and restores the CPU generator around a recomputation, which
    happens inside this stream's forward, so the recomputed forward draws the same decisions.
    Other CPU random draws inside the forward (dropout of a model on the CPU) come from the
    shared stream too: they are the same on every rank and must draw the same count everywhere
    (equal shapes), or the following keep draws differ. A checkpoint stores the state; loading
    takes rank 0's.

    Args:
        comm: collectives over every rank of the job (`tachyon.engine.setup.world_comm`).
        device: the training device (the broadcast travels through it).
    """

    def __init__(self, comm: Any, device: torch.device):
        self.comm, self.device = comm, device
        self.state: torch.Tensor | None = None
        """The shared generator state (a CPU uint8 tensor), None until the first training forward."""

    def _from_rank_0(self, state: torch.Tensor | None) -> torch.Tensor | None:
        """Rank 0's ``state`` (or None when rank 0 has none) on every rank. Collective: a SUM of
        [flag, bytes] where only rank 0 contributes."""
        if not self.comm.enabled:
            return state
        size = torch.get_rng_state().numel()
        packed = torch.zeros(1 + size, dtype=torch.uint8, device=self.device)
        if self.comm.rank == 0 and state is not None:
            packed[0] = 1
            packed[1:] = state.to(self.device)
        self.comm.all_reduce(packed)
        packed = packed.cpu()
        return packed[1:].clone() if int(packed[0]) else None

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around one training forward: the shared state in torch's default CPU generator (taken
        from rank 0's default generator the first time: collective then), the caller's state back
        afterwards."""
        if self.state is None:
            self.state = self._from_rank_0(torch.get_rng_state())
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def state_dict(self) -> torch.Tensor | None:
        """The state to save (None before the first training forward)."""
        return None if self.state is None else self.state.clone()

    def load_state_dict(self, state: torch.Tensor | None) -> None:
        """Take rank 0's saved state (every rank: collective); None there (a checkpoint saved
        without PLD at stage 3) starts again from rank 0's default generator at the next forward."""
        if state is not None and not (torch.is_tensor(state) and state.dtype == torch.uint8
                                      and state.shape == torch.get_rng_state().shape):
            raise ValueError(f"the shared PLD generator state should be a uint8 tensor shaped like "
                             f"torch.get_rng_state(); got {state!r:.80}")
        self.state = self._from_rank_0(state)


class UnusedParameterGuard:
    """Leaves parameters that got no gradient in a step (on any rank) exactly as they were.

    Args:
        zero: the engine's ZeRO strategy; uses ``flat.slots`` (the trained parameters and their
            param groups), ``masters`` (the optimizer's flat fp32 tensors, one per group) and
            ``master_pieces`` (where each parameter's elements lie in this rank's masters).
        comm: the data-parallel collectives (`tachyon.engine.zero.DataParallelComm`).

    Memory: during ``optimizer.step()`` it holds a copy of the skipped parameters' master
    weights and per-element optimizer states that lie in this rank's partition.
    """

    def __init__(self, zero: Any, comm: Any):
        self.zero, self.comm = zero, comm
        self.slots = list(zero.flat.slots)
        self.used = [False] * len(self.slots)
        # stage 3: autograd accumulates into FSDP2's unsharded parameters, not the sharded ones a
        # hook could sit on; the strategy says which gradient shards exist instead
        self._read_grads = getattr(zero, "slots_with_grad", None)
        self._hooks = [] if self._read_grads is not None else [
            slot.param.register_post_accumulate_grad_hook(self._marker(index)) for index, slot in enumerate(self.slots)
        ]

    def _marker(self, index: int):
        def mark(_param: torch.Tensor) -> None:
            self.used[index] = True

        return mark

    def reset(self) -> None:
        """Forget the window's gradients (after each step, and on ``engine.zero_grad()``)."""
        self.used = [False] * len(self.slots)

    def release(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def unused_slots(self) -> list[int]:
        """Indices of the parameters no rank got a gradient for in this window. Collective."""
        flags = self._read_grads() if self._read_grads is not None else self.used
        used = torch.tensor(flags, dtype=torch.uint8, device=self.zero.device)
        if self.comm.world_size > 1:
            self.comm.all_reduce(used, op=dist.ReduceOp.MAX)
        return [int(i) for i in torch.nonzero(used == 0).flatten().tolist()]

    def _local_pieces(self, unused: list[int]) -> list[tuple[int, int, int]]:
        """(master index, master offset, length) of the unused parameters' elements in this rank's
        masters (its partition at stages 1/2, everything at stage 0, its shards at stage 3)."""
        zero = self.zero
        pieces = zero.master_pieces(zero.rank, whole=not zero.partitioned_masters)
        return [(zero.master_index(self.slots[index]), offset, hi - lo)
                for index in unused for lo, hi, offset in pieces[index]]

    @contextmanager
    def keep_unused(self, optimizer: torch.optim.Optimizer) -> Iterator[list[int]]:
        """Around ``optimizer.step()``: the masters and per-element optimizer states (tensors
        shaped like their master, e.g. Adam's exp_avg / exp_avg_sq) of the parameters no rank
        got a gradient for are restored afterwards. States the step creates (the first step)
        start from a zero gradient there, which is zero for Adam, LAMB and SGD momentum. Yields
        the unused parameter indices. Collective (every data-parallel rank must enter it on the
        same steps)."""
        unused = self.unused_slots()
        saved: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        for master_index, start, length in self._local_pieces(unused):
            master = self.zero.masters[master_index]
            targets = [master] + [
                value for value in optimizer.state.get(master, {}).values()
                if torch.is_tensor(value) and value.shape == master.shape
            ]
            saved += [(t, start, length, t.detach().narrow(0, start, length).clone()) for t in targets]
        try:
            yield unused
        finally:
            with torch.no_grad():
                for tensor, start, length, copy in saved:
                    tensor.narrow(0, start, length).copy_(copy)


__all__ = ["PLD_KWARGS", "ProgressiveLayerDrop", "SharedLayerDraws", "UnusedParameterGuard"]
