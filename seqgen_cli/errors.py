"""The one exception type users see: printed as a single line, non-zero exit, no traceback."""


class SeqgenError(Exception):
    """A user-facing error; ``str(err)`` is the whole message (name the file, line and problem)."""

    exit_code = 2
