"""A param group's ``exp_avg_mask`` as the 1-bit optimizers apply it.

DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB multiply a group's ``exp_avg_mask`` into the
momentum (or the compressed averages) of its parameters, and scripts read and replace
``optimizer.param_groups[i]["exp_avg_mask"]`` (after loading a checkpoint, which keeps the current
mask). The group keeps the mask exactly as given. On its own, an optimizer applies it to each
parameter of the group by broadcasting; bound to tachyon's engine, whose optimizer parameters are
flat fp32 masters (one per group, padded, a partition at ZeRO-1/2), the engine sets
``mask_layout(index, mask)``, which lays a mask given for the group's model parameters out as
that master (`tachyon.engine.zero.base`). The laid-out mask is remembered per group until the
group's mask is replaced or changed in place.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
import torch

MaskLayout = Callable[[int, Tensor], Tensor]


class MaskedGroups:
    """Mixin of the optimizers that honour ``exp_avg_mask``: :meth:`group_mask`."""

    mask_layout: MaskLayout | None = None  # set by the engine (module docstring)
    _laid_masks: dict[int, tuple[int, int, Tensor]]

    def group_mask(self, index: int, group: dict, p: Tensor) -> Tensor | None:
        """Group ``index``'s mask for its parameter ``p`` (fp32 on p's device), or None."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return None
        if self.mask_layout is None:
            try:
                torch.broadcast_shapes(mask.shape, p.shape)
            except RuntimeError:
                raise ValueError(f"param group 'exp_avg_mask' of shape {tuple(mask.shape)} does not broadcast to a "
                                 f"parameter of shape {tuple(p.shape)}; give each masked parameter its own group") from None
            return mask.to(device=p.device, dtype=torch.float32)
        laid = getattr(self, "_laid_masks", None)
        if laid is None:
            laid = self._laid_masks = {}
        key = (id(mask), mask._version)
        cached = laid.get(index)
        if cached is None or cached[:2] != key:
            cached = laid[index] = (*key, self.mask_layout(index, mask).to(device=p.device, dtype=torch.float32))
        return cached[2]

    def check_masks(self) -> None:
        """Lay every group's mask out once (raises, naming the group, where a mask fits no layout)."""
        for index, group in enumerate(self.param_groups):  # type: ignore[attr-defined]
            if group.get("exp_avg_mask") is not None:
                self.group_mask(index, group, group["params"][0])


__all__ = ["MaskLayout", "MaskedGroups"]
