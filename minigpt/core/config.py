"""The trainer's flags as one table, and the checks that turn a user's mistake into one line.

Each flag is a field of TrainConfig: its type, default, group and help, and where needed its bounds
(one loop checks them all), name, argparse action, choices and what a None default means. The
parser and the checks read the table; nothing else lists the flags. Torch-free."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import typing
import uuid
from dataclasses import Field, asdict, dataclass, field, fields
from decimal import Decimal, InvalidOperation

from minigpt.errors import ArgParser, UsageError

# Named model and batch shapes. Explicit flags override them; they override the field defaults.
PRESETS: dict[str, dict] = {
    # The default main job, about a minute on a 2-core CPU; also the shape of the nanoGPT speed
    # comparison in benchmarks/ (4 layers, 4 heads, 256 wide, block 256, batch 8).
    "small": dict(
        n_layers=4, n_heads=4, d_model=256, d_ff=1024, seq_len=256, batch_size=8, dropout=0.0, lr=1e-3
    ),
    # GPT-2 small, 124M parameters.
    "gpt2": dict(
        n_layers=12,
        n_heads=12,
        d_model=768,
        d_ff=3072,
        seq_len=1024,
        max_position_embeddings=1024,
        batch_size=8,
        dropout=0.0,
        lr=6e-4,
    ),
    # Seconds per run: for tests and smoke runs.
    "tiny": dict(n_layers=2, n_heads=2, d_model=64, d_ff=256, seq_len=64, batch_size=4, dropout=0.0, lr=1e-3),
}
DEFAULT_PRESET = "small"
TOY_VOCAB_SIZE = 64  # --use-toy-data needs no 50k vocabulary; a small one learns in seconds
EXTRA_ARGS_ENV = "MINIGPT_ARGS"

# ------------------------------------------------------------------------------------------ bounds
INT_LIMIT = 2**63  # every count ends in a C int64 somewhere (torch sizes, seeds, timers)
# Loops that run inside one step before anything is printed (micro-batches, validation batches):
# beyond this a typo (1e9) hangs the first step with no output, and no real run needs more
# (nanoGPT's largest: 40 micro-batches, 200 evaluation batches).
MAX_INNER_LOOP = 65_536
# A week: no collective should wait longer, and far beyond it timedelta and c10d's int64
# milliseconds overflow with a traceback.
MAX_DDP_TIMEOUT_S = 7 * 24 * 3600.0
BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW's two moments
ESTIMATE_CAP_BYTES = 2**50  # --estimate-memory answers for other machines: refuse only above 1 PiB
GIB_HINT = "the figure is in GiB: 80 for an 80 GB GPU"
# A path of at most 255 bytes is never too long (minigpt/fileio.py's name_problem judges a longer one).
SHORT_PATH = 255
PATH_FLAGS = ("out_dir", "checkpoint_path", "memory_snapshot_path", "train_data", "val_data")


@dataclass(frozen=True)
class Bounds:
    """A numeric flag's range (an open end excludes its value), and the words for a value outside."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    too_low: str = ""
    too_high: str = ""

    def problem(self, v) -> str | None:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return self.too_low
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return self.too_high
        return None


POSITIVE = Bounds(0, lo_open=True, too_low="must be positive")
NON_NEGATIVE = Bounds(0, too_low="must not be negative")
SEED = Bounds(0, 2**32, hi_open=True, too_low="must be in [0, 2**32)", too_high="must be in [0, 2**32)")
INNER_LOOP = Bounds(
    0,
    MAX_INNER_LOOP,
    lo_open=True,
    too_low="must be positive",
    too_high=f"must be at most {MAX_INNER_LOOP} (it runs inside every step)",
)
# A peak below a GFLOP/s or above an exaFLOP/s is a typo: MFU against it reads 10^9 %, or 0.
PEAK_TFLOPS = Bounds(
    0.001,
    1e6,
    too_low="must be at least 0.001 (1 GFLOP/s; the figure is in TFLOP/s)",
    too_high="must be at most 1e6 (an exaFLOP/s; the figure is in TFLOP/s)",
)


def parse_int(text: str) -> int:
    """int(), and also integers written as 1e6 (exactly: 1e30 is 10**30, not a rounded float)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    # More than 100 digits is no count of anything; converting 1e999999999 would take minutes.
    if not value.is_finite() or value != value.to_integral_value() or value.adjusted() > 100:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    return int(value)


# ------------------------------------------------------------------------------------------ the table
# What flag() takes beside default, group, help and bounds: argparse's action (OFF: the flag is
# --no-<name>), choices and metavar, and none (what a default of None means).
FLAG_OPTIONS = ("action", "choices", "metavar", "none")


def flag(default, group: str, help: str, bounds: Bounds | None = None, **options) -> Field:
    """A TrainConfig field that is also a flag; `options` from FLAG_OPTIONS."""
    unknown = sorted(set(options) - set(FLAG_OPTIONS))
    if unknown:
        raise TypeError(f"flag() has no option {', '.join(unknown)}; it takes {', '.join(FLAG_OPTIONS)}")
    meta = {"help": help, "group": group, "bounds": bounds, **dict.fromkeys(FLAG_OPTIONS), **options}
    if default is list:
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


MODEL, DATA, TRAIN, CKPT, LOG = "model", "data", "training", "checkpointing", "logging"
INSTR, MEM, DIST = "instrumentation", "memory", "distributed (under torchrun)"
SWITCH, OFF, BOTH = "store_true", "store_false", argparse.BooleanOptionalAction  # OFF: --no-<name>
UNIT = Bounds(0, 1, hi_open=True, too_low="must be in [0, 1)", too_high="must be in [0, 1)")
SCORE = Bounds(0, 1, lo_open=True, too_low="must be in (0, 1]", too_high="must be in (0, 1]")
ENTRIES = Bounds(
    0, 2**31 - 1, lo_open=True, too_low="must be positive", too_high=f"must be at most {2**31 - 1} (a C int)"
)
WEEK = Bounds(
    0,
    MAX_DDP_TIMEOUT_S,
    lo_open=True,
    too_low="must be positive",
    too_high=f"must be at most a week ({MAX_DDP_TIMEOUT_S:.0f} s)",
)
GIB = Bounds(
    1 / 1024,
    2.0**20,
    too_low=f"must be at least 1 MiB, i.e. 0.0009765625 ({GIB_HINT})",
    too_high=f"must be at most 1048576 (1 PiB; {GIB_HINT})",
)
SCHEDULES, DEVICES, MODES = (
    ["cosine", "linear", "constant"],
    ["auto", "cpu", "cuda"],
    ["default", "reduce-overhead", "max-autotune"],
)


@dataclass
class TrainConfig:
    """Every flag of train_minimal.py: `--n-layers` is n_layers. Presets set some of them first."""

    # model
    preset: str = flag(
        DEFAULT_PRESET, MODEL, "model and batch shape (the presets below)", choices=sorted(PRESETS)
    )
    vocab_size: int | None = flag(
        None, MODEL, "vocabulary size", POSITIVE, none="the tokenizer's, padded to 64"
    )
    max_position_embeddings: int | None = flag(None, MODEL, "longest sequence", POSITIVE, none="--seq-len")
    n_layers: int = flag(4, MODEL, "transformer blocks", POSITIVE)
    n_heads: int = flag(4, MODEL, "attention heads", POSITIVE)
    d_model: int = flag(256, MODEL, "residual stream width", POSITIVE)
    d_ff: int | None = flag(None, MODEL, "MLP width", POSITIVE, none="4 * d_model")
    dropout: float = flag(0.0, MODEL, "dropout probability", UNIT, metavar="P")
    use_activation_checkpoint: bool = flag(False, MODEL, "recompute activations in backward", action=SWITCH)
    # data. Several files, or the flag given twice: the blog passes its files that way.
    train_data: list[str] = flag(
        list,
        DATA,
        "text files to train on (UTF-8, at most 1 GiB each)",
        action="extend",
        metavar="FILE",
        none="the built-in corpus",
    )
    val_data: list[str] = flag(
        list,
        DATA,
        "validation text files",
        action="extend",
        metavar="FILE",
        none="a tenth of the built-in corpus, or the last 10% of --train-data's tokens",
    )
    tokenizer_name: str = flag("gpt2", DATA, "tiktoken encoding (gpt2 works offline)", metavar="NAME")
    use_toy_data: bool = flag(False, DATA, "synthetic, learnable sequences: a smoke test", action=SWITCH)
    max_tokens: int | None = flag(None, DATA, "use at most this many training tokens", POSITIVE, none="all")
    data_seed: int | None = flag(None, DATA, "seed of the batch order", SEED, none="--seed")
    seq_len: int = flag(256, DATA, "tokens per sequence", POSITIVE)
    # training
    batch_size: int = flag(8, TRAIN, "sequences per micro-batch", POSITIVE)
    auto_batch_size: bool = flag(
        False, TRAIN, "CUDA: the largest micro-batch that fits 80% of the GPU", action=SWITCH
    )
    grad_accum_steps: int = flag(1, TRAIN, "micro-batches per optimizer step", INNER_LOOP)
    num_steps: int = flag(60, TRAIN, "optimizer steps", POSITIVE)
    lr: float = flag(1e-3, TRAIN, "peak learning rate", POSITIVE, metavar="LR")
    min_lr: float | None = flag(None, TRAIN, "final learning rate", metavar="LR", none="--lr / 10")
    lr_scheduler: str = flag("cosine", TRAIN, "decay after the warm-up", choices=SCHEDULES)
    warmup_steps: int | None = flag(
        None, TRAIN, "linear warm-up steps", NON_NEGATIVE, none="10% of --num-steps, at most 100"
    )
    weight_decay: float = flag(0.1, TRAIN, "AdamW decay, on matrices only", NON_NEGATIVE)
    grad_clip: float = flag(1.0, TRAIN, "max gradient norm; 0 turns clipping off", NON_NEGATIVE)
    seed: int = flag(1337, TRAIN, "seed of the weights and dropout", SEED)
    device: str = flag("auto", TRAIN, "auto: cuda where a GPU is visible, else cpu", choices=DEVICES)
    amp: bool | None = flag(
        None, TRAIN, "autocast; --no-amp: fp32", action=BOTH, none="on where bf16 is native"
    )
    amp_dtype: str = flag(
        "bf16", TRAIN, "autocast dtype; fp16 (CUDA) uses a GradScaler", choices=["bf16", "fp16"]
    )
    compile: bool = flag(False, TRAIN, "torch.compile the model", action=SWITCH)
    compile_mode: str = flag("default", TRAIN, "torch.compile's mode under --compile", choices=MODES)
    keep_freed_memory: bool = flag(
        True, TRAIN, "CPU: glibc malloc's defaults (minigpt/core/cpu.py)", action=OFF
    )
    chunked_loss: bool = flag(False, TRAIN, "LM head and loss in chunks: no full logits", action=BOTH)
    # checkpointing
    checkpoint_path: str | None = flag(
        None, CKPT, "checkpoint file", metavar="PATH", none="<out-dir>/checkpoints/ckpt.pt"
    )
    resume: bool = flag(
        False, CKPT, "continue from --checkpoint-path (or the latest run in runs/)", action=SWITCH
    )
    save_interval: int = flag(50, CKPT, "steps between checkpoints (0: at the end only)", NON_NEGATIVE)
    no_checkpoint: bool = flag(
        False, CKPT, "never write a checkpoint (--resume still reads one)", action=SWITCH
    )
    # logging
    log_interval: int = flag(10, LOG, "steps between log lines", POSITIVE)
    eval_interval: int = flag(20, LOG, "steps between evaluations (and one at the end)", POSITIVE)
    eval_iters: int = flag(10, LOG, "validation batches per evaluation", INNER_LOOP)
    out_dir: str | None = flag(None, LOG, "run directory", metavar="DIR", none="runs/<date-time>")
    no_report: bool = flag(False, LOG, "do not write report.html at the end", action=SWITCH)
    # instrumentation
    stage_timing: bool = flag(True, INSTR, "stop timing the stages (their ranges stay)", action=OFF)
    comm_profile: bool = flag(True, INSTR, "--fsdp/--tp: no profiled step for collectives", action=OFF)
    use_profiler: bool = flag(
        False, INSTR, "torch.profiler trace of the window into <out-dir>/traces/", action=SWITCH
    )
    # Steps 5..6: after the first steps' allocations and warm-up, and with steps 2..3 before them
    # to measure the profiler's cost.
    profile_step_start: int = flag(5, INSTR, "first profiled step")
    profile_step_end: int = flag(7, INSTR, "step after the last profiled one")
    profile_ranks: str = flag("0", INSTR, "ranks that profile: a list like 0,1, or all", metavar="RANKS")
    profile_with_stack: bool = flag(
        False, INSTR, "record Python stacks (larger, slower traces)", action=SWITCH
    )
    profile_record_shapes: bool = flag(
        False, INSTR, "record operator input shapes (larger traces)", action=SWITCH
    )
    profile_with_flops: bool = flag(False, INSTR, "estimate the FLOPs of matmuls in the trace", action=SWITCH)
    profile_with_modules: bool = flag(False, INSTR, "record each operator's nn.Module", action=SWITCH)
    nsys: bool = flag(False, INSTR, "CUDA: cudaProfilerStart/Stop around the window, for nsys", action=SWITCH)
    record_memory_history: bool = flag(False, INSTR, "CUDA allocation history and snapshots", action=SWITCH)
    memory_history_entries: int = flag(100_000, INSTR, "allocations kept in the history", ENTRIES)
    memory_snapshot_path: str | None = flag(
        None,
        INSTR,
        "where the memory snapshot goes",
        metavar="PATH",
        none="<out-dir>/snapshots/rank{R}_snapshot.pickle",
    )
    peak_tflops: float | None = flag(
        None,
        INSTR,
        "the MFU denominator, TFLOP/s of one device",
        PEAK_TFLOPS,
        metavar="X",
        none="the data sheet's, or this CPU's measured peak",
    )
    # memory (minigpt/instruments/memory.py, minigpt/instruments/estimate.py)
    memory_profiler: bool = flag(False, MEM, "measure one step's memory, by what holds it", action=SWITCH)
    # After warm-up, like the trace; with --use-profiler the step after its window, since the
    # measurement runs a profiler of its own and two cannot record at once.
    memory_profile_step: int | None = flag(
        None,
        MEM,
        "the measured step",
        metavar="N",
        none="--profile-step-start, or --profile-step-end with --use-profiler",
    )
    estimate_memory: bool = flag(
        False, MEM, "print the predicted memory and exit (builds nothing)", action=SWITCH
    )
    device_memory_gb: float | None = flag(
        None,
        MEM,
        "GiB the estimate must fit in",
        GIB,
        metavar="GIB",
        none="the GPU's memory, else this machine's RAM",
    )
    # distributed (torchrun)
    ddp_backend: str | None = flag(
        None, DIST, "process group backend", choices=["nccl", "gloo"], none="nccl on CUDA, else gloo"
    )
    ddp_timeout: float = flag(300.0, DIST, "seconds a collective waits for a missing rank", WEEK, metavar="S")
    straggler_threshold: float = flag(0.75, DIST, "report a rank whose score falls below this", SCORE)
    simulate_slow_rank: str | None = flag(
        None, DIST, "rank R sleeps MS ms in STAGE (forward) each step", metavar="R:MS[:STAGE]", none="off"
    )
    fsdp: bool = flag(False, DIST, "shard parameters, gradients and optimizer state (FSDP2)", action=SWITCH)
    tp: int = flag(1, DIST, "tensor-parallel degree: heads and MLP over N ranks", POSITIVE)
    use_tensor_parallel: bool = flag(False, DIST, "tensor parallelism over one node's ranks", action=SWITCH)

    # Not a flag: an id drawn by parse_args and recorded in config.json and in every checkpoint
    # (to_dict), so a --resume can tell this run's checkpoint from another's (check_own_run in
    # minigpt/core/checkpoint.py). A resumed run takes its checkpoint's id; torchrun's ranks, rank 0's.
    run_id: typing.ClassVar[str | None] = None

    def to_dict(self) -> dict:
        return {**asdict(self), "run_id": self.run_id}

    def asks_for_ranks(self) -> bool:
        """A flag that needs the job's ranks (their checks, a mesh) even in a single process."""
        ranks = self.fsdp or self.tp != 1 or self.use_tensor_parallel or self.simulate_slow_rank
        return bool(ranks or self.profile_ranks.strip() != "0")


_TYPES = typing.get_type_hints(TrainConfig)


def flag_name(f: Field) -> str:
    return ("--no-" if f.metadata["action"] == OFF else "--") + f.name.replace("_", "-")


def base_type(f: Field) -> type:
    """int for `int | None`, list for `list[str]`, and so on."""
    hint = _TYPES[f.name]
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None -> X
    return args[0] if args else hint


# Per field, once at import: (field, flag, kind, bounds) for the checks' one loop; the flags that
# take a --no- form.
CHECKED = [(f, flag_name(f), base_type(f), f.metadata["bounds"]) for f in fields(TrainConfig)]
BOTH_WAYS = [flag_name(f) for f in fields(TrainConfig) if f.metadata["action"] is BOTH]


# ------------------------------------------------------------------------------------------ parser
def argument(f: Field) -> tuple[str, dict]:
    """argparse's add_argument for one field. Every parse default is SUPPRESS, so the namespace
    holds exactly the flags the user gave (they beat the preset, which beats the field defaults);
    --help writes the defaults into the help texts (FlagParser)."""
    meta, kind = f.metadata, base_type(f)
    kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=meta["help"].replace("%", "%%"))
    if meta["action"] is not None:
        kwargs["action"] = meta["action"]
    if kind is list:
        kwargs["nargs"] = "+"
    elif kind in (int, float):
        kwargs["type"] = parse_int if kind is int else float
    kwargs.update({key: meta[key] for key in ("choices", "metavar") if meta[key] is not None})
    if kind in (int, float) and "metavar" not in kwargs:
        kwargs["metavar"] = "N" if kind is int else "X"
    return flag_name(f), kwargs


ARGUMENTS = [(f.metadata["group"], *argument(f)) for f in fields(TrainConfig)]  # once, at import


class FlagParser(ArgParser):
    """The trainer's flags. --help adds each one's default and the presets to the text
    (minigpt/core/flaghelp.py, loaded then)."""

    def format_help(self) -> str:
        from minigpt.core.flaghelp import add_defaults

        add_defaults(self)
        return super().format_help()


def build_parser(prog: str = "train_minimal.py") -> argparse.ArgumentParser:
    """One argument per TrainConfig field, grouped as --help shows them."""
    p = FlagParser(
        prog=prog,
        description="Train a GPT and see where the time and memory go.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.name_prog = True
    groups = {group: p.add_argument_group(group) for group in dict.fromkeys(g for g, _, _ in ARGUMENTS)}
    for group, name, kwargs in ARGUMENTS:
        groups[group].add_argument(name, **kwargs)
    return p


# ------------------------------------------------------------------------------------------ parse
def parse_args(argv: list[str] | None = None, prog: str = "train_minimal.py") -> TrainConfig:
    """Flags over preset over defaults, then checked; raises UsageError. $MINIGPT_ARGS is appended
    to the command line (its flags win): every command of a script scaled down to a quick run."""
    try:
        extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    except ValueError as e:
        raise UsageError(
            f"${EXTRA_ARGS_ENV} does not parse as shell words ({e}): {os.environ[EXTRA_ARGS_ENV]!r}"
        ) from None
    argv = list(sys.argv[1:] if argv is None else argv)
    check_alternatives(argv, "on the command line")
    check_alternatives(extra, f"in ${EXTRA_ARGS_ENV}")  # there, each may override the command line's
    given = vars(build_parser(prog).parse_args(argv + extra))  # only the flags on the command line
    preset = given.get("preset", DEFAULT_PRESET)
    cfg = TrainConfig(**{**PRESETS[preset], **given, "preset": preset})
    check_fields(cfg)  # before anything is derived from a value, so a bad one is blamed on its own flag
    cfg.d_ff = cfg.d_ff or 4 * cfg.d_model
    cfg.max_position_embeddings = cfg.max_position_embeddings or cfg.seq_len
    cfg.min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    # Warm-up that fits the run: a short run would otherwise never reach its peak lr.
    cfg.warmup_steps = min(100, cfg.num_steps // 10) if cfg.warmup_steps is None else cfg.warmup_steps
    cfg.data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    if cfg.use_toy_data and cfg.vocab_size is None:
        cfg.vocab_size = TOY_VOCAB_SIZE
    validate(cfg, given=set(given))
    cfg.run_id = uuid.uuid4().hex[:16]
    if cfg.memory_profiler and cfg.memory_profile_step is None:
        cfg.memory_profile_step = cfg.profile_step_end if cfg.use_profiler else cfg.profile_step_start
    return cfg


def check_alternatives(words: list[str], where: str) -> None:
    """A flag and its --no- form (--amp --no-amp) given together, in one place: argparse would let
    the last win silently, while --help shows them as alternatives."""
    words = words[: words.index("--")] if "--" in words else words
    for yes in BOTH_WAYS:
        if yes in words and f"--no-{yes[2:]}" in words:
            raise UsageError(f"{yes} and --no-{yes[2:]} are alternatives, both given {where}; keep one")


def check_fields(cfg: TrainConfig) -> None:
    """Each flag on its own: text without NUL and paths not empty; numbers finite, within their
    bounds, and ints that fit an int64."""
    for f, name, kind, bounds in CHECKED:
        value = getattr(cfg, f.name)
        if isinstance(value, (str, list)):
            check_text(f, name, value)
        elif value is not None and kind in (int, float):
            problem = bounds.problem(value) if bounds else None
            if kind is float and not math.isfinite(value):
                problem = "must be a finite number"  # NaN passes every comparison unnoticed
            elif not problem and not -INT_LIMIT < value < INT_LIMIT:
                problem = "is out of range (a 64-bit integer)"
            if problem:
                raise UsageError(f"{name} {problem}, got {value}")


def check_text(f: Field, name: str, value) -> None:
    """A path flag given as "" would silently mean its default: refused. A NUL byte cannot be in a
    path or a name (open() raises a ValueError deep inside)."""
    for text in value if isinstance(value, list) else [value]:
        if "\0" in text:
            raise UsageError(f"{name} holds a NUL byte, which no file name or value may hold")
        if f.name in PATH_FLAGS and len(os.fsencode(text)) > SHORT_PATH:  # a name past 255 bytes: errno 36
            from minigpt.fileio import name_problem

            if problem := name_problem(text):
                raise UsageError(f"{name}: the path {problem}; choose a shorter one")
        if f.name in PATH_FLAGS and not text.strip():
            default = f.metadata["none"]
            raise UsageError(
                f"{name} is empty; name a path"
                + (f", or leave the flag out for the default ({default})" if default else "")
            )


def validate(cfg: TrainConfig, given: set[str] | None = None) -> None:
    """Every field's own check, then the checks across fields (minigpt/core/checks.py) that a field
    the user gave asks for, then the size. `given`: the fields set on the command line or in
    $MINIGPT_ARGS; None asks for every check (the tests hold each preset and the defaults to them all)."""
    check_fields(cfg)
    if given is None or given & ACROSS_FLAGS:
        from minigpt.core.checks import check_across

        check_across(cfg, given)
    check_size(cfg)


# The fields that ask for a check across flags (minigpt/core/checks.py's ACROSS, loaded then): the
# defaults and every preset pass them all, so a run that gives none of these needs none of them.
ACROSS_FLAGS = frozenset(
    {
        "memory_snapshot_path", "memory_profile_step", "nsys", "use_profiler", "use_toy_data", "train_data",
        "val_data", "max_tokens", "tokenizer_name", "lr", "min_lr", "d_model", "n_heads", "seq_len",
        "max_position_embeddings", "no_checkpoint", "save_interval", "checkpoint_path", "resume",
        "compile_mode", "compile", "record_memory_history", "memory_profiler", "profile_step_start",
        "profile_step_end", "fsdp", "tp", "use_tensor_parallel", "simulate_slow_rank", "profile_ranks",
    }
)  # fmt: skip


# ------------------------------------------------------------------------------------------ size
def machine_ram_bytes() -> int | None:
    """Physical RAM, from sysconf (no psutil, no torch); None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def quick_bytes(cfg: TrainConfig) -> dict[str, int]:
    """A training step's bytes, roughly: parameters x 16 (fp32 weights, gradients, AdamW's moments),
    fp32 logits (4 b s V, unless --chunked-loss), saved activations (~68 b s d per layer). Only to
    refuse absurd sizes before anything is built: minigpt/instruments/estimate.py estimates."""
    vocab, tokens, d = pad_vocab(cfg.vocab_size or GPT2_VOCAB), cfg.batch_size * cfg.seq_len, cfg.d_model
    params = param_count(vocab, cfg.max_position_embeddings, d, cfg.d_ff, cfg.n_layers)  # as parse_args set
    return {
        f"for {params:.3g} parameters at {BYTES_PER_PARAM} bytes each": params * BYTES_PER_PARAM,
        "of logits": 0 if cfg.chunked_loss else 4 * tokens * vocab,
        "of activations": 68 * tokens * d * cfg.n_layers,
    }


def check_size(cfg: TrainConfig) -> None:
    """Refuse a configuration whose quick count exceeds this machine's RAM (the whole model is built
    here before it moves or is sharded; a typo like --vocab-size 1e13 should not meet the OOM
    killer). --estimate-memory builds nothing, for any machine: refused only above 1 PiB."""
    terms = quick_bytes(cfg)
    ram = None if cfg.estimate_memory else machine_ram_bytes()
    if sum(terms.values()) > (ram or ESTIMATE_CAP_BYTES):
        from minigpt.fileio import format_bytes

        what = f"this machine's {format_bytes(ram)} of RAM" if ram else "1 PiB, the cap of --estimate-memory"
        parts = ", ".join(f"{format_bytes(n)} {label}" for label, n in terms.items() if n)
        raise UsageError(
            f"this configuration needs about {format_bytes(sum(terms.values()))} ({parts}), "
            f"more than {what}; "
            "lower --vocab-size, --d-model, --d-ff, --n-layers, --max-position-embeddings, "
            "--batch-size or --seq-len"
        )


# ------------------------------------------------------------------------------------------ device
# What only CUDA has (its profiler range, its allocator, NCCL): the value that asks for it, and why
# not on a CPU. Checked once the device is known: a planned GPU run is estimated anywhere.
CUDA_ONLY = {
    "ddp_backend": ("nccl", "--ddp-backend nccl needs CUDA GPUs; on the CPU use gloo (the default there)"),
    "auto_batch_size": (
        True,
        "--auto-batch-size sizes a GPU's micro-batch from the GPU's memory; on the CPU choose "
        "--batch-size yourself",
    ),
    "nsys": (
        True,
        "--nsys needs CUDA: Nsight Systems' capture range is cudaProfilerStart/Stop; "
        "on the CPU use --use-profiler",
    ),
    "record_memory_history": (
        True,
        "--record-memory-history needs CUDA: it records the CUDA caching allocator; "
        "on the CPU see the memory breakdown instead",
    ),
}


def check_cuda_features(cfg: TrainConfig, device: str) -> None:
    """A flag that drives what only CUDA has, on a CPU."""
    for name, (asks, why) in CUDA_ONLY.items():
        if device != "cuda" and getattr(cfg, name) == asks:
            raise UsageError(why)


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def cpu_bf16_features() -> dict[str, bool]:
    """{"avx512_bf16": ..., "amx": ...}: the instructions that make bf16 native on this CPU (torch's
    private checks, the ones its own CPU kernels use)."""
    import torch

    return {
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
    }


def resolve_amp(cfg: TrainConfig, device: str) -> tuple[bool, str, str]:
    """(autocast on, dtype 'bf16'|'fp16'|'fp32', a note for the log): bf16 where the hardware runs
    it natively; elsewhere autocast would emulate bf16, slower than fp32, unless --amp insists."""
    import torch

    if cfg.amp is False:
        return False, "fp32", "AMP off (--no-amp): training in fp32"
    if device == "cpu":
        if cfg.amp_dtype == "fp16":
            raise UsageError("--amp-dtype fp16 needs CUDA (its GradScaler); use bf16 on the CPU")
        if any(cpu_bf16_features().values()):
            return True, "bf16", "AMP on: bf16 autocast (this CPU has native bf16)"
        if cfg.amp:
            return (
                True,
                "bf16",
                "AMP on as asked, but this CPU has no native bf16: expect it slower than fp32",
            )
        return (
            False,
            "fp32",
            "AMP off: this CPU has no native bf16 (AVX512-BF16/AMX), so fp32 is faster; --amp forces it",
        )
    if cfg.amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
        if cfg.amp:
            raise UsageError("this GPU does not support bf16; use --amp-dtype fp16")
        return True, "fp16", "AMP on: this GPU lacks bf16, using fp16 with a GradScaler"
    scaler = " with a GradScaler" if cfg.amp_dtype == "fp16" else ""
    return True, cfg.amp_dtype, f"AMP on: {cfg.amp_dtype} autocast{scaler}"


# ------------------------------------------------------------------------------------------ shape
MiB = 2**20  # the byte units the estimates are printed in (memory.log's "MiB")
GiB = 2**30
VOCAB_MULTIPLE = 64  # matrix sizes that are multiples of 64 run faster
GPT2_VOCAB = 50257  # GPT-2's ids: its 50,256 BPE tokens and <|endoftext|>
EOT = GPT2_VOCAB - 1  # <|endoftext|>, the last id: placed between documents


def pad_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round the vocabulary up: matrix sizes that are multiples of 64 run faster (50257 -> 50304)."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


GPT2_PADDED = pad_vocab(GPT2_VOCAB)  # 50304: the vocabulary of every preset trained on gpt2 tokens


def block_param_sizes(d_model: int, d_ff: int) -> list[int]:
    """Elements of each parameter tensor of one block, in the module's order: ln_1, qkv, attn.proj,
    ln_2, mlp.fc, mlp.proj (weights, then biases)."""
    h, f = d_model, d_ff
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]


def param_count(vocab_size: int, positions: int, d_model: int, d_ff: int, n_layers: int) -> int:
    """Parameters of a GPT of this shape (embeddings, blocks, final LayerNorm; the head is tied to
    the token embedding and counted once). Closed form in exact integers: it also sizes absurd
    shapes, which check_size refuses before anything is built."""
    return (vocab_size + positions) * d_model + n_layers * sum(block_param_sizes(d_model, d_ff)) + 2 * d_model
