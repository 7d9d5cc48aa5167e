"""Progressive layer drop at ZeRO stage 3 against stage 2, run inside the 2-rank launch of
tests/engine/test_pld_zero3.py (`scenarios`): the same model, data and keep draws at both
stages, 5 steps; the test compares the parameters and the layers each rank ran.

At stage 2 both ranks are seeded alike (each draws its own decisions from its own generator, the
same ones); at stage 3 rank r is seeded ``SEED + 10 r`` and the engine's shared generator state
(rank 0's) must make both ranks draw stage 2's decisions, leaving each rank's own generator alone.
After every stage-3 step the check here asserts that no unit is left gathered or with a pending
all-gather, that exactly the layers no micro-batch ran have no gradient shard at the boundary,
and that such a layer kept its weights and this rank's shards of its Adam moments bit for bit."""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, SEQ, MICRO, DEPTH, STEPS, SEED = 16, 4, 2, 3, 5, 4
PLD = {"enabled": True, "theta": 0.1, "gamma": 3.0}
CLIP = 0.5


class PLDStack(nn.Module):
    """``DEPTH`` pre-LN tachyon layers (stage-3 units) and a head (the root's).

    ``mode``: "layer" passes the PLD arguments to each layer (the layer is called and returns its
    input when dropped: FSDP2's hooks still run); "checkpoint" does the same with every layer under
    ``tachyon.checkpointing.checkpoint``; "skip" draws in the model and does not call a dropped
    layer at all (its FSDP2 hooks never run; the previous unit's forward prefetch of it is unused);
    "kernel" is "layer" with the BERT job's ``TransformerKernelLayer`` (pre-LN) instead.
    ``forwards`` records, per forward, which layers ran."""

    def __init__(self, mode: str = "layer", dtype: torch.dtype = torch.float32):
        super().__init__()
        from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer, TransformerLayer

        torch.manual_seed(0)
        self.mode = mode
        if mode == "kernel":  # the BERT job's layer (pre-LN), called with the PLD arguments; its packed
            # qkv bias holds the key bias, whose exact gradient is zero (below): the test leaves it out
            config = TransformerKernelConfig(batch_size=MICRO, max_seq_length=SEQ, hidden_size=HIDDEN,
                                             intermediate_size=2 * HIDDEN, heads=2, attn_dropout_ratio=0.0,
                                             hidden_dropout_ratio=0.0, num_hidden_layers=DEPTH,
                                             initializer_range=0.1, seed=1, bf16=dtype == torch.bfloat16,
                                             pre_layer_norm=True)
            self.layers = nn.ModuleList(TransformerKernelLayer(config) for _ in range(DEPTH))
            for number, layer in enumerate(self.layers, 1):
                layer.layer_number = number
        else:
            # bias=False: the key projection's bias has an exact gradient of zero (softmax ignores
            # it), so its computed gradient is rounding noise, which AdamW turns into full-size
            # steps that differ with the order of any sum: no tolerance could compare it
            self.layers = nn.ModuleList(
                TransformerLayer(HIDDEN, 2 * HIDDEN, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                 attn_input_format="bshd", layer_number=i, num_layers=DEPTH, params_dtype=dtype,
                                 bias=False)
                for i in range(1, DEPTH + 1)
            )
        self.head = nn.Linear(HIDDEN, 1, dtype=dtype)
        self.forwards: list[list[bool]] = []
        for layer in self.layers:  # a dropped layer returns its input itself
            layer.register_forward_hook(self._mark)

    def _mark(self, module, args, output) -> None:
        index = [id(layer) for layer in self.layers].index(id(module))
        self.forwards[-1][index] |= output is not args[0]

    def forward(self, x, progressive_layer_drop=False, pld_theta=None):
        import tachyon
        from tachyon.nn.transformer_layer import pld_draw_keep, pld_keep_probability

        self.forwards.append([False] * DEPTH)
        pld = {"progressive_layer_drop": progressive_layer_drop, "pld_theta": pld_theta}
        for layer in self.layers:
            if self.mode == "skip":
                keep = pld_keep_probability("PLDStack", progressive_layer_drop, pld_theta, layer.layer_number, DEPTH)
                if keep is not None and self.training and not pld_draw_keep(keep):
                    continue
                x = layer(x)
            elif self.mode == "checkpoint":
                x = tachyon.checkpointing.checkpoint(layer, x, **pld)
            else:
                x = layer(x, **pld)
        return self.head(x).float().squeeze(-1)


def _units_at_rest(engine) -> list[str]:
    """Stage-3 units holding gathered parameters or an all-gather nobody waited for (FSDP2's
    state; none may be left between steps)."""
    problems = []
    for unit in engine.zero.units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        if not group.is_sharded:
            problems.append(f"{type(unit).__name__} not sharded")
        if group._all_gather_result is not None:
            problems.append(f"{type(unit).__name__} has a pending all-gather")
    gathered = engine.memory_breakdown()["gathered"]
    return problems + ([f"{gathered} bytes gathered"] if gathered else [])


def _layer_states(engine, index: int) -> list[torch.Tensor]:
    """This rank's shards of layer ``index``'s masters and Adam moments (stage 3: one master per parameter)."""
    zero, out = engine.zero, []
    for slot in zero.flat.slots:
        if slot.name.startswith(f"layers.{index}."):
            master = zero.masters[zero.master_index(slot)]
            out.append(master.detach().clone())
            out += [v.clone() for v in engine.optimizer.state.get(master, {}).values()
                    if torch.is_tensor(v) and v.shape == master.shape]
    return out


def _whole(model) -> dict[str, torch.Tensor]:
    from tachyon.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _batch(step: int, micro: int, rank: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, SEQ, HIDDEN, generator=gen).to(dtype), torch.randn(MICRO, SEQ, generator=gen)


def _config(stage: int, gas: int, precision: str, offload: str | None) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if offload == "param":
            zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "gradient_clipping": CLIP, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "progressive_layer_drop": PLD}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _steps(engine, model, first: int, last: int, dtype: torch.dtype, stats: dict) -> None:
    """Train steps ``first..last-1``; at stage 3 check every step (module docstring)."""
    import torch.distributed as dist

    rank, gas = dist.get_rank(), engine.gradient_accumulation_steps()
    stage3 = engine.zero_optimization_stage() == 3
    for step in range(first, last):
        if stage3:
            before = _whole(model)
            states = [_layer_states(engine, i) for i in range(DEPTH)]
        start = len(model.forwards)
        for micro in range(gas):
            x, y = _batch(step, micro, rank, dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if stage3 and micro == gas - 1:  # a gradient shard exactly for the layers that ran in the window
                ran = [any(f[i] for f in model.forwards[start:]) for i in range(DEPTH)]
                has = dict(zip((s.name for s in engine.zero.flat.slots), engine.zero.slots_with_grad()))
                wrong = [n for n, g in has.items() if n.startswith("layers.") and g != ran[int(n.split(".")[1])]]
                assert not wrong, f"rank {rank} step {step}: gradient shards of {wrong} (layers ran: {ran})"
            engine.step()
        stats["norms"].append(engine.get_global_grad_norm())
        if not stage3:
            continue
        problems = _units_at_rest(engine)
        assert not problems, f"rank {rank} step {step}: {problems}"
        after = _whole(model)
        ran = [any(f[i] for f in model.forwards[start:]) for i in range(DEPTH)]
        for i in range(DEPTH):
            names = [n for n in after if n.startswith(f"layers.{i}.")]
            moved = any(not torch.equal(before[n], after[n]) for n in names)
            if ran[i]:
                stats["kept"] += 1
                assert moved, f"rank {rank} step {step}: layer {i + 1} ran but did not move"
            elif step > 0:  # from step 1 on the moments are nonzero: AdamW on a zero grad would move them
                stats["dropped"] += 1
                same = all(torch.equal(b, a) for b, a in zip(states[i], _layer_states(engine, i)))
                assert not moved and same, f"rank {rank} step {step}: layer {i + 1} ran nowhere but changed"


def train(stage: int, *, gas: int = 1, precision: str = "fp32", mode: str = "layer",
          offload: str | None = None) -> dict:
    """Five steps; returns the whole parameters, which layers ran in each forward, the stage-3
    check's counts, the global gradient norms and whether this rank's own generator was left alone."""
    import torch.distributed as dist

    import tachyon

    rank = dist.get_rank()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = PLDStack(mode, dtype)
    engine, *_ = tachyon.initialize(model=model, config=_config(stage, gas, precision, offload))
    torch.manual_seed(SEED + (10 * rank if stage == 3 else 0))  # stage 3: the ranks seeded apart
    own = torch.get_rng_state()
    stats = {"kept": 0, "dropped": 0, "norms": []}
    _steps(engine, model, 0, STEPS, dtype, stats)
    result = {"params": _whole(model), "forwards": model.forwards, **stats,
              "own_generator_untouched": torch.equal(own, torch.get_rng_state())}
    return result


def resume(root: str) -> dict:
    """Stage 3: 2 steps, a checkpoint (and one with a malformed shared state), 3 more; then a fresh
    engine tries the malformed one, loads the good one and trains the same 3 steps (each rank's
    generator reset to a different seed first: the shared state must come from the checkpoint)."""
    import torch.distributed as dist

    import tachyon

    rank = dist.get_rank()
    runs = {}
    for name in ("straight", "resumed"):
        model = PLDStack()
        engine, *_ = tachyon.initialize(model=model, config=_config(3, 2, "fp32", None))
        stats = {"kept": 0, "dropped": 0, "norms": []}
        if name == "straight":
            torch.manual_seed(SEED + 10 * rank)
            _steps(engine, model, 0, 2, torch.float32, stats)
            engine.save_checkpoint(root, tag="pld3")
            good, engine.pld_draws.state = engine.pld_draws.state, torch.zeros(3, dtype=torch.uint8)
            engine.save_checkpoint(root, tag="malformed", save_latest=False)  # a shared state of the wrong shape
            engine.pld_draws.state = good
            model.forwards.clear()
        else:
            try:
                engine.load_checkpoint(root, tag="malformed")
                refused = ""
            except Exception as error:  # noqa: BLE001 - the test reads the message
                refused = f"{type(error).__name__}: {error}"
            untouched = engine.global_steps == 0 and engine.pld_draws.state is None
            engine.load_checkpoint(root, tag="pld3")
            torch.manual_seed(99 + rank)
        _steps(engine, model, 2, STEPS, torch.float32, stats)
        runs[name] = {"params": _whole(model), "forwards": model.forwards, "global_steps": engine.global_steps}
        if name == "resumed":
            runs[name].update(refused=refused, untouched=untouched)
    return runs


CASES = {  # name: (arguments of both stages' runs, extra arguments of the stage-3 run)
    "fp32": ({}, {}),
    "fp32-gas2": ({"gas": 2}, {}),
    "bf16-gas2": ({"gas": 2, "precision": "bf16"}, {}),
    "checkpointing": ({"mode": "checkpoint"}, {}),
    "kernel-layer-gas2": ({"gas": 2, "mode": "kernel"}, {}),
    "skipped-calls-gas2": ({"gas": 2, "mode": "skip"}, {}),
    "offload-optimizer-gas2": ({"gas": 2}, {"offload": "optimizer"}),
    "offload-param-gas2": ({"gas": 2}, {"offload": "param"}),
}


def scenarios(root: str, names: list[str], with_resume: bool) -> dict:
    """The comparisons ``names`` of tests/engine/test_pld_zero3.py in one launch: {name: {stage:
    result}}, and "resume" with ``with_resume``."""
    torch.set_num_threads(1)
    out = {}
    for name in names:
        both, three = CASES[name]
        out[name] = {2: train(2, **both), 3: train(3, **both, **three)}
    if with_resume:
        out["resume"] = resume(root)
    return out
