"""Sampling and verification, apart from the decoding that uses them (as vLLM's v1 keeps its rejection sampler
apart from its proposers): logits to the sampling distribution (temperature, top-p), one draw, the lossless
rejection sampler of speculative decoding (Algorithm 2 of the HSD paper, "Hierarchical Speculative Decoding",
arXiv 2510.19705), and the noise of a draw by the largest of the logits plus noise (Gumbel-max:
:func:`gumbel_offsets`, which the engine's picks take). Greedy verification is a comparison of token ids and lives
in the decoding itself.

Used by :class:`~hsd_opt.runtime.decode.Decoding` and by the profiler (which times them as the runtime runs them).
Shapes: ``V`` the vocabulary; probabilities float32.
"""

from __future__ import annotations

import math

import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.interface import Window
from hsd_opt.errors import HsdError
from hsd_opt.runtime.arguments import check_filters


def process_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                   min_p: float = 0.0) -> torch.Tensor:
    """Logits ``[m, V]`` -> probabilities ``[m, V]`` (float32): in the order of HF ``generate``'s warpers, top-k
    (``top_k`` > 0: the ``k`` largest logits, :func:`top_k_columns`; every other token 0), then
    softmax(logits / temperature) over what is kept, then, each renormalising, top-p (nucleus: the smallest set of
    most probable tokens whose mass reaches ``top_p``, at least one) and min-p (``min_p`` > 0: the tokens at least
    ``min_p`` times as probable as the most probable one). With top-k the softmax and the later filters run over
    the ``k`` tokens alone (the same distribution as softmax over the row, cut to its ``k`` largest and
    renormalised, without a pass of ``exp`` over the vocabulary).

    The nucleus is found among the ``k`` most probable tokens (``torch.topk``, k = 64, 256, ... until their mass
    reaches ``top_p``; a full sort only when it never does), which gives the same probabilities as sorting the
    whole vocabulary — the same values in the same order, the same cumulative sums — at a fraction of its cost; of
    tokens equal in probability at the nucleus' edge the lower columns are kept, as the kernels keep them. The
    mass before each token is summed in float64 (a float32 running sum over a nucleus of hundreds of tokens can end
    it a token early or late).

    A temperature so small that ``logits / temperature`` overflows (a row's softmax is then not a number) gives that
    row softmax's limit as the temperature goes to 0: the same weight on each of its largest logits. A row whose
    logits are not numbers, or all ``-inf`` (every token masked), is an :class:`HsdError`, and so is a
    ``temperature`` below 0 or not finite, a ``top_p`` outside (0, 1], a ``top_k`` not an integer >= 0 or a
    ``min_p`` outside [0, 1]."""
    check_filters(temperature, top_p, top_k, min_p)
    x, kept = logits.float(), None
    if 0 < top_k < x.shape[-1]:
        kept = top_k_columns(x, top_k)
        x = x.gather(-1, kept)
    p = torch.softmax(x / temperature, dim=-1)
    bad = torch.isnan(p[..., 0])
    if bool(bad.any()):
        top = x[bad]
        most = top.max(-1, keepdim=True).values
        if bool(torch.isneginf(most).any()):
            raise HsdError("sampling: every token of a row is masked (no token is allowed)")
        top = (top == most).float()
        if not bool((top.sum(-1) > 0).all()):
            raise HsdError("sampling: the logits hold values that are not numbers")
        p[bad] = top / top.sum(-1, keepdim=True)
    if top_p < 1.0:
        v = p.shape[-1]
        k = min(64, v)
        while True:
            sp = (torch.topk(p, k, dim=-1) if k < v else torch.sort(p, dim=-1, descending=True)).values
            cum = sp.cumsum(-1, dtype=torch.float64)  # the mass so far, exact to float64 over thousands of tokens
            if k >= v or bool((cum[..., -1] >= top_p).all()):
                break
            k = min(4 * k, v)
        drop = (cum - sp) >= top_p  # mass strictly before this token already reaches top_p
        drop[..., 0] = False        # the most probable token stays (a top_p that rounds to 0 in float32 too)
        p = p.masked_fill(~_nucleus(p, sp, (~drop).sum(-1, keepdim=True)), 0.0)
        p = p / p.sum(-1, keepdim=True)
    if min_p > 0.0:
        p = p.masked_fill(p < min_p * p.max(-1, keepdim=True).values, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if kept is not None:
        p = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, kept, p)
    return p


def _nucleus(p: torch.Tensor, sp: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Which tokens of rows ``p`` ``[m, V]`` a nucleus of ``n`` (``[m, 1]``) tokens keeps, given the rows' largest
    probabilities in descending order ``sp`` (``[m, >= n]``): those above the ``n``-th largest, and among those equal
    to it the lower columns, as the kernels' filters keep them (``torch.topk``'s order among equal values is any;
    how many are kept does not depend on it, the cumulative sums being the same)."""
    least = sp.gather(-1, n - 1)
    above = p > least
    tied = p == least
    return above | (tied & (tied.cumsum(-1) <= n - above.sum(-1, keepdim=True)))


def top_k_columns(x: torch.Tensor, k: int) -> torch.Tensor:
    """The columns of each row's ``k`` largest values (``x`` ``[..., V]``, ``0 < k < V``): int64 ``[..., k]``,
    ascending. Among values equal to the ``k``-th largest, the lower columns, as the kernels' filters keep them
    (``torch.topk`` keeps any), so that a row's filtered distribution does not depend on which path read it."""
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    above = x > kth
    tied = x == kth
    keep = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    if not bool((keep.sum(-1) == k).all()):     # values that are not numbers: as topk has them (refused later)
        return torch.topk(x, k, dim=-1).indices
    return keep.nonzero()[:, -1].view(*x.shape[:-1], k)


#: The highest temperature drawn by noise: the offsets ``T g`` (``g`` up to about 16.6) stay finite in float32 (which
#: ends at 3.4e38). Hotter draws go through the distribution (uniform over the vocabulary to float32's precision).
MAX_NOISE_TEMPERATURE = 1e30


def unfiltered(temperature: float, top_p: float, top_k: int, min_p: float) -> bool:
    """Sampling (``temperature`` > 0, at most :data:`MAX_NOISE_TEMPERATURE`) without top-p, top-k or min-p: the
    whole ``softmax(logits / T)``, which a draw by noise (:func:`gumbel_offsets` added to the logits, the largest
    taken) reproduces without computing it."""
    return 0 < temperature <= MAX_NOISE_TEMPERATURE and top_p >= 1.0 and top_k == 0 and min_p == 0.0


def filter_window(temperature: float, top_p: float, top_k: int, min_p: float, vocab: int) -> Window | None:
    """The window of each row's largest logits that sampling at ``temperature`` (> 0) with these filters keeps, or
    None where it needs every logit: top-k keeps the ``k`` largest (a ``k`` of the whole ``vocab`` or more: no
    such filter); min-p those within ``T ln(1 / min_p)`` of the largest (``p >= min_p * max p``), with top-p 1 only
    (top-p after top-k needs the ``k`` tokens; without top-k, the whole distribution's mass)."""
    k = top_k if 0 < top_k < vocab else 0
    below = -temperature * math.log(min_p) if min_p > 0 and top_p >= 1.0 else math.inf
    return None if k == 0 and below == math.inf else Window(k, below)


def window_columns(logits: torch.Tensor) -> torch.Tensor:
    """The columns of rows ``[m, V]`` that some row holds above ``-inf`` (int64, ascending): one reduction over the
    rows, then one comparison a column (a fifth of ``isfinite(...).any(0)``'s time at 5 rows)."""
    return (logits.amax(dim=0) > float("-inf")).nonzero()[:, 0]


def window_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float,
                 cols: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`process_logits` of rows ``[m, V]`` read through a :func:`filter_window` (every logit outside the
    window ``-inf``): the filters run over the columns some row holds (``cols``, int64 ascending, as the engine
    returned them; None: :func:`window_columns`), probability 0 elsewhere (a tie at top-k's ``k``-th place broken
    among them). On the CPU with the kernels, a window that leaves some column out goes through their filters
    (:func:`~hsd_opt.engine.kernels.filter_probs`: one call, where ``process_logits`` is a score of small
    operations, each slow on data and code the model's weights have just pushed out of the caches; among equal
    logits at top-k's ``k``-th place the lower column); rows that hold every column (the engine read every logit)
    through ``process_logits``, whose selections suit a whole vocabulary."""
    if cols is None:
        cols = window_columns(logits)
    x = logits[:, cols]
    lib = kernels.load() if logits.device.type == "cpu" and cols.numel() < logits.shape[1] else None
    kept = None
    if lib is not None and kernels.has(lib, "hsd_filter_probs"):
        kept = kernels.filter_probs(lib, x, temperature, top_p, top_k, min_p)
    p = torch.zeros_like(logits)
    p[:, cols] = process_logits(x, temperature, top_p, top_k, min_p) if kept is None else kept
    return p


def filtered_probs(logits: torch.Tensor, cols: torch.Tensor | None, temperature: float, top_p: float, top_k: int,
                   min_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampling distribution of rows ``[m, V]`` as a read gave them, and its support: through a window
    (``cols``: the columns its rows hold, :class:`~hsd_opt.engine.interface.WindowLogits`), :func:`window_probs`
    over those columns, which are the support; every logit read (``cols`` None), :func:`process_logits` of the
    rows, support None (every column)."""
    if cols is None:
        return process_logits(logits, temperature, top_p, top_k, min_p), None
    return window_probs(logits, temperature, top_p, top_k, min_p, cols), cols


def sample_token(p: torch.Tensor, generator: torch.Generator, support: torch.Tensor | None = None) -> int:
    """One draw from the distribution ``p`` ``[V]`` (non-negative weights with a positive sum, not necessarily
    normalised), by inverting its cumulative sum: the first index whose running sum (float64) exceeds ``u`` times
    the total, ``u`` uniform in [0, 1). A token of weight 0 is never drawn (its running sum equals the one before
    it). The same distribution as ``torch.multinomial(p, 1)``, at a small fraction of its time on a large
    vocabulary (one cumulative sum instead of its checks and set-up: about 0.08 ms against 1.2 ms for 49,152
    tokens on this project's CPU). ``support``: the columns outside which ``p`` is 0 (int64, ascending; None:
    every column). The sum then runs over them alone and gives the same running sums at them (a weight of 0 adds
    nothing): the same token for the same ``generator``."""
    if support is not None:
        return int(support[sample_token(p[support], generator)])
    c = torch.cumsum(p, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    if i >= p.shape[0]:  # u rounded up to the total: the last token of positive weight
        i = int(torch.nonzero(p > 0)[-1])
    return i


#: The least uniform draw of :func:`gumbel_offsets` (a draw of 0 would give an infinite offset): half of
#: ``torch.rand``'s float32 step.
LEAST_UNIFORM = 2.0 ** -25


def gumbel_offsets(vocab: int, generator: torch.Generator, temperature: float,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Offsets ``[vocab]`` float32 for one draw by the Gumbel-max form of sampling: ``temperature * g`` with ``g``
    standard Gumbel noise (``-log(-log u)``, ``u`` uniform on float32's 24-bit grid, at least
    :data:`LEAST_UNIFORM`), so that ``argmax(logits + offsets)`` is a draw from ``softmax(logits / temperature)``
    (the largest of ``logits / temperature + g`` is that draw; multiplying by the temperature keeps the argmax).
    ``g`` lies between about -2.85 and 16.6: every offset is finite, and a token whose probability is below
    ``exp(-19.5)`` (about 3e-9) times the most likely token's is never drawn. Only for sampling without top-p
    (the nucleus needs every probability).

    On the CPU where the kernels load with vector instructions (AVX2, NEON), the noise is theirs
    (:func:`~hsd_opt.engine.kernels.gumbel`: uniforms from splitmix64 keyed by one 64-bit draw of ``generator``,
    their logarithms vectorized, over torch's threads), a fraction of the time of ``torch.rand``'s Mersenne twister
    and two ``torch.log``; elsewhere ``torch.rand`` from ``generator`` and ``torch.log``. Either way ``generator``
    alone decides the noise: a seed repeats a run on the same machine, though not between the two sources."""
    if torch.device(device).type == "cpu":
        lib = kernels.load()
        if kernels.makes_noise(lib):
            key = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), generator=generator)) & (2 ** 64 - 1)
            return kernels.gumbel(lib, key, vocab, temperature)
    return torch_gumbel_offsets(vocab, generator, temperature, device)


def torch_gumbel_offsets(vocab: int, generator: torch.Generator, temperature: float,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`gumbel_offsets` from ``torch.rand`` (``vocab`` uniforms of ``generator``) and ``torch.log``: its
    source off the CPU, on the portable build or without the kernels."""
    u = torch.rand(vocab, generator=generator, device=device).clamp_min_(LEAST_UNIFORM)
    return u.log_().neg_().log_().neg_().mul_(temperature)


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], generator: torch.Generator,
                     residual: bool = True, support: torch.Tensor | None = None) -> tuple[int, int]:
    """Verify ``d`` drafts by rejection sampling: ``p`` ``[d+1, V]`` the verifier's probabilities at the drafts'
    positions and one past, ``q`` ``[d, V]`` the drafter's (None: one-hot, a token drafter). Draft ``i`` is accepted
    with probability ``min(1, p_i(x_i) / q_i(x_i))``, in order; at the first rejection the token is drawn from the
    residual ``max(0, p - q)`` (renormalised), after ``d`` acceptances a bonus token from ``p[d]``. The output
    then has ``p``'s distribution, whatever ``q`` is. ``residual=False`` draws the correction from ``p`` instead: a
    deliberately wrong sampler, for the statistical test that must reject it. ``support``: the columns outside
    which every row of ``p`` is 0 (int64, ascending; None: every column), where the correction or bonus token is
    drawn (the residual is 0 wherever ``p`` is: the same draw, over fewer columns). Returns (accepted count, the
    corrected or bonus token)."""
    d = len(drafts)
    x = torch.tensor(drafts, dtype=torch.long, device=p.device)
    ar = torch.arange(d, device=p.device)
    px = p[ar, x]
    qx = q[ar, x] if q is not None else torch.ones_like(px)
    u = torch.rand(d, generator=generator, device=p.device)
    ok = (u * qx < px).tolist()  # u < p/q  <=>  accept with probability min(1, p/q)
    j = 0
    while j < d and ok[j]:
        j += 1
    if j == d:
        return j, sample_token(p[d], generator, support)
    if not residual:
        return j, sample_token(p[j], generator, support)
    cols = slice(None) if support is None else support
    if q is not None:
        r = (p[j, cols] - q[j, cols]).clamp_(min=0.0)
    else:
        r = p[j, cols].clone()
        r[drafts[j] if support is None else support == drafts[j]] = 0.0
    if float(r.sum()) <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
        r = p[j, cols]
    i = sample_token(r, generator)
    return j, i if support is None else int(support[i])
