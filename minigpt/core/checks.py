"""The checks across flags (parse_args loads this module when the user gives a flag beyond
config.QUIET's, which no row below can fail on their own: the defaults and every preset pass them).
Each row: (the flags that ask for it, what must hold, the one line if it does not). What must hold
holds where its flags are left out, so that every row may be run (the tests run them all)."""

from __future__ import annotations

from minigpt.errors import UsageError

DATA_FLAGS = ("train_data", "val_data", "max_tokens", "tokenizer_name")


def window_fits(c) -> bool:
    """The profiler's window (and Nsight's range, the memory history's) lies within the run."""
    asked = c.use_profiler or c.nsys or c.record_memory_history
    return not asked or 1 <= c.profile_step_start < c.profile_step_end <= c.num_steps


ACROSS = [
    (
        "memory_snapshot_path",
        lambda c: c.memory_snapshot_path is None or c.record_memory_history,
        "needs --record-memory-history",
    ),
    (
        "memory_profile_step",
        lambda c: c.memory_profile_step is None or c.memory_profiler,  # parse_args sets it for the profiler
        "needs --memory-profiler",
    ),
    ("nsys use_profiler", lambda c: not (c.nsys and c.use_profiler), "exclude each other: pick one"),
    (
        "use_toy_data " + " ".join(DATA_FLAGS),
        lambda c: not c.use_toy_data or not (c.given & set(DATA_FLAGS)),
        "--use-toy-data makes its own tokens: drop the data flags",
    ),
    ("lr min_lr", lambda c: c.min_lr <= c.lr, "--min-lr must be at most --lr"),
    ("d_model n_heads", lambda c: c.d_model % c.n_heads == 0, "--d-model must be divisible by --n-heads"),
    (
        "seq_len max_position_embeddings",
        lambda c: c.seq_len <= c.max_position_embeddings,
        "--seq-len must be at most --max-position-embeddings (the position table's length)",
    ),
    (
        "no_checkpoint save_interval",
        lambda c: not c.no_checkpoint or "save_interval" not in c.given,
        "--no-checkpoint writes none: drop --save-interval",
    ),
    (
        "no_checkpoint checkpoint_path",
        lambda c: c.resume or not (c.no_checkpoint and c.checkpoint_path),
        "--no-checkpoint writes none: drop --checkpoint-path",
    ),
    ("compile_mode", lambda c: c.compile or "compile_mode" not in c.given, "needs --compile"),
    ("allow_changes", lambda c: c.resume or not c.allow_changes, "needs --resume"),
    (
        "use_profiler nsys record_memory_history profile_step_start profile_step_end num_steps",
        window_fits,
        "the window needs 1 <= --profile-step-start < --profile-step-end <= --num-steps",
    ),
    (
        "memory_profiler memory_profile_step num_steps",
        lambda c: not c.memory_profiler or 1 <= c.memory_profile_step <= c.num_steps,
        "the measured step (--memory-profile-step) must lie within the run's steps (--num-steps)",
    ),
]


def check_across(cfg, given: set[str], both: list[str] = (), commands: tuple = ()) -> None:
    """The rows a flag in `given` asks for (every flag, for the tests); first, in each of the
    `commands` (the command line, $MINIGPT_ARGS), a flag of `both` given with its --no- form."""
    for yes in (flag for flag in both for words in commands if flag in words and f"--no-{flag[2:]}" in words):
        raise UsageError(f"{yes} and --no-{yes[2:]} are alternatives, both given together; keep one")
    for names, holds, why in ACROSS:
        if given & set(names.split()) and not holds(cfg):
            shown = [f"--{n.replace('_', '-')}" for n in names.split() if n in given][:3]
            raise UsageError(f"{', '.join(shown)}: {why}")
