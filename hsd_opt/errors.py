"""Errors that reach the user as one clear line (the CLI prints them and exits with code 2)."""

from __future__ import annotations


class HsdError(Exception):
    """A usage or input error: bad flag, bad file, bad field. Printed as one line, exit code 2."""


class InputFileError(HsdError):
    """A file that cannot be read or does not hold what was expected.

    The message names the file and, where known, the field: ``profile.json: acceptance.layer8.layer30: ...``.
    """

    def __init__(self, path: str, message: str, field: str | None = None):
        self.path = str(path)
        self.field = field
        where = f"{self.path}: {field}: " if field else f"{self.path}: "
        super().__init__(where + message)
