"""Two disjoint, fixed samples of a Spec-Bench question file: one to benchmark on, one to profile on.

    .venv/bin/python -m benchmarks.spec_bench_sample --questions ../shared/benchmarks/spec_bench/question_even.jsonl \
        --eval-out out/spec_bench_eval.jsonl --profile-out out/spec_bench_profile.jsonl

The benchmark sample takes, in file order, the first ``--eval-per-group`` questions of every category group
(translation, summarization, qa, math_reasoning, rag) and, for the MT-bench group, the first
``--eval-per-mt-category`` of each of its eight categories (so every MT-bench category is in it). The profiling
sample takes the next questions after those (``--profile-per-group`` per group, ``--profile-per-mt-category`` per
MT-bench category), so a plan fitted on it is measured on questions it has not seen. Lines are copied unchanged
(the `question_id`, `category`, `turns` format `hsd profile --prompts` and `hsd bench --prompts` read). The question
file itself is the user's; nothing of it goes into the repository (write the samples under out/).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.entry import run, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", required=True, help="Spec-Bench question file (JSON lines)")
    ap.add_argument("--eval-out", required=True)
    ap.add_argument("--profile-out", required=True)
    ap.add_argument("--eval-per-group", type=whole, default=10)
    ap.add_argument("--eval-per-mt-category", type=whole, default=2)
    ap.add_argument("--profile-per-group", type=whole, default=6)
    ap.add_argument("--profile-per-mt-category", type=whole, default=1)
    a = ap.parse_args()

    from hsd_opt.prompts import MT_BENCH_CATEGORIES, load_prompts, spec_bench_group, text_lines

    items = load_prompts(a.questions).items          # checks every line (a clear error names a bad one)
    text = text_lines(Path(a.questions).read_bytes().decode("utf-8"))     # each item's line as load_prompts read it
    seen: dict[str, int] = {}
    ev, pr = [], []
    for it in items:
        line, cat = text[it.line - 1], it.category
        key = cat if cat in MT_BENCH_CATEGORIES else spec_bench_group(cat)
        n_ev = a.eval_per_mt_category if cat in MT_BENCH_CATEGORIES else a.eval_per_group
        n_pr = a.profile_per_mt_category if cat in MT_BENCH_CATEGORIES else a.profile_per_group
        k = seen.get(key, 0)
        seen[key] = k + 1
        if k < n_ev:
            ev.append(line)
        elif k < n_ev + n_pr:
            pr.append(line)
    for path, out in ((a.eval_out, ev), (a.profile_out, pr)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path + ".partial")
        tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        print(f"wrote {path}: {len(out)} questions")


if __name__ == "__main__":
    run(main)
