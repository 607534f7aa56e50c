"""--compile runs every time: twice in a row on one compiler cache (the second run once stopped in
its first forward, replaying a graph break's output alias from AOTAutograd's warm cache), and the
steps that compiled are left out of the run's steady figures, named "compilation". Slow:
torch.compile of even the tiny model takes tens of seconds on a 2-core CPU."""

import json

import pytest
from conftest import TINY, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.ci]


def test_compile_runs_twice_on_one_cache_and_names_its_compilation(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for i in (1, 2):
        out = tmp_path / f"run{i}"
        flags = ["--compile", "--num-steps", "4", "--log-interval", "2", "--no-checkpoint"]
        r = run_cli(*TINY, *flags, "--no-report", "--out-dir", str(out), timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        left = rows[-1]["run_left_out"]
        assert left["compilation"]["steps"][0] == 1 and "warm-up" not in left  # compiling is step 1's warm-up
        assert rows[-1]["run_steps"] == 4 - sum(len(e["steps"]) for e in left.values()) > 0
        assert "torch.compile compiling, and kernel warm-up" in r.stdout
