"""Training text for exit heads: continuations the target model itself generates from the prompt suite.

Generated token sequences (chat template + prompt + continuation) are cached in
``<cache>/heads-data/<key>.json`` keyed by the model id, revision and dtype (a bfloat16 model writes other text),
a hash of the prompts' token ids (through the chat template: a changed template is other text) and the
generation settings, so repeated runs skip generation.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Sequence

import torch

from hsd_opt.console import progress_bar
from hsd_opt.jsonio import read_json, write_json
from hsd_opt.prompts import encode_prompt


def sequences_sha256(seqs: Sequence[Sequence[int]]) -> str:
    """Hash of a list of token sequences (the training data's identity in a heads file)."""
    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps(list(map(int, s))).encode())
        h.update(b"\n")
    return h.hexdigest()


def generate_training_sequences(loaded, prompts: Sequence[str], tokens: int = 4096, *, temperature: float = 0.7,
                                top_p: float = 0.95, seed: int = 0, batch_size: int = 32, max_new: int = 256,
                                cache: bool = True, progress: bool = True, with_prompt_lens: bool = False):
    """Token sequences (prompt + the target's own continuation), about ``tokens`` generated tokens in total.

    Each prompt gets ``ceil(tokens / len(prompts))`` new tokens (at most ``max_new`` per sample; more samples per
    prompt when needed), sampled with light temperature for diversity. Cached on disk (see module doc).
    With ``with_prompt_lens`` returns ``(sequences, prompt_lens)``: each sequence's prompt length (its first
    generated token is at index ``prompt_len``).
    """
    from hsd_opt.cache import cache_dir

    model, tok = loaded.model, loaded.tokenizer
    per_prompt = max(1, math.ceil(tokens / len(prompts)))
    new = min(max_new, per_prompt)
    samples = max(1, math.ceil(per_prompt / new))
    ids = [encode_prompt(tok, p) for p in prompts]     # the ids, not the texts: a changed chat template is new text
    settings = {"model": loaded.model_id, "revision": loaded.revision, "dtype": loaded.dtype, "prompts": hashlib.sha256(
        json.dumps(ids).encode()).hexdigest(), "eos": tok.eos_token_id, "new": new, "samples": samples,
        "temperature": temperature, "top_p": top_p, "seed": seed, "v": 3}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "heads-data" / f"{key}.json"
    if cache and path.is_file():
        try:
            obj = read_json(path)
            if obj.get("settings") == settings:
                seqs = [list(map(int, s)) for s in obj["sequences"]]
                return (seqs, list(map(int, obj["prompt_lens"]))) if with_prompt_lens else seqs
        except Exception:
            pass
    encoded = [x for x in ids for _ in range(samples)]
    t0 = time.time()
    seqs, plens = _generate_batched(model, encoded, new, tok.eos_token_id, temperature, top_p, seed,
                                    batch_size, progress)
    if cache:
        try:
            write_json(path, {"settings": settings, "seconds": round(time.time() - t0, 2), "sequences": seqs,
                              "prompt_lens": plens}, indent=None)
        except OSError:         # a cache that cannot be written is only slower next time: the text is here
            pass
    return (seqs, plens) if with_prompt_lens else seqs


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from ``logits`` ``[V]``: greedy when ``temperature <= 0``, else temperature + nucleus."""
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits.float() / temperature, -1)
    sp, si = p.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < top_p
    sp = sp * keep
    return int(si[torch.multinomial(sp / sp.sum(), 1, generator=gen)])


@torch.no_grad()
def _generate_batched(model, encoded, new, eos, temperature, top_p, seed, batch_size, progress):
    """A KV-cached sampling loop over batches of left-padded prompts (explicit position ids).

    One batched forward per step is far cheaper per token than batch-1 decoding on a CPU, and this loop avoids
    ``generate``'s per-step overheads. Sequences stop at EOS; each gets at most ``new`` tokens.
    """
    from hsd_opt.models.loading import cache_keyword

    cache_kw = cache_keyword(model)
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seqs: list[list[int]] = []
    plens: list[int] = []
    with progress_bar(progress, transient=True) as prog:
        task = prog.add_task("generating training text", total=len(encoded) * new)
        for i in range(0, len(encoded), batch_size):
            batch = encoded[i: i + batch_size]
            B, L = len(batch), max(len(x) for x in batch)
            ids = torch.zeros((B, L), dtype=torch.long)
            mask = torch.zeros((B, L), dtype=torch.long)
            for j, x in enumerate(batch):
                ids[j, L - len(x):] = torch.tensor(x)
                mask[j, L - len(x):] = 1
            ids, mask = ids.to(device), mask.to(device)
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
            cache = getattr(out, cache_kw)
            logits = out.logits[:, -1].float().cpu()
            conts: list[list[int]] = [[] for _ in batch]
            done = [False] * B
            next_pos = pos[:, -1:] + 1
            for _ in range(new):
                toks = []
                for j in range(B):
                    t = _sample(logits[j], temperature, top_p, gen)
                    if not done[j]:
                        conts[j].append(t)
                        if eos is not None and t == eos:
                            done[j] = True
                    toks.append(t)
                prog.advance(task, B)
                if all(done) or len(conts[0]) >= new and all(len(c) >= new or d for c, d in zip(conts, done)):
                    break
                step = torch.tensor(toks, dtype=torch.long, device=device).unsqueeze(1)
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=device)], dim=1)
                out = model(input_ids=step, attention_mask=mask, position_ids=next_pos, use_cache=True,
                            **{cache_kw: cache})
                cache = getattr(out, cache_kw)
                logits = out.logits[:, -1].float().cpu()
                next_pos = next_pos + 1
            for x, c in zip(batch, conts):
                seqs.append(list(x) + c[:new])
                plens.append(len(x))
    return seqs, plens


def split_indices(n: int, holdout: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic split of ``n`` sequences: (train indices, held-out indices); one held out at least."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(n - 1, max(1, round(holdout * n))) if n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def split_sequences(seqs: Sequence[Sequence[int]], holdout: float = 0.2, seed: int = 0):
    """Deterministic split by sequence: (train, held_out); at least one sequence on each side when possible."""
    n = len(seqs)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(n - 1, max(1, round(holdout * n))) if n > 1 else 0
    held = sorted(order[:k])
    train = sorted(order[k:])
    return [list(seqs[i]) for i in train], [list(seqs[i]) for i in held]
