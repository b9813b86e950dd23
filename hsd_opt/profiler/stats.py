"""Streaming pairwise acceptance statistics that merge exactly (sums of sums).

For every pair of drafters the profiler accumulates, per task type of the prompt suite:

- ``sum``   = sum over positions of the per-position acceptance ``a = sum_x min(p_i(x), p_j(x))``
  (for a token drafter with proposal ``y``: ``a = p_j(y)``),
- ``sumsq`` = sum of ``a**2`` (for the variance, hence the confidence interval),
- ``agree`` = number of positions where the greedy choices agree (``argmax p_i == argmax p_j``; for a token
  drafter ``y == argmax p_j``),
- ``count`` = number of positions (for a token drafter that may abstain: of the positions where it proposed;
  the share of those is its ``draft_rate``, :meth:`PairStats.proposals` over its ``propose_calls``).

Neural drafters (early exits, draft models, the target: anything with a distribution) form a symmetric
relation — ``sum_x min(p_i, p_j)`` and argmax agreement do not depend on which one drafts — so one entry per
unordered pair is stored (``nn[:, :, i, j]`` with ``i < j`` in :attr:`PairStats.neural` order). Token drafters
(``tn[:, :, t, j]``) only ever draft. Everything is float64 and additive: two shards' statistics merge by
adding arrays, which is what :meth:`PairStats.merge`, ``hsd profile merge`` and the torch.distributed
all-reduce do.

The 95% confidence interval is the normal approximation ``mean ± 1.96 sqrt(var / n)`` over positions. Positions
of one continuation are correlated, so it is optimistic; treat it as a lower bound on the uncertainty.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

SUM, SUMSQ, AGREE, COUNT = range(4)
Z95 = 1.959963984540054


class PairStats:
    """Additive statistics for ``neural`` x ``neural`` (unordered) and ``token`` x ``neural`` pairs per task.

    Attributes:
        neural: names of drafters with distributions (exits, draft models, target), fixed order.
        token: names of token drafters.
        tasks: task types (fixed order).
        nn: ``[4, n_tasks, N, N]`` float64 (SUM, SUMSQ, AGREE, COUNT); only ``i < j`` is used.
        tn: ``[4, n_tasks, T, N]`` float64.
        counters: named additive counters (prompts, tokens, token-drafter seconds, ...).
    """

    def __init__(self, neural: Sequence[str], token: Sequence[str], tasks: Sequence[str],
                 counters: Iterable[str] = ()):
        self.neural = list(neural)
        self.token = list(token)
        self.tasks = list(tasks)
        n, t, k = len(self.neural), len(self.token), len(self.tasks)
        self.nn = np.zeros((4, k, n, n), dtype=np.float64)
        self.tn = np.zeros((4, k, t, n), dtype=np.float64)
        self.counters: dict[str, float] = {c: 0.0 for c in counters}

    # ------------------------------------------------------------------------------------ accumulate

    def task_index(self, task: str) -> int:
        return self.tasks.index(task)

    def add_neural(self, task: str, acc: np.ndarray, agree: np.ndarray) -> None:
        """Add per-position values: ``acc``/``agree`` ``[N, N, m]`` (only ``i < j`` read)."""
        k = self.task_index(task)
        iu = np.triu_indices(len(self.neural), 1)
        a = np.asarray(acc, dtype=np.float64)[iu]
        g = np.asarray(agree, dtype=np.float64)[iu]
        self.nn[SUM, k][iu] += a.sum(-1)
        self.nn[SUMSQ, k][iu] += (a * a).sum(-1)
        self.nn[AGREE, k][iu] += g.sum(-1)
        self.nn[COUNT, k][iu] += a.shape[-1]

    def add_token(self, task: str, acc: np.ndarray, agree: np.ndarray) -> None:
        """Add per-position values of token drafters: ``acc``/``agree`` ``[T, N, m]``; ``acc`` NaN marks a
        position where the drafter proposed nothing (it abstained), which is not counted."""
        k = self.task_index(task)
        a = np.asarray(acc, dtype=np.float64)
        seen = ~np.isnan(a)
        a = np.where(seen, a, 0.0)
        g = np.where(seen, np.asarray(agree, dtype=np.float64), 0.0)
        self.tn[SUM, k] += a.sum(-1)
        self.tn[SUMSQ, k] += (a * a).sum(-1)
        self.tn[AGREE, k] += g.sum(-1)
        self.tn[COUNT, k] += seen.sum(-1)

    def proposals(self, token: str, task: str | None = None) -> float:
        """Positions where token drafter ``token`` proposed (all tasks, or one task)."""
        if not self.neural:
            return 0.0
        sel = slice(None) if task is None else self.task_index(task)
        return float(self.tn[COUNT, sel, self.token.index(token), 0].sum())

    def count(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + float(value)

    # ------------------------------------------------------------------------------------ combine

    def merge(self, other: "PairStats") -> "PairStats":
        """A new PairStats with the sums of both (tasks and counters: the union). Drafter names must match."""
        if self.neural != other.neural or self.token != other.token:
            raise ValueError(f"cannot merge statistics of different drafter pools: {self.neural + self.token} "
                             f"vs {other.neural + other.token}")
        tasks = sorted(set(self.tasks) | set(other.tasks))
        out = PairStats(self.neural, self.token, tasks, sorted(set(self.counters) | set(other.counters)))
        for src in (self, other):
            for k, t in enumerate(src.tasks):
                kk = tasks.index(t)
                out.nn[:, kk] += src.nn[:, k]
                out.tn[:, kk] += src.tn[:, k]
            for c, v in src.counters.items():
                out.counters[c] += v
        return out

    def flat(self) -> np.ndarray:
        """All sums as one float64 vector (for an all-reduce); :meth:`load_flat` is the inverse."""
        keys = sorted(self.counters)
        return np.concatenate([self.nn.ravel(), self.tn.ravel(), np.array([self.counters[k] for k in keys])])

    def load_flat(self, v: np.ndarray) -> None:
        v = np.asarray(v, dtype=np.float64)
        a, b = self.nn.size, self.tn.size
        self.nn = v[:a].reshape(self.nn.shape).copy()
        self.tn = v[a:a + b].reshape(self.tn.shape).copy()
        for i, k in enumerate(sorted(self.counters)):
            self.counters[k] = float(v[a + b + i])

    # ------------------------------------------------------------------------------------ results

    def _cell(self, drafter: str, verifier: str, task: str | None = None) -> np.ndarray | None:
        """``[4]`` sums for (drafter, verifier) over all tasks or one task; None if not a stored pair."""
        sel = slice(None) if task is None else self.task_index(task)
        if drafter in self.token and verifier in self.neural:
            x = self.tn[:, sel, self.token.index(drafter), self.neural.index(verifier)]
        elif drafter in self.neural and verifier in self.neural and drafter != verifier:
            i, j = sorted((self.neural.index(drafter), self.neural.index(verifier)))
            x = self.nn[:, sel, i, j]
        else:
            return None
        return x if task is not None else x.sum(axis=1)

    def acceptance(self, drafter: str, verifier: str, task: str | None = None) -> float | None:
        c = self._cell(drafter, verifier, task)
        if c is None or c[COUNT] <= 0:
            return None
        return float(min(1.0, max(0.0, c[SUM] / c[COUNT])))

    def agreement(self, drafter: str, verifier: str) -> float | None:
        c = self._cell(drafter, verifier)
        if c is None or c[COUNT] <= 0:
            return None
        return float(c[AGREE] / c[COUNT])

    def n(self, drafter: str, verifier: str) -> int:
        c = self._cell(drafter, verifier)
        return 0 if c is None else int(round(c[COUNT]))

    def ci95(self, drafter: str, verifier: str) -> list[float] | None:
        c = self._cell(drafter, verifier)
        if c is None or c[COUNT] <= 0:
            return None
        n = c[COUNT]
        if n < 2:                       # one position tells no spread: the interval is every rate
            return [0.0, 1.0]
        mean = c[SUM] / n
        var = max(0.0, c[SUMSQ] / n - mean * mean) * (n / (n - 1))
        h = Z95 * math.sqrt(var / n)
        return [float(max(0.0, mean - h)), float(min(1.0, mean + h))]

    # ------------------------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {"neural": self.neural, "token": self.token, "tasks": self.tasks,
                "nn": self.nn.tolist(), "tn": self.tn.tolist(), "counters": dict(sorted(self.counters.items()))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PairStats":
        """The statistics :meth:`to_dict` wrote; a ``ValueError`` (or ``KeyError``, ``TypeError``) for a dict that
        is not such: names repeated, arrays of other shapes, sums or counters negative or not finite."""
        s = cls(d["neural"], d["token"], d["tasks"], d.get("counters", {}).keys())
        for name in ("neural", "token", "tasks"):
            if len(set(getattr(s, name))) != len(getattr(s, name)):
                raise ValueError(f"{name} {getattr(s, name)} names one twice")
        nn = np.asarray(d["nn"], dtype=np.float64)
        tn = np.asarray(d["tn"], dtype=np.float64)
        if nn.shape != s.nn.shape or tn.size != s.tn.size or (tn.ndim == 4 and tn.shape != s.tn.shape):
            raise ValueError(f"statistics arrays of shape {nn.shape}/{tn.shape}, expected {s.nn.shape}/{s.tn.shape}")
        s.nn, s.tn = nn, tn.reshape(s.tn.shape)
        s.counters = {k: float(v) for k, v in d.get("counters", {}).items()}
        values = np.concatenate([s.nn.ravel(), s.tn.ravel(), np.array(list(s.counters.values()), dtype=np.float64)])
        if not np.isfinite(values).all() or (values < 0).any():
            raise ValueError("a sum or counter that is negative or not finite")
        return s
