"""The grammar engines side by side on the shipped JSON-schema tasks (``hsd_opt/data/json_tasks.jsonl``) with the
embedded model's tokenizer: what the project's choice of llguidance rests on.

    .venv/bin/python -m benchmarks.grammar_engines [--limit 60] [--sweep-mb 100] \\
        [--out benchmarks/results/grammar_engines.json]

Engines: llguidance (the project's, :mod:`hsd_opt.grammar`), xgrammar and outlines-core, each where it is installed
(neither is a dependency: ``pip install xgrammar outlines-core`` to compare); each schema in the project's JSON
layout (``", "``, ``": "``, no other white space; outlines-core: its regular expression of the schema). Per engine:

- compile: seconds to compile each schema for the tokenizer (the first compile of each, no cache);
- mask: seconds to fill the allowed-token bitmask at each position of each task's example answer (the JSON of the
  task's ``example``, tokenized, then the end of sequence), the engine then consuming the example's token; twice:
  back to back (the engine's tables in cache) and after reading ``--sweep-mb`` MB at every position (as in
  decoding, where every step reads the model's weights between two masks);
- accepted: examples whose every token (and the end) the engine allowed, of those it compiled (the others named,
  with the position refused).

Reported per engine: p50 and p99 of each (milliseconds), the counts, and any schema it refused.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from benchmarks.entry import count, run
from benchmarks.json_schema_bench import quantiles_ms
from hsd_opt.engine.variants import host
from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
from hsd_opt.jsonio import write_json
from hsd_opt.models.loading import eos_token_ids, load_model


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok, eos: list[int], vocab: int):
        self.compiler, self.words = GrammarCompiler(tok, eos, vocab), (vocab + 31) // 32

    def compile(self, schema: dict):
        return self.compiler.compile(GrammarSpec.json_schema(schema))

    def matcher(self, compiled):
        return compiled.template.deep_copy()

    def fill(self, m) -> np.ndarray:
        b = np.empty(self.words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
        return b

    @staticmethod
    def allows(bits: np.ndarray, t: int) -> bool:
        return bool((int(bits[t >> 5]) >> (t & 31)) & 1)

    @staticmethod
    def consume(m, t: int) -> None:
        m.consume_token(t)


class _Xgrammar(_Llguidance):
    name = "xgrammar"

    def __init__(self, tok, eos: list[int], vocab: int):
        import xgrammar as xg

        self.xg = xg
        info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        self.compiler, self.vocab = xg.GrammarCompiler(info, cache_enabled=False), vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        m = self.xg.GrammarMatcher(compiled)
        m.bits = self.xg.allocate_token_bitmask(1, self.vocab)
        return m

    def fill(self, m):
        m.fill_next_token_bitmask(m.bits)
        return m.bits[0].numpy()

    @staticmethod
    def consume(m, t: int) -> None:
        if not m.accept_token(t):
            raise ValueError(f"token {t} refused")


def _byte_chars() -> dict[int, str]:
    """The byte-level BPE's character for each byte (GPT-2's table, which SmolLM2's tokenizer uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class _OutlinesCore(_Llguidance):
    name = "outlines-core"

    def __init__(self, tok, eos: list[int], vocab: int):
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        self.Guide, self.Index, self.regex = Guide, Index, build_regex_from_schema
        back = {c: b for b, c in _byte_chars().items()}
        table: dict[bytes, list[int]] = {}
        for t in range(len(tok)):
            if t in eos:
                continue
            s = tok.convert_ids_to_tokens(t)
            if s is None or any(c not in back for c in s):
                continue                         # special tokens: never in a JSON answer
            table.setdefault(bytes(back[c] for c in s), []).append(t)
        self.vocabulary, self.vocab, self.eos = Vocabulary(eos[0], table), vocab, eos[0]

    def compile(self, schema: dict):
        return self.Index(self.regex(json.dumps(schema), whitespace_pattern=r"[ ]?"), self.vocabulary)

    def matcher(self, compiled):
        return self.Guide(compiled), torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self, m):
        guide, bits = m
        guide.write_mask_into(bits.data_ptr(), bits.numel(), bits.element_size())
        return bits.numpy()

    def consume(self, m, t: int) -> None:
        m[0].advance(t)


def _engines(tok, eos, vocab) -> tuple[list, dict[str, str]]:
    out, missing = [_Llguidance(tok, eos, vocab)], {}
    for cls in (_Xgrammar, _OutlinesCore):
        try:
            out.append(cls(tok, eos, vocab))
        except ImportError as e:
            missing[cls.name] = f"not installed ({e})"
    return out, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=count, default=60)
    ap.add_argument("--sweep-mb", type=count, default=100, help="MB read between two masks in the cold run")
    ap.add_argument("--out", default="benchmarks/results/grammar_engines.json")
    a = ap.parse_args()
    loaded = load_model("smollm2-135m", device="cpu")
    tok, eos = loaded.tokenizer, eos_token_ids(loaded)
    vocab = int(loaded.model.config.vocab_size)
    text = (files("hsd_opt") / "data" / "json_tasks.jsonl").read_text(encoding="utf-8")
    tasks = [json.loads(x) for x in text.splitlines() if x.strip()][:a.limit]
    engines, missing = _engines(tok, eos, vocab)
    sweep = np.ones(a.sweep_mb * (1 << 20) // 4, dtype=np.float32)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": host(),
                    "tasks": len(tasks), "sweep_mb": a.sweep_mb, "engines": {}, "missing": missing}
    for eng in engines:
        t = time.perf_counter()
        eng.compile({"type": "object"})                     # the tokenizer's one-time set-up, apart
        setup = time.perf_counter() - t
        compile_s, warm, cold, refused, accepted, rejected = [], [], [], {}, 0, {}
        for task in tasks:
            t = time.perf_counter()
            try:
                compiled = eng.compile(task["schema"])
            except Exception as e:  # noqa: BLE001 - an engine refusing a schema is a result
                refused[task["name"]] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            compile_s.append(time.perf_counter() - t)
            ids = tok.encode(json.dumps(task["example"], ensure_ascii=False), add_special_tokens=False) + [eos[0]]
            ok = True
            for times, cold_cache in ((warm, False), (cold, True)):
                m = eng.matcher(compiled)
                for k, tid in enumerate(ids):
                    if cold_cache:
                        float(sweep.sum())                  # the model's weights read between two masks
                    t = time.perf_counter()
                    bits = eng.fill(m)
                    times.append(time.perf_counter() - t)
                    if not eng.allows(bits, tid):
                        ok = False
                        rejected[task["name"]] = f"token {k} of {len(ids)} ({tok.decode([tid])!r})"
                        break
                    if k + 1 < len(ids):
                        eng.consume(m, tid)
            accepted += ok
        report["engines"][eng.name] = {
            "setup_s": round(setup, 3), "compile": quantiles_ms(compile_s, 4), "mask_in_cache": quantiles_ms(warm, 4),
            "mask_after_sweep": quantiles_ms(cold, 4), "compiled": len(compile_s), "examples_accepted": accepted,
            "refused": refused, "examples_rejected": rejected}
        r = report["engines"][eng.name]
        print(f"{eng.name}: compiled {r['compiled']}/{len(tasks)}, examples accepted {accepted}; compile "
              f"{r['compile']}; mask in cache {r['mask_in_cache']}; after a {a.sweep_mb} MB sweep "
              f"{r['mask_after_sweep']}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, report, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    run(main)
