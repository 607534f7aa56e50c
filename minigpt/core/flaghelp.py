"""--help's text for the trainer's flags: each flag's default (the default preset's value where it
sets one), and the presets and $MINIGPT_ARGS after the flags. Loaded by --help alone."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields

from minigpt.core.config import DEFAULT_PRESET, EXTRA_ARGS_ENV, PRESETS, TrainConfig, flag_name


def add_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag's help ends with its default; the presets table and $MINIGPT_ARGS close the text."""
    by_dest = {f.name: f for f in fields(TrainConfig)}
    for action in parser._actions:
        if action.dest in by_dest and not getattr(action, "described", False):
            action.help += default_help(by_dest[action.dest]).replace("%", "%%")
            action.described = True
    parser.epilog = EPILOG


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(value) if value else "none"
    return str(value)


def default_help(f: Field) -> str:
    """'(default: ...)' for --help: the default preset's value where it sets this field, else the
    field's default, or what None means."""
    meta = f.metadata
    if meta["action"] in ("store_true", "store_false"):
        return ""  # a switch: off unless given
    if f.name in PRESETS[DEFAULT_PRESET]:
        return f" (default: {_show(PRESETS[DEFAULT_PRESET][f.name])}, from --preset {DEFAULT_PRESET})"
    value = [] if f.default_factory is list else f.default
    shown = meta["none"] if meta["none"] is not None and value in (None, []) else _show(value)
    by_presets = [p for p in PRESETS if f.name in PRESETS[p]]
    return f" (default: {shown}" + (f"; set by --preset {', '.join(by_presets)}" if by_presets else "") + ")"


def presets_table() -> str:
    names = sorted({k for p in PRESETS.values() for k in p}, key=[f.name for f in fields(TrainConfig)].index)
    flags = {f.name: flag_name(f) for f in fields(TrainConfig)}
    lines = [f"presets (--preset NAME sets these; flags on the command line win; default {DEFAULT_PRESET}):"]
    for preset, values in PRESETS.items():
        lines.append(f"  {preset:6s} " + " ".join(f"{flags[n]} {values[n]}" for n in names if n in values))
    return "\n".join(lines)


EPILOG = (
    presets_table() + "\n\n"
    f"${EXTRA_ARGS_ENV}: flags in it are appended to the command line, so they win over the same\n"
    "flags given there: a way to scale every command of a script down to a quick run, e.g.\n"
    f'  {EXTRA_ARGS_ENV}="--preset tiny --num-steps 8" python train_minimal.py'
)
