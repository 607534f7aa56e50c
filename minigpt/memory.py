"""`python -m minigpt.memory`: the command's short name, kept for the commands people know; the
code is minigpt.instruments.estimate (also `python -m minigpt memory`)."""

from minigpt.instruments.estimate import main

if __name__ == "__main__":
    raise SystemExit(main())
