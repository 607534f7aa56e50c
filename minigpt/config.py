"""What the trainer, its rooms and the tools share, torch-free: the flags as one table (bounds
checked by one loop), the stages of a step, the files of a run directory and how they are written
(the one atomic write; never through a link), and the load of the machine."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import stat
import sys
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields

from minigpt.errors import UsageError

INTERRUPTED, INTERRUPTED_LINE = 130, "interrupted (Ctrl-C); no file was left half-written"


class ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a bad flag: one line, exit status 2
        sys.exit(print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr) or 2)


def exit_on_ctrl_c(prog: str) -> None:
    """Until imports_done(), Ctrl-C exits at once with one line: raised inside torch's import, it
    can be swallowed (torch clears the error of an interrupted numpy import and goes on)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where ignored (nohup)
        line = f"{prog}: {INTERRUPTED_LINE}\n".encode()
        signal.signal(signal.SIGINT, lambda *_: os.write(2, line) and os._exit(INTERRUPTED))


def imports_done() -> None:
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.default_int_handler):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again


def atomic_write(path, data) -> None:
    """`data` (bytes, text, or a function that writes the open file) into a temporary file beside
    `path` (O_EXCL: never through a link), flushed to disk, renamed into place: a reader sees the
    old file or the new one, never half of either."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    if os.path.lexists(tmp):  # left by a killed process of the same PID
        os.unlink(tmp)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
            data(f) if callable(data) else f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


BUSY = 0.25  # a figure timed while other processes took more than this share of the cores ran busy


def cpu_seconds() -> tuple[float, float, float | None]:
    """(wall, this process's CPU, every process's busy CPU) seconds now; None for the last without
    /proc/stat. Two readings tell the share of the cores other processes took between them."""
    t = os.times()
    try:
        with open("/proc/stat") as f:
            j = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return t.elapsed, t.user + t.system, None
    return t.elapsed, t.user + t.system, (sum(j) - j[3] - j[4]) / os.sysconf("SC_CLK_TCK")


def busy_share(before: tuple, after: tuple) -> float | None:
    """The share of the cores other processes took between two readings of cpu_seconds(); under
    torchrun the job's ranks on this machine are not others (each taken to use what this one did)."""
    (w0, c0, b0), (w1, c1, b1) = before, after
    if b0 is None or b1 is None or w1 <= w0:
        return None
    ours = (c1 - c0) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return round(min(1.0, max(0.0, (b1 - b0 - ours) / ((w1 - w0) * os.cpu_count()))), 3)


LINK = "is a link: a run writes nothing through a link it did not make; remove it, or use another --out-dir"


def open_run_file(path, flags: int) -> int:
    """A run's file, never through a link (O_NOFOLLOW) nor into what is not a plain file of its own."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise UsageError(f"{path} {LINK}" if os.path.islink(path) else f"{path}: {e.strerror}") from None
    if not stat.S_ISREG((st := os.fstat(fd)).st_mode) or st.st_nlink != 1:  # a FIFO; a hard link elsewhere
        os.close(fd)
        raise UsageError(f"{path} is not a plain file of its own; move it away, or use another --out-dir")
    return fd


# The stages of a step: the range's name (metrics.jsonl's key) -> (the log's label, the colour).
STAGES = {"data_to_device": ("h2d", "gold"), "forward": ("fwd", "green"), "backward": ("bwd", "red")}
STAGES["optimizer_step"] = ("opt", "blue")
STAGE_NAMES = tuple(STAGES)
SPLITS, STEP_RANGE = {"backward_compute": "backward"}, "train_step"  # DDP: the backward's own compute
# A run directory's files; {rank} and {worker} (rank{R}_dp{d}[_tp{t}]) are filled per rank.
RUNS_ROOT, CONFIG_FILE, LOG_FILE, METRICS_FILE = "runs", "config.json", "train.log", "metrics.jsonl"
REPORT_FILE, STRAGGLERS_FILE, TENSORBOARD_DIR, TRACE_DIR = "report.html", "stragglers.jsonl", "tb", "traces"
CHECKPOINT_FILE, PLOTLY_JS_FILE = "checkpoints/ckpt.pt", "plotly.min.js"
OPS_FILE, MEMORY_TRACE_DIR = "traces/rank{rank}_ops.txt", "memory_trace/{worker}"
SNAPSHOT_FILE = "snapshots/rank{rank}_snapshot.pickle"
OOM_SNAPSHOT_FILE = "snapshots/oom_rank{rank}_snapshot.pickle"
GPT2_VOCAB, EOT = 50257, 50256  # GPT-2's 50,256 BPE tokens and <|endoftext|>


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    return -(-vocab_size // multiple) * multiple  # multiples of 64 run faster: 50257 -> 50304


# ---------------------------------------------------------------------------- the flags
PRESETS = {  # a preset sets these; flags given on the command line win
    "small": dict(n_layers=4, n_heads=4, d_model=256, d_ff=1024, seq_len=256, batch_size=8, lr=1e-3),
    "gpt2": dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072, seq_len=1024, batch_size=8, lr=6e-4),
    "tiny": dict(n_layers=2, n_heads=2, d_model=64, d_ff=256, seq_len=64, batch_size=4, lr=1e-3),
}
DEFAULT_PRESET, TOY_VOCAB_SIZE, EXTRA_ARGS_ENV, INNER = "small", 64, "MINIGPT_ARGS", 65_536
# The flags no check across flags (core/checks.py) can fail on their own, nor the presets' values:
# a run that gives only these never loads the checks.
QUIET = {"preset", "out_dir", "num_steps", "log_interval", "eval_interval", "eval_iters", "seed", "device"}


def flag(default, group: str, help: str, lo=None, hi=None, **options):
    """A field that is a flag: its bounds lo..hi (open="lo", "hi" or "both": that end not taken),
    argparse's action, choices or metavar, and `none`: what a default of None means."""
    meta = dict(help=help, group=group, lo=lo, hi=hi, **options)
    kind = dict(default_factory=list) if default is list else dict(default=default)
    return field(**kind, metadata=meta)


MODEL, DATA, TRAIN, CKPT, LOG = "model", "data", "training", "checkpointing", "logging"
INSTR, MEM, DIST = "instrumentation", "memory", "distributed (under torchrun)"
ON, OFF, BOTH, POS = "store_true", "store_false", argparse.BooleanOptionalAction, dict(lo=0, open="lo")
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune"]


@dataclass
class TrainConfig:
    """Every flag of train_minimal.py (`--n-layers` is n_layers), in --help's groups."""

    preset: str = flag(DEFAULT_PRESET, MODEL, "model and batch shape", choices=sorted(PRESETS))
    vocab_size: int | None = flag(None, MODEL, "vocabulary size", **POS, none="the tokenizer's")
    max_position_embeddings: int | None = flag(None, MODEL, "longest sequence", **POS, none="--seq-len")
    n_layers: int = flag(4, MODEL, "transformer blocks", **POS)
    n_heads: int = flag(4, MODEL, "attention heads", **POS)
    d_model: int = flag(256, MODEL, "residual stream width", **POS)
    d_ff: int | None = flag(None, MODEL, "MLP width", **POS, none="4 * d_model")
    dropout: float = flag(0.0, MODEL, "dropout probability", 0, 1, open="hi", metavar="P")
    use_activation_checkpoint: bool = flag(False, MODEL, "recompute activations in backward", action=ON)
    init_from: str | None = flag(None, MODEL, "a Hugging Face GPT-2 folder to start from", metavar="DIR")
    train_data: list[str] = flag(list, DATA, "text or token files", action="extend", metavar="FILE")
    val_data: list[str] = flag(list, DATA, "validation files", action="extend", metavar="FILE")
    tokenizer_name: str = flag("gpt2", DATA, "tiktoken encoding (gpt2 works offline)", metavar="NAME")
    use_toy_data: bool = flag(False, DATA, "synthetic, learnable sequences: a smoke test", action=ON)
    max_tokens: int | None = flag(None, DATA, "train on at most this many tokens", **POS)
    data_seed: int | None = flag(None, DATA, "seed of the batch order", 0, 2**32 - 1, none="--seed")
    seq_len: int = flag(256, DATA, "tokens per sequence", **POS)
    batch_size: int = flag(8, TRAIN, "sequences per micro-batch", **POS)
    auto_batch_size: bool = flag(False, TRAIN, "CUDA: the batch that fits 80%% of the GPU", action=ON)
    grad_accum_steps: int = flag(1, TRAIN, "micro-batches per optimizer step", 1, INNER)
    num_steps: int = flag(60, TRAIN, "optimizer steps", **POS)
    lr: float = flag(1e-3, TRAIN, "peak learning rate", **POS, metavar="LR")
    min_lr: float | None = flag(None, TRAIN, "final learning rate", 0, metavar="LR", none="--lr / 10")
    lr_scheduler: str = flag("cosine", TRAIN, "decay after warm-up", choices=["cosine", "linear", "constant"])
    warmup_steps: int | None = flag(None, TRAIN, "linear warm-up steps", 0, none="10%% of the steps, <= 100")
    weight_decay: float = flag(0.1, TRAIN, "AdamW's decay, of matrices only", 0)
    grad_clip: float = flag(1.0, TRAIN, "max gradient norm; 0: no clipping", 0)
    seed: int = flag(1337, TRAIN, "seed of the weights and dropout", 0, 2**32 - 1)
    device: str = flag("auto", TRAIN, "auto: cuda where a GPU is visible", choices=["auto", "cpu", "cuda"])
    amp: bool | None = flag(None, TRAIN, "autocast; --no-amp: fp32", action=BOTH, none="where native")
    amp_dtype: str = flag("bf16", TRAIN, "autocast's dtype; fp16 scales the loss", choices=["bf16", "fp16"])
    tf32: bool = flag(False, TRAIN, "CUDA: fp32 matmuls in TF32, as nanoGPT's", action=BOTH)
    compile: bool = flag(False, TRAIN, "torch.compile the model", action=ON)
    compile_mode: str = flag("default", TRAIN, "torch.compile's mode", choices=COMPILE_MODES)
    keep_freed_memory: bool = flag(True, TRAIN, "CPU: glibc malloc's own defaults", action=OFF)
    chunked_loss: bool = flag(False, TRAIN, "LM head and loss in chunks: no full logits", action=BOTH)
    checkpoint_path: str | None = flag(None, CKPT, "checkpoint file", metavar="PATH", none="in --out-dir")
    resume: bool = flag(False, CKPT, "continue from the checkpoint (or the latest run's)", action=ON)
    allow_changes: bool = flag(False, CKPT, "--resume with flags that change the run", action=ON)
    save_interval: int = flag(50, CKPT, "steps between checkpoints (0: at the end only)", 0)
    no_checkpoint: bool = flag(False, CKPT, "write no checkpoint", action=ON)
    log_interval: int = flag(10, LOG, "steps between log lines", **POS)
    eval_interval: int = flag(20, LOG, "steps between evaluations (and one at the end)", **POS)
    eval_iters: int = flag(10, LOG, "validation batches per evaluation", 1, INNER)
    out_dir: str | None = flag(None, LOG, "run directory", metavar="DIR", none="runs/<date-time>")
    no_report: bool = flag(False, LOG, "write no report.html at the end", action=ON)
    predict_time: bool = flag(False, LOG, "at the end, the step's time predicted from rates", action=ON)
    stage_timing: bool = flag(True, INSTR, "time no stage (the ranges stay)", action=OFF)
    comm_profile: bool = flag(True, INSTR, "--fsdp/--tp: no profiled step for collectives", action=OFF)
    use_profiler: bool = flag(False, INSTR, "torch.profiler trace of the window (traces/)", action=ON)
    profile_step_start: int = flag(5, INSTR, "first profiled step")
    profile_step_end: int = flag(7, INSTR, "step after the last profiled one")
    profile_ranks: str = flag("0", INSTR, "ranks that profile: 0,1 or all", metavar="RANKS")
    profile_with_stack: bool = flag(False, INSTR, "record Python stacks (larger traces)", action=ON)
    profile_record_shapes: bool = flag(False, INSTR, "record operator input shapes", action=ON)
    profile_with_flops: bool = flag(False, INSTR, "estimate the FLOPs of matmuls", action=ON)
    profile_with_modules: bool = flag(False, INSTR, "record each operator's nn.Module", action=ON)
    nsys: bool = flag(False, INSTR, "CUDA: cudaProfilerStart/Stop around the window", action=ON)
    record_memory_history: bool = flag(False, INSTR, "CUDA allocation history and snapshots", action=ON)
    memory_history_entries: int = flag(100_000, INSTR, "allocations kept in the history", 1, 2**31 - 1)
    memory_snapshot_path: str | None = flag(None, INSTR, "the snapshot's file", metavar="PATH")
    peak_tflops: float | None = flag(None, INSTR, "MFU's denominator, TFLOP/s", 0.001, 1e6, none="measured")
    memory_profiler: bool = flag(False, MEM, "measure one step's memory, by what holds it", action=ON)
    memory_profile_step: int | None = flag(None, MEM, "the measured step", metavar="N", none="after warm-up")
    estimate_memory: bool = flag(False, MEM, "print the predicted memory and exit", action=ON)
    device_memory_gb: float | None = flag(None, MEM, "GiB the estimate must fit", 2**-10, 2**20, none="all")
    ddp_backend: str | None = flag(None, DIST, "process group backend", choices=["nccl", "gloo"], none="auto")
    ddp_timeout: float = flag(300.0, DIST, "seconds a collective waits for a lost rank", 0, 604800, open="lo")
    straggler_threshold: float = flag(0.75, DIST, "name a rank scoring below this", 0, 1, open="lo")
    simulate_slow_rank: str | None = flag(None, DIST, "rank R sleeps MS ms in STAGE", metavar="R:MS[:STAGE]")
    fsdp: bool = flag(False, DIST, "shard weights, gradients, optimizer state (FSDP2)", action=ON)
    tp: int = flag(1, DIST, "tensor-parallel degree", **POS)
    use_tensor_parallel: bool = flag(False, DIST, "tensor parallelism over one node's ranks", action=ON)

    def to_dict(self) -> dict:
        return {**asdict(self), "run_id": self.run_id, "changed_on_resume": self.changes}

    def asks_for_ranks(self) -> bool:  # a flag that needs the job's ranks, even in a single process
        ranks = self.fsdp or self.tp > 1 or self.use_tensor_parallel or self.simulate_slow_rank
        return bool(ranks) or self.profile_ranks.strip() != "0"


TrainConfig.run_id, TrainConfig.changes = None, []  # a resume's proof; what --allow-changes changed
FIELDS = {f.name: f for f in fields(TrainConfig)}
TYPES = (list, bool, int, float, str)  # a field's kind: the first its annotation names (int | None: int)
KINDS = {n: next(t for t in TYPES if t.__name__ in str(f.type)) for n, f in FIELDS.items()}


def flag_name(name: str) -> str:
    return ("--no-" if FIELDS[name].metadata.get("action") == OFF else "--") + name.replace("_", "-")


def parse_int(text: str) -> int:
    """int(), and integers written as 1e6 (exactly: 1e30 is 10**30)."""
    digits, _, exponent = text.lower().partition("e")
    if not digits.lstrip("+-").isdigit() or exponent and not (exponent.isdigit() and int(exponent) <= 100):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    return int(digits) * 10 ** int(exponent or 0)


def build_parser(prog: str = "train_minimal.py") -> argparse.ArgumentParser:
    """One flag per field, each help with its default. Every parse default is SUPPRESS: the
    namespace holds just the flags given."""
    presets, raw = "".join(f"  {k:6} {v}\n" for k, v in PRESETS.items()), argparse.RawDescriptionHelpFormatter
    p = ArgParser(prog, epilog=f"presets:\n{presets}${EXTRA_ARGS_ENV}: flags appended", formatter_class=raw)
    p.allow_abbrev, groups = False, {}
    for name, f in FIELDS.items():
        m, kind = f.metadata, KINDS[name]
        kw = {key: m[key] for key in ("action", "choices", "metavar") if key in m}
        if kind in (int, float) and "action" not in m:
            kw["type"] = parse_int if kind is int else float
            kw.setdefault("metavar", "N" if kind is int else "X")
        if kind is list:
            kw["nargs"] = "+"
        value = PRESETS[DEFAULT_PRESET].get(name, None if f.default is MISSING else f.default)
        default = m.get("none", "none") if value is None else value
        help = m["help"] + ("" if m.get("action") in (ON, OFF) else f" (default: {default})")
        group = groups.get(m["group"]) or groups.setdefault(m["group"], p.add_argument_group(m["group"]))
        group.add_argument(flag_name(name), dest=name, default=argparse.SUPPRESS, help=help, **kw)
    return p


def parse_args(argv: list[str] | None = None, prog: str = "train_minimal.py") -> TrainConfig:
    """Flags over preset over defaults, then checked (UsageError). $MINIGPT_ARGS is appended to the
    command line, its flags winning: every command of a script scaled down to a quick run."""
    try:
        extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    except ValueError as e:
        raise UsageError(f"${EXTRA_ARGS_ENV} does not parse as shell words ({e})") from None
    argv = list(sys.argv[1:] if argv is None else argv)
    given = vars(build_parser(prog).parse_args(argv + extra))
    cfg = TrainConfig(**{**PRESETS[given.get("preset", DEFAULT_PRESET)], **given})
    check_fields(cfg)
    cfg.d_ff, cfg.min_lr = cfg.d_ff or 4 * cfg.d_model, cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    cfg.max_position_embeddings = cfg.max_position_embeddings or cfg.seq_len
    cfg.warmup_steps = min(100, cfg.num_steps // 10) if cfg.warmup_steps is None else cfg.warmup_steps
    cfg.data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    cfg.vocab_size = cfg.vocab_size or (TOY_VOCAB_SIZE if cfg.use_toy_data else None)
    if cfg.memory_profiler and cfg.memory_profile_step is None:  # after warm-up, and after the window
        cfg.memory_profile_step = cfg.profile_step_end if cfg.use_profiler else cfg.profile_step_start
    cfg.given, cfg.run_id = set(given), uuid.uuid4().hex[:16]
    if cfg.given - QUIET:  # a flag that takes part in a check across flags
        from minigpt.core.checks import check_across

        both = [flag_name(n) for n, f in FIELDS.items() if f.metadata.get("action") is BOTH]  # --x, --no-x
        check_across(cfg, cfg.given, both, (argv, extra))
    check_size(cfg)
    return cfg


def check_fields(cfg: TrainConfig) -> None:
    """Each flag on its own: a number finite and within its bounds; text without NUL; a path not
    empty and with no name a file system cannot hold."""
    for name, f in FIELDS.items():
        value, m, problem = getattr(cfg, name), f.metadata, None
        path = m.get("metavar") in ("FILE", "PATH", "DIR")
        for text in value if isinstance(value, list) else [value] if isinstance(value, str) else []:
            parts = os.fsencode(text).split(b"/")
            if "\0" in text:
                problem = "holds a NUL byte"
            elif path and not text.strip():
                problem = "is empty; name a path, or leave the flag out"
            elif path and max(map(len, parts)) > 255:  # not echoed, here and below: the length is the problem
                raise UsageError(f"{flag_name(name)} has a name longer than 255 bytes; choose a shorter one")
            elif path and len(os.fsencode(text)) >= 4096:
                why = f"is {len(os.fsencode(text)):,} bytes, past the 4,096 of a path; choose a shorter one"
                raise UsageError(f"{flag_name(name)} {why}")
        lo, hi, open_ = m["lo"], m["hi"], m.get("open", "")
        number = KINDS[name] in (int, float) and value is not None
        if number and not math.isfinite(value):
            problem = "must be a finite number"
        elif number and lo is not None and (value <= lo if "lo" in open_ else value < lo):
            problem = "must be positive" if (lo, open_) == (0, "lo") else f"must be at least {lo:g}"
        elif number and hi is not None and (value >= hi if "hi" in open_ else value > hi):
            problem = f"must be below {hi:g}" if "hi" in open_ else f"must be at most {hi:g}"
        elif number and abs(value) >= 2**63:
            problem = "is out of range (a 64-bit integer)"
        if problem:
            raise UsageError(f"{flag_name(name)} {problem}, got {value!r}")


def param_count(vocab: int, positions: int, d: int, d_ff: int, layers: int) -> int:
    """A GPT's parameters, the tied head once: embeddings, blocks (qkv, proj, MLP, LayerNorms), ln_f."""
    return (vocab + positions) * d + layers * (4 * d * d + 2 * d * d_ff + 9 * d + d_ff) + 2 * d


def check_size(cfg: TrainConfig) -> None:
    """Refuse a shape whose rough count (16 bytes a parameter, fp32 logits, ~68 bytes a token, layer
    and width of activations) passes this machine's RAM: a typo is not fed to the OOM killer.
    --estimate-memory builds nothing, and answers for any machine: refused only above 1 PiB."""
    tokens, vocab = cfg.batch_size * cfg.seq_len, pad_vocab(cfg.vocab_size or GPT2_VOCAB)
    need = 16 * param_count(vocab, cfg.max_position_embeddings, cfg.d_model, cfg.d_ff, cfg.n_layers)
    need += 4 * tokens * vocab * (not cfg.chunked_loss) + 68 * tokens * cfg.d_model * cfg.n_layers
    ram = 2**50 if cfg.estimate_memory else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram:
        need, ram = f"{need / 2**30:,.1f} GiB", f"{ram / 2**30:,.1f} GiB"
        raise UsageError(f"this configuration needs about {need}, more than {ram}: lower its model or batch")
