"""From a plan to a running hierarchy: check the model the plan was solved for, build its levels.

A plan (``hsd-plan/1``) names its levels in ``hierarchy``; ``plan.models`` holds the profile's entries for them
(:class:`~hsd_opt.formats.PlanModel`) and ``plan.provenance`` the model (``model``, ``revision``, ``heads``,
``device``, ``dtype``, ``target_precision``). Entry kinds: ``target`` / ``early_exit`` (``layer``: decoder layers
run; with ``model``, an exit of that draft model), ``model`` (``model``: another causal LM of the same tokenizer),
``quantized`` (``quantization``: a weight-quantized copy of the target, or with ``model`` of that draft model, rebuilt
here with :class:`~hsd_opt.engine.quantized.QuantizedLM`), and token drafters (``ngram_context``, ``bigram_model``,
``aded``, ... with ``config``, rebuilt by :func:`hsd_opt.drafters.make_token_drafter`). A plan without ``models`` is
accepted when every name is ``layer<N>`` (the profiler's naming). A :class:`PlanModels` loads each draft model once
and builds each quantized copy once per model and setting, for every hierarchy built with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from hsd_opt.errors import HsdError, InputFileError, SettingError
from hsd_opt.formats import PlanModel, Quantization, sampling_words
from hsd_opt.models.loading import eos_token_ids as eos_ids  # noqa: F401  (re-exported)
from hsd_opt.models.loading import model_positions
from hsd_opt.prompts import template_head
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.runtime.plan_checks import check_kinds, check_target_precision, plan_entries, plan_target_precision
from hsd_opt.runtime.state_pool import StatePool
from hsd_opt.solver.context import latency_at

if TYPE_CHECKING:
    from hsd_opt.engine.interface import Engine
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.models.loading import LoadedModel

MODEL_KINDS = ("target", "early_exit")


def check_provenance(plan, loaded, source: str = "plan", target_precision: str | None = None) -> None:
    """Refuse a plan profiled on another model, revision or dtype than ``loaded`` (a :class:`LoadedModel`), or
    for another target precision than ``target_precision`` (``--target-precision``; None or ``auto``: the
    plan's own)."""
    from hsd_opt.models.loading import same_model

    prov = plan.provenance
    want = prov.model
    if want and not same_model(want, loaded.model_id):
        raise InputFileError(source, f"the plan was made for model {want!r}, not {loaded.model_id!r}",
                             "provenance.model")
    rev = prov.revision
    if rev and loaded.revision and rev != loaded.revision:
        raise InputFileError(source, f"the plan was made for revision {rev!r} of {loaded.model_id!r}, but the "
                                     f"loaded weights are revision {loaded.revision!r}", "provenance.revision")
    dtype = prov.dtype
    if dtype and loaded.dtype and dtype != loaded.dtype:
        raise InputFileError(source, f"the plan was made for the {dtype} target, but the model is loaded in "
                                     f"{loaded.dtype} (another target, with its own greedy output: profile and "
                                     f"solve for it, or drop --dtype)", "provenance.dtype")
    check_target_precision(plan, source, target_precision)


def machine_differences(plan, threads: int, variant: str | None, openmp: bool | None = None) -> list[str]:
    """How this run's machine differs from the one ``plan``'s costs were measured on: the torch threads
    (``threads`` now), the CPU kernel variant (``variant`` now; None: no kernels) and, where either side runs more
    than one thread, whether the kernels have OpenMP threads (``openmp`` now; without, a kernel call runs on one
    thread). Empty where they agree or the plan does not say."""
    prov, out = plan.provenance, []
    if prov.threads is not None and prov.threads != threads:
        out.append(f"the plan's costs were measured with {prov.threads} thread(s), this run uses {threads}")
    if prov.kernel_variant is not None and prov.kernel_variant != variant:
        out.append(f"the plan's costs were measured on the {prov.kernel_variant} kernels, this run uses "
                   f"{variant or 'the torch path'}")
    elif (variant is not None and openmp is not None and prov.kernel_openmp not in (None, openmp)
          and max(threads, prov.threads or 1) > 1):
        words = {True: "with OpenMP threads", False: "without OpenMP (HSD_OPENMP=0, or a compiler without it)"}
        out.append(f"the plan's costs were measured on kernels {words[prov.kernel_openmp]}, this run's are "
                   f"{words[openmp]}")
    return out


def sampling_differences(plan, temperature: float, top_p: float = 1.0, top_k: int = 0,
                         min_p: float = 0.0) -> list[str]:
    """How this run's sampling differs from the one ``plan`` was profiled with (its acceptance rates, and so its
    hierarchy, are for that one): greedy against sampled, another temperature or other filters (a profile without
    top-k or min-p recorded sampled without them). Empty where they agree or the plan does not say."""
    was = plan.provenance.sampling
    if was is None:
        return []
    now = sampling_words(temperature, top_p, top_k, min_p)
    return [] if was == now else [f"the plan was profiled {was}; this run is {now}"]


def build_levels(plan, models: PlanModels, source: str = "plan") -> list[Level]:
    """The :class:`Level` list (bottom first) of ``plan`` over ``models`` (its target, draft models and copies).
    Exits share the target's engine (:meth:`PlanModels.target`).

    Raises:
        InputFileError: a layer the model lacks, an exit above the target, a target that is not the model's last
            layer, a token drafter above the bottom, an unknown kind, a model of another tokenizer.
    """
    check_kinds(plan, source)
    loaded = models.loaded
    target = models.target(plan, source)
    entries = plan_entries(plan, source)
    L = target.n_layers
    levels: list[Level] = []
    top = len(plan.hierarchy) - 1
    for i, name in enumerate(plan.hierarchy):
        e = entries[name]
        kind = e.kind
        where = f"hierarchy[{i}] ({name})"
        if kind == "early_exit" and e.model is not None:     # an exit of a draft model
            draft = models.draft_engine(models.draft_model(e.model, f"{source}: {where}: model"))
            layer = e.layer
            if layer is None or not 1 <= layer <= draft.n_layers:
                raise InputFileError(source, f"layer {layer!r} of {name!r}: the model {e.model} has layers "
                                             f"1..{draft.n_layers}", where)
            levels.append(Level(name, draft, layer))
        elif kind in MODEL_KINDS:
            layer = e.layer
            if layer is None or not 1 <= layer <= L:
                raise InputFileError(source, f"layer {layer!r} of {name!r}: the model {loaded.model_id} has "
                                             f"layers 1..{L}", where)
            if i == top and layer != L:
                raise InputFileError(source, f"the target {name!r} is layer {layer}, but the model has {L} layers",
                                     where)
            levels.append(Level(name, target, layer))
        elif kind == "quantized":
            levels.append(_quantized_level(models, name, e, source, where))
        elif kind == "model":
            ref = e.model
            if ref is None:
                raise InputFileError(source, f"model entry {name!r} needs 'model' (id or path)", where)
            draft = models.draft_engine(models.draft_model(ref, f"{source}: {where}: model"))
            levels.append(Level(name, draft, draft.n_layers))
        else:
            if i != 0:
                raise InputFileError(source, f"{name!r} ({kind}) cannot verify: a token drafter may only be the "
                                             f"bottom level", where)
            levels.append(Level(name, drafter=_token_drafter(name, kind, e.config, target.vocab_size, source)))
    if not levels[-1].is_model or levels[-1].engine is not target:
        raise InputFileError(source, "the last level must be the target model", "hierarchy")
    return levels


def _token_drafter(name: str, kind: str, config: dict | None, vocab: int, source: str):
    """The token drafter ``name`` of a plan (its ``kind`` and ``config``), refused naming its config where it cannot
    be built or drafts ids past the target's ``vocab`` (a table or matrix made for another model: found before
    anything is decoded, not when a draft reaches such an id)."""
    from hsd_opt.drafters import make_token_drafter

    cfg = dict(config or {})
    cfg.pop("kind", None)
    cfg.setdefault("name", name)
    try:
        drafter = make_token_drafter(kind, **cfg)
    except HsdError as err:
        raise InputFileError(source, str(err), f"models.{name}.config") from None
    largest = drafter.largest_id()
    if largest is not None and largest >= vocab:
        raise InputFileError(source, f"{name!r} drafts token ids up to {largest}, past the target's vocabulary 0 .. "
                                     f"{vocab - 1} (a table or matrix made for another model?)",
                             f"models.{name}.config")
    return drafter


class PlanModels:
    """What the hierarchies of one plan run over, for one loaded target: the target's engine, each draft model
    loaded once (checked to share the target's tokenizer) with one float engine over it, and one quantized copy
    per model and setting. Every hierarchy built with the same instance shares them (``hsd bench`` and plans per
    task build several from one plan; loading and quantizing take seconds); a new instance loads and builds
    anew. Not for use by two threads at once (the engines hold work buffers).

    Args:
        loaded: the target, as :func:`~hsd_opt.models.loading.load_model` returned it.
        device, dtype: where and how draft models are loaded (default: the target's).
    """

    def __init__(self, loaded: LoadedModel, device: str | None = None, dtype: str | None = None):
        self.loaded, self.device, self.dtype = loaded, device, dtype
        self._targets: dict[tuple, Engine] = {}
        self._drafts: dict[tuple[str, str, str], LoadedModel] = {}
        self._float_engines: dict[int, LayeredLM] = {}          # id(draft model) -> its engine
        self._copies: dict[tuple[int, int, int, int], QuantizedLM] = {}   # (id(model), bits, group, head bits)
        self._heads: dict[int, tuple[int, ...]] = {}                       # id(tokenizer) -> its template's head
        #: the decoding states every hierarchy built over these models gives back and takes (none reused unless a
        #: command sets a pool that reuses: ``hsd run``, ``hsd serve --prompt-cache``)
        self.pool = StatePool()

    def target(self, plan, source: str = "plan") -> Engine:
        """The engine of ``plan``'s target: a :class:`LayeredLM` over its weights (with the plan's trained heads),
        or, for a plan made for an ``int8``/``int4`` target (``provenance.target_precision``), that quantized copy
        on the CPU kernels."""
        from hsd_opt.engine.layered import LayeredLM
        from hsd_opt.engine.precisions import QUANT_KINDS

        precision = plan_target_precision(plan, source)
        key = (precision, plan.provenance.heads)
        if key in self._targets:
            return self._targets[key]
        if precision not in QUANT_KINDS:
            eng: Engine = LayeredLM(self.loaded.model, exit_heads=load_plan_heads(plan, self.loaded, source))
        else:
            name = plan.hierarchy[-1]
            e = plan.model_entry(name)
            bits, group = QUANT_KINDS[precision]
            q = e.quantization if e is not None and e.quantization is not None else Quantization(bits, group)
            if q.bits != bits:
                raise InputFileError(source, f"the target {name!r} is quantized to {q.bits} bits, but the plan's "
                                             f"target precision is {precision}", "provenance.target_precision")
            eng = self.copy(self.loaded.model, q, name, source, "provenance.target_precision")
            if not eng.uses_kernels:
                raise InputFileError(source, f"an {precision} target runs on the CPU decode kernels only, which are "
                                             f"unavailable here (a CPU build with a C compiler, HSD_KERNELS not 0)",
                                     "provenance.target_precision")
        eng.prompt_head = self._head(self.loaded.tokenizer)
        self._targets[key] = eng
        return eng

    def _head(self, tokenizer) -> tuple[int, ...]:
        """:func:`~hsd_opt.prompts.template_head` of ``tokenizer``, rendered once for every engine over it."""
        if id(tokenizer) not in self._heads:
            self._heads[id(tokenizer)] = template_head(tokenizer)
        return self._heads[id(tokenizer)]

    def draft_model(self, ref: str, flag: str = "--draft-model") -> LoadedModel:
        """The draft model ``ref`` (alias, id or path), loaded once on ``device``/``dtype`` (default: the
        target's), for the engines alone where the target was (``LoadedModel.engines_only``), checked to share
        the target's tokenizer and given its head width (:func:`~hsd_opt.models.loading.match_width`); ``flag``
        (or the plan's field) is what errors name."""
        from hsd_opt.models.loading import check_same_tokenizer, load_model, match_width, resolve_model_name

        key = (resolve_model_name(ref), self.device or self.loaded.device, self.dtype or self.loaded.dtype)
        if key not in self._drafts:
            other = load_model(ref, device=key[1], dtype=key[2], flag=flag, engines_only=self.loaded.engines_only)
            check_same_tokenizer(self.loaded.tokenizer, other.tokenizer, ref, flag)
            match_width(self.loaded, other)
            self._drafts[key] = other
        return self._drafts[key]

    def draft_engine(self, draft: LoadedModel) -> LayeredLM:
        """The :class:`LayeredLM` over a loaded draft model's own weights (its float levels and the copies
        sharing its prompt use the same one)."""
        from hsd_opt.engine.layered import LayeredLM

        if id(draft.model) not in self._float_engines:
            eng = self._float_engines[id(draft.model)] = LayeredLM(draft.model)
            eng.prompt_head = self._head(draft.tokenizer)
        return self._float_engines[id(draft.model)]

    def copy(self, model, q: Quantization | None, name: str, source: str, where: str) -> QuantizedLM:
        """The :class:`~hsd_opt.engine.quantized.QuantizedLM` of ``model`` (the target's or a draft model's) for
        a ``quantization`` field ``q`` (validated when the plan was loaded)."""
        from hsd_opt.engine.quantized import QuantizedLM

        if q is None:
            raise InputFileError(source, f"quantized entry {name!r} needs 'quantization' ({{bits, group_size, "
                                         f"head_bits}})", where)
        key = (id(model), q.bits, q.group_size, q.head_bits)
        if key not in self._copies:
            try:
                self._copies[key] = QuantizedLM(model, bits=q.bits, group_size=q.group_size, head_bits=q.head_bits,
                                                name=name)
            except SettingError:
                raise                                   # the environment's, not the plan's
            except HsdError as err:
                raise InputFileError(source, f"quantized entry {name!r}: {err}", where) from None
            self._copies[key].prompt_head = self._head(self.loaded.tokenizer)
        return self._copies[key]

    def release_unused_floats(self, plan, hierarchies: Sequence[Sequence[str]],
                              log: Callable[[str], None] | None = None) -> int:
        """Once every hierarchy that will run is built: release the float weights of each model no level of
        ``hierarchies`` runs over its own weights, the draft models loaded only for their quantized copies and,
        for a plan with a quantized target, the target's (:func:`~hsd_opt.engine.layered.release_float_weights`).
        Returns the bytes released. For ``hsd run`` and ``hsd serve``; ``hsd bench`` keeps them (its Hugging Face
        baselines run the float models)."""
        from hsd_opt.engine.layered import is_released, release_float_weights
        from hsd_opt.engine.precisions import QUANT_KINDS
        from hsd_opt.models.loading import resolve_model_name

        entries = {e.name: e for e in plan.models}
        floats = {resolve_model_name(entries[n].model) for h in hierarchies for n in h
                  if n in entries and entries[n].kind in ("model", "early_exit") and entries[n].model is not None}
        copied = {key[0] for key in self._copies}
        models = [(mid, other.model) for (mid, _, _), other in self._drafts.items()
                  if mid not in floats and id(other.model) in copied]
        if plan_target_precision(plan) in QUANT_KINDS:
            models.append((self.loaded.model_id, self.loaded.model))
        freed = 0
        for name, model in models:
            if is_released(model):
                continue
            self._float_engines.pop(id(model), None)     # an engine no hierarchy of these runs
            try:
                freed += release_float_weights(model)
            except HsdError:            # a float engine over it is alive (built for another hierarchy): keep them
                continue
            if log:
                log(f"{name}: only its quantized copies run; its float weights are released")
        return freed


def _quantized_level(models: PlanModels, name: str, e: PlanModel, source: str, where: str) -> Level:
    """A level over a quantized copy from a ``quantized`` entry: of the target, or with ``model`` of that draft
    model (one copy per model and setting)."""
    model = models.draft_model(e.model, f"{source}: {where}: model").model if e.model else models.loaded.model
    copy = models.copy(model, e.quantization, name, source, where)
    layer = copy.n_layers if e.layer is None else e.layer
    if not 1 <= layer <= copy.n_layers:
        raise InputFileError(source, f"layer {layer!r} of {name!r}: the model has layers 1..{copy.n_layers}", where)
    return Level(name, copy, layer)


def load_plan_heads(plan, loaded, source: str = "plan"):
    """Trained exit heads named by ``provenance.heads`` (None when the plan uses the shared final head), for
    ``loaded`` (a :class:`LoadedModel`). Refused with an :class:`InputFileError` naming ``source`` and the field: a
    heads file that is missing, damaged or made for another model or revision (``provenance.heads``), or whose
    SHA-256 is not the one the profile recorded (``provenance.heads_sha256``; a plan without it is not checked)."""
    from pathlib import Path

    from hsd_opt.heads import load_heads
    from hsd_opt.models.loading import file_sha256

    path = plan.provenance.heads
    if not path:
        return None
    if not Path(path).is_file():
        where = "" if Path(path).is_absolute() else f" (a relative path, read from {Path.cwd()})"
        raise InputFileError(source, f"{path}: heads file not found{where}", "provenance.heads")
    want = plan.provenance.get("heads_sha256")
    if want is not None and not isinstance(want, str):
        raise InputFileError(source, f"expected the heads file's sha256 as a string, got {want!r}",
                             "provenance.heads_sha256")
    if want:
        have = file_sha256(Path(path))
        if have != want:
            raise InputFileError(source, f"{path} has sha256 {have[:16]}..., not the {want[:16]}... the profile was "
                                         f"measured with (the heads file changed since)", "provenance.heads_sha256")
    try:
        heads, _meta = load_heads(path, loaded)
    except HsdError as e:
        raise InputFileError(source, str(e), "provenance.heads") from None
    return heads


def hsd_for_plan(plan, loaded: LoadedModel, mode: str = "exact", source: str = "plan", hierarchy=None,
                 budgets=None, models: PlanModels | None = None) -> HSD:
    """An :class:`HSD` runner for ``plan`` (or for ``hierarchy``/``budgets`` drawn from the same plan's models),
    over ``models`` (a new :class:`PlanModels` of ``loaded`` when None: pass one to share engines between
    runners). A plan made for another model, revision or dtype than ``loaded`` is refused
    (:func:`check_provenance`), as ``hsd run`` refuses it."""
    from hsd_opt.formats import Plan
    from hsd_opt.models.loading import LoadedModel

    if not isinstance(plan, Plan):
        raise HsdError(f"plan: expected a Plan (hsd_opt.load_plan(path)), got {type(plan).__name__}")
    if not isinstance(loaded, LoadedModel):
        raise HsdError(f"loaded: expected a LoadedModel (hsd_opt.models.loading.load_model(name)), "
                       f"got {type(loaded).__name__}")
    check_provenance(plan, loaded, source)
    for name, value in (("hierarchy", hierarchy), ("budgets", budgets)):
        if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
            raise HsdError(f"{name}: expected a list, got {type(value).__name__}")
    if hierarchy is not None:
        from copy import copy

        if not hierarchy:
            raise HsdError("hierarchy: empty; expected names of the plan's models, bottom first, the target last")
        plan = copy(plan)
        plan.hierarchy, plan.budgets = list(hierarchy), list(budgets or [])
    if models is not None and not isinstance(models, PlanModels):
        raise HsdError(f"models: expected a PlanModels or None, got {type(models).__name__}")
    models = models or PlanModels(loaded)
    return HSD(build_levels(plan, models, source=source), plan.budgets, eos_ids=eos_ids(loaded), mode=mode,
               pool=models.pool, max_positions=model_context(loaded))


def model_context(loaded: LoadedModel) -> int | None:
    """The model's context in tokens (:func:`~hsd_opt.models.loading.model_positions`: its
    ``max_position_embeddings``, or its attention window where one is in force), None where its configuration has
    neither."""
    return model_positions(getattr(loaded.model, "config", None))


def hsd_by_load(plan, loaded: LoadedModel, models: PlanModels, mode: str = "exact", source: str = "plan",
                log: Callable[[str], None] | None = None, plan_runner: HSD | None = None) -> dict[int, HSD]:
    """An :class:`HSD` per load level of ``plan`` (``plan.by_load``; empty for a plan without them), every one over
    ``models``' engines; levels that run the same hierarchy and budgets share one runner, and those that run the
    plan's own share ``plan_runner`` when given (built already). ``log`` hears each hierarchy as it is built."""
    if not isinstance(models, PlanModels):
        raise HsdError(f"models: expected the PlanModels every level's hierarchy runs over, got "
                       f"{type(models).__name__}")
    built: dict[tuple, HSD] = {}
    if plan_runner is not None:
        built[(tuple(plan.hierarchy), tuple(plan.budgets))] = plan_runner
    levels: dict[int, HSD] = {}
    for n, e in plan.by_load.items():
        key = (tuple(e.hierarchy), tuple(e.budgets))
        if key not in built:
            if log:
                log(f"load level {n}: the hierarchy {' -> '.join(e.hierarchy)} ...")
            built[key] = hsd_for_plan(plan, loaded, mode=mode, source=source, hierarchy=list(e.hierarchy),
                                      budgets=list(e.budgets), models=models)
        levels[n] = built[key]
    return levels


def run_context(prompt_tokens: int, generated: int) -> float:
    """The context (tokens) a generation's prediction is taken at: the prompt plus half the generated tokens. It
    decodes at contexts ``prompt .. prompt + generated - 1``, and costs are linear in the context, so its mean cost
    per token is the cost at this context (`docs/design.md#costs-that-depend-on-the-context`)."""
    return float(prompt_tokens) + generated / 2.0


def predicts_by_context(plan) -> bool:
    """Whether the plan's predictions depend on the context (it was solved from costs at several contexts and
    carries ``latency_by_context`` tables)."""
    return plan.latency_by_context is not None


def prediction_context(plan, context: float | None) -> float | None:
    """The context a prediction for a run at ``context`` is taken at: ``context`` for a plan whose predictions
    depend on it, else the context the plan was solved for (None when the plan does not record one)."""
    return context if context is not None and predicts_by_context(plan) else plan.context


def _at(table: list | None, latency, context: float | None) -> float | None:
    """``latency`` (seconds/token), or the ``latency_by_context`` ``table`` at ``context`` when both are given."""
    if context is not None and table:
        return latency_at(table, context)
    return None if latency is None else float(latency)


def predicted_latency(plan, hierarchy: Sequence[str], context: float | None = None) -> float | None:
    """The plan's predicted seconds/token for ``hierarchy`` (the plan itself, a baseline, or an alternative), at
    ``context`` tokens when the plan has ``latency_by_context`` tables (None: at the plan's own context)."""
    wanted = list(hierarchy)
    if wanted == list(plan.hierarchy):
        return _at(plan.latency_by_context, plan.expected_latency, context)
    for b in plan.baselines.values():
        if isinstance(b, dict) and list(b.get("hierarchy") or []) == wanted:
            return _at(b.get("latency_by_context"), b.get("expected_latency"), context)
    for alt in plan.alternatives:
        if alt.hierarchy == wanted:
            return _at(alt.latency_by_context, alt.expected_latency, context)
    return None


def task_prediction(plan, task: str | None, key: str | None, fallback: float | None,
                    context: float | None = None) -> float | None:
    """The plan's predicted seconds/token on prompts of ``task`` for one of its overall hierarchies (``key``:
    ``"plan"`` or a baseline's name): ``by_task[task].overall_hierarchies[key]`` when the plan has plans per task
    and one for ``task`` (the hierarchy's latency under that task's acceptance; at ``context`` tokens from
    ``overall_hierarchies_by_context`` when the plan has it), else ``fallback``."""
    e = plan.by_task.get(task) if task is not None else None
    v = e.overall_hierarchies.get(key) if e is not None and key else None
    if v is None:
        return fallback
    return _at(e.overall_hierarchies_by_context.get(key), v, context)


def plan_for_prompt(plan, task: str | None, per_task: bool = True,
                    context: float | None = None) -> tuple[list[str], list[int], float, str]:
    """``(hierarchy, budgets, predicted seconds/token, which)`` to run a prompt of ``task`` with: its task's plan
    (``which = "by_task.<task>"``) when ``per_task`` and the plan has one, else the plan itself (``"plan"``),
    predicted for that task when the plan knows it (:func:`task_prediction`), at ``context`` tokens when the
    plan's predictions depend on the context (None: at the plan's own contexts)."""
    if per_task:
        h, b, pred, which = plan.for_task(task)
        if which != "plan":
            return h, b, _at(plan.by_task[task].latency_by_context, pred, context), which
    own = _at(plan.latency_by_context, plan.expected_latency, context)
    return list(plan.hierarchy), list(plan.budgets), task_prediction(plan, task, "plan", own, context), "plan"
