"""Lossless greedy HSD on the embedded SmolLM2-135M-Instruct: hand-written plans of depth 2, 3 and 4 (early exits
sharing one KV cache, the int4 copy of the target, and the context n-gram drafter at the bottom) emit exactly our
autoregressive greedy ids on prompts of the suite; so do the solved plan (built the way ``hsd run`` builds it, with
the abstaining lookup at the bottom) and plans of depth 3 and 4 on every prompt of the suite; our AR loop on the
decode kernels equals Hugging Face ``generate`` greedy and the torch path on every prompt of the suite; a bfloat16
target's hierarchies equal its own AR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsd_opt.drafters import make_token_drafter
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.models.loading import eos_token_ids as eos_ids
from hsd_opt.prompts import encode_prompt, load_prompts
from hsd_opt.runtime.decode import HSD, Level

N_NEW = 16  # tokens per prompt in the per-depth tests (three prompts)
N_SUITE = 12  # tokens per prompt on the whole suite (24 prompts)
REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "data" / "prompts.jsonl"
# The plan `hsd solve` made from a measured SmolLM2 profile (tests/data/profile_lookup.json): the abstaining n-gram
# lookup (T = 2) -> the int4 copy (T = 15) -> the target.
SOLVED_PLAN = REPO / "tests" / "data" / "runtime_bench_lookup_plan.json"


@pytest.fixture(scope="module")
def setup(embedded):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's 2 cores are shared; one thread is faster under load
    by_task: dict[str, str] = {}
    for it in load_prompts(SUITE).items:
        by_task.setdefault(it.task, it.prompt)
    prompts = [encode_prompt(embedded.tokenizer, by_task[t]) for t in ("code", "math", "chat") if t in by_task]
    lm = LayeredLM(embedded.model)
    eos = eos_ids(embedded)
    ar = HSD([Level("layer30", lm, 30)], [], eos_ids=eos)
    refs = [ar.generate(p, N_NEW).token_ids for p in prompts]
    yield embedded, lm, eos, prompts, refs
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def quantized(embedded):
    from hsd_opt.engine.quantized import QuantizedLM

    return QuantizedLM(embedded.model, bits=4)


@pytest.fixture(scope="module")
def quantized8(embedded):
    from hsd_opt.engine.quantized import QuantizedLM

    return QuantizedLM(embedded.model, bits=8)


def _ngram():
    return make_token_drafter("ngram_context", q=2, w=4)


def _hierarchy(chain, budgets, lm, quantized, eos, quantized8=None) -> HSD:
    """``chain`` (names: ``ngram``, ``int4``, ``int8`` or ``layer<N>``, bottom first) under the target
    ``layer30``."""
    copies = {"int4": quantized, "int8": quantized8}
    levels = [Level(n, drafter=_ngram()) if n == "ngram" else Level(n, copies[n], 30) if n in copies
              else Level(n, lm, int(n[5:])) for n in chain]
    return HSD(levels + [Level("layer30", lm, 30)], budgets, eos_ids=eos)


@pytest.mark.parametrize("chain,budgets", [
    (["layer26"], [3]),                                   # depth 2: one exit
    (["ngram", "layer29"], [2, 3]),                       # depth 3: n-gram -> exit -> target
    (["layer6", "layer14", "layer22"], [1, 2, 3]),        # depth 4: three exits, one shared cache
    (["int4"], [12]),                                     # depth 2: the int4 copy of the target
    (["ngram", "int4", "layer28"], [1, 6, 8]),            # depth 4: n-gram -> int4 copy -> exit -> target
])
def test_embedded_greedy_lossless(setup, quantized, chain, budgets):
    _, lm, eos, prompts, refs = setup
    h = _hierarchy(chain, budgets, lm, quantized, eos)
    n = 2 if len(chain) >= 3 else len(prompts)  # the deep logit-lens chain is the slowest (low acceptance)
    for p, ref in list(zip(prompts, refs))[:n]:
        res = h.generate(p, N_NEW)
        assert res.token_ids == ref, (chain, budgets)


def test_embedded_eager_mode_and_sampling_run(setup):
    _, lm, eos, prompts, refs = setup
    h = HSD([Level("layer22", lm, 22), Level("layer28", lm, 28), Level("layer30", lm, 30)], [2, 4], eos_ids=eos,
            mode="eager")
    assert h.generate(prompts[0], N_NEW).token_ids == refs[0]
    out = h.generate(prompts[0], 8, temperature=0.7, top_p=0.9, seed=1)
    assert 1 <= len(out.token_ids) <= 8


@pytest.fixture(scope="module")
def whole_suite(setup):
    """Every prompt of the suite, encoded, with our AR greedy reference of ``N_SUITE`` tokens."""
    loaded, lm, eos, _, _ = setup
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompts(SUITE).texts]
    ar = HSD([Level("layer30", lm, 30)], [], eos_ids=eos)
    return prompts, [ar.generate(p, N_SUITE).token_ids for p in prompts]


def test_our_ar_on_the_kernels_equals_hf_generate_on_every_suite_prompt(setup, whole_suite):
    """The kernels reorder float32 sums (docs/design.md#decode-kernels); greedy outputs still agree with HF
    ``generate`` on every prompt of the suite."""
    loaded, lm, eos, _, _ = setup
    assert lm.uses_kernels
    prompts, refs = whole_suite
    for k, (p, ref) in enumerate(zip(prompts, refs)):
        ids = torch.tensor([p])
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_SUITE,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos[0], temperature=None,
                                    top_p=None, top_k=None)
        hf = out[0, len(p):].tolist()
        hit = [i for i, t in enumerate(hf) if t in eos]
        assert (hf[: hit[0] + 1] if hit else hf) == ref, k


def test_the_torch_path_gives_the_kernels_greedy_output_on_every_suite_prompt(setup, whole_suite):
    loaded, _, eos, _, _ = setup
    eager = LayeredLM(loaded.model, kernels=False)
    ar = HSD([Level("layer30", eager, 30)], [], eos_ids=eos)
    prompts, refs = whole_suite
    for k, (p, ref) in enumerate(zip(prompts, refs)):
        assert ar.generate(p, N_SUITE).token_ids == ref, k


def test_bfloat16_target_hsd_equals_its_own_ar(setup):
    """A bfloat16 target is another target with its own greedy output; its int4 copy and exits draft for it
    losslessly."""
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.models.loading import load_model

    _, _, eos, prompts, _ = setup
    bf = load_model("smollm2-135m", device="cpu", dtype="bfloat16")
    lm = LayeredLM(bf.model)
    assert lm.uses_kernels and bf.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    q4 = QuantizedLM(bf.model, bits=4)
    ar = HSD([Level("layer30", lm, 30)], [], eos_ids=eos)
    for chain, budgets in ((["int4"], [8]), (["ngram", "int4"], [1, 12]), (["layer22", "layer28"], [2, 4])):
        levels = [Level(n, drafter=_ngram()) if n == "ngram" else Level(n, q4, 30) if n == "int4"
                  else Level(n, lm, int(n[5:])) for n in chain]
        h = HSD(levels + [Level("layer30", lm, 30)], budgets, eos_ids=eos)
        for p in prompts:
            assert h.generate(p, N_NEW).token_ids == ar.generate(p, N_NEW).token_ids, chain


def test_solved_plan_lossless_on_every_suite_prompt(setup, whole_suite):
    from hsd_opt.formats import load_plan
    from hsd_opt.runtime.runner import hsd_for_plan

    loaded, _, _, _, _ = setup
    plan = load_plan(SOLVED_PLAN)
    assert len(plan.hierarchy) >= 2                      # a plan that drafts, not the target alone
    h = hsd_for_plan(plan, loaded, source=str(SOLVED_PLAN))
    prompts, refs = whole_suite
    assert len(prompts) == 24
    abstained = 0
    for k, (p, ref) in enumerate(zip(prompts, refs)):
        res = h.generate(p, N_SUITE)
        assert res.token_ids == ref, (plan.hierarchy, k)
        abstained += res.stats["levels"][0].get("abstained", 0)
    assert abstained > 0                                  # the lookup at the bottom abstained, and it stayed exact


@pytest.mark.parametrize("chain,budgets", [
    (["ngram", "int4"], [1, 12]),                         # depth 3
    (["ngram", "int4", "int8"], [1, 6, 12]),              # depth 4: three engines' caches and a token drafter
])
def test_deeper_plans_lossless_on_every_suite_prompt(setup, quantized, quantized8, whole_suite, chain, budgets):
    _, lm, eos, _, _ = setup
    h = _hierarchy(chain, budgets, lm, quantized, eos, quantized8)
    prompts, refs = whole_suite
    for k, (p, ref) in enumerate(zip(prompts, refs)):
        assert h.generate(p, N_SUITE).token_ids == ref, (chain, budgets, k)
