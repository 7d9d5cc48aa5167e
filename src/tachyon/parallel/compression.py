"""1-bit compressed all-reduce and reduce-scatter with error feedback, on torch.distributed.

This is the communication of 1-bit Adam / 1-bit LAMB (Tang et al. 2021, arXiv 2102.02888;
Li et al. 2021, arXiv 2104.06069) and of DeepSpeed's ``NcclBackend.compressed_allreduce``,
built from two stock collectives so it runs on NCCL and gloo alike:

    worker phase   x_i = tensor_i + e_i                      (e_i: this rank's worker error)
                   C(x_i) = sign bits + one scale per block; e_i <- x_i - C(x_i)
                   all_to_all_single: chunk j of every C(x_i) goes to rank j
    server phase   y_j = mean_i C(x_i)[chunk j] + s_j        (s_j: rank j's server error)
                   C(y_j); s_j <- y_j - C(y_j)
                   all_gather_single: every rank receives every C(y_j)
    result         tensor <- concat_j C(y_j)                 (identical on every rank)

Compression. A block of b elements is sent as b sign bits (bit k of byte i is element 8i + k,
1 = ">= 0") and one fp32 scale ``||x||_1 / n_real`` (the mean absolute value of the block's real
elements). That is the paper's scale (and Karimireddy et al.'s, "Error feedback fixes signSGD"):
it is the scale minimizing ||x - scale * sign(x)||_2, so the error of one block satisfies
``||e||^2 = ||x||^2 - ||x||_1^2 / n <= (1 - 1/n) ||x||^2``, a contraction whatever x looks like,
which is the property error-feedback convergence rests on. DeepSpeed uses ``||x||_2 / sqrt(n)``
(it keeps the block's norm) whose error ``2 ||x||^2 - 2 ||x||_2 ||x||_1 / sqrt(n)`` exceeds
``||x||^2`` for peaked blocks (one large element among small ones), so the residual can grow.
Scales are per block of ``block_size`` elements (default 2048, i.e. 1/64 bit per element), not
per whole tensor as DeepSpeed's worker side: one scale over a flat buffer that concatenates
parameters of very different magnitudes would drown the small ones.

Error feedback on both sides makes the result unbiased over time. With R = mean_i e_i + s (the
server errors of all ranks concatenated), one call returns exactly
``mean_i tensor_i + R_before - R_after``: summed over calls the outputs equal the summed exact
means up to the last residual, so the time-average converges to the exact mean (tested).

Reduce-scatter form (`compressed_reduce_scatter`): the worker phase only; rank j keeps
``mean_i C(x_i)[chunk j]`` and nothing is compressed a second time or gathered. That is what a
ZeRO-1/2 partition needs: rank j owns the optimizer state of chunk j only, so nobody else needs
its result. There is no server error (nothing is compressed on the server). See docs/onebit.md
for how the 1-bit optimizers use it with partitioned states.

Layout. The tensor is split into ``world_size`` chunks of ``chunk`` elements (rank j's chunk is
``[j * chunk, (j + 1) * chunk)``); each chunk is split into ``blocks`` blocks of ``block``
elements (a multiple of 32, so a chunk's sign bytes end on a 4-byte boundary and the scales
follow in the same uint8 message). Elements past the real ones (``valid``) are padding: they are
zero on the wire and never leave an error behind. Bytes per call and rank: one all_to_all of
``world_size * message_bytes`` and one all_gather of ``message_bytes`` per rank (payload), i.e.
about 1/32 of an fp32 all-reduce of the same tensor plus 4 bytes per block.

Non-finite inputs (an fp16 overflow) come out non-finite where their blocks land, and leave
the error buffers as they were there (`_keep_finite`).

World size 1: there is nothing to average; the all-reduce leaves the tensor as it is and the
reduce-scatter copies it (no compression). Error buffers a one-rank run holds can only come
from a checkpoint of a larger run: the first call adds them to its result and zeroes them, so
the identity above still holds (`_pay_out`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BLOCK_SIZE = 2048
"""Elements per scale: 1/64 bit of scale per element on top of the sign bit."""

_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
"""torch 2.13 renamed all_gather_into_tensor (the old name warns); looked up at call time, so a
wrapper installed on torch.distributed (a byte counter) sees the call."""


def all_gather_into(output: Tensor, tensor: Tensor, group=None) -> Tensor:
    """``output`` [world_size * n] <- every rank's ``tensor`` [n], in rank order (torch's
    all_gather_single / all_gather_into_tensor, whichever this torch has)."""
    getattr(dist, _ALL_GATHER)(output, tensor, group=group)
    return output


_BLOCK_ALIGN = 32  # elements; 32 sign bits = 4 bytes, so the fp32 scales after them stay aligned


# ---------------------------------------------------------------------- bit packing
def pack_signs(x: Tensor) -> Tensor:
    """Sign bits of ``x`` packed 8 per byte: x [..., 8m] float -> uint8 [..., m]; bit k of byte i
    is 1 where element 8i + k is >= 0 (zero counts as positive, as in DeepSpeed; NaN as negative)."""
    if x.shape[-1] % 8:
        raise ValueError(f"pack_signs: the last dimension must be a multiple of 8; got shape {tuple(x.shape)}")
    bits = (x >= 0).to(torch.uint8).reshape(*x.shape[:-1], -1, 8)
    return (bits << _shifts(x.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of `pack_signs`: uint8 [..., m] -> ``dtype`` [..., 8m] of +1 / -1."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_signs: expected a uint8 tensor; got {packed.dtype}")
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1).to(dtype).mul_(2).sub_(1)


_SHIFTS: dict[torch.device, Tensor] = {}


def _shifts(device: torch.device) -> Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[device]


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor is cut for the collectives (see the module docstring).

    world_size: ranks; chunk: logical elements per rank's chunk; valid: real elements of each
    chunk (the rest is padding); blocks, block: scale blocks per chunk and elements per block
    (``blocks * block >= chunk``; the tail past ``chunk`` is padding too).
    """

    world_size: int
    chunk: int
    valid: tuple[int, ...]
    blocks: int
    block: int

    @property
    def padded_chunk(self) -> int:
        return self.blocks * self.block

    @property
    def sign_bytes(self) -> int:
        return self.padded_chunk // 8

    @property
    def message_bytes(self) -> int:
        """Bytes of one compressed chunk: sign bits then ``blocks`` fp32 scales."""
        return self.sign_bytes + 4 * self.blocks

    @property
    def numel(self) -> int:
        return sum(self.valid)

    @cached_property
    def counts(self) -> Tensor:
        """fp32 [world_size, blocks]: real elements in each block (the scale's denominator)."""
        starts = torch.arange(self.blocks, dtype=torch.float64) * self.block
        valid = torch.tensor(self.valid, dtype=torch.float64)[:, None]
        return (valid - starts).clamp(0, self.block).float()

    def wire_bytes(self) -> dict[str, int]:
        """Payload per rank and call: the all_to_all input, this rank's all_gather input."""
        return {"all_to_all": self.world_size * self.message_bytes, "all_gather": self.message_bytes}


def _blocking(chunk: int, block_size: int) -> tuple[int, int]:
    blocks = max(1, math.ceil(chunk / block_size))
    block = max(_BLOCK_ALIGN, math.ceil(math.ceil(chunk / blocks) / _BLOCK_ALIGN) * _BLOCK_ALIGN)
    return blocks, block


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return value


def flat_layout(numel: int, world_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> ChunkLayout:
    """Layout of a flat tensor of ``numel`` elements cut into ``world_size`` equal chunks
    (``ceil(numel / world_size)`` elements; the last chunks hold the padding)."""
    _check_positive("numel", numel)
    _check_positive("world_size", world_size)
    _check_positive("block_size", block_size)
    chunk = math.ceil(numel / world_size)
    valid = tuple(max(0, min(chunk, numel - j * chunk)) for j in range(world_size))
    return ChunkLayout(world_size, chunk, valid, *_blocking(chunk, block_size))


def chunk_layout(chunk: int, world_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> ChunkLayout:
    """Layout of a tensor of ``world_size * chunk`` elements whose chunk j belongs to rank j
    (a ZeRO bucket: the caller's own partition boundaries, every element real)."""
    _check_positive("chunk", chunk)
    _check_positive("world_size", world_size)
    _check_positive("block_size", block_size)
    return ChunkLayout(world_size, chunk, (chunk,) * world_size, *_blocking(chunk, block_size))


# ---------------------------------------------------------------------- compression
def compress(x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """x: fp32 [rows, blocks, block] (padding zero), counts: fp32 [rows, blocks] real elements
    -> (uint8 [rows, blocks * block / 8] sign bits, fp32 [rows, blocks] scales ||x||_1 / count)."""
    scales = x.abs().sum(dim=-1).div_(counts.clamp(min=1))
    return pack_signs(x.reshape(x.shape[0], -1)), scales


def decompress(packed: Tensor, scales: Tensor) -> Tensor:
    """Inverse of `compress` up to the compression error: -> fp32 [rows, blocks, block]."""
    rows, blocks = scales.shape
    return unpack_signs(packed).view(rows, blocks, -1).mul_(scales.unsqueeze(-1))


def _encode(packed: Tensor, scales: Tensor) -> Tensor:
    """(sign bytes [rows, s], scales [rows, blocks]) -> uint8 messages [rows, s + 4 * blocks]."""
    return torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=1)


def _decode(messages: Tensor, layout: ChunkLayout) -> Tensor:
    """uint8 messages [rows, message_bytes] -> fp32 [rows, blocks, block] (padding not zeroed)."""
    packed = messages[:, : layout.sign_bytes]
    scales = messages[:, layout.sign_bytes:].contiguous().view(torch.float32)
    return decompress(packed, scales)


def _zero_padding(x: Tensor, layout: ChunkLayout, chunks: range) -> None:
    """x: [len(chunks), padded_chunk]; zero every element past the real ones of each chunk."""
    for row, j in enumerate(chunks):
        x[row, layout.valid[j]:] = 0


def _group_size_and_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check(name: str, tensor: Tensor, numel: int, what: str, *, fp32: bool = False) -> None:
    if not isinstance(tensor, Tensor) or tensor.numel() != numel or not tensor.is_contiguous():
        got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(f"{name}: expected a contiguous tensor of {numel} elements ({what}); got {got}")
    if fp32 and tensor.dtype != torch.float32:
        raise ValueError(f"{name}: error buffers are fp32; got {tensor.dtype}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor; got {tensor.dtype}")


def _keep_finite(error: Tensor, new: Tensor) -> None:
    """error <- new where it is finite; elsewhere the old error stays. An fp16 overflow (inf/NaN
    gradients, a step the engine then skips) must not poison the error buffers of every later
    step; the non-finite values still travel (a block's scale turns inf/NaN) so every rank
    sees the overflow."""
    error.copy_(torch.where(torch.isfinite(new), new, error))


def _pay_out(tensor: Tensor, errors: list[Tensor | None]) -> None:
    """World size 1: tensor += every error buffer (their first ``tensor.numel()`` elements), then
    the buffers are zero. A run of one rank makes no error of its own; buffers it holds were
    loaded from a larger run (the residual that run still owed), and adding them once keeps
    ``result = mean + R_before - R_after`` exact (R_after = 0)."""
    flat = tensor.view(-1)
    for error in errors:
        if error is None or error.numel() < flat.numel() or not bool(error.any()):
            continue
        flat.add_(error[: flat.numel()].to(flat.dtype))
        error.zero_()


def _stage(tensor: Tensor, worker_error: Tensor, layout: ChunkLayout) -> Tensor:
    """fp32 [world_size, padded_chunk]: tensor + worker_error cut into chunk rows, padding zero."""
    n, c, numel = layout.world_size, layout.chunk, layout.numel
    x = torch.zeros(n, layout.padded_chunk, dtype=torch.float32, device=tensor.device)
    flat = tensor.view(-1)
    rows, rest = divmod(numel, c)  # the flat layout may end inside a chunk
    x[:rows, :c].copy_(flat[: rows * c].view(rows, c))
    if rest:
        x[rows, :rest].copy_(flat[rows * c :])
    x[:, :c].add_(worker_error.view(n, c))  # zero past the real elements: nothing leaves an error there
    return x


def _worker_phase(tensor: Tensor, worker_error: Tensor, layout: ChunkLayout, group) -> Tensor:
    """Compress tensor + worker_error (updating worker_error in place), exchange the chunks with
    all_to_all, return the mean of the decompressed chunks this rank serves: fp32 [padded_chunk]
    (padding zeroed)."""
    n, c, cp = layout.world_size, layout.chunk, layout.padded_chunk
    rank = dist.get_rank(group)
    x = _stage(tensor, worker_error, layout)
    packed, scales = compress(x.view(n, layout.blocks, layout.block), layout.counts.to(x.device))
    decoded = decompress(packed, scales).view(n, cp)
    _zero_padding(decoded, layout, range(n))
    _keep_finite(worker_error.view(n, c), x.sub_(decoded)[:, :c])
    del x, decoded
    send = _encode(packed, scales).view(-1)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    received = received.view(n, -1)
    total = torch.zeros(cp, dtype=torch.float32, device=tensor.device)
    for i in range(n):  # one chunk at a time: no [world_size, chunk] fp32 temporary
        total.add_(_decode(received[i : i + 1], layout).view(cp))
    total.div_(n)
    total[layout.valid[rank]:] = 0
    return total


def compressed_all_reduce(tensor: Tensor, worker_error: Tensor, server_error: Tensor, layout: ChunkLayout,
                          group=None) -> Tensor:
    """Replace ``tensor`` (any float dtype, ``layout.numel`` elements, same on no rank) by the
    1-bit compressed mean over the group, identical on every rank; returns ``tensor``.

    worker_error: fp32 [world_size * chunk], this rank's worker error (updated in place);
    server_error: fp32 [chunk], the error of the chunk this rank serves (updated in place).
    Collectives: one all_to_all_single and one all_gather_single of uint8 messages.
    """
    size, rank = _group_size_and_rank(group)
    if size != layout.world_size:
        raise ValueError(f"compressed_all_reduce: the layout is for {layout.world_size} ranks; the group has {size}")
    _check("compressed_all_reduce tensor", tensor, layout.numel, "layout.numel")
    if size == 1:
        _pay_out(tensor, [worker_error, server_error])
        return tensor
    _check("worker_error", worker_error, layout.world_size * layout.chunk, "world_size * chunk", fp32=True)
    _check("server_error", server_error, layout.chunk, "chunk", fp32=True)
    c, cp = layout.chunk, layout.padded_chunk
    y = _worker_phase(tensor, worker_error, layout, group)
    y[:c].add_(server_error)
    packed, scales = compress(y.view(1, layout.blocks, layout.block), layout.counts[rank : rank + 1].to(y.device))
    decoded = decompress(packed, scales).view(cp)
    decoded[layout.valid[rank]:] = 0
    _keep_finite(server_error, y[:c] - decoded[:c])
    del y, decoded
    message = _encode(packed, scales)
    gathered = torch.empty(size * layout.message_bytes, dtype=torch.uint8, device=tensor.device)
    getattr(dist, _ALL_GATHER)(gathered, message.view(-1), group=group)
    result = _decode(gathered.view(size, -1), layout).view(size, cp)[:, :c].reshape(-1)
    tensor.view(-1).copy_(result[: tensor.numel()])
    return tensor


def compressed_reduce_scatter(tensor: Tensor, out: Tensor, worker_error: Tensor, layout: ChunkLayout,
                              group=None) -> Tensor:
    """``out`` [chunk] <- the 1-bit compressed mean over the group of chunk ``rank`` of ``tensor``
    (``layout.numel`` elements, any float dtype); returns ``out``.

    worker_error: fp32 [world_size * chunk], this rank's worker error (updated in place). One
    all_to_all_single; no second compression, no all-gather (see the module docstring).
    Positions of ``out`` past the chunk's real elements are set to zero.
    """
    size, rank = _group_size_and_rank(group)
    if size != layout.world_size:
        raise ValueError(f"compressed_reduce_scatter: the layout is for {layout.world_size} ranks; "
                         f"the group has {size}")
    _check("compressed_reduce_scatter tensor", tensor, layout.numel, "layout.numel")
    _check("compressed_reduce_scatter out", out, layout.chunk, "chunk")
    if size == 1:
        out.view(-1)[: tensor.numel()].copy_(tensor.view(-1))
        out.view(-1)[tensor.numel():] = 0
        _pay_out(out.view(-1)[: tensor.numel()], [worker_error])
        return out
    _check("worker_error", worker_error, layout.world_size * layout.chunk, "world_size * chunk", fp32=True)
    y = _worker_phase(tensor, worker_error, layout, group)
    out.view(-1).copy_(y[: layout.chunk])
    return out


# ---------------------------------------------------------------------- stateful wrappers
class CompressedAllReduce:
    """The error buffers of one flat tensor and the collective that uses them.

        reducer = CompressedAllReduce(numel, group=None, block_size=2048, device="cuda")
        reducer(tensor)                      # tensor [numel] <- compressed mean, in place

    ``state_dict()`` holds this rank's buffers plus the layout they belong to;
    `reshard_error_feedback` maps the buffers of all ranks onto another world size.
    """

    def __init__(self, numel: int, *, group=None, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str | None = None) -> None:
        self.group = group
        self.world_size, self.rank = _group_size_and_rank(group)
        self.block_size = block_size
        self.layout = flat_layout(numel, self.world_size, block_size)
        c = self.layout.chunk
        self.worker_error = torch.zeros(self.world_size * c, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(c, dtype=torch.float32, device=device)

    def __call__(self, tensor: Tensor) -> Tensor:
        return compressed_all_reduce(tensor, self.worker_error, self.server_error, self.layout, self.group)

    def state_dict(self) -> dict:
        """{numel, world_size, rank, block_size, worker_error [numel], server_error [valid chunk]} (copies)."""
        n = self.layout.numel
        return {"numel": n, "world_size": self.world_size, "rank": self.rank, "block_size": self.block_size,
                "worker_error": self.worker_error[:n].clone(),
                "server_error": self.server_error[: self.layout.valid[self.rank]].clone()}

    def matches(self, state: dict) -> bool:
        """Whether ``state`` was saved by this rank of a run with this layout."""
        return (state.get("numel"), state.get("world_size"), state.get("rank"), state.get("block_size")) == (
            self.layout.numel, self.world_size, self.rank, self.block_size)

    def load_state_dict(self, state: dict) -> None:
        """Load buffers saved by `state_dict` of this same rank and layout (else ValueError: use
        `reshard_error_feedback` first, or leave the buffers at zero)."""
        if not self.matches(state):
            raise ValueError(
                "CompressedAllReduce.load_state_dict: the error buffers were saved by rank "
                f"{state.get('rank')} of {state.get('world_size')} for {state.get('numel')} elements, block_size "
                f"{state.get('block_size')}; this is rank {self.rank} of {self.world_size}, {self.layout.numel} "
                f"elements, block_size {self.block_size}. Reshard them with reshard_error_feedback")
        n = self.layout.numel
        self.worker_error.zero_()
        self.server_error.zero_()
        self.worker_error[:n].copy_(state["worker_error"])
        self.server_error[: state["server_error"].numel()].copy_(state["server_error"])


class CompressedReduceScatter:
    """The worker error of one ``[world_size * chunk]`` tensor (e.g. a ZeRO bucket) and the
    compressed reduce-scatter that uses it: ``reducer(tensor, out)``, out [chunk]."""

    def __init__(self, chunk: int, *, group=None, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str | None = None) -> None:
        self.group = group
        self.world_size, self.rank = _group_size_and_rank(group)
        self.layout = chunk_layout(chunk, self.world_size, block_size)
        self.worker_error = torch.zeros(self.world_size * chunk, dtype=torch.float32, device=device)

    def __call__(self, tensor: Tensor, out: Tensor) -> Tensor:
        return compressed_reduce_scatter(tensor, out, self.worker_error, self.layout, self.group)


def reshard_error_feedback(states: list[dict], world_size: int) -> list[dict]:
    """Map the `CompressedAllReduce` states of every rank of one run (``states[r]`` from rank r)
    onto ``world_size`` ranks, keeping the total residual R = mean_r worker_error_r +
    concat_r server_error_r exact: every new rank gets the old ranks' mean worker error, and the
    concatenated server error is cut at the new chunk boundaries. What the old run still owed
    the average is therefore paid out by the new one as if nothing had changed (module docstring)."""
    _check_positive("world_size", world_size)
    if not states or sorted(s.get("rank") for s in states) != list(range(len(states))) or \
            any(s.get("world_size") != len(states) for s in states):
        raise ValueError("reshard_error_feedback: give the states of every rank of one run, "
                         f"one per rank 0..world_size-1; got ranks {[s.get('rank') for s in states]}")
    states = sorted(states, key=lambda s: s["rank"])
    numel, block_size = states[0]["numel"], states[0]["block_size"]
    if any((s["numel"], s["block_size"]) != (numel, block_size) for s in states):
        raise ValueError("reshard_error_feedback: the states are of different tensors (numel or block_size differ)")
    worker = torch.stack([s["worker_error"].float() for s in states]).mean(dim=0)
    server = torch.cat([s["server_error"].float() for s in states])
    layout = flat_layout(numel, world_size, block_size)
    out = []
    for r in range(world_size):
        start = r * layout.chunk
        out.append({"numel": numel, "world_size": world_size, "rank": r, "block_size": block_size,
                    "worker_error": worker.clone(), "server_error": server[start : start + layout.valid[r]].clone()})
    return out


__all__ = [
    "DEFAULT_BLOCK_SIZE", "ChunkLayout", "CompressedAllReduce", "CompressedReduceScatter", "all_gather_into",
    "chunk_layout",
    "compress", "compressed_all_reduce", "compressed_reduce_scatter", "decompress", "flat_layout", "pack_signs",
    "reshard_error_feedback", "unpack_signs",
]
