"""Learning-free drafters : context n-grams, model bigram, mixed batches, factory. Tiny models only."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from hsd_opt.drafters import make_token_drafter
from hsd_opt.drafters.bigram import (
    BigramDrafter,
    build_bigram_table,
    load_or_build_bigram_table,
    table_path,
    unigram_from_weights,
)
from hsd_opt.drafters.mixed import MixedNgramDrafter, mixed_greedy_decode, verify_batch, verify_batch_greedy
from hsd_opt.drafters.ngram import ContextNgramDrafter
from hsd_opt.errors import HsdError


# ---------------------------------------------------------------- context n-gram matcher
def test_ngram_counts_rank_first():
    # after query (1,): continuations 5 (twice) and 7 (once, but more recent) -> count wins
    ctx = [1, 5, 9, 1, 5, 9, 1, 7, 9, 1]
    d = ContextNgramDrafter(q=1, w=1)
    assert d.candidates(ctx, 5, 1) == [[5], [7]]
    assert d.propose(ctx, 1) == [5]


def test_ngram_recency_breaks_ties():
    ctx = [1, 5, 9, 1, 7, 9, 1]
    d = ContextNgramDrafter(q=1, w=2)
    assert d.candidates(ctx, 5, 2) == [[7, 9], [5, 9]]  # equal counts: the later occurrence first
    assert d.propose(ctx, 2) == [7, 9]


def test_ngram_longer_query_first_then_backoff():
    # query (3, 1): seen once, followed by 8; query (1,) alone is followed by 5 three times
    ctx = [1, 5, 0, 1, 5, 0, 1, 5, 3, 1, 8, 2, 3, 1]
    d = ContextNgramDrafter(q=2, w=1)
    assert d.candidates(ctx, 3, 1) == [[8], [5]]
    assert d.propose(ctx, 1) == [8]
    # unknown bigram query backs off to the unigram query
    ctx2 = [1, 5, 0, 1, 5, 0, 4, 1]
    assert ContextNgramDrafter(q=2, w=1).propose(ctx2, 1) == [5]
    assert ContextNgramDrafter(q=2, min_q=2, w=1).candidates(ctx2, 3, 1) == []


def test_ngram_only_full_continuations_and_exact_n():
    ctx = [4, 1, 2, 3, 1, 2]
    d = ContextNgramDrafter(q=2, w=3)
    # query (1, 2) occurs at the start with continuation [3, 1, 2]; the query itself never matches
    assert d.propose(ctx, 3) == [3, 1, 2]
    # n = 6 has no full continuation: chained one-token predictions, still exactly 6 ids
    out = d.propose(ctx, 6)
    assert len(out) == 6 and out[:3] == [3, 1, 2]
    assert d._seq == ctx  # the virtual extension was undone


def test_ngram_no_match_fallback_and_batch_shape():
    d = ContextNgramDrafter(q=3, w=4)
    assert d.propose([10, 11, 12], 4) == [12, 12, 12, 12]  # nothing repeats: repeat the last token
    assert d.propose([], 3) == [0, 0, 0]
    rows = d.propose_batch([1, 2, 1, 3, 1, 4, 1], 5, 1)
    assert len(rows) == 5 and all(len(r) == 1 for r in rows)
    assert rows[:3] == [[4], [3], [2]]


def test_ngram_incremental_index_matches_fresh():
    rng = random.Random(0)
    d = ContextNgramDrafter(q=3, w=3)
    seq = [rng.randrange(6) for _ in range(40)]
    d.reset(seq[:10])
    ctx = seq[:10]
    for step in range(60):
        if rng.random() < 0.3 and len(ctx) > 5:  # rollback
            ctx = ctx[: len(ctx) - rng.randrange(1, 4)]
        else:
            acc = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            d.observe(ctx, acc)
            ctx = ctx + acc
        fresh = ContextNgramDrafter(q=3, w=3)
        assert d.propose_batch(ctx, 4, 3) == fresh.propose_batch(ctx, 4, 3)
        assert d.propose(ctx, 5) == fresh.propose(ctx, 5)


# ---------------------------------------------------------------- tiny model
def tiny_llama(seed: int = 0, init: float = 0.2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def table(model):
    return build_bigram_table(model, top_k=8, batch_size=24, bos_id=None, progress=False)


def test_bigram_table_equals_direct_model_calls(model, table):
    assert table.ids.shape == (64, 8) and table.probs.shape == (64, 8)
    with torch.no_grad():
        for x in range(64):
            p = torch.softmax(model(torch.tensor([[x]])).logits[0, -1].float(), -1)
            top = torch.topk(p, 8)
            assert table.ids[x].tolist() == top.indices.tolist()
            np.testing.assert_allclose(table.probs[x], top.values.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_bigram_table_with_bos(model):
    t = build_bigram_table(model, top_k=4, bos_id=1, batch_size=7, progress=False, vocab_size=20)
    assert t.meta["bos_id"] == 1
    assert build_bigram_table(model, top_k=4, progress=False, vocab_size=2).meta["bos_id"] == model.config.bos_token_id
    with torch.no_grad():
        for x in range(20):
            p = torch.softmax(model(torch.tensor([[1, x]])).logits[0, -1], -1)
            assert t.ids[x].tolist() == torch.topk(p, 4).indices.tolist()


def test_the_kv_cache_goes_by_the_keyword_this_transformers_takes(model):
    from hsd_opt.models.loading import cache_keyword

    class New:
        def forward(self, input_ids, cache=None, use_cache=None):
            pass

    class Old:
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
    with warnings.catch_warnings(record=True) as caught:       # the prefix cache path, no deprecated keyword
        warnings.simplefilter("always")
        t = build_bigram_table(model, top_k=4, bos_id=1, batch_size=7, progress=False, vocab_size=7)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert t.meta["bos_id"] == 1


def test_unigram_is_distance_from_mean(model):
    ids, logp = unigram_from_weights(model, keep=64)
    E = model.get_input_embeddings().weight.detach()
    U = model.get_output_embeddings().weight.detach()
    C = E.T @ E / E.shape[0]
    D = U - U.mean(0)
    d = torch.sqrt(torch.einsum("vi,ij,vj->v", D, C, D))
    assert ids.tolist() == torch.argsort(d, stable=True).tolist()
    np.testing.assert_allclose(np.exp(logp).sum(), 1.0, rtol=1e-4)
    np.testing.assert_allclose(logp[0], float(-d.min() - torch.logsumexp(-d, 0)), rtol=1e-4)


def test_bigram_cache_round_trip(model, tmp_path):
    t1 = load_or_build_bigram_table(model, "abc123", top_k=4, cache_dir=tmp_path, bos_id=None, progress=False)
    path = table_path(tmp_path, "abc123", 4, None)
    assert path.exists() and t1.path == str(path)
    t2 = load_or_build_bigram_table(None, "abc123", top_k=4, cache_dir=tmp_path, bos_id=None)  # must load
    assert np.array_equal(t1.ids, t2.ids) and np.array_equal(t1.probs, t2.probs)
    assert np.array_equal(t1.unigram_ids, t2.unigram_ids) and t2.meta["model_hash"] == "abc123"
    with pytest.raises(HsdError):
        load_or_build_bigram_table(None, "other", top_k=4, cache_dir=tmp_path, bos_id=None)
    with pytest.raises(HsdError):
        load_or_build_bigram_table(None, "abc123", top_k=4, cache_dir=tmp_path)  # "auto" needs the model


def test_bigram_drafter_and_extended_bigram(table):
    d = BigramDrafter(table)
    x = 5
    chain = d.propose([3, x], 4)
    assert len(chain) == 4 and chain[0] == table.ids[x, 0] and chain[1] == table.ids[chain[0], 0]
    assert table.extended(x, 1, 4) == [chain]  # beam width 1 is greedy chaining
    rows = d.propose_batch([x], 8, 2)
    assert len(rows) == 8 and len({tuple(r) for r in rows}) == 8
    # with k = top_k the 2-step beam is exact: compare with brute force over all chains
    lp = np.log(table.probs)
    brute = sorted(((lp[x, i] + lp[table.ids[x, i], j], (int(table.ids[x, i]), int(table.ids[table.ids[x, i], j])))
                    for i in range(8) for j in range(8)), key=lambda t: -t[0])
    assert [tuple(r) for r in rows] == [c for _, c in brute[:8]]
    assert d.propose([], 3)[0] == table.unigram_ids[0]


# ---------------------------------------------------------------- mixed batches + verification
def _logits_fn(model):
    def fn(ids):
        with torch.no_grad():
            return model(input_ids=ids).logits
    return fn


def _greedy(model, prompt, n):
    ctx = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ctx.append(int(model(torch.tensor([ctx])).logits[0, -1].argmax()))
    return ctx[len(prompt):]


def test_mixed_rows_ngram_first_then_bigram(table):
    m = MixedNgramDrafter(ContextNgramDrafter(q=1), BigramDrafter(table), k=4, w=2)
    ctx = [7, 8, 9, 7, 8, 3, 7]
    rows = m.propose_batch(ctx, 4, 2)
    assert rows[:2] == [[8, 3], [8, 9]] and m.last_sources == ["ngram", "ngram", "bigram", "bigram"]
    assert len({tuple(r) for r in rows}) == 4
    assert m.propose(ctx, 2) == [8, 3]


@pytest.mark.slow
@pytest.mark.parametrize("k,w", [(1, 3), (4, 3), (6, 5)])
def test_mixed_greedy_equals_target_greedy(model, table, k, w):
    prompt = [3, 17, 42, 3, 17, 9, 25, 3]
    ref = _greedy(model, prompt, 40)
    drafter = MixedNgramDrafter(ContextNgramDrafter(q=2), BigramDrafter(table), k=k, w=w)
    out, stats = mixed_greedy_decode(_logits_fn(model), prompt, drafter, k, w, 40)
    assert out == ref
    assert stats["calls"] <= 40 and stats["tokens_per_call"] >= 1


def test_verify_picks_longest_row_and_bonus(model):
    ctx = [3, 17, 42]
    ref = _greedy(model, ctx, 4)
    bad = (ref[0] + 1) % 64
    rows = [[bad, 0, 0, 0], ref[:2] + [(ref[2] + 1) % 64, 0], ref[:1] + [0, 0, 0]]
    res = verify_batch_greedy(_logits_fn(model), ctx, rows)
    assert (res.row, res.n_accepted, res.tokens) == (1, 2, ref[:3])
    # a logits_fn returning only the last w + 1 positions works too
    res2 = verify_batch_greedy(lambda ids: _logits_fn(model)(ids)[:, -5:], ctx, rows)
    assert res2 == res


def test_sampling_with_several_rows_is_refused(model):
    with pytest.raises(HsdError, match="refused"):
        verify_batch(_logits_fn(model), [1, 2], [[3, 4], [5, 6]], temperature=0.7)
    g = torch.Generator().manual_seed(0)
    res = verify_batch(_logits_fn(model), [1, 2], [[3, 4]], temperature=0.7, generator=g)
    assert len(res.tokens) == res.n_accepted + 1 and 0 <= res.n_accepted <= 2


def test_factory_rebuilds_from_config(table, tmp_path):
    table.save(tmp_path / "t.npz")
    ng = ContextNgramDrafter(q=3, w=5, name="ng3")
    bg = BigramDrafter(str(tmp_path / "t.npz"))
    mixed = MixedNgramDrafter(ng, bg, k=3, w=2)
    ctx = [1, 2, 3, 1, 2, 4, 1, 2]
    for d in (ng, bg, mixed):
        cfg = d.config()
        rebuilt = make_token_drafter(**cfg)
        assert rebuilt.config() == cfg
        assert rebuilt.propose_batch(ctx, 3, 2) == d.propose_batch(ctx, 3, 2)
    with pytest.raises(HsdError):
        make_token_drafter("nope")
    with pytest.raises(HsdError):
        make_token_drafter("ngram_context", bogus=1)


@pytest.mark.parametrize("kind,config,said", [
    ("ngram_context", {"w": -3}, "w must be an integer >= 1, got -3"),
    ("ngram_context", {"max_occurrences": 0}, "max_occurrences must be an integer >= 1"),
    ("ngram_context", {"q": 2.7}, "q must be an integer in 1 .. 64, got 2.7"),
    ("ngram_context", {"q": 10 ** 7}, "q must be an integer in 1 .. 64"),
    ("ngram_context", {"q": "2"}, "q must be an integer in 1 .. 64, got '2'"),
    ("ngram_context", {"abstain": "no"}, "abstain must be true or false, got 'no'"),
    ("ngram_context", {"name": 5}, "name must be a non-empty string"),
    ("aded", {"c2": 0}, "c2 must be a number in (0, inf], got 0"),
    ("aded", {"c1": float("nan")}, "c1 must be a number in [0, inf]"),
    ("aded", {"iterations": 10 ** 9}, "iterations must be an integer in 1 .. 100000"),
    ("aded", {"iterations": 0}, "iterations must be an integer in 1 .. 100000"),
    ("aded", {"max_children": 0}, "max_children must be an integer >= 1"),
    ("aded", {"increment": -1}, "increment must be a number in [0, 1]"),
    ("mixed_ngram", {"k": 0}, "k must be an integer >= 1"),
    ("mixed_ngram", {"ngram": {"kind": "bigram_model", "table": "T"}}, "its 'ngram' must be a ngram_context"),
    ("mixed_ngram", {"bigram": {"kind": "ngram_context"}}, "its 'bigram' must be a bigram_model or unigram_model"),
    ("mixed_ngram", {"bigram": 3}, "its 'bigram' must be a bigram_model or unigram_model drafter's config, got int"),
])
def test_a_config_out_of_range_is_refused_naming_the_field(table, tmp_path, kind, config, said):
    """A hand-edited plan's drafter values are refused when the drafter is built, naming the field (they crashed
    at the first draft, hung, or were read as something else: abstain "no" as true)."""
    from hsd_opt.drafters.aded import TrigramMatrix

    table.save(tmp_path / "t.npz")
    TrigramMatrix({(1, 2): {3: 1.0}}).save(tmp_path / "m.npz")
    base = {"aded": {"matrix": str(tmp_path / "m.npz")},
            "mixed_ngram": {"ngram": {"kind": "ngram_context"},
                            "bigram": {"kind": "bigram_model", "table": str(tmp_path / "t.npz")}}}.get(kind, {})
    full = {**base, **{k: (str(tmp_path / "t.npz") if v == "T" else v) for k, v in config.items()}}
    if isinstance(full.get("ngram"), dict) and full["ngram"].get("table") == "T":
        full["ngram"] = {**full["ngram"], "table": str(tmp_path / "t.npz")}
    with pytest.raises(HsdError) as e:
        make_token_drafter(kind, **full)
    assert said in str(e.value), str(e.value)


def test_a_damaged_table_is_refused_naming_it_and_a_damaged_cache_file_is_built_again(model, table, tmp_path):
    """A cut ``.npz`` (a crash, a full disk) is one line naming the file where it is a plan's; in the cache it is
    built again and replaced."""
    from hsd_opt.drafters.aded import TrigramMatrix
    from hsd_opt.errors import InputFileError

    table.save(tmp_path / "t.npz")
    TrigramMatrix({(1, 2): {3: 1.0}}).save(tmp_path / "m.npz")
    for name, kind, key in (("t.npz", "bigram_model", "table"), ("m.npz", "aded", "matrix")):
        data = (tmp_path / name).read_bytes()
        for cut in (data[: len(data) // 2], b""):
            (tmp_path / name).write_bytes(cut)
            with pytest.raises(InputFileError, match=f"{name}: not a "):
                make_token_drafter(kind, **{key: str(tmp_path / name)})
    built = load_or_build_bigram_table(model, "k1", top_k=4, cache_dir=tmp_path, bos_id=None, progress=False)
    path = table_path(tmp_path, "k1", 4, None)
    path.write_bytes(path.read_bytes()[:100])
    again = load_or_build_bigram_table(model, "k1", top_k=4, cache_dir=tmp_path, bos_id=None, progress=False)
    assert np.array_equal(again.ids, built.ids)
    with pytest.raises(InputFileError):             # no model to build it from: the damaged file is named
        path.write_bytes(b"")
        load_or_build_bigram_table(None, "k1", top_k=4, cache_dir=tmp_path, bos_id=None)


def test_a_table_whose_arrays_do_not_fit_together_is_refused_naming_the_array(table, tmp_path):
    """A file that unzips but holds wrong values (arrays of other lengths or shapes, negative or too large ids, a NaN)
    is one line naming the file and the array: it loaded, then crashed a search (NaN), drafted ids the target
    refused, or read wrong rows."""
    import json

    from hsd_opt.drafters.aded import MATRIX_FORMAT, TrigramMatrix
    from hsd_opt.drafters.bigram import TABLE_FORMAT, BigramTable
    from hsd_opt.errors import InputFileError

    good = {"a": np.array([1, 2], np.int32), "b": np.array([2, 3], np.int32), "c": np.array([3, 1], np.int32),
            "p": np.array([0.5, 1.0], np.float32)}
    for change, field in (({"c": np.array([3], np.int32)}, "c"), ({"a": np.array([1, -2], np.int32)}, "a"),
                          ({"p": np.array([0.5, np.nan], np.float32)}, "p")):
        np.savez(tmp_path / "m.npz", **{**good, **change}, meta=np.array(json.dumps({"format": MATRIX_FORMAT})))
        with pytest.raises(InputFileError, match=rf"m.npz: {field}: "):
            TrigramMatrix.load(tmp_path / "m.npz")
    meta = np.array(json.dumps({"format": MATRIX_FORMAT}))
    for change, field in (({"meta": np.array("[1, 2]")}, "meta"), ({"meta": np.array("null")}, "meta"),  # crashed
                          ({"p": np.array(["x", "y"])}, "p"), ({"c": np.array([3.0, 1.0])}, "c")):  # a TypeError
        np.savez(tmp_path / "m.npz", **{**good, "meta": meta, **change})
        with pytest.raises(InputFileError, match=rf"m.npz: {field}: not a tri-gram matrix"):
            TrigramMatrix.load(tmp_path / "m.npz")
    np.savez(tmp_path / "m.npz", **good, meta=meta)
    assert TrigramMatrix.load(tmp_path / "m.npz").get(2, 3, 1) == 1.0
    arrays = {"ids": table.ids, "probs": table.probs, "unigram_ids": table.unigram_ids,
              "unigram_logp": table.unigram_logp}
    bad_ids = table.ids.copy()
    bad_ids[5, 0] = table.vocab_size
    for change, field in (({"ids": bad_ids}, "ids"), ({"probs": table.probs[:, :3]}, "ids"),
                          ({"ids": table.ids[:, 0]}, "ids"), ({"unigram_ids": table.unigram_ids - 100}, "unigram_ids")):
        np.savez(tmp_path / "t.npz", **{**arrays, **change}, meta=np.array(json.dumps({"format": TABLE_FORMAT})))
        with pytest.raises(InputFileError, match=rf"t.npz: {field}: "):
            BigramTable.load(tmp_path / "t.npz")
    for change, field in (({"meta": np.array("null")}, "meta"), ({"probs": table.probs.astype(str)}, "probs"),
                          ({"unigram_ids": table.unigram_ids.astype(np.float32)}, "unigram_ids")):
        np.savez(tmp_path / "t.npz", **{**arrays, "meta": np.array(json.dumps({"format": TABLE_FORMAT})), **change})
        with pytest.raises(InputFileError, match=rf"t.npz: {field}: not a bigram table"):
            BigramTable.load(tmp_path / "t.npz")
    np.savez(tmp_path / "t.npz", **arrays, meta=np.array(json.dumps({"format": TABLE_FORMAT})))
    assert np.array_equal(BigramTable.load(tmp_path / "t.npz").ids, table.ids)


def test_a_proposal_of_another_size_or_form_is_refused_naming_the_argument(table):
    """``propose(ctx, 2.5)`` was a TypeError from a slice, ``propose_batch`` with ``k`` 0 or below returned a row
    (ADED's differing for 0 and -1); each drafter now refuses them naming ``n``, ``k`` or ``w``."""
    from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix

    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    drafters = [ContextNgramDrafter(), AdedDrafter(TrigramMatrix.from_sequences([[1, 2, 3, 4] * 3])),
                BigramDrafter(table), MixedNgramDrafter(ContextNgramDrafter(), BigramDrafter(table))]
    for d in drafters:
        d.reset(ctx)
        for n in (2.5, "3", None, float("nan"), -1, True):
            with pytest.raises(HsdError, match=r"^n: expected an integer >= 0"):
                d.propose(ctx, n)
        for k, w, said in ((0, 2, "k: "), (-1, 2, "k: "), (2.0, 2, "k: "), (2, 1.5, "w: ")):
            with pytest.raises(HsdError, match=f"^{said}expected an integer"):
                d.propose_batch(ctx, k, w)
        assert d.propose(ctx, np.int64(2)) == d.propose(ctx, 2) and len(d.propose_batch(ctx, 3, 2)) == 3


def test_a_drafted_id_outside_the_targets_vocabulary_is_an_error_not_a_crash(model):
    """A table or matrix made for a model of a larger vocabulary drafts ids the target has no row for: one line
    naming the drafter (it was an IndexError deep in the embedding)."""
    from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.runtime.decode import HSD, Level

    lm = LayeredLM(model)
    rows = {(a, b): {5000: 1.0} for a in range(64) for b in [*range(64), 5000]}    # 5000 after any pair
    aded = AdedDrafter(TrigramMatrix(rows), iterations=5)
    h = HSD([Level("aded", drafter=aded), Level("t", lm, 2)], [3])
    with pytest.raises(HsdError, match="drafter 'aded' proposed token id 5000, outside the target's vocabulary"):
        h.generate([3, 1, 2], 4)


def _toy_logits_fn(V=6, T=8):
    """A deterministic toy 'model': next-token logits depend on the last two tokens only (cheap, exact)."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, V, V, generator=g) * 1.5

    def fn(ids):
        prev = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
        return table[prev, ids]  # [k, L, V]
    return fn, table


@pytest.mark.slow
def test_multi_draft_sampling_is_lossless():
    """Joint law of the first two emitted tokens equals the target's, with 3 overlapping draft rows."""
    fn, table = _toy_logits_fn()
    ctx = [1, 2]
    rows = [[3, 4], [3, 0], [5, 1]]
    g = torch.Generator().manual_seed(0)
    N = 6000
    counts = torch.zeros(6, 6)
    for _ in range(N):
        res = verify_batch(fn, ctx, rows, temperature=1.0, generator=g, multi_draft=True)
        assert res.tokens[: res.n_accepted] == rows[res.row][: res.n_accepted]
        if len(res.tokens) >= 2:
            counts[res.tokens[0], res.tokens[1]] += 1
        else:  # first token resampled: draw the second from the target to complete the pair
            x = res.tokens[0]
            y = int(torch.multinomial(torch.softmax(table[2, x], -1), 1, generator=g))
            counts[x, y] += 1
    p1 = torch.softmax(table[1, 2], -1)
    joint = p1[:, None] * torch.softmax(table[2, torch.arange(6)], -1)
    emp = counts / N
    # total variation distance between empirical and exact joint law (36 cells, N = 6000: noise ~0.03)
    assert 0.5 * float((emp - joint).abs().sum()) < 0.06


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "bigram", "aded"])
def test_each_drafter_greedy_equals_target_greedy(model, table, kind):
    from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix

    prompt = [5, 9, 5, 9, 33, 2, 5, 9]
    ref = _greedy(model, prompt, 30)
    if kind == "ngram":
        d = ContextNgramDrafter(q=2)
    elif kind == "bigram":
        d = BigramDrafter(table)
    else:
        d = AdedDrafter(TrigramMatrix.from_sequences([prompt + ref[:10]], threshold=1), iterations=20)
    for k in (1, 3):
        out, _ = mixed_greedy_decode(_logits_fn(model), prompt, d, k, 3, 30)
        assert out == ref
