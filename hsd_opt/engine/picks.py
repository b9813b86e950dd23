"""Rows of a pass's logits ready for draws by offsets: ``pick(i, offsets)`` is ``argmax(logits[i] + offsets)``
(first index on ties; each sum rounded to float32), without computing every logit where the head has an int8
screen.

The sampler draws a token by adding noise to the logits and taking the largest (the Gumbel-max form of sampling:
:func:`~hsd_opt.runtime.sampling.gumbel_offsets`); which token is largest is a greedy question, so the head's int8
screen (:mod:`hsd_opt.engine.screen`) answers it from about a quarter of the head's bytes, its bound widened for
the offsets' sums. Rows are picked one at a time: a verification draws row ``i + 1`` only when row ``i`` took its
draft. ``values(i, ids)`` gives a row's exact logits at a few tokens (offsets that depend on them: the repetition
penalty's). Shapes: logits and offsets ``[V]`` float32 per row.
"""

from __future__ import annotations

from typing import Callable

import torch

from hsd_opt.engine.screen import HeadScreen


class LogitPicks:
    """Picks over logits already computed (``logits`` ``[m, V]`` float32)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.rows = logits.shape[0]

    def pick(self, i: int, offsets: torch.Tensor) -> int:
        """``argmax(logits[i] + offsets)`` (first index on ties)."""
        return int(torch.argmax(self.logits[i] + offsets.to(self.logits.device)))

    def values(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s logits at token ``ids`` (int64 ``[n]``): ``[n]`` float32 on the CPU."""
        return self.logits[i, ids.to(self.logits.device)].float().cpu()


class ScreenPicks:
    """Picks through a head's int8 screen: ``normed`` ``[m, d]`` the normed hidden states of the rows, ``a``
    ``[m, V]`` their screen logits (:meth:`HeadScreen.logits`), ``full_row(i)`` row ``i``'s logits ``[V]`` as
    the head computes them (for a row the screen leaves: a flat distribution, values not finite)."""

    def __init__(self, screen: HeadScreen, normed: torch.Tensor, a: torch.Tensor,
                 full_row: Callable[[int], torch.Tensor]):
        self.screen, self.normed, self.a, self.full_row = screen, normed, a, full_row
        self.rows = a.shape[0]

    def pick(self, i: int, offsets: torch.Tensor) -> int:
        """``argmax(logits[i] + offsets)`` (first index on ties), the logits of the head's own kernels."""
        got = self.screen.pick(self.normed[i:i + 1], self.a[i:i + 1], offsets[None])
        if got is not None:
            return int(got[0])
        return int(torch.argmax(self.full_row(i) + offsets))

    def values(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s logits at token ``ids`` (int64 ``[n]``), bit for bit the head's
        (:meth:`~hsd_opt.engine.screen.HeadScreen.row_values`): ``[n]`` float32."""
        return self.screen.row_values(self.normed[i:i + 1], ids)
