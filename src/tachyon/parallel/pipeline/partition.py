"""Splitting a layer list into pipeline stages (DeepSpeed's ``partition_method``).

    "uniform"        the same number of layers per stage (the first stages take the remainder)
    "parameters"     balance the trainable parameter count per stage (the default)
    "type:<regex>"   balance the number of layers whose class name matches the regex
                     (case-insensitive, e.g. "type:TransformerLayer")

Balancing finds contiguous stages that minimize the largest stage weight (dynamic programming,
exact), each stage holding at least one layer. Parameter counts come from building each
LayerSpec on the meta device (no memory, no initialization cost); a spec that cannot be built
there is built for real and dropped. Boundaries are returned as ``parts``: stage s holds layers
``parts[s]:parts[s+1]``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tachyon.parallel.pipeline.spec import LayerSpec, layer_type_name


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` parts of sizes differing by at most one (first parts larger)."""
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` non-empty contiguous parts minimizing the largest part weight
    (ties: the latest boundaries that reach the optimum, so earlier stages take more layers, as
    with "uniform", and the last stage, which also computes the loss, fewer)."""
    n = len(weights)
    if num_parts > n:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max part weight splitting the first i items into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    parts, i = [n], n
    for k in range(num_parts, 0, -1):
        target = best[k][i]
        j = next(j for j in range(i - 1, k - 2, -1) if max(best[k - 1][j], prefix[i] - prefix[j]) == target)
        parts.append(j)
        i = j
    return parts[::-1]


def count_parameters(layer: object) -> int:
    """Trainable parameter elements of a layer (a LayerSpec is built on the meta device)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # noqa: BLE001 (a constructor that needs real tensors: build it for real)
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def check_partition_method(method: object) -> str:
    if not isinstance(method, str) or not (method in ("uniform", "parameters") or method.startswith("type:")):
        raise ValueError(f"partition_method must be 'parameters', 'uniform' or 'type:<regex>'; got {method!r}")
    if method.startswith("type:"):
        pattern = method[len("type:"):]
        if not pattern:
            raise ValueError("partition_method 'type:<regex>' needs a regex after 'type:' (e.g. 'type:TransformerLayer')")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"partition_method {method!r}: bad regex ({err})") from None
    return method


def partition_layers(layers: list, num_parts: int, method: str) -> list[int]:
    """Stage boundaries for ``layers`` by ``method`` (see the module docstring)."""
    method = check_partition_method(method)
    if method == "uniform":
        return partition_uniform(len(layers), num_parts)
    if method == "parameters":
        weights = [count_parameters(layer) for layer in layers]
    else:
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1 if pattern.search(layer_type_name(layer)) else 0 for layer in layers]
    return partition_balanced(weights, num_parts)


__all__ = ["check_partition_method", "count_parameters", "partition_balanced", "partition_layers", "partition_uniform"]
