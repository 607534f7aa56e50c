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


def state_nbytes(obj) -> int:
    """The bytes of every tensor in a nested state: about the size of the checkpoint file, so a
    full disk can say how much room the save needed."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write to a temporary file beside the target, flush it to disk, then rename it into place:
    a crash mid-write leaves the previous checkpoint whole, and a full disk ends as one line
    (minigpt.fileio.DiskFull) with the previous checkpoint whole."""
    with atomic_open(path, size_hint=state_nbytes(state)) as f:
        torch.save(state, f)


def describe_intact(path: str | Path) -> str:
    """What a run that stops on an error leaves behind, for its last line: the claim that a good
    checkpoint survives is made only when there is one."""
    path = Path(path)
    if path.is_file():
        return f"the last good checkpoint ({path}) was left intact"
    return "no checkpoint had been written yet"


def directory_message(path: Path) -> str:
    return (f"checkpoint path {path} is a directory, not a checkpoint file; point --checkpoint-path at a "
            f"file (for example {path / 'ckpt.pt'})")


def check_checkpoint_path(path: str | Path, resume: bool) -> None:
    """Before anything is built: the one message for each way the checkpoint path can be wrong
    (a directory gets the same line with or without --resume)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(directory_message(path))
    if resume and not path.is_file():
        raise UsageError(f"no checkpoint at {path} to resume from; train without --resume first, "
                         "or point --checkpoint-path at one")
    if not resume and path.exists():
        raise UsageError(f"{path} already exists; pass --resume to continue that run, "
                         "or choose another --out-dir / --checkpoint-path")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_problem(state: dict) -> str | None:
    """The first field whose type or value cannot be what save_checkpoint wrote, described."""
    checks = [
        ("model", lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                        for k, t in v.items()),
         "a dict of tensors"),
        ("optimizer", lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
         and isinstance(v.get("param_groups"), list), "an optimizer state dict (state, param_groups)"),
        ("scaler", lambda v: isinstance(v, dict), "a dict"),
        ("step", lambda v: _is_int(v) and v >= 0, "a non-negative int"),
        ("data_position", lambda v: _is_int(v) and v >= 0, "a non-negative int"),
        ("rng", lambda v: isinstance(v, dict) and isinstance(v.get("torch"), torch.Tensor)
         and v["torch"].dtype == torch.uint8 and isinstance(v.get("python"), tuple), "a dict of RNG states"),
        ("config", lambda v: isinstance(v, dict), "a dict"),
        ("model_config", lambda v: isinstance(v, dict) and all(_is_int(v.get(k)) and v[k] > 0
                                                               for k in SHAPE_FIELDS),
         f"a dict with positive ints for {', '.join(SHAPE_FIELDS)}"),
    ]
    for key, ok, expected in checks:
        if not ok(state[key]):
            value = state[key]
            return f"field {key!r} holds {type(value).__name__} {_short(value)}, expected {expected}"
    per_rank = state.get("rng_per_rank")
    if per_rank is not None and not (isinstance(per_rank, list)
                                     and all(isinstance(r, dict) for r in per_rank)):
        return f"field 'rng_per_rank' holds {type(per_rank).__name__}, expected a list of dicts"
    return None


def _short(v) -> str:
    text = repr(v) if not isinstance(v, (dict, list, torch.Tensor)) else ""
    return f"({text[:40]})" if text else ""


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint as plain data (tensors, numbers, strings): never code. Every field is
    checked for the type save_checkpoint gave it, so a hand-made or damaged file is refused by
    name rather than failing later inside load_state_dict."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(directory_message(path))
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path} to resume from; train without --resume first, "
                         "or point --checkpoint-path at one")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UsageError(f"cannot read checkpoint {path} ({e.strerror or e}); "
                         "check its permissions") from None
    except Exception as e:  # truncated zip, garbage bytes, a pickle with code in it
        raise UsageError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); "
                         "use an earlier checkpoint or train without --resume") from None
    if not isinstance(state, dict) or not REQUIRED_KEYS <= state.keys():
        missing = sorted(REQUIRED_KEYS - state.keys()) if isinstance(state, dict) else sorted(REQUIRED_KEYS)
        raise UsageError(f"{path} is not a minigpt checkpoint (missing {', '.join(missing)})")
    problem = _field_problem(state)
    if problem:
        raise UsageError(f"checkpoint {path} is malformed: {problem}; use a checkpoint written by "
                         "train_minimal.py, or train without --resume")
    return state


def check_same_shape(saved: dict, current: dict, path: str | Path) -> None:
    """Refuse a checkpoint whose model shape differs from the flags, naming the differences."""
    diff = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in SHAPE_FIELDS if saved.get(k) != current.get(k)]
    if diff:
        raise UsageError(f"checkpoint {path} holds a different model ({'; '.join(diff)}: checkpoint "
                         "vs flags); pass the flags it was trained with")
