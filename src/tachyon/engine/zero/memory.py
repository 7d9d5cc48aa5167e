"""Model-state bytes per rank: the analytic formulas, and a count of every live tensor storage.

With Psi trainable parameters, N data-parallel ranks, a model dtype of ``p`` bytes, a gradient
accumulator of ``g`` bytes, fp32 masters (4 bytes; none when the model itself is fp32 and the
master aliases it) and ``s`` bytes of optimizer state per element (Adam: 8), after the boundary
backward (the point where a step holds the most model state):

    stage 0:  p*Psi + g*Psi   + (4 + s)*Psi
    stage 1:  p*Psi + g*Psi/N + (4 + s)*Psi/N   (gas > 1, g == p: p*Psi of param.grad instead of
                                                 g*Psi/N between micro-steps, ZeRO's stage 1)
    stage 2:  p*Psi + g*Psi/N + (4 + s)*Psi/N
    stage 3:  4*Psi/N + 4*Psi/N + s*Psi/N        (fp32 shards = the masters, fp32 gradient shards:
                                                 the ZeRO paper's 16*Psi/N with Adam)

With ZeRO-Offload of the optimizer (stages 1-3) the fp32 masters, an fp32 gradient accumulator
and the optimizer states, (8 + s)*Psi/N, live in host memory (``offloaded``); the device keeps
the model-dtype weights: p*Psi at stages 1/2, its p*Psi/N shard at stage 3.

fp16 + Adam (g = 2) gives 16*Psi, 2*Psi + 14*Psi/N (ZeRO's 4*Psi + 12*Psi/N with gradient
accumulation) and 2*Psi + 14*Psi/N. bf16 accumulates in bf16 by default (DeepSpeed's default):
the same numbers; with fp32 accumulation (g = 4): 18*Psi, 2*Psi + 16*Psi/N, 2*Psi + 16*Psi/N.
During the optimizer step a non-fp32 accumulator is replaced by the fp32 master gradient (4
bytes per element of the master: 4*Psi at stage 0, 4*Psi/N at stages 1/2); after the step no
gradient is held. Padding (each param group is padded to a multiple of N * 8 elements) comes on
top; bucket buffers (at most two of min(reduce_bucket_size, largest bucket) elements, stages
1/2) exist only during a reducing backward.
"""

from __future__ import annotations

import gc

import torch


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_accum_bytes: int = 2,
    fp32_master: bool = True,
    optimizer_state_bytes: int = 8,
    gradient_accumulation_steps: int = 1,
    offload: bool = False,
) -> dict[str, float]:
    """Analytic bytes per rank after the boundary backward: parameters, gradients,
    master_weights, optimizer_states and their sum model_states (see the module docstring);
    with ``offload`` (ZeRO-Offload of the optimizer, stages 1-3) also ``offloaded``, the part in
    host memory."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3; got {stage!r}")
    if offload and stage == 0:
        raise ValueError("offload needs ZeRO stage 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size!r}")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1; got {gradient_accumulation_steps!r}")
    psi, n = float(num_params), float(world_size)
    shard = psi if stage == 0 else psi / n
    if offload:  # host: fp32 masters, the fp32 gradient accumulator, the optimizer states
        out = {"parameters": param_bytes * (shard if stage == 3 else psi), "gradients": 4 * shard,
               "master_weights": 4 * shard, "optimizer_states": optimizer_state_bytes * shard}
        out["model_states"] = sum(out.values())
        out["offloaded"] = (8 + optimizer_state_bytes) * shard
        return out
    if stage == 3:  # the fp32 shards are the masters; fp32 gradient shards
        out = {"parameters": 4 * shard, "gradients": 4 * shard, "master_weights": 0.0,
               "optimizer_states": optimizer_state_bytes * shard}
        out["model_states"] = sum(out.values())
        return out
    gradients = grad_accum_bytes * shard
    if stage == 1 and gradient_accumulation_steps > 1 and grad_accum_bytes <= param_bytes:
        gradients = max(gradients, param_bytes * psi)  # param.grad between the micro-steps
    out = {
        "parameters": param_bytes * psi,
        "gradients": gradients,
        "master_weights": 4 * shard if fp32_master else 0.0,
        "optimizer_states": optimizer_state_bytes * shard,
    }
    out["model_states"] = sum(out.values())
    return out


def live_tensor_bytes(device_type: str | None = None, *, collect: bool = True) -> int:
    """Bytes of every tensor storage alive in this process that Python can reach, each storage
    counted once (`live_tensor_storages`).

    This is what "memory per rank" means in the benchmarks: whatever a training library keeps,
    reachable from its engine or not, and whether or not it reports it.
    """
    return sum(live_tensor_storages(device_type, collect=collect).values())


def live_tensor_storages(device_type: str | None = None, *, collect: bool = True) -> dict[tuple[str, int], int]:
    """{(device type, storage data pointer): bytes} of every tensor storage alive in this
    process that Python can reach: every tensor object the garbage collector tracks (all
    torch.Tensor objects are tracked), plus the ``.grad`` of leaf tensors (autograd creates those
    without a Python object). Not seen: tensors only C++ holds (activations saved by a graph
    that has not run backward yet, buffers inside communication libraries). ``device_type``:
    only storages on that device type ("cpu", "cuda"); meta and sparse tensors are skipped.
    ``collect``: run the garbage collector first, so unreachable reference cycles do not count.
    """
    if collect:
        gc.collect()
    sizes: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): isinstance reads __class__, which some
            continue  # deprecated torch objects warn on
        for t in (obj, obj._grad if obj.is_leaf else None):
            if t is None or t.is_meta or t.is_sparse or (device_type is not None and t.device.type != device_type):
                continue
            try:
                storage = t.untyped_storage()
                address = storage.data_ptr() if storage.nbytes() else 0
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage, or a
                continue  # storage freed under its Python object (FSDP2's gathered parameters)
            if address:
                key = (t.device.type, address)
                sizes[key] = max(sizes.get(key, 0), storage.nbytes())
    return sizes
