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

IMPORTED_AT = time.time()  # the script's start-up begins here (the interpreter's own ~0.03 s before it)
# The CPU's malloc is this script's to choose, at its start (minigpt/core/cpu.py, set below): None
# where main() runs in an interpreter that started otherwise (a notebook, the tests).
CPU_MALLOC = None

if __name__ == "__main__":  # the CPU's malloc is chosen before torch loads: a re-exec then costs ~0
    from minigpt.errors import exit_quietly_on_interrupt

    exit_quietly_on_interrupt("train_minimal.py")  # a Ctrl-C while torch imports: one line, status 130
    from minigpt.core import cpu as CPU_MALLOC

    CPU_MALLOC.run_under_preferred_allocator(sys.argv[1:], IMPORTED_AT)
    IMPORTED_AT = CPU_MALLOC.script_started_at(IMPORTED_AT)  # the first process's start, through the re-exec

import logging
import math
import os
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import NamedTuple

import torch

from minigpt.core.config import (
    TrainConfig,
    UsageError,
    check_cuda_features,
    pad_vocab,
    parse_args,
    resolve_amp,
    resolve_device,
)
from minigpt.core.data import Batches, Data, load_data
from minigpt.core.model import GPT, GPTConfig, flops_per_token
from minigpt.core.runs import Outputs, RunDir, stop_on_signals
from minigpt.errors import INTERRUPTED, INTERRUPTED_LINE, LostRank, NonFiniteLoss, imports_done
from minigpt.instruments.instrument import (
    TORCH_DTYPES,
    Instruments,
    RunTotals,
    Throughput,
    device_peak,
    evaluation_notice,
)
from minigpt.ranks import DistInfo, Plan


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine / linear / constant down to cfg.min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps))
    if cfg.lr_scheduler == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        decay = 1.0 - progress
    return cfg.min_lr + decay * (cfg.lr - cfg.min_lr)


def build_model(cfg: TrainConfig, vocab_size: int, device: str) -> GPT:
    """GPT-2 in the flags' shape (minigpt/core/model.py)."""
    config = GPTConfig(
        vocab_size=pad_vocab(vocab_size),  # 50257 -> 50304: multiples of 64 run faster
        max_position_embeddings=cfg.max_position_embeddings,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        dropout=cfg.dropout,
        activation_checkpoint=cfg.use_activation_checkpoint,
        chunked_loss=cfg.chunked_loss,
    )
    return GPT(config).to(device)


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig, sharded: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear weights, embeddings) only, not on biases and
    LayerNorm gains; the fused kernel, on the CPU too (benchmarks/results/cpu-small.md)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if sharded:  # the fused kernel takes one kind of tensor per group: plain, or DTensors of one mesh
        from minigpt.core.parallel import split_by_mesh

        groups = split_by_mesh(groups)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


@torch.no_grad()
def evaluate(model: GPT, batches: Batches, iters: int, device: str, autocast, stop: list) -> float | None:
    """Mean loss over the same `iters` validation batches every time, so evaluations compare. None
    once `stop` holds a signal (SIGINT/SIGTERM): the run stops after the next step, not the last batch."""
    model.eval()
    losses = []
    while len(losses) < iters and not stop:
        if CPU_MALLOC:  # the kept heap's free blocks back to the system (minigpt/core/cpu.py)
            CPU_MALLOC.release_freed_memory()
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with autocast:
            losses.append(model(x, y)[1].float())
    if CPU_MALLOC:
        CPU_MALLOC.release_freed_memory()
    model.train()
    return torch.stack(losses).mean().item() if len(losses) == iters else None


def is_log_step(step: int, cfg: TrainConfig) -> bool:
    # An evaluation step is a log step too, so --eval-interval holds whatever --log-interval is.
    return step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == cfg.num_steps


class Setup(NamedTuple):
    """What set_up() builds and the loop trains with, in the order train() unpacks it."""

    cfg: TrainConfig
    device: str
    dist_info: DistInfo
    plan: Plan
    data: Data
    model: GPT
    ddp_model: torch.nn.Module  # DDP from 2 ranks on (FSDP and TP wrap the model in place)
    train_model: torch.nn.Module  # ddp_model, compiled under --compile
    ranks: object  # the other ranks, under torchrun (minigpt/instruments/straggler.py's Ranks); else None
    clip_grad_norm: Callable  # torch's, or for DTensor gradients minigpt/core/parallel.py's
    optimizer: torch.optim.AdamW
    scaler: torch.amp.GradScaler
    autocast: object
    step: int  # the checkpoint's step, 0 for a fresh run
    inst: Instruments
    rate: Throughput
    run: RunDir
    log: logging.Logger


def set_up(argv: list[str] | None, held: ExitStack) -> Setup | None:
    """Flags -> process group -> run directory guarded -> data, model, optimizer -> checkpoint
    restored -> run directory opened. None for --estimate-memory, which builds nothing."""
    cfg = parse_args(argv)
    device = resolve_device(cfg.device)
    check_cuda_features(cfg, device)
    amp_on, amp_dtype, amp_note = resolve_amp(cfg, device)
    batch_note = None
    if cfg.estimate_memory or cfg.auto_batch_size:  # the estimator, loaded when a flag asks for it
        from minigpt.instruments.estimate import estimate_report, fit_batch_size

        cfg.batch_size, batch_note = fit_batch_size(cfg, device, amp_dtype)  # --auto-batch-size (CUDA)
        if cfg.estimate_memory:  # the predicted memory of this configuration: no model, no run directory
            print(estimate_report(cfg, device, amp_dtype, amp_note))
            return None
    malloc_note = None  # before the first big allocation
    if CPU_MALLOC and device == "cpu":
        malloc_note = CPU_MALLOC.choose_allocator(cfg.keep_freed_memory)
    dist_info, plan = DistInfo(), Plan()  # a single process: rank 0 of a world of 1
    if "WORLD_SIZE" in os.environ or cfg.asks_for_ranks():  # torchrun: the process group and the mesh
        from minigpt.core.distributed import join

        dist_info, plan = join(cfg, device)
    torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
    run = RunDir(cfg, dist_info, plan.sharded)  # rank 0's folder on every rank, and the checkpoint's path
    run.guard(held)  # rank 0: every output path probed, the folder locked, stale files removed

    # ------------------------------------------------------------------ data, model, optimizer
    data = load_data(cfg, plan.dp_rank, pin=device == "cuda")  # the ranks of a tp group share batches
    inst = Instruments(cfg, device, dist_info.rank, dist_info.world_size, run.path, plan.worker, plan.sharded)
    if dist_info.enabled or cfg.simulate_slow_rank:  # a stage's parts timed apart, a rank slowed on purpose
        from minigpt.instruments.straggler import RankTimer

        inst.timer = RankTimer(device, cfg.stage_timing, cfg.simulate_slow_rank, dist_info.rank)
    model = build_model(cfg, data.vocab_size, device)
    flops = flops_per_token(model, cfg.seq_len) // plan.tp  # before sharding; a tp group splits the model
    plan_note = None
    if plan.sharded:  # in place, into DTensors: before the optimizer, which must hold those
        from minigpt.core.parallel import describe, parallelize

        parallelize(model, cfg, plan.mesh, device, amp_dtype)
        plan_note = f"{describe(plan, amp_dtype)}; {dist_info.backend} backend"
    if plan.dp_rank:  # different dropout masks per data-parallel rank (a tp group's ranks share theirs)
        torch.manual_seed(cfg.seed + plan.dp_rank)
    optimizer = configure_optimizer(model, cfg, plan.sharded)
    scaler = torch.amp.GradScaler(device, enabled=amp_dtype == "fp16")  # fp16's narrow range: loss scaling
    autocast = torch.autocast(device, dtype=TORCH_DTYPES[amp_dtype]) if amp_on else nullcontext()
    step = run.restore(model, optimizer, scaler, data.train)  # with --resume; 0 otherwise
    ddp_model = model
    if dist_info.enabled and not plan.sharded:  # DDP from 2 ranks on (FSDP and TP wrap in place)
        from minigpt.core.distributed import ddp_note, wrap_ddp

        ddp_model, plan_note = wrap_ddp(model, dist_info, device), ddp_note(dist_info)
    train_model = torch.compile(ddp_model, mode=cfg.compile_mode) if cfg.compile else ddp_model
    ranks = None  # under torchrun: one grad sync per step, one stop for all, lost and slow ranks named
    if dist_info.enabled:
        from minigpt.instruments.straggler import Ranks

        ranks = Ranks(cfg, dist_info, run.path, ddp_model)
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    if plan.sharded:
        from minigpt.core.parallel import clip_grad_norm  # DTensor gradients too
    peak = device_peak(cfg.peak_tflops, device, dist_info)  # MFU's denominator: the device's fastest dtype
    tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps  # per rank and step
    totals = RunTotals(tokens * plan.dp)
    rate = Throughput(tokens, plan.dp, flops, peak, amp_dtype, step, cfg.num_steps, data.train_tokens, totals)

    # ------------------------------------------------------------------ run directory
    memory = None  # --memory-profiler: the predicted memory, shown beside the measured
    if cfg.memory_profiler:
        from minigpt.instruments.estimate import memory_estimate

        memory = memory_estimate(cfg, model.cfg.vocab_size, amp_dtype, device, plan)
    log = run.open(model, data, rate, [amp_note, malloc_note, plan_note, batch_note])
    inst.attach(model, optimizer, step + 1, memory, ddp_model)  # with DDP: the backward's compute timed apart
    return Setup(cfg, device, dist_info, plan, data, model, ddp_model, train_model, ranks, clip_grad_norm,
                 optimizer, scaler, autocast, step, inst, rate, run, log)  # fmt: skip


def main(argv: list[str] | None = None, on_step: Callable[[int], None] | None = None) -> int:
    """Train. `on_step(n)` is called just before training step n (1-based) runs: the seam through
    which tests and notebooks stop or inspect a run at a chosen step (e.g. send SIGTERM in step 4)."""
    # Start-up counts from the script's start (imports included), or from this call when main()
    # runs in an interpreter that imported everything before (a notebook, the tests).
    started_at = IMPORTED_AT if __name__ == "__main__" else time.time()
    with ExitStack() as held:  # what the run holds until it returns, however it returns: its directory's lock
        s = set_up(argv, held)
        return 0 if s is None else train(s, on_step, started_at)


def train(s: Setup, on_step: Callable[[int], None] | None, started_at: float) -> int:
    """The loop, with what set_up() built under the names it reads."""
    (cfg, device, dist_info, plan, data, model, ddp_model, train_model, ranks, clip_grad_norm,
     optimizer, scaler, autocast, step, inst, rate, run, log) = s  # fmt: skip
    is_main = dist_info.is_main
    outputs = Outputs(run.path, log, is_main, purge_step=step + 1)  # log lines, metrics.jsonl, TensorBoard
    lost = ranks.watch(run) if ranks else None  # a rank lost mid-run: one line on the others

    # ------------------------------------------------------------------ train loop
    model.train()
    losses, val = [], None
    rate.totals.start(started_at)  # start-up ends here: the run-wide figures count from now
    # SIGINT / SIGTERM finish the step in flight, save, and leave; a second Ctrl-C kills at once.
    with stop_on_signals() as stop_signal, outputs, inst, lost or nullcontext(), ranks or nullcontext():
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
                    with ranks.no_grad_sync(micro == cfg.grad_accum_steps - 1) if ranks else nullcontext():
                        with inst.stage("forward"), autocast:
                            # only the loss is kept: logits (b x s x vocab) held would add to the next peak
                            loss = train_model(x, y)[1] / cfg.grad_accum_steps  # mean of micro-batches
                        with inst.stage("backward"):
                            scaler.scale(loss).backward()
                    step_loss += loss.detach()
                with inst.stage("optimizer_step"):
                    lr = get_lr(step, cfg)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    if cfg.grad_clip > 0:
                        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                        clip_grad_norm(model.parameters(), cfg.grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step += 1
            if CPU_MALLOC and len(inst.step_times) == 1:  # mimalloc keeps freed pages longer than a step
                CPU_MALLOC.outlast_first_step(inst.step_times[step], log)
            losses.append(step_loss)
            last = step == cfg.num_steps
            stop = ranks.any(bool(stop_signal)) if ranks else bool(stop_signal)  # all ranks stop at one step

            if is_log_step(step, cfg) or stop:  # outside the step: not in its clock nor in its ProfilerStep
                values = run.check_finite(losses, step, rate.amp)
                interval = inst.interval()  # the steady steps' times; warm-up and instrumented ones apart
                val = None  # a val loss only at the step it was evaluated: never carried as new
                # sharded: every rank takes part (the forward has collectives)
                if (is_main or plan.sharded) and (step % cfg.eval_interval == 0 or last):
                    if notice := evaluation_notice(cfg.eval_iters, interval, cfg.grad_accum_steps):
                        log.info(notice)  # a long evaluation is not silence
                    stop_eval = [] if plan.sharded else stop_signal  # sharded: all ranks, to the end
                    val = evaluate(model, data.make_val(), cfg.eval_iters, device, autocast, stop_eval)
                logged = rate.record(step, values, lr, val, interval)
                outputs.write(logged)
                if ranks:
                    ranks.report_stragglers(step, interval, log)
                losses = []
            if run.saves and (last or stop or cfg.save_interval and step % cfg.save_interval == 0):
                run.check_finite(losses, step, rate.amp)  # the steps since the log line, before a save
                run.save(step)
            if stop:
                from minigpt.core.finish import stopped

                return stopped(run, stop_signal, step, log)

    # ------------------------------------------------------------------ finish
    from minigpt.analysis.report import write_report  # what only the end needs, loaded at the end
    from minigpt.core.finish import finish
    from minigpt.instruments.predict import run_prediction

    finish(run, log, inst.profiler_cost(), rate, logged, run_prediction, write_report)
    return 0


def cli(argv: list[str] | None = None, on_step: Callable[[int], None] | None = None) -> int:
    """main() with the user's mistakes turned into one line on stderr and exit status 2."""
    try:
        return main(argv, on_step)
    except (UsageError, NonFiniteLoss, LostRank) as e:  # a mistake exits 2; a fault (a NaN, a lost rank) 1
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:  # outside the loop (in it, a signal stops the run at a step and saves)
        print(f"error: {INTERRUPTED_LINE} (outside the training loop)", file=sys.stderr)
        return INTERRUPTED
    finally:
        if "minigpt.core.distributed" in sys.modules:  # on every exit path: a process group left behind
            sys.modules["minigpt.core.distributed"].cleanup()  # hangs or leaks


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing import errors

    imports_done()  # a Ctrl-C from here on is KeyboardInterrupt: cli() and the loop handle it
    # errors.record: under torchrun, a failing rank's error reaches the launcher's summary, with its rank.
    sys.exit(errors.record(cli)())
