"""What a solver returns and the rules every solver shares (`docs/design.md#the-graph`,
`docs/design.md#depth-and-min-gain`).

Plain functions over a :class:`~hsd_opt.formats.Profile`; the bottom of the solver's imports (it imports no other
solver module):

- :class:`Solution`: a hierarchy (cheapest first, target last), its budgets (tokens) and latency (seconds per
  token);
- :func:`cost_order`: drafters are ordered by ``(cost, list index)``, and a hierarchy is strictly cheaper going
  down in that order; :func:`source_candidates`: the drafters the target may verify directly;
- :func:`drafter_limit`: ``max_depth`` (models, target included) as a number of drafters;
- :func:`pick_by_min_gain`: the plan chosen from the optima per depth when a deeper level must pay for itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile
from hsd_opt.values import is_integer


@dataclass
class Solution:
    """A hierarchy (cheapest first, target last), its budgets (tokens) and latency (seconds per token)."""

    latency: float
    hierarchy: list[str]
    budgets: list[int]
    info: dict = field(default_factory=dict)


def cost_order(profile: Profile) -> list[str]:
    """All model names ordered by ``(cost, list index)``: cheapest first."""
    idx = {m.name: i for i, m in enumerate(profile.models)}
    return sorted(profile.names, key=lambda n: (profile.entry(n).cost, idx[n]))


def source_candidates(profile: Profile) -> list[str]:
    """Drafters the target may verify directly: before the target in :func:`cost_order`, acceptance measured."""
    order = cost_order(profile)
    K = profile.target
    return [n for n in order[: order.index(K)] if profile.accept(n, K) is not None]


def check_max_depth(max_depth: int | None) -> None:
    """Raise :class:`HsdError` unless ``max_depth`` is None or an integer >= 1 (models including the target)."""
    if max_depth is not None and (not is_integer(max_depth) or max_depth < 1):
        raise HsdError(f"--max-depth: expected an integer >= 1 (models including the target), got {max_depth!r}")


def drafter_limit(n_drafters: int, max_depth: int | None) -> int:
    """Most drafters below the target: ``max_depth - 1`` capped at ``n_drafters`` (all of them when None)."""
    check_max_depth(max_depth)
    if max_depth is None:
        return n_drafters
    return min(n_drafters, int(max_depth) - 1)


def pick_by_min_gain(by_depth: Sequence[Solution], min_gain: float) -> Solution:
    """The plan chosen by the min-gain rule (`docs/design.md#depth-and-min-gain`).

    ``by_depth[0]`` is the optimum with at most 2 models (one drafter and the target, or the target alone when no
    single draft beats it: no margin there), ``by_depth[1]`` with at most 3, and so on. Going deeper, a plan
    replaces the one chosen so far only if its latency is at most ``(1 - min_gain)`` times the chosen one's.
    """
    chosen = by_depth[0]
    for s in by_depth[1:]:
        if s.latency <= chosen.latency * (1.0 - min_gain):
            chosen = s
    return chosen
