"""The serving scheduler's policy, as pure functions of what it decides on.

:class:`~hsd_opt.runtime.batch.Batch` runs this policy on its sequences and the load predictor
(:mod:`hsd_opt.measure.load_predictor`) runs it on priced ones, so the two cannot drift apart. A tick decides,
in this order:

1. whose prompt takes the tick's prefill pass (:func:`prefill_turn`): of the prompts being computed and the oldest
   waiting sequence (where fewer than ``max_active`` are in flight: :meth:`Occupancy.admits`), the one with the
   fewest positions left, so that a short prompt is not held behind a long one's passes; where that is a begun
   prompt's next pass while the decoding sequences are owed time (:class:`PrefillShare`: a long prompt's passes
   take at most a share of the time, so that they do not hold every decoding sequence to one token per pass), the
   oldest waiting sequence's first pass goes instead, or none (:func:`prompt_pass`);
2. the load level in force (:func:`level_at`): the plan level nearest, on a log scale, to the sequences in flight
   and those about to take a place (:attr:`Occupancy.load`);
3. which sequences take that level's hierarchy: one that follows the load and can take it for no more than a
   prefill's cost (the batch asks the sequence, the predictor its priced engines);
4. which groups of pending passes (one group per engine) are served (:func:`served_groups`).

The predictor prices a tick by the expected seconds per token of the hierarchies in use, not pass by pass, so it
runs steps 1 to 3 and not step 4 (what that leaves out: the module doc of the predictor); the batch keeps the
prompts' share with the seconds it measures, the predictor with those it prices. Units: sequence counts, ticks,
seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from hsd_opt.errors import HsdError
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


#: The share of the time a batch's prompts take at most while other sequences decode (:class:`PrefillShare`).
PREFILL_SHARE = 0.5


@dataclass
class PrefillShare:
    """How much of the time a long prompt's passes may take while sequences decode: after a pass of ``p`` seconds
    that leaves more of its prompt for later, with sequences decoding, ``p * (1 - share) / share`` seconds of
    decoding are owed to them before a begun prompt's next pass (``share`` 0.5: as long as the pass took), so a long
    prompt computed in many passes lets every decoding sequence go on at about ``1 - share`` of its speed instead of
    one token per pass. A prompt's first pass is never held, nor the target's last (:func:`prompt_pass`), and a
    pass that ends its prompt owes nothing, so a short prompt (one pass) is computed as soon as before and a stream
    of them does not hold a long one. With nothing decoding, prompts take every tick; ``share`` 1: a prompt pass
    every tick (prompts first). Which passes compute a prompt does not change (every sequence's numbers stay those
    of ``hsd run``), only when they run.

    Attributes:
        share: the share of the time, in (0, 1].
        owed: seconds of decoding owed before the next prompt pass.
    """

    share: float = PREFILL_SHARE
    owed: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and not isinstance(self.share, bool) and 0 < self.share <= 1):
            raise HsdError(f"--prefill-share: expected a number in (0, 1], got {self.share!r}")

    def due(self, decoding: int) -> bool:
        """Whether a begun prompt's next pass may run this tick, with ``decoding`` sequences decoding."""
        return decoding == 0 or self.owed <= 0.0

    def prefilled(self, seconds: float, decoding: int) -> None:
        """A pass that left more of its prompt for later took ``seconds`` while ``decoding`` sequences decoded (0:
        nothing is owed)."""
        self.owed = self.owed + seconds * (1.0 - self.share) / self.share if decoding else 0.0

    def decoded(self, seconds: float) -> None:
        """The decoding sequences' passes took ``seconds``."""
        self.owed = max(0.0, self.owed - seconds)


def prefill_turn(left: Sequence[int], next_waiting: int | None) -> int | None:
    """Whose prompt takes this tick's prefill pass: an index into ``left`` (the positions each prompt being computed
    has left, in the order they began), ``len(left)`` for the oldest waiting sequence (``next_waiting``: its prompt's
    positions; None where it may not begin), None for none. The fewest positions left first: a short prompt that
    arrives while a long one is computed goes before the long one's remaining passes (its first token after a pass or
    two, not after the whole long prompt), which resumes after it; a tie goes to the prompt begun first, the waiting
    one last, so a burst of equal prompts is computed one after the other in arrival order."""
    sizes = [*left, *([] if next_waiting is None else [next_waiting])]
    return min(range(len(sizes)), key=lambda i: (sizes[i], i)) if sizes else None


def prompt_pass(left: Sequence[int], next_waiting: int | None, share: PrefillShare, decoding: int,
                chunk: int) -> int | None:
    """Whose prompt takes this tick's pass, as :func:`prefill_turn` (same arguments), except that a begun prompt's
    next pass waits while the ``decoding`` sequences are owed time (``share``), unless the target's last pass is all
    that is left of it (``0 < left <= chunk``, the positions of a pass: e.g. the few positions of a conversation's
    next turn past a pass's end): the oldest waiting sequence's first pass goes instead where it may begin
    (``len(left)``), else none (None). A begun prompt with nothing left on the target (0) computes it on its other
    engines (a draft model's passes), and waits."""
    turn = prefill_turn(left, next_waiting)
    if turn is None or turn == len(left) or 0 < left[turn] <= chunk or share.due(decoding):
        return turn
    return len(left) if next_waiting is not None else None


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
