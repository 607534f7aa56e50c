"""How a command ends on an error: a user's mistake, or a fault of the run or the machine."""


class UsageError(Exception):
    """A mistake the user can fix: one line on stderr, exit status 2, nothing written."""


class Fault(Exception):
    """A fault (a NaN, a lost rank, a full disk): one line on stderr, exit status 1."""
