"""The run's end: the last lines of a run that finished (the profiler's cost, the predicted step
beside the measured one, the run's figures, the report, what to open next) or that a signal
stopped. Loaded at the end: nothing here is on the path of a step."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from minigpt import paths
from minigpt.fileio import atomic_write
from minigpt.left_out import describe_left_out
from minigpt.step_record import StepRecord, format_duration


def stopped(run, stop_signal: list[int], step: int, log: logging.Logger) -> int:
    """After a SIGINT/SIGTERM (on any rank) and the save: say how to continue; exit status
    128 + signal."""
    if run.dist_info.enabled:  # no rank leaves (and gets torn down) before the save is done
        from minigpt.core.distributed import barrier

        barrier(run.dist_info)
    signum = stop_signal[0] if stop_signal else signal.SIGTERM  # another rank's signal
    saved = (
        "no checkpoint (--no-checkpoint)"
        if run.cfg.no_checkpoint
        else f"checkpoint saved to {run.checkpoint}"
    )
    log.info(
        f"Stopped by {signal.Signals(signum).name} after step {step}; {saved}. Continue with: "
        f"python train_minimal.py --resume --out-dir {run.path} (and the same flags)"
    )
    return 128 + signum


def finish(
    run,
    log: logging.Logger,
    profiler_cost: str | None,
    rate,
    last: StepRecord,
    run_prediction,
    write_report,
) -> None:
    """The run's last lines after its last step (`last`: that step's record, the loop always logs
    it): the profiler's cost, the predicted step beside the measured one
    (`run_prediction`: minigpt/instruments/predict.py's), the run's figures, the report
    (`write_report`: minigpt/analysis/report.py's), and what to open next."""
    if profiler_cost:
        log.info(profiler_cost)
    # From cached rates only, None without them (measuring would lengthen the run's end), and under
    # --fsdp/--tp (collectives are not modelled).
    prediction = None if run.sharded else run_prediction(run.cfg, run.vocab_size, last.amp, rate.device)
    if prediction:
        log.info(predicted_line(prediction))
        run.config["predicted_step"] = prediction  # kept in config.json beside what the run measured
        if run.dist_info.is_main:
            atomic_write(run.path / paths.CONFIG_FILE, json.dumps(run.config, indent=2) + "\n")
        rate.predicted_ms = prediction.get("step_ms")
    log.info(finished_line(rate, last, last.step))
    if not run.cfg.no_report:
        report(run, log, write_report)
    out_dir, ckpt = run.path, run.checkpoint
    log.info(f"Checkpoint: {ckpt}" if ckpt.exists() else "Checkpoint: none (--no-checkpoint)")
    log.info(f"Run directory: {out_dir} ({paths.LOG_FILE}, {paths.METRICS_FILE}, {paths.CONFIG_FILE})")
    if run.dist_info.is_main:
        has_traces, has_report = (
            (out_dir / paths.TRACE_DIR).is_dir(),
            (out_dir / paths.REPORT_FILE).is_file(),
        )
        for line in next_steps(
            out_dir,
            has_traces,
            has_report,
            has_checkpoint=ckpt.is_file(),
            checkpoint=run.cfg.checkpoint_path,
        ):
            log.info(line)


def report(run, log: logging.Logger, write_report: Callable[[Path], Path]) -> None:
    """report.html: the run in one offline page, written by rank 0 once every rank's trace is
    on disk. A report that cannot be made costs a warning, never the run that trained."""
    if run.dist_info.enabled:
        from minigpt.core.distributed import barrier

        barrier(run.dist_info)
    if run.dist_info.is_main:
        try:
            page = write_report(run.path)
            log.info(f"Report: {page} (one offline page; python -m minigpt report rewrites it)")
        except Exception as e:  # noqa: BLE001 - the training is done and saved; say what went wrong
            log.warning(f"report not written: {type(e).__name__}: {e}")


def finished_line(rate, last: StepRecord, step: int) -> str:
    """The run's last line, from its last record: the steps since the start or the resume, and
    the steady step against the predicted one (rate.predicted_ms, config.json's) where there is one.
    `rate`: the run's Throughput (minigpt/instruments/instrument.py)."""
    share = None
    if rate.predicted_ms and last.run_steps:
        steady_ms = 1000 * last.run_step_time_s / last.run_steps
        share = (
            f"a steady step of {steady_ms:.1f} ms, {steady_ms / rate.predicted_ms:.0%} of the "
            f"predicted {rate.predicted_ms:.1f}"
        )
    return format_finished(last, step - rate.start_step, rate.start_step, share)


def format_finished(r: StepRecord, steps: int, resumed_at: int = 0, prediction: str | None = None) -> str:
    """The run's last line: its figures exactly as metrics.jsonl's last record holds them. A run
    resumed at step `resumed_at` counts from there: the steps before were another process's.
    `prediction`: the steady step against the predicted one, when there is a prediction."""
    startup = (
        f"start-up {format_duration(r.startup_s)} before the loop, in neither figure"
        if r.startup_s is not None
        else "start-up not measured"
    )
    val = f"val loss {r.val_loss:.4f}, val ppl {r.val_ppl:.1f}" if r.val_loss is not None else "no evaluation"
    left = describe_left_out(r.run_left_out)
    steady = (
        f"{r.run_tokens_per_s:,.0f} tokens/s in steady state ({r.run_steps} steps in {r.run_step_time_s:.2f}s"
        + (f"; left out: {left})" if left else ")")
        if r.run_tokens_per_s is not None
        else f"no steady-state figure: every step was left out ({left})"
    )
    return (
        f"Training finished: {steps} steps"
        + (f" (since the resume at step {resumed_at})" if resumed_at else "")
        + f", {r.tokens_trained:,} tokens; {val}; {steady}"
        + (f", {prediction}" if prediction else "")
        + f"; {r.tokens_per_s_e2e:,.0f} tokens/s end to end ({r.elapsed_s:.2f}s of loop to the last log "
        "line: left-out steps, evaluations, logging and checkpoints included); "
        f"{startup}"
    )


def next_steps(
    out_dir: str | Path,
    has_traces: bool,
    has_report: bool,
    *,
    has_checkpoint: bool = True,
    checkpoint: str | Path | None = None,
    trace_dir: str = "traces",
    report_file: str = "report.html",
) -> list[str]:
    """The lines every run ends with: what to open or run next, with this run's paths.
    checkpoint: a --checkpoint-path outside the run directory, which sample.py must be told."""
    out_dir = Path(out_dir)
    lines = [f"  scalars:        tensorboard --logdir {out_dir}"]
    if has_traces:
        lines.append(f"  trace summary:  python -m minigpt traces {out_dir / trace_dir}")
    if has_report:
        lines.append(f"  report:         {out_dir / report_file}")
    if has_checkpoint:
        where = f"--checkpoint {checkpoint}" if checkpoint else f"--out-dir {out_dir}"
        lines.append(f"  text from it:   python sample.py {where}")
    return ["Next steps:", *lines]


def predicted_line(p: dict) -> str:
    """config.json's predicted_step in one line, with the rates it came from: a data sheet's (a
    GPU's peak FLOP/s and bandwidth, not checked against a measured step) or this machine's own."""
    stages = ", ".join(f"{k} {v:.1f}" for k, v in p.get("stage_ms", {}).items())
    sheet = str(p.get("rates_source", "")).startswith("table")
    return (
        f"Predicted step: {p.get('step_ms', 0):.1f} ms ({stages}), "
        f"{p.get('tokens_per_s', 0):,.0f} tokens/s, from "
        + (
            "a data sheet's rates, not yet checked against a measured step"
            if sheet
            else "this machine's measured rates"
        )
        + f" [{p.get('rates_source', 'source not recorded')}]; "
        "the last line gives the steady step's share of it"
    )
