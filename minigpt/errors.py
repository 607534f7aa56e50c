"""A user's mistake, and how every command line of the project reports one: one line on stderr
that names the problem and the fix, exit status 2, no traceback, no usage block. Standard library
only: the trainer, the instruments and the analysis tools all import it."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """A mistake the user can fix. The trainer prints it as one line and exits with status 2."""


class ArgParser(argparse.ArgumentParser):
    """argparse with the project's rule for a bad flag: one line and exit status 2.
    `name_prog`: begin the line with the program's name, as the trainer's own errors do."""

    def __init__(self, *args, name_prog: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.name_prog = name_prog

    def error(self, message: str) -> None:
        head = f"{self.prog}: " if self.name_prog else ""
        print(f"{head}error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
