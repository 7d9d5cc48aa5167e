"""Asserts that explain a mismatch: how many elements, where the worst one is, how far off."""

from __future__ import annotations

import torch

from tests.utils.tolerances import tolerance


def describe_mismatch(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> str | None:
    """None when every element is within atol + rtol * |expected|, else a report."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    lines = []
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    nan_diff = int((a_nan != e_nan).sum())
    inf_diff = int(((a_inf != e_inf) | (a_inf & e_inf & (torch.sign(a) != torch.sign(e)))).sum())
    if nan_diff:
        lines.append(f"NaN disagreements: {nan_diff} (actual has {int(a_nan.sum())}, expected {int(e_nan.sum())})")
    if inf_diff:
        lines.append(f"inf disagreements: {inf_diff} (actual has {int(a_inf.sum())}, expected {int(e_inf.sum())})")
    finite = torch.isfinite(a) & torch.isfinite(e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bad = finite & (err > atol + rtol * e.abs())
    n_bad = int(bad.sum())
    if n_bad:
        worst = int(torch.argmax(torch.where(bad, err, torch.zeros_like(err))))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
        rel = err / e.abs().clamp_min(1e-30)
        lines.append(
            f"{n_bad} of {a.numel()} elements differ beyond rtol={rtol:g}, atol={atol:g}; worst at index {idx}: "
            f"actual {a.reshape(-1)[worst].item():.8g}, expected {e.reshape(-1)[worst].item():.8g}; "
            f"max abs error {float(err.max()):.4g}, max rel error {float(rel[finite].max()) if finite.any() else 0:.4g}"
        )
    return "\n".join(lines) or None


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    name: str = "tensor",
) -> None:
    """Assert closeness with the tolerance of ``dtype`` (default: actual's dtype)."""
    t_rtol, t_atol = tolerance(dtype or actual.dtype)
    report = describe_mismatch(actual, expected, t_rtol if rtol is None else rtol, t_atol if atol is None else atol)
    if report:
        raise AssertionError(f"{name}: {report}")


def assert_close_to_reference(
    actual: torch.Tensor,
    lowp_reference: torch.Tensor,
    fp32_reference: torch.Tensor,
    *,
    name: str = "tensor",
    inherent: float = 0.0,
) -> None:
    """The 2x-of-PyTorch rule for low-precision kernels.

    ``actual``: the kernel's result in dtype d; ``lowp_reference``: plain PyTorch in dtype d;
    ``fp32_reference``: the oracle in fp32 (or fp64). The kernel's max error against the oracle
    may be at most 2x PyTorch's own max error in dtype d, plus atol of d, plus ``inherent``: a
    bound, derived by the caller from the data, on error the kernel's algorithm has by design and
    the plain PyTorch sequence does not (e.g. recomputing a norm's input from its rounded output).
    """
    dtype = actual.dtype
    _, atol = tolerance(dtype)
    oracle = fp32_reference.detach().double().cpu()
    kernel_err = (actual.detach().double().cpu() - oracle).abs().max().item()
    torch_err = (lowp_reference.detach().double().cpu() - oracle).abs().max().item()
    if not kernel_err <= 2 * torch_err + atol + inherent:
        report = describe_mismatch(actual, fp32_reference.to(actual.dtype), *tolerance(dtype)) or ""
        raise AssertionError(
            f"{name}: max error vs the fp32 oracle is {kernel_err:.4g}, more than 2x PyTorch's {torch_err:.4g} "
            f"in {dtype} (+ atol {atol:g}, + inherent {inherent:.3g})\n{report}"
        )
