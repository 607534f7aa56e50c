"""The analysis reads run directories and imports nothing of the trainer: each analysis module, and
each base module it stands on, imports in a fresh interpreter without torch and without any core
or instrument module of minigpt, so a report is written wherever the run folder was copied to.
`python -m minigpt TOOL` is the tools' one entry. And the product's functions stay short."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_report import gpu_trace_events, make_run

# The torch-free base every part shares (minigpt/*.py), and the tools that read a run's files
# (minigpt/analysis): the trainer may import them; they import nothing of the trainer (one way, in
# no circle: tests/test_reading_path.py reads every import).
BASE = ("config", "errors", "fileio")
ANALYSIS = (
    "analysis",
    *(
        f"analysis.{m}"
        for m in ("traces", "report", "compare", "runfiles", "stats", "snapshot", "cuda_snapshot", "html")
    ),
    *(f"analysis.{m}" for m in ("record", "breakdown_log")),
)
TOOLS = ("__main__",)  # python -m minigpt TOOL: the tools' one entry
MODULES = [*BASE, *ANALYSIS, *TOOLS]


def python(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", MODULES)
def test_analysis_and_base_import_no_torch_and_nothing_of_the_trainer(module):
    result = python(
        "import json, sys\n"
        f"import minigpt.{module}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'minigpt'))))"
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "torch" not in loaded, f"minigpt.{module} imports torch"
    allowed = {"minigpt", *(f"minigpt.{m}" for m in MODULES)}
    assert set(loaded) <= allowed, f"minigpt.{module} imports {sorted(set(loaded) - allowed)}"


def test_report_compare_and_traces_run_where_torch_is_missing(tmp_path):
    """Through `python -m minigpt TOOL`, with `import torch` made to fail: each tool does its work."""
    a = make_run(tmp_path / "a", trace=gpu_trace_events())
    b = make_run(tmp_path / "b", trace=gpu_trace_events(), tokens_per_s=1500.0)
    no_torch = (
        "import sys; sys.modules['torch'] = None\nfrom minigpt.__main__ import main\nmain(sys.argv[1:])"
    )
    for args, says in (
        (["report", str(a)], f"report: {a / 'report.html'}"),
        (["compare", str(a), str(b)], "tokens/s per step"),
        (["traces", str(a)], "2 profiled step(s): 5, 6"),
    ):
        result = python(no_torch, *args)
        assert result.returncode == 0 and says in result.stdout, (args, result.stderr)
    assert "Stage times per step" in (a / "report.html").read_text()


@pytest.mark.parametrize("args", [[], ["repot", "RUN"]])
def test_an_unknown_tool_is_one_line_and_exit_2(args):
    result = subprocess.run(
        [sys.executable, "-m", "minigpt", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "report|compare|traces" in line and "Traceback" not in result.stderr


# A newcomer reads one function at a time: none of the product's (trainer, minigpt/, benchmarks,
# docs' scripts) runs past a screen and a half or takes more than a handful of arguments.
MAX_LINES, MAX_PARAMS = 80, 7


def test_no_function_is_longer_than_80_lines_or_takes_more_than_7_parameters():
    product = [ROOT / "train_minimal.py", ROOT / "sample.py"]
    for folder in ("minigpt", "benchmarks", "docs", "data"):
        product += sorted((ROOT / folder).rglob("*.py"))
    too_big = []
    for path in product:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            n_params = len(params) - (bool(a.args) and a.args[0].arg in ("self", "cls"))
            n_lines = node.end_lineno - node.lineno + 1
            if path.name == "train_minimal.py" and node.name == "main":
                n_lines = 0  # the page: set-up, the loop and the finish, read top to bottom in one place
            if n_lines > MAX_LINES or n_params > MAX_PARAMS:
                where = path.relative_to(ROOT)
                too_big.append(f"{where}:{node.lineno} {node.name}: {n_lines} lines, {n_params} parameters")
    assert len(product) > 40 and not too_big, "\n".join(too_big) or f"only {len(product)} files read"


def test_no_test_puts_a_folder_on_sys_path():
    """benchmarks/' and docs/' scripts are imported from their files (conftest.bench_module,
    docs_module): a folder put on sys.path would shadow modules of the same name for every test
    after it."""
    wrong = [
        f"{path.name}:{n}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append|extend)|sys\.path \+?=", line)
    ]
    assert not wrong, wrong


def test_the_trainer_fits_in_350_lines():
    """train_minimal.py is the loop and its set-up; helpers live in the rooms that own them."""
    assert lines_in(ROOT / "train_minimal.py") <= 350


def layout_rows() -> list[tuple[list[Path], int, bool]]:
    """docs/reference.md's map of the files, row by row: the files a row names, the count it gives,
    and whether that count is for each file ("7 each") or for the files together."""
    text = (ROOT / "docs" / "reference.md").read_text()
    start = text.index("Line counts from `wc -l`")
    block = text[start : text.index("## Dependencies, and why each", start)]
    rows, folder = [], ""
    for line in block.splitlines():
        if m := re.match(r"^(\S+/)\s", line):
            folder = m.group(1)
        if m := re.match(r"^(\s*)([\w./, ]+?\.py)\s+(\d+)(\s+each)?", line):
            indent, names, count, each = m.groups()
            files = [ROOT / ((folder if indent else "") + n.strip()) for n in names.split(",")]
            rows.append((files, int(count), bool(each)))
    return rows


def lines_in(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_map_gives_each_files_size_as_it_is():
    """The reading order's sizes are what `wc -l` says today, exactly (an afternoon is only true for
    the sizes it names, and a count is a fact, not a measurement); the layer totals too."""
    rows = layout_rows()
    assert len(rows) > 25
    wrong = []
    for files, count, each in rows:
        real = [lines_in(f) for f in files]
        for n in real if each else [sum(real)]:
            if n != count:
                wrong.append(f"{', '.join(f.name for f in files)}: the map says {count}, wc -l {n}")
    text = (ROOT / "docs" / "reference.md").read_text()
    for layer, files in (
        ("base", (ROOT / "minigpt").glob("*.py")),
        *((name, (ROOT / "minigpt" / name).glob("*.py")) for name in ("core", "instruments", "analysis")),
        ("the trainer", [ROOT / "train_minimal.py"]),
    ):
        said = int(re.search(rf"\b{layer} ([\d,]+)", text).group(1).replace(",", ""))
        real = sum(lines_in(f) for f in files)
        if real != said:
            wrong.append(f"{layer}: the map says {said} lines, wc -l {real}")
    assert not wrong, "\n".join(wrong)
