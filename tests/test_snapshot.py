"""The CUDA memory snapshot read back without torch (minigpt/analysis/cuda_snapshot.py) and drawn as an
offline page (minigpt/analysis/snapshot.py), on the real snapshot of the H200 run."""

import gzip
import json
import pickle
import re
from pathlib import Path

import pytest
from conftest import GPU_RUNS

from minigpt.analysis import snapshot as page
from minigpt.analysis.cuda_snapshot import MiB, SnapshotError, load_snapshot, peak_text, replay

H200 = GPU_RUNS / "h200-gpt2-bf16-memory"
PICKLE = H200 / "snapshots" / "rank0_snapshot.pickle.gz"


def plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(plain(v) for v in x)
    return x is None or isinstance(x, (str, int, float, bool))


@pytest.fixture(scope="module")
def h200():
    return load_snapshot(PICKLE)


def test_the_h200_snapshot_loads_as_plain_data_and_replays_to_its_peak(h200):
    """Plain dicts and lists; the replay's peak, in the bytes the tensors asked for (the history's
    unit), is the allocator's max_allocated (8,309.86 MiB, which counts its rounded blocks) less
    the rounding, in a backward, and the blocks live then add up to it."""
    assert plain(h200) and set(h200) >= {"segments", "device_traces"}
    r = replay(h200)
    assert abs(r.peak / MiB - 8289.4) < 0.05
    record = next(
        json.loads(x) for x in (H200 / "metrics.jsonl").read_text().splitlines() if "memory_breakdown" in x
    )
    assert 0 <= record["memory_breakdown"]["cuda_max_allocated"] - r.peak < 0.005 * r.peak
    assert sum(b.size for b in r.live_at_peak) == r.peak
    assert len(r.steps) == 6 and r.first_step_event == 80249  # start-up before the first step
    step, stage = page.stage_at(r, r.times[r.peak_at])
    assert (step, stage) == (2, "backward")
    sizes = [b.size for b in r.live_at_peak[:3]]
    N, V = 8 * 1024, 50304
    assert sorted(sizes) == [2 * N * V, 4 * N * V, 4 * N * V]  # bf16 log-probs, fp32 copy, NLL gradient


def test_the_text_beside_a_snapshot_lists_what_is_live_at_the_peak(h200):
    text = peak_text(h200)
    assert text.startswith("peak allocated 8289.4 MiB (recorded step 2, backward)")
    assert "840 allocations live at the peak" in text and "at the end of the recording: 1489.6 MiB" in text
    rows = text.splitlines()[2:5]
    assert "1572.00 MiB  step 2 backward" in rows[0] and "no Python frames" in rows[0]
    assert "minigpt/core/model.py:162 cross_entropy" in rows[1]


def test_the_snapshot_page_is_offline_and_shows_the_steps_the_peak_and_what_was_live(h200, tmp_path):
    out = page.write_snapshot_page(PICKLE, tmp_path / "s.html")
    html = out.read_text()
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert all(f">step {k}</text>" in html for k in range(1, 7))
    assert "peak 8,289.4 MiB" in html and "recorded step 2, backward" in html
    assert "The first 80,249 of them came before the first step" in html
    assert "minigpt/core/model.py:162 cross_entropy" in html and "12 x 48.00" in html
    points = re.findall(r'points="([^"]+)"', html)
    assert len(points) == 2 and all(len(p.split()) <= page.POINTS for p in points)


def test_a_pickle_that_names_a_class_is_refused_not_run(tmp_path, capsys):
    bad = tmp_path / "rank0_snapshot.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "x": Path("/")}))
    with pytest.raises(SnapshotError, match="plain data"):
        load_snapshot(bad)
    assert page.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plain data" in err
    (tmp_path / "junk.pickle.gz").write_bytes(gzip.compress(b"not a pickle"))
    assert page.main([str(tmp_path / "junk.pickle.gz")]) == 2
    assert page.main([str(tmp_path / "missing")]) == 2


def small_snapshot() -> dict:
    return {
        "segments": [
            {
                "device": 0,
                "total_size": 4096,
                "blocks": [{"address": 1, "size": 1024, "state": "active_allocated", "frames": []}],
            }
        ],
        "device_traces": [
            [
                {"action": "segment_alloc", "addr": 0, "size": 4096, "time_us": 10},
                {
                    "action": "alloc",
                    "addr": 1,
                    "size": 1024,
                    "time_us": 11,
                    "frames": [{"filename": "train_minimal.py", "line": 1, "name": "train"}],
                },
                {"action": "alloc", "addr": 2, "size": 2048, "time_us": 12, "frames": []},
                {"action": "free_completed", "addr": 2, "size": 2048, "time_us": 21},
            ]
        ],
        "external_annotations": [
            {"stage": "START", "name": "train_step", "time_us": 10},
            {"stage": "START", "name": "forward", "time_us": 10},
            {"stage": "END", "name": "forward", "time_us": 15},
            {"stage": "START", "name": "backward", "time_us": 20},
            {"stage": "END", "name": "backward", "time_us": 25},
            {"stage": "END", "name": "train_step", "time_us": 30},
        ],
    }


def test_a_small_history_replays_by_hand(tmp_path):
    """Two blocks made in a step's forward, one freed in its backward: the peak is both, in forward."""
    snap = small_snapshot()
    (tmp_path / "snapshots").mkdir()
    path = tmp_path / "snapshots" / "rank0_snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    r = replay(load_snapshot(path))
    assert r.allocated == [0, 1024, 3072, 1024] and r.reserved == [4096] * 4
    assert r.peak == 3072 and page.stage_at(r, r.times[r.peak_at]) == (1, "forward")
    assert [b.size for b in r.live_at_peak] == [2048, 1024]
    assert page.main([str(tmp_path)]) == 0 and (tmp_path / "snapshots" / "rank0_snapshot.html").is_file()


def test_a_snapshot_without_history_says_its_peak_is_what_it_holds(tmp_path):
    """An OOM during start-up, before the history starts: the segments only."""
    snap = {**small_snapshot(), "device_traces": [[]], "external_annotations": []}
    r = replay(snap)
    assert r.peak == 1024 and r.peak_at == -1 and [b.size for b in r.live_at_peak] == [1024]
    assert peak_text(snap).startswith("peak allocated 0.0 MiB, before the recording began")
    assert "no allocation events" in page.render(snap, "oom_rank0_snapshot.pickle")


def test_the_report_writes_and_links_each_snapshots_page(tmp_path):
    from test_report import make_run

    from minigpt.analysis.report import write_report

    run = make_run(tmp_path / "run")
    (run / "snapshots").mkdir()
    (run / "snapshots" / "rank0_snapshot.pickle").write_bytes(pickle.dumps(small_snapshot()))
    (run / "snapshots" / "oom_rank0_snapshot.pickle").write_bytes(b"not a pickle")  # costs its page only
    html = write_report(run).read_text()
    assert (run / "snapshots" / "rank0_snapshot.html").is_file()
    assert not (run / "snapshots" / "oom_rank0_snapshot.html").exists()
    assert '<a href="snapshots/rank0_snapshot.html">' in html
