"""minigpt/core/cpu.py: the glibc setting the trainer applies, and the heap given back around evaluations."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.core import cpu

CHILD = r"""
import json, torch
from minigpt.core import cpu
from minigpt.instruments.instrument import process_memory

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


MIMALLOC_CHILD = r"""
import json, torch
from minigpt.core import cpu
from minigpt.instruments.instrument import process_memory

line = cpu.keep_freed_memory()
logits = torch.ones(100 * 2**20)  # 400 MiB: a step's logits
before = process_memory()["rss_bytes"]
del logits
kept = process_memory()["rss_bytes"]
logits = torch.ones(100 * 2**20)  # the next step's
print(json.dumps({"line": line, "before": before, "kept": kept, "released": cpu.release_freed_memory()}))
"""


@pytest.mark.skipif(cpu.mimalloc_library() is None, reason=f"{cpu.MIMALLOC_DIST} not installed")
def test_mimalloc_keeps_a_freed_step_tensor_for_the_next_step():
    """Under the trainer's mimalloc options a freed 400 MiB tensor stays resident, so the next
    step's reuses its pages instead of faulting in new ones; glibc's give-back is not asked for."""
    env = {**os.environ, "LD_PRELOAD": cpu.mimalloc_library(), **cpu.MIMALLOC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", MIMALLOC_CHILD], capture_output=True, text=True, check=True, env=env
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    options = ", ".join(f"{k}={v}" for k, v in sorted(cpu.MIMALLOC_ENV.items()))
    assert r["line"] == f"CPU allocator: mimalloc (LD_PRELOAD), {options}; glibc's settings left alone"
    assert r["kept"] > r["before"] - 50 * 2**20, r  # freed, still resident
    assert r["released"] is False


OUTLAST_CHILD = """
import ctypes, json
from minigpt.core import cpu
lib = ctypes.CDLL(cpu.mimalloc_library())
lib.mi_option_get.restype, lib.mi_option_get.argtypes = ctypes.c_long, [ctypes.c_int]
short = cpu.outlast_step(0.5)  # 1 s: shorter than the 3 s already set
after_short = lib.mi_option_get(cpu.MI_OPTION_PURGE_DELAY)
long = cpu.outlast_step(14.0)  # a GPT-2 step on a 2-core CPU
print(json.dumps([short, after_short, long, lib.mi_option_get(cpu.MI_OPTION_PURGE_DELAY)]))
"""


@pytest.mark.skipif(cpu.mimalloc_library() is None, reason=f"{cpu.MIMALLOC_DIST} not installed")
@pytest.mark.parametrize("own", [True, False])
def test_a_step_longer_than_the_purge_delay_lengthens_it_unless_the_user_set_it(own):
    """mimalloc's purge delay is the trainer's 3 s; a 14 s first step makes it 28 s (read back from
    mimalloc itself), a 0.5 s one leaves it; a delay the user set (3000 too) is never changed."""
    env = {**os.environ, "LD_PRELOAD": cpu.mimalloc_library(), **cpu.MIMALLOC_ENV}
    env[cpu.OWN_OPTIONS_ENV] = ",".join(cpu.MIMALLOC_ENV) if own else "MIMALLOC_ALLOW_THP"
    out = subprocess.run(
        [sys.executable, "-c", OUTLAST_CHILD], capture_output=True, text=True, check=True, env=env
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == ([None, 3000, 28000, 28000] if own else [None, 3000, None, 3000])


def test_the_purge_delay_is_left_alone_without_mimalloc(monkeypatch):
    monkeypatch.setenv(cpu.OWN_OPTIONS_ENV, ",".join(cpu.MIMALLOC_ENV))
    monkeypatch.setattr(cpu, "preloaded_allocator", lambda: None)
    assert cpu.outlast_step(100.0) is None


def test_nothing_is_given_back_unless_the_heap_is_kept(monkeypatch):
    monkeypatch.setattr(cpu, "_release_at_evaluation", False)
    assert cpu.release_freed_memory() is False


def test_the_trainer_reexecutes_under_the_preferred_allocator_only_when_it_should(monkeypatch):
    """Where tcmalloc or jemalloc is all there is: the same command, LD_PRELOAD added, never twice,
    and never when glibc is asked for."""
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


MIMALLOC = "/venv/site-packages/cmeel.prefix/lib/libmimalloc.so"


@pytest.mark.parametrize("pip_installed_mimalloc", [True, False])
def test_a_fresh_machine_takes_mimalloc_when_pip_installed_it(monkeypatch, pip_installed_mimalloc):
    """A fresh machine has no tcmalloc nor jemalloc, only what `pip install -r requirements.txt`
    brought: the trainer re-executes under cmeel-mimalloc's library with MIMALLOC_ENV (a user's own
    MIMALLOC_ options win); without it, it stays on glibc (keep_freed_memory's setting)."""
    monkeypatch.setattr(cpu, "preloaded_allocator", lambda: None)
    monkeypatch.setattr(cpu, "mimalloc_library", lambda: MIMALLOC if pip_installed_mimalloc else None)
    fresh = {MIMALLOC}.__contains__  # no /usr/lib/.../libtcmalloc*, libjemalloc*, no /dev/nvidiactl
    chosen = cpu.preload_command(["--num-steps", "3"], {"PATH": "/bin"}, fresh)
    if not pip_installed_mimalloc:
        assert chosen is None and cpu.installed_allocators(fresh) == {}
        return
    cmd, env = chosen
    assert cmd[0] == sys.executable and env["LD_PRELOAD"] == MIMALLOC and env["PATH"] == "/bin"
    assert all(env[k] == v for k, v in cpu.MIMALLOC_ENV.items())
    mine = {k: "7" for k in cpu.MIMALLOC_ENV}
    assert cpu.preload_command([], mine, fresh)[1].items() >= mine.items()
    # the trainer says which options are its own: only those may it change later (outlast_step)
    assert env[cpu.OWN_OPTIONS_ENV].split(",") == list(cpu.MIMALLOC_ENV)
    assert (
        cpu.preload_command([], {"MIMALLOC_PURGE_DELAY": "7"}, fresh)[1][cpu.OWN_OPTIONS_ENV]
        == "MIMALLOC_ALLOW_THP"
    )
    # mimalloc comes first even beside tcmalloc: every machine then runs what requirements.txt installs
    with_tcmalloc = {MIMALLOC, cpu.PRELOADS["tcmalloc"]}.__contains__
    assert cpu.preload_command([], {}, with_tcmalloc)[1]["LD_PRELOAD"] == MIMALLOC


def test_the_mimalloc_library_is_found_inside_its_pip_package():
    """requirements.txt names cmeel-mimalloc; its libmimalloc.so is what the trainer preloads."""
    requirements = (Path(__file__).resolve().parents[1] / "requirements.txt").read_text().split()
    assert any(line.startswith(cpu.MIMALLOC_DIST) for line in requirements)
    lib = cpu.mimalloc_library()
    if lib is None:
        pytest.skip(f"{cpu.MIMALLOC_DIST} not installed in this environment")
    assert os.path.isfile(lib) and os.path.basename(lib) == "libmimalloc.so"


@pytest.mark.skipif(cpu.mimalloc_library() is None, reason=f"{cpu.MIMALLOC_DIST} not installed")
def test_the_main_job_runs_under_mimalloc_without_tcmalloc(tmp_path, monkeypatch):
    """The README's first command on a fresh machine: the log says mimalloc, with its options."""
    from conftest import ROOT, TINY

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu.NO_PRELOAD_ENV)}
    env = {k: v for k, v in env.items() if not k.startswith("MIMALLOC_")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "train_minimal.py"), *TINY, "--out-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    options = ", ".join(f"{k}={v}" for k, v in sorted(cpu.MIMALLOC_ENV.items()))
    assert f"CPU allocator: mimalloc (LD_PRELOAD), {options}" in out.stdout + out.stderr


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
    first = next(iter(cpu.installed_allocators()))  # mimalloc where pip installed it, else tcmalloc
    assert f"CPU allocator: {first} (LD_PRELOAD)" in out.stdout + out.stderr
