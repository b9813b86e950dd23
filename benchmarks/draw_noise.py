"""A/B of sampled draws in one process, switched per generation (interleaved, the order alternating per prompt), so
the ratio is taken under the same machine conditions:

- ``--compare source`` (the default): the noise behind draws by the largest of the logits plus noise (Gumbel-max),
  the kernels' (``hsd_gumbel``: splitmix64 and vectorized logarithms) against torch's (``torch.rand`` and two
  ``torch.log``);
- ``--compare picks``: a target without an int8 screen (``--target-precision int4``) drawing by the kernels' noise
  over its logits (a rule tried, not the runtime's) against drawing from its distributions (softmax, an
  inverse-CDF draw; Algorithm 2: the runtime's).

    .venv/bin/python -m benchmarks.draw_noise --plan out/plan-walk-t1.json [--compare source|picks] [--limit 12]
        [--max-new-tokens 64] [--rounds 2] [--out benchmarks/results/draw_noise.json]

Runs the target alone and the plan's hierarchy, sampled (``--temperature``, seeds 0, 1, ...: each setting draws
other tokens, so the figures are decode seconds per token over all prompts), and times one draw's noise alone
(median of 200 calls over the target's vocabulary). Only a level that draws by noise uses it: the target at top-p
1, alone or over a token drafter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.entry import count, positive, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--compare", choices=["source", "picks"], default="source")
    ap.add_argument("--prompts", default=None, help="default: the project's suite")
    ap.add_argument("--limit", type=count, default=12)
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--temperature", type=positive, default=1.0)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--out", default="benchmarks/results/draw_noise.json")
    a = ap.parse_args()

    import torch

    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.variants import host
    from hsd_opt.formats import load_plan
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import conversation_ids, load_prompts
    from hsd_opt.runtime import decode, sampling
    from hsd_opt.runtime.runner import hsd_for_plan

    torch.set_num_threads(a.threads)
    noise = {"torch": sampling.torch_gumbel_offsets, "kernels": sampling.gumbel_offsets}
    rule = LayeredLM.picks_cheaply                                      # the runtime's: through an int8 screen only
    on_kernels = property(lambda self: self._kernels is not None)       # tried: any engine on the kernels
    if a.compare == "source":
        sources = {"torch": lambda: setattr(decode, "gumbel_offsets", noise["torch"]),
                   "kernels": lambda: setattr(decode, "gumbel_offsets", noise["kernels"])}
    else:
        sources = {"distributions": lambda: setattr(LayeredLM, "picks_cheaply", rule),
                   "noise": lambda: setattr(LayeredLM, "picks_cheaply", on_kernels)}
    plan = load_plan(a.plan)
    prov = plan.provenance
    print(f"loading {prov.model} ...", file=sys.stderr)
    loaded = load_model(prov.model, device="cpu", dtype=prov.dtype or "float32")
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    draw_ms = {}
    for k, fn in noise.items():
        fn(vocab, g, a.temperature)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn(vocab, g, a.temperature)
            times.append(time.perf_counter() - t0)
        draw_ms[k] = 1e3 * statistics.median(times)
    items = list(load_prompts(a.prompts).items)[: a.limit]
    ids = [conversation_ids(loaded.tokenizer, it.turns, [], False) for it in items]
    runners = {"target": hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[], source=a.plan),
               "plan": hsd_for_plan(plan, loaded, source=a.plan)}
    rows = {(r, k): {"tokens": 0, "decode_seconds": 0.0} for r in runners for k in sources}
    old, new = list(sources)
    for name, h in runners.items():
        h.generate(ids[0], 8, temperature=a.temperature)                   # warm-up
        for rnd in range(a.rounds):
            for i, p in enumerate(ids):
                order = list(sources) if (i + rnd) % 2 == 0 else list(sources)[::-1]
                for k in order:
                    sources[k]()
                    res = h.generate(p, a.max_new_tokens, temperature=a.temperature, seed=rnd * len(ids) + i)
                    rows[name, k]["tokens"] += len(res.token_ids)
                    rows[name, k]["decode_seconds"] += res.stats["decode_seconds"]
            print(f"{name}: round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    decode.gumbel_offsets = sampling.gumbel_offsets
    LayeredLM.picks_cheaply = rule
    report = {"what": ("the noise of sampled draws, kernels' against torch's" if a.compare == "source" else
                       "draws by noise over every logit against draws from the distributions")
              + ", A/B in one process (benchmarks/draw_noise.py)",
              "date": time.strftime("%Y-%m-%d %H:%M"), "host": host(), "command": " ".join(sys.argv),
              "plan": a.plan, "hierarchy": list(plan.hierarchy), "budgets": list(plan.budgets),
              "temperature": a.temperature, "threads": a.threads, "draw_ms": draw_ms}
    for name in runners:
        for k in sources:
            r = rows[name, k]
            report[f"{name}_{k}"] = {"tokens": r["tokens"], "ms_per_token": 1e3 * r["decode_seconds"] / r["tokens"]}
        report[f"{name}_{new}_over_{old}"] = (report[f"{name}_{new}"]["ms_per_token"]
                                              / report[f"{name}_{old}"]["ms_per_token"])
    write_json(a.out, report, indent=1)
    print(f"one draw's noise: torch {draw_ms['torch']:.3f} ms, kernels {draw_ms['kernels']:.3f} ms")
    for name in runners:
        print(f"{name}: decode ms/token {old} {report[f'{name}_{old}']['ms_per_token']:.2f}, {new} "
              f"{report[f'{name}_{new}']['ms_per_token']:.2f} ({report[f'{name}_{new}_over_{old}']:.3f}x)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    run(main)
