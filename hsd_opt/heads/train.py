"""Distilling exit heads to the final layer: KL(p_final || p_exit) on the target's own text.

One teacher-forced pass per sequence gives the residual stream at every trained boundary and the final layer's
distribution; every layer's head is then trained on minibatches of those positions (the backbone is frozen, so
the layers' heads are independent and all are trained from the same pass). Adam, 5% linear warm-up then cosine
decay, a few epochs.

On the CPU the full-vocabulary softmax (``d x V`` per position and layer, twice for the backward) dominates, so
by default (``train_vocab="auto"`` on CPU) full-vocabulary heads are trained on a candidate vocabulary: every
token the teacher ranks in its top 32 at a training position, plus the training text's tokens, plus ``negatives``
tokens sampled uniformly from the rest at each step with the usual sampled-softmax correction ``log(|rest| / n)``
on their logits (teacher and student alike), so mass a head puts outside the candidates is still penalised.
Held-out evaluation always uses the full vocabulary. ``train_vocab="full"`` (default on CUDA) trains exactly.

Resumable: with ``checkpoint=PATH`` the heads, the optimiser and the position in the data are written
atomically to ``PATH`` every ``checkpoint_every`` seconds and at each epoch's end; ``resume=True`` continues from
it when its settings and data hash match.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from hsd_opt.console import progress_bar
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.heads.data import sequences_sha256, split_indices
from hsd_opt.heads.modules import KINDS, RawHead, TranslatorHead
from hsd_opt.jsonio import atomic_write_bytes
from hsd_opt.models.loading import unwrap_model
from hsd_opt.seeds import SEED_STRIDE


@dataclass
class TrainResult:
    """What :func:`train_heads` returns.

    Attributes:
        heads: boundary -> trained :class:`TranslatorHead` (eval mode, no grad).
        before, after: boundary -> held-out metrics ``{"acceptance", "greedy", "kl"}`` of the raw logit lens
            and of the trained head (``after`` also holds the raw lens restricted to the subset for
            reduced-vocabulary heads under ``"raw_subset_acceptance"``).
        history: per epoch ``{"epoch", "train_loss", "seconds"}`` (mean loss per layer and position).
        vocab_ids: the reduced vocabulary (or None).
        data_sha256: hash of the training and held-out sequences.
        seconds: wall time of training (excluding evaluation); ``cpu_seconds``: this process's CPU time over the
            same span (all threads; tells a loaded machine from slow code); ``settings``: the training settings.
    """

    heads: dict[int, TranslatorHead]
    before: dict[int, dict]
    after: dict[int, dict]
    history: list[dict]
    vocab_ids: torch.Tensor | None
    data_sha256: str
    seconds: float
    eval_seconds: float
    settings: dict = field(default_factory=dict)
    train_positions: int = 0
    heldout_positions: int = 0
    cpu_seconds: float = 0.0

    def summary(self) -> dict:
        """JSON-able: settings, timings and the per-layer before/after table."""
        return {"settings": self.settings, "train_seconds": round(self.seconds, 2),
                "train_cpu_seconds": round(self.cpu_seconds, 2),
                "eval_seconds": round(self.eval_seconds, 2), "train_positions": self.train_positions,
                "heldout_positions": self.heldout_positions, "data_sha256": self.data_sha256,
                "history": self.history,
                "layers": {str(b): {"before": self.before.get(b), "after": self.after.get(b)}
                           for b in sorted(self.heads)}}


def head_layers(layers: Sequence[int] | None, n_layers: int) -> list[int]:
    """The layers of a model with ``n_layers`` decoder layers that get exit heads: ``layers`` (any order, repeats
    allowed; None: every layer 1..n_layers-1) sorted and without repeats. An empty list, or a layer outside
    1..n_layers-1 (layer n_layers is the model's own output), raises :class:`HsdError` naming ``--layers``."""
    wanted = list(range(1, n_layers)) if layers is None else [int(v) for v in layers]
    for v in wanted:
        if not 1 <= v <= n_layers - 1:
            raise HsdError(f"--layers: layer {v} is out of range: exit heads go after layers 1..{n_layers - 1} "
                           f"(layer {n_layers} is the model's own output)")
    if not wanted:
        raise HsdError("--layers: no layers given")
    return sorted(set(wanted))


# ---------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate_heads(model, heads: Mapping[int, Callable], sequences: Sequence[Sequence[int]],
                   starts: Sequence[int] | None = None, chunk: int = 128) -> dict[int, dict]:
    """Held-out agreement of each boundary's head with the final layer, teacher-forced on ``sequences``.

    For every position ``p >= starts[i] - 1`` (default: every position): acceptance ``sum_x min(q(x), p(x))``
    (the expected acceptance of one drafted token under speculative sampling), greedy agreement
    ``argmax q == argmax p``, and KL(p || q) (for a head with ``-inf`` logits — a reduced vocabulary — the KL to
    ``p`` renormalised on the head's support). Returns boundary -> means over positions.
    """
    m, _, _ = unwrap_model(model)
    eng = LayeredLM(m)
    layers = sorted(heads)
    n = eng.n_layers
    sums = {b: {"acceptance": 0.0, "greedy": 0.0, "kl": 0.0} for b in layers}
    count = 0
    for i, seq in enumerate(sequences):
        hs = eng.hidden_states(seq, layers + [n])
        lo = max(0, (starts[i] - 1) if starts is not None else 0)
        L = len(seq)
        for a in range(lo, L, chunk):
            e = min(L, a + chunk)
            logp = F.log_softmax(eng.head(hs[n][a:e], n), dim=-1)
            p = logp.exp()
            top = p.argmax(-1)
            for b in layers:
                z = heads[b](hs[b][a:e]).float()
                logq = F.log_softmax(z, dim=-1)
                q = logq.exp()
                s = sums[b]
                s["acceptance"] += torch.minimum(p, q).sum().item()
                s["greedy"] += (q.argmax(-1) == top).sum().item()
                support = torch.isfinite(z)
                if bool(support.all()):
                    kl = (p * (logp - logq)).sum(-1)
                else:
                    pm = torch.where(support, p, torch.zeros_like(p))
                    mass = pm.sum(-1, keepdim=True).clamp_min(1e-30)
                    pr = pm / mass
                    kl = torch.where(support & (pr > 0), pr * (pr.clamp_min(1e-30).log() - logq),
                                     torch.zeros_like(pr)).sum(-1)
                s["kl"] += kl.sum().item()
            count += e - a
    return {b: {k: (v / count if count else float("nan")) for k, v in sums[b].items()} for b in layers}


# ---------------------------------------------------------------------------------------------- training

@torch.no_grad()
def _prepass(eng: LayeredLM, seqs, starts, topk: int):
    """Final-layer statistics on the training text: expected token counts and the teacher's top-k ids."""
    V = eng.vocab_size
    expected = torch.zeros(V, dtype=torch.float64)
    cand = torch.zeros(V, dtype=torch.bool)
    n = eng.n_layers
    for i, seq in enumerate(seqs):
        h = eng.hidden_states(seq, [n])[n]
        lo = max(0, starts[i] - 1)
        for a in range(lo, len(seq), 256):
            z = eng.head(h[a: a + 256], n)
            expected += F.softmax(z, -1).sum(0).double().cpu()
            cand[z.topk(min(topk, V), dim=-1).indices.reshape(-1).cpu()] = True
        t = torch.as_tensor(seq[lo:], dtype=torch.long)
        expected.index_add_(0, t, torch.ones(t.numel(), dtype=torch.float64))
        cand[t] = True
    return expected, cand


def frequent_vocab(expected_counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` token ids with the highest (text + teacher-expected) counts, sorted by id."""
    k = min(int(k), expected_counts.numel())
    return expected_counts.topk(k).indices.sort().values


def train_heads(model, layers: Sequence[int], token_sequences: Sequence[Sequence[int]], *,
                held_out: Sequence[Sequence[int]] | None = None, starts: Sequence[int] | None = None,
                held_out_starts: Sequence[int] | None = None, holdout: float = 0.2, kind: str = "affine",
                rank: int = 64, vocab_subset: int | None = None, epochs: int = 3, lr: float = 2e-3,
                batch_tokens: int = 32, train_vocab: str = "auto", negatives: int = 1024, topk: int = 32,
                max_len: int = 1024, seed: int = 0, checkpoint: str | Path | None = None, resume: bool = False,
                checkpoint_every: float = 60.0, evaluate: bool = True, revert_worse: bool = True, progress: bool = True,
                log: Callable[[str], None] | None = None) -> TrainResult:
    """Train one exit head per boundary in ``layers`` to match the final layer's next-token distribution.

    Args:
        model: ``LoadedModel`` or a ``transformers`` Llama-family causal LM (frozen; its weights are not changed).
        layers: boundaries (1..n_layers-1).
        token_sequences: token id sequences (e.g. from :func:`~hsd_opt.heads.data.generate_training_sequences`).
        held_out: evaluation sequences; when None, a ``holdout`` fraction of ``token_sequences`` is held out.
        starts, held_out_starts: per sequence, the index of its first generated token (prompt length): losses and
            metrics use positions ``>= start - 1`` only. Default 0 (all positions).
        kind, rank: head kind (``affine`` / ``lowrank``) and the low rank.
        vocab_subset: ``K`` -> reduced-vocabulary draft heads over the K most frequent training tokens.
        epochs, lr, batch_tokens: Adam schedule (5% warm-up, cosine decay), positions per step.
        train_vocab: ``"auto"`` (candidates on CPU, full on CUDA), ``"full"`` or ``"candidates"`` (module doc).
        checkpoint, resume, checkpoint_every: resumable training (module doc).
        evaluate: compute held-out metrics before and after.
        revert_worse: (full-vocabulary heads, with ``evaluate``) a head whose held-out acceptance is below the raw
            exit's is reset to the identity translator, i.e. the raw exit (``after`` then says ``reverted``).
    """
    if kind not in KINDS:
        raise HsdError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    m, _, _ = unwrap_model(model)
    eng = LayeredLM(m)
    layers = sorted(set(int(b) for b in layers))
    for b in layers:
        if not 1 <= b < eng.n_layers:
            raise HsdError(f"layer {b} is out of range: exit heads go after layers 1..{eng.n_layers - 1}")
    seqs = [list(map(int, s))[:max_len] for s in token_sequences]
    st = list(starts) if starts is not None else [0] * len(seqs)
    if held_out is None:
        tr, ho = split_indices(len(seqs), holdout, seed)
        train_seqs, held = [seqs[i] for i in tr], [seqs[i] for i in ho]
        train_st, held_st = [st[i] for i in tr], [st[i] for i in ho]
    else:
        train_seqs, train_st = seqs, st
        held = [list(map(int, s))[:max_len] for s in held_out]
        held_st = list(held_out_starts) if held_out_starts is not None else [0] * len(held)
    if not train_seqs or sum(max(0, len(s) - max(0, a - 1)) for s, a in zip(train_seqs, train_st)) == 0:
        raise HsdError("no training positions: give more or longer sequences")
    data_hash = sequences_sha256(train_seqs + [[-1]] + held)
    device = eng.device
    if train_vocab == "auto":
        train_vocab = "full" if device.type == "cuda" else "candidates"
    if train_vocab not in ("full", "candidates"):
        raise HsdError(f"train_vocab: expected auto, full or candidates, got {train_vocab!r}")
    settings = {"layers": layers, "kind": kind, "rank": rank if kind == "lowrank" else None,
                "vocab_subset": vocab_subset, "epochs": epochs, "lr": lr, "batch_tokens": batch_tokens,
                "train_vocab": train_vocab, "negatives": negatives, "topk": topk, "seed": seed,
                "max_len": max_len, "revert_worse": revert_worse}
    say = log or (lambda s: None)
    requires = [p.requires_grad for p in m.parameters()]
    m.requires_grad_(False)
    try:
        with torch.enable_grad():  # load_model() turns autograd off process-wide
            return _train(eng, m, layers, train_seqs, train_st, held, held_st, settings, data_hash, checkpoint, resume,
                          checkpoint_every, evaluate, progress, say)
    finally:
        for p, r in zip(m.parameters(), requires):
            p.requires_grad_(r)


def _train(eng, m, layers, train_seqs, train_st, held, held_st, settings, data_hash, checkpoint, resume,
           checkpoint_every, evaluate, progress, say) -> TrainResult:
    n = eng.n_layers
    V = eng.vocab_size
    kind, rank, K = settings["kind"], settings["rank"] or 64, settings["vocab_subset"]
    seed = settings["seed"]
    t_eval = 0.0
    before: dict[int, dict] = {}
    if evaluate and held:
        t0 = time.time()
        before = evaluate_heads(m, {b: RawHead(m) for b in layers}, held, held_st)
        t_eval += time.time() - t0
    t_start = time.time()
    cpu_start = time.process_time()
    expected, cand = _prepass(eng, train_seqs, train_st, settings["topk"])
    vocab_ids = frequent_vocab(expected, K).to(eng.device) if K else None
    heads = {b: TranslatorHead(m, kind, rank=rank, vocab_ids=vocab_ids) for b in layers}
    g = torch.Generator().manual_seed(seed)
    for b in layers:  # lowrank V init: deterministic per seed
        if kind == "lowrank":
            with torch.no_grad():
                heads[b].v.copy_(torch.randn(heads[b].v.shape, generator=g) / heads[b].hidden_size ** 0.5)
    # the vocabulary each step's softmax runs over
    if vocab_ids is not None:
        base_ids, rest = vocab_ids, None
    elif settings["train_vocab"] == "full":
        base_ids, rest = None, None
    else:
        base_ids = cand.nonzero().reshape(-1).to(eng.device)
        rest = (~cand).nonzero().reshape(-1).to(eng.device)
        if rest.numel() == 0:
            base_ids, rest = None, None
    n_neg = min(settings["negatives"], rest.numel()) if rest is not None else 0
    corr = math.log(rest.numel() / n_neg) if n_neg else 0.0
    say(f"training softmax over {'all ' + str(V) if base_ids is None else base_ids.numel()} tokens"
        + (f" + {n_neg} sampled negatives" if n_neg else "") + f"; prepass {time.time() - t_start:.1f} s")
    params = [p for h in heads.values() for p in h.parameters()]
    opt = torch.optim.Adam(params, lr=settings["lr"])
    bt = settings["batch_tokens"]
    steps_per_epoch = sum(math.ceil(max(0, len(s) - max(0, a - 1)) / bt) for s, a in zip(train_seqs, train_st))
    total_steps = max(1, steps_per_epoch * settings["epochs"])
    warm = max(1, int(0.05 * total_steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return settings["lr"] * (step + 1) / warm
        t = (step - warm) / max(1, total_steps - warm)
        return settings["lr"] * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    epoch0, seq0, step, history, elapsed0 = 0, 0, 0, [], 0.0
    ck_settings = dict(settings, data_sha256=data_hash, n_layers=n, hidden_size=eng.hidden_size, vocab_size=V)
    if checkpoint and resume and Path(checkpoint).is_file():
        try:
            ck = torch.load(str(checkpoint), map_location=eng.device, weights_only=False)
        except Exception as e:
            raise HsdError(f"{checkpoint}: cannot read the training checkpoint ({e}); delete it or run without "
                           f"--resume") from None
        if ck.get("settings") != ck_settings:
            diff = sorted(k for k in ck_settings if ck.get("settings", {}).get(k) != ck_settings[k])
            raise HsdError(f"{checkpoint}: the checkpoint was made with different settings or data "
                           f"({', '.join(diff)}); delete it or run without --resume")
        for b in layers:
            heads[b].load_state_dict(ck["heads"][b])
        opt.load_state_dict(ck["opt"])
        epoch0, seq0, step, history, elapsed0 = ck["epoch"], ck["seq"], ck["step"], ck["history"], ck["elapsed"]
        say(f"resuming from {checkpoint}: epoch {epoch0 + 1}, sequence {seq0}, step {step}")

    def save_ckpt(epoch: int, seq: int) -> None:
        if not checkpoint:
            return
        buf = io.BytesIO()
        torch.save({"settings": ck_settings, "heads": {b: h.state_dict() for b, h in heads.items()},
                    "opt": opt.state_dict(), "epoch": epoch, "seq": seq, "step": step, "history": history,
                    "elapsed": elapsed0 + time.time() - t_run}, buf)
        atomic_write_bytes(checkpoint, buf.getvalue())

    t_run = time.time()
    last_ck = time.time()
    with progress_bar(progress, fields="loss {task.fields[loss]}") as prog:
        task = prog.add_task(f"training {len(layers)} heads", total=total_steps, completed=step, loss="-")
        for epoch in range(epoch0, settings["epochs"]):
            order = torch.randperm(len(train_seqs), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            loss_sum, loss_n, t_ep = 0.0, 0, time.time()
            for si in range(seq0 if epoch == epoch0 else 0, len(train_seqs)):
                i = int(order[si])
                seq, lo = train_seqs[i], max(0, train_st[i] - 1)
                hs = eng.hidden_states(seq, layers + [n])
                with torch.no_grad():
                    tfull = eng.head(hs[n], n)  # [L, V] float32
                gpos = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch * 1009 + i)
                pos = lo + torch.randperm(len(seq) - lo, generator=gpos)
                for a in range(0, pos.numel(), bt):
                    idx = pos[a: a + bt].to(eng.device)
                    if base_ids is None:
                        ids = None
                        tz = tfull[idx]
                    else:
                        ids = base_ids
                        if n_neg:
                            neg = rest[torch.randint(0, rest.numel(), (n_neg,), generator=gpos).to(eng.device)]
                            ids = torch.cat([base_ids, neg])
                        tz = tfull[idx][:, ids]
                        if n_neg:
                            tz = tz.clone()
                            tz[:, base_ids.numel():] += corr
                    logp = F.log_softmax(tz, -1)
                    p = logp.exp()
                    for g_ in opt.param_groups:
                        g_["lr"] = lr_at(step)
                    opt.zero_grad(set_to_none=True)
                    step_loss = 0.0
                    for b in layers:
                        h = heads[b]
                        z = h.project(h.translate(hs[b][idx]), ids).float()
                        if n_neg:
                            z = torch.cat([z[:, : base_ids.numel()], z[:, base_ids.numel():] + corr], dim=1)
                        loss = (p * (logp - F.log_softmax(z, -1))).sum(-1).mean()
                        loss.backward()
                        step_loss += loss.item()
                    opt.step()
                    step += 1
                    loss_sum += step_loss / len(layers) * idx.numel()
                    loss_n += idx.numel()
                    prog.update(task, advance=1, loss=f"{step_loss / len(layers):.3f}")
                if checkpoint and time.time() - last_ck > checkpoint_every:
                    save_ckpt(epoch, si + 1)
                    last_ck = time.time()
            history.append({"epoch": epoch + 1, "train_loss": loss_sum / max(1, loss_n),
                            "seconds": round(time.time() - t_ep, 2)})
            save_ckpt(epoch + 1, 0)
            say(f"epoch {epoch + 1}/{settings['epochs']}: mean train KL {loss_sum / max(1, loss_n):.4f}")
            last_ck = time.time()
    seconds = elapsed0 + time.time() - t_start
    cpu_seconds = time.process_time() - cpu_start
    for h in heads.values():
        h.eval()
        h.requires_grad_(False)
    after: dict[int, dict] = {}
    if evaluate and held:
        t0 = time.time()
        after = evaluate_heads(m, heads, held, held_st)
        if vocab_ids is None and settings.get("revert_worse") and before:
            for b in layers:  # a head that does worse than the raw lens on held-out text becomes the raw lens
                if after[b]["acceptance"] < before[b]["acceptance"]:
                    with torch.no_grad():
                        for prm in heads[b].parameters():
                            prm.zero_()
                    after[b] = dict(before[b], reverted=True)
                    say(f"layer {b}: trained head did worse than the raw exit on held-out text; reverted to it")
        if vocab_ids is not None:
            raw_sub = evaluate_heads(m, {b: RawHead(m, vocab_ids) for b in layers}, held, held_st)
            for b in layers:
                after[b]["raw_subset_acceptance"] = raw_sub[b]["acceptance"]
        t_eval += time.time() - t0
    n_train = sum(len(s) - max(0, a - 1) for s, a in zip(train_seqs, train_st))
    n_held = sum(len(s) - max(0, a - 1) for s, a in zip(held, held_st))
    return TrainResult(heads=heads, before=before, after=after, history=history, vocab_ids=vocab_ids,
                       data_sha256=data_hash, seconds=seconds, eval_seconds=t_eval, settings=settings,
                       train_positions=n_train, heldout_positions=n_held, cpu_seconds=cpu_seconds)
