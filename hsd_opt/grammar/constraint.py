"""One sequence's grammar state: the tokens allowed after each prefix of what it has generated.

A :class:`Constraint` copies a compiled grammar's matcher and answers :meth:`Constraint.allowed` ``(generated,
length)``: the tokens that may follow ``generated[:length]`` (the tokens after the prompt), as a boolean row over
the model's vocabulary. The decoding asks for rows at the positions of every pass it reads (a draft's row, a verify
pass's rows over the drafts and the bonus position), with ``generated`` holding its drafts: the matcher is moved to
each prefix by rolling back and consuming (microseconds), and each row is kept until the prefix it belongs to
changes (a rejected draft), so a verify pass's rows were mostly computed while drafting. Only tokens the grammar
allowed are ever appended, so the matcher never meets a refused token.

Units: token counts; rows are ``torch.bool`` of shape ``[vocab]``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hsd_opt.errors import HsdError
from hsd_opt.grammar.compiler import Grammar


def _common(a: Sequence[int], b: Sequence[int], n: int) -> int:
    """The length of the longest common prefix of ``a[:n]`` and ``b[:n]``."""
    n = min(n, len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Constraint:
    """A grammar's state for one sequence (see the module doc); its rows are as wide as the model's logits
    (``grammar.width``; ids past the tokenizer's are never allowed)."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.vocab_size = grammar.width
        self._eos = frozenset(grammar.eos_ids)
        self._matcher = grammar.template.deep_copy()
        self._at: list[int] = []                 # the tokens the matcher has consumed
        self._path: list[int] = []               # the prefix the kept rows belong to
        self._rows: dict[int, torch.Tensor] = {}     # length -> allowed row after path[:length]
        self._only: dict[int, int | None] = {}       # length -> the one token allowed there, as its row
        self._bits = np.zeros((1, (grammar.vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self, generated: Sequence[int], length: int) -> torch.Tensor:
        """The tokens that may follow ``generated[:length]``: ``torch.bool [vocab]``."""
        c = _common(self._path, generated, length)
        if c < min(len(self._path), length):         # the prefix changed at c: rows past it are stale
            del self._path[c:]
            for k in [k for k in self._rows if k > c]:
                del self._rows[k]
                self._only.pop(k, None)
        row = self._rows.get(length)
        if row is not None:
            return row
        if len(self._path) < length:
            self._path.extend(int(t) for t in generated[len(self._path):length])
        row = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self._move(self._path[:length]):       # after the end of sequence: nothing follows (only it, again)
            row[list(self._eos)] = True
        else:
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self._matcher.is_error():
                raise HsdError(f"grammar: {self._matcher.get_error()}")
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.grammar.vocab_size]
            row[:bits.size] = torch.from_numpy(bits.astype(bool))
        self._rows[length] = row
        return row

    def only(self, generated: Sequence[int], length: int) -> int | None:
        """The one token the grammar allows after ``generated[:length]``, None where it allows several (or the
        end of sequence is among them). Where it returns a token, every level's masked distribution is one-hot
        on it: greedy and sampled decoding both take it."""
        row = self.allowed(generated, length)         # drops what a changed prefix made stale, this too
        if length not in self._only:
            ids = row.nonzero().flatten()
            t = int(ids[0]) if ids.numel() == 1 else None
            self._only[length] = None if t is None or t in self._eos else t
        return self._only[length]

    def allowed_prefix(self, generated: Sequence[int], start: int, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (proposed after ``generated[:start]``) the grammar allows in a row."""
        seq = list(generated[:start]) + [int(t) for t in tokens]
        for i, t in enumerate(seq[start:]):
            if not bool(self.allowed(seq, start + i)[t]):
                return i
        return len(tokens)

    def accepting(self, generated: Sequence[int]) -> bool:
        """Whether the grammar accepts ``generated`` as a whole output (end of sequence allowed there)."""
        return self._move(list(generated)) or bool(self._matcher.is_accepting())

    def _move(self, tokens: list[int]) -> bool:
        """Roll the matcher back to the common prefix with ``tokens`` and consume the rest; True when ``tokens``
        ends with the end of sequence (allowed only where the grammar accepts; the matcher stays before it)."""
        ended = bool(tokens) and tokens[-1] in self._eos
        body = tokens[:-1] if ended else tokens
        c = _common(self._at, body, len(body))
        if c < len(self._at):
            self._matcher.rollback(len(self._at) - c)
            del self._at[c:]
        rest = body[c:]
        if rest:
            n = self._matcher.try_consume_tokens(rest)
            if n != len(rest):
                self._at.extend(rest[:n])
                raise HsdError(f"grammar: token {rest[n]} after {c + n} generated tokens is not allowed "
                               f"({self._matcher.get_error() or 'refused'})")
            self._at.extend(rest)
        if ended and not self._matcher.is_accepting():
            raise HsdError(f"grammar: the end of sequence after {len(body)} generated tokens is not allowed")
        return ended


def mask_logits(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits [m, V]`` with every token a row of ``rows [m, V]`` (bool) does not allow set to ``-inf`` (a new
    tensor)."""
    return logits.masked_fill(~rows.to(logits.device), float("-inf"))
