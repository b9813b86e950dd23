"""``hsd profile --costs-only``: the costs of a pool (on random weights built from the model's configuration where
its weights are not on this machine), and ``hsd profile merge-costs`` of them with another profile's rates, which
equals a profile made in one run when both runs time the same work alike (a virtual clock that moves only with the
engines' and token drafters' work)."""

from __future__ import annotations

import json
import time

import pytest

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import load_profile, profile_from_dict
from tests.helpers import cli_output, run_cli, save_tiny, write_prompts

# One torch thread (as in test_profiler.py), a short cost scheme, no progress bar.
FAST = ["--tmax", "3", "--cost-repeats", "1", "--quiet", "--threads", "1", "--device", "cpu"]
#: The pool both runs measure: an exit and the target, a 2-layer draft model, an int8 copy, every token drafter.
POOL = ["--layers", "1", "--quantized", "int8", "--token-drafters", "ngram,lookup,bigram,aded", "--cost-contexts",
        "8,64", "--batch-sizes", "1,2", "--max-prompts", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"model": save_tiny(root / "model"), "copy": save_tiny(root / "copy", seed=1, layers=2),
            "prompts": write_prompts(root / "prompts.jsonl")}


pytestmark = pytest.mark.usefixtures("isolated_cache")    # a test cache; torch's thread count restored


class VirtualClock:
    """``time.perf_counter`` as a count of ticks (2**-24 s each: every time and every difference of two is exact)
    that moves only when an engine computes or a token drafter proposes, by a fixed function of what it computes:
    a pass over positions at a context, a read of rows through a head, a proposal. Two runs that do the same work
    then measure the same costs to the last bit, whatever the weights, the text or the machine's load."""

    TICK = 2.0 ** -24

    def __init__(self):
        self.ticks = 0
        self.depth = 0

    def now(self) -> float:
        return self.ticks * self.TICK

    def charging(self, fn, cost):
        """``fn`` (a method) that adds ``cost(self_, args, result)`` ticks when it returns, unless it was called
        from inside another charged method (its work is then already counted)."""
        clock = self

        def wrapper(obj, *args, **kw):
            outer = clock.depth == 0
            clock.depth += 1
            try:
                out = fn(obj, *args, **kw)
            finally:
                clock.depth -= 1
            if outer:
                clock.ticks += int(cost(obj, args, out))
            return out

        return wrapper


#: Ticks of one proposal of each token drafter.
PROPOSE_TICKS = {"ngram": 1000, "lookup": 2000, "bigram": 3000, "aded": 5000}


def _weight(eng) -> int:
    """Ticks per position and layer of an engine: its weights' bits (a float engine 16)."""
    return int(getattr(eng, "bits", 16))


@pytest.fixture
def virtual_clock(monkeypatch):
    from hsd_opt.drafters.aded import AdedDrafter
    from hsd_opt.drafters.bigram import BigramDrafter
    from hsd_opt.drafters.ngram import ContextNgramDrafter
    from hsd_opt.engine.layered import LayeredLM

    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock.now)

    def passes(eng, args, computed):                # positions x layers, dearer at a longer context
        return computed * (64 + args[0].n) * _weight(eng)

    def passes_many(eng, args, computed):
        return sum(c * (64 + st.n) for (st, _), c in zip(args[0], computed)) * _weight(eng)

    def rows(eng, args, out):                       # rows through a head
        return (args[3] - args[2]) * 4096 * _weight(eng)

    def rows_many(eng, args, out):
        return sum(s1 - s0 for _, _, s0, s1 in args[0]) * 4096 * _weight(eng)

    for name, cost in (("advance", passes), ("advance_many", passes_many), ("logits", rows),
                       ("greedy_ids", rows), ("logits_many", rows_many), ("greedy_ids_many", rows_many)):
        monkeypatch.setattr(LayeredLM, name, clock.charging(getattr(LayeredLM, name), cost))
    for cls in (ContextNgramDrafter, BigramDrafter, AdedDrafter):
        monkeypatch.setattr(cls, "propose", clock.charging(cls.propose, lambda d, args, out: PROPOSE_TICKS[d.name]))
    return clock


def _profile(tiny, out, *extra, configs: bool = False):
    """A profile of the tiny pool; ``configs``: named by their config.json files (random weights when costs only)."""
    model, copy = (tiny["model"], tiny["copy"]) if not configs else (tiny["model"] / "config.json",
                                                                      tiny["copy"] / "config.json")
    res = run_cli("profile", "--model", model, "--prompts", tiny["prompts"], "--draft-model", copy,
                  "--out", out, *POOL, *FAST, *extra)
    assert res.exit_code == 0, cli_output(res)
    return load_profile(out)[0]


def _without_provenance(prof) -> dict:
    d = prof.to_dict()
    d.pop("provenance")
    return d


def test_rates_merged_with_costs_only_costs_equal_one_run(tiny, tmp_path, virtual_clock):
    """A profile made in one run equals its own rates merged with a costs-only run's costs, when both runs time
    the same work alike: every cost, curve, verify cost, context and batch cost, step check and copy's record, the
    acceptance and statistics, and the plan ``hsd solve`` makes of it."""
    from hsd_opt.solver.api import solve

    one = _profile(tiny, tmp_path / "one.json", "--max-new-tokens", "6")
    costs = _profile(tiny, tmp_path / "costs.json", "--costs-only")
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "one.json", "--costs", tmp_path / "costs.json",
                  "-o", tmp_path / "merged.json")
    assert res.exit_code == 0, cli_output(res)
    merged, _ = load_profile(tmp_path / "merged.json")
    assert costs.provenance.costs_only is True and one.provenance.costs_only is None
    assert merged.provenance.costs_only is None and merged.provenance.get("costs_from")["costs_only"] is True
    # the clock tells the drafters apart: the test would see costs taken from the wrong drafter or context
    assert len({m.cost for m in one.models}) == len(one.models)
    assert one.context_costs[1].cost["layer4"] > one.context_costs[0].cost["layer4"]
    assert _without_provenance(merged) == _without_provenance(one)
    assert merged.models == one.models and merged.batch_costs == one.batch_costs
    a, b = solve(one, 3).to_dict(), solve(merged, 3).to_dict()
    for d in (a, b):
        d.pop("provenance"), d.pop("profile_sha256", None)
    assert a == b and len(a["hierarchy"]) >= 1


def test_costs_only_covers_every_drafter_of_the_pool(tiny, tmp_path):
    """Every drafter of the pool has its costs at every context (token drafters too), its cost curve and verify
    costs, and its batch ratios; no acceptance, no statistics; marked costs-only, random weights, the token
    drafters timed on the prompts' ids."""
    prof = _profile(tiny, tmp_path / "c.json", "--costs-only", configs=True)
    pool = {"layer1", "layer4", "copy", "int8", "ngram", "lookup", "bigram", "aded"}
    assert set(prof.names) == pool and prof.target == "layer4"
    assert prof.acceptance == {} and prof.stats is None and not prof.counts and not prof.acceptance_by_task
    pv = prof.provenance
    assert pv.costs_only is True and pv.get("source") == "random" and pv.get("revision").startswith("config:")
    assert pv.get("token_drafter_text") == "the prompts' token ids"
    assert prof.contexts == [8, 64] and prof.batch_sizes == [1, 2]
    neural = {"layer1", "layer4", "copy", "int8"}
    for e in prof.context_costs:
        assert set(e.cost) == pool and set(e.cost_curve) == neural
        assert set(e.verify_cost["layer4"]) == {"layer1"} and len(e.cost_curve["layer4"]) == 4
    assert set(prof.batch_costs[0].ratio) == pool and prof.batch_costs[0].ratio["ngram"] == 2.0
    for m in prof.models:
        assert m.cost == prof.context_costs[0].cost[m.name] and m.draft_rate == 1.0
    assert prof.entry("copy").kind == "model" and prof.entry("int8").extra["quantization"]["bits"] == 8
    assert prof.entry("bigram").extra["config"]["table"] is None          # a random table, never cached
    assert prof.models[-1].name == "layer4"


def test_costs_only_times_weights_that_are_on_this_machine_themselves(tiny, tmp_path):
    """A model directory (or a GGUF file, the embedded model) is timed on its own weights, not random ones of its
    shape: their form decides the CPU kernels' speed (an exact int4 form reads an eighth of float32's bytes)."""
    from hsd_opt.models.random_weights import weights_here

    prof = _profile(tiny, tmp_path / "c.json", "--costs-only")
    pv = prof.provenance
    assert pv.costs_only is True and pv.get("source") == "local" and not pv.get("revision", "").startswith("config:")
    assert weights_here(str(tiny["model"])) and not weights_here(str(tiny["model"] / "config.json"))
    assert not weights_here("tiny") and not weights_here("tinyllama-1.1b")
    assert set(pv.get("draft_sources").values()) == {"local"}


def test_costs_only_draft_models_follow_the_same_rule_as_the_target(tiny, tmp_path):
    """A draft model is timed on its own weights where they are here, whatever the target is timed on (a target
    named by its configuration alone gets random weights, its local draft model does not), and on random weights
    of its configuration where only that is given."""
    from hsd_opt.models.random_weights import RANDOM_SOURCE

    for target, draft, want in ((tiny["model"] / "config.json", tiny["copy"], "local"),
                                (tiny["model"], tiny["copy"] / "config.json", RANDOM_SOURCE)):
        out = tmp_path / f"{want}.json"
        res = run_cli("profile", "--model", target, "--prompts", tiny["prompts"], "--draft-model", draft, "--out",
                      out, "--costs-only", "--layers", "none", "--quantized", "none", "--token-drafters", "ngram",
                      "--cost-contexts", "16", "--batch-sizes", "1", *FAST)
        assert res.exit_code == 0, cli_output(res)
        assert list(load_profile(out)[0].provenance.get("draft_sources").values()) == [want]


def test_costs_only_a_configuration_without_a_tokenizer_takes_a_draft_model(tiny, tmp_path):
    """A ``config.json`` alone in its folder (no tokenizer) as the target, with a draft model of its vocabulary: the
    draft is checked by its vocabulary's size, as the target has no tokenizer (transformers made a Qwen2 tokenizer
    of one token there, and the draft was refused as of another tokenizer, "vocab sizes 100 vs 1")."""
    import shutil

    from tests.helpers import save_tiny_family

    big, small = save_tiny_family(tmp_path / "family")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(big / "config.json", bare / "config.json")
    out = tmp_path / "c.json"
    res = run_cli("profile", "--model", bare / "config.json", "--prompts", tiny["prompts"], "--draft-model", small,
                  "--out", out, "--costs-only", "--layers", "none", "--quantized", "none", "--token-drafters",
                  "ngram", "--cost-contexts", "16", "--batch-sizes", "1", *FAST)
    assert res.exit_code == 0, cli_output(res)
    assert {"small", "layer4", "ngram"} <= set(load_profile(out)[0].names)


def test_costs_only_from_a_bare_configuration(tmp_path):
    """A configuration without a tokenizer (``tiny``, as the shipped ones): random weights of its shapes, the
    token drafters timed on the prompts' UTF-8 bytes as ids."""
    res = run_cli("profile", "--costs-only", "--model", "tiny", "--out", tmp_path / "t.json", "--layers", "none",
                  "--quantized", "none", "--token-drafters", "ngram", "--cost-contexts", "16", "--batch-sizes", "1",
                  "--max-prompts", "1", *FAST)
    assert res.exit_code == 0, cli_output(res)
    assert "merge-costs --rates" in " ".join(res.output.split())
    prof, _ = load_profile(tmp_path / "t.json")
    assert set(prof.names) == {"layer4", "ngram"} and prof.provenance.model == "tiny"
    assert "UTF-8 bytes" in prof.provenance.get("token_drafter_text")


def test_costs_only_errors_exit_2_naming_the_flag(tiny, tmp_path):
    base = ["profile", "--costs-only", "--out", tmp_path / "c.json", *FAST]
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    no_layers = tmp_path / "other.json"
    no_layers.write_text(json.dumps({"hidden_size": 8}))
    no_causal_lm = tmp_path / "unknown.json"
    no_causal_lm.write_text(json.dumps({"model_type": "no-such-type", "num_hidden_layers": 2}))
    cases = [(base + ["--model", "no-such-config"], "--model no-such-config: unknown model"),
             (base + ["--model", "no-such-config"], "shipped configuration (layerskip-llama2-7b, qwen2.5-coder-0.5b"),
             (base + ["--model", bad_json], "not a readable config.json"),
             (base + ["--model", no_layers], "not a model configuration (no num_hidden_layers)"),
             (base + ["--model", no_causal_lm], "--model: cannot build a causal LM of this configuration"),
             (base + ["--model", "tiny", "--resume"], "--resume: --costs-only keeps no checkpoint"),
             (base + ["--model", "tiny", "--shard", "0/2"], "--shard: --costs-only"),
             (base + ["--model", "tiny", "--draft-model", "no-such-draft"], "--draft-model no-such-draft")]
    for args, needle in cases:
        res = run_cli(*args)
        text = " ".join(cli_output(res).split())
        assert res.exit_code == 2 and needle in text and "Traceback" not in text, (needle, text)


def test_solve_and_merges_refuse_a_costs_only_profile_where_rates_are_needed(tmp_path):
    """``hsd solve`` and ``hsd simulate`` on a costs-only profile, ``merge-costs`` with one as ``--rates`` and
    ``hsd profile merge`` of one: exit 2 with one line saying what to do; the solver's API raises."""
    import numpy as np

    from hsd_opt.formats import save_profile
    from hsd_opt.solver.api import solve
    from tests.helpers import random_profile, write_plan

    rates = random_profile(np.random.default_rng(1), 4, contexts=True)
    d = rates.to_dict()
    d.update(acceptance={}, provenance={"model": "m", "costs_only": True})
    costs, _ = profile_from_dict(d, "costs.json")
    save_profile(rates, tmp_path / "rates.json")
    save_profile(costs, tmp_path / "costs.json")
    c = str(tmp_path / "costs.json")
    plan = write_plan(tmp_path / "plan.json", "m")
    cases = [(["solve", "--profile", c, "--tmax", "3"],
              f"merge-costs --rates RATES.json --costs {c} -o merged.json"),
             (["simulate", "--plan", plan, "--profile", c], "has no acceptance rates"),
             (["profile", "merge-costs", "--rates", c, "--costs", tmp_path / "rates.json", "-o", tmp_path / "m.json"],
              "give it as --costs"),
             (["profile", "merge", c, tmp_path / "rates.json", "-o", tmp_path / "m.json"], "costs-only profile")]
    for args, needle in cases:
        res = run_cli(*args)
        out = cli_output(res)
        assert res.exit_code == 2 and needle in " ".join(out.split()) and "Traceback" not in out, (args, out)
        assert len(out.strip().splitlines()) <= 3          # one error line (wrapped at most by the console)
    with pytest.raises(InputFileError, match="provenance.costs_only"):
        solve(costs, 3)
    r = rates.to_dict()
    r["provenance"] = {**r.get("provenance", {}), "model": "m", "target_precision": "float32"}
    save_profile(profile_from_dict(r, "rates.json")[0], tmp_path / "rates.json")
    for field, value in (("temperature", 1.0), ("top_k", 40), ("min_p", 0.05), ("target_precision", "int4")):
        d2 = {**d, "provenance": {**d["provenance"], field: value}}       # costs measured under another setting
        save_profile(profile_from_dict(d2, "other.json")[0], tmp_path / "other.json")
        res = run_cli("profile", "merge-costs", "--rates", tmp_path / "rates.json", "--costs", tmp_path / "other.json",
                      "-o", tmp_path / "m.json")
        out = " ".join(cli_output(res).split())
        assert res.exit_code == 2 and f"provenance.{field}" in out and not (tmp_path / "m.json").exists(), out
    d3 = {**d, "provenance": {**d["provenance"], "tmax": 2}}       # cost curves shorter than the rates' tmax
    r["provenance"]["tmax"] = 3
    save_profile(profile_from_dict(r, "rates.json")[0], tmp_path / "rates.json")
    save_profile(profile_from_dict(d3, "other.json")[0], tmp_path / "other.json")
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "rates.json", "--costs", tmp_path / "other.json",
                  "-o", tmp_path / "m.json")
    assert res.exit_code == 2 and "provenance.tmax" in cli_output(res) and "--tmax 3" in cli_output(res)
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "rates.json", "--costs", c, "-o",
                  tmp_path / "m.json")
    assert res.exit_code == 0, cli_output(res)
    assert run_cli("solve", "--profile", tmp_path / "m.json", "--tmax", "3").exit_code == 0
    # a GPU's bfloat16 target, rates measured in float32 on a CPU: the same model's numbers up to rounding; the
    # merged profile (and a plan from it) is for the target the costs timed
    d4 = {**d, "provenance": {**d["provenance"], "dtype": "bfloat16", "target_precision": "bfloat16"}}
    r["provenance"]["dtype"] = "float32"
    res, merged = _merge_dicts(tmp_path, r, d4)
    assert res.exit_code == 0, cli_output(res)
    prov = merged.provenance
    assert (prov.dtype, prov.target_precision) == ("bfloat16", "bfloat16")
    assert prov.get("rates_measured_with") == {"dtype": "float32", "target_precision": "float32"}
    assert prov.get("costs_from")["model"] == "m"


def test_a_merge_takes_the_costs_machine_and_refuses_costs_of_another_model(tmp_path):
    """The merged profile kept the rates' threads, kernel variant and sampling time (``hsd run`` then warned of a
    machine it was not, and ``--retime`` took the rates' sampling time out of the costs' passes), and took the costs
    of a model of another shape or tokenizer silently."""
    import numpy as np

    from hsd_opt.runtime.runner import machine_differences
    from hsd_opt.solver.api import solve
    from tests.helpers import random_profile

    shape = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    rates = random_profile(np.random.default_rng(2), 4).to_dict()
    rates["provenance"] = {"model": "m", "torch_threads": 1, "kernels": {"variant": "avx2", "openmp": True},
                           "sampling_seconds": [1e-4, 2e-4], "model_shape": shape, "tokenizer_sha256": "aa"}
    costs = {**rates, "acceptance": {}}
    costs["provenance"] = {"model": "m.config", "costs_only": True, "torch_threads": 16, "sampling_seconds": [5e-3],
                           "kernels": {"variant": "avx512", "openmp": True}, "model_shape": shape}
    res, merged = _merge_dicts(tmp_path, rates, costs)
    assert res.exit_code == 0, cli_output(res)
    prov = merged.provenance
    assert (prov.threads, prov.kernel_variant, prov.get("sampling_seconds")) == (16, "avx512", [5e-3])
    assert prov.get("rates_measured_with")["torch_threads"] == 1 and prov.get("tokenizer_sha256") == "aa"
    plan = solve(merged, 3)
    assert machine_differences(plan, 16, "avx512") == [] and len(machine_differences(plan, 1, "avx2")) == 2
    for field, value in (("model_shape", {**shape, "hidden_size": 128}), ("tokenizer_sha256", "bb")):
        res, merged = _merge_dicts(tmp_path, rates, {**costs, "provenance": {**costs["provenance"], field: value}})
        out = " ".join(cli_output(res).split())
        assert res.exit_code == 2 and f"provenance.{field}" in out and merged is None, out


def _merge_dicts(tmp_path, rates: dict, costs: dict):
    """``hsd profile merge-costs`` of the profiles ``rates`` and ``costs`` (as dicts, saved first): its result and
    the merged profile (None where none was written)."""
    from hsd_opt.formats import save_profile

    out = tmp_path / "merged-dicts.json"
    out.unlink(missing_ok=True)
    for d, name in ((rates, "rates-dict.json"), (costs, "costs-dict.json")):
        save_profile(profile_from_dict(d, name)[0], tmp_path / name)
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "rates-dict.json", "--costs",
                  tmp_path / "costs-dict.json", "-o", out)
    return res, (load_profile(out)[0] if out.exists() else None)


def test_costs_only_is_typed_and_checked():
    d = {"format": "hsd-profile/1", "target": "t", "models": [{"name": "t", "kind": "target", "cost": 1.0}],
         "acceptance": {}, "provenance": {"costs_only": True}}
    prof, _ = profile_from_dict(d)
    assert prof.provenance.costs_only is True and prof.provenance.get("costs_only") is True
    assert prof.to_dict()["provenance"] == {"costs_only": True}
    with pytest.raises(InputFileError, match="provenance.costs_only: expected true or false"):
        profile_from_dict({**d, "provenance": {"costs_only": "yes"}})


def test_random_weights_follow_the_configuration(tmp_path):
    from hsd_opt.models.random_weights import config_of, load_random

    cfg = dict(config_of("tiny"), num_hidden_layers=2, vocab_size=300)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"_source": "a note", **cfg}))
    lm = load_random(str(tmp_path / "m" / "config.json"), device="cpu", dtype="float32")
    assert lm.model_id == str(tmp_path / "m") and lm.source == "random" and lm.tokenizer is None
    assert lm.model.config.num_hidden_layers == 2 and lm.model.lm_head.weight.shape == (300, cfg["hidden_size"])
    assert lm.model.hsd_weights_key is None and lm.revision == load_random(str(tmp_path / "m"), "cpu").revision
    with pytest.raises(HsdError, match="--config: no configuration 'nope'"):
        config_of("nope")
    assert config_of("tinyllama-1.1b")["num_hidden_layers"] == 22 and "_source" not in config_of("tinyllama-1.1b")


def test_a_registry_model_not_fetched_is_timed_on_its_shipped_configuration():
    """A model ``hsd models fetch`` serves has its configuration shipped: where it is not fetched (a lent GPU, the
    test cache) a costs-only run builds it from that, under the same name as where it is fetched, so the costs
    merge with rates measured elsewhere."""
    from hsd_opt.models.random_weights import config_of, shipped_configs, weights_here
    from hsd_opt.models.registry import SPLIT_GGUFS

    for alias, spec in SPLIT_GGUFS.items():
        assert alias in shipped_configs() and not weights_here(alias)
        assert f"({config_of(alias)['num_hidden_layers']} layers)" in spec.title


def test_the_costs_record_how_the_torch_path_ran(tiny, tmp_path, monkeypatch):
    """Costs measured with copies reading their codes (``HSD_WEIGHT_ONLY=1``, on the torch path) say so, and a
    merge carries it with the costs: a plan's costs are those of one way of running."""
    plain = _profile(tiny, tmp_path / "plain.json", "--costs-only")
    assert plain.provenance.get("torch_path") == {"fixed_shapes": False, "compiled": False, "cuda_graphs": False,
                                                     "weight_only": False, "triton_attention": False}
    monkeypatch.setenv("HSD_KERNELS", "0")
    monkeypatch.setenv("HSD_WEIGHT_ONLY", "1")
    codes = _profile(tiny, tmp_path / "codes.json", "--costs-only")
    assert codes.provenance.get("torch_path") == {"fixed_shapes": False, "compiled": False, "cuda_graphs": False,
                                                     "weight_only": True, "triton_attention": False}
    rates = _profile(tiny, tmp_path / "rates.json", "--max-new-tokens", "4")
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "rates.json", "--costs", tmp_path / "codes.json",
                  "-o", tmp_path / "merged.json")
    assert res.exit_code == 0, cli_output(res)
    assert load_profile(tmp_path / "merged.json")[0].provenance.get("costs_from")["torch_path"]["weight_only"]
    assert rates.provenance.get("torch_path")["weight_only"] is True


@pytest.mark.parametrize("change,needle", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"vocab_size": 0}, "vocab_size must be an integer >= 1, got 0"),
    ({"hidden_size": 30, "num_attention_heads": 4}, "cannot build a causal LM of this configuration .*hidden size"),
    ({"pad_token_id": 10**6}, "cannot build a causal LM of this configuration"),
])
def test_a_configuration_no_model_can_be_built_of_is_one_error_naming_the_flag(tmp_path, change, needle):
    """transformers refuses some of these with an assertion or a validation error of its own: one line too."""
    from hsd_opt.models.random_weights import config_of, load_random

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config_of("tiny"), **change}))
    with pytest.raises(HsdError, match=f"^--model.*{needle}"):
        load_random(str(path), device="cpu", dtype="float32")
