"""Every shell command of docs/walkthrough.md runs, scaled down, so the text cannot go stale.

The commands run in order, in a copy of the repository (they write runs/ and benchmark results),
with MINIGPT_ARGS (documented in the walkthrough) shrinking every training run to a tiny model and
a few steps. Benchmark commands get `--steps 2 --warmup 1 --repeats 1`. A command marked
`# needs CUDA` must, on a machine without CUDA, be refused with its one-line explanation; an `nsys`
command is skipped where Nsight Systems is not installed, the screenshot script where Chromium is
not (outside CI). `tensorboard` is started, asked for the
run over HTTP, and stopped.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import NANOGPT_DIR, ROOT, docs_module

serve_tensorboard = docs_module("tbserve").serve_tensorboard


WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
SCALE = "--preset tiny --seq-len 32 --batch-size 2 --eval-iters 1"  # the walkthrough's own step counts stay
BENCH_SCALE = "--steps 2 --warmup 1 --repeats 1"


def commands(text: str) -> list[str]:
    """The lines of ```bash blocks, continuation lines joined, comments and blank lines left out."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(re.sub(r"\s+", " ", line.strip()))
    return out


def test_the_walkthrough_has_commands():
    cmds = commands(WALKTHROUGH.read_text())
    assert len(cmds) >= 10 and any(c.startswith("python train_minimal.py") for c in cmds)


@pytest.mark.slow
def test_every_walkthrough_command_runs(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    env = {
        **os.environ,
        "MINIGPT_ARGS": SCALE,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    }
    failures = []
    for cmd in commands(WALKTHROUGH.read_text()):
        needs_cuda = "# needs CUDA" in cmd
        cmd = cmd.split(" # ")[0]
        if "--nanogpt " in cmd:  # nanoGPT's files: the clone the environment names (.ci/run sets it)
            if NANOGPT_DIR is None:
                continue  # not given here: test_benchmarks.py says so in its skip reason
            cmd = re.sub(r"--nanogpt \S+", f"--nanogpt {NANOGPT_DIR}", cmd)
        if cmd.startswith("nsys ") and shutil.which("nsys") is None:
            continue  # Nsight Systems is not installed here; its trainer flag is checked on its own line
        if (
            "tensorboard_screenshots.py" in cmd
            and shutil.which("chromium") is None
            and not os.environ.get("CI")
        ):
            continue  # needs Debian's chromium; CI installs it, so there the command runs
        if cmd.startswith("tensorboard "):  # a server: it must come up and list the run's traces
            with serve_tensorboard(shlex.split(cmd), cwd=repo, env=env):
                continue
        if "benchmarks/" in cmd and "make_figures.py" not in cmd:  # the figures only draw: no steps to scale
            cmd = f"{cmd} {BENCH_SCALE}"
        if any(b in cmd for b in ("ablation.py", "overhead.py", "nanogpt_shape.py", "allocator.py")):
            cmd = f"{cmd} --busy"  # the copy's results are thrown away: written even under the tests' load

        result = subprocess.run(
            cmd, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=900
        )
        if needs_cuda and not torch.cuda.is_available():
            ok = result.returncode == 2 and "needs CUDA" in result.stderr
        else:
            ok = result.returncode == 0
        if not ok:
            failures.append(
                f"$ {cmd}\n(exit {result.returncode})\n{result.stdout[-1500:]}\n{result.stderr[-1500:]}"
            )
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_tensorboard_profiler_page_in_chromium(tmp_path):
    """TensorBoard over a profiled run, its PyTorch Profiler tab opened in headless Chromium: the
    tab lists the run's worker and views, and the Overview holds the profiled steps. The same
    script makes the screenshots of docs/img/."""
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is not installed: .ci/run installs Debian's chromium before the tests")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train_minimal.py"),
            "--use-toy-data",
            "--preset",
            "tiny",
            "--num-steps",
            "8",
            "--log-interval",
            "4",
            "--use-profiler",
            "--profile-step-start",
            "3",
            "--profile-step-end",
            "5",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    img = tmp_path / "img"
    r = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "tensorboard_screenshots.py"), str(out), "--out", str(img)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the PyTorch Profiler tab lists the run (views Overview, Operator" in r.stdout, r.stdout
    assert "the Overview's steps 3, 4 were" in r.stdout, r.stdout
    offline = "did not draw, so no tb_profiler.png" in r.stdout  # a spinner is not saved as a picture
    assert offline != (img / "tb_profiler.png").exists()
    for name in ("tb_scalars.png",) if offline else ("tb_profiler.png", "tb_scalars.png"):
        data = (img / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name  # a real page, not a blank one
