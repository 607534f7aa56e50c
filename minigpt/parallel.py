"""`python -m minigpt.parallel`: the command's short name, kept for the commands people know; the
code is minigpt.instruments.per_rank (also `python -m minigpt parallel`)."""

from minigpt.instruments.per_rank import main

if __name__ == "__main__":
    raise SystemExit(main())
