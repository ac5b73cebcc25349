"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (a flag, a file, a path). Its message says what to do."""


class ConfigError(UserError):
    """A configuration field has a bad value; the message names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class DataError(UserError):
    """The training data cannot be used (missing, empty, corrupt, inconsistent, non-finite)."""
