"""The run directory: its folder and its lock, config.json, the log and its first lines. A record's
places (the log line, metrics.jsonl, TensorBoard) and the losses' check load at the first log line
(outputs.py), a save or a resume checkpoint.py, a folder used before guards.py. Nothing of a run is
written through a link it did not make: its files open with O_NOFOLLOW; config.json is renamed in."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import signal
import sys
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch

from minigpt import config
from minigpt.config import UsageError, open_run_file
from minigpt.errors import Fault


def lock_folder(path: Path) -> int:
    """An exclusive flock on the run's folder itself, held until the run returns: one trainer a
    folder, and no lock file that a link or a FIFO could stand in for. The kernel drops it when its
    holder dies, SIGKILL included."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"another trainer is using {path}; wait for it, or use another --out-dir") from None
    return fd


def release(fd: int, made: list[Path]) -> None:
    os.close(fd)
    for folder in reversed(made):  # the folders made for the run, innermost first, while empty
        try:
            folder.rmdir()
        except OSError:
            break


@contextmanager
def stop_on_signals():
    """A list that receives the first SIGINT, SIGTERM or SIGHUP (a closed terminal): the loop saves
    and stops after the step in flight. A second Ctrl-C kills at once; a repeated SIGTERM is
    ignored (torchrun and SLURM often send two, and the save must still happen)."""
    received: list[int] = []

    def handler(signum, frame):
        received[:] = received or [signum]
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Console(logging.StreamHandler):
    def handleError(self, record) -> None:  # a closed pipe, a full disk: the console goes quiet
        self.stream = open(os.devnull, "w")  # noqa: SIM115  (not setStream: it flushes the dead one)


class RunDir:
    """One run's folder and checkpoint: guard() before any work, restore() with --resume, open()
    once the model is built, write(), check_finite() and save() in the loop. Rank 0 writes."""

    def __init__(self, cfg, dist_info, sharded: bool):
        self.cfg, self.dist_info, self.sharded, self.outputs, self.log = cfg, dist_info, sharded, None, None
        stamp, n = datetime.now().strftime("%Y%m%d-%H%M%S"), 0
        self.path = Path(cfg.out_dir or Path(config.RUNS_ROOT, stamp))
        while not cfg.out_dir and self.path.exists():  # started in the same second as another run
            n, self.path = n + 1, Path(config.RUNS_ROOT, f"{stamp}-{n + 1}")
        if not cfg.out_dir and cfg.resume and not cfg.checkpoint_path:
            from minigpt.core.checkpoint import latest_run

            self.path = latest_run(config.RUNS_ROOT, config.CHECKPOINT_FILE)  # the newest checkpoint
        if dist_info.enabled:  # every rank writes where rank 0 chose
            from minigpt.core.distributed import gather

            self.path = Path(gather(str(self.path), dist_info)[0])
        self.checkpoint = Path(cfg.checkpoint_path or self.path / config.CHECKPOINT_FILE)
        self.saves, self.used, self.ckpt, self.said = not cfg.no_checkpoint, self.path.exists(), None, []
        if cfg.resume or cfg.checkpoint_path or sharded or dist_info.enabled or self.used:
            from minigpt.core.guards import check_paths  # a fresh folder holds no checkpoint, nothing stale

            check_paths(self)

    def guard(self, held) -> None:
        """Rank 0 makes and locks the folder until the run returns; a folder used before, or a
        --checkpoint-path of its own, loads guards.py (stale files, the checkpoint's own lock)."""
        held.push(self.close)  # on any exit
        if not self.dist_info.is_main:
            return
        made = [p for p in (*reversed(self.path.parents), self.path) if not p.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            held.callback(release, lock_folder(self.path), made)
        except OSError:  # a folder that cannot be made or opened: the guards say why, in one line
            from minigpt.core.guards import check_paths

            check_paths(self)
            raise
        if self.used or self.cfg.checkpoint_path:
            from minigpt.core.guards import guard_used

            guard_used(self, held)

    def close(self, kind, error, traceback) -> None:  # on any exit: the files closed, an error logged
        for handler in self.log.handlers[1:] if isinstance(error, (UsageError, Fault)) and self.log else []:
            handler.emit(logging.makeLogRecord({"msg": f"error: {error}"}))  # rank 0's train.log
        self.outputs and self.outputs.close()

    def restore(self, model, optimizer, scaler, batches) -> int:
        """The step to continue from: with --resume the checkpoint's (loaded, checked), else 0."""
        start = f"Starting from {self.cfg.init_from}'s weights" if self.cfg.init_from else "Starting afresh"
        self.held, self.resumed_at, self.start = (model, optimizer, scaler, batches), 0, start
        if self.cfg.resume:
            from minigpt.core.checkpoint import resume

            self.resumed_at = resume(self, model, optimizer, scaler, batches)
        return self.resumed_at

    def open(self, model, data, figures: dict, notes: list) -> logging.Logger:
        """The folder, config.json, the log and its first lines. `figures`: what config.json keeps
        beside the flags (the device, FLOPs per token); `notes`: lines for the log."""
        cfg, info, device = self.cfg, self.dist_info, figures["device"]
        self.path.mkdir(parents=True, exist_ok=True)
        self.log = log = logging.getLogger("minigpt")
        log.handlers.clear()
        log.propagate = False
        log.setLevel(logging.INFO if info.is_main else logging.WARNING)
        handlers = [Console(sys.stdout if info.is_main else sys.stderr)]
        if info.is_main:
            log_file = open_run_file(self.path / config.LOG_FILE, os.O_WRONLY | os.O_APPEND)
            handlers.append(logging.StreamHandler(open(log_file, "a", encoding="utf-8")))
        for handler in handlers:
            rank = "" if info.is_main else f"[rank {info.rank}] "
            handler.setFormatter(logging.Formatter(f"[%(asctime)s] {rank}%(message)s", "%Y-%m-%d %H:%M:%S"))
            log.addHandler(handler)
        name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "a CPU"
        versions = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version())
        params = model.num_params(non_embedding=False)
        self.config = dict(config=cfg.to_dict(), model=asdict(model.cfg), device_name=name, params=params)
        self.keep(figures | dict(world_size=info.world_size, ddp_backend=info.backend, versions=versions))
        shape = f"{cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}"
        train, val = data.train_tokens, data.val_tokens
        tokens = f"; {train:,} training tokens, {val:,} validation" if train else ""
        lines = [f"Training started; run directory {self.path}"]
        lines.append(f"Device: {device} ({name}), torch {torch.__version__}")
        if extra := os.environ.get(config.EXTRA_ARGS_ENV):
            lines.append(f"Flags appended from ${config.EXTRA_ARGS_ENV}: {extra}")
        lines += [*filter(None, notes), f"Data: {data.name}{tokens}"]
        lines.append(f"Model: {shape}, vocab {model.cfg.vocab_size}, {params / 1e6:.2f}M parameters")
        lines.append(f"Batch: {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum_steps} micro-batches")
        lines += [self.start, *self.said]  # what a folder used before held (guards.py, a resume)
        for line in lines:
            log.info(line)
        return log

    def keep(self, figures: dict) -> None:
        """More of config.json: the MFU peak at the first log line, the predicted step at the end."""
        self.config |= figures
        if self.dist_info.is_main:
            config.atomic_write(self.path / config.CONFIG_FILE, json.dumps(self.config, indent=2) + "\n")

    def write(self, record) -> None:
        """A record's places: its lines in the log, metrics.jsonl, TensorBoard (outputs.py)."""
        if self.outputs is None:
            from minigpt.core.outputs import Outputs

            self.outputs = Outputs(self)
        self.outputs.write(record)

    def check_finite(self, losses: list, step: int, amp: str) -> list[float]:
        """The interval's losses (this syncs); a non-finite one stops every rank (outputs.py)."""
        from minigpt.core.outputs import check_finite

        return check_finite(self, losses, step, amp)

    def save(self, step: int) -> None:
        if self.ckpt is None:
            from minigpt.core.checkpoint import Checkpointer

            self.ckpt = Checkpointer(self.cfg, self.checkpoint, self.sharded, self.dist_info)
            self.ckpt.hold(*self.held)
        self.ckpt.check_weights(step)
        self.ckpt.save(step)
