"""minigpt: a minimal GPT trainer that shows where the time and the memory go."""

import sys as _sys

if _sys.argv[:1] == ["-m"]:  # `python -m minigpt...`: the package loads before the tool's imports
    from minigpt.errors import exit_quietly_on_interrupt

    exit_quietly_on_interrupt("python -m minigpt")
