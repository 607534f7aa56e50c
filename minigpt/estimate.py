"""`python -m minigpt.estimate`: the command's short name, kept for the commands people know; the
code is minigpt.instruments.estimate (also `python -m minigpt estimate`)."""

import sys

# --time: the rates are timed on the malloc the trainer runs on, chosen before torch loads
if __name__ == "__main__" and "--time" in sys.argv:
    from minigpt.core.cpu import run_under_preferred_allocator

    run_under_preferred_allocator(sys.argv[1:])

from minigpt.instruments.estimate import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
