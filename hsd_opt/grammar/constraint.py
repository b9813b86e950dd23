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

from hsd_opt.errors import GrammarStopped, HsdError
from hsd_opt.grammar.compiler import Grammar


def _common(a: Sequence[int], b: Sequence[int], n: int) -> int:
    """The length of the longest common prefix of ``a[:n]`` and ``b[:n]``."""
    n = min(n, len(a), len(b))
    if list(a[:n]) == list(b[:n]):          # the usual case, compared at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class Constraint:
    """A grammar's state for one sequence (see the module doc); its rows are as wide as the model's logits
    (``grammar.width``; ids past the tokenizer's are never allowed). Each prefix's allowed tokens are kept as the
    matcher's packed bits (one bit per token id, ``int32`` words); the boolean row is made only where a level reads
    masked logits, and the questions the decoding asks most (is this token allowed, is one token forced) are
    answered from the bits."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.vocab_size = grammar.width
        self._eos = frozenset(grammar.eos_ids)
        self._matcher = grammar.template.deep_copy()
        self._own = False                        # a matcher built anew for this sequence alone (see _renew)
        self._at: list[int] = []                 # the tokens the matcher has consumed
        self._path: list[int] = []               # the prefix the kept bits and rows belong to
        self._bits: dict[int, np.ndarray] = {}       # length -> allowed tokens after path[:length], packed
        self._rows: dict[int, torch.Tensor] = {}     # length -> the same as a boolean row
        self._only: dict[int, int | None] = {}       # length -> the one token allowed there
        self._words = (grammar.vocab_size + 31) // 32
        after_end = np.zeros(self._words, dtype=np.uint32)       # after the end of sequence: only it, again
        for t in self._eos:
            if t < grammar.vocab_size:
                after_end[t >> 5] |= np.uint32(1 << (t & 31))
        self._after_end = after_end.view(np.int32)

    def bits(self, generated: Sequence[int], length: int) -> np.ndarray:
        """The tokens that may follow ``generated[:length]`` as packed bits: ``int32 [ceil(vocab / 32)]``, bit ``t %
        32`` of word ``t // 32`` for token ``t`` (kept: do not change it)."""
        c = _common(self._path, generated, length)
        if c < min(len(self._path), length):         # the prefix changed at c: what is kept past it is stale
            del self._path[c:]
            for kept in (self._bits, self._rows, self._only):
                for k in [k for k in kept if k > c]:
                    del kept[k]
        b = self._bits.get(length)
        if b is not None:
            return b
        if len(self._path) < length:
            self._path.extend(int(t) for t in generated[len(self._path):length])
        if self._move(self._path[:length]):
            b = self._after_end
        else:
            b = np.empty(self._words, dtype=np.int32)
            self._matcher.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
            if self._matcher.is_error():
                if self._renew():
                    return self.bits(generated, length)
                raise self._stopped(length)
        self._bits[length] = b
        return b

    def allows(self, generated: Sequence[int], length: int, token: int) -> bool:
        """Whether ``token`` may follow ``generated[:length]`` (one bit of :meth:`bits`)."""
        if not 0 <= token < self.grammar.vocab_size:
            return False
        return bool((int(self.bits(generated, length)[token >> 5]) >> (token & 31)) & 1)

    def allowed(self, generated: Sequence[int], length: int) -> torch.Tensor:
        """The tokens that may follow ``generated[:length]``: ``torch.bool [vocab]``."""
        b = self.bits(generated, length)            # drops what a changed prefix made stale, rows too
        row = self._rows.get(length)
        if row is None:
            row = torch.zeros(self.vocab_size, dtype=torch.bool)
            flags = np.unpackbits(b.view(np.uint8), bitorder="little")[:self.grammar.vocab_size]
            row[:flags.size] = torch.from_numpy(flags.view(bool))
            self._rows[length] = row
        return row

    def only(self, generated: Sequence[int], length: int) -> int | None:
        """The one token the grammar allows after ``generated[:length]``, None where it allows several (or the
        end of sequence is among them). Where it returns a token, every level's masked distribution is one-hot
        on it: greedy and sampled decoding both take it."""
        b = self.bits(generated, length)            # drops what a changed prefix made stale, this too
        if length not in self._only:
            t = None
            words = np.flatnonzero(b)
            if words.size == 1:
                w = int(b[words[0]]) & 0xFFFFFFFF
                if w & (w - 1) == 0:                     # one bit set
                    t = int(words[0]) * 32 + w.bit_length() - 1
            self._only[length] = None if t is None or t in self._eos else t
        return self._only[length]

    def allowed_prefix(self, generated: Sequence[int], start: int, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (proposed after ``generated[:start]``) the grammar allows in a row."""
        seq = list(generated[:start]) + [int(t) for t in tokens]
        for i, t in enumerate(seq[start:]):
            if not self.allows(seq, start + i, t):
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
        while True:
            c = _common(self._at, body, len(body))
            if c < len(self._at):
                self._matcher.rollback(len(self._at) - c)
                del self._at[c:]
            rest = body[c:]
            n = self._matcher.try_consume_tokens(rest) if rest else 0
            self._at.extend(rest[:n])
            if n == len(rest):
                break
            if self._renew():                      # a shared state another sequence broke: again on our own
                continue
            if self._matcher.is_error():            # the engine's own limit, met on an allowed token
                raise self._stopped(c + n)
            raise HsdError(f"grammar: token {rest[n]} after {c + n} generated tokens is not allowed "
                           f"({self._matcher.get_error() or 'refused'})")
        if ended and not self._matcher.is_accepting():
            raise HsdError(f"grammar: the end of sequence after {len(body)} generated tokens is not allowed")
        return ended

    def _renew(self) -> bool:
        """After the matcher refused an allowed token or failed: drop the grammar from its compiler's cache and,
        unless this sequence already has one, take a matcher of its own built anew (the copies of one template
        share llguidance's lexer state, which another sequence may have run past a limit); the caller then moves it
        to the prefix again. False where it had one already (the failure is this sequence's own)."""
        self.grammar.forget()
        if self._own or self.grammar.fresh is None:
            return False
        self._matcher, self._own, self._at = self.grammar.fresh(), True, []
        return True

    def _stopped(self, length: int) -> GrammarStopped:
        """The error of this sequence's own matcher (:meth:`_renew` gave it one) that ran past a limit of
        llguidance's after ``length`` generated tokens, on one line (its message goes on with a dump of its state
        and the grammar)."""
        why = " ".join(self._matcher.get_error().split("<state>")[0].split()) or "refused"
        return GrammarStopped(self.grammar.spec.source, f"the grammar engine (llguidance) cannot follow it past "
                                                        f"{length} generated tokens ({why}); a simpler schema may "
                                                        f"pass (fewer optional properties, smaller repeats)")


def mask_logits(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits [m, V]`` with every token a row of ``rows [m, V]`` (bool) does not allow set to ``-inf`` (a new
    tensor)."""
    return logits.masked_fill(~rows.to(logits.device), float("-inf"))
