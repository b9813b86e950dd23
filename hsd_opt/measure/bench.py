"""``hsd bench``: every decoding method side by side on the same prompts, in one process.

Methods: ``hf_ar`` (Hugging Face ``generate``), ``hf_prompt_lookup`` (``prompt_lookup_num_tokens``),
``hf_early_exit`` (``assistant_early_exit`` at the plan's best single exit, only when named; when transformers
refuses it for this model the error is recorded), ``hf_assisted`` (assisted generation with a draft model as
``assistant_model``: the ``assistant`` given, else the plan's draft model, :func:`assistant_ref`), ``ar`` (our
autoregressive loop on the layered engine), ``single_draft`` (the plan's ``baselines.best_single_draft``), ``hsd``
(the plan), ``hsd_task`` (the plan's plans per task, ``by_task``: each prompt runs its task's hierarchy, the plan
itself for a task without one; only for a plan that has them).

Greedy (temperature 0): the reference is ``ar``'s output and every method reports ``matches_reference``. For a
plan made for a quantized target (``--target-precision int4``) ``ar`` is that copy's own loop, while the Hugging
Face methods run the float model, the baseline users compare against: they are not expected to match.
Sampling (``temperature > 0``, optionally ``top_p``): every method samples from the same processed distribution
(Hugging Face methods with ``do_sample`` and ``top_k=0``, seeded with ``torch.manual_seed``; ours with their own
seeded generator), prompt ``i`` with seed ``seed + i`` (its index in the file; a later turn ``k`` with
``seed + i + 1000003 k``, :data:`~hsd_opt.seeds.SEED_STRIDE`). Outputs are draws and are not compared token for
token: the tests prove that our sampler keeps the target's distribution.

Prompts: :class:`~hsd_opt.prompts.PromptItem` s (or plain strings). With ``turns="all"`` each later turn of a
multi-turn item (MT-bench) is sent after the method's OWN answer to the previous turn, under greedy and sampling
alike: a lossless method answers like the reference, so it sees the reference's conversation, and one that does
not is reported as not matching (it is then judged on its own conversation, as a user would see it).

Timing: one warm-up generation per method (and per hierarchy of ``hsd_task``), then per prompt every method runs
its whole conversation once, in rotating order (so load from other processes spreads evenly over methods).
``tokens_per_s`` = generated tokens / wall seconds, every turn counted (prefill included, as HF's); our methods
also report decode-only ``seconds_per_token`` next to the plan's prediction. Figures are reported overall and per
task (:mod:`hsd_opt.measure.report`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from hsd_opt.console import heartbeat
from hsd_opt.errors import HsdError, one_line
from hsd_opt.measure.methods import DEFAULT_METHODS, METHODS, ON_REQUEST_METHODS, Sampling, check_sampling
from hsd_opt.measure.report import Generation, add_matches, add_speedups, outputs_by_item, plot_report, totals_by
from hsd_opt.prompts import PromptItem, check_report_key, check_turn_mode, conversation_ids, user_turns
from hsd_opt.runtime.plan_checks import plan_target_precision
from hsd_opt.runtime.runner import eos_ids, hsd_for_plan, predicts_by_context, run_context

if TYPE_CHECKING:
    from hsd_opt.formats import Profile

__all__ = ["METHODS", "DEFAULT_METHODS", "ON_REQUEST_METHODS", "Sampling", "assistant_ref", "build_runners",
           "converse", "default_methods", "plot_report", "run_bench"]


def _hf_generate(loaded, ids: list[int], max_new: int, eos: list[int], sampling: Sampling, seed: int,
                 **kw) -> list[int]:
    model = loaded.model
    inp = torch.tensor([ids], device=model.device)
    pad = loaded.tokenizer.pad_token_id
    if sampling.greedy:
        how = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    else:  # the same processing as ours: temperature, top-k (0: none; HF's default would be 50), top-p, min-p
        torch.manual_seed(seed)
        how = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
               "top_k": sampling.top_k, "min_p": sampling.min_p or None}
    out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, eos_token_id=eos,
                         pad_token_id=pad if pad is not None else eos[0], **how, **kw)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


def _best_exit(plan) -> int | None:
    """The layer of the target's own early exit that ``hf_early_exit`` runs: that of the best early exit, else
    the best single draft's or the plan's own drafter when they are one, else the best-ranked two-level
    alternative's (alternatives are ranked by predicted latency); None when none is an exit of the target."""
    bee = plan.baselines.get("best_early_exit") or {}
    bsd = plan.baselines.get("best_single_draft") or {}
    drafters = list(bee.get("hierarchy") or [])[:-1] + list(bsd.get("hierarchy") or [])[:-1]
    alt_drafters = [a.hierarchy[0] for a in plan.alternatives if len(a.hierarchy) == 2]
    for name in drafters + plan.hierarchy[:-1] + alt_drafters:
        e = plan.level_entry(name, is_target=False)
        if e is not None and e.kind == "early_exit" and e.model is None and e.layer is not None:
            return e.layer
    return None


def default_methods(plan, assistant: str | None = None) -> list[str]:
    """The methods ``hsd bench`` runs when none are named: :data:`DEFAULT_METHODS` (``hf_assisted`` only with a
    draft model: ``assistant``, else the plan's, :func:`assistant_ref`), plus ``hsd_task`` when the plan has plans
    per task. ``hf_early_exit`` runs only when named."""
    methods = [m for m in DEFAULT_METHODS if m != "hf_assisted" or assistant or assistant_ref(plan)]
    return methods + (["hsd_task"] if plan.tasks else [])


def _as_items(prompts: Sequence[str | PromptItem]) -> list[PromptItem]:
    return [p if isinstance(p, PromptItem) else PromptItem(i, p, "other") for i, p in enumerate(prompts)]


#: A method: (prompt ids, max new tokens, seed, the prompt's item) -> (generated ids, our stats or None, plan used
#: or None, predicted seconds/token or None, the context in tokens it was predicted at or None).
Runner = Callable[[list[int], int, int, PromptItem],
                  tuple[list[int], dict | None, str | None, float | None, float | None]]


def assistant_ref(plan) -> str | None:
    """The draft model ``hf_assisted`` hands Hugging Face as ``assistant_model``: the model of the plan's first
    ``model`` entry, else the model a quantized copy of a draft model was made from; None without either."""
    for kind in ("model", "quantized"):
        for e in plan.models:
            if e.kind == kind and e.model is not None:
                return e.model
    return None


def build_runners(plan, loaded, methods: Sequence[str], sampling: Sampling, mode: str, source: str,
                  tasks: Sequence[str], extra: dict[str, tuple[list[str], list[int]]] | None = None,
                  assistant: str | None = None):
    """``(runners, descriptions, errors, built)`` for ``methods`` (and ``extra`` hierarchies of the plan's models);
    ``built``: our runners by ``(hierarchy, budgets)``, each built once over one set of models. ``tasks`` are the
    prompts' tasks: ``hsd_task`` builds the hierarchy of each of them up front. ``assistant``: the draft model of
    ``hf_assisted`` (default :func:`assistant_ref`)."""
    from hsd_opt.runtime.runner import PlanModels

    eos = eos_ids(loaded)
    models = PlanModels(loaded)          # every hierarchy of the plan over one target engine, one copy each
    runners: dict[str, Runner] = {}
    desc: dict[str, Any] = {}
    errors: dict[str, str] = {}
    built: dict[tuple, Any] = {}

    def hsd(hierarchy, budgets):
        key = (tuple(hierarchy), tuple(budgets))
        if key not in built:
            built[key] = hsd_for_plan(plan, loaded, mode=mode, source=source, hierarchy=list(hierarchy),
                                      budgets=list(budgets), models=models)
        return built[key]

    for m in methods:
        run, d, why = _method_runner(m, plan, loaded, models, hsd, eos, sampling, tasks, assistant)
        if why is not None:
            errors[m] = why
        elif run is not None:
            runners[m] = run
            if d is not None:
                desc[m] = d
    for name, (hh, bb) in (extra or {}).items():
        runners[name], desc[name] = _hierarchy_runner(plan, hsd, list(hh), list(bb), None, sampling)
    return runners, desc, errors, built


def _method_runner(m: str, plan, loaded, models, hsd, eos: list[int], sampling: Sampling, tasks: Sequence[str],
                   assistant: str | None) -> tuple[Runner | None, dict | None, str | None]:
    """``(runner, its description or None, None)`` for method ``m``, or ``(None, None, why)`` where the plan lacks
    what it needs (nothing for a name not in :data:`METHODS`). ``hsd(hierarchy, budgets)``: our runner of one
    hierarchy, built once."""
    if m.startswith("hf_") and sampling.constrained:
        return None, None, ("HF generate does not follow a grammar (--json-schema, --grammar, or a prompt's schema): "
                            "not run")
    if m == "hf_ar":
        return _hf_runner(loaded, eos, sampling), None, None
    if m == "hf_prompt_lookup":
        return _hf_runner(loaded, eos, sampling, prompt_lookup_num_tokens=10), None, None
    if m == "hf_early_exit":
        ex = _best_exit(plan)
        if ex is None:
            return None, None, "neither the plan nor its alternatives use an early exit to self-speculate with: not run"
        return _hf_runner(loaded, eos, sampling, assistant_early_exit=ex), {"assistant_early_exit": ex}, None
    if m == "hf_assisted":
        ref = assistant or assistant_ref(plan)
        if ref is None:
            return None, None, "the plan has no draft model to assist with (give --assistant MODEL): not run"
        draft = models.draft_model(ref, "--assistant" if assistant else "the plan's draft model")
        return (_hf_runner(loaded, eos, sampling, assistant_model=draft.model), {"assistant_model": draft.model_id},
                None)
    if m == "ar":
        return (*_hierarchy_runner(plan, hsd, [plan.hierarchy[-1]], [], "target_only", sampling), None)
    if m == "single_draft":
        bsd = plan.baselines.get("best_single_draft") or None
        if not bsd:
            return None, None, "the plan has no baselines.best_single_draft: not run"
        return (*_hierarchy_runner(plan, hsd, list(bsd["hierarchy"]), list(bsd["budgets"]), "best_single_draft",
                                   sampling), None)
    if m == "hsd":
        return (*_hierarchy_runner(plan, hsd, list(plan.hierarchy), list(plan.budgets), "plan", sampling), None)
    if m == "hsd_task":
        if not plan.tasks:
            return None, None, "the plan has no plans per task (by_task; hsd solve --per-task makes them): not run"
        return (*_task_runner(plan, hsd, tasks, sampling), None)
    return None, None, None


def _generate(h, ids: list[int], n: int, seed: int, sampling: Sampling, item: PromptItem):
    """``(token ids, stats)`` of one generation of at most ``n`` tokens of ``item`` by our runner ``h``."""
    r = h.generate(ids, n, temperature=sampling.temperature, **sampling.filters, seed=seed,
                   constraint=sampling.constraint(item))
    return r.token_ids, r.stats


def _hierarchy_runner(plan, hsd, hierarchy: list[str], budgets: list[int], key: str | None,
                      sampling: Sampling) -> tuple[Runner, dict]:
    """Our runner of one hierarchy (built now) and its description; each generation predicted at its own context
    (``key``: the plan's section the hierarchy is, for the prediction under a prompt's task)."""
    from hsd_opt.runtime.runner import predicted_latency, prediction_context, task_prediction

    h = hsd(hierarchy, budgets)

    def run(ids, n, seed, item):
        toks, st = _generate(h, ids, n, seed, sampling, item)
        ctx = run_context(len(ids), len(toks))
        pred = predicted_latency(plan, hierarchy, ctx)
        return toks, st, None, task_prediction(plan, item.task, key, pred, ctx), prediction_context(plan, ctx)

    return run, {"hierarchy": list(hierarchy), "budgets": list(budgets)}


def _task_runner(plan, hsd, tasks: Sequence[str], sampling: Sampling) -> tuple[Runner, dict]:
    """``hsd_task``: each prompt runs its task's hierarchy (that of every task in ``tasks``, and the plan's own,
    built now); its description holds each plan's hierarchy and budgets (``plan_hierarchies``; the report's
    ``plans`` are those that ran)."""
    from hsd_opt.runtime.runner import plan_for_prompt, prediction_context

    plans = {}
    for t in list(tasks) + [None]:
        hh, bb, _, which = plan_for_prompt(plan, t)
        plans[which] = {"hierarchy": hh, "budgets": bb}
        hsd(hh, bb)

    def run(ids, n, seed, item):
        hh, bb, _, which = plan_for_prompt(plan, item.task)
        toks, st = _generate(hsd(hh, bb), ids, n, seed, sampling, item)
        ctx = run_context(len(ids), len(toks))
        return toks, st, which, plan_for_prompt(plan, item.task, context=ctx)[2], prediction_context(plan, ctx)

    return run, {"plan_hierarchies": plans}


def _hf_runner(loaded, eos: list[int], sampling: Sampling, **kw) -> Runner:
    """A Hugging Face ``generate`` method (``kw``: its speculation options); no stats, no prediction."""
    return lambda ids, n, seed, item: (_hf_generate(loaded, ids, n, eos, sampling, seed, **kw), None, None, None,
                                       None)


def converse(run: Runner, tokenizer, item: PromptItem, turns: str, raw: bool, max_new_tokens: int,
             sampling: Sampling) -> list[Generation]:
    """Run ``item``'s turns with one method: turn k is sent after the method's own answers to turns 0..k-1
    (:func:`~hsd_opt.prompts.conversation_ids`). Returns one :class:`Generation` per turn (only the generation
    call is timed)."""
    answers: list[str] = []
    out = []
    for k, _ in enumerate(user_turns(item, turns)):
        ids = conversation_ids(tokenizer, item.turns, answers, raw)
        t0 = time.perf_counter()
        toks, st, which, pred, at = run(ids, max_new_tokens, sampling.seed_for(item.index, k), item)
        dt = time.perf_counter() - t0
        out.append(Generation(item.index, k, item.task, item.category, toks, dt, st, which, pred,
                              run_context(len(ids), len(toks)), at))
        answers.append(tokenizer.decode(toks, skip_special_tokens=True))
    return out


def run_bench(plan, loaded, prompts: Sequence[str | PromptItem], max_new_tokens: int = 64, raw: bool = False,
              mode: str = "exact", methods: Sequence[str] | None = None, log: Callable[[str], None] | None = None,
              source: str = "plan", extra: dict[str, tuple[list[str], list[int]]] | None = None,
              turns: str = "first", sampling: Sampling | None = None, by: str = "group",
              assistant: str | None = None, retime: "Profile | None" = None,
              retime_source: str = "profile", between: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Benchmark ``methods`` (default: :func:`default_methods`) over ``prompts``; returns the JSON report
    ``{"methods": {...}, "by_task": {task: {...}}, ...}``; stopped by Ctrl-C after a prompt every method finished,
    the report of those, with ``stopped``.

    ``extra`` adds more of our hierarchies drawn from the plan's models: ``{name: (hierarchy, budgets)}``;
    ``assistant``: the draft model of ``hf_assisted`` (default: the plan's, :func:`assistant_ref`).
    ``turns``: ``"first"`` or ``"all"`` (every turn, after the method's own answers); ``by``: ``"group"`` (the
    task) or ``"category"`` (Spec-Bench's raw category) for the ``by_task`` section. ``retime``: the profile the
    plan was solved from (a :class:`~hsd_opt.formats.Profile`; ``retime_source`` names it in errors): before each
    prompt the engines' steps are timed (:class:`~hsd_opt.measure.retime.StepClock`) and every generation of ours
    is priced again with the profile's costs scaled to that speed (``retimed_predicted_seconds_per_token``).
    ``between(i)`` is called after prompt ``i`` (every method finished it), before the next: a benchmark
    interleaves another program's runs with the prompts (llama.cpp's, ``benchmarks/llama_anchor.py``).
    """
    log = log or (lambda s: None)
    sampling = sampling or Sampling()
    check_sampling(sampling)
    check_turn_mode(turns)
    check_report_key(by)
    items = _as_items(prompts)
    if not items:
        raise HsdError("no prompts to benchmark")
    if retime is not None:
        from hsd_opt.measure.retime import check_profile_for_plan

        check_profile_for_plan(retime, plan, retime_source)
    if methods is None:
        methods = default_methods(plan, assistant)
    tok = loaded.tokenizer
    runners, desc, errors, built = build_runners(plan, loaded, methods, sampling, mode, source,
                                                 sorted({it.task for it in items}), extra, assistant)
    _some_method_runs(runners, errors)
    ids0 = conversation_ids(tok, items[0].turns, [], raw)
    _warm_up(runners, built, errors, ids0, min(8, max_new_tokens), sampling, items[0], log)
    _some_method_runs(runners, errors)
    clock = None
    if retime is not None:
        from hsd_opt.measure.retime import StepClock, greedy_costs

        # timed as the profile's steps were (a sampled profile's end in logits), whatever this run samples
        clock = StepClock(retime, list(built.values()), text=ids0, greedy=greedy_costs(retime))
    gens, done = _timed_runs(runners, items, tok, turns, raw, max_new_tokens, sampling, clock, desc, plan, retime,
                             log, between, errors)
    report = _method_reports(gens, desc, errors, by, sampling)
    _reference_notes(report, plan, source, loaded.dtype, sampling)
    if done < len(items):
        report["stopped"] = {"prompts_done": done, "prompts_asked": len(items),
                             "said": f"the report holds the {done} of {len(items)} prompts every method finished"}
    report.update({"sampling": sampling.to_dict(), "prompts": done, "turns": turns, "by": by,
                   "max_new_tokens": max_new_tokens, "mode": mode,
                   "plan": {"hierarchy": plan.hierarchy, "budgets": plan.budgets,
                            "expected_latency": plan.expected_latency, "tasks": plan.tasks, "context": plan.context},
                   "prediction_context": ("each generation's own: prompt + half the generated tokens"
                                          if predicts_by_context(plan) else "the plan's"),
                   "torch_threads": torch.get_num_threads()})
    if clock is not None:
        report["retime"] = {"profile": retime_source, "engines": clock.summary(),
                            "note": "retimed_predicted_seconds_per_token: the plan's latency model with the "
                                    "profile's costs scaled per engine by its step time measured before each "
                                    "prompt"}
    return report


def _some_method_runs(runners: dict[str, Runner], errors: dict[str, str]) -> None:
    """Refuse a bench none of whose methods can run, saying why each cannot (one line)."""
    if not runners:
        raise HsdError("--methods: none of the methods can run: "
                       + "; ".join(f"{m}: {why}" for m, why in errors.items()))


def _warm_up(runners: dict[str, Runner], built: dict, errors: dict[str, str], ids: list[int], n: int,
             sampling: Sampling, item: PromptItem, log) -> None:
    """One generation of ``n`` tokens from ``ids`` by every hierarchy ``built`` (those of ``hsd_task`` included),
    then by every method: a method that raises is recorded in ``errors`` and dropped from ``runners``, said."""
    for h in built.values():
        h.generate(ids, n, temperature=sampling.temperature, **sampling.filters,
                   constraint=sampling.constraint(item))
    for m in list(runners):
        try:
            runners[m](ids, n, sampling.seed, item)
        except Exception as e:  # noqa: BLE001 - HF may refuse a generation mode for this model
            errors[m] = one_line(e)
            del runners[m]
            log(f"{m}: skipped ({errors[m]})")


def _timed_runs(runners: dict[str, Runner], items: list[PromptItem], tok, turns: str, raw: bool,
                max_new_tokens: int, sampling: Sampling, clock, desc: dict, plan, retime, log,
                between: Callable[[int], None] | None, errors: dict[str, str]) -> dict[str, list]:
    """Every method's conversation of every prompt (:func:`converse`), the methods in an order rotating with the
    prompt; with a ``clock`` (``--retime``) the engines' steps timed before each prompt and our generations priced
    again at that speed (:func:`_retime`); ``between(i)`` after prompt ``i`` (None: nothing). Returns the
    :class:`Generation` s of each method, in prompt order, and how many prompts every method finished: fewer than
    ``items`` after Ctrl-C (those finished are kept; none finished: the interrupt goes on). A method that raises on
    a prompt is dropped from the report, its error in ``errors`` (:func:`_drop_failed`), the others go on."""
    names = list(runners)
    gens: dict[str, list[Generation]] = {m: [] for m in names}
    t_start, done = time.monotonic(), 0
    try:
        for i, it in enumerate(items):
            order = names[i % len(names):] + names[: i % len(names)]
            factor = clock.measure() if clock is not None else None
            for m in order:
                if m not in runners:
                    continue
                where = f"prompt {i + 1}/{len(items)} ({it.category or it.task}), {m}"
                try:
                    with heartbeat(log, where):
                        new = converse(runners[m], tok, it, turns, raw, max_new_tokens, sampling)
                except Exception as e:  # noqa: BLE001 - HF may refuse or run out of memory on a longer prompt
                    _drop_failed(m, e, i, runners, gens, errors, log)
                    continue
                if factor is not None:
                    _retime(new, m, desc, plan, retime, factor)
                gens[m] += new
                n_tok, secs = sum(len(g.token_ids) for g in new), sum(g.seconds for g in new)
                log(f"{where}: {n_tok} tokens in {secs:.1f} s ({n_tok / secs if secs > 0 else 0:.2f} tok/s)")
            done = i + 1
            if between is not None:
                between(i)
            elapsed = time.monotonic() - t_start
            left = elapsed / (i + 1) * (len(items) - i - 1)
            log(f"prompt {i + 1}/{len(items)} done, elapsed {elapsed / 60:.1f} min, ETA {left / 60:.1f} min")
    except KeyboardInterrupt:               # Ctrl-C: the prompts every method finished are reported
        if done == 0:
            raise
        kept = {it.index for it in items[:done]}
        gens = {m: [g for g in gs if g.item in kept] for m, gs in gens.items()}
    return gens, done


def _drop_failed(m: str, e: Exception, i: int, runners: dict, gens: dict, errors: dict[str, str], log) -> None:
    """Method ``m`` raised ``e`` on prompt ``i``: recorded in ``errors``, said, and dropped from ``runners`` and
    ``gens`` (a method's figures over fewer prompts than the others' would not compare); an :class:`HsdError`
    where no method is left (it ended the bench with a traceback, every finished prompt lost)."""
    errors[m] = f"failed on prompt {i + 1}: {one_line(e)}"
    del runners[m]
    gens.pop(m, None)
    log(f"{m}: dropped ({errors[m]})")
    if not runners:
        raise HsdError("every method failed: " + "; ".join(f"{k}: {why}" for k, why in errors.items())) from None


def _method_reports(gens: dict[str, list[Generation]], desc: dict, errors: dict[str, str], by: str,
                    sampling: Sampling) -> dict[str, Any]:
    """The report's ``methods`` and ``by_task`` (totals, speed-ups, matches with ``ar``'s outputs under greedy,
    the errors of the methods that did not run) and ``reference`` (``ar``, or None where not compared)."""
    report: dict[str, Any] = {"methods": {}, "by_task": {}}
    ref = outputs_by_item(gens["ar"]) if sampling.greedy and "ar" in gens else None
    for m in gens:
        overall, per = totals_by(gens[m], by)
        outs = outputs_by_item(gens[m]) if ref is not None else None
        d = {**overall.to_dict(), **desc.get(m, {})}
        if outs is not None:
            add_matches(d, overall.items, outs, ref)
        elif not sampling.greedy:
            d["matches_reference"] = None
        report["methods"][m] = d
        for task, t in per.items():
            td = t.to_dict()
            if outs is not None:
                add_matches(td, t.items, outs, ref)
            elif not sampling.greedy:
                td["matches_reference"] = None
            report["by_task"].setdefault(task, {})[m] = td
    add_speedups(report["methods"])
    for ms in report["by_task"].values():
        add_speedups(ms)
    for m, e in errors.items():
        report["methods"].setdefault(m, {})["error"] = e
    report["reference"] = "ar" if ref is not None else None
    return report


def _reference_notes(report: dict[str, Any], plan, source: str, dtype, sampling: Sampling) -> None:
    """Add to the report the plan's target precision and what the ``matches_reference`` figures mean: against a
    quantized target the hf_* methods (the ``dtype`` model) are not expected to match; under sampling, or without
    ``ar``, nothing is compared."""
    precision = plan_target_precision(plan, source)
    report["target_precision"] = precision
    if precision in ("int8", "int4"):
        report["reference_note"] = (f"the target is the {precision} copy: ar is its own loop and the reference; "
                                    f"the hf_* methods run the {dtype} model (the baseline to compare "
                                    f"against) and are not expected to match it")
    report["hf_ar_matches_reference"] = report["methods"].get("hf_ar", {}).get("matches_reference")
    if not sampling.greedy:
        report["matches_reference_note"] = ("not compared under sampling: outputs are draws (the tests prove that "
                                            "the sampler keeps the target's distribution)")
    elif report["reference"] is None and "error" in report["methods"].get("ar", {}):
        report["matches_reference_note"] = (f"not compared: ar, the greedy reference, failed "
                                            f"({report['methods']['ar']['error']})")
    elif report["reference"] is None:
        report["matches_reference_note"] = ("not compared: the greedy reference is our AR loop, and this run did "
                                            "not include ar in --methods")


def _retime(gens: Sequence[Generation], method: str, desc: dict, plan, profile, factor: dict[str, float]) -> None:
    """Set ``retimed`` on our ``gens`` of ``method``: its hierarchy priced with ``profile``'s costs scaled by
    ``factor`` (:func:`~hsd_opt.measure.retime.retimed_latency`), at the context and under the task acceptance
    its own prediction used."""
    from hsd_opt.measure.retime import profile_task, retimed_latency
    from hsd_opt.runtime.runner import plan_for_prompt

    for g in gens:
        if g.stats is None:
            continue
        if method == "hsd_task":
            hh, bb = plan_for_prompt(plan, g.task)[:2]
        elif "hierarchy" in desc.get(method, {}):
            hh, bb = desc[method]["hierarchy"], desc[method]["budgets"]
        else:
            continue
        g.retimed = retimed_latency(profile, hh, bb, factor, g.predicted_at, profile_task(profile, plan, g.task))


