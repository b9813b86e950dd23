"""Decoding states no sequence holds, kept per engine for the sequences after: their memory (no allocation per
generation), and the keys and values of the tokens they hold, which a prompt that starts with those tokens may take
instead of computing them (a conversation's next turn starts with the previous turn's prompt and answer).

The pool knows nothing of passes: the decoding that takes a state says how many of its positions it can use
(:meth:`StatePool.take`'s ``usable``), and so whether taking them is exact (``hsd_opt.runtime.decode``)."""

from __future__ import annotations

from typing import Callable, Sequence

from hsd_opt.engine.interface import Engine
from hsd_opt.engine.state import DecodeState

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
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes: expected >= 0, got {keep_bytes}")
        self.keep_bytes = int(keep_bytes)
        self.reuse = reuse
        self._free: list[tuple[int, DecodeState]] = []     # (id(engine), state), least recently given first

    def take(self, eng: Engine, max_len: int, bounds: Sequence[int],
             usable: Callable[[DecodeState], int] | None = None) -> DecodeState:
        """A state of ``eng`` with room for ``max_len`` tokens keeping residual streams at ``bounds``: the free one
        whose first ``usable(st)`` positions are the most (with :attr:`reuse`), cropped to them (copied into a new
        state where it is too short); else the least recently given free one that fits, cropped to nothing; else a
        new one."""
        mine = [i for i, (key, st) in enumerate(self._free) if key == id(eng) and all(b in st.resid for b in bounds)]
        best, keep = None, 0
        if self.reuse and usable is not None:
            for i in reversed(mine):                    # the most recent first: it wins a tie
                n = usable(self._free[i][1])
                if n > keep:
                    best, keep = i, n
        if best is None:
            best = next((i for i in mine if self._free[i][1].max_len >= max_len), None)
        if best is None:
            return eng.new_state(max(max_len, 256), save_boundaries=bounds)
        st = self._free.pop(best)[1]
        eng.crop(st, keep)
        return st if st.max_len >= max_len else _grown(eng, st, max_len, bounds)

    def give(self, eng: Engine, st: DecodeState) -> None:
        """Take back a state no sequence holds, dropping the least recently given ones while those beyond each
        engine's most recent hold more than :attr:`keep_bytes`."""
        self._free.append((id(eng), st))
        latest = {key: i for i, (key, _) in enumerate(self._free)}
        extra = [i for i in range(len(self._free)) if latest[self._free[i][0]] != i]
        held = sum(state_bytes(self._free[i][1]) for i in extra)
        drop = set()
        for i in extra:
            if held <= self.keep_bytes:
                break
            drop.add(i)
            held -= state_bytes(self._free[i][1])
        self._free = [e for i, e in enumerate(self._free) if i not in drop]

    def states(self, eng: Engine) -> list[DecodeState]:
        """``eng``'s free states, least recently given first."""
        return [st for key, st in self._free if key == id(eng)]


def _grown(eng: Engine, st: DecodeState, max_len: int, bounds: Sequence[int]) -> DecodeState:
    """A new state of ``eng`` with room for ``max_len`` tokens holding what ``st`` holds (its tokens, every
    layer's keys and values, the residual streams at ``bounds``)."""
    new = eng.new_state(max(max_len, 256), save_boundaries=bounds)
    n = st.n
    new.tokens[:n] = st.tokens[:n]
    new.n, new.lens, new.stepwise, new.prompt = n, list(st.lens), st.stepwise, st.prompt
    for dst, src in zip(new.k + new.v, st.k + st.v):
        dst[:, :, :n] = src[:, :, :n]
    for b, rows in new.resid.items():
        rows[:n] = st.resid[b][:n]
    return new
