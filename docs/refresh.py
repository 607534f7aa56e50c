"""Rewrite every excerpt, table and image of README.md and docs/ from the current code.

    python docs/refresh.py                  # runs every excerpt's command at full scale (~10 minutes)
    python docs/refresh.py --check          # changes nothing; lists the excerpts that differ
    python docs/refresh.py --only estimate  # the excerpts whose command contains "estimate"

An excerpt is a fenced block that follows a marker naming the command that prints it:

    <!-- excerpt: python -m minigpt estimate --preset gpt2 -->
    ```text
    ...what the command prints...
    ```

`<!-- excerpt(check=log): ... -->` says which lines the tests compare (tests/test_walkthrough.py):
`all` (default) every line's form, `log` only the timestamped log lines' (a profiler table's rows
change with the model), `labels` the lines that do not start with a figure (a table's headings and
row names, not its rows of numbers), `exact` the text itself (a deterministic command such as the
estimator, which the fast tests run at full scale; the `Device` line and the `*` that marks this
machine's AMP column are left out, as they depend on the CPU).

A table that a benchmark wrote is included, not pasted:

    <!-- include: benchmarks/results/overhead-cpu-small.md -->
    ...the file's text...
    <!-- end include -->

The commands run in a copy of the repository (their run directories and benchmark outputs land
there, not here), in the order they appear; then the images are drawn (IMAGES) and copied back.
Benchmarks are not re-run: their tables are included from benchmarks/results/, which only a
benchmark command rewrites (timings need a quiet machine; see docs/reference.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/walkthrough.md", "docs/reference.md", "docs/memory.md", "docs/parallel.md")

# The images, drawn after the excerpts (the report and TensorBoard screenshots need the main job's
# run and runs/prof), each (command, files it writes in the copy); copied back into this repository.
LATEST_RUN = "$(ls -d runs/2*/ | tail -n 1)"  # the main job's run directory (runs/<date-time>)
IMAGES = (
    (
        "python benchmarks/make_figures.py",
        ("docs/img/tokens_per_s.png", "docs/img/stage_times.png", "docs/img/memory_breakdown.png"),
    ),
    (
        f"python -m minigpt report {LATEST_RUN} && python docs/report_screenshots.py "
        f"{LATEST_RUN}report.html --out docs/img/report_main.png",
        ("docs/img/report_main.png",),
    ),
    (
        "python -m minigpt report runs/prof && python docs/report_screenshots.py runs/prof/report.html "
        "--sections timeline operators --out docs/img/report_profiler.png",
        ("docs/img/report_profiler.png",),
    ),
    (
        f"python docs/tensorboard_screenshots.py runs/prof --out docs/img --scalars-dir {LATEST_RUN}",
        ("docs/img/tb_scalars.png",),  # the Profiler tab's charts need the network: no picture of it
    ),
)

EXCERPT = re.compile(
    r"<!-- excerpt(?:\(check=(all|log|labels|exact)\))?: (.+?) -->\n```text\n(.*?)```\n", re.S
)
INCLUDE = re.compile(r"<!-- include: (\S+) -->\n(.*?)<!-- end include -->\n", re.S)
FENCE_TEXT = re.compile(r"^```text$", re.M)
PIPE = " 2>&1 | "  # an excerpt's command, then the filter that cuts what it printed to the excerpt


@dataclass
class Excerpt:
    doc: str  # README.md or docs/...
    command: str
    check: str  # all | log | exact
    text: str  # what the document holds now

    @property
    def runs(self) -> list[str]:
        """The commands whose output the excerpt shows, in order: `(a && b) 2>&1 | filter` runs a
        and b. Two excerpts of one command (a whole log, and a line of it) share its run."""
        head = self.command.split(PIPE, 1)[0]
        return head.removeprefix("(").removesuffix(")").split(" && ") if head.startswith("(") else [head]

    def shown(self, outputs: dict[str, str]) -> str:
        """What the excerpt's command prints, from what its runs printed (`outputs`, by command):
        their output, through the excerpt's filter (`| sed -n ...`) where it has one."""
        text = "".join(outputs[c] for c in self.runs)
        if PIPE in self.command:
            filter_ = self.command.split(PIPE, 1)[1]
            text = subprocess.run(["bash", "-c", filter_], input=text, capture_output=True, text=True).stdout
        return "".join(line.rstrip() + "\n" for line in text.splitlines())


def excerpts(root: Path = ROOT) -> list[Excerpt]:
    out = []
    for doc in DOCS:
        for m in EXCERPT.finditer((root / doc).read_text()):
            out.append(Excerpt(doc, m.group(2), m.group(1) or "all", m.group(3)))
    return out


def includes(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(doc, included file, the text the document holds)."""
    return [(doc, m.group(1), m.group(2)) for doc in DOCS for m in INCLUDE.finditer((root / doc).read_text())]


def unmarked_text_blocks(root: Path = ROOT) -> list[str]:
    """```text blocks that no excerpt marker names: a pasted excerpt nobody can refresh."""
    bad = []
    for doc in DOCS:
        text = (root / doc).read_text()
        marked = {m.start(3) - len("```text\n") for m in EXCERPT.finditer(text)}
        for m in FENCE_TEXT.finditer(text):
            if m.start() not in marked:
                bad.append(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}")
    return bad


def copy_repo(dest: Path) -> Path:
    """The tracked files of this repository in `dest`, as a clone holds them."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for f in files.stdout.split():
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


class CommandFailed(Exception):
    """An excerpt's or an image's command exited non-zero: its output is not an excerpt."""


def user_env(home: Path, extra_args: str = "") -> dict[str, str]:
    """A new user's environment: a home of its own (no token cache, no peak FLOP/s in
    ~/.cache/minigpt), the interpreter's scripts first on PATH. `extra_args` go to every trainer
    run through $MINIGPT_ARGS (the tests' scaled-down runs)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(home)}
    for name in ("MINIGPT_ARGS", "MINIGPT_CACHE_DIR"):
        env.pop(name, None)
    return env | ({"MINIGPT_ARGS": extra_args} if extra_args else {})


def in_terminal(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The command run by the shell, its stdout and stderr in one stream, as a terminal shows them."""
    return subprocess.run(
        command,
        shell=True,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def run(command: str, cwd: Path, timeout: float = 1800, may_fail: bool = False) -> str:
    """What the command prints (stdout and stderr, as a terminal shows them), as a new user in
    `cwd` runs it. `may_fail`: an excerpt that filters the output (`| tail -n 1`) may show a
    refusal, and its pipeline exits 0 whatever the command's status."""
    r = in_terminal(command, cwd, user_env(cwd / ".home"), timeout)
    if r.returncode != 0 and not may_fail:
        raise CommandFailed(f"exit {r.returncode}: {command}\n{r.stdout[-3000:]}")
    return r.stdout


def included(path: Path) -> str:
    """A results file as a document includes it: without its own "# title" line, and its
    sections two levels down, under the document's chapter."""
    text = path.read_text()
    if text.startswith("# "):
        text = text.split("\n", 1)[1].lstrip("\n")
    return re.sub(r"^(#+) ", r"\1## ", text, flags=re.M)


def splice(m: re.Match, group: int, new: str) -> str:
    """The match's text with one group's text replaced."""
    a, b = m.start(group) - m.start(), m.end(group) - m.start()
    return m.group(0)[:a] + new + m.group(0)[b:]


def skeleton(line: str) -> str:
    """A line's form without its figures: timestamps, numbers, run-directory names and
    parenthesised lists (a breakdown's top names change with the model) masked. Two outputs of
    one command at different scales or on different machines have the same skeletons."""
    line = re.sub(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", "[T]", line)
    line = re.sub(r" \| busy: others took .*$", "", line)  # a loaded machine's note, not the line's form
    line = re.sub(r"runs/\d{8}-\d{6}(-\d+)?", "runs/RUN", line)
    line = re.sub(r"[0-9a-f]{12,}", "ID", line)
    line = re.sub(r"\[[/~][^\]]*\]", "[PATH]", line)  # a cache or temporary folder's path
    line = re.sub(r"\bwhen: .*", "when: WHERE", line)  # where a peak falls moves with the model's size
    # where the MFU denominator came from: the cache, or measured now (again, after a busy figure)
    line = re.sub(r"^(\[T\] MFU peak \S+ TFLOP/s[^;]*; ).*", r"\1SOURCE", line)
    line = re.sub(r"^\[T\]\s+(cache \[PATH\]|measured now): .*", "[T] SOURCE", line)  # its own line
    while (new := re.sub(r"\([^()]*\)", "", line)) != line:
        line = new
    line = re.sub(r"\(.*$", "", line)  # a list cut short by the excerpt's line width
    line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line)
    line = re.sub(r"#[smh]\b", "#s", line)  # a duration: 59.1s at one scale, 1.1m at another
    line = re.sub(r"#\s+(compute|memory|overhead)\s+#", "# BOUND #", line)  # --time's bound: a figure
    line = re.sub(r"#(x#)+(,#(x#)+)*", "SHAPES", line)  # a kernel's shapes: as many as the model has
    return " ".join(line.split())


# Lines a run prints only when a time crosses a threshold: a long evaluation's notice, mimalloc's
# purge delay raised past a long first step, a step still running after 30 s. An excerpt taken on
# a slow machine at full scale has them; the tests' scaled-down run has not: not a change of form.
WHEN_SLOW = re.compile(r"\] (evaluating \(|CPU allocator: mimalloc keeps freed pages|step \d+ still running)")
# A memory breakdown's line for a part that only a model of the full size has enough bytes in.
AT_FULL_SCALE = re.compile(r"^\s+\(outside any submodule\)")


def form_differences(doc_text: str, fresh_text: str, check: str) -> list[str]:
    """The document's lines whose form the fresh output no longer has (for `check`=all or log),
    or a diff of the text itself (`exact`); a line printed only when a step is slow (WHEN_SLOW)
    need not be printed again."""
    if check == "exact":
        a, b = machine_free(doc_text), machine_free(fresh_text)
        return [] if a == b else [f"expected exactly:\n{fresh_text}"]
    have = {skeleton(line) for line in fresh_text.splitlines()}
    scale_or_time = [x for x in doc_text.splitlines() if WHEN_SLOW.search(x) or AT_FULL_SCALE.match(x)]
    lines = [x for x in doc_text.splitlines() if x.strip() and x not in scale_or_time]
    if check == "log":
        lines = [x for x in lines if skeleton(x).startswith("[T]")]
    if check == "labels":
        lines = [x for x in lines if not skeleton(x).startswith("#")]
    return [x for x in lines if skeleton(x) not in have]


def machine_free(text: str) -> str:
    """An estimate's text without what depends on the CPU (its AMP decision)."""
    return "\n".join(x.replace("*", " ") for x in text.splitlines() if not x.startswith("Device "))


def refresh(check: bool, only: str | None) -> int:
    """Run the commands in a copy, then rewrite: a failed command leaves every document as it was."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = copy_repo(Path(tmp) / "repo")
        fresh: dict[tuple[str, str], str] = {}
        outputs: dict[str, str] = {}  # each command runs once, for every excerpt that shows it
        for e in excerpts():
            if only is None or only in e.command:
                print(f"$ {e.command}", flush=True)
                for command in e.runs:
                    if command not in outputs:
                        outputs[command] = run(command, copy, may_fail=PIPE in e.command)
                fresh[e.doc, e.command] = e.shown(outputs)
        images = not check and only is None
        for command, _ in IMAGES if images else ():
            print(f"$ {command}", flush=True)
            run(command, copy)
        stale = 0
        for doc in DOCS:
            path = ROOT / doc
            text = path.read_text()

            def excerpt(m: re.Match, doc: str = doc) -> str:
                return splice(m, 3, fresh.get((doc, m.group(2)), m.group(3)))

            def include(m: re.Match) -> str:
                return splice(m, 2, included(ROOT / m.group(1)))

            new = INCLUDE.sub(include, EXCERPT.sub(excerpt, text))
            if new != text:
                stale += 1
                print(f"{'differs' if check else 'rewrote'}: {doc}")
                if not check:
                    path.write_text(new)
        for _, files in IMAGES if images else ():
            for f in files:
                shutil.copy2(copy / f, ROOT / f)
                print(f"wrote {f}")
    return 1 if check and stale else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when an excerpt differs")
    p.add_argument("--only", help="refresh only the excerpts whose command contains this text")
    args = p.parse_args()
    if bad := unmarked_text_blocks():
        print(f"error: text blocks with no excerpt marker: {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        return refresh(args.check, args.only)
    except CommandFailed as e:  # nothing was rewritten: the documents change only after every run
        print(f"error: a command failed, no document rewritten: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
