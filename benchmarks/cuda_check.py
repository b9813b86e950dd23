"""The CUDA path end to end on tiny models: profile -> solve -> run -> bench -> batched decoding on `--device cuda`,
every greedy answer checked against the target's own greedy loop on the same device.

    python -m benchmarks.cuda_check [--out DIR] [--device cuda]

Steps (a tiny random Llama with a word tokenizer, made here; nothing downloaded):

0. fixed shapes (``hsd_opt.engine.fixed``) on the device: a verify pass's logits equal its steps', and a batch's
   step each sequence's alone, bit for bit, op by op, replayed from CUDA graphs and compiled (and with the attention
   in Triton kernels where ``HSD_TRITON_ATTENTION=1``: every later step then runs with it), and replayed steps
   the op-by-op ones (``benchmarks.gpu_scale``'s ``exactness`` on a tiny bfloat16 model);
1. ``hsd profile --device cuda`` with early exits, the int8/int4 copies (on CUDA: their de-quantized weights in
   bfloat16), an n-gram drafter and batch sizes 1,2,4; ``hsd solve`` (a plan per load level too);
2. ``hsd run`` of the plan on three prompts, each answer equal to the target alone (``HSD.generate``), and a
   hierarchy with each copy under the target, equal too;
3. ``hsd bench --methods ar,single_draft,hsd`` on the suite's first prompts (every output equal to ``ar``), and
   ``hsd bench --concurrency 1,2,4 --retime`` (every answer of every method equal to the target's, every level
   predicted whole on the device's timings);
4. the batch scheduler on six prompts of different lengths with the plan per load level (four in flight):
   every answer equal to its prompt's own; again with a prompt head the engines keep (as a chat template's is),
   each answer equal to an engine that computes every head itself;
5. ``hsd serve --device cuda --max-batch 4`` with six concurrent greedy requests (each answer equal to the
   target's own), a seeded sampled request alone and again among five others (the same tokens), and
   ``/health``.

Prints one JSON line of what ran and exits 1 on the first inequality. Needs torch with CUDA, transformers,
typer, rich, networkx, scipy, and for step 5 starlette and uvicorn (not gguf, cvxpy or llguidance: checked on a
CPU with those three not importable, 2026-12-02).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.entry import run

REPO = Path(__file__).resolve().parents[1]


def hsd(*args, cwd=None) -> str:
    res = subprocess.run([sys.executable, "-m", "hsd_opt", *map(str, args)], capture_output=True, text=True,
                         cwd=cwd, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"hsd {' '.join(map(str, args))} failed ({res.returncode}):\n{res.stdout[-3000:]}"
                         f"\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    import torch

    from tests.helpers import save_tiny, write_prompts

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here")
    out = Path(a.out or tempfile.mkdtemp(prefix="hsd-cuda-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = save_tiny(out / "m", layers=4)
    prompts = write_prompts(out / "p.jsonl", n=6)
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
              "torch": torch.__version__}

    # 0. fixed shapes on the device: a verify pass gives its steps' logits, a batch's step each sequence's own, bit
    # for bit (op by op and replayed from CUDA graphs); at each pass's own shapes reported, not required
    from benchmarks.gpu_scale import exactness
    from hsd_opt.engine.layered import torch_path_settings
    from hsd_opt.models.random_weights import TINY, random_model

    ex = report["exactness"] = exactness(random_model(TINY, a.device, torch.bfloat16, peak=1.0), 32)
    # the Triton attention reported, and required where this run's engines take it (HSD_TRITON_ATTENTION=1)
    triton = ("triton", "triton_replayed") if torch_path_settings()["triton_attention"] else ()
    for name in ("fixed", "replayed", "compiled") + triton:
        if not (isinstance(ex[name], dict) and ex[name]["pass_equal_steps"] and ex[name]["batch_equal_alone"]):
            raise SystemExit(f"fixed shapes on {a.device} ({name}): {ex[name]}")
    if not ex.get("replayed_equal_fixed"):
        raise SystemExit(f"fixed shapes on {a.device}: replayed steps differ from op-by-op ones: {ex}")

    # 1. profile and solve on the device
    prof, plan = out / "profile.json", out / "plan.json"
    hsd("profile", "--model", model, "--prompts", prompts, "--out", prof, "--device", a.device, "--layers", "1,2,4",
        "--quantized", "int8,int4", "--token-drafters", "ngram", "--max-new-tokens", "8", "--tmax", "3",
        "--cost-repeats", "1", "--cost-contexts", "32", "--batch-sizes", "1,2,4", "--quiet")
    hsd("solve", "--profile", prof, "--tmax", "3", "--out", plan)
    p = json.loads(plan.read_text())
    d = json.loads(prof.read_text())
    report.update(profile_device=d["provenance"]["device"], dtype=d["provenance"]["dtype"],
                  hierarchy=p["hierarchy"], budgets=p["budgets"],
                  by_load={n: e["hierarchy"] for n, e in p.get("by_load", {}).items()})

    # 2. hsd run against the target's own greedy loop
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, load_prompts
    from hsd_opt.runtime.batch import generate_many
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan

    pl = load_plan(plan)
    loaded = load_model(str(model), device=a.device, dtype=pl.provenance.dtype or "auto")
    models = PlanModels(loaded)
    ar = hsd_for_plan(pl, loaded, hierarchy=[pl.hierarchy[-1]], budgets=[], models=models)
    texts = load_prompts(prompts).texts
    runs = []
    for i, text in enumerate(texts[:3]):
        res_file = out / f"run{i}.jsonl"
        hsd("run", "--plan", plan, "--prompt", text, "--raw", "--device", a.device, "--max-new-tokens", "24",
            "--quiet", "--json", res_file)
        got = json.loads(res_file.read_text().splitlines()[0])["token_ids"]
        want = ar.generate(encode_prompt(loaded.tokenizer, text, raw=True), 24).token_ids
        runs.append(got == want)
        if got != want:
            raise SystemExit(f"hsd run differs from the target's own loop on prompt {i}: {got} vs {want}")
    for copy in ("int8", "int4"):
        h = hsd_for_plan(pl, loaded, hierarchy=[copy, pl.hierarchy[-1]], budgets=[3], models=models)
        for text in texts[:3]:
            ids = encode_prompt(loaded.tokenizer, text, raw=True)
            if h.generate(ids, 24).token_ids != ar.generate(ids, 24).token_ids:
                raise SystemExit(f"{copy} -> target differs from the target's own loop")
    report["run_equal_to_ar"] = runs

    # 3. hsd bench
    bench = out / "bench.json"
    hsd("bench", "--plan", plan, "--prompts", prompts, "--device", a.device, "--limit", "3", "--max-new-tokens", "16",
        "--methods", "ar,single_draft,hsd", "--json", bench)
    b = json.loads(bench.read_text())["methods"]
    report["bench_matches_ar"] = {m: v["matches_reference"] for m, v in b.items()}
    report["bench_tokens_per_s"] = {m: round(v["tokens_per_s"], 1) for m, v in b.items()}
    if not all(report["bench_matches_ar"].values()):
        raise SystemExit(f"hsd bench: an output differs from ar: {report['bench_matches_ar']}")

    # 3b. hsd bench --concurrency with the load levels chosen again at the device's speed (--retime): every
    # answer of every method at every level equal to the target's greedy answer
    load = out / "load.json"
    hsd("bench", "--plan", plan, "--prompts", prompts, "--device", a.device, "--concurrency", "1,2,4", "--requests",
        "1", "--max-new-tokens", "12", "--retime", prof, "--json", load)
    lv = json.loads(load.read_text())["levels"]
    report["load_bench_equal"] = {str(e["clients"]): {m: v["equal_to_target"] for m, v in e["methods"].items()}
                                  for e in lv}
    report["load_bench_ran"] = {str(e["clients"]): e["methods"]["hsd"].get("hierarchy") for e in lv}
    report["load_bench_measured_over_predicted"] = {
        str(e["clients"]): {m: v.get("measured_over_predicted") for m, v in e["methods"].items()} for e in lv}
    if not all(ok for e in report["load_bench_equal"].values() for ok in e.values()):
        raise SystemExit(f"hsd bench --concurrency: an answer differs: {report['load_bench_equal']}")
    if not all(r and r > 0 for e in report["load_bench_measured_over_predicted"].values() for r in e.values()):
        raise SystemExit("hsd bench --concurrency --retime: a level without its whole-level prediction: "
                         f"{report['load_bench_measured_over_predicted']}")

    # 4. the batch scheduler with the plan of every load level
    levels = hsd_by_load(pl, loaded, models) or hsd_for_plan(pl, loaded, models=models)
    ids = [encode_prompt(loaded.tokenizer, t, raw=True) for t in texts]
    news = [5, 30, 17, 24, 9, 28]
    want = [ar.generate(x, n).token_ids for x, n in zip(ids, news)]
    got = [r.token_ids for r in generate_many(levels, ids, max(news), max_active=4)]
    got = [g[:n] for g, n in zip(got, news)]
    report["batched_equal_to_ar"] = got == want
    if got != want:
        raise SystemExit("batched answers differ from the target's own loop")

    # 4b. a prompt head the engines keep, as a chat template's is: prompts that start with it, four in flight; the
    # first computes the head and keeps its keys and values, the others take them. Each answer equal to an engine
    # that computes every head itself (the same passes: the head's, then the rest).
    head = tuple(ids[0][:6])
    headed = [list(head) + x for x in ids]

    def with_head(h):
        for lv in ([h] if not isinstance(h, dict) else h.values()):
            for level in lv.levels:
                if level.engine is not None:
                    level.engine.prompt_head = head
        return h

    kept_models = PlanModels(loaded)
    kept = with_head(hsd_by_load(pl, loaded, kept_models) or hsd_for_plan(pl, loaded, models=kept_models))
    target = kept_models.target(pl)
    taken, take = [], target.take_head
    target.take_head = lambda st, upto: taken.append(take(st, upto)) or taken[-1]
    got = [r.token_ids[:n] for r, n in zip(generate_many(kept, headed, max(news), max_active=4), news)]
    report["kept_head_taken"] = sum(taken)
    if not any(taken):
        raise SystemExit("no prompt took the kept head")
    want_h = [with_head(hsd_for_plan(pl, loaded, hierarchy=[pl.hierarchy[-1]], budgets=[], models=PlanModels(loaded)))
              .generate(x, n).token_ids for x, n in zip(headed, news)]
    report["kept_head_equal_to_ar"] = got == want_h
    if got != want_h:
        raise SystemExit("batched answers with a kept prompt head differ from an engine computing every head")

    # 5. the server on the device, six requests at once
    report["server"] = check_server(plan, a.device, texts, news, want)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def check_server(plan: Path, device: str, texts: list[str], news: list[int], want: list[list[int]]) -> dict:
    """``hsd serve --max-batch 4`` on ``device``: greedy answers under concurrency equal ``want`` (the target's own
    raw-prompt loop), a seeded sampled answer the same alone and among others; returns what ``/health`` says."""
    from benchmarks.server_load import start, stop_server

    proc, url, _ = start([sys.executable, "-m", "hsd_opt", "serve", "--plan", str(plan), "--port", "0", "--device",
                          device, "--max-batch", "4"], r"^ready: .* at (http://\S+/v1)", 300)
    try:
        def complete(i: int, sampled: bool = False) -> list[int]:
            body = {"model": "m", "prompt": texts[i], "max_tokens": news[i]}
            body.update({"temperature": 0.8, "seed": 7} if sampled else {"temperature": 0})
            return post(url + "/completions", body)["hsd"]["token_ids"]

        alone = complete(1, sampled=True)
        with ThreadPoolExecutor(6) as pool:
            greedy = list(pool.map(complete, range(len(texts))))
            crowd = [pool.submit(complete, 1, True)] + [pool.submit(complete, i) for i in range(2, 6)]
            shared = crowd[0].result()
            [f.result() for f in crowd[1:]]
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
            health = json.loads(r.read())
    finally:
        stop_server(proc)
    if greedy != want:
        raise SystemExit("hsd serve's greedy answers differ from the target's own loop")
    if shared != alone:
        raise SystemExit("a seeded sampled answer changed when other requests shared its passes")
    return {"greedy_equal_to_ar": True, "seeded_sample_same_under_load": True, "health": health}


if __name__ == "__main__":
    run(main)
