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

import json
import math
import os
import platform
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from minigpt import distributed
from minigpt.checkpoint import check_same_shape, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from minigpt.config import (EXTRA_ARGS_ENV, TrainConfig, UsageError, check_cuda_features, parse_args,
                            profile_ranks, resolve_amp, resolve_device)
from minigpt.cpu import keep_freed_memory
from minigpt.data import (Batches, ToyBatches, builtin_corpus, check_enough_tokens, get_tokenizer,
                          load_tokens, split_train_val)
from minigpt.fileio import atomic_write
from minigpt.instrument import (STAGES, MemoryHistory, NsysCaptureRange, StageTimer, cuda_memory_report,
                                has_device_kernels, make_profiler, top_operators)
from minigpt.estimate import estimate_gpt, estimate_report, gpt_shape
from minigpt.memory import capture_memory, format_breakdown, write_memory_trace
from minigpt.metrics import (JsonlWriter, TensorBoardLogger, format_duration, format_log_line, mfu, peak_flops,
                             perplexity, setup_logging)
from minigpt.model import GPT, GPTConfig, flops_per_token, pad_vocab
from minigpt.straggler import StragglerDetector, format_report, parse_slow_rank, rank_figures

# Every file a run writes, relative to its run directory.
RUNS_ROOT = Path("runs")
CONFIG_FILE = "config.json"
LOG_FILE = "train.log"
METRICS_FILE = "metrics.jsonl"
STRAGGLERS_FILE = "stragglers.jsonl"
CHECKPOINT_FILE = Path("checkpoints") / "ckpt.pt"
TENSORBOARD_DIR = "tb"
TRACE_DIR = "traces"
OPS_FILE = "traces/rank{rank}_ops.txt"
SNAPSHOT_FILE = "snapshots/rank{rank}_snapshot.pickle"
OOM_SNAPSHOT_FILE = "snapshots/oom_rank{rank}_snapshot.pickle"
MEMORY_TRACE_DIR = "memory_trace/rank{rank}_dp{rank}"  # memory.log and *_sunburst.html (--memory-profiler)


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
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, iters: int, device: str, autocast) -> float:
    """Mean loss over the same `iters` validation batches every time, so evaluations compare."""
    model.eval()
    losses = []
    for _ in range(iters):
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with autocast:
            losses.append(model(x, y)[1].float())
    model.train()
    return torch.stack(losses).mean().item()


def resolve_out_dir(cfg: TrainConfig) -> Path:
    """The run directory. --resume without --out-dir continues the latest run that has a checkpoint."""
    if cfg.out_dir:
        return Path(cfg.out_dir)
    if cfg.resume and not cfg.checkpoint_path:
        runs = sorted(p.parent.parent for p in RUNS_ROOT.glob(f"*/{CHECKPOINT_FILE}"))
        if not runs:
            raise UsageError(f"--resume: no run in {RUNS_ROOT}/ has a checkpoint; pass --out-dir or --checkpoint-path")
        return runs[-1]
    out = RUNS_ROOT / datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 1
    while out.exists():  # two runs started in the same second
        out, n = RUNS_ROOT / f"{datetime.now():%Y%m%d-%H%M%S}-{n}", n + 1
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


def main(argv: list[str] | None = None) -> int:
    # ------------------------------------------------------------------ flags
    cfg = parse_args(argv)
    device = resolve_device(cfg.device)
    check_cuda_features(cfg, device)
    amp_on, amp_dtype, amp_note = resolve_amp(cfg, device)
    if device == "cpu":  # before the first big allocation
        malloc_note = (keep_freed_memory() if cfg.keep_freed_memory
                       else "CPU allocator: glibc defaults (--no-keep-freed-memory)")
    if cfg.estimate_memory:  # the predicted memory of this configuration: no model, no run directory
        print(estimate_report(cfg, device, amp_dtype, amp_note))
        return 0
    slow = parse_slow_rank(cfg.simulate_slow_rank, STAGES) if cfg.simulate_slow_rank else None
    if cfg.ddp_backend == "nccl" and device != "cuda":
        raise UsageError("--ddp-backend nccl needs CUDA GPUs; on the CPU use gloo (the default there)")
    # Under torchrun: join the process group (NCCL on CUDA, gloo on the CPU). Otherwise world size 1.
    dist_info = distributed.setup(device, cfg.ddp_backend, cfg.ddp_timeout)
    rank, world_size, is_main = dist_info.rank, dist_info.world_size, dist_info.is_main
    ranks = profile_ranks(cfg.profile_ranks, world_size)
    profiled = ranks is None or rank in ranks  # this rank takes part in --use-profiler / --nsys / history
    if slow and slow.rank >= world_size:
        raise UsageError(f"--simulate-slow-rank {cfg.simulate_slow_rank}: no rank {slow.rank} in a world of {world_size}")
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    out_dir = Path(distributed.gather(str(resolve_out_dir(cfg)), dist_info)[0])  # rank 0's choice
    ckpt_path = Path(cfg.checkpoint_path) if cfg.checkpoint_path else out_dir / CHECKPOINT_FILE
    if not cfg.resume and ckpt_path.exists():
        raise UsageError(f"{ckpt_path} already exists; pass --resume to continue that run, "
                         "or choose another --out-dir / --checkpoint-path")

    # ------------------------------------------------------------------ data
    # Everything is read and checked before the run directory is touched: a mistake costs nothing.
    pin = device == "cuda"  # page-locked batches make the host-to-device copy asynchronous
    if cfg.use_toy_data:
        data_name, vocab_size, train_tokens = "toy sequences", cfg.vocab_size, None
        train_batches = ToyBatches(vocab_size, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin)
        make_val_batches = lambda: ToyBatches(vocab_size, cfg.batch_size, cfg.seq_len, cfg.data_seed,  # noqa: E731
                                              stream=1, pin_memory=pin)
    else:
        train_files = cfg.train_data or [builtin_corpus()]
        data_name = ", ".join(map(str, train_files)) if cfg.train_data else "built-in corpus (pydoc_data topics)"
        tokens = load_tokens(train_files, cfg.tokenizer_name, cfg.max_tokens)
        if cfg.val_data:
            train_tokens, val_tokens = tokens, load_tokens(cfg.val_data, cfg.tokenizer_name)
        else:
            train_tokens, val_tokens = split_train_val(tokens)
        check_enough_tokens(train_tokens, cfg.seq_len, "the training data")
        check_enough_tokens(val_tokens, cfg.seq_len, "the validation data")
        n_vocab = get_tokenizer(cfg.tokenizer_name).n_vocab
        if cfg.vocab_size is not None and cfg.vocab_size < n_vocab:
            raise UsageError(f"--vocab-size {cfg.vocab_size} is smaller than the {cfg.tokenizer_name} "
                             f"tokenizer's {n_vocab} ids; drop --vocab-size or raise it")
        vocab_size = cfg.vocab_size or n_vocab
        train_batches = Batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin)
        make_val_batches = lambda: Batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed,  # noqa: E731
                                           stream=1, pin_memory=pin)

    # ------------------------------------------------------------------ model, optimizer
    memory_history = None
    if cfg.record_memory_history and profiled:  # before the model exists, so its allocations are in it
        memory_history = MemoryHistory(cfg.memory_history_entries)
        memory_history.start()
        memory_history.dump_on_oom(out_dir / OOM_SNAPSHOT_FILE.format(rank=rank))
    snapshot_path = Path(cfg.memory_snapshot_path or out_dir / SNAPSHOT_FILE.format(rank=rank))
    if cfg.memory_snapshot_path and world_size > 1:  # one file per rank, never overwritten by another
        snapshot_path = snapshot_path.with_name(f"rank{rank}_{snapshot_path.name}")
    snapshot_dumped = False
    model_cfg = GPTConfig(
        vocab_size=pad_vocab(vocab_size), max_position_embeddings=cfg.max_position_embeddings,
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=cfg.d_model, d_ff=cfg.d_ff,
        dropout=cfg.dropout, activation_checkpoint=cfg.use_activation_checkpoint,
    )
    model = GPT(model_cfg).to(device)
    if rank:
        torch.manual_seed(cfg.seed + rank)  # different dropout masks on each rank
    optimizer = configure_optimizer(model, cfg, device)
    # fp16 needs loss scaling (its range is narrow); bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device, enabled=amp_dtype == "fp16")
    autocast = (torch.autocast(device, dtype=torch.bfloat16 if amp_dtype == "bf16" else torch.float16)
                if amp_on else nullcontext())

    step = 0
    if cfg.resume:
        state = load_checkpoint(ckpt_path)
        check_same_shape(state["model_config"], asdict(model_cfg), ckpt_path)
        if state["step"] >= cfg.num_steps:
            raise UsageError(f"checkpoint {ckpt_path} is at step {state['step']}, already past "
                             f"--num-steps {cfg.num_steps}; raise --num-steps to train further")
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise UsageError(f"checkpoint {ckpt_path} does not fit this run's flags (model, optimizer or "
                             f"--amp-dtype differ: {str(e).splitlines()[0]}); resume with the flags it was "
                             "trained with") from None
        step = state["step"]
        train_batches.position = state["data_position"]
        per_rank = state.get("rng_per_rank") or []
        # last: building the model above drew from the generators
        if len(per_rank) == world_size:
            set_rng_state(per_rank[rank])
        else:  # the world size changed: exact continuation is impossible, keep the ranks' streams apart
            set_rng_state(state["rng"])
            torch.manual_seed(cfg.seed + rank + state["step"])
    ddp_model = distributed.wrap_ddp(model, dist_info, device)  # the model itself if world size 1
    train_model = torch.compile(ddp_model) if cfg.compile else ddp_model
    model_flops_per_token = flops_per_token(model, cfg.seq_len)
    peak, peak_source = peak_flops(device, amp_dtype)

    # ------------------------------------------------------------------ run directory
    out_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging(out_dir / LOG_FILE, rank)  # rank 0 writes the log, metrics, TensorBoard, checkpoints
    metrics_file = JsonlWriter(out_dir / METRICS_FILE, enabled=is_main)
    stragglers_file = JsonlWriter(out_dir / STRAGGLERS_FILE, enabled=is_main and world_size > 1)
    device_name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    if is_main:
        write_json_atomic(out_dir / CONFIG_FILE, {
            "config": cfg.to_dict(), "model": asdict(model_cfg), "device": device, "device_name": device_name,
            "amp": amp_dtype, "params": model.num_params(non_embedding=False),
            "flops_per_token": model_flops_per_token, "peak_flops": peak, "peak_flops_source": peak_source,
            "world_size": world_size, "ddp_backend": dist_info.backend,
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        })
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
    log.info(f"Training started; run directory {out_dir}")
    if os.environ.get(EXTRA_ARGS_ENV):
        log.info(f"Flags appended from ${EXTRA_ARGS_ENV}: {os.environ[EXTRA_ARGS_ENV]}")
    log.info(f"Device: {device} ({device_name}), torch {torch.__version__}; {amp_note}")
    if device == "cpu":
        log.info(malloc_note)
    if world_size > 1:
        log.info(f"DDP: {world_size} ranks, {dist_info.backend} backend; every rank draws its own batches")
    log.info(f"Data: {data_name}" + ("" if train_tokens is None else
             f"; {len(train_tokens):,} training tokens, {len(val_tokens):,} validation tokens"))
    log.info(f"Model: {cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}, "
             f"vocab {model_cfg.vocab_size}, {model.num_params(non_embedding=False) / 1e6:.2f}M parameters"
             + (", activation checkpointing" if cfg.use_activation_checkpoint else ""))
    log.info(f"Batch: {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum_steps} accumulation = "
             f"{tokens_per_step:,} tokens per step per rank; {cfg.num_steps} steps")
    log.info(f"MFU peak: {peak / 1e12:.2f} TFLOP/s per device ({peak_source})")
    log.info(f"Resumed from {ckpt_path} at step {step}" if cfg.resume else "Starting from scratch")
    tensorboard = TensorBoardLogger(out_dir / TENSORBOARD_DIR, enabled=is_main)

    # ------------------------------------------------------------------ instrumentation
    timer = StageTimer(device, enabled=cfg.stage_timing,
                       sleep_ms={slow.stage: slow.ms} if slow and slow.rank == rank else None)
    if world_size > 1 and cfg.stage_timing:  # the backward's compute without the all-reduce wait
        timer.add_split("backward", "backward_compute")
        distributed.time_backward_compute(ddp_model, lambda: timer.split("backward", "backward_compute"))
    stragglers = StragglerDetector(cfg.straggler_threshold)
    step_times: dict[int, float] = {}  # host seconds of each step, to price the profiler window
    window = range(cfg.profile_step_start, cfg.profile_step_end)

    def on_profile_window_end(prof) -> None:
        ops = top_operators(prof, device)
        ops_path = out_dir / OPS_FILE.format(rank=rank)
        atomic_write(ops_path, ops)
        log.info(f"Profiled steps {window.start}-{window.stop - 1}; top operators (also in {ops_path}):\n{ops}")
        if device == "cuda" and not has_device_kernels(prof):
            log.warning("WARNING: the trace holds no CUDA kernel events: CUPTI recorded nothing "
                        "(check that the CUDA profiling libraries match the driver)")
        before = [t for s, t in step_times.items() if 2 <= s < window.start - 1]  # not step 1, not warm-up
        during = [step_times[s] for s in window if s in step_times]
        if before and during:
            b, d = sum(before) / len(before), sum(during) / len(during)
            log.info(f"Profiler cost: {1000 * d:.0f} ms/step profiled vs {1000 * b:.0f} ms/step before "
                     f"({d / b:.2f}x)")
        elif during:
            log.info("Profiler cost: not priced, no unprofiled step to compare with (step 1 allocates "
                     "everything and the step before the window is the profiler's warm-up; start at step 4 or later)")
        log.info(f"View the trace: tensorboard --logdir {out_dir}, or open {out_dir / TRACE_DIR}/*.json.gz "
                 "in ui.perfetto.dev, or run python -m minigpt.traces on it")

    profiler = None
    if cfg.use_profiler and profiled and step < window.start:
        profiler = make_profiler(out_dir / TRACE_DIR, rank, step + 1, window.start, window.stop, device,
                                 cfg.profile_with_stack, on_profile_window_end)
    nsys = NsysCaptureRange(window.start, window.stop) if cfg.nsys and profiled and step < window.start else None
    if (cfg.use_profiler or cfg.nsys) and step >= window.start:
        log.warning(f"the profile window starts at step {window.start}, but this run resumes at step {step}: "
                    "nothing is profiled (pass a later --profile-step-start/--profile-step-end)")
    # --memory-profiler: one whole step measured (minigpt/memory.py), the estimate beside it.
    memory_step = cfg.memory_profile_step if cfg.memory_profiler and profiled else None
    memory_estimate = estimate_gpt(**gpt_shape(cfg, model_cfg.vocab_size), amp_dtype=amp_dtype, device=device,
                                   activation_checkpoint=cfg.use_activation_checkpoint) if memory_step else None
    memory_breakdown: dict | None = None  # the measured step's figures, for the next metrics line
    if memory_step and step >= memory_step:
        log.warning(f"--memory-profiler: step {memory_step} was done before the resume at step {step}; "
                    "nothing is measured (pass a later --memory-profile-step)")

    def checkpoint_state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "data_position": train_batches.position, "rng": rng_state(),
                "rng_per_rank": distributed.gather(rng_state(), dist_info),  # each rank's dropout stream
                "config": cfg.to_dict(), "model_config": asdict(model_cfg)}

    # ------------------------------------------------------------------ train loop
    model.train()
    start_step, t_start = step, time.perf_counter()
    interval_losses: list[torch.Tensor] = []  # one device scalar per step: no sync until we log
    interval_time = 0.0
    last_val: float | None = None

    def check_finite() -> list[float]:
        """Read the interval's losses (this syncs) and stop at the first non-finite one, on every
        rank together (each rank sees only its own loss)."""
        values = torch.stack(interval_losses).tolist()
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if distributed.any_rank(bad is not None, dist_info):
            where = (f"loss is {values[bad]} at step {step - len(values) + bad + 1}" if bad is not None
                     else f"another rank's loss became non-finite by step {step}")
            raise NonFiniteLoss(f"{where}; the last good checkpoint ({ckpt_path}) was left intact; "
                                "lower --lr or use --amp-dtype bf16")
        return values

    # SIGINT / SIGTERM finish the step in flight, save, and leave; a second Ctrl-C kills at once.
    with stop_on_signals() as stop_signal, metrics_file, stragglers_file, tensorboard, profiler or nullcontext():
        while step < cfg.num_steps:
            if nsys:
                nsys.before_step(step + 1)
            t0 = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            measure = capture_memory(model, optimizer, step + 1) if step + 1 == memory_step else nullcontext()
            with measure, timer.step():
                for micro in range(cfg.grad_accum_steps):
                    batch = next(train_batches)  # host memory (pinned on CUDA)
                    with timer.stage("data_to_device"):
                        x, y = (t.to(device, non_blocking=True) for t in batch)
                    # DDP all-reduces the gradients in the last micro-batch's backward only.
                    with distributed.no_grad_sync(ddp_model, sync=micro == cfg.grad_accum_steps - 1):
                        with timer.stage("forward"), autocast:
                            _, loss = train_model(x, y)
                            loss = loss / cfg.grad_accum_steps  # the mean over the micro-batches
                        with timer.stage("backward"):
                            scaler.scale(loss).backward()
                    step_loss += loss.detach()
                with timer.stage("optimizer_step"):
                    lr = get_lr(step, cfg)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    if cfg.grad_clip > 0:
                        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step += 1
            interval_losses.append(step_loss)
            last = step == cfg.num_steps
            stop = distributed.any_rank(bool(stop_signal), dist_info)  # every rank stops at the same step
            # An evaluation step is a log step too, so --eval-interval holds whatever --log-interval is.
            log_now = step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or last or stop
            if log_now and device == "cuda":
                torch.cuda.synchronize()  # the interval's time must include the work still queued
            step_times[step] = time.perf_counter() - t0
            interval_time += step_times[step]
            # After the clock: writing the trace or the snapshot is not training time.
            if profiler:
                profiler.step()
            if memory_history and step == window.stop - 1:  # the end of the window: a snapshot of it
                memory_history.dump(snapshot_path)
                snapshot_dumped = True
            if step == memory_step:  # the measured step: memory_trace/, the log, the next metrics line
                memory_dir = out_dir / MEMORY_TRACE_DIR.format(rank=rank)
                write_memory_trace(measure.breakdown, memory_dir, memory_estimate)
                log.info(f"{format_breakdown(measure.breakdown, memory_estimate)}\n  memory.log and sunburst "
                         f"charts: {memory_dir}")
                memory_breakdown = measure.breakdown.to_record(memory_estimate)

            if log_now:
                losses = check_finite()
                if is_main and (step % cfg.eval_interval == 0 or last):
                    last_val = evaluate(model, make_val_batches(), cfg.eval_iters, device, autocast)
                step_time = interval_time / len(losses)
                stages = timer.read()
                record = {
                    "step": step, "num_steps": cfg.num_steps, "loss": sum(losses) / len(losses), "lr": lr,
                    "epoch": (1 + (step * tokens_per_step * world_size) // len(train_tokens)
                              if train_tokens is not None else 1),
                    "step_time_s": step_time, "tokens_per_s": world_size * tokens_per_step / step_time,
                    "tokens_per_s_per_rank": tokens_per_step / step_time, "world_size": world_size,
                    "val_loss": last_val, "val_ppl": None if last_val is None else perplexity(last_val),
                    "elapsed_s": time.perf_counter() - t_start, "eta_s": step_time * (cfg.num_steps - step),
                    "amp": amp_dtype, "mfu": mfu(model_flops_per_token, tokens_per_step / step_time, peak),
                    "stage_host_ms": stages.host_ms, "stage_device_ms": stages.device_ms,
                    "memory": cuda_memory_report() if device == "cuda" else {},
                }
                if memory_breakdown is not None:  # bytes; "total" is the CPU's peak-memory figure
                    record["memory_breakdown"], memory_breakdown = memory_breakdown, None
                log.info(format_log_line(record))
                metrics_file.write(record)
                tensorboard.log(record)
                if world_size > 1 and stages.host_steps:  # every rank's medians, scored for stragglers
                    mine = rank_figures(rank, dist_info.host, [1000 * step_times[s] for s in
                                        range(step - len(losses) + 1, step + 1)], stages.device_steps)
                    for report in stragglers.update(step, distributed.gather(mine, dist_info)):
                        if is_main:
                            log.warning(format_report(report, cfg.straggler_threshold))
                            stragglers_file.write(report)
                interval_losses, interval_time = [], 0.0

            if step % cfg.save_interval == 0 or last or stop:
                if interval_losses:
                    check_finite()
                if not all(torch.isfinite(p).all() for p in model.parameters()):
                    raise NonFiniteLoss(f"the weights became non-finite at step {step}; the last good "
                                        f"checkpoint ({ckpt_path}) was left intact; lower --lr")
                state = checkpoint_state()  # on every rank: it gathers each rank's RNG state
                if is_main:
                    save_checkpoint(ckpt_path, state)
            if stop:
                distributed.barrier(dist_info)  # no rank leaves (and gets torn down) before the save is done
                signum = stop_signal[0] if stop_signal else signal.SIGTERM  # another rank's signal
                log.info(f"Stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to "
                         f"{ckpt_path}. Continue with: python train_minimal.py --resume --out-dir {out_dir} "
                         "(and the same flags)")
                return 128 + signum

    # ------------------------------------------------------------------ finish
    if nsys:
        nsys.stop()
    if memory_history:
        if not snapshot_dumped:  # the run ended before the window did
            memory_history.dump(snapshot_path)
        memory_history.stop()
        log.info(f"CUDA memory snapshot: {snapshot_path} (open it at pytorch.org/memory_viz)")
    elapsed = time.perf_counter() - t_start
    if is_main:
        log.info(f"Training finished: {step - start_step} steps in {format_duration(elapsed)}; "
                 f"val loss {last_val:.4f}, val ppl {perplexity(last_val):.1f}")
    log.info(f"Checkpoint: {ckpt_path}")
    log.info(f"Run directory: {out_dir} ({LOG_FILE}, {METRICS_FILE}, {CONFIG_FILE})")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """main() with the user's mistakes turned into one line on stderr and exit status 2."""
    try:
        return main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.cleanup()  # on every exit path: a process group left behind hangs or leaks


if __name__ == "__main__":
    # record(): under torchrun, a failing rank's error reaches the launcher's summary, with its rank.
    sys.exit(record(cli)())
