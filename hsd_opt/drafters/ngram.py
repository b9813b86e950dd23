"""Context-derived n-gram drafter (N-Grammys paper, arXiv 2411.03786, Sec. 4.2 and App. B.2).

For the last ``q`` tokens of the context (the query), find ALL earlier occurrences of that q-gram in the
context; the ``w`` tokens that follow an occurrence are a candidate continuation. Candidates are ranked by
how many occurrences share them (count, descending), ties broken by the most recent occurrence (later in
the context wins), as in App. B.2 (``torch.unique`` counts + ``topk``) with the recency tie-break of Sec. 4.2.

Choices where the paper is silent (documented here, tested in tests/test_drafters.py):

* Only occurrences with a FULL continuation of ``w`` tokens inside the context count (the paper's ``unfold``
  into grams of size ``q + w``). The query's own position never matches (it has no continuation).
* Backoff: if the q-gram has no usable occurrence, try ``q - 1``, ..., ``1`` (``min_q``). For batches, rows are
  filled from the longest query first, then from shorter ones, keeping rows distinct.
* At most ``max_occurrences`` most recent occurrences per query are scanned (bounded cost per call).
* Fallback of ``propose(context, n)`` when no full ``n``-token continuation exists at any q: chain one-token
  predictions (same matcher with ``w = 1`` on the context extended by the tokens chosen so far); when even
  that finds nothing, repeat the last token chosen (or the last context token; ``0`` for an empty context).
  ``propose_batch`` pads missing rows with copies of ``propose(context, w)``.
* ``abstain=True`` (prompt-lookup style, the default pool's ``lookup``): no fallback; ``propose`` returns ``[]``
  when no q-gram with ``q >= min_q`` has a full continuation. The guesses the fallback makes are rarely right
  (far less often than a matched 2-gram's continuation), so the level above is better off taking its own step
  there.

Index: ``positions[q][gram]`` = increasing list of positions ``i`` with ``seq[i-q:i] == gram`` (the continuation
starts at ``i``). It is kept in sync incrementally with the context passed to any call (append when the
context extends the indexed sequence, pop the tail when it was rolled back), so ``propose`` indexes only the new
tokens and scans O(q + occurrences) entries; what grows with the context is one comparison of the context with the
indexed sequence (list equality, in C: about 35 us at 8,000 tokens against a step's milliseconds), which finds a
rollback whatever the caller did.
"""

from __future__ import annotations

from typing import Sequence

from hsd_opt.drafters.base import TokenDrafter, check_proposal, check_settings

#: The longest query an n-gram drafter keeps an index for (each length one index, rebuilt per sequence).
MAX_Q = 64


class ContextNgramDrafter(TokenDrafter):
    """The N-Grammys context matcher (Sec. 4.2).

    Args:
        q: query length (last q context tokens), backing off down to ``min_q``.
        w: default continuation length for :meth:`propose_batch` callers that use ``self.w`` (the runtime
           passes ``n``/``w`` explicitly; ``w`` is recorded in :meth:`config`).
        min_q: shortest query tried when backing off.
        max_occurrences: most recent occurrences scanned per query length.
        abstain: propose nothing (``[]``) instead of falling back when no query of length >= ``min_q`` matches.
    """

    kind = "ngram_context"

    def __init__(self, q: int = 2, w: int = 4, min_q: int = 1, max_occurrences: int = 512, name: str = "ngram",
                 abstain: bool = False):
        check_settings(ints={"q": (q, 1, MAX_Q), "w": (w, 1, None), "min_q": (min_q, 1, None),
                             "max_occurrences": (max_occurrences, 1, None)}, flags={"abstain": abstain})
        if min_q > q:
            raise ValueError(f"need 1 <= min_q <= q, got q={q}, min_q={min_q}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.q, self.w, self.min_q, self.max_occurrences = int(q), int(w), int(min_q), int(max_occurrences)
        self.name = name
        self.abstain = self.may_abstain = bool(abstain)
        self._seq: list[int] = []
        self._pos: dict[int, dict[tuple, list[int]]] = {qq: {} for qq in range(1, self.q + 1)}

    # ---- index maintenance ---------------------------------------------------------------------------
    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._seq = []
        self._pos = {qq: {} for qq in range(1, self.q + 1)}
        self._sync(prompt_ids)

    def observe(self, context: Sequence[int], accepted: Sequence[int]) -> None:
        self._sync(list(context) + list(accepted))

    def _append(self, tok: int) -> None:
        seq = self._seq
        seq.append(int(tok))
        i = len(seq)  # a continuation may start at position i, after the gram seq[i-q:i]
        for qq in range(1, self.q + 1):
            if i >= qq:
                self._pos[qq].setdefault(tuple(seq[i - qq:i]), []).append(i)

    def _pop(self) -> None:
        seq = self._seq
        i = len(seq)
        for qq in range(1, self.q + 1):
            if i >= qq:
                key = tuple(seq[i - qq:i])
                lst = self._pos[qq][key]
                lst.pop()  # i is the largest registered position for this key
                if not lst:
                    del self._pos[qq][key]
        seq.pop()

    def _sync(self, context: Sequence[int]) -> None:
        """Make the index describe exactly ``context`` (common prefix kept, tail popped / appended)."""
        ctx = context if isinstance(context, list) else list(context)
        seq = self._seq
        n = min(len(seq), len(ctx))
        if seq[:n] == ctx[:n]:
            m = n
        else:  # find the first divergence (rare: rollbacks)
            m = 0
            while m < n and seq[m] == ctx[m]:
                m += 1
        while len(seq) > m:
            self._pop()
        for t in ctx[m:]:
            self._append(t)

    # ---- matching ------------------------------------------------------------------------------------
    def _ranked(self, qq: int, w: int) -> list[tuple[int, ...]]:
        """Distinct full continuations of length w of the last qq tokens, ranked (count desc, recency desc)."""
        seq = self._seq
        L = len(seq)
        if L < qq:
            return []
        occ = self._pos[qq].get(tuple(seq[L - qq:]))
        if not occ:
            return []
        stats: dict[tuple, list[int]] = {}  # cont -> [count, last position]
        scanned = 0
        for i in reversed(occ):
            if i + w > L:  # continuation not complete inside the context (includes the query itself)
                continue
            cont = tuple(seq[i:i + w])
            s = stats.get(cont)
            if s is None:
                stats[cont] = [1, i]
            else:
                s[0] += 1
            scanned += 1
            if scanned >= self.max_occurrences:
                break
        return sorted(stats, key=lambda c: (-stats[c][0], -stats[c][1]))

    def candidates(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        """Up to ``k`` distinct continuations of ``w`` tokens, longest query first, each level ranked."""
        self._sync(context)
        out: list[list[int]] = []
        seen: set[tuple] = set()
        for qq in range(self.q, self.min_q - 1, -1):
            for c in self._ranked(qq, w):
                if c not in seen:
                    seen.add(c)
                    out.append(list(c))
                    if len(out) >= k:
                        return out
        return out

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        check_proposal(n)
        if n <= 0:
            return []
        top = self.candidates(context, 1, n)
        if top:
            return top[0]
        if self.abstain:
            return []
        # fallback: chain one-token predictions on the virtually extended context
        base_len = len(self._seq)
        out: list[int] = []
        last = self._seq[-1] if self._seq else 0
        try:
            for _ in range(n):
                nxt = None
                for qq in range(self.q, self.min_q - 1, -1):
                    r = self._ranked(qq, 1)
                    if r:
                        nxt = r[0][0]
                        break
                if nxt is None:
                    nxt = last
                out.append(nxt)
                last = nxt
                self._append(nxt)
        finally:
            while len(self._seq) > base_len:
                self._pop()
        return out

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        check_proposal(w, k, "w")
        rows = self.candidates(context, k, w)
        if len(rows) < k:
            pad = self.propose(context, w)
            rows += [list(pad) for _ in range(k - len(rows))]
        return rows

    def config(self) -> dict:
        return {"kind": self.kind, "name": self.name, "q": self.q, "w": self.w, "min_q": self.min_q,
                "max_occurrences": self.max_occurrences, "abstain": self.abstain}
