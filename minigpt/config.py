"""TrainConfig, the command line that fills it, and the checks that turn a user's mistake into
one clear line instead of a traceback."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields


class UsageError(Exception):
    """A mistake the user can fix. The trainer prints it as one line and exits with status 2."""


# Named model and batch shapes. Explicit flags override them.
PRESETS: dict[str, dict] = {
    # The default main job: trains in about two minutes on a 2-core CPU. It is also the shape of
    # the nanoGPT speed comparison in benchmarks/ (4 layers, 4 heads, 256 wide, block 256, batch 8).
    "small": dict(n_layers=4, n_heads=4, d_model=256, d_ff=1024, seq_len=256, batch_size=8,
                  dropout=0.0, lr=1e-3),
    # GPT-2 small, 124M parameters.
    "gpt2": dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072, seq_len=1024,
                 max_position_embeddings=1024, batch_size=8, dropout=0.0, lr=6e-4),
    # Seconds per run: for tests and smoke runs.
    "tiny": dict(n_layers=2, n_heads=2, d_model=64, d_ff=256, seq_len=64, batch_size=4,
                 dropout=0.0, lr=1e-3),
}
DEFAULT_PRESET = "small"
TOY_VOCAB_SIZE = 64  # --use-toy-data needs no 50k vocabulary; a small one learns in seconds


@dataclass
class TrainConfig:
    # model
    preset: str = DEFAULT_PRESET
    vocab_size: int | None = None  # None: the tokenizer's, padded to a multiple of 64
    max_position_embeddings: int | None = None  # None: the preset's, else seq_len
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 256
    d_ff: int | None = None  # None: 4 * d_model
    dropout: float = 0.0
    use_activation_checkpoint: bool = False
    # data
    train_data: list[str] = field(default_factory=list)  # empty: the built-in corpus
    val_data: list[str] = field(default_factory=list)  # empty: last 10% of the training tokens
    tokenizer_name: str = "gpt2"
    use_toy_data: bool = False
    max_tokens: int | None = None
    data_seed: int | None = None  # None: --seed
    seq_len: int = 256
    # training
    batch_size: int = 8
    grad_accum_steps: int = 1
    num_steps: int = 60  # the default main job: about two minutes on 2 CPU cores
    lr: float = 1e-3
    min_lr: float | None = None  # None: lr / 10
    lr_scheduler: str = "cosine"
    warmup_steps: int | None = None  # None: 10% of num_steps, at most 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337
    device: str = "auto"
    amp: bool | None = None  # None: on where the device runs bf16 natively
    amp_dtype: str = "bf16"
    compile: bool = False
    keep_freed_memory: bool = True  # CPU: glibc malloc keeps freed blocks (minigpt/cpu.py)
    # checkpointing
    checkpoint_path: str | None = None  # None: <out-dir>/checkpoints/ckpt.pt
    resume: bool = False
    save_interval: int = 50
    # logging
    log_interval: int = 10
    eval_interval: int = 20
    eval_iters: int = 10
    out_dir: str | None = None  # None: runs/<date-time>
    # instrumentation
    stage_timing: bool = True
    use_profiler: bool = False
    profile_step_start: int = 5  # steps 5..6: after the first steps' allocations and warm-up,
    profile_step_end: int = 7  # and with steps 2..3 before them to measure the profiler's cost
    profile_ranks: str = "0"  # comma-separated ranks, or "all"
    profile_with_stack: bool = False
    nsys: bool = False
    record_memory_history: bool = False
    memory_history_entries: int = 100_000
    memory_snapshot_path: str | None = None  # None: <out-dir>/snapshots/rank{R}_snapshot.pickle
    # memory (minigpt/memory.py)
    memory_profiler: bool = False
    memory_profile_step: int | None = None  # None: --profile-step-start (after warm-up, like the trace)
    estimate_memory: bool = False
    device_memory_gb: float | None = None  # None: the GPU's memory on CUDA, else this machine's RAM
    # distributed (torchrun)
    ddp_backend: str | None = None  # None: nccl on CUDA, gloo on the CPU
    ddp_timeout: float = 300.0  # seconds any collective may wait before the job fails
    straggler_threshold: float = 0.75
    simulate_slow_rank: str | None = None  # "R:MS[:STAGE]"

    def to_dict(self) -> dict:
        return asdict(self)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(prog: str = "train_minimal.py") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Train a GPT and see where the time and memory go.",
                argument_default=argparse.SUPPRESS)  # unset flags fall back to preset/defaults
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help=f"model and batch shape (default {DEFAULT_PRESET})")
    g.add_argument("--vocab-size", type=int, help="default: the tokenizer's, padded to a multiple of 64")
    g.add_argument("--max-position-embeddings", type=int, help="default: the preset's, else --seq-len")
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--d-ff", type=int, help="MLP width (default 4 * d_model)")
    g.add_argument("--dropout", type=float)
    g.add_argument("--use-activation-checkpoint", action="store_true",
                   help="recompute each block's activations in backward (less memory, more time)")
    g = p.add_argument_group("data")
    g.add_argument("--train-data", nargs="+", metavar="FILE", help="text files (default: built-in corpus)")
    g.add_argument("--val-data", nargs="+", metavar="FILE", help="default: last 10%% of the training tokens")
    g.add_argument("--tokenizer-name", help="tiktoken encoding (default gpt2, works offline)")
    g.add_argument("--use-toy-data", action="store_true", help="synthetic, learnable sequences: a smoke test")
    g.add_argument("--max-tokens", type=int, help="use at most this many training tokens")
    g.add_argument("--data-seed", type=int, help="seed of the batch order (default: --seed)")
    g.add_argument("--seq-len", type=int)
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    g.add_argument("--grad-accum-steps", type=int, help="micro-batches per optimizer step")
    g.add_argument("--num-steps", type=int, help="optimizer steps (default 60)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, help="final learning rate (default lr / 10)")
    g.add_argument("--lr-scheduler", choices=["cosine", "linear", "constant"])
    g.add_argument("--warmup-steps", type=int, help="linear warm-up (default 10%% of steps, at most 100)")
    g.add_argument("--weight-decay", type=float, help="AdamW decay on matrices only (default 0.1)")
    g.add_argument("--grad-clip", type=float, help="max gradient norm, 0 turns clipping off (default 1.0)")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--amp", action=argparse.BooleanOptionalAction,
                   help="autocast; default on where the device has native bf16. --no-amp: fp32")
    g.add_argument("--amp-dtype", choices=["bf16", "fp16"], help="fp16 uses a GradScaler (CUDA only)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                   help="CPU: leave glibc malloc's defaults (each step's big tensors then page-fault anew)")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--checkpoint-path", help="default <out-dir>/checkpoints/ckpt.pt")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-path (without --out-dir: the latest run in runs/)")
    g.add_argument("--save-interval", type=int, help="steps between checkpoints (default 50; and at the end)")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, help="steps between log lines (default 10)")
    g.add_argument("--eval-interval", type=int, help="steps between evaluations (default 20; and at the end)")
    g.add_argument("--eval-iters", type=int, help="validation batches per evaluation (default 10)")
    g.add_argument("--out-dir", help="run directory (default runs/<date-time>)")
    g = p.add_argument_group("instrumentation")
    g.add_argument("--no-stage-timing", dest="stage_timing", action="store_false",
                   help="stop timing the stages (their profiler/NVTX ranges stay): for overhead measurements")
    g.add_argument("--use-profiler", action="store_true",
                   help="torch.profiler trace of steps --profile-step-start..end-1 into <out-dir>/traces/")
    g.add_argument("--profile-step-start", type=int, help="first profiled step (default 5)")
    g.add_argument("--profile-step-end", type=int, help="step after the last profiled one (default 7)")
    g.add_argument("--profile-ranks", help="ranks that profile: a list like 0,1 or 'all' (default 0)")
    g.add_argument("--profile-with-stack", action="store_true", help="record Python stacks (larger, slower traces)")
    g.add_argument("--nsys", action="store_true",
                   help="cudaProfilerStart/Stop around the profile window, for nsys --capture-range=cudaProfilerApi")
    g.add_argument("--record-memory-history", action="store_true",
                   help="CUDA allocation history; snapshot at the end of the window or run, and on OOM")
    g.add_argument("--memory-history-entries", type=int, help="allocations kept in the history (default 100000)")
    g.add_argument("--memory-snapshot-path", help="default <out-dir>/snapshots/rank{R}_snapshot.pickle")
    g = p.add_argument_group("memory")
    g.add_argument("--memory-profiler", action="store_true",
                   help="measure one step: params, grads, optimizer state, saved activations per module; "
                        "writes <out-dir>/memory_trace/rank{R}_dp{R}/ (memory.log, sunburst charts)")
    g.add_argument("--memory-profile-step", type=int, help="the measured step (default --profile-step-start)")
    g.add_argument("--estimate-memory", action="store_true",
                   help="print the predicted memory of this configuration and exit (builds no model)")
    g.add_argument("--device-memory-gb", type=float,
                   help="GiB the estimate must fit in (default: the GPU's memory on CUDA, else this machine's RAM)")
    g = p.add_argument_group("distributed (under torchrun)")
    g.add_argument("--ddp-backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU")
    g.add_argument("--ddp-timeout", type=float,
                   help="seconds a collective may wait for a missing rank before the job fails (default 300)")
    g.add_argument("--straggler-threshold", type=float,
                   help="report a rank whose relative or individual score falls below this (default 0.75)")
    g.add_argument("--simulate-slow-rank", metavar="R:MS[:STAGE]",
                   help="teaching/testing aid: rank R sleeps MS ms in STAGE (default forward) every step")
    return p


EXTRA_ARGS_ENV = "MINIGPT_ARGS"


def parse_args(argv: list[str] | None = None, prog: str = "train_minimal.py") -> TrainConfig:
    """Flags over preset over defaults, then validated. Raises UsageError.

    Flags in the environment variable MINIGPT_ARGS are appended to the command line, so they win
    over the same flags given there: a way to scale every command of a script or of the
    walkthrough down to a quick run (MINIGPT_ARGS="--preset tiny --num-steps 8")."""
    try:
        extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    except ValueError as e:
        raise UsageError(f"${EXTRA_ARGS_ENV} does not parse as shell words ({e}): {os.environ[EXTRA_ARGS_ENV]!r}")
    argv = list(sys.argv[1:] if argv is None else argv) + extra
    given = vars(build_parser(prog).parse_args(argv))
    preset = given.get("preset", DEFAULT_PRESET)
    values = {**PRESETS[preset], **given, "preset": preset}
    known = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in known})
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
    validate(cfg)
    if cfg.memory_profiler and cfg.memory_profile_step is None:
        cfg.memory_profile_step = cfg.profile_step_start  # after warm-up, the same step as the trace
    return cfg


def validate(cfg: TrainConfig) -> None:
    positive = ["n_layers", "n_heads", "d_model", "d_ff", "seq_len", "batch_size", "grad_accum_steps",
                "num_steps", "max_position_embeddings", "save_interval", "log_interval",
                "eval_interval", "eval_iters"]
    for name in positive + ["vocab_size", "max_tokens"]:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if cfg.lr <= 0:
        raise UsageError(f"--lr must be positive, got {cfg.lr}")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise UsageError(f"--min-lr must be between 0 and --lr ({cfg.lr}), got {cfg.min_lr}")
    for name in ["warmup_steps", "weight_decay", "grad_clip"]:
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative, got {getattr(cfg, name)}")
    if not 0 <= cfg.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.d_model % cfg.n_heads:
        raise UsageError(f"--d-model ({cfg.d_model}) must be divisible by --n-heads ({cfg.n_heads})")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len ({cfg.seq_len}) is larger than --max-position-embeddings "
                         f"({cfg.max_position_embeddings}); lower --seq-len or raise the other")
    if cfg.memory_history_entries <= 0:
        raise UsageError(f"--memory-history-entries must be positive, got {cfg.memory_history_entries}")
    if cfg.use_profiler or cfg.nsys or cfg.record_memory_history:
        s, e = cfg.profile_step_start, cfg.profile_step_end
        if not 1 <= s < e <= cfg.num_steps:
            raise UsageError(f"the profile window needs 1 <= --profile-step-start < --profile-step-end <= "
                             f"--num-steps; got start {s}, end {e}, num-steps {cfg.num_steps}")
    if cfg.nsys and cfg.use_profiler:
        raise UsageError("--nsys and --use-profiler exclude each other (both capture the same steps, "
                         "and each distorts the other); pick one")
    profile_ranks(cfg.profile_ranks, world_size=None)  # the format; the range is checked at start-up
    if not 0 < cfg.straggler_threshold <= 1:
        raise UsageError(f"--straggler-threshold must be in (0, 1], got {cfg.straggler_threshold}")
    if cfg.ddp_timeout <= 0:
        raise UsageError(f"--ddp-timeout must be positive, got {cfg.ddp_timeout}")
    if cfg.use_toy_data and (cfg.train_data or cfg.val_data):
        raise UsageError("--use-toy-data generates its own data; drop --train-data/--val-data")
    if cfg.memory_profile_step is not None and not cfg.memory_profiler:
        raise UsageError("--memory-profile-step needs --memory-profiler")
    if cfg.memory_profiler:
        step = cfg.memory_profile_step if cfg.memory_profile_step is not None else cfg.profile_step_start
        if not 1 <= step <= cfg.num_steps:
            given = "--memory-profile-step" if cfg.memory_profile_step is not None else \
                "--memory-profile-step (default: --profile-step-start)"
            raise UsageError(f"{given} is {step}, outside the run's steps 1..{cfg.num_steps}; "
                             "pass --memory-profile-step N within them")
    if cfg.device_memory_gb is not None and not cfg.device_memory_gb > 0:
        raise UsageError(f"--device-memory-gb must be positive, got {cfg.device_memory_gb}")


def profile_ranks(spec: str, world_size: int | None) -> list[int] | None:
    """Parse --profile-ranks: 'all' (None: every rank) or a comma-separated list of ranks."""
    if spec.strip() == "all":
        return None
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        raise UsageError(f"--profile-ranks must be 'all' or a list like 0,1; got {spec!r}") from None
    if world_size is not None and any(not 0 <= r < world_size for r in ranks):
        raise UsageError(f"--profile-ranks {spec} names a rank outside 0..{world_size - 1} "
                         f"(the world size is {world_size})")
    return ranks


def check_cuda_features(cfg: TrainConfig, device: str) -> None:
    """--nsys and --record-memory-history drive CUDA's profiler and allocator: nothing to do on a CPU."""
    if device == "cuda":
        return
    if cfg.nsys:
        raise UsageError("--nsys needs CUDA: Nsight Systems' capture range is cudaProfilerStart/Stop; "
                         "on the CPU use --use-profiler")
    if cfg.record_memory_history:
        raise UsageError("--record-memory-history needs CUDA: it records the CUDA caching allocator; "
                         "on the CPU see the memory breakdown instead")


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
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        if native:
            return True, "bf16", "AMP on: bf16 autocast (this CPU has native bf16)"
        if cfg.amp:
            return True, "bf16", "AMP on as asked, but this CPU has no native bf16: expect it slower than fp32"
        return False, "fp32", "AMP off: this CPU has no native bf16 (AVX512-BF16/AMX), so fp32 is faster; --amp forces it"
    if cfg.amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
        if cfg.amp:
            raise UsageError("this GPU does not support bf16; use --amp-dtype fp16")
        return True, "fp16", "AMP on: this GPU lacks bf16, using fp16 with a GradScaler"
    return True, cfg.amp_dtype, f"AMP on: {cfg.amp_dtype} autocast" + (" with a GradScaler" if cfg.amp_dtype == "fp16" else "")
