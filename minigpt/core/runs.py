"""The run directory: its folder and lock, config.json, the log with its first lines and its step
lines, metrics.jsonl and TensorBoard's scalars, the checks of the losses and the save point. A
fresh folder (the default) needs no more; a folder used before, a --checkpoint-path of its own or
a path that cannot be written loads its guards (minigpt/core/guards.py), a resume or a save
minigpt/core/checkpoint.py, the run's end minigpt/core/finish.py."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch

from minigpt import paths
from minigpt.core.config import EXTRA_ARGS_ENV, TrainConfig, UsageError
from minigpt.errors import NonFiniteLoss
from minigpt.ranks import DistInfo
from minigpt.stages import LABELS
from minigpt.step_record import MEMORY_BREAKDOWN_KEYS, StepRecord

LOG_FORMAT = "[%(asctime)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def disk_full(e: BaseException, path: Path, need: int | None = None):
    """DiskFull's one line for `e` when it is a full disk (minigpt/fileio.py, loaded then), else None."""
    from minigpt.fileio import DiskFull, disk_full_message, is_disk_full

    return DiskFull(disk_full_message(path, need, True)) if is_disk_full(e) else None


def checkpoint_lock_path(checkpoint: str | Path) -> Path:
    """The lock file of a checkpoint (a file, or a folder of shards): beside it, hidden."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f".{checkpoint.name}.lock")


class RunLock:
    """One trainer per run directory and per checkpoint: an exclusive flock on <out_dir>/.lock and,
    when the run saves, on .<name>.lock beside the checkpoint (two runs sharing a --checkpoint-path
    would overwrite each other's weights). Each holds its holder's PID, for the second trainer's
    message. The kernel drops a flock when its holder exits, SIGKILL included: a lock file left by a
    crash is no lock. Folders a lock had to create are removed again if left empty."""

    def __init__(self, out_dir: str | Path, checkpoint: str | Path | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / paths.LOCK_FILE
        busy = f"another trainer (PID {{holder}}) is using {self.out_dir}; wait for it to finish, or choose "
        self.wanted = [(self.path, busy + "another --out-dir")]
        if checkpoint is not None:
            busy = f"another trainer (PID {{holder}}) writes its checkpoint to {checkpoint}; wait for it to "
            self.wanted.append(
                (checkpoint_lock_path(checkpoint), busy + "finish, or choose another --checkpoint-path")
            )
        self.held: list[tuple[Path, int, list[Path]]] = []  # (lock file, its descriptor, folders made)

    def acquire(self) -> RunLock:
        try:
            for path, busy in self.wanted:
                self.held.append(take_lock(path, busy))
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        while self.held:
            path, fd, made = self.held.pop()
            path.unlink(missing_ok=True)  # while still locked: no one can be waiting on this inode
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            remove_empty(made)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def take_lock(path: Path, busy: str) -> tuple[Path, int, list[Path]]:
    """The flock on `path`, made with its folders; `busy` (with {holder} for the PID) when another
    process holds it. On any error nothing it made is left."""
    made = [p for p in [*reversed(path.parent.parents), path.parent] if not p.exists()]
    fd, locked = None, False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while not locked:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                raise UsageError(busy.format(holder=holder)) from None
            # The holder before us may have removed the file between our open and our flock: then
            # we hold a lock on a file the path no longer names, which guards nothing. Try again.
            try:
                locked = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                pass
            if not locked:
                os.close(fd)
                fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        if locked:
            path.unlink(missing_ok=True)  # ours: no one else can be holding it
        if fd is not None:
            os.close(fd)
        remove_empty(made)
        raise
    return path, fd, made


def remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (outermost first), innermost first, as long as each is empty."""
    for p in reversed(folders):
        try:
            p.rmdir()
        except OSError:
            break


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
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0 and log_file is not None:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    fmt = LOG_FORMAT if rank == 0 else f"[%(asctime)s] [rank {rank}] %(message)s"
    for h in handlers:
        h.setFormatter(logging.Formatter(fmt, LOG_DATEFMT))
        log.addHandler(h)
    return log


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """A list that receives the first SIGINT/SIGTERM. A second Ctrl-C kills at once; a repeated
    SIGTERM is ignored (torchrun and SLURM often send two, and the save must still happen)."""
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


class RunDir:
    """One run's folder and checkpoint: guard() before any work, restore() with --resume, open()
    once the model is built, check_finite() and save() in the loop. Rank 0 writes; every rank
    holds the same paths."""

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
        elif cfg.resume or cfg.checkpoint_path or dist_info.enabled or self.path.exists():
            from minigpt.core.guards import check_checkpoint_path  # a fresh folder holds no checkpoint

            check_checkpoint_path(checkpoint, cfg.resume)
        self.cleaned: list[str] = []  # what a killed earlier run left, and what was done about it
        self.start = "Starting from scratch"  # restore() says where a resumed run starts
        self.ckpt = None  # minigpt/core/checkpoint.py's Checkpointer: with --resume, or at the first save

    def guard(self, held: ExitStack) -> None:
        """Rank 0 locks the folder until the run returns, which proves a fresh one writable. A folder
        used before, a --checkpoint-path, a kernel file system's path or a lock that cannot be made
        load minigpt/core/guards.py, which says what is wrong in one line."""
        if not self.dist_info.is_main:
            return
        resolved = self.path.resolve()
        used = self.path.exists() or self.path.is_symlink() or self.cfg.checkpoint_path or self.sharded
        if used or any(root == resolved or root in resolved.parents for root in paths.PSEUDO_FS):
            from minigpt.core.guards import check_run_dir

            check_run_dir(self)
        try:
            held.enter_context(RunLock(self.path, self.checkpoint if self.saves else None))
        except OSError:  # a folder that cannot be made or written: the guards say why, in one line
            from minigpt.core.guards import check_run_dir

            check_run_dir(self)
            raise
        if used:  # locked: what a killed earlier run left is no live trainer's
            from minigpt.core.guards import clean_stale_tmp

            stale = clean_stale_tmp(self.checkpoint.parent) + clean_stale_tmp(self.path)
            self.cleaned = [f"removed {p}, a save killed midway" for p in stale]

    # -- the checkpoint
    def restore(self, model, optimizer, scaler, batches) -> int:
        """The step to continue from: with --resume the checkpoint's (loaded and checked against the
        flags; the metrics past it dropped, so no step appears twice), else 0."""
        self.held = (model, optimizer, scaler, batches)  # what a save writes
        if not self.cfg.resume:
            return 0
        from minigpt.core.checkpoint import resume

        return resume(self, model, optimizer, scaler, batches)

    def check_finite(self, losses: list, step: int, amp_dtype: str) -> list[float]:
        """Read the interval's losses (this syncs) and stop at the first non-finite one, on every
        rank together (each rank sees only its own loss): the last good checkpoint is kept."""
        values = torch.stack(losses).tolist() if losses else []
        bad = next((i for i, v in enumerate(values) if v != v or abs(v) == float("inf")), None)
        if self.dist_info.enabled:  # every rank stops together
            from minigpt.core.distributed import check_peers_finite

            check_peers_finite(bad is not None, step, self.dist_info, self.checkpoint)
        if bad is not None:
            from minigpt.core.guards import describe_intact

            hint = " or use --amp-dtype bf16 (fp16's range is narrow)" if amp_dtype == "fp16" else ""
            raise NonFiniteLoss(
                f"loss is {values[bad]} at step {step - len(values) + bad + 1}; "
                f"{describe_intact(self.checkpoint)}; lower --lr{hint}"
            )
        return values

    def save(self, step: int) -> None:
        """The checkpoint at this step, if its weights are finite (minigpt/core/checkpoint.py)."""
        if self.ckpt is None:
            from minigpt.core.checkpoint import Checkpointer

            self.ckpt = Checkpointer(self.cfg, self.checkpoint, self.sharded, self.dist_info)
            self.ckpt.hold(*self.held)
        self.ckpt.check_weights(step)
        self.ckpt.save(step)

    # -- the log's first lines
    def open(self, model, data, rate, notes: list[str | None]) -> logging.Logger:
        """The folder, config.json (rank 0) and the log's first lines; `notes`: the AMP decision, then
        the CPU allocator's, the ranks' plan and --auto-batch-size's, where there are."""
        cfg, info, device, (amp_note, *notes) = self.cfg, self.dist_info, rate.device, notes
        self.path.mkdir(parents=True, exist_ok=True)
        log = setup_logging(self.path / paths.LOG_FILE, info.rank)
        device_name = (
            torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
        )
        n_params = model.num_params(non_embedding=False)  # the tied head once
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
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
        }
        if info.is_main:  # written whole under a temporary name, then renamed into place
            text, path = json.dumps(self.config, indent=2) + "\n", self.path / paths.CONFIG_FILE
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # minigpt/fileio.py's tmp_path
            try:
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)
            except OSError:  # fileio's writer says a full disk in one line, removes tmp, or raises
                from minigpt.fileio import atomic_write

                atomic_write(path, text)
        log.info(f"Training started; run directory {self.path}")
        if os.environ.get(EXTRA_ARGS_ENV):
            log.info(f"Flags appended from ${EXTRA_ARGS_ENV}: {os.environ[EXTRA_ARGS_ENV]}")
        log.info(f"Device: {device} ({device_name}), torch {torch.__version__}; {amp_note}")
        for line in self.header(model, data, rate, notes, n_params):
            log.info(line)
        self.vocab_size = model.cfg.vocab_size
        return log

    def header(self, model, data, rate, notes: list[str | None], n_params: int) -> list[str]:
        """The notes, the data, the model, the batch, the MFU peak, where the run starts."""
        cfg, (*notes, batch_note) = self.cfg, notes
        tokens = data.train_tokens
        counts = (
            "" if tokens is None else f"; {tokens:,} training tokens, {data.val_tokens:,} validation tokens"
        )
        checkpointing = ", activation checkpointing" if cfg.use_activation_checkpoint else ""
        return [
            *(line for note in notes if note for line in note.split("\n")),
            f"Data: {data.name}{counts}",
            f"Model: {cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}, "
            f"vocab {model.cfg.vocab_size}, {n_params / 1e6:.2f}M parameters{checkpointing}",
            *([batch_note] if batch_note else []),  # --auto-batch-size's choice
            f"Batch: {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum_steps} accumulation = "
            f"{rate.tokens_per_step:,} tokens per step per rank; {cfg.num_steps} steps",
            *rate.peak.describe().split("\n"),
            self.start,
            *(f"Cleaned up after an earlier run: {line}" for line in self.cleaned),
        ]


# ---------------------------------------------------------------------------- the log's lines


def format_log_line(m: StepRecord) -> str:
    """The step's line, read at a glance: step, losses, step time, tokens/s, MFU, memory. The
    stage times follow on a line of their own (format_stages); the rest is in metrics.jsonl."""
    val = f" | val {m.val_loss:.4f}" if m.val_loss is not None else ""
    # A step time of left-out steps only (the interval's every step was: warm-up) is theirs, and says so.
    steady = "" if m.steady_steps else f" ({', '.join(x['why'] for x in m.left_out)}, not steady)"
    rate = f"{m.tokens_per_s:,.0f} tok/s" + (f" ({m.world_size} ranks)" if m.world_size > 1 else "")
    mfu_text = f" | mfu {100 * m.mfu:.1f}%" if m.mfu is not None else ""
    mem = m.memory
    if "peak_allocated_gib" in mem:
        memory = f"mem {mem['peak_allocated_gib']:.2f} GiB (reserved {mem['peak_reserved_gib']:.2f})"
    else:  # what the machine sees: the tensors and malloc's cache, the interpreter, the libraries
        memory = f"rss {mem.get('rss_bytes', 0) / 2**30:.2f} GiB"
    return (
        f"step {m.step}/{m.num_steps} | loss {m.loss:.4f}{val} | "
        f"{1000 * m.step_time_s:.0f} ms/step{steady} | {rate}{mfu_text} | {memory}"
    )


def format_stages(m: StepRecord) -> str:
    """The stages' mean times: one number each where host and device share a clock (the CPU), host/
    device on a GPU, where the host runs ahead and waits later; then what was left out and why."""
    host, device = m.stage_host_ms, m.stage_device_ms
    same = host == device
    times = " ".join(
        f"{LABELS.get(k, k)} {v:.1f}"
        if same
        else f"{LABELS.get(k, k)} {v:.1f}/{device.get(k, float('nan')):.1f}"
        for k, v in host.items()
    )
    line = f"  stage ms{'' if same else ' host/device'}: {times}" if host else "  stages not timed"
    if m.stage_comm_ms:
        comm = " ".join(f"{LABELS.get(k, k)} {v:.1f}" for k, v in m.stage_comm_ms.items())
        line += f" | in collectives{f' (step {m.comm_step})' if m.comm_step else ''}: {comm}"
    for x in m.left_out:
        line += f" | left out: step {x['step']} {x['s']:.2f}s ({x['why']})"
    peak = (m.memory_breakdown or {}).get("peak")
    if peak:
        line += f" | allocator peak {peak / 2**20:,.1f} MiB in step {m.memory_breakdown['step']}"
    return line


# ---------------------------------------------------------------------------- the record's places


class Outputs:
    """Where a logged step goes: its two lines in the log, a line of metrics.jsonl and TensorBoard's
    scalars (rank 0 writes the files). A context manager: the files close on any exit."""

    def __init__(self, out_dir: Path, log: logging.Logger, enabled: bool, purge_step: int):
        self.log, self.tb_dir, self.tensorboard = log, out_dir / paths.TENSORBOARD_DIR, None
        self.metrics = JsonlWriter(out_dir / paths.METRICS_FILE, enabled=enabled)
        if enabled:  # under DDP only rank 0 writes
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

            if threading.excepthook is not _quiet_full_disk:
                _quiet_full_disk.previous = threading.excepthook
                threading.excepthook = _quiet_full_disk
            # purge_step: the first step (re)trained; what an earlier run wrote from there is hidden
            self.tensorboard = SummaryWriter(str(self.tb_dir), purge_step=purge_step)

    def write(self, record: StepRecord) -> None:
        self.log.info(format_log_line(record))
        self.log.info(format_stages(record))
        self.metrics.write(record)
        if self.tensorboard is None:
            return
        try:  # a full disk is one line (DiskFull): TensorBoard's writer thread fails first
            for tag, value, step in tensorboard_scalars(record):
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()
        except (OSError, RuntimeError) as e:
            if full := disk_full(e, self.tb_dir):
                raise full from None
            raise

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.metrics.close()
        finally:
            self.close_tensorboard(error_in_flight=exc[0] is not None)

    def close_tensorboard(self, error_in_flight: bool) -> None:
        """A full disk met while closing is one line, unless the run is already ending on an error
        (write() reported it, or another one): then it adds nothing."""
        if self.tensorboard is None:
            return
        try:
            self.tensorboard.close()
        except (OSError, RuntimeError) as e:
            full = disk_full(e, self.tb_dir)
            if full is None:
                raise
            if not error_in_flight:
                raise full from None
        finally:
            self.tensorboard = None


# ---------------------------------------------------------------------------- metrics.jsonl


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line (a
    resumed run drops a cut line: minigpt.core.checkpoint.repair_jsonl)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.f, self.path = None, path
        if enabled:  # under DDP only rank 0 writes
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict | StepRecord) -> None:
        if self.f:
            if isinstance(record, StepRecord):  # a line without the breakdown unless a step measured it
                record = {k: v for k, v in asdict(record).items() if v is not None or k != "memory_breakdown"}
            line = json.dumps(record) + "\n"
            try:
                self.f.write(line)
                self.f.flush()
            except OSError as e:
                if full := disk_full(e, self.path, len(line)):
                    raise full from None
                raise

    def close(self) -> None:
        if self.f:
            try:
                self.f.close()
            except OSError:  # a full disk was already reported by write(); closing adds nothing
                pass

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- TensorBoard


# StepRecord's figures as TensorBoard charts them: the tag, and the factor to the chart's unit.
TB_SCALARS = {
    "loss": ("train/loss", 1),
    "val_loss": ("val/loss", 1),
    "val_ppl": ("val/ppl", 1),
    "lr": ("train/lr", 1),
    "tokens_per_s": ("perf/tokens_per_s", 1),
    "tokens_per_s_e2e": ("perf/tokens_per_s_e2e", 1),
    "run_tokens_per_s": ("perf/run_tokens_per_s", 1),  # the run so far, in steady state
    "tokens_per_s_per_rank": ("perf/tokens_per_s_per_rank", 1),
    "mfu": ("perf/mfu_percent", 100),
    "achieved_tflops": ("perf/achieved_tflops", 1),
    "step_time_s": ("perf/step_time_ms", 1000),
}


def tensorboard_scalars(r: StepRecord) -> Iterator[tuple[str, float, int]]:
    """(tag, value, step) for each of the record's figures, in the unit a chart reads (TB_SCALARS;
    stage times in ms, memory in MiB)."""
    for key, (tag, scale) in TB_SCALARS.items():
        if (value := getattr(r, key)) is not None:
            yield tag, value * scale, r.step
    for kind in ("host", "device", "comm"):
        for stage, ms in getattr(r, f"stage_{kind}_ms").items():
            yield f"stage_{kind}_ms/{stage}", ms, r.step
    for key, value in r.memory.items():  # bytes in MiB
        yield (
            f"memory/{key.replace('_bytes', '_mib')}",
            value / 2**20 if key.endswith("_bytes") else value,
            r.step,
        )
    if r.memory_breakdown:  # --memory-profiler's measured step, and its estimate
        breakdown = r.memory_breakdown
        for prefix, figures in (
            ("memory_breakdown", breakdown),
            ("memory_estimate", breakdown.get("estimate") or {}),
        ):
            for key in MEMORY_BREAKDOWN_KEYS:
                if figures.get(key) is not None:
                    yield f"{prefix}/{key}_mib", figures[key] / 2**20, breakdown.get("step", r.step)


def _quiet_full_disk(args) -> None:
    """threading.excepthook: TensorBoard's writer thread dies on a full disk and prints its
    traceback; Outputs.write raises the same error in the loop as one line, so the
    thread's copy is dropped. Every other thread's error goes to the hook that was there before."""
    from minigpt.fileio import is_disk_full

    if type(args.thread).__module__.startswith("tensorboard.") and is_disk_full(args.exc_value):
        return
    _quiet_full_disk.previous(args)


_quiet_full_disk.previous = threading.excepthook
