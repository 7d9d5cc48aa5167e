"""``PipelineModule``: a model given as a list of layers, split into pipeline stages.

    net = PipelineModule(layers=[TiedLayerSpec("embed", ...), LayerSpec(Block, ...), ..., head_spec],
                         num_stages=4, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="parameters")
    schedule = PipelineSchedule(net, micro_batches=8, schedule="1F1B")
    loss = schedule.train_batch(data_iter)

DeepSpeed's class and arguments. The layer list is cut into ``num_stages * stages_per_rank``
contiguous stages (partition.py); stage ``s`` runs on pipeline rank ``s % num_stages`` (with
``stages_per_rank > 1``, the interleaved schedule's virtual stages: rank r holds stages r,
r + num_stages, ...). Only this rank's layers are built. Each layer gets the output of the one
before it as its single argument (a tensor or a tuple of tensors); the last stage's output goes
to ``loss_fn(output, labels)``.

Placement comes from ``topology``: a tachyon Mesh (or an mpu / mesh_from_mpu view); without one
a Mesh(pp=num_stages) over all ranks is made (DeepSpeed's default, the data-parallel size
inferred). With num_stages=1 and no topology nothing distributed is touched: the module runs
every layer, which is how a single process trains the same model.

State dict keys are layout-free, DeepSpeed's: layer ``i``'s parameters are ``"{i}.<name>"``, a
tied module's ``"tied_modules.{key}.<name>"`` (the first spec of each key owns it); a rank's
state dict holds its layers only.

Tied weights: every rank holding a key builds the module; at build time the copies are made equal
(broadcast from the lowest pipeline rank holding the key), and ``allreduce_tied_weight_gradients``
(PipelineSchedule calls it after every batch) sums their gradients over those ranks, so equal
optimizer steps keep them bit-identical.

``seed_layers=True`` builds layer ``i`` under ``torch.manual_seed(base_seed + i)`` (``seed_fn``
if given), so its initial values do not depend on the partition; the global RNG state is
restored afterwards. ``activation_checkpoint_interval=k > 0`` recomputes each run of k layers in
the backward (``activation_checkpoint_func``, default ``torch.utils.checkpoint.checkpoint``
without reentrancy). As in DeepSpeed, a run is checkpointed when one of its layers is a module
with parameters or, with ``checkpointable_layers``, when every layer's class name is listed
(``is_checkpointable_results``: one entry per run of this rank's stages). Both attributes may be
changed after building (``set_checkpoint_interval``, DeepSpeed's; the engine applies the
config's ``pipeline.activation_checkpoint_interval`` / ``use_reentrant`` this way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tachyon.parallel.pipeline.partition import check_partition_method, partition_layers
from tachyon.parallel.pipeline.spec import LayerSpec, TiedLayerSpec, layer_type_name


def _default_checkpoint(function: Callable, *args: Any) -> Any:
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


class StageModule(nn.Module):
    """One pipeline stage: layers ``start:stop`` of a PipelineModule, run in order.

    forward(*inputs): the first layer gets ``inputs[0]`` (or the tuple when several), each next
    layer the previous output. Registered children: the stage's modules under their global
    layer index, tied modules under ``tied_modules``. What torch.distributed.pipelining's
    PipelineStage wraps.
    """

    def __init__(self, index: int, start: int, funcs: list[Callable], modules: dict[str, nn.Module],
                 checkpoint_interval: int, checkpoint_func: Callable, names: list[str],
                 checkpointable_layers: list[str] | None) -> None:
        super().__init__()
        self.index, self.start, self.stop = index, start, start + len(funcs)
        for name, module in modules.items():
            self.add_module(name, module)
        self._funcs, self._names, self._checkpointable_layers = funcs, names, checkpointable_layers
        self.set_checkpointing(checkpoint_interval, checkpoint_func)

    def set_checkpointing(self, interval: int, checkpoint_func: Callable) -> None:
        """Checkpoint every run of ``interval`` layers (0: none) with ``checkpoint_func``."""
        self._interval, self._checkpoint_func = interval, checkpoint_func
        n = len(self._funcs)
        self.is_checkpointable_results = [self._is_checkpointable(lo, min(n, lo + interval))
                                          for lo in range(0, n, interval)] if interval > 0 else []

    def _is_checkpointable(self, lo: int, hi: int) -> bool:
        """DeepSpeed's rule for a run of layers: every class name in ``checkpointable_layers``
        when given, else any layer is a module with parameters (parameter-free runs are cheap to keep)."""
        if self._checkpointable_layers is not None:
            return all(name in self._checkpointable_layers for name in self._names[lo:hi])
        return any(isinstance(f, nn.Module) and next(iter(f.parameters()), None) is not None for f in self._funcs[lo:hi])

    def ordered_layers(self) -> list[Callable]:
        """The stage's layers in the order they run (modules, or functions for parameter-free
        layers and tied forward_fns)."""
        return list(self._funcs)

    def _run(self, lo: int, hi: int) -> Callable:
        def run(*x):
            x = x[0] if len(x) == 1 else x
            for f in self._funcs[lo:hi]:
                x = f(x)
            return x

        return run

    def forward(self, *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        n = len(self._funcs)
        if self._interval == 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(0, n)(x)
        for block, lo in enumerate(range(0, n, self._interval)):
            run = self._run(lo, min(n, lo + self._interval))
            args = x if isinstance(x, tuple) else (x,)
            x = self._checkpoint_func(run, *args) if self.is_checkpointable_results[block] else run(*args)
        return x


class PipelineModule(nn.Module):
    """A layer list split into pipeline stages; this rank builds and runs its own (module docstring).

    Args:
        layers: LayerSpec, TiedLayerSpec, nn.Module or plain callables (applied as functions).
        num_stages: pipeline ranks (default: the topology's pp size).
        topology: tachyon Mesh or mpu; default Mesh(pp=num_stages) (none when num_stages is 1).
        loss_fn: callable(output, labels) -> scalar loss; required.
        seed_layers, seed_fn, base_seed: per-layer seeding (module docstring).
        partition_method: "parameters" (default), "uniform" or "type:<regex>".
        activation_checkpoint_interval, activation_checkpoint_func, checkpointable_layers:
            activation checkpointing inside each stage.
        stages_per_rank: virtual stages per pipeline rank (>1 for the interleaved 1F1B schedule).

    Raises ValueError, before building anything, for a missing loss_fn, an empty layer list, more
    stages than layers, a bad partition method, or num_stages that does not match the topology.
    Attributes: ``parts`` (boundaries of every stage), ``stage_ids`` (this rank's stages),
    ``stage_modules`` (their StageModules), ``num_stages``, ``total_stages``, ``mesh`` (None
    without one), ``tied_modules``.
    """

    def __init__(
        self,
        layers: list,
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
        *,
        stages_per_rank: int = 1,
    ) -> None:
        super().__init__()
        layers = list(layers)
        _check_args(layers, num_stages, loss_fn, partition_method, activation_checkpoint_interval, stages_per_rank)
        if topology is not None:
            from tachyon.parallel.mesh import as_mesh

            topology = as_mesh(topology)
        pp = topology.size("pp") if topology is not None else (num_stages or 1)
        if num_stages is not None and num_stages != pp:
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has pp={pp} pipeline ranks")
        total = pp * stages_per_rank
        if total > len(layers):
            raise ValueError(
                f"PipelineModule: {total} stages ({pp} pipeline ranks x {stages_per_rank} per rank) but only "
                f"{len(layers)} layers; every stage needs at least one layer"
            )
        mesh = topology if topology is not None else _default_mesh(pp)  # after every check: a mesh creates groups
        self.mesh, self.loss_fn = mesh, loss_fn
        self.num_stages, self.stages_per_rank, self.total_stages = pp, stages_per_rank, total
        self.pp_rank = mesh.rank("pp") if mesh is not None else 0
        self.partition_method = partition_method
        self.seed_layers = bool(seed_layers)
        self.parts = partition_layers(layers, total, partition_method)
        self.stage_ids = [self.pp_rank + k * pp for k in range(stages_per_rank)]
        self._layer_specs = layers
        self.tied_modules = nn.ModuleDict()
        self._tied_attrs: dict[str, tuple[str, ...]] = {}
        self._seed = (seed_layers, seed_fn, base_seed)
        self._ac_interval = activation_checkpoint_interval
        self._ac_func = activation_checkpoint_func or _default_checkpoint
        stages = [self._build_stage(s, checkpointable_layers) for s in self.stage_ids]
        object.__setattr__(self, "stage_modules", stages)  # not registered twice: the layers are children of self
        self._tie_groups = self._make_tie_groups()
        self._synchronize_tied_weights()

    # ------------------------------------------------------------------ building
    def _build(self, index: int, spec: LayerSpec) -> nn.Module:
        seed_layers, seed_fn, base_seed = self._seed
        if not seed_layers:
            return spec.build()
        with torch.random.fork_rng(devices=[]):
            (seed_fn or torch.manual_seed)(base_seed + index)
            return spec.build()

    def _build_stage(self, stage: int, checkpointable_layers: list[str] | None) -> StageModule:
        start, stop = self.parts[stage], self.parts[stage + 1]
        funcs: list[Callable] = []
        modules: dict[str, nn.Module] = {}
        for index in range(start, stop):
            layer = self._layer_specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = self._build(index, layer)
                    self._tied_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                modules.setdefault(f"tied_modules_{layer.key}", module)
                funcs.append(functools.partial(layer.forward_fn, module) if layer.forward_fn is not None else module)
            elif isinstance(layer, LayerSpec):
                module = self._build(index, layer)
                self.add_module(str(index), module)
                modules[str(index)] = module
                funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                modules[str(index)] = layer
                funcs.append(layer)
            else:
                funcs.append(layer)
        names = [layer_type_name(layer) for layer in self._layer_specs[start:stop]]
        return StageModule(stage, start, funcs, modules, self._ac_interval, self._ac_func, names, checkpointable_layers)

    # ------------------------------------------------------------------ activation checkpointing
    @property
    def activation_checkpoint_interval(self) -> int:
        """Layers per checkpointed run (0: no checkpointing); settable, as DeepSpeed's attribute."""
        return self._ac_interval

    @activation_checkpoint_interval.setter
    def activation_checkpoint_interval(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0; got {interval!r}")
        self._ac_interval = interval
        self._precompute_checkpointable_values()

    @property
    def activation_checkpoint_func(self) -> Callable:
        """The function a checkpointed run goes through, ``func(run, *inputs)``; settable."""
        return self._ac_func

    @activation_checkpoint_func.setter
    def activation_checkpoint_func(self, func: Callable) -> None:
        if not callable(func):
            raise ValueError(f"PipelineModule: activation_checkpoint_func must be callable; got {func!r}")
        self._ac_func = func
        self._precompute_checkpointable_values()

    def set_checkpoint_interval(self, interval: int) -> None:
        """DeepSpeed's setter: checkpoint every ``interval`` layers from the next forward on."""
        self.activation_checkpoint_interval = interval

    def _precompute_checkpointable_values(self) -> None:
        """Recompute which runs of layers are checkpointed for the current interval (DeepSpeed's name)."""
        for stage in self.stage_modules:
            stage.set_checkpointing(self._ac_interval, self._ac_func)

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """Per run of ``activation_checkpoint_interval`` layers of this rank's stages (in order):
        whether it is checkpointed (empty when the interval is 0)."""
        return [result for stage in self.stage_modules for result in stage.is_checkpointable_results]

    # ------------------------------------------------------------------ tied weights
    def _tied_placement(self) -> dict[str, tuple[list[int], int]]:
        """{key: (sorted pipeline ranks holding it, the pipeline rank of its first occurrence)},
        the same on every rank (computed from the layer list and the partition)."""
        ranks: dict[str, set[int]] = {}
        first: dict[str, int] = {}
        for stage in range(self.total_stages):
            for layer in self._layer_specs[self.parts[stage]:self.parts[stage + 1]]:
                if isinstance(layer, TiedLayerSpec):
                    ranks.setdefault(layer.key, set()).add(stage % self.num_stages)
                    first.setdefault(layer.key, stage % self.num_stages)
        return {key: (sorted(ranks[key]), first[key]) for key in sorted(ranks)}

    def _make_tie_groups(self) -> dict[str, tuple[Any, int]]:
        """{key held here and on another pipeline rank: (process group, global rank of the copy
        that initializes the others)}.

        A key held by every pipeline rank uses the mesh's pp group. Otherwise a group is made for
        each pp group of the mesh (each (dp, tp) coordinate): creating a group is a collective
        over the whole job, so every rank creates all of them in the same order, having learned
        every pp group with one all_gather_object."""
        groups: dict[str, tuple[Any, int]] = {}
        if self.mesh is None or self.num_stages == 1:
            return groups
        shared = {k: v for k, v in self._tied_placement().items() if len(v[0]) > 1}
        if not shared:
            return groups
        from tachyon.parallel.distributed import new_group

        mine = tuple(self.mesh.ranks("pp"))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for key, (pp_ranks, src_pp) in shared.items():
            for pp_group in sorted({tuple(g) for g in every}):
                if len(pp_ranks) == self.num_stages:
                    group = self.mesh.group("pp") if pp_group == mine else None
                else:
                    group = new_group([pp_group[r] for r in pp_ranks])
                if pp_group == mine and self.pp_rank in pp_ranks:
                    groups[key] = (group, pp_group[src_pp])
        return groups

    def _tied_params(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        params = []
        for attr in self._tied_attrs[key]:
            value = module
            for part in attr.split("."):
                value = getattr(value, part)
            params.append(value)
        return params

    def _synchronize_tied_weights(self) -> None:
        for key, (group, src) in self._tie_groups.items():
            for param in self._tied_params(key):
                with torch.no_grad():
                    dist.broadcast(param.data, src=src, group=group)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the tied parameters' gradients over the pipeline ranks holding them (DeepSpeed's
        name); call after the backward of a batch, before the optimizer step."""
        for key, (group, _) in self._tie_groups.items():
            for param in self._tied_params(key):
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)

    def owns_tied(self, key: str) -> bool:
        """Whether this rank holds the copy of tied module ``key`` that counts: the one on the
        lowest pipeline rank holding it (the copy the others were initialized from). The other
        copies are equal to it, so a global gradient norm counts only this one and a checkpoint
        writes only this one."""
        if key not in self.tied_modules:
            return False
        entry = self._tie_groups.get(key)
        return entry is None or entry[1] == dist.get_rank()

    @property
    def tied_weight_keys(self) -> list[str]:
        """Keys whose module this rank shares with another pipeline rank."""
        return list(self._tie_groups)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's entries of a state dict covering every stage (keys as this module's:
        layer index, tied_modules.<key>). ValueError listing the keys this rank needs but
        ``state`` lacks; entries of other stages are ignored."""
        own = self.state_dict()
        missing = sorted(k for k in own if k not in state)
        if missing:
            raise ValueError(f"PipelineModule.load_full_state_dict: missing {len(missing)} keys of this rank's stages: "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        self.load_state_dict({k: state[k] for k in own})

    # ------------------------------------------------------------------ running
    @property
    def is_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last_stage(self) -> bool:
        return self.total_stages - 1 in self.stage_ids

    def ordered_layer_lists(self) -> list[list[Callable]]:
        """Each local stage's layers in run order (tensor parallelism finds its layer runs here)."""
        return [stage.ordered_layers() for stage in self.stage_modules]

    def stage_owner(self, layer_index: int) -> int:
        """The pipeline rank that runs layer ``layer_index``."""
        if not 0 <= layer_index < len(self._layer_specs):
            raise ValueError(f"stage_owner: layer_index={layer_index} outside [0, {len(self._layer_specs)})")
        stage = next(s for s in range(self.total_stages) if self.parts[s] <= layer_index < self.parts[s + 1])
        return stage % self.num_stages

    def forward(self, *inputs: Any) -> Any:
        """Run this rank's stage (several virtual stages: use a PipelineSchedule)."""
        if len(self.stage_modules) != 1:
            raise RuntimeError("PipelineModule.forward runs one stage; with stages_per_rank > 1 use PipelineSchedule")
        return self.stage_modules[0](*inputs)


def _check_args(layers: list, num_stages: object, loss_fn: object, partition_method: object, interval: object,
                stages_per_rank: object) -> None:
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(
            "PipelineModule needs loss_fn, a callable(outputs, labels) -> scalar loss: the last stage computes the loss "
            f"from the last layer's output and the batch's labels; got {loss_fn!r}"
        )
    if not layers:
        raise ValueError("PipelineModule: layers is empty")
    for i, layer in enumerate(layers):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise ValueError(f"PipelineModule: layers[{i}] is {type(layer).__name__}; allowed: LayerSpec, TiedLayerSpec, "
                             "nn.Module or a callable")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"PipelineModule: num_stages must be an int >= 1 or None; got {num_stages!r}")
    check_partition_method(partition_method)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0; got {interval!r}")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"PipelineModule: stages_per_rank must be an int >= 1; got {stages_per_rank!r}")


def _default_mesh(num_stages: int) -> Any:
    """DeepSpeed's default topology: all ranks, num_stages pipeline ranks, data parallel over the
    rest; none for a single stage (nothing distributed needed)."""
    if num_stages == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"PipelineModule: num_stages={num_stages} needs torch.distributed (call tachyon.init_distributed()) or a "
            "topology (tachyon.parallel.Mesh)"
        )
    from tachyon.parallel.mesh import Mesh

    return Mesh(pp=num_stages)


__all__ = ["PipelineModule", "StageModule"]
