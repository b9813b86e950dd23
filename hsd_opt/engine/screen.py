"""Exact greedy tokens of a float32 LM head at a fraction of its cost: screen with an int8 copy, then compute
only the candidates.

A greedy decoder needs the argmax of the head's logits, not the logits. The int8 copy of the head (per-row scales)
reads a quarter of the bytes, against the activation in int16 with one scale per position (``hsd_screen_i16``:
exact int32 sums converted once per row and position). Its logits ``a_r`` are within a bound ``e_r`` of the float32
logits ``l_r`` that the kernels compute, for every row ``r``:

    |a_r - l_r| <= rho_r (|h| + delta) + |W_r| delta + margin_r

where ``rho_r = |Wq_r - W_r|`` (the row's quantization error, Euclidean norm), ``delta`` bounds ``|hq - h|`` (the
activation's quantization error: at most half a step per element, the step from its maximum and the int16
range, plus the rounding of ``x / step``) and ``margin_r`` covers float rounding in both computations (``mu
(|W_r| + rho_r)(|h| + delta)`` with ``mu`` the larger of 1e-4 and four times ``(d / 8 + 64)`` float32 roundings,
``d`` the hidden size: the 8-lane sums of the kernels round about ``d / 8`` times per lane, and each rounding errs
by at most ``2^-24`` of the sum of magnitudes, which is at most ``|W_r| |h|``; the int16 read's three roundings of
``a_r`` are far inside). Every row whose interval ``[a_r - e_r, a_r + e_r]`` reaches the highest lower bound is a
candidate; the row with the largest logit is always one of them, and a row left out has a logit below it. The
candidates' logits are then computed by the same float32 kernel operations as the full head
(:func:`~hsd_opt.engine.kernels.rows_f32`), so the argmax over them (first index on ties, as ``torch.argmax``) is
the argmax over the whole vocabulary, bit for bit.

Sampling by the largest of the logits plus noise (Gumbel-max) asks the same question of the logits plus offsets
(:meth:`HeadScreen.pick`): the candidates are the rows whose interval, shifted by their offset and widened for the
rounding of the sums, reaches the highest shifted lower bound. Sampling with top-k or min-p asks for the logits of a
window of each row's largest only (:meth:`HeadScreen.window`): every token that may be among the ``k`` largest, or
within a given distance of the largest, gets its exact logit, the others ``-inf``; the filtered distribution is the
same (the filters drop those tokens whatever their logits). Otherwise only for greedy decoding, and only where it
pays: passes over at most
:data:`MAX_POSITIONS` positions (batched decode steps and verify passes); a head
with a bias, non-finite values or a flat distribution (more than :data:`MAX_CANDIDATES` candidates) gets the full
logits. On SmolLM2-135M a decode position has two candidates (median).
Shapes: hidden ``[m, d]``, head ``[V, d]``; logits float32.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.weights import F32, GROUP, ROW_BLOCK, Mat, quantize_q8

#: Least relative allowance for float rounding in both head computations (see the module doc).
ROUNDING_MARGIN = 1e-4
#: Passes (or batched reads) over more positions compute the full logits (the int16 read, measured up to 16
#: positions, costs 0.4-0.6x the exact head there: docs/results.md, "the screen over 16 positions").
MAX_POSITIONS = 16
#: More candidates than this (a flat distribution) and the full logits are cheaper.
MAX_CANDIDATES = 1024
#: Allowance (logit units, times one plus the threshold's magnitude) by which :meth:`HeadScreen.window` lowers its
#: threshold: it covers the float32 rounding of the bounds plus offsets and of the filters' softmax, which compares
#: probabilities rather than logits (both far smaller).
WINDOW_SLACK = 1e-3
#: Logit units below a row's largest lower bound within which :meth:`HeadScreen.window` first looks for top-k's
#: ``k``-th largest (the whole row where fewer than ``k`` are there): a selection over a few hundred values
#: instead of the vocabulary.
WINDOW_REACH = 16.0


class HeadScreen:
    """The int8 screen of one float32 kernel head (``head``: a float32 :class:`~hsd_opt.engine.kernels.Mat`
    without bias). Holds the int8 copy (a quarter of the head's bytes, in :func:`~hsd_opt.engine.kernels.screen_i16`'s
    layout) and two norms per row."""

    def __init__(self, lib, head: Mat):
        if head.kind != F32 or head.bias is not None or head.cols % GROUP:
            raise ValueError("the screen takes a float32 head without bias, its width a multiple of 32")
        self.lib, self.head = lib, head
        w = head.tensors[0]
        # the int8 copy (quantize_q8's codes and scales) and the norms rho_r = |Wq_r - W_r|, |W_r|: in one pass of
        # the kernels (float64 sums), else here in float32, a block of rows at a time
        got = kernels.screen_codes(lib, w)
        if got is None:
            q8 = quantize_q8(w)
            codes, scale = q8.tensors[0], q8.tensors[1]
            rho, wnorm = torch.empty(w.shape[0]), torch.empty(w.shape[0])
            for a in range(0, w.shape[0], ROW_BLOCK):
                b = a + ROW_BLOCK
                rho[a:b] = torch.linalg.vector_norm(codes[a:b].float() * scale[a:b, None] - w[a:b], dim=1)
                wnorm[a:b] = torch.linalg.vector_norm(w[a:b], dim=1)
            packed = kernels.pack_screen_codes(codes)
        else:
            packed, scale, rho, wnorm = got
        #: the int8 copy's row scales ``[V]`` float32 (``w ~ code * scale``)
        self.scale = scale
        # float32 norms of d terms err by at most about 2 d roundings (relative); the products code * scale by one
        # rounding of |Wq_r| each, which adds at most 2^-24 (|W_r| + rho_r) to rho_r: both made upper bounds here
        # (the float64 norms of the kernels err far less: the same allowances bound them)
        up = 1 + 2 * head.cols * 2.0 ** -24
        wnorm = wnorm.double() * up
        rho = rho.double() * up + 2.0 ** -23 * (wnorm + rho.double())
        # e_r = rho_r (|h| + delta) + |W_r| delta + mu (|W_r| + rho_r)(|h| + delta), as
        # e_r = c_r (|h| + delta) + |W_r| delta; float32 (its rounding is far inside the margin)
        mu = max(ROUNDING_MARGIN, 4 * (head.cols / 8 + 64) * 2.0 ** -24)
        self.c = (rho * (1 + mu) + mu * wnorm).float()
        self.wnorm = wnorm.float()
        # the codes in the int16 read's layout (kernels.pack_screen_codes); the int16 range of the activation
        self.q16 = int(lib.hsd_screen_q16(head.cols))
        self.packed = packed

    def nbytes(self) -> int:
        """Bytes of the screen's int8 copy (codes and row scales)."""
        return self.packed.numel() + self.scale.numel() * 4

    def bounds(self, h: torch.Tensor) -> torch.Tensor:
        """``e`` ``[m, V]`` float32: the bound on ``|a_r - l_r|`` at each position of normed hidden ``h`` (computed
        by the kernels, as :meth:`argmax` computes it) for the screen logits of :meth:`logits`. Raises ValueError
        for ``h`` with values not finite."""
        e = kernels.screen_bounds(self.lib, h, self.c, self.wnorm, self.q16)
        if e is None:
            raise ValueError("the screen's bound needs finite hidden states")
        return e

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """The screen logits ``a`` ``[m, V]`` of the int8 copy at normed hidden ``h`` ``[m, d]`` float32, the
        activation quantized to int16 with one scale per position; None for ``h`` with values not finite."""
        return kernels.screen_i16(self.lib, self.packed, self.scale, self.head.rows, h)

    def pick(self, h: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
        """Ids ``[m]`` (int64) of ``argmax(linear(head, h) + offsets)`` (first index on ties) at normed hidden ``h``
        ``[m, d]``, from the screen logits ``a`` ``[m, V]`` of :meth:`logits` and finite ``offsets`` ``[m, V]``
        float32; None where the screen steps aside (more than :data:`MAX_CANDIDATES` candidates, values not
        finite): the caller computes the logits."""
        return kernels.screen_pick(self.lib, self.head, h.float().contiguous(), a, self.c, self.wnorm,
                                   MAX_CANDIDATES, self.q16, offsets=offsets)

    def row_values(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The head's logits at token ``ids`` (int64 ``[n]``) of the one normed hidden row ``h`` ``[1, d]``: ``[n]``
        float32, bit for bit the full head's (:func:`~hsd_opt.engine.kernels.rows_f32`)."""
        ids = ids.to(torch.long)
        return kernels.rows_f32(self.lib, self.head, ids, torch.zeros_like(ids), h)

    def window(self, h: torch.Tensor, a: torch.Tensor, top_k: int, below: float,
               offsets: torch.Tensor | None = None, pinned: Sequence[torch.Tensor] = (),
               reoffset: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits ``[m, V]`` float32 at normed hidden ``h`` ``[m, d]`` of the tokens that may lie in a window of
        each row's largest, every other ``-inf``: of ``logits + offsets`` (``offsets`` ``[m, V]`` float32, finite;
        zero when None), those that may be among the ``top_k`` largest (``top_k`` > 0) and no more than ``below``
        (logit units; ``inf``: no such limit) under the largest. Those tokens' values are exactly what
        ``linear(head, h)`` gives (:func:`~hsd_opt.engine.kernels.rows_f32`; the offsets are not added); a token
        left out is outside the window by its screen bound (``a`` ``[m, V]``: :meth:`logits`), less
        :data:`WINDOW_SLACK`. Row ``i``'s tokens ``pinned[i]`` (int64 ids) are moved by ``reoffset`` of their
        logits too (:class:`~hsd_opt.engine.interface.Window`): their logits are computed first, and their moved
        values stand for their bounds. With them the window's columns (int64, ascending: the tokens some row's
        window holds). None where the screen steps aside (values not finite, more than
        :data:`MAX_CANDIDATES` candidates at a position): the caller computes the logits."""
        if not 0 < top_k < a.shape[1] and below == torch.inf:
            return None
        h = h.float().contiguous()
        pins = None
        if any(ids.numel() for ids in pinned):
            vals = []
            for i, ids in enumerate(pinned):
                v = self.row_values(h[i:i + 1], ids) if ids.numel() else torch.zeros(0)
                vals.append(v + (reoffset(v) if offsets is None else offsets[i, ids] + reoffset(v)))
            pins = (torch.cat([torch.full((ids.numel(),), i, dtype=torch.long) for i, ids in enumerate(pinned)]),
                    torch.cat([ids.to(torch.long) for ids in pinned]), torch.cat(vals))
        return kernels.screen_window(self.lib, self.head, h, a, self.c, self.wnorm, self.q16, top_k, below,
                                     WINDOW_REACH, WINDOW_SLACK, MAX_CANDIDATES, offsets=offsets, pins=pins)

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """Greedy token ids ``[m]`` (int64) of the head at normed hidden ``h`` ``[m, d]``, equal to
        ``linear(head, h).argmax(-1)``; None when the screen does not apply (more than :data:`MAX_POSITIONS`
        positions or :data:`MAX_CANDIDATES` candidates, non-finite values): the caller computes the logits. The
        screen's logits come from the kernels' integer products (:meth:`logits`); the bounds, the candidates and
        their float32 logits from one kernel call (:func:`~hsd_opt.engine.kernels.screen_pick`)."""
        if h.shape[0] > MAX_POSITIONS:
            return None
        if h.shape[0] == 0:
            return torch.empty(0, dtype=torch.long)
        h = h.float().contiguous()
        # the logits go into a buffer kept per thread (kernels.scratch), read within this call only
        buf = kernels.scratch("screen_logits", MAX_POSITIONS * self.head.rows, torch.float32)
        a = kernels.screen_i16(self.lib, self.packed, self.scale, self.head.rows, h, out=buf)
        if a is None:
            return None
        return kernels.screen_pick(self.lib, self.head, h, a, self.c, self.wnorm, MAX_CANDIDATES, self.q16)
