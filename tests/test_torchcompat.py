"""The private torch internals behind minigpt/core/torchcompat.py, each run on a real profiler session.

A torch upgrade that moves one fails here, with the line that names it and the file to update,
instead of as a silent wrong figure (a step range left open, an empty memory breakdown) later."""

from contextlib import contextmanager

import pytest
import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from minigpt.core import torchcompat
from minigpt.instruments import mfu


@contextmanager
def internal(name: str):
    """Turn a missing attribute, op or module into the one line a maintainer needs."""
    try:
        yield
    except (AttributeError, ImportError, RuntimeError, TypeError) as e:
        pytest.fail(f"{torchcompat.moved(name)}: {type(e).__name__}: {e}", pytrace=False)
    except StopIteration:
        pytest.fail(torchcompat.moved(name), pytrace=False)


def test_the_message_names_the_version_the_internals_were_read_from():
    assert torchcompat.READ_FROM == "2.13.0"
    line = torchcompat.moved("prof.step_rec_fn")
    assert line.startswith(
        f"torch {torch.__version__} moved prof.step_rec_fn: update minigpt/core/torchcompat.py"
    )
    assert "2.13.0" in line


def test_profiler_step_internals():
    """The count starts at the training step, and the step's range closes when told (not at the next
    step() call): the trace's ProfilerStep#3 holds only what ran before the close."""
    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU], schedule=lambda n: ProfilerAction.RECORD)
    with internal("profile._prev_schedule_action / step_num / current_action"):
        assert hasattr(prof, "_prev_schedule_action")
        torchcompat.start_profiler_count(prof, 3, ProfilerAction.RECORD)
    with prof:
        with internal("profile.step_rec_fn"):
            assert prof.step_rec_fn is not None  # ProfilerStep#3 is open
            torch.ones(8).sum()
            torchcompat.close_profiler_step(prof)
            assert prof.step_rec_fn is None
        torch.ones(8).mul(2)  # between steps: outside every ProfilerStep range
        with internal("torch.autograd.profiler._is_profiler_enabled"):
            assert torchcompat.profiler_running()
    assert not torchcompat.profiler_running()
    spans = torchcompat.kineto_spans(prof)
    steps = [sp for sp in spans if sp[0].startswith("ProfilerStep#")]
    assert [sp[0] for sp in steps] == ["ProfilerStep#3"]
    mul = next(sp for sp in spans if sp[0] == "aten::mul")
    assert mul[2] >= steps[0][3]


def test_ranges_from_hooks_and_the_raw_spans():
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        with internal("torch.ops.profiler._record_function_enter_new / _record_function_exit"):
            handle = torchcompat.range_enter("outer")
            torch.ones(4).add(1)
            torchcompat.mark("instant")
            torchcompat.range_exit(handle)
    with internal("prof.profiler.kineto_results.events()"):
        spans = torchcompat.kineto_spans(prof)
    by_name = {name: (thread, lo, hi) for name, thread, lo, hi in spans}
    assert {"outer", "instant", "aten::add"} <= by_name.keys()
    outer, add = by_name["outer"], by_name["aten::add"]
    assert outer[1] <= add[1] <= add[2] <= outer[2] and outer[0] == add[0]


def test_the_event_tree_holds_allocations_under_their_ops():
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.ones(1024, requires_grad=True)
        (x * 2).sum().backward()
    with internal("prof.profiler.kineto_results.experimental_event_tree() / torch._C._profiler._EventType"):
        roots = torchcompat.event_tree(prof)

    def walk(events, parent):
        for e in events:
            yield e, parent
            yield from walk(e.children, e)

    nodes = list(walk(roots, None))
    allocs = [(e, parent) for e, parent in nodes if e.kind == "alloc"]
    assert any(e.device == "cpu" and e.nbytes == 4096 and e.ptr and e.total >= 4096 for e, _ in allocs)
    assert any(e.nbytes < 0 for e, _ in allocs)  # the frees, too
    assert all(parent is None or parent.kind in ("op", "other") for _, parent in allocs)
    mul = next(e for e, _ in nodes if e.kind == "op" and e.name == "aten::mul")
    assert mul.sequence >= 0 and mul.start_ns > 0  # made an autograd node: backward finds its module
    with internal(f"the autograd node's range name {torchcompat.AUTOGRAD_NODE_RANGE!r}"):
        node = next(e for e, _ in nodes if e.name.startswith(torchcompat.AUTOGRAD_NODE_RANGE + "MulBackward"))
    assert node.kind == "op" and node.sequence == mul.sequence  # the backward node names its forward op


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_allocator_internals(tmp_path):
    with internal("torch.cuda.memory._record_memory_history / _snapshot"):
        torchcompat.start_memory_history(1000)
        x = torch.ones(1024, device="cuda")
        snapshot = torchcompat.memory_snapshot()
        torchcompat.stop_memory_history()
    assert any(b.get("state") == "active_allocated" for s in snapshot["segments"] for b in s["blocks"])
    with internal("torch._C._cuda_attach_out_of_memory_observer"):
        torchcompat.attach_oom_observer(lambda *args: None)
    del x


def test_the_cpus_bf16_check_in_mfu_py():
    """The one private torch name spelled outside torchcompat.py: mfu.py's, which every run needs
    before any room loads (AMP's decision)."""
    with internal(
        "torch.cpu._is_avx512_bf16_supported / _is_amx_tile_supported (minigpt/instruments/mfu.py)"
    ):
        features = mfu.cpu_bf16_features()
    assert set(features) == {"avx512_bf16", "amx"} and all(isinstance(v, bool) for v in features.values())
    assert not hasattr(torchcompat, "cpu_bf16_features")  # one place, not two


def test_dcp_and_dispatch_internals():
    nested = {"optim": {"state": {0: {"exp_avg": None}}}}
    with internal("torch.distributed.checkpoint._traverse.set_element"):
        torchcompat.dcp_set_element(nested, ("optim", "state", 0, "exp_avg"), 7)
    assert nested["optim"]["state"][0]["exp_avg"] == 7
    with internal("torch.utils._python_dispatch.TorchDispatchMode"):
        base = torchcompat.dispatch_mode_base()
    seen = []

    class Ops(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.ones(2) + 1
    assert any("add" in name for name in seen)
