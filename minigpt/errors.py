"""A user's mistake, and how every command line of the project reports one: one line on stderr
that names the problem and the fix, exit status 2, no traceback, no usage block. Standard library
only: the trainer, the instruments and the analysis tools all import it."""

from __future__ import annotations

import argparse
import os
import signal
import sys

# A stop by Ctrl-C: 128 + SIGINT, the shell's convention (the trainer stopped by a signal in its
# loop exits with 128 + the signal's number too, after its checkpoint).
INTERRUPTED = 130
INTERRUPTED_LINE = "interrupted (Ctrl-C); no file was left half-written (each is renamed into place whole)"


class UsageError(Exception):
    """A mistake the user can fix. The trainer prints it as one line and exits with status 2."""


class NonFiniteLoss(Exception):
    """The loss or the weights became NaN or inf: the run stops (exit status 1) rather than train
    on garbage, and says that its last good checkpoint was kept."""


class LostRank(Exception):
    """A peer process ended or stopped answering mid-run (torchrun): a fault, not a user's mistake
    (exit 1). Raised by minigpt/core/distributed.py."""


class ArgParser(argparse.ArgumentParser):
    """argparse with the project's rule for a bad flag: one line and exit status 2.
    `name_prog`: begin the line with the program's name, as the trainer's own errors do."""

    name_prog = False

    def error(self, message: str) -> None:
        head = f"{self.prog}: " if self.name_prog else ""
        print(f"{head}error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def exit_quietly_on_interrupt(prog: str) -> None:
    """A Ctrl-C that nothing of the program caught ends as one line and status 130, not a traceback.
    While the imports run (until imports_done()), it exits at once from a signal handler: raised as
    KeyboardInterrupt there, it can be swallowed (torch's import clears the error of an interrupted
    numpy import and goes on with numpy half-made). Other uncaught exceptions go to the earlier hook."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        exit_interrupted(prog)

    sys.excepthook = hook
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup)
        _exit_at_once.prog = prog
        signal.signal(signal.SIGINT, _exit_at_once)


def imports_done() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for the program's own handling (a save, a clean-up)."""
    if signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_at_once(signum, frame) -> None:
    exit_interrupted(_exit_at_once.prog)


def exit_interrupted(prog: str) -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"{prog}: {INTERRUPTED_LINE}", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)  # at once: a second Ctrl-C must not meet the interpreter's shutdown
