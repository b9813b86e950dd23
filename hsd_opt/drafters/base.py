"""The interface of learning-free (token-level) drafters.

A :class:`TokenDrafter` proposes token ids without a neural forward of its own. Its draft distribution is
one-hot (q(x) = 1 for the proposed token), so it can only be the bottom level of a hierarchy
(``can_verify = False``). All token sequences are plain Python lists / sequences of ``int`` ids.
"""

from __future__ import annotations

import abc
import copy
from typing import Sequence


class TokenDrafter(abc.ABC):
    """A drafter that proposes token ids without a neural forward of its own (bottom level only).

    Attributes:
        name: unique in a profile, e.g. ``"ngram"``, ``"bigram"``, ``"aded"``.
        kind: ``"ngram_context" | "bigram_model" | "aded" | "mixed_ngram"``.
        can_verify: always False: a one-hot drafter has no distribution to verify others with.
    """

    name: str = "token"
    kind: str = "token"
    can_verify: bool = False
    #: True for a drafter that proposes only where it is confident and otherwise returns no tokens (or fewer
    #: than asked): the level above then takes one step of its own. Its acceptance is measured over the
    #: positions where it proposes, and the share of those positions is its ``draft_rate`` in a profile.
    may_abstain: bool = False

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start of a new sequence whose first tokens are ``prompt_ids``. Default: no state to reset."""

    def fork(self) -> "TokenDrafter":
        """A drafter for another sequence, decoded at the same time as this one's: the same configuration and
        read-only data (tables), and per-sequence state of its own once :meth:`reset` is called. Default: a
        shallow copy (every per-sequence structure is rebuilt by :meth:`reset`)."""
        return copy.copy(self)

    @abc.abstractmethod
    def propose(self, context: Sequence[int], n: int) -> list[int]:
        """Return EXACTLY ``n`` token ids continuing ``context`` (prompt + generated so far); a drafter with
        :attr:`may_abstain` returns at most ``n`` (``[]``: it abstains). ``context`` is the decoding's own
        sequence, not a copy: read it, never change it (the runtime refuses a drafter that appends to it or
        changes its last token).

        Deterministic: the same context gives the same proposal (q is one-hot). When nothing matches,
        each implementation documents its fallback; only an abstaining drafter returns fewer than ``n`` ids.
        An implementation refuses an ``n`` (and :meth:`propose_batch` a ``k`` or ``w``) of another form or range
        with :func:`check_proposal`.
        """

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        """Return ``k`` rows of ``w`` ids each, best first. Default: one row, ``[propose(context, w)]``.

        Implementations that can rank several continuations return exactly ``k`` rows (padding with
        duplicates of lower-ranked rows if they have fewer distinct ones, documented per class).
        """
        check_proposal(w, k, "w")
        return [self.propose(context, w)]

    def observe(self, context: Sequence[int], accepted: Sequence[int]) -> None:
        """``accepted`` tokens were just verified and appended after ``context``. Default: no-op."""

    def largest_id(self) -> int | None:
        """The largest token id this drafter may propose that is not in the context it is given (a table's or a
        matrix's), or None where it proposes only tokens of the context. A plan refuses a drafter whose largest id
        is past its target's vocabulary (a table made for another model) before it decodes anything."""
        return None

    def config(self) -> dict:
        """JSON-able parameters that rebuild this drafter with :func:`hsd_opt.drafters.make_token_drafter`."""
        return {"kind": self.kind, "name": self.name}

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"{type(self).__name__}({self.config()})"


def check_proposal(n: object, k: object = 1, width: str = "n") -> None:
    """Refuse the size of a proposal asked of a drafter (:meth:`TokenDrafter.propose`, :meth:`~TokenDrafter.
    propose_batch`): ``n`` tokens per row an integer >= 0 (``width``: its argument's name), ``k`` rows an integer
    >= 1; an :class:`~hsd_opt.errors.HsdError` naming the argument (a float was a TypeError from a slice, ``k`` 0 or
    below gave a row)."""
    from hsd_opt.errors import HsdError
    from hsd_opt.values import is_integer

    if not is_integer(n) or n < 0:
        raise HsdError(f"{width}: expected an integer >= 0 (tokens per proposal), got {n!r}")
    if not is_integer(k) or k < 1:
        raise HsdError(f"k: expected an integer >= 1 (proposals), got {k!r}")


def read_npz_table(path, what: str, fmt: str, keys: Sequence[str], ids: Sequence[str] = ()) -> tuple[dict, dict]:
    """Arrays ``keys`` and the JSON ``meta`` of an ``.npz`` table written by a drafter's ``save``.

    Raises :class:`~hsd_opt.errors.InputFileError` naming ``path`` when the file is missing, is not such a
    table (``what`` says which: its ``meta`` not a JSON object, an array not of numbers, one of ``ids`` (token
    ids) not of integers), or has another ``format`` than ``fmt``.
    """
    import json
    import zipfile

    import numpy as np

    from hsd_opt.errors import InputFileError

    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in keys}
    except FileNotFoundError:
        raise InputFileError(str(path), f"{what} not found") from None
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:     # a cut or damaged file too
        raise InputFileError(str(path), f"not a {what} ({e or type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise InputFileError(str(path), f"not a {what} (not a JSON object)", "meta")
    for k, a in arrays.items():
        if a.dtype.kind not in ("iu" if k in ids else "iuf"):
            raise InputFileError(str(path), f"not a {what} (its {k} holds {a.dtype}, not "
                                            f"{'token ids' if k in ids else 'numbers'})", k)
    if meta.get("format") != fmt:
        raise InputFileError(str(path), f"format {meta.get('format')!r}, expected {fmt!r}")
    return arrays, meta


def check_settings(ints: dict[str, tuple[object, int, int | None]] = {},
                   reals: dict[str, tuple[object, float, float, bool]] = {},
                   flags: dict[str, object] = {}) -> None:
    """Refuse a drafter's configuration values with a ``ValueError`` naming the field (the plan loader names the
    model entry): ``ints`` ``{name: (value, least, most or None)}`` integers in range; ``reals`` ``{name: (value,
    low, high, low_open)}`` finite numbers in ``[low, high]`` (``(low, high]`` where ``low_open``); ``flags``
    ``{name: value}`` true or false."""
    from hsd_opt.values import is_finite, is_integer

    for name, (v, least, most) in ints.items():
        if not is_integer(v) or v < least or (most is not None and v > most):
            span = f">= {least}" if most is None else f"in {least} .. {most}"
            raise ValueError(f"{name} must be an integer {span}, got {v!r}")
    for name, (v, low, high, low_open) in reals.items():
        if not is_finite(v) or not (low < v if low_open else low <= v) or v > high:
            raise ValueError(f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}")
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be true or false, got {v!r}")
