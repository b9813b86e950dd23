"""``hsd bench``: every decoding method side by side on the same prompts, in one process.

Methods (greedy): ``hf_ar`` (Hugging Face ``generate``), ``hf_prompt_lookup`` (``prompt_lookup_num_tokens``),
``hf_early_exit`` (``assistant_early_exit`` at the plan's best single exit; when transformers refuses it for this
model the error is recorded), ``ar`` (our autoregressive loop on the layered engine), ``single_draft`` (the plan's
``baselines.best_single_draft``), ``hsd`` (the plan). The greedy reference is ``ar``'s output; every method
reports ``matches_reference``.

Timing: one warm-up generation per method, then per prompt every method runs once, in rotating order (so load
from other processes spreads evenly over methods). ``tokens_per_s`` = generated tokens / wall seconds (prefill
included, as HF's); our methods also report decode-only ``seconds_per_token`` next to the plan's prediction.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from hsd_opt.prompts import encode_prompt
from hsd_opt.runtime.decode import LevelStats, add_levels
from hsd_opt.runtime.runner import eos_ids, hsd_for_plan

METHODS = ("hf_ar", "hf_prompt_lookup", "hf_early_exit", "ar", "single_draft", "hsd")


def _hf_generate(loaded, ids: list[int], max_new: int, eos: list[int], **kw) -> list[int]:
    model = loaded.model
    inp = torch.tensor([ids], device=model.device)
    pad = loaded.tokenizer.pad_token_id
    out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad if pad is not None else eos[0], temperature=None,
                         top_p=None, top_k=None, **kw)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


def _best_exit(plan) -> int | None:
    from hsd_opt.runtime.runner import plan_entries

    bee = plan.baselines.get("best_early_exit") or {}
    bsd = plan.baselines.get("best_single_draft") or {}
    drafters = list(bee.get("hierarchy") or [])[:-1] + list(bsd.get("hierarchy") or [])[:-1]
    try:
        entries = plan_entries(plan)
    except Exception:
        entries = {}
    allm = {e["name"]: e for e in plan.extra.get("models") or [] if isinstance(e, dict) and "name" in e}
    allm.update(entries)
    # The best early exit, else the best single draft or the plan itself when they use an exit; else the
    # best-ranked two-level alternative whose drafter is an exit (alternatives are ranked by predicted latency).
    alt_drafters = [a["hierarchy"][0] for a in plan.extra.get("alternatives") or []
                    if isinstance(a, dict) and len(a.get("hierarchy") or []) == 2]
    for n in drafters + plan.hierarchy[:-1] + alt_drafters:
        e = allm.get(n)
        if e is None and n.startswith("layer") and n[5:].isdigit():
            return int(n[5:])
        if e and e.get("kind") == "early_exit":
            return int(e["layer"])
    return None


def run_bench(plan, loaded, prompts: Sequence[str], max_new_tokens: int = 64, raw: bool = False,
              mode: str = "exact", methods: Sequence[str] = METHODS, log: Callable[[str], None] | None = None,
              source: str = "plan", extra: dict[str, tuple[list[str], list[int]]] | None = None) -> dict[str, Any]:
    """Benchmark ``methods`` over ``prompts`` (strings); returns the JSON report ``{"methods": {...}, ...}``.

    ``extra`` adds more of our hierarchies drawn from the plan's models: ``{name: (hierarchy, budgets)}``.
    """
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.runtime.runner import load_plan_heads, predicted_latency

    log = log or (lambda s: None)
    eos = eos_ids(loaded)
    ids_list = [encode_prompt(loaded.tokenizer, p, raw=raw) for p in prompts]
    lm = LayeredLM(loaded.model, exit_heads=load_plan_heads(plan, loaded, source))
    target = plan.hierarchy[-1]
    bsd = plan.baselines.get("best_single_draft") or None
    runners: dict[str, Callable[[list[int], int], tuple[list[int], dict | None]]] = {}
    predicted: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    hier: dict[str, Any] = {}

    def ours(name, hierarchy, budgets):
        h = hsd_for_plan(plan, loaded, lm=lm, mode=mode, source=source, hierarchy=hierarchy, budgets=budgets)

        def go(ids, n):
            r = h.generate(ids, n)
            return r.token_ids, r.stats

        runners[name] = go
        predicted[name] = predicted_latency(plan, hierarchy) if hierarchy != [target] else \
            (plan.baselines.get("target_only") or {}).get("expected_latency")
        hier[name] = {"hierarchy": list(hierarchy), "budgets": list(budgets)}

    for m in methods:
        if m == "hf_ar":
            runners[m] = lambda ids, n: (_hf_generate(loaded, ids, n, eos), None)
        elif m == "hf_prompt_lookup":
            runners[m] = lambda ids, n: (_hf_generate(loaded, ids, n, eos, prompt_lookup_num_tokens=10), None)
        elif m == "hf_early_exit":
            ex = _best_exit(plan)
            if ex is None:
                errors[m] = "neither the plan nor its alternatives use an early exit to self-speculate with"
                continue
            hier[m] = {"assistant_early_exit": ex}
            runners[m] = (lambda e: lambda ids, n: (_hf_generate(loaded, ids, n, eos, assistant_early_exit=e),
                                                    None))(ex)
        elif m == "ar":
            ours(m, [target], [])
        elif m == "single_draft":
            if not bsd:
                errors[m] = "the plan has no baselines.best_single_draft"
                continue
            ours(m, list(bsd["hierarchy"]), list(bsd["budgets"]))
        elif m == "hsd":
            ours(m, list(plan.hierarchy), list(plan.budgets))

    for name, (hh, bb) in (extra or {}).items():
        ours(name, list(hh), list(bb))

    # warm-up (a refused method is recorded and dropped)
    for m in list(runners):
        try:
            runners[m](ids_list[0], min(8, max_new_tokens))
        except Exception as e:  # noqa: BLE001 - HF may refuse a generation mode for this model
            errors[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            del runners[m]
            log(f"{m}: skipped ({errors[m]})")
    names = list(runners)
    outs: dict[str, list[list[int]]] = {m: [] for m in names}
    secs: dict[str, float] = {m: 0.0 for m in names}
    dec: dict[str, float] = {m: 0.0 for m in names}
    tcalls: dict[str, int] = {m: 0 for m in names}
    levels: dict[str, list[LevelStats]] = {}
    for i, ids in enumerate(ids_list):
        order = names[i % len(names):] + names[: i % len(names)]
        for m in order:
            t0 = time.perf_counter()
            toks, st = runners[m](ids, max_new_tokens)
            secs[m] += time.perf_counter() - t0
            outs[m].append(toks)
            if st is not None:
                dec[m] += st["decode_seconds"]
                tcalls[m] += st["target_calls"]
                levels[m] = add_levels(levels.get(m), st["levels"])
        log(f"prompt {i + 1}/{len(ids_list)} done")
    ref = outs.get("ar")
    report: dict[str, Any] = {"methods": {}}
    for m in names:
        n = sum(len(o) for o in outs[m])
        d: dict[str, Any] = {"tokens": n, "seconds": secs[m], "tokens_per_s": n / secs[m] if secs[m] else None}
        d.update(hier.get(m, {}))
        if ref is not None:
            same = [a == b for a, b in zip(outs[m], ref)]
            d["matches_reference"] = all(same)
            d["prompts_matching"] = sum(same)
        if m in levels:
            d["levels"] = [lv.to_dict() for lv in levels[m]]
            d["seconds_per_token"] = dec[m] / n if n else None
            d["target_calls"] = tcalls[m]
            d["tokens_per_target_call"] = n / tcalls[m] if tcalls[m] else None
            pr = predicted.get(m)
            d["predicted_seconds_per_token"] = pr
            if pr and d["seconds_per_token"]:
                d["measured_over_predicted"] = d["seconds_per_token"] / pr
        report["methods"][m] = d
    for m, d in report["methods"].items():
        for base in ("hf_ar", "ar"):
            b = report["methods"].get(base, {}).get("tokens_per_s")
            d[f"speedup_vs_{base}"] = d["tokens_per_s"] / b if b and d["tokens_per_s"] else None
    for m, e in errors.items():
        report["methods"].setdefault(m, {})["error"] = e
    report["reference"] = "ar"
    report["hf_ar_matches_reference"] = report["methods"].get("hf_ar", {}).get("matches_reference")
    report["prompts"] = len(ids_list)
    report["max_new_tokens"] = max_new_tokens
    report["mode"] = mode
    report["plan"] = {"hierarchy": plan.hierarchy, "budgets": plan.budgets,
                      "expected_latency": plan.expected_latency}
    report["torch_threads"] = torch.get_num_threads()
    return report


def plot_report(report: dict[str, Any], path) -> None:
    """PNG: tokens/s per method (left) and predicted vs measured ms/token for our methods (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = {m: d for m, d in report["methods"].items() if d.get("tokens_per_s")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(ms)
    a.bar(names, [ms[m]["tokens_per_s"] for m in names], color="tab:blue")
    a.set_ylabel("tokens / s")
    a.set_title("throughput (greedy, same prompts)")
    a.tick_params(axis="x", rotation=30)
    ours = [m for m in names if ms[m].get("seconds_per_token")]
    x = range(len(ours))
    b.bar([i - 0.2 for i in x], [1e3 * (ms[m].get("predicted_seconds_per_token") or 0) for m in ours], 0.4,
          label="predicted (plan)")
    b.bar([i + 0.2 for i in x], [1e3 * ms[m]["seconds_per_token"] for m in ours], 0.4, label="measured")
    b.set_xticks(list(x), ours)
    b.set_ylabel("ms / token (decode)")
    b.set_title("latency: predicted vs measured")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
