import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The real runs on one NVIDIA H200 that the docs cite, committed with them (docs/gpu-runs/README.md).
GPU_RUNS = ROOT / "docs" / "gpu-runs"
# A clone of karpathy/nanoGPT, which this repository cannot ship: the tests that run its files read
# its path from the environment (.ci/run sets it) and skip, saying so, where it is not given.
NANOGPT_ENV = "MINIGPT_NANOGPT_DIR"
NANOGPT_DIR = Path(os.environ[NANOGPT_ENV]) if os.environ.get(NANOGPT_ENV) else None


# A suite started in the background of a script (`cmd &` without job control) inherits SIGINT
# ignored, and every process it starts would too: the tests that send a Ctrl-C to the trainer
# would wait out their timeout. Python's own handler here: the processes the tests start get the
# default disposition back at exec, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under pytest-xdist each worker is a process with torch's default of a thread a core: two workers
# on two cores ran four threads that waited on each other (the suite took 20% longer, measured
# side by side). Each worker, and the trainers it launches, gets its share of the cores (a user's
# own OMP_NUM_THREADS wins).
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0)):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _module_from_file(name: str, folder: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def docs_module(name: str):
    """A script of docs/ (tbserve, refresh, report_screenshots) imported from its file, once: the
    helpers the tests share with the docs' scripts, without putting docs/ on sys.path."""
    return _module_from_file(name, "docs")


def bench_module(name: str):
    """A script of benchmarks/ imported from its file, once, without putting benchmarks/ on
    sys.path. The scripts import `common` (and make_figures `ablation`) as their neighbours, so
    those are loaded first, under the names the scripts' imports look up."""
    for neighbour in ("common", "ablation"):
        if name != neighbour and (neighbour == "common" or name == "make_figures"):
            _module_from_file(neighbour, "benchmarks")
    return _module_from_file(name, "benchmarks")


# Toy data and a tiny model, on the CPU: each training run in the tests takes a few seconds. Every
# test states the device it tests: the default suite the CPU (on a GPU machine too, where --device
# auto would pick the GPU), the `cuda` tests the GPU (they append --device cuda: argparse takes a
# flag's last value).
TINY = [
    "--use-toy-data",
    "--preset",
    "tiny",
    "--n-layers",
    "2",
    "--d-model",
    "32",
    "--n-heads",
    "2",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--lr",
    "1e-2",
    "--eval-iters",
    "1",
    "--device",
    "cpu",
]


# TINY for a run whose MFU and report the test does not read: no GEMM timed for the MFU peak (a
# loaded machine measures it again at every start), no report page.
FAST = [*TINY, "--peak-tflops", "1", "--no-report"]


@pytest.fixture(params=[False, True], ids=["as-this-machine", "gpu-visible"])
def gpu_visible(request, monkeypatch):
    """The test twice: on this machine as it is, and as on a CUDA machine, where --device auto picks
    the GPU (torch.cuda.is_available() True, the GPU an H200, faked where there is none). A test of
    the default suite that states --device cpu runs the CPU both times; one that leaves the device
    to auto does not."""
    if request.param and not torch.cuda.is_available():
        if torch.version.cuda:  # torch's own checks (AdamW's, on graph capture) would call the driver
            pytest.skip("a CUDA build of torch without a GPU: a faked one reaches the driver")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H200")
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory):
    """Token files of the tests go to a fresh folder, not the user's ~/.cache."""
    os.environ["MINIGPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    os.environ.pop("MINIGPT_ARGS", None)  # a user's scaled-down flags would change what the tests run


@pytest.hookimpl(trylast=True)  # after -m has deselected: the tests that run
def pytest_collection_modifyitems(config, items):
    # pytest-xdist hands out a file at a time (pytest.ini: --dist loadfile) in this order: the
    # files with slow tests first, each of them minutes long (CI runs them in the same session as
    # the rest), so no worker is left alone with one at the end; then the files with more tests,
    # as xdist's own order would have them (pytest.ini turns that off: it would put these last).
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    slow = lambda path: any(item.get_closest_marker("slow") for item in files[path])
    order = sorted(files, key=lambda path: (not slow(path), -len(files[path])))
    items[:] = [item for path in order for item in files[path]]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def run_cli(
    *args: str, cwd: Path = ROOT, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run train_minimal.py as a user would, in a fresh process (`env`: variables to add)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train_minimal.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def exit_status(call) -> int:
    """`call()` as a command's main: the status its process would exit with (sys.exit's code,
    argparse's errors included)."""
    try:
        return call()
    except SystemExit as e:
        return e.code or 0  # sys.exit() and sys.exit(None) are 0, as for a process


def in_process(capsys, call) -> SimpleNamespace:
    """`call()` as a command's main: its exit status and what it printed, without a process and
    torch's import."""
    status = exit_status(call)
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def bench_main(monkeypatch, capsys, script: str, *args: str) -> SimpleNamespace:
    """A benchmark script's main() as its command line runs it (the same argv), in this process."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    return in_process(capsys, bench_module(script.removesuffix(".py")).main)


def fails(capsys, *args: str) -> str:
    """Run the trainer in-process; return its single stderr line after checking status 2."""
    import train_minimal

    result = in_process(capsys, lambda: train_minimal.cli(list(args)))
    err = result.stderr
    assert result.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
