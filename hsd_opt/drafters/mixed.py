"""Mixed batched drafts and their one-call verification (N-Grammys paper, arXiv 2411.03786, Sec. 4.3).

A batch is ``k`` rows of ``w`` draft tokens: first as many distinct context n-gram continuations as the
context offers (possibly zero), then rows of the extended model bigram (deduplicated) fill the rest.
The target verifies all rows in ONE forward call on ``k`` copies of the context, each followed by its row
(input ``[k, L0 + w]``); greedy acceptance keeps the row with the longest prefix equal to the target's own
argmax, plus the target's next token after it. Output is therefore token for token the target's greedy output.

Sampling (temperature > 0) with ``k > 1`` is refused by default: accepting the best of several rows is not
lossless under sampling. ``verify_batch(..., multi_draft=True)`` opts into a lossless recursive-rejection
scheme over the rows seen as a token tree. With ``k = 1`` the standard rejection rule for a one-hot draft is
used (accept ``x`` w.p. ``p(x)``, else resample from ``p`` with ``x`` removed), which is lossless.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

from hsd_opt.drafters.base import TokenDrafter, check_proposal, check_settings
from hsd_opt.drafters.bigram import BigramDrafter
from hsd_opt.drafters.ngram import ContextNgramDrafter
from hsd_opt.errors import HsdError

LogitsFn = Callable[["object"], "object"]  # LongTensor[k, L] -> FloatTensor[k, L or >= w+1, V]


class MixedNgramDrafter(TokenDrafter):
    """Sec. 4.3 mixed strategy: context n-gram rows first, then extended-bigram rows.

    Args:
        ngram: the context matcher (its ``q`` is the query length; the paper uses ``q = 1``).
        bigram: the model bigram drafter (extended bigram for ``w > 1``).
        k, w: the default batch shape, recorded in :meth:`config` (callers pass ``k, w`` explicitly).

    ``propose(context, n)`` (single draft) is the first row: the top n-gram continuation if the context has
    one, else the bigram's greedy chain. ``propose_batch`` returns exactly ``k`` distinct rows when the two
    sources have that many (padding with copies of the last row otherwise).
    """

    kind = "mixed_ngram"

    def __init__(self, ngram: ContextNgramDrafter, bigram: BigramDrafter, k: int = 5, w: int = 4,
                 name: str = "mixed"):
        check_settings(ints={"k": (k, 1, None), "w": (w, 1, None)})
        self.ngram, self.bigram, self.k, self.w, self.name = ngram, bigram, int(k), int(w), name
        self.last_sources: list[str] = []  # per row of the last batch: "ngram" | "bigram" (for ablations)

    def fork(self) -> "MixedNgramDrafter":
        new = copy.copy(self)
        new.ngram, new.bigram, new.last_sources = self.ngram.fork(), self.bigram.fork(), []
        return new

    def largest_id(self) -> int | None:
        return max((i for i in (self.ngram.largest_id(), self.bigram.largest_id()) if i is not None), default=None)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.ngram.reset(prompt_ids)
        self.bigram.reset(prompt_ids)

    def observe(self, context: Sequence[int], accepted: Sequence[int]) -> None:
        self.ngram.observe(context, accepted)
        self.bigram.observe(context, accepted)

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        check_proposal(n)
        return self.propose_batch(context, 1, n)[0]

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        check_proposal(w, k, "w")
        rows = self.ngram.candidates(context, k, w)
        sources = ["ngram"] * len(rows)
        if len(rows) < k:
            seen = {tuple(r) for r in rows}
            for r in self.bigram.propose_batch(context, k, w):
                if tuple(r) not in seen:
                    seen.add(tuple(r))
                    rows.append(list(r))
                    sources.append("bigram")
                    if len(rows) >= k:
                        break
        while len(rows) < k:
            rows.append(list(rows[-1]))
            sources.append(sources[-1])
        self.last_sources = sources
        return rows

    def config(self) -> dict:
        return {"kind": self.kind, "name": self.name, "k": self.k, "w": self.w,
                "ngram": self.ngram.config(), "bigram": self.bigram.config()}


@dataclass
class BatchVerifyResult:
    """Outcome of verifying a ``k x w`` batch.

    Attributes:
        row: index of the kept row (the first among rows with the longest accepted prefix).
        n_accepted: how many draft tokens of that row were accepted (0..w).
        tokens: the ``n_accepted + 1`` tokens to append: the accepted drafts + the target's next token.
    """

    row: int
    n_accepted: int
    tokens: list[int]


def _batch_logits(logits_fn: LogitsFn, context: Sequence[int], drafts: Sequence[Sequence[int]]):
    """One forward call; returns ``(drafts LongTensor[k, w], logits FloatTensor[k, w + 1, V])`` where
    ``logits[:, j]`` is the target's prediction for draft position ``j`` (``j = w``: the bonus position)."""
    import torch

    if len(context) == 0:
        raise HsdError("batched verification needs a non-empty context")
    if not drafts:
        raise HsdError("batched verification needs at least one draft row")
    w = len(drafts[0])
    if any(len(r) != w for r in drafts):
        raise HsdError("all draft rows must have the same length w")
    k = len(drafts)
    ctx = torch.as_tensor(list(context), dtype=torch.long)
    d = torch.as_tensor([list(r) for r in drafts], dtype=torch.long).reshape(k, w)
    ids = torch.cat([ctx.unsqueeze(0).expand(k, -1), d], dim=1)  # [k, L0 + w]
    logits = logits_fn(ids)
    # logits_fn may return all L positions or only the last >= w + 1; the last w + 1 are what we need
    return d, logits[:, -(w + 1):, :]


def verify_batch_greedy(logits_fn: LogitsFn, context: Sequence[int],
                        drafts: Sequence[Sequence[int]]) -> BatchVerifyResult:
    """Greedy verification of ``k`` rows in one ``logits_fn`` call (``LongTensor[k, L] -> FloatTensor[k, L, V]``).

    Row ``r`` is accepted up to its first token that differs from the target's argmax; the longest accepted
    row wins (ties: the lowest index, i.e. the best-ranked row), and the target's argmax after it is appended.
    """
    d, logits = _batch_logits(logits_fn, context, drafts)
    w = d.shape[1]
    pred = logits.argmax(dim=-1)  # [k, w + 1]
    match = (pred[:, :w] == d).int()  # [k, w]
    n_acc = match.cumprod(dim=1).sum(dim=1)  # accepted prefix length per row
    row = int(n_acc.argmax())  # argmax returns the first maximal index
    m = int(n_acc[row])
    tokens = [int(t) for t in d[row, :m]] + [int(pred[row, m])]
    return BatchVerifyResult(row, m, tokens)


def verify_batch(logits_fn: LogitsFn, context: Sequence[int], drafts: Sequence[Sequence[int]],
                 temperature: float = 0.0, generator=None, multi_draft: bool = False) -> BatchVerifyResult:
    """Greedy (``temperature == 0``) for any ``k``; speculative sampling for ``temperature > 0``.

    Sampling with ``k == 1``: the standard rule for a one-hot draft (accept ``x`` w.p. ``p(x)``, else sample
    from ``p`` with ``x`` removed). Sampling with ``k > 1`` raises :class:`HsdError` unless ``multi_draft=True``,
    which uses recursive rejection over the rows viewed as a token tree (SpecInfer-style, for one-hot drafts):
    at each depth the distinct next tokens of the rows still alive are tried best row first, token ``x``
    accepted w.p. ``q(x) / sum(q)`` where ``q`` is the target distribution with the already rejected siblings
    zeroed; if all are rejected, the output is sampled from that residual. Each emitted token has exactly the
    target's conditional distribution (lossless); tested statistically in tests/test_drafters.py.
    ``generator`` is an optional ``torch.Generator``. No top-p/top-k here: pass already-warped logits.
    """
    import torch

    if temperature <= 0:
        return verify_batch_greedy(logits_fn, context, drafts)
    if len(drafts) > 1 and not multi_draft:
        raise HsdError(
            f"sampling (temperature={temperature}) with k={len(drafts)} draft rows is refused: picking the "
            "best of several rows is not lossless under sampling; use k=1, greedy decoding, or "
            "multi_draft=True (recursive rejection over the draft tree)")
    d, logits = _batch_logits(logits_fn, context, drafts)
    k, w = d.shape

    def dist(r: int, j: int):  # target distribution at draft position j of row r, [V] float64
        return torch.softmax(logits[r, j].double() / temperature, dim=-1)

    alive = list(range(k))
    out: list[int] = []
    for j in range(w):
        q = dist(alive[0], j)  # the same distribution for every alive row (same prefix)
        tried: list[int] = []
        for r in alive:
            x = int(d[r, j])
            if x in tried:
                continue
            tried.append(x)
            tot = float(q.sum())
            if tot > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) * tot < float(q[x]):
                out.append(x)
                alive = [rr for rr in alive if int(d[rr, j]) == x]
                break
            q[x] = 0.0
        else:
            if float(q.sum()) <= 0:  # numerically impossible unless p is one-hot on rejected tokens
                q = dist(alive[0], j)
            out.append(int(torch.multinomial(q / q.sum(), 1, generator=generator)))
            return BatchVerifyResult(alive[0], j, out)
    out.append(int(torch.multinomial(dist(alive[0], w), 1, generator=generator)))
    return BatchVerifyResult(alive[0], w, out)


def mixed_greedy_decode(logits_fn: LogitsFn, prompt_ids: Sequence[int], drafter: TokenDrafter, k: int, w: int,
                        max_new_tokens: int) -> tuple[list[int], dict]:
    """Reference decoding loop: draft ``k x w`` with ``drafter``, verify in one call, append, repeat.

    No KV cache (each call re-reads the whole context): for tests and acceptance statistics, not speed.
    Returns ``(new_tokens[:max_new_tokens], stats)`` with ``stats = {"calls", "tokens_per_call", "accepted_rows"}``.
    """
    ctx = list(prompt_ids)
    drafter.reset(ctx)
    new: list[int] = []
    calls = 0
    rows_used: list[int] = []
    while len(new) < max_new_tokens:
        rows = drafter.propose_batch(ctx, k, w) if k > 1 else [drafter.propose(ctx, w)]
        res = verify_batch_greedy(logits_fn, ctx, rows)
        calls += 1
        rows_used.append(res.row)
        drafter.observe(ctx, res.tokens)
        ctx.extend(res.tokens)
        new.extend(res.tokens)
    return new[:max_new_tokens], {"calls": calls, "tokens_per_call": len(new) / max(calls, 1),
                                  "accepted_rows": rows_used}
