"""The tools, under one entry: `python -m minigpt TOOL [ARGS]`.

    python -m minigpt report runs/RUN               # the run's offline HTML page
    python -m minigpt compare runs/A runs/B         # two runs side by side, each ratio with its interval
    python -m minigpt traces runs/RUN               # where the time went, from the profiler traces
    python -m minigpt estimate --preset gpt2        # a step's memory from the flags (--time: its stage times)
    python -m minigpt parallel --gpus 8             # memory and communication per GPU of each parallel plan
    python -m minigpt snapshot runs/RUN             # the CUDA memory snapshot, offline (snapshots/*.html)
    python -m minigpt export runs/RUN --out DIR     # the run as a Hugging Face GPT-2 folder
    python -m minigpt TOOL --help                   # the tool's own flags

Training and sampling are the scripts at the repository's root: train_minimal.py and sample.py.
"""

from __future__ import annotations

import importlib
import sys

from minigpt.config import exit_on_ctrl_c, imports_done

exit_on_ctrl_c("python -m minigpt")  # a Ctrl-C during a tool's imports: one line, status 130

# Tool -> (the module whose main() it runs, what it does): `python -m minigpt TOOL` is the one address
# of each tool; the modules stay where their layer is (analysis reads runs, instruments measure).
TOOLS = {
    "report": ("minigpt.analysis.report", "write a run's offline HTML report"),
    "compare": ("minigpt.analysis.compare", "compare two runs"),
    "traces": ("minigpt.analysis.traces", "summarise profiler traces: stages, kernels, operators"),
    "estimate": (
        "minigpt.instruments.estimate",
        "predict a step's memory (or, with --time, its stage times) from the trainer's flags",
    ),
    "parallel": (
        "minigpt.instruments.per_rank",
        "per-GPU memory and communication of DDP, FSDP and TP plans",
    ),
    "export": (
        "minigpt.core.gpt2",
        "a run or checkpoint as a Hugging Face GPT-2 folder (weights, config, tokenizer)",
    ),
    "snapshot": (
        "minigpt.analysis.snapshot",
        "a CUDA memory snapshot as an offline page: bytes over the steps, the peak, what was live",
    ),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    return "usage: python -m minigpt TOOL [ARGS]\n\ntools:\n" + "\n".join(
        f"  {name:{width}s}  {what}" for name, (_, what) in TOOLS.items()
    )


def main(argv: list[str] | None = None) -> int:
    """Run the tool named first in argv with the rest; its exit status is returned."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"{usage()}\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in TOOLS:
        given = f"no tool {argv[0]!r}" if argv else "no tool given"
        print(f"error: {given}; python -m minigpt {'|'.join(TOOLS)} (see --help)", file=sys.stderr)
        return 2
    tool, args = argv[0], argv[1:]
    module = importlib.import_module(TOOLS[tool][0])
    imports_done()  # a Ctrl-C from here on is the tool's to handle
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
