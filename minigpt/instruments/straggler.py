"""The other ranks, under torchrun: the DDP wrapper, one stop for every rank, a lost rank named in
one line, and slow ranks (stragglers) named. One slow rank drags every other rank down, because
data parallelism waits for the slowest at each gradient all-reduce. In the spirit of NVIDIA's
straggler detector, at every log line each rank sends its stage times per step, and two scores
are computed per rank over a window of its latest steps (at least WINDOW_STEPS steady steps):

    relative score   = fastest rank's median / this rank's median      (is it slower than the others?)
    individual score = this rank's best median so far / its current one (is it slower than it was?)

A rank scoring below the threshold (default 0.75) on either is named only when it is behind
persistently and by more than the noise: its median over the whole window (so over most of those
steps, not in one unlucky interval) is behind its reference by more than the spread of its own
and its reference's step times (their interquartile ranges), by more than MIN_DELAY_MS, and by
more than MIN_DELAY_SHARE of the step. A score is a ratio, and a ratio of small times is noise.
A slowdown every rank shares (the machine's load) is no rank's: the individual score is held to
the threshold relative to the median rank's individual score.

The trap: in DDP the fast ranks wait for the slow one inside the all-reduce, during their own
backward, so their step and backward times grow as much as the slow rank's. Scoring step times
would name every rank. The scores therefore use only what holds no collective: data_to_device,
forward, optimizer_step, and the backward's own compute (`backward_compute`, up to the moment
the last gradient bucket is ready, timed through a DDP communication hook), never the wait.
Knows nothing of GPT.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager
from functools import partial

from minigpt import config
from minigpt.core import distributed
from minigpt.instruments.instrument import StageTimer


def scored_stages() -> tuple[str, ...]:
    """What straggler scoring sums: every stage that holds no collective, and each split (the
    backward's own compute) in place of the stage it is part of."""
    return (*(s for s in config.STAGE_NAMES if s not in config.SPLITS.values()), *config.SPLITS)


# A score is a ratio, and a ratio of a few milliseconds is noise: on two gloo ranks sharing a quiet
# 2-core CPU, a 3.8 ms forward became 5.4 ms in one interval (individual score 0.74) and a backward's
# compute 5.6 ms against 3.8 on the other rank (relative score 0.68), with no rank slowed. So a rank
# is named only when its delay (its scored time less that of the rank or window it is compared
# with) is both over MIN_DELAY_MS, past what a scheduler's hiccup or a clock change costs, and over
# MIN_DELAY_SHARE of its step, past what the job loses to it (each rank waits for the slowest at the
# all-reduce, so the step grows by about the delay). A rank 60 ms slow in a 70 ms step passes both.
MIN_DELAY_MS = 10.0
MIN_DELAY_SHARE = 0.10
# Persistence: the scores are medians over at least this many steady steps (the latest log
# intervals that hold them), so a rank behind in a few steps of an interval is not named. Five of
# eight unslowed two-rank runs with --log-interval 2 named a rank when each interval was scored on
# its own (issue 48); a window of 8 steps spans 4 such intervals. Nothing is said before the first
# window is full (with --log-interval 10: at step 10, from steps 2-10; step 1 is warm-up).
WINDOW_STEPS = 8


def delay_matters(delay_ms: float, step_ms: float) -> bool:
    """Whether a rank's delay over its reference is large enough to name it (MIN_DELAY_MS and
    MIN_DELAY_SHARE of its step, both)."""
    return delay_ms > MIN_DELAY_MS and delay_ms > MIN_DELAY_SHARE * step_ms


def spread(values: list[float]) -> float:
    """The interquartile range: how far a rank's own step times wander (0 for one step)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def rank_figures(rank: int, host: str, stage_steps: list[dict[str, float]]) -> dict:
    """This rank's figures over some steps (`stage_steps`: each step's ms per stage): the medians of
    its step (the sum of the stages, the wait for the others included), of its scored time and of
    each stage, the spread of its scored time, and the steps themselves (a window is made of them)."""

    def scored(step: dict[str, float]) -> float:
        # A split that was not timed stands for its whole stage: without DDP there is no
        # communication hook, and the whole backward is the rank's own work.
        return sum(step.get(s, step.get(config.SPLITS.get(s, s), 0.0)) for s in scored_stages())

    names = sorted({k for s in stage_steps for k in s})
    scores = [scored(s) for s in stage_steps]
    return {
        "rank": rank,
        "host": host,
        "step_ms": statistics.median(sum(s.get(k, 0.0) for k in config.STAGE_NAMES) for s in stage_steps),
        "scored_ms": statistics.median(scores),
        "spread_ms": spread(scores),
        "stages_ms": {k: statistics.median([s.get(k, 0.0) for s in stage_steps]) for k in names},
        "steps": stage_steps,
    }


class StragglerDetector:
    def __init__(self, threshold: float, window_steps: int = WINDOW_STEPS):
        self.threshold, self.window_steps = threshold, window_steps
        self.recent: dict[int, list[dict]] = {}  # rank -> its latest intervals' figures (the window)
        self.best: dict[int, dict] = {}  # rank -> its figures over its fastest window so far

    def window(self, f: dict) -> dict:
        """Add a rank's figures for one interval; its figures over the latest intervals that hold
        at least window_steps steps (all of them while fewer have run)."""
        recent = self.recent.setdefault(f["rank"], [])
        recent.append(f)
        while len(recent) > 1 and sum(len(x["steps"]) for x in recent[1:]) >= self.window_steps:
            recent.pop(0)
        return rank_figures(f["rank"], f["host"], [s for x in recent for s in x["steps"]])

    def update(self, step: int, figures: list[dict]) -> list[dict]:
        """Every rank's figures for this interval (rank_figures): the reports of the ranks behind
        over the window. None while the window holds fewer than window_steps steps."""
        windows = [self.window(f) for f in figures]
        if any(len(w["steps"]) < self.window_steps for w in windows):
            return []
        fastest = min(windows, key=lambda w: w["scored_ms"])
        for w in windows:
            if w["rank"] not in self.best or w["scored_ms"] < self.best[w["rank"]]["scored_ms"]:
                self.best[w["rank"]] = w
        scores = [[self.score(ref, w) for ref in (fastest, self.best[w["rank"]])] for w in windows]
        # A slowdown every rank shares (the machine's load, a slower part of the run) is no rank's:
        # a rank's individual score counts against the threshold over the median rank's.
        typical = statistics.median(individual for _, individual in scores) or 1.0
        rows = []
        for w, (relative, individual) in zip(windows, scores):
            refs = ((relative, fastest), (individual / typical, self.best[w["rank"]]))
            # Each low score with the figures it compares against, if the delay matters and
            # stands out of both windows' noise.
            low = [(x, ref) for x, ref in refs if x < self.threshold and self.behind(w, ref)]
            rows.append((w, (relative, individual), low))
        reports = []
        for w, scores, low in rows:
            if not low:
                continue
            # The stage that grew most: against the fastest rank if that is the lower score, else
            # against this rank's own best window.
            reference = min(low, key=lambda x: x[0])[1]
            grew = {
                s: w["stages_ms"].get(s, 0.0) - reference["stages_ms"].get(s, 0.0)
                for s in scored_stages()
                if s in w["stages_ms"]
            }
            stage = max(grew, key=grew.get) if grew else None
            reports.append(
                {
                    "step": step,
                    "rank": w["rank"],
                    "host": w["host"],
                    "relative_score": round(scores[0], 3),
                    "individual_score": round(scores[1], 3),
                    "stage": stage,
                    "stage_ms": w["stages_ms"].get(stage),
                    "reference_stage_ms": reference["stages_ms"].get(stage),
                    "scored_ms": w["scored_ms"],
                    "spread_ms": w["spread_ms"],
                    "step_ms": w["step_ms"],
                    "window_steps": len(w["steps"]),
                }
            )
        return reports

    @staticmethod
    def score(ref: dict, w: dict) -> float:
        return ref["scored_ms"] / w["scored_ms"] if w["scored_ms"] else 1.0  # none timed: 1

    @staticmethod
    def behind(w: dict, ref: dict) -> bool:
        delay = w["scored_ms"] - ref["scored_ms"]
        return delay_matters(delay, w["step_ms"]) and delay > max(w["spread_ms"], ref["spread_ms"])


def format_report(r: dict, threshold: float) -> str:
    return (
        f"STRAGGLER rank {r['rank']} on {r['host']} at step {r['step']}: relative score "
        f"{r['relative_score']:.2f}, individual {r['individual_score']:.2f} (threshold {threshold:.2f}) "
        f"over {r['window_steps']} steps; {r['stage']} grew most: {r['stage_ms']:.1f} ms vs "
        f"{r['reference_stage_ms']:.1f} ms"
    )


class Ranks:
    """What the training loop does with the other ranks, in one object: the model it trains (DDP's
    wrapper for plain data parallelism; FSDP and TP work in place), gradients reduced on the last
    micro-batch only, one stop for every rank, slow ranks reported (stragglers.jsonl, rank 0), and
    `with ranks:` a lost rank named in one line."""

    def __init__(self, cfg, device: str, dist_info, plan, model, run, notes: list):
        self.cfg, self.device, self.info, self.plan, self.run = cfg, device, dist_info, plan, run
        self.detector = StragglerDetector(cfg.straggler_threshold)
        self.file = None
        if dist_info.is_main:  # before the first collective: a link in its place is one line on rank 0
            path = run.path / config.STRAGGLERS_FILE
            self.file = open(config.open_run_file(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
        self.model = model
        if not plan.sharded:  # DDP: its constructor broadcasts rank 0's weights to every rank
            from torch.nn.parallel import DistributedDataParallel

            ids = [dist_info.local_rank] if device == "cuda" else None
            try:
                self.model = DistributedDataParallel(model, device_ids=ids)
            except RuntimeError as e:  # a rank lost already: the same one line
                self.raise_lost(e)
                raise
            ranks, backend = dist_info.world_size, dist_info.backend
            notes.append(f"DDP: {ranks} ranks, {backend} backend; every rank draws its own batches")

    def timer(self, base: StageTimer) -> RankTimer:
        """The stage timer of a rank among others, in place of `base`: under DDP it also times the
        backward's own compute, through a communication hook; it sleeps for --simulate-slow-rank."""
        timer = RankTimer(self.device, base.enabled, self.cfg.simulate_slow_rank, self.info.rank)
        if not self.plan.sharded and timer.enabled:
            ((split, stage),) = config.SPLITS.items()  # the backward's own compute
            timer.add_split(stage, split)
            distributed.time_backward_compute(self.model, partial(timer.split, stage, split))
        return timer

    def sync_gradients(self, flag: bool) -> None:
        """Before each micro-batch's forward: whether its backward reduces the gradients over the
        ranks (the last micro-batch's only; the others accumulate locally, as nanoGPT does)."""
        if not self.plan.sharded:
            self.model.require_backward_grad_sync = flag
        elif self.plan.fsdp:
            self.model.set_requires_gradient_sync(flag)  # every FSDP module under the root

    def any(self, flag: bool) -> bool:
        """True on every rank if it is on any: every rank stops at the same step."""
        return distributed.any_rank(flag, self.info)

    def report_stragglers(self, step: int, inst, log) -> None:
        """At a log line: every rank's stage times over the interval's steady steps (warm-up is no
        straggler: figures.py leaves it out of `inst.device_steps`), gathered and scored; the slow
        ranks' reports on rank 0 alone (torchrun prints each rank's warnings: a report from every
        rank would show each STRAGGLER line once per rank)."""
        if not inst.device_steps:  # --no-stage-timing: on every rank alike
            return
        mine = rank_figures(self.info.rank, self.info.host, inst.device_steps)
        reports = self.detector.update(step, distributed.gather(mine, self.info))
        for report in reports if self.file else []:
            log.warning(format_report(report, self.detector.threshold))
            self.file.write(json.dumps(report) + "\n")
            self.file.flush()

    def resume(self) -> str:
        """How to go on after a lost rank: from the checkpoint, if one was saved."""
        run, cfg = self.run, self.cfg
        if not run.saves:
            return "nothing to resume from (--no-checkpoint)"
        checkpoint = run.checkpoint
        if self.plan.sharded:
            from minigpt.core.guards import sharded_checkpoint_dir

            checkpoint = sharded_checkpoint_dir(checkpoint)
        if not checkpoint.exists():
            return "no checkpoint was saved yet: start the run again"
        own = f" --checkpoint-path {cfg.checkpoint_path}" if cfg.checkpoint_path else ""
        return f"continue from {checkpoint} with --resume --out-dir {run.path}{own}"

    def raise_lost(self, error: BaseException) -> None:
        """LostRank, if `error` is a collective's that another rank left (distributed.as_lost_rank)."""
        lost = distributed.as_lost_rank(error, self.info, self.resume())
        if lost is not None:
            raise lost from error

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close()
        if error is not None:
            self.raise_lost(error)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


class RankTimer(StageTimer):
    """The stage timer of a rank among others: it also times a part of a stage, up to a mark inside
    it (add_split: under DDP, the backward's compute up to the last gradient bucket ready, which a
    slow peer does not stretch), and it sleeps inside a chosen stage on a chosen rank
    (--simulate-slow-rank R:MS:STAGE): a teaching and testing aid, never on by default."""

    def __init__(self, device: str, enabled: bool = True, slow_rank: str | None = None, rank: int = 0):
        super().__init__(device, enabled)
        self.sleep_ms: dict[str, float] = {}
        if slow_rank:
            slow = distributed.parse_slow_rank(slow_rank, config.STAGE_NAMES)
            self.sleep_ms = {slow.stage: slow.ms} if slow.rank == rank else {}
        self.split_of: dict[str, str] = {}  # stage -> the name of its split (see add_split)
        self.splits: dict[str, tuple[str, float, object]] = {}  # split -> (stage, seconds, event)
        self.open: dict[str, float] = {}  # the stages running now -> when they began

    @contextmanager
    def stage(self, name: str, timed: bool = True):
        with super().stage(name, timed):
            self.open[name] = time.perf_counter()  # split() measures from here
            try:
                if name in self.sleep_ms:
                    time.sleep(self.sleep_ms[name] / 1000)
                yield
            finally:
                del self.open[name]

    def done(self, name: str, seconds: float, start):
        end = super().done(name, seconds, start)
        split = self.split_of.get(name)
        if split is not None:  # the split's last mark inside this stage, else all of it
            _, part, event = self.splits.pop(split, (name, seconds, end))
            self.host[split] += 1000 * part
            if self.cuda:
                self.events.append((len(self.steps), split, start, event))
        return end

    def add_split(self, stage: str, name: str) -> None:
        """Time `name`, the part of every `stage` up to its last split() mark; a stage run without a
        mark counts whole. (Under DDP: the backward's compute, up to the last gradient bucket ready;
        a micro-step without gradient sync has no all-reduce to wait for, so all of it is compute.)"""
        self.split_of[stage] = name

    def split(self, stage: str, name: str) -> None:
        """Mark, now, the end of `name`: the part of the open `stage` done so far. Called several
        times in one stage, the last mark counts. Safe from another thread (autograd's)."""
        if not self.enabled or stage not in self.open:
            return
        self.splits[name] = (stage, time.perf_counter() - self.open[stage], self.event())
