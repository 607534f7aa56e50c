"""The private torch internals minigpt's rooms reach into, each behind one function, all in this file.

They were read from torch 2.13.0 (READ_FROM). torch may move any of them in a release without
notice; tests/test_torchcompat.py runs each one on a real profiler session and, where one is
missing, fails with "torch X moved <internal>: update minigpt/core/torchcompat.py". Nothing else in
minigpt names a private torch attribute but the CPU's bf16 check, which every run needs before any
room loads (minigpt/instruments/mfu.py's cpu_bf16_features, which that test runs too).

Why each one, when no public API does it:
- `profile.step_rec_fn`: the profiler keeps ProfilerStep#N open until its next step() call, so
  evaluation and logging between steps would land inside a step's range; closing it at the end of
  the training step is the only way to keep them out.
- `profile._prev_schedule_action`: the profiler counts steps from 0; starting its count at the
  training step (after --resume) means setting the action it compares the next one with.
- `torch.autograd.profiler._is_profiler_enabled`: two profilers cannot record at once; this is the
  one flag that says whether another is running.
- `torch.ops.profiler._record_function_enter_new` / `_record_function_exit`: record_function
  ranges and instant markers from inside module and autograd hooks, with no context manager to
  hold (a hook enters, a later hook exits).
- `prof.profiler.kineto_results.events()`: every range of a stopped profiler as raw spans, without
  building prof.events()'s Python event objects and their tree (several times slower).
- `prof.profiler.kineto_results.experimental_event_tree()` and `torch._C._profiler._EventType`:
  the allocator's events nested under the ops that made them, in order: the only reader that
  says which op, module and stage each allocation happened in.
- `torch._C._cuda_attach_out_of_memory_observer`: a callback as the allocator runs out of memory,
  before the error unwinds the stack, so the snapshot shows what filled the device.
- `torch.cuda.memory._record_memory_history` / `_snapshot`: the allocator's history for
  pytorch.org/memory_viz (documented, but underscored).
- `torch.distributed.checkpoint._traverse.set_element`: a sharded checkpoint's loader that refuses
  pickles (weights-only) must put each loaded object back where DCP's flattening took it from.
- `torch.utils._python_dispatch.TorchDispatchMode`: the base of a dispatch mode that sees every
  aten op (the estimate table's shape-only matmuls).
- `torch._dynamo.utils.counters`: how many graphs torch.compile has captured and compiled so far;
  a step during which the count moved compiled, and is warm-up, not steady state. No public call
  says whether a call compiled.

It imports only torch: the core (config, checkpoints) and the instruments both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

READ_FROM = "2.13.0"  # the torch version whose internals this file was written against


def moved(internal: str) -> str:
    """The line a failing check prints: which internal, and where to fix it."""
    return (
        f"torch {torch.__version__} moved {internal}: update minigpt/core/torchcompat.py "
        f"(written against torch {READ_FROM})"
    )


# ---------------------------------------------------------------------------- the profiler's step


def close_profiler_step(prof: torch.profiler.profile) -> None:
    """Close the open ProfilerStep#N range now; the profiler's next step() then skips closing it."""
    if prof.step_rec_fn is not None:
        prof.step_rec_fn.__exit__(None, None, None)
        prof.step_rec_fn = None


def start_profiler_count(prof: torch.profiler.profile, step: int, action) -> None:
    """Make a profiler (not yet entered) count its steps from `step`, `action` being its schedule's
    action for that step."""
    prof.step_num = step
    prof.current_action = action
    prof._prev_schedule_action = action


def profiler_running() -> bool:
    """Whether any torch profiler is recording in this process."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


# ---------------------------------------------------------------------------- ranges from hooks


def range_enter(name: str):
    """Open a record_function range; returns the handle range_exit closes."""
    return torch.ops.profiler._record_function_enter_new(name, None)


def range_exit(handle) -> None:
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


def mark(name: str) -> None:
    """An instant in the running profiler session, ordered with the allocator's events."""
    range_exit(range_enter(name))


# ---------------------------------------------------------------------------- a stopped profiler's results

# Names torch gives its own record_function ranges, which the memory capture places allocations by:
# the range around each autograd node's backward ("...: MmBackward0"), and FSDP2's ranges
# (torch.distributed.fsdp._fully_shard) around its all-gather (with its copy-out into the full
# parameters) and around its gradient reduction (the reduce-scatter), "FSDP::all_gather (blocks.1)".
AUTOGRAD_NODE_RANGE = "autograd::engine::evaluate_function: "
FSDP_GATHER_RANGE = "FSDP::all_gather"
FSDP_REDUCE_RANGE = "FSDP::post_backward_reduce"


def kineto_spans(prof: torch.profiler.profile) -> list[tuple[str, int, float, float]]:
    """(name, thread, start us, end us) of every range a stopped profiler recorded."""
    return [
        (e.name(), e.start_thread_id(), e.start_ns() / 1000, (e.start_ns() + e.duration_ns()) / 1000)
        for e in prof.profiler.kineto_results.events()
    ]


@dataclass(frozen=True, slots=True)
class TreeEvent:
    """One node of a stopped profiler's event tree, read out of torch's private types.

    kind: "alloc" (an allocation or, with negative nbytes, a free), "op" (a torch op or a
    record_function range), "other" (Python frames, Kineto's own events)."""

    kind: str
    name: str
    start_ns: int
    children: tuple[TreeEvent, ...] = ()
    sequence: int = -1  # op: the autograd sequence number (-1: no autograd node)
    device: str = ""  # alloc: "cpu", "cuda", ...
    ptr: int = 0  # alloc: the block's address
    nbytes: int = 0  # alloc: bytes, negative for a free
    total: int = 0  # alloc: the allocator's total after this event


def event_tree(prof: torch.profiler.profile) -> list[TreeEvent]:
    """The roots of a stopped profiler's event tree (profile_memory=True for allocations)."""
    from torch._C._profiler import _EventType

    def read(node) -> TreeEvent:
        if node.tag == _EventType.Allocation:
            f = node.typed[1]
            return TreeEvent(
                "alloc", "", node.start_time_ns, (), -1, f.device.type, f.ptr, f.alloc_size, f.total_allocated
            )
        children = tuple(read(c) for c in node.children)
        if node.tag == _EventType.TorchOp:
            return TreeEvent("op", node.name, node.start_time_ns, children, node.typed[1].sequence_number)
        return TreeEvent("other", node.name, node.start_time_ns, children)

    return [read(root) for root in prof.profiler.kineto_results.experimental_event_tree()]


# ---------------------------------------------------------------------------- the CUDA allocator


def attach_oom_observer(observer: Callable[[int, int, int, int], None]) -> None:
    """observer(device, alloc, device_alloc, device_free) as the CUDA allocator runs out of memory."""
    torch._C._cuda_attach_out_of_memory_observer(observer)


def start_memory_history(max_entries: int) -> None:
    """Record every CUDA allocation and free with Python stacks only: C++ frames make a dump slow."""
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=max_entries
    )


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def memory_snapshot() -> dict:
    """The CUDA allocator's segments and recorded history, as pytorch.org/memory_viz reads it."""
    return torch.cuda.memory._snapshot()


# ---------------------------------------------------------------------------- the CPU, DCP, dispatch


def dcp_set_element(state_dict: dict, path, value) -> None:
    """Put `value` at DCP's flattened `path` (a tuple of keys) inside a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


def dispatch_mode_base() -> type:
    """The base class of a TorchDispatchMode: every aten op passes through its __torch_dispatch__."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def compile_count() -> int:
    """Graphs torch.compile has captured, compiled or loaded from its cache in this process so far
    (Dynamo's frames, AOTAutograd's forward and backward, Inductor's): it moves only while
    something compiles, never while compiled code runs. 0 without torch.compile."""
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"]
        + counters["aot_autograd"]["total"]
        + sum(counters["inductor"].values())
    )
