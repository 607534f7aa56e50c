"""`python -m minigpt.report`: the command's short name, kept for the commands people know; the
code is minigpt.analysis.report (also `python -m minigpt report`)."""

from minigpt.analysis.report import main

if __name__ == "__main__":
    raise SystemExit(main())
