"""The run's end, loaded there: the last lines of a run that finished (the profiler's cost, the
predicted step beside the measured one with --predict-time, the run's figures, the report, what to
open next) or that a signal stopped."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from minigpt.analysis.record import StepRecord, format_duration, left_out_parts
from minigpt.config import CONFIG_FILE, LOG_FILE, METRICS_FILE, REPORT_FILE, TRACE_DIR
from minigpt.core.data import cache_dir
from minigpt.instruments.peak import PEAK_CACHE_FILE, machine_key, write_cache


def stopped(run, stop_signal: list[int], step: int, log: logging.Logger) -> int:
    """After a SIGINT/SIGTERM/SIGHUP (on any rank) and the save: how to continue; 128 + signal."""
    if run.dist_info.enabled:  # no rank leaves (and is torn down) before the save is done
        from minigpt.core.distributed import barrier

        barrier(run.dist_info)
    signum = stop_signal[0] if stop_signal else signal.SIGTERM  # another rank's signal
    saved = (
        "no checkpoint (--no-checkpoint)"
        if run.cfg.no_checkpoint
        else f"checkpoint saved to {run.checkpoint}"
    )
    log.info(f"Stopped by {signal.Signals(signum).name} after step {step}; {saved}.")
    log.info(f"Continue with: python train_minimal.py --resume --out-dir {run.path} (and the same flags)")
    return 128 + signum


def finish(run, log: logging.Logger, inst, last: StepRecord) -> None:
    """The run's last lines after its last step (`last`: that step's record)."""
    cfg, main = run.cfg, run.dist_info.is_main
    if inst.window and (cost := inst.window.profiler_cost(inst.step_times)):
        log.info(cost)
    if main and (line := keep_achieved(inst.device, inst.figures.peak, last.achieved_tflops * 1e12)):
        log.warning(line)
    predicted = None
    if cfg.predict_time and not run.sharded:  # collectives are not modelled
        from minigpt.instruments.predict import run_prediction

        prediction = run_prediction(cfg, run.config["model"]["vocab_size"], last.amp, inst.device)
        if isinstance(prediction, str):  # none: why, and how to have one
            log.info(f"Predicted step: none ({prediction})")
        else:
            log.info(predicted_line(prediction))
            run.keep({"predicted_step": prediction})  # in config.json beside what the run measured
            predicted = prediction.get("step_ms")
    for line in finished_lines(last, last.step - inst.first_step + 1, inst.first_step - 1, predicted):
        log.info(line)
    if not cfg.no_report:
        report(run, log)
    ckpt = run.checkpoint
    log.info(f"Checkpoint: {ckpt}" if ckpt.exists() else "Checkpoint: none (--no-checkpoint)")
    log.info(f"Run directory: {run.path} ({LOG_FILE}, {METRICS_FILE}, {CONFIG_FILE})")
    if main:
        traces, page = (run.path / TRACE_DIR).is_dir(), (run.path / REPORT_FILE).is_file()
        for line in next_steps(run.path, traces, page, ckpt.is_file(), cfg.checkpoint_path):
            log.info(line)


def next_steps(
    path, has_traces: bool, has_report: bool, has_checkpoint: bool = True, checkpoint=None
) -> list:
    """What to open next, with this run's paths: its scalars, its traces' summary, its report, and
    text from its checkpoint (`checkpoint`: a --checkpoint-path of its own)."""
    lines = ["Next steps:", f"  scalars:        tensorboard --logdir {path}"]
    if has_traces:
        lines.append(f"  trace summary:  python -m minigpt traces {Path(path) / TRACE_DIR}")
    if has_report:
        lines.append(f"  report:         {Path(path) / REPORT_FILE}")
    if has_checkpoint:
        where = f"--checkpoint {checkpoint}" if checkpoint else f"--out-dir {path}"
        lines.append(f"  text from it:   python sample.py {where}")
    return lines


def keep_achieved(device: str, peak, achieved: float) -> str | None:
    """A rate a run achieved above its measured peak proves the peak low: cached as the machine's
    figure, so the next run's MFU stays below 100%. The line that says so; None otherwise."""
    if achieved <= peak.value or not peak.source.startswith(("measured", "cache")):
        return None
    path, date = cache_dir() / PEAK_CACHE_FILE, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_cache(
        path, machine_key(device, peak.dtype), dict(best=achieved, calls=1, date=date, what="a run's rate")
    )
    return (
        f"MFU passed 100%: the run achieved {achieved / 1e12:.3g} TFLOP/s, above its measured peak of "
        f"{peak.value / 1e12:.3g};\n  the next run's peak is at least that ({path})"
    )


def report(run, log: logging.Logger) -> None:
    """report.html, written by rank 0 once every rank's trace is on disk. A report that cannot be
    made costs a warning, never the run that trained."""
    if run.dist_info.enabled:
        from minigpt.core.distributed import barrier

        barrier(run.dist_info)
    if run.dist_info.is_main:
        from minigpt.analysis.report import write_report

        try:
            page = write_report(run.path)
            log.info(f"Report: {page} (one offline page; python -m minigpt report rewrites it)")
        except Exception as e:  # noqa: BLE001 - the training is done and saved; say what went wrong
            log.warning(f"report not written: {type(e).__name__}: {e}")


def finished_lines(
    r: StepRecord, steps: int, resumed_at: int = 0, predicted_ms: float | None = None
) -> list[str]:
    """The run's last lines, its figures as metrics.jsonl's last record holds them: the steps since
    the start (or the resume), the validation loss; the steady state and what was left out of it;
    end to end and the start-up; the share of the steady steps that ran busy."""
    resumed = f" (since the resume at step {resumed_at})" if resumed_at else ""
    val = f"val loss {r.val_loss:.4f}, val ppl {r.val_ppl:.1f}" if r.val_loss is not None else "no evaluation"
    lines = [f"Training finished: {steps} steps{resumed}, {r.tokens_trained:,} tokens; {val}"]
    if r.run_tokens_per_s is not None:
        steady_ms = 1000 * r.run_step_time_s / r.run_steps
        line = f"  steady state: {r.run_tokens_per_s:,.0f} tokens/s, {r.run_steps} steps in "
        line += f"{r.run_step_time_s:.2f}s"
        if predicted_ms:
            line += f"; a steady step of {steady_ms:.1f} ms, {steady_ms / predicted_ms:.0%} of the predicted "
            line += f"{predicted_ms:.1f}"
        lines.append(line)
    lines += [f"  left out: {part}" for part in left_out_parts(r.run_left_out)]  # a line per reason
    startup = (
        f"start-up {format_duration(r.startup_s)}" if r.startup_s is not None else "start-up not measured"
    )
    lines.append(
        f"  end to end: {r.tokens_per_s_e2e:,.0f} tokens/s over {r.elapsed_s:.2f}s of loop (evaluations, "
        f"logging, checkpoints in it); {startup} before the loop, in neither figure"
    )
    if r.run_busy:
        lines.append(
            f"  busy: others took over a quarter of the cores in {r.run_busy:.0%} of the steady steps: "
            "re-run on a quiet machine before comparing"
        )
    return lines


def predicted_line(p: dict) -> str:
    """config.json's predicted_step in one line, with where its rates come from."""
    stages = ", ".join(f"{k} {v:.1f}" for k, v in p.get("stage_ms", {}).items())
    sheet = str(p.get("rates_source", "")).startswith("table")
    source = "a data sheet's rates, unchecked" if sheet else "this machine's measured rates"
    where = p.get("rates_source", "?")
    return f"Predicted step: {p.get('step_ms', 0):.1f} ms ({stages}),\n  from {source} [{where}]"
