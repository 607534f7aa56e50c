"""The CPU trainer's malloc (train_minimal.keep_freed_memory): glibc told to keep a freed step's
memory for the next step, said in the log; --no-keep-freed-memory leaves glibc's defaults."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY

import train_minimal

LINE = "CPU malloc: glibc keeps freed memory for the next step (--no-keep-freed-memory: not)"


def glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


# A step's logits (400 MiB) freed: does the process keep their pages for the next step?
CHILD = r"""
import json, sys, torch
from train_minimal import keep_freed_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

line = keep_freed_memory() if sys.argv[1] == "keep" else None
logits = torch.ones(100 * 2**20)
before = rss()
del logits
print(json.dumps({"line": line, "before": before, "after": rss()}))
"""


def test_every_mallopt_value_fits_the_c_int_it_is_passed_as(monkeypatch):
    """mallopt(int, int): a Python int past 2**31 - 1 reaches glibc cut to its low 32 bits (4 GiB
    arrives as 0, a trim threshold of nothing: the heap trimmed at every free)."""
    calls = []

    class Libc:
        malloc = object()

        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    fake = Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(ctypes, "cast", lambda f, t: type("P", (), {"value": id(f)})())
    assert train_minimal.keep_freed_memory() == LINE
    assert calls and all(-(2**31) <= v < 2**31 for _, v in calls), calls
    assert dict(calls)[-1] >= 2**30  # the trim threshold: at least 1 GiB kept


@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
@pytest.mark.parametrize("keep", [True, False])
def test_a_freed_step_tensor_stays_resident_only_when_kept(keep):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "keep" if keep else "default"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    freed = r["before"] - r["after"]
    if keep:
        assert r["line"] == LINE and freed < 50 * 2**20, r  # kept: no page faults for the next step's
    else:
        assert freed > 350 * 2**20, r  # glibc's default: a big block is unmapped when freed


PRELOADED = [p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",) if os.path.exists(p)]


@pytest.mark.skipif(not glibc() or not PRELOADED, reason="glibc, and jemalloc installed (libjemalloc2)")
def test_another_malloc_in_ld_preload_is_not_told_glibcs_setting():
    """Under another malloc (LD_PRELOAD, as some GPU images ship), glibc's mallopt succeeds but rules
    nothing: the trainer says nothing of glibc, and its freed pages go as that malloc decides."""
    env = {**os.environ, "LD_PRELOAD": PRELOADED[0]}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "keep"], capture_output=True, text=True, check=True, cwd=ROOT, env=env
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["line"] is None


@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
@pytest.mark.parametrize("flag", [[], ["--no-keep-freed-memory"]])
def test_the_log_says_the_malloc_setting_unless_turned_off(tmp_path, flag):
    out = tmp_path / "run"
    flags = [*TINY, *flag, "--num-steps", "1", "--peak-tflops", "1", "--no-report", "--no-checkpoint"]
    assert train_minimal.cli([*flags, "--out-dir", str(out)]) == 0
    log = (out / "train.log").read_text()
    assert (LINE in log) == (not flag), log
