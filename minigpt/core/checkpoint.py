"""Checkpoints: written atomically, read as data only (`weights_only=True`), and complete enough
that a resumed run repeats, on the CPU, the losses of a run that never stopped."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import warnings
import zlib
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from minigpt import config as paths
from minigpt.config import UsageError, flag_name, param_count
from minigpt.core.guards import SHARDED_META, describe_intact, directory_message
from minigpt.errors import NonFiniteLoss
from minigpt.fileio import UnreadableFile, atomic_write, format_bytes, read_bounded

# The fields that fix the model's shape: a checkpoint whose values differ cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "max_position_embeddings", "n_layers", "n_heads", "d_model", "d_ff")
REQUIRED_KEYS = {"model", "optimizer", "scaler", "step", "data_position", "rng", "config", "model_config"}
# What each rank of a sharded checkpoint keeps beside its shards (extra_rank{R}.pt).
EXTRA_KEYS = REQUIRED_KEYS - {"model", "optimizer"}
# Building a model needs its fp32 weights at least (sample.py); the trainer adds gradients and
# AdamW's two moments (16 bytes a parameter, as minigpt.config.check_size counts).
WEIGHT_BYTES = 4
# What a refusal of a checkpoint file offers besides an earlier checkpoint: the trainer's advice by
# default; another caller (sample.py) passes its own, naming its own flags (`instead=`).
INSTEAD = "train without --resume"
CONFIG_JSON_LIMIT = 1 << 20  # config.json is a few KiB; read for the run id only


def rng_state() -> dict:
    """Every random number generator a training step draws from (dropout, init, Python)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # a CUDA run's (a CPU run on a GPU machine never touches the GPU)
        state["cuda"] = torch.cuda.get_rng_state()  # this process's GPU: other ranks save their own
    return state


def rng_problem(state) -> str | None:
    """What is wrong with an RNG state, tried on throwaway generators (never the global ones), so
    a malformed state is refused by name before set_rng_state fails on it mid-restore."""
    if not isinstance(state, dict):
        return f"holds {type(state).__name__}, expected a dict of RNG states"
    t = state.get("torch")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        return "'torch' is not a 1-D uint8 tensor"
    try:
        torch.Generator().set_state(t.clone())
    except (RuntimeError, TypeError, ValueError) as e:
        return f"'torch' is not a generator state ({str(e).splitlines()[0][:80]})"
    try:
        random.Random().setstate(state.get("python"))
    except (TypeError, ValueError, OverflowError):
        return "'python' is not a random.getstate() tuple"
    cuda = state.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1
    ):
        return "'cuda' is not a 1-D uint8 tensor"
    if cuda is not None and torch.cuda.is_available():
        size = torch.cuda.get_rng_state().numel()
        if cuda.numel() != size:
            return f"'cuda' holds {cuda.numel()} bytes, not the {size} of a CUDA generator"
    return None


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_initialized():
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


# What proves a checkpoint whole: a CRC-32 of everything in it (every tensor's dtype, shape and
# bytes, every other value's repr, in a fixed order), written with it and checked on load. torch's
# zip reader checks no CRC of its own: 64 zeroed bytes inside a tensor load without a word.
# Its cost, measured on a 2-core CPU (zlib.crc32 at about 4 GB/s) with the weights and both AdamW
# moments at GPT-2's vocabulary: --preset tiny (3.4 M parameters, 41 MB) 12 ms, --preset small
# (16 M, 195 MB) 47 ms a save and again a load. A checkpoint without one is refused.
CHECKSUM_KEY = "checksum"


def state_crc(obj, crc: int = 0) -> int:
    """The CRC-32 of a nested state (dicts in key order, lists, tuples, tensors, plain values):
    a tensor counts by dtype, shape and its bytes (contiguous, on the CPU), anything else by repr."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{t.dtype}{tuple(obj.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy(), crc) if t.numel() else crc
    if isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            crc = state_crc(obj[k], zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for v in obj:
            crc = state_crc(v, crc)
        return zlib.crc32(type(obj).__name__.encode(), crc)
    return zlib.crc32(repr(obj).encode(), crc)


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write to a temporary file beside the target, flush it to disk, then rename it into place:
    a crash mid-write leaves the previous checkpoint whole, and a full disk ends as one line
    (minigpt.fileio.DiskFull) with the previous checkpoint whole. The state goes with its checksum
    (CHECKSUM_KEY), which check_whole verifies on load."""
    body = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    whole = {**body, CHECKSUM_KEY: {"crc32": state_crc(body)}}
    atomic_write(path, lambda f: torch.save(whole, f), need=state_nbytes(body))


def nonfinite_tensor(state: dict, keys: tuple[str, ...] = ("model", "optimizer")) -> str | None:
    """The name of the first floating-point tensor under `keys` that holds NaN or inf, else None."""

    def walk(obj, name: str) -> str | None:
        if isinstance(obj, torch.Tensor):
            if not obj.is_floating_point() or not obj.numel():
                return None
            # min and max carry a NaN, and an inf is one of them: 30x faster than isfinite().all()
            return None if all(math.isfinite(v) for v in map(float, obj.aminmax())) else name
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        return next((n for k, v in items if (n := walk(v, f"{name}.{k}"))), None)

    return next((n for k in keys if k in state and (n := walk(state[k], k))), None)


def check_whole(state: dict, path: str | Path, instead: str = INSTEAD) -> None:
    """A loaded checkpoint is the one that was saved (its checksum), with no NaN or inf: else one line."""
    fix = f"use an earlier checkpoint, or {instead}"
    saved = state.get(CHECKSUM_KEY)
    if saved is None:
        raise UsageError(f"checkpoint {path} carries no checksum (an older minigpt's, or edited); {fix}")
    body = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    if not (isinstance(saved, dict) and _is_int(saved.get("crc32"))) or saved["crc32"] != state_crc(body):
        raise UsageError(
            f"checkpoint {path} is damaged: its contents do not match the checksum written with "
            f"it (changed on disk or in transit, or edited after it was saved); {fix}"
        )
    if name := nonfinite_tensor(state):
        raise UsageError(f"checkpoint {path} is damaged: {name} holds NaN or inf; {fix}")


# Two runs whose checkpoints were written closer together than this cannot be told apart by age.
AMBIGUOUS_S = 1.0


def latest_run(
    root: str | Path,
    checkpoint_file: str | Path = Path("checkpoints") / "ckpt.pt",
    asker: str = "--resume",
    flag: str = "--checkpoint-path",
    purpose: str = "to continue",
) -> Path:
    """The run under `root` whose checkpoint was written last (by its mtime, not its name:
    'runs/long' sorts after 'runs/20261123-...'). Refused when none has one, or when the two
    newest were written within AMBIGUOUS_S of each other. The messages name who asked (`asker`:
    the trainer's --resume, sample.py) and the flags that tool takes instead (--out-dir, `flag`)."""
    root, depth = Path(root), len(Path(checkpoint_file).parts)
    found = []
    for ckpt in root.glob(f"*/{checkpoint_file}"):
        try:
            found.append((ckpt.stat().st_mtime, ckpt.parents[depth - 1]))
        except OSError:
            continue
    if not found:
        raise UsageError(
            f"{asker}: no run in {root}/ has a checkpoint ({checkpoint_file}); pass --out-dir or {flag}"
        )
    found.sort(key=lambda t: t[0], reverse=True)
    if len(found) > 1 and found[0][0] - found[1][0] < AMBIGUOUS_S:
        raise UsageError(
            f"{asker}: {found[0][1]} and {found[1][1]} saved their checkpoints within "
            f"{AMBIGUOUS_S:g}s of each other; pass --out-dir to say which {purpose}"
        )
    return found[0][1]


def repair_jsonl(path: str | Path, last_step: int | None) -> int:
    """Make a JSON-lines log fit a resume from the checkpoint at `last_step`: drop a partial last
    line (a crash mid-write, which would fuse with the next record), any line that is not a JSON
    object, and records past `last_step` (they are trained again, and no step may appear twice).
    Rewritten atomically, and only when something is dropped. Returns the lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline
    dropped = 1 if partial.strip() else 0
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            dropped += 1
            continue
        if not isinstance(rec, dict):
            dropped += 1
            continue
        step = rec.get("step")
        if last_step is not None and isinstance(step, (int, float)) and step > last_step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        atomic_write(path, b"".join(line + b"\n" for line in kept))
    return dropped


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_problem(state: dict, keys: set[str] = REQUIRED_KEYS) -> str | None:
    """The first field (of `keys`) whose type or value cannot be what save_checkpoint wrote, described."""
    checks = [
        (
            "model",
            lambda v: (
                isinstance(v, dict)
                and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items())
            ),
            "a dict of tensors",
        ),
        (
            "optimizer",
            lambda v: (
                isinstance(v, dict)
                and isinstance(v.get("state"), dict)
                and isinstance(v.get("param_groups"), list)
            ),
            "an optimizer state dict (state, param_groups)",
        ),
        ("scaler", lambda v: isinstance(v, dict), "a dict"),
        ("step", lambda v: _is_int(v) and v >= 0, "a non-negative int"),
        ("data_position", lambda v: _is_int(v) and v >= 0, "a non-negative int"),
        ("rng", lambda v: rng_problem(v) is None, "a dict of RNG states"),
        ("config", lambda v: isinstance(v, dict), "a dict"),
        (
            "model_config",
            lambda v: isinstance(v, dict) and all(_is_int(v.get(k)) and v[k] > 0 for k in SHAPE_FIELDS),
            f"a dict with positive ints for {', '.join(SHAPE_FIELDS)}",
        ),
    ]
    for key, ok, expected in checks:
        if key in keys and not ok(state[key]):
            value = state[key]
            if key == "rng":
                return f"field 'rng' {rng_problem(value)}"
            return f"field {key!r} holds {type(value).__name__} {_short(value)}, expected {expected}"
    per_rank = state.get("rng_per_rank")
    if per_rank is not None:
        if not isinstance(per_rank, list):
            return f"field 'rng_per_rank' holds {type(per_rank).__name__}, expected a list of RNG states"
        for i, r in enumerate(per_rank):
            if problem := rng_problem(r):
                return f"field 'rng_per_rank' entry {i} {problem}"
    return None


def _short(v) -> str:
    text = repr(v) if not isinstance(v, (dict, list, torch.Tensor)) else ""
    return f"({text[:40]})" if text else ""


def read_state(path: Path, instead: str = INSTEAD):
    """torch.load as data only, every failure one line: no permission to read it (the only case
    that says permissions), or bytes that are not a checkpoint (truncated, damaged, a pickle with
    code in it). torch warns before it refuses a pickle of another protocol: that warning is
    silenced, the refusal is the line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise UsageError(f"cannot read checkpoint {path} ({e.strerror}); check its permissions") from None
        raise UsageError(
            f"checkpoint {path} cannot be read whole ({e.strerror or type(e).__name__}): it is "
            f"truncated or damaged; use an earlier checkpoint, or {instead}"
        ) from None
    except Exception as e:  # truncated zip, garbage bytes, a pickle with code in it
        raise UsageError(
            f"checkpoint {path} is damaged (corrupt or truncated) or not a checkpoint ({type(e).__name__}); "
            f"use an earlier checkpoint, or {instead}"
        ) from None


def load_checkpoint(path: str | Path, instead: str = INSTEAD) -> dict:
    """Load a checkpoint as plain data (tensors, numbers, strings): never code. Every field is
    checked for the type save_checkpoint gave it, so a hand-made or damaged file is refused by
    name rather than failing later inside load_state_dict. `instead`: the caller's advice beside
    "use an earlier checkpoint" in those refusals (INSTEAD: the trainer's)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(directory_message(path))
    if not path.is_file():
        raise UsageError(
            f"no checkpoint at {path} to resume from; train without --resume first, "
            "or point --checkpoint-path at one"
        )
    check_file_fits(path)
    state = read_state(path, instead)
    if not isinstance(state, dict) or not REQUIRED_KEYS <= state.keys():
        missing = sorted(REQUIRED_KEYS - state.keys()) if isinstance(state, dict) else sorted(REQUIRED_KEYS)
        raise UsageError(f"{path} is not a minigpt checkpoint (missing {', '.join(missing)})")
    check_whole(state, path, instead)
    problem = _field_problem(state)
    if problem:
        raise UsageError(
            f"checkpoint {path} is malformed: {problem}; use a checkpoint written by "
            f"train_minimal.py, or {instead}"
        )
    check_model_fits(state["model_config"], path)
    del state[CHECKSUM_KEY]  # proven; save_checkpoint writes it anew
    return state


def available_memory_bytes() -> int | None:
    """Memory a new allocation can have without swapping: the kernel's MemAvailable, else the
    machine's RAM (no psutil, no torch); None where the OS says neither."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode(errors="replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def model_bytes(model_config: dict, bytes_per_param: int = WEIGHT_BYTES) -> int:
    """The bytes of a model built from a checkpoint's model_config, torch-free: its parameter
    count (minigpt.config.param_count) times bytes_per_param."""
    c = model_config
    params = param_count(
        c["vocab_size"], c["max_position_embeddings"], c["d_model"], c["d_ff"], c["n_layers"]
    )
    return params * bytes_per_param


def check_model_fits(model_config: dict, path: str | Path, bytes_per_param: int = WEIGHT_BYTES) -> None:
    """Before a model is built from a checkpoint's model_config (sample.py, the trainer): refuse
    one whose weights alone exceed the memory available now, so a checkpoint that says
    n_layers 100000 costs one line instead of the kernel's OOM killer. The config's shape fields
    must already be positive ints (load_checkpoint checks them)."""
    need = model_bytes(model_config, bytes_per_param)
    have = available_memory_bytes()
    if have is not None and need > have:
        shape = ", ".join(f"{k} {model_config[k]}" for k in SHAPE_FIELDS)
        raise UsageError(
            f"checkpoint {path} describes a model of about {format_bytes(need)} ({shape}), more than "
            f"the {format_bytes(have)} of memory available; it cannot be built here: use a "
            "checkpoint of a smaller model, or a machine with more memory"
        )


def check_file_fits(path: Path) -> None:
    """torch.load reads the whole file into memory: refuse one larger than the memory available."""
    try:
        size = path.stat().st_size
    except OSError:
        return  # torch.load names the problem
    have = available_memory_bytes()
    if have is not None and size > have:
        raise UsageError(
            f"checkpoint {path} is {format_bytes(size)}, more than the {format_bytes(have)} of memory "
            "available to load it; use it on a machine with more memory"
        )


def recorded_run_id(out_dir: str | Path) -> str | None:
    """The run id in a run directory's config.json (None: no config.json, or one written before
    run ids, or unreadable: then there is nothing to protect or nothing to compare)."""
    path = Path(out_dir) / paths.CONFIG_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(read_bounded(path, CONFIG_JSON_LIMIT))
    except (UnreadableFile, ValueError, RecursionError):
        return None
    config = data.get("config") if isinstance(data, dict) else None
    run_id = config.get("run_id") if isinstance(config, dict) else None
    return run_id if isinstance(run_id, str) else None


def check_own_run(saved_config: dict, cfg, path: str | Path) -> None:
    """Before --resume touches the run directory (its metrics cut back to the checkpoint's step,
    config.json rewritten, TensorBoard purged): refuse a checkpoint that is not this run's own,
    told by the run id that config.json and every checkpoint record. Then this run takes the
    checkpoint's id, so the run stays one run however often it resumes. A run directory without
    a config.json has no history to lose, and one written before run ids cannot be told apart."""
    saved = saved_config.get("run_id") if isinstance(saved_config, dict) else None
    saved = saved if isinstance(saved, str) else None
    mine = recorded_run_id(cfg.out_dir) if cfg.out_dir else None
    if mine and saved and mine != saved:
        raise UsageError(
            f"checkpoint {path} belongs to another run (run id {saved}) than {cfg.out_dir} (run id "
            f"{mine}): resuming would cut that run's metrics back to the checkpoint's step and "
            "overwrite its config; resume with a new --out-dir, or with that run's own checkpoint"
        )
    if saved:
        cfg.run_id = saved


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _step_ok(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and v.is_floating_point() and bool(torch.isfinite(v).all()) and v.item() >= 0
    return _number(v) and v >= 0


def optimizer_problem(saved: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """What makes a saved optimizer state unfit for `optimizer`, described; None when it fits.
    load_state_dict checks only the number of parameters per group: a moment of the wrong shape
    is accepted and the fused AdamW kernel then reads past its end (a segmentation fault)."""
    groups = saved["param_groups"]
    live = optimizer.param_groups
    if len(groups) != len(live):
        return f"{len(groups)} parameter groups, this model's optimizer has {len(live)}"
    params: dict = {}
    for i, (g, lg) in enumerate(zip(groups, live)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            return f"parameter group {i} is not a dict with a 'params' list"
        if len(g["params"]) != len(lg["params"]):
            return (
                f"parameter group {i} holds {len(g['params'])} parameters, this model's {len(lg['params'])}"
            )
        for key, value in lg.items():
            if key == "params" or key not in g:
                continue
            kept = g[key]
            if isinstance(value, bool) or value is None:
                ok = kept is None or isinstance(kept, bool)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                ok = _number(kept)
            elif isinstance(value, (tuple, list)):
                ok = isinstance(kept, (tuple, list)) and len(kept) == len(value) and all(map(_number, kept))
            else:
                ok = type(kept) is type(value)
            if not ok:
                return f"parameter group {i}'s {key!r} holds {type(kept).__name__} {_short(kept)}"
        for pid, p in zip(g["params"], lg["params"]):
            if not isinstance(pid, int) or isinstance(pid, bool) or pid in params:
                return f"parameter group {i} names parameter {pid!r} twice or not by number"
            params[pid] = p
    state = saved["state"]
    for pid, st in state.items():
        if pid not in params:
            return f"state for parameter {pid!r}, which no parameter group names"
        if not isinstance(st, dict):
            return f"state of parameter {pid} holds {type(st).__name__}, expected a dict"
        p = params[pid]
        for key, value in st.items():
            if key == "step":
                if not _step_ok(value):
                    return f"parameter {pid}'s step is not a finite, non-negative number"
            elif isinstance(value, torch.Tensor):
                if tuple(value.shape) != tuple(p.shape):
                    return (
                        f"parameter {pid}'s {key} has shape {list(value.shape)}, "
                        f"the parameter {list(p.shape)}"
                    )
                if not value.is_floating_point():
                    return f"parameter {pid}'s {key} is {value.dtype}, not floating point"
            else:
                return f"parameter {pid}'s {key} holds {type(value).__name__}, expected a tensor"
    return None


def check_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Before optimizer.load_state_dict: one line for a saved state that does not fit."""
    if problem := optimizer_problem(saved, optimizer):
        raise UsageError(
            f"checkpoint {path}: its optimizer state does not fit this model ({problem}); "
            "use a checkpoint written by train_minimal.py for these flags, or train without --resume"
        )


def check_resume(state: dict, cfg, optimizer: torch.optim.Optimizer, path: str | Path, world: int) -> list:
    """Everything a --resume checks of a loaded one-file checkpoint before any of it is used: the
    run it belongs to (check_own_run), what the flags change (returned), its optimizer state
    against this model's parameters."""
    check_own_run(state["config"], cfg, path)
    saved_world = len(state.get("rng_per_rank") or [None])
    changes = check_changes(state["config"], cfg, saved_world, world, path, state["step"])
    check_optimizer_state(state["optimizer"], optimizer, path)
    return changes


# The flags that make a run what it is: its data, its batch order, its schedule, its precision.
# A --resume that changes one (or the world size) is another run: refused, unless --allow-changes,
# and then each change is kept in config.json (changed_on_resume) and said in the log.
CHANGES_THE_RUN = (
    "train_data val_data tokenizer_name use_toy_data max_tokens seed data_seed batch_size grad_accum_steps "
    "lr min_lr lr_scheduler warmup_steps weight_decay grad_clip dropout tf32 chunked_loss"
).split()
# The precision is compared as the run resolves it (minigpt/instruments/mfu.py), not as flags: --amp
# where AMP was on by default, or --amp-dtype under --no-amp, changes nothing.
# Flags derived from others unless given (as parse_args derives them): compared where given now or
# where given then (the saved value is not its derivation); else a change of the flag they derive
# from says it (--seed for data_seed), or it is no change of the run's (--num-steps for warmup_steps).
DERIVED = {
    "min_lr": lambda c: c["lr"] / 10,
    "warmup_steps": lambda c: min(100, c["num_steps"] // 10),
    "data_seed": lambda c: c["seed"],
}


def check_changes(saved: dict, cfg, saved_world: int, world: int, path, step: int) -> list[str]:
    """Refuse a --resume whose flags change the run (one line naming each change and the fix),
    unless --allow-changes: then they are returned, and join those of earlier resumes in
    cfg.changes (config.json's changed_on_resume)."""
    changes = []
    for k in CHANGES_THE_RUN:
        if k not in saved or same(saved[k], getattr(cfg, k), k in ("train_data", "val_data")):
            continue
        if k in DERIVED and k not in getattr(cfg, "given", ()):
            try:
                derived_then = saved[k] == DERIVED[k](saved)
            except (KeyError, TypeError, ZeroDivisionError):
                derived_then = False
            if derived_then:
                continue
        changes.append(f"{flag_name(k)} {saved[k]!r} -> {getattr(cfg, k)!r}")
    if "amp" in saved and (then := precision(saved, cfg.device)) != (now := precision(vars(cfg), cfg.device)):
        changes.append(f"--amp/--amp-dtype: {then} -> {now}")
    changes += [f"world size {saved_world} -> {world}"] * (saved_world != world)
    if changes and not cfg.allow_changes:
        raise UsageError(
            f"checkpoint {path}: this --resume changes the run ({'; '.join(changes)}); resume with the "
            "flags it was trained with, or add --allow-changes to continue it changed"
        )
    earlier = saved.get("changed_on_resume")
    earlier = [c for c in earlier if isinstance(c, str)] if isinstance(earlier, list) else []
    cfg.changes = earlier + [f"at step {step}: {change}" for change in changes]
    return changes


def same(then, now, paths: bool) -> bool:
    """A flag's value then and now the same; `paths`: lists of paths, the same files however they
    are written (./a.txt, a.txt, /home/me/a.txt from /home/me, through a link)."""
    if paths and all(
        isinstance(v, list) and all(isinstance(p, str) and "\0" not in p for p in v) for v in (then, now)
    ):
        return [os.path.realpath(p) for p in then] == [os.path.realpath(p) for p in now]
    return then == now


def precision(flags: dict, device: str) -> str:
    """The dtype a run of these flags trains in on this machine ("bf16", "fp16", "fp32"), as the
    trainer resolves --amp/--no-amp and --amp-dtype (`device`: --device's value)."""
    from minigpt.instruments.mfu import resolve_amp

    device = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    kept = dict(amp=flags.get("amp"), amp_dtype=flags.get("amp_dtype"), tf32=bool(flags.get("tf32")))
    amp = SimpleNamespace(**kept)
    try:
        return resolve_amp(amp, device)[0]
    except UsageError:  # fp16 on the CPU: another machine's (a GPU's) run
        return f"{amp.amp_dtype} autocast"


def check_same_shape(saved: dict, current: dict, path: str | Path) -> None:
    """Refuse a checkpoint whose model shape differs from the flags, naming the differences."""
    diff = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in SHAPE_FIELDS if saved.get(k) != current.get(k)]
    if diff:
        raise UsageError(
            f"checkpoint {path} holds a different model ({'; '.join(diff)}: checkpoint "
            "vs flags); pass the flags it was trained with"
        )


# ---------------------------------------------------------------------------- sharded (DCP) checkpoints
# Under --fsdp or --tp each rank holds only its shards: torch.distributed.checkpoint writes them
# in parallel, one file per rank, and can reshard them on load to another world size.

SHARDED_EXTRA = "extra_rank{rank}.pt"  # each rank's own `extra` (step, data position, its RNG)


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _model_tp(model: torch.nn.Module) -> int:
    """The tensor-parallel degree the model was split with (1 without TP)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            return p.device_mesh["tp"].size()
    return 1


def save_sharded(
    folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict
) -> None:
    """Every rank writes its shards of the model and AdamW state into `folder`.tmp (DCP, files
    fsynced), and its own `extra` (plain data and tensors: step, RNG state) beside them; after a
    barrier rank 0 renames the folder into place. A crash mid-write leaves the previous checkpoint
    whole; a crash between the two renames leaves it as `folder`.old, which load_sharded finds."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    rank, world = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that crashed
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    save_checkpoint(tmp / SHARDED_EXTRA.format(rank=rank), extra)
    if rank == 0:
        meta = {"world_size": world, "tp": _model_tp(model)}
        atomic_write(tmp / SHARDED_META, json.dumps(meta))
    _barrier()  # every rank's files are on disk
    if rank == 0:
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()  # no rank goes on (and maybe loads) before the rename


# What DCP's metadata file may name when it is unpickled (read off the pickles DCP 2.13 writes): its
# own dataclasses, torch's dtypes, Size and layout lookup, and pathlib's paths (the checkpoint_id).
# Each is data or a harmless constructor; anything else (os.system, a class with __reduce__, any
# other name in those modules) is refused before it is called.
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


def _restricted_unpickler():
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if name in _SAFE_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")

    return Restricted


def _safe_reader_and_planner(folder: Path):
    """DCP's FileSystemReader unpickles `.metadata` with plain pickle.load, and DefaultLoadPlanner
    reads non-tensor values (the optimizer's lr, betas, ...) with torch.load(weights_only=False):
    both could run code from the file. These subclasses read the metadata through a restricted
    unpickler and those values with weights_only=True. (Tensors DCP already reads with
    weights_only=True.)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    from minigpt.core.torchcompat import dcp_set_element

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _restricted_unpickler()(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader(folder), SafePlanner()


def sharded_meta(folder: Path) -> tuple[Path, int, int]:
    """(the folder, its world size, its tensor-parallel degree) of a save_sharded checkpoint: the
    `.old` one where a crash came between save_sharded's two renames; one line for none or a damaged one."""
    if not (folder / SHARDED_META).is_file():
        old = folder.with_name(folder.name + ".old")
        if not (old / SHARDED_META).is_file():
            fix = "train without --resume first, or point --checkpoint-path at one"
            raise UsageError(f"no sharded checkpoint at {folder} to resume from; {fix}")
        folder = old
    try:
        meta = json.loads(read_bounded(folder / SHARDED_META, CONFIG_JSON_LIMIT))
        saved_world, saved_tp = int(meta["world_size"]), int(meta["tp"])
        if saved_world < 1 or saved_tp < 1:
            raise ValueError
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, UnreadableFile):
        raise UsageError(f"{folder / SHARDED_META} is damaged; use an earlier checkpoint") from None
    return folder, saved_world, saved_tp


def load_sharded(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dist_info=None,
) -> dict:
    """Load a save_sharded checkpoint into the (already parallelized) model and optimizer, as
    data only, and return this rank's `extra`. At the writer's world size the continuation is
    exact; at another world size DCP reshards the state, the extra of rank 0 is returned, and a
    message says that the losses will not repeat exactly. Raises UsageError for a missing or
    damaged folder or another tensor-parallel degree."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from minigpt.core import distributed, parallel

    folder, saved_world, saved_tp = sharded_meta(Path(folder))
    rank, world = _rank()
    tp = _model_tp(model)
    if saved_tp != tp:
        raise UsageError(
            f"checkpoint {folder} was saved with tensor-parallel degree {saved_tp}, this run "
            f"uses {tp}: the attention's qkv rows are grouped per tp rank; "
            f"resume with --tp {saved_tp}"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    reader, planner = _safe_reader_and_planner(folder)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        fallback = lines[-1] if lines else type(e).__name__
        why = next((line for line in lines if "not allowed" in line), fallback)
        raise UsageError(
            f"sharded checkpoint {folder} is damaged or does not fit this model ({why[:300]})"
        ) from None
    # The shards carry no checksum of their own (one per rank's shards would not survive a
    # resharding to another world size): what DCP read is checked to be finite, on every rank, and
    # each rank's extra file (written by save_checkpoint) carries its checksum like a one-file one.
    name = nonfinite_tensor({k: {n: parallel.local(t) for n, t in flat(v)} for k, v in state.items()})
    if dist_info is not None and distributed.any_rank(name is not None, dist_info):  # all ranks stop
        name = name or "another rank's shard"
    if name:
        raise UsageError(
            f"sharded checkpoint {folder} is damaged: {name} holds NaN or inf; use an earlier checkpoint"
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if saved_world != world and rank == 0:
        print(
            f"Resharding checkpoint {folder} from {saved_world} ranks to {world}: training continues "
            "from its state, but the losses will not repeat exactly (another batch split and "
            "reduction order)",
            flush=True,
        )
    extra_file = folder / SHARDED_EXTRA.format(rank=rank if saved_world == world else 0)
    if not extra_file.is_file():
        raise UsageError(f"{extra_file} is missing; use an earlier checkpoint")
    extra = read_state(extra_file)
    if isinstance(extra, dict):
        check_whole(extra, extra_file)
        del extra[CHECKSUM_KEY]
        extra["written_by_ranks"] = saved_world
    return extra


def flat(obj, name: str = ""):
    """(dotted name, tensor) for every tensor in a nested state dict: DCP's state, shards included."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flat(v, f"{name}.{i}")


def check_sharded_resume(extra, cfg, folder: str | Path) -> None:
    """restore_sharded's checks of what load_sharded returned, before any of it is used: the
    extra state's keys and types (check_extra), and that it is this run's own (check_own_run)."""
    check_extra(extra, Path(folder) / "extra_rank*.pt")
    check_own_run(extra["config"], cfg, folder)


def check_extra(extra, extra_file: str | Path) -> None:
    """A sharded checkpoint's extra_rank{R}.pt: the keys and types save_run gave it, or one line."""
    if not isinstance(extra, dict) or not EXTRA_KEYS <= extra.keys():
        missing = sorted(EXTRA_KEYS - extra.keys()) if isinstance(extra, dict) else sorted(EXTRA_KEYS)
        raise UsageError(
            f"{extra_file} is not a minigpt checkpoint's extra state (missing {', '.join(missing)}); "
            "use an earlier checkpoint"
        )
    if problem := _field_problem(extra, EXTRA_KEYS):
        raise UsageError(f"{extra_file} is malformed: {problem}; use an earlier checkpoint")


# ---------------------------------------------------------------------------- the trainer's checkpointer


class Checkpointer:
    """The checkpoint a run writes and resumes from: one file written by rank 0, or under
    --fsdp/--tp a folder of shards that every rank writes (DCP). The trainer calls restore() once
    and save() at each save point, and never asks which of the two it is."""

    def __init__(self, cfg, path: Path, sharded: bool, dist_info):
        """`path`: the checkpoint file, or under --fsdp/--tp its folder of shards, as the run
        directory resolved and checked it before anything was built (minigpt/core/runs.py)."""
        self.path, self.cfg, self.sharded, self.dist_info = Path(path), cfg, sharded, dist_info
        self.changed: list[str] = []  # what --allow-changes let a --resume change

    def hold(self, model, optimizer: torch.optim.Optimizer, scaler, batches) -> None:
        """What save() writes."""
        self.model, self.optimizer, self.scaler, self.batches = model, optimizer, scaler, batches

    def check_weights(self, step: int) -> None:
        """Before a save: a checkpoint of non-finite weights would replace the last good one."""
        params = list(self.model.parameters())
        if self.sharded:  # each DTensor's own shard
            from minigpt.core.parallel import local

            params = [local(p) for p in params]
        if not all(torch.isfinite(p).all() for p in params):
            raise NonFiniteLoss(
                f"the weights became non-finite at step {step}; {describe_intact(self.path)}; lower --lr"
            )

    def restore(self, model, optimizer: torch.optim.Optimizer, scaler, batches) -> int:
        """Hold what save() writes and, with --resume, load the checkpoint into it; return its
        step (0 for a fresh run). Refuses a checkpoint that does not fit the flags."""
        self.hold(model, optimizer, scaler, batches)
        if not self.cfg.resume:
            return 0
        return self._load_shards() if self.sharded else self._load_file()

    def _check_step(self, step: int) -> None:
        if step >= self.cfg.num_steps:
            raise UsageError(
                f"checkpoint {self.path} is at step {step}, already past "
                f"--num-steps {self.cfg.num_steps}; raise --num-steps to train further"
            )

    def _load_file(self) -> int:
        path, cfg, rank = self.path, self.cfg, self.dist_info.rank
        state = load_checkpoint(path)
        check_same_shape(state["model_config"], asdict(self.model.cfg), path)
        self.changed = check_resume(state, cfg, self.optimizer, path, self.dist_info.world_size)
        self._check_step(state["step"])
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise UsageError(
                f"checkpoint {path} does not fit this run's flags (model, optimizer or "
                f"--amp-dtype differ: {str(e).splitlines()[0]}); resume with the flags it was "
                "trained with"
            ) from None
        self.batches.position = state["data_position"]
        per_rank = state.get("rng_per_rank") or []
        # last: building the model drew from the generators
        if len(per_rank) == self.dist_info.world_size:
            set_rng_state(per_rank[rank])
        else:  # the world size changed: exact continuation is impossible, keep the ranks' streams apart
            set_rng_state(state["rng"])
            torch.manual_seed(cfg.seed + rank + state["step"])
        return state["step"]

    def _load_shards(self) -> int:
        """Every rank loads its shards (load_sharded)."""
        extra = load_sharded(self.path, self.model, self.optimizer, self.dist_info)
        check_sharded_resume(extra, self.cfg, self.path)  # its keys and types; this run's own checkpoint
        world = self.dist_info.world_size
        saved_world = extra["written_by_ranks"]
        self.changed = check_changes(extra["config"], self.cfg, saved_world, world, self.path, extra["step"])
        check_same_shape(extra["model_config"], asdict(self.model.cfg), self.path)
        self._check_step(extra["step"])
        self.scaler.load_state_dict(extra["scaler"])
        self.batches.position = extra["data_position"]
        set_rng_state(extra["rng"])  # this rank's own stream (rank 0's after a change of world size)
        return extra["step"]

    def save(self, step: int) -> None:
        """Everything a resumed run needs to repeat the uninterrupted one. Called on every rank:
        one file gathers each rank's RNG state (each rank's dropout stream) and rank 0 writes it;
        shards are written by every rank, each with its own RNG state beside them."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        configs = {"config": self.cfg.to_dict(), "model_config": asdict(model.cfg)}
        if self.sharded:
            extra = {"scaler": scaler.state_dict(), "step": step, "data_position": self.batches.position}
            save_sharded(self.path, model, optimizer, {**extra, "rng": rng_state(), **configs})
            return
        per_rank = [rng_state()]
        if self.dist_info.enabled:  # each rank's dropout stream
            from minigpt.core.distributed import gather

            per_rank = gather(per_rank[0], self.dist_info)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "step": step,
            "data_position": self.batches.position,
            "rng": rng_state(),
            "rng_per_rank": per_rank,
            **configs,
        }
        if self.dist_info.is_main:
            save_checkpoint(self.path, state)


def resume(run, model, optimizer: torch.optim.Optimizer, scaler, batches) -> int:
    """--resume: the checkpoint loaded into the model, the optimizer, the scaler and the batches, and
    checked against the flags; its step. Rank 0 also drops the metrics and straggler lines past that
    step, or cut short by a crash, so no step appears twice (the steps after it are trained again).
    `run`: minigpt/core/runs.py's RunDir, which holds the Checkpointer for the saves."""
    run.ckpt = Checkpointer(run.cfg, run.checkpoint, run.sharded, run.dist_info)
    step = run.ckpt.restore(model, optimizer, scaler, batches)
    run.start = f"Resumed from {run.checkpoint} at step {step}"
    if run.ckpt.changed:
        run.start += f", changed (--allow-changes): {'; '.join(run.ckpt.changed)}"
    for name in (paths.METRICS_FILE, paths.STRAGGLERS_FILE):
        if run.dist_info.is_main and (dropped := repair_jsonl(run.path / name, step)):
            cut = f"dropped {dropped} line(s) of {name} past step {step} or cut short"
            run.said.append(f"Cleaned up after an earlier run: {cut}")
    return step
