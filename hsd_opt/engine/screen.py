"""Exact greedy tokens of a float32 LM head at a fraction of its cost: screen with an int8 copy, then compute
only the candidates.

A greedy decoder needs the argmax of the head's logits, not the logits. The int8 copy of the head (per-row
scales, int8 activations: the kernels' integer path) reads a quarter of the bytes, and its logits ``a_r`` are
within a bound ``e_r`` of the float32 logits ``l_r`` that the kernels compute, for every row ``r``:

    |a_r - l_r| <= rho_r (|h| + delta) + |W_r| delta + margin_r

where ``rho_r = |Wq_r - W_r|`` (the row's quantization error, Euclidean norm), ``delta`` bounds ``|hq - h|`` (the
activation's quantization error: at most half a step per element, from its group maxima) and ``margin_r`` covers
float rounding in both computations (``mu (|W_r| + rho_r)(|h| + delta)`` with ``mu`` the larger of 1e-4 and
four times ``(d / 8 + 64)`` float32 roundings, ``d`` the hidden size: the 8-lane sums of the kernels round
about ``d / 8`` times per lane, and each rounding errs by at most ``2^-24`` of the sum of magnitudes, which is at
most ``|W_r| |h|``). Every row whose interval ``[a_r - e_r, a_r + e_r]`` reaches the highest lower
bound is a candidate; the row with the largest logit is always one of them, and a row left out has a logit below
it. The candidates' logits are then computed by the same float32 kernel operations as the full head
(:func:`~hsd_opt.engine.kernels.rows_f32`), so the argmax over them (first index on ties, as ``torch.argmax``)
is the argmax over the whole vocabulary, bit for bit.

Only for greedy decoding (sampling needs every probability), and only where it pays: passes over at most
:data:`MAX_POSITIONS` positions (over more, the int8 integer path costs as much as the float32 head); a head
with a bias, non-finite values or a flat distribution (more than :data:`MAX_CANDIDATES` candidates) gets the full
logits. On SmolLM2-135M a decode step has about a dozen candidates and its head takes half the time.
Shapes: hidden ``[m, d]``, head ``[V, d]``; logits float32.
"""

from __future__ import annotations

import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.weights import F32, GROUP, ROW_BLOCK, Mat, quantize_q8

#: Least relative allowance for float rounding in both head computations (see the module doc).
ROUNDING_MARGIN = 1e-4
#: Passes (or batched reads) over more positions compute the full logits: the int8 head's integer products cost as
#: much as the float32 head's from 5 rows on (docs/results.md, "the screen for up to 4 rows").
MAX_POSITIONS = 4
#: More candidates than this (a flat distribution) and the full logits are cheaper.
MAX_CANDIDATES = 1024


class HeadScreen:
    """The int8 screen of one float32 kernel head (``head``: a float32 :class:`~hsd_opt.engine.kernels.Mat`
    without bias). Holds the int8 copy (a quarter of the head's bytes) and two norms per row."""

    def __init__(self, lib, head: Mat):
        if head.kind != F32 or head.bias is not None or head.cols % GROUP:
            raise ValueError("the screen takes a float32 head without bias, its width a multiple of 32")
        self.lib, self.head = lib, head
        w = head.tensors[0]
        self.q8 = quantize_q8(w)
        codes, scale = self.q8.tensors[0], self.q8.tensors[1]
        rho = torch.empty(w.shape[0])     # |Wq_r - W_r|
        wnorm = torch.empty(w.shape[0])   # |W_r|
        for a in range(0, w.shape[0], ROW_BLOCK):                   # float32, a block of rows at a time
            b = a + ROW_BLOCK
            rho[a:b] = torch.linalg.vector_norm(codes[a:b].float() * scale[a:b, None] - w[a:b], dim=1)
            wnorm[a:b] = torch.linalg.vector_norm(w[a:b], dim=1)
        # float32 norms of d terms err by at most about 2 d roundings (relative); the products code * scale by one
        # rounding of |Wq_r| each, which adds at most 2^-24 (|W_r| + rho_r) to rho_r: both made upper bounds here
        up = 1 + 2 * head.cols * 2.0 ** -24
        wnorm = wnorm.double() * up
        rho = rho.double() * up + 2.0 ** -23 * (wnorm + rho.double())
        # e_r = rho_r (|h| + delta) + |W_r| delta + mu (|W_r| + rho_r)(|h| + delta), as
        # e_r = c_r (|h| + delta) + |W_r| delta; float32 (its rounding is far inside the margin)
        mu = max(ROUNDING_MARGIN, 4 * (head.cols / 8 + 64) * 2.0 ** -24)
        self.c = (rho * (1 + mu) + mu * wnorm).float()
        self.wnorm = wnorm.float()

    def nbytes(self) -> int:
        return self.q8.nbytes()

    def bounds(self, h: torch.Tensor) -> torch.Tensor:
        """``e`` ``[m, V]`` float32: the bound on ``|a_r - l_r|`` at each position of normed hidden ``h`` (computed
        by the kernels, as :meth:`argmax` computes it). Raises ValueError for ``h`` with values not finite."""
        e = kernels.screen_bounds(self.lib, h, self.c, self.wnorm)
        if e is None:
            raise ValueError("the screen's bound needs finite hidden states")
        return e

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """Greedy token ids ``[m]`` (int64) of the head at normed hidden ``h`` ``[m, d]`` float32, equal to
        ``linear(head, h).argmax(-1)``; None when the screen does not apply (too many positions or candidates,
        non-finite values): the caller computes the logits. The screen's logits come from the kernels' integer
        path; the bounds, the candidates and their float32 logits from one kernel call
        (:func:`~hsd_opt.engine.kernels.screen_pick`)."""
        if h.shape[0] > MAX_POSITIONS:
            return None
        h = h.float().contiguous()
        a = kernels.linear(self.lib, self.q8, h)
        return kernels.screen_pick(self.lib, self.head, h, a, self.c, self.wnorm, MAX_CANDIDATES)
