"""
Train a GPT on real text and see where the time and the memory go.

    python train_minimal.py                                  # built-in corpus, ~2 minutes on 2 CPU cores
    python train_minimal.py --preset tiny --num-steps 20     # a few seconds
    python train_minimal.py --use-toy-data --preset tiny     # synthetic task: a smoke test
    python train_minimal.py --train-data data/train.txt --n-heads 4 --d-model 768 --d-ff 3072 \\
        --n-layers 12 --seq-len 1024 --batch-size 2 --no-amp --use-activation-checkpoint
    python train_minimal.py --resume --out-dir runs/RUN      # continue a stopped run
    python train_minimal.py --memory-profiler                # where the memory goes, measured at step 5
    python train_minimal.py --estimate-memory --preset gpt2  # predicted memory; builds nothing, exits
    python train_minimal.py --help                           # every flag, grouped

The file reads top to bottom: parse flags -> build data, model, optimizer -> train loop -> finish.
"""

from __future__ import annotations

import sys
import time

IMPORTED_AT = time.time()  # start-up's lower bound where /proc cannot tell when the process started

if __name__ == "__main__":  # the CPU's malloc is chosen before torch loads: a re-exec then costs ~0
    from minigpt.cpu import run_under_preferred_allocator

    run_under_preferred_allocator(sys.argv[1:])

import json
import logging
import math
import os
import platform
import signal
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from minigpt import distributed, parallel, paths
from minigpt.checkpoint import (
    SHARDED_META,
    check_checkpoint_path,
    check_resume,
    check_same_shape,
    check_sharded_path,
    check_sharded_resume,
    describe_intact,
    load_checkpoint,
    load_sharded,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
    sharded_checkpoint_dir,
)
from minigpt.config import (
    EXTRA_ARGS_ENV,
    TrainConfig,
    UsageError,
    check_cuda_features,
    parse_args,
    profile_ranks,
    resolve_amp,
    resolve_device,
)
from minigpt.cpu import keep_freed_memory, preload_hint, release_freed_memory
from minigpt.data import (
    Batches,
    ToyBatches,
    builtin_corpus,
    check_enough_tokens,
    load_tokens,
    split_train_val,
    tokenizer_vocab,
)
from minigpt.estimate import estimate_gpt, estimate_report
from minigpt.fileio import atomic_write
from minigpt.instrument import Instruments, cuda_memory_report
from minigpt.memory import process_memory
from minigpt.metrics import (
    JsonlWriter,
    RunTotals,
    StepRecord,
    TensorBoardLogger,
    evaluation_notice,
    format_finished,
    format_log_line,
    perplexity,
    setup_logging,
)
from minigpt.mfu import PeakFlops, achieved_tflops, describe, mfu, model_workloads, peak_flops
from minigpt.model import GPT, GPTConfig
from minigpt.per_rank import per_rank_memory_estimate
from minigpt.report import write_report
from minigpt.runs import (
    RunLock,
    check_out_dir,
    clean_stale_tmp,
    latest_run,
    next_steps,
    probe_writable,
    repair_jsonl,
)
from minigpt.shape import shape_of
from minigpt.stages import STAGE_NAMES
from minigpt.straggler import StragglerDetector, format_report, parse_slow_rank, rank_figures


class NonFiniteLoss(Exception):
    """The loss became NaN or inf: the run stops rather than train on garbage."""


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine / linear / constant down to cfg.min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    progress = min(progress, 1.0)
    if cfg.lr_scheduler == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        decay = 1.0 - progress
    return cfg.min_lr + decay * (cfg.lr - cfg.min_lr)


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear weights, embeddings) only, not on biases and
    LayerNorm gains. The fused kernel, on CUDA (one launch instead of one per tensor) and on the
    CPU too: for the `small` preset the optimizer_step stage (clipping included) went from about
    35 ms with the per-tensor loop to 17 ms a step on the 2-core machine of benchmarks/results
    (cpu-small.md)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # Under --fsdp/--tp each group must hold one kind of tensor (plain, or DTensors of one mesh) for
    # the fused kernel: split_by_mesh splits them (a no-op for plain parameters).
    return torch.optim.AdamW(parallel.split_by_mesh(groups), lr=cfg.lr, betas=(0.9, 0.95), fused=True)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, iters: int, device: str, autocast) -> float:
    """Mean loss over the same `iters` validation batches every time, so evaluations compare."""
    model.eval()
    losses = []
    for _ in range(iters):
        release_freed_memory()  # CPU: the kept heap's free blocks back to the system (minigpt/cpu.py)
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with autocast:
            losses.append(model(x, y)[1].float())
    release_freed_memory()
    model.train()
    return torch.stack(losses).mean().item()


def resolve_out_dir(cfg: TrainConfig) -> Path:
    """The run directory. --resume without --out-dir continues the latest run that has a checkpoint."""
    root = paths.RUNS_ROOT
    if cfg.out_dir:
        return Path(cfg.out_dir)
    if cfg.resume and not cfg.checkpoint_path:
        return latest_run(root, paths.CHECKPOINT_FILE)  # the newest checkpoint, not the last name
    out = root / datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 1
    while out.exists():  # two runs started in the same second
        out, n = root / f"{datetime.now():%Y%m%d-%H%M%S}-{n}", n + 1
    return out


@contextmanager
def stop_on_signals():
    """Yield a list that receives the number of the first SIGINT/SIGTERM; restore the handlers after.

    A second Ctrl-C kills at once. A repeated SIGTERM is ignored: launchers and schedulers
    (torchrun, SLURM) often send it to every process twice, and the save must still happen."""
    received: list[int] = []

    def handler(signum, frame):
        if not received:
            received.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def write_json_atomic(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


@dataclass
class Data:
    """The batches a run draws, and what the log says of them."""

    train: Batches
    make_val: Callable[[], Batches]  # a fresh iterator over the same validation batches each time
    name: str
    vocab_size: int
    train_tokens: int | None  # None for toy data, which has no epochs
    val_tokens: int | None


def load_data(cfg: TrainConfig, rank: int, pin: bool) -> Data:
    """Read and check everything before the run directory is touched: a mistake costs nothing.
    `pin`: page-locked batches make the host-to-device copy asynchronous (CUDA)."""
    if cfg.use_toy_data:
        v = cfg.vocab_size
        return Data(
            ToyBatches(v, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin),
            partial(ToyBatches, v, cfg.batch_size, cfg.seq_len, cfg.data_seed, stream=1, pin_memory=pin),
            "toy sequences",
            v,
            None,
            None,
        )
    train_files = cfg.train_data or [builtin_corpus()]
    name = ", ".join(map(str, train_files)) if cfg.train_data else "built-in corpus (pydoc_data topics)"
    tokens = load_tokens(train_files, cfg.tokenizer_name, cfg.max_tokens)
    if cfg.val_data:
        train_tokens, val_tokens = tokens, load_tokens(cfg.val_data, cfg.tokenizer_name)
    else:
        train_tokens, val_tokens = split_train_val(tokens)
    check_enough_tokens(train_tokens, cfg.seq_len, "the training data")
    check_enough_tokens(val_tokens, cfg.seq_len, "the validation data")
    n_vocab = tokenizer_vocab(cfg.tokenizer_name)
    if cfg.vocab_size is not None and cfg.vocab_size < n_vocab:
        raise UsageError(
            f"--vocab-size {cfg.vocab_size} is smaller than the {cfg.tokenizer_name} "
            f"tokenizer's {n_vocab} ids; drop --vocab-size or raise it"
        )
    return Data(
        Batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin),
        partial(Batches, val_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed, stream=1, pin_memory=pin),
        name,
        cfg.vocab_size or n_vocab,
        len(train_tokens),
        len(val_tokens),
    )


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(**shape_of(cfg, vocab_size).model_kwargs())


def restore(
    ckpt_path: Path,
    sharded: bool,
    cfg: TrainConfig,
    model: GPT,
    optimizer,
    scaler,
    batches: Batches,
    rank: int,
    world_size: int,
) -> int:
    """Load a checkpoint into the run (with --resume); return its step, 0 for a fresh run. Refuses
    a checkpoint that does not fit the flags."""
    if not cfg.resume:
        return 0
    if sharded:
        return restore_sharded(ckpt_path, cfg, model, optimizer, scaler, batches)
    state = load_checkpoint(ckpt_path)
    check_same_shape(state["model_config"], asdict(model.cfg), ckpt_path)
    check_resume(state, cfg, optimizer, ckpt_path)  # this run's own checkpoint; optimizer state fits
    if state["step"] >= cfg.num_steps:
        raise UsageError(
            f"checkpoint {ckpt_path} is at step {state['step']}, already past "
            f"--num-steps {cfg.num_steps}; raise --num-steps to train further"
        )
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise UsageError(
            f"checkpoint {ckpt_path} does not fit this run's flags (model, optimizer or "
            f"--amp-dtype differ: {str(e).splitlines()[0]}); resume with the flags it was "
            "trained with"
        ) from None
    batches.position = state["data_position"]
    per_rank = state.get("rng_per_rank") or []
    # last: building the model drew from the generators
    if len(per_rank) == world_size:
        set_rng_state(per_rank[rank])
    else:  # the world size changed: exact continuation is impossible, keep the ranks' streams apart
        set_rng_state(state["rng"])
        torch.manual_seed(cfg.seed + rank + state["step"])
    return state["step"]


def restore_sharded(folder: Path, cfg: TrainConfig, model: GPT, optimizer, scaler, batches: Batches) -> int:
    """restore() for --fsdp/--tp: every rank loads its shards (minigpt.checkpoint.load_sharded);
    returns the step."""
    extra = load_sharded(folder, model, optimizer)
    check_sharded_resume(extra, cfg, folder)  # its keys and types; this run's own checkpoint
    check_same_shape(extra["model_config"], asdict(model.cfg), folder)
    if extra["step"] >= cfg.num_steps:
        raise UsageError(
            f"checkpoint {folder} is at step {extra['step']}, already past "
            f"--num-steps {cfg.num_steps}; raise --num-steps to train further"
        )
    scaler.load_state_dict(extra["scaler"])
    batches.position = extra["data_position"]
    set_rng_state(extra["rng"])  # this rank's own stream (rank 0's after a change of world size)
    return extra["step"]


def checkpoint_target(cfg: TrainConfig, out_dir: Path, sharded: bool) -> Path:
    """The checkpoint this run writes (and resumes from), checked: a file, or under --fsdp/--tp a
    folder of shards (DCP) that every rank writes."""
    path = Path(cfg.checkpoint_path) if cfg.checkpoint_path else out_dir / paths.CHECKPOINT_FILE
    if sharded:
        path = sharded_checkpoint_dir(path)
    (check_sharded_path if sharded else check_checkpoint_path)(path, cfg.resume)
    return path


def repair_logs(out_dir: Path, step: int) -> list[str]:
    """On resume: drop metrics and straggler lines past the checkpoint's step, or cut short by a
    crash, so no step appears twice. Returns what was done, for the log."""
    dropped = {n: repair_jsonl(out_dir / n, step) for n in (paths.METRICS_FILE, paths.STRAGGLERS_FILE)}
    return [f"dropped {k} line(s) of {n} past step {step} or cut short" for n, k in dropped.items() if k]


def predicted_memory(cfg: TrainConfig, model: GPT, amp_dtype: str, device: str, plan):
    """The estimate printed beside --memory-profiler's measurement: one rank's share under --fsdp/--tp."""
    if not cfg.memory_profiler:
        return None
    shape = shape_of(cfg, model.cfg.vocab_size)
    estimate = estimate_gpt(shape, amp_dtype, device)
    if plan.sharded:
        estimate = per_rank_memory_estimate(estimate, plan.dp, plan.tp, plan.fsdp, shape)
    return estimate


def save_run(
    path: Path,
    sharded: bool,
    model: GPT,
    optimizer,
    scaler,
    step: int,
    batches: Batches,
    cfg: TrainConfig,
    dist_info: distributed.DistInfo,
) -> None:
    """One file from rank 0 (every rank's RNG state gathered into it), or, under --fsdp/--tp, a
    folder of shards that every rank writes (DCP) with the rest of the state beside them."""
    if sharded:
        extra = {
            "scaler": scaler.state_dict(),
            "step": step,
            "data_position": batches.position,
            "rng": rng_state(),
            "config": cfg.to_dict(),
            "model_config": asdict(model.cfg),
        }
        save_sharded(path, model, optimizer, extra)
        return
    state = checkpoint_state(model, optimizer, scaler, step, batches, cfg, dist_info)
    if dist_info.is_main:
        save_checkpoint(path, state)


def checkpoint_state(
    model, optimizer, scaler, step: int, batches: Batches, cfg: TrainConfig, dist_info: distributed.DistInfo
) -> dict:
    """Everything a resumed run needs to repeat the uninterrupted one. Called on every rank: it
    gathers each rank's RNG state (each rank's dropout stream)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "data_position": batches.position,
        "rng": rng_state(),
        "rng_per_rank": distributed.gather(rng_state(), dist_info),
        "config": cfg.to_dict(),
        "model_config": asdict(model.cfg),
    }


def check_finite(
    losses: list[torch.Tensor],
    step: int,
    dist_info: distributed.DistInfo,
    ckpt_path: Path,
    amp_dtype: str,
    weights=None,
) -> list[float]:
    """Read the interval's losses (this syncs) and stop at the first non-finite one, on every rank
    together (each rank sees only its own loss). Before a save, `weights` too: a checkpoint of
    non-finite weights would replace the last good one."""
    if weights is not None and not all(torch.isfinite(parallel.local(p)).all() for p in weights):
        raise NonFiniteLoss(
            f"the weights became non-finite at step {step}; {describe_intact(ckpt_path)}; lower --lr"
        )
    if not losses:
        return []
    values = torch.stack(losses).tolist()
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if distributed.any_rank(bad is not None, dist_info):
        where = (
            f"loss is {values[bad]} at step {step - len(values) + bad + 1}"
            if bad is not None
            else f"another rank's loss became non-finite by step {step}"
        )
        hint = " or use --amp-dtype bf16 (fp16's range is narrow)" if amp_dtype == "fp16" else ""
        raise NonFiniteLoss(f"{where}; {describe_intact(ckpt_path)}; lower --lr{hint}")
    return values


@dataclass
class Throughput:
    """What turns the loop's clocks into a StepRecord: this run's constants, and the run-wide
    totals (minigpt.metrics.RunTotals) that every record carries."""

    tokens_per_step: int  # per rank: batch x seq_len x accumulation
    world_size: int
    device: str
    flops_per_token: int
    peak_flops: float
    start_step: int
    totals: RunTotals

    @classmethod
    def of(cls, cfg: TrainConfig, plan, device: str, model: GPT, peak: PeakFlops, step: int) -> Throughput:
        """Tokens per step: each data-parallel rank's batch (the ranks of a tp group share one);
        FLOPs per token per device (a tp group's devices split the model)."""
        tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
        fpt = shape_of(cfg, model.cfg.vocab_size).flops_per_token // plan.tp
        return cls(tokens, plan.dp, device, fpt, peak.value, step, RunTotals(tokens * plan.dp))

    def record(
        self,
        cfg: TrainConfig,
        step: int,
        losses: list[float],
        lr: float,
        val: float | None,
        step_times: list[float],
        stages,
        comm: tuple[int, dict[str, float]] | None,
        train_tokens: int | None,
        amp: str,
    ) -> StepRecord:
        """`comm`: under FSDP/TP, (the profiled step, its ms in collectives per stage) from
        Instruments.take_comm; under DDP the backward's wait for the all-reduce is split off instead."""
        step_time = sum(step_times) / len(step_times)
        per_rank = self.tokens_per_step / step_time
        self.totals.add(step_times)
        run = self.totals.figures()  # run_tokens, run_tokens_per_s, tokens_per_s_e2e, elapsed_s, ...
        comm_step, comm_ms = comm or (None, {})
        if "backward_compute" in stages.host_ms:  # DDP: every step's wait, averaged like the stages
            comm_ms = {"backward": stages.host_ms["backward"] - stages.host_ms["backward_compute"]}
        return StepRecord(
            step=step,
            num_steps=cfg.num_steps,
            loss=sum(losses) / len(losses),
            lr=lr,
            epoch=1 + step * self.tokens_per_step * self.world_size // train_tokens if train_tokens else 1,
            step_time_s=step_time,
            tokens_per_s=self.world_size * per_rank,
            tokens_per_s_per_rank=per_rank,
            **run,
            world_size=self.world_size,
            val_loss=val,
            val_ppl=None if val is None else perplexity(val),
            eta_s=self.totals.tokens_per_step * (cfg.num_steps - step) / run["tokens_per_s_e2e"],
            amp=amp,
            mfu=mfu(self.flops_per_token, per_rank, self.peak_flops),
            achieved_tflops=achieved_tflops(self.flops_per_token, per_rank),
            stage_host_ms=stages.host_ms,
            stage_device_ms=stages.device_ms,
            stage_comm_ms=comm_ms,
            comm_step=comm_step,
            memory=cuda_memory_report() if self.device == "cuda" else process_memory(),
        )


def forward_ms(stages, step_times: list[float], cfg: TrainConfig) -> float | None:
    """One batch's forward time in the interval (ms), what an evaluation batch costs: the forward
    stage per micro-batch, or a third of a step without stage timing."""
    if "forward" in stages.host_ms:
        return stages.host_ms["forward"] / cfg.grad_accum_steps
    return 1000 * sum(step_times) / len(step_times) / 3 / cfg.grad_accum_steps if step_times else None


def score_stragglers(
    detector: StragglerDetector, step: int, step_times: list[float], stages, dist_info: distributed.DistInfo
) -> list[dict]:
    """Every rank's medians over the interval, gathered and scored; the slow ranks' reports, on
    rank 0 alone: every rank gathers the same figures, and torchrun prints each rank's warnings, so
    a report from every rank would show each STRAGGLER line once per rank."""
    if dist_info.world_size == 1 or not stages.host_steps:
        return []
    mine = rank_figures(dist_info.rank, dist_info.host, [1000 * t for t in step_times], stages.device_steps)
    reports = detector.update(step, distributed.gather(mine, dist_info))
    return reports if dist_info.is_main else []


def is_log_step(step: int, cfg: TrainConfig) -> bool:
    # An evaluation step is a log step too, so --eval-interval holds whatever --log-interval is.
    return step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == cfg.num_steps


def open_run_dir(
    out_dir: Path,
    cfg: TrainConfig,
    model: GPT,
    data: Data,
    rate: Throughput,
    peak: PeakFlops,
    amp: tuple,
    notes: list[str | None],
    dist_info: distributed.DistInfo,
    ckpt_path: Path,
    cleaned: list[str],
) -> logging.Logger:
    """Create the run directory, write config.json (rank 0) and say what this run is: the lines
    every log starts with. `amp`: (dtype, the decision in words); `notes`: the CPU allocator's
    setting and the parallel plan, when there are. Returns the logger (rank 0 writes the log,
    metrics, TensorBoard, checkpoints)."""
    (amp_dtype, amp_note), device, (malloc_note, plan_note) = amp, rate.device, notes
    out_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging(out_dir / paths.LOG_FILE, dist_info.rank)
    device_name = (
        torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    )
    n_params = model.num_params(non_embedding=False)
    if dist_info.is_main:
        write_json_atomic(
            out_dir / paths.CONFIG_FILE,
            {
                "config": cfg.to_dict(),
                "model": asdict(model.cfg),
                "device": device,
                "device_name": device_name,
                "amp": amp_dtype,
                "params": n_params,
                "flops_per_token": rate.flops_per_token,
                **peak.config(),
                "world_size": dist_info.world_size,
                "ddp_backend": dist_info.backend,
                "versions": {
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "python": platform.python_version(),
                },
            },
        )
    log.info(f"Training started; run directory {out_dir}")
    if os.environ.get(EXTRA_ARGS_ENV):
        log.info(f"Flags appended from ${EXTRA_ARGS_ENV}: {os.environ[EXTRA_ARGS_ENV]}")
    log.info(f"Device: {device} ({device_name}), torch {torch.__version__}; {amp_note}")
    if malloc_note:
        log.info(malloc_note)
        if hint := preload_hint():
            log.info(f"CPU allocator: {hint}")
    if plan_note:  # --fsdp / --tp
        log.info(f"{plan_note}; {dist_info.backend} backend")
    elif dist_info.world_size > 1:
        log.info(
            f"DDP: {dist_info.world_size} ranks, {dist_info.backend} backend; "
            f"every rank draws its own batches"
        )
    log.info(
        f"Data: {data.name}"
        + (
            ""
            if data.train_tokens is None
            else f"; {data.train_tokens:,} training tokens, {data.val_tokens:,} validation tokens"
        )
    )
    log.info(
        f"Model: {cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}, "
        f"vocab {model.cfg.vocab_size}, {n_params / 1e6:.2f}M parameters"
        + (", activation checkpointing" if cfg.use_activation_checkpoint else "")
    )
    log.info(
        f"Batch: {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum_steps} accumulation = "
        f"{rate.tokens_per_step:,} tokens per step per rank; {cfg.num_steps} steps"
    )
    log.info(describe(peak))
    log.info(f"Resumed from {ckpt_path} at step {rate.start_step}" if cfg.resume else "Starting from scratch")
    for line in cleaned:
        log.info(f"Cleaned up after an earlier run: {line}")
    return log


def guard_run_dir(
    out_dir: Path, ckpt_path: Path, sharded: bool, cfg: TrainConfig, held: ExitStack
) -> list[str]:
    """Before any work, on rank 0: every output path probed (a bad one costs one line, not an
    interval of training and a traceback at the first save), the run directory locked for this
    trainer alone (held until the run returns), and what a killed earlier run left cleaned up."""
    check_out_dir(out_dir)
    if not cfg.no_checkpoint:
        probe_writable(ckpt_path / SHARDED_META if sharded else ckpt_path, "--checkpoint-path")
    held.enter_context(RunLock(out_dir, None if cfg.no_checkpoint else ckpt_path))
    return [
        f"removed {p}, a save killed midway"
        for p in clean_stale_tmp(ckpt_path.parent) + clean_stale_tmp(out_dir)
    ]


def write_run_report(out_dir: Path, dist_info: distributed.DistInfo, log: logging.Logger) -> None:
    """report.html: the run in one offline page, written by rank 0 once every rank's trace is on disk.
    A report that cannot be made costs a warning, never the run that trained."""
    distributed.barrier(dist_info)
    if dist_info.is_main:
        try:
            log.info(
                f"Report: {write_report(out_dir)} (one offline page; python -m minigpt.report rewrites it)"
            )
        except Exception as e:  # noqa: BLE001 - the training is done and saved; say what went wrong
            log.warning(f"report not written: {type(e).__name__}: {e}")


def mfu_peak(
    cfg: TrainConfig, model: GPT, device: str, amp_dtype: str, dist_info: distributed.DistInfo
) -> PeakFlops:
    """MFU's denominator (minigpt/mfu.py): --peak-tflops, a known GPU's data sheet, or this machine's
    best rate on the model's own units, measured once and cached. Rank 0 measures alone and the
    others read its cache: measured together they would share the cores and cache a low figure."""
    units = model_workloads(
        cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.d_ff, model.cfg.vocab_size, cfg.n_heads
    )
    if not dist_info.is_main:
        distributed.barrier(dist_info)
    peak = peak_flops(device, amp_dtype, units, override_tflops=cfg.peak_tflops)
    if dist_info.is_main:
        distributed.barrier(dist_info)
    return peak


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_allocator(cfg: TrainConfig) -> str:
    """Set the CPU allocator (minigpt/cpu.py) and say what was done."""
    return (
        keep_freed_memory()
        if cfg.keep_freed_memory
        else "CPU allocator: glibc defaults (--no-keep-freed-memory)"
    )


def stopped(
    stop_signal: list[int],
    step: int,
    cfg: TrainConfig,
    ckpt_path: Path,
    out_dir: Path,
    dist_info: distributed.DistInfo,
    log: logging.Logger,
) -> int:
    """After a SIGINT/SIGTERM (on any rank) and the save: say how to continue; exit status 128 + signal."""
    distributed.barrier(dist_info)  # no rank leaves (and gets torn down) before the save is done
    signum = stop_signal[0] if stop_signal else signal.SIGTERM  # another rank's signal
    saved = "no checkpoint (--no-checkpoint)" if cfg.no_checkpoint else f"checkpoint saved to {ckpt_path}"
    log.info(
        f"Stopped by {signal.Signals(signum).name} after step {step}; {saved}. Continue with: "
        f"python train_minimal.py --resume --out-dir {out_dir} (and the same flags)"
    )
    return 128 + signum


def finish(
    step: int,
    record: StepRecord,
    rate: Throughput,
    inst: Instruments,
    cfg: TrainConfig,
    ckpt_path: Path,
    out_dir: Path,
    dist_info: distributed.DistInfo,
    log: logging.Logger,
) -> None:
    """The run's last lines: the profiler's cost, the run's figures (metrics.jsonl's last record's:
    minigpt.metrics.format_finished), the report, and what to open next."""
    if cost := inst.profiler_cost():
        log.info(cost)
    if dist_info.is_main:
        log.info(format_finished(record, step - rate.start_step, rate.start_step))
    if not cfg.no_report:
        write_run_report(out_dir, dist_info, log)
    log.info(f"Checkpoint: {ckpt_path}" if ckpt_path.exists() else "Checkpoint: none (--no-checkpoint)")
    log.info(f"Run directory: {out_dir} ({paths.LOG_FILE}, {paths.METRICS_FILE}, {paths.CONFIG_FILE})")
    if dist_info.is_main:
        has_traces, has_report = (out_dir / paths.TRACE_DIR).is_dir(), (out_dir / paths.REPORT_FILE).is_file()
        for line in next_steps(
            out_dir,
            has_traces,
            has_report,
            has_checkpoint=ckpt_path.is_file(),
            checkpoint=cfg.checkpoint_path,
        ):
            log.info(line)


def main(argv: list[str] | None = None, on_step: Callable[[int], None] | None = None) -> int:
    """Train. `on_step(n)` is called just before training step n (1-based) runs: the seam through
    which tests and notebooks stop or inspect a run at a chosen step (e.g. send SIGTERM in step 4)."""
    with ExitStack() as held:  # what the run holds until it returns, however it returns: its directory's lock
        return train(argv, on_step, held)


def train(argv: list[str] | None, on_step: Callable[[int], None] | None, held: ExitStack) -> int:
    # ------------------------------------------------------------------ flags
    cfg = parse_args(argv)
    device = resolve_device(cfg.device)
    check_cuda_features(cfg, device)
    amp_on, amp_dtype, amp_note = resolve_amp(cfg, device)
    malloc_note = cpu_allocator(cfg) if device == "cpu" else None  # before the first big allocation
    if cfg.estimate_memory:  # the predicted memory of this configuration: no model, no run directory
        print(estimate_report(cfg, device, amp_dtype, amp_note))
        return 0
    slow = parse_slow_rank(cfg.simulate_slow_rank, STAGE_NAMES) if cfg.simulate_slow_rank else None
    parallel.check_plan(cfg, parallel.world_size_from_env())  # --fsdp / --tp: before any process group
    # Under torchrun: join the process group (NCCL on CUDA, gloo on the CPU). Otherwise world size 1.
    dist_info = distributed.setup(device, cfg.ddp_backend, cfg.ddp_timeout)
    rank, world_size, is_main = dist_info.rank, dist_info.world_size, dist_info.is_main
    distributed.check_same_config(cfg, dist_info)  # ranks started with different flags: one line
    plan = parallel.make_plan(cfg, rank, world_size, device)  # the (dp, tp) mesh under --fsdp / --tp
    profile_ranks(cfg.profile_ranks, world_size)  # a rank outside the world: one line, before any work
    if slow and slow.rank >= world_size:
        raise UsageError(
            f"--simulate-slow-rank {cfg.simulate_slow_rank}: no rank {slow.rank} in a world of {world_size}"
        )
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    out_dir = Path(distributed.gather(str(resolve_out_dir(cfg)), dist_info)[0])  # rank 0's choice
    ckpt_path = checkpoint_target(cfg, out_dir, plan.sharded)
    stale = guard_run_dir(out_dir, ckpt_path, plan.sharded, cfg, held) if is_main else []

    # ------------------------------------------------------------------ data, model, optimizer
    data = load_data(cfg, plan.dp_rank, pin=device == "cuda")  # the ranks of a tp group share batches
    inst = Instruments(cfg, device, rank, world_size, out_dir, plan.worker, comm=plan.sharded)
    model = GPT(model_config(cfg, data.vocab_size)).to(device)
    if plan.sharded:  # in place, into DTensors: before the optimizer, which must hold those
        parallel.parallelize(model, cfg, plan.mesh, device, amp_dtype)
    if plan.dp_rank:  # different dropout masks per data-parallel rank (a tp group's ranks share theirs)
        torch.manual_seed(cfg.seed + plan.dp_rank)
    optimizer = configure_optimizer(model, cfg, device)
    # fp16 needs loss scaling (its range is narrow); bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device, enabled=amp_dtype == "fp16")
    autocast = torch.autocast(device, dtype=AUTOCAST_DTYPES[amp_dtype]) if amp_on else nullcontext()
    step = restore(ckpt_path, plan.sharded, cfg, model, optimizer, scaler, data.train, rank, world_size)
    # DDP from 2 ranks on (FSDP and TP wrapped the model in place above)
    ddp_model = model if plan.sharded else distributed.wrap_ddp(model, dist_info, device)
    train_model = torch.compile(ddp_model) if cfg.compile else ddp_model
    peak = mfu_peak(cfg, model, device, amp_dtype, dist_info)
    rate = Throughput.of(cfg, plan, device, model, peak, step)

    # ------------------------------------------------------------------ run directory
    if is_main and cfg.resume:  # a resumed run repeats the steps after its checkpoint: logged once each
        stale += repair_logs(out_dir, step)
    notes = [malloc_note, plan.describe(amp_dtype) if plan.sharded else None]
    log = open_run_dir(
        out_dir, cfg, model, data, rate, peak, (amp_dtype, amp_note), notes, dist_info, ckpt_path, stale
    )
    metrics_file = JsonlWriter(out_dir / paths.METRICS_FILE, enabled=is_main)
    stragglers_file = JsonlWriter(out_dir / paths.STRAGGLERS_FILE, enabled=is_main and world_size > 1)
    tensorboard = TensorBoardLogger(out_dir / paths.TENSORBOARD_DIR, enabled=is_main, purge_step=step + 1)
    inst.attach(model, optimizer, step + 1, predicted_memory(cfg, model, amp_dtype, device, plan), ddp_model)
    stragglers = StragglerDetector(cfg.straggler_threshold)

    # ------------------------------------------------------------------ train loop
    model.train()
    losses, val = [], None
    rate.totals.start(IMPORTED_AT)  # start-up ends here: the run-wide figures count from now
    # SIGINT / SIGTERM finish the step in flight, save, and leave; a second Ctrl-C kills at once.
    # A rank lost mid-run (killed, stopped): one line naming it and how to resume, on the others.
    resume = (
        f"the last checkpoint, if one was saved, is {ckpt_path}: continue with --resume --out-dir {out_dir}"
    )
    lost = distributed.peers_watched(
        dist_info, "nothing to resume (--no-checkpoint)" if cfg.no_checkpoint else resume
    )
    with stop_on_signals() as stop_signal, metrics_file, stragglers_file, tensorboard, inst, lost:
        while step < cfg.num_steps:
            if on_step:
                on_step(step + 1)
            step_loss = torch.zeros((), device=device)
            with inst.step(step + 1, sync=is_log_step(step + 1, cfg)):
                for micro in range(cfg.grad_accum_steps):
                    batch = next(data.train)  # host memory (pinned on CUDA)
                    with inst.stage("data_to_device"):
                        x, y = (t.to(device, non_blocking=True) for t in batch)
                    # DDP all-reduces the gradients in the last micro-batch's backward only.
                    with distributed.no_grad_sync(ddp_model, sync=micro == cfg.grad_accum_steps - 1):
                        with inst.stage("forward"), autocast:
                            # Only the loss is kept: held logits (b x s x vocab) would live
                            # on through the next forward and add to its peak.
                            loss = train_model(x, y)[1] / cfg.grad_accum_steps  # mean of micro-batches
                        with inst.stage("backward"):
                            scaler.scale(loss).backward()
                    step_loss += loss.detach()
                with inst.stage("optimizer_step"):
                    lr = set_lr(optimizer, get_lr(step, cfg))
                    if cfg.grad_clip > 0:
                        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                        parallel.clip_grad_norm(model.parameters(), cfg.grad_clip)  # DTensors too
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step += 1
            losses.append(step_loss)
            last = step == cfg.num_steps
            stop = distributed.any_rank(bool(stop_signal), dist_info)  # every rank stops at the same step

            if is_log_step(step, cfg) or stop:  # outside the step: not in its clock nor in its ProfilerStep
                values = check_finite(losses, step, dist_info, ckpt_path, amp_dtype)
                step_times, stages = inst.interval()
                # sharded: every rank takes part (the forward has collectives)
                if (is_main or plan.sharded) and (step % cfg.eval_interval == 0 or last):
                    if notice := evaluation_notice(cfg.eval_iters, forward_ms(stages, step_times, cfg)):
                        log.info(notice)  # a long evaluation is not silence
                    val = evaluate(model, data.make_val(), cfg.eval_iters, device, autocast)
                record = rate.record(
                    cfg,
                    step,
                    values,
                    lr,
                    val,
                    step_times,
                    stages,
                    inst.take_comm(),
                    data.train_tokens,
                    amp_dtype,
                )
                record.memory_breakdown = inst.take_memory_breakdown()
                log.info(format_log_line(record))
                metrics_file.write(record)
                tensorboard.log(record)
                for report in score_stragglers(stragglers, step, step_times, stages, dist_info):
                    log.warning(format_report(report, cfg.straggler_threshold))
                    stragglers_file.write(report)
                losses = []
            if not cfg.no_checkpoint and (
                last or stop or cfg.save_interval and step % cfg.save_interval == 0
            ):
                check_finite(losses, step, dist_info, ckpt_path, amp_dtype, weights=model.parameters())
                save_run(ckpt_path, plan.sharded, model, optimizer, scaler, step, data.train, cfg, dist_info)
            if stop:
                return stopped(stop_signal, step, cfg, ckpt_path, out_dir, dist_info, log)

    # ------------------------------------------------------------------ finish
    finish(step, record, rate, inst, cfg, ckpt_path, out_dir, dist_info, log)
    return 0


def cli(argv: list[str] | None = None, on_step: Callable[[int], None] | None = None) -> int:
    """main() with the user's mistakes turned into one line on stderr and exit status 2."""
    try:
        return main(argv, on_step)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLoss, distributed.LostRank) as e:  # faults: one line, exit status 1
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.cleanup()  # on every exit path: a process group left behind hangs or leaks


if __name__ == "__main__":
    # record(): under torchrun, a failing rank's error reaches the launcher's summary, with its rank.
    sys.exit(record(cli)())
