"""Every shell command of docs/walkthrough.md runs, scaled down, so the text cannot go stale.

The commands run in order, in a copy of the repository (they write runs/ and benchmark results),
as a new user runs them (a home of their own: no token cache, no measured peak), with MINIGPT_ARGS
(documented in the walkthrough) shrinking every training run to a tiny model and a few steps. On
what they print, every excerpt of README.md and docs/ (but the estimator's exact ones, which
tests/test_docs.py runs at full scale) keeps the form the code prints now. Benchmark commands get
`--steps 2 --warmup 1 --repeats 1`, and what a benchmark builds itself rather than through the
trainer (overhead.py's profiler options, nanoGPT's side of nanogpt_shape.py) the tiny shape
(nanogpt_shape.py in bf16 alone, the dtype for which it patches nanoGPT's copy). A
command marked `# needs CUDA` must, on a machine without CUDA, be refused with its one-line
explanation; an `nsys` command is skipped where Nsight Systems is not installed, the screenshot
script where Chromium is not (outside CI). `tensorboard` is started, asked for the run over HTTP,
and stopped. The screenshot script opens TensorBoard's PyTorch Profiler tab in headless Chromium:
it must list the run's views and the profiled steps. The ablation's files are held to what
tests/test_benchmarks.py's check_ablation asks: this is the script's one end-to-end run in CI.
"""

import os
import re
import shlex
import shutil

import pytest
import torch
from conftest import NANOGPT_DIR, ROOT, bench_module, docs_module
from test_benchmarks import check_ablation

serve_tensorboard = docs_module("tbserve").serve_tensorboard
refresh = docs_module("refresh")


WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
SCALE = "--preset tiny --seq-len 32 --batch-size 2 --eval-iters 1"  # the walkthrough's own step counts stay
BENCH_SCALE = "--steps 2 --warmup 1 --repeats 1"
# What a benchmark measures outside the trainer's runs (which MINIGPT_ARGS scales), scaled down too;
# overhead.py's options part runs here; its stage-timing part is tests/test_benchmarks.py's (its trainer
# runs faked in the default suite, real in the slow one: run_variant's real runs are the ablation's here).
BENCH_OWN_SCALE = {
    "overhead.py": "--preset tiny --parts options --option-steps 1 --option-warmup 0 --micro-steps 1000",
    "nanogpt_shape.py": "--shape tiny --dtypes bf16",
}


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


def walkthrough_excerpts(cmds: list[str]) -> list:
    """The excerpts (docs/refresh.py) whose commands are all walkthrough commands: the slow test
    checks them on what those commands printed. The estimator's exact excerpts run at full scale in
    test_docs."""
    own = {c.split(" # ")[0] for c in cmds}  # without its comment
    return [e for e in refresh.excerpts() if e.check != "exact" and set(map(own_form, e.runs)) <= own]


def own_form(cmd: str) -> str:
    """A command as commands() lists it: one space between words, no trailing comment."""
    return re.sub(r"\s+", " ", cmd.strip())


def test_every_excerpt_is_checked_by_the_walkthrough():
    """Every excerpt of README.md and docs/ but the exact ones shows what walkthrough commands
    print: the slow test below checks its form on their output, where the command runs anyway."""
    checked = [(e.doc, e.command) for e in walkthrough_excerpts(commands(WALKTHROUGH.read_text()))]
    inexact = [(e.doc, e.command) for e in refresh.excerpts() if e.check != "exact"]
    assert sorted(checked) == sorted(inexact), set(inexact) - set(checked)


# One test, one user, the commands in the walkthrough's order: each reads the runs the earlier ones
# made, as a reader's do. Not split into parts for more workers: each part would be a new user's
# first run (the corpus tokenised, the peak measured again) and re-run the commands that made the
# runs it reads; in CI's one session the other workers have the rest of the suite to run.
@pytest.mark.slow
@pytest.mark.ci
def test_every_walkthrough_command_runs(tmp_path):
    repo = refresh.copy_repo(tmp_path / "repo")  # the tracked files, as a clone holds them
    env = refresh.user_env(repo / ".home", SCALE)  # a new user's: no token cache, no measured peak
    failures, outputs = [], {}
    cmds = commands(WALKTHROUGH.read_text())
    for cmd in cmds:
        needs_cuda = "# needs CUDA" in cmd
        cmd = own = cmd.split(" # ")[0]
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
        if (
            "tensorboard_screenshots.py" in cmd
        ):  # the copy's committed pictures: gone, so the script's are new
            for old in (repo / "docs" / "img").glob("tb_*.png"):
                old.unlink()
        if cmd.startswith("tensorboard "):  # a server: it must come up and list the run's traces
            with serve_tensorboard(shlex.split(cmd), cwd=repo, env=env):
                continue
        if "benchmarks/" in cmd and "make_figures.py" not in cmd:  # the figures only draw: no steps to scale
            cmd = f"{cmd} {BENCH_SCALE}"
            cmd += "".join(f" {flags}" for script, flags in BENCH_OWN_SCALE.items() if script in cmd)
        if any(b in cmd for b in ("ablation.py", "overhead.py", "nanogpt_shape.py", "allocator.py")):
            cmd = f"{cmd} --busy"  # the copy's results are thrown away: written even under the tests' load
        if "ablation.py" in cmd:
            cmd += " --noisy"  # and where the command says, whatever its A/A check found under that load

        result = refresh.in_terminal(cmd, repo, env, timeout=900)  # as the excerpts show it
        outputs[own] = result.stdout
        if needs_cuda and not torch.cuda.is_available():
            ok = result.returncode == 2 and "needs CUDA" in result.stdout
        else:
            ok = result.returncode == 0
        if ok and "tensorboard_screenshots.py" in cmd:
            ok = screenshots_taken(result.stdout, repo / "docs" / "img", steps="5, 6")
        if ok and "ablation.py" in cmd:  # the script's one end-to-end run in CI: its files, checked
            check_ablation(repo / "benchmarks" / "results" / "cpu-mine", result.stdout, ablation_rows())
        if not ok:
            failures.append(f"$ {cmd}\n(exit {result.returncode})\n{result.stdout[-3000:]}")
    # The excerpts of these commands' output: each line's form is still printed (refresh.py rewrites them).
    for e in walkthrough_excerpts(cmds):
        fresh = e.shown({c: outputs[own_form(c)] for c in e.runs})
        if missing := refresh.form_differences(e.text, fresh, e.check):
            failures.append(f"{e.doc}: $ {e.command}\nno longer printed:\n" + "\n".join(missing[:5]))
    assert not failures, "\n\n".join(failures) + "\n\n(python docs/refresh.py rewrites the excerpts)"


def ablation_rows() -> list[str]:
    """The rows of `ablation.py --malloc` here: the AMP rows where the CPU runs bf16 natively."""
    common = bench_module("common")
    native = common.native_bf16(common.machine())  # the rule ablation.py's --amp-rows auto follows
    base = "amp" if native else "fp32"
    return ["fp32", "fp32 + ckpt", *(["amp", "amp + ckpt"] if native else []), f"{base}, malloc defaults"]


def screenshots_taken(out: str, img, steps: str) -> bool:
    """docs/tensorboard_screenshots.py's run: the PyTorch Profiler tab listed the run's views and
    the Overview the profiled steps (`steps`, as the script prints them), and each picture it saved
    is a real page (a spinner is not saved as one: without the internet the tab does not draw)."""
    listed = "the PyTorch Profiler tab lists the run (views Overview, Operator" in out
    overview = f"the Overview's steps {steps} were" in out
    offline = "did not draw, so no tb_profiler.png" in out
    names = ("tb_scalars.png",) if offline else ("tb_profiler.png", "tb_scalars.png")
    pictures = [(img / name).read_bytes() if (img / name).exists() else b"" for name in names]
    real = all(p[:8] == b"\x89PNG\r\n\x1a\n" and len(p) > 20_000 for p in pictures)
    return listed and overview and real and offline != (img / "tb_profiler.png").exists()
