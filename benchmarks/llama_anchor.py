"""A plan against llama.cpp on the same GGUF file, in one run: `llama-bench` decode speed interleaved with
`hsd bench` rounds over the same prompts, so that both see the same spell of a shared machine.

    .venv/bin/python -m benchmarks.llama_anchor --plan out/family/plan-int4.json \
        --llama-bench <llama.cpp>/build/bin/llama-bench --gguf ~/.cache/hsd-opt/gguf/<file>.gguf \
        [--prompts FILE] [--limit 6] [--max-new-tokens 64] [--methods ar,single_draft,hsd] [--rounds 2] \
        [--depth 64] [--retime PROFILE] [--out benchmarks/results/llama_anchor.json] \
        [--speculative <llama.cpp>/build/bin/llama-speculative-simple [--gguf-draft DRAFT.gguf] \
         [--spec-configs draft-simple:2,draft-simple:4,ngram-cache]]

Each round runs `llama-bench -t THREADS -p 0 -n N -d DEPTH -r 3` (decode only: N tokens after DEPTH tokens of
context) before the first prompt and again after every `--llama-every` prompts of `run_bench` (every method,
interleaved per prompt, as `hsd bench` does) and after the last, so that llama.cpp is sampled across the round's
whole spell rather than at its two ends. Reported per method: decode tokens/s, tokens/s with prefill, and the ratio
of decode tokens/s to the mean of the round's llama.cpp runs (their spread beside it). Decode tokens/s counts the
tokens that took a decode pass over the decode seconds (prefill excluded, as llama-bench's `tg` test excludes it):
a generation's first token is read from its prompt's pass, so each generation's first token is not counted
(llama-bench pays a pass for every token it counts). llama.cpp runs the file in its stored quantization; a plan
made for `--target-precision int4` runs the same weights as our int4 groups (docs/design.md#target-precision).
`--retime PROFILE` (the profile the plan was solved from) prices every generation again at the engines' speed of
the moment, as `hsd bench --retime` does. The report is written after every round, so an interrupted run keeps
the rounds it finished.

`--speculative BIN` adds llama.cpp's own speculative decoding to every round, each prompt right after our methods
ran it: `llama-speculative-simple` greedy (`--temp 0 --top-k 1`) on each prompt, its text the
chat-templated prompt our methods start from, once per `--spec-configs` entry `TYPE[:N_MAX]` (`--spec-type TYPE`,
`--spec-draft-n-max N_MAX`; `draft-*` types draft with `--gguf-draft`). Reported per configuration: decode
tokens/s (its tokens over its decode seconds, as it prints them: prefill and model loading excluded; its clock
includes the pass over the prompt's last token, which gives its first token), the draft
acceptance, and the ratio of our plan's decode tokens/s to it. Its outputs are llama.cpp's greedy text on the
file's own arithmetic, not compared with ours. A run that decodes past ``-n`` by more than a last verify pass gives
(``ngram-mod`` drafts up to 64 tokens past it where its text repeats) is left out of its configuration's rate and named
(:func:`spec_summary`), and the plan is rated against it over the same prompts: ours stop at ``-n``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.entry import count, run, whole
from hsd_opt.engine.variants import host


def llama_decode(binary: str, gguf: str, threads: int, n: int, depth: int, reps: int) -> dict:
    """`llama-bench` decode test (`-p 0 -n n -d depth`): tokens/s (mean and sd over `reps` runs)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n), "-r", str(reps), "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"llama-bench failed ({' '.join(cmd)}): {res.stderr.strip()[-500:]}")
    row = [r for r in json.loads(res.stdout) if r.get("n_gen")][0]
    return {"tok_s": row["avg_ts"], "sd": row.get("stddev_ts"), "type": row.get("model_type"), "n": n,
            "depth": depth, "threads": threads, "reps": reps}


SPEC_LINES = {"decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", "n_draft": r"n_draft\s*=\s*(\d+)",
              "encoded": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
              "drafted": r"n_drafted\s*=\s*(\d+)", "accepted": r"n_accept\s*=\s*(\d+)"}


def parse_spec_config(text: str) -> tuple[str, int | None]:
    """``"draft-simple:4"`` -> ``("draft-simple", 4)``; ``"ngram-cache"`` -> ``("ngram-cache", None)``."""
    kind, _, n_max = text.strip().partition(":")
    if not kind or (n_max and not n_max.isdigit()):
        raise ValueError(f"--spec-configs: {text!r} is not TYPE or TYPE:N_MAX (e.g. draft-simple:4)")
    return kind, int(n_max) if n_max else None


def parse_spec_output(text: str) -> dict:
    """The counts `llama-speculative-simple` prints at its end: tokens and seconds decoded (and encoded: the
    prompt), tokens drafted and accepted, and its draft length ``n_draft`` (``--spec-draft-n-max``, 3 unless set).
    A missing line raises ValueError naming it."""
    out = {}
    for key, pattern in SPEC_LINES.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"no '{key}' line in llama-speculative-simple's output")
        out[key] = [float(g) for g in m.groups()] if len(m.groups()) > 1 else int(m.group(1))
    return {"tokens": int(out["decoded"][0]), "decode_seconds": out["decoded"][1],
            "prompt_tokens": int(out["encoded"][0]), "drafted": out["drafted"], "accepted": out["accepted"],
            "n_draft": out["n_draft"]}


def llama_speculative(binary: str, gguf: str, draft: str | None, config: str, prompt: str, n: int,
                      threads: int) -> dict:
    """One greedy generation of `llama-speculative-simple` (``n`` new tokens after ``prompt``, a text with the
    chat template's special tokens) under ``config`` (``TYPE[:N_MAX]``); returns :func:`parse_spec_output`."""
    kind, n_max = parse_spec_config(config)
    cmd = [binary, "-m", gguf, "-t", str(threads), "--temp", "0", "--top-k", "1", "-n", str(n), "-c", "4096",
           "--spec-type", kind, "-p", prompt]
    if n_max is not None:
        cmd += ["--spec-draft-n-max", str(n_max)]
    if kind.startswith("draft"):
        cmd += ["-md", draft]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"llama-speculative-simple failed ({config}): {res.stderr.strip()[-500:]}")
    return parse_spec_output(res.stdout + res.stderr)


def spec_summary(runs: list[dict], n: int) -> dict:
    """One configuration's runs of a round (one per prompt, :func:`parse_spec_output`) summed: decode tokens/s
    over the runs that decoded at most ``n + 1 + n_draft`` tokens (``-n``, the one its last pass gives, and the
    drafts of a last verify pass, which the draft model's drafter does not cut at ``-n``: up to 73 tokens for 64
    at a draft length of 8, every pass an ordinary one). A run past that (``ngram-mod`` drafts up to 64 tokens past
    ``-n`` where the text repeats, 161 tokens for 96 asked) decoded other tokens than ours, which stop at ``n``: it
    is left out, its prompt's index in ``past_n``, and our plan is rated over the same prompts (:func:`plan_rate`).
    With every run past that the rate is None."""
    past = [i for i, r in enumerate(runs) if r["tokens"] > n + 1 + r["n_draft"]]
    kept = [r for i, r in enumerate(runs) if i not in past]
    tokens, seconds = sum(r["tokens"] for r in kept), sum(r["decode_seconds"] for r in kept)
    drafted = sum(r["drafted"] for r in kept)
    return {"decode_tok_s": tokens / seconds if seconds > 0 else None, "tokens": tokens, "decode_seconds": seconds,
            "acceptance": sum(r["accepted"] for r in kept) / drafted if drafted else None, "drafted": drafted,
            "past_n": past, "runs": runs}


def decode_rate(totals: list[dict]) -> float | None:
    """Decode tokens/s of a method's report totals (``hsd bench``'s, of the whole run or of groups): the tokens that
    took a decode pass (each generation's first came with its prompt's pass) over their decode seconds; None
    without either."""
    counted = sum(d["tokens"] - d["generations"] for d in totals)
    seconds = sum(d.get("decode_seconds") or 0.0 for d in totals)
    return counted / seconds if counted > 0 and seconds > 0 else None


def plan_rate(rep: dict, groups: list[str]) -> float | None:
    """The plan's (method ``hsd``) :func:`decode_rate` over the report's ``groups`` (one a prompt); None without."""
    per = [rep["by_task"].get(g, {}).get("hsd") for g in groups]
    if not per or any(d is None or "error" in d for d in per):
        return None
    return decode_rate(per)


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    """A Markdown table on stdout: a first column numbering the rounds, then ``columns``."""
    print("\n| round | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for i, cells in enumerate(rows):
        print(f"| {i + 1} | " + " | ".join(cells) + " |")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--llama-bench", required=True, help="a llama-bench binary (llama.cpp)")
    ap.add_argument("--gguf", required=True, help="the GGUF file the plan's model was loaded from")
    ap.add_argument("--prompts", default=None, help="prompt file (default: the shipped suite)")
    ap.add_argument("--task", default="code", help="keep the suite's prompts of this task ('' for all)")
    ap.add_argument("--limit", type=count, default=6)
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--methods", default="ar,single_draft,hsd")
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--depth", type=whole, default=64, help="llama-bench context before its decode test (tokens)")
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--llama-every", type=count, default=3,
                    help="run llama-bench again after every N prompts (and after the last)")
    ap.add_argument("--retime", default=None, help="the profile the plan was solved from (hsd bench --retime)")
    ap.add_argument("--speculative", default=None, help="a llama-speculative-simple binary (llama.cpp)")
    ap.add_argument("--gguf-draft", default=None, help="the draft model's GGUF file (draft-* configurations)")
    ap.add_argument("--spec-configs", default="draft-simple:2,draft-simple:4,ngram-cache",
                    help="llama.cpp speculative configurations TYPE[:N_MAX], comma-separated")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "llama_anchor.json"))
    a = ap.parse_args()

    import torch

    from hsd_opt.commands.common import load_plan_and_model
    from hsd_opt.jsonio import write_json
    from hsd_opt.measure.bench import run_bench
    from hsd_opt.prompts import encode_prompt, load_prompts, select_items

    torch.set_num_threads(a.threads)
    if not os.path.isfile(a.gguf):
        ap.error(f"--gguf: no file at {a.gguf}")
    if not os.access(a.llama_bench, os.X_OK):
        ap.error(f"--llama-bench: {a.llama_bench} is not an executable")
    configs = []
    if a.speculative:
        if not os.access(a.speculative, os.X_OK):
            ap.error(f"--speculative: {a.speculative} is not an executable")
        try:
            configs = [c.strip() for c in a.spec_configs.split(",") if c.strip()]
            kinds = [parse_spec_config(c)[0] for c in configs]
        except ValueError as e:
            ap.error(str(e))
        if any(k.startswith("draft") for k in kinds) and not (a.gguf_draft and os.path.isfile(a.gguf_draft)):
            ap.error(f"--gguf-draft: a draft-* configuration needs the draft model's GGUF file (got {a.gguf_draft})")
    retime = None
    if a.retime:
        from hsd_opt.formats import load_profile

        retime, _ = load_profile(a.retime)
    plan, loaded = load_plan_and_model(Path(a.plan), None, "cpu", None)
    items = load_prompts(a.prompts).items
    if a.task:
        items = [it for it in items if it.task == a.task]
    if not items:
        ap.error(f"--task: no prompt of task {a.task!r} in {a.prompts or 'the shipped suite'}")
    # each prompt its own group of the report (its category), so that the plan's rate can be read over the prompts
    # a llama.cpp configuration is rated on (spec_summary)
    items = [replace(it, category=f"{it.category or it.task} #{i + 1}")
             for i, it in enumerate(select_items(items, limit=a.limit))]
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not methods:
        ap.error("--methods: expected a comma-separated list of methods, got none")
    # llama.cpp's speculative runs start from the text of the chat-templated prompts our methods start from
    spec_texts = [loaded.tokenizer.decode(encode_prompt(loaded.tokenizer, it.prompt)) for it in items if configs]
    n_gen = a.max_new_tokens
    rounds = []
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    for r in range(a.rounds):
        log(f"round {r + 1}/{a.rounds}: llama-bench ...")
        runs_llama = [llama_decode(a.llama_bench, a.gguf, a.threads, n_gen, a.depth, 3)]
        log(f"  llama.cpp decode {runs_llama[0]['tok_s']:.2f} tok/s; hsd bench over {len(items)} prompts ...")
        spec_runs: dict[str, list[dict]] = {c: [] for c in configs}

        def between(i: int) -> None:      # after prompt i: llama.cpp's speculative runs of it, llama-bench now and then
            for config in configs:
                spec_runs[config].append(llama_speculative(a.speculative, a.gguf, a.gguf_draft, config,
                                                           spec_texts[i], n_gen, a.threads))
            if (i + 1) % a.llama_every == 0 or i + 1 == len(items):
                runs_llama.append(llama_decode(a.llama_bench, a.gguf, a.threads, n_gen, a.depth, 3))
                log(f"  llama.cpp decode {runs_llama[-1]['tok_s']:.2f} tok/s after prompt {i + 1}")

        rep = run_bench(plan, loaded, items, max_new_tokens=n_gen, methods=methods, log=log, retime=retime,
                        retime_source=a.retime or "profile", between=between, by="category")
        spec = {}
        for config, runs in spec_runs.items():
            spec[config] = spec_summary(runs, n_gen)
            past, rate = spec[config]["past_n"], spec[config]["decode_tok_s"]
            log(f"  llama.cpp speculative {config}: decode "
                + ("-" if rate is None else f"{rate:.2f} tok/s")
                + (f" (prompts {', '.join(str(i + 1) for i in past)} left out: decoded past -n {n_gen} by more "
                   f"than a last pass)" if past else ""))
        rates = [x["tok_s"] for x in runs_llama]
        llama = statistics.fmean(rates)
        ours = {}
        for m, d in rep["methods"].items():
            if "error" in d:
                ours[m] = {"error": d["error"]}
                continue
            dec = decode_rate([d])
            ours[m] = {"decode_tok_s": dec, "decode_tokens": d["tokens"] - d["generations"],
                       "tok_s": d.get("tokens_per_s"),
                       "decode_vs_llama_cpp": dec / llama if dec else None,
                       "tokens_per_target_call": d.get("tokens_per_target_call"),
                       "predicted_ms_per_token": _ms(d.get("predicted_seconds_per_token")),
                       "retimed_ms_per_token": _ms(d.get("retimed_predicted_seconds_per_token")),
                       "measured_ms_per_token": _ms(d.get("seconds_per_token")),
                       "matches_reference": d.get("matches_reference")}
        for d in spec.values():
            d["vs_llama_cpp_decode"] = d["decode_tok_s"] / llama if d["decode_tok_s"] else None
            plan_tok_s = plan_rate(rep, [it.category for i, it in enumerate(items) if i not in d["past_n"]])
            d["plan_vs_this"] = plan_tok_s / d["decode_tok_s"] if plan_tok_s and d["decode_tok_s"] else None
            if d["past_n"]:
                d["plan_decode_tok_s_same_prompts"] = plan_tok_s
        for m, d in ours.items():
            if "error" not in d and d["decode_tok_s"]:
                log(f"  {m}: decode {d['decode_tok_s']:.2f} tok/s = {d['decode_vs_llama_cpp']:.2f}x llama.cpp")
        rounds.append({"llama_cpp_runs": runs_llama, "llama_cpp_decode_tok_s": llama,
                       "llama_cpp_spread": [min(rates), max(rates)],
                       "ours": ours, "llama_cpp_speculative": spec, "bench": rep})
        report = {
            "what": "a plan against llama.cpp on the same GGUF (benchmarks/llama_anchor.py)",
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "machine": {"platform": platform.platform(), "host": host(), "threads": a.threads},
            "plan": a.plan, "gguf": os.path.basename(a.gguf),
            "gguf_draft": os.path.basename(a.gguf_draft) if a.gguf_draft and configs else None,
            "spec_configs": configs, "prompts": len(items), "max_new_tokens": n_gen,
            "target_precision": rounds[0]["bench"].get("target_precision"), "rounds": rounds,
        }
        write_json(a.out, report, indent=1)

    def ours_cell(rd, m):
        d = rd["ours"].get(m, {})
        return "error" if "error" in d or not d else f"{d['decode_tok_s']:.2f} ({d['decode_vs_llama_cpp']:.2f}x)"

    def spec_cell(rd, c):
        d = rd["llama_cpp_speculative"][c]
        acc = "-" if d["acceptance"] is None else f"{d['acceptance']:.2f}"
        mine = "-" if d["plan_vs_this"] is None else f"{d['plan_vs_this']:.2f}x"
        if d["decode_tok_s"] is None:
            return "every prompt past -n"
        past = f"; {len(d['past_n'])} prompts past -n left out" if d.get("past_n") else ""
        return f"{d['decode_tok_s']:.2f} ({acc}; {mine}{past})"

    cols = ["llama.cpp decode tok/s (its runs' range)"] + [f"{m} decode tok/s (x llama.cpp)" for m in methods]
    print_table(cols,
                [[f"{rd['llama_cpp_decode_tok_s']:.2f} ({rd['llama_cpp_spread'][0]:.1f}-"
                  f"{rd['llama_cpp_spread'][1]:.1f})"] + [ours_cell(rd, m) for m in methods] for rd in rounds])
    if configs:
        print_table([f"llama.cpp {c} decode tok/s (acceptance; our plan x this)" for c in configs],
                    [[spec_cell(rd, c) for c in configs] for rd in rounds])
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    run(main)
