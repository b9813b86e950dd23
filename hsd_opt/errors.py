"""Errors that reach the user as one clear line (the CLI prints them and exits with code 2)."""

from __future__ import annotations


class HsdError(Exception):
    """A usage or input error: bad flag, bad file, bad field. Printed as one line, exit code 2."""


class SettingError(HsdError):
    """An environment setting (``HSD_*``) with a value it does not take: the message names the variable, and
    nothing that merely read it while loading a file blames the file."""


class ContextFull(HsdError):
    """A prompt that, with the tokens asked for after it, passes the model's context (``hsd chat``: a conversation
    that no longer fits, which every later turn would pass too)."""


class GrammarStopped(HsdError):
    """A grammar the engine compiled but cannot follow further partway through an output: a limit of llguidance's
    own that this grammar reaches there (its parser's items per token, its lexer's expressions), not a bug of the
    decoding. ``source`` names the grammar (``--json-schema FILE``, ``response_format.json_schema.schema``)."""

    def __init__(self, source: str, message: str):
        self.source = source
        super().__init__(f"{source}: {message}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout``, ``kill``, batch schedulers and service managers send), raised where Ctrl-C is,
    so that a long command keeps and reports the work it finished; the command line then exits with status 143
    (128 + SIGTERM), as a process the signal ended does. A subclass, so that code which must end on it but only
    pause on Ctrl-C (``hsd chat``) can tell them apart."""


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


def one_line(e: BaseException) -> str:
    """``e`` as the words a report or an error line gives it: its type and the first line of its message."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"
