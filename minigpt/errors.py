"""How a command ends on an error: a user's mistake (one line, status 2), a fault (one line, 1)."""


class UsageError(Exception): ...  # a mistake the user can fix: nothing was written


class Fault(Exception): ...  # a fault of the run or the machine: a lost rank, a full disk


class NonFiniteLoss(Fault): ...  # the loss or the weights became NaN or inf: the last good checkpoint kept
