"""Measured costs of a layered model's exits at several context lengths (seconds, wall time, medians over repeats
after warm-up); `docs/design.md#the-cost-model`.

Everything is timed through the engine's public API, the calls the runtime makes: ``new_state``, ``append``,
``advance``, ``logits``, ``crop`` (and a token drafter's ``propose``), so whatever path the engine takes inside is
what gets timed. For each context length ``c`` (tokens already in the KV cache) one decoding state is prefilled
with ``c`` tokens (a quantized copy of the target takes the target's keys and values instead, as the runtime's
shared prompt cache does); then, on ``t`` new tokens:

1. a direct **step time** of a few exits (target, quartiles) at the first context: append one token,
   ``advance(state, b)``, ``logits`` at ``b``; crop back; median. Kept as a check (``step_measured``).
2. **segment timings** ``seg[b][t]``: append t tokens, then ``advance(state, b)`` for every exit boundary ``b`` in
   increasing order, each call timed on its own (it runs layers ``b_prev .. b-1`` on the t positions; the first
   also the embedding), then ``logits`` of each distinct exit head on t rows (``head[b][t]``; one shared timing
   when the exits use the model's own final norm and LM head). Rounds go over every context and every t (not all
   repeats of one in a row), so a slow spell of a shared machine hits them alike. The first context is timed at
   every t = 1..tmax+1; the others on a grid of t (1, 2, 4, ..., tmax+1), their difference to the first context
   interpolated linearly in t in between (attention over the cache adds a smooth amount per position; the
   shape of the curve over t, steps where kernels change tiles, is the first context's).
3. the **whole model** over t = 1..tmax+1 tokens, timed directly at the first context (``2 x repeats`` rounds,
   each timed pass right after an untimed pass of the same size, as a drafter's passes come): the cost curve of
   the last layer, i.e. of the target's verify pass and of a separate draft model or quantized copy. At another
   context it is the first context's plus the sum of the segments' differences.
4. From these, per context (:class:`LayerCosts`): ``curve(b)``, one pass of exit ``b`` over t tokens, is the sum
   of the segments up to ``b`` plus its head; ``verify_curve(a, b)``, exit ``b`` verifying drafts of exit ``a < b``
   (activation reuse: the drafting ran layers ``0 .. a-1`` on every draft but the last), the segments above ``a``
   on t positions, those up to ``a`` on one, and the head. Every sum is scaled at each t by the whole model's
   direct timing over its own sum: each segment was one ``advance`` call, so a sum over k segments pays the call's
   fixed work k times where the runtime's one call pays it once (and misses effects of a whole pass).

Every timing series is made non-decreasing in t by an isotonic least-squares fit (dips are noise), and
:func:`monotone_in_context` makes the figures non-decreasing in the context as well.

How much of this is timed is a :class:`CostPlan` (`docs/design.md#the-cost-budget`): ``full`` is the scheme
above; ``grid`` and ``coarse`` time the whole model directly on the grid of t only, its curve elsewhere the
segment sum scaled by the interpolated ratio of the two, refined with direct timings where that ratio moves
(:func:`refine_sizes`). :func:`calibrate` times an engine briefly, :func:`estimate_seconds` prices a plan with
that, and :func:`choose_plan` takes the most thorough plan that fits a budget in seconds. Only the longest context
is prefilled; the shorter ones copy its first keys and values.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hsd_opt.engine.layered import pass_output
from hsd_opt.engine.timing import median_pass, now, time_pass
from hsd_opt.errors import HsdError
from hsd_opt.prompts import text_of_length
from hsd_opt.runtime.decode import PREFILL_CHUNK  # prompts are prefilled in the passes decoding uses


def fit_contexts(contexts: Sequence[int], max_positions: int | None, tmax: int) -> list[int]:
    """The contexts that fit in ``max_positions`` (the model's) with a pass of ``tmax + 1`` tokens after them:
    longer ones are lowered to the longest that fits (then duplicates dropped), sorted."""
    if not max_positions:
        return sorted(set(int(c) for c in contexts))
    cap = int(max_positions) - (int(tmax) + 2)
    if cap < 1:
        raise HsdError(f"--tmax {tmax}: a pass over tmax + 1 tokens does not fit in the model's {max_positions} "
                       f"positions")
    return sorted({min(int(c), cap) for c in contexts})


def t_grid(tmax1: int) -> list[int]:
    """Pass sizes timed at the contexts after the first: 1, 2, 4, ... up to ``tmax1``, and ``tmax1``."""
    out, t = [], 1
    while t < tmax1:
        out.append(t)
        t *= 2
    return out + [tmax1]


@dataclass
class LayerCosts:
    """The timings of one layered model at one context (all seconds), and the cost model built on them.

    Attributes:
        context: tokens in the KV cache when the passes ran.
        n_layers: the model's decoder layers (the boundary of the whole model).
        seg: boundary ``b`` -> ``[s_1, ..., s_tmax1]``: ``advance`` to ``b`` right after the previous boundary,
            on t new tokens (the first boundary's also embeds them).
        head: boundary -> exit head (``logits``) on t rows; key -1: the shared head of exits without their own.
        full: the whole model's pass over t tokens, timed directly (None: not timed).
        step: boundary -> a directly timed decode step of that exit (a check; first context only).
        check: the whole model's direct timings against the sum of its segments at a few t (first context only).
    """

    context: int
    n_layers: int
    seg: dict[int, list[float]]
    head: dict[int, list[float]]
    full: list[float] | None = None
    step: dict[int, float] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)

    def head_t(self, b: int, t: int) -> float:
        return (self.head.get(b) or self.head[-1])[t - 1]

    def step_cost(self, b: int) -> float:
        """Seconds of one decode step (1 token, warm cache) of exit ``b``: its curve at t = 1."""
        return self.curve(b, 1)[0]

    def summed(self, b: int, tmax1: int, a: int = 0) -> list[float]:
        """The segment sum of a pass of exit ``b`` over t = 1..tmax1 tokens; with ``a > 0`` (a boundary), of the
        pass that verifies drafts of exit ``a``: segments above ``a`` on t positions, those up to ``a`` on the
        last draft only (t >= 2), and the head of ``b`` on t rows. Unscaled (see :meth:`curve`)."""
        lower = sum(s[0] for k, s in self.seg.items() if k <= a)
        return [(lower if t >= 2 else 0.0) + sum(s[t - 1] for k, s in self.seg.items() if a < k <= b)
                + self.head_t(b, t) for t in range(1, tmax1 + 1)]

    def _scale(self, tmax1: int) -> list[float]:
        """Per t: the whole model's direct timing over the sum of its segments (1 without a direct timing)."""
        if self.full is None or len(self.full) < tmax1 or self.n_layers not in self.seg:
            return [1.0] * tmax1
        return [f / s if s > 0 else 1.0 for f, s in zip(self.full, self.summed(self.n_layers, tmax1))]

    def curve(self, b: int, tmax1: int) -> list[float]:
        """Seconds for exit ``b`` to run one pass over t = 1..tmax1 tokens: the direct timing for the whole model,
        else the segment sum scaled to it."""
        if b == self.n_layers and self.full is not None and len(self.full) >= tmax1:
            return list(self.full[:tmax1])
        return [x * f for x, f in zip(self.summed(b, tmax1), self._scale(tmax1))]

    def verify_curve(self, a: int, b: int, tmax1: int) -> list[float]:
        """Seconds for exit ``b`` to verify over t tokens drafted by exit ``a < b`` (activation reuse), scaled like
        :meth:`curve`; never more than that full pass (the sums differ only in their order of addition when the
        lower segments cost the same on one position as on t)."""
        full = self.curve(b, tmax1)
        return [min(x * f, c) for x, f, c in zip(self.summed(b, tmax1, a), self._scale(tmax1), full)]


def isotonic(xs: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``xs`` in least squares (pool adjacent violators).

    A pass over more tokens (or at a longer context) does not cost less; dips in measured medians are timing
    noise (large on a shared machine), and a solver fed them would pick budgets for a pass that only looked
    cheap."""
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


def monotone_in_context(curves: Sequence[Sequence[float]]) -> list[list[float]]:
    """``curves[k]`` (seconds over t = 1..n at the k-th context, increasing contexts) made non-decreasing in t,
    then at every t non-decreasing in the context. The second fit keeps the first: isotonic regression is
    order-preserving (``x <= y`` pointwise gives ``fit(x) <= fit(y)``), so columns that were ordered stay so."""
    rows = [isotonic(c) for c in curves]
    if not rows:
        return []
    cols = [isotonic([r[t] for r in rows]) for t in range(len(rows[0]))]
    return [[cols[t][k] for t in range(len(cols))] for k in range(len(rows))]


def _ids(eng, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(4, eng.vocab_size - 1), (n,), generator=g)


@dataclass(frozen=True)
class CostPlan:
    """How many timings the cost phase takes per engine (`docs/design.md#the-cost-budget`).

    Attributes:
        level: ``"full"``, ``"grid"`` or ``"coarse"`` (:data:`PLAN_LEVELS`, most timings first).
        warmup: untimed rounds before the timed ones (segments, direct timings, step checks).
        repeats: timed rounds at t = 1 (the step cost; medians) and of the step checks; the whole model's direct
            timings take ``warmup + max(2 * repeats, curve_repeats, 3)`` rounds.
        curve_repeats: timed rounds over every pass size t (segment timings).
        seg_every_t: segments at the first context timed at every t = 1..tmax+1 (else on :func:`t_grid`, the
            others interpolated linearly in t).
        direct_every_t: the whole model timed directly at every t (else on :func:`t_grid`, and at the t between
            two grid points too where the per-layer model's scale, direct / segment sum, moves by more than
            ``refine_tol`` between them; elsewhere the segment sum times the interpolated scale).
        refine_tol: relative change of that scale between neighbouring grid points that asks for direct timings
            in between.
    """

    level: str = "full"
    warmup: int = 2
    repeats: int = 5
    curve_repeats: int = 2
    seg_every_t: bool = True
    direct_every_t: bool = True
    refine_tol: float = 0.05

    @property
    def direct_rounds(self) -> int:
        """Rounds of direct whole-model timings (warm-up included)."""
        return self.warmup + max(2 * self.repeats, self.curve_repeats, 3)

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "warmup": self.warmup, "repeats": self.repeats,
                "curve_repeats": self.curve_repeats, "seg_every_t": self.seg_every_t,
                "direct_every_t": self.direct_every_t, "refine_tol": self.refine_tol}


#: The cost plans from most to fewest timings; :func:`choose_plan` takes the first that fits the budget.
PLAN_LEVELS = ("full", "grid", "coarse")


def cost_plan(level: str, repeats: int = 5, warmup: int = 2, curve_repeats: int = 2) -> CostPlan:
    """The plan of ``level`` from the configured repeats (``--cost-repeats``): ``full`` as configured (every t,
    timed directly too); ``grid`` times the whole model directly on the grid of t only (refined where the
    per-layer model does not predict it), with at most 3 repeats and 1 warm-up round; ``coarse`` also times the
    segments at the first context on the grid, with 2 repeats and 1 round over every t."""
    repeats, warmup, curve_repeats = max(1, int(repeats)), max(0, int(warmup)), max(1, int(curve_repeats))
    if level == "full":
        return CostPlan("full", warmup, repeats, curve_repeats, True, True)
    if level == "grid":
        return CostPlan("grid", min(warmup, 1), min(repeats, 3), min(curve_repeats, 2), True, False)
    if level == "coarse":
        return CostPlan("coarse", min(warmup, 1), min(repeats, 2), 1, False, False)
    raise HsdError(f"unknown cost plan {level!r} (expected one of {', '.join(PLAN_LEVELS)})")


@dataclass
class Calibration:
    """Quick timings of one engine that price a cost plan (:func:`calibrate`; seconds).

    Attributes:
        prefill_token: seconds per prompt token of a prefill.
        step: one pass over 1 token at a short context.
        pass_max: one pass over ``t_max`` tokens.
        t_max: the largest pass size timed (tmax + 1).
    """

    prefill_token: float
    step: float
    pass_max: float
    t_max: int

    def pass_seconds(self, t: int) -> float:
        """A pass over ``t`` tokens, linear between the two timed sizes."""
        if self.t_max <= 1:
            return self.step
        return self.step + max(0.0, self.pass_max - self.step) * (t - 1) / (self.t_max - 1)


@torch.no_grad()
def calibrate(eng, tmax: int, tokens: int = 96, greedy: bool = True,
              text: Sequence[int] | None = None) -> Calibration:
    """Time a prefill of ``tokens`` tokens and one pass over 1 and over ``tmax + 1`` tokens after it (each right
    after an untimed pass of the same size): what :func:`estimate_seconds` prices a cost plan with. A few
    seconds on a 1.5B model on a CPU. ``greedy``, ``text``: as in :func:`measure_costs`."""
    tmax1 = tmax + 1
    n_ids = tokens + tmax1 + 1
    ids = torch.tensor(text_of_length(text, n_ids)) if text else _ids(eng, n_ids, seed=1)
    st = eng.new_state(tokens + tmax1 + 1)
    eng.append(st, ids[:tokens])
    a = now()
    eng.advance(st, eng.n_layers)
    prefill = (now() - a) / tokens
    out = {}
    for t in (1, tmax1):
        for _ in range(2):
            out[t] = time_pass(eng, [(st, ids[tokens:tokens + t])], eng.n_layers, greedy=greedy)
    return Calibration(max(prefill, 1e-9), max(out[1], 1e-9), max(out[tmax1], 1e-9), tmax1)


def plan_passes(plan: CostPlan, contexts: Sequence[int], n_boundaries: int, tmax: int, check: bool = True,
                step_check: bool = True) -> dict[str, dict[int, int]]:
    """The passes :func:`measure_costs` runs under ``plan`` (refinements aside), by phase and pass size t:
    ``{"steps": {1: n}, "segments": {t: n}, "direct": {t: n}}``; a direct timing counts twice (the untimed pass
    of the same size before it)."""
    tmax1 = tmax + 1
    grid = t_grid(tmax1)
    k = len(set(contexts))
    steps = {1: len(_check_boundaries(list(range(n_boundaries)))) * (plan.warmup + plan.repeats)} if step_check \
        else {}
    seg: dict[int, int] = {}
    t0 = list(range(1, tmax1 + 1)) if plan.seg_every_t else grid
    for r in range(plan.warmup + max(plan.curve_repeats, plan.repeats)):
        if r >= plan.warmup + plan.curve_repeats:
            seg[1] = seg.get(1, 0) + k
            continue
        for t in t0 + grid * (k - 1):
            seg[t] = seg.get(t, 0) + 1
    direct: dict[int, int] = {}
    if check:
        for t in (range(1, tmax1 + 1) if plan.direct_every_t else grid):
            direct[t] = 2 * plan.direct_rounds
    return {"steps": steps, "segments": seg, "direct": direct}


def estimate_seconds(plan: CostPlan, calib: Calibration, contexts: Sequence[int], n_boundaries: int, tmax: int,
                     shared: bool = False) -> float:
    """Seconds :func:`measure_costs` is expected to take for one engine under ``plan`` (refinements aside): its
    prefill (the longest context; none when shared) and every pass :func:`plan_passes` lists, priced with
    ``calib``."""
    prefill = 0.0 if shared else max(contexts) * calib.prefill_token
    n = plan_passes(plan, contexts, n_boundaries, tmax)
    return prefill + sum(calib.pass_seconds(t) * c for phase in n.values() for t, c in phase.items())


def choose_plan(budget: float | None, engines: Sequence[tuple[Calibration, int, bool]], contexts: Sequence[int],
                tmax: int, repeats: int, warmup: int, curve_repeats: int) -> tuple[CostPlan, float]:
    """``(plan, estimated seconds)``: the first plan of :data:`PLAN_LEVELS` whose estimate over ``engines``
    (``(calibration, exit boundaries, shares its prompt)`` each) fits ``budget`` seconds, else the last; None:
    no budget, the full plan."""
    for level in PLAN_LEVELS:
        plan = cost_plan(level, repeats, warmup, curve_repeats)
        est = sum(estimate_seconds(plan, c, contexts, nb, tmax, sh) for c, nb, sh in engines)
        if budget is None or est <= budget:
            break
    return plan, est


def _prefill(eng, st, ids: torch.Tensor, n: int, step: Callable[[str], None], share=None,
             chunk: int = PREFILL_CHUNK) -> None:
    """Fill ``st`` with the first ``n`` of ``ids`` through every layer, ``chunk`` tokens per call; or, with
    ``share = (source engine, its state holding the same n tokens)``, as the runtime prefills a copy of the
    source's model: the source's keys and values (``share_prompt``), then the last position (one ``advance``)."""
    if share is not None:
        eng.append(st, ids[:n])
        eng.share_prompt(st, share[0], share[1], eng.n_layers)
        eng.advance(st, eng.n_layers)
        step(f"prefill {n}/{n} tokens (shared)")
        return
    for s in range(0, n, chunk):
        eng.append(st, ids[s: min(n, s + chunk)])
        eng.advance(st, eng.n_layers)
        step(f"prefill {min(n, s + chunk)}/{n} tokens")


def _prefix(eng, st, src, ids: torch.Tensor, n: int) -> None:
    """Fill ``st`` with the first ``n`` of ``ids`` by copying them from ``src``, a state of the same engine that
    holds a longer prefill of the same ids (causal attention: the first ``n`` keys and values of a longer
    prompt are those of its first ``n`` tokens)."""
    eng.append(st, ids[:n])
    for layer in range(eng.n_layers):
        st.k[layer][:, :, :n] = src.k[layer][:, :, :n]
        st.v[layer][:, :, :n] = src.v[layer][:, :, :n]
    st.lens = [n] * eng.n_layers


def _kept_at(eng, src, ids: torch.Tensor, n: int, b: int):
    """A state of ``src``'s size holding the first ``n`` of ``ids`` (copied from ``src``, :func:`_prefix`) that
    keeps the residual of exit ``b`` alone (none below the whole model): its passes to ``b`` run as one run of
    layers."""
    st = eng.new_state(src.max_len, save_boundaries=[b] if b < eng.n_layers else [])
    _prefix(eng, st, src, ids, n)
    return st


def _time_segments(eng, st, ids: torch.Tensor, bs: Sequence[int], heads: dict[int, int], t: int,
                   greedy: bool = True):
    """One pass over ``t`` new tokens as segments: ``({b: seconds of advance to b}, {key: seconds of the head})``.
    ``heads`` maps a head key to the boundary whose head (:func:`pass_output`) times it. The state is cropped
    back after."""
    output = pass_output(eng, greedy)
    n0 = st.n
    eng.append(st, ids[n0:n0 + t])
    seg = {}
    for b in bs:
        a = now()
        eng.advance(st, b)
        seg[b] = now() - a
    hd = {}
    for k, b in heads.items():
        a = now()
        output(st, b, n0, n0 + t)
        hd[k] = now() - a
    eng.crop(st, n0)
    return seg, hd


def _head_keys(eng, bs: Sequence[int]) -> dict[int, int]:
    """Head key -> the boundary to time it at: each boundary with its own trained head, and -1 (the model's own
    final norm and LM head, shared by the other exits) at the last boundary without one."""
    own = getattr(eng, "exit_heads", {}) or {}
    keys = {b: b for b in bs if b in own}
    shared = [b for b in bs if b not in own]
    if shared:
        keys[-1] = shared[-1]
    return keys


def _check_boundaries(bs: Sequence[int]) -> list[int]:
    """The exits whose step is timed directly as a check: the last and the quartiles."""
    return sorted({bs[-1], bs[len(bs) // 4], bs[len(bs) // 2], bs[(3 * len(bs)) // 4]})


def _median_rows(samples: dict, tmax1: int) -> dict[int, list[float]]:
    """``{key: {t: [seconds, ...]}}`` -> ``{key: [median at t = 1..tmax1]}``, linear in t between the t that
    were timed (a row timed on a grid of t)."""
    out = {}
    for k, v in samples.items():
        ts = sorted(t for t in v if v[t])
        med = [statistics.median(v[t]) for t in ts]
        out[k] = [float(x) for x in np.interp(np.arange(1, tmax1 + 1), ts, med)] if ts else [float("nan")] * tmax1
    return out


def _shifted(base_fit: list[float], base_raw: list[float], raw: list[float], grid: list[int]) -> list[float]:
    """``base_fit`` plus the difference ``raw - base_raw`` measured on ``grid`` (t values), interpolated in t."""
    xs = np.array(grid, dtype=float)
    diff = np.array([raw[t - 1] - base_raw[t - 1] for t in grid])
    ts = np.arange(1, len(base_fit) + 1, dtype=float)
    return [max(1e-12, b + d) for b, d in zip(base_fit, np.interp(ts, xs, diff))]


def refine_sizes(scale: dict[int, float], tol: float, cost: Callable[[int], float] | None = None,
                 allowance: float | None = None) -> list[int]:
    """The t between neighbouring timed sizes (keys of ``scale``: the whole model's direct timing over its
    segment sum) whose scales differ by more than ``tol`` (relative): there the per-layer model does not predict
    the whole pass, so it is timed directly. With ``allowance`` (seconds) and ``cost(t)`` (seconds to time size
    t), the gaps with the largest change first, as long as their sizes fit the allowance together."""
    ts = sorted(scale)
    gaps = [(abs(scale[b] / scale[a] - 1.0), list(range(a + 1, b))) for a, b in zip(ts, ts[1:])
            if b - a > 1 and abs(scale[b] / scale[a] - 1.0) > tol]
    out: list[int] = []
    left = allowance
    for _, sizes in sorted(gaps, key=lambda g: -g[0]):
        need = sum(cost(t) for t in sizes) if cost is not None else 0.0
        if left is not None and need > left:
            continue
        out.extend(sizes)
        left = None if left is None else left - need
    return sorted(out)


@torch.no_grad()
def _context_states(eng, ids: torch.Tensor, ctxs: list[int], bs: list[int], tmax1: int, share_from, chunk: int,
                    calib: Calibration, step_cb: Callable[[str, float], None]) -> list:
    """A state per context of ``ctxs`` (room for a pass of ``tmax1`` tokens after it, the exits ``bs`` kept):
    the longest prefilled (``chunk`` tokens a call) or, for a copy, filled from ``share_from``'s keys and values;
    the shorter ones its prefixes."""
    states = [eng.new_state(c + tmax1 + 1, save_boundaries=bs) for c in ctxs]
    for k in reversed(range(len(ctxs))):          # the longest first: the others are its prefixes
        c = ctxs[k]
        if share_from is not None:
            _prefill(eng, states[k], ids, c, lambda s, c=c: step_cb(f"context {c}: {s}", calib.step),
                     share=(share_from[0], share_from[1][c]))
        elif k == len(ctxs) - 1:
            _prefill(eng, states[k], ids, c, lambda s, c=c: step_cb(f"context {c}: {s}",
                                                                   calib.prefill_token * min(chunk, c)),
                     chunk=chunk)
        else:
            _prefix(eng, states[k], states[-1], ids, c)
            step_cb(f"context {c}: prefill {c}/{c} tokens (prefix of {ctxs[-1]})", calib.step)
    return states


def _direct_check(eng, base, ids: torch.Tensor, n0: int, first: "LayerCosts", tmax1: int, grid: list[int],
                  plan: CostPlan, warmup: int, calib: Calibration, context: int,
                  step_cb: Callable[[str, float], None], on_extend, refine_seconds: float | None,
                  greedy: bool) -> None:
    """Step 3 of :func:`measure_costs`: the whole model over t tokens, timed directly at the first context, into
    ``first.full`` (its cost curve) and ``first.check`` (measured against the segment sums)."""
    n_layers, n_direct = eng.n_layers, plan.direct_rounds
    whole = _kept_at(eng, base, ids, n0, n_layers)
    modelled = first.summed(n_layers, tmax1) if n_layers in first.seg else [float("nan")] * tmax1

    def direct_cb(m: str, x: float) -> None:
        step_cb(f"context {context}: {m}", x)

    timed = _time_direct(eng, whole, ids, list(range(1, tmax1 + 1)) if plan.direct_every_t else grid,
                         n_direct, warmup, calib, direct_cb, greedy)
    scale = {t: timed[t] / modelled[t - 1] for t in timed if modelled[t - 1] > 0}
    more = [] if plan.direct_every_t or len(scale) < len(timed) else refine_sizes(
        scale, plan.refine_tol, lambda t: 2 * n_direct * calib.pass_seconds(t), refine_seconds)
    if more:
        if on_extend is not None:
            on_extend(len(more) * n_direct, sum(2 * n_direct * calib.pass_seconds(t) for t in more))
        timed.update(_time_direct(eng, whole, ids, more, n_direct, warmup, calib, direct_cb, greedy))
        scale.update({t: timed[t] / modelled[t - 1] for t in more})
    ts = sorted(timed)
    if len(scale) == len(timed):
        s_t = np.interp(np.arange(1, tmax1 + 1), ts, [scale[t] for t in ts])
        full = [timed[t] if t in timed else modelled[t - 1] * float(s_t[t - 1]) for t in range(1, tmax1 + 1)]
    else:
        full = [float(x) for x in np.interp(np.arange(1, tmax1 + 1), ts, [timed[t] for t in ts])]
    first.full = isotonic(full)
    pick = sorted({1, max(1, tmax1 // 2), tmax1} & set(ts))
    first.check = {"boundary": n_layers, "context": context, "timed_t": ts,
                   "measured": {str(t): timed[t] for t in pick},
                   "modelled": {str(t): modelled[t - 1] for t in pick}}


def measure_costs(eng, boundaries: Sequence[int], tmax: int = 15, repeats: int = 5, warmup: int = 2,
                  curve_repeats: int = 3, contexts: Sequence[int] = (64,), check: bool = True,
                  step_check: bool = True, on_step: Callable[..., None] | None = None,
                  keep_states: dict | None = None, share_from=None, plan: CostPlan | None = None,
                  calib: Calibration | None = None, on_extend: Callable[[int, float], None] | None = None,
                  chunk: int = PREFILL_CHUNK, refine_seconds: float | None = None,
                  greedy: bool = True, text: Sequence[int] | None = None) -> list[LayerCosts]:
    """Time the exits ``boundaries`` of ``eng`` at every context of ``contexts`` (see the module doc): one
    :class:`LayerCosts` per context, in increasing context order. ``on_step(message, seconds)`` is called after
    every prefill chunk, direct step check and timed pass size (``seconds``:
    what ``calib`` expects the step to take): a progress bar moves at least every few seconds. ``plan``
    (default: the full plan of ``repeats``, ``warmup`` and ``curve_repeats``) says what is timed; a refinement of
    the direct timings first calls ``on_extend(steps, seconds)`` with what it adds (at most every t off the grid,
    all direct rounds, and within ``refine_seconds`` as ``calib`` prices them; None: no limit).

    Only the longest context is prefilled (``chunk`` tokens per call); the shorter ones copy its first keys and
    values. ``keep_states``: a dict that receives this engine's prefilled states by context. ``share_from =
    (engine, {context: state})``, such states of the engine over the model's own weights, for an engine that is
    a copy of it (``can_share_prompt``): its contexts are filled from those keys and values, as the runtime
    does, instead of prefilled. ``greedy``: passes end as greedy decoding's do (:func:`pass_output`), else with
    the logits sampling needs. ``text``: token ids the timed passes read (repeated to length; default random
    ids): real text, because how peaked the head's distributions are decides what a greedy head reads."""
    plan = plan or CostPlan("full", max(0, warmup), max(1, repeats), max(1, curve_repeats))
    calib = calib or Calibration(1.0, 1.0, 1.0, 1)
    step_cb = on_step or (lambda msg, seconds: None)
    warmup = plan.warmup
    tmax1 = tmax + 1
    n_layers = eng.n_layers
    bs = sorted(set(boundaries))
    ctxs = sorted(set(int(c) for c in contexts))
    grid = t_grid(tmax1)
    n_ids = ctxs[-1] + tmax1 + 1
    ids = torch.tensor(text_of_length(text, n_ids)) if text else _ids(eng, n_ids)
    states = _context_states(eng, ids, ctxs, bs, tmax1, share_from, chunk, calib, step_cb)
    if keep_states is not None:
        keep_states.update(zip(ctxs, states))
    base = states[0]
    n0 = base.n

    # 1. direct step cost of a few exits (the target and quartiles): a check of the segment model
    step = _exit_steps(eng, base, ids, _check_boundaries(bs) if step_check else [], plan, calib, ctxs[0], step_cb,
                       greedy)

    # 2. segment timings, in rounds over every context and t; t = 1 (the step cost) gets extra rounds
    seg_s, head_s = _segment_samples(eng, states, ids, bs, ctxs, plan, tmax1, calib, step_cb, greedy)
    raw = [_median_rows(s, tmax1) for s in seg_s]
    seg0 = {b: isotonic(v) for b, v in raw[0].items()}
    head = {h: isotonic(v) for h, v in _median_rows(head_s, tmax1).items()}
    out = [LayerCosts(ctxs[0], n_layers, seg0, head, step=step)]

    # 3. the whole model over t tokens, timed directly at the first context: its cost curve (what a verify pass
    #    of the target or of another model costs) and the scale of the segment sums. Under a budget on the grid
    #    of t, and in between where the scale moves (there the per-layer model does not predict the pass). On a
    #    state that keeps no exit's residual: one run of every layer, as the runtime's target computes a pass
    #    when no exit of it drafts (the segments' state stops at every exit, each stop a call of its own)
    if check:
        _direct_check(eng, base, ids, n0, out[0], tmax1, grid, plan, warmup, calib, ctxs[0], step_cb, on_extend,
                      refine_seconds, greedy)

    # 4. the other contexts: the first context's curves plus the measured difference, interpolated over t
    for k in range(1, len(ctxs)):
        out.append(_shifted_context(out[0], raw[0], raw[k], ctxs[k], grid))
    return out


def _exit_steps(eng, base, ids: torch.Tensor, exits: Sequence[int], plan: CostPlan, calib: Calibration, ctx: int,
                step_cb: Callable[[str, float], None], greedy: bool) -> dict[int, float]:
    """Median seconds of one decode step of each exit of ``exits`` at the first context (``ctx`` tokens, the state
    ``base``), each on a state that keeps only that exit's residual, as the runtime's does (an advance stops at
    every kept boundary)."""
    step: dict[int, float] = {}
    n0 = base.n
    for b in exits:
        one = _kept_at(eng, base, ids, n0, b)
        step[b] = median_pass(eng, [(one, ids[n0:n0 + 1])], b, plan.repeats, plan.warmup, greedy=greedy)
        step_cb(f"context {ctx}: step of exit {b}", calib.step * (plan.warmup + plan.repeats))
    return step


def _segment_samples(eng, states: list, ids: torch.Tensor, bs: list[int], ctxs: list[int], plan: CostPlan,
                     tmax1: int, calib: Calibration, step_cb: Callable[[str, float], None], greedy: bool):
    """The segments' timings (seconds), in rounds over every context's state and t (every t of the grid, at the
    first context every t with ``plan.seg_every_t``; t = 1, the step, gets extra rounds), warm-up rounds dropped:
    ``(per context {boundary: {t: samples}}, {head key: {t: samples}})``, the heads timed at the first context."""
    warmup, repeats, curve_repeats = plan.warmup, plan.repeats, plan.curve_repeats
    grid = t_grid(tmax1)
    heads = _head_keys(eng, bs)
    seg_s = [{b: {} for b in bs} for _ in ctxs]
    head_s: dict[int, dict[int, list[float]]] = {k: {} for k in heads}
    n_rounds = warmup + max(curve_repeats, repeats)
    t0s = list(range(1, tmax1 + 1)) if plan.seg_every_t else grid
    for r in range(n_rounds):
        for k, st in enumerate(states):
            ts = [1] if r >= warmup + curve_repeats else t0s if k == 0 else grid
            for t in ts:
                seg, hd = _time_segments(eng, st, ids, bs, heads if k == 0 else {}, t, greedy)
                if r >= warmup:
                    for b, x in seg.items():
                        seg_s[k][b].setdefault(t, []).append(x)
                    for h, x in hd.items():
                        head_s[h].setdefault(t, []).append(x)
                step_cb(f"context {ctxs[k]}: round {r + 1}/{n_rounds}, t = {t}", calib.pass_seconds(t))
    return seg_s, head_s


def _shifted_context(first: LayerCosts, raw0: dict[int, list[float]], raw: dict[int, list[float]], ctx: int,
                     grid: list[int]) -> LayerCosts:
    """The costs at another context (``ctx`` tokens): the first context's curves (``first``; ``raw0`` its
    segments' medians) plus the difference measured there (``raw``), interpolated over t; the heads' costs and
    the whole model's curve carried over (the latter with the segments' difference added)."""
    seg0 = first.seg
    seg = {b: isotonic(_shifted(seg0[b], raw0[b], raw[b], grid)) for b in seg0}
    full_k = None
    if first.full is not None:
        extra = [sum(seg[b][t] - seg0[b][t] for b in seg0) for t in range(len(first.full))]
        full_k = isotonic([max(1e-12, f + x) for f, x in zip(first.full, extra)])
    return LayerCosts(ctx, first.n_layers, seg, first.head, full_k)


def _time_direct(eng, st, ids: torch.Tensor, ts: Sequence[int], rounds: int, warmup: int, calib: Calibration,
                 step: Callable[[str, float], None], greedy: bool = True) -> dict[int, float]:
    """Median seconds of the whole model's pass over each ``t`` of ``ts`` (``rounds`` rounds over every t, the
    first ``warmup`` untimed), each timed pass right after an untimed pass of the same size: a drafter's passes
    come in runs of one size (its budget, or T_below + 1 when it verifies), and right after a long pass a short
    pass measures slow."""
    n0, n = st.n, eng.n_layers
    times: dict[int, list[float]] = {t: [] for t in ts}
    for r in range(rounds):
        for t in ts:
            for _ in range(2):
                dt = time_pass(eng, [(st, ids[n0:n0 + t])], n, greedy=greedy)
            if r >= warmup:
                times[t].append(dt)
            step(f"whole model, round {r + 1}/{rounds}, t = {t}", 2 * calib.pass_seconds(t))
    return {t: statistics.median(v) for t, v in times.items()}


def time_token_drafter(make: Callable[[], Any], stream: Sequence[int], context: int, positions: int = 16) -> float:
    """Mean seconds of one ``propose(context, 1)`` of a token drafter at context lengths ``context ..
    context + positions - 1`` of ``stream`` (token ids of real text; repeated when shorter), fed as at run time:
    ``reset`` with the first ``context`` tokens, then at each position one ``propose`` (a second call on the same
    context could hit the drafter's memo) and ``observe`` of the next token. ``make()`` returns the drafter in its
    initial state."""
    text = text_of_length(stream, context + positions + 1)
    d = make()
    d.reset(text[:context])
    total = 0.0
    for j in range(positions):
        ctx = text[:context + j]
        t0 = time.perf_counter()
        d.propose(ctx, 1)
        total += time.perf_counter() - t0
        d.observe(ctx, [text[context + j]])
    return max(1e-9, total / positions)


def time_sampling(logits: torch.Tensor, temperature: float, top_p: float, tmax1: int, repeats: int = 15,
                  seed: int = 0, top_k: int = 0, min_p: float = 0.0) -> list[float]:
    """Seconds the runtime spends, under sampling, on the distributions of one pass over ``t = 1 .. tmax1`` tokens
    beyond the pass itself: :func:`~hsd_opt.runtime.sampling.process_logits` on its ``t`` rows of logits (temperature,
    then top-k, top-p, min-p) and one :func:`~hsd_opt.runtime.sampling.sample_token` (a draft, a correction or a
    bonus token).

    ``logits`` ``[n, V]`` are real rows (the target's, over profiled text): how far top-p has to look depends on
    how peaked they are. Timed at ``t = 1`` and ``t = tmax1`` (median over ``repeats``, each on other rows), linear
    in ``t`` in between; returns ``tmax1`` values, non-decreasing. A greedy pass takes an argmax, which the pass's
    own timing already holds: callers add this only when ``temperature > 0``."""
    from hsd_opt.runtime.sampling import process_logits, sample_token

    n = logits.shape[0]
    g = torch.Generator(device=logits.device).manual_seed(seed)

    def once(t: int, k: int) -> float:
        rows = logits[(torch.arange(t) + k * t) % n]
        t0 = time.perf_counter()
        p = process_logits(rows, temperature, top_p, top_k, min_p)
        sample_token(p[-1], g)
        return time.perf_counter() - t0

    ends = []
    for t in (1, tmax1):
        once(t, 0)
        ends.append(statistics.median(once(t, k + 1) for k in range(repeats)))
    if tmax1 == 1:
        return [ends[0]]
    slope = (ends[1] - ends[0]) / (tmax1 - 1)
    return isotonic([max(1e-9, ends[0] + slope * (t - 1)) for t in range(1, tmax1 + 1)])


def time_draw_saving(eng, text: Sequence[int], temperature: float, tmax1: int, repeats: int = 9,
                     seed: int = 0) -> list[float]:
    """Seconds the target's sampled pass over ``t = 1 .. tmax1`` tokens saves when it ends in draws by noise
    (:meth:`~hsd_opt.runtime.decode.Decoding._draws_by_picks`: the target alone, or over a token drafter, at top-p
    1) instead of in distributions: the read of its ``t`` rows of logits, their processing and one draw (what the
    pass costs beyond its layers in a profile made with a temperature), minus ``picks_many`` over the same rows and
    a draw from each of them (every row drawn: a verification draws fewer, past a rejection none). Timed as
    :func:`_pass_saving` times (``eng``: the target's engine, ``picks_cheaply``). Negative where the draws cost
    more."""
    from hsd_opt.runtime.sampling import gumbel_offsets, process_logits, sample_token

    def full(read, g) -> None:
        sample_token(process_logits(eng.logits_many([read])[0], temperature, 1.0)[-1], g)

    def drawn(read, g) -> None:
        picks = eng.picks_many([read])[0]
        for i in range(picks.rows):
            picks.pick(i, gumbel_offsets(eng.vocab_size, g, temperature, eng.device))

    return _pass_saving(eng, text, tmax1, full, drawn, repeats, seed)


def time_window_saving(eng, text: Sequence[int], temperature: float, top_p: float, top_k: int, min_p: float,
                       tmax1: int, repeats: int = 9, seed: int = 0) -> list[float]:
    """Seconds a pass of the target's engine over ``t = 1 .. tmax1`` tokens saves, sampled with these filters
    (top-k, or min-p at top-p 1: a :func:`~hsd_opt.runtime.sampling.filter_window`), when it reads only the filters'
    window through its int8 screen (:meth:`~hsd_opt.engine.interface.Engine.window_logits_many`, as the runtime's
    ``Decoding._window`` asks) instead of every logit: the read of its ``t`` rows, their processing
    (:func:`~hsd_opt.runtime.sampling.process_logits`) and one draw, minus the window's read,
    :func:`~hsd_opt.runtime.sampling.filtered_probs` and one draw over its columns, as ``Decoding._dist``. Every
    level on the engine whose exit reads the model's own head reads its window so (a verification or a draft step
    alike). Timed as :func:`_pass_saving` times (``eng``: ``picks_cheaply``). Negative where the window costs
    more."""
    from hsd_opt.runtime.sampling import filter_window, filtered_probs, process_logits, sample_token

    window = filter_window(temperature, top_p, top_k, min_p, eng.vocab_size)
    if window is None:
        raise ValueError("time_window_saving: the filters keep no window (top-k or min-p needed)")

    def full(read, g) -> None:
        sample_token(process_logits(eng.logits_many([read])[0], temperature, top_p, top_k, min_p)[-1], g)

    def windowed(read, g) -> None:
        got = eng.window_logits_many([read], [window])[0]
        p, support = filtered_probs(got.logits, got.cols, temperature, top_p, top_k, min_p)
        sample_token(p[-1], g, support)

    return _pass_saving(eng, text, tmax1, full, windowed, repeats, seed)


def _pass_saving(eng, text: Sequence[int], tmax1: int, full: Callable, cheap: Callable, repeats: int,
                 seed: int) -> list[float]:
    """Seconds ``cheap(read, generator)`` saves against ``full(read, generator)`` on a read ``(state, boundary,
    start, end)`` of the engine's own head over ``t = 1 .. tmax1`` rows: at every ``t`` on ``eng``'s state over
    real ``text``, the median of ``repeats`` each after an untimed one, on other rows each time."""
    n = max(64, tmax1 + 1)
    ids = text_of_length(list(text), n)
    st = eng.new_state(n)
    eng.append(st, ids)
    eng.advance(st, eng.n_layers)
    g = torch.Generator().manual_seed(seed)
    b = eng.n_layers
    out = []
    for t in range(1, tmax1 + 1):
        times: dict[Callable, list[float]] = {full: [], cheap: []}
        for k in range(repeats):
            read = (st, b, (k * t) % (n - t), (k * t) % (n - t) + t)
            for f in (full, cheap):
                f(read, g)
                t0 = now()
                f(read, g)
                times[f].append(now() - t0)
        out.append(statistics.median(times[full]) - statistics.median(times[cheap]))
    return out
