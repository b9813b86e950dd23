"""Model-derived unigram and bigram drafters (N-Grammys paper, arXiv 2411.03786, Sec. 4.1 and App. B.1).

* **Bigram**: ``p_M(. | x)`` for every token ``x`` of the vocabulary, from ONE forward of the causal LM on the
  single-token context ``[x]`` (batched: ``input_ids`` of shape ``[batch, 1]``). Only the ``top_k`` most
  likely next tokens per row are kept: ``ids [V, top_k] int32`` and ``probs [V, top_k] float32`` (probabilities
  under the full-vocabulary softmax, so rows sum to <= 1).

  BOS choice: by default a one-token prefix IS prepended: the row of ``x`` is ``p_M(. | bos, x)`` with ``bos =
  model.config.bos_token_id`` (``bos_id="auto"``; pass an id or None to override). Without a prefix, position 0 is
  an attention sink (the model predicts punctuation after almost every token) and the rows agree far less often with
  the model's full-context argmax (the comparison is in ``docs/results.md``). The prefix's KV cache is computed once
  and shared by every batch, so the build costs the same as without it. The id used is stored in the file and in the
  cache key.

* **Unigram** (q = 0): ``d(x) = ||u_x - u_mean||_V`` with ``u_x`` the output (LM-head) embedding of ``x``,
  ``u_mean`` their mean, and ``<a, b>_V = a^T C b`` with ``C = E^T E / |X|`` from the input embeddings ``E``
  (uncentered, exactly as the paper's App. B.1 code computes ``covV``). ``p(x) ∝ exp(-d(x))``.
  Note: the paper's code ranks by ``mu^T C u_x`` (an inner product) while its text defines a distance; we follow
  the text. The unigram is the fallback of :class:`BigramDrafter` for an empty context.

* **Extended bigram** (w > 1): beam search through the table, score = sum of log-probabilities of the
  chain, beam width ``k``, each beam expanded by its row's ``top_k``; rows are cached per ``(x, k, w)`` so
  repeated lookups are O(1) as in the paper.

The table is computed once and cached on disk in ``cache_dir`` (default ``$HSD_CACHE`` or
``~/.cache/hsd-opt``) under a name keyed by the model hash the caller gives.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from hsd_opt.cache import cache_dir as default_cache_dir
from hsd_opt.cache import writable_folder
from hsd_opt.console import progress_bar
from hsd_opt.drafters.base import TokenDrafter, check_proposal, read_npz_table
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.jsonio import atomic_write
from hsd_opt.models.loading import cache_keyword

TABLE_FORMAT = "hsd-bigram/1"


def model_fingerprint(model) -> str:
    """A cheap content hash of a torch model (config + a strided sample of every parameter), 16 hex chars.

    Callers that already know a model hash (e.g. of the weights file) should pass that instead.
    """
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        h.update(cfg.to_json_string(use_diff=False).encode() if hasattr(cfg, "to_json_string") else repr(cfg).encode())
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 256)
        h.update(name.encode())
        h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def table_path(cache_dir: str | os.PathLike | None, model_hash: str, top_k: int, bos_id: int | None) -> Path:
    """Where the table of this model/top_k/BOS choice lives: ``<cache_dir>/bigram-<hash>-k<top_k>[-bos<id>].npz``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    suffix = "" if bos_id is None else f"-bos{bos_id}"
    return root / f"bigram-{model_hash}-k{top_k}{suffix}.npz"  # suffix "" = built without a prefix


def _check_table(path, z: dict) -> None:
    """The arrays of a saved table: ``ids`` ``[V, k]`` of token ids below ``V`` (each is a row's index too),
    ``probs`` of its shape, ``unigram_ids`` ``[U]`` below ``V`` with ``unigram_logp`` of its shape, ``V, k, U >= 1``;
    :class:`InputFileError` naming ``path`` and the array otherwise (a damaged file gave an IndexError or wrong
    rows)."""
    ids, uni = z["ids"], z["unigram_ids"]
    if ids.ndim != 2 or 0 in ids.shape or z["probs"].shape != ids.shape:
        raise InputFileError(str(path), f"ids [V, k] and probs of its shape expected, got {ids.shape} and "
                                        f"{z['probs'].shape}", "ids")
    if uni.ndim != 1 or not len(uni) or z["unigram_logp"].shape != uni.shape:
        raise InputFileError(str(path), f"unigram_ids [U] and unigram_logp of its shape expected, got {uni.shape} "
                                        f"and {z['unigram_logp'].shape}", "unigram_ids")
    for k, a in (("ids", ids), ("unigram_ids", uni)):
        if int(a.min()) < 0 or int(a.max()) >= ids.shape[0]:
            raise InputFileError(str(path), f"token ids in 0 .. {ids.shape[0] - 1} (its rows) expected, got "
                                            f"{int(a.min())} .. {int(a.max())}", k)


@dataclass
class BigramTable:
    """Top-k bigram table plus the unigram ranking of one model.

    Attributes:
        ids: ``[V, top_k]`` int32, next-token ids of ``p_M(. | x)`` for row ``x``, most likely first.
        probs: ``[V, top_k]`` float32, their probabilities (full-vocabulary softmax).
        unigram_ids: ``[U]`` int32, tokens with the highest unigram probability, best first.
        unigram_logp: ``[U]`` float32, their log-probabilities ``-d(x) - logsumexp(-d)``.
        meta: plain-data description (model hash, bos_id, build seconds, ...).
        path: the file it was loaded from / saved to, if any.
    """

    ids: np.ndarray
    probs: np.ndarray
    unigram_ids: np.ndarray
    unigram_logp: np.ndarray
    meta: dict = field(default_factory=dict)
    path: str | None = None
    _ext_cache: dict = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])

    @property
    def largest_id(self) -> int:
        """The largest token id the table holds (next tokens and the unigram's ranking)."""
        return max(int(self.ids.max(initial=0)), int(self.unigram_ids.max(initial=0)))

    def save(self, path: str | os.PathLike) -> Path:
        """Write an ``.npz`` atomically (:func:`hsd_opt.jsonio.atomic_write`)."""
        import json

        path = Path(path)
        atomic_write(path, lambda f: np.savez(
            f,
            ids=self.ids.astype(np.int32),
            probs=self.probs.astype(np.float32),
            unigram_ids=self.unigram_ids.astype(np.int32),
            unigram_logp=self.unigram_logp.astype(np.float32),
            meta=np.array(json.dumps({"format": TABLE_FORMAT, **self.meta})),
        ))
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BigramTable":
        """Read a table written by :meth:`save`; raises :class:`InputFileError` on a bad file."""
        z, meta = read_npz_table(path, "bigram table", TABLE_FORMAT, ("ids", "probs", "unigram_ids", "unigram_logp"),
                                  ids=("ids", "unigram_ids"))
        _check_table(path, z)
        return cls(z["ids"], z["probs"], z["unigram_ids"], z["unigram_logp"], meta, str(path))

    # ---- lookups -----------------------------------------------------------------------------------------
    def greedy_chain(self, x: int, n: int) -> list[int]:
        """``n`` tokens by repeatedly taking the argmax of the row of the last token, starting after ``x``."""
        out = []
        nxt = self.ids[:, 0]
        for _ in range(n):
            x = int(nxt[x])
            out.append(x)
        return out

    def extended(self, x: int, k: int, w: int) -> list[list[int]]:
        """Extended bigram: the ``<= k`` most likely chains of ``w`` tokens after ``x`` (beam search), best first.

        Score of a chain ``y_1..y_w`` = ``sum_j log p(y_j | y_{j-1})`` with ``y_0 = x`` (table probabilities).
        Fewer than ``k`` rows only when ``k > top_k ** w``. Cached per ``(x, k, w)``.
        """
        key = (int(x), int(k), int(w))
        hit = self._ext_cache.get(key)
        if hit is not None:
            return hit
        kk = self.top_k
        logp = self._ext_cache.get("logp")
        if logp is None:
            logp = self._ext_cache["logp"] = np.log(np.maximum(self.probs, 1e-30))
        seqs = np.array([[x]], dtype=np.int64)  # [beams, t]
        score = np.zeros(1)
        for _ in range(w):
            last = seqs[:, -1]
            cand_ids = self.ids[last].astype(np.int64)  # [beams, kk]
            cand_sc = score[:, None] + logp[last]  # [beams, kk]
            flat = cand_sc.reshape(-1)
            take = min(k, flat.size)
            # stable ranking: higher score first, ties to the lower (beam, rank) index
            order = np.argsort(-flat, kind="stable")[:take]
            b, j = np.divmod(order, kk)
            seqs = np.concatenate([seqs[b], cand_ids[b, j][:, None]], axis=1)
            score = flat[order]
        rows = [list(map(int, r[1:])) for r in seqs]
        if len(self._ext_cache) > 100_000:
            self._ext_cache.clear()
            self._ext_cache["logp"] = logp
        self._ext_cache[key] = rows
        return rows


# ---- building -------------------------------------------------------------------------------------------
def unigram_from_weights(model, keep: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """The N-Grammys unigram (Sec. 4.1) from the embeddings: ``(ids [keep], logp [keep])``, best first.

    ``d(x) = sqrt((u_x - u_mean)^T C (u_x - u_mean))``, ``C = E^T E / |X|`` (input embeddings ``E [V, d]``),
    ``u`` the output embeddings (LM-head rows ``[V, d]``), ``log p(x) = -d(x) - logsumexp(-d)``.
    """
    import torch

    with torch.no_grad():
        E = model.get_input_embeddings().weight.detach().float()
        U = model.get_output_embeddings().weight.detach().float()
        C = E.T @ E / E.shape[0]
        D = U - U.mean(dim=0, keepdim=True)
        d = ((D @ C) * D).sum(dim=1).clamp_min(0).sqrt()
        logp = -d - torch.logsumexp(-d, dim=0)
        keep = min(keep, logp.numel())
        top = torch.topk(logp, keep)
    return top.indices.numpy().astype(np.int32), top.values.numpy().astype(np.float32)


AUTO = "auto"


def resolve_bos(model, bos_id) -> int | None:
    """``"auto"`` -> ``model.config.bos_token_id`` (None if the config has none); ints and None pass through."""
    if bos_id == AUTO:
        b = getattr(getattr(model, "config", None), "bos_token_id", None)
        return int(b) if b is not None else None
    return None if bos_id is None else int(bos_id)


def _prefix_cache(model, bos_id: int, device, cache_kw: str):
    """KV cache of the one-token prefix ``[bos_id]`` (batch 1), or None if this transformers cannot do it;
    ``cache_kw``: the keyword ``model`` takes its cache by (:func:`~hsd_opt.models.loading.cache_keyword`)."""
    import torch

    try:
        from transformers import DynamicCache

        cache = DynamicCache()
        model(input_ids=torch.tensor([[bos_id]], device=device), use_cache=True, **{cache_kw: cache})
        return cache
    except Exception:  # pragma: no cover - older/newer cache APIs: fall back to [bos, x] inputs
        return None


def build_bigram_table(
    model,
    top_k: int = 16,
    batch_size: int = 256,
    bos_id: int | None | str = AUTO,
    vocab_size: int | None = None,
    progress: bool = True,
) -> BigramTable:
    """Compute the top-k bigram table of a Hugging Face causal LM: one forward call per batch of rows.

    Args:
        model: a causal LM (``model(input_ids=LongTensor[b, L]).logits -> [b, L, V]``), any device.
        top_k: kept next tokens per row.
        batch_size: rows per forward call (single-token contexts, so memory ~ batch_size * V floats).
        bos_id: ``"auto"`` (default: ``model.config.bos_token_id``), an id, or None. With an id each row is
            ``p_M(. | bos_id, x)``; the prefix's KV cache is computed once and shared by all rows, so the
            build costs the same as without it. See the module docstring for why a prefix is the default.
        vocab_size: rows to compute (default: the LM-head size).
        progress: show a rich progress bar.
    """
    import copy

    import torch

    bos_id = resolve_bos(model, bos_id)
    cache_kw = cache_keyword(model)
    V_out = model.get_output_embeddings().weight.shape[0]
    V = int(vocab_size or V_out)
    device = next(model.parameters()).device
    ids = np.empty((V, top_k), dtype=np.int32)
    probs = np.empty((V, top_k), dtype=np.float32)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    bar = progress_bar(progress)
    bar.start()
    try:
        task = bar.add_task("bigram table", total=V)
        with torch.inference_mode():
            prefix = _prefix_cache(model, bos_id, device, cache_kw) if bos_id is not None else None
            for s in range(0, V, batch_size):
                e = min(V, s + batch_size)
                x = torch.arange(s, e, device=device, dtype=torch.long)[:, None]
                if prefix is not None:
                    cache = copy.deepcopy(prefix)
                    cache.batch_repeat_interleave(e - s)
                    out = model(input_ids=x, use_cache=True, **{cache_kw: cache})
                else:
                    if bos_id is not None:
                        x = torch.cat([torch.full_like(x, bos_id), x], dim=1)
                    out = model(input_ids=x, use_cache=False)
                logits = out.logits[:, -1, :].float()
                lp = torch.log_softmax(logits, dim=-1)
                top = torch.topk(lp, top_k, dim=-1)
                ids[s:e] = top.indices.cpu().numpy()
                probs[s:e] = top.values.exp().cpu().numpy()
                bar.update(task, advance=e - s)
    finally:
        bar.stop()
        model.train(was_training)
    uni_ids, uni_logp = unigram_from_weights(model)
    meta = {"top_k": top_k, "bos_id": bos_id, "vocab_size": V, "build_seconds": time.perf_counter() - t0,
            "batch_size": batch_size}
    return BigramTable(ids, probs, uni_ids, uni_logp, meta)


def random_bigram_table(vocab_size: int, top_k: int = 16, seed: int = 0) -> BigramTable:
    """A table of ``vocab_size`` random rows of ``top_k`` next tokens (probabilities descending), the shape a
    model's table has: what a lookup costs, for costs measured on a model with random weights (no forward pass
    per token to build it, nothing cached)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(vocab_size, top_k), dtype=np.int32)
    probs = np.sort(rng.dirichlet(np.ones(top_k), size=vocab_size).astype(np.float32), axis=1)[:, ::-1]
    keep = min(1024, vocab_size)
    uni_ids = rng.permutation(vocab_size)[:keep].astype(np.int32)
    uni_logp = np.sort(np.log(rng.dirichlet(np.ones(keep))).astype(np.float32))[::-1]
    return BigramTable(ids, np.ascontiguousarray(probs), uni_ids, np.ascontiguousarray(uni_logp),
                       {"top_k": top_k, "vocab_size": vocab_size, "random": True})


def load_or_build_bigram_table(
    model,
    model_hash: str,
    top_k: int = 16,
    cache_dir: str | os.PathLike | None = None,
    bos_id: int | None | str = AUTO,
    batch_size: int = 256,
    progress: bool = True,
) -> BigramTable:
    """Load ``table_path(cache_dir, model_hash, top_k, bos_id)`` if present, else build it and save it there.

    ``model`` may be None when the table is known to be cached and ``bos_id`` is given explicitly (an int or
    None; ``"auto"`` needs the model's config). Raises :class:`HsdError` when it cannot be loaded or built.
    """
    if bos_id == AUTO:
        if model is None:
            raise HsdError("bos_id='auto' needs the model (pass the BOS id used when the table was built)")
        bos_id = resolve_bos(model, bos_id)
    path = table_path(cache_dir, model_hash, top_k, bos_id)
    if path.exists():
        try:
            return BigramTable.load(path)
        except InputFileError:
            if model is None:                   # nothing to build it again from: say which file is damaged
                raise
            # a damaged cache file (cut by a crash, a full disk): built again and replaced below
    if model is None:
        raise HsdError(f"no cached bigram table at {path} and no model given to build it")
    writable_folder(path.parent, "the bigram table")            # before minutes of building, not after
    table = build_bigram_table(model, top_k=top_k, batch_size=batch_size, bos_id=bos_id, progress=progress)
    table.meta["model_hash"] = model_hash
    table.save(path)
    return table


# ---- drafters -------------------------------------------------------------------------------------------
class BigramDrafter(TokenDrafter):
    """Greedy chaining through the model bigram; batched: the extended bigram (beam search), best first.

    Fallback: for an empty context the chain starts from the unigram's most likely token (q = 0).
    ``propose_batch`` pads with copies of its last row when ``k > top_k ** w`` (never in practice).
    """

    kind = "bigram_model"

    def __init__(self, table: BigramTable | str | os.PathLike, name: str = "bigram"):
        self.table = table if isinstance(table, BigramTable) else BigramTable.load(table)
        self.name = name

    def _start(self, context: Sequence[int]) -> int | None:
        if len(context):
            x = int(context[-1])
            if 0 <= x < self.table.vocab_size:
                return x
        return None

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        check_proposal(n)
        x = self._start(context)
        if x is None:
            first = int(self.table.unigram_ids[0])
            return ([first] + self.table.greedy_chain(first, n - 1))[:n] if n > 0 else []
        return self.table.greedy_chain(x, n)

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        check_proposal(w, k, "w")
        x = self._start(context)
        if x is None:
            rows = [[int(u)] + self.table.greedy_chain(int(u), w - 1) for u in self.table.unigram_ids[:k]]
        else:
            rows = self.table.extended(x, k, w)
        rows = [r[:w] for r in rows]
        while len(rows) < k:
            rows.append(list(rows[-1]))
        return rows

    def largest_id(self) -> int:
        return self.table.largest_id

    def config(self) -> dict:
        return {"kind": self.kind, "name": self.name, "table": self.table.path, "top_k": self.table.top_k}


class UnigramDrafter(TokenDrafter):
    """q = 0 drafter (Sec. 4.1): always the unigram's top token, then the bigram chain after it.

    Not in the default pool (its single draft ignores the context); kept for ablations. ``kind="unigram_model"``.
    """

    kind = "unigram_model"

    def __init__(self, table: BigramTable | str | os.PathLike, name: str = "unigram"):
        self.table = table if isinstance(table, BigramTable) else BigramTable.load(table)
        self.name = name

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        check_proposal(n)
        if n <= 0:
            return []
        first = int(self.table.unigram_ids[0])
        return [first] + self.table.greedy_chain(first, n - 1)

    def propose_batch(self, context: Sequence[int], k: int, w: int) -> list[list[int]]:
        check_proposal(w, k, "w")
        rows = [([int(u)] + self.table.greedy_chain(int(u), w - 1))[:w] for u in self.table.unigram_ids[:k]]
        while len(rows) < k:
            rows.append(list(rows[-1]))
        return rows

    def largest_id(self) -> int:
        return self.table.largest_id

    def config(self) -> dict:
        return {"kind": self.kind, "name": self.name, "table": self.table.path, "top_k": self.table.top_k}
