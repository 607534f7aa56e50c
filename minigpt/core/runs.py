"""The run directory, from the choice of its name to its last lines: every output path checked
before any work (a bad one costs one line, exit 2, not an interval of training and a traceback at
the first save), one trainer per directory, what a killed process left cleaned up, config.json and
the lines every log starts and ends with, the checkpoint's save point. RunDir holds all of it for
the trainer; what only a resume or a save needs is minigpt/core/checkpoint.py, loaded then."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import platform
import re
import signal
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from minigpt import paths
from minigpt.core.config import EXTRA_ARGS_ENV, TrainConfig, UsageError
from minigpt.errors import NonFiniteLoss
from minigpt.fileio import atomic_write
from minigpt.ranks import DistInfo

LOCK_FILE = ".lock"  # in the run directory; holds the PID of the trainer that owns it
# Pseudo file systems: the kernel's views, never a place for a run's files.
PSEUDO_FS = (Path("/proc"), Path("/sys"), Path("/dev"))
STALE_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")  # minigpt.fileio.tmp_path's names
LOG_FORMAT = "[%(asctime)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def _reason(e: OSError) -> str:
    if isinstance(e, PermissionError):
        return "permission denied"
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or type(e).__name__


def _pseudo_fs(path: Path) -> Path | None:
    resolved = path.resolve()
    return next((root for root in PSEUDO_FS if resolved == root or root in resolved.parents), None)


def probe_writable(path: str | Path, what: str) -> None:
    """Prove that the file `path` can be written, before any work is done: make its folders,
    write and remove a temporary file beside it. The target itself is never touched, and folders
    the probe made are removed again, so a run refused later leaves nothing behind.
    `what` names the flag, for the message: '--checkpoint-path', 'the token cache'."""
    path = Path(path)
    fix = f"choose a {what} in a folder you can write to"
    root = _pseudo_fs(path)
    if root is not None:
        raise UsageError(f"{what} {path} lies under {root}, a kernel file system; {fix}")
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory, not a file; {fix}, and name a file in it")
    for parent in path.parents:  # the nearest existing ancestor must be a folder
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UsageError(f"{what} {path} cannot be written: {parent} is a file, not a folder; {fix}")
            break
    made = [p for p in reversed(path.parents) if not p.exists()]  # outermost first
    probe = path.with_name(f".{path.name}.probe.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be written ({_reason(e)}); {fix}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses even to remove a file that is not there
            pass
        for p in reversed(made):  # innermost first; only the empty folders this probe made
            try:
                p.rmdir()
            except OSError:
                break


def check_out_dir(path: str | Path, what: str = "--out-dir") -> None:
    """An --out-dir that is a file, lies under /proc or /sys, or cannot be written: one line."""
    path = Path(path)
    root = _pseudo_fs(path)
    if root is not None:
        raise UsageError(
            f"{what} {path} lies under {root}, a kernel file system; choose a folder such as runs/NAME"
        )
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder; choose another {what}")
    lock = path / LOCK_FILE
    if lock.is_dir():
        raise UsageError(
            f"{lock}, the lock file that keeps a second trainer out of {path}, is a directory; "
            "remove it (the trainer makes its lock itself), or choose another --out-dir"
        )
    probe_writable(lock, what)


# What a run keeps in its directory, by the kind of path it must be: a file at a folder's name (or
# a folder at a file's) would end a resumed run in a traceback halfway into its start.
RUN_FILES = (paths.CONFIG_FILE, paths.LOG_FILE, paths.METRICS_FILE, paths.STRAGGLERS_FILE, paths.REPORT_FILE)
RUN_FOLDERS = (
    paths.TENSORBOARD_DIR,
    paths.TRACE_DIR,
    *(Path(p).parts[0] for p in (paths.SNAPSHOT_FILE, paths.MEMORY_TRACE_DIR, paths.CHECKPOINT_FILE)),
)


def check_run_files(out_dir: str | Path) -> None:
    """Every file and folder the run will write that is already there has the kind it must have
    (a regular file, a folder): else one line naming it, before anything is touched."""
    out_dir = Path(out_dir)
    for name, want in [*((n, "file") for n in RUN_FILES), *((n, "folder") for n in RUN_FOLDERS)]:
        try:
            mode = (out_dir / name).stat().st_mode
        except OSError:  # not there (made when needed), or not reachable (the probes say why)
            continue
        if not (stat.S_ISREG(mode) if want == "file" else stat.S_ISDIR(mode)):
            from minigpt.fileio import file_kind

            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            raise UsageError(
                f"{out_dir / name} is {kind}, where the run keeps its {name} ({want}); "
                "move it away, or choose another --out-dir"
            )


def checkpoint_lock_path(checkpoint: str | Path) -> Path:
    """The lock file of a checkpoint (a file, or a folder of shards): beside it, hidden."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f".{checkpoint.name}.lock")


class _Flock:
    """An exclusive flock on one lock file, with the holder's PID written inside for the message
    a second trainer gets. The kernel drops a flock when its holder exits, however it exits
    (SIGKILL included), so a lock file left by a crash is not a lock: the next trainer takes it.
    Folders the lock had to create are removed again if they are left empty."""

    def __init__(self, path: Path, busy: str):
        self.path, self.busy = path, busy  # busy: the message, with {holder} for the PID
        self.fd: int | None = None
        self.made: list[Path] = []

    def acquire(self) -> None:
        folder = self.path.parent
        self.made = [p for p in [*reversed(folder.parents), folder] if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self.remove_made()
                raise UsageError(self.busy.format(holder=holder)) from None
            # The holder before us may have removed the file between our open and our flock:
            # then we hold a lock on a deleted file, which guards nothing. Try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked: no one can be waiting on this inode
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        self.remove_made()

    def remove_made(self) -> None:
        for p in reversed(self.made):  # innermost first, only if the run left them empty
            try:
                p.rmdir()
            except OSError:
                break
        self.made = []


class RunLock:
    """One trainer per run directory, and one per checkpoint: an exclusive flock on
    <out_dir>/.lock and, when the run writes a checkpoint, on .<name>.lock beside it. Two runs
    with different --out-dir but one --checkpoint-path would otherwise both exit 0 while the
    second overwrote the first's weights. Held until the run returns; a crash drops both."""

    def __init__(self, out_dir: str | Path, checkpoint: str | Path | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self.locks = [
            _Flock(
                self.path,
                f"another trainer (PID {{holder}}) is using {self.out_dir}; wait for it to "
                "finish, or choose another --out-dir",
            )
        ]
        if checkpoint is not None:
            self.locks.append(
                _Flock(
                    checkpoint_lock_path(checkpoint),
                    f"another trainer (PID {{holder}}) writes its checkpoint to {checkpoint}; wait "
                    "for it to finish, or choose another --checkpoint-path",
                )
            )

    def acquire(self) -> RunLock:
        taken: list[_Flock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        return self

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clean_stale_tmp(folder: str | Path) -> list[Path]:
    """Remove the temporary files (.NAME.<pid>.tmp) that a process killed mid-save left in
    `folder`, those whose process is gone; a live process's file is a save in progress."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = STALE_TMP.match(p.name)
        if m and p.is_file() and not _alive(int(m["pid"])):
            p.unlink(missing_ok=True)
            removed.append(p)
    return sorted(removed)


def describe_intact(path: str | Path) -> str:
    """What a run that stops on an error leaves behind, for its last line: the claim that a good
    checkpoint survives is made only when there is one."""
    path = Path(path)
    if path.is_file():
        return f"the last good checkpoint ({path}) was left intact"
    return "no checkpoint had been written yet"


def directory_message(path: Path) -> str:
    return (
        f"checkpoint path {path} is a directory, not a checkpoint file; point --checkpoint-path at a "
        f"file (for example {path / 'ckpt.pt'})"
    )


def check_checkpoint_path(path: str | Path, resume: bool) -> None:
    """Before anything is built: the one message for each way the checkpoint path can be wrong
    (a directory gets the same line with or without --resume)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(directory_message(path))
    if resume and not path.is_file():
        raise UsageError(
            f"no checkpoint at {path} to resume from; train without --resume first, "
            "or point --checkpoint-path at one"
        )
    if not resume and path.exists():
        raise UsageError(
            f"{path} already exists; pass --resume to continue that run, "
            "or choose another --out-dir / --checkpoint-path"
        )


def next_steps(
    out_dir: str | Path,
    has_traces: bool,
    has_report: bool,
    *,
    has_checkpoint: bool = True,
    checkpoint: str | Path | None = None,
    trace_dir: str = "traces",
    report_file: str = "report.html",
) -> list[str]:
    """The lines every run ends with: what to open or run next, with this run's paths.
    checkpoint: a --checkpoint-path outside the run directory, which sample.py must be told."""
    out_dir = Path(out_dir)
    lines = [f"  scalars:        tensorboard --logdir {out_dir}"]
    if has_traces:
        lines.append(f"  trace summary:  python -m minigpt traces {out_dir / trace_dir}")
    if has_report:
        lines.append(f"  report:         {out_dir / report_file}")
    if has_checkpoint:
        where = f"--checkpoint {checkpoint}" if checkpoint else f"--out-dir {out_dir}"
        lines.append(f"  text from it:   python sample.py {where}")
    return ["Next steps:", *lines]


def resolve_out_dir(cfg: TrainConfig) -> Path:
    """The run directory. --resume without --out-dir continues the latest run that has a checkpoint."""
    root = paths.RUNS_ROOT
    if cfg.out_dir:
        return Path(cfg.out_dir)
    if cfg.resume and not cfg.checkpoint_path:
        from minigpt.core.checkpoint import latest_run

        return latest_run(root, paths.CHECKPOINT_FILE)  # the newest checkpoint, not the last name
    out = root / datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 1
    while out.exists():  # two runs started in the same second
        out, n = root / f"{datetime.now():%Y%m%d-%H%M%S}-{n}", n + 1
    return out


def setup_logging(log_file: Path | None = None, rank: int = 0) -> logging.Logger:
    """The 'minigpt' logger: on rank 0 the console plus log_file when given; on other ranks only
    warnings and errors, on stderr, marked with the rank."""
    log = logging.getLogger("minigpt")
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        log.setLevel(logging.INFO)
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
        fmt = LOG_FORMAT
    else:
        log.setLevel(logging.WARNING)
        handlers, fmt = [logging.StreamHandler(sys.stderr)], f"[%(asctime)s] [rank {rank}] %(message)s"
    for h in handlers:
        h.setFormatter(logging.Formatter(fmt, LOG_DATEFMT))
        log.addHandler(h)
    return log


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
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


def predicted_line(p: dict) -> str:
    """config.json's predicted_step in one line, with the rates it came from: a data sheet's (a
    GPU's peak FLOP/s and bandwidth, not checked against a measured step) or this machine's own."""
    stages = ", ".join(f"{k} {v:.1f}" for k, v in p.get("stage_ms", {}).items())
    sheet = str(p.get("rates_source", "")).startswith("table")
    return (
        f"Predicted step: {p.get('step_ms', 0):.1f} ms ({stages}), "
        f"{p.get('tokens_per_s', 0):,.0f} tokens/s, from "
        + (
            "a data sheet's rates, not yet checked against a measured step"
            if sheet
            else "this machine's measured rates"
        )
        + f" [{p.get('rates_source', 'source not recorded')}]; "
        "the last line gives the steady step's share of it"
    )


class RunDir:
    """One training run's folder and checkpoint, from the choice of their names to the run's last
    lines: guard() before any work, restore() with --resume, open() once the model is built
    (config.json and the log's first lines), check_finite() and save() in the loop, then stopped()
    or finish(). Rank 0 writes; every rank holds the same paths."""

    def __init__(self, cfg: TrainConfig, dist_info: DistInfo, sharded: bool):
        """The run directory and the checkpoint's path, checked before anything is built."""
        self.cfg, self.dist_info, self.sharded = cfg, dist_info, sharded
        self.path = resolve_out_dir(cfg)
        if dist_info.enabled:  # every rank writes to rank 0's choice
            from minigpt.core.distributed import gather

            self.path = Path(gather(str(self.path), dist_info)[0])
        checkpoint = Path(cfg.checkpoint_path) if cfg.checkpoint_path else self.path / paths.CHECKPOINT_FILE
        self.saves = not cfg.no_checkpoint
        self.checkpoint = self.probe = checkpoint  # the first file a save writes, probed by guard()
        if sharded:  # a folder of shards (DCP), written by every rank
            from minigpt.core.checkpoint import SHARDED_META, check_sharded_path, sharded_checkpoint_dir

            self.checkpoint = sharded_checkpoint_dir(checkpoint)
            self.probe = self.checkpoint / SHARDED_META
            check_sharded_path(self.checkpoint, cfg.resume)
        else:
            check_checkpoint_path(checkpoint, cfg.resume)
        self.cleaned: list[str] = []  # what a killed earlier run left, and what was done about it
        self.ckpt = None  # minigpt/core/checkpoint.py's Checkpointer: with --resume, or at the first save

    def guard(self, held: ExitStack) -> None:
        """Before any work, on rank 0: every output path checked (a bad one costs one line, not an
        interval of training and a traceback at the first save), the run directory locked for this
        trainer alone (held until the run returns), and what a killed earlier run left cleaned up."""
        if not self.dist_info.is_main:
            return
        check_out_dir(self.path)
        check_run_files(self.path)
        if self.saves:
            probe_writable(self.probe, "--checkpoint-path")
        held.enter_context(RunLock(self.path, self.checkpoint if self.saves else None))
        stale = clean_stale_tmp(self.checkpoint.parent) + clean_stale_tmp(self.path)
        self.cleaned = [f"removed {p}, a save killed midway" for p in stale]

    # -- the checkpoint
    def restore(self, model, optimizer, scaler, batches) -> int:
        """The step to continue from: the checkpoint's with --resume (loaded into the model, the
        optimizer, the scaler and the batches, and checked against the flags), else 0. On resume,
        rank 0 also drops the metrics and straggler lines past that step, or cut short by a crash,
        so that no step appears twice (the steps after it are trained again)."""
        self.held = (model, optimizer, scaler, batches)  # what a save writes
        if not self.cfg.resume:
            return 0
        from minigpt.core.checkpoint import Checkpointer, repair_jsonl

        self.ckpt = Checkpointer(self.cfg, self.checkpoint, self.sharded, self.dist_info)
        step = self.ckpt.restore(model, optimizer, scaler, batches)
        for name in (paths.METRICS_FILE, paths.STRAGGLERS_FILE):
            if self.dist_info.is_main and (dropped := repair_jsonl(self.path / name, step)):
                self.cleaned.append(f"dropped {dropped} line(s) of {name} past step {step} or cut short")
        return step

    def check_finite(self, losses: list, step: int, amp_dtype: str) -> list[float]:
        """Read the interval's losses (this syncs) and stop at the first non-finite one, on every
        rank together (each rank sees only its own loss): the last good checkpoint is kept."""
        import torch

        values = torch.stack(losses).tolist() if losses else []
        bad = next((i for i, v in enumerate(values) if v != v or abs(v) == float("inf")), None)
        if self.dist_info.enabled:
            from minigpt.core.distributed import any_rank

            if any_rank(bad is not None, self.dist_info) and bad is None:
                raise NonFiniteLoss(
                    f"another rank's loss became non-finite by step {step}; "
                    f"{describe_intact(self.checkpoint)}; lower --lr"
                )
        if bad is not None:
            hint = " or use --amp-dtype bf16 (fp16's range is narrow)" if amp_dtype == "fp16" else ""
            raise NonFiniteLoss(
                f"loss is {values[bad]} at step {step - len(values) + bad + 1}; "
                f"{describe_intact(self.checkpoint)}; lower --lr{hint}"
            )
        return values

    def save(self, step: int) -> None:
        """The checkpoint at this step, if its weights are finite (a checkpoint of non-finite
        weights would replace the last good one): everything a resumed run needs to repeat the
        uninterrupted one (minigpt/core/checkpoint.py)."""
        if self.ckpt is None:
            from minigpt.core.checkpoint import Checkpointer

            self.ckpt = Checkpointer(self.cfg, self.checkpoint, self.sharded, self.dist_info)
            self.ckpt.hold(*self.held)
        self.ckpt.check_weights(step)
        self.ckpt.save(step)

    def resume_hint(self) -> str:
        """What to do after a run ended abruptly (a lost rank): where its last save is, how to go on."""
        if not self.saves:
            return "nothing to resume (--no-checkpoint)"
        where = f"the last checkpoint, if one was saved, is {self.checkpoint}"
        return f"{where}: continue with --resume --out-dir {self.path}"

    # -- the log's first and last lines
    def open(self, model, data, rate, notes: list[str | None]) -> logging.Logger:
        """Create the folder, write config.json (rank 0) and say what this run is: the lines every
        log starts with. `notes`: the AMP decision in words, then the CPU allocator's setting,
        the parallel plan and --auto-batch-size's choice, when there are. `rate`: the run's
        Throughput (minigpt/instruments/metrics.py). Returns the logger (rank 0 writes the log)."""
        import torch

        cfg, info, device, (amp_note, *notes) = self.cfg, self.dist_info, rate.device, notes
        self.path.mkdir(parents=True, exist_ok=True)
        log = setup_logging(self.path / paths.LOG_FILE, info.rank)
        device_name = (
            torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
        )
        n_params = model.num_params(non_embedding=False)
        versions = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        }
        self.config = {
            "config": cfg.to_dict(),
            "model": asdict(model.cfg),
            "device": device,
            "device_name": device_name,
            "amp": rate.amp,
            "params": n_params,
            **rate.config(),
            "world_size": info.world_size,
            "ddp_backend": info.backend,
            "versions": versions,
        }
        if info.is_main:
            atomic_write(self.path / paths.CONFIG_FILE, json.dumps(self.config, indent=2) + "\n")
        log.info(f"Training started; run directory {self.path}")
        if os.environ.get(EXTRA_ARGS_ENV):
            log.info(f"Flags appended from ${EXTRA_ARGS_ENV}: {os.environ[EXTRA_ARGS_ENV]}")
        log.info(f"Device: {device} ({device_name}), torch {torch.__version__}; {amp_note}")
        for line in self.header(model, data, rate, notes, n_params):
            log.info(line)
        self.vocab_size = model.cfg.vocab_size
        return log

    def header(self, model, data, rate, notes: list[str | None], n_params: int) -> list[str]:
        """The log's first lines after the device: the CPU allocator, the ranks, the data, the
        model, the batch, the MFU peak, where the run starts and what was cleaned up."""
        cfg, info, (malloc_note, plan_note, batch_note) = self.cfg, self.dist_info, notes
        lines = [malloc_note] if malloc_note else []
        if malloc_note:
            from minigpt.core.cpu import preload_hint

            lines += [f"CPU allocator: {hint}"] if (hint := preload_hint()) else []
        if plan_note or info.world_size > 1:  # --fsdp / --tp, or DDP
            ddp = f"DDP: {info.world_size} ranks, {info.backend} backend; every rank draws its own batches"
            lines.append(f"{plan_note}; {info.backend} backend" if plan_note else ddp)
        tokens = data.train_tokens
        counts = (
            "" if tokens is None else f"; {tokens:,} training tokens, {data.val_tokens:,} validation tokens"
        )
        checkpointing = ", activation checkpointing" if cfg.use_activation_checkpoint else ""
        start = (
            f"Resumed from {self.checkpoint} at step {rate.start_step}"
            if cfg.resume
            else "Starting from scratch"
        )
        return [
            *lines,
            f"Data: {data.name}{counts}",
            f"Model: {cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}, "
            f"vocab {model.cfg.vocab_size}, {n_params / 1e6:.2f}M parameters{checkpointing}",
            *([batch_note] if batch_note else []),  # --auto-batch-size's choice
            f"Batch: {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum_steps} accumulation = "
            f"{rate.tokens_per_step:,} tokens per step per rank; {cfg.num_steps} steps",
            *rate.peak.describe().split("\n"),
            start,
            *(f"Cleaned up after an earlier run: {line}" for line in self.cleaned),
        ]

    def stopped(self, stop_signal: list[int], step: int, log: logging.Logger) -> int:
        """After a SIGINT/SIGTERM (on any rank) and the save: say how to continue; exit status
        128 + signal."""
        if self.dist_info.enabled:  # no rank leaves (and gets torn down) before the save is done
            from minigpt.core.distributed import barrier

            barrier(self.dist_info)
        signum = stop_signal[0] if stop_signal else signal.SIGTERM  # another rank's signal
        saved = (
            "no checkpoint (--no-checkpoint)"
            if self.cfg.no_checkpoint
            else f"checkpoint saved to {self.checkpoint}"
        )
        log.info(
            f"Stopped by {signal.Signals(signum).name} after step {step}; {saved}. Continue with: "
            f"python train_minimal.py --resume --out-dir {self.path} (and the same flags)"
        )
        return 128 + signum

    def finish(
        self,
        log: logging.Logger,
        profiler_cost: str | None,
        rate,
        last,
        step: int,
        run_prediction,
        write_report,
    ) -> None:
        """The run's last lines: the profiler's cost, the predicted step beside the measured one
        (`run_prediction`: minigpt/instruments/predict.py's), the run's figures, the report
        (`write_report`: minigpt/analysis/report.py's), and what to open next."""
        if profiler_cost:
            log.info(profiler_cost)
        # From cached rates only, None without them (measuring would lengthen the run's end), and under
        # --fsdp/--tp (collectives are not modelled).
        prediction = (
            None if self.sharded else run_prediction(self.cfg, self.vocab_size, last.amp, rate.device)
        )
        if prediction:
            log.info(predicted_line(prediction))
            self.config["predicted_step"] = prediction  # kept in config.json beside what the run measured
            if self.dist_info.is_main:
                atomic_write(self.path / paths.CONFIG_FILE, json.dumps(self.config, indent=2) + "\n")
            rate.predicted_ms = prediction.get("step_ms")
        log.info(rate.finished(last, step))
        if not self.cfg.no_report:
            self.report(log, write_report)
        out_dir, ckpt = self.path, self.checkpoint
        log.info(f"Checkpoint: {ckpt}" if ckpt.exists() else "Checkpoint: none (--no-checkpoint)")
        log.info(f"Run directory: {out_dir} ({paths.LOG_FILE}, {paths.METRICS_FILE}, {paths.CONFIG_FILE})")
        if self.dist_info.is_main:
            has_traces, has_report = (
                (out_dir / paths.TRACE_DIR).is_dir(),
                (out_dir / paths.REPORT_FILE).is_file(),
            )
            for line in next_steps(
                out_dir,
                has_traces,
                has_report,
                has_checkpoint=ckpt.is_file(),
                checkpoint=self.cfg.checkpoint_path,
            ):
                log.info(line)

    def report(self, log: logging.Logger, write_report: Callable[[Path], Path]) -> None:
        """report.html: the run in one offline page, written by rank 0 once every rank's trace is
        on disk. A report that cannot be made costs a warning, never the run that trained."""
        if self.dist_info.enabled:
            from minigpt.core.distributed import barrier

            barrier(self.dist_info)
        if self.dist_info.is_main:
            try:
                page = write_report(self.path)
                log.info(f"Report: {page} (one offline page; python -m minigpt report rewrites it)")
            except Exception as e:  # noqa: BLE001 - the training is done and saved; say what went wrong
                log.warning(f"report not written: {type(e).__name__}: {e}")
