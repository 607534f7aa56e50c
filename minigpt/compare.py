"""`python -m minigpt.compare`: the command's short name, kept for the commands people know; the
code is minigpt.analysis.compare (also `python -m minigpt compare`)."""

from minigpt.analysis.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
