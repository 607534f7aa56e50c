"""The excerpts of README.md and docs/ are what the code prints now (docs/refresh.py rewrites them).

Every ```text block names the command that prints it; every included table is its results file;
the estimator's excerpts, deterministic, are what it prints now, to the byte. Every other excerpt
shows what commands of docs/walkthrough.md print: tests/test_walkthrough.py runs them scaled down
and holds each line of the excerpt to a line of the same form (figures masked) in their output: a
changed log line, a renamed field or a new column fails there until `python docs/refresh.py` runs.
"""

import re
import subprocess
import sys

from conftest import ROOT, docs_module

refresh = docs_module("refresh")


def test_every_text_block_is_an_excerpt_with_its_command():
    assert refresh.unmarked_text_blocks() == []
    commands = [e.command for e in refresh.excerpts()]
    assert any(c.startswith("python train_minimal.py") for c in commands), commands


def test_included_tables_are_their_results_files():
    found = refresh.includes()
    assert found, "README and walkthrough include the benchmark tables"
    for doc, path, text in found:
        assert text == refresh.included(ROOT / path), f"{doc} holds a stale copy of {path}"


def test_estimate_excerpts_are_what_the_estimator_prints(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the excerpts are a CPU's: on a GPU machine too
    exact = [e for e in refresh.excerpts() if e.check == "exact"]
    assert exact, "the walkthrough's estimate is an exact excerpt"
    for e in exact:
        fresh = e.shown({e.command: refresh.run(e.command, tmp_path)})
        assert refresh.form_differences(e.text, fresh, "exact") == [], f"{e.doc}: {e.command}"


def test_a_changed_form_is_caught():
    """The check itself: a field added to a log line, or a renamed label, is a difference;
    other figures, times and run names are not."""
    doc = "[2026-11-22 18:02:09] epoch 1 step 10/60 | lr 9.93e-04 | step 896ms | 2,286 tok/s (x)\n"
    same = "[2026-11-24 03:00:00] epoch 2 step 3/6 | lr 1.00e-02 | step 12ms | 17 tok/s (other)\n"
    changed = "[2026-11-24 03:00:00] epoch 2 step 3/6 | lr 1.00e-02 | step 12ms | 17 tok/s | mfu 3%\n"
    assert refresh.form_differences(doc, same, "all") == []
    assert refresh.form_differences(doc, changed, "all") == [doc.strip()]
    assert refresh.skeleton("Training started; run directory runs/20261124-030000") == refresh.skeleton(
        "Training started; run directory runs/20261123-105443-2"
    )
    assert refresh.form_differences("  4.0 MiB  aten::mm\nby self time\n", "by total time\n", "labels") == [
        "by self time"
    ]
    # A line printed only when a step or an evaluation is slow need not come back at the tests' scale;
    # where the MFU peak came from (the cache, or measured now) is not its form.
    slow = "[2026-11-26 19:48:12] evaluating (10 batches, about 5.5s)...\n"
    assert refresh.form_differences(slow, "", "all") == []
    peak = "[2026-11-26 19:48:21] MFU peak 0.168 TFLOP/s (bf16, the device's fastest); "
    cached, measured = peak + "cache: matmul 1024x1024x1024", peak + "measured now: matmul 64x64x64 at load 2"
    assert refresh.form_differences(cached, measured, "all") == []
    stamp = "[2026-11-28 22:30:49] "
    cached = stamp + "  cache [/home/u/.cache/minigpt/peak_flops.json]: matmul 1024x1024x1024"
    assert refresh.form_differences(cached, stamp + "  measured now: matmul 64x64x64", "all") == []
    line = stamp + "step 20/60 | loss 6.5658 | 891 ms/step | 2,298 tok/s | mfu 21.2% | rss 5.67 GiB"
    busy = line + " | busy: others took 31% of the cores"
    assert refresh.form_differences(line, busy, "all") == [] == refresh.form_differences(busy, line, "all")
    bound = "  forward                  370.6         364.0 - 377.7  {}    313.7 / 56.5 / 0.4"
    assert refresh.form_differences(bound.format("compute"), bound.format("memory "), "all") == []


def test_an_excerpt_shows_its_runs_output_through_its_filter():
    """`(a && b) 2>&1 | filter`: the output of a, then b's, cut by the filter; a plain command its
    output whole, trailing spaces cut. The walkthrough's test and refresh.py both read it so."""
    piped = refresh.Excerpt("doc", "(a --x && b) 2>&1 | sed -n '/start/,/end/p' | cut -c1-5", "all", "")
    assert piped.runs == ["a --x", "b"]
    outputs = {"a --x": "noise\nstart here\n", "b": "middle\nend of it\nafter\n"}
    assert piped.shown(outputs) == "start\nmiddl\nend o\n"
    plain = refresh.Excerpt("doc", "a --x", "all", "")
    assert plain.runs == ["a --x"] and plain.shown({"a --x": "one  \ntwo\n"}) == "one\ntwo\n"


def test_refresh_check_passes_on_the_committed_docs():
    """--check of the includes alone (no command runs): exit 0 when nothing is stale."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "refresh.py"), "--check", "--only", "no such command"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    return text[start : text.find("\n## ", start + 1)]


def test_the_reference_names_every_flag_and_tool():
    """docs/reference.md says it covers every flag and tool: each of the trainer's flags in its
    "Flags" section, each of sample.py's in "Text from the model", each tool as a command."""
    from minigpt.__main__ import TOOLS
    from minigpt.config import build_parser

    text = (ROOT / "docs" / "reference.md").read_text()
    trainer = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    usage = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--help"], capture_output=True, text=True, timeout=120
    ).stdout.split("\n\n")[0]  # the usage block: every flag, once
    sampler = set(re.findall(r"(--[a-z][\w-]*)", usage))
    assert "--init-from" in sampler and "--out-dir" in sampler, usage

    def named(flag: str, where: str) -> bool:  # `--flag`, `--flag X`, `--flag/--no-flag`
        return re.search(rf"[`/]{re.escape(flag)}[`/ ]", where) is not None

    missing = [f for f in sorted(trainer - {"--help"}) if not named(f, section(text, "Flags"))]
    missing += [
        f"sample.py {f}" for f in sorted(sampler - {"--help"}) if not named(f, section(text, "Text from"))
    ]
    missing += [f"python -m minigpt {t}" for t in TOOLS if f"python -m minigpt {t}" not in text]
    assert not missing, missing
