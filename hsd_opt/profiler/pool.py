"""The drafter pool a profile measures: exits of the target, draft models, quantized copies, token drafters.

Neural drafters (anything with a next-token distribution) are :class:`NeuralDrafter` s: an exit ``boundary`` of
a :class:`~hsd_opt.engine.layered.LayeredLM` (the target's, a draft model's or a quantized copy's). Token
drafters (:class:`~hsd_opt.drafters.base.TokenDrafter`) only propose; they are built by name here. See
``docs/design.md#the-profiler``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Sequence

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.models.random_weights import RANDOM_SOURCE
from hsd_opt.profiler.dist import all_gather
from hsd_opt.prompts import PromptItem, encode_prompt
from hsd_opt.values import is_integer

if TYPE_CHECKING:   # the engine, drafters and models are imported when a pool is built
    from hsd_opt.drafters.base import TokenDrafter
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.models.loading import LoadedModel

#: Token drafters a profile includes by default (``bigram`` only once its table is cached).
DEFAULT_TOKEN_DRAFTERS = ("ngram", "lookup", "bigram", "aded")
#: Token drafters ``--token-drafters`` accepts.
KNOWN_TOKEN_DRAFTERS = ("ngram", "lookup", "bigram", "aded")


def exit_boundaries(layers: Sequence[int] | None, n_layers: int, flag: str = "--layers") -> list[int]:
    """The exit boundaries of a model with ``n_layers`` decoder layers: ``layers`` (layer numbers, any order,
    repeats allowed; None: every layer 1..n; empty: no early exit) sorted and without repeats, with the model's
    last layer n always added. Boundaries count decoder layers run (layer b = the residual stream after b layers).
    A layer outside 1..n raises :class:`HsdError` naming ``flag``."""
    if layers is not None and (isinstance(layers, str) or not all(is_integer(v) for v in layers)):
        raise HsdError(f"{flag}: expected layer numbers (a list of integers), got {layers!r}")
    wanted = list(range(1, n_layers + 1)) if layers is None else [int(v) for v in layers]
    for v in wanted:
        if not 1 <= v <= n_layers:
            raise HsdError(f"{flag}: layer {v} is out of range: valid layers are 1..{n_layers} (the model has "
                           f"{n_layers} decoder layers)")
    return sorted(set(wanted) | {n_layers})


def default_quantized(device) -> list[tuple[str | None, str]]:
    """The quantized copies a profile includes when none are named: ``int8`` and ``int4`` of the target on a CPU
    (where their kernels run), else none; as ``(model, kind)`` pairs (model None: the target)."""
    import torch

    from hsd_opt.engine.precisions import QUANT_KINDS

    return [(None, k) for k in QUANT_KINDS] if torch.device(device).type == "cpu" else []


def short_name(model_id: str, taken: set[str]) -> str:
    """A profile name for a draft model: the last part of its id or path, made unique against ``taken``."""
    bare = re.sub(r"^[a-z][a-z-]*:(?!\\)", "", model_id)         # embedded:..., split-gguf:... -> the alias
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(bare.rstrip("/")).name or bare).strip("-") or "draft"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


@dataclass
class NeuralDrafter:
    """A drafter with a distribution: an exit ``boundary`` of ``engine`` (the target's or a draft model's)."""

    name: str
    kind: str                      # target | early_exit | model | quantized
    engine: LayeredLM
    boundary: int
    model_id: str | None = None
    revision: str | None = None    # of the draft model ``model_id`` (its weights' identity)


def build_token_drafters(names: Sequence[str] | None, loaded, explicit: bool, warn: Callable[[str], None]):
    """Instantiate token drafters by name: ``ngram`` (context n-gram), ``lookup`` (context n-gram that abstains
    without a 2- or 3-gram match, prompt-lookup style), ``bigram`` (model bigram table, built
    once and disk-cached), ``aded`` (when its module exists). With the default pool a missing module is
    skipped silently; a name asked for explicitly and unavailable is an error."""
    out = []
    for name in (names if names is not None else DEFAULT_TOKEN_DRAFTERS):
        try:
            d = _make_token_drafter(name, loaded, explicit)
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


def _make_token_drafter(name: str, loaded, explicit: bool = True):
    if name == "ngram":
        from hsd_opt.drafters.ngram import ContextNgramDrafter

        return ContextNgramDrafter(name="ngram")
    if name == "lookup":
        from hsd_opt.drafters.ngram import ContextNgramDrafter

        return ContextNgramDrafter(name="lookup", q=3, w=4, min_q=2, abstain=True)
    if name == "bigram":
        from hsd_opt.drafters import bigram as bg

        BigramDrafter, load_or_build_bigram_table = bg.BigramDrafter, bg.load_or_build_bigram_table
        if loaded.source == RANDOM_SOURCE:        # costs only: a lookup costs the same in any table of its shape
            return BigramDrafter(bg.random_bigram_table(int(loaded.model.config.vocab_size)), name="bigram")
        key = bg.model_fingerprint(loaded.model)
        bos = bg.resolve_bos(loaded.model, bg.AUTO) if hasattr(bg, "resolve_bos") else None
        cached = bg.table_path(None, key, 16, bos)
        if not explicit and not cached.exists():
            raise _NotCached(f"the bigram table of this model is not cached yet ({cached});"
                             f" pass --token-drafters ngram,bigram once to build it (one forward per vocabulary "
                             f"token: minutes on a CPU)")
        table = load_or_build_bigram_table(loaded.model, key, top_k=16, progress=True)
        return BigramDrafter(table, name="bigram")
    return None


def aded_available(explicit: bool) -> bool:
    import importlib.util

    if importlib.util.find_spec("hsd_opt.drafters.aded") is not None:
        return True
    if explicit:
        raise HsdError("--token-drafters: 'aded' is not available in this installation (no hsd_opt.drafters.aded)")
    return False


def aded_store() -> Path:
    """The folder under the cache that keeps ADED's tri-gram matrices, made and checked to take a file
    (:func:`~hsd_opt.cache.writable_folder`): a profile checks it before generating the continuations the matrix
    is counted from."""
    from hsd_opt.cache import cache_dir, writable_folder

    return writable_folder(cache_dir() / "aded", "ADED's tri-gram matrix")


def build_aded(conts: dict[str, list[int]], world: int, warn: Callable[[str], None]):
    """ADED's tri-gram matrix from the target's continuations of the whole suite (all ranks: gathered), saved in
    the cache under a content hash so its config() rebuilds it."""
    from hsd_opt.cache import cache_dir
    from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix

    allc = dict(conts)
    if world > 1:
        for c in all_gather(conts, world):
            allc.update(c)
    seqs = [allc[k] for k in sorted(allc, key=int)]
    h = hashlib.sha256(repr(seqs).encode()).hexdigest()[:16]
    path = cache_dir() / "aded" / f"aded-{h}.npz"
    try:
        m = TrigramMatrix.load(path) if path.exists() else None
    except InputFileError:                      # a damaged cache file: counted again and replaced
        m = None
    if m is None:
        aded_store()
        m = TrigramMatrix.from_sequences(seqs)
        m.save(path)
    if len(m) == 0:
        warn("aded: the continuations hold no tri-gram seen twice; its matrix is empty (it will repeat tokens)")
    return AdedDrafter(m, name="aded")


def fresh_drafter(d):
    """A drafter in its initial state for one prompt. Adaptive drafters whose state outlives reset() (ADED's
    matrix) are rebuilt from their config, so every prompt is profiled independently of the others: shards,
    ranks and resumed runs then add up exactly."""
    if getattr(d, "kind", "") == "aded":
        from hsd_opt.drafters import make_token_drafter

        cfg = dict(d.config())
        return make_token_drafter(cfg.pop("kind"), **cfg)
    return d


def encode_item(loaded, it: PromptItem, raw: bool, source: str) -> list[int]:
    ids = encode_prompt(loaded.tokenizer, it.prompt, raw)
    if not ids:
        raise InputFileError(source, "prompt encodes to no tokens", it.place)
    return ids


@dataclass
class Pool:
    """Every drafter of one profile: ``neural`` (the target's exits in layer order, the target among them,
    then draft models and quantized copies), ``token`` drafters, whether ADED is wanted (it is built
    later, from the target's continuations), and the loaded draft models (kept alive with their engines)."""

    neural: list[NeuralDrafter]
    token: list[TokenDrafter]
    want_aded: bool
    draft_models: list[LoadedModel]

    @property
    def token_names(self) -> list[str]:
        return [d.name for d in self.token] + (["aded"] if self.want_aded else [])


def build_pool(loaded, eng, boundaries: Sequence[int], draft_models: Sequence[str],
               quantized: Sequence[tuple[str | None, str]] | None, token_drafters: Sequence[str] | None,
               device: str, dtype: str, log: Callable[[str], None], warn: Callable[[str], None],
               draft_layers: Sequence[int] | None = (), costs_only: bool = False,
               left_out: Collection[str] = ()) -> Pool:
    """The pool for target ``loaded`` (a :class:`~hsd_opt.models.loading.LoadedModel`) whose layered engine is
    ``eng`` (over its own weights, or a quantized copy of it that is the target itself): its exits at
    ``boundaries`` (the last is the target), each of ``draft_models`` (loaded on ``device``/``dtype``, refused
    when its tokenizer differs), the ``quantized`` copies (``(model, kind)`` pairs, ``kind`` one of
    :data:`~hsd_opt.engine.precisions.COPY_KINDS`: ``(None, "int4")`` a copy of the target, ``("MODEL", "int4")``
    of a draft model; None: :func:`default_quantized`, none when the target is itself a copy) and the named
    ``token_drafters`` (None: the default pool, less the names in ``left_out``: those left are still the default
    pool's, skipped where unavailable, not built on request). Names are unique; a copy of draft model ``D`` is
    named ``D-int4``.
    ``draft_layers`` (layer numbers in each draft model's own layers; None: all of them; empty: none): early exits
    of the draft models too, named ``D-layer<b>``, sharing the draft model's engine as the target's exits share
    the target's. ``costs_only``: each draft model is loaded as a costs-only run loads its target (its own weights
    where they are on this machine, else random weights of its configuration).

    Every model is loaded once: its engines reference its weights. A model that only serves as the source of
    quantized copies (a draft model named only in ``--quantized``, or the target when ``eng`` is a copy) has its
    float decoder weights released once the pool is built (:func:`~hsd_opt.engine.layered.release_float_weights`)."""
    n_layers = eng.n_layers
    neural = [NeuralDrafter(f"layer{b}", "target" if b == n_layers else "early_exit", eng, b) for b in boundaries]
    taken = {nd.name for nd in neural}
    drafts: dict[str, DraftSource] = {}
    for dm in draft_models:
        if find_draft(dm, drafts) is not None:
            raise HsdError(f"--draft-model: {dm} is given twice")
        found, ds = _draft_model_drafters(loaded, dm, draft_layers, device, dtype, taken, log, costs_only)
        neural += found
        drafts[ds.loaded.model_id] = ds
    if quantized is None:
        quantized = [] if eng.is_copy else default_quantized(eng.device)
    for ref, kind in quantized:
        neural.append(_quantized_drafter(loaded, eng, ref, kind, drafts, taken, device, dtype, log, costs_only))
    tds, want_aded = _pool_token_drafters(token_drafters, loaded, taken, warn, left_out)
    # models that only feed quantized copies (the bigram table above was the last reader of the target's)
    _release_copy_sources(loaded, eng, drafts, log)
    return Pool(neural, tds, want_aded, [ds.loaded for ds in drafts.values()])


def _load_draft(loaded, ref: str, flag: str, device: str, dtype: str, log: Callable[[str], None],
                costs_only: bool = False):
    """Load the draft model ``ref`` (named by ``flag`` in errors); in a costs-only run as the target is loaded
    (:func:`~hsd_opt.models.random_weights.load_for_costs`: its own weights where they are on this machine, else
    random weights of its configuration): refused when its tokenizer differs from the target's (its vocabulary
    size, where either has no tokenizer) or when it is the target itself; a head of another number of rows is
    given the target's (:func:`~hsd_opt.models.loading.match_width`), and that is said (``log``)."""
    from hsd_opt.models.loading import check_same_tokenizer, load_model, match_width, recorded_model_id
    from hsd_opt.models.random_weights import load_for_costs

    try:
        if costs_only:
            dlm = load_for_costs(ref, device=device, dtype=dtype, flag=flag)
        else:
            dlm = load_model(ref, device=device, dtype=dtype)
    except HsdError as e:
        raise HsdError(str(e).replace("--model", flag, 1)) from None
    if loaded.tokenizer is not None and dlm.tokenizer is not None:
        check_same_tokenizer(loaded.tokenizer, dlm.tokenizer, ref, flag)
    elif loaded.model.config.vocab_size != dlm.model.config.vocab_size:
        raise HsdError(f"{flag} {ref}: its vocabulary ({dlm.model.config.vocab_size} tokens) differs from the "
                       f"target's ({loaded.model.config.vocab_size}); drafts must share the target's tokens")
    rows = match_width(loaded, dlm)
    if rows:
        width = loaded.model.config.vocab_size
        log(f"{ref}: its head has {width - rows:,} rows, the target's {width:,}: "
            f"{f'{rows:,} rows of zeros added' if rows > 0 else f'its last {-rows:,} rows dropped'}")
    dlm.model_id = recorded_model_id(dlm.model_id)      # a local model: its absolute path (plans run anywhere)
    if dlm.model_id == recorded_model_id(loaded.model_id):
        raise HsdError(f"{flag} {ref}: that is the target itself (its copies are --quantized int8,int4)")
    return dlm


def _draft_model_drafters(loaded, ref: str, draft_layers: Sequence[int] | None, device: str, dtype: str,
                          taken: set[str], log: Callable[[str], None],
                          costs_only: bool = False) -> tuple[list[NeuralDrafter], "DraftSource"]:
    """The drafters of one ``--draft-model``: its early exits at ``draft_layers`` (its own layer numbers), then
    the whole model, over one engine; and its :class:`DraftSource`. Their names are added to ``taken``."""
    from hsd_opt.engine.layered import LayeredLM

    dlm = _load_draft(loaded, ref, "--draft-model", device, dtype, log, costs_only)
    deng = LayeredLM(dlm.model)
    name = short_name(dlm.model_id, taken)
    taken.add(name)
    out = []
    for b in exit_boundaries(draft_layers, deng.n_layers, "--draft-layers")[:-1]:
        if f"{name}-layer{b}" in taken:
            raise HsdError(f"--draft-layers: name {name}-layer{b} is already used by another drafter")
        taken.add(f"{name}-layer{b}")
        out.append(NeuralDrafter(f"{name}-layer{b}", "early_exit", deng, b, dlm.model_id, dlm.revision))
    out.append(NeuralDrafter(name, "model", deng, deng.n_layers, dlm.model_id, dlm.revision))
    return out, DraftSource(dlm, name, True)


def _quantized_drafter(loaded, eng, ref: str | None, kind: str, drafts: dict[str, "DraftSource"], taken: set[str],
                       device: str, dtype: str, log: Callable[[str], None],
                       costs_only: bool = False) -> NeuralDrafter:
    """The quantized copy ``kind`` of the target (``ref`` None) or of the draft model ``ref`` (loaded now and
    added to ``drafts`` when it is no drafter itself), said; its name (``D-int4``, or the kind for the target's)
    added to ``taken``."""
    from hsd_opt.engine.precisions import COPY_KINDS
    from hsd_opt.engine.quantized import QuantizedLM

    if kind not in COPY_KINDS:
        raise HsdError(f"--quantized: expected {', '.join(COPY_KINDS)}, got {kind!r}")
    bits, group, head_bits = COPY_KINDS[kind]
    if ref is None:
        if eng.is_copy:
            raise HsdError(f"--quantized {kind}: the target is itself a quantized copy (--target-precision); "
                           f"copies of it are no drafters (quantize draft models: MODEL:{kind})")
        src, qname, model_id, revision, what = loaded.model, kind, None, None, "the target"
    else:
        ds = find_draft(ref, drafts)
        if ds is None:
            dlm = _load_draft(loaded, ref, "--quantized", device, dtype, log, costs_only)
            ds = drafts[dlm.model_id] = DraftSource(dlm, short_name(dlm.model_id, taken), False)
        src, qname, what = ds.loaded.model, f"{ds.name}-{kind}", ds.name
        model_id, revision = ds.loaded.model_id, ds.loaded.revision
    if qname in taken:
        raise HsdError(f"--quantized: name {qname!r} is already used by another drafter")
    log(f"quantizing a copy of {what}: {qname}")
    qeng = QuantizedLM(src, bits=bits, group_size=group, head_bits=head_bits, name=qname)
    taken.add(qname)
    return NeuralDrafter(qname, "quantized", qeng, qeng.n_layers, model_id, revision)


def _pool_token_drafters(token_drafters: Sequence[str] | None, loaded, taken: set[str],
                         warn: Callable[[str], None], left_out: Collection[str] = ()) -> tuple[list, bool]:
    """The named token drafters (None: the default pool less ``left_out``) but ADED, their names added to
    ``taken``; and whether ADED is wanted (it is built later, from the target's continuations)."""
    explicit = token_drafters is not None
    requested = list(token_drafters) if explicit else [n for n in DEFAULT_TOKEN_DRAFTERS if n not in left_out]
    want_aded = "aded" in requested and aded_available(explicit)
    tds = build_token_drafters([n for n in requested if n != "aded"], loaded, explicit, warn)
    for d in tds:
        if d.name in taken:
            raise HsdError(f"--token-drafters: name {d.name!r} is already used by another drafter")
        taken.add(d.name)
    return tds, want_aded


def _release_copy_sources(loaded, eng, drafts: dict[str, "DraftSource"], log: Callable[[str], None]) -> None:
    """Release the float decoder weights of the models that only feed quantized copies: the draft models that are
    no drafters themselves, and the target when ``eng`` is a copy of it (said, in GB)."""
    from hsd_opt.engine.layered import release_float_weights

    for ds in drafts.values():
        if not ds.float_drafter:
            log(f"{ds.name}: only its quantized copies are drafters; released "
                f"{release_float_weights(ds.loaded.model) / 1e9:.2f} GB of float weights")
    if eng.is_copy:
        log(f"the target is a quantized copy: released {release_float_weights(loaded.model) / 1e9:.2f} GB of float "
            f"weights")


@dataclass
class DraftSource:
    """A loaded draft model of the pool: ``loaded`` (a :class:`~hsd_opt.models.loading.LoadedModel`), its profile
    ``name`` (its copies are ``<name>-int4``, ...) and whether its float engine is a drafter itself."""

    loaded: LoadedModel
    name: str
    float_drafter: bool


def find_draft(ref: str, drafts: dict[str, DraftSource]) -> DraftSource | None:
    """The loaded draft model ``ref`` names (an alias, id or path as typed, or its profile name), else None."""
    from hsd_opt.models.loading import resolve_model_name

    want = resolve_model_name(ref)
    for ds in drafts.values():
        mid = ds.loaded.model_id
        if want in (mid, ds.name) or (Path(want).exists() and Path(mid).exists()
                                      and Path(want).resolve() == Path(mid).resolve()):
            return ds
    return None
