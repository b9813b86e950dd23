"""The profiler: acceptance rates and costs of a drafter pool for one target (seed 003 Sec. 4.2).

For each prompt of the suite:

1. the target generates a continuation with its own layered engine (greedy at ``temperature == 0``, else
   sampling from ``softmax(logits / T)`` with a generator seeded by ``(seed, prompt index)`` so shards and
   resumed runs generate the same text), stopping at EOS or ``max_new_tokens``;
2. ONE teacher-forced pass over prompt + continuation keeps the residual stream at every exit boundary
   (:meth:`LayeredLM.hidden_states`); draft models run their own pass;
3. in chunks of ``chunk`` positions, each drafter's next-token distribution at every generated position is
   computed (exit head -> ``softmax(logits / T)``; at ``T == 0`` the plain ``softmax(logits)`` is used for the
   TV-based acceptance and ``argmax`` for greedy agreement), and for every pair the per-position
   ``sum_x min(p_i(x), p_j(x))`` and argmax agreement are added to :class:`~hsd_opt.profiler.stats.PairStats`.
   Only ``[N, chunk, V]`` probabilities exist at a time; nothing vocab-sized is kept across chunks;
4. token drafters (n-gram, bigram, ...) propose one token at every generated position from the true context
   (``reset`` with the prompt, ``observe`` fed the true continuation as it goes, as at run time); their
   acceptance against verifier j is ``p_j(proposal)`` and agreement is ``proposal == argmax p_j``.

After every prompt the statistics are checkpointed atomically to ``<out>.partial.json`` (per rank under
torchrun: ``<out>.partial.rank<r>.json``); ``resume=True`` continues from it and refuses a checkpoint made with
other settings. Under ``torchrun`` (``WORLD_SIZE > 1``) prompts are sharded round-robin across ranks, the sums
are all-reduced (gloo on CPU, NCCL on CUDA) and rank 0 measures costs and writes the profile.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import PROFILE_FORMAT, ModelEntry, Profile, profile_from_dict, save_profile
from hsd_opt.jsonio import read_json, write_json
from hsd_opt.models.loading import eos_token_ids, file_sha256
from hsd_opt.profiler.prompts import PromptItem, encode_prompt, load_prompts, task_names
from hsd_opt.profiler.stats import PairStats

DEFAULT_MAX_NEW_TOKENS = 24
PARTIAL_FORMAT = "hsd-profile-partial/1"
DEFAULT_TOKEN_DRAFTERS = ("ngram", "lookup", "bigram", "aded")
KNOWN_TOKEN_DRAFTERS = ("ngram", "lookup", "bigram", "aded")
#: Settings a checkpoint must share with the run that resumes it (and profiles must share to merge).
RESUME_FIELDS = ("model", "revision", "heads_sha256", "prompts_sha256", "temperature", "max_new_tokens", "raw",
                 "seed", "dtype", "layers", "draft_models", "quantized", "token_drafters", "shard", "max_prompts",
                 "world_size")
MERGE_FIELDS = ("model", "revision", "heads_sha256", "temperature", "max_new_tokens", "raw", "dtype", "layers",
                "draft_models", "quantized", "token_drafters")


@dataclass
class ProfileConfig:
    """Everything ``hsd profile`` takes (see ``hsd profile --help`` for the flags)."""

    model: str
    out: Path
    prompts: Path | None = None
    layers: str = "all"
    draft_models: list[str] = field(default_factory=list)
    quantized: str | None = None                    # --quantized: None = default (int8,int4 where kernels run)
    token_drafters: list[str] | None = None        # None: the default pool (those whose modules exist)
    heads: Path | None = None
    temperature: float = 0.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    raw: bool = False
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    resume: bool = False
    tmax: int = 15
    cost_repeats: int = 5
    cost_warmup: int = 2
    curve_repeats: int = 2
    shard: tuple[int, int] | None = None            # (k, n): this run does prompts i with i % n == k
    max_prompts: int | None = None
    chunk: int = 16
    progress: bool = True
    threads: int = 0                                # CPU threads for torch (0: torch's default)


# -------------------------------------------------------------------------------------------- helpers


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """``"all"`` -> 1..n; ``"4,8,12"`` or ``"2-10"`` -> those (the target's last layer n is always added).
    Boundaries count decoder layers run (layer b = the residual stream after b layers)."""
    from hsd_opt.engine.layered import parse_layer_spec

    note = f"valid layers are 1..{n_layers} (the model has {n_layers} decoder layers)"
    return sorted(set(parse_layer_spec(spec or "all", n_layers, note)) | {n_layers})


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or not int(m.group(2)) >= 1 or not int(m.group(1)) < int(m.group(2)):
        raise HsdError(f"--shard: expected K/N with 0 <= K < N (e.g. 0/4), got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def _short_name(model_id: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model_id.rstrip("/")).name or model_id).strip("-") or "draft"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def set_threads(threads: int, warn: Callable[[str], None]) -> str:
    """``threads > 0``: use that many torch CPU threads. ``0`` (auto): torch's default, except on a CPU machine
    that is already oversubscribed (1-minute load average >= number of cores), where 1 thread is used: there,
    OpenMP threads spin-waiting for each other make small decode steps 10-20x slower (measured on a 2-core VM at
    load 8: 2.7 s vs 0.13 s per SmolLM2 step). Returns a note for the provenance."""
    if threads and threads > 0:
        torch.set_num_threads(int(threads))
        return f"--threads {threads}"
    if torch.cuda.is_available() or not hasattr(os, "getloadavg"):
        return "torch default"
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if cpus > 1 and load >= cpus and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        warn(f"this machine is busy (load average {load:.1f} on {cpus} cores): profiling with 1 torch thread, "
             f"and the costs are measured with 1 thread; pass --threads {cpus} to force more")
        return f"auto: 1 (load average {load:.1f} on {cpus} cores)"
    return "torch default"


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` from torchrun's environment (``(0, 1)`` outside torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# -------------------------------------------------------------------------------------------- the pool


@dataclass
class NeuralDrafter:
    """A drafter with a distribution: an exit ``boundary`` of ``engine`` (the target's or a draft model's)."""

    name: str
    kind: str                      # target | early_exit | model | quantized
    engine: Any                    # LayeredLM
    boundary: int
    model_id: str | None = None


def build_token_drafters(names: Sequence[str] | None, lm, explicit: bool, warn: Callable[[str], None]):
    """Instantiate token drafters by name: ``ngram`` (context n-gram), ``lookup`` (context n-gram that abstains
    without a 2- or 3-gram match, prompt-lookup style), ``bigram`` (model bigram table, built
    once and disk-cached), ``aded`` (when its module exists). With the default pool a missing module is
    skipped silently; a name asked for explicitly and unavailable is an error."""
    out = []
    for name in (names if names is not None else DEFAULT_TOKEN_DRAFTERS):
        try:
            d = _make_token_drafter(name, lm, explicit)
        except _NotCached as e:
            warn(f"token drafter {name!r} skipped: {e}")
            continue
        except ImportError as e:
            if explicit:
                raise HsdError(f"--token-drafters: {name!r} is not available in this installation ({e})") from None
            continue
        except HsdError:
            raise
        if d is None:
            raise HsdError(f"--token-drafters: unknown token drafter {name!r}; known: "
                           f"{', '.join(KNOWN_TOKEN_DRAFTERS)}")
        out.append(d)
    return out


class _NotCached(Exception):
    pass


def _make_token_drafter(name: str, lm, explicit: bool = True):
    if name == "ngram":
        from hsd_opt.drafters.ngram import ContextNgramDrafter

        return ContextNgramDrafter(name="ngram")
    if name == "lookup":
        from hsd_opt.drafters.ngram import ContextNgramDrafter

        return ContextNgramDrafter(name="lookup", q=3, w=4, min_q=2, abstain=True)
    if name == "bigram":
        from hsd_opt.drafters import bigram as bg

        BigramDrafter, load_or_build_bigram_table = bg.BigramDrafter, bg.load_or_build_bigram_table
        key = bg.model_fingerprint(lm.model)
        bos = bg.resolve_bos(lm.model, bg.AUTO) if hasattr(bg, "resolve_bos") else None
        cached = bg.table_path(None, key, 16, bos)
        if not explicit and not cached.exists():
            raise _NotCached(f"the bigram table of this model is not cached yet ({cached});"
                             f" pass --token-drafters ngram,bigram once to build it (one forward per vocabulary "
                             f"token: ~3.5 min for SmolLM2-135M on 2 CPU cores)")
        table = load_or_build_bigram_table(lm.model, key, top_k=16, progress=True)
        return BigramDrafter(table, name="bigram")
    return None


def _aded_available(explicit: bool) -> bool:
    import importlib.util

    if importlib.util.find_spec("hsd_opt.drafters.aded") is not None:
        return True
    if explicit:
        raise HsdError("--token-drafters: 'aded' is not available in this installation (no hsd_opt.drafters.aded)")
    return False


def _build_aded(conts: dict[str, list[int]], world: int, warn: Callable[[str], None]):
    """ADED's tri-gram matrix from the target's continuations of the whole suite (all ranks: gathered), saved in
    the cache under a content hash so its config() rebuilds it."""
    from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix
    from hsd_opt.models.loading import cache_dir

    allc = dict(conts)
    if world > 1:
        import torch.distributed as dist

        _ensure_dist(torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda"))
        got: list = [None] * world
        dist.all_gather_object(got, conts)
        for c in got:
            allc.update(c)
    seqs = [allc[k] for k in sorted(allc, key=int)]
    h = hashlib.sha256(repr(seqs).encode()).hexdigest()[:16]
    path = cache_dir() / "aded" / f"aded-{h}.npz"
    if path.exists():
        m = TrigramMatrix.load(path)
    else:
        m = TrigramMatrix.from_sequences(seqs)
        m.save(path)
    if len(m) == 0:
        warn("aded: the continuations hold no tri-gram seen twice; its matrix is empty (it will repeat tokens)")
    return AdedDrafter(m, name="aded")


def _fresh(d):
    """A drafter in its initial state for one prompt. Adaptive drafters whose state outlives reset() (ADED's
    matrix) are rebuilt from their config, so every prompt is profiled independently of the others: shards,
    ranks and resumed runs then add up exactly."""
    if getattr(d, "kind", "") == "aded":
        from hsd_opt.drafters import make_token_drafter

        cfg = dict(d.config())
        return make_token_drafter(cfg.pop("kind"), **cfg)
    return d


def _encode(lm, it: PromptItem, raw: bool, source: str) -> list[int]:
    ids = encode_prompt(lm.tokenizer, it.prompt, raw)
    if not ids:
        raise InputFileError(source, "prompt encodes to no tokens", f"line of prompt {it.index + 1}")
    return ids


# -------------------------------------------------------------------------------------------- core


@torch.no_grad()
def generate(eng, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float, eos: set[int],
             generator: torch.Generator | None = None) -> list[int]:
    """The target's continuation of ``prompt_ids`` (greedy at T = 0), up to and including an EOS token."""
    n = eng.n_layers
    st = eng.new_state(len(prompt_ids) + max_new_tokens + 1)
    eng.append(st, list(prompt_ids))
    out: list[int] = []
    for _ in range(max_new_tokens):
        eng.advance(st, n)
        logits = eng.logits(st, n, st.n - 1, st.n)[0]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, -1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        else:
            tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
        eng.append(st, [tok])
    return out


def _exit_logits(neural: Sequence[NeuralDrafter], hidden: dict, rows: torch.Tensor) -> list[torch.Tensor]:
    """Float32 logits ``[m, V]`` of every drafter at ``rows``. Exits that share their model's own final norm +
    LM head are computed in ONE matmul over all their rows (the LM head's weights are read once instead of once
    per exit: ~3x faster for SmolLM2's 30 exits); trained exit heads are applied one by one."""
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
        lg = eng.lm_head(eng.norm(hs)).float()
        m = rows.numel()
        for n, k in enumerate(ks):
            out[k] = lg[n * m:(n + 1) * m]
    return out  # type: ignore[return-value]


def pairwise_overlap(P: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """``out[i, j, p] = sum_x min(P[i, p, x], P[j, p, x])`` for ``i < j`` (zeros elsewhere); ``P`` is ``[N, m, V]``.

    Computed in vocabulary blocks of ``block`` columns into a reused buffer, so the ``[N, m, block]`` temporaries
    stay in cache (about 3x faster on CPU than whole-vocabulary temporaries; the sum is the same up to float32
    summation order)."""
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


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)


@torch.no_grad()
def profile_sequence(neural: Sequence[NeuralDrafter], token_drafters: Sequence, prompt_ids: Sequence[int],
                     continuation: Sequence[int], temperature: float, chunk: int = 16):
    """Per-position statistics of one prompt + continuation (see the module doc).

    Returns ``(acc_nn [N, N, G], agree_nn [N, N, G], acc_tn [T, N, G], agree_tn [T, N, G], propose_seconds[T])``
    as numpy arrays (``i < j`` filled for the neural ones), ``G = len(continuation)``; ``acc_tn`` is NaN (and
    ``agree_tn`` False) at positions where a token drafter abstained.
    """
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
            secs[ti] += time.perf_counter() - t0
            props[ti, g] = int(prop[0]) if prop else -1      # -1: it abstained (NaN in acc_tn)
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
        for lg in _exit_logits(neural, hidden, r):
            am.append(lg.argmax(-1).cpu())
            probs.append(_probs(lg, temperature).cpu())
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


# -------------------------------------------------------------------------------------------- driver


def _partial_path(out: Path, rank: int, world: int) -> Path:
    return out.with_name(out.name + (".partial.json" if world == 1 else f".partial.rank{rank}.json"))


def _check_settings(theirs: dict, ours: dict, source: str, fields: Sequence[str], what: str) -> None:
    for f in fields:
        if theirs.get(f) != ours.get(f):
            raise InputFileError(source, f"{what} was made with {f} = {theirs.get(f)!r}, this run has "
                                         f"{ours.get(f)!r}; rerun without --resume (or delete it) to start over",
                                 f"settings.{f}")


def run_profile(cfg: ProfileConfig, on_prompt: Callable[[int], None] | None = None,
                log: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None) -> Profile | None:
    """Profile ``cfg.model``; write ``cfg.out`` (rank 0) and return the :class:`Profile` (None on other ranks).

    ``on_prompt(k)`` is called after the k-th prompt of this run is done and checkpointed (tests use it to
    simulate a crash).
    """
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.models.loading import check_same_tokenizer, load_model

    log = log or (lambda s: None)
    warn = warn or (lambda s: None)
    rank, world = dist_info()
    if cfg.max_new_tokens < 1:
        raise HsdError(f"--max-new-tokens: expected >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0:
        raise HsdError(f"--temperature: expected >= 0, got {cfg.temperature}")
    if cfg.tmax < 1:
        raise HsdError(f"--tmax: expected >= 1, got {cfg.tmax}")
    threads_note = set_threads(cfg.threads, warn)
    items, prompts_sha, prompts_source = load_prompts(cfg.prompts)
    tasks = task_names(items)
    if cfg.max_prompts is not None:
        items = items[: cfg.max_prompts]

    t_start = time.perf_counter()
    lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    heads_sha = None
    exit_heads = None
    heads_meta: dict = {}
    if cfg.heads is not None:
        if not Path(cfg.heads).is_file():
            raise InputFileError(str(cfg.heads), "file not found", None)
        from hsd_opt.heads import load_heads

        exit_heads, heads_meta = load_heads(str(cfg.heads), lm)
        heads_sha = file_sha256(Path(cfg.heads))
    eng = LayeredLM(lm.model, exit_heads=exit_heads)
    n_layers = eng.n_layers
    boundaries = parse_layers(cfg.layers, n_layers)
    target_name = f"layer{n_layers}"

    neural: list[NeuralDrafter] = [
        NeuralDrafter(f"layer{b}", "target" if b == n_layers else "early_exit", eng, b) for b in boundaries]
    drafts = []
    taken = {nd.name for nd in neural}
    for dm in cfg.draft_models:
        try:
            dlm = load_model(dm, device=cfg.device, dtype=cfg.dtype)
        except HsdError as e:
            raise HsdError(str(e).replace("--model", "--draft-model", 1)) from None
        check_same_tokenizer(lm.tokenizer, dlm.tokenizer, dm)
        deng = LayeredLM(dlm.model)
        name = _short_name(dlm.model_id, taken)
        taken.add(name)
        neural.append(NeuralDrafter(name, "model", deng, deng.n_layers, dlm.model_id))
        drafts.append(dlm)
    from hsd_opt.engine.quantized import QuantizedLM, parse_quantized, quant_spec

    for qname in parse_quantized(cfg.quantized, eng.device):
        if qname in taken:
            raise HsdError(f"--quantized: name {qname!r} is already used by another drafter")
        bits, group = quant_spec(qname)
        log(f"quantizing a copy of the target: {qname}")
        qeng = QuantizedLM(lm.model, bits=bits, group_size=group, name=qname)
        taken.add(qname)
        neural.append(NeuralDrafter(qname, "quantized", qeng, qeng.n_layers))
    requested = list(cfg.token_drafters) if cfg.token_drafters is not None else list(DEFAULT_TOKEN_DRAFTERS)
    want_aded = "aded" in requested and _aded_available(cfg.token_drafters is not None)
    tds = build_token_drafters([n for n in requested if n != "aded"], lm, cfg.token_drafters is not None, warn)
    for d in tds:
        if d.name in taken:
            raise HsdError(f"--token-drafters: name {d.name!r} is already used by another drafter")
        taken.add(d.name)

    settings = {
        "model": lm.model_id, "revision": lm.revision, "heads": str(cfg.heads) if cfg.heads else None,
        "heads_sha256": heads_sha, "prompts": prompts_source, "prompts_sha256": prompts_sha,
        "temperature": float(cfg.temperature), "max_new_tokens": int(cfg.max_new_tokens), "raw": bool(cfg.raw),
        "seed": int(cfg.seed), "dtype": lm.dtype, "layers": boundaries,
        "draft_models": [nd.model_id for nd in neural if nd.kind == "model"],
        "quantized": [nd.name for nd in neural if nd.kind == "quantized"],
        "token_drafters": [f"{d.kind}:{d.name}" for d in tds] + (["aded:aded"] if want_aded else []),
        "shard": list(cfg.shard) if cfg.shard else None,
        "max_prompts": cfg.max_prompts, "world_size": world,
    }
    counters = ["prompts", "prompt_tokens", "generated_tokens", "eos_stops"]
    token_names = [d.name for d in tds] + (["aded"] if want_aded else [])
    counters += [f"propose_seconds.{n}" for n in token_names] + [f"propose_calls.{n}" for n in token_names]
    stats = PairStats([nd.name for nd in neural], token_names, tasks, counters)

    mine = [it for it in items if cfg.shard is None or it.index % cfg.shard[1] == cfg.shard[0]]
    mine = [it for j, it in enumerate(mine) if j % world == rank]
    partial = _partial_path(Path(cfg.out), rank, world)
    done: list[int] = []
    conts: dict[str, list[int]] = {}
    if cfg.resume and partial.exists():
        ck = read_json(partial)
        if not isinstance(ck, dict) or ck.get("format") != PARTIAL_FORMAT:
            raise InputFileError(str(partial), f"not a profiler checkpoint (expected format {PARTIAL_FORMAT!r})",
                                 "format")
        _check_settings(ck.get("settings", {}), settings, str(partial), RESUME_FIELDS, "this checkpoint")
        stats = PairStats.from_dict(ck["stats"])
        done = [int(x) for x in ck.get("done", [])]
        conts = {str(k): [int(t) for t in v] for k, v in ck.get("continuations", {}).items()}
        log(f"resuming from {partial}: {len(done)} prompt(s) already profiled")
    elif cfg.resume:
        warn(f"--resume: no checkpoint at {partial}; starting from the beginning")
    elif partial.exists():
        raise HsdError(f"{partial}: a checkpoint of an interrupted run exists; pass --resume to continue it, or "
                       f"delete it to start over")
    todo = [it for it in mine if it.index not in set(done)]

    def _checkpoint() -> None:
        write_json(partial, {"format": PARTIAL_FORMAT, "settings": settings, "rank": rank, "world_size": world,
                             "done": done, "continuations": conts, "stats": stats.to_dict()}, indent=None)

    eos = set(eos_token_ids(lm))
    progress = _progress(cfg.progress and rank == 0)
    t_prof = time.perf_counter()
    try:
        # phase 1: the target's continuations (checkpointed; they are also ADED's default corpus)
        need_gen = [it for it in mine if str(it.index) not in conts]
        gid = progress.add_task("generating", total=len(mine), completed=len(mine) - len(need_gen)) \
            if progress else None
        for it in need_gen:
            ids = _encode(lm, it, cfg.raw, settings["prompts"])
            gen = None
            if cfg.temperature > 0:
                gen = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + it.index)
            conts[str(it.index)] = generate(eng, ids, cfg.max_new_tokens, cfg.temperature, eos, gen)
            _checkpoint()
            if progress:
                progress.update(gid, advance=1)
        if want_aded:
            tds.append(_build_aded(conts, world, warn))
        # phase 2: every drafter's distribution at every generated position, streamed into the sums
        pid = progress.add_task("profiling", total=len(mine), completed=len(mine) - len(todo)) if progress else None
        for k, it in enumerate(todo, 1):
            ids = _encode(lm, it, cfg.raw, settings["prompts"])
            cont = conts[str(it.index)]
            fresh = [_fresh(d) for d in tds]
            acc_nn, agr_nn, acc_tn, agr_tn, secs = profile_sequence(neural, fresh, ids, cont, cfg.temperature,
                                                                     cfg.chunk)
            stats.add_neural(it.task, acc_nn, agr_nn)
            if tds:
                stats.add_token(it.task, acc_tn, agr_tn)
            for ti, d in enumerate(tds):
                stats.count(f"propose_seconds.{d.name}", secs[ti])
                stats.count(f"propose_calls.{d.name}", len(cont))
            stats.count("prompts")
            stats.count("prompt_tokens", len(ids))
            stats.count("generated_tokens", len(cont))
            stats.count("eos_stops", 1 if cont and cont[-1] in eos else 0)
            done.append(it.index)
            _checkpoint()
            if progress:
                progress.update(pid, advance=1,
                                description=f"profiling ({int(stats.counters['generated_tokens'])} tokens)")
            if on_prompt:
                on_prompt(k)
    finally:
        if progress:
            progress.stop()
    profiling_seconds = time.perf_counter() - t_prof

    # combine shards across ranks
    if world > 1:
        import torch.distributed as dist

        _ensure_dist(eng.device)
        v = torch.from_numpy(stats.flat()).to(torch.float64)
        if dist.get_backend() == "nccl":
            v = v.to(eng.device)
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        stats.load_flat(v.cpu().numpy())
        if rank != 0:
            dist.barrier()
            return None

    # costs (rank 0)
    from hsd_opt.profiler.costs import measure_costs

    log("measuring costs")
    t_cost = time.perf_counter()
    by_engine: dict[int, tuple[Any, list[int]]] = {}
    for nd in neural:
        by_engine.setdefault(id(nd.engine), (nd.engine, []))[1].append(nd.boundary)
    lcs = {k: measure_costs(e, bs, tmax=cfg.tmax, repeats=cfg.cost_repeats, warmup=cfg.cost_warmup,
                            curve_repeats=cfg.curve_repeats)
           for k, (e, bs) in by_engine.items()}
    cost_seconds = time.perf_counter() - t_cost

    prof = build_profile(neural, tds, stats, lcs, cfg.tmax, target_name)
    prof.extra["provenance"] = {
        **settings,
        "source": lm.source, "device": lm.device, "heads_meta": heads_meta or None,
        "prompt_count": int(stats.counters["prompts"]),
        "prompt_tokens": int(stats.counters["prompt_tokens"]),
        "generated_tokens": int(stats.counters["generated_tokens"]),
        "positions_by_task": {t: int(stats.nn[3, k].max()) if stats.nn.size else 0
                              for k, t in enumerate(stats.tasks)},
        "temperature_note": ("acceptance uses softmax(logits / T); at T = 0 the plain softmax(logits) (T = 1) "
                             "for the TV acceptance and argmax for greedy_agreement"),
        "cost_model": "exits: cost, cost_curve and verify_cost are sums of median per-layer timings; the whole "
                      "model (target, draft model, quantized copy): cost and cost_curve timed directly, verify "
                      "curves into the target scaled to them; all non-decreasing in t (hsd_opt/profiler/costs.py); "
                      "step_measured = direct median of one warm decode step",
        "cost_model_check": {nd.name: lcs[id(nd.engine)].check for nd in neural
                             if nd.kind in ("target", "model", "quantized")},
        "timings": {"profiling_seconds": round(profiling_seconds, 3), "cost_seconds": round(cost_seconds, 3),
                    "total_seconds": round(time.perf_counter() - t_start, 3)},
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hsd_opt_version": _version(), "torch": torch.__version__, "world_size": world,
        "torch_threads": torch.get_num_threads(), "threads_note": threads_note, "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    _, warnings = profile_from_dict(prof.to_dict(), str(cfg.out))
    save_profile(prof, cfg.out)
    for p in [partial] + ([_partial_path(Path(cfg.out), r, world) for r in range(world)] if world > 1 else []):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    for w in warnings[:5]:
        warn(w)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return prof


def _version() -> str:
    try:
        from hsd_opt import __version__

        return __version__
    except Exception:  # pragma: no cover
        return "unknown"


def _ensure_dist(device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if (device.type == "cuda" and dist.is_nccl_available()) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from hsd_opt.cli import err_console

    p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("ETA"), TimeRemainingColumn(), console=err_console, transient=False)
    p.start()
    return p


# -------------------------------------------------------------------------------------------- output


def draft_rate(stats: PairStats, token: str) -> float:
    """Share of the positions where token drafter ``token`` proposed (1 for a drafter that never abstains; a
    floor of 1e-6 for one that never proposed, whose acceptance is then not measured)."""
    calls = stats.counters.get(f"propose_calls.{token}", 0.0)
    if calls <= 0:
        return 1.0
    return min(1.0, max(1e-6, stats.proposals(token) / calls))


def results_from_stats(stats: PairStats, order: Sequence[str], can_verify: dict[str, bool],
                       target: str) -> dict[str, Any]:
    """acceptance / greedy_agreement / counts / ci95 / acceptance_by_task for ``drafter`` before ``verifier`` in
    ``order`` (cheapest first) where the verifier can verify.

    The target verifies every drafter and drafts for none, wherever its measured cost puts it in ``order``: on a
    tiny or loaded machine a drafter can time dearer than the target, and its pair with the target must still be
    recorded (the solver then leaves that drafter out by cost)."""
    order = [n for n in order if n != target] + [target]
    acc: dict[str, dict[str, float]] = {}
    agr: dict[str, dict[str, float]] = {}
    cnt: dict[str, dict[str, int]] = {}
    ci: dict[str, dict[str, list[float]]] = {}
    by_task: dict[str, dict[str, dict[str, float]]] = {t: {} for t in stats.tasks}
    for i, d in enumerate(order):
        for v in order[i + 1:]:
            if not can_verify.get(v, False):
                continue
            a = stats.acceptance(d, v)
            if a is None:
                continue
            acc.setdefault(d, {})[v] = a
            agr.setdefault(d, {})[v] = stats.agreement(d, v)
            cnt.setdefault(d, {})[v] = stats.n(d, v)
            ci.setdefault(d, {})[v] = stats.ci95(d, v)
            for t in stats.tasks:
                at = stats.acceptance(d, v, t)
                if at is not None:
                    by_task[t].setdefault(d, {})[v] = at
    return {"acceptance": acc, "greedy_agreement": agr, "counts": cnt, "ci95": ci,
            "acceptance_by_task": {t: v for t, v in by_task.items() if v}}


def quantization_entry(qeng) -> dict[str, Any]:
    """The ``quantization`` field of a quantized drafter's profile entry (what the runtime rebuilds it from)."""
    return {"bits": qeng.bits, "group_size": qeng.group_size, "head_bits": qeng.head_bits,
            "packed_kernels": qeng.packed, "activation_dtype": str(qeng.dtype).replace("torch.", ""),
            "weight_bytes": qeng.weight_bytes()}


def build_profile(neural: Sequence[NeuralDrafter], tds: Sequence, stats: PairStats, lcs: dict, tmax: int,
                  target_name: str) -> Profile:
    tmax1 = tmax + 1
    entries: list[ModelEntry] = []
    cost_curve: dict[str, list[float]] = {}
    verify_cost: dict[str, dict[str, list[float]]] = {}
    for nd in neural:
        lc = lcs[id(nd.engine)]
        extra: dict[str, Any] = {}
        if nd.kind == "model":
            extra["model"] = nd.model_id
        if nd.kind == "quantized":
            extra["quantization"] = quantization_entry(nd.engine)
        if nd.boundary in lc.step:
            extra["step_measured"] = lc.step[nd.boundary]
        entries.append(ModelEntry(nd.name, nd.kind, max(lc.step_cost(nd.boundary), 1e-9), True,
                                  nd.boundary if nd.kind not in ("model", "quantized") else None, extra))
        cost_curve[nd.name] = [max(x, 1e-9) for x in lc.curve(nd.boundary, tmax1)]
    for nv in neural:
        for nd in neural:
            if nd.engine is nv.engine and nd.boundary < nv.boundary:
                verify_cost.setdefault(nv.name, {})[nd.name] = [
                    max(x, 1e-9) for x in lcs[id(nv.engine)].verify_curve(nd.boundary, nv.boundary, tmax1)]
    for d in tds:
        calls = stats.counters.get(f"propose_calls.{d.name}", 0.0)
        secs = stats.counters.get(f"propose_seconds.{d.name}", 0.0)
        c = secs / calls if calls > 0 else 1e-6
        entries.append(ModelEntry(d.name, d.kind, max(c, 1e-9), False, None, {"config": d.config()},
                                  draft_rate(stats, d.name)))
    rank = {nd.name: (0, nd.boundary) for nd in neural}
    entries.sort(key=lambda e: (e.name == target_name, e.cost, rank.get(e.name, (0, 0))))
    order = [e.name for e in entries]
    res = results_from_stats(stats, order, {e.name: e.can_verify for e in entries}, target_name)
    extra = {k: v for k, v in res.items() if k != "acceptance"}
    extra["stats"] = stats.to_dict()
    return Profile(target_name, entries, res["acceptance"], verify_cost, cost_curve, extra)


# -------------------------------------------------------------------------------------------- merge


def merge_profiles(paths: Sequence[Path], warn: Callable[[str], None] | None = None) -> Profile:
    """Combine profiles of the same model and settings exactly: the raw sums (``stats``) are added and every
    rate is recomputed. Costs, cost curves and verify costs are the FIRST profile's (costs are measurements of
    one machine, not sums; profile costs on the machine you will run on)."""
    from hsd_opt.formats import load_profile

    warn = warn or (lambda s: None)
    if len(paths) < 2:
        raise HsdError("hsd profile merge: give at least two profiles")
    profs = []
    for p in paths:
        prof, _ = load_profile(p)
        if "stats" not in prof.extra:
            raise InputFileError(str(p), "has no raw statistics (made by another tool?); cannot merge exactly",
                                 "stats")
        profs.append((Path(p), prof))
    p0, first = profs[0]
    prov0 = first.extra.get("provenance", {})
    stats = PairStats.from_dict(first.extra["stats"])
    seen = {(prov0.get("prompts_sha256"), str(prov0.get("shard")))}
    prompt_sets = [prov0.get("prompts_sha256")]
    for p, prof in profs[1:]:
        prov = prof.extra.get("provenance", {})
        for f in MERGE_FIELDS:
            if prov.get(f) != prov0.get(f):
                raise InputFileError(str(p), f"cannot merge: {f} = {prov.get(f)!r} but {p0} has {prov0.get(f)!r}",
                                     f"provenance.{f}")
        if prof.target != first.target:
            raise InputFileError(str(p), f"cannot merge: target {prof.target!r} but {p0} has {first.target!r}",
                                 "target")
        s = PairStats.from_dict(prof.extra["stats"])
        if s.neural + s.token != stats.neural + stats.token:
            raise InputFileError(str(p), f"cannot merge: drafters {s.neural + s.token} differ from {p0}'s "
                                         f"{stats.neural + stats.token}", "stats")
        key = (prov.get("prompts_sha256"), str(prov.get("shard")))
        if key in seen and prov.get("world_size", 1) == 1:
            warn(f"{p}: same prompt set and shard as an earlier profile: its positions are counted twice")
        seen.add(key)
        prompt_sets.append(prov.get("prompts_sha256"))
        stats = stats.merge(s)
    entries = [replace(e, draft_rate=draft_rate(stats, e.name)) if e.name in stats.token else e
               for e in first.models]
    order = [e.name for e in entries]
    res = results_from_stats(stats, order, {e.name: e.can_verify for e in entries}, first.target)
    extra = dict(first.extra)
    extra.update({k: v for k, v in res.items() if k != "acceptance"})
    extra["stats"] = stats.to_dict()
    prov = dict(prov0)
    prov.update({"merged_from": [str(p) for p, _ in profs], "prompts_sha256_list": prompt_sets,
                 "prompt_count": int(stats.counters.get("prompts", 0)),
                 "prompt_tokens": int(stats.counters.get("prompt_tokens", 0)),
                 "generated_tokens": int(stats.counters.get("generated_tokens", 0)),
                 "costs_from": str(p0)})
    extra["provenance"] = prov
    return Profile(first.target, entries, res["acceptance"], first.verify_cost, first.cost_curve, extra)
