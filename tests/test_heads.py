"""Trained exit heads on tiny randomly initialised Llamas: training, the file format, refusal of a
file made for another model, reduced-vocabulary heads, the layered engine with loaded heads, resume, CLI errors."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.heads import (
    HeadsModelMismatch,
    RawHead,
    TranslatorHead,
    evaluate_heads,
    head_layers,
    load_heads,
    save_heads,
    train_heads,
)
from tests.helpers import make_tiny_llama

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32, scale=20.0)


def _seqs(n=10, length=40, seed=1, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tiny):
    return train_heads(tiny, LAYERS, _seqs(), epochs=4, lr=1e-2, progress=False, train_vocab="full")


def test_training_reduces_heldout_kl_and_raises_acceptance(trained):
    for b in LAYERS:
        assert trained.after[b]["kl"] < 0.9 * trained.before[b]["kl"], b
        assert trained.after[b]["acceptance"] > trained.before[b]["acceptance"], b
    assert trained.history[-1]["train_loss"] < trained.history[0]["train_loss"]


def test_untrained_head_is_the_logit_lens(tiny):
    h = torch.randn(5, 32)
    for kind in ("affine", "lowrank"):
        head = TranslatorHead(tiny, kind, rank=4)
        torch.testing.assert_close(head(h), RawHead(tiny)(h))


def test_candidate_vocabulary_training_also_improves(tiny):
    r = train_heads(tiny, [2], _seqs(), epochs=3, lr=1e-2, progress=False, train_vocab="candidates", topk=4,
                    negatives=8)
    assert r.after[2]["kl"] < r.before[2]["kl"]


def test_save_load_round_trip_is_exact(tiny, trained, tmp_path):
    path = tmp_path / "heads.safetensors"
    header = save_heads(path, trained.heads, tiny, model_id="tiny-a", revision="r1",
                        training_data_sha256=trained.data_sha256, train=trained.summary())
    assert header["layers"] == LAYERS and header["kind"] == "affine" and header["vocab_subset"] is None
    heads, meta = load_heads(path, tiny, expected_model_id="tiny-a", expected_revision="r1")
    assert sorted(heads) == LAYERS
    assert meta["model"] == "tiny-a" and meta["training_data_sha256"] == trained.data_sha256
    h = torch.randn(7, 32)
    for b in LAYERS:
        assert torch.equal(heads[b](h), trained.heads[b](h))
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == {f"layer{b}.{n}" for b in LAYERS for n in ("weight", "bias")}


def test_lowrank_round_trip(tiny, tmp_path):
    r = train_heads(tiny, [2], _seqs(4), kind="lowrank", rank=4, epochs=1, progress=False, evaluate=False)
    path = tmp_path / "lr.safetensors"
    save_heads(path, r.heads, tiny, model_id="tiny-a", revision="r1")
    heads, meta = load_heads(path, tiny)
    assert meta["kind"] == "lowrank" and meta["rank"] == 4
    h = torch.randn(3, 32)
    assert torch.equal(heads[2](h), r.heads[2](h))


def test_heads_for_a_different_model_are_refused(tiny, trained, tmp_path):
    path = tmp_path / "heads.safetensors"
    save_heads(path, trained.heads, tiny, model_id="tiny-a", revision="r1")
    other = make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=48, heads=4)
    with pytest.raises(HeadsModelMismatch, match=r"heads\.safetensors: hidden_size: .*32.*48"):
        load_heads(path, other)
    other_vocab = make_tiny_llama(seed=3, vocab_size=80, layers=4, hidden=32)
    with pytest.raises(HsdError, match="vocab_size"):
        load_heads(path, other_vocab)
    with pytest.raises(HsdError, match=r"heads\.safetensors: model: .*'tiny-a'.*'tiny-b'"):
        load_heads(path, tiny, expected_model_id="tiny-b")
    with pytest.raises(HsdError, match=r"revision: .*'r1'.*'r2'"):
        load_heads(path, tiny, expected_model_id="tiny-a", expected_revision="r2")


def test_missing_or_corrupt_file_is_an_input_file_error(tiny, tmp_path):
    with pytest.raises(InputFileError, match="nope.safetensors: file not found"):
        load_heads(tmp_path / "nope.safetensors", tiny)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(InputFileError, match="bad.safetensors"):
        load_heads(bad, tiny)
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(InputFileError, match="not an hsd heads file"):
        load_heads(plain, tiny)


def test_reduced_vocab_head_is_a_proper_distribution_on_its_subset(tiny, tmp_path):
    r = train_heads(tiny, [1, 3], _seqs(), vocab_subset=16, epochs=2, lr=1e-2, progress=False)
    ids = r.vocab_ids
    assert ids.numel() == 16
    h = torch.randn(6, 32)
    z = r.heads[3](h)
    assert z.shape == (6, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(z[:, outside]).all() and torch.isfinite(z[:, ids]).all()
    q = torch.softmax(z, -1)
    torch.testing.assert_close(q.sum(-1), torch.ones(6))
    assert (q[:, outside] == 0).all()
    path = tmp_path / "sub.safetensors"
    save_heads(path, r.heads, tiny, model_id="tiny-a", revision="r1")
    heads, meta = load_heads(path, tiny)
    assert meta["vocab_subset"] == 16
    assert torch.equal(heads[3](h), z)


def test_layered_engine_uses_loaded_heads(tiny, trained, tmp_path):
    path = tmp_path / "heads.safetensors"
    save_heads(path, trained.heads, tiny, model_id="tiny-a", revision="r1")
    heads, _ = load_heads(path, tiny)
    lm = LayeredLM(tiny, heads)
    raw = LayeredLM(tiny)
    ids = _seqs(1, 12, seed=5)[0]
    hs = raw.hidden_states(ids, [2])
    st = lm.new_state(16, save_boundaries=[2])
    lm.append(st, ids)
    lm.advance(st, 2)
    got = lm.logits(st, 2, 0, len(ids))
    torch.testing.assert_close(got, heads[2](hs[2]).float())
    assert not torch.allclose(got, raw.head(hs[2], 2))
    # the last boundary still uses the model's own head
    lm.advance(st, 4)
    torch.testing.assert_close(lm.logits(st, 4, 0, len(ids)), raw.head(raw.hidden_states(ids, [4])[4], 4))


def test_resume_after_interruption_matches_an_uninterrupted_run(tiny, tmp_path):
    seqs = _seqs(6, 30)
    kw = dict(epochs=2, lr=1e-2, progress=False, evaluate=False, train_vocab="full")
    full = train_heads(tiny, [2, 3], seqs, **kw)
    ckpt = tmp_path / "h.ckpt"

    def boom(msg):
        if msg.startswith("epoch 1/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, log=boom, **kw)
    assert ckpt.is_file()
    kept = ckpt.read_bytes()
    with pytest.raises(HsdError, match="a checkpoint of an interrupted training exists; pass --resume"):
        train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, **kw)      # --resume forgotten: it was replaced
    assert ckpt.read_bytes() == kept
    msgs = []
    resumed = train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, resume=True, log=msgs.append, **kw)
    assert any(m.startswith("resuming") for m in msgs)
    h = torch.randn(4, 32)
    for b in (2, 3):
        torch.testing.assert_close(resumed.heads[b](h), full.heads[b](h))
    with pytest.raises(HsdError, match="different settings"):
        train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, resume=True, **dict(kw, lr=5e-3))
    ck = torch.load(str(ckpt), weights_only=False)        # an optimizer moment of another shape: refused naming
    state = next(iter(ck["opt"]["state"].values()))          # the file (it was torch's traceback at the first step)
    state["exp_avg"] = torch.zeros(3)
    torch.save(ck, str(ckpt))
    with pytest.raises(HsdError, match=r"h\.ckpt: a damaged heads training checkpoint \(ValueError: the optimizer's "
                                       r"exp_avg has shape \(3,\)"):
        train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, resume=True, **kw)


def test_an_epoch_resumed_midway_records_the_whole_epochs_mean_loss(tiny, tmp_path, monkeypatch):
    """A checkpoint written mid-epoch keeps the epoch's loss so far: the resumed run's history equals an
    uninterrupted run's (it counted only the sequences after the resume)."""
    import hsd_opt.heads.train as train_mod

    seqs = _seqs(6, 30)
    kw = dict(epochs=2, lr=1e-2, progress=False, evaluate=False, train_vocab="full")
    full = train_heads(tiny, [2, 3], seqs, **kw)
    ckpt, real, calls = tmp_path / "h.ckpt", train_mod._train_sequence, []

    def stop_in_the_second_epoch(*a, **k):
        calls.append(1)
        if len(calls) == 10:  # midway through the second epoch (5 training sequences per epoch, 1 held out)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "_train_sequence", stop_in_the_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, checkpoint_every=0.0, **kw)
    monkeypatch.setattr(train_mod, "_train_sequence", real)
    msgs = []
    resumed = train_heads(tiny, [2, 3], seqs, checkpoint=ckpt, resume=True, log=msgs.append, **kw)
    assert any(m.startswith("resuming from") and "epoch 2, sequence 4" in m for m in msgs), msgs
    assert [h["train_loss"] for h in resumed.history] == pytest.approx([h["train_loss"] for h in full.history],
                                                                      rel=1e-5)


def test_head_layers():
    assert head_layers(None, 5) == [1, 2, 3, 4]
    assert head_layers([4, 2, 3, 4], 30) == [2, 3, 4]
    for bad in ([30], [0], [2, 31]):
        with pytest.raises(HsdError, match=r"--layers: layer \d+ is out of range: exit heads go after layers 1\.\.29"):
            head_layers(bad, 30)
    with pytest.raises(HsdError, match="--layers: no layers given"):   # heads need at least one exit
        head_layers([], 30)


def test_evaluate_raw_last_layer_agrees_fully(tiny):
    r = evaluate_heads(tiny, {3: RawHead(tiny)}, _seqs(2, 10))
    assert 0 < r[3]["acceptance"] <= 1


def test_cli_errors_exit_2_with_one_line(tmp_path):
    from hsd_opt.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["heads", "eval", "--heads", str(tmp_path / "missing.safetensors")])
    assert res.exit_code == 2
    assert "missing.safetensors: file not found" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["heads", "train", "--kind", "mlp", "--out", str(tmp_path / "h.safetensors")])
    assert res.exit_code == 2 and "--kind" in res.output
    res = runner.invoke(app, ["heads", "train", "--prompts", str(tmp_path / "p.jsonl"),
                              "--out", str(tmp_path / "h.safetensors")])
    assert res.exit_code == 2 and "--prompts " in res.output and "p.jsonl: file not found" in res.output
    for cmd in (["train", "--out", str(tmp_path / "h.safetensors")],         # a directory: said so (not "not found")
                ["eval", "--heads", str(tmp_path / "missing.safetensors")]):
        res = runner.invoke(app, ["heads", *cmd, "--prompts", str(tmp_path)])
        assert res.exit_code == 2 and f"--prompts {tmp_path}: is a directory" in res.output, res.output


def test_batched_generation_matches_layered_greedy(tiny):
    from hsd_opt.heads.data import _generate_batched, split_sequences

    prompts = [_seqs(1, n, seed=n)[0] for n in (5, 9, 3)]  # different lengths: left padding
    seqs, plens = _generate_batched(tiny, prompts, 6, None, 0.0, 1.0, 0, 8, False)
    lm = LayeredLM(tiny)
    for x, s, pl in zip(prompts, seqs, plens):
        assert pl == len(x) and s[:pl] == x and len(s) == pl + 6
        st = lm.new_state(len(x) + 6)
        lm.append(st, x)
        out = []
        for _ in range(6):
            lm.advance(st, 4)
            t = int(lm.logits(st, 4, st.n - 1, st.n)[0].argmax())
            out.append(t)
            lm.append(st, [t])
        assert s[pl:] == out
    tr, ho = split_sequences(_seqs(10, 4), 0.2)
    assert len(tr) == 8 and len(ho) == 2


def test_training_works_with_autograd_globally_off(tiny):
    prev = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # as load_model() leaves it
    try:
        r = train_heads(tiny, [2], _seqs(4), epochs=1, lr=1e-2, progress=False, evaluate=False)
        assert not torch.equal(r.heads[2].weight, torch.zeros_like(r.heads[2].weight))
    finally:
        torch.set_grad_enabled(prev)


def test_a_reduced_vocabulary_heads_evaluation_says_the_mass_it_cannot_draft(tiny):
    """The KL of a head over a reduced vocabulary is to the final layer renormalised on that vocabulary, so the
    evaluation also reports the final layer's mass outside it: here the final layer itself cut to 16 tokens (KL 0
    on its vocabulary, acceptance = the mass inside), against the mass computed from the model's own logits."""
    seqs = _seqs(2, 12)
    vocab = torch.arange(0, 64, 4)
    r = evaluate_heads(tiny, {4: RawHead(tiny, vocab)}, seqs)[4]
    with torch.no_grad():
        p = torch.cat([torch.softmax(tiny(torch.tensor([s])).logits[0].float(), -1) for s in seqs])
    outside = (1 - p[:, vocab].sum(-1)).mean().item()
    assert outside > 0.3
    assert r["outside"] == pytest.approx(outside, abs=1e-4)
    assert r["acceptance"] == pytest.approx(1 - outside, abs=1e-4) and r["kl"] == pytest.approx(0, abs=1e-4)
    assert evaluate_heads(tiny, {4: RawHead(tiny)}, seqs)[4]["outside"] == 0


def test_the_heads_table_shows_the_mass_outside_a_reduced_vocabulary():
    from rich.console import Console

    from hsd_opt.commands.heads import results_table

    def shown(after):
        c = Console(width=200, record=True)
        c.print(results_table("t", {2: {"acceptance": 0.5, "greedy": 0.5, "kl": 1.0}}, after))
        return c.export_text()

    full = shown({2: {"acceptance": 0.6, "greedy": 0.6, "kl": 0.5, "outside": 0.0}})
    reduced = shown({2: {"acceptance": 0.6, "greedy": 0.6, "kl": 0.5, "outside": 0.21}})
    assert "outside" not in full and "mass outside its vocab" in reduced and "0.210" in reduced


def test_heads_saved_with_the_bare_model_of_a_loaded_one_load_for_it(trained, tmp_path):
    """``save_heads(path, heads, loaded.model)`` recorded the model's config path (a GGUF's conversion folder) and
    no revision, which ``load_heads(path, loaded)`` then refused as another model; the bare model now carries the
    id and revision of the :class:`LoadedModel` that holds it."""
    from hsd_opt.models.loading import LoadedModel

    model = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32, scale=20.0)
    model.config._name_or_path = str(tmp_path / "converted-from-gguf")
    loaded = LoadedModel(model, None, "embedded:tiny", "sha256:" + "ab" * 32, "embedded", "cpu", "float32")
    header = save_heads(tmp_path / "h.safetensors", trained.heads, loaded.model)
    assert (header["model"], header["revision"]) == ("embedded:tiny", "sha256:" + "ab" * 32)
    heads, _ = load_heads(tmp_path / "h.safetensors", loaded)
    assert sorted(heads) == LAYERS
    other = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32, scale=20.0)   # held by no LoadedModel
    assert save_heads(tmp_path / "o.safetensors", trained.heads, other)["revision"] == ""
