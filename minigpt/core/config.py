"""TrainConfig, the command line built from it, and the checks that turn a user's mistake into
one clear line instead of a traceback.

Each flag is defined once, as a field of TrainConfig: its type (the annotation), its default, and
in the field's metadata its help, its group in --help, its check, and where needed its flag name,
argparse action, choices and what a None default means. build_parser() and validate() read them
from `dataclasses.fields(TrainConfig)`; nothing else lists the flags."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import typing
import uuid
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from decimal import Decimal, InvalidOperation

from minigpt.errors import ArgParser, UsageError
from minigpt.shape import GPT2_VOCAB, shape_of

# Named model and batch shapes. Explicit flags override them; they override the field defaults.
PRESETS: dict[str, dict] = {
    # The default main job: trains in about two minutes on a 2-core CPU. It is also the shape of
    # the nanoGPT speed comparison in benchmarks/ (4 layers, 4 heads, 256 wide, block 256, batch 8).
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

# ------------------------------------------------------------------------------------------ checks
# A check takes a flag's value and returns what is wrong with it ("must be positive"), or None.
Check = Callable[[typing.Any], "str | None"]

SEED_LIMIT = 2**32  # numpy's and torch's generators take seeds in [0, 2**32) everywhere
INT_LIMIT = 2**63  # every count ends in a C int64 somewhere (torch sizes, seeds, timers)
MIN_DEVICE_MEMORY_GB = 1 / 1024  # 1 MiB: a smaller figure is a typo (1e-12 GiB), not a device
# A week: no collective should wait longer, and far beyond it timedelta (at most 1e9 days) and
# c10d's int64 milliseconds overflow with a traceback.
MAX_DDP_TIMEOUT_S = 7 * 24 * 3600.0
BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW's two moments
ESTIMATE_CAP_BYTES = 2**50  # --estimate-memory answers for other machines: refuse only above 1 PiB
# Loops that run inside one step before anything is printed (micro-batches, validation batches):
# beyond this a typo (1e9) hangs the first step with no output, and no real run needs more
# (nanoGPT's largest: 40 micro-batches, 200 evaluation batches).
MAX_INNER_LOOP = 65_536
MAX_DEVICE_MEMORY_GB = 2.0**20  # 1 PiB: far beyond any device; 1e300 overflows an int of bytes
MAX_SLOW_MS = (
    3_600_000.0  # an hour per step: --simulate-slow-rank is a teaching aid; time.sleep overflows past ~1e16 s
)
MAX_HISTORY_ENTRIES = 2**31 - 1  # the CUDA allocator's history size is a C int
# Flags that name a file or folder: an empty value would silently mean the default.
PATH_FLAGS = ("out_dir", "checkpoint_path", "memory_snapshot_path", "train_data", "val_data")


def positive(v) -> str | None:
    return None if v is None or v > 0 else "must be positive"


def non_negative(v) -> str | None:
    return None if v is None or v >= 0 else "must not be negative"


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    def check(v) -> str | None:
        if v is None or (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi):
            return None
        return f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    return check


def seed(v) -> str | None:
    return None if v is None or 0 <= v < SEED_LIMIT else "must be in [0, 2**32)"


def memory_gb(v) -> str | None:
    if v is None or MIN_DEVICE_MEMORY_GB <= v <= MAX_DEVICE_MEMORY_GB:
        return None
    if v > MAX_DEVICE_MEMORY_GB:
        return (
            f"must be at most {MAX_DEVICE_MEMORY_GB:.0f} (1 PiB; the figure is in GiB: 80 for an 80 GB GPU)"
        )
    return "must be at least 1 MiB, i.e. 0.0009765625 (the figure is in GiB: 80 for an 80 GB GPU)"


def inner_loop(v) -> str | None:
    if v is None:
        return None
    if v <= 0:
        return "must be positive"
    return None if v <= MAX_INNER_LOOP else f"must be at most {MAX_INNER_LOOP} (it runs inside every step)"


def history_entries(v) -> str | None:
    if v is None:
        return None
    if v <= 0:
        return "must be positive"
    return None if v <= MAX_HISTORY_ENTRIES else f"must be at most {MAX_HISTORY_ENTRIES} (a C int)"


def timeout(v) -> str | None:
    if not v > 0:
        return "must be positive"
    return None if v <= MAX_DDP_TIMEOUT_S else f"must be at most a week ({MAX_DDP_TIMEOUT_S:.0f} s)"


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


# ------------------------------------------------------------------------------------------ fields
# What flag() takes beside help and group: check (a value's own check), name (the flag when it is
# not --field-name), argparse's action, choices and metavar, and none (what a default of None
# means, for --help).
FLAG_OPTIONS = ("check", "name", "action", "choices", "metavar", "none")


def flag(default=MISSING, *, help: str, group: str, factory=None, **options) -> Field:
    """A TrainConfig field that is also a flag; `options` from FLAG_OPTIONS."""
    unknown = sorted(set(options) - set(FLAG_OPTIONS))
    if unknown:
        raise TypeError(f"flag() has no option {', '.join(unknown)}; it takes {', '.join(FLAG_OPTIONS)}")
    meta = {"help": help, "group": group, **dict.fromkeys(FLAG_OPTIONS), **options}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


MODEL, DATA, TRAIN, CKPT, LOG = "model", "data", "training", "checkpointing", "logging"
INSTR, MEM, DIST = "instrumentation", "memory", "distributed (under torchrun)"


@dataclass
class TrainConfig:
    # model
    preset: str = flag(
        DEFAULT_PRESET,
        group=MODEL,
        choices=sorted(PRESETS),
        help="model and batch shape; the table below lists what each sets",
    )
    vocab_size: int | None = flag(
        None,
        group=MODEL,
        check=positive,
        metavar="N",
        none="the tokenizer's, padded to a multiple of 64",
        help="vocabulary size",
    )
    max_position_embeddings: int | None = flag(
        None,
        group=MODEL,
        check=positive,
        metavar="N",
        none="--seq-len",
        help="longest sequence the model can take",
    )
    n_layers: int = flag(4, group=MODEL, check=positive, metavar="N", help="transformer blocks")
    n_heads: int = flag(4, group=MODEL, check=positive, metavar="N", help="attention heads")
    d_model: int = flag(256, group=MODEL, check=positive, metavar="N", help="residual stream width")
    d_ff: int | None = flag(
        None, group=MODEL, check=positive, metavar="N", none="4 * d_model", help="MLP width"
    )
    dropout: float = flag(
        0.0, group=MODEL, check=between(0, 1, hi_open=True), metavar="P", help="dropout probability"
    )
    use_activation_checkpoint: bool = flag(
        False,
        group=MODEL,
        action="store_true",
        help="recompute each block's activations in backward (less memory, more time)",
    )
    # data. Several files, or the flag given twice: the blog passes its files that way.
    train_data: list[str] = flag(
        factory=list,
        group=DATA,
        action="extend",
        metavar="FILE",
        none="the built-in corpus",
        help="text files to train on (UTF-8, at most 1 GiB each: minigpt.core.data.MAX_TEXT_BYTES)",
    )
    val_data: list[str] = flag(
        factory=list,
        group=DATA,
        action="extend",
        metavar="FILE",
        none="a tenth of the built-in corpus spread over it, or the last 10% of --train-data's tokens",
        help="validation text files",
    )
    tokenizer_name: str = flag(
        "gpt2", group=DATA, metavar="NAME", help="tiktoken encoding (gpt2 works offline)"
    )
    use_toy_data: bool = flag(
        False, group=DATA, action="store_true", help="synthetic, learnable sequences: a smoke test"
    )
    max_tokens: int | None = flag(
        None,
        group=DATA,
        check=positive,
        metavar="N",
        none="all of them",
        help="use at most this many training tokens",
    )
    data_seed: int | None = flag(
        None, group=DATA, check=seed, metavar="N", none="--seed", help="seed of the batch order"
    )
    seq_len: int = flag(256, group=DATA, check=positive, metavar="N", help="tokens per sequence")
    # training
    batch_size: int = flag(8, group=TRAIN, check=positive, metavar="N", help="sequences per micro-batch")
    # Off by default until a GPU measures what it buys (the predicted gain is in README "GPU speed").
    auto_batch_size: bool = flag(
        False,
        group=TRAIN,
        action="store_true",
        help="CUDA: the largest power-of-two micro-batch from --batch-size up whose predicted peak fits "
        "in 80%% of the GPU (--device-memory-gb to override), named in the log",
    )
    grad_accum_steps: int = flag(
        1,
        group=TRAIN,
        check=inner_loop,
        metavar="N",
        help=f"micro-batches per optimizer step (at most {MAX_INNER_LOOP})",
    )
    num_steps: int = flag(
        60,
        group=TRAIN,
        check=positive,
        metavar="N",  # about two minutes on 2 CPU cores
        help="optimizer steps",
    )
    lr: float = flag(1e-3, group=TRAIN, check=positive, metavar="LR", help="peak learning rate")
    min_lr: float | None = flag(
        None,
        group=TRAIN,
        metavar="LR",
        none="--lr / 10",  # checked against lr
        help="final learning rate",
    )
    lr_scheduler: str = flag(
        "cosine", group=TRAIN, choices=["cosine", "linear", "constant"], help="decay after the warm-up"
    )
    warmup_steps: int | None = flag(
        None,
        group=TRAIN,
        check=non_negative,
        metavar="N",
        none="10% of --num-steps, at most 100",
        help="linear warm-up steps",
    )
    weight_decay: float = flag(
        0.1, group=TRAIN, check=non_negative, metavar="X", help="AdamW decay, on matrices only"
    )
    grad_clip: float = flag(
        1.0, group=TRAIN, check=non_negative, metavar="X", help="max gradient norm; 0 turns clipping off"
    )
    seed: int = flag(1337, group=TRAIN, check=seed, metavar="N", help="seed of the weights and dropout")
    device: str = flag(
        "auto",
        group=TRAIN,
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda where a GPU is visible, else cpu",
    )
    amp: bool | None = flag(
        None,
        group=TRAIN,
        action=argparse.BooleanOptionalAction,
        none="on where the device has native bf16",
        help="autocast; --no-amp: fp32",
    )
    amp_dtype: str = flag(
        "bf16",
        group=TRAIN,
        choices=["bf16", "fp16"],
        help="autocast dtype; fp16 uses a GradScaler (CUDA only)",
    )
    compile: bool = flag(False, group=TRAIN, action="store_true", help="torch.compile the model")
    compile_mode: str = flag(
        "default",
        group=TRAIN,
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile's mode under --compile: reduce-overhead replays CUDA graphs (fewer "
        "launches), max-autotune also times kernel choices (a longer compilation)",
    )
    keep_freed_memory: bool = flag(
        True,
        group=TRAIN,
        name="--no-keep-freed-memory",
        action="store_false",
        help="CPU: leave glibc malloc's defaults (each step's big tensors then "
        "page-fault anew; by default freed blocks are kept, minigpt/core/cpu.py)",
    )
    chunked_loss: bool = flag(
        False,
        group=TRAIN,
        action=argparse.BooleanOptionalAction,
        help="compute the LM head and cross-entropy in chunks of the sequence, "
        "so the full logits never exist at once (less memory)",
    )
    # checkpointing
    checkpoint_path: str | None = flag(
        None, group=CKPT, metavar="PATH", none="<out-dir>/checkpoints/ckpt.pt", help="checkpoint file"
    )
    resume: bool = flag(
        False,
        group=CKPT,
        action="store_true",
        help="continue from --checkpoint-path (without --out-dir: the latest run in runs/)",
    )
    save_interval: int = flag(
        50,
        group=CKPT,
        check=non_negative,
        metavar="N",
        help="steps between checkpoints; 0: none between, still one at the end and on a signal",
    )
    no_checkpoint: bool = flag(
        False, group=CKPT, action="store_true", help="never write a checkpoint (--resume still reads one)"
    )
    # logging
    log_interval: int = flag(10, group=LOG, check=positive, metavar="N", help="steps between log lines")
    eval_interval: int = flag(
        20, group=LOG, check=positive, metavar="N", help="steps between evaluations (and one at the end)"
    )
    eval_iters: int = flag(
        10,
        group=LOG,
        check=inner_loop,
        metavar="N",
        help=f"validation batches per evaluation (at most {MAX_INNER_LOOP})",
    )
    out_dir: str | None = flag(None, group=LOG, metavar="DIR", none="runs/<date-time>", help="run directory")
    no_report: bool = flag(False, group=LOG, action="store_true", help="do not write report.html at the end")
    # instrumentation
    stage_timing: bool = flag(
        True,
        group=INSTR,
        name="--no-stage-timing",
        action="store_false",
        help="stop timing the stages (their profiler/NVTX ranges stay): for overhead measurements",
    )
    comm_profile: bool = flag(
        True,
        group=INSTR,
        name="--no-comm-profile",
        action="store_false",
        help="under --fsdp/--tp: do not profile one step per log interval for the stages' time in "
        "collectives (the log line's 'waiting on collectives')",
    )
    use_profiler: bool = flag(
        False,
        group=INSTR,
        action="store_true",
        help="torch.profiler trace of steps --profile-step-start..end-1 into <out-dir>/traces/ "
        "(not with --nsys: each would distort the other)",
    )
    # Steps 5..6: after the first steps' allocations and warm-up, and with steps 2..3 before them
    # to measure the profiler's cost.
    profile_step_start: int = flag(5, group=INSTR, metavar="N", help="first profiled step")
    profile_step_end: int = flag(7, group=INSTR, metavar="N", help="step after the last profiled one")
    profile_ranks: str = flag(
        "0", group=INSTR, metavar="RANKS", help="ranks that profile: a list like 0,1, or all"
    )
    profile_with_stack: bool = flag(
        False, group=INSTR, action="store_true", help="record Python stacks (larger, slower traces)"
    )
    profile_record_shapes: bool = flag(
        False, group=INSTR, action="store_true", help="record operator input shapes (larger traces)"
    )
    profile_with_flops: bool = flag(
        False,
        group=INSTR,
        action="store_true",
        help="estimate FLOPs of matmuls and convolutions in the trace",
    )
    profile_with_modules: bool = flag(
        False, group=INSTR, action="store_true", help="record the nn.Module hierarchy of each operator"
    )
    nsys: bool = flag(
        False,
        group=INSTR,
        action="store_true",
        help="cudaProfilerStart/Stop around the profile window, for nsys --capture-range=cudaProfilerApi "
        "(CUDA; not with --use-profiler: each would distort the other)",
    )
    record_memory_history: bool = flag(
        False,
        group=INSTR,
        action="store_true",
        help="CUDA allocation history; snapshot at the end of the window or run, and on OOM",
    )
    memory_history_entries: int = flag(
        100_000, group=INSTR, check=history_entries, metavar="N", help="allocations kept in the history"
    )
    memory_snapshot_path: str | None = flag(
        None,
        group=INSTR,
        metavar="PATH",
        none="<out-dir>/snapshots/rank{R}_snapshot.pickle",
        help="where the memory snapshot goes",
    )
    peak_tflops: float | None = flag(
        None,
        group=INSTR,
        check=positive,
        metavar="X",
        none="a known GPU's data sheet, else a GEMM timed on this machine",
        help="peak TFLOP/s of one device: the MFU denominator, set by hand",
    )
    # memory (minigpt/instruments/memory.py, minigpt/instruments/estimate.py)
    memory_profiler: bool = flag(
        False,
        group=MEM,
        action="store_true",
        help="measure one step: params, grads, optimizer state, saved activations "
        "per module; writes <out-dir>/memory_trace/rank{R}_dp{R}/",
    )
    # After warm-up, like the trace; with --use-profiler the step after its window, since the
    # measurement runs a profiler of its own and two cannot record at once.
    memory_profile_step: int | None = flag(
        None,
        group=MEM,
        metavar="N",
        none="--profile-step-start, or --profile-step-end with --use-profiler",
        help="the measured step",
    )
    estimate_memory: bool = flag(
        False,
        group=MEM,
        action="store_true",
        help="print the predicted memory of this configuration and exit (builds no model)",
    )
    device_memory_gb: float | None = flag(
        None,
        group=MEM,
        check=memory_gb,
        metavar="GIB",
        none="the GPU's memory on CUDA, else this machine's RAM",
        help="GiB the estimate must fit in",
    )
    # distributed (torchrun)
    ddp_backend: str | None = flag(
        None,
        group=DIST,
        choices=["nccl", "gloo"],
        none="nccl on CUDA, gloo on the CPU",
        help="process group backend",
    )
    ddp_timeout: float = flag(
        300.0,
        group=DIST,
        check=timeout,
        metavar="S",
        help="seconds a collective may wait for a missing rank before the job fails",
    )
    straggler_threshold: float = flag(
        0.75,
        group=DIST,
        check=between(0, 1, lo_open=True),
        metavar="X",
        help="report a rank whose relative or individual score falls below this",
    )
    simulate_slow_rank: str | None = flag(
        None,
        group=DIST,
        metavar="R:MS[:STAGE]",
        none="off",
        help="teaching/testing aid: rank R sleeps MS ms in STAGE (default forward) every step",
    )
    fsdp: bool = flag(
        False,
        group=DIST,
        action="store_true",
        help="shard parameters, gradients and optimizer state over the ranks (FSDP2)",
    )
    tp: int = flag(
        1,
        group=DIST,
        check=positive,
        metavar="N",
        help="tensor-parallel degree: split each block's heads and MLP over N ranks",
    )
    use_tensor_parallel: bool = flag(
        False,
        group=DIST,
        action="store_true",
        help="tensor parallelism over the ranks of one node (the blog's flag; "
        "the degree is the node's size, so not with --tp)",
    )

    # Not a flag: an id drawn by parse_args and recorded in config.json and in every checkpoint
    # (to_dict), so a --resume can tell this run's checkpoint from another's (check_own_run in
    # minigpt/core/checkpoint.py). A resumed run takes its checkpoint's id; torchrun's ranks, rank 0's.
    run_id: typing.ClassVar[str | None] = None

    def to_dict(self) -> dict:
        return {**asdict(self), "run_id": self.run_id}


_TYPES = typing.get_type_hints(TrainConfig)


def flag_name(f: Field) -> str:
    return f.metadata["name"] or "--" + f.name.replace("_", "-")


def base_type(f: Field) -> type:
    """int for `int | None`, list for `list[str]`, and so on."""
    hint = _TYPES[f.name]
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None -> X
    return args[0] if args else hint


def field_default(f: Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default


# ------------------------------------------------------------------------------------------ parser
def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(value) if value else "none"
    return str(value)


def default_help(f: Field) -> str:
    """'(default: ...)' for --help: the default preset's value where it sets this field, else the
    field's default, or what None means."""
    meta = f.metadata
    if meta["action"] in ("store_true", "store_false"):
        return ""  # a switch: off unless given
    if f.name in PRESETS[DEFAULT_PRESET]:
        return f" (default: {_show(PRESETS[DEFAULT_PRESET][f.name])}, from --preset {DEFAULT_PRESET})"
    value = field_default(f)
    shown = meta["none"] if meta["none"] is not None and value in (None, []) else _show(value)
    by_presets = [p for p in PRESETS if f.name in PRESETS[p]]
    return f" (default: {shown}" + (f"; set by --preset {', '.join(by_presets)}" if by_presets else "") + ")"


def presets_table() -> str:
    names = sorted({k for p in PRESETS.values() for k in p}, key=[f.name for f in fields(TrainConfig)].index)
    flags = {f.name: flag_name(f) for f in fields(TrainConfig)}
    lines = [f"presets (--preset NAME sets these; flags on the command line win; default {DEFAULT_PRESET}):"]
    for preset, values in PRESETS.items():
        lines.append(f"  {preset:6s} " + " ".join(f"{flags[n]} {values[n]}" for n in names if n in values))
    return "\n".join(lines)


def build_parser(prog: str = "train_minimal.py") -> argparse.ArgumentParser:
    """One argument per TrainConfig field. Every argument's parse default is SUPPRESS, so the
    namespace holds exactly the flags the user gave (they beat the preset, which beats the field
    defaults); --help shows the real defaults, written into each help text."""
    epilog = (
        presets_table() + "\n\n"
        f"${EXTRA_ARGS_ENV}: flags in it are appended to the command line, so they win over the same\n"
        "flags given there: a way to scale every command of a script down to a quick run, e.g.\n"
        f'  {EXTRA_ARGS_ENV}="--preset tiny --num-steps 8" python train_minimal.py'
    )
    p = ArgParser(
        prog=prog,
        name_prog=True,
        description="Train a GPT and see where the time and memory go.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        if meta["group"] not in groups:
            groups[meta["group"]] = p.add_argument_group(meta["group"])
        kwargs: dict = dict(
            dest=f.name, default=argparse.SUPPRESS, help=(meta["help"] + default_help(f)).replace("%", "%%")
        )
        kind = base_type(f)
        if meta["action"] is not None:
            kwargs["action"] = meta["action"]
        if kind is list:
            kwargs["nargs"] = "+"
        elif kind in (int, float):
            kwargs["type"] = parse_int if kind is int else float
        for key in ("choices", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        groups[meta["group"]].add_argument(flag_name(f), **kwargs)
    return p


# ------------------------------------------------------------------------------------------ parse
def parse_args(argv: list[str] | None = None, prog: str = "train_minimal.py") -> TrainConfig:
    """Flags over preset over defaults, then validated. Raises UsageError.

    Flags in the environment variable MINIGPT_ARGS are appended to the command line, so they win
    over the same flags given there: a way to scale every command of a script or of the
    walkthrough down to a quick run (MINIGPT_ARGS="--preset tiny --num-steps 8"). --train-data and
    --val-data add to the files given before them, there as on the command line."""
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
    if cfg.d_ff is None:
        cfg.d_ff = 4 * cfg.d_model
    if cfg.max_position_embeddings is None:
        cfg.max_position_embeddings = cfg.seq_len
    if cfg.min_lr is None:
        cfg.min_lr = cfg.lr / 10
    if cfg.warmup_steps is None:
        # Warm-up that fits the run: a short run would otherwise never reach its peak lr.
        cfg.warmup_steps = min(100, cfg.num_steps // 10)
    if cfg.data_seed is None:
        cfg.data_seed = cfg.seed
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
    for f in fields(TrainConfig):
        if f.metadata["action"] is argparse.BooleanOptionalAction:
            yes = flag_name(f)
            no = f"--no-{yes[2:]}"
            if yes in words and no in words:
                raise UsageError(f"{yes} and {no} are alternatives, both given {where}; keep one")


def check_text(f: Field, value) -> None:
    """A path flag given as "" would silently mean its default (runs/<date-time>, the run's own
    checkpoint): refused. A NUL byte cannot be in a path or a name (the OS refuses it with a
    ValueError deep inside open())."""
    texts = value if isinstance(value, list) else [value] if isinstance(value, str) else []
    for text in texts:
        if "\0" in text:
            raise UsageError(f"{flag_name(f)} holds a NUL byte, which no file name or value may hold")
        if f.name in PATH_FLAGS and not text.strip():
            default = f.metadata["none"]
            raise UsageError(
                f"{flag_name(f)} is empty; name a path"
                + (f", or leave the flag out for the default ({default})" if default else "")
            )


def check_slow_rank(spec: str | None) -> None:
    """--simulate-slow-rank's numbers bounded (the format itself: straggler.parse_slow_rank):
    a delay of 1e99 ms overflows time.sleep with a traceback in the first step."""
    if spec is None:
        return
    parts = spec.split(":")
    try:
        rank, ms = int(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return  # parse_slow_rank names the format
    if not -INT_LIMIT < rank < 2**31:
        raise UsageError(f"--simulate-slow-rank {spec}: the rank must be below 2**31")
    if math.isfinite(ms) and ms > MAX_SLOW_MS:
        raise UsageError(
            f"--simulate-slow-rank {spec}: the delay must be at most {MAX_SLOW_MS:.0f} ms (an hour per step)"
        )


def check_fields(cfg: TrainConfig) -> None:
    """Each flag on its own: finite floats, the field's own check, ints that fit an int64, no
    empty path, no NUL byte."""
    check_slow_rank(cfg.simulate_slow_rank)
    for f in fields(TrainConfig):
        value, kind, check = getattr(cfg, f.name), base_type(f), f.metadata["check"]
        check_text(f, value)
        if value is None or kind not in (int, float):
            continue
        if kind is float and not math.isfinite(value):
            problem = "must be a finite number"  # NaN passes every comparison check unnoticed
        else:
            problem = check(value) if check else None
        if not problem and kind is int and not -INT_LIMIT < value < INT_LIMIT:
            problem = "is out of range (a 64-bit integer)"
        if problem:
            raise UsageError(f"{flag_name(f)} {problem}, got {value}")


def validate(cfg: TrainConfig, given: set[str] | frozenset[str] = frozenset()) -> None:
    """Every field's own check, then the checks across fields. `given`: the fields set on the
    command line (a few checks refuse a combination only when the user asked for both)."""
    check_fields(cfg)
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise UsageError(f"--min-lr must be between 0 and --lr ({cfg.lr}), got {cfg.min_lr}")
    if cfg.d_model % cfg.n_heads:
        raise UsageError(f"--d-model ({cfg.d_model}) must be divisible by --n-heads ({cfg.n_heads})")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise UsageError(
            f"--seq-len ({cfg.seq_len}) is larger than --max-position-embeddings "
            f"({cfg.max_position_embeddings}); lower --seq-len or raise the other"
        )
    if cfg.use_profiler or cfg.nsys or cfg.record_memory_history:
        s, e = cfg.profile_step_start, cfg.profile_step_end
        if not 1 <= s < e <= cfg.num_steps:
            raise UsageError(
                f"the profile window needs 1 <= --profile-step-start < --profile-step-end <= "
                f"--num-steps; got start {s}, end {e}, num-steps {cfg.num_steps}"
            )
    if cfg.nsys and cfg.use_profiler:
        raise UsageError(
            "--nsys and --use-profiler exclude each other (both capture the same steps, "
            "and each distorts the other); pick one"
        )
    profile_ranks(cfg.profile_ranks, world_size=None)  # the format; the range is checked at start-up
    if cfg.use_toy_data and (cfg.train_data or cfg.val_data):
        raise UsageError("--use-toy-data generates its own data; drop --train-data/--val-data")
    if cfg.use_toy_data and ("tokenizer_name" in given or cfg.max_tokens is not None):
        which = "--tokenizer-name" if "tokenizer_name" in given else "--max-tokens"
        raise UsageError(f"--use-toy-data generates its own tokens, which {which} would not change; drop it")
    if cfg.memory_snapshot_path is not None and not cfg.record_memory_history:
        raise UsageError(
            "--memory-snapshot-path names where --record-memory-history's snapshot goes; "
            "add --record-memory-history, or drop --memory-snapshot-path"
        )
    if cfg.memory_profile_step is not None and not cfg.memory_profiler:
        raise UsageError("--memory-profile-step needs --memory-profiler")
    if cfg.memory_profiler:
        default = cfg.profile_step_end if cfg.use_profiler else cfg.profile_step_start
        step = cfg.memory_profile_step if cfg.memory_profile_step is not None else default
        if not 1 <= step <= cfg.num_steps:
            which = (
                "--memory-profile-step"
                if cfg.memory_profile_step is not None
                else "--memory-profile-step (default: --profile-step-start, or "
                "--profile-step-end with --use-profiler)"
            )
            raise UsageError(
                f"{which} is {step}, outside the run's steps 1..{cfg.num_steps}; "
                "pass --memory-profile-step N within them"
            )
    if cfg.no_checkpoint and "save_interval" in given:
        raise UsageError(
            "--no-checkpoint writes no checkpoint, so --save-interval has nothing to do; drop one of them"
        )
    if cfg.no_checkpoint and cfg.checkpoint_path is not None and not cfg.resume:
        raise UsageError(
            "--no-checkpoint writes no checkpoint, and without --resume --checkpoint-path "
            "only says where to write one; drop one of them"
        )
    check_parallel(cfg, given)
    check_size(cfg)


def check_parallel(cfg: TrainConfig, given: set[str] | frozenset[str]) -> None:
    """What FSDP and tensor parallelism need that is known without the world size."""
    if cfg.use_tensor_parallel and "tp" in given:
        raise UsageError(
            "--use-tensor-parallel takes the tensor-parallel degree from the node's size; "
            "--tp sets it by hand: pass one of them"
        )
    if cfg.tp > 1:
        # torchrun's world size, known here from its environment: a --tp that does not divide it
        # is the first thing wrong, whatever the model's shape
        world = os.environ.get("WORLD_SIZE", "")
        ranks = f"; this launch has {world} rank(s)" if world.isdigit() else ""
        if world.isdigit() and int(world) % cfg.tp:
            raise UsageError(
                f"--tp {cfg.tp} does not divide the world size {world} (the ranks torchrun started): "
                "use a --tp that divides the number of processes"
            )
        if cfg.n_heads % cfg.tp:
            raise UsageError(
                f"--tp {cfg.tp} must divide --n-heads {cfg.n_heads}: each rank holds whole heads{ranks}"
            )
        if cfg.d_ff % cfg.tp:
            raise UsageError(
                f"--tp {cfg.tp} must divide --d-ff {cfg.d_ff}: each rank holds an equal slice of the MLP"
            )
    sharded = [
        name
        for name, on in [
            ("--fsdp", cfg.fsdp),
            ("--tp", cfg.tp > 1),
            ("--use-tensor-parallel", cfg.use_tensor_parallel),
        ]
        if on
    ]
    if cfg.compile_mode != "default" and not cfg.compile:
        raise UsageError(f"--compile-mode {cfg.compile_mode} without --compile: add --compile")
    if cfg.compile and sharded:
        raise UsageError(
            f"--compile with {' and '.join(sharded)} is not supported: torch.compile of "
            "sharded (DTensor) modules needs per-block compilation, which this trainer does "
            "not do; drop --compile"
        )


# ------------------------------------------------------------------------------------------ size
def machine_ram_bytes() -> int | None:
    """Physical RAM, from sysconf (no psutil, no torch); None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def quick_bytes(cfg: TrainConfig) -> dict[str, int]:
    """The bytes of a training step, roughly and cheaply, by what needs them: parameters x 16 bytes (fp32
    weights, gradients, AdamW's two moments), the fp32 logits (4 b s V, unless --chunked-loss),
    and the blocks' saved fp32 activations (about 68 b s d per layer; SDPA keeps no s x s
    matrix). Only to refuse absurd sizes before anything is built: minigpt/instruments/estimate.py is the
    real estimate."""
    shape = shape_of(cfg, cfg.vocab_size or GPT2_VOCAB)
    params = shape.params
    logits = 0 if cfg.chunked_loss else 4 * shape.tokens * shape.vocab_size
    activations = 68 * shape.tokens * shape.d_model * shape.n_layers
    return {
        f"for {params:.3g} parameters at {BYTES_PER_PARAM} bytes each": params * BYTES_PER_PARAM,
        "of logits": logits,
        "of activations": activations,
    }


def check_size(cfg: TrainConfig) -> None:
    """Refuse a configuration whose quick count exceeds this machine's RAM: the trainer builds
    the whole model in this process before moving or sharding it, so more cannot run (and a
    typo like --vocab-size 1e13 should not be found by the kernel's OOM killer). --estimate-memory
    builds nothing and answers for other machines, so it is refused only above 1 PiB."""
    terms = quick_bytes(cfg)
    need = sum(terms.values())
    if cfg.estimate_memory:
        limit, what = ESTIMATE_CAP_BYTES, "1 PiB, the cap of --estimate-memory"
    else:
        ram = machine_ram_bytes()
        if ram is None:
            return
        limit, what = ram, f"this machine's {format_bytes(ram)} of RAM"
    if need > limit:
        parts = ", ".join(f"{format_bytes(n)} {label}" for label, n in terms.items())
        raise UsageError(
            f"this configuration needs about {format_bytes(need)} ({parts}), more than {what}; "
            "lower --vocab-size, --d-model, --d-ff, --n-layers, --max-position-embeddings, "
            "--batch-size or --seq-len"
        )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def profile_ranks(spec: str, world_size: int | None) -> list[int] | None:
    """Parse --profile-ranks: 'all' (None: every rank) or a comma-separated list of ranks."""
    if spec.strip() == "all":
        return None
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        raise UsageError(f"--profile-ranks must be 'all' or a list like 0,1; got {spec!r}") from None
    if world_size is not None and any(not 0 <= r < world_size for r in ranks):
        raise UsageError(
            f"--profile-ranks {spec} names a rank outside 0..{world_size - 1} "
            f"(the world size is {world_size})"
        )
    return ranks


def check_cuda_features(cfg: TrainConfig, device: str) -> None:
    """--nsys and --record-memory-history drive CUDA's profiler and allocator: nothing to do on a CPU."""
    if device == "cuda":
        return
    if cfg.ddp_backend == "nccl":
        raise UsageError("--ddp-backend nccl needs CUDA GPUs; on the CPU use gloo (the default there)")
    if cfg.auto_batch_size:
        raise UsageError(
            "--auto-batch-size sizes a GPU's micro-batch from the GPU's memory; on the CPU choose "
            "--batch-size yourself"
        )
    if cfg.nsys:
        raise UsageError(
            "--nsys needs CUDA: Nsight Systems' capture range is cudaProfilerStart/Stop; "
            "on the CPU use --use-profiler"
        )
    if cfg.record_memory_history:
        raise UsageError(
            "--record-memory-history needs CUDA: it records the CUDA caching allocator; "
            "on the CPU see the memory breakdown instead"
        )


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def resolve_amp(cfg: TrainConfig, device: str) -> tuple[bool, str, str]:
    """Decide autocast: (enabled, dtype 'bf16'|'fp16'|'fp32', a note for the log).

    bf16 is the default where the hardware runs it natively; elsewhere autocast would emulate
    bf16 and run slower than fp32, so we train in fp32 unless --amp insists."""
    import torch

    if cfg.amp is False:
        return False, "fp32", "AMP off (--no-amp): training in fp32"
    if device == "cpu":
        if cfg.amp_dtype == "fp16":
            raise UsageError("--amp-dtype fp16 needs CUDA (its GradScaler); use bf16 on the CPU")
        from minigpt.core.torchcompat import cpu_bf16_features

        native = any(cpu_bf16_features().values())
        if native:
            return True, "bf16", "AMP on: bf16 autocast (this CPU has native bf16)"
        if cfg.amp:
            return (
                True,
                "bf16",
                ("AMP on as asked, but this CPU has no native bf16: expect it slower than fp32"),
            )
        return (
            False,
            "fp32",
            ("AMP off: this CPU has no native bf16 (AVX512-BF16/AMX), so fp32 is faster; --amp forces it"),
        )
    if cfg.amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
        if cfg.amp:
            raise UsageError("this GPU does not support bf16; use --amp-dtype fp16")
        return True, "fp16", "AMP on: this GPU lacks bf16, using fp16 with a GradScaler"
    scaler = " with a GradScaler" if cfg.amp_dtype == "fp16" else ""
    return True, cfg.amp_dtype, f"AMP on: {cfg.amp_dtype} autocast{scaler}"
