"""Checkpoints: written atomically, read as data only (`weights_only=True`), and complete enough
that a resumed run repeats, on the CPU, the losses of a run that never stopped."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from minigpt.config import UsageError
from minigpt.fileio import atomic_open

# The fields that fix the model's shape: a checkpoint whose values differ cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "max_position_embeddings", "n_layers", "n_heads", "d_model", "d_ff")
REQUIRED_KEYS = {"model", "optimizer", "scaler", "step", "data_position", "rng", "config", "model_config"}


def rng_state() -> dict:
    """Every random number generator a training step draws from (dropout, init, Python)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's GPU: other ranks save their own
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write to a temporary file beside the target, flush it to disk, then rename it into place:
    a crash mid-write leaves the previous checkpoint whole."""
    with atomic_open(path) as f:
        torch.save(state, f)


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint as plain data (tensors, numbers, strings): never code."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path} to resume from; train without --resume first, "
                         "or point --checkpoint-path at one")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, garbage bytes, a pickle with code in it
        raise UsageError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); "
                         "use an earlier checkpoint or train without --resume") from None
    if not isinstance(state, dict) or not REQUIRED_KEYS <= state.keys():
        missing = sorted(REQUIRED_KEYS - state.keys()) if isinstance(state, dict) else sorted(REQUIRED_KEYS)
        raise UsageError(f"{path} is not a minigpt checkpoint (missing {', '.join(missing)})")
    return state


def check_same_shape(saved: dict, current: dict, path: str | Path) -> None:
    """Refuse a checkpoint whose model shape differs from the flags, naming the differences."""
    diff = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in SHAPE_FIELDS if saved.get(k) != current.get(k)]
    if diff:
        raise UsageError(f"checkpoint {path} holds a different model ({'; '.join(diff)}: checkpoint "
                         "vs flags); pass the flags it was trained with")
