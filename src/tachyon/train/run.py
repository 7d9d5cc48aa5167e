"""The training loop of ``tachyon train``: one process of the job (rank r of a torchrun group, or
the only process).

    result = train(load_train_config("examples/train_ci.json"), output_dir=Path("runs/ci"), resume=False)

What it does, in order: pick the precision and threads, seed, build the datasets (the embedded
corpus and the shipped tokenizer, no downloads) and the model, ``tachyon.initialize`` the engine
(torch.distributed starts there under torchrun), optionally load the latest checkpoint, then
train until the engine's ``global_steps`` reaches ``config.steps``:

- output on rank 0, by ``output``: "bar" (a tqdm bar on stderr with loss, validation loss and
  tokens/s; the step and validation lines are written above it with ``tqdm.write``, never
  through it; without a terminal there is no bar, only the lines), "lines" (the lines, no bar) or
  "quiet" (nothing until the one-line result). The step lines (every ``steps_per_print`` steps:
  loss averaged over the data-parallel ranks, lr, grad norm, loss scale, skipped steps,
  samples/s, tokens/s, step time), the ``tensorboard`` / ``csv_monitor`` events and the
  ``wall_clock_breakdown`` lines are the engine's own (`tachyon.engine.telemetry`); this loop
  tells it the tokens per sample, routes its lines and reads ``engine.telemetry.last_step``.
- every step, a row of metrics: the loss (mean over the data-parallel ranks), lr, grad norm,
  loss scale, throughput, the step's wall time (the engine's, evaluations and checkpoints
  excluded) and CPU time (``cpu_s``: process time of every rank in the step, summed; on a shared
  machine the steadier measure of the work done), and with progressive layer drop on the keep
  ratio ``pld_theta`` the step's forwards used (``engine.get_pld_theta()`` before its first).
- every ``eval_interval`` steps and at the last step: the validation loss and top-1 accuracy
  (:mod:`tachyon.train.evaluate`; every rank scores its share, the sums are all-reduced).
- every ``checkpoint_interval`` steps and at the end, ``engine.save_checkpoint(output_dir /
  "checkpoints", tag="global_step<N>", client_state={"epoch", "batches_in_epoch"})``, the data
  position, so ``--resume`` continues with the next unseen micro-batch.
- at the end, rank 0 writes ``metrics.csv`` and ``validation.csv`` (appended to on resume),
  ``loss.png`` (the whole run) and ``summary.txt`` (the job, validation loss vs the unigram
  baseline, fill-mask predictions or generated lines, memory per rank), and prints the table
  and the summary; then ``engine.destroy()``.
"""

from __future__ import annotations

import contextlib

import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import tachyon
from tachyon.config import load_config
from tachyon.data import build_lm_datasets, collate, load_works
from tachyon.train.config import TrainConfig
from tachyon.train.evaluate import (
    Evaluation, evaluate, evaluate_pipeline, evaluation_indices, fill_mask_examples, generate_lines, unigram_baseline, unigram_log_probs,
)
from tachyon.train.helpers import (
    Checkpointer, epoch_loader, mean_over_ranks, memory_per_rank, or_nan, rank_and_world, rank_seed,
    native_bf16, reseed_kernel_dropout, set_threads,
)
from tachyon.train.models import GPT, BertMLM, count_parameters
from tachyon.train.plot import plot_training
from tachyon.engine.preemption import Preempted
from tachyon.train.report import METRIC_COLUMNS, RunLog, final_table, read_metrics, summary_text
from tachyon.train.resume import checkpoint_position, default_preemption, finished_note, schedule_note

__all__ = ["OUTPUT_MODES", "TrainResult", "build_model", "pipeline_model", "read_metrics", "train", "whole_model"]

OUTPUT_MODES = ("bar", "lines", "quiet")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What one process saw: the steps it ran (``first_step``..``last_step``), the per-step
    metrics rows (rank 0 only; other ranks get an empty list), the last validation result and
    the unigram baseline on the same targets."""

    first_step: int
    last_step: int
    rows: list[dict[str, float]] = field(default_factory=list)
    validation: Evaluation | None = None
    baseline: Evaluation | None = None
    checkpoints: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the run said about itself at the start (resume, schedule changes)."""

    @property
    def validation_loss(self) -> float | None:
        return None if self.validation is None else self.validation.loss


def build_model(config: TrainConfig, vocab_size: int, dtype: torch.dtype, max_batch_size: int,
                dropout_seed: int | None = None, output_bias: torch.Tensor | None = None) -> torch.nn.Module:
    """The model ``config`` names, with parameters in ``dtype`` (the training precision);
    ``dropout_seed`` seeds the fused BERT layers' dropout (default: ``config.seed``);
    ``output_bias``: BERT's initial LM-head bias (see :class:`BertMLM`)."""
    common = dict(vocab_size=vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                  num_heads=config.num_heads, intermediate_size=config.intermediate_size,
                  max_seq_len=config.seq_len, hidden_dropout=config.hidden_dropout,
                  attention_dropout=config.attention_dropout, tie_embeddings=config.tie_embeddings, dtype=dtype)
    if config.model == "bert":
        seed = config.seed if dropout_seed is None else dropout_seed
        return BertMLM(**common, max_batch_size=max_batch_size, seed=seed, kernel_flags=config.kernel_flags,
                       output_bias=output_bias)
    return GPT(**common, position=config.position)


class _CpuClock:
    """This process's CPU seconds (user + system, every thread) since the last lap or restart."""

    def __init__(self) -> None:
        self.mark = time.process_time()

    def restart(self) -> None:
        self.mark = time.process_time()

    def lap(self) -> float:
        now = time.process_time()
        elapsed, self.mark = now - self.mark, now
        return elapsed


class _Console:
    """Rank 0's output: the bar (or none) and the lines, by output mode (module docstring)."""

    def __init__(self, mode: str, rank: int, total: int, initial: int) -> None:
        if mode not in OUTPUT_MODES:
            raise ValueError(f"output must be one of {OUTPUT_MODES}; got {mode!r}")
        self.bar = None
        self.lines = rank == 0 and mode != "quiet"
        if rank == 0 and mode == "bar":
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (a log gets the lines alone)
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, disable=None, leave=False)
            if self.bar.disable:
                self.bar = None

    def write(self, line: str) -> None:
        if not self.lines:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)  # above the bar, which is redrawn below it
        else:
            print(line, flush=True)

    def update(self, loss: float, tokens_per_s: float, validation: float | None) -> None:
        if self.bar is None:
            return
        postfix = {"loss": f"{loss:.3f}"}
        if validation is not None:
            postfix["val"] = f"{validation:.3f}"
        if math.isfinite(tokens_per_s):
            postfix["tok/s"] = f"{tokens_per_s:,.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def train(config: TrainConfig, output_dir: str | Path, *, resume: bool = False, output: str = "bar",
          reschedule: bool = False) -> TrainResult:
    """Run (or continue, with ``resume``) the training job ``config`` describes in this process.

    Under torchrun every rank calls this; torch.distributed is started by ``tachyon.initialize``.
    Files go to ``output_dir`` (created): checkpoints/, metrics.csv, validation.csv, loss.png,
    summary.txt. ``output``: "bar", "lines" or "quiet" (module docstring). ``reschedule``: at a
    resume with another ``steps``, stretch the lr schedule over them (`tachyon.train.resume`).
    Returns this process's :class:`TrainResult`; raises `tachyon.engine.preemption.Preempted`
    (exit code 75) after saving when a preemption signal stopped the run."""
    output_dir = Path(output_dir)
    started = time.perf_counter()
    rank, world = rank_and_world()
    set_threads(config.threads_per_process, world)
    precision = config.training_precision(native_bf16())
    engine_config = default_preemption(config.engine_config(precision), output_dir)
    # checked (and the micro-batch resolved) before any work: a bad engine section fails fast
    checked = load_config(engine_config, world)
    micro_batch = checked.train_micro_batch_size_per_gpu
    pld = checked.progressive_layer_drop if checked.progressive_layer_drop.enabled else None  # theta, gamma
    tp, pp = checked.tensor_parallel.size, checked.pipeline.num_stages or 1

    torch.manual_seed(config.seed)  # the same initial weights on every rank
    train_set, val_set = build_lm_datasets(config.objective, config.seq_len, seed=config.seed,
                                           mask_prob=config.mask_prob, tokenizer=config.tokenizer)
    tokenizer = train_set.tokenizer
    prior = unigram_log_probs(train_set.tokens, tokenizer.vocab_size)
    model = build_model(config, tokenizer.vocab_size, _DTYPES[precision], micro_batch,
                        dropout_seed=rank_seed(config.seed, rank), output_bias=prior)
    n_params = count_parameters(model)
    if pp > 1:  # the same GPT, cut into stages (its weights loaded, so every layout starts alike)
        model = pipeline_model(config, checked.pipeline, model, tokenizer.vocab_size, _DTYPES[precision], tp)
    engine, _, dataloader, _ = tachyon.initialize(
        model=model, model_parameters=model.parameters(), training_data=train_set, collate_fn=collate,
        config=engine_config,
    )
    if engine.zero_optimization_stage() == 3:  # evaluation calls these, not forward: they gather too
        for method in ("logits", "logits_at"):
            if hasattr(model, method):
                tachyon.zero.register_forward_method(model, method)
    rank, world = rank_and_world()
    dp, dp_rank = engine.data_parallel_world_size, engine.data_parallel_rank
    # per data-parallel copy: the TE-style layers' dropout and the layer-drop draws. The ranks of
    # one copy (tensor / pipeline parallel) draw alike, or they would drop different layers
    # (tensor-parallel regions get their own dropout seeds from tachyon.parallel.tensor.rng)
    torch.manual_seed(rank_seed(config.seed, dp_rank))
    device = engine.device
    sampler = dataloader.sampler  # a DistributedSampler over the data-parallel ranks
    # a pipeline evaluates a step's micro-batches per call: eval_batches counts those (--pp divides
    # the job's micro-batch into the pipeline's, so the evaluated samples stay the same)
    eval_batch = micro_batch * engine.gradient_accumulation_steps() if pp > 1 else micro_batch
    indices = evaluation_indices(len(val_set), config.eval_batches, eval_batch, dp)
    baseline = unigram_baseline(prior, val_set, indices)
    layout = "" if engine.mesh is None else f" (data parallel {dp} x pipeline {pp} x tensor parallel {tp})"

    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(engine, output_dir / "checkpoints")
    epoch, batches_in_epoch = 0, 0
    notes = []
    if resume:
        state = checkpointer.load()
        if state is None:
            notes.append(f"--resume: no checkpoint in {checkpointer.directory}; starting from step 0")
        else:
            epoch, batches_in_epoch = int(state.get("epoch", 0)), int(state.get("batches_in_epoch", 0))
            reseed_kernel_dropout(model, rank_seed(config.seed, rank))
            notes.append(f"resumed from step {engine.global_steps} (epoch {epoch}, micro-batch {batches_in_epoch})")
            notes += [n for n in (schedule_note(engine, state, config.steps, reschedule),) if n]
            finished = finished_note(engine, config.steps, output_dir)
            if finished is not None:  # a finished run stays as it is
                if rank == 0:
                    print(f"tachyon train: {finished}", flush=True)
                engine.destroy()
                return TrainResult(engine.global_steps + 1, engine.global_steps, notes=[finished])
    first_step = engine.global_steps + 1
    console = _Console(output, rank, config.steps, engine.global_steps)
    for note in notes:
        console.write(f"tachyon train: {note}")
    console.write(f"tachyon train: {config.model}, {n_params / 1e6:.2f} M parameters, {world} process(es){layout} on "
                  f"{device.type}, {precision}, ZeRO stage {engine.zero_optimization_stage()}, global batch "
                  f"{engine.train_batch_size()} x {config.seq_len} tokens, {tokenizer.name} tokenizer "
                  f"({tokenizer.vocab_size} ids), steps {first_step}-{config.steps}, output {output_dir}")
    console.write(f"unigram baseline on the validation targets: {baseline.loss:.3f} nats/token "
                  f"(perplexity {baseline.perplexity:.1f})")

    fp8 = fp8_autocast(config.fp8)
    if config.fp8 is not None:
        from tachyon.fp8 import gemm_paths

        console.write(f"FP8: the TransformerLayers' GEMMs under {type(fp8().recipe).__name__} "
                      f"({gemm_paths(device)[config.fp8][1]})")
    if pld is not None:
        console.write(f"progressive layer drop: keep ratio theta(t) = {1 - pld.theta:g} * exp(-{pld.gamma:g} t) + "
                      f"{pld.theta:g}; layer l of {config.num_layers} runs with probability 1 - l/{config.num_layers}"
                      " * (1 - theta(t)) in training, every layer in evaluation")
    columns = METRIC_COLUMNS + (("pld_theta",) if pld is not None else ())
    telemetry = engine.telemetry  # the engine prints the step lines and writes the monitor events
    telemetry.set_tokens_per_sample(config.seq_len)
    telemetry.printer = console.write
    rows: list[dict[str, float]] = []
    evaluations: list[dict[str, float]] = []
    latest: Evaluation | None = None
    log = RunLog(output_dir, first_step, columns) if rank == 0 else None  # rows written as they come

    def position() -> dict[str, Any]:
        return checkpoint_position(engine, epoch, batches_in_epoch, config.steps)

    engine.preemption.client_state = position  # a save on SIGTERM / SIGUSR1 keeps the data position

    def run_evaluation(step: int) -> None:
        nonlocal latest
        if pp > 1:
            latest = evaluate_pipeline(engine, val_set, indices, micro_batch)
        else:
            with fp8():
                latest = evaluate(engine.module, val_set, indices, micro_batch, device, dp_rank, dp,
                                  group=None if engine.mesh is None else engine.data_parallel_group)
        evaluations.append({"step": step, "loss": latest.loss, "accuracy": latest.accuracy,
                            "baseline_loss": baseline.loss, "baseline_accuracy": baseline.accuracy})
        if log is not None:
            log.validation.append(evaluations[-1])
        console.write(f"validation at step {step}: {latest.loss:.3f} nats/token (perplexity {latest.perplexity:.1f}), "
                      f"unigram baseline {baseline.loss:.3f} ({baseline.perplexity:.1f})")
        telemetry.restart_window()  # the evaluation is not the next step's time
        cpu.restart()

    engine.train()
    telemetry.restart_window()  # step 1's time starts at its first forward
    cpu = _CpuClock()
    theta = None
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # a pipeline step's micro-batches so far
    preempted: Preempted | None = None
    while engine.global_steps < config.steps and preempted is None:
        for batch in epoch_loader(train_set, sampler, epoch, batches_in_epoch, micro_batch):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batches_in_epoch += 1
            try:  # Preempted: the step completed and was saved; its row is still written below
                if pp > 1:  # the schedule runs the step's micro-batches itself: one call per step
                    pending.append((batch["input_ids"], batch["labels"]))
                    if len(pending) < engine.gradient_accumulation_steps():
                        continue
                    engine.train_batch(iter(pending))
                    pending = []
                else:
                    if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                        theta = engine.get_pld_theta()  # what this step's forwards get (the engine passes it)
                    with fp8():
                        loss = engine(**batch)
                    engine.backward(loss)
                    boundary = engine.is_gradient_accumulation_boundary()
                    engine.step()
                    if not boundary:
                        continue
            except Preempted as stop:
                preempted = stop
            stats = telemetry.last_step
            step = stats.step
            # one all-reduce: the loss (metrics.csv wants every step's, the engine averages it on print
            # steps only; its value is kept there) and the step's CPU seconds of every rank
            loss_mean, cpu_mean = mean_over_ranks([stats.loss.item(), cpu.lap()], device)
            loss_value = loss_mean if stats.global_loss is None else stats.global_loss
            lrs = engine.get_lr()
            rows.append({"step": step, "loss": loss_value, "lr": float(lrs[0]) if lrs else 0.0,
                         "grad_norm": or_nan(engine.get_global_grad_norm()), "loss_scale": engine.loss_scale,
                         "samples_per_s": or_nan(stats.samples_per_s), "tokens_per_s": or_nan(stats.tokens_per_s),
                         "step_time_s": stats.step_time_s, "cpu_s": cpu_mean * world})
            if pld is not None:
                rows[-1]["pld_theta"] = theta
            if log is not None:
                log.metrics.append(rows[-1])
            if preempted is not None:
                break
            if step >= config.steps or (config.eval_interval and step % config.eval_interval == 0):
                run_evaluation(step)
            console.update(loss_value, or_nan(stats.tokens_per_s), None if latest is None else latest.loss)
            if step >= config.steps or (config.checkpoint_interval and step % config.checkpoint_interval == 0):
                checkpointer.save(step, position())
                telemetry.restart_window()  # the save is not the next step's time
                cpu.restart()
            if step >= config.steps:
                break
        else:  # the epoch ran out
            epoch, batches_in_epoch = epoch + 1, 0
            continue
        break
    console.close()
    if preempted is not None:  # saved by the engine; metrics.csv and validation.csv hold every step so far
        engine.destroy()
        raise preempted
    last_step = engine.global_steps
    if last_step >= first_step:
        checkpointer.save(last_step, position())
    if latest is None:  # nothing new trained (a resume at the end): still report the model
        run_evaluation(last_step)
    memory = memory_per_rank(engine, device)
    result = TrainResult(first_step, last_step, rows if rank == 0 else [], latest, baseline, checkpointer.saved)
    split = engine.mesh is not None or engine.zero_optimization_stage() == 3  # no rank holds the whole model
    whole = whole_model(engine, config, tokenizer.vocab_size, precision, pp) if split else engine.module
    result.notes = notes
    if rank == 0:
        _finish(config, engine, tokenizer, val_set, result, log, memory, precision, world, n_params,
                time.perf_counter() - started, output_dir, output, pld, whole, layout)
    engine.destroy()  # closes the monitor files and the engine's data-parallel group
    return result


def fp8_autocast(name: str | None):
    """A factory of the context each forward runs in: tachyon.autocast under TrainConfig.fp8's
    recipe (delayed scaling's amaxes all-reduced over every process), or none without FP8."""
    if name is None:
        return contextlib.nullcontext
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    recipe = {"delayed": DelayedScaling(amax_history_len=16, amax_compute_algo="max"),
              "current": Float8CurrentScaling(), "block": Float8BlockScaling()}[name]
    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    return lambda: tachyon.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)


def pipeline_model(config: TrainConfig, section: Any, gpt: torch.nn.Module, vocab_size: int, dtype: torch.dtype,
                   tp: int) -> torch.nn.Module:
    """``gpt`` (a tachyon.train.models.GPT) as a PipelineModule of ``section.num_stages`` stages
    (the engine config's pipeline section: partition, seed_layers, activation_checkpoint_interval),
    over a (pp, tp) mesh when ``tp`` > 1, holding ``gpt``'s weights. Starts torch.distributed
    (the stages need their process group before `tachyon.initialize`)."""
    from tachyon.parallel import Mesh
    from tachyon.parallel.distributed import init_distributed
    from tachyon.parallel.pipeline import PipelineModule
    from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss, gpt_state_dict_to_pipeline

    init_distributed()
    specs = gpt_layer_specs(vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                            num_heads=config.num_heads, intermediate_size=config.intermediate_size,
                            max_seq_len=config.seq_len, hidden_dropout=config.hidden_dropout,
                            attention_dropout=config.attention_dropout, position=config.position,
                            tie_embeddings=config.tie_embeddings, dtype=dtype)
    net = PipelineModule(specs, num_stages=section.num_stages, topology=Mesh(pp=section.num_stages, tp=tp) if tp > 1 else None,
                         loss_fn=gpt_loss, partition_method=section.partition, seed_layers=section.seed_layers,
                         activation_checkpoint_interval=section.activation_checkpoint_interval)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(gpt.state_dict(), config.num_layers))
    return net


def whole_model(engine: Any, config: TrainConfig, vocab_size: int, precision: str, pp: int) -> torch.nn.Module | None:
    """The trained model gathered whole on rank 0 (with every tensor-parallel shard, pipeline
    stage or ZeRO stage-3 shard), for the generated lines of summary.txt; None on the other ranks. Collective."""
    from tachyon.engine.checkpoint.export import consolidated_state_dict
    from tachyon.parallel.pipeline.gpt import pipeline_state_dict_to_gpt

    state = consolidated_state_dict(engine)
    if state is None:
        return None
    if pp > 1:
        state = pipeline_state_dict_to_gpt(state, config.num_layers, learned=config.position == "learned")
    model = build_model(config, vocab_size, _DTYPES[precision], engine.train_micro_batch_size_per_gpu())
    # the gathered state holds tensors only: the layers' _extra_state (FP8 metadata, unused here) stays as built
    missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = [k for k in missing if not k.endswith("._extra_state")] + list(unexpected)
    if wrong:
        raise RuntimeError(f"the gathered model's weights do not fit the GPT: {', '.join(wrong[:5])}")
    return model.to(engine.device)


def _numerics(device: torch.device) -> str:
    """What a run's numbers depend on beyond the code and the config: the torch build and, on CPU,
    the vector ISA torch's kernels use and the intra-op threads (they change the order of
    floating-point sums; the machine's load does not: docs/reliability.md)."""
    if device.type != "cpu":
        return f"numerics: torch {torch.__version__}, {torch.cuda.get_device_name(device)}"
    return (f"numerics: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} intra-op thread(s) per process")


def _samples(config: TrainConfig, model: Any, tokenizer: Any, val_set: Any, device: torch.device) -> list[str]:
    """The fill-mask predictions (BERT) or generated lines (GPT) for summary.txt."""
    if config.examples == 0:
        return []
    if config.model == "bert":
        lines = ["fill-mask on held-out lines (validation split; the masked word as ____, the model's top 3):"]
        for example in fill_mask_examples(model, tokenizer, val_set.tokens, config.seq_len, config.examples, device):
            top = ", ".join(f"{word} {p:.2f}" for word, p in example["top"])
            mark = "hit" if example["top"][0][0] == example["answer"] else "miss"
            lines.append(f"  {example['line']}")
            lines.append(f"      answer: {example['answer']:<12} model: {top}   ({mark})")
        return lines
    prompts = _speaker_prompts(config.examples)
    lines = ["generated (the prompt is a speaker's name from the validation split, then 48 sampled tokens, "
             "temperature 0.8, top-k 40):"]
    for text in generate_lines(model, tokenizer, prompts, seed=config.seed, device=device):
        lines += [f"  | {line}" for line in text.strip("\n").splitlines()] + ["  ---"]
    return lines[:-1]


def _speaker_prompts(count: int) -> list[str]:
    """``count`` prompts from the validation text: the k-th speaker heading ("BRUTUS.") found at or
    after (k + 0.5) / count of the split, followed by its line break."""
    text = "\n\n".join(load_works("validation"))
    prompts = []
    for k in range(count):
        match = re.compile(r"\n\n([A-Z][A-Z ]+\.)\n").search(text, int((k + 0.5) / count * len(text)))
        if match:
            prompts.append(match.group(1) + "\n")
    return prompts


def _finish(config: TrainConfig, engine: Any, tokenizer: Any, val_set: Any, result: TrainResult, log: RunLog,
            memory: list[dict[str, float]], precision: str, world: int, n_params: int, wall_s: float, output_dir: Path,
            output: str, pld: Any = None, model: Any = None, layout: str = "") -> None:
    """Rank 0's end of the run: loss.png and summary.txt from the whole metrics.csv and
    validation.csv (``log``: written as the run went), and the table and summary printed.
    ``pld``: the engine config's progressive_layer_drop section when it is on; ``model``: the
    whole trained model for the samples (default: ``engine.module``); ``layout``: the parallel
    layout's words for the job line."""
    model = engine.module if model is None else model
    rows = result.rows
    metrics, validation = log.metrics.table(), log.validation.table()
    if metrics:
        plot_training(output_dir / "loss.png", metrics, validation=[(int(v["step"]), v["loss"]) for v in validation],
                      baseline=result.baseline.loss,
                      title=f"{config.model}, {config.num_layers} x {config.hidden_size}, {tokenizer.name} tokenizer, "
                            f"{world} x {engine.device.type}, {precision}")
    timed = [r for r in rows if r["step"] > result.first_step]  # a process's first step includes warm-up
    step_time = sum(r["step_time_s"] for r in timed) / len(timed) if timed else math.nan
    job = [
        f"tachyon train: {config.model} ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads, {n_params / 1e6:.2f} M parameters), {tokenizer.name} tokenizer "
        f"({tokenizer.vocab_size} ids), seq_len {config.seq_len}",
        f"job: {world} process(es){layout} on {engine.device.type}, {precision}"
        f"{f', FP8 {config.fp8} scaling' if config.fp8 else ''}, ZeRO stage "
        f"{engine.zero_optimization_stage()}, global batch {engine.train_batch_size()} "
        f"(micro-batch {engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} "
        f"accumulation x {engine.data_parallel_world_size} data-parallel ranks)",
        _numerics(engine.device),
        f"steps: {result.last_step} of {config.steps} (this run: "
        + (f"{result.first_step}-{result.last_step}" if result.last_step >= result.first_step else "no new steps")
        + f"), wall time {wall_s:.1f} s",
    ]
    if timed:
        tokens_per_s = engine.train_batch_size() * config.seq_len / step_time
        job.append(f"throughput: {tokens_per_s:,.0f} tokens/s, {step_time * 1e3:.0f} ms/step (mean over this "
                   f"run's steps after its first, evaluations and checkpoints excluded)")
    if metrics:
        window = max(1, min(10, len(metrics) // 4))
        first = sum(r["loss"] for r in metrics[:window]) / window
        last = sum(r["loss"] for r in metrics[-window:]) / window
        job.append(f"training loss: {first:.3f} (mean of the first {window} steps) -> {last:.3f} (last {window})")
    thetas = [(int(r["step"]), r["pld_theta"]) for r in metrics if math.isfinite(r.get("pld_theta", math.nan))]
    if pld is not None and thetas:
        job.append(f"progressive layer drop: theta {pld.theta:g}, gamma {pld.gamma:g}; keep ratio {thetas[0][1]:.3f} "
                   f"at step {thetas[0][0]} -> {thetas[-1][1]:.3f} at step {thetas[-1][0]} (layer l of "
                   f"{config.num_layers} runs with probability 1 - l/{config.num_layers} * (1 - keep ratio))")
    job.append(f"skipped steps (fp16 overflow or a non-finite gradient): {int(getattr(engine, 'skipped_steps', 0))}")
    job += [f"note: {note}" for note in result.notes]
    checked = {"model": result.validation, "baseline": result.baseline,
               "what": "every scored token replaced by [MASK]" if config.model == "bert" else "next-token prediction"}
    saved = ", ".join(result.checkpoints) or "nothing new"
    files = [f"checkpoints: {output_dir / 'checkpoints'} (this run saved {saved})",
             f"files: {output_dir / 'metrics.csv'}, {output_dir / 'validation.csv'}, {output_dir / 'loss.png'}, "
             f"{output_dir / 'summary.txt'}"]
    summary = summary_text({"lines": job}, checked, _samples(config, model, tokenizer, val_set, engine.device),
                           memory, files)
    (output_dir / "summary.txt").write_text(summary)
    if output == "quiet":
        model, baseline = result.validation, result.baseline
        print(f"tachyon train: validation loss {model.loss:.3f} nats/token (perplexity {model.perplexity:.1f}), "
              f"unigram baseline {baseline.loss:.3f} ({baseline.perplexity:.1f}); {output_dir / 'summary.txt'}",
              flush=True)
        return
    print("\n" + final_table(metrics, validation) + "\n" + summary, end="", flush=True)
