"""Where the memory goes, measured: a breakdown of one training step, memory.log and sunburst
charts in InternEvo's layout. Its predicting counterpart is minigpt/instruments/estimate.py.

    python train_minimal.py --memory-profiler                 # measure step --profile-step-start

Measuring (model-agnostic: any nn.Module and optimizer). Wrap one whole training step:

    with capture_memory(model, optimizer, step=5) as cap:
        loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    breakdown = cap.breakdown

- parameters: every parameter of the model, once (a tied weight is one tensor);
- gradients: the real `.grad` tensors, read when autograd accumulates them (a hook per parameter),
  because the step ends with zero_grad(set_to_none=True), and, for any the hooks missed (a gradient
  assigned rather than accumulated), read from `.grad` as the optimizer step begins (a step
  pre-hook). Under FSDP2 they are the reduce-scattered shards, one storage per block;
- optimizer state: the tensors in `optimizer.state`, read after the step (they exist from the
  first step on);
- activations: the tensors autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks` and attributed to the module that runs when they are
  saved (forward pre/post hooks on every module keep a stack of module paths).

Every figure counts storages, not tensors: a storage is counted once however many views of it are
saved (q, k and v are three views of one qkv output), and a saved tensor whose storage is a
parameter's (a weight saved by a matmul) counts as a parameter, not as an activation. Sharded
models (FSDP2, tensor parallelism) count each DTensor's local shard; the full weights FSDP2
all-gathers for a block's forward are parameters too ("gathered"), never activations, and at the
peak its all-gather buffers are named as gathered parameters, its reduce-scatter buffer and the
unsharded gradients as gradients. The live
total of saved bytes is kept as tensors are saved and released, and its highest value is the
activation peak; under non-reentrant activation checkpointing the forward saves only each block's
input (the block's insides are recomputed during backward, under the checkpoint's own hooks).
Under autocast the saved tensors include the low-precision copies of the Linear weights that
autocast makes (one per weight per forward), which live until backward like any activation.

The categories above are not a peak: gradients and activations are never all alive at once, and
the ops' temporaries (the logits, their gradient) are in none of them. The measured peak is: the
step runs under a profiler session of the capture's own (profile_memory=True), the allocator's
events are replayed in order from what was live at the start, and the highest total is `peak`,
with when it happened (stage, module, op) and every byte live at that moment named, in parts
that add up to it exactly (PEAK_PARTS). docs/memory.md explains how, and how it was checked
against the allocator's own count and the kernel's resident pages. On CUDA
torch.cuda.max_memory_allocated() is the reference and what the events miss is named as such.
Under torch.compile the saved tensors are the compiled graph's, attributed to the modules Dynamo
leaves in place.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

from minigpt.analysis.breakdown_log import (
    CATEGORIES,
    LAYOUT,
    MB,
    MEMORY_LOG,
    PEAK_PART_NAMES,
    PEAK_PARTS,
    PEAK_ROOT,
    PEAK_SECTION,
    SUMMARY_DEPTH,
    SUNBURST_FILES,
    MiB,
    category_rows,
    layer_line,
    peak_rows,
    sunburst,
    tree_rows,
)
from minigpt.analysis.html import write_plotly_js
from minigpt.config import STAGE_NAMES
from minigpt.core import torchcompat
from minigpt.core.torchcompat import TreeEvent
from minigpt.fileio import atomic_write

# What this module reads of estimate.MemoryEstimate (a type only: no import at run time).
if TYPE_CHECKING:

    class MemoryEstimate(Protocol):
        def to_record(self) -> dict: ...


GiB = 2**30

# Saved tensors of ops that run in no submodule take the op's name; the cross-entropy's are the loss.
LOSS_OPS = (
    "cross_entropy",
    "nll_loss",
    "log_softmax",
    "LogSoftmaxBackward",
    "NllLossBackward",
    "CrossEntropy",
)
NO_MODULE = "(outside any submodule)"
# On CUDA: max_memory_allocated less the replayed peak. Mostly blocks allocated before the step
# that no Python tensor holds (the cuBLAS workspaces, one per handle), which the session never sees.
NOT_SEEN = "(not seen by the profiler)"  # saved tensors whose op could not be told (no profiler session)
# Names of the markers a capture writes into its own profiler session (never seen outside it).
_MARK = "minigpt.instruments.breakdown::"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, tensor parallelism): the bytes this rank holds."""
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return t.to_local()
    return t


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int]:
    """(a key that identifies t's storage, the storage's size in bytes)."""
    t = _local(t)
    try:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (fake, nested, ...)
        return ("id", id(t)), t.numel() * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- the breakdown


@dataclass
class MemoryBreakdown:
    """One step's memory, in bytes. Each category maps a path to the bytes held there: parameter
    and gradient paths are parameter names (`blocks.0.attn.qkv.weight`), optimizer state paths add
    the state's key (`...qkv.weight.exp_avg`), activation paths are module paths (`blocks.0.attn`),
    or, for tensors saved by ops that ran in no submodule, the op's name and what the tensor is
    (`loss (log_softmax output: bfloat16 log-probs)`).

    `peak` is the allocator's highest figure in the step and `peak_parts` what was live at that
    moment, {part: {name: bytes}} for the parts of PEAK_PARTS: they add up to `peak` exactly."""

    step: int | None
    params: dict[str, int]
    grads: dict[str, int]
    optimizer: dict[str, int]
    activations: dict[str, int]
    activations_peak: int  # highest live total of saved tensors during the captured step
    activation_dtypes: dict[str, int]  # bytes of saved storages per dtype ("bfloat16": ...)
    device: str = "cpu"
    cuda_max_allocated: int | None = None
    cuda_max_reserved: int | None = None
    time: float = field(default_factory=time.time)
    peak: int | None = None  # the allocator's peak in the step (None: not measured, see peak_note)
    peak_stage: str | None = None  # data_to_device, forward, backward, optimizer_step (or outside them)
    peak_where: str | None = None  # e.g. "backward / loss (cross_entropy) / LogSoftmaxBackward0: ..."
    peak_parts: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_note: str | None = None  # why the peak was not measured
    allocator_peak_delta: int | None = None  # the allocator's own "Total Allocated" rise: a cross-check
    start_bytes: int | None = None  # live at the start of the step (params, optimizer state, held tensors)

    def category_total(self, category: str) -> int:
        return sum(getattr(self, category).values())

    def subtree(self, category: str, prefix: str) -> int:
        """Bytes under a path, e.g. subtree("activations", "blocks.0")."""
        return sum(
            v
            for k, v in getattr(self, category).items()
            if k == prefix or k.startswith(prefix + ".") or not prefix
        )

    def peak_part(self, part: str) -> int:
        return sum(self.peak_parts.get(part, {}).values())

    @property
    def total(self) -> int:
        """params + grads + optimizer state + the activation peak: the sum InternEvo reports as
        total_memory. Gradients and activations are not all alive at once (backward frees one as it
        makes the other), and the ops' temporaries are not in it: `peak` is the true figure."""
        return sum(self.category_total(c) for c in ("params", "grads", "optimizer")) + self.activations_peak

    @property
    def other(self) -> int | None:
        """CUDA: max_memory_allocated minus the named parts (temporaries, workspaces, rounding)."""
        return None if self.cuda_max_allocated is None else self.cuda_max_allocated - self.total

    def to_record(self, estimate: MemoryEstimate | None = None) -> dict:
        """The stable record that metrics.jsonl carries under "memory_breakdown" (bytes). `peak` is
        the measured peak (the benchmarks' peak column), `peak_stage` when it happened."""
        record = {
            "step": self.step,
            "device": self.device,
            "params": self.category_total("params"),
            "grads": self.category_total("grads"),
            "optimizer": self.category_total("optimizer"),
            "activations": self.category_total("activations"),
            "activations_peak": self.activations_peak,
            "total": self.total,
            "activation_dtypes": dict(self.activation_dtypes),
            "cuda_max_allocated": self.cuda_max_allocated,
            "cuda_max_reserved": self.cuda_max_reserved,
            "other": self.other,
            "peak": self.peak,
            "peak_stage": self.peak_stage,
            "peak_where": self.peak_where,
            "peak_parts": {p: self.peak_part(p) for p in PEAK_PARTS} if self.peak is not None else None,
            "temporaries": dict(self.peak_parts.get("temporaries", {})),
            "peak_activations": dict(self.peak_parts.get("activations", {})),
            "held": dict(self.peak_parts.get("held", {})),
            "peak_note": self.peak_note,
            "start_bytes": self.start_bytes,
        }
        if estimate is not None:
            record["estimate"] = estimate.to_record()
        return record


class _Marks:
    """The capture's markers in its own profiler session: instants ordered with the allocator's
    events, each index naming what happened then (kind, data pointer, bytes, module, dtype): a saved
    tensor packed or released, a gradient made, a block from before the step freed."""

    def __init__(self):
        self.items: list[tuple] = []
        self.on = False  # only while the capture's profiler records

    def note(self, kind: str, ptr: int, nbytes: int = 0, module: str = "", dtype: str = "") -> None:
        if self.on:
            self.items.append((kind, ptr, nbytes, module, dtype))
            torchcompat.mark(f"{_MARK}{len(self.items) - 1}")


class _Saved:
    """What autograd keeps instead of a saved tensor while we watch: the tensor, and a note to the
    count when autograd lets go of it (after the backward of its node, or with the graph)."""

    __slots__ = ("tensor", "key", "count")

    def __init__(self, tensor: torch.Tensor, key: tuple, count: _SavedTensors):
        self.tensor, self.key, self.count = tensor, key, count

    def __del__(self):
        self.count.release(self.key)


class _SavedTensors:
    """The tensors autograd saves for backward, by storage: the live total and its highest value
    (the activation peak), and the bytes each module saved in the first forward (the layout).
    Safe from autograd's thread."""

    def __init__(self, modules: list[str], marks: _Marks):
        self.marks = marks
        self.lock = threading.Lock()
        self.refs: dict[tuple, int] = defaultdict(int)
        self.live_bytes: dict[tuple, int] = {}
        self.live = self.peak = 0
        self.seen: set = set()
        self.by_module: dict[str, int] = defaultdict(int, {n: 0 for n in modules})
        self.dtypes: dict[str, int] = defaultdict(int)
        self.root_saves: list[tuple[int, int]] = []  # (marker index, bytes): named by their op, later
        self.forward_done = False  # later micro-batches add to the peak, not to the layout

    def pack(self, t: torch.Tensor, key: tuple, nbytes: int, module: str) -> _Saved:
        with self.lock:
            if self.refs[key] == 0:
                self.live += nbytes
                self.live_bytes[key] = nbytes
                self.peak = max(self.peak, self.live)
                self.marks.note("pack", key[2], nbytes, module, _dtype_name(t.dtype))
            self.refs[key] += 1
            if not self.forward_done and key not in self.seen:  # attribute the first forward only
                self.seen.add(key)
                if module == "" and self.marks.on:
                    self.root_saves.append((len(self.marks.items) - 1, nbytes))
                else:
                    self.by_module[module or NO_MODULE] += nbytes
                self.dtypes[_dtype_name(t.dtype)] += nbytes
        return _Saved(t, key, self)

    def release(self, key: tuple) -> None:
        with self.lock:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.live -= self.live_bytes.pop(key)
                del self.refs[key]
                self.marks.note("release", key[2])


class _Baseline:
    """What the allocator holds as the step begins, {data pointer: [bytes, part, name]}: the
    parameters, the optimizer state, gradients kept from before, and every other tensor that
    Python can reach (the caller's last logits, batches). The profiler sees only allocations
    made after it starts; frees of these are noted by a marker when their last tensor dies."""

    def __init__(self, device: str, marks: _Marks):
        self.device, self.marks = device, marks
        self.blocks: dict[int, list] = {}
        self._owners: dict[int, int] = defaultdict(int)
        self._watched: list = []

    def add(self, t: torch.Tensor, part: str, name: str) -> None:
        t = _local(t)
        if t.device.type != self.device or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
            if not storage.resizable() or storage.nbytes() == 0:  # not the allocator's (numpy, mmap)
                return
        except (RuntimeError, NotImplementedError):
            return
        self.blocks.setdefault(storage.data_ptr(), [storage.nbytes(), part, name])

    def scan(self, model: nn.Module, optimizer, names: dict[int, str]) -> None:
        params = dict(model.named_parameters())
        for name, p in params.items():
            self.add(p, "params", name)
        for name, p in params.items():
            if p.grad is not None:
                self.add(p.grad, "grads", name)
        if optimizer is not None:
            for i, (p, state) in enumerate(optimizer.state.items()):
                for k, v in state.items():
                    if torch.is_tensor(v):
                        self.add(v, "optimizer", f"{names.get(id(p), f'param{i}')}.{k}")
        for buf_name, buf in model.named_buffers():
            self.add(buf, "held", f"buffer {buf_name}")
        self._scan_held()

    def _scan_held(self) -> None:
        # Garbage in reference cycles not yet collected would count as held tensors (and hold
        # allocator memory until the collector happens to run): collect it before the scan, so the
        # measured step starts from what is really live.
        gc.collect()
        for obj in gc.get_objects():
            # not isinstance: it reads __class__, which warns on deprecated module objects. Parameters
            # of this model are already in `blocks`; another model's are held like any tensor.
            if not issubclass(type(obj), torch.Tensor):
                continue
            try:
                t = _local(obj)
                if t.device.type != self.device:
                    continue
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            fn = type(obj.grad_fn).__name__ if obj.grad_fn is not None else ""
            self.add(obj, "held", f"{_dtype_name(obj.dtype)}{list(obj.shape)}" + (f" ({fn})" if fn else ""))
            if ptr in self.blocks and self.blocks[ptr][1] == "held":
                self._owners[ptr] += 1
                self._watched.append(weakref.ref(obj, self._gone(ptr)))

    def _gone(self, ptr: int):
        def callback(_ref) -> None:
            self._owners[ptr] -= 1
            if self._owners[ptr] == 0:
                self.marks.note("free", ptr)

        return callback

    def forget(self) -> None:
        self._watched = []


def _param_bytes(params: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each parameter's bytes in the model's order; a storage shared by several (a tied weight) once."""
    out, seen = {}, set()
    for name, p in params.items():
        key, nbytes = _storage_key_and_bytes(p)
        out[name] = 0 if key in seen else nbytes
        seen.add(key)
    return out


def _grad_bytes(order: dict[str, int], grads: dict[str, tuple[tuple, int]]) -> dict[str, int]:
    """The gradients seen, in the model's order; a storage shared by several gradients once."""
    out, seen = {}, set()
    for name in [n for n in order if n in grads]:
        key, nbytes = grads[name]
        out[name] = 0 if key in seen else nbytes
        seen.add(key)
    return out


def _optimizer_bytes(optimizer, names: dict[int, str], order: dict[str, int]):
    """({param.state_key: bytes}, {data pointer: param.state_key}) of the optimizer's state tensors,
    in the model's parameter order."""
    out: dict[str, int] = {}
    ptrs: dict[int, str] = {}
    if optimizer is None:
        return out, ptrs
    index = {name: i for i, name in enumerate(order)}
    states = sorted(
        ((names.get(id(p), f"param{i}"), state) for i, (p, state) in enumerate(optimizer.state.items())),
        key=lambda item: index.get(item[0], len(index)),
    )
    seen: set = set()
    for name, state in states:
        for k, v in state.items():
            if torch.is_tensor(v):
                key, nbytes = _storage_key_and_bytes(v)
                out[f"{name}.{k}"] = 0 if key in seen else nbytes
                ptrs[key[2]] = f"{name}.{k}"
                seen.add(key)
    return out, ptrs


class _PeakSession:
    """The capture's own profiler session (profile_memory=True: every allocation and free), and
    what the allocator held as it began: together, the step's peak, when it came, and every byte
    live then."""

    def __init__(self, device: str, marks: _Marks):
        self.device, self.marks = device, marks
        self.baseline = _Baseline(device, marks)
        self.prof: torch.profiler.profile | None = None

    def start(self, model: nn.Module, optimizer, names: dict[int, str]) -> None:
        self.baseline.scan(model, optimizer, names)  # before the session: it sees only what comes after
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.prof = profile(activities=activities, profile_memory=True)
        self.prof.__enter__()
        self.marks.on = True

    def stop(self) -> None:
        if self.marks.on:
            self.marks.on = False
            self.prof.__exit__(None, None, None)

    def measure(self, b: MemoryBreakdown, optimizer_ptrs: dict[int, str], root_saves: list) -> None:
        """Fill in b's peak from the stopped session, every byte live then named; `root_saves`:
        (marker index, bytes) of tensors saved outside any submodule, named after their op."""
        timeline = _timeline(self.prof, self.device, self.marks.items)
        _replay(b, timeline, self.baseline.blocks, self.marks.items, optimizer_ptrs)
        for index, nbytes in root_saves:
            name = timeline.mark_names.get(index) or NO_MODULE
            b.activations[name] = b.activations.get(name, 0) + nbytes
        if b.cuda_max_allocated is not None:  # the CUDA allocator's own figure is the reference
            temps = b.peak_parts.setdefault("temporaries", {})
            temps[NOT_SEEN] = b.cuda_max_allocated - b.peak
            b.peak_parts["temporaries"] = dict(sorted(temps.items(), key=lambda kv: -kv[1]))
            b.peak = b.cuda_max_allocated
        self.baseline.forget()


class MemoryCapture:
    """Context manager around one training step (forward, backward, optimizer step); afterwards
    `.breakdown` holds the figures. Hooks are removed on exit, also when the step fails.

    With `peak=True` (the default) the step also runs under a profiler session of its own that
    records every allocation and free (torch.profiler, profile_memory=True): the peak, when it
    happened, and what was live then. A profiler already running (the trainer's trace window)
    cannot be nested: the peak is then not measured, and `peak_note` says so."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        peak: bool = True,
    ):
        self.model, self.optimizer, self.step, self.want_peak = model, optimizer, step, peak
        self.breakdown: MemoryBreakdown | None = None
        self._names = {id(p): n for n, p in model.named_parameters()}

    # -- saved tensors
    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage_key_and_bytes(t)
        if key in self._param_keys or key in self._own_keys.get(self._stack[-1], ()):
            # a parameter saved for backward (the weights of a matmul), or the copy FSDP2 gathered of
            # one for the running module's forward: counted as a parameter, not an activation
            return t
        return self._saved.pack(t, key, nbytes, self._stack[-1])

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    # -- context manager
    def __enter__(self) -> MemoryCapture:
        params = dict(self.model.named_parameters())
        self._param_keys = {_storage_key_and_bytes(p)[0] for p in params.values()}
        self._params = _param_bytes(params)
        self._grads: dict[str, tuple[tuple, int]] = {}
        self._own_keys: dict[str, set] = {}  # module -> the storages of its own parameters as it runs
        self._hooked: set[int] = set()  # gathered (unsharded) parameters whose gradient is watched
        self._stack = [""]  # the module paths running now (forward pre/post hooks)
        self._ranges: list = []  # the open record_function ranges of those modules
        self._marks = _Marks()
        self._saved = _SavedTensors([n for n, _ in self.model.named_modules()], self._marks)
        self._session: _PeakSession | None = None
        self._peak_note = None
        self.cuda = any(p.is_cuda for p in params.values())
        self._device = "cuda" if self.cuda else "cpu"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the peak of this step only
        self._exit = ExitStack()
        try:
            if self.want_peak and torchcompat.profiler_running():
                self._peak_note = (
                    "not measured: another profiler was running during this step (measure a step "
                    "outside the trace window)"
                )
            elif self.want_peak:
                self._session = _PeakSession(self._device, self._marks)
                self._session.start(self.model, self.optimizer, self._names)
            self._install_hooks(params)
        except BaseException:
            self._exit.close()
            if self._session is not None:
                self._session.stop()
            raise
        return self

    def _install_hooks(self, params: dict[str, torch.Tensor]) -> None:
        for name, module in self.model.named_modules():
            self._exit.callback(module.register_forward_pre_hook(self._enter_module(name)).remove)
            hook = self._leave_module(name, root=module is self.model)
            self._exit.callback(module.register_forward_hook(hook, always_call=True).remove)
        for name, p in params.items():
            if p.requires_grad:
                self._exit.callback(p.register_post_accumulate_grad_hook(self._grad_hook(name)).remove)
        if self.optimizer is not None:  # gradients that came without AccumulateGrad (see _before_step)
            self._exit.callback(self.optimizer.register_step_pre_hook(self._before_step).remove)
        self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append(name)
            self._own_keys[name] = self._gathered(name, module)
            if self._marks.on and name:
                self._ranges.append(torchcompat.range_enter(f"{_MARK}module:{name}"))

        return hook

    def _leave_module(self, name: str, root: bool):
        def hook(module, args, output):
            if len(self._stack) > 1:
                self._stack.pop()
            if self._marks.on and name and self._ranges:
                torchcompat.range_exit(self._ranges.pop())
            if root:
                self._saved.forward_done = True

        return hook

    def _gathered(self, name: str, module: nn.Module) -> set:
        """The storages of `module`'s own parameters as its forward starts. Under FSDP2 these are
        not the sharded parameters seen on entering but the full copies its pre-forward hook (which
        runs before this one) all-gathered: a matmul that saves its weight then saves a parameter,
        not an activation. Their gradients (autograd's, before FSDP2 reduce-scatters them into
        the shards) are watched too, to name them at the peak."""
        keys = set()
        for pname, p in module.named_parameters(recurse=False):
            key = _storage_key_and_bytes(p)[0]
            keys.add(key)
            if key not in self._param_keys and p.requires_grad and id(p) not in self._hooked:
                self._hooked.add(id(p))
                full = f"{name}.{pname}" if name else pname
                hook = self._grad_hook(full, unsharded=True)
                self._exit.callback(p.register_post_accumulate_grad_hook(hook).remove)
        return keys

    def _grad_hook(self, name: str, unsharded: bool = False):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            key_bytes = _storage_key_and_bytes(p.grad)
            if not unsharded:
                self._grads[name] = key_bytes
            label = f"{name} (unsharded before the reduce-scatter)" if unsharded else name
            self._marks.note("grad", key_bytes[0][2], 0, label)

        return hook

    def _before_step(self, optimizer, args, kwargs) -> None:
        """The gradients the optimizer is about to use, read from `.grad`, for any parameter whose
        gradient no AccumulateGrad hook reported (a gradient assigned directly, as FSDP2 does with
        the reduce-scattered shard; torch 2.13 calls the hooks for it, other versions need not)."""
        for name, p in self.model.named_parameters():
            if p.grad is not None and name not in self._grads:
                self._grad_hook(name)(p)

    def __exit__(self, *exc) -> None:
        self._exit.close()
        while self._ranges:  # a module whose forward failed before its post-hook
            torchcompat.range_exit(self._ranges.pop())
        if self.cuda:
            torch.cuda.synchronize()
        if self._session is not None:
            self._session.stop()
        if exc[0] is None:
            self.breakdown = self._breakdown()
        self._session = None

    def _breakdown(self) -> MemoryBreakdown:
        optimizer, optimizer_ptrs = _optimizer_bytes(self.optimizer, self._names, self._params)
        saved = self._saved
        b = MemoryBreakdown(
            self.step,
            self._params,
            _grad_bytes(self._params, self._grads),
            optimizer,
            {k: v for k, v in saved.by_module.items() if v},
            saved.peak,
            dict(sorted(saved.dtypes.items())),
            device=self._device,
            peak_note=self._peak_note,
        )
        if self.cuda:
            b.cuda_max_allocated, b.cuda_max_reserved = (
                torch.cuda.max_memory_allocated(),
                torch.cuda.max_memory_reserved(),
            )
        if self._session is not None:
            self._session.measure(b, optimizer_ptrs, saved.root_saves)
        return b


def capture_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    peak: bool = True,
) -> MemoryCapture:
    """`with capture_memory(model, optimizer) as cap:` around one training step."""
    return MemoryCapture(model, optimizer, step, peak)


# ---------------------------------------------------------------------------- the peak

# Ranges that are not ops: the profiler's step, the loop's step range (stages are matched apart).
_RANGES = ("ProfilerStep", "train_step", "backward_compute", "##")
_FSDP_RANGES = (torchcompat.FSDP_GATHER_RANGE, torchcompat.FSDP_REDUCE_RANGE)


@dataclass
class _Timeline:
    """The capture's profiler session, flattened in time order: allocations with where they
    happened, and the capture's markers."""

    events: list[tuple]  # ("alloc", ptr, bytes (negative: a free), total, where) or ("mark", index, where)
    mark_names: dict[int, str]  # marker index -> the op it fired in (for saved tensors of no submodule)


@dataclass(frozen=True)
class _Where:
    stage: str
    module: str  # "" when no submodule ran (or it could not be told)
    node: str  # the autograd node in backward ("MmBackward0"), else ""
    outer: str  # the outermost aten op under the module ("aten::linear"), else ""
    inner: str  # the innermost ("aten::mm")
    fsdp: str = ""  # inside FSDP2's all-gather ("gather") or gradient reduction ("reduce"), else ""
    fsdp_unit: str = ""  # the module FSDP2 gathers or reduces for ("blocks.1"; "" for the root)

    def fsdp_part(self) -> tuple[str, str] | None:
        """(part, name) at the peak for memory FSDP2 allocates: the all-gather's buffers and the full
        parameters copied out of them are parameters (gathered), the reduce-scatter's input buffer
        gradients; None elsewhere."""
        unit = self.fsdp_unit or "the root module"  # no commas: memory.log's rows are comma-separated
        if self.fsdp == "gather":
            return "params", f"{unit} (gathered by FSDP)"
        if self.fsdp == "reduce":
            return "grads", f"{unit} (FSDP reduce-scatter input)"
        return None

    def is_loss(self) -> bool:
        return not self.module and any(k in f"{self.outer} {self.inner} {self.node}" for k in LOSS_OPS)

    def owner(self) -> str:
        if self.is_loss():
            return "loss (cross_entropy)"
        return self.module or NO_MODULE

    def op(self) -> str:
        ops = self.outer if self.outer == self.inner or not self.inner else f"{self.outer} > {self.inner}"
        return f"{self.node}: {ops}" if self.node else ops

    def describe(self) -> str:
        """e.g. "backward / loss (cross_entropy) / LogSoftmaxBackward0: aten::_log_softmax_backward_data";
        no commas and no dots outside module paths: memory.log's rows are comma-separated."""
        return f"{self.stage} / {self.owner()}" + (f" / {self.op()}" if self.op() else "")


def _timeline(prof, device: str, marks: list[tuple]) -> _Timeline:
    """The capture's profiler session in time order (ties in tree order): its allocations on
    `device`, each with where it happened, and its markers (`marks`: what each one noted)."""
    seq_module: dict[int, str] = {}  # forward op's sequence number -> its module (for backward nodes)
    raw: list[tuple] = []
    order = 0

    def walk(e: TreeEvent, ctx: dict) -> None:
        nonlocal order
        order += 1
        if e.kind == "alloc":
            if e.device == device and e.nbytes != 0:
                raw.append((e.start_ns, order, "alloc", e.ptr, e.nbytes, e.total, _where(ctx)))
            return
        if e.kind == "op":
            if e.name.startswith(_MARK) and not e.name.startswith(f"{_MARK}module:"):
                raw.append((e.start_ns, order, "mark", int(e.name[len(_MARK) :]), 0, 0, _where(ctx)))
                return
            ctx = _op_context(e, ctx, seq_module)
        for child in e.children:
            walk(child, ctx)

    for root in torchcompat.event_tree(prof):
        walk(root, {})
    raw.sort(key=lambda e: (e[0], e[1]))
    events, names = [], {}
    for _, _, kind, a, nbytes, total, where in raw:
        if kind == "alloc":
            events.append(("alloc", a, nbytes, total, where))
        else:
            events.append(("mark", a, where))
            if where.outer and a < len(marks):
                names[a] = _saved_name(where, marks[a][4], marks[a][2])
    return _Timeline(events, names)


def _op_context(e: TreeEvent, ctx: dict, seq_module: dict[int, str]) -> dict:
    """Where the ops under `e` run: the context of its parent with what `e` says (a module range of
    the capture's, a stage, FSDP2's gather or reduction, an autograd node, an op)."""
    ctx, name = dict(ctx), e.name
    if name.startswith(_MARK):  # "minigpt.instruments.breakdown::module:blocks.0"
        ctx["module"] = name[len(f"{_MARK}module:") :]
    elif name in STAGE_NAMES:
        ctx["stage"] = name
    elif name.startswith(_FSDP_RANGES):  # "FSDP::all_gather (blocks.1)": FSDP2's own memory
        ctx["fsdp"] = "gather" if name.startswith(_FSDP_RANGES[0]) else "reduce"
        ctx["fsdp_unit"] = name.partition(" (")[2].removesuffix(")")
    elif name.startswith(torchcompat.AUTOGRAD_NODE_RANGE):
        ctx["node"] = name.split(": ", 1)[1]
        ctx["module"] = seq_module.get(e.sequence, "")
        ctx.pop("outer", None)
    elif "::" in name or not name.startswith(_RANGES):  # an op, or an autograd.Function's forward
        ctx.setdefault("outer", name)
        if e.sequence >= 0 and not ctx.get("node"):  # the op that made the autograd node (addmm under linear)
            seq_module.setdefault(e.sequence, ctx.get("module", ""))
        ctx["inner"] = name
    return ctx


def _where(ctx: dict) -> _Where:
    return _Where(
        ctx.get("stage", "outside the stages"),
        ctx.get("module", ""),
        ctx.get("node", ""),
        ctx.get("outer", ""),
        ctx.get("inner", ctx.get("outer", "")),
        ctx.get("fsdp", ""),
        ctx.get("fsdp_unit", ""),
    )


_INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")


def _saved_name(where: _Where, dtype: str = "", nbytes: int = 0) -> str:
    """The name of a tensor saved by an op that ran in no submodule: for the loss, what the tensor
    is, by the op that saved it and its dtype; else the op itself. F.cross_entropy is log_softmax
    then nll_loss: log_softmax saves its output (the
    log-probs, in the logits' dtype on CUDA under autocast, fp32 elsewhere), nll_loss its input,
    the targets and a scalar weight total. When log_softmax ran in fp32 nll_loss's input is that
    same storage, counted once under log_softmax; under CUDA autocast nll_loss (autocast's fp32
    list) runs on a float32 copy of the bf16/fp16 log-probs, a storage of its own."""
    op = where.inner.removeprefix("aten::")
    if not where.is_loss():
        return f"op {where.outer.removeprefix('aten::')}"
    if "log_softmax" in op:
        return f"loss (log_softmax output: {dtype or 'the'} log-probs)"
    if op.startswith("nll_loss"):
        if dtype in _INTEGER_DTYPES:
            return "loss (nll_loss targets)"
        if 0 < nbytes <= 8:  # a 0-d tensor: the sum of the targets' weights
            return "loss (nll_loss weight total)"
        return f"loss (nll_loss input: {dtype or 'the'} log-probs)"
    return f"loss ({op})"


def _replay(
    b: MemoryBreakdown,
    timeline: _Timeline,
    baseline: dict[int, list],
    marks: list[tuple],
    optimizer_ptrs: dict[int, str],
) -> None:
    """Walk the allocations in order from what was live at the start; the highest total is the
    peak. Then walk again to that moment and name every byte live there."""
    events = timeline.events
    base = _held_at_start(events, baseline)
    whole = _walk(events, marks, timeline.mark_names, base, None)
    b.start_bytes = sum(v[0] for v in base.values())
    at_peak = _walk(events, marks, timeline.mark_names, base, whole.at + 1)
    b.peak = whole.peak
    b.peak_parts = _name_live(at_peak, optimizer_ptrs)
    if whole.at >= 0:
        where = events[whole.at][-1]
        b.peak_stage = where.stage
        b.peak_where = where.describe()
    else:
        b.peak_stage, b.peak_where = "before the step", "at the start of the step"
    if whole.first_total is not None:
        b.allocator_peak_delta = max(0, whole.top_total - whole.first_total)


def _held_at_start(events: list[tuple], baseline: dict[int, list]) -> dict[int, list]:
    """The baseline, and the blocks freed in the session that it never allocated and the scan of
    Python's tensors did not find (an earlier profiler session's): they were live at the start too."""
    allocated: set[int] = set()
    base = {ptr: list(v) for ptr, v in baseline.items()}
    for e in events:
        if e[0] == "alloc":
            ptr, nbytes = e[1], e[2]
            if nbytes > 0:
                allocated.add(ptr)
            elif ptr in allocated:
                allocated.discard(ptr)
            elif ptr not in base:
                base[ptr] = [-nbytes, "held", "not reachable from Python"]
    return base


@dataclass
class _Walk:
    """The state of a replay after its last event: the highest total and the event it came at."""

    peak: int
    at: int  # index of the event that reached the peak; -1: the start
    live: dict[int, tuple[int, _Where]] = field(default_factory=dict)  # allocated in the step
    base_live: dict[int, list] = field(default_factory=dict)  # held from the start, not yet freed
    saved: dict[int, tuple[str, int]] = field(default_factory=dict)  # ptr -> (who saved it, bytes)
    grad_ptrs: dict[int, str] = field(default_factory=dict)  # ptr -> the parameter whose gradient
    first_total: int | None = None  # the allocator's total before the first event
    top_total: int | None = None  # the allocator's highest total


def _walk(
    events: list[tuple],
    marks: list[tuple],
    mark_names: dict[int, str],
    base: dict[int, list],
    stop: int | None,
) -> _Walk:
    """Replay events[:stop] from `base`."""
    w = _Walk(0, -1, base_live=dict(base))
    current = w.peak = sum(v[0] for v in w.base_live.values())
    for i, e in enumerate(events[:stop]):
        if e[0] == "alloc":
            _, ptr, nbytes, total, where = e
            if w.first_total is None:
                w.first_total = total - nbytes
            w.top_total = total if w.top_total is None else max(w.top_total, total)
            if nbytes > 0:
                w.live[ptr] = (nbytes, where)
                current += nbytes
            elif ptr in w.live:
                current -= w.live.pop(ptr)[0]
            elif ptr in w.base_live:
                current -= w.base_live.pop(ptr)[0]
        else:
            kind, ptr, nbytes, module, _ = marks[e[1]]
            if kind == "pack":
                w.saved[ptr] = (module or mark_names.get(e[1]) or NO_MODULE, nbytes)
            elif kind == "release":
                w.saved.pop(ptr, None)
            elif kind == "grad":
                w.grad_ptrs[ptr] = module
            elif kind == "free" and ptr in w.base_live:
                current -= w.base_live.pop(ptr)[0]
        if current > w.peak:
            w.peak, w.at = current, i
    return w


def _name_live(w: _Walk, optimizer_ptrs: dict[int, str]) -> dict[str, dict[str, int]]:
    """Every byte live at the end of a walk, {part: {name: bytes}} (PEAK_PARTS), largest first."""
    parts: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PEAK_PARTS}
    for nbytes, part, name in w.base_live.values():
        parts[part][f"held before the step: {name}" if part == "held" else name] += nbytes
    for ptr, (nbytes, where) in w.live.items():
        if ptr in w.saved:
            parts["activations"][w.saved[ptr][0]] += nbytes
        elif ptr in w.grad_ptrs:
            parts["grads"][w.grad_ptrs[ptr]] += nbytes
        elif ptr in optimizer_ptrs:
            parts["optimizer"][optimizer_ptrs[ptr]] += nbytes
        elif fsdp := where.fsdp_part():
            parts[fsdp[0]][fsdp[1]] += nbytes
        else:
            parts["temporaries"][where.describe()] += nbytes
    return {p: dict(sorted(v.items(), key=lambda kv: -kv[1])) for p, v in parts.items()}


# ---------------------------------------------------------------------------- trees


# ---------------------------------------------------------------------------- memory.log


def _mb(nbytes: float) -> str:
    return f"{nbytes / MiB:.2f} MiB"


def _pct(measured: float, estimated: float) -> str:
    return "n/a" if not measured else f"{100 * (estimated - measured) / measured:+.1f}%"


def format_memory_log(b: MemoryBreakdown, estimate: MemoryEstimate | None = None) -> str:
    """memory.log in InternEvo's layout: a state with its summary, then each category's tree, one
    `layer:` line per node, indented by depth, with exact bytes after the MiB figures; then the
    measured peak, part by part, each byte named (peak_layout)."""
    s = {c: b.category_total(c) for c in CATEGORIES}
    lines = [
        "Memory State:",
        f"step: {b.step}",
        f"time: {time.strftime(TIME_FORMAT, time.gmtime(b.time))}",  # InternEvo's is a Unix time
        "---summary---",
        f"total_memory: {_mb(b.total)}",
        f"params_memory: {_mb(s['params'])}, grads_memory: {_mb(s['grads'])}, "
        # No fp32 master copy: autocast keeps the parameters themselves in fp32.
        f"os_params_memory: {_mb(0)}, os_state_memory: {_mb(s['optimizer'])}, "
        f"activation_memory: {_mb(s['activations'])}",
        f"activation_peak_memory: {_mb(b.activations_peak)}",
        "activation_dtype_memory: " + ", ".join(f"{k}: {_mb(v)}" for k, v in b.activation_dtypes.items()),
    ]
    if b.peak is not None:
        lines.append(
            f"peak_memory: {_mb(b.peak)}, "
            + ", ".join(f"peak_{part}_memory: {_mb(b.peak_part(part))}" for part in PEAK_PARTS)
        )
        lines.append(f"peak_stage: {b.peak_stage}")
        lines.append(f"peak_where: {b.peak_where}")
    elif b.peak_note:
        lines.append(f"peak_note: {b.peak_note}")
    if b.cuda_max_allocated is not None:
        lines.append(
            f"cuda_memory: max_allocated: {_mb(b.cuda_max_allocated)}, "
            f"max_reserved: {_mb(b.cuda_max_reserved)}, other_memory: {_mb(b.other)}"
        )
    if estimate is not None:
        e = estimate.to_record()
        pairs = [
            ("params_memory", s["params"], e["params"]),
            ("grads_memory", s["grads"], e["grads"]),
            ("os_state_memory", s["optimizer"], e["optimizer"]),
            ("activation_memory", s["activations"], e["activations"]),
            ("total_memory", b.total, e["total"]),
        ]
        if b.peak is not None:
            pairs.append(("peak_memory", b.peak, e["peak"]))
        lines.append(
            "estimate_memory: " + ", ".join(f"{k}: {_mb(est)} ({_pct(m, est)})" for k, m, est in pairs)
        )
    lines.append(
        "bytes: "
        + ", ".join(
            f"{k}={v}"
            for k, v in [
                ("total", b.total),
                ("params", s["params"]),
                ("grads", s["grads"]),
                ("os_params", 0),
                ("os_state", s["optimizer"]),
                ("activation", s["activations"]),
                ("activation_peak", b.activations_peak),
            ]
            + ([("peak", b.peak)] if b.peak is not None else [])
        )
    )
    lines.append("---Layout---")
    for category, (root, section) in LAYOUT.items():
        lines.append(f"{section}:")
        for path, depth, own, total in tree_rows(getattr(b, category), root):
            lines.append(f"{'  ' * depth}{layer_line(path, own, total)}")
    if b.peak is not None:
        lines.append(f"{PEAK_SECTION}:")
        lines.append(layer_line(PEAK_ROOT, 0, b.peak))
        for part in PEAK_PARTS:
            lines.append(f"  {layer_line(part, 0, b.peak_part(part))}")
            for name, nbytes in b.peak_parts.get(part, {}).items():
                lines.append(f"    {layer_line(name, nbytes, nbytes)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- sunburst charts


def _sunburst_html(rows: list[tuple[str, str, str, int]], title: str, plotly_src: str) -> str:
    """rows: (id, label, parent id, bytes). Offline HTML that loads plotly.js from `plotly_src`, a
    path relative to the page (the run folder's one copy)."""
    import plotly.graph_objects as go  # imported when charts are written, not by the trainer

    fig = go.Figure(
        sunburst(
            rows,
            # each slice says its size, as the report's charts do: a slice's area alone reads as a share
            texttemplate="%{label}<br>%{customdata:.1f} MiB",
            hovertemplate="%{id}<br>%{customdata:.2f} MiB<br>%{percentRoot:.1%} of the chart<extra></extra>",
        )
    )
    fig.update_layout(title=title, margin=dict(t=80, l=0, r=0, b=0))  # two-line titles
    return fig.to_html(include_plotlyjs=plotly_src, full_html=True)


def write_memory_trace(
    b: MemoryBreakdown, folder: Path, estimate: MemoryEstimate | None = None, run_dir: Path | None = None
) -> list[Path]:
    """memory.log and the sunburst charts into `folder`, each written to a temporary name and
    renamed into place; the charts load plotly.min.js from `run_dir` (default `folder`), written
    there once for every page of the run. Returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    js = write_plotly_js(run_dir if run_dir is not None else folder)
    src = Path(os.path.relpath(js.resolve(), folder.resolve())).as_posix()
    _sunburst = partial(_sunburst_html, plotly_src=src)
    mib = lambda c: b.category_total(c) / MiB  # noqa: E731
    titles = {
        "params": f"Parameters: {mib('params'):.2f} MiB",
        "grads": f"Gradients: {mib('grads'):.2f} MiB",
        "optimizer": f"Optimizer state: {mib('optimizer'):.2f} MiB",
        "activations": f"Activations saved for backward (first forward): {mib('activations'):.2f} MiB",
    }
    files = {MEMORY_LOG: format_memory_log(b, estimate)}
    for category in CATEGORIES:
        rows = category_rows(getattr(b, category), category)
        files[SUNBURST_FILES[category]] = _sunburst(rows, titles[category])
    step = f" at step {b.step}" if b.step is not None else ""
    if b.peak is not None:
        files[SUNBURST_FILES["peak"]] = _sunburst(
            peak_rows(b.peak_parts),
            f"Measured peak{step}: {b.peak / MiB:.2f} MiB (what was live then; the parts add up to it)"
            f"<br>in {b.peak_where}",
        )
    summary = [("total", "sum of the categories", "", sum(b.category_total(c) for c in CATEGORIES))]
    for category in CATEGORIES:
        summary += category_rows(getattr(b, category), category, max_depth=SUMMARY_DEPTH, parent="total")
    peak = (
        f"the measured peak is {b.peak / MiB:.2f} MiB ({SUNBURST_FILES['peak']})"
        if b.peak is not None
        else "the peak was not measured"
    )
    files[SUNBURST_FILES["summary"]] = _sunburst(
        summary,
        f"By category{step}: {sum(b.category_total(c) for c in CATEGORIES) / MiB:.2f} MiB, a sum of parts "
        "never all live at once<br>(parameters + gradients + optimizer state + every saved activation; "
        f"{peak})",
    )
    paths = []
    for name, text in files.items():
        path = folder / name
        atomic_write(path, text)
        paths.append(path)
    return paths


def format_breakdown(b: MemoryBreakdown, estimate: MemoryEstimate | None = None) -> str:
    """The console table: each measured figure, and beside it the estimate and the difference."""
    e = estimate.to_record() if estimate is not None else {}
    rows = [
        ("parameters", b.category_total("params"), "params"),
        ("gradients", b.category_total("grads"), "grads"),
        ("optimizer state", b.category_total("optimizer"), "optimizer"),
        ("activations (saved for backward)", b.category_total("activations"), "activations"),
        ("activation peak", b.activations_peak, "activations"),
        ("total (params+grads+optimizer+peak)", b.total, "total"),
    ]
    head = f"Memory breakdown at step {b.step} ({b.device}):"
    lines = [head, f"  {'':38s}{'measured':>12s}" + (f"{'estimate':>12s}{'diff':>9s}" if e else "")]
    for label, measured, key in rows:
        line = f"  {label:38s}{measured / MB:>8.2f} MiB"
        if e:
            line += f"{e[key] / MB:>8.2f} MiB{_pct(measured, e[key]):>9s}"
        lines.append(line)
    dtypes = ", ".join(f"{k} {v / MB:.2f} MiB" for k, v in b.activation_dtypes.items())
    lines.append(f"  activations by dtype: {dtypes}")
    lines += _peak_table(b, e)
    if b.cuda_max_allocated is not None:
        lines += _cuda_lines(b)
    return "\n".join(lines)


def _cuda_lines(b: MemoryBreakdown) -> list[str]:
    """The CUDA allocator's figures, and why max_allocated is not the total above: part by part,
    what was live at the peak less what the total counts (every term is bytes named above)."""
    head = f"  CUDA max allocated {b.cuda_max_allocated / MB:.2f} MiB"
    head += f" (reserved {b.cuda_max_reserved / MB:.2f} MiB)"
    if b.peak is None:
        return [f"{head}; above the total by {b.other / MB:+.2f} MiB, not measured part by part"]
    terms = [
        ("temporaries of the ops at the peak", b.peak_part("temporaries")),
        ("gradients not live at the peak", b.peak_part("grads") - b.category_total("grads")),
        ("parameters", b.peak_part("params") - b.category_total("params")),
        ("optimizer state", b.peak_part("optimizer") - b.category_total("optimizer")),
        (
            "saved activations at the peak less the activation peak (allocator blocks outsize tensors)",
            b.peak_part("activations") - b.activations_peak,
        ),
        ("held from before the step", b.peak_part("held")),
    ]
    lines = [f"{head} is the measured peak: {b.other / MB:+.2f} MiB over the total, the sum of:"]
    lines += [f"    {name} {v / MiB:+.2f} MiB" for name, v in terms if round(v / MiB, 2)]
    not_seen = b.peak_parts.get("temporaries", {}).get(NOT_SEEN)
    if not_seen:
        lines.append(
            f"    of the temporaries, {not_seen / MiB:+.2f} MiB the profiler did not see: blocks from "
            "before the step that no tensor holds (cuBLAS workspaces, 32 MiB a handle on Hopper)"
        )
    return lines


def _peak_table(b: MemoryBreakdown, e: dict) -> list[str]:
    """format_breakdown's lines for the measured peak: the figure, when, and the largest names of
    each part; or why it was not measured."""
    if b.peak is None:
        return [f"  measured peak: {b.peak_note}"] if b.peak_note else []
    line = f"  {'measured peak (the allocator)':38s}{b.peak / MiB:>8.2f} MiB"
    if e:
        line += f"{e['peak'] / MiB:>8.2f} MiB{_pct(b.peak, e['peak']):>9s}"
    lines = [line, f"    when: {b.peak_where}"]
    for part in PEAK_PARTS:
        items = sorted(((n, v) for n, v in b.peak_parts.get(part, {}).items() if v), key=lambda kv: -kv[1])
        if items:
            shown = [(n, v) for n, v in items[:3] if abs(v) >= 0.05 * MiB] or items[:1]
            rest = items[len(shown) :]
            more = [f"{len(rest)} more, {sum(v for _, v in rest) / MiB:.2f} MiB together"] if rest else []
            line = f"    {PEAK_PART_NAMES[part]:28s}{b.peak_part(part) / MiB:>8.2f} MiB"
            one = f"{line}  ({'; '.join([*(f'{n} {v / MiB:.1f}' for n, v in shown), *more])})"
            if len(one) <= LINE:
                lines.append(one)
            else:  # long names (a stack's): one a line under the part's figure
                lines += [line, *(f"      {_cut(n, LINE - 20)} {v / MiB:.1f} MiB" for n, v in shown)]
                lines += [f"      {x}" for x in more]
    return lines


TIME_FORMAT = "%Y-%m-%d %H:%M:%S UTC"  # memory.log's `time:` (the parser reads it, or a Unix time)
LINE = 160  # the longest line the table prints (a terminal's width at a glance)


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."
