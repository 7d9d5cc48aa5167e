"""The training loop of ``tachyon train``: one process of the job (rank r of a torchrun group, or
the only process).

    result = train(load_train_config("examples/train_ci.json"), output_dir=Path("runs/ci"), resume=False)

What it does, in order: pick the precision and threads, seed, build the datasets (the embedded
corpus, no downloads) and the model, ``tachyon.initialize`` the engine (torch.distributed starts
there under torchrun), optionally load the latest checkpoint, then train until the engine's
``global_steps`` reaches ``config.steps``:

- rank 0 shows a tqdm bar (stderr, at most one refresh per second, every 30 s when stderr is not
  a terminal). The step lines (every ``steps_per_print`` steps: loss averaged over the
  data-parallel ranks, lr, grad norm, loss scale, skipped steps, samples/s, tokens/s, step
  time), the ``tensorboard`` / ``csv_monitor`` events and the ``wall_clock_breakdown`` lines are
  the engine's own (`tachyon.engine.telemetry`); this loop only tells it the tokens per sample,
  routes its lines through the bar, and reads ``engine.telemetry.last_step`` for metrics.csv.
- every ``checkpoint_interval`` steps and at the end, ``engine.save_checkpoint(output_dir /
  "checkpoints", tag="global_step<N>", client_state={"epoch", "batches_in_epoch"})``, the data
  position, so ``--resume`` continues with the next unseen micro-batch.
- at the end: the validation loss over ``eval_batches`` micro-batches per rank, then rank 0
  writes ``metrics.csv`` (appended to on resume), ``loss.png`` (the whole run, earlier
  segments included) and ``summary.txt`` (final loss, tokens/s, memory per rank).
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import tachyon
from tachyon.config import load_config
from tachyon.data import build_lm_datasets, collate
from tachyon.train.config import TrainConfig
from tachyon.train.models import GPT, BertMLM, count_parameters
from tachyon.train.plot import plot_training

__all__ = ["METRIC_COLUMNS", "TrainResult", "build_model", "read_metrics", "train"]

METRIC_COLUMNS = ("step", "loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "tokens_per_s", "step_time_s")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What one process saw: the steps it ran (``first_step``..``last_step``), the per-step
    metrics rows (rank 0 only; other ranks get an empty list) and the validation loss."""

    first_step: int
    last_step: int
    rows: list[dict[str, float]] = field(default_factory=list)
    validation_loss: float | None = None
    checkpoints: list[str] = field(default_factory=list)


def _rank_seed(seed: int, rank: int) -> int:
    """Each rank's dropout seed: ranks see different data, so they draw different masks."""
    return (seed * 1_000_003 + rank) % 2**62


def _reseed_kernel_dropout(model: torch.nn.Module, seed: int) -> None:
    """Give the fused BERT layers this rank's dropout seed again after a checkpoint load (the
    checkpoint holds one rank's seeds); their forward counters stay as loaded."""
    for module in model.modules():
        if hasattr(module, "dropout_seed") and hasattr(module, "dropout_calls"):
            module.dropout_seed = seed


def build_model(config: TrainConfig, vocab_size: int, dtype: torch.dtype, max_batch_size: int,
                dropout_seed: int | None = None) -> torch.nn.Module:
    """The model ``config`` names, with parameters in ``dtype`` (the training precision);
    ``dropout_seed`` seeds the fused BERT layers' dropout (default: ``config.seed``)."""
    common = dict(vocab_size=vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                  num_heads=config.num_heads, intermediate_size=config.intermediate_size,
                  max_seq_len=config.seq_len, hidden_dropout=config.hidden_dropout,
                  attention_dropout=config.attention_dropout, tie_embeddings=config.tie_embeddings, dtype=dtype)
    if config.model == "bert":
        seed = config.seed if dropout_seed is None else dropout_seed
        return BertMLM(**common, max_batch_size=max_batch_size, seed=seed, kernel_flags=config.kernel_flags)
    return GPT(**common, position=config.position)


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv as dicts of floats (``step`` as int)."""
    with Path(path).open(newline="") as handle:
        return [{k: (int(v) if k == "step" else float(v)) for k, v in row.items()} for row in csv.DictReader(handle)]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise mean of ``values`` over the data-parallel ranks (the values themselves alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def _set_threads(config: TrainConfig, world: int) -> None:
    if torch.cuda.is_available():
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = config.threads_per_process or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)


def _epoch_loader(dataset: Any, sampler: Any, epoch: int, skip_batches: int, micro_batch: int) -> DataLoader:
    """This rank's micro-batches of ``epoch``, starting after the first ``skip_batches``."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)  # fresh masked-LM masks per epoch
    indices = list(sampler)[skip_batches * micro_batch:]
    return DataLoader(dataset, batch_size=micro_batch, sampler=indices, collate_fn=collate)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


class _Checkpointer:
    """engine.save_checkpoint / load_checkpoint into ``directory``, each tag saved once."""

    def __init__(self, engine: Any, directory: Path) -> None:
        self.engine, self.directory = engine, directory
        self.saved: list[str] = []

    def save(self, step: int, client_state: dict[str, Any]) -> None:
        tag = f"global_step{step}"
        if tag in self.saved:
            return
        self.engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state)
        self.saved.append(tag)

    def load(self) -> dict[str, Any] | None:
        """The client state of the latest checkpoint, or None when there is none to load."""
        if not self.directory.is_dir():
            return None
        path, client_state = self.engine.load_checkpoint(str(self.directory))
        if path is None:
            return None
        return dict(client_state or {})


def train(config: TrainConfig, output_dir: str | Path, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or continue, with ``resume``) the training job ``config`` describes in this process.

    Under torchrun every rank calls this; torch.distributed is started by ``tachyon.initialize``.
    Files go to ``output_dir`` (created): checkpoints/, metrics.csv, loss.png, summary.txt.
    Returns this process's :class:`TrainResult`."""
    output_dir = Path(output_dir)
    started = time.perf_counter()
    rank, world = _rank_and_world()
    _set_threads(config, world)
    precision = config.training_precision(tachyon.capabilities()["bf16"].available)
    dtype = _DTYPES[precision]
    engine_config = config.engine_config(precision)

    # checked (and the micro-batch resolved) before any work: a bad engine section fails fast
    micro_batch = load_config(engine_config, world).train_micro_batch_size_per_gpu

    torch.manual_seed(config.seed)  # the same initial weights on every rank
    train_set, val_set = build_lm_datasets(config.objective, config.seq_len, seed=config.seed,
                                           mask_prob=config.mask_prob, tokenizer=config.tokenizer)
    vocab_size = train_set.tokenizer.vocab_size
    model = build_model(config, vocab_size, dtype, micro_batch, dropout_seed=_rank_seed(config.seed, rank))
    n_params = count_parameters(model)
    engine, _, dataloader, _ = tachyon.initialize(
        model=model, model_parameters=model.parameters(), training_data=train_set, collate_fn=collate,
        config=engine_config,
    )
    rank, world = _rank_and_world()
    torch.manual_seed(_rank_seed(config.seed, rank))  # per-rank dropout seeds of the TE-style layers
    device = engine.device
    sampler = dataloader.sampler  # a DistributedSampler over the data-parallel ranks

    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = _Checkpointer(engine, output_dir / "checkpoints")
    epoch, batches_in_epoch = 0, 0
    if resume:
        state = checkpointer.load()
        if state is None:
            if rank == 0:
                print(f"tachyon train: --resume: no checkpoint in {checkpointer.directory}; starting from step 0",
                      file=sys.stderr)
        else:
            epoch, batches_in_epoch = int(state.get("epoch", 0)), int(state.get("batches_in_epoch", 0))
            _reseed_kernel_dropout(model, _rank_seed(config.seed, rank))
            if rank == 0:
                print(f"tachyon train: resumed from step {engine.global_steps} (epoch {epoch}, "
                      f"micro-batch {batches_in_epoch})", flush=True)
    first_step = engine.global_steps + 1
    if rank == 0:
        print(f"tachyon train: {config.model}, {n_params / 1e6:.2f} M parameters, {world} process(es) on "
              f"{device.type}, {precision}, ZeRO stage {engine.zero_optimization_stage()}, "
              f"global batch {engine.train_batch_size()} x {config.seq_len} tokens, steps {first_step}-{config.steps}, "
              f"output {output_dir}", flush=True)

    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=engine.global_steps, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=1.0 if sys.stderr.isatty() else 30.0, file=sys.stderr)
    telemetry = engine.telemetry  # the engine prints the step lines and writes the monitor events
    telemetry.set_tokens_per_sample(config.seq_len)
    if bar is not None:
        telemetry.printer = bar.write  # lines above the bar, not through it
    rows: list[dict[str, float]] = []
    engine.train()
    telemetry.restart_window()  # step 1's time starts at its first forward
    while engine.global_steps < config.steps:
        for batch in _epoch_loader(train_set, sampler, epoch, batches_in_epoch, micro_batch):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            batches_in_epoch += 1
            if not boundary:
                continue
            stats = telemetry.last_step
            step = stats.step
            # the engine averaged the loss over the ranks on print steps; metrics.csv wants every step's
            loss_value = stats.global_loss
            if loss_value is None:
                loss_value, = _mean_over_ranks([stats.loss.item()], device)
            lrs = engine.get_lr()
            rows.append({"step": step, "loss": loss_value, "lr": float(lrs[0]) if lrs else 0.0,
                         "grad_norm": _or_nan(engine.get_global_grad_norm()), "loss_scale": engine.loss_scale,
                         "samples_per_s": _or_nan(stats.samples_per_s), "tokens_per_s": _or_nan(stats.tokens_per_s),
                         "step_time_s": stats.step_time_s})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
            if step >= config.steps or (config.checkpoint_interval and step % config.checkpoint_interval == 0):
                checkpointer.save(step, {"epoch": epoch, "batches_in_epoch": batches_in_epoch, "step": step})
                telemetry.restart_window()  # the save is not the next step's time
            if step >= config.steps:
                break
        else:  # the epoch ran out
            epoch, batches_in_epoch = epoch + 1, 0
            continue
        break
    if bar is not None:
        bar.close()
    last_step = engine.global_steps
    if last_step >= first_step:
        checkpointer.save(last_step, {"epoch": epoch, "batches_in_epoch": batches_in_epoch, "step": last_step})
    validation_loss = _evaluate(engine, val_set, config.eval_batches, micro_batch, rank, world, device)
    memory = _memory_per_rank(engine, device)
    result = TrainResult(first_step, last_step, rows if rank == 0 else [], validation_loss, checkpointer.saved)
    if rank == 0:
        all_rows = _write_metrics(output_dir / "metrics.csv", rows, first_step)
        title = f"{config.model}, {world} x {device.type}, {precision}"
        if all_rows:
            plot_training(output_dir / "loss.png", [int(r["step"]) for r in all_rows], [r["loss"] for r in all_rows],
                          [r["tokens_per_s"] for r in all_rows], title=title)
        summary = _summary(config, engine, precision, world, device, n_params, vocab_size, result, all_rows, memory,
                           time.perf_counter() - started, output_dir)
        (output_dir / "summary.txt").write_text(summary)
        print(summary, end="", flush=True)
    engine.destroy()  # closes the monitor files and the engine's data-parallel group
    return result


@torch.no_grad()
def _evaluate(engine: Any, dataset: Any, batches: int, micro_batch: int, rank: int, world: int,
              device: torch.device) -> float | None:
    """Mean loss over the first ``batches`` validation micro-batches of every rank (None: none)."""
    if batches == 0:
        return None
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    indices = list(sampler)[:batches * micro_batch]
    engine.eval()
    losses = [engine(**{k: v.to(device) for k, v in batch.items()}).float().item()
              for batch in DataLoader(dataset, batch_size=micro_batch, sampler=indices, collate_fn=collate)]
    engine.train()
    total, count = _mean_over_ranks([sum(losses), float(len(losses))], device)
    return total / count if count else None


def _memory_per_rank(engine: Any, device: torch.device) -> list[dict[str, float]]:
    """Every rank's engine.memory_breakdown() (bytes) plus its peak memory, gathered on all ranks."""
    mine = {k: float(v) for k, v in engine.memory_breakdown().items()}
    if device.type == "cuda":
        mine["peak_allocated"] = float(torch.cuda.max_memory_allocated(device))
    else:
        try:
            import resource  # POSIX only
        except ImportError:
            resource = None
        if resource is not None:  # ru_maxrss is KiB on Linux, bytes on macOS
            scale = 1 if sys.platform == "darwin" else 1024
            mine["peak_rss"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered
    return [mine]


def _write_metrics(path: Path, rows: list[dict[str, float]], first_step: int) -> list[dict[str, float]]:
    """Append ``rows`` to metrics.csv, dropping earlier rows at or after ``first_step`` (a run that
    resumed from an older checkpoint replaces them); returns the whole table."""
    previous = [r for r in read_metrics(path) if r["step"] < first_step] if path.is_file() else []
    table = previous + rows
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        for row in table:
            writer.writerow({k: (row[k] if k == "step" else f"{row[k]:.6g}") for k in METRIC_COLUMNS})
    return table


def _window_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _summary(config: TrainConfig, engine: Any, precision: str, world: int, device: torch.device,
             n_params: int, vocab_size: int, result: TrainResult, table: list[dict[str, float]],
             memory: list[dict[str, float]], wall_s: float, output_dir: Path) -> str:
    window = max(1, min(10, len(table) // 4)) if table else 1
    losses = [r["loss"] for r in table]
    run_rows = [r for r in table if r["step"] >= result.first_step]
    timed = run_rows[1:] if len(run_rows) > 1 else run_rows  # step 1 of a process includes warm-up
    step_time = _window_mean([r["step_time_s"] for r in timed])
    tokens_per_s = engine.train_batch_size() * config.seq_len / step_time if timed else math.nan
    lines = [
        f"tachyon train: {config.model} ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads, {n_params / 1e6:.2f} M parameters), {config.tokenizer} tokenizer "
        f"({vocab_size} ids), seq_len {config.seq_len}",
        f"job: {world} process(es) on {device.type}, {precision}, ZeRO stage "
        f"{engine.zero_optimization_stage()}, global batch {engine.train_batch_size()} "
        f"(micro-batch {engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} "
        f"accumulation x {world} ranks)",
        f"steps: {result.last_step} of {config.steps} (this run: "
        + (f"{result.first_step}-{result.last_step}" if result.last_step >= result.first_step else "no new steps")
        + f"), wall time {wall_s:.1f} s",
    ]
    if losses:
        lines.append(f"loss: {_window_mean(losses[:window]):.4f} (mean of the first {window} steps) -> "
                     f"{_window_mean(losses[-window:]):.4f} (mean of the last {window}); final step {losses[-1]:.4f}")
    if result.validation_loss is not None:
        lines.append(f"validation loss: {result.validation_loss:.4f} ({config.eval_batches} micro-batches per rank)")
    if timed:
        lines.append(f"throughput: {tokens_per_s:.0f} tokens/s, {engine.train_batch_size() / step_time:.1f} samples/s, "
                     f"{step_time * 1e3:.1f} ms/step (mean over this run's steps after its first)")
    skipped = int(getattr(engine, "skipped_steps", 0))
    lines.append(f"skipped steps (fp16 overflow): {skipped}")
    lines.append("memory per rank (MiB):")
    for rank, entry in enumerate(memory):
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in entry.items())
        lines.append(f"  rank {rank}: {parts}")
    saved = ", ".join(result.checkpoints) or "nothing new"
    lines.append(f"checkpoints: {output_dir / 'checkpoints'} (this run saved {saved})")
    lines.append(f"files: {output_dir / 'metrics.csv'}, {output_dir / 'loss.png'}, {output_dir / 'summary.txt'}")
    return "\n".join(lines) + "\n"
