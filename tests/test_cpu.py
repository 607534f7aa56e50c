"""minigpt/cpu.py: the glibc setting the trainer applies, and the heap given back around evaluations."""

import json
import subprocess
import sys

import pytest

from minigpt import cpu

CHILD = r"""
import json, torch
from minigpt import cpu
from minigpt.memory import process_memory

line = cpu.keep_freed_memory()
big = [torch.ones(64 * 2**20) for _ in range(4)]  # 4 x 256 MiB from the heap (under 1 GiB)
pin = torch.ones(16)  # allocated above them: the heap's top cannot be trimmed past it
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
    assert r["held"] - r["after"] > 768 * 2**20, r  # most of the 1 GiB freed went back


def test_nothing_is_given_back_unless_the_heap_is_kept(monkeypatch):
    monkeypatch.setattr(cpu, "_release_at_evaluation", False)
    assert cpu.release_freed_memory() is False
