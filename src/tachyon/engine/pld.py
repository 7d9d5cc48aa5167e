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
        self._hooks = [
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
        used = torch.tensor(self.used, dtype=torch.uint8, device=self.zero.flat.buffer.device)
        if self.comm.world_size > 1:
            self.comm.all_reduce(used, op=dist.ReduceOp.MAX)
        return [int(i) for i in torch.nonzero(used == 0).flatten().tolist()]

    def _local_pieces(self, unused: list[int]) -> list[tuple[int, int, int]]:
        """(group, master offset, length) of the unused parameters' elements in this rank's
        masters (its partition at stages 1/2, everything at stage 0)."""
        zero = self.zero
        pieces = zero.master_pieces(zero.rank, whole=not zero.partitioned_masters)
        return [(self.slots[index].group, offset, hi - lo) for index in unused for lo, hi, offset in pieces[index]]

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
        for group, start, length in self._local_pieces(unused):
            master = self.zero.masters[group]
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


__all__ = ["PLD_KWARGS", "ProgressiveLayerDrop", "UnusedParameterGuard"]
