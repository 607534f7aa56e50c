"""The third hostile round (issue 33): output paths that name a run's own files, checkpoints damaged
byte by byte, paths of the wrong type, a trace of overlapping ranges, contradictory flags. Each
case ends with exit 2 and one line (a fault: exit 1 and one line), and nothing written before is
lost or changed.

COUNTS says how many bad inputs this file tries (tests/test_hostile.py adds them up)."""

import hashlib
import os
from pathlib import Path

import pytest
from conftest import TINY

import train_minimal
from minigpt.analysis import compare, report

FAST = [*TINY, "--peak-tflops", "1", "--no-report"]


def tree(root: Path) -> dict[str, str]:
    """Every file under root with a digest of its bytes: 'nothing lost' made checkable."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
    }


def one_line_exit_2(capsys, status: int) -> str:
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One tiny run of 2 steps with its checkpoint, a user's notes and a link beside them."""
    out = tmp_path_factory.mktemp("lost") / "run"
    assert train_minimal.cli([*FAST, "--num-steps", "2", "--log-interval", "1", "--out-dir", str(out)]) == 0
    (out / "notes.txt").write_text("a user's own file\n")
    (out / "link-to-config.json").symlink_to(out / "config.json")
    os.mkfifo(out / "fifo")
    return out


# ---------------------------------------------------------------------------- 1. output paths

# What a tool's output path may name that it must not replace: the run's own files, a checkpoint,
# a user's file, a link to the config, a FIFO (not a regular file at all).
TARGETS = [
    "config.json",
    "metrics.jsonl",
    "train.log",
    "checkpoints/ckpt.pt",
    "notes.txt",
    "link-to-config.json",
    "fifo",
]


def report_to(run: Path, target: str, *more: str) -> int:
    return report.main([str(run), "--out", str(run / target), *more])


def compare_to(run: Path, target: str, *more: str) -> int:
    return compare.main([str(run), str(run), "--html", str(run / target), *more])


TOOLS = {"report --out": report_to, "compare --html": compare_to}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tool", TOOLS)
def test_an_output_path_never_replaces_a_file_the_tool_did_not_write(capsys, run, tool, target):
    before = tree(run)
    msg = one_line_exit_2(capsys, TOOLS[tool](run, target))
    assert target in msg, msg
    assert "--force" in msg or "FIFO" in msg, msg
    assert tree(run) == before


def test_a_tools_own_earlier_page_is_replaced_and_force_replaces_a_users_file(capsys, run, tmp_path):
    """The page a tool wrote is its own to rewrite; --force is the user saying so for another file.
    Neither touches the run's files."""
    page, notes = tmp_path / "page.html", tmp_path / "notes.txt"
    notes.write_text("mine\n")
    before = tree(run)
    assert report.main([str(run), "--out", str(page)]) == 0
    first = page.read_bytes()
    assert first.startswith(report.PAGE_HEAD.encode())
    assert compare.main([str(run), str(run), "--html", str(page)]) == 0  # compare's over report's
    assert page.read_bytes() != first
    assert one_line_exit_2(capsys, report.main([str(run), "--out", str(notes)]))
    assert notes.read_text() == "mine\n"
    assert report.main([str(run), "--out", str(notes), "--force"]) == 0
    assert notes.read_bytes().startswith(report.PAGE_HEAD.encode())
    assert tree(run) == before


def test_even_force_does_not_write_through_a_fifo(capsys, run):
    before = tree(run)
    assert "FIFO" in one_line_exit_2(capsys, report_to(run, "fifo", "--force"))
    assert (run / "fifo").is_fifo() and tree(run) == before


COUNTS = {
    "output paths over a run's files (report, compare)": len(TARGETS) * len(TOOLS) + 2,
}
