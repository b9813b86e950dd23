"""The serving scheduler's policy, as pure functions of what it decides on.

:class:`~hsd_opt.runtime.batch.Batch` runs this policy on its sequences and the load predictor
(:mod:`hsd_opt.measure.load_predictor`) runs it on priced ones, so the two cannot drift apart. A tick decides,
in this order:

1. whose prompt takes the tick's prefill pass (:func:`prefill_turn`): of the prompts being computed and the oldest
   waiting sequence (where fewer than ``max_active`` are in flight: :meth:`Occupancy.admits`), the one with the
   fewest positions left, so that a short prompt is not held behind a long one's passes;
2. the load level in force (:func:`level_at`): the plan level nearest, on a log scale, to the sequences in flight
   and those about to take a place (:attr:`Occupancy.load`);
3. which sequences take that level's hierarchy: one that follows the load and can take it for no more than a
   prefill's cost (the batch asks the sequence, the predictor its priced engines);
4. which groups of pending passes (one group per engine) are served (:func:`served_groups`).

The predictor prices a tick by the expected seconds per token of the hierarchies in use, not pass by pass, so it
runs steps 1 to 3 and not step 4 (what that leaves out: the module doc of the predictor). Units: sequence counts
and ticks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from hsd_opt.formats import nearest_level


@dataclass(frozen=True)
class Occupancy:
    """How many sequences a batch holds, by state.

    Attributes:
        decoding: sequences decoding (their prompt computed).
        prefilling: sequences whose prompt is being computed (begun, a pass per tick among them).
        waiting: sequences added and not yet in flight.
        max_active: sequences decoded together at most.
    """

    decoding: int
    prefilling: int
    waiting: int
    max_active: int

    @property
    def in_flight(self) -> int:
        """Sequences decoding or being prefilled."""
        return self.decoding + self.prefilling

    @property
    def load(self) -> int:
        """Sequences in flight and those that take a free place next (the load a level is chosen for)."""
        return self.in_flight + max(0, min(self.waiting, self.max_active - self.in_flight))

    def admits(self) -> bool:
        """Whether the oldest waiting sequence may begin its prompt now (a place is free for it)."""
        return self.waiting > 0 and self.in_flight < self.max_active


def prefill_turn(left: Sequence[int], next_waiting: int | None) -> int | None:
    """Whose prompt takes this tick's prefill pass: an index into ``left`` (the positions each prompt being computed
    has left, in the order they began), ``len(left)`` for the oldest waiting sequence (``next_waiting``: its prompt's
    positions; None where it may not begin), None for none. The fewest positions left first: a short prompt that
    arrives while a long one is computed goes before the long one's remaining passes (its first token after a pass or
    two, not after the whole long prompt), which resumes after it; a tie goes to the prompt begun first, the waiting
    one last, so a burst of equal prompts is computed one after the other in arrival order."""
    sizes = [*left, *([] if next_waiting is None else [next_waiting])]
    return min(range(len(sizes)), key=lambda i: (sizes[i], i)) if sizes else None


def level_at(levels: Iterable[int], occupancy: Occupancy) -> int:
    """The load level in force at ``occupancy``: :func:`~hsd_opt.formats.nearest_level` of its load."""
    return nearest_level(levels, occupancy.load)


@dataclass(frozen=True)
class Group:
    """The pending passes of one engine, as the scheduler sees them.

    Attributes:
        key: the engine (any hashable that names it).
        size: sequences waiting for a pass of it.
        rank: the engine's lowest level in the hierarchies (drafters before the target).
        waited: the most ticks any of those sequences has waited for it.
        first_token: whether one of them waits for its first token (its prompt's last pass).
    """

    key: Hashable
    size: int
    rank: int
    waited: int
    first_token: bool


def served_groups(groups: Sequence[Group], max_wait: int) -> list[Hashable]:
    """The keys of the groups served this tick, in the order given: the largest group (on a tie, the engine
    lowest in the hierarchies, so that sequences behind catch up), every group with a sequence that has waited
    ``max_wait`` ticks (sequences fall into step and share passes), and every group with a request's first token
    (it waits for no one's drafts). Empty without groups."""
    if not groups:
        return []
    first = min(groups, key=lambda g: (-g.size, g.rank)).key
    return [g.key for g in groups if g.key == first or g.waited >= max_wait or g.first_token]
