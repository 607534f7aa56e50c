"""Where the memory goes: a measured breakdown of one training step, memory.log and sunburst
charts in InternEvo's layout, and an estimator that predicts the same figures from the shape.

    python -m minigpt.memory                                  # estimate the default job (same flags as the trainer)
    python -m minigpt.memory --preset gpt2 --batch-size 4 --device-memory-gb 24
    python train_minimal.py --estimate-memory --preset gpt2   # the same, from the trainer
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

import os
import re
import sys
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.fileio import atomic_write

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


# ---------------------------------------------------------------------------- the estimator (GPT)

@dataclass
class MemoryEstimate:
    """Predicted bytes of one training step of the GPT in minigpt/model.py; see estimate_gpt."""

    amp_dtype: str
    activation_checkpoint: bool
    attention: str  # "flash" (no s x s scores saved) or "math"
    params: int
    grads: int
    optimizer: int
    block: int  # saved per block (with checkpointing: the block input the checkpoint keeps)
    n_layers: int
    embeddings: int  # saved by wte, wpe and the embedding dropout
    head: int  # saved by ln_f and lm_head
    loss: int  # saved by the cross-entropy
    weight_copies: int  # of the above: autocast's low-precision weight copies that matmuls save
    logits: int  # the logits the model returns: held by the caller, not saved
    recompute: int  # checkpointing: one block's activations, rebuilt during backward

    @property
    def activations(self) -> int:
        return self.n_layers * self.block + self.embeddings + self.head + self.loss

    @property
    def total(self) -> int:
        """Same definition as MemoryBreakdown.total: comparable with the measurement."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def peak(self) -> int:
        """What must fit: the total, the returned logits, and a recomputed block."""
        return self.total + self.logits + self.recompute

    def to_record(self) -> dict:
        return {**asdict(self), "activations": self.activations, "total": self.total, "peak": self.peak}


def estimate_gpt(*, n_layers: int, d_model: int, n_heads: int, d_ff: int, seq_len: int, batch_size: int,
                 vocab_size: int, max_position_embeddings: int, amp_dtype: str = "fp32",
                 activation_checkpoint: bool = False, dropout: float = 0.0, device: str = "cpu") -> MemoryEstimate:
    """Bytes of one training step of minigpt's GPT (plain numbers in, no model built), with AdamW.

    Notation: L layers, h = d_model, f = d_ff, a heads, s = seq_len, b = batch, V = vocab (padded),
    P = positions; p = bytes per element of the autocast dtype (2 for bf16/fp16, 4 without AMP).

    Parameters: V*h (wte, tied with lm_head) + P*h (wpe) + L*(4h + 3h^2+3h + h^2+h + hf+f + fh+h)
    + 2h (ln_f), 4 bytes each. Gradients: the same. AdamW: exp_avg and exp_avg_sq in fp32 (2x the
    parameters) plus one 4-byte `step` tensor per parameter tensor (2 + 12L + 2 tensors).

    Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models" (2022), who count sbh(34 + 5as/h) bytes per layer in 16-bit training: attention 11sbh
    (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1) + 5as^2b (softmax output 2,
    its dropout mask 1, dropped probabilities 2), MLP 19sbh (input 2, GELU input 8, projection
    input 8, dropout mask 1), two LayerNorm inputs 4sbh. What this model saves instead (storages,
    counted once; read off the saved-tensor hooks):

        ln_1, ln_2   input, fp32 even under autocast (the residual stream: fp32 embeddings plus
                     low-precision branch outputs promote to fp32)        2 x (4sbh + mean/rstd 8bs)
        attn.qkv     input, the autocast copy of ln_1's output            p*sbh
        attention    q, k, v: three views of the qkv output               3p*sbh
                     F.scaled_dot_product_attention's flash / memory-efficient kernel saves its
                     output and the fp32 logsumexp, not the s x s scores: p*sbh + 4abs
        attn.proj    input: the attention output, whose (B, T, heads, hd) memory layout makes
                     .transpose(1, 2).contiguous() a no-op: already counted   0
        mlp.fc       input (autocast copy of ln_2's output)               p*sbh
        mlp.gelu     input (fc output)                                    p*bsf
        mlp.proj     input (GELU output)                                  p*bsf
        autocast     the low-precision weight copies the matmuls save      p*(4h^2 + 2hf)

    Per block: sbh(8 + 6p) + 2p*bsf + 16bs + 4abs (+ weight copies). With f = 4h that is 36sbh in
    bf16 against Korthikanti's 34sbh: +4 for the fp32 LayerNorm inputs, -2 without dropout masks
    (dropout 0), and no 5as^2b. (The flash output the attention backward keeps is the same storage
    as attn.proj's input, which the paper already counts.)
    In fp32: 64sbh. Dropout > 0 adds a mask per dropout (1 byte per element on CUDA, the tensor's
    dtype on the CPU), and on the CPU sends attention down the math path, which saves fp32 copies
    of q, k and v and three fp32 s x s tensors (probabilities, mask, dropped probabilities) in
    place of the q, k, v views and the flash output (on CUDA the flash kernel handles dropout).

    Outside the blocks: token and position ids (8bs + 8s); ln_f's input (4sbh + 8bs); lm_head's
    input (p*sbh) and, under autocast, its weight copy (p*Vh); the cross-entropy runs in fp32
    (autocast's fp32 list) and saves the fp32 log-probabilities 4bsV, the targets 8bs and a scalar.
    The logits themselves (p*bsV) are not saved, but the caller holds them until the next step.

    Activation checkpointing (non-reentrant) saves only each block's input, 4sbh, during the
    forward; during backward one block at a time is recomputed, its full activations (as above)
    alive on top of the rest: `recompute`.

    Not included: the ops' temporary buffers (the backward's gradient of the logits, 4bsV, is the
    largest), library workspaces, the allocator's rounding and the CUDA context.
    """
    L, h, a, f, s, b, V, P = n_layers, d_model, n_heads, d_ff, seq_len, batch_size, vocab_size, max_position_embeddings
    amp = amp_dtype != "fp32"
    p = 2 if amp else 4
    sbh, bs = s * b * h, b * s
    cuda = device == "cuda"

    n_block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    params = 4 * (V * h + P * h + L * n_block + 2 * h)
    optimizer = 2 * params + 4 * (2 + 12 * L + 2)

    def mask(dtype_bytes: int) -> int:  # a dropout mask over an (s, b, h) tensor
        return 0 if dropout == 0 else sbh * (1 if cuda else dtype_bytes)

    flash = dropout == 0 or cuda  # the CPU flash kernel has no dropout: the math path takes over
    layer_norm = 4 * sbh + 8 * bs
    weight_copies = p * (4 * h * h + 2 * h * f) if amp else 0
    if flash:
        attention = p * sbh + 3 * p * sbh + p * sbh + 4 * a * b * s
    else:
        attention = p * sbh + 3 * 4 * sbh + 3 * 4 * a * b * s * s + p * sbh
    mlp = p * sbh + 2 * p * b * s * f
    full_block = 2 * layer_norm + attention + mlp + weight_copies + 2 * mask(p)
    block = 4 * sbh if activation_checkpoint else full_block
    embeddings = 8 * bs + 8 * s + mask(4)
    head_copy = p * V * h if amp else 0
    head = layer_norm + p * sbh + head_copy
    loss = 4 * bs * V + 8 * bs + 4
    return MemoryEstimate(
        amp_dtype=amp_dtype, activation_checkpoint=activation_checkpoint, attention="flash" if flash else "math",
        params=params, grads=params, optimizer=optimizer, block=block, n_layers=L, embeddings=embeddings,
        head=head, loss=loss, weight_copies=(0 if activation_checkpoint else L * weight_copies) + head_copy,
        logits=p * bs * V, recompute=full_block if activation_checkpoint else 0,
    )


# ---------------------------------------------------------------------------- the estimate report

def device_memory(device: str, given_gb: float | None) -> tuple[int | None, str]:
    """(bytes the run may use, where the figure comes from)."""
    if given_gb is not None:
        return int(given_gb * GiB), "--device-memory-gb"
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"the GPU's memory ({props.name})"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM: the CPU trains in RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no CUDA, and the RAM size is not readable here); pass --device-memory-gb"


def format_estimate(shape: dict, amp_dtype: str, activation_checkpoint: bool, device: str,
                    memory: int | None, memory_source: str, note: str = "") -> str:
    """The estimator's table: columns for the run's AMP dtype (and fp32) without and with
    activation checkpointing; the run's own configuration is marked with *."""
    dtypes = [amp_dtype] + (["fp32"] if amp_dtype != "fp32" else [])
    columns = [(d, c) for d in dtypes for c in (False, True)]
    est = {col: estimate_gpt(**shape, amp_dtype=col[0], activation_checkpoint=col[1], device=device) for col in columns}
    chosen = (amp_dtype, activation_checkpoint)
    names = [("*" if col == chosen else "") + col[0] + (" + ckpt" if col[1] else "") for col in columns]
    e0 = est[columns[0]]
    gib = lambda n: f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MB:.1f} MiB"  # noqa: E731
    rows = [
        ("parameters (fp32)", lambda e: e.params),
        ("gradients (fp32)", lambda e: e.grads),
        ("AdamW state (exp_avg, exp_avg_sq fp32, step)", lambda e: e.optimizer),
        ("activations per block (ckpt: its input)", lambda e: e.block),
        (f"  x {shape['n_layers']} blocks", lambda e: e.n_layers * e.block),
        ("embeddings (ids, dropout mask)", lambda e: e.embeddings),
        ("ln_f + lm_head (input, weight copy)", lambda e: e.head),
        ("cross-entropy (fp32 log-probs, targets)", lambda e: e.loss),
        ("activations saved for backward", lambda e: e.activations),
        ("  of which autocast weight copies", lambda e: e.weight_copies),
        ("total: params+grads+optimizer+activations", lambda e: e.total),
        ("logits returned (held by the caller)", lambda e: e.logits),
        ("a block recomputed in backward", lambda e: e.recompute),
        ("peak estimate", lambda e: e.peak),
    ]
    width = max(14, *(len(n) + 2 for n in names))
    s = shape
    lines = [
        f"Memory estimate: {s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, d_ff {s['d_ff']}, "
        f"vocab {s['vocab_size']}, positions {s['max_position_embeddings']}; batch {s['batch_size']} x seq "
        f"{s['seq_len']}; AdamW; {e0.params // 4 / 1e6:.2f}M parameters",
        f"Device {device}; AMP {amp_dtype}" + (f" ({note})" if note else "")
        + "; attention: " + ("flash/memory-efficient SDPA (no s x s scores)" if e0.attention == "flash"
                             else "math SDPA (s x s scores saved)"),
        f"  {'':46s}" + "".join(f"{n:>{width}s}" for n in names),
    ]
    for label, get in rows:
        lines.append(f"  {label:46s}" + "".join(f"{gib(get(est[c])):>{width}s}" for c in columns))
    if memory is None:
        lines.append(f"Device memory: {memory_source}")
    else:
        fits = []
        for name, col in zip(names, columns):
            use = est[col].peak / memory
            fits.append(f"{name} {'fits' if use <= 0.9 else 'is tight' if use <= 1 else 'does NOT fit'} "
                        f"({100 * use:.0f}% of it)")
        lines.append(f"Device memory: {memory / GiB:.1f} GiB ({memory_source}). " + "; ".join(fits))
        lines.append("  (peak estimate against device memory; above 90% counts as tight: the ops' temporary "
                     "buffers, workspaces and allocator overhead are not in the estimate)")
    return "\n".join(lines)


def gpt_shape(cfg, vocab_size: int) -> dict:
    """The estimator's numbers from a TrainConfig (minigpt.config) and the padded vocabulary."""
    return dict(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
                seq_len=cfg.seq_len, batch_size=cfg.batch_size, vocab_size=vocab_size,
                max_position_embeddings=cfg.max_position_embeddings, dropout=cfg.dropout)


def estimate_report(cfg, device: str, amp_dtype: str, amp_note: str = "", vocab_size: int | None = None) -> str:
    """What `python -m minigpt.memory` and `train_minimal.py --estimate-memory` print. Builds no
    model: the vocabulary comes from --vocab-size or the tokenizer, padded to a multiple of 64 as
    the trainer does."""
    if vocab_size is None:
        if cfg.vocab_size is not None:
            vocab_size = cfg.vocab_size
        else:
            from minigpt.data import get_tokenizer
            vocab_size = get_tokenizer(cfg.tokenizer_name).n_vocab
        vocab_size = -(-vocab_size // 64) * 64  # as model.pad_vocab (not imported: this module is model-agnostic)
    memory, source = device_memory(device, cfg.device_memory_gb)
    return format_estimate(gpt_shape(cfg, vocab_size), amp_dtype, cfg.use_activation_checkpoint, device,
                           memory, source, amp_note)


def main(argv: list[str] | None = None) -> int:
    """The estimator's command line: the trainer's flags (minigpt.config), nothing allocated."""
    from minigpt.config import UsageError, parse_args, resolve_amp, resolve_device

    try:
        cfg = parse_args(argv, prog="python -m minigpt.memory")
        device = resolve_device(cfg.device)
        _, amp_dtype, amp_note = resolve_amp(cfg, device)
        print(estimate_report(cfg, device, amp_dtype, amp_note))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
