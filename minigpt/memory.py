"""Where the memory goes, measured: a breakdown of one training step, memory.log and sunburst
charts in InternEvo's layout. Its predicting counterpart is minigpt/estimate.py.

    python train_minimal.py --memory-profiler                 # measure step --profile-step-start

Measuring (model-agnostic: any nn.Module and optimizer). Wrap one whole training step:

    with capture_memory(model, optimizer, step=5) as cap:
        loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    breakdown = cap.breakdown

- parameters: every parameter of the model, once (a tied weight is one tensor);
- gradients: the real `.grad` tensors, read when autograd accumulates them (a hook per parameter),
  because the step ends with zero_grad(set_to_none=True);
- optimizer state: the tensors in `optimizer.state`, read after the step (they exist from the
  first step on);
- activations: the tensors autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks` and attributed to the module that runs when they are
  saved (forward pre/post hooks on every module keep a stack of module paths).

Every figure counts storages, not tensors: a storage is counted once however many views of it are
saved (q, k and v are three views of one qkv output), and a saved tensor whose storage is a
parameter's (a weight saved by a matmul) counts as a parameter, not as an activation. The live
total of saved bytes is kept as tensors are saved and released, and its highest value is the
activation peak; under non-reentrant activation checkpointing the forward saves only each block's
input (the block's insides are recomputed during backward, under the checkpoint's own hooks).
Under autocast the saved tensors include the low-precision copies of the Linear weights that
autocast makes (one per weight per forward), which live until backward like any activation.

On CUDA the breakdown sits beside torch.cuda.max_memory_allocated(); the difference is what the
breakdown does not name: temporary buffers of the ops, library workspaces (cuBLAS, attention),
the allocator's rounding, and, when the parts did not all peak at once, a negative figure.

Not counted either: tensors nobody saves for backward (the logits the model returns, autocast's
weight copies inside checkpointed blocks, cached until the forward ends), DDP's gradient buckets,
and the recomputation inside checkpointed blocks during backward. Under torch.compile the saved
tensors are the compiled graph's, attributed to the modules Dynamo leaves in place.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from minigpt.fileio import atomic_write

if TYPE_CHECKING:
    from minigpt.estimate import MemoryEstimate

MB = 2**20  # memory.log's "MB", as in InternEvo's profiler: 2^20 bytes
GiB = 2**30

# Every file the memory profiler writes, in <out-dir>/memory_trace/rank{R}_dp{R}/ (InternEvo's names).
MEMORY_LOG = "memory.log"
SUNBURST_FILES = {
    "params": "params_memory_sunburst.html",
    "grads": "grads_memory_sunburst.html",
    "optimizer": "os_memory_sunburst.html",
    "activations": "activation_memory_sunburst.html",
    "summary": "summary_sunburst.html",
}
# The root of each category's tree in memory.log, and the section that lists it.
LAYOUT = {
    "params": ("param_mem", "params_layout"),
    "grads": ("grads_mem", "grads_layout"),
    "optimizer": ("os_state_mem", "os_state_layout"),
    "activations": ("activation_mem", "activation_base_layout"),
}
CATEGORIES = tuple(LAYOUT)
SUMMARY_DEPTH = 3  # levels under each category in summary_sunburst.html (total > params > blocks > blocks.0)


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int]:
    """(a key that identifies t's storage, the storage's size in bytes)."""
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
    the state's key (`...qkv.weight.exp_avg`), activation paths are module paths (`blocks.0.attn`;
    "" is the root module and whatever ran outside any submodule)."""

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

    def category_total(self, category: str) -> int:
        return sum(getattr(self, category).values())

    def subtree(self, category: str, prefix: str) -> int:
        """Bytes under a path, e.g. subtree("activations", "blocks.0")."""
        return sum(v for k, v in getattr(self, category).items()
                   if k == prefix or k.startswith(prefix + ".") or not prefix)

    @property
    def total(self) -> int:
        """params + grads + optimizer state + the activation peak: the sum InternEvo reports as
        total_memory. Gradients and activations are not all alive at once (backward frees one as it
        makes the other), so this is an upper bound on the tensors, without the ops' temporaries."""
        return sum(self.category_total(c) for c in ("params", "grads", "optimizer")) + self.activations_peak

    @property
    def other(self) -> int | None:
        """CUDA: max_memory_allocated minus the named parts (temporaries, workspaces, rounding)."""
        return None if self.cuda_max_allocated is None else self.cuda_max_allocated - self.total

    def to_record(self, estimate: "MemoryEstimate | None" = None) -> dict:
        """The stable record that metrics.jsonl carries under "memory_breakdown" (bytes)."""
        record = {
            "step": self.step, "device": self.device,
            "params": self.category_total("params"), "grads": self.category_total("grads"),
            "optimizer": self.category_total("optimizer"), "activations": self.category_total("activations"),
            "activations_peak": self.activations_peak, "total": self.total,
            "activation_dtypes": dict(self.activation_dtypes),
            "cuda_max_allocated": self.cuda_max_allocated, "cuda_max_reserved": self.cuda_max_reserved,
            "other": self.other,
        }
        if estimate is not None:
            record["estimate"] = estimate.to_record()
        return record


class _Saved:
    """What autograd keeps instead of a saved tensor while we watch: the tensor, and a note to the
    capture when autograd lets go of it (after the backward of its node, or with the graph)."""

    __slots__ = ("tensor", "key", "capture")

    def __init__(self, tensor: torch.Tensor, key: tuple, capture: "MemoryCapture"):
        self.tensor, self.key, self.capture = tensor, key, capture

    def __del__(self):
        self.capture._release(self.key)


class MemoryCapture:
    """Context manager around one training step (forward, backward, optimizer step); afterwards
    `.breakdown` holds the figures. Hooks are removed on exit, also when the step fails."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, step: int | None = None):
        self.model, self.optimizer, self.step = model, optimizer, step
        self.breakdown: MemoryBreakdown | None = None
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._lock = threading.Lock()

    # -- saved tensors
    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage_key_and_bytes(t)
        if key in self._param_keys:
            return t  # a parameter saved for backward (fp32 weights of a matmul): counted as a parameter
        with self._lock:
            if self._refs[key] == 0:
                self._live += nbytes
                self._live_bytes[key] = nbytes
                self._peak = max(self._peak, self._live)
            self._refs[key] += 1
            if not self._forward_done and key not in self._seen:  # attribute the first forward only
                self._seen.add(key)
                self._activations[self._stack[-1]] += nbytes
                self._dtypes[_dtype_name(t.dtype)] += nbytes
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: tuple) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                self._live -= self._live_bytes.pop(key)
                del self._refs[key]

    # -- context manager
    def __enter__(self) -> "MemoryCapture":
        params = dict(self.model.named_parameters())
        self._param_keys = {_storage_key_and_bytes(p)[0] for p in params.values()}
        self._params = {}
        seen: set = set()
        for name, p in params.items():
            key, nbytes = _storage_key_and_bytes(p)
            self._params[name] = 0 if key in seen else nbytes
            seen.add(key)
        self._grads: dict[str, tuple[tuple, int]] = {}
        self._refs: dict[tuple, int] = defaultdict(int)
        self._live_bytes: dict[tuple, int] = {}
        self._live = self._peak = 0
        self._seen: set = set()
        self._activations: dict[str, int] = {name: 0 for name, _ in self.model.named_modules()}
        self._dtypes: dict[str, int] = defaultdict(int)
        self._stack = [""]
        self._forward_done = False
        self.cuda = any(p.is_cuda for p in params.values())
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the peak of this step only

        self._exit = ExitStack()
        try:
            for name, module in self.model.named_modules():
                self._exit.callback(module.register_forward_pre_hook(self._enter_module(name)).remove)
                hook = self._leave_module(name, root=module is self.model)
                self._exit.callback(module.register_forward_hook(hook, always_call=True).remove)
            for name, p in params.items():
                if p.requires_grad:
                    self._exit.callback(p.register_post_accumulate_grad_hook(self._grad_hook(name)).remove)
            self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        except BaseException:
            self._exit.close()
            raise
        return self

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _leave_module(self, name: str, root: bool):
        def hook(module, args, output):
            if len(self._stack) > 1:
                self._stack.pop()
            if root:
                self._forward_done = True  # later micro-batches add to the peak, not to the layout
        return hook

    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._grads[name] = _storage_key_and_bytes(p.grad)
        return hook

    def __exit__(self, *exc) -> None:
        self._exit.close()
        if exc[0] is not None:
            return
        grads, seen = {}, set()
        for name in [n for n in self._params if n in self._grads]:  # in the model's order
            key, nbytes = self._grads[name]
            grads[name] = 0 if key in seen else nbytes  # a storage shared by several grads: once
            seen.add(key)
        optimizer: dict[str, int] = {}
        seen = set()
        if self.optimizer is not None:
            order = {name: i for i, name in enumerate(self._params)}
            states = sorted(((self._names.get(id(p), f"param{i}"), state)
                             for i, (p, state) in enumerate(self.optimizer.state.items())),
                            key=lambda item: order.get(item[0], len(order)))
            for name, state in states:
                for k, v in state.items():
                    if torch.is_tensor(v):
                        key, nbytes = _storage_key_and_bytes(v)
                        optimizer[f"{name}.{k}"] = 0 if key in seen else nbytes
                        seen.add(key)
        max_alloc = max_reserved = None
        if self.cuda:
            torch.cuda.synchronize()
            max_alloc, max_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        self.breakdown = MemoryBreakdown(
            step=self.step, params=self._params, grads=grads, optimizer=optimizer,
            activations={k: v for k, v in self._activations.items() if v},
            activations_peak=self._peak, activation_dtypes=dict(sorted(self._dtypes.items())),
            device="cuda" if self.cuda else "cpu", cuda_max_allocated=max_alloc, cuda_max_reserved=max_reserved,
        )


def capture_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   step: int | None = None) -> MemoryCapture:
    """`with capture_memory(model, optimizer) as cap:` around one training step."""
    return MemoryCapture(model, optimizer, step)


# ---------------------------------------------------------------------------- trees

def _tree(leaves: dict[str, int], root: str) -> list[tuple[str, int, int, int]]:
    """Depth-first rows (path, depth, own bytes, subtree bytes) for the leaves' paths and every
    prefix of them, under `root`, in the leaves' order (modules in registration order)."""
    own: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    children: dict[str, list[str]] = defaultdict(list)
    total[root] += 0
    for path, nbytes in leaves.items():
        node = root
        total[root] += nbytes
        for part in path.split(".") if path else []:
            child = f"{node}.{part}"
            if child not in total:
                children[node].append(child)
            total[child] += nbytes
            node = child
        own[node] += nbytes
    rows = []

    def walk(node: str, depth: int) -> None:
        rows.append((node, depth, own[node], total[node]))
        for child in children[node]:
            walk(child, depth + 1)

    walk(root, 0)
    return rows


# ---------------------------------------------------------------------------- memory.log

def _mb(nbytes: float) -> str:
    return f"{nbytes / MB:.2f} MB"


def _pct(measured: float, estimated: float) -> str:
    return "n/a" if not measured else f"{100 * (estimated - measured) / measured:+.1f}%"


def format_memory_log(b: MemoryBreakdown, estimate: "MemoryEstimate | None" = None) -> str:
    """memory.log in InternEvo's layout: a state with its summary, then each category's tree, one
    `layer:` line per node, indented by depth, with exact bytes after the MB figures."""
    s = {c: b.category_total(c) for c in CATEGORIES}
    lines = [
        "Memory State:",
        f"step: {b.step}",
        f"time: {b.time}",
        "---summary---",
        f"total_memory: {_mb(b.total)}",
        f"params_memory: {_mb(s['params'])}, grads_memory: {_mb(s['grads'])}, "
        # No fp32 master copy: autocast keeps the parameters themselves in fp32.
        f"os_params_memory: {_mb(0)}, os_state_memory: {_mb(s['optimizer'])}, "
        f"activation_memory: {_mb(s['activations'])}",
        f"activation_peak_memory: {_mb(b.activations_peak)}",
        "activation_dtype_memory: " + ", ".join(f"{k}: {_mb(v)}" for k, v in b.activation_dtypes.items()),
    ]
    if b.cuda_max_allocated is not None:
        lines.append(f"cuda_memory: max_allocated: {_mb(b.cuda_max_allocated)}, "
                     f"max_reserved: {_mb(b.cuda_max_reserved)}, other_memory: {_mb(b.other)}")
    if estimate is not None:
        e = estimate.to_record()
        pairs = [("params_memory", s["params"], e["params"]), ("grads_memory", s["grads"], e["grads"]),
                 ("os_state_memory", s["optimizer"], e["optimizer"]),
                 ("activation_memory", s["activations"], e["activations"]), ("total_memory", b.total, e["total"])]
        lines.append("estimate_memory: " + ", ".join(f"{k}: {_mb(est)} ({_pct(m, est)})" for k, m, est in pairs))
    lines.append("bytes: " + ", ".join(f"{k}={v}" for k, v in [
        ("total", b.total), ("params", s["params"]), ("grads", s["grads"]), ("os_params", 0),
        ("os_state", s["optimizer"]), ("activation", s["activations"]), ("activation_peak", b.activations_peak)]))
    lines.append("---Layout---")
    for category, (root, section) in LAYOUT.items():
        lines.append(f"{section}:")
        for path, depth, own, total in _tree(getattr(b, category), root):
            lines.append(f"{'  ' * depth}layer: {path}, layer_mem: {_mb(own)}, total_mem: {_mb(total)}, "
                         f"layer_bytes: {own}, total_bytes: {total}")
    return "\n".join(lines) + "\n"


_LAYER = re.compile(r"^(?P<indent>\s*)layer: (?P<path>[^,]*), layer_mem: (?P<own>[\d.]+) MB, "
                    r"total_mem: (?P<total>[\d.]+) MB(?:, layer_bytes: (?P<own_b>\d+), total_bytes: (?P<total_b>\d+))?")
_MB_FIELD = re.compile(r"(\w+): (-?[\d.]+) MB")


def parse_memory_log(text: str) -> list[dict]:
    """memory.log back into numbers: one dict per `Memory State:` with step, time, summary (bytes;
    exact where the log has a bytes line, else from the MB figures), activation_dtypes (bytes from
    MB), cuda and estimate (bytes from MB, when present) and layouts {section: [rows]}, each row
    {"path", "depth", "layer_bytes", "total_bytes"}. Reads InternEvo's own logs too."""
    states: list[dict] = []
    state: dict = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "Memory State:":
            state = {"step": None, "time": None, "summary": {}, "activation_dtypes": {}, "cuda": {},
                     "estimate": {}, "layouts": {}}
            states.append(state)
            section = None
        elif not stripped or not states or stripped in ("---summary---", "---Layout---"):
            continue
        elif stripped.startswith("step:"):
            value = stripped.split(":", 1)[1].strip()
            state["step"] = None if value == "None" else int(value)
        elif stripped.startswith("time:"):
            state["time"] = float(stripped.split(":", 1)[1])
        elif stripped.startswith("bytes:"):
            for item in stripped.split(":", 1)[1].split(","):
                k, v = item.strip().split("=")
                state["summary"][f"{k}_memory"] = int(v)
        elif stripped.startswith(("activation_dtype_memory:", "cuda_memory:", "estimate_memory:")):
            head, rest = stripped.split(":", 1)
            target = {"activation_dtype_memory": "activation_dtypes", "cuda_memory": "cuda",
                      "estimate_memory": "estimate"}[head]
            state[target] = {k: round(float(v) * MB) for k, v in _MB_FIELD.findall(rest)}
        elif stripped.endswith("_layout:"):
            section = stripped[:-1]
            state["layouts"][section] = []
        elif (m := _LAYER.match(line)) and section:
            own_b, total_b = m["own_b"], m["total_b"]
            state["layouts"][section].append({
                "path": m["path"], "depth": len(m["indent"]) // 2 if m["indent"] else m["path"].count("."),
                "layer_bytes": int(own_b) if own_b else round(float(m["own"]) * MB),
                "total_bytes": int(total_b) if total_b else round(float(m["total"]) * MB)})
        elif section is None:
            for k, v in _MB_FIELD.findall(stripped):
                state["summary"].setdefault(k, round(float(v) * MB))
    return states


# ---------------------------------------------------------------------------- sunburst charts

def _sunburst_html(rows: list[tuple[str, str, str, int]], title: str) -> str:
    """rows: (id, label, parent id, bytes). Offline HTML: plotly.js is embedded (about 4.6 MB)."""
    import plotly.graph_objects as go  # imported when charts are written, not by the trainer

    fig = go.Figure(go.Sunburst(
        ids=[r[0] for r in rows], labels=[r[1] for r in rows], parents=[r[2] for r in rows],
        values=[r[3] for r in rows], customdata=[r[3] / MB for r in rows],
        branchvalues="total",  # a node's value is its subtree's: parents are never inflated
        hovertemplate="%{id}<br>%{customdata:.2f} MB<br>%{percentRoot:.1%} of the chart<extra></extra>",
    ))
    fig.update_layout(title=title, margin=dict(t=50, l=0, r=0, b=0))
    return fig.to_html(include_plotlyjs=True, full_html=True)


def _category_rows(b: MemoryBreakdown, category: str, max_depth: int | None = None,
                   parent: str = "") -> list[tuple[str, str, str, int]]:
    """(id, label, parent, bytes) rows of one category's tree; ids are memory.log's paths."""
    root = LAYOUT[category][0]
    rows = []
    for path, depth, _, total in _tree(getattr(b, category), root):
        if max_depth is not None and depth > max_depth:
            continue
        parts = path.split(".")
        label = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]  # "blocks.0", not "0"
        rows.append((path, label, ".".join(parts[:-1]) if depth else parent, total))
    return rows


def write_memory_trace(b: MemoryBreakdown, folder: Path, estimate: "MemoryEstimate | None" = None) -> list[Path]:
    """memory.log and the five sunburst charts into `folder`, each written to a temporary name and
    renamed into place. Returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    mb = lambda c: b.category_total(c) / MB  # noqa: E731
    titles = {"params": f"Parameters: {mb('params'):.2f} MB", "grads": f"Gradients: {mb('grads'):.2f} MB",
              "optimizer": f"Optimizer state: {mb('optimizer'):.2f} MB",
              "activations": f"Activations saved for backward (first forward): {mb('activations'):.2f} MB"}
    files = {MEMORY_LOG: format_memory_log(b, estimate)}
    for category in CATEGORIES:
        files[SUNBURST_FILES[category]] = _sunburst_html(_category_rows(b, category), titles[category])
    summary = [("total", "total", "", sum(b.category_total(c) for c in CATEGORIES))]
    for category in CATEGORIES:
        summary += _category_rows(b, category, max_depth=SUMMARY_DEPTH, parent="total")
    step = f" at step {b.step}" if b.step is not None else ""
    files[SUNBURST_FILES["summary"]] = _sunburst_html(
        summary, f"Memory{step}: {sum(b.category_total(c) for c in CATEGORIES) / MB:.2f} MB "
                 f"(activation peak {b.activations_peak / MB:.2f} MB)")
    paths = []
    for name, text in files.items():
        path = folder / name
        atomic_write(path, text)
        paths.append(path)
    return paths


def format_breakdown(b: MemoryBreakdown, estimate: "MemoryEstimate | None" = None) -> str:
    """The console table: each measured figure, and beside it the estimate and the difference."""
    e = estimate.to_record() if estimate is not None else {}
    rows = [("parameters", b.category_total("params"), "params"),
            ("gradients", b.category_total("grads"), "grads"),
            ("optimizer state", b.category_total("optimizer"), "optimizer"),
            ("activations (saved for backward)", b.category_total("activations"), "activations"),
            ("activation peak", b.activations_peak, "activations"),
            ("total (params+grads+optimizer+peak)", b.total, "total")]
    head = f"Memory breakdown at step {b.step} ({b.device}):"
    lines = [head, f"  {'':38s}{'measured':>12s}" + (f"{'estimate':>12s}{'diff':>9s}" if e else "")]
    for label, measured, key in rows:
        line = f"  {label:38s}{measured / MB:>8.2f} MiB"
        if e:
            line += f"{e[key] / MB:>8.2f} MiB{_pct(measured, e[key]):>9s}"
        lines.append(line)
    dtypes = ", ".join(f"{k} {v / MB:.2f} MiB" for k, v in b.activation_dtypes.items())
    lines.append(f"  activations by dtype: {dtypes}")
    if b.cuda_max_allocated is not None:
        lines.append(f"  CUDA max allocated {b.cuda_max_allocated / MB:.2f} MiB (reserved "
                     f"{b.cuda_max_reserved / MB:.2f} MiB); not in the breakdown: {b.other / MB:+.2f} MiB of "
                     "temporary buffers, workspaces and allocator rounding")
    return "\n".join(lines)


if __name__ == "__main__":  # the estimator's old address: python -m minigpt.memory still predicts
    from minigpt.estimate import main

    sys.exit(main())
