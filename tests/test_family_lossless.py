"""Lossless on a real model family: greedy HSD with a solved plan equals Hugging Face ``generate`` of its target,
token for token, on every code prompt of the suite and on 20 Spec-Bench questions.

Needs the fetched models and a plan made for them, so it runs only when asked (marker ``family``)::

    hsd models fetch qwen2.5-coder-0.5b && hsd models fetch qwen2.5-coder-1.5b
    hsd profile --model qwen2.5-coder-1.5b ... --out out/family/profile.json   # see `make demo-family`
    hsd solve --profile out/family/profile.json --tmax 15 --out out/family/plan.json
    HSD_FAMILY_PLAN=out/family/plan.json HSD_SPEC_BENCH=path/to/question.jsonl \\
        .venv/bin/python -m pytest -m family tests/test_family_lossless.py

A plan whose target is a quantized copy (``hsd profile --target-precision int4``) is held to that copy's own greedy
output (the copy alone, step by step), which is not the float model's that HF ``generate`` computes.
``HSD_SPEC_BENCH`` (Spec-Bench's question file, first turns) is optional: without it the Spec-Bench test skips.
About ten minutes on a 2-core CPU (Hugging Face ``generate`` of a float32 1.5B model is the slow part).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.family, pytest.mark.slow]

PLAN = os.environ.get("HSD_FAMILY_PLAN")
SPEC_BENCH = os.environ.get("HSD_SPEC_BENCH")
N_NEW = 32  # tokens per prompt
N_SPEC_BENCH = 20

if not PLAN:
    pytest.skip("HSD_FAMILY_PLAN is not set (a plan made for a fetched model family)", allow_module_level=True)


@pytest.fixture(scope="module")
def family_plan():
    from hsd_opt.commands.common import load_plan_and_model
    from hsd_opt.models.loading import eos_token_ids
    from hsd_opt.runtime.runner import PlanModels, hsd_for_plan

    plan, loaded = load_plan_and_model(Path(PLAN), None, "cpu", None)
    eos = eos_token_ids(loaded)
    models = PlanModels(loaded)
    runner = hsd_for_plan(plan, loaded, source=PLAN, models=models)
    if plan.provenance.target_precision in (None, "float32", "bfloat16"):
        return loaded, runner, lambda ids: _hf_greedy(loaded, ids, eos)
    alone = hsd_for_plan(plan, loaded, source=PLAN, hierarchy=[plan.hierarchy[-1]], models=models)
    return loaded, runner, lambda ids: list(alone.generate(ids, N_NEW).token_ids)


def _hf_greedy(loaded, ids: list[int], eos: list[int]) -> list[int]:
    x = torch.tensor([ids])
    out = loaded.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
    hf = out[0, len(ids):].tolist()
    hit = [i for i, t in enumerate(hf) if t in eos]
    return hf[: hit[0] + 1] if hit else hf


def _check(family_plan, texts: list[str]) -> None:
    from hsd_opt.prompts import encode_prompt

    loaded, runner, reference = family_plan
    differ = []
    for k, text in enumerate(texts):
        ids = encode_prompt(loaded.tokenizer, text)
        if list(runner.generate(ids, N_NEW).token_ids) != reference(ids):
            differ.append(k)
    assert not differ, f"prompts whose HSD output differs from its target's greedy output: {differ}"


def test_the_plan_equals_hf_generate_on_every_code_prompt_of_the_suite(family_plan):
    from hsd_opt.prompts import load_prompts

    items = [it for it in load_prompts().items if it.task == "code"]
    assert items
    _check(family_plan, [it.prompt for it in items])


@pytest.mark.skipif(not SPEC_BENCH, reason="HSD_SPEC_BENCH is not set (Spec-Bench's question file)")
def test_the_plan_equals_hf_generate_on_20_spec_bench_questions(family_plan):
    from hsd_opt.prompts import load_prompts

    items = load_prompts(SPEC_BENCH).items[:N_SPEC_BENCH]
    assert len(items) == N_SPEC_BENCH
    _check(family_plan, [it.prompt for it in items])
