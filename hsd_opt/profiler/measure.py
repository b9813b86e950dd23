"""What the profiler measures on one prompt: the target's continuation and every drafter's distribution at
every generated position, reduced to per-position acceptance and greedy agreement for every pair.

For each prompt of the suite:

1. the target generates a continuation with its own layered engine (greedy at ``temperature == 0``, else
   sampling with a seeded generator from the runtime's processed distribution: ``softmax(logits / T)``, then
   top-p, :func:`~hsd_opt.runtime.sampling.process_logits`), stopping at EOS or ``max_new_tokens``;
2. ONE teacher-forced pass over prompt + continuation keeps the residual stream at every exit boundary
   (:meth:`LayeredLM.hidden_states`); draft models and quantized copies run their own pass;
3. in chunks of ``chunk`` positions, each drafter's next-token distribution at every generated position is
   computed (exit head -> ``softmax(logits / T)`` then top-p, as speculative sampling sees it at every level; at
   ``T == 0`` the plain ``softmax(logits)`` is used for the acceptance and ``argmax`` for greedy agreement), and
   for every pair the per-position ``sum_x min(p_i(x), p_j(x))`` and argmax agreement are computed. Only
   ``[N, chunk, V]`` probabilities exist at a time; nothing vocab-sized is kept across chunks;
4. token drafters propose one token at every generated position from the true context (``reset`` with the
   prompt, ``observe`` fed the true continuation as it goes, as at run time); their acceptance against
   verifier j is ``p_j(proposal)`` and agreement is ``proposal == argmax p_j``.

Under a grammar (a prompt with a JSON schema) the continuation is the masked target's, every drafter's logits are
masked with the grammar's row at each position before the steps above (the masked models decoding compares), a
token drafter's refused proposal counts as no proposal (decoding cuts it), and the positions where the grammar
allows one token only are left out: decoding takes those without drafting or a pass, so they are counted apart.

See ``docs/design.md#acceptance-statistics``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hsd_opt.grammar.constraint import mask_logits
from hsd_opt.profiler.pool import NeuralDrafter
from hsd_opt.runtime.sampling import process_logits, sample_token


@torch.no_grad()
def generate(eng, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float, eos: set[int],
             generator: torch.Generator | None = None, top_p: float = 1.0, constraint=None, top_k: int = 0,
             min_p: float = 0.0) -> list[int]:
    """The target's continuation of ``prompt_ids`` (greedy at T = 0, else sampled from the distribution processed
    with ``temperature`` and the filters ``top_k``, ``top_p``, ``min_p``), up to and including an EOS token; with
    ``constraint`` (a :class:`~hsd_opt.grammar.constraint.Constraint`) the masked target's."""
    n = eng.n_layers
    st = eng.new_state(len(prompt_ids) + max_new_tokens + 1)
    eng.append(st, list(prompt_ids))
    out: list[int] = []
    for _ in range(max_new_tokens):
        eng.advance(st, n)
        logits = eng.logits(st, n, st.n - 1, st.n)[0]
        if constraint is not None:
            logits = mask_logits(logits[None], constraint.allowed(out, len(out))[None])[0]
        if temperature > 0:
            probs = process_logits(logits[None], temperature, top_p, top_k, min_p)[0]
            tok = sample_token(probs.cpu(), generator)
        else:
            tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
        eng.append(st, [tok])
    return out


def exit_logits(neural: Sequence[NeuralDrafter], hidden: dict, rows: torch.Tensor) -> list[torch.Tensor]:
    """Float32 logits ``[m, V]`` of every drafter at ``rows``. Exits that share their model's own final norm +
    LM head (a quantized copy: its quantized head) are computed in ONE matmul over all their rows (the LM head's
    weights are read once instead of once per exit); trained exit heads are applied one by one."""
    out: list[torch.Tensor | None] = [None] * len(neural)
    groups: dict[int, list[int]] = {}
    for k, nd in enumerate(neural):
        if nd.boundary in nd.engine.exit_heads:
            h = hidden[id(nd.engine)][nd.boundary][rows.to(nd.engine.device)]
            out[k] = nd.engine.head(h, nd.boundary)
        else:
            groups.setdefault(id(nd.engine), []).append(k)
    for ks in groups.values():
        eng = neural[ks[0]].engine
        hs = torch.cat([hidden[id(eng)][neural[k].boundary][rows.to(eng.device)] for k in ks])
        lg = eng.head(hs, neural[ks[0]].boundary)   # the model's own head (none of these has a trained one)
        m = rows.numel()
        for n, k in enumerate(ks):
            out[k] = lg[n * m:(n + 1) * m]
    return out  # type: ignore[return-value]


def pairwise_overlap(P: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """``out[i, j, p] = sum_x min(P[i, p, x], P[j, p, x])`` for ``i < j`` (zeros elsewhere); ``P`` is ``[N, m, V]``.

    Computed in vocabulary blocks of ``block`` columns into a reused buffer, so the ``[N, m, block]`` temporaries
    stay in cache (the sum is the same up to float32 summation order)."""
    N, m, V = P.shape
    out = torch.zeros(N, N, m, dtype=torch.float32, device=P.device)
    if N < 2:
        return out
    buf = torch.empty(N - 1, m, min(block, V), dtype=P.dtype, device=P.device)
    for v0 in range(0, V, block):
        Pb = P[:, :, v0:v0 + block].contiguous()
        b = Pb.shape[-1]
        for i in range(N - 1):
            o = buf[: N - i - 1, :, :b]
            torch.minimum(Pb[i:i + 1], Pb[i + 1:], out=o)
            out[i, i + 1:] += o.sum(-1, dtype=torch.float32)
    return out


def _probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
           min_p: float = 0.0) -> torch.Tensor:
    """Probabilities ``[m, V]`` a drafter's logits stand for: the runtime's processing at ``temperature > 0``
    (temperature, then top-k, top-p, min-p), the plain ``softmax(logits)`` at 0."""
    if temperature > 0:
        return process_logits(logits, temperature, top_p, top_k, min_p)
    return torch.softmax(logits, dim=-1)


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether the grammar's ``row`` ``[V]`` allows ``token`` (an id past it is refused)."""
    return 0 <= token < row.numel() and bool(row[token])


def _masked(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[m, W]`` masked with the grammar's ``rows`` ``[m, V]``; a model whose head is wider or narrower
    than the target's (the same tokenizer) has its extra ids refused, its missing ones ignored."""
    W, V = logits.shape[1], rows.shape[1]
    if W != V:
        rows = rows[:, :W] if W < V else torch.cat([rows, rows.new_zeros(rows.shape[0], W - V)], 1)
    return mask_logits(logits, rows)


@torch.no_grad()
def profile_sequence(neural: Sequence[NeuralDrafter], token_drafters: Sequence, prompt_ids: Sequence[int],
                     continuation: Sequence[int], temperature: float, chunk: int = 16, top_p: float = 1.0,
                     allowed: torch.Tensor | None = None, forced: np.ndarray | None = None, top_k: int = 0,
                     min_p: float = 0.0):
    """Per-position statistics of one prompt + continuation (see the module doc).

    Returns ``(acc_nn [N, N, G], agree_nn [N, N, G], acc_tn [T, N, G], agree_tn [T, N, G], propose_seconds[T])``
    as numpy arrays (``i < j`` filled for the neural ones), ``G = len(continuation)``; ``acc_tn`` is NaN (and
    ``agree_tn`` False) at positions where a token drafter abstained. Under a grammar: ``allowed`` ``[G, V]``
    (bool) its row at each generated position, ``forced`` ``[G]`` (bool) where it allows one token only; those
    positions are left out, so ``G`` is then the number of the others, and ``propose_seconds`` the seconds of
    each token drafter's ``propose`` calls at them (decoding asks no drafter where the grammar forces the token).
    """
    out = _sequence_stats(neural, token_drafters, prompt_ids, continuation, temperature, chunk, top_p, allowed,
                          top_k, min_p, forced)
    if forced is None or not forced.any():
        return out
    keep = ~np.asarray(forced, dtype=bool)
    return (*(a[..., keep] for a in out[:4]), out[4])


def _sequence_stats(neural, token_drafters, prompt_ids, continuation, temperature, chunk, top_p, allowed, top_k,
                    min_p, forced=None):
    """:func:`profile_sequence` at every generated position (``propose_seconds`` at those ``forced`` leaves out)."""
    P, G = len(prompt_ids), len(continuation)
    full = list(prompt_ids) + list(continuation)
    N, T = len(neural), len(token_drafters)
    acc_nn = np.zeros((N, N, G), dtype=np.float64)
    agr_nn = np.zeros((N, N, G), dtype=bool)
    acc_tn = np.zeros((T, N, G), dtype=np.float64)
    agr_tn = np.zeros((T, N, G), dtype=bool)
    secs = np.zeros(T)
    if G == 0:
        return acc_nn, agr_nn, acc_tn, agr_tn, secs

    # token drafters: one proposal per generated position from the true context, observing the truth
    props = np.zeros((T, G), dtype=np.int64)
    for ti, d in enumerate(token_drafters):
        d.reset(full[:P])
        for g in range(G):
            ctx = full[:P + g]
            t0 = time.perf_counter()
            prop = d.propose(ctx, 1)
            if forced is None or not forced[g]:
                secs[ti] += time.perf_counter() - t0
            props[ti, g] = int(prop[0]) if prop else -1      # -1: it abstained (NaN in acc_tn)
            if allowed is not None and prop and not _allows(allowed[g], int(props[ti, g])):
                props[ti, g] = -1                              # refused by the grammar: decoding cuts it
            d.observe(ctx, [full[P + g]])

    # one teacher-forced pass per engine, residual streams at every exit boundary
    inp = full[:-1]
    hidden: dict[int, dict[int, torch.Tensor]] = {}
    engines = {}
    for nd in neural:
        engines.setdefault(id(nd.engine), (nd.engine, set()))[1].add(nd.boundary)
    for key, (eng, bs) in engines.items():
        hidden[key] = eng.hidden_states(inp, bs)
    rows = torch.arange(P - 1, P - 1 + G)
    for c0 in range(0, G, chunk):
        r = rows[c0:c0 + chunk]
        m = r.numel()
        probs, am = [], []
        for lg in exit_logits(neural, hidden, r):
            if allowed is not None:
                lg = _masked(lg, allowed[c0:c0 + m])
            am.append(lg.argmax(-1).cpu())
            probs.append(_probs(lg, temperature, top_p, top_k, min_p).cpu())
        Pm = torch.stack(probs)                     # [N, m, V]
        A = torch.stack(am)                         # [N, m]
        acc_nn[:, :, c0:c0 + m] = pairwise_overlap(Pm).double().numpy()
        agr_nn[:, :, c0:c0 + m] = (A[:, None, :] == A[None, :, :]).numpy()
        if T:
            pr = torch.as_tensor(props[:, c0:c0 + m])                      # [T, m]
            idx = torch.arange(m)
            for ti in range(T):
                made = pr[ti] >= 0
                y = pr[ti].clamp(min=0)
                acc = Pm[:, idx, y].double()
                acc[:, ~made] = float("nan")
                acc_tn[ti, :, c0:c0 + m] = acc.numpy()
                agr_tn[ti, :, c0:c0 + m] = ((A == y[None, :]) & made[None, :]).numpy()
        del Pm
    return acc_nn, agr_nn, acc_tn, agr_tn, secs


def walk_rounds(make_drafter: Callable[[], Any], prompt_ids: Sequence[int], continuation: Sequence[int],
                tmax: int) -> np.ndarray:
    """Rounds of an abstaining token drafter along ``continuation`` for every budget ``T`` in 1..``tmax``:
    ``[2, tmax]`` counts (row 0: rounds, row 1: rounds in which it proposed a block), indexed ``T - 1``;
    ``make_drafter()`` gives the drafter in its initial state (one per budget).

    Decoding calls the drafter once per round, and a round that accepts ``k`` drafts skips the positions the
    accepted block covered; a drafter whose proposals come in runs (a repeated passage) therefore proposes in a
    smaller share of rounds than of positions. Each budget's walk is what decoding does with the target's
    continuation as the verifier's output: the first token is the target's own (as in decoding), then from each
    position the drafter proposes ``propose(context, T)``; its block's drafts are accepted up to the first one that
    differs from the continuation, and the round adds those plus the next continuation token (no block: one
    token). For greedy decoding that is exactly decoding's rounds; for sampling it is decoding's rounds in
    distribution (a one-hot draft ``y`` is accepted with probability ``p(y)``, and otherwise the round's token is
    drawn from the rest of ``p``, as the continuation's token is). A walk counts the rounds that start at most at
    position ``len(continuation) - T - 1`` (a whole block and the round's last token inside the continuation), so
    a budget's figures do not depend on how its rounds end. ``docs/design.md#abstaining-drafters``."""
    full = list(prompt_ids) + list(continuation)
    P, G = len(prompt_ids), len(continuation)
    out = np.zeros((2, tmax), dtype=np.float64)
    for T in range(1, tmax + 1):
        if G < T + 2:
            break
        d = make_drafter()
        d.reset(full[:P])
        d.observe(full[:P], full[P:P + 1])
        g = 1
        while g + T < G:
            ctx = full[:P + g]
            block = [int(t) for t in d.propose(ctx, T)][:T]
            k = 0
            while k < len(block) and block[k] == full[P + g + k]:
                k += 1
            out[0, T - 1] += 1
            out[1, T - 1] += bool(block)
            n = k + 1 if block else 1
            d.observe(ctx, full[P + g:P + g + n])
            g += n
    return out
