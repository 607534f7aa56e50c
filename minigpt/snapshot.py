"""`python -m minigpt.snapshot`: the command's short name; the code is minigpt.analysis.snapshot
(also `python -m minigpt snapshot`)."""

from minigpt.analysis.snapshot import main

if __name__ == "__main__":
    raise SystemExit(main())
