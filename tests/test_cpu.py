"""minigpt/cpu.py: the glibc setting the trainer applies, and the heap given back around evaluations."""

import json
import os
import subprocess
import sys

import pytest

from minigpt import cpu

CHILD = r"""
import json, torch
from minigpt import cpu
from minigpt.memory import process_memory

line = cpu.keep_freed_memory()
big, pins = [], []
for _ in range(4):  # 4 x 256 MiB from the heap (under 1 GiB), each followed by a block that stays
    big.append(torch.ones(64 * 2**20))
    pins.append(torch.ones(2 * 2**20))  # 8 MiB: no earlier hole of the heap takes it
del big
held = process_memory()["rss_bytes"]
released = cpu.release_freed_memory()
print(json.dumps({"line": line, "held": held, "after": process_memory()["rss_bytes"], "released": released}))
"""


@pytest.mark.skipif(cpu._glibc() is None, reason="glibc only")
def test_the_kept_heap_is_given_back_on_request():
    """The trainer keeps freed blocks (no page faults each step) and gives them back around
    evaluations: a freed block under a live one stays resident until release_freed_memory()."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "given back around evaluations" in r["line"], r["line"]
    assert r["released"] is True
    assert r["held"] - r["after"] > 512 * 2**20, r  # the holes under the kept blocks went back


def test_nothing_is_given_back_unless_the_heap_is_kept(monkeypatch):
    monkeypatch.setattr(cpu, "_release_at_evaluation", False)
    assert cpu.release_freed_memory() is False


def test_the_trainer_reexecutes_under_the_preferred_allocator_only_when_it_should(monkeypatch):
    """benchmarks/results/cpu-allocator.md chose tcmalloc (then jemalloc) where installed: the same
    command, LD_PRELOAD added, never twice, and never when glibc is asked for."""
    monkeypatch.setattr(cpu, "preloaded_allocator", lambda: None)
    tcmalloc = cpu.PRELOADS["tcmalloc"]
    installed = {tcmalloc}.__contains__
    cmd, env = cpu.preload_command(["--num-steps", "3"], {"PATH": "/bin"}, installed)
    assert env["LD_PRELOAD"] == tcmalloc and env["PATH"] == "/bin"
    assert cmd[0] == sys.executable
    assert cpu.preload_command([], env, installed) is None  # the re-executed process runs as it is
    assert cpu.preload_command([], {cpu.NO_PRELOAD_ENV: "glibc"}, installed) is None
    assert cpu.preload_command(["--no-keep-freed-memory"], {}, installed) is None
    assert (
        cpu.preload_command([], {"MINIGPT_ARGS": "--preset tiny --no-keep-freed-memory"}, installed) is None
    )
    assert cpu.preload_command([], {}, {tcmalloc, "/dev/nvidiactl"}.__contains__) is None  # a GPU run
    assert cpu.preload_command([], {}, lambda path: False) is None  # none installed: glibc's heap
    only_jemalloc = {cpu.PRELOADS["jemalloc"]}.__contains__
    assert cpu.preload_command([], {}, only_jemalloc)[1]["LD_PRELOAD"] == cpu.PRELOADS["jemalloc"]


@pytest.mark.skipif(not os.path.exists(cpu.PRELOADS["tcmalloc"]), reason="libtcmalloc-minimal4 not installed")
def test_the_main_job_runs_under_tcmalloc_when_installed(tmp_path):
    from conftest import ROOT, TINY

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu.NO_PRELOAD_ENV)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "train_minimal.py"), *TINY, "--out-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU allocator: tcmalloc (LD_PRELOAD)" in out.stdout + out.stderr
