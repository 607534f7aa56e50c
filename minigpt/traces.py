"""`python -m minigpt.traces`: the command's short name, kept for the commands people know; the
code is minigpt.analysis.traces (also `python -m minigpt traces`)."""

from minigpt.analysis.traces import main

if __name__ == "__main__":
    raise SystemExit(main())
