"""A served load's time, predicted: the batch scheduler's ticks replayed on the latency model's costs.

The plan of a load level predicts the aggregate of ``B`` sequences decoding together for ever (``B`` over the
seconds per token of each). A served level also computes every request's prompt, and its number of sequences in
flight ramps up at the start, dips while a client waits for its next request to be prefilled, and runs down at the
end. :func:`predict_level` replays :class:`~hsd_opt.runtime.batch.Batch`'s policy on costs instead of passes:

- a request waits until fewer than ``max_batch`` sequences are in flight and no other prompt is being computed,
  then its prompt takes one tick per pass of the target (:func:`~hsd_opt.runtime.decode.prompt_pass_ends`: a kept
  prompt head is taken, not computed; the rest in passes of at most ``PREFILL_CHUNK`` positions), the last of
  them also computing the prompt on every other engine of its hierarchy; it decodes from that tick on (its first
  token is read in that tick's decode pass);
- the hierarchy is the load level's of the sequences in flight and those about to join (as the batch picks it);
  a sequence takes the level's hierarchy when it holds a state of every engine of it (it was prefilled on them);
- every tick, every sequence decoding gains one token, and the tick costs, for each hierarchy in use by ``n`` of
  them, the seconds per token of ``n`` sequences running it together (:meth:`LoadCosts.decode`): the latency
  model's expectation (a speculative round yields several tokens in several passes; over a request the expected
  seconds per token are what counts);
- a request ends with its last token; its client's next request is submitted then.

:class:`LoadCosts` prices a tick: decode from the profile at the batch size (:func:`~hsd_opt.solver.batch.at_batch`;
between measured batch sizes interpolated linearly in the batch, past the largest extended linearly), a prompt's
pass over ``m`` positions from the model's cost curve (passes over ``t = 1 .. n`` positions; past ``n`` extended by
the curve's slope over its upper half: a long pass is bound by arithmetic, its cost linear in the positions), each
cost times the factor of the machine's speed of the moment when re-timed (:class:`~hsd_opt.runtime.retime.StepClock`
at each batch size; a prompt's passes take the factor of a pass over many positions).

What the replay leaves out: Python's own work between passes (about 1% of a level), a group of sequences on one
engine waiting while another's larger group is served (the batch serves one or the other per tick; the replay
charges both every tick), and the difference between sequences' contexts (one context prices every decode
tick). Units: seconds, tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile, nearest_level
from hsd_opt.runtime.decode import HSD, prompt_pass_ends
from hsd_opt.runtime.retime import scale_costs
from hsd_opt.solver.api import evaluate, resolve_context
from hsd_opt.solver.batch import at_batch


@dataclass(frozen=True)
class Spec:
    """What one hierarchy runs, for pricing.

    Attributes:
        hierarchy: model names, cheapest first, the target last; ``budgets``: tokens drafted per level below.
        prefill: per engine, the model whose pass computes a prompt on it (the engine's highest level), the
            target first.
        engines: a key per engine (a sequence holds the engines it was prefilled on).
        shared: the models of ``prefill`` that take a prompt's keys and values from another engine (a quantized
            copy of the target, :meth:`~hsd_opt.engine.interface.Engine.share_prompt`): they compute its last
            position only.
    """

    hierarchy: tuple[str, ...]
    budgets: tuple[int, ...]
    prefill: tuple[str, ...]
    engines: frozenset[str]
    shared: frozenset[str] = frozenset()


def spec_of(hsd: HSD) -> Spec:
    """The :class:`Spec` of a built hierarchy: its names and budgets, and per engine its highest level."""
    tops: dict[int, tuple[int, str]] = {}
    engines = {}
    for lv in hsd.levels:
        if lv.is_model and (id(lv.engine) not in tops or lv.boundary > tops[id(lv.engine)][0]):
            tops[id(lv.engine)] = (lv.boundary, lv.name)
            engines[id(lv.engine)] = lv.engine
    target = id(hsd.levels[-1].engine)
    order = [target] + [k for k in tops if k != target]
    shared = {tops[k][1] for k in order[1:] if hsd.share_prompt
              and any(engines[k].can_share_prompt(engines[o]) for o in order if o != k)}
    names = tuple(lv.name for lv in hsd.levels)
    return Spec(names, tuple(hsd.budgets) if len(names) > 1 else (), tuple(tops[k][1] for k in order),
                frozenset(str(k) for k in order), frozenset(shared))


@dataclass(frozen=True)
class Job:
    """One request of a client: ``positions`` prompt positions to compute (after a kept prompt head of ``head``
    positions, 0: none) and ``tokens`` generated (>= 1, its answer's length)."""

    positions: int
    tokens: int
    head: int = 0


def _at(values: Sequence[float], t: int) -> float:
    """A cost curve ``[s_1 .. s_n]`` at ``t`` positions; past ``n`` extended by the slope over its upper half."""
    n = len(values)
    if t <= n:
        return float(values[t - 1])
    h = n // 2
    slope = (values[-1] - values[h - 1]) / (n - h) if n >= 2 else values[-1]
    return float(values[-1] + max(slope, 0.0) * (t - n))


class LoadCosts:
    """Seconds of the ticks of a served load (see the module doc).

    Args:
        profile: the plan's profile (``batch_costs`` needed for more than one sequence).
        factors: batch size -> model -> measured / profiled seconds of that batched step (re-timed; a batch size
            without its own factors takes the nearest one's on a log scale; none: 1).
        prefill_factors: model -> measured / profiled seconds of a pass over many positions (default 1).
        context: tokens in a decoding sequence's cache that price the decode ticks (default: the profile's
            typical context).
    """

    def __init__(self, profile: Profile, factors: Mapping[int, Mapping[str, float]] | None = None,
                 prefill_factors: Mapping[str, float] | None = None, context: float | None = None):
        self.profile = profile
        self.factors = {int(b): dict(f) for b, f in (factors or {}).items()}
        self.prefill_factors = dict(prefill_factors or {})
        self.context = context
        self.sizes = sorted({1} | {b.batch for b in profile.batch_costs})
        first = profile.context_costs[0].context if profile.context_costs else None
        self._prompt_profile = resolve_context(profile, first)[0]
        self._latency: dict[tuple[Spec, int], float] = {}

    def _factor(self, b: int) -> dict[str, float]:
        if not self.factors:
            return {}
        return self.factors[min(self.factors, key=lambda k: (abs(math.log(k / b)), k))]

    def _measured(self, spec: Spec, b: int) -> float:
        key = (spec, b)
        if key not in self._latency:
            prof = scale_costs(at_batch(self.profile, b), self._factor(b))
            self._latency[key] = float(evaluate(prof, list(spec.hierarchy), list(spec.budgets), self.context))
        return self._latency[key]

    def decode(self, spec: Spec, batch: int) -> float:
        """Seconds per token of each of ``batch`` sequences running ``spec`` together."""
        if batch < 1:
            raise HsdError(f"a decode tick runs 1 or more sequences, not {batch}")
        if batch in self.sizes:
            return self._measured(spec, batch)
        if len(self.sizes) == 1:
            raise HsdError("the profile has no costs of passes over several sequences (hsd profile "
                           "--batch-sizes 1,2,4,8)")
        lo = max((b for b in self.sizes if b < batch), default=self.sizes[0])
        hi = min((b for b in self.sizes if b > batch), default=None)
        if hi is None:                       # past the largest: the line through the two largest
            lo, hi = self.sizes[-2], self.sizes[-1]
        a, z = self._measured(spec, lo), self._measured(spec, hi)
        return a + (z - a) * (batch - lo) / (hi - lo)

    def prompt_pass(self, model: str, positions: int) -> float:
        """Seconds of a pass of ``model`` over ``positions`` new prompt positions."""
        p = self._prompt_profile
        curve = p.cost_curve.get(model) or [m.cost for m in p.models if m.name == model]
        if not curve:
            raise HsdError(f"the profile has no cost for {model!r}")
        return _at(curve, positions) * float(self.prefill_factors.get(model, 1.0))

    def prefill(self, spec: Spec, job: Job) -> list[float]:
        """Seconds of each tick of ``job``'s prompt: one per pass of the target; the last also computes the
        prompt on every other engine of ``spec`` (its last position only on an engine that shares the target's)."""
        n = job.head + job.positions
        ends = [b for b in prompt_pass_ends(n, job.head) if b > job.head] or [n]
        starts = [job.head] + ends[:-1]
        ticks = [self.prompt_pass(spec.prefill[0], b - a) for a, b in zip(starts, ends)]
        for m in spec.prefill[1:]:
            ticks[-1] += (self.prompt_pass(m, 1) if m in spec.shared
                          else sum(self.prompt_pass(m, b - a) for a, b in zip(starts, ends)))
        return ticks


@dataclass
class _Seq:
    client: int
    job: Job
    submitted: float
    spec: Spec | None = None
    holds: frozenset[str] = frozenset()
    ticks: list[float] = field(default_factory=list)
    left: int = 0


@dataclass
class LevelPrediction:
    """What :func:`predict_level` predicts: ``wall_seconds`` from the first submission to the last answer,
    ``tokens`` generated, ``ttft`` (seconds from each request's submission to its first token, in the order their
    prompts were computed) and ``decoding`` (per tick, the number of sequences that gained a token)."""

    wall_seconds: float
    tokens: int
    ttft: list[float]
    decoding: list[int]

    @property
    def aggregate_tokens_per_s(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds > 0 else float("inf")


def predict_level(costs: LoadCosts, levels: Mapping[int, Spec], clients: Sequence[Sequence[Job]],
                  max_batch: int) -> LevelPrediction:
    """Replay the batch scheduler (see the module doc) on ``clients`` (each client's requests, sent one after the
    other, every client's first at time 0) with ``levels`` (load level -> what it runs) decoding at most
    ``max_batch`` sequences together."""
    if not levels:
        raise HsdError("no load levels to predict with")
    if max_batch < 1:
        raise HsdError(f"--max-batch: expected >= 1, got {max_batch}")
    specs = dict(sorted((int(k), v) for k, v in levels.items()))
    now = 0.0
    waiting = [_Seq(i, jobs[0], 0.0) for i, jobs in enumerate(clients) if jobs]
    sent = {i: 1 for i in range(len(clients))}
    active: list[_Seq] = []
    prefilling: _Seq | None = None
    ttft: list[float] = []
    decoding: list[int] = []
    tokens = 0

    def load() -> int:
        flight = len(active) + (prefilling is not None)
        return flight + min(len(waiting), max_batch - flight)

    def level_spec() -> Spec:
        return specs[nearest_level(specs, load())]

    while waiting or active or prefilling is not None:
        ended: list[_Seq] = []
        joined: _Seq | None = None
        dt = 0.0
        if prefilling is None and waiting and len(active) < max_batch:
            prefilling = waiting.pop(0)
            spec = level_spec()
            prefilling.spec, prefilling.holds = spec, spec.engines
            prefilling.ticks = costs.prefill(spec, prefilling.job)
        if prefilling is not None:
            dt += prefilling.ticks.pop(0)
            if not prefilling.ticks:          # the prompt computed: it decodes from this tick on
                s, prefilling = prefilling, None
                s.left = s.job.tokens
                active.append(s)
                joined = s
        spec = level_spec()
        for s in active:
            if spec.engines <= s.holds:
                s.spec = spec
        groups: dict[Spec, int] = {}
        for s in active:
            groups[s.spec] = groups.get(s.spec, 0) + 1
        dt += sum(costs.decode(sp, n) for sp, n in groups.items())
        if active:
            decoding.append(len(active))
        for s in active:
            s.left -= 1
            tokens += 1
            if s.left <= 0:
                ended.append(s)
        now += dt
        if joined is not None:               # its first token: this tick's pass read it
            ttft.append(now - joined.submitted)
        for s in ended:
            active.remove(s)
            k = sent[s.client]
            if k < len(clients[s.client]):
                sent[s.client] = k + 1
                waiting.append(_Seq(s.client, clients[s.client][k], now))
    return LevelPrediction(now, tokens, ttft, decoding)


def _hierarchies(h: HSD | Mapping[int, HSD]) -> dict[int, HSD]:
    return dict(h) if isinstance(h, Mapping) else {1: h}


class LoadPredictor:
    """Predictions of a load benchmark's levels at the machine's speed of the moment (``hsd bench --concurrency
    --retime PROFILE``).

    :meth:`retime`, called right before a method serves a level, times one batched step of every engine the
    method's hierarchies run at each of the profile's batch sizes up to its ``max_batch`` (1 included) and one
    pass over the longest measured pass of one sequence (the factor of a prompt's passes) with
    :class:`~hsd_opt.runtime.retime.StepClock`; :meth:`predict` then replays the level on the profile's costs
    scaled by those factors (:func:`predict_level`).

    Args:
        profile: the plan's profile. ``text``: token ids the timed passes read. ``head``: the prompt head every
        engine keeps (its ids; a prompt that starts with it and is longer computes only the rest).
        ``context``: the tokens in a cache that price the decode ticks (default: the mean over the requests of
        their prompt and half their answer).
    """

    def __init__(self, profile: Profile, text: Sequence[int] | None = None, head: Sequence[int] = (),
                 context: float | None = None, repeats: int = 3):
        self.profile = profile
        self.text = list(text or [])
        self.head = list(head)
        self.context = context
        self.repeats = repeats
        self.sizes = sorted({1} | {b.batch for b in profile.batch_costs})
        self._clocks: dict[tuple, object] = {}
        self._factors: dict[int, dict[str, float]] = {}
        self._prefill: dict[str, float] = {}

    def _clock(self, runs: list[HSD], batch: int, positions: int = 1):
        from hsd_opt.runtime.retime import StepClock

        key = (tuple(sorted({id(h) for h in runs})), batch, positions)
        if key not in self._clocks:
            self._clocks[key] = StepClock(self.profile, runs, repeats=self.repeats, text=self.text, batch=batch,
                                          positions=positions)
        return self._clocks[key]

    def retime(self, hierarchies: HSD | Mapping[int, HSD], max_batch: int) -> dict:
        """Time the engines of ``hierarchies`` now (see the class doc); returns the factors (batch size -> model ->
        factor, and ``prefill``: model -> factor)."""
        runs = list({id(h): h for h in _hierarchies(hierarchies).values()}.values())
        self._factors = {b: self._clock(runs, b).measure() for b in self.sizes if b <= max(1, max_batch)}
        cc = self.profile.context_costs
        curve = len((cc[0].cost_curve if cc else self.profile.cost_curve).get(self.profile.target) or [0.0])
        self._prefill = self._clock(runs, 1, curve).measure()
        return {"batch": {str(b): f for b, f in self._factors.items()}, "prefill": dict(self._prefill)}

    def jobs(self, prompts: Sequence[Sequence[int]], lengths: Mapping[int, int], clients: int, requests: int,
             start: int = 0) -> list[list[Job]]:
        """The requests of ``clients`` closed-loop clients as :func:`~hsd_opt.runtime.load_bench.serve_clients`
        sends them: client ``i``'s ``k``-th on prompt ``(start + i * requests + k) mod n``, generating
        ``lengths[prompt]`` tokens (its answer's length)."""
        h = len(self.head)
        out = []
        for i in range(clients):
            row = []
            for k in range(requests):
                j = (start + i * requests + k) % len(prompts)
                p = list(prompts[j])
                kept = h if h and len(p) > h and p[:h] == self.head else 0
                row.append(Job(len(p) - kept, max(1, int(lengths[j])), kept))
            out.append(row)
        return out

    def predict(self, hierarchies: HSD | Mapping[int, HSD], max_batch: int,
                clients: Sequence[Sequence[Job]]) -> dict:
        """The replayed level (:func:`predict_level`) at the factors of the last :meth:`retime`: predicted
        aggregate tokens/s, wall seconds and time to the first token p50."""
        context = self.context
        if context is None:            # the mean of the requests' contexts halfway through their answers
            every = [j for row in clients for j in row]
            context = statistics.fmean(j.head + j.positions + j.tokens / 2 for j in every) if every else None
        costs = LoadCosts(self.profile, self._factors, self._prefill, context)
        levels = {k: spec_of(h) for k, h in _hierarchies(hierarchies).items()}
        p = predict_level(costs, levels, clients, max_batch)
        return {"predicted_run_tokens_per_s": p.aggregate_tokens_per_s, "predicted_wall_seconds": p.wall_seconds,
                "predicted_ttft_p50_s": statistics.median(p.ttft) if p.ttft else None}
