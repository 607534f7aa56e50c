"""Train a GPT on real text and see where the time and the memory go.

    python train_minimal.py                                  # built-in corpus, ~2 minutes on 2 CPU cores
    python train_minimal.py --preset tiny --num-steps 20     # a few seconds
    python train_minimal.py --use-toy-data --preset tiny     # synthetic task: a smoke test
    python train_minimal.py --resume --out-dir runs/RUN      # continue a stopped run
    python train_minimal.py --use-profiler                   # a profiler trace of steps 5-6
    python train_minimal.py --memory-profiler                # where the memory goes, measured at step 5
    python train_minimal.py --estimate-memory --preset gpt2  # predicted memory; builds nothing, exits

The file reads top to bottom: flags -> data, model, optimizer -> the loop -> finish.
"""

import sys
import time

STARTED_AT = time.time()  # the start-up is counted from here (the interpreter's own ~0.03 s before)
if __name__ == "__main__":
    from minigpt.config import exit_on_ctrl_c

    exit_on_ctrl_c("train_minimal.py")  # a Ctrl-C while torch imports: one line, status 130

import ctypes
import math
import os
from contextlib import ExitStack, nullcontext
from types import SimpleNamespace

import torch

from minigpt import config
from minigpt.config import pad_vocab, parse_args
from minigpt.core.data import builtin_tokens, load_data
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.runs import RunDir, stop_on_signals
from minigpt.errors import Fault, UsageError
from minigpt.instruments.instrument import Instruments
from minigpt.instruments.mfu import DTYPES, resolve_amp


def get_lr(step: int, cfg) -> float:
    """Linear warm-up to cfg.lr, then cosine, linear or constant down to cfg.min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps))
    decay = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress, "constant": 1}
    return cfg.min_lr + decay[cfg.lr_scheduler] * (cfg.lr - cfg.min_lr)


def keep_freed_memory() -> str | None:
    """glibc's malloc gives a freed big tensor's pages back to the system and faults them in again
    in the next step; told to keep them (no mmap, no trimming below 2 GiB: mallopt takes a C int)
    the CPU trainer runs faster (benchmarks/results/cpu-allocator.md). None where malloc is not
    glibc's (another libc, or another malloc in LD_PRELOAD, which glibc's mallopt would not rule)."""
    try:
        libc, address = ctypes.CDLL("libc.so.6"), lambda f: ctypes.cast(f, ctypes.c_void_p).value
        glibc = address(ctypes.CDLL(None).malloc) == address(libc.malloc)
        if glibc and libc.mallopt(-4, 0) == 1 == libc.mallopt(-1, 2**31 - 1):  # M_MMAP_MAX, M_TRIM_THRESHOLD
            return "CPU malloc: glibc keeps freed memory for the next step (--no-keep-freed-memory: not)"
    except (OSError, AttributeError):
        return None


def configure_optimizer(model: torch.nn.Module, cfg, sharded: bool) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices (weights, embeddings) only; the fused kernel, on the CPU too."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay}]
    groups.append({"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0})
    if sharded:  # the fused kernel takes one kind of tensor per group
        from minigpt.core.parallel import split_by_mesh

        groups = split_by_mesh(groups)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


@torch.no_grad()
def evaluate(model, batches, iters: int, autocast, stop: list, inst) -> float | None:
    """Mean loss over the same `iters` validation batches every time, so evaluations compare; None
    once `stop` holds a signal. The watch (instrument.py) says how far it got, every 10 s."""
    model.eval()
    losses, t0 = [], time.perf_counter()
    while len(losses) < iters and not stop:
        inst.doing = ("evaluation", t0, f"; {len(losses)} of {iters} batches done")
        x, y = (t.to(inst.device, non_blocking=True) for t in next(batches))
        with autocast:
            losses.append(model(x, y)[1].float())
    inst.doing = None
    model.train()
    return torch.stack(losses).mean().item() if len(losses) == iters else None


def main(argv: list[str] | None = None, on_step=None) -> int:
    """Train. `on_step(n)` is called just before step n (1-based) runs: the seam through which
    tests and notebooks stop or inspect a run at a chosen step."""
    started_at = STARTED_AT if __name__ == "__main__" else time.time()
    cfg = parse_args(argv)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    cuda_only = [n for n in ("nsys", "record_memory_history", "auto_batch_size", "tf32") if getattr(cfg, n)]
    if device == "cpu" and (cuda_only := cuda_only or ["ddp_backend"] * (cfg.ddp_backend == "nccl")):
        raise UsageError(f"{config.flag_name(cuda_only[0])} needs CUDA; this run is on the CPU")
    amp, amp_note = resolve_amp(cfg, device)
    notes = [amp_note]
    if cfg.estimate_memory or cfg.auto_batch_size:  # the estimator, loaded when a flag asks for it
        from minigpt.instruments.estimate import estimate_report, fit_batch_size

        cfg.batch_size, batch_note = fit_batch_size(cfg, device, amp)
        if cfg.estimate_memory:  # the predicted memory: no model, no run directory
            return print(estimate_report(cfg, device, amp, amp_note)) or 0
        notes.append(batch_note)
    if device == "cpu" and cfg.keep_freed_memory:  # before the first big allocation
        notes.append(keep_freed_memory())
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # TF32: --tf32, CUDA only
    with ExitStack() as held:  # what the run holds until it returns: its lock, its process group
        # A single process: rank 0 of a world of 1, writing the run's files, one data-parallel rank.
        dist_info = SimpleNamespace(rank=0, world_size=1, backend=None, is_main=True, enabled=False)
        plan = SimpleNamespace(dp_rank=0, dp=1, tp=1, sharded=False, worker="rank0_dp0")
        if "WORLD_SIZE" in os.environ or cfg.asks_for_ranks():  # torchrun: the process group and the mesh
            from minigpt.core.distributed import join

            dist_info, plan = join(cfg, device, held)
        torch.manual_seed(cfg.seed)  # the same on every rank: the same initial weights
        run = RunDir(cfg, dist_info, plan.sharded)  # rank 0's folder on every rank, the checkpoint's path
        run.guard(held)  # rank 0 locks the folder

        # ---------------------------------------------------------------- data, model, optimizer
        if cfg.use_toy_data:  # a smoke test's synthetic sequences: no corpus, no tokenizer
            from minigpt.core.toy import toy_data

            data = toy_data(cfg, plan.dp_rank, pin=device == "cuda")
        elif cfg.train_data or cfg.val_data or cfg.tokenizer_name != "gpt2":  # text or token files
            from minigpt.core.tokens import user_tokens

            data = load_data(cfg, user_tokens(cfg, dist_info.is_main), plan.dp_rank, pin=device == "cuda")
        else:  # the built-in corpus; a tp group's ranks share their batches (plan.dp_rank)
            data = load_data(cfg, builtin_tokens(), plan.dp_rank, pin=device == "cuda")
        shape = (cfg.max_position_embeddings, cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_ff)
        model_cfg = GPTConfig(pad_vocab(data.vocab_size), *shape, cfg.dropout, cfg.use_activation_checkpoint)
        model_cfg.chunked_loss = cfg.chunked_loss
        if cfg.init_from:  # OpenAI's GPT-2 weights, from a Hugging Face folder
            from minigpt.core.gpt2 import load_pretrained

            model = load_pretrained(cfg.init_from, model_cfg, cfg, data.vocab_size).to(device)
        else:
            model = GPT(model_cfg).to(device)
        clip_grad_norm = torch.nn.utils.clip_grad_norm_
        if plan.sharded:  # in place, into DTensors, before the optimizer that must hold them
            from minigpt.core.parallel import clip_grad_norm, describe, parallelize

            parallelize(model, cfg, plan.mesh, device, amp)
            notes.append(f"{describe(plan, amp)}; {dist_info.backend} backend")
        if plan.dp_rank:  # different dropout masks per data-parallel rank
            torch.manual_seed(cfg.seed + plan.dp_rank)
        optimizer = configure_optimizer(model, cfg, plan.sharded)
        scaler = torch.amp.GradScaler(device, enabled=amp == "fp16")  # fp16's narrow range: loss scaling
        autocast = torch.autocast(device, dtype=DTYPES[amp]) if amp != "fp32" else nullcontext()
        step = run.restore(model, optimizer, scaler, data.train)  # with --resume; 0 otherwise
        ranks, train_model = None, model
        if dist_info.enabled:  # DDP, one stop for every rank, lost and slow ranks named
            from minigpt.instruments.straggler import Ranks

            ranks = Ranks(cfg, device, dist_info, plan, model, run, notes)
            train_model = ranks.model  # DDP's wrapper (FSDP and TP work in place)
        train_model = torch.compile(train_model, mode=cfg.compile_mode) if cfg.compile else train_model
        window = None  # what a flag adds beside the step: the profiler window, the memory capture...
        if cfg.use_profiler or cfg.nsys or cfg.record_memory_history or cfg.memory_profiler or plan.sharded:
            from minigpt.instruments.window import Window

            window = Window(run, device, amp, plan, model, optimizer, step + 1)
        tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps  # per rank and step
        # What turns the clocks into figures: tokens, ranks, the model's size (its FLOPs), the dtype.
        rate = dict(tokens_per_step=tokens, dp=plan.dp, tp=plan.tp, vocab_size=model.cfg.vocab_size, amp=amp)
        rate |= dict(train_tokens=data.train_tokens, dist=dist_info, is_main=dist_info.is_main)
        inst = Instruments(cfg, device, rate, run, window, step + 1, started_at)
        inst.timer = ranks.timer(inst.timer) if ranks else inst.timer
        notes.append(window and window.note)  # what a flag's instrument prints that looks like trouble
        log = run.open(model, data, dict(device=device, amp=amp), notes)

        # ---------------------------------------------------------------- the loop
        model.train()
        losses = []
        # SIGINT, SIGTERM, SIGHUP finish the step in flight, save and stop; a second Ctrl-C kills at once.
        with stop_on_signals() as stop_signal, inst, ranks or nullcontext():
            while step < cfg.num_steps:
                if on_step:
                    on_step(step + 1)
                step_loss, last = torch.zeros((), device=device), step + 1 == cfg.num_steps
                log_step = (step + 1) % cfg.log_interval == 0 or (step + 1) % cfg.eval_interval == 0 or last
                with inst.step(step + 1, sync=log_step):
                    for micro in range(cfg.grad_accum_steps):
                        batch = next(data.train)  # host memory (pinned on CUDA)
                        with inst.stage("data_to_device"):
                            x, y = (t.to(device, non_blocking=True) for t in batch)
                        if ranks:  # the gradients are all-reduced in the last micro-batch's backward only
                            ranks.sync_gradients(micro == cfg.grad_accum_steps - 1)
                        with inst.stage("forward"), autocast:
                            # only the loss is kept: logits (b x s x vocab) held would add to the next peak
                            loss = train_model(x, y)[1] / cfg.grad_accum_steps
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
                losses.append(step_loss)
                stop = ranks.any(bool(stop_signal)) if ranks else bool(stop_signal)  # every rank at one step

                if log_step or stop:  # outside the step: in neither its clock nor its ProfilerStep
                    values = run.check_finite(losses, step, amp)
                    val = None  # a validation loss only at the step it was evaluated
                    if (dist_info.is_main or plan.sharded) and (step % cfg.eval_interval == 0 or last):
                        stop_eval = [] if plan.sharded else stop_signal  # sharded: every rank, to the end
                        val = evaluate(model, data.make_val(), cfg.eval_iters, autocast, stop_eval, inst)
                    run.write(record := inst.record(step, values, lr, val))  # the log, metrics.jsonl, TB
                    if ranks:
                        ranks.report_stragglers(step, inst, log)
                    losses = []
                if run.saves and (last or stop or cfg.save_interval and step % cfg.save_interval == 0):
                    run.check_finite(losses, step, amp)  # the steps since the log line, before a save
                    run.save(step)
                if stop:
                    from minigpt.core.finish import stopped

                    return stopped(run, stop_signal, step, log)

        # ---------------------------------------------------------------- finish
        from minigpt.core.finish import finish  # what only the end needs, loaded at the end

        finish(run, log, inst, record)
        return 0


def cli(argv: list[str] | None = None, on_step=None) -> int:
    """main() with a user's mistake as one line and status 2; a fault (a NaN, a lost rank, a full
    disk) as one line and status 1."""
    try:
        return main(argv, on_step)
    except (UsageError, Fault) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except OSError as e:
        from minigpt.fileio import disk_full_line  # a diagnosis, loaded when the failure happens

        if not (line := disk_full_line(e)):
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the loop (in it, a signal stops the run at a step and saves)
        print(f"error: {config.INTERRUPTED_LINE} (outside the training loop)", file=sys.stderr)
        return config.INTERRUPTED


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing import errors

    config.imports_done()  # a Ctrl-C from here on is KeyboardInterrupt: cli() and the loop handle it
    # errors.record: under torchrun, a failing rank's error reaches the launcher's summary, with its rank.
    sys.exit(errors.record(cli)())
