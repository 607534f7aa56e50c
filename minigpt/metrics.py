"""What a run reports: the log line (console and train.log) and metrics.jsonl."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

LOG_FORMAT = "[%(asctime)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def setup_logging(log_file: Path | None = None, enabled: bool = True) -> logging.Logger:
    """The 'minigpt' logger: console, plus log_file when given. Disabled on ranks other than 0."""
    log = logging.getLogger("minigpt")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None and enabled:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        log.addHandler(h)
    return log


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


def format_log_line(m: dict) -> str:
    """One line per log interval, in the spirit of the blog's trainer."""
    val = "n/a" if m.get("val_loss") is None else f"{m['val_loss']:.4f}"
    ppl = "n/a" if m.get("val_loss") is None else f"{m['val_ppl']:.1f}"
    return (f"epoch {m['epoch']} step {m['step']}/{m['num_steps']} | lr {m['lr']:.2e} | "
            f"step {m['step_time_s'] * 1000:.0f}ms | {m['tokens_per_s']:,.0f} tok/s | "
            f"train loss {m['loss']:.4f} | val loss {val} | val ppl {ppl} | "
            f"elapsed {format_duration(m['elapsed_s'])} | eta {format_duration(m['eta_s'])} | "
            f"amp {m['amp']}")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows a float past ~709


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
