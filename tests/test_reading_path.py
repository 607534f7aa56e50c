"""The reading path, measured as a user launches the trainer (design: a reader follows one training
step in an afternoon). `python train_minimal.py --preset tiny --num-steps 4 --log-interval 2` runs
as its own process, on a first run (an empty cache, as on a fresh machine) and on a second; a tracer
loaded into it through sitecustomize counts the project's lines it executes until the third
optimizer step begins, and the project's files it has loaded, whole, when the first one begins. The
budget: at most 7 files of more than 10 lines, 1,300 lines loaded, 700 executed. And the house's
rule: imports run one way, in no circle."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

MAX_FILES, MAX_LOADED, MAX_EXECUTED = 7, 1300, 700
# two traced launches (a first run tokenises): slow where many tests share the cores
pytestmark = pytest.mark.timeout(600)
FLAGS = ["--preset", "tiny", "--num-steps", "4", "--log-interval", "2", "--device", "cpu"]

# Loaded into the trainer's process: a line counts once, in a function that runs (a module's or a
# class's body, which only defines, does not); the loaded files are read when step 1's optimizer
# step begins (torch's optimizer pre-hook), the executed lines end when step 3's begins.
TRACER = r"""
import json, os, sys
import torch, torch._dynamo  # before the tracer: no line of the project, and traced, a third of the run
ROOT, OUT = os.environ["PATH_ROOT"], os.environ["PATH_OUT"]
hits, state = set(), {"steps": 0, "loaded": None, "done": False, "hooked": False}

def ours(f):
    return f.startswith(ROOT + os.sep) and "/tests/" not in f and "/.venv/" not in f

def loaded():
    files = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None) or ""
        if os.path.isabs(f) and f.endswith(".py") and os.path.isfile(f) and ours(os.path.realpath(f)):
            with open(f, encoding="utf-8") as fh:
                files[os.path.relpath(os.path.realpath(f), ROOT)] = sum(1 for _ in fh)
    return files

def pre_step(opt, args, kwargs):
    state["steps"] += 1
    if state["steps"] == 1:
        state["loaded"] = loaded()
    if state["steps"] == 3:
        state["done"] = True
        with open(OUT, "w") as fh:
            json.dump({"loaded": state["loaded"], "executed": sorted(hits)}, fh)

def tracer(frame, event, arg):
    f = frame.f_code.co_filename
    if state["done"] or not ours(f):
        return None
    if not state["hooked"] and "torch.optim.optimizer" in sys.modules:
        state["hooked"] = True
        sys.modules["torch.optim.optimizer"].register_optimizer_step_pre_hook(pre_step)
    if not frame.f_code.co_flags & 0x2:  # CO_NEWLOCALS: a function runs; a module or class body defines
        return None
    hits.add((os.path.relpath(f, ROOT), frame.f_code.co_firstlineno))

    def lines(frame, event, arg):
        if event == "line" and not state["done"]:
            hits.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_lineno))
        return lines
    return lines

import threading
sys.settrace(tracer)
threading.settrace(tracer)
"""


def traced_run(tmp_path: Path, cache: Path, name: str) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(TRACER)
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "MINIGPT_ARGS"}
    env |= dict(PATH_ROOT=str(ROOT.resolve()), PATH_OUT=str(out), MINIGPT_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "train_minimal.py", *FLAGS, "--out-dir", str(tmp_path / name)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("path")
    return {name: traced_run(tmp, tmp / "cache", name) for name in ("first", "second")}


@pytest.mark.parametrize("which", ["first", "second"])
def test_a_default_run_loads_at_most_seven_files_and_1300_lines(runs, which):
    loaded = runs[which]["loaded"]
    files = {f: n for f, n in loaded.items() if n > 10}
    assert len(files) <= MAX_FILES, files
    assert sum(loaded.values()) <= MAX_LOADED, loaded
    assert "train_minimal.py" in files and "minigpt/core/model.py" in files  # the trace saw the path


@pytest.mark.parametrize("which", ["first", "second"])
def test_set_up_and_two_steps_execute_at_most_700_lines(runs, which):
    executed = runs[which]["executed"]
    assert 200 < len(executed) <= MAX_EXECUTED, len(executed)


def project_modules() -> dict[str, Path]:
    files = [*ROOT.glob("minigpt/**/*.py"), ROOT / "train_minimal.py", ROOT / "sample.py"]
    names = {}
    for f in files:
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        names[name.removesuffix(".__init__")] = f
    return names


def imports_of(path: Path, modules: dict) -> set[str]:
    """The project's modules `path` imports, anywhere in it (a lazy import is a dependency too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and not modules[name].name == "__init__.py":
                found.add(name)
    return found


def test_imports_run_one_way_in_no_circle():
    """No module reaches itself through the project's imports; the tools (minigpt.analysis) import
    nothing of the trainer (core, instruments) and no torch."""
    modules = project_modules()
    graph = {m: imports_of(f, modules) - {m} for m, f in modules.items()}

    def reach(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    assert [m for m in graph if m in reach(m)] == []
    for m, deps in graph.items():
        if m.startswith("minigpt.analysis."):
            assert not {d for d in deps if d.startswith(("minigpt.core", "minigpt.instruments"))}, m
            assert "import torch" not in modules[m].read_text(), m


def readme_map() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("python train_minimal.py: flags -> data, model, optimizer")
    return text[start : text.index("beside it, loaded by what asks for it", start)]


def near(said: int, measured: int) -> bool:
    """A count of executed lines depends a little on timing (the watcher thread's turns, a busy
    machine's notes): the README's is near today's, not equal."""
    return abs(said - measured) <= max(5, 0.05 * measured)


def test_the_readmes_map_gives_the_path_as_it_is(runs):
    """README's picture of the reading path: each file's length exactly (`wc -l`), the lines and
    files loaded exactly (whole files: no timing in them), the lines each file runs near a first
    run's."""
    block, first = readme_map(), runs["first"]
    ran = {}
    for f, _ in first["executed"]:
        ran[f] = ran.get(f, 0) + 1
    where = lambda name: name if name == "train_minimal.py" else f"minigpt/{name}"  # noqa: E731
    sized = re.findall(r"^  (\S+\.py)\s.*?\s(\d+)\s+(\d+)$", block, re.M)  # a row: run, lines
    sized += re.findall(r"([\w/]+\.py)(?:, [^:]*)?: (\d+) of (\d+)", block)  # "(mfu.py, ...: 10 of 32"
    first_log = block[block.index("at the first log line") :]
    run_only = re.findall(r"(\w+/\w+\.py)(?:\s+\([^)]*\))?\s+(\d+)\b", first_log)
    named = {where(name) for name, *_ in sized + run_only}
    big = {f for f, n in first["loaded"].items() if n > 1}  # the three one-line __init__.py go unnamed
    assert named == set(ran) | big, (sorted(named), sorted(set(ran) | big))  # every file of the path
    wrong = [
        f"{where(name)}: the map says {size} lines long"
        for name, _, size in sized
        if int(size) != len((ROOT / where(name)).read_text().splitlines())
    ]
    for name, run in [(name, run) for name, run, _ in sized] + run_only:
        if not near(int(run), ran.get(where(name), 0)):
            wrong.append(
                f"{where(name)}: the map says {run} lines run, a first run {ran.get(where(name), 0)}"
            )
    run, files = map(int, re.search(r"(\d+) lines run in (\d+) files", block).groups())
    if not near(run, len(first["executed"])) or files != len(ran):
        said, measured = f"{run} lines run in {files} files", f"{len(first['executed'])} in {len(ran)}"
        wrong.append(f"the map says {said}, a first run {measured}")
    loaded, in_files = re.search(r"([\d,]+) lines\s+in (\d+) files \(", block).groups()
    if (int(loaded.replace(",", "")), int(in_files)) != (sum(first["loaded"].values()), len(first["loaded"])):
        wrong.append(f"the map says {loaded} lines loaded in {in_files} files, a first run {first['loaded']}")
    assert not wrong, "\n".join(wrong)
