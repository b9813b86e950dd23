"""The ADED drafter ("Adaptive Draft-Verification for Efficient Large Language Model Decoding", arXiv
2407.12021): an adaptive tri-gram matrix and an MCTS draft maker. See ``docs/design.md#token-drafters``.

* :class:`TrigramMatrix` — Eq. (1): ``P(c | a, b) = C(a, b, c) / C(a, b)`` counted over a corpus of token
  sequences. Tri-grams seen fewer than ``threshold`` times are dropped (the appendix's "threshold for the
  elimination of tri-gram probability", 12 there on corpora of 10^5-10^6 conversations; OCR/ambiguity choice:
  we read it as a minimum COUNT and default to 2 because our default corpus is the target's own generations on
  a small prompt suite). The denominator ``C(a, b)`` counts every occurrence of the pair followed by any token,
  before thresholding, as Eq. (1) states. Stored as ``{(a, b): {c: p}}``; saved as ``.npz`` (arrays a, b, c, p).

* :meth:`TrigramMatrix.adjust` — appendix Algorithm 2, literally: over the last ``max_length`` tokens, every
  tri-gram's value becomes ``min(p + increment, max_prob)`` if present, else ``increment``. The paper gives no
  values for ``increment`` / ``max_prob``; we default to 0.1 / 1.0. :class:`AdedDrafter` applies it in
  ``observe`` to the tri-grams ENDING in the accepted tokens (``context[-2:] + accepted``, in windows of
  ``max_length`` tokens when they are more), so each occurrence raises its tri-gram once, and in ``reset`` to the
  prompt's last ``max_length`` tokens.

* :class:`MctsDraftMaker` — appendix Algorithm 1 with PUCT (Eq. 2) and exploration weight (Eq. 3)::

      PUCT(s, a) = Q(s, a) + E * P(s, a) * sqrt(sum_b N(s, b)) / (1 + N(s, a))
      E          = c1 + log((sum_b N(s, b) + c2 + 1) / c2)

  Defaults from the appendix: 150 iterations, c1 = 32, c2 = 8, depth 4, 24 candidates. Choices (paper silent or
  OCR-ambiguous): a node's state is its last two tokens; ``P(s, a)`` is the matrix value normalised over the
  node's candidate children (only the ``max_children`` most likely, default 16, are expanded, to bound the
  cost); ``Q = score_sum / visits`` (0 for unvisited); expansion creates all children at once and continues
  from the most likely new one (the paper's ``children.last()``); selection descends while the node is fully
  expanded and has children and the depth is not reached; simulation samples next tokens from the matrix
  (seeded RNG, so a search is deterministic for a seed and matrix); the rollout score is
  ``1 + sum_i P(t_i | t_{i-2}, t_{i-1})`` over the drafted tokens. Candidates ("sentences") are the visited
  nodes none of whose children were visited, ranked by accumulated score (ties: visits, then token ids),
  extended greedily (matrix argmax) to the full depth where the tree stopped early; candidates that stay
  shorter than the depth (the support has a dead end) are ranked after all full-depth ones.

* Backoff (not in the paper, on by default, ``backoff=False`` disables it): when the pair ``(a, b)`` is unknown,
  the candidates of ``b`` merged over all known pairs ``(*, b)`` are used.

Fallback of :class:`AdedDrafter`: when the search finds nothing (or a shorter chain), the draft is padded by
repeating its last token (or the last context token).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from hsd_opt.drafters.base import TokenDrafter, check_proposal, check_settings, read_npz_table
from hsd_opt.errors import InputFileError
from hsd_opt.jsonio import atomic_write
from hsd_opt.seeds import SEED_STRIDE

MATRIX_FORMAT = "hsd-trigram/1"


class TrigramMatrix:
    """Sparse tri-gram conditional probabilities ``P(c | a, b)`` (Eq. 1), adaptively updated (Algorithm 2)."""

    def __init__(self, table: dict[tuple[int, int], dict[int, float]] | None = None, meta: dict | None = None,
                 backoff: bool = True):
        self.table: dict[tuple[int, int], dict[int, float]] = table or {}
        self.meta = dict(meta or {})
        self.backoff = backoff
        self.path: str | None = None
        self.version = 0  # bumped by every update (caches key on it)
        self._by_last: dict[int, set[int]] = {}
        for a, b in self.table:
            self._by_last.setdefault(b, set()).add(a)
        self._sorted: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
        self._merged: dict[int, tuple[list[int], list[float]]] = {}
        self._shared: set[tuple[int, int]] = set()   # rows this matrix shares with the one it was forked from

    def fork(self) -> "TrigramMatrix":
        """A matrix for one sequence: the same probabilities, its own adaptation (:meth:`adjust` copies a shared row
        before changing it, in the fork and in this matrix alike), so that what one sequence teaches it reaches no
        other and the saved matrix never grows. O(rows) to make; the rows themselves are copied only when
        adjusted."""
        new = copy.copy(self)
        new.table = dict(self.table)
        new._shared = set(self.table)
        self._shared = set(self.table)       # this matrix's own changes must not reach the fork either
        new._by_last = {b: set(a) for b, a in self._by_last.items()}
        new._sorted, new._merged = dict(self._sorted), dict(self._merged)
        return new

    # ---- building / IO ------------------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, seqs: Iterable[Sequence[int]], threshold: int = 2, backoff: bool = True) -> "TrigramMatrix":
        """Count tri-grams of every sequence, keep those with ``count >= threshold``, Eq. (1) probabilities."""
        tri: Counter = Counter()
        pair: Counter = Counter()
        n_seq = n_tok = 0
        for s in seqs:
            s = [int(t) for t in s]
            n_seq += 1
            n_tok += len(s)
            for i in range(2, len(s)):
                tri[(s[i - 2], s[i - 1], s[i])] += 1
                pair[(s[i - 2], s[i - 1])] += 1
        table: dict[tuple[int, int], dict[int, float]] = {}
        for (a, b, c), n in tri.items():
            if n >= threshold:
                table.setdefault((a, b), {})[c] = n / pair[(a, b)]
        meta = {"threshold": threshold, "sequences": n_seq, "tokens": n_tok, "trigrams_seen": len(tri),
                "trigrams_kept": sum(len(v) for v in table.values())}
        return cls(table, meta, backoff)

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

    def largest_id(self) -> int | None:
        """The largest token id the matrix may draft (a tri-gram's last token; None: an empty matrix)."""
        return max((c for d in self.table.values() for c in d), default=None)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``.npz`` with int32 arrays ``a, b, c``, float32 ``p`` and a JSON ``meta`` string (atomic)."""
        path = Path(path)
        rows = [(a, b, c, p) for (a, b), d in self.table.items() for c, p in d.items()]
        arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
        atomic_write(path, lambda f: np.savez(
            f, a=arr[:, 0].astype(np.int32), b=arr[:, 1].astype(np.int32), c=arr[:, 2].astype(np.int32),
            p=arr[:, 3].astype(np.float32), meta=np.array(json.dumps({"format": MATRIX_FORMAT, **self.meta}))))
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, backoff: bool = True) -> "TrigramMatrix":
        z, meta = read_npz_table(path, "tri-gram matrix", MATRIX_FORMAT, ("a", "b", "c", "p"), ids=("a", "b", "c"))
        _check_arrays(path, z)
        a, b, c, p = (z[k].tolist() for k in ("a", "b", "c", "p"))
        meta.pop("format", None)
        table: dict[tuple[int, int], dict[int, float]] = {}
        for ai, bi, ci, pi in zip(a, b, c, p):
            table.setdefault((ai, bi), {})[ci] = float(pi)
        m = cls(table, meta, backoff)
        m.path = str(path)
        return m

    # ---- lookups -----------------------------------------------------------------------------------
    def get(self, a: int, b: int, c: int) -> float:
        """Matrix value of ``(a, b, c)``; 0.0 when absent."""
        d = self.table.get((a, b))
        return d.get(c, 0.0) if d else 0.0

    def candidates(self, a: int, b: int) -> tuple[list[int], list[float]]:
        """Next tokens after ``(a, b)`` and their values, most likely first (ties: lower id). Backoff if enabled."""
        key = (a, b)
        hit = self._sorted.get(key)
        if hit is not None:
            return hit
        d = self.table.get(key)
        if d:
            items = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))
            hit = ([c for c, _ in items], [p for _, p in items])
            self._sorted[key] = hit
            return hit
        if not self.backoff:
            return [], []
        hit = self._merged.get(b)
        if hit is None:
            acc: dict[int, float] = {}
            for a2 in self._by_last.get(b, ()):
                for c, p in self.table[(a2, b)].items():
                    acc[c] = acc.get(c, 0.0) + p
            items = sorted(acc.items(), key=lambda kv: (-kv[1], kv[0]))
            hit = ([c for c, _ in items], [p for _, p in items])
            self._merged[b] = hit
        return hit

    # ---- Algorithm 2 --------------------------------------------------------------------------------
    def adjust(self, tokens: Sequence[int], max_length: int, increment: float = 0.1, max_prob: float = 1.0) -> int:
        """Appendix Algorithm 2 on the last ``max_length`` tokens; returns the number of tri-grams touched."""
        n = len(tokens)
        sub = [int(t) for t in tokens[max(0, n - max_length):n]]
        touched = 0
        for i in range(2, len(sub)):
            a, b, c = sub[i - 2], sub[i - 1], sub[i]
            d = self.table.get((a, b))
            if d is None:
                d = self.table[(a, b)] = {}
                self._by_last.setdefault(b, set()).add(a)
            elif (a, b) in self._shared:         # the matrix it was forked from still reads this row
                d = self.table[(a, b)] = dict(d)
                self._shared.discard((a, b))
            cur = d.get(c)
            d[c] = increment if cur is None else min(cur + increment, max_prob)
            self._sorted.pop((a, b), None)
            self._merged.pop(b, None)
            touched += 1
        if touched:
            self.version += 1
        return touched


def _check_arrays(path, z: dict) -> None:
    """The arrays of a saved matrix, each one-dimensional and of one length, token ids >= 0 and values in [0, 1]:
    :class:`InputFileError` naming ``path`` and the array otherwise (a damaged file read as valid drafted ids the
    target refuses, or crashed a search on a NaN)."""
    n = len(z["p"]) if np.ndim(z["p"]) == 1 else -1
    for k in ("a", "b", "c", "p"):
        if np.ndim(z[k]) != 1 or len(z[k]) != n:
            raise InputFileError(str(path), f"arrays a, b, c and p of one length expected, got shapes "
                                            f"{', '.join(str(np.shape(z[x])) for x in 'abcp')}", k)
        if k != "p" and n and int(np.min(z[k])) < 0:
            raise InputFileError(str(path), f"token ids >= 0 expected, got {int(np.min(z[k]))}", k)
    if n and not (np.isfinite(z["p"]).all() and 0 <= float(np.min(z["p"])) and float(np.max(z["p"])) <= 1):
        raise InputFileError(str(path), "values in [0, 1] expected (a NaN, an infinity or a value out of range)",
                             "p")


class _Node:
    __slots__ = ("p_word", "word", "parent", "children", "untried", "prior", "visits", "score")

    def __init__(self, p_word: int, word: int, parent, prior: float):
        self.p_word, self.word, self.parent, self.prior = p_word, word, parent, prior
        self.children: list[_Node] = []
        self.untried: tuple[list[int], list[float]] | None = None  # filled lazily: (tokens, priors)
        self.visits = 0
        self.score = 0.0


class MctsDraftMaker:
    """Appendix Algorithm 1 (see module docstring for the choices). ``search`` returns ranked continuations."""

    def __init__(self, matrix: TrigramMatrix, iterations: int = 150, c1: float = 32.0, c2: float = 8.0,
                 depth: int = 4, n_candidates: int = 24, max_children: int = 16, seed: int = 0):
        self.matrix, self.iterations, self.c1, self.c2 = matrix, int(iterations), float(c1), float(c2)
        self.depth, self.n_candidates = int(depth), int(n_candidates)
        self.max_children, self.seed = int(max_children), int(seed)

    def _untried(self, a: int, b: int) -> tuple[list[int], list[float]]:
        toks, vals = self.matrix.candidates(a, b)
        toks, vals = toks[: self.max_children], vals[: self.max_children]
        tot = sum(vals)
        return toks, ([v / tot for v in vals] if tot > 0 else vals)

    def _select(self, node: _Node) -> _Node:
        total = sum(ch.visits for ch in node.children)
        e = self.c1 + math.log((total + self.c2 + 1.0) / self.c2)
        sq = math.sqrt(total)
        best, best_v = None, -math.inf
        for ch in node.children:
            q = ch.score / ch.visits if ch.visits else 0.0
            v = q + e * ch.prior * sq / (1.0 + ch.visits)
            if v > best_v:  # ties: the earlier (more likely) child
                best, best_v = ch, v
        return best

    def search(self, a: int, b: int, depth: int | None = None,
               iterations: int | None = None) -> list[tuple[list[int], float]]:
        """Ranked ``(tokens, score)`` continuations after the context tail ``(a, b)``, each ``<= depth`` long.

        Every token follows the matrix support (or its backoff). Empty list when ``(a, b)`` has no successor.
        """
        depth = self.depth if depth is None else int(depth)
        iters = self.iterations if iterations is None else int(iterations)
        m = self.matrix
        rng = random.Random((self.seed * SEED_STRIDE + int(a)) * SEED_STRIDE + int(b))
        root = _Node(int(a), int(b), None, 1.0)
        root.untried = self._untried(root.p_word, root.word)
        if not root.untried[0] or depth <= 0:
            return []
        for _ in range(iters):
            node, d = root, 0
            # selection: descend while the node is expanded (has children) and the depth is not reached
            while node.children and d < depth:
                node = self._select(node)
                d += 1
            if node.untried is None:  # not yet looked up (children get their untried words lazily)
                node.untried = self._untried(node.p_word, node.word) if d < depth else ([], [])
            # expansion: all untried words at once, continue from the most likely new child
            if node.untried[0] and d < depth:
                toks, priors = node.untried
                node.untried = ([], [])
                for t, p in zip(toks, priors):
                    node.children.append(_Node(node.word, t, node, p))
                node = node.children[0]
                d += 1
            # the drafted path root -> node
            path = []
            n = node
            while n.parent is not None:
                path.append(n.word)
                n = n.parent
            path.reverse()
            hist = [root.p_word, root.word] + path
            # simulation
            while len(hist) - 2 < depth:
                toks, vals = m.candidates(hist[-2], hist[-1])
                if not toks:
                    break
                toks, vals = toks[: self.max_children], vals[: self.max_children]
                hist.append(rng.choices(toks, weights=vals)[0] if sum(vals) > 0 else toks[0])
            # score: 1 + sum of matrix values along the drafted tokens
            score = 1.0
            for i in range(2, len(hist)):
                score += m.get(hist[i - 2], hist[i - 1], hist[i])
            # backpropagation
            n = node
            while n is not None:
                n.visits += 1
                n.score += score
                n = n.parent
        return self._extract(root, depth)

    def _extract(self, root: _Node, depth: int) -> list[tuple[list[int], float]]:
        frontier: list[tuple[float, int, list[int]]] = []
        stack = [(root, [])]
        while stack:
            node, path = stack.pop()
            visited = [ch for ch in node.children if ch.visits > 0]
            if visited:
                for ch in visited:
                    stack.append((ch, path + [ch.word]))
            elif node is not root:
                frontier.append((node.score, node.visits, path))
        frontier.sort(key=lambda t: (-t[0], -t[1], t[2]))
        out: list[tuple[list[int], float]] = []
        seen: set[tuple] = set()
        for score, _, path in frontier:
            full = list(path)
            hist = [root.p_word, root.word] + full
            while len(full) < depth:  # greedy completion inside the matrix support
                toks, _ = self.matrix.candidates(hist[-2], hist[-1])
                if not toks:
                    break
                full.append(toks[0])
                hist.append(toks[0])
            key = tuple(full)
            if key not in seen:
                seen.add(key)
                out.append((full, score))
        # full-depth candidates first (a shorter one hit a dead end of the support), stable otherwise
        out.sort(key=lambda t: len(t[0]) < depth)
        return out[: self.n_candidates]


#: The most MCTS iterations a draft may take (each a walk of the tree: 10^5 takes seconds a draft).
MAX_ITERATIONS = 100_000


class AdedDrafter(TokenDrafter):
    """ADED as a drafter: MCTS over the adaptive tri-gram matrix; single draft = best candidate, batch = top k.

    The search depth is the requested length (``n`` or ``w``); ``depth`` is the default recorded in the config.
    ``observe`` applies Algorithm 2 (when ``adapt``) within a sequence: each :meth:`fork` (a generation, a
    request) adapts a copy of the matrix it was built with (:meth:`TrigramMatrix.fork`), so nothing one request
    teaches it reaches the next, and a long-running server's matrix does not grow.
    """

    kind = "aded"

    def __init__(self, matrix: TrigramMatrix | str | os.PathLike, iterations: int = 150, c1: float = 32.0,
                 c2: float = 8.0, depth: int = 4, n_candidates: int = 24, max_children: int = 16, seed: int = 0,
                 adapt: bool = True, increment: float = 0.1, max_prob: float = 1.0, max_length: int = 64,
                 backoff: bool = True, name: str = "aded"):
        check_settings(ints={"iterations": (iterations, 1, MAX_ITERATIONS), "depth": (depth, 1, None),
                             "n_candidates": (n_candidates, 1, None), "max_children": (max_children, 1, None),
                             "max_length": (max_length, 3, None), "seed": (seed, 0, None)},
                       reals={"c1": (c1, 0.0, math.inf, False), "c2": (c2, 0.0, math.inf, True),
                              "increment": (increment, 0.0, 1.0, False), "max_prob": (max_prob, 0.0, 1.0, True)},
                       flags={"adapt": adapt, "backoff": backoff})
        self.matrix = matrix if isinstance(matrix, TrigramMatrix) else TrigramMatrix.load(matrix, backoff=backoff)
        self.matrix.backoff = backoff
        self.maker = MctsDraftMaker(self.matrix, iterations, c1, c2, depth, n_candidates, max_children, seed)
        self.adapt, self.increment = adapt, float(increment)
        self.max_prob, self.max_length = float(max_prob), int(max_length)
        self.name = name
        self._memo: tuple | None = None

    def largest_id(self) -> int | None:
        return self.matrix.largest_id()

    def fork(self) -> "AdedDrafter":
        """A drafter for another sequence, adapting its own copy of the matrix (see the class doc)."""
        new = copy.copy(self)
        new.matrix = self.matrix.fork()
        new.maker = copy.copy(self.maker)
        new.maker.matrix = new.matrix
        new._memo = None
        return new

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._memo = None
        if self.adapt and len(prompt_ids) >= 3:
            self.matrix.adjust(list(prompt_ids), self.max_length, self.increment, self.max_prob)

    def observe(self, context: Sequence[int], accepted: Sequence[int]) -> None:
        """Raise every tri-gram that ends in one of ``accepted`` (the tokens after ``context``), in order: in
        windows of ``max_length`` tokens overlapping by two, so a drafter taken on mid-sequence and given the whole
        history at once adapts as one given it round by round (one call's ``adjust`` reads its last
        ``max_length`` tokens only)."""
        if self.adapt and accepted:
            tail = list(context[-2:]) + list(accepted)
            for start in range(0, len(tail) - 2, self.max_length - 2):
                self.matrix.adjust(tail[start:start + self.max_length], self.max_length, self.increment,
                                   self.max_prob)

    def _ranked(self, context: Sequence[int], w: int) -> list[list[int]]:
        a = int(context[-2]) if len(context) >= 2 else -1
        b = int(context[-1]) if len(context) >= 1 else -1
        key = (a, b, w, self.matrix.version)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        rows = [toks for toks, _ in self.maker.search(a, b, depth=w)] if b >= 0 else []
        self._memo = (key, rows)
        return rows

    @staticmethod
    def _pad(row: list[int], n: int, last: int) -> list[int]:
        row = list(row[:n])
        fill = row[-1] if row else last
        return row + [fill] * (n - len(row))

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        check_proposal(n)
        if n <= 0:
            return []
        rows = self._ranked(context, n)
        last = int(context[-1]) if len(context) else 0
        return self._pad(rows[0] if rows else [], n, last)

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        check_proposal(w, k, "w")
        rows = self._ranked(context, w)[:k]
        last = int(context[-1]) if len(context) else 0
        out = [self._pad(r, w, last) for r in rows] or [self._pad([], w, last)]
        while len(out) < k:
            out.append(list(out[-1]))
        return out

    def config(self) -> dict:
        mk = self.maker
        return {"kind": self.kind, "name": self.name, "matrix": self.matrix.path, "iterations": mk.iterations,
                "c1": mk.c1, "c2": mk.c2, "depth": mk.depth, "n_candidates": mk.n_candidates,
                "max_children": mk.max_children, "seed": mk.seed, "adapt": self.adapt, "increment": self.increment,
                "max_prob": self.max_prob, "max_length": self.max_length, "backoff": self.matrix.backoff}
