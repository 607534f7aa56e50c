"""Slow ranks: one slow rank drags every other rank down, because data parallelism waits for the
slowest at each gradient all-reduce. This module names it, in the spirit of NVIDIA's straggler
detector: every log interval each rank contributes its median step and stage times, and two
scores are computed per rank:

    relative score   = fastest rank's median / this rank's median      (is it slower than the others?)
    individual score = this rank's best median so far / its current one (is it slower than it was?)

A rank scoring below the threshold (default 0.75) on either is reported, when its delay matters
to the step (MIN_DELAY_MS and MIN_DELAY_SHARE below): a score is a ratio, and a ratio of small
times is noise.

The trap: in DDP the fast ranks wait for the slow one inside the all-reduce, during their own
backward, so their step and backward times grow as much as the slow rank's. Scoring step times
would name every rank. The scores therefore use only what holds no collective: data_to_device,
forward, optimizer_step, and the backward's own compute (`backward_compute`, up to the moment
the last gradient bucket is ready, timed through a DDP communication hook), never the wait.
Knows nothing of GPT.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from minigpt import config as paths
from minigpt import stages as registry
from minigpt.config import STAGE_NAMES, split_parent
from minigpt.core import distributed
from minigpt.instruments.instrument import StageTimer


def scored_stages() -> tuple[str, ...]:
    """What straggler scoring sums: every scored stage and split. A stage whose split is scored
    (backward -> backward_compute) stands in for its split when the split was not timed (no DDP)."""
    return tuple(s.name for s in (*registry.STAGES, *registry.SPLITS) if s.scored)  # as registered now


# A score is a ratio, and a ratio of a few milliseconds is noise: on two gloo ranks sharing a quiet
# 2-core CPU, a 3.8 ms forward became 5.4 ms in one interval (individual score 0.74) and a backward's
# compute 5.6 ms against 3.8 on the other rank (relative score 0.68), with no rank slowed. So a rank
# is named only when its delay (its scored time less that of the rank or interval it is compared
# with) is both over MIN_DELAY_MS, past what a scheduler's hiccup or a clock change costs, and over
# MIN_DELAY_SHARE of its step, past what the job loses to it (each rank waits for the slowest at the
# all-reduce, so the step grows by about the delay). A rank 60 ms slow in a 70 ms step passes both.
MIN_DELAY_MS = 10.0
MIN_DELAY_SHARE = 0.10


def delay_matters(delay_ms: float, step_ms: float) -> bool:
    """Whether a rank's delay over its reference is large enough to name it (MIN_DELAY_MS and
    MIN_DELAY_SHARE of its step, both)."""
    return delay_ms > MIN_DELAY_MS and delay_ms > MIN_DELAY_SHARE * step_ms


def rank_figures(
    rank: int, host: str, step_times_ms: list[float], stage_steps: list[dict[str, float]]
) -> dict:
    """This rank's medians over one log interval, as sent to every other rank."""

    def scored(step: dict[str, float]) -> float:
        # A split that was not timed stands for its whole stage: without DDP there is no
        # communication hook, and the whole backward is the rank's own work.
        return sum(step.get(s, step.get(split_parent(s) or s, 0.0)) for s in scored_stages())

    names = {k for s in stage_steps for k in s}
    return {
        "rank": rank,
        "host": host,
        "step_ms": statistics.median(step_times_ms),
        "scored_ms": statistics.median([scored(s) for s in stage_steps]),
        "stages_ms": {k: statistics.median([s.get(k, 0.0) for s in stage_steps]) for k in sorted(names)},
    }


class StragglerDetector:
    def __init__(self, threshold: float):
        self.threshold = threshold
        self.best: dict[int, dict] = {}  # rank -> its figures at its best interval so far

    def update(self, step: int, figures: list[dict]) -> list[dict]:
        """Score every rank's figures for this interval; return the reports of the slow ones."""
        fastest = min(figures, key=lambda f: f["scored_ms"])
        reports = []
        for f in figures:
            best = self.best.get(f["rank"])
            if best is None or f["scored_ms"] < best["scored_ms"]:
                best = self.best[f["rank"]] = f
            relative = fastest["scored_ms"] / f["scored_ms"]
            individual = best["scored_ms"] / f["scored_ms"]
            # Each score that is low, with the figures it compares against, if the delay matters.
            low = [
                (score, ref)
                for score, ref in ((relative, fastest), (individual, best))
                if score < self.threshold and delay_matters(f["scored_ms"] - ref["scored_ms"], f["step_ms"])
            ]
            if not low:
                continue
            # The stage that grew most: against the fastest rank if that is the lower score, else
            # against this rank's own best interval.
            reference = min(low, key=lambda x: x[0])[1]
            grew = {
                s: f["stages_ms"].get(s, 0.0) - reference["stages_ms"].get(s, 0.0)
                for s in scored_stages()
                if s in f["stages_ms"]
            }
            stage = max(grew, key=grew.get) if grew else None
            reports.append(
                {
                    "step": step,
                    "rank": f["rank"],
                    "host": f["host"],
                    "relative_score": round(relative, 3),
                    "individual_score": round(individual, 3),
                    "stage": stage,
                    "stage_ms": f["stages_ms"].get(stage),
                    "reference_stage_ms": reference["stages_ms"].get(stage),
                    "scored_ms": f["scored_ms"],
                    "step_ms": f["step_ms"],
                }
            )
        return reports


def score_interval(detector: StragglerDetector, step: int, interval, dist_info) -> list[dict]:
    """Every rank's medians over the interval's steady steps (warm-up is no straggler: the
    Instruments' Interval leaves it out), gathered and scored; the slow ranks' reports, on rank 0
    alone: every rank gathers the same figures, and torchrun prints each rank's warnings, so a
    report from every rank would show each STRAGGLER line once per rank. `dist_info`: the
    process group (minigpt.core.distributed.DistInfo)."""
    from minigpt.core import distributed

    stages = interval.stages
    if dist_info.world_size == 1 or not stages.host_steps:
        return []
    times = [1000 * t for t in interval.step_times]
    mine = rank_figures(dist_info.rank, dist_info.host, times, stages.device_steps)
    reports = detector.update(step, distributed.gather(mine, dist_info))
    return reports if dist_info.is_main else []


def format_report(r: dict, threshold: float) -> str:
    return (
        f"STRAGGLER rank {r['rank']} on {r['host']} at step {r['step']}: relative score "
        f"{r['relative_score']:.2f}, individual score {r['individual_score']:.2f} (threshold "
        f"{threshold:.2f}); {r['stage']} grew most: {r['stage_ms']:.1f} ms vs "
        f"{r['reference_stage_ms']:.1f} ms"
    )


class Ranks:
    """What the training loop does with the other ranks, in one object: gradients reduced on the
    last micro-batch only, one stop for every rank, a lost rank named, slow ranks reported
    (minigpt/instruments/straggler.py; stragglers.jsonl on rank 0)."""

    def __init__(self, cfg, info, out_dir, model):
        from minigpt.core.runs import JsonlWriter

        self.info, self.model, self.threshold = info, model, cfg.straggler_threshold
        self.detector = StragglerDetector(cfg.straggler_threshold)
        self.file = JsonlWriter(out_dir / paths.STRAGGLERS_FILE, enabled=info.is_main)

    def no_grad_sync(self, sync: bool):
        return distributed.no_grad_sync(self.model, sync)

    def any(self, flag: bool) -> bool:
        return distributed.any_rank(flag, self.info)

    def watch(self, run):
        """A rank lost mid-run ends the others with one line that says where `run` (the RunDir) left
        its last checkpoint and how to go on."""
        resume = (
            f"the last checkpoint, if one was saved, is {run.checkpoint}: continue with --resume "
            f"--out-dir {run.path}"
            if run.saves
            else "nothing to resume (--no-checkpoint)"
        )
        return distributed.peers_watched(self.info, resume)

    def report_stragglers(self, step: int, interval, log) -> None:
        for report in score_interval(self.detector, step, interval, self.info):
            log.warning(format_report(report, self.threshold))
            self.file.write(report)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.file.__exit__(*exc)


class RankTimer(StageTimer):
    """The stage timer of a rank among others: it also times a part of a stage, up to a mark inside
    it (add_split: under DDP, the backward's compute up to the last gradient bucket ready, which a
    slow peer does not stretch), and it sleeps inside a chosen stage on a chosen rank
    (--simulate-slow-rank R:MS:STAGE): a teaching and testing aid, never on by default."""

    def __init__(self, device: str, enabled: bool = True, slow_rank: str | None = None, rank: int = 0):
        super().__init__(device, enabled)
        self.sleep_ms: dict[str, float] = {}
        if slow_rank:
            slow = distributed.parse_slow_rank(slow_rank, STAGE_NAMES)
            self.sleep_ms = {slow.stage: slow.ms} if slow.rank == rank else {}
        self.split_of: dict[str, str] = {}  # stage -> the name of its split (see add_split)
        self.splits: dict[str, tuple[str, float, object]] = {}  # split -> (stage, seconds, event)

    @contextmanager
    def stage(self, name: str, timed: bool = True):
        with super().stage(name, timed):
            if name in self.sleep_ms:
                time.sleep(self.sleep_ms[name] / 1000)
            yield

    def done(self, name: str, seconds: float, start):
        end = super().done(name, seconds, start)
        split = self.split_of.get(name)
        if split is not None:  # the split's last mark inside this stage, else all of it
            _, part, event = self.splits.pop(split, (name, seconds, end))
            self.step_host[split] += 1000 * part
            if self.cuda:
                self.events.append((len(self.host_steps), split, start, event))
        return end

    def add_split(self, stage: str, name: str) -> None:
        """Time `name`, the part of every `stage` up to its last split() mark; a stage run without a
        mark counts whole. (Under DDP: the backward's compute, up to the last gradient bucket ready;
        a micro-step under no_sync has no all-reduce to wait for, so all of it is compute.)"""
        self.split_of[stage] = name

    def split(self, stage: str, name: str) -> None:
        """Mark, now, the end of `name`: the part of the open `stage` done so far. Called several
        times in one stage, the last mark counts. Safe from another thread (autograd's)."""
        if not self.enabled or stage not in self.open:
            return
        t0, _ = self.open[stage]
        self.splits[name] = (stage, time.perf_counter() - t0, self.event())
