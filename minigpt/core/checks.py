"""The checks across flags, as data: a row runs when the user gave one of its fields
(minigpt/core/config.py's validate() loads this module only then). Each refuses with one line."""

from __future__ import annotations

from minigpt.core.config import TrainConfig, UsageError


def check_across(cfg: TrainConfig, given: set[str] | None) -> None:
    """The rows a field in `given` asks for; every row when `given` is None (the tests hold each
    preset and the defaults to them all)."""
    for asked_by, refuse, why in ACROSS:
        if (given is None or given & asked_by) and refuse(cfg, given or set()):
            raise UsageError(why(cfg) if callable(why) else why)


def check_ranks(cfg: TrainConfig, given: set[str]) -> None:
    """The checks of the flags that need the job's ranks, in the rooms that own them
    (minigpt/core/distributed.py, parallel.py: loaded only then); each raises its own one line."""
    from minigpt.core.distributed import check_slow_rank, profile_ranks
    from minigpt.core.parallel import check_parallel

    if cfg.simulate_slow_rank:
        check_slow_rank(cfg.simulate_slow_rank)
    if cfg.profile_ranks.strip() != "0":
        profile_ranks(cfg.profile_ranks, world_size=None)  # the format; the range is checked at start-up
    if cfg.asks_for_ranks() or cfg.compile:
        check_parallel(cfg, given)


def check_windows(cfg: TrainConfig, given: set[str] | None = None) -> None:
    """The profile window and the measured memory step lie within the run's steps."""
    if cfg.use_profiler or cfg.nsys or cfg.record_memory_history:
        s, e = cfg.profile_step_start, cfg.profile_step_end
        if not 1 <= s < e <= cfg.num_steps:
            raise UsageError(
                f"the profile window needs 1 <= --profile-step-start < --profile-step-end <= "
                f"--num-steps; got start {s}, end {e}, num-steps {cfg.num_steps}"
            )
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


WINDOW_FLAGS = {"use_profiler", "nsys", "record_memory_history", "memory_profiler"}
PARALLEL_FLAGS = {"fsdp", "tp", "use_tensor_parallel", "simulate_slow_rank", "profile_ranks", "compile"}
# The checks across flags, as data: (the fields that ask for the check, when it refuses, why).
# A row runs when the user gave one of its fields: the defaults and every preset pass every row,
# so a row no flag asked for would only prove them again. `why`: a text, or one made from cfg; None
# where the test is a check that raises its own line.
ACROSS = [
    (
        {"memory_snapshot_path"},
        lambda c, g: c.memory_snapshot_path is not None and not c.record_memory_history,
        "--memory-snapshot-path names where --record-memory-history's snapshot goes; "
        "add --record-memory-history, or drop --memory-snapshot-path",
    ),
    (
        {"memory_profile_step"},
        lambda c, g: c.memory_profile_step is not None and not c.memory_profiler,
        "--memory-profile-step needs --memory-profiler",
    ),
    (
        {"nsys", "use_profiler"},
        lambda c, g: c.nsys and c.use_profiler,
        "--nsys and --use-profiler exclude each other (both capture the same steps, and "
        "each distorts the other); pick one",
    ),
    (
        {"use_toy_data", "train_data", "val_data"},
        lambda c, g: c.use_toy_data and (c.train_data or c.val_data),
        "--use-toy-data generates its own data; drop --train-data/--val-data",
    ),
    (
        {"use_toy_data", "max_tokens"},
        lambda c, g: c.use_toy_data and c.max_tokens is not None,
        "--use-toy-data generates its own tokens, which --max-tokens would not change; drop it",
    ),
    (
        {"use_toy_data", "tokenizer_name"},
        lambda c, g: c.use_toy_data and "tokenizer_name" in g,
        "--use-toy-data generates its own tokens, which --tokenizer-name would not change; drop it",
    ),
    (
        {"lr", "min_lr"},
        lambda c, g: not 0 <= c.min_lr <= c.lr,
        lambda c: f"--min-lr must be between 0 and --lr ({c.lr}), got {c.min_lr}",
    ),
    (
        {"d_model", "n_heads"},
        lambda c, g: c.d_model % c.n_heads,
        lambda c: f"--d-model ({c.d_model}) must be divisible by --n-heads ({c.n_heads})",
    ),
    (
        {"seq_len", "max_position_embeddings"},
        lambda c, g: c.seq_len > c.max_position_embeddings,
        lambda c: (
            f"--seq-len ({c.seq_len}) is larger than --max-position-embeddings "
            f"({c.max_position_embeddings}); lower --seq-len or raise the other"
        ),
    ),
    (
        {"no_checkpoint", "save_interval"},
        lambda c, g: c.no_checkpoint and "save_interval" in g,
        "--no-checkpoint writes no checkpoint, so --save-interval has nothing to do; drop one of them",
    ),
    (
        {"no_checkpoint", "checkpoint_path", "resume"},
        lambda c, g: c.no_checkpoint and c.checkpoint_path is not None and not c.resume,
        "--no-checkpoint writes no checkpoint, and without --resume --checkpoint-path "
        "only says where to write one; drop one of them",
    ),
    (
        {"compile_mode", "compile"},
        lambda c, g: c.compile_mode != "default" and not c.compile,
        lambda c: f"--compile-mode {c.compile_mode} without --compile: add --compile",
    ),
    # Checks that say their own line (why None): the profile window and the measured memory step
    # within the run's steps; the flags that need the job's ranks, in the rooms that own them.
    (WINDOW_FLAGS | {"profile_step_start", "profile_step_end", "memory_profile_step"}, check_windows, None),
    (PARALLEL_FLAGS | {"compile_mode"}, check_ranks, None),
]
