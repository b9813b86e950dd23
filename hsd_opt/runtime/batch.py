"""Many sequences decoded together: continuous batching with speculation inside the scheduler.

A :class:`Batch` holds the sequences in flight, each a :class:`~hsd_opt.runtime.decode.Decoding` (its own caches,
drafters, random generator), and drives them in ticks. Each :meth:`Batch.tick`

1. computes one pass of at most ``PREFILL_CHUNK`` prompt positions in a tick where one is due (a new request's
   prompt costs the others one such pass per round, a long prompt several; its first token comes after its prefill
   and its first round, not after the others finish; while sequences decode, prompt passes take at most
   ``prefill_share`` of the time, :class:`~hsd_opt.runtime.schedule.PrefillShare`, timed with the batch's clock, a
   prompt's first pass never held, so a long prompt does not hold the others to a token per pass): of the prompt
   with the fewest positions left among those begun and the oldest waiting sequence where a place is free
   (:func:`~hsd_opt.runtime.schedule.prefill_turn`: a short request that arrives while a long prompt is computed is
   not held behind its passes), which begins with the hierarchy of the load it starts under (those in flight, it,
   and those waiting for a place). Where the target is that hierarchy's only engine, the prompt's last pass is left
   to the sequence's first round (``prefill_passes(defer_last=True)``): step 3 computes it in the call that serves
   the others' rounds, each weight read once for all their rows;
2. gives every sequence that follows the load (greedy, or sampled without a seed) the hierarchy of the current load
   level (of its task's hierarchies where it has one: ``by_task``), applied at its next round (a round under way
   drafts no further, :meth:`~hsd_opt.runtime.decode.Decoding.switch`), if that costs no more than a prefill on it
   (:meth:`~hsd_opt.runtime.decode.Decoding.can_switch`): it holds a state of every engine of that hierarchy already,
   or the engines it lacks are quantized copies that take the target's keys and values of every position so far and
   compute one (a draft model taken on mid-sequence would compute them all, a cost the latency model does not price);
   a copy the sequence held but did not run for a while takes them again too, instead of computing what it missed;
3. serves the passes the sequences wait for, the passes on one engine in one batched call
   (:meth:`~hsd_opt.engine.interface.Engine.advance_many`, then ``greedy_ids_many`` / ``picks_many`` /
   ``window_logits_many`` / ``logits_many``), so a decode step of eight sequences reads each weight once, not eight
   times: the largest group of one engine (on a tie, the engine lowest in the hierarchies), and every group with a
   sequence that has waited ``max_wait`` ticks. Every round ends in a pass of the target, so sequences out of step (one
   joined later, one's round was shorter) meet there: the one ahead waits while those behind draft, they share that
   pass, and from there draft together. ``max_wait`` is by default the most passes a round of the batch's hierarchies
   takes below its top (:func:`round_passes`; at least 3), so that those behind can arrive within it: a wait costs the
   batch nothing (the cores serve the others' passes), a pass computed alone costs the call it could have shared. A
   request's first token (the target's pass at the end of its prompt) waits for no one: it is served in the tick it is
   asked for;
4. resumes each sequence to its next pass, reporting the blocks its target commits (``on_tokens``) and its end
   (``on_done``).

Exactness: a batched call computes, for each sequence, bit for bit what it computes alone (the kernels' rows are
independent of the rows beside them; the torch path runs sequences one by one), and each sequence's prompt is
prefilled in the passes ``hsd run`` prefills it in. So a greedy sequence's tokens are those of ``hsd run`` on its
prompt whatever shares its passes and whichever hierarchy each round uses (every round ends in the target's own
argmax). A sampled sequence without a seed follows the load too (every round samples from the target's
distribution, whichever hierarchy drafts); one with a seed keeps the hierarchy it started with, the plan's own
(``seeded``) or else the one for a single sequence: its draws depend only on its seed, not on the load. Units:
seconds; token counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Mapping, Sequence

import hsd_opt.runtime.decode as decode_module
from hsd_opt.errors import HsdError
from hsd_opt.formats import nearest_level
from hsd_opt.grammar.constraint import Constraint
from hsd_opt.runtime.decode import HSD, Committed, Decoding, GenerationResult, Pass, follows_load
from hsd_opt.runtime.penalties import Penalties
from hsd_opt.runtime.schedule import (
    PREFILL_SHARE,
    Group,
    Occupancy,
    PrefillShare,
    level_at,
    prompt_pass,
    served_groups,
)
from hsd_opt.values import is_integer

#: The least ``max_wait`` of a batch by default (ticks).
MIN_WAIT = 3


def round_passes(hsd: HSD) -> int:
    """The most passes one round of ``hsd`` takes on its engines below the top (the ticks a sequence drafts before
    its round's target pass): the bottom level drafts ``T_0`` tokens a pass each (none for a token drafter), and a
    level ``k`` in between runs at most ``T_k`` passes (each hands up at least one token), each after a round of
    the level below."""
    passes = 0
    for k, lv in enumerate(hsd.levels[:-1]):
        passes = hsd.budgets[k] * (passes + 1) if k else (hsd.budgets[0] if lv.is_model else 0)
    return passes


@dataclass(eq=False)
class Entry:
    """One sequence of a :class:`Batch`.

    Attributes:
        decoding: the sequence.
        on_tokens: called with each block the target commits; True asks to stop after it.
        on_done: called once at the end with the result, or with ``(None, error)`` when decoding failed.
        added: when it was added (``time.perf_counter``); ``first_token``: when its first block was committed.
    """

    decoding: Decoding
    on_tokens: Callable[[list[int]], bool | None] | None = None
    on_done: Callable[[GenerationResult | None, BaseException | None], None] | None = None
    added: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    steps: Generator | None = None
    pending: Pass | None = None
    waited: int = 0
    prefill: Generator | None = None
    task: str | None = None
    computed: int = 0           # prompt positions its prefill has computed so far


def _load_levels(hierarchies: HSD | Mapping[int, HSD], name: str = "hierarchies") -> dict[int, HSD]:
    """Load level -> hierarchy, sorted (one hierarchy: every level's); argument ``name`` of another form, an
    :class:`HsdError` naming it."""
    if isinstance(hierarchies, HSD):
        return {1: hierarchies}
    if not isinstance(hierarchies, Mapping) or not hierarchies \
            or not all(is_integer(k) and k >= 1 and isinstance(h, HSD) for k, h in hierarchies.items()):
        raise HsdError(f"{name}: expected an HSD or a mapping of load levels (integers >= 1) to HSDs, got "
                       f"{type(hierarchies).__name__}")
    return dict(sorted((int(k), h) for k, h in hierarchies.items()))


class Batch:
    """Decodes the sequences added to it together (see the module doc).

    Args:
        hierarchies: one hierarchy (every load level) or load level -> hierarchy (the plan of each level of a
            load-aware plan; every hierarchy over the same target engine). At ``n`` sequences in flight the
            hierarchy of the level nearest ``n`` on a log scale is used (:meth:`hierarchy_for`).
        max_active: sequences decoded together at most; more wait (prefilled when a place frees).
        max_wait: ticks a sequence may wait for its engine while another engine's group is served (0: every
            pending pass is served every tick; None: :func:`round_passes` of the hierarchies, at least 3).
        by_task: the hierarchies (one, or one per load level) of the sequences added with a ``task`` (e.g. those
            under a grammar: a plan's plan for task ``json``); every other sequence runs ``hierarchies``.
        seeded: the hierarchy a seeded sampled sequence without a task keeps from start to end, so that its seed
            gives what ``hsd run`` gives with it: the plan's own (None: the load level nearest one sequence's; a
            plan's level 1 may differ from the plan's own, or be missing, or be chosen again at start).
        prefill_share: the share of the time prompt passes take at most while sequences decode, in (0, 1]
            (:class:`~hsd_opt.runtime.schedule.PrefillShare`; 1: a prompt pass every tick, prompts first).
        clock: seconds, for the share (``time.perf_counter``).
    """

    def __init__(self, hierarchies: HSD | Mapping[int, HSD], max_active: int = 8, max_wait: int | None = None,
                 by_task: Mapping[str, HSD | Mapping[int, HSD]] | None = None, seeded: HSD | None = None,
                 prefill_share: float = PREFILL_SHARE, clock: Callable[[], float] = time.perf_counter):
        self.levels = _load_levels(hierarchies)
        if by_task is not None and not isinstance(by_task, Mapping):
            raise HsdError(f"by_task: expected a mapping of tasks to hierarchies, got {type(by_task).__name__}")
        self.tasks = {t: _load_levels(h, f"by_task[{t!r}]") for t, h in (by_task or {}).items()}
        if seeded is not None and not isinstance(seeded, HSD):
            raise HsdError(f"seeded: expected an HSD or None, got {type(seeded).__name__}")
        self.seeded = seeded
        every = [h for lv in (self.levels, *self.tasks.values()) for h in lv.values()] + ([seeded] if seeded else [])
        if len({id(h.target) for h in every}) != 1:
            raise HsdError("every load level's hierarchy must run over the same target engine")
        if not (is_integer(max_active) and max_active >= 1):
            raise HsdError(f"--max-batch: expected >= 1, got {max_active!r}")
        if max_wait is not None and not (is_integer(max_wait) and max_wait >= 0):
            raise HsdError(f"max_wait: expected None or an integer >= 0 (ticks), got {max_wait!r}")
        self.max_active = int(max_active)
        self.share = PrefillShare(prefill_share)
        self.clock = clock
        self.max_wait = (max(MIN_WAIT, *(round_passes(h) for h in every)) if max_wait is None else int(max_wait))
        self._rank: dict[int, int] = {}            # id(engine) -> its lowest level in any hierarchy
        for i, lv in ((i, lv) for h in every for i, lv in enumerate(h.levels) if lv.is_model):
            self._rank[id(lv.engine)] = min(i, self._rank.get(id(lv.engine), i))
        self.waiting: list[Entry] = []
        self.active: list[Entry] = []
        #: the sequences whose prompt is being computed (one pass per tick among them), in the order they began: in
        #: flight but not decoding yet
        self.prefilling: list[Entry] = []

    def hierarchy_for(self, n: int, task: str | None = None) -> HSD:
        """The hierarchy of the load level for ``n`` sequences in flight (:func:`~hsd_opt.formats.nearest_level`: the
        level nearest ``n`` on a log scale), of ``task``'s hierarchies when the batch has them."""
        levels = self.tasks.get(task, self.levels)
        return levels[nearest_level(levels, n)]

    @property
    def occupancy(self) -> Occupancy:
        """The batch's sequences counted by state, as the scheduler's policy decides on them."""
        return Occupancy(len(self.active), len(self.prefilling), len(self.waiting), self.max_active)

    @property
    def in_flight(self) -> int:
        """Sequences decoding or being prefilled (at most ``max_active``)."""
        return self.occupancy.in_flight

    @property
    def load(self) -> int:
        """Sequences in flight (decoding, being prefilled, or prefilled next)."""
        return self.occupancy.load

    def add(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = 0, on_tokens: Callable[[list[int]], bool | None] | None = None,
            on_done: Callable[[GenerationResult | None, BaseException | None], None] | None = None,
            constraint: Constraint | None = None, task: str | None = None, logprobs: int | None = None,
            penalties: Penalties | None = None, top_k: int = 0, min_p: float = 0.0) -> Entry:
        """Queue a sequence (prefilled by a later tick); ``seed`` None: a random one, and the sequence follows the
        load; ``constraint``: the grammar its output follows (its own state; None: none); ``task``: it runs that
        task's hierarchies when the batch has them (``by_task``); ``logprobs``: as :meth:`HSD.start` (the entry's
        ``decoding.logprobs`` grows with each committed block, before ``on_tokens`` hears of it); ``penalties``,
        ``top_k``, ``min_p``: as :meth:`HSD.start`. Bad arguments raise :class:`HsdError` here."""
        if follows_load(temperature, seed):
            hsd = self.hierarchy_for(self.load + 1, task)
        else:
            hsd = self.seeded if self.seeded is not None and task not in self.tasks else self.hierarchy_for(1, task)
        entry = Entry(hsd.start(prompt_ids, max_new_tokens, temperature, top_p, seed, constraint, logprobs,
                                penalties, top_k, min_p),
                      on_tokens, on_done, task=task)
        self.waiting.append(entry)
        return entry

    def drop(self, entry: Entry) -> bool:
        """Remove a sequence that waits or is being prefilled (never decoded); False when it is neither."""
        if entry in self.waiting:
            self.waiting.remove(entry)
        elif entry in self.prefilling:
            self.prefilling.remove(entry)
            entry.prefill.close()
        else:
            return False
        entry.decoding.close()
        return True

    @property
    def starting(self) -> list[Entry]:
        """The sequences not decoding yet: those waiting, then those being prefilled."""
        return self.waiting + self.prefilling

    @property
    def queued(self) -> int:
        """Sequences added and not yet in flight (waiting for their prompt's turn)."""
        return len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self.prefilling)

    def clear(self) -> list[Entry]:
        """Remove every sequence, decoding, being prefilled or waiting (after a :meth:`tick` that failed), each
        decoding closed; returns them, decoding ones first, for the caller to end their requests."""
        entries = self.active + self.starting
        self.active, self.waiting, self.prefilling = [], [], []
        for e in entries:
            e.decoding.close()
        return entries

    def tick(self) -> int:
        """One round of the scheduler (see the module doc; its policy: :mod:`hsd_opt.runtime.schedule`); returns
        the passes served."""
        nxt = self.waiting[0].decoding.n_prompt if self.occupancy.admits() else None
        turn = prompt_pass([e.decoding.n_prompt - e.computed for e in self.prefilling], nxt, self.share,
                           len(self.active), decode_module.PREFILL_CHUNK)
        if turn == len(self.prefilling):
            self._begin(self.waiting.pop(0))
        if turn is not None:
            e, decoding, t0 = self.prefilling[turn], len(self.active), self.clock()
            self._prefill_pass(e)
            if e in self.prefilling:                # more of its prompt left: the decoding sequences are owed
                self.share.prefilled(self.clock() - t0, decoding)
        occupancy = self.occupancy                  # those in flight and those about to join
        level = {t: lv[level_at(lv, occupancy)] for t, lv in ((None, self.levels), *self.tasks.items())}
        for e in self.active:
            to = level.get(e.task, level[None])
            if e.decoding.follows_load and e.decoding.can_switch(to):
                e.decoding.switch(to)
        groups: dict[int, list[Entry]] = {}
        for e in self.active:
            groups.setdefault(id(e.pending.engine), []).append(e)
        views = [Group(k, len(es), self._rank.get(k, 0), max(e.waited for e in es),
                       any(e.first_token is None for e in es)) for k, es in groups.items()]
        served, t0 = 0, self.clock()
        for key in served_groups(views, self.max_wait):
            entries = groups.pop(key)
            for e in entries:
                e.waited = 0
            try:
                replies = self._serve([e.pending for e in entries])
            except Exception as err:  # noqa: BLE001 - a bug in a pass: end these sequences, keep the others
                for e in entries:
                    self._finish(e, err)
                continue
            served += len(entries)
            for e, reply in zip(entries, replies):
                self._resume(e, reply)
        for entries in groups.values():       # not served: they wait a tick more
            for e in entries:
                e.waited += 1
        self.share.decoded(self.clock() - t0)
        return served

    def run(self) -> None:
        """Tick until every sequence has ended."""
        while self.busy:
            self.tick()

    # ------------------------------------------------------------------------------------------ inside

    @staticmethod
    def _serve(passes: list[Pass]) -> list[object]:
        """The passes of one engine (each of another sequence) in one batched call each for the layers and the
        heads."""
        eng = passes[0].engine
        eng.advance_many([(p.state, p.boundary) for p in passes])
        out: list[object] = [None] * len(passes)
        picks = [i for i, p in enumerate(passes) if p.picks]
        if picks:
            for i, r in zip(picks, eng.picks_many([passes[i].read for i in picks])):
                out[i] = r
        greedy = [i for i, p in enumerate(passes) if p.greedy]
        if greedy:
            for i, t in zip(greedy, eng.greedy_ids_many([passes[i].read for i in greedy])):
                out[i] = t.tolist()
        sampled = [i for i, p in enumerate(passes) if not p.greedy and not p.picks and p.window is None]
        if sampled:
            for i, lg in zip(sampled, eng.logits_many([passes[i].read for i in sampled])):
                out[i] = lg
        windowed = [i for i, p in enumerate(passes) if p.window is not None]
        if windowed:
            got = eng.window_logits_many([passes[i].read for i in windowed], [passes[i].window for i in windowed])
            for i, lg in zip(windowed, got):
                out[i] = lg
        return out

    def _begin(self, e: Entry) -> None:
        self.prefilling.append(e)               # in flight from its prefill on
        if e.decoding.follows_load:  # the load it starts under: those in flight, it, and those waiting for a place
            e.decoding.switch(self.hierarchy_for(self.load, e.task))
        e.prefill = e.decoding.prefill_passes(defer_last=True)

    def _prefill_pass(self, e: Entry) -> None:
        """One pass of ``e``'s prefill; after its last, ``e`` decodes: run to its first pass."""
        try:
            e.computed = next(e.prefill)
            return                              # more of the prompt at a later tick
        except StopIteration:
            pass
        except Exception as err:  # noqa: BLE001 - a bug: end this sequence, keep the others
            self.prefilling.remove(e)
            self._finish(e, err)
            return
        self.prefilling.remove(e)
        self.active.append(e)
        try:
            e.steps = e.decoding.steps()
        except Exception as err:  # noqa: BLE001 - a bug: end this sequence, keep the others
            self._finish(e, err)
            return
        self._resume(e, None)

    def _resume(self, e: Entry, reply: object) -> None:
        """Run ``e`` to its next pass (reporting committed blocks) or its end."""
        try:
            while True:
                req = e.steps.send(reply)
                if isinstance(req, Committed):
                    if e.first_token is None:
                        e.first_token = time.perf_counter()
                    reply = e.on_tokens(req.tokens) is True if e.on_tokens is not None else False
                    continue
                e.pending = req
                return
        except StopIteration:
            self._finish(e, None)
        except Exception as err:  # noqa: BLE001 - a bug: end this sequence, keep the others
            self._finish(e, err)

    def _finish(self, e: Entry, err: BaseException | None) -> None:
        if e in self.active:
            self.active.remove(e)
        result = None
        try:
            if err is None:
                result = e.decoding.result()
        finally:
            e.decoding.close()
        if e.on_done is not None:
            e.on_done(result, err)


def generate_many(hierarchies: HSD | Mapping[int, HSD], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  max_active: int = 8, temperature: float = 0.0, top_p: float = 1.0,
                  seeds: Sequence[int] | None = None,
                  constraints: Sequence[Constraint | None] | None = None,
                  logprobs: int | None = None,
                  penalties: Sequence[Penalties | None] | None = None, top_k: int = 0,
                  min_p: float = 0.0) -> list[GenerationResult]:
    """Decode ``prompts`` together (at most ``max_active`` at once) and return their results in order;
    ``constraints``: each prompt's grammar state (or None); ``logprobs``: as :meth:`HSD.start`, for every prompt;
    ``penalties``: each prompt's (or None); ``top_k``, ``min_p``: as :meth:`HSD.start`, for every prompt.
    Raises the first error a sequence met, and :class:`HsdError` where ``seeds``, ``constraints`` or
    ``penalties`` do not give one entry per prompt."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise HsdError(f"prompts: expected a list of token id lists, got {type(prompts).__name__}")
    for name, per_prompt in (("seeds", seeds), ("constraints", constraints), ("penalties", penalties)):
        if per_prompt is None:
            continue
        if not isinstance(per_prompt, Sequence) or isinstance(per_prompt, (str, bytes)):
            raise HsdError(f"{name}: expected a list, one per prompt, got {type(per_prompt).__name__}")
        if len(per_prompt) != len(prompts):
            raise HsdError(f"{name}: expected one per prompt ({len(prompts)}), got {len(per_prompt)}")
    batch = Batch(hierarchies, max_active)
    results: list[GenerationResult | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    for i, p in enumerate(prompts):
        def done(res, err, i=i):
            results[i] = res
            if err is not None:
                errors.append(err)
        batch.add(p, max_new_tokens, temperature, top_p, seeds[i] if seeds is not None else 0, on_done=done,
                  constraint=constraints[i] if constraints is not None else None, logprobs=logprobs,
                  penalties=penalties[i] if penalties is not None else None, top_k=top_k, min_p=min_p)
    batch.run()
    if errors:
        raise errors[0]
    return results
