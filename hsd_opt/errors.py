"""Errors that reach the user as one clear line (the CLI prints them and exits with code 2)."""

from __future__ import annotations


class HsdError(Exception):
    """A usage or input error: bad flag, bad file, bad field. Printed as one line, exit code 2."""


class OutputFileError(HsdError, OSError):
    """A file that cannot be written (a directory, a folder that cannot be made, no room): the message names it.
    Also an :class:`OSError`, so that code which writes only a cache and goes on without it still does."""


class InputFileError(HsdError):
    """A file that cannot be read or does not hold what was expected.

    The message names the file and, where known, the field: ``profile.json: acceptance.layer8.layer30: ...``.
    """

    def __init__(self, path: str, message: str, field: str | None = None):
        self.path = str(path)
        self.field = field
        where = f"{self.path}: {field}: " if field else f"{self.path}: "
        super().__init__(where + message)
