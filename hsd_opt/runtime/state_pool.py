"""Decoding states no sequence holds, kept per engine for the sequences after: their memory (no allocation per
generation), and the keys and values of the tokens they hold, which a prompt that starts with those tokens may take
instead of computing them (a conversation's next turn starts with the previous turn's prompt and answer). States
a decoding still holds are lent too, for their prompts' positions to be copied (an answer's other choices, requests
that share a system prompt).

The pool knows nothing of passes: the decoding that takes a state says how many of its positions it can use
(:meth:`StatePool.take`'s ``usable``), and so whether taking them is exact (``hsd_opt.runtime.decode``)."""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from hsd_opt.engine.interface import Engine
from hsd_opt.engine.state import DecodeState
from hsd_opt.errors import HsdError
from hsd_opt.values import is_integer

#: Bytes of free states a pool keeps by default beyond one per engine: none (the pool then only saves allocations
#: and holds each engine's last sequence).
DEFAULT_KEEP_BYTES = 0


def state_bytes(st: DecodeState) -> int:
    """Bytes a decoding state holds (its token ids, caches and residual streams, as allocated)."""
    tensors = [st.tokens, *st.k, *st.v, *st.resid.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


class StatePool:
    """Free decoding states per engine, least recently given first.

    Args:
        keep_bytes: bytes of free states kept beyond the most recent one of each engine (0: one per engine). A
            server that keeps several lets several clients' next turns find their conversations.
        reuse: whether a sequence may take the positions of a free state that its prompt starts with (the caller's
            ``usable`` decides how many); False: every state is taken cropped to nothing.
    """

    def __init__(self, keep_bytes: int = DEFAULT_KEEP_BYTES, reuse: bool = False):
        if not is_integer(keep_bytes) or keep_bytes < 0:
            raise HsdError(f"keep_bytes: expected an integer >= 0, got {keep_bytes!r}")
        if not isinstance(reuse, bool):
            raise HsdError(f"reuse: expected True or False, got {reuse!r}")
        self.keep_bytes = int(keep_bytes)
        self.reuse = reuse
        self._free: list[tuple[weakref.ref, DecodeState]] = []    # (engine, state), least recently given first
        self._live: list[tuple[weakref.ref, weakref.ref]] = []     # (engine, state a decoding holds), lent

    def take(self, eng: Engine, max_len: int, bounds: Sequence[int],
             usable: Callable[[DecodeState], int] | None = None) -> DecodeState:
        """A state of ``eng`` with room for ``max_len`` tokens keeping residual streams at ``bounds``. With
        :attr:`reuse` and ``usable``, the one whose first ``usable(st)`` positions are the most: a free state
        cropped to them (copied into a new state where it is too short), or a state a decoding holds
        (:meth:`lend`; at most its prompt) copied into a free or new one; else the least recently given free one
        that fits, cropped to nothing; else a new one. While the free states hold no more than
        :attr:`keep_bytes` (a server's prompt cache), none is cropped for another prompt: one that shares only
        part of a free state copies that part into a new state, and one that shares nothing gets a new state."""
        def has(st: DecodeState) -> bool:
            return all(b in st.resid for b in bounds)

        def new() -> DecodeState:
            return eng.new_state(max(max_len, 256), save_boundaries=bounds)

        mine = [i for i, (key, st) in enumerate(self._free) if key() is eng and has(st)]
        best, keep, source = None, 0, None
        if self.reuse and usable is not None:
            for i in reversed(mine):                    # the most recent first: it wins a tie
                n = usable(self._free[i][1])
                if n > keep:
                    best, keep = i, n
            for key, ref in self._live:
                st = ref()
                if key() is eng and st is not None and has(st):
                    n = min(usable(st), st.prompt)
                    if n > keep:
                        best, keep, source = None, n, st
        # within the bytes the pool keeps, a state kept for another conversation stays whole: a prompt that shares
        # only its first positions copies them, one that shares none gets a new state (taken and cropped, a client
        # in between two turns of another's conversation wiped it, so the pool held one conversation per request
        # decoding at once, whatever its bytes)
        # (the bytes measured as :meth:`give` keeps them: beyond each engine's most recent state, which always
        # stays, so that a full pool drops the states unused longest instead of cropping a recent one)
        room = self.reuse and self.keep_bytes > 0 and self.kept_bytes() <= self.keep_bytes
        if room and best is not None and keep < max(self._free[best][1].lens, default=0):
            best, source = None, self._free[best][1]     # it holds positions past those taken: it stays whole
        if best is None and not room:
            best = next((i for i in mine if self._free[i][1].max_len >= max_len), None)
        st = self._free.pop(best)[1] if best is not None else new()
        if source is not None:
            eng.crop(st, 0)
            return _copy(st, source, keep)
        eng.crop(st, keep)
        return st if st.max_len >= max_len else _copy(new(), st, st.n)

    def lend(self, eng: Engine, st: DecodeState) -> None:
        """Let later sequences copy the positions ``st`` holds of its prompt while a decoding holds it (an answer's
        other choices, requests sharing a system prompt); until it is given back (:meth:`give`) or dropped."""
        if self.reuse:
            self._live = [(k, r) for k, r in self._live if r() is not None] + [(weakref.ref(eng), weakref.ref(st))]

    def give(self, eng: Engine, st: DecodeState) -> None:
        """Take back a state no sequence holds, dropping the least recently given ones while those beyond each
        engine's most recent hold more than :attr:`keep_bytes`."""
        self._live = [(k, r) for k, r in self._live if r() is not None and r() is not st]
        self._free = [(k, s) for k, s in self._free if k() is not None] + [(weakref.ref(eng), st)]  # engines alive
        extra = self._beyond_latest()
        held = sum(state_bytes(self._free[i][1]) for i in extra)
        drop = set()
        for i in extra:
            if held <= self.keep_bytes:
                break
            drop.add(i)
            held -= state_bytes(self._free[i][1])
        self._free = [e for i, e in enumerate(self._free) if i not in drop]

    def _beyond_latest(self) -> list[int]:
        """Indices into the free states of those beyond each engine's most recent one (those :attr:`keep_bytes`
        bounds), least recently given first."""
        latest = {id(key()): i for i, (key, _) in enumerate(self._free) if key() is not None}
        return [i for i, (key, _) in enumerate(self._free) if key() is not None and latest[id(key())] != i]

    def held_bytes(self) -> int:
        """Bytes of the free states the pool holds (every engine's)."""
        return sum(state_bytes(st) for key, st in self._free if key() is not None)

    def kept_bytes(self) -> int:
        """Bytes of the free states beyond each engine's most recent one: what :attr:`keep_bytes` bounds (a
        server's ``--prompt-cache``)."""
        return sum(state_bytes(self._free[i][1]) for i in self._beyond_latest())

    def states(self, eng: Engine) -> list[DecodeState]:
        """``eng``'s free states, least recently given first."""
        return [st for key, st in self._free if key() is eng]


def _copy(dst: DecodeState, src: DecodeState, n: int) -> DecodeState:
    """``dst`` (empty, with room) holding ``src``'s first ``n`` positions: their tokens, every layer's keys and values
    (``src`` has computed them all), the residual streams at the boundaries both keep."""
    dst.tokens[:n] = src.tokens[:n]
    dst.n, dst.lens, dst.prompt = n, [min(x, n) for x in src.lens], min(src.prompt, n)
    dst.off_steps = src.off_steps.below(n)
    for d, s in zip(dst.k + dst.v, src.k + src.v):
        d[:, :, :n] = s[:, :, :n]
    for b, rows in dst.resid.items():
        if b in src.resid:
            rows[:n] = src.resid[b][:n]
    return dst
