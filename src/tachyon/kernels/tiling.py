"""Launch shapes shared by the elementwise Triton kernels (kernels/activation, kernels/dropout).

Forward: 2-D tiles of about TILE elements, [BLOCK_M rows, BLOCK_N columns]. Backward: a grid of
(row programs, column blocks) where each row program walks a contiguous range of rows (a
multiple of BLOCK_M) and writes one row of fp32 partial column sums, which the launcher adds up:
enough row programs to fill the GPU, few under the interpreter (each program costs milliseconds).
The backward kernels of kernels/layernorm and kernels/dropout keep the same layout, and
:func:`sum_partials` adds up all the partial sums of one backward in one launch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting
from tachyon.kernels.ints import cdiv, next_power_of_2
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch

TILE = 4096  # elements per program tile: 16-32 per thread at 4-8 warps

# Under Triton's CPU interpreter the launchers use few programs (each costs milliseconds), so the
# per-program fp32 partial sums of the backward kernels have few rows there. Counting bytes as a
# GPU would move them (tachyon.profiling.traffic; benchmarks/bench_traffic.py --as-gpu-sms) sets
# this to the GPU's SM count: the interpreter then launches the GPU's grids.
INTERPRETER_AS_SMS: int | None = None


@functools.lru_cache(maxsize=256)  # launch host time: a C-level cache hit instead of the arithmetic
def tiles(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the 2-D tiles over rows of n columns."""
    block_n = min(next_power_of_2(n), 1024)
    block_m = max(1, TILE // block_n)
    return block_m, block_n, 8 if block_m * block_n >= 4096 else 4


# Set by `tachyon.profiling.launch_stub.StubLaunches`: CPU tensors stand for a GPU with this many
# SMs (launchers take their GPU branches, whose host time is then measured).
STUB_SMS: int | None = None

_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int | None:
    """The number of SMs of a CUDA ``device`` (cached: the device-properties query costs
    microseconds of host time per call); None for other devices, unless STUB_SMS stands in."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        count = _SM_COUNTS.get(index)
        if count is None:
            count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return count
    return STUB_SMS


def gpu_sms(device: torch.device) -> int | None:
    """SMs of the GPU the launch sizes are for: the device's own, INTERPRETER_AS_SMS under the
    interpreter, or None (the interpreter's small grids)."""
    if device.type == "cuda":
        return _SM_COUNTS.get(device.index) or sm_count(device)
    return STUB_SMS or INTERPRETER_AS_SMS


def max_programs(device: torch.device) -> int:
    """How many programs fill ``device``: 8 per SM on a GPU, 4 under the interpreter (8 per SM of
    ``INTERPRETER_AS_SMS`` when set)."""
    sms = gpu_sms(device)
    return 8 * sms if sms else 4


MIN_ROWS_PER_PARTIAL = 8  # row_programs: rows a program sums before one more program (one more partial row) pays


def row_programs(m: int, device: torch.device, interpreter_programs: int) -> int:
    """Programs for a backward kernel that walks whole rows and writes one fp32 partial row each
    (the norm backward kernels). Each program's partial row is written and read once more, as
    many bytes as MIN_ROWS_PER_PARTIAL fp32 rows of data would be read at most: so programs beyond
    one per SM (the GPU filled) are added only while each keeps that many rows, up to 4 per SM.
    (512 rows on an H100: 132 programs, not 512, whose partial sums would move as many bytes as
    the gradient itself.) Under the interpreter: ``interpreter_programs``, or the GPU's grid of
    ``INTERPRETER_AS_SMS``."""
    sms = gpu_sms(device)
    if not sms:
        return max(1, min(m, interpreter_programs))
    return max(1, min(m, max(sms, min(4 * sms, cdiv(m, MIN_ROWS_PER_PARTIAL)))))


def row_split(m: int, block_m: int, col_blocks: int, device: torch.device) -> tuple[int, int]:
    """(row programs, rows per program) for m rows in blocks of block_m, beside col_blocks column
    blocks; rows per program is a multiple of block_m and no program is empty. Each row program
    writes one fp32 partial row, so on a GPU (or the interpreter with INTERPRETER_AS_SMS) row
    programs beyond filling the SMs are added only while each keeps MIN_ROWS_PER_PARTIAL rows
    (see :func:`row_programs`), up to 8 programs per SM in all."""
    blocks = cdiv(m, block_m)
    sms = gpu_sms(device)
    if not sms:
        programs = max(1, min(blocks, cdiv(max_programs(device), col_blocks)))
    else:
        wanted = max(cdiv(sms, col_blocks),
                     min(cdiv(8 * sms, col_blocks), cdiv(m, MIN_ROWS_PER_PARTIAL)))
        programs = max(1, min(blocks, wanted))
    rows_per_program = cdiv(cdiv(m, programs), block_m) * block_m
    return cdiv(m, rows_per_program), rows_per_program


@triton.jit
def _sum_columns(PART, OUT0, OUT1, OUT2, P, N, stride_p, col_block, g, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sum over all P rows of group g's BLOCK_N columns of column block ``col_block``, stored in OUT<g>."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & col_ok[None, :]
        acc += tl.load(PART + rows[:, None] * stride_p + g * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if g == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=col_ok)
    elif g == 1:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=col_ok)
    else:
        tl.store(OUT2 + cols, total.to(OUT2.dtype.element_ty), mask=col_ok)


@fast_launch
@triton.jit
def _sum_partials_kernel(
    PART, OUT0, OUT1, OUT2, P, N, stride_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (column block, group)
    _sum_columns(PART, OUT0, OUT1, OUT2, P, N, stride_p, tl.program_id(0), tl.program_id(1), BLOCK_P, BLOCK_N)


@triton.jit
def _segment(PART, OUT0, OUT1, OUT2, P, N, stride_p, local, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # the segment's programs in _sum_partials_kernel's grid order: column blocks, then groups
    col_blocks = tl.cdiv(N, BLOCK_N)
    _sum_columns(PART, OUT0, OUT1, OUT2, P, N, stride_p, local % col_blocks, local // col_blocks, BLOCK_P, BLOCK_N)


@fast_launch
@triton.jit
def _sum_segments_kernel(
    A_PART, A_OUT0, A_OUT1, A_OUT2, A_P, A_N, A_S, A_END,
    B_PART, B_OUT0, B_OUT1, B_OUT2, B_P, B_N, B_S, B_END,
    C_PART, C_OUT0, C_OUT1, C_OUT2, C_P, C_N, C_S, C_END,
    D_PART, D_OUT0, D_OUT1, D_OUT2, D_P, D_N, D_S, D_END,
    E_PART, E_OUT0, E_OUT1, E_OUT2, E_P, E_N, E_S,
    SEGMENTS: tl.constexpr,
    A_BP: tl.constexpr, A_BN: tl.constexpr, B_BP: tl.constexpr, B_BN: tl.constexpr, C_BP: tl.constexpr,
    C_BN: tl.constexpr, D_BP: tl.constexpr, D_BN: tl.constexpr, E_BP: tl.constexpr, E_BN: tl.constexpr,
):
    # up to five sum_partials reductions in one grid: segment k owns programs [END of k - 1, END of k),
    # each computing what its own _sum_partials_kernel program would (the same code: the same bits)
    pid = tl.program_id(0)
    if pid < A_END:
        _segment(A_PART, A_OUT0, A_OUT1, A_OUT2, A_P, A_N, A_S, pid, A_BP, A_BN)
    if SEGMENTS > 1:
        if (pid >= A_END) & (pid < B_END):
            _segment(B_PART, B_OUT0, B_OUT1, B_OUT2, B_P, B_N, B_S, pid - A_END, B_BP, B_BN)
    if SEGMENTS > 2:
        if (pid >= B_END) & (pid < C_END):
            _segment(C_PART, C_OUT0, C_OUT1, C_OUT2, C_P, C_N, C_S, pid - B_END, C_BP, C_BN)
    if SEGMENTS > 3:
        if (pid >= C_END) & (pid < D_END):
            _segment(D_PART, D_OUT0, D_OUT1, D_OUT2, D_P, D_N, D_S, pid - C_END, D_BP, D_BN)
    if SEGMENTS > 4:
        if pid >= D_END:
            _segment(E_PART, E_OUT0, E_OUT1, E_OUT2, E_P, E_N, E_S, pid - D_END, E_BP, E_BN)


def sum_block_n(n: int, groups: int, device: torch.device) -> int:
    """Columns per program of :func:`sum_partials`. On a GPU, narrow enough that the
    (column block, group) programs fill the SMs, down to 32 fp32 columns (one 128-byte line per
    row): with 1024 columns per program, as under the interpreter, a 1024-wide LayerNorm's two
    partial buffers were summed by 2 programs on 2 of 132 SMs. Under the interpreter, few wide
    programs (each program costs milliseconds)."""
    return _sum_geometry(1, n, groups, gpu_sms(device))[2]


def partials(programs: int, groups: int, n: int, device: torch.device) -> torch.Tensor:
    """The fp32 buffer [programs, groups * n] a backward kernel writes its per-program partial sums
    into: group g of program p at row p, columns [g * n, (g + 1) * n). Every program writes its
    whole rows, so it is never zero-filled."""
    return torch.empty((programs, groups * n), dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=512)  # host time: one C-level cache hit per call instead of the arithmetic
def _sum_geometry(p: int, n: int, groups: int, sms: int | None) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_P, BLOCK_N) of :func:`sum_partials` for P partial rows of ``groups`` groups of n columns."""
    widest = min(next_power_of_2(n), 1024)
    block_n = widest if not sms else max(min(32, widest), min(widest, next_power_of_2(cdiv(n * groups, sms))))
    block_p = min(next_power_of_2(p), max(1, TILE // block_n))
    return (cdiv(n, block_n), groups), block_p, block_n


def sum_partials(part: torch.Tensor, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Column sums of each group of ``part`` (fp32 [P, G * n], see :func:`partials`) over its P
    rows, in fp32 and stored in ``dtypes[g]``: G tensors [n] from ONE launch (summing each group
    with torch would be a launch per group, plus one per cast). Deterministic (a fixed order).
    Inside :func:`deferred_sums` the outputs are returned unwritten and the reduction is queued.
    Traced by torch.compile (``launch.wrapped_launches``) the sums are torch's (in fp32, then
    cast), computed at once: a reduction the compiler handles for any number of rows (the kernel's
    BLOCK_P, a constexpr, would fix P), and no output passed for two pointers (kernels/launch.py:
    a traced launch passes no aliasing arguments)."""
    groups = len(dtypes)
    p, width = part.shape if part.dim() == 2 else (0, -1)
    if not 1 <= groups <= 3 or width < 0 or width % groups:
        raise ValueError(f"sum_partials: part [P, G * n] with G in 1..3 groups; got shape {tuple(part.shape)}, G={groups}")
    n, device = width // groups, part.device
    if launch._wrapping:  # traced (kernels/launch.py): torch's reduction, at once
        sums = part.reshape(p, groups, n).sum(0)
        return [sums[g].to(dt) for g, dt in enumerate(dtypes)]
    outs = [torch.empty(n, dtype=dt, device=device) for dt in dtypes]
    if n == 0:
        return outs
    grid, block_p, block_n = _sum_geometry(p, n, groups, gpu_sms(device))
    out0 = outs[0]
    args = (part, out0, outs[1] if groups > 1 else out0, outs[2] if groups > 2 else out0, p, n, part.stride(0))
    queue = _deferred.queue
    if queue is not None:
        queue.append((args, grid, block_p, block_n))
        if _INTERPRETING:  # tests: a read before the block ends sees NaN, not stale memory
            for out in outs:
                out.fill_(float("nan"))
        return outs
    _sum_partials_kernel[grid](*args, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return outs


class _Deferred(threading.local):
    queue: list | None = None  # the reductions queued by sum_partials inside deferred_sums, else None


_deferred = _Deferred()
_INTERPRETING = triton_interpreting()  # fixed when Triton is imported (tachyon.backend)
MAX_SEGMENTS = 5  # reductions per _sum_segments_kernel launch
_BLOCK_NAMES = tuple((f"{c}_BP", f"{c}_BN") for c in "ABCDE")  # each segment's block constexprs


@contextlib.contextmanager
def _queue_scope(queue: list | None) -> Iterator[None]:
    """This thread's queue of deferred reductions is ``queue`` within (None: launch at once)."""
    outer = _deferred.queue
    _deferred.queue = queue
    try:
        yield
    finally:
        _deferred.queue = outer


@contextlib.contextmanager
def deferred_sums() -> Iterator[None]:
    """Within (this thread): :func:`sum_partials` returns its outputs unwritten and queues the
    reduction; leaving the block normally launches the queued reductions together, up to
    MAX_SEGMENTS per launch (one launch where a backward made several, each output's values the
    same bits as its own launch would give). Code inside must not read those outputs before the
    block ends (a layer's backward that only returns its bias and norm-weight gradients); code that
    does reads them inside :func:`immediate_sums`. On an exception nothing is launched."""
    queue: list = []
    with _queue_scope(queue):
        yield
    for start in range(0, len(queue), MAX_SEGMENTS):  # only reached without an exception
        _sum_segments(queue[start:start + MAX_SEGMENTS])


def immediate_sums() -> contextlib.AbstractContextManager[None]:
    """Within (this thread): :func:`sum_partials` launches at once even inside :func:`deferred_sums`,
    for code that reads the sums it gets (e.g. casts them) before returning them."""
    return _queue_scope(None)


def _sum_segments(segments: list) -> None:
    """Launch queued reductions ((kernel arguments, grid, BLOCK_P, BLOCK_N) each) in one grid."""
    if len(segments) == 1:
        args, grid, block_p, block_n = segments[0]
        _sum_partials_kernel[grid](*args, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
        return
    flat, blocks, end = [], {}, 0
    for k, (args, grid, block_p, block_n) in enumerate(segments):
        end += grid[0] * grid[1]
        flat += args
        if k < MAX_SEGMENTS - 1:
            flat.append(end)
        blocks[_BLOCK_NAMES[k][0]], blocks[_BLOCK_NAMES[k][1]] = block_p, block_n
    for k in range(len(segments), MAX_SEGMENTS):  # unused segments: never reached (SEGMENTS), any valid tensors
        flat += segments[0][0]
        if k < MAX_SEGMENTS - 1:
            flat.append(end)
        blocks[_BLOCK_NAMES[k][0]], blocks[_BLOCK_NAMES[k][1]] = 1, 1
    _sum_segments_kernel[(end,)](*flat, SEGMENTS=len(segments), **blocks, num_warps=4)
