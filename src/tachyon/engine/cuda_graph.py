"""The engine's ``cuda_graph`` section: the model's forward and backward replayed from CUDA graphs.

At the first training micro-batch the engine hands the model and that batch to
`tachyon.make_graphed_callables` (warm-up runs that change no state, then the capture); every
later training forward replays the forward graph and the loss's backward the backward graph,
whose parameter gradients autograd accumulates into ``.grad`` as usual, where ZeRO's gradient
hooks take them. Loss scaling, the non-finite check, clipping, the optimizer step and evaluation
(``model.eval()`` runs the original forward) stay eager. What a graph cannot replay is refused at
``tachyon.initialize`` (:func:`check_cuda_graph`), before any state changes.
"""

from __future__ import annotations

from typing import Any

import torch

from tachyon.config import ConfigError


def check_cuda_graph(model: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Refuse a ``cuda_graph`` config that cannot be captured correctly, naming why."""
    if not config.cuda_graph.enabled:
        return
    why = []
    if device.type != "cuda":
        why.append(f"the engine trains on {device}: CUDA graphs need a CUDA device")
    if config.progressive_layer_drop.enabled:
        why.append("progressive_layer_drop draws each layer's keep-or-drop on the host at every step, which a graph "
                   "cannot replay")
    if config.flops_profiler.enabled:
        why.append("the flops profiler counts through module hooks, which graph replays bypass")
    ac = config.activation_checkpointing
    if ac.cpu_checkpointing:
        why.append("activation_checkpointing.cpu_checkpointing allocates pinned host memory during the forward, "
                   "which a capture cannot")
    if ac.synchronize_checkpoint_boundary:
        why.append("activation_checkpointing.synchronize_checkpoint_boundary synchronizes the device, which a "
                   "capture cannot")
    from tachyon.parallel.pipeline import PipelineModule

    if isinstance(model, PipelineModule):
        why.append("a PipelineModule runs its schedule's micro-batches itself (engine.train_batch)")
    if why:
        raise ConfigError("cuda_graph.enabled is refused: " + "; ".join(why))


class EngineCudaGraph:
    """Captures the engine's model at its first training forward; see the module docstring."""

    def __init__(self, model: torch.nn.Module, num_warmup_iters: int) -> None:
        self.model = model
        self.num_warmup_iters = num_warmup_iters
        self.captured = False

    def before_forward(self, inputs: tuple, kwargs: dict) -> None:
        """Called with each training forward's arguments; the first call captures the graphs."""
        if self.captured:
            return
        bad = [type(v).__name__ for v in inputs if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"cuda_graph: the engine's forward got positional arguments that are not tensors ({bad}); "
                             "a captured forward takes tensors positionally (pass other values as keywords, which "
                             "must then be the same at every call)")
        from tachyon.cuda_graphs import make_graphed_callables

        make_graphed_callables(self.model, tuple(inputs), sample_kwargs=dict(kwargs),
                               num_warmup_iters=self.num_warmup_iters)
        self.captured = True


__all__ = ["EngineCudaGraph", "check_cuda_graph"]
