"""Benchmark: trained exit heads on SmolLM2-135M on this CPU.

Trains affine translator heads for every layer 1..29 on the target's own continuations of the prompt suite,
reports held-out acceptance (sum_x min(p_exit, p_final)) and greedy agreement vs the final layer before
(raw logit lens) and after training, the training time, and the one-token decode step cost of exits with the
full LM head vs a reduced-vocabulary draft head.

    .venv/bin/python -m benchmarks.heads_train [--threads 1] [--tokens 4096] [--epochs 3] \
        [--out out/heads-smollm2.safetensors] [--json benchmarks/results/heads_train.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.entry import count, positive, run, whole
from hsd_opt.commands.options import layer_numbers
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.heads import generate_training_sequences, head_layers, load_heads, save_heads, train_heads
from hsd_opt.heads.data import split_indices
from hsd_opt.heads.modules import RawHead, TranslatorHead
from hsd_opt.jsonio import write_json
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def step_cost(model, heads_by_name: dict, layers: list[int], ctx: list[int], reps: int = 30) -> dict:
    """Median seconds of one draft step at exit b: append 1 token, run layers 0..b-1 on it, apply the head,
    then crop back (the state's KV caches hold ``ctx`` already)."""
    out = {}
    for name, make in heads_by_name.items():
        for b in layers:
            lm = LayeredLM(model, {b: make(b)})
            st = lm.new_state(len(ctx) + 4, save_boundaries=[b])
            lm.append(st, ctx)
            lm.advance(st, b)
            n = st.n
            ts = []
            for r in range(reps + 3):
                t0 = time.perf_counter()
                lm.append(st, [ctx[r % len(ctx)]])
                lm.advance(st, b)
                z = lm.logits(st, b, n, n + 1)
                torch.softmax(z, -1)
                ts.append(time.perf_counter() - t0)
                lm.crop(st, n)
            out.setdefault(name, {})[str(b)] = round(statistics.median(ts[3:]) * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=count, default=1, help="torch threads (1 is fastest on a loaded 2-core machine)")
    ap.add_argument("--tokens", type=count, default=4096)
    ap.add_argument("--epochs", type=count, default=3)
    ap.add_argument("--lr", type=positive, default=2e-3)
    ap.add_argument("--layers", default="all")
    ap.add_argument("--kind", default="affine")
    ap.add_argument("--vocab-subset", type=whole, default=4096, help="K of the reduced-vocabulary head trained "
                    "for the step-cost comparison (0: skip)")
    ap.add_argument("--subset-layers", default="2,4,8,14")
    ap.add_argument("--cost-layers", default="2,4,8,14")
    ap.add_argument("--out", default=str(ROOT / "out" / "heads-smollm2.safetensors"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "heads_train.json"))
    args = ap.parse_args()
    for flag, spec in (("--layers", args.layers), ("--subset-layers", args.subset_layers),
                       ("--cost-layers", args.cost_layers)):
        layer_numbers(spec, flag)          # the syntax, before the model loads and the heads train
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    loaded = load_model(args.model, device="cpu", dtype="float32")
    m = loaded.model
    n_layers = m.config.num_hidden_layers
    layers = head_layers(layer_numbers(args.layers), n_layers)
    prompts = load_prompts(None).texts
    t0 = time.time()
    seqs, plens = generate_training_sequences(loaded, prompts, tokens=args.tokens, with_prompt_lens=True)
    gen_s = time.time() - t0
    print(f"{len(seqs)} sequences, {sum(len(s) - p for s, p in zip(seqs, plens))} generated tokens "
          f"({gen_s:.1f} s incl. cache)")
    tr, ho = split_indices(len(seqs), 0.2, 0)
    train = dict(token_sequences=[seqs[i] for i in tr], starts=[plens[i] for i in tr],
                 held_out=[seqs[i] for i in ho], held_out_starts=[plens[i] for i in ho])

    res = train_heads(loaded, layers, kind=args.kind, epochs=args.epochs, lr=args.lr,
                      checkpoint=args.out + ".ckpt", resume=True, log=print, **train)
    header = save_heads(args.out, res.heads, loaded, training_data_sha256=res.data_sha256, train=res.summary())
    Path(args.out + ".ckpt").unlink(missing_ok=True)
    heads2, _ = load_heads(args.out, loaded)  # round-trip check of the saved file
    print(f"\ntrained {len(layers)} heads in {res.seconds:.1f} s (evaluation {res.eval_seconds:.1f} s); "
          f"saved {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)")
    print(f"{'layer':>5} {'acc before':>10} {'acc after':>10} {'greedy before':>13} {'greedy after':>12} "
          f"{'KL before':>9} {'KL after':>9}")
    for b in layers:
        bf, af = res.before[b], res.after[b]
        print(f"{b:>5} {bf['acceptance']:>10.3f} {af['acceptance']:>10.3f} {bf['greedy']:>13.3f} "
              f"{af['greedy']:>12.3f} {bf['kl']:>9.3f} {af['kl']:>9.3f}")

    subset = None
    cost = None
    if args.vocab_subset:
        sl = head_layers(layer_numbers(args.subset_layers, "--subset-layers"), n_layers)
        rs = train_heads(loaded, sl, kind=args.kind, epochs=args.epochs, lr=args.lr,
                         vocab_subset=args.vocab_subset, log=print, **train)
        subset = {"K": args.vocab_subset, "train_seconds": round(rs.seconds, 2),
                  "layers": {str(b): {"raw_full_acceptance": rs.before[b]["acceptance"],
                                      "raw_subset_acceptance": rs.after[b]["raw_subset_acceptance"],
                                      "trained_subset_acceptance": rs.after[b]["acceptance"],
                                      "trained_subset_greedy": rs.after[b]["greedy"],
                                      "trained_full_acceptance": res.after[b]["acceptance"] if b in res.after
                                      else None} for b in sl}}
        print(f"\nreduced-vocabulary heads (K={args.vocab_subset}):")
        for b in sl:
            d = subset["layers"][str(b)]
            print(f"  layer {b}: acceptance raw {d['raw_full_acceptance']:.3f}, raw on subset "
                  f"{d['raw_subset_acceptance']:.3f}, trained subset {d['trained_subset_acceptance']:.3f}, "
                  f"trained full {d['trained_full_acceptance']}")
        cl = head_layers(layer_numbers(args.cost_layers, "--cost-layers"), n_layers)
        ctx = seqs[ho[0]][:128]
        makers = {
            "raw_full": lambda b: RawHead(m),
            "trained_full": lambda b: heads2.get(b) or TranslatorHead(m, args.kind),
            "trained_subset": lambda b: rs.heads.get(b) or TranslatorHead(m, args.kind, vocab_ids=rs.vocab_ids),
        }
        cost = step_cost(m, makers, cl, ctx)
        lm = LayeredLM(m)
        st = lm.new_state(len(ctx) + 4)
        lm.append(st, ctx)
        lm.advance(st, n_layers)
        ts = []
        for r in range(33):
            t1 = time.perf_counter()
            lm.append(st, [ctx[r % len(ctx)]])
            lm.advance(st, n_layers)
            torch.softmax(lm.logits(st, n_layers, len(ctx), len(ctx) + 1), -1)
            ts.append(time.perf_counter() - t1)
            lm.crop(st, len(ctx))
        cost["target_ms"] = round(statistics.median(ts[3:]) * 1e3, 3)
        print("\none-token step cost (ms, median):", json.dumps(cost))

    result = {
        "benchmark": "heads_train", "model": loaded.model_id, "revision": loaded.revision,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "command": "python " + " ".join(sys.argv),
        "data": {"sequences": len(seqs), "generated_tokens": sum(len(s) - p for s, p in zip(seqs, plens)),
                 "train_positions": res.train_positions, "heldout_positions": res.heldout_positions,
                 "generation_seconds_incl_cache": round(gen_s, 2)},
        "heads_file": str(args.out), "heads_file_bytes": Path(args.out).stat().st_size,
        "train_seconds": round(res.seconds, 2), "train_cpu_seconds": round(res.cpu_seconds, 2),
        "load_average_at_end": list(__import__("os").getloadavg()), "eval_seconds": round(res.eval_seconds, 2),
        "settings": res.settings, "history": res.history,
        "per_layer": {str(b): {"before": res.before[b], "after": res.after[b]} for b in layers},
        "reduced_vocab": subset, "step_cost_ms": cost, "header": {k: v for k, v in header.items() if k != "train"},
    }
    write_json(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run(main)
