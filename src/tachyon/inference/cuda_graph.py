"""CUDA graphs for decode (``enable_cuda_graph=True``): one captured decode step per batch size.

A decode step launches ~10 kernels per layer for one token per sequence; at batch 1 the GPU
finishes each in microseconds and the step time becomes the host's launch time. Capturing the
step once and replaying it removes that: the graph holds every launch of every layer (the
Triton kernels read the cache lengths from the device, so the same graph serves every position).

What makes it capturable: the cache is preallocated at ``max_out_tokens`` and kept per batch size
(the graph holds its addresses), the step's inputs are copied into static buffers before each
replay, and :meth:`InjectedDecoder.run` reads nothing on the host. Prefill is not captured (its
shape changes with every prompt).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.inference.decoder import InjectedDecoder, KVCache


class DecodeGraph:
    """A captured decode step of ``model`` over ``cache`` (whose prefill has run)."""

    def __init__(self, model: InjectedDecoder, cache: KVCache) -> None:
        batch = cache.lengths.shape[0]
        self.model, self.cache = model, cache
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=model.device)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=model.device)
        lengths = cache.lengths.clone()
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes outside the capture
            model.run(self.ids, self.positions, cache, True)
        torch.cuda.current_stream(model.device).wait_stream(side)
        cache.lengths.copy_(lengths)  # the warm-up wrote one slot past the prompt; the real step overwrites it
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.run(self.ids, self.positions, cache, True)

    def __call__(self, next_tokens: Tensor, positions: Tensor) -> Tensor:
        self.ids.copy_(next_tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        self.cache.past += 1
        return self.logits


class GraphPool:
    """Caches of capacity max_out_tokens and their decode graphs, kept per (batch, padded)."""

    def __init__(self, model: InjectedDecoder, capacity: int) -> None:
        if model.device.type != "cuda":
            raise ValueError("enable_cuda_graph=True needs the model on a CUDA device; this one is on "
                             f"{model.device} (leave enable_cuda_graph off on CPU)")
        self.model, self.capacity = model, capacity
        self.caches: dict[int, KVCache] = {}
        self.graphs: dict[tuple[int, bool], DecodeGraph] = {}

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        del capacity  # always max_out_tokens: the graph holds the cache's addresses
        cache = self.caches.get(batch)
        if cache is None:
            cache = self.caches[batch] = self.model.new_cache(batch, self.capacity)
        cache.reset()
        return cache

    def decode(self, next_tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        key = (cache.lengths.shape[0], cache.has_padding)
        graph = self.graphs.get(key)
        if graph is None or graph.cache is not cache:
            graph = self.graphs[key] = DecodeGraph(self.model, cache)
        return graph(next_tokens, positions)


__all__ = ["DecodeGraph", "GraphPool"]
