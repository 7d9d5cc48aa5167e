"""The PyTorch Philox equals Triton's bit for bit (tl.rand; the dropout mask's eight 16-bit draws per
tl.randint4x call), so both paths drop the same elements."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.random import (
    dropout_draws, dropout_keep_mask, dropout_keep_rows, dropout_threshold, philox4, rand,
)


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 7])
@pytest.mark.parametrize("offset", [0, 5_000_000])
def test_reference_is_bit_identical_to_triton(seed, offset):
    from tachyon.kernels.random import triton as tri

    got = tri.rand(seed, 3000, offset=offset)
    want = rand(seed, torch.arange(offset, offset + 3000))
    assert torch.equal(got, want), f"{int((got != want).sum())} of 3000 values differ"


@pytest.mark.parametrize("seed", [0, 2**31 + 5, 2**63 - 1])
def test_tensor_seed_gives_the_same_numbers_as_the_int(seed):
    """A 0-dim int64 tensor seed (loaded by the kernel, never read on the host) is the int seed."""
    from tachyon.kernels.random import triton as tri

    offsets = torch.arange(77, 77 + 1500)
    want = rand(seed, offsets)
    assert torch.equal(rand(torch.tensor(seed), offsets), want), "reference: tensor seed != int seed"
    got = tri.rand(torch.tensor(seed), 1500, offset=77)
    assert torch.equal(got, want), f"triton tensor seed: {int((got != want).sum())} of 1500 values differ"
    assert torch.equal(dropout_keep_mask(torch.tensor(seed), (30, 50), 0.3, row_offset=77),
                       dropout_keep_mask(seed, (30, 50), 0.3, row_offset=77))
    got = tri.keep_mask(torch.tensor(seed), 30, 50, 0.3, row0=77)
    assert torch.equal(got, dropout_keep_mask(seed, (30, 50), 0.3, row_offset=77)), "triton mask, tensor seed"


@pytest.mark.parametrize("seed", [0, 99, 2**40 + 7])
@pytest.mark.parametrize("m,n,row0", [(5, 37, 0), (9, 64, 11), (3, 8, 2), (4, 100, 1000), (2, 3, 5)])
def test_the_dropout_mask_of_the_triton_tiles_is_the_references(seed, m, n, row0):
    """keep_tile (2-D tiles, columns in blocks of 32) and keep_row (one row per program) against
    dropout_keep_rows, for row lengths that are and are not multiples of 8."""
    from tachyon.kernels.random import triton as tri

    want = dropout_keep_rows(seed, torch.arange(row0, row0 + m), n, 0.3)
    assert torch.equal(tri.keep_mask(seed, m, n, 0.3, row0=row0), want)
    assert torch.equal(tri.keep_mask(seed, m, n, 0.3, row0=row0, row=True), want)


def test_the_dropout_draws_are_philoxs_outputs_split_in_16_bit_halves():
    """Independently of dropout_draws' reshapes: element (r, c) of an n-column mask is half c % 2 of
    Philox output (c % 8) // 2 at counter r * cdiv(n, 8) + c // 8 (output 0 is checked against
    tl.rand through philox_randint above; all four against Triton through the mask tests)."""
    seed, n = 1234, 21
    draws = dropout_draws(seed, torch.arange(3, 7), n)
    groups = 3  # cdiv(21, 8)
    for r in range(3, 7):
        for c in range(n):
            word = philox4(seed, torch.tensor([r * groups + c // 8]))[(c % 8) // 2].item()
            assert draws[r - 3, c].item() == (word >> (16 * (c % 2))) & 0xFFFF, (r, c)


def test_the_threshold_gives_p_in_steps_of_a_65536th():
    assert [dropout_threshold(p) for p in (0.0, 0.1, 0.5, 1.0)] == [0, 6554, 32768, 65536]
    keep = dropout_keep_mask(7, (2000, 1000), 0.1)
    rate = 1 - keep.float().mean().item()
    assert abs(rate - 6554 / 65536) < 3e-3, rate  # 2e6 Bernoulli draws: sd 2e-4
    assert dropout_keep_mask(7, (3, 40), 0.0).all() and not dropout_keep_mask(7, (3, 40), 1.0).any()
    # neighbouring elements use different halves and words: no two columns of a row agree throughout
    cols = dropout_keep_mask(3, (4000, 16), 0.5)
    agree = (cols[:, :, None] == cols[:, None, :]).float().mean(0)
    assert (agree - torch.eye(16) * 0.5).max().item() < 0.55, "columns correlated"


def test_check_seed_names_the_argument_and_the_allowed_forms():
    from tachyon.kernels.random import check_seed

    assert check_seed("op", 5, torch.device("cpu")) == 5
    t = torch.tensor(5)
    assert check_seed("op", t, torch.device("cpu")) is t
    bad = [(-1, "got -1"), (2**63, "got 9223372036854775808"), (True, "got True"), (1.5, "got 1.5"),
           (torch.tensor(5, dtype=torch.int32), "dtype torch.int32"), (torch.tensor([5]), r"shape \(1,\)"),
           (torch.tensor(5.0), "dtype torch.float32")]
    for seed, why in bad:
        with pytest.raises(ValueError, match=r"op: seed must be an int in \[0, 2\*\*63\) or a 0-dim torch.int64 "
                                             r"tensor on cpu.*" + why):
            check_seed("op", seed, torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor on meta; got a tensor of dtype torch.int64, shape \\(\\) on cpu"):
        check_seed("op", t, torch.device("meta"))


@pytest.mark.gpu
def test_reference_is_bit_identical_to_triton_on_gpu():
    from tachyon.kernels.random import triton as tri

    got = tri.rand(42, 1 << 20, device="cuda").cpu()
    assert torch.equal(got, rand(42, torch.arange(1 << 20)))
    seed = torch.tensor(2**62 + 3, device="cuda")
    got = tri.rand(seed, 1 << 20, device="cuda")
    assert torch.equal(got, rand(seed, torch.arange(1 << 20, device="cuda"))), "tensor seed on the GPU"
    assert torch.equal(got.cpu(), rand(2**62 + 3, torch.arange(1 << 20)))


def test_uniform_statistics_and_determinism():
    u = rand(7, torch.arange(200_000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005  # sd of the mean: 0.29 / sqrt(2e5) = 6.5e-4
    assert torch.equal(u, rand(7, torch.arange(200_000)))
    assert not torch.equal(u, rand(8, torch.arange(200_000)))


def test_keep_mask_rate():
    keep = dropout_keep_mask(3, (400, 500), p=0.1)
    rate = keep.float().mean().item()
    assert abs(rate - 0.9) < 0.003  # sd: sqrt(0.09 / 2e5) = 6.7e-4


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.random import triton as tri

# a seed and offset under 2**31 arrive as i32, larger ones as i64: tl.rand takes both paths;
# a tensor seed is loaded from an int64 pointer
for int_type in ("i32", "i64"):
    compile_sm90(tri._rand_kernel, {"OUT": "*fp32", "seed": int_type, "SEED_PTR": "*i64", "offset0": int_type},
                 dict(SEED_FROM_PTR=False, BLOCK=1024), num_warps=4)
compile_sm90(tri._rand_kernel, {"OUT": "*fp32", "SEED_PTR": "*i64", "offset0": "i64"},
             dict(SEED_FROM_PTR=True, BLOCK=1024), num_warps=4)
compile_sm90(tri._chained_seeds_kernel, {"KEY": "*i64", "CALLS": "*i64", "OUT": "*i64"},
             dict(ADVANCE=True, N=3, BLOCK=4), num_warps=1)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build the Philox kernel (TTIR -> PTX -> cubin
    with the bundled ptxas) for compute capability 9.0 with 32- and 64-bit seeds and offsets, and
    with the seed loaded from a tensor; and the chained-seeds kernel of the BERT layer."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=4)


_AOT_BROKEN_SCRIPT = """
import triton
import triton.language as tl
from tests.utils.aot import compile_sm90


@triton.jit
def _broken_kernel(X, BLOCK: tl.constexpr):
    x = tl.load(X + tl.arange(0, BLOCK))
    tl.store(X + tl.arange(0, BLOCK), tl.dot(x, x))  # 1-D dot: the compiler rejects it


compile_sm90(_broken_kernel, {"X": "*bf16"}, dict(BLOCK=16), num_warps=4)
"""


def test_aot_helper_reports_a_kernel_that_does_not_compile():
    """The compile tests above can fail: a compiler error surfaces with Triton's message."""
    from tests.utils.aot import compile_in_subprocess, signature

    with pytest.raises(AssertionError, match="equal ranks"):
        compile_in_subprocess(_AOT_BROKEN_SCRIPT, expected=1)
    with pytest.raises(ValueError, match=r"\['Y'\], which are not kernel arguments"):
        signature(["X", "n"], {"Y": "*fp32"}, {})
    assert signature(["X", "n", "B"], {"X": "*bf16"}, {"B": 4}) == {"X": "*bf16", "n": "i32", "B": "constexpr"}
