"""``make_graphed_callables``: modules' forward and backward captured as CUDA graphs, with FP8.

    layer = tachyon.make_graphed_callables(layer, (x,))                    # x: a sample input
    layers = tachyon.make_graphed_callables((l1, l2), ((x1,), (x2,)), fp8_enabled=True,
                                            fp8_recipe=DelayedScaling())
    y = layer(x_new)            # the forward graph replays; y.backward(...) replays the backward one

Transformer Engine's function and arguments (torch.cuda.make_graphed_callables plus keyword
arguments and FP8). A call replays the kernels the module launched at capture, with no Python,
autograd bookkeeping or launch overhead in between: the host time of a layer drops to a few
copies and two replays, whatever the layer does. The price is that everything is fixed at
capture: shapes, dtypes, the tensors' memory (new inputs are copied into the captured ones),
and every decision taken on the host.

How it runs, per callable (in the order given, sharing one memory pool):

1. checks, before any CUDA work: callables all training or all eval, no hooks registered on
   them, no buffer that requires grad, sample arguments tensors (keyword values: tensors, or
   Python values that must then be the same at every call), CUDA tensors, no progressive layer
   drop (its coin flip is drawn on the host);
2. ``num_warmup_iters`` forwards and backwards (``torch.autograd.grad``, so no ``.grad`` is
   touched) on a side stream: Triton compiles and autotunes, cuBLAS picks its algorithms,
   tachyon's launch caches fill;
3. the forward graphs in order, then the backward graphs in reverse order (one memory pool).
   Warm-up and capture run under ``tachyon.kernels.dispatch.graph_capture_choices()``: where
   ``backend="auto"`` chooses between a Triton kernel and its torch twin, it chooses by GPU time
   (what a replay costs), not by eager time, so a graph may hold a different (faster when replayed)
   implementation than the same module runs eagerly; results agree to rounding;
4. the modules' buffers (e.g. the BERT layer's dropout counter), FP8 scaling state (amax
   histories, scales) and the CUDA RNG state are restored to what they were before step 2, so
   the warm-up leaves no trace: the first replay computes what the first eager call would have.

Each module's ``forward`` is replaced: in the training mode it was captured in, a call copies its
tensor arguments into the captured inputs (where they are other tensors), replays the forward
graph and returns the captured outputs; their backward copies the incoming gradients in and
replays the backward graph, returning the gradients of the inputs and the parameters (which
autograd accumulates into ``.grad`` as usual). In the other mode it runs the original forward.

FP8 (``fp8_enabled`` / ``fp8_calibrating`` / ``fp8_recipe`` / ``fp8_group``): the callables run
inside ``tachyon.autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, recipe=fp8_recipe,
amax_reduction_group=fp8_group)`` at warm-up and capture, under any recipe (delayed, current or
block scaling). Under delayed scaling each forward graph ends with what the autocast's exit does
in eager mode (the forward amaxes reduced over ``fp8_group``, the scales updated) and each
backward graph with what the end of an eager backward pass does (the gradients' amaxes and
scales, :func:`tachyon.fp8.reduce_and_update_fp8_tensors` run inside the capture): every replay
updates the scales exactly once, as an eager step does. Current and block scaling compute their
scales inside the captured kernels and have no state to update. Called inside an open
``tachyon.autocast`` it is refused (the captures would take that context's settings and its exit
would update the scales once, outside the graphs). ``fp8_weight_caching=True`` (callables take ``is_first_microbatch``,
which must then be passed at every call as a bool): two graph pairs per callable, one casting the
weights into the FP8 cache and one reusing it, sharing the cache's memory.

DeepSpeed-style training does this per micro-batch through the engine's ``cuda_graph`` config
section (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tachyon.kernels import dispatch

PLD_KWARGS = ("progressive_layer_drop", "pld_theta")


def _as_tuple(value: Any, single: bool) -> tuple:
    return (value,) if single else tuple(value)


def _check_callables(callables: tuple, sample_args: tuple, sample_kwargs: tuple, fp8_weight_caching: bool) -> bool:
    """Every check that needs no GPU; returns whether the callables are in training mode."""
    if len(sample_args) != len(callables) or len(sample_kwargs) != len(callables):
        raise ValueError(f"make_graphed_callables: {len(callables)} callables but {len(sample_args)} sample_args and "
                         f"{len(sample_kwargs)} sample_kwargs; pass one tuple of arguments (and one dict) per callable")
    modes = {c.training for c in callables if isinstance(c, nn.Module)}
    if len(modes) > 1:
        raise ValueError("make_graphed_callables: the modules must all be in training mode or all in eval mode "
                         "(a graph replays one mode's kernels)")
    for index, (c, args, kwargs) in enumerate(zip(callables, sample_args, sample_kwargs)):
        if not callable(c):
            raise ValueError(f"make_graphed_callables: callable {index} is a {type(c).__name__}, not a module or function")
        if isinstance(c, nn.Module):
            hooks = [name for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
                     if any(getattr(m, name) for m in c.modules())]
            if hooks:
                raise ValueError(f"make_graphed_callables: module {index} ({type(c).__name__}) has hooks registered "
                                 f"({', '.join(hooks)}): a replay would skip them; register hooks after capture")
            trainable = [name for name, b in c.named_buffers() if b.requires_grad]
            if trainable:
                raise ValueError(f"make_graphed_callables: module {index} has buffers that require grad ({trainable}); "
                                 "only parameters may be trainable")
        if not isinstance(args, tuple):
            raise ValueError(f"make_graphed_callables: sample_args[{index}] must be a tuple of tensors; got "
                             f"{type(args).__name__}")
        leaves, _ = tree_flatten(args)
        bad = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"make_graphed_callables: sample_args[{index}] must contain only tensors; got {bad} "
                             "(pass other values as sample_kwargs)")
        if not isinstance(kwargs, dict):
            raise ValueError(f"make_graphed_callables: sample_kwargs[{index}] must be a dict; got {type(kwargs).__name__}")
        drops = [k for k in PLD_KWARGS if kwargs.get(k) not in (None, False)]
        if drops:
            raise ValueError(f"make_graphed_callables: {drops} in sample_kwargs[{index}]: progressive layer drop draws "
                             "its keep-or-drop decision on the host at every call, which a graph cannot replay")
        if fp8_weight_caching and not isinstance(kwargs.get("is_first_microbatch"), bool):
            raise ValueError(f"make_graphed_callables: fp8_weight_caching=True needs sample_kwargs[{index}] with "
                             "is_first_microbatch=True or False (both variants are captured)")
        tensors = [v for v in leaves + tree_flatten(kwargs)[0] if isinstance(v, torch.Tensor)]
        off_gpu = sorted({str(t.device) for t in tensors if not t.is_cuda})
        if off_gpu:
            raise ValueError(f"make_graphed_callables captures CUDA graphs: the sample arguments of callable {index} "
                             f"are on {', '.join(off_gpu)}; pass CUDA tensors (no graph capture on the CPU)")
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise ValueError("make_graphed_callables: torch.autocast's weight cache is enabled; enter "
                         "torch.autocast(..., cache_enabled=False) (a cached cast would be captured once)")
    if not torch.cuda.is_available():
        raise ValueError("make_graphed_callables captures CUDA graphs and needs a CUDA device; this machine has none")
    return modes != {False}


class _Snapshot:
    """Buffers and FP8 scaling tensors of modules, and the CUDA RNG state, copied now and put back
    in place (the same tensors, so captured graphs keep pointing at them) by :meth:`restore`."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        self.saved = {key: t.detach().clone() for key, t in self._tensors()}
        self.rng = torch.cuda.get_rng_state()

    def _tensors(self):
        for i, module in enumerate(self.modules):
            for name, buf in module.named_buffers():
                yield (i, "buffer", name), buf
            for name, sub in module.named_modules():
                for key, scaling in (getattr(sub, "fp8_scaling", None) or {}).items():
                    for path, t in _state_tensors(scaling, ()):
                        yield (i, "fp8", name, key, *path), t

    @torch.no_grad()
    def restore(self) -> None:
        for key, t in self._tensors():
            old = self.saved.get(key)
            if old is not None and old.shape == t.shape:
                t.copy_(old)  # in place: a state tensor moved to the GPU at warm-up keeps its new home
        torch.cuda.set_rng_state(self.rng)


def _state_tensors(obj: Any, path: tuple, depth: int = 0):
    """(attribute path, tensor) of the tensors an FP8 scaling object holds (states nest one level)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth > 2 or not hasattr(obj, "__dict__"):
        return
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor) or (hasattr(value, "__dict__") and not callable(value)):
            yield from _state_tensors(value, (*path, name), depth + 1)


class _Captured:
    """One forward graph and its backward graph, with their static inputs, outputs and gradients."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, params: tuple[nn.Parameter, ...]) -> None:
        self.func, self.args, self.kwargs, self.params = func, args, kwargs, params
        arg_leaves, self.args_spec = tree_flatten(args)
        kwarg_leaves, self.kwargs_spec = tree_flatten(kwargs)
        self.n_args = len(arg_leaves)
        self.kwarg_leaves = kwarg_leaves
        tensor_kwargs = [v for v in kwarg_leaves if isinstance(v, torch.Tensor)]
        self.inputs = tuple(arg_leaves) + tuple(tensor_kwargs) + params  # everything the graph may read
        self.n_user = self.n_args + len(tensor_kwargs)
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd = torch.cuda.CUDAGraph()
        self.outputs: tuple = ()
        self.out_spec = None
        self.grad_outputs: tuple = ()
        self.grad_inputs: tuple = ()

    def run(self) -> Any:
        return self.func(*self.args, **self.kwargs)

    def warm_up(self, iters: int, training: bool, allow_unused: bool) -> None:
        for _ in range(iters):
            outputs = [o for o in tree_flatten(self.run())[0] if isinstance(o, torch.Tensor)]
            if training:
                wanted = tuple(o for o in outputs if o.requires_grad)
                torch.autograd.grad(wanted, tuple(i for i in self.inputs if i.requires_grad),
                                    grad_outputs=tuple(torch.empty_like(o) for o in wanted), only_inputs=True,
                                    allow_unused=allow_unused)
            del outputs

    def capture_forward(self, pool) -> None:
        with torch.cuda.graph(self.fwd, pool=pool):
            out = self.run()
        flat, self.out_spec = tree_flatten(out)
        bad = [type(o).__name__ for o in flat if not isinstance(o, torch.Tensor)]
        if bad:
            raise ValueError(f"make_graphed_callables: the callable returned non-tensor values {bad}; a graphed "
                             "callable returns tensors only")
        self.outputs = tuple(flat)

    def capture_backward(self, pool, training: bool, allow_unused: bool, retain_graph: bool, fp8: bool) -> None:
        self.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in self.outputs)
        needed = tuple(i for i in self.inputs if i.requires_grad)
        grads: tuple = ()
        if training and needed:
            with torch.cuda.graph(self.bwd, pool=pool):
                grads = torch.autograd.grad(tuple(o for o in self.outputs if o.requires_grad), needed,
                                            grad_outputs=tuple(g for g in self.grad_outputs if g is not None),
                                            only_inputs=True, allow_unused=allow_unused, retain_graph=retain_graph)
                if fp8:  # a captured backward queues no update: the graph ends with it (delayed scaling)
                    from tachyon.fp8 import reduce_and_update_fp8_tensors

                    reduce_and_update_fp8_tensors(forward=False)
        it = iter(grads)
        self.grad_inputs = tuple(next(it) if training and i.requires_grad else None for i in self.inputs)


def _graphed_function(cap: _Captured) -> Callable[..., Any]:
    """The replaying autograd function of one capture: (*user tensors, *params) -> outputs."""

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, new in zip(cap.inputs[:cap.n_user], inputs[:cap.n_user]):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            cap.fwd.replay()
            return tuple(o.detach() for o in cap.outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for static, grad in zip(cap.grad_outputs, grads):
                if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
                elif static is not None and grad is None:
                    static.zero_()  # an output that got no gradient this time
            cap.bwd.replay()
            return tuple(g.detach() if g is not None else None for g in cap.grad_inputs)

    return Graphed.apply


class _Replayer:
    """Calls of one graphed callable: check the arguments against the capture, pick the graph pair
    (by ``is_first_microbatch`` when FP8 weights are cached), replay."""

    def __init__(self, captures: dict[Any, _Captured], fp8_weight_caching: bool) -> None:
        self.captures = captures
        self.fp8_weight_caching = fp8_weight_caching
        self.apply = {key: _graphed_function(cap) for key, cap in captures.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None
        if self.fp8_weight_caching:
            key = kwargs.get("is_first_microbatch")
            if not isinstance(key, bool):
                raise ValueError("a callable graphed with fp8_weight_caching=True takes is_first_microbatch=True or False "
                                 f"at every call; got {key!r}")
        cap = self.captures[key]
        arg_leaves, spec = tree_flatten(args)
        if spec != cap.args_spec:
            raise ValueError(f"graphed callable: called with positional arguments {spec}; captured with {cap.args_spec}")
        kwarg_leaves, kspec = tree_flatten(kwargs)
        if kspec != cap.kwargs_spec:
            raise ValueError(f"graphed callable: called with keyword arguments {kspec}; captured with {cap.kwargs_spec}")
        user = list(arg_leaves)
        for new, old in zip(kwarg_leaves, cap.kwarg_leaves):
            if isinstance(old, torch.Tensor):
                user.append(new)
            elif new != old:
                raise ValueError(f"graphed callable: a keyword argument is {new!r} but was {old!r} at capture; "
                                 "non-tensor arguments are part of the captured graph and cannot change")
        for new, old in zip(user, cap.inputs):
            if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype \
                    or new.device != old.device:
                got = f"{new.dtype} {tuple(new.shape)} on {new.device}" if isinstance(new, torch.Tensor) else repr(new)
                raise ValueError(f"graphed callable: an input is {got}; the graph was captured for {old.dtype} "
                                 f"{tuple(old.shape)} on {old.device} (shapes, dtypes and devices are fixed at capture)")
        out = self.apply[key](*user, *cap.params)
        return tree_unflatten(list(out), cap.out_spec)


def make_graphed_callables(
    modules: nn.Module | Callable | tuple,
    sample_args: tuple,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: dict | tuple | None = None,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe: Any = None,
    fp8_group: Any = None,
    fp8_weight_caching: bool = False,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
) -> Any:
    """Capture callables' forward and backward as CUDA graphs (module docstring); returns the
    callables (modules with their forward replaced; functions as replaying functions), one or a
    tuple as given. Arguments as Transformer Engine's ``make_graphed_callables``."""
    single = not isinstance(modules, tuple)
    callables = _as_tuple(modules, single)
    if single:
        sample_args = (sample_args,)
    if not isinstance(sample_args, tuple):
        raise ValueError(f"make_graphed_callables: sample_args must be a tuple; got {type(sample_args).__name__}")
    if sample_kwargs is None:
        sample_kwargs = tuple({} for _ in callables)
    elif single:
        sample_kwargs = (sample_kwargs,)
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"make_graphed_callables: num_warmup_iters must be an int >= 1 (the capture needs Triton's "
                         f"compilation and autotuning done before it); got {num_warmup_iters!r}")
    for name, flag in (("allow_unused_input", allow_unused_input), ("fp8_enabled", fp8_enabled),
                       ("fp8_calibrating", fp8_calibrating), ("fp8_weight_caching", fp8_weight_caching),
                       ("retain_graph_in_backward", retain_graph_in_backward)):
        if not isinstance(flag, bool):
            raise ValueError(f"make_graphed_callables: {name} must be True or False; got {flag!r}")
    if fp8_weight_caching and not fp8_enabled:
        raise ValueError("make_graphed_callables: fp8_weight_caching=True caches FP8 weights and needs fp8_enabled=True")
    from tachyon.fp8 import autocast, autocast_active

    if autocast_active():
        raise RuntimeError("make_graphed_callables: called inside an open tachyon.autocast; call it outside and pass "
                           "fp8_enabled / fp8_calibrating / fp8_recipe / fp8_group (the captures run in their own "
                           "autocast, so that each replay updates the FP8 scales itself)")
    uses_fp8 = fp8_enabled or fp8_calibrating
    if uses_fp8:  # the recipe and flags checked (MXFP8 on a GPU without it, ...) before any CUDA work
        autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)
    training = _check_callables(callables, tuple(sample_args), tuple(sample_kwargs), fp8_weight_caching)

    def in_autocast(func: Callable) -> Callable:
        if not uses_fp8:
            return func

        def run(*args, **kwargs):
            with autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, recipe=fp8_recipe,
                          amax_reduction_group=fp8_group):
                return func(*args, **kwargs)
        return run

    modules_only = [c for c in callables if isinstance(c, nn.Module)]
    snapshot = _Snapshot(modules_only)
    mempool = torch.cuda.graph_pool_handle() if pool is None else pool
    variants = (True, False) if fp8_weight_caching else (None,)
    captures: list[dict[Any, _Captured]] = []
    for c, args, kwargs in zip(callables, sample_args, sample_kwargs):
        params = tuple(c.parameters()) if isinstance(c, nn.Module) else ()
        per = {}
        for variant in variants:
            kw = dict(kwargs) if variant is None else {**kwargs, "is_first_microbatch": variant}
            per[variant] = _Captured(in_autocast(c), args, kw, params)
        captures.append(per)
    torch.cuda.synchronize()
    # backend "auto" picks, in warm-up and capture alike, what is fastest when replayed (GPU time alone)
    with dispatch.graph_capture_choices():
        with torch.cuda.stream(torch.cuda.Stream()):
            for per in captures:
                for cap in per.values():
                    cap.warm_up(num_warmup_iters, training, allow_unused_input)
        torch.cuda.synchronize()
        snapshot.restore()  # the captures start from the state before warm-up (their effects replay at each call)
        for per in captures:
            for cap in per.values():
                cap.capture_forward(mempool)
        for per in reversed(captures):
            for cap in reversed(list(per.values())):
                cap.capture_backward(mempool, training, allow_unused_input, retain_graph_in_backward, uses_fp8)
        torch.cuda.synchronize()
    results = []
    for c, per in zip(callables, captures):
        replayer = _Replayer(per, fp8_weight_caching)
        if isinstance(c, nn.Module):
            original, mode = c.forward, c.training

            def forward(*args, _c=c, _replay=replayer, _orig=original, _mode=mode, **kwargs):
                return _replay(*args, **kwargs) if _c.training == _mode else _orig(*args, **kwargs)

            c.forward = forward
            results.append(c)
        else:
            results.append(replayer)
    return results[0] if single else tuple(results)


__all__ = ["make_graphed_callables"]
