"""Slow ranks: one slow rank drags every other rank down, because data parallelism waits for the
slowest at each gradient all-reduce. This module names it, in the spirit of NVIDIA's straggler
detector: every log interval each rank contributes its median step and stage times, and two
scores are computed per rank:

    relative score   = fastest rank's median / this rank's median      (is it slower than the others?)
    individual score = this rank's best median so far / its current one (is it slower than it was?)

A rank scoring below the threshold (default 0.75) on either is reported.

The trap: in DDP the fast ranks wait for the slow one inside the all-reduce, during their own
backward, so their step and backward times grow as much as the slow rank's. Scoring step times
would name every rank. The scores therefore use only what holds no collective: data_to_device,
forward, optimizer_step, and the backward's own compute (`backward_compute`, up to the moment
the last gradient bucket is ready, timed through a DDP communication hook), never the wait.
Knows nothing of GPT.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from minigpt.core.config import INT_LIMIT, UsageError
from minigpt.stages import scored_stages, split_parent


@dataclass
class SlowRank:
    """--simulate-slow-rank R:MS[:STAGE]: rank R sleeps MS milliseconds inside STAGE each step."""

    rank: int
    ms: float
    stage: str = "forward"


MAX_SLOW_MS = 3_600_000.0  # an hour per step: time.sleep overflows past ~1e16 s


def check_slow_rank(spec: str) -> None:
    """--simulate-slow-rank's numbers bounded (the format itself: straggler.parse_slow_rank): a delay
    of 1e99 ms overflows time.sleep with a traceback in the first step."""
    parts = spec.split(":")
    try:
        rank, ms = int(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return  # parse_slow_rank names the format
    if not -INT_LIMIT < rank < 2**31:
        raise UsageError(f"--simulate-slow-rank {spec}: the rank must be below 2**31")
    if math.isfinite(ms) and ms > MAX_SLOW_MS:
        raise UsageError(
            f"--simulate-slow-rank {spec}: the delay must be at most {MAX_SLOW_MS:.0f} ms (an hour per step)"
        )


def parse_slow_rank(spec: str, stages: tuple[str, ...]) -> SlowRank:
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        slow = SlowRank(int(parts[0]), float(parts[1]), *parts[2:])
    except ValueError:
        raise UsageError(
            f"--simulate-slow-rank takes RANK:MS or RANK:MS:STAGE (e.g. 1:200:forward); got {spec!r}"
        ) from None
    if slow.rank < 0 or not 0 < slow.ms < float("inf"):
        raise UsageError(f"--simulate-slow-rank {spec}: the rank must be >= 0 and the delay positive")
    if slow.stage not in stages:
        raise UsageError(
            f"--simulate-slow-rank {spec}: unknown stage {slow.stage!r}; one of {', '.join(stages)}"
        )
    return slow


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
            if min(relative, individual) >= self.threshold:
                continue
            # The stage that grew most: against the fastest rank if that is the low score, else
            # against this rank's own best interval.
            reference = fastest if relative <= individual else best
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
