"""`hsd run` (generate with a plan's hierarchy, lossless, streaming) and `hsd bench` (every method side by side)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from hsd_opt.commands.common import cli_command, fmt
from hsd_opt.console import console


def _load(plan_path: Path, model: Optional[str], device: str, dtype: Optional[str]):
    """Load the plan and the model it names (or ``model``, which must match the plan's provenance)."""
    from hsd_opt.errors import InputFileError
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import check_provenance

    plan = load_plan(str(plan_path))
    prov = plan.extra.get("provenance") or {}
    name = model or prov.get("model")
    if not name:
        raise InputFileError(str(plan_path), "the plan names no model (provenance.model); give --model",
                             "provenance.model")
    loaded = load_model(name, device=device, dtype=dtype or prov.get("dtype") or "auto")
    check_provenance(plan, loaded, str(plan_path))
    return plan, loaded


def _prompts(prompt: Optional[str], prompts: Optional[Path]) -> list[str]:
    from hsd_opt.errors import HsdError
    from hsd_opt.prompts import load_prompts

    if (prompt is None) == (prompts is None):
        raise HsdError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompt is not None:
        if not prompt.strip():
            raise HsdError("--prompt: empty prompt")
        return [prompt]
    return load_prompts(prompts).texts


def stats_table(stats: dict, predicted: float | None, title: str = "hsd run"):
    """Rich table of one generation's (or a summed run's) stats."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("tokens", str(stats["tokens"]))
    t.add_row("seconds (prefill included)", fmt(stats["seconds"], ".3f"))
    t.add_row("tokens/s", fmt(stats["tokens_per_s"], ".2f"))
    t.add_row("target calls", str(stats["target_calls"]))
    t.add_row("tokens per target call", fmt(stats["tokens_per_target_call"], ".2f"))
    spt = stats.get("seconds_per_token")
    t.add_row("ms/token decode (measured)", fmt(spt and spt * 1e3, ".2f"))
    t.add_row("ms/token (plan's prediction)", fmt(predicted and predicted * 1e3, ".2f"))
    if spt and predicted:
        t.add_row("measured / predicted", f"{spt / predicted:.2f}")
    for i, lv in enumerate(stats["levels"]):
        if len(stats["levels"]) == 1:  # the target alone (a plan where no drafter pays): plain decode steps
            row = f"steps {lv['calls']}, generated {lv['drafted']} tokens"
        elif i == 0:  # the bottom drafter: it proposes, nothing is verified at its level
            row = f"draft calls {lv['calls']}, proposed {lv['drafted']} tokens"
            if "draft_rate" in lv:
                row += f" (in {lv['draft_rate']:.0%} of calls)"
        else:  # a verifying level: its passes over the drafts of the level below
            a = lv.get("acceptance_rate")
            row = (f"passes {lv['calls']}, checked {lv['drafted']} drafts, accepted {lv['accepted']}"
                   + (f", a={a:.3f}" if a is not None else ""))
        t.add_row(f"level {lv['name']}", row)
    return t


def _sum_stats(all_stats: list[dict]) -> dict:
    s = {k: sum(x[k] for x in all_stats) for k in ("tokens", "seconds", "decode_seconds", "target_calls")}
    s["tokens_per_s"] = s["tokens"] / s["seconds"] if s["seconds"] else None
    s["seconds_per_token"] = s["decode_seconds"] / s["tokens"] if s["tokens"] else None
    s["tokens_per_target_call"] = s["tokens"] / s["target_calls"] if s["target_calls"] else None
    from hsd_opt.runtime.decode import add_levels

    levels = None
    for st in all_stats:
        levels = add_levels(levels, st["levels"])
    s["levels"] = [lv.to_dict() for lv in levels]
    return s


@cli_command
def run_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt text."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON lines {\"prompt\": ...} (one run each)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (lossless)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write one JSON line per prompt here."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    mode: str = typer.Option("exact", "--mode", help="exact: levels hand up exactly T_i tokens per call "
                                                     "(the latency model); eager: every verified token."),
    quiet: bool = typer.Option(False, "--quiet", help="Do not stream the text."),
):
    """Generate with the plan's hierarchy (lossless HSD), streaming text, then print stats."""
    from hsd_opt.jsonio import atomic_write_bytes
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.decode import check_generation_args
    from hsd_opt.runtime.runner import hsd_for_plan

    check_generation_args(max_new_tokens, temperature, top_p)
    texts = _prompts(prompt, prompts)
    p, loaded = _load(plan, model, device, dtype)
    h = hsd_for_plan(p, loaded, mode=mode, source=str(plan))
    tok = loaded.tokenizer
    ids_list = [encode_prompt(tok, t, raw=raw) for t in texts]
    lines, all_stats = [], []
    for text, ids in zip(texts, ids_list):
        got: list[int] = []
        shown = [""]

        def stream(block, got=got, shown=shown):
            got.extend(block)
            if quiet:
                return
            s = tok.decode(got, skip_special_tokens=True)
            if s.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next block
                return
            if s.startswith(shown[0]):
                sys.stdout.write(s[len(shown[0]):])
                sys.stdout.flush()
                shown[0] = s

        res = h.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                         on_tokens=stream)
        if not quiet:
            sys.stdout.write("\n")
        all_stats.append(res.stats)
        lines.append({"prompt": text, "token_ids": res.token_ids,
                      "text": tok.decode(res.token_ids, skip_special_tokens=True), "stats": res.stats})
    total = _sum_stats(all_stats)
    console.print(stats_table(total, p.expected_latency,
                              f"hsd run: {' <- '.join(reversed(p.hierarchy))} (T={p.budgets}, {mode})"))
    if json_out is not None:
        atomic_write_bytes(json_out, "".join(json.dumps(x) + "\n" for x in lines).encode())
        console.print(f"wrote {json_out}")


@cli_command
def bench_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON lines prompt file; default: the "
                                                                   "suite shipped with hsd-opt."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per prompt."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot here."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    mode: str = typer.Option("exact", "--mode", help="exact | eager (see hsd run)."),
    methods: str = typer.Option(",".join(("hf_ar", "hf_prompt_lookup", "hf_early_exit", "ar", "single_draft",
                                          "hsd")), "--methods", help="Comma-separated subset of methods."),
):
    """Greedy benchmark on the same prompts: HF generate (AR, prompt lookup, early-exit self-speculation),
    our AR loop, the plan's best single draft, and the HSD plan."""
    from rich.table import Table

    from hsd_opt.errors import HsdError
    from hsd_opt.jsonio import write_json
    from hsd_opt.prompts import load_prompts
    from hsd_opt.runtime.bench import METHODS, plot_report, run_bench

    if max_new_tokens < 1:
        raise HsdError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    if limit is not None and limit < 1:
        raise HsdError(f"--limit: expected >= 1, got {limit}")
    ms = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in ms if m not in METHODS]
    if bad or not ms:
        raise HsdError(f"--methods: unknown {', '.join(bad) or '(none)'}; known: {', '.join(METHODS)}")
    texts = load_prompts(prompts).texts[:limit]
    p, loaded = _load(plan, model, device, dtype)
    rep = run_bench(p, loaded, texts, max_new_tokens, raw=raw, mode=mode, methods=ms,
                    log=lambda s: console.print(s, style="dim"), source=str(plan))
    rep["model"] = loaded.provenance()
    t = Table(title=f"hsd bench: {len(texts)} prompts x {max_new_tokens} tokens, greedy ({loaded.model_id}, "
                    f"{loaded.device}, {rep['torch_threads']} threads)")
    for c in ("method", "tok/s", "x hf_ar", "x ar", "tok/call", "pred ms", "meas ms", "=ref"):
        t.add_column(c, justify="right" if c != "method" else "left")
    for m, d in rep["methods"].items():
        if "error" in d:
            t.add_row(m, "error", "", "", "", "", "", "-")
            continue
        pr, me = d.get("predicted_seconds_per_token"), d.get("seconds_per_token")
        t.add_row(m, fmt(d["tokens_per_s"], ".2f"), fmt(d.get("speedup_vs_hf_ar"), ".2f"),
                  fmt(d.get("speedup_vs_ar"), ".2f"), fmt(d.get("tokens_per_target_call"), ".2f"),
                  fmt(pr and pr * 1e3, ".1f"), fmt(me and me * 1e3, ".1f"),
                  {True: "yes", False: "NO", None: "-"}[d.get("matches_reference")])
    console.print(t)
    if json_out is not None:
        write_json(json_out, rep)
        console.print(f"wrote {json_out}")
    if plot is not None:
        plot_report(rep, plot)
        console.print(f"wrote {plot}")
