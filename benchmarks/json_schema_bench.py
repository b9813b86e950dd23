"""Structured output on the shipped JSON-schema tasks (``hsd_opt/data/json_tasks.jsonl``), every method under each
task's schema, greedy, interleaved per task (the order rotating), in one process:

    .venv/bin/python -m benchmarks.json_schema_bench --plan tests/data/runtime_bench_lookup_plan.json \
        [--json-plan plan.json] [--skip 0] [--limit 60] [--max-new-tokens 200] \
        [--out benchmarks/results/json_schema_bench.json]

Methods: ``masked_ar_no_skip`` (the target alone, one pass per token: the reference of losslessness), ``masked_ar``
(the target alone, forced tokens taken without a pass), ``plan_no_skip`` and ``plan`` (the plan's hierarchy under
the grammar, without and with forced tokens taken without passes) and, with ``--json-plan``, ``json_plan`` (that
plan's plan for task ``json``, ``hsd solve --per-task`` of a profile made with ``--json-tasks``; ``--skip N`` leaves
out the first N tasks, e.g. those it was profiled on). Reported per method: tokens, decode tokens/s
(prefill excluded), tokens per target pass, the grammar's seconds per token (all of the constraint's work); per task
whether the output ended and parses as JSON, whether every method's output equals the reference, and the share of
positions where the grammar allowed one token only (forced). Also p50/p99 of a new prefix's mask (moving the matcher
and filling its bits) and of a schema's compile, cold and from the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.entry import count, nonnegative, run, whole
from hsd_opt.engine.variants import host
from hsd_opt.errors import HsdError
from hsd_opt.formats import load_plan
from hsd_opt.grammar.compiler import GrammarSpec, compiler_for
from hsd_opt.grammar.constraint import Constraint
from hsd_opt.jsonio import write_json
from hsd_opt.models.loading import eos_token_ids, load_model
from hsd_opt.prompts import chat_ids
from hsd_opt.runtime import decode
from hsd_opt.runtime.runner import hsd_for_plan

TASKS = Path(__file__).resolve().parents[1] / "hsd_opt" / "data" / "json_tasks.jsonl"


class _Timed(Constraint):
    """A constraint that adds up the seconds of all its work (``seconds``: the outermost call of each question the
    decoding asks, so nothing is counted twice) and keeps the seconds of each new prefix's mask (``fills``: moving
    the matcher there and filling its bits)."""

    seconds = 0.0
    fills: list[float] = []
    _depth = 0

    def _timed(self, fn, *args):
        _Timed._depth += 1
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _Timed._depth -= 1
            if _Timed._depth == 0:
                _Timed.seconds += time.perf_counter() - t

    def bits(self, generated, length):
        before = self._bits.get(length)
        t = time.perf_counter()
        b = self._timed(super().bits, generated, length)
        if b is not before:
            _Timed.fills.append(time.perf_counter() - t)
        return b

    def allowed(self, generated, length):
        return self._timed(super().allowed, generated, length)

    def allows(self, generated, length, token):
        return self._timed(super().allows, generated, length, token)

    def only(self, generated, length):
        return self._timed(super().only, generated, length)

    def allowed_prefix(self, generated, start, tokens):
        return self._timed(super().allowed_prefix, generated, start, tokens)


def quantiles_ms(xs: list[float], digits: int | None = None) -> dict:
    """p50 and p99 of ``xs`` (seconds) in milliseconds (rounded to ``digits`` where given), and their count."""
    if not xs:
        return {}
    p99 = statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]
    p50, p99 = 1e3 * statistics.median(xs), 1e3 * p99
    if digits is not None:
        p50, p99 = round(p50, digits), round(p99, digits)
    return {"p50_ms": p50, "p99_ms": p99, "count": len(xs)}


def _valid(text: str, schema: dict) -> tuple[bool, bool | None]:
    """``(parses as JSON, valid against the schema)``: the second by the ``jsonschema`` package where it is
    installed (an independent check; not a dependency of the project), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        import jsonschema
    except ImportError:
        return True, None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def _run(h, ids, n, grammar, skip: bool, temperature: float = 0.0, seed: int = 0):
    passes = []
    saved = decode.Decoding._forced, decode.Decoding._forced_block
    if not skip:
        decode.Decoding._forced = lambda self, n, lv=None: []
        decode.Decoding._forced_block = lambda self, k, s, drafts: False
    try:
        d = h.start(ids, n, temperature=temperature, top_p=1.0, seed=seed, constraint=_Timed(grammar))
        try:
            res = d.run(on_pass=lambda p: passes.append(p.engine is h.target))
        finally:
            d.close()
    finally:
        decode.Decoding._forced, decode.Decoding._forced_block = saved
    return res, sum(passes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--json-plan", default=None, help="a plan with a plan for task json (by_task)")
    ap.add_argument("--skip", type=whole, default=0, help="leave out the first N tasks")
    ap.add_argument("--limit", type=count, default=60)
    ap.add_argument("--max-new-tokens", type=count, default=200)
    ap.add_argument("--temperature", type=nonnegative, default=0.0, help="> 0: sampled (seed per task), outputs not "
                    "compared; every method's output checked")
    ap.add_argument("--out", default="benchmarks/results/json_schema_bench.json")
    a = ap.parse_args()
    plan = load_plan(a.plan)
    loaded = load_model(plan.provenance.model, device="cpu")
    tok = loaded.tokenizer
    plan_h = hsd_for_plan(plan, loaded)
    ar = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[])
    grammars = compiler_for(loaded)
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines() if x.strip()][a.skip:a.skip + a.limit]
    methods = {"masked_ar_no_skip": (ar, False), "masked_ar": (ar, True), "plan_no_skip": (plan_h, False),
               "plan": (plan_h, True)}
    json_levels = None
    if a.json_plan:
        jp = load_plan(a.json_plan)
        if "json" not in jp.by_task:
            raise HsdError(f"--json-plan {a.json_plan}: no plan for task json (by_task); solve with --per-task")
        e = jp.by_task["json"]
        json_levels = {"hierarchy": e.hierarchy, "budgets": e.budgets}
        methods["json_plan"] = (hsd_for_plan(jp, loaded, hierarchy=e.hierarchy, budgets=e.budgets), True)
    totals = {m: {"tokens": 0, "decode_seconds": 0.0, "target_passes": 0, "grammar_seconds": 0.0} for m in methods}
    rows, compile_cold, compile_cached = [], [], []
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        spec = GrammarSpec.json_schema(task["schema"], task["name"])
        t = time.perf_counter()
        grammar = grammars.compile(spec)
        compile_cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammars.compile(GrammarSpec.json_schema(task["schema"], task["name"]))
        compile_cached.append(time.perf_counter() - t)
        ids = chat_ids(tok, [{"role": "user", "content": task["prompt"]}])
        outs = {}
        names = list(methods)
        for m in names[i % len(names):] + names[:i % len(names)]:     # the order rotates with the task
            h, skip = methods[m]
            _Timed.seconds = 0.0
            res, passes = _run(h, ids, a.max_new_tokens, grammar, skip, a.temperature, a.skip + i)
            outs[m] = res.token_ids
            tt = totals[m]
            tt["tokens"] += len(res.token_ids)
            tt["decode_seconds"] += res.stats["decode_seconds"]
            tt["target_passes"] += passes
            tt["grammar_seconds"] += _Timed.seconds
        ref = outs["masked_ar_no_skip"]
        c = Constraint(grammar)
        forced = sum(c.only(ref, k) is not None for k in range(len(ref)))
        eos = set(eos_token_ids(loaded))
        checks = {m: (bool(o) and o[-1] in eos, *_valid(tok.decode(o, skip_special_tokens=True), task["schema"]))
                  for m, o in outs.items()}
        ended, parses, valid = checks["masked_ar_no_skip"]
        rows.append({"task": task["name"], "category": task["category"], "tokens": len(ref), "forced": forced,
                     "ended": ended, "parses": parses, "valid": valid,
                     "equal": all(o == ref for o in outs.values()) if a.temperature == 0 else None,
                     "checks": {m: {"ended": e, "parses": p, "valid": v} for m, (e, p, v) in checks.items()}})
        print(f"{i + 1}/{len(tasks)} {task['name']}: {len(ref)} tokens, {forced} forced, ended {ended}, "
              f"parses {parses}, valid {valid}, equal {rows[-1]['equal']}", flush=True)
    report = {"host": host(), "plan": a.plan, "hierarchy": plan.hierarchy,
              "budgets": plan.budgets, "json_plan": a.json_plan, "json_hierarchy": json_levels, "skip": a.skip,
              "max_new_tokens": a.max_new_tokens, "tasks": len(rows),
              "seconds": time.perf_counter() - t0, "methods": {}, "rows": rows}
    for m, tt in totals.items():
        report["methods"][m] = {**tt, "decode_tokens_per_s": tt["tokens"] / tt["decode_seconds"],
                                "tokens_per_target_pass": tt["tokens"] / max(tt["target_passes"], 1),
                                "grammar_ms_per_token": 1e3 * tt["grammar_seconds"] / max(tt["tokens"], 1)}
    n = sum(r["tokens"] for r in rows)
    report["forced_share"] = sum(r["forced"] for r in rows) / max(n, 1)
    report["mask_fill"] = quantiles_ms(_Timed.fills)
    report["compile_cold"], report["compile_cached"] = quantiles_ms(compile_cold), quantiles_ms(compile_cached)
    report["all_equal"] = all(r["equal"] for r in rows) if a.temperature == 0 else None
    report["temperature"] = a.temperature
    report["ended_valid_by_method"] = {m: [sum(r["checks"][m]["ended"] for r in rows),
                                           sum(r["checks"][m]["ended"] and r["checks"][m]["valid"] is True
                                               for r in rows)] for m in methods}
    report["ended_and_parse"] = sum(r["ended"] and r["parses"] for r in rows)
    report["ended"] = sum(r["ended"] for r in rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, report, indent=2)
    for m, r in report["methods"].items():
        print(f"{m}: {r['decode_tokens_per_s']:.1f} tok/s decode, {r['tokens_per_target_pass']:.2f} tokens per "
              f"target pass, grammar {r['grammar_ms_per_token']:.3f} ms/token")
    print(f"mask fill {report['mask_fill']}; schema compile cold {report['compile_cold']}, cached "
          f"{report['compile_cached']}")
    print(f"forced share {report['forced_share']:.3f}; ended {report['ended']}/{len(rows)}, of which parse "
          f"{report['ended_and_parse']}; (ended, ended and valid) per method {report['ended_valid_by_method']}; "
          f"every output equal: {report['all_equal']}; wrote {a.out}")


if __name__ == "__main__":
    run(main)
