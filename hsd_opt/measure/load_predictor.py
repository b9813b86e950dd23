"""A served load's time, predicted: the batch scheduler's policy run on the latency model's costs.

The plan of a load level predicts the aggregate of ``B`` sequences decoding together for ever (``B`` over the
seconds per token of each). A served level also computes every request's prompt, and its number of sequences in
flight ramps up at the start, dips while a client waits for its next request to be prefilled, and runs down at the
end. :func:`predict_level` runs the policy :class:`~hsd_opt.runtime.batch.Batch` runs (the functions of
:mod:`hsd_opt.runtime.schedule`: admission, the level in force, who takes it) on costs instead of passes:

- a request waits until fewer than ``max_batch`` sequences are in flight and its prompt has the turn (of those
  begun and the oldest waiting one, the fewest positions left: :func:`~hsd_opt.runtime.schedule.prefill_turn`),
  then its prompt takes one tick per pass of the target (:func:`~hsd_opt.runtime.decode.prompt_pass_ends`: a kept
  prompt head is taken, not computed; the rest in passes of at most ``PREFILL_CHUNK`` positions), the last of
  them also computing the prompt on every other engine of its hierarchy; it decodes from that tick on (its first
  token is read in that tick's decode pass); while sequences decode, a begun prompt's next pass waits until they
  were given their share of the time (:func:`~hsd_opt.runtime.schedule.prompt_pass`, the share kept on the priced
  seconds as the batch keeps it on measured ones);
- the hierarchy is the load level's of the sequences in flight and those about to join (as the batch picks it);
  a sequence takes the level's hierarchy when it holds a state of every engine of it (it was prefilled on them)
  or lacks only quantized copies that take the keys and values of an engine it holds (as the batch's
  ``Decoding.can_switch``; their one position is not priced);
- every tick, every sequence decoding gains one token, and the tick costs, for each hierarchy in use by ``n`` of
  them, the seconds per token of ``n`` sequences running it together (:meth:`LoadCosts.decode`): the latency
  model's expectation (a speculative round yields several tokens in several passes; over a request the expected
  seconds per token are what counts);
- a request ends with its last token; its client's next request is submitted then.

:class:`LoadCosts` prices a tick: decode from the profile at the batch size (:func:`~hsd_opt.solver.batch.at_batch`;
between measured batch sizes interpolated linearly in the batch, past the largest extended linearly), times the
factor of the machine's speed of the moment when re-timed (:class:`~hsd_opt.measure.retime.StepClock` at each batch
size); a prompt's pass over ``m`` positions from passes timed at the moment (:func:`time_prompt_passes`, linear
between them), or without them from the model's cost curve (passes over ``t = 1 .. n`` positions; past ``n``
extended by the curve's slope over its upper half: a long pass is bound by arithmetic, its cost linear in the
positions).

What the prediction leaves out: Python's own work between passes, a prompt's last pass computed in the call of
the others' decode rows (a batch's saving: it prices the two apart), a group of sequences on one engine waiting
while another's larger group is served (the batch serves one or the other per tick, :func:`~hsd_opt.runtime.
schedule.served_groups`; the prediction prices expected seconds per token, not passes, and charges both every
tick), and the difference between sequences' contexts (one context prices every decode tick). Units: seconds, tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

import hsd_opt.runtime.decode as decode_module
from hsd_opt.engine.timing import median_pass
from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile, nearest_level
from hsd_opt.measure.retime import StepClock, greedy_costs, scale_costs
from hsd_opt.prompts import text_of_length
from hsd_opt.runtime.decode import HSD, prompt_pass_ends
from hsd_opt.runtime.schedule import PREFILL_SHARE, Occupancy, PrefillShare, level_at, prompt_pass
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
        sources: ``(engine, engine it takes keys and values from)`` for those copies (keys as in ``engines``).
    """

    hierarchy: tuple[str, ...]
    budgets: tuple[int, ...]
    prefill: tuple[str, ...]
    engines: frozenset[str]
    shared: frozenset[str] = frozenset()
    sources: frozenset[tuple[str, str]] = frozenset()

    def takes(self, holds: frozenset[str]) -> bool:
        """Whether a sequence holding ``holds`` takes this hierarchy: every engine held, or a copy of one held."""
        return all(e in holds or any(c == e and o in holds for c, o in self.sources) for e in self.engines)


def spec_of(hsd: HSD) -> Spec:
    """The :class:`Spec` of a built hierarchy: its names and budgets, and per engine its highest level."""
    tops = _tops([hsd])
    target = id(hsd.levels[-1].engine)
    order = [target] + [k for k in tops if k != target]
    sources = {(str(k), str(o)) for k in order[1:] for o in order if o != k and hsd.share_prompt
               and tops[k][1].can_share_prompt(tops[o][1])}
    shared = {tops[k][0] for k in order[1:] if any(c == str(k) for c, _ in sources)}
    names = tuple(lv.name for lv in hsd.levels)
    return Spec(names, tuple(hsd.budgets) if len(names) > 1 else (), tuple(tops[k][0] for k in order),
                frozenset(str(k) for k in order), frozenset(shared), frozenset(sources))


def _tops(runs: Sequence[HSD]) -> dict[int, tuple[str, object, int]]:
    """id(engine) -> (name, engine, boundary) of each engine's highest level in ``runs``: what computes a prompt
    on it."""
    tops: dict[int, tuple[str, object, int]] = {}
    for h in runs:
        for lv in h.levels:
            if lv.is_model and (id(lv.engine) not in tops or lv.boundary > tops[id(lv.engine)][2]):
                tops[id(lv.engine)] = (lv.name, lv.engine, lv.boundary)
    return tops


@dataclass(frozen=True)
class Job:
    """One request of a client: ``positions`` prompt positions to compute (after a kept prompt head of ``head``
    positions, 0: none) and ``tokens`` generated (>= 1, its answer's length)."""

    positions: int
    tokens: int
    head: int = 0

    @property
    def length(self) -> int:
        """Its prompt's positions, the kept head's included."""
        return self.head + self.positions


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
        prompt_seconds: model -> ``[(positions, seconds), ...]``: prompt passes timed (:func:`time_prompt_passes`),
            which price a model's prompt passes in place of its cost curve.
        context: tokens in a decoding sequence's cache that price the decode ticks (default: the profile's
            typical context).
    """

    def __init__(self, profile: Profile, factors: Mapping[int, Mapping[str, float]] | None = None,
                 prompt_seconds: Mapping[str, Sequence[tuple[int, float]]] | None = None,
                 context: float | None = None):
        self.profile = profile
        self.factors = {int(b): dict(f) for b, f in (factors or {}).items()}
        self.prompt_seconds = {m: sorted((int(n), float(x)) for n, x in pts)
                               for m, pts in (prompt_seconds or {}).items() if pts}
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
        """Seconds of a pass of ``model`` over ``positions`` new prompt positions: on the line through the timed
        passes around it (``prompt_seconds``; below or past them, the nearest two's line), else the model's cost
        curve (past its end extended by its upper half's slope)."""
        pts = self.prompt_seconds.get(model)
        if pts:
            if len(pts) == 1:
                return pts[0][1] * positions / pts[0][0]
            j = next((i for i, (n, _) in enumerate(pts) if n >= positions), len(pts) - 1)
            (n0, s0), (n1, s1) = pts[max(j, 1) - 1], pts[max(j, 1)]
            return max(s0 + (s1 - s0) * (positions - n0) / (n1 - n0), 0.0)
        p = self._prompt_profile
        curve = p.cost_curve.get(model) or [m.cost for m in p.models if m.name == model]
        if not curve:
            raise HsdError(f"the profile has no cost for {model!r}")
        return _at(curve, positions)

    def prefill(self, spec: Spec, job: Job) -> list[float]:
        """Seconds of each tick of ``job``'s prompt: one per pass of the target; the last also computes the
        prompt on every other engine of ``spec`` (its last position only on an engine that shares the target's)."""
        ends = pass_ends(job)
        starts = [min(job.head, job.length - 1)] + ends[:-1]         # a prompt computes its last position at least
        ticks = [self.prompt_pass(spec.prefill[0], b - a) for a, b in zip(starts, ends)]
        for m in spec.prefill[1:]:
            ticks[-1] += (self.prompt_pass(m, 1) if m in spec.shared
                          else sum(self.prompt_pass(m, b - a) for a, b in zip(starts, ends)))
        return ticks


def pass_ends(job: Job) -> list[int]:
    """Where the passes of ``job``'s prompt end (prompt positions), one per tick of its prefill: those after its kept
    head (:func:`~hsd_opt.runtime.decode.prompt_pass_ends`), its last position at least."""
    return [b for b in prompt_pass_ends(job.length, job.head) if b > job.head] or [job.length]


@dataclass(eq=False)
class _Seq:
    client: int
    job: Job
    submitted: float
    spec: Spec | None = None
    holds: frozenset[str] = frozenset()
    ticks: list[float] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    computed: int = 0
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


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None without ``a`` or with ``b`` None or 0."""
    return a / b if a is not None and b else None


def predict_level(costs: LoadCosts, levels: Mapping[int, Spec], clients: Sequence[Sequence[Job]],
                  max_batch: int, prefill_share: float = PREFILL_SHARE) -> LevelPrediction:
    """Replay the batch scheduler (see the module doc) on ``clients`` (each client's requests, sent one after the
    other, every client's first at time 0) with ``levels`` (load level -> what it runs) decoding at most
    ``max_batch`` sequences together, prompt passes taking at most ``prefill_share`` of the time while sequences
    decode (:class:`~hsd_opt.runtime.schedule.PrefillShare`, on the priced seconds)."""
    if not levels:
        raise HsdError("no load levels to predict with")
    if max_batch < 1:
        raise HsdError(f"--max-batch: expected >= 1, got {max_batch}")
    specs = dict(sorted((int(k), v) for k, v in levels.items()))
    share = PrefillShare(prefill_share)
    now = 0.0
    waiting = [_Seq(i, jobs[0], 0.0) for i, jobs in enumerate(clients) if jobs]
    sent = {i: 1 for i in range(len(clients))}
    active: list[_Seq] = []
    prefilling: list[_Seq] = []
    ttft: list[float] = []
    decoding: list[int] = []
    tokens = 0

    def occupancy() -> Occupancy:
        return Occupancy(len(active), len(prefilling), len(waiting), max_batch)

    while waiting or active or prefilling:
        ended: list[_Seq] = []
        joined: _Seq | None = None
        dt = 0.0
        nxt = waiting[0].job.length if occupancy().admits() else None
        turn = prompt_pass([s.job.length - s.computed for s in prefilling], nxt, share, len(active),
                           decode_module.PREFILL_CHUNK)
        if turn == len(prefilling):
            s = waiting.pop(0)
            prefilling.append(s)
            spec = specs[level_at(specs, occupancy())]
            s.spec, s.holds = spec, spec.engines
            s.ticks, s.ends = costs.prefill(spec, s.job), pass_ends(s.job)
        if turn is not None:
            s = prefilling[turn]
            dt += s.ticks.pop(0)
            if s.ticks:                       # more of its prompt left: the decoding sequences are owed
                share.prefilled(dt, len(active))
            s.computed = s.ends.pop(0)
            if not s.ticks:                   # the prompt computed: it decodes from this tick on
                prefilling.remove(s)
                s.left = s.job.tokens
                active.append(s)
                joined = s
        spec = specs[level_at(specs, occupancy())]
        for s in active:
            if spec.takes(s.holds):             # every priced sequence is greedy: it follows the load
                s.spec, s.holds = spec, s.holds | spec.engines
        groups: dict[Spec, int] = {}
        for s in active:
            groups[s.spec] = groups.get(s.spec, 0) + 1
        decode = sum(costs.decode(sp, n) for sp, n in groups.items())
        share.decoded(decode)
        dt += decode
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


def _mean(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Per model the mean of two sets of factors (a model in one set only keeps its factor)."""
    return {m: (a[m] + b[m]) / 2 if m in a and m in b else a.get(m, b.get(m)) for m in {**a, **b}}


def _hierarchies(h: HSD | Mapping[int, HSD]) -> dict[int, HSD]:
    return dict(h) if isinstance(h, Mapping) else {1: h}


#: Prompt positions of the passes :func:`time_prompt_passes` times.
PROMPT_PASS_SIZES = (8, 32, 96)


@torch.no_grad()
def time_prompt_passes(eng, boundary: int, text: Sequence[int], sizes: Sequence[int] = PROMPT_PASS_SIZES,
                       context: int = 24, repeats: int = 2) -> list[tuple[int, float]]:
    """``[(m, seconds)]``: a prompt's pass of ``eng`` over ``m`` new positions after ``context`` (a kept head), to
    layer ``boundary``, and the greedy read of its last position, as a prefill ends; the median of ``repeats``
    after a warm-up, on ``text`` (token ids; random ids when empty)."""
    n = context + max(sizes)
    if text:
        ids = torch.tensor(text_of_length(list(text), n))
    else:
        ids = torch.randint(3, max(4, eng.vocab_size - 1), (n,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(eng.device)
    st = eng.new_state(n + 1)
    eng.append(st, ids[:context])
    eng.advance(st, boundary)
    return [(int(m), median_pass(eng, [(st, ids[context:context + m])], boundary, repeats, read=1))
            for m in sizes]


class LoadPredictor:
    """Predictions of a load benchmark's levels at the machine's speed of the moment (``hsd bench --concurrency
    --retime PROFILE``).

    :meth:`retime`, called right before a method serves a level and again right after it, times one batched step
    of every engine at each of the profile's batch sizes up to the method's ``max_batch`` (1 included), the engines
    of the hierarchy that runs at that load, with :class:`~hsd_opt.measure.retime.StepClock`, and each engine's
    prompt passes (:func:`time_prompt_passes`; over 1 and 8 positions for a copy that only ever shares the
    target's prompt); :meth:`predict` then predicts the level (:func:`predict_level`) on the profile's
    decode costs scaled by the mean of the two timings' factors and on the mean of the two timings' prompt passes.

    Args:
        profile: the plan's profile. ``text``: token ids the timed passes read. ``head``: the prompt head every
        engine keeps (its ids; a prompt that starts with it and is longer computes only the rest).
        ``context``: the tokens in a cache that price the decode ticks (default: the mean over the requests of
        their prompt and half their answer).
    """

    def __init__(self, profile: Profile, text: Sequence[int] | None = None, head: Sequence[int] = (),
                 context: float | None = None, repeats: int = 5):
        self.profile = profile
        self.text = list(text or [])
        self.head = list(head)
        self.context = context
        self.repeats = repeats
        self.sizes = sorted({1} | {b.batch for b in profile.batch_costs})
        self._clocks: dict[tuple, StepClock] = {}
        self._factors: dict[int, dict[str, float]] = {}
        self._prompts: dict[str, list[tuple[int, float]]] = {}

    def _clock(self, runs: list[HSD], batch: int) -> StepClock:
        key = (tuple(sorted(id(h) for h in runs)), batch)
        if key not in self._clocks:
            self._clocks[key] = StepClock(self.profile, runs, repeats=self.repeats, text=self.text, batch=batch,
                                          greedy=greedy_costs(self.profile))
        return self._clocks[key]

    def retime(self, hierarchies: HSD | Mapping[int, HSD], max_batch: int, again: bool = False) -> dict:
        """Time the engines of ``hierarchies`` now (see the class doc); returns the factors (batch size -> model ->
        factor) and the prompt passes (model -> ``[(positions, seconds)]``). ``again``: a second timing of the
        same run (after it), averaged with the first: a run of several seconds on a machine whose speed drifts is
        priced at the middle of its spell, not at its start."""
        levels = _hierarchies(hierarchies)
        runs = list({id(h): h for h in levels.values()}.values())
        factors = {b: self._clock([levels[nearest_level(levels, b)]], b).measure()
                   for b in self.sizes if b <= max(1, max_batch)}
        whole: set[str] = set()         # models that compute a whole prompt in some hierarchy (not only share it)
        for h in runs:
            sp = spec_of(h)
            whole |= set(sp.prefill) - sp.shared
        prompts = {name: time_prompt_passes(eng, b, self.text, PROMPT_PASS_SIZES if name in whole else (1, 8),
                                            context=max(1, len(self.head)))
                   for name, eng, b in _tops(runs).values()}
        if again:
            factors = {b: _mean(self._factors.get(b, f), f) for b, f in factors.items()}
            prompts = {m: [(n, (x + y) / 2) for (n, x), (_, y) in zip(self._prompts.get(m, pts), pts)]
                       for m, pts in prompts.items()}
        self._factors, self._prompts = factors, prompts
        return {"batch": {str(b): f for b, f in factors.items()},
                "prompt_seconds": {m: [list(p) for p in pts] for m, pts in prompts.items()}}

    def jobs(self, prompts: Sequence[Sequence[int]], lengths: Mapping, clients: int, requests: int,
             start: int = 0) -> list[list[Job]]:
        """The requests of ``clients`` closed-loop clients as :func:`~hsd_opt.measure.load_bench.serve_clients`
        sends them: client ``i``'s ``k``-th on prompt ``(start + i * requests + k) mod n``, generating its answer's
        length in tokens: ``lengths[(i, k)]`` where given (sampled: each request its own), else ``lengths[prompt]``
        (greedy: every request of a prompt the same)."""
        h = len(self.head)
        out = []
        for i in range(clients):
            row = []
            for k in range(requests):
                j = (start + i * requests + k) % len(prompts)
                p = list(prompts[j])
                kept = h if h and len(p) > h and p[:h] == self.head else 0
                n = lengths[(i, k)] if (i, k) in lengths else lengths[j]
                row.append(Job(len(p) - kept, max(1, int(n)), kept))
            out.append(row)
        return out

    def after(self, hierarchies: HSD | Mapping[int, HSD], max_batch: int, clients: Sequence[Sequence[Job]],
              measured: float | None) -> dict:
        """Right after a run that :meth:`retime` timed before: time it again (``again``), predict it
        (:meth:`predict`) and return the prediction's figures with ``factors`` (the second timing's report) and
        ``measured_over_predicted`` (``measured`` aggregate tokens/s over the prediction; None without either)."""
        factors = self.retime(hierarchies, max_batch, again=True)
        out = self.predict(hierarchies, max_batch, clients)
        return {**out, "factors": factors,
                "measured_over_predicted": ratio(measured, out["predicted_run_tokens_per_s"])}

    def predict(self, hierarchies: HSD | Mapping[int, HSD], max_batch: int,
                clients: Sequence[Sequence[Job]]) -> dict:
        """The level predicted (:func:`predict_level`) at the factors of the last :meth:`retime` s: predicted
        aggregate tokens/s, wall seconds and time to the first token p50 (each None where sequences would share
        passes and the profile has no costs of batched passes)."""
        if max_batch > 1 and len(clients) > 1 and len(self.sizes) == 1:
            return {"predicted_run_tokens_per_s": None, "predicted_wall_seconds": None,
                    "predicted_ttft_p50_s": None}
        context = self.context
        if context is None:            # the mean of the requests' contexts halfway through their answers
            every = [j for row in clients for j in row]
            context = statistics.fmean(j.length + j.tokens / 2 for j in every) if every else None
        costs = LoadCosts(self.profile, self._factors, self._prompts, context)
        levels = {k: spec_of(h) for k, h in _hierarchies(hierarchies).items()}
        p = predict_level(costs, levels, clients, max_batch)
        return {"predicted_run_tokens_per_s": p.aggregate_tokens_per_s, "predicted_wall_seconds": p.wall_seconds,
                "predicted_ttft_p50_s": statistics.median(p.ttft) if p.ttft else None}
