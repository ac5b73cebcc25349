"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""


# Exit status of a command (or a rank) that stopped on a UserError, as argparse uses for bad flags.
USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in what the user asked for (a flag, a file, a path). Its message says what to do.

    `shared` marks an error every rank of a job raises alike (a decision broadcast from rank 0, a
    NaN seen in all-reduced metrics): rank 0 alone reports it, so the user reads it once.
    """

    shared = False


class ConfigError(UserError):
    """A configuration field has a bad value; the message names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class DataError(UserError):
    """The training data cannot be used (missing, empty, corrupt, inconsistent, non-finite)."""


class TrainingStopped(BaseException):
    """SIGTERM or SIGINT reached a training process (a cancel, a time limit, Ctrl-C): it stops,
    records its run as STOPPED, and exits 128 + the signal without a traceback. A BaseException,
    so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, checkpoint_step: int | None = None):
        import signal

        self.signum = signum
        self.checkpoint_step = checkpoint_step  # the step a stop during training checkpointed
        self.signame = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signame}")
