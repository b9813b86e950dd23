"""Deriving the seeds of many random streams from one user seed.

Wherever one run draws several independent streams (one per prompt, per turn, per context, per epoch), stream ``i``
of a run with seed ``s`` is seeded ``s * SEED_STRIDE + i`` (or ``s + k * SEED_STRIDE`` for turn ``k``): with
fewer than ``SEED_STRIDE`` streams, no two of them, in this run or in a run with another seed, share a seed.
"""

from __future__ import annotations

from hsd_opt.errors import HsdError

#: The stride between derived seeds: a prime above any count of streams one run draws (prompts, turns, positions).
SEED_STRIDE = 1_000_003

#: The seeds a random generator takes: any 64-bit integer, signed or not (``torch.Generator.manual_seed``).
SEED_RANGE = (-2**63, 2**64 - 1)


def seed_fits(seed: int) -> bool:
    """Whether a generator takes ``seed`` (:data:`SEED_RANGE`)."""
    return SEED_RANGE[0] <= seed <= SEED_RANGE[1]


def offset_seed(seed: int, k: int) -> int:
    """``seed + k`` (stream ``k`` of a run seeded ``seed``, e.g. a conversation's turn), taken modulo ``2**64`` where
    it leaves :data:`SEED_RANGE`: every ``k`` gets a seed a generator takes."""
    s = seed + k
    return s if seed_fits(s) else s % 2**64


def check_strided_seed(seed: int, what: str) -> None:
    """Refuse (an :class:`~hsd_opt.errors.HsdError` naming ``--seed``) a seed whose streams
    ``seed * SEED_STRIDE + i`` leave :data:`SEED_RANGE`; ``what`` says what those streams are ("the prompts")."""
    if not (seed_fits(seed * SEED_STRIDE) and seed_fits((seed + 1) * SEED_STRIDE)):
        raise HsdError(f"--seed: expected an integer of magnitude below {SEED_RANGE[1] // SEED_STRIDE // 2} (the "
                       f"seeds of {what} are seed * {SEED_STRIDE} + i), got {seed}")
