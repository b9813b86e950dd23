"""Measured costs of a layered model's exits (seconds, wall time, median over repeats after warm-up).

Three things are measured on one :class:`~hsd_opt.engine.layered.LayeredLM` with a warm KV cache over a
context of ``context_len`` tokens:

1. a direct **step time** of a few exits (target, quartiles): append one token, ``advance(state, b)``
   (layers ``0 .. b-1`` on that token) and the exit head at ``b``; crop back; repeat; median. Kept as a check
   (``step_measured`` in the model entries) of the per-layer model, whose t = 1 value is the ``cost``.
2. **per-layer timings** ``layer[l][t]`` of decoder layer ``l`` on ``t`` new tokens (t = 1..tmax+1), plus
   ``base[t]`` (embedding + rotary tables) and ``head_b[t]`` (the exit head of boundary ``b`` on t rows; one
   shared timing when every exit uses the model's own final norm + LM head). These are the very calls
   ``advance`` makes, timed one by one.
   Each timing is made non-decreasing in t by an isotonic (least-squares) fit: dips are timing noise.
3. From (2), by summation (the **per-layer cost model**):

   - ``cost[b] = base[1] + sum_{l < b} layer[l][1] + head_b[1]``: one decode step of exit ``b`` (monotone in b);
   - ``cost_curve[b][t-1] = base[t] + sum_{l < b} layer[l][t] + head_b[t]``: one pass of exit ``b`` over t
     tokens (verifying t - 1 drafts plus the bonus token);
   - ``verify_cost[b][a][t-1] = base[t] + [t >= 2] sum_{l < a} layer[l][1] + sum_{a <= l < b} layer[l][t]
     + head_b[t]`` for exits ``a < b``: exit ``b`` verifying ``t - 1`` drafts of exit ``a`` with activation
     reuse. Drafting ran layers ``0 .. a-1`` on the token before the block and on every draft but the last
     (the drafter never feeds its own last draft back in), so the verify pass runs layers ``a .. b-1`` on all
     ``t`` positions and layers ``0 .. a-1`` on the last draft alone.

   Timing all ~n²/2 pairs directly would take minutes; the model needs n x (tmax+1) layer timings.
4. The **whole model** over t = 1..tmax+1 tokens, timed directly (``2 x repeats`` rounds: a draft model's step
   cost is multiplied by its budget in every round, so its noise matters most; each timed pass follows an
   untimed pass of the same size, as a drafter's passes do in the runtime): the cost curve (and step cost)
   of the last layer, i.e. of the target's verify pass and of a separate draft model, where per-layer sums underestimate
   long passes; the per-layer model's figures for it are kept as a check (``cost_model_check`` in the profile).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class LayerCosts:
    """Result of :func:`measure_costs` for one layered model (all seconds)."""

    step: dict[int, float]                      # boundary -> directly measured decode step (a few exits)
    layer: list[list[float]]                    # layer[l][t-1]
    base: list[float]                           # base[t-1]: embedding + rotary tables
    head: dict[int, list[float]]                # boundary -> head on t rows; key -1 = shared default head
    check: dict[str, Any] = field(default_factory=dict)
    full: list[float] | None = None             # full[t-1]: direct median of a whole-model pass over t tokens

    def head_t(self, b: int, t: int) -> float:
        return (self.head.get(b) or self.head[-1])[t - 1]

    def step_cost(self, b: int) -> float:
        """Seconds of one decode step (1 token, warm cache) of exit ``b``: the per-layer model at t = 1
        (monotone in ``b`` by construction, unlike direct timings of single steps on a noisy machine)."""
        return self.curve(b, 1)[0]

    def curve(self, b: int, tmax1: int) -> list[float]:
        """Seconds for exit ``b`` to run one pass over t = 1..tmax1 tokens: the direct measurement for the whole
        model (``b`` = every layer) when there is one, else the per-layer model."""
        if self._direct(b, tmax1):
            return list(self.full[:tmax1])
        return self._summed(b, tmax1)

    def _direct(self, b: int, tmax1: int) -> bool:
        """Whether exit ``b`` is the whole model and its pass was timed directly up to ``tmax1`` tokens."""
        return self.full is not None and b == len(self.layer) and len(self.full) >= tmax1

    def _summed(self, b: int, tmax1: int, a: int = 0) -> list[float]:
        """The per-layer model of a pass of exit ``b`` over t = 1..tmax1 tokens; with ``a > 0``, of the pass that
        verifies drafts of exit ``a`` (layers ``a .. b-1`` on all t positions, ``0 .. a-1`` on the last draft)."""
        lower = sum(self.layer[l][0] for l in range(a))
        return [self.base[t - 1] + (lower if t >= 2 else 0.0) + sum(self.layer[l][t - 1] for l in range(a, b))
                + self.head_t(b, t) for t in range(1, tmax1 + 1)]

    def verify_curve(self, a: int, b: int, tmax1: int) -> list[float]:
        """Seconds for exit ``b`` to verify over t tokens drafted by exit ``a < b`` (activation reuse): layers
        ``a .. b-1`` on all t positions, layers ``0 .. a-1`` on the last draft (t >= 2), the head on t rows. Into
        the whole model (``b`` = every layer) the sum is scaled to its direct measurement over t tokens."""
        out = self._summed(b, tmax1, a)
        if self._direct(b, tmax1):
            # calibrated: scaled by the whole model's directly measured / per-layer cost over the same t tokens
            out = [x * f / m for x, f, m in zip(out, self.full, self._summed(b, tmax1))]
        return out


def isotonic(xs: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``xs`` in least squares (pool adjacent violators).

    A pass over more tokens does not cost less; dips in measured medians are timing noise (large on a shared
    machine), and a solver fed them would pick budgets for a verify pass that only looked cheap."""
    blocks: list[list[float]] = []  # [mean, weight]
    for x in xs:
        blocks.append([float(x), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    out: list[float] = []
    for m, w in blocks:
        out.extend([m] * int(w))
    return out


def _ids(eng, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(4, eng.vocab_size - 1), (n,), generator=g)


@torch.no_grad()
def measure_costs(eng, boundaries: Sequence[int], tmax: int = 15, repeats: int = 5, warmup: int = 2,
                  curve_repeats: int = 3, context_len: int = 64, check: bool = True,
                  step_check: bool = True) -> LayerCosts:
    """Measure step costs of ``boundaries`` and per-layer timings for t = 1..tmax+1 (see the module doc)."""
    tmax1 = tmax + 1
    n_layers = eng.n_layers
    bs = sorted(set(boundaries))
    extra = max(tmax1, 1) + 2
    st = eng.new_state(context_len + extra, save_boundaries=bs)
    ctx = _ids(eng, context_len + extra)
    eng.append(st, ctx[:context_len])
    eng.advance(st, n_layers)
    n0 = st.n

    # 1. direct step cost of a few exits (the target and quartiles): a check of the per-layer model
    step: dict[int, float] = {}
    check_bs = sorted({bs[-1], bs[len(bs) // 4], bs[len(bs) // 2], bs[(3 * len(bs)) // 4]}) if step_check else []
    for b in check_bs:
        times = []
        for r in range(warmup + repeats):
            eng.append(st, ctx[n0:n0 + 1])
            t0 = _now()
            eng.advance(st, b)
            eng.logits(st, b, n0, n0 + 1)
            dt = _now() - t0
            eng.crop(st, n0)
            if r >= warmup:
                times.append(dt)
        step[b] = statistics.median(times)

    # 2. per-layer timings for t new tokens, the same calls advance() makes
    layer = [[0.0] * tmax1 for _ in range(n_layers)]
    base = [0.0] * tmax1
    head_keys = sorted(b for b in bs if b in eng.exit_heads) + [-1]
    head: dict[int, list[float]] = {k: [0.0] * tmax1 for k in head_keys}
    lt = [[[] for _ in range(n_layers)] for _ in range(tmax1)]
    bt: list[list[float]] = [[] for _ in range(tmax1)]
    ht = {k: [[] for _ in range(tmax1)] for k in head_keys}
    # rounds over every t (not all repeats of one t in a row): a slow spell of a shared machine then hits every
    # t alike instead of bending the curve; t = 1 (the step cost) gets extra rounds
    n_rounds = warmup + max(curve_repeats, repeats)
    for r in range(n_rounds):
        for t in range(1, tmax1 + 1):
            if r >= warmup + curve_repeats and t > 1:
                continue
            eng.append(st, ctx[n0:n0 + t])
            t0 = _now()
            x = eng.embed(st.tokens[n0:n0 + t])
            cos, sin = eng.rope(n0, n0 + t)
            t1 = _now()
            times = []
            for l in range(n_layers):
                a = _now()
                x = eng.run_layers(l, l + 1, x, st, n0, cos, sin)
                times.append(_now() - a)
            hts = {}
            for k in head_keys:
                a = _now()
                eng.head(x, k)
                hts[k] = _now() - a
            eng.crop(st, n0)
            if r >= warmup:
                bt[t - 1].append(t1 - t0)
                for l in range(n_layers):
                    lt[t - 1][l].append(times[l])
                for k in head_keys:
                    ht[k][t - 1].append(hts[k])
    for t in range(1, tmax1 + 1):
        base[t - 1] = statistics.median(bt[t - 1])
        for l in range(n_layers):
            layer[l][t - 1] = statistics.median(lt[t - 1][l])
        for k in head_keys:
            head[k][t - 1] = statistics.median(ht[k][t - 1])
    layer = [isotonic(row) for row in layer]
    base = isotonic(base)
    head = {k: isotonic(v) for k, v in head.items()}
    lc = LayerCosts(step, layer, base, head)

    # 3. the whole model over t tokens, measured directly for every t: its cost curve (what a verify pass of the
    #    target or of another model costs) and a check of the per-layer model. Summed per-layer medians miss
    #    effects of the whole pass (cache traffic between layers), most of all on long passes.
    if check:
        ft: list[list[float]] = [[] for _ in range(tmax1)]
        for r in range(warmup + max(2 * repeats, curve_repeats, 3)):
            for t in range(1, tmax1 + 1):                  # rounds over every t, as above
                for _ in range(2):                         # a pass of the same size first, untimed: a drafter's
                    eng.append(st, ctx[n0:n0 + t])         # passes come in runs of one size (its budget, or
                    t0 = _now()                            # T_below + 1 when it verifies); right after a long
                    eng.advance(st, n_layers)              # pass, a short pass measures slow
                    eng.logits(st, n_layers, n0, n0 + t)
                    dt = _now() - t0
                    eng.crop(st, n0)
                if r >= warmup:
                    ft[t - 1].append(dt)
        full = [statistics.median(x) for x in ft]
        modelled = lc._summed(n_layers, tmax1)
        lc.full = isotonic(full)
        pick = sorted({1, max(1, tmax1 // 2), tmax1})
        lc.check = {"boundary": n_layers, "measured": {str(t): full[t - 1] for t in pick},
                    "modelled": {str(t): modelled[t - 1] for t in pick}}
    return lc


def time_token_drafter(drafter, contexts: Sequence[Sequence[int]], repeats: int = 3) -> float:
    """Median seconds of ``propose(context, 1)`` over a few contexts (fallback when no timing was gathered)."""
    times = []
    for _ in range(repeats):
        for c in contexts:
            drafter.reset(list(c[: max(1, len(c) // 2)]))
            t0 = time.perf_counter()
            drafter.propose(list(c), 1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 1e-6
