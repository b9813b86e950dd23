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
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from hsd_opt.console import progress_bar
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.heads.data import sequences_sha256, split_indices
from hsd_opt.heads.modules import RawHead, TranslatorHead
from hsd_opt.heads.settings import KINDS, MAX_LEN, MAX_LR, TRAIN_VOCABS, check_checkpoint
from hsd_opt.jsonio import atomic_write_bytes
from hsd_opt.models.loading import unwrap_model
from hsd_opt.seeds import SEED_STRIDE
from hsd_opt.values import is_integer, is_real


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
    ``argmax q == argmax p``, KL(p || q), and ``outside``: the target's mass on tokens the head cannot draft
    (``-inf`` logits: a reduced vocabulary; 0 for a full one). For a head with such tokens KL(p || q) is infinite,
    so ``kl`` is then the KL to ``p`` renormalised on the head's support: read it with ``outside`` beside it (a
    head can be close to ``p`` on its vocabulary and still miss a fifth of ``p``'s mass). Returns boundary ->
    means over positions.
    """
    m, _, _ = unwrap_model(model)
    eng = LayeredLM(m)
    layers = sorted(heads)
    n = eng.n_layers
    sums = {b: {"acceptance": 0.0, "greedy": 0.0, "kl": 0.0, "outside": 0.0} for b in layers}
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
                    s["outside"] += (1.0 - pm.sum(-1)).clamp_min(0.0).sum().item()
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


def _check_schedule(epochs, lr, batch_tokens, max_len, holdout) -> None:
    """The training's numbers as :func:`train_heads` takes them (the CLI checks its flags first); ``holdout``
    None: not used (held-out sequences given)."""
    for name, value, ok, what in (
            ("epochs", epochs, is_integer(epochs) and epochs >= 1, "an integer >= 1"),
            ("batch_tokens", batch_tokens, is_integer(batch_tokens) and batch_tokens >= 1, "an integer >= 1"),
            ("max_len", max_len, is_integer(max_len) and max_len >= 1, "an integer >= 1"),
            ("holdout", holdout, holdout is None or (is_real(holdout) and 0 < holdout < 1), "a fraction in (0, 1)"),
            ("lr", lr, is_real(lr) and math.isfinite(lr) and 0 < lr <= MAX_LR,
             f"a number in (0, {MAX_LR:g}] (Adam's step size)")):
        if not ok:
            raise HsdError(f"{name}: expected {what}, got {value!r}")


def _layer_list(layers, n_layers: int) -> list[int]:
    """``layers`` (boundaries 1..n_layers-1, a sequence of integers) sorted, without repeats."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers \
            or not all(is_integer(b) for b in layers):
        raise HsdError(f"layers: expected a non-empty list of layer numbers, got {layers!r}")
    out = sorted(set(int(b) for b in layers))
    for b in out:
        if not 1 <= b < n_layers:
            raise HsdError(f"layer {b} is out of range: exit heads go after layers 1..{n_layers - 1}")
    return out


def _check_vocab_sizes(vocab_subset, negatives, topk, vocab: int) -> None:
    """``vocab_subset`` (None or 1..vocab-1 tokens), ``negatives`` and ``topk`` (integers >= 0) as
    :func:`train_heads` takes them (the CLI checks its flags first)."""
    if vocab_subset is not None and not (is_integer(vocab_subset) and 1 <= vocab_subset < vocab):
        raise HsdError(f"vocab_subset: expected None or an integer in 1..{vocab - 1} (fewer tokens than the "
                       f"vocabulary), got {vocab_subset!r}")
    for name, value in (("negatives", negatives), ("topk", topk)):
        if not (is_integer(value) and value >= 0):
            raise HsdError(f"{name}: expected an integer >= 0, got {value!r}")


def _token_lists(name: str, sequences, vocab: int, max_len: int) -> list[list[int]]:
    """``sequences`` (token id sequences, argument ``name``) as lists of at most ``max_len`` ids, each checked to
    be in the vocabulary."""
    unordered = (str, bytes, dict, set, frozenset)      # text, or no order: not a list of sequences of ids
    if isinstance(sequences, unordered) or not hasattr(sequences, "__iter__"):
        raise HsdError(f"{name}: expected a list of token id sequences, got {type(sequences).__name__}")
    out = []
    for i, s in enumerate(sequences):
        if isinstance(s, unordered) or not hasattr(s, "__iter__"):
            raise HsdError(f"{name}[{i}]: expected a sequence of token ids, got {type(s).__name__}")
        ids = s.tolist() if hasattr(s, "tolist") else list(s)
        if not all(is_integer(t) and 0 <= t < vocab for t in ids):
            raise HsdError(f"{name}[{i}]: token ids must be in 0..{vocab - 1} (the model's vocabulary)")
        out.append([int(t) for t in ids[:max_len]])
    return out


def _start_list(name: str, starts, n: int) -> list[int]:
    """``starts`` (argument ``name``: one index >= 0 per sequence, ``n`` of them; None: 0 each) as a list."""
    if starts is None:
        return [0] * n
    out = list(starts)
    if len(out) != n or not all(is_integer(a) and a >= 0 for a in out):
        raise HsdError(f"{name}: expected one integer >= 0 per sequence ({n}), got {len(out)} values")
    return [int(a) for a in out]


def train_heads(model, layers: Sequence[int], token_sequences: Sequence[Sequence[int]], *,
                held_out: Sequence[Sequence[int]] | None = None, starts: Sequence[int] | None = None,
                held_out_starts: Sequence[int] | None = None, holdout: float = 0.2, kind: str = "affine",
                rank: int = 64, vocab_subset: int | None = None, epochs: int = 3, lr: float = 2e-3,
                batch_tokens: int = 32, train_vocab: str = "auto", negatives: int = 1024, topk: int = 32,
                max_len: int = MAX_LEN, seed: int = 0, checkpoint: str | Path | None = None, resume: bool = False,
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
    if kind == "lowrank" and (not is_integer(rank) or rank < 1):
        raise HsdError(f"--rank: expected an integer >= 1, got {rank!r}")
    _check_schedule(epochs, lr, batch_tokens, max_len, holdout if held_out is None else None)
    check_checkpoint(checkpoint, resume)
    m, _, _ = unwrap_model(model)
    eng = LayeredLM(m)
    layers = _layer_list(layers, eng.n_layers)
    vocab = m.get_input_embeddings().weight.shape[0]
    _check_vocab_sizes(vocab_subset, negatives, topk, vocab)
    seqs = _token_lists("token_sequences", token_sequences, vocab, max_len)
    st = _start_list("starts", starts, len(seqs))
    if held_out is None:
        tr, ho = split_indices(len(seqs), holdout, seed)
        train_seqs, held = [seqs[i] for i in tr], [seqs[i] for i in ho]
        train_st, held_st = [st[i] for i in tr], [st[i] for i in ho]
    else:
        train_seqs, train_st = seqs, st
        held = _token_lists("held_out", held_out, vocab, max_len)
        held_st = _start_list("held_out_starts", held_out_starts, len(held))
    if not train_seqs or sum(max(0, len(s) - max(0, a - 1)) for s, a in zip(train_seqs, train_st)) == 0:
        raise HsdError("no training positions: give more or longer sequences")
    data_hash = sequences_sha256(train_seqs + [[-1]] + held)
    device = eng.device
    if train_vocab == "auto":
        train_vocab = "full" if device.type == "cuda" else "candidates"
    if train_vocab not in TRAIN_VOCABS[1:]:
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
    """Train one head per boundary of ``layers`` (:func:`train_heads`, its arguments checked): the raw exits
    evaluated on the held-out text, the prepass, new heads and the softmax's vocabulary, Adam (resumed from
    ``checkpoint``), the epochs, then the trained heads evaluated."""
    t_eval = 0.0
    before: dict[int, dict] = {}
    if evaluate and held:
        t0 = time.time()
        before = evaluate_heads(m, {b: RawHead(m) for b in layers}, held, held_st)
        t_eval += time.time() - t0
    t_start = time.time()
    cpu_start = time.process_time()
    expected, cand = _prepass(eng, train_seqs, train_st, settings["topk"])
    K = settings["vocab_subset"]
    vocab_ids = frequent_vocab(expected, K).to(eng.device) if K else None
    heads = _new_heads(m, layers, settings, vocab_ids)
    vocab = _softmax_vocab(settings, vocab_ids, cand, eng.device)
    say(f"training softmax over {'all ' + str(eng.vocab_size) if vocab.base is None else vocab.base.numel()} tokens"
        + (f" + {vocab.n_neg} sampled negatives" if vocab.n_neg else "") + f"; prepass {time.time() - t_start:.1f} s")
    opt = torch.optim.Adam([p for h in heads.values() for p in h.parameters()], lr=settings["lr"])
    ck_settings = dict(settings, data_sha256=data_hash, n_layers=eng.n_layers, hidden_size=eng.hidden_size,
                       vocab_size=eng.vocab_size)
    start: tuple[int, int, int, list, float, tuple] = (0, 0, 0, [], 0.0, NO_LOSS)
    if checkpoint and resume and Path(checkpoint).is_file():
        start = _resume(checkpoint, eng.device, ck_settings, heads, opt, say)
    history, elapsed0 = start[3], start[4]
    _run_epochs(eng, layers, heads, opt, train_seqs, train_st, settings, vocab, start, checkpoint, ck_settings,
                checkpoint_every, progress, say)
    seconds = elapsed0 + time.time() - t_start
    cpu_seconds = time.process_time() - cpu_start
    for h in heads.values():
        h.eval()
        h.requires_grad_(False)
    after: dict[int, dict] = {}
    if evaluate and held:
        t0 = time.time()
        after = _evaluate_trained(m, heads, held, held_st, before, vocab_ids, settings, say)
        t_eval += time.time() - t0
    n_train = sum(len(s) - max(0, a - 1) for s, a in zip(train_seqs, train_st))
    n_held = sum(len(s) - max(0, a - 1) for s, a in zip(held, held_st))
    return TrainResult(heads=heads, before=before, after=after, history=history, vocab_ids=vocab_ids,
                       data_sha256=data_hash, seconds=seconds, eval_seconds=t_eval, settings=settings,
                       train_positions=n_train, heldout_positions=n_held, cpu_seconds=cpu_seconds)


def _new_heads(m, layers, settings: dict, vocab_ids: torch.Tensor | None) -> dict[int, TranslatorHead]:
    """One untrained head per boundary (``settings``' kind and rank; over ``vocab_ids`` when a reduced
    vocabulary); a low-rank head's V drawn from the seed (N(0, 1 / hidden size))."""
    kind = settings["kind"]
    rank = settings["rank"] if kind == "lowrank" else 64     # an affine head has no rank (its settings say None)
    heads = {b: TranslatorHead(m, kind, rank=rank, vocab_ids=vocab_ids) for b in layers}
    g = torch.Generator().manual_seed(settings["seed"])
    for b in layers:  # lowrank V init: deterministic per seed
        if kind == "lowrank":
            with torch.no_grad():
                heads[b].v.copy_(torch.randn(heads[b].v.shape, generator=g) / heads[b].hidden_size ** 0.5)
    return heads


class _SoftmaxVocab(NamedTuple):
    """The tokens each training step's softmax runs over: every token (``base`` None), or the ids ``base`` plus
    ``n_neg`` negatives sampled from the ids ``rest`` at each step, their logits raised by ``corr`` =
    log(|rest| / n_neg) (the sampled-softmax correction)."""

    base: torch.Tensor | None
    rest: torch.Tensor | None
    n_neg: int
    corr: float


def _softmax_vocab(settings: dict, vocab_ids: torch.Tensor | None, cand: torch.Tensor, device) -> _SoftmaxVocab:
    """The training softmax's vocabulary: a reduced-vocabulary head's own ids, every token (``train_vocab``
    "full", or no token outside the candidates), or the prepass's candidates ``cand`` ([V] bool) with sampled
    negatives from the rest."""
    if vocab_ids is not None:
        base_ids, rest = vocab_ids, None
    elif settings["train_vocab"] == "full":
        base_ids, rest = None, None
    else:
        base_ids = cand.nonzero().reshape(-1).to(device)
        rest = (~cand).nonzero().reshape(-1).to(device)
        if rest.numel() == 0:
            base_ids, rest = None, None
    n_neg = min(settings["negatives"], rest.numel()) if rest is not None else 0
    corr = math.log(rest.numel() / n_neg) if n_neg else 0.0
    return _SoftmaxVocab(base_ids, rest, n_neg, corr)


#: An epoch's loss before its first sequence: ``(sum of the steps' mean KL weighted by positions, positions,
#: seconds)``, what a checkpoint keeps of the epoch under way (:func:`_save_checkpoint`).
NO_LOSS = (0.0, 0, 0.0)


def _resume(checkpoint, device, ck_settings: dict, heads: dict, opt,
            say) -> tuple[int, int, int, list, float, tuple]:
    """Load the heads' and the optimiser's state from ``checkpoint``, which must have been made with
    ``ck_settings`` (the settings and the data's hash): ``(epoch, sequence, step, history, elapsed seconds,
    the epoch's loss so far)`` to go on from (the loss: ``(sum, positions, seconds)``, :func:`_save_checkpoint`)."""
    try:
        ck = torch.load(str(checkpoint), map_location=device, weights_only=False)
    except Exception as e:
        raise HsdError(f"{checkpoint}: cannot read the training checkpoint ({e}); delete it to start "
                       f"over") from None
    if not isinstance(ck, dict) or not isinstance(ck.get("settings"), dict):
        raise HsdError(f"{checkpoint}: not a heads training checkpoint (a {type(ck).__name__} without settings); "
                       f"delete it to start over")
    if ck["settings"] != ck_settings:
        diff = sorted(k for k in ck_settings if ck["settings"].get(k) != ck_settings[k])
        raise HsdError(f"{checkpoint}: the checkpoint was made with different settings or data "
                       f"({', '.join(diff)}); delete it to start over")
    try:
        for b, h in heads.items():
            h.load_state_dict(ck["heads"][b])
        opt.load_state_dict(ck["opt"])
        _check_moments(opt)
        part = ck.get("epoch_loss", NO_LOSS)             # (a checkpoint written before it was kept)
        at = (int(ck["epoch"]), int(ck["seq"]), int(ck["step"]), list(ck["history"]), float(ck["elapsed"]),
              (float(part[0]), int(part[1]), float(part[2])))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise HsdError(f"{checkpoint}: a damaged heads training checkpoint ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); delete it to start over") from None
    say(f"resuming from {checkpoint}: epoch {at[0] + 1}, sequence {at[1]}, step {at[2]}")
    return at


def _check_moments(opt) -> None:
    """Raise ValueError where a state tensor the optimizer took (Adam's moments) has another shape than its
    parameter: ``load_state_dict`` takes it, and the first step would fail with torch's traceback."""
    for group in opt.param_groups:
        for p in group["params"]:
            for name, t in opt.state.get(p, {}).items():
                if torch.is_tensor(t) and t.dim() > 0 and t.shape != p.shape:
                    raise ValueError(f"the optimizer's {name} has shape {tuple(t.shape)}, its parameter "
                                     f"{tuple(p.shape)}")


def _save_checkpoint(path, ck_settings: dict, heads: dict, opt, epoch: int, seq: int, step: int, history: list,
                     elapsed: float, epoch_loss: tuple = NO_LOSS) -> None:
    """Write the heads, the optimiser and the position in the data (``epoch``, ``seq``, ``step``) to ``path``,
    atomically, with ``ck_settings`` to check a resume against, the seconds trained so far and, mid-epoch, the
    epoch's loss so far (``(sum of the steps' mean KL weighted by positions, positions, seconds)``: a resumed
    epoch's mean loss is the whole epoch's)."""
    buf = io.BytesIO()
    torch.save({"settings": ck_settings, "heads": {b: h.state_dict() for b, h in heads.items()},
                "opt": opt.state_dict(), "epoch": epoch, "seq": seq, "step": step, "history": history,
                "elapsed": elapsed, "epoch_loss": list(epoch_loss)}, buf)
    atomic_write_bytes(path, buf.getvalue())


def _lr_at(step: int, lr: float, total_steps: int) -> float:
    """The learning rate at ``step``: linear warm-up to ``lr`` over the first 5% of the steps, then cosine decay
    to 0."""
    warm = max(1, int(0.05 * total_steps))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total_steps - warm)
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _run_epochs(eng, layers, heads: dict, opt, train_seqs, train_st, settings: dict, vocab: _SoftmaxVocab,
                start: tuple, checkpoint, ck_settings: dict, checkpoint_every: float, progress: bool, say) -> None:
    """The epochs from ``start`` (``(epoch, sequence, step, history, elapsed seconds)``, :func:`_resume`): each
    visits the training sequences in an order drawn from the seed and the epoch, appends its mean loss to the
    history, and ends with a checkpoint (also written every ``checkpoint_every`` seconds)."""
    epoch0, seq0, step, history, elapsed0, part = start
    bt = settings["batch_tokens"]
    steps_per_epoch = sum(math.ceil(max(0, len(s) - max(0, a - 1)) / bt) for s, a in zip(train_seqs, train_st))
    total_steps = max(1, steps_per_epoch * settings["epochs"])
    t_run = last_ck = time.time()

    def save(epoch: int, seq: int, step: int, epoch_loss: tuple = NO_LOSS) -> None:
        if checkpoint:
            _save_checkpoint(checkpoint, ck_settings, heads, opt, epoch, seq, step, history,
                             elapsed0 + time.time() - t_run, epoch_loss)

    with progress_bar(progress, fields="loss {task.fields[loss]}") as prog:
        task = prog.add_task(f"training {len(layers)} heads", total=total_steps, completed=step, loss="-")
        for epoch in range(epoch0, settings["epochs"]):
            g = torch.Generator().manual_seed(settings["seed"] * 1000 + epoch)
            order = torch.randperm(len(train_seqs), generator=g)
            resumed = epoch == epoch0 and seq0 > 0
            loss, t_ep = ((part[0], part[1]), time.time() - part[2]) if resumed else ((0.0, 0), time.time())
            for si in range(seq0 if epoch == epoch0 else 0, len(train_seqs)):
                i = int(order[si])
                step, loss = _train_sequence(eng, layers, heads, opt, train_seqs[i], max(0, train_st[i] - 1), vocab,
                                             settings, epoch, i, step, total_steps, loss,
                                             lambda x: prog.update(task, advance=1, loss=f"{x:.3f}"))
                if checkpoint and time.time() - last_ck > checkpoint_every:
                    save(epoch, si + 1, step, (*loss, time.time() - t_ep))
                    last_ck = time.time()
            history.append({"epoch": epoch + 1, "train_loss": loss[0] / max(1, loss[1]),
                            "seconds": round(time.time() - t_ep, 2)})
            save(epoch + 1, 0, step)
            say(f"epoch {epoch + 1}/{settings['epochs']}: mean train KL {loss[0] / max(1, loss[1]):.4f}")
            last_ck = time.time()


def _train_sequence(eng, layers, heads: dict, opt, seq: list[int], lo: int, vocab: _SoftmaxVocab, settings: dict,
                    epoch: int, i: int, step: int, total_steps: int, loss: tuple[float, int],
                    advance: Callable[[float], None]) -> tuple[int, tuple[float, int]]:
    """Train on sequence ``i`` (token ids; its positions from ``lo`` on) in steps of ``batch_tokens`` positions,
    in an order drawn from the seed, the epoch and ``i``, off one teacher-forced pass: the step count after it and
    the epoch's ``loss`` (sum of the steps' mean KL over the heads weighted by positions, positions) added to;
    ``advance`` hears each step's mean KL."""
    n = eng.n_layers
    hs = eng.hidden_states(seq, layers + [n])
    with torch.no_grad():
        tfull = eng.head(hs[n], n)  # [L, V] float32
    gpos = torch.Generator().manual_seed(settings["seed"] * SEED_STRIDE + epoch * 1009 + i)
    pos = lo + torch.randperm(len(seq) - lo, generator=gpos)
    loss_sum, loss_n = loss
    for a in range(0, pos.numel(), settings["batch_tokens"]):
        idx = pos[a: a + settings["batch_tokens"]].to(eng.device)
        ids, tz = _step_targets(tfull, idx, vocab, gpos, eng.device)
        step_loss = _train_step(heads, layers, hs, idx, ids, tz, vocab, opt,
                                _lr_at(step, settings["lr"], total_steps))
        step += 1
        loss_sum += step_loss / len(layers) * idx.numel()
        loss_n += idx.numel()
        advance(step_loss / len(layers))
    return step, (loss_sum, loss_n)


def _step_targets(tfull: torch.Tensor, idx: torch.Tensor, vocab: _SoftmaxVocab, gpos: torch.Generator, device):
    """The token ids one step's softmax runs over (None: all V) and the teacher's logits there, ``[B, len(ids)]``,
    at the positions ``idx`` (``[B]``) of ``tfull`` (``[L, V]``); the step's negatives drawn from ``gpos``."""
    if vocab.base is None:
        return None, tfull[idx]
    ids = vocab.base
    if vocab.n_neg:
        neg = vocab.rest[torch.randint(0, vocab.rest.numel(), (vocab.n_neg,), generator=gpos).to(device)]
        ids = torch.cat([vocab.base, neg])
    tz = tfull[idx][:, ids]
    if vocab.n_neg:
        tz = tz.clone()
        tz[:, vocab.base.numel():] += vocab.corr
    return ids, tz


def _train_step(heads: dict, layers, hs: dict, idx: torch.Tensor, ids: torch.Tensor | None, tz: torch.Tensor,
                vocab: _SoftmaxVocab, opt, lr: float) -> float:
    """One Adam step at learning rate ``lr`` on every head: KL(teacher || head) over ``ids`` at the positions
    ``idx`` of the hidden states ``hs`` (``{layer: [L, d]}``), mean over positions, with ``tz`` the teacher's
    logits (``[B, len(ids)]``). Returns the sum of the heads' losses."""
    logp = F.log_softmax(tz, -1)
    p = logp.exp()
    for g_ in opt.param_groups:
        g_["lr"] = lr
    opt.zero_grad(set_to_none=True)
    step_loss = 0.0
    for b in layers:
        h = heads[b]
        z = h.project(h.translate(hs[b][idx]), ids).float()
        if vocab.n_neg:
            z = torch.cat([z[:, : vocab.base.numel()], z[:, vocab.base.numel():] + vocab.corr], dim=1)
        loss = (p * (logp - F.log_softmax(z, -1))).sum(-1).mean()
        loss.backward()
        step_loss += loss.item()
    opt.step()
    return step_loss


def _evaluate_trained(m, heads: dict, held, held_st, before: dict, vocab_ids: torch.Tensor | None, settings: dict,
                      say) -> dict[int, dict]:
    """The trained heads' held-out metrics; a full-vocabulary head that does worse than the raw exit (``before``)
    is reverted to it (``revert_worse``); a reduced-vocabulary head's row also holds the raw exit's acceptance on
    the same subset."""
    after = evaluate_heads(m, heads, held, held_st)
    if vocab_ids is None and settings.get("revert_worse") and before:
        for b in heads:  # a head that does worse than the raw lens on held-out text becomes the raw lens
            if not after[b]["acceptance"] >= before[b]["acceptance"]:      # NaN (a diverged head) too
                with torch.no_grad():
                    for prm in heads[b].parameters():
                        prm.zero_()
                after[b] = dict(before[b], reverted=True)
                say(f"layer {b}: trained head did worse than the raw exit on held-out text; reverted to it")
    if vocab_ids is not None:
        raw_sub = evaluate_heads(m, {b: RawHead(m, vocab_ids) for b in heads}, held, held_st)
        for b in heads:
            after[b]["raw_subset_acceptance"] = raw_sub[b]["acceptance"]
    return after
