"""Errors that the CLI turns into one line and a non-zero exit code, never a traceback."""


class ScoutbenchError(Exception):
    """A failure the user can fix; the message says what to do. Exit code 1."""

    exit_code = 1


class UsageError(ScoutbenchError):
    """Bad input (unknown name, malformed value, impossible combination). Exit code 2."""

    exit_code = 2
