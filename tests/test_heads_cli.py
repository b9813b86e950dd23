"""Trained exit heads through the command line and plans: heads tied to the model they were trained for (however
its folder is named), plans that carry heads (their path, their hash, their model), damaged heads headers, bfloat16
models, and the flags `hsd heads train` and `eval` refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.heads import RawHead, TranslatorHead, evaluate_heads, load_heads, read_heads_file, save_heads, train_heads
from hsd_opt.models.loading import file_sha256, load_model
from tests.helpers import TINY_CHAT_TEMPLATE, cli_output, make_tiny_llama, run_cli, save_tiny, write_plan, write_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder with two tiny models ``tA`` and ``tB`` (one tokenizer, other weights), prompts, and a test cache."""
    r = tmp_path_factory.mktemp("heads-cli")
    save_tiny(r / "tA", seed=0, chat_template=TINY_CHAT_TEMPLATE)
    save_tiny(r / "tB", seed=1, chat_template=TINY_CHAT_TEMPLATE)
    write_prompts(r / "p.jsonl", n=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSD_CACHE", str(r / "cache"))
        yield r


def _heads_for(loaded, path: Path, **kw) -> Path:
    """Heads for layers 1 and 2 of ``loaded``, moved off the raw exit, saved to ``path``."""
    g = torch.Generator().manual_seed(0)
    heads = {b: TranslatorHead(loaded.model, "affine") for b in (1, 2)}
    with torch.no_grad():
        for h in heads.values():
            h.weight.add_(0.05 * torch.randn(h.weight.shape, generator=g))
    save_heads(path, heads, loaded, **kw)
    return path


@pytest.fixture(scope="module")
def heads_a(root):
    """Heads trained (in effect) for ``tA``, loaded as ``tA`` from ``root``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        return _heads_for(load_model("tA", device="cpu", dtype="float32"), root / "hA.safetensors")


def _run(plan: Path):
    return run_cli("run", "--plan", plan, "--prompt", "w1 w2 w3", "--max-new-tokens", "3", "--device", "cpu")


# ------------------------------------------------------------------------------------------ heads in a plan


def test_a_plan_whose_heads_were_made_for_another_model_is_refused(root, heads_a):
    res = _run(write_plan(root / "planB.json", root / "tB", heads=str(heads_a)))
    assert res.exit_code == 2, cli_output(res)
    assert f"planB.json: provenance.heads: {heads_a}: model: the heads were trained for" in cli_output(res)
    assert "Traceback" not in cli_output(res)
    res = _run(write_plan(root / "planA.json", root / "tA", heads=str(heads_a)))
    assert res.exit_code == 0, cli_output(res)


def test_a_plans_missing_heads_file_names_the_plan_and_the_field(root, heads_a, monkeypatch, tmp_path):
    plan = write_plan(root / "planA_rel.json", root / "tA", heads="hA.safetensors")
    monkeypatch.chdir(tmp_path)                 # the relative path is not there from this folder
    res = _run(plan)
    assert res.exit_code == 2, cli_output(res)
    line = [ln for ln in cli_output(res).splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "planA_rel.json: provenance.heads: hA.safetensors: heads file not found" in line[0]


def test_heads_overwritten_since_the_profile_are_refused_by_their_hash(root, heads_a, tmp_path):
    heads = tmp_path / "h.safetensors"
    heads.write_bytes(heads_a.read_bytes())
    plan = write_plan(root / "planA_sha.json", root / "tA", heads=str(heads), heads_sha256=file_sha256(heads))
    assert _run(plan).exit_code == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        _heads_for(load_model("tA", device="cpu", dtype="float32"), heads, training_data_sha256="other")
    res = _run(plan)
    assert res.exit_code == 2, cli_output(res)
    assert "planA_sha.json: provenance.heads_sha256: " in cli_output(res)
    assert "the heads file changed since" in cli_output(res)


def test_a_profile_records_the_heads_by_their_absolute_path(root, heads_a, monkeypatch):
    monkeypatch.chdir(root)
    res = run_cli("profile", "--model", "tA", "--prompts", "p.jsonl", "--out", "prof.json", "--max-new-tokens", "4",
                  "--token-drafters", "none", "--layers", "1,2", "--heads", "hA.safetensors", "--device", "cpu",
                  "--tmax", "3", "--cost-repeats", "1", "--quiet", "--threads", "1")
    assert res.exit_code == 0, cli_output(res)
    prov = json.loads((root / "prof.json").read_text())["provenance"]
    assert prov["heads"] == str(heads_a.resolve()) and prov["heads_sha256"] == file_sha256(heads_a)


# ------------------------------------------------------------------------------------------ the model's name


def test_heads_load_for_the_same_local_model_however_its_folder_is_named(root, heads_a, tmp_path, monkeypatch):
    monkeypatch.chdir(root)
    assert read_heads_file(heads_a)[1]["model"] == str((root / "tA").resolve())
    for name in ("tA", "./tA", str(root / "tA")):
        hs, _ = load_heads(heads_a, load_model(name, device="cpu", dtype="float32"))
        assert sorted(hs) == [1, 2]
    with pytest.raises(HsdError, match="model: the heads were trained for"):
        load_heads(heads_a, load_model("./tB", device="cpu", dtype="float32"))
    monkeypatch.chdir(tmp_path)             # another folder: the absolute path still names tA
    hs, _ = load_heads(heads_a, load_model(str(root / "tA"), device="cpu", dtype="float32"))
    assert sorted(hs) == [1, 2]
    res = run_cli("profile", "--model", root / "tA", "--prompts", root / "p.jsonl", "--out", tmp_path / "p.json",
                  "--max-new-tokens", "2", "--token-drafters", "none", "--layers", "1,2", "--heads", heads_a,
                  "--device", "cpu", "--tmax", "3", "--cost-repeats", "1", "--quiet", "--threads", "1")
    assert res.exit_code == 0, cli_output(res)


def test_heads_that_recorded_a_relative_name_load_by_the_revision(root, tmp_path, monkeypatch):
    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")
    monkeypatch.chdir(tmp_path)             # "tA" is no folder here: recorded as given, as earlier versions did
    path = _heads_for(loaded, tmp_path / "old.safetensors", model_id="tA")
    assert read_heads_file(path)[1]["model"] == "tA"
    hs, _ = load_heads(path, loaded)        # the same weights (revision): the same model
    assert sorted(hs) == [1, 2]
    with pytest.raises(HsdError, match="model: the heads were trained for 'tA'"):
        load_heads(path, load_model(str(root / "tB"), device="cpu", dtype="float32"))


# ------------------------------------------------------------------------------------------ damaged headers


def _damaged(src: Path, dst: Path, **edit) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["hsd_heads"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in edit.items():
        if k.startswith("train_"):
            header["train"] = dict(header.get("train") or {}, **{k[len("train_"):]: v})
        else:
            header[k] = v
    save_file(tensors, str(dst), metadata={"hsd_heads": json.dumps(header)})
    return dst


@pytest.mark.parametrize("edit, field", [
    ({"layers": 5}, "layers"), ({"layers": []}, "layers"), ({"layers": [1, 1]}, "layers"),
    ({"layers": [True, 2]}, "layers"), ({"hidden_size": "abc"}, "hidden_size"), ({"n_layers": 0}, "n_layers"),
    ({"kind": "lowrank", "rank": "x"}, "rank"), ({"train": "x"}, "train"), ({"train_settings": "x"}, "train.settings"),
    ({"train_tokens": "abc"}, "train.tokens"), ({"train_tokens": -5}, "train.tokens"),
    ({"train_holdout": 5}, "train.holdout"), ({"train_prompts": 3}, "train.prompts"),
    ({"train_settings": {"seed": "s"}}, "train.settings.seed"), ({"model": 7}, "model"),
    # hsd heads eval cuts the held-out sequences at it: a traceback after generating them, or a silent slice
    ({"train_settings": {"max_len": "abc"}}, "train.settings.max_len"),
    ({"train_settings": {"max_len": [1]}}, "train.settings.max_len"),
    ({"train_settings": {"max_len": -3}}, "train.settings.max_len")])
def test_a_damaged_header_names_the_file_and_the_field(heads_a, tmp_path, edit, field):
    bad = _damaged(heads_a, tmp_path / "bad.safetensors", **edit)
    with pytest.raises(InputFileError, match=rf"bad\.safetensors: {field}: expected ") as e:
        read_heads_file(bad)
    assert e.value.field == field


def test_damaged_tensors_are_refused(root, heads_a, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(heads_a), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")
    for name, change, field in (("nan", {"layer1.weight": torch.full_like(tensors["layer1.weight"], float("nan"))},
                                 "layer1.weight"),
                                ("float_ids", {"vocab_ids": torch.tensor([5.7, 9.2])}, "vocab_ids"),
                                ("dup_ids", {"vocab_ids": torch.tensor([5, 5, 7])}, "vocab_ids")):
        path = tmp_path / f"{name}.safetensors"
        save_file({**tensors, **change}, str(path), metadata=meta)
        with pytest.raises(InputFileError, match=rf"{name}\.safetensors: {field}: "):
            load_heads(path, loaded)


def test_heads_eval_refuses_a_damaged_header_in_one_line(heads_a, tmp_path):
    bad = _damaged(heads_a, tmp_path / "bad.safetensors", train_tokens="abc")
    res = run_cli("heads", "eval", "--model", "no-such-model", "--heads", bad)
    assert res.exit_code == 2 and "Traceback" not in cli_output(res)
    assert "bad.safetensors: train.tokens: expected an integer >= 1 or null, got 'abc'" in cli_output(res)


# ------------------------------------------------------------------------------------------ bfloat16


def test_the_raw_exit_runs_on_a_bfloat16_model():
    m = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32).to(torch.bfloat16)
    z = RawHead(m)(torch.randn(3, 32))          # float32 hidden states into a bfloat16 LM head
    assert z.shape == (3, 64) and z.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 64, (12,), generator=g).tolist() for _ in range(2)]
    raw = evaluate_heads(m, {1: RawHead(m)}, seqs)[1]
    untrained = evaluate_heads(m, {1: TranslatorHead(m)}, seqs)[1]     # starts as the raw exit
    assert 0 < raw["acceptance"] <= 1 and raw["acceptance"] == pytest.approx(untrained["acceptance"], abs=1e-6)


def test_heads_train_and_eval_run_in_bfloat16(root, tmp_path):
    out = tmp_path / "bf.safetensors"
    res = run_cli("heads", "train", "--model", root / "tA", "--prompts", root / "p.jsonl", "--tokens", "64",
                  "--epochs", "1", "--out", out, "--device", "cpu", "--dtype", "bfloat16", "--layers", "1,2")
    assert res.exit_code == 0, cli_output(res)
    res = run_cli("heads", "eval", "--model", root / "tA", "--heads", out, "--device", "cpu", "--dtype", "bfloat16")
    assert res.exit_code == 0, cli_output(res)


# ------------------------------------------------------------------------------------------ flags and data


def test_heads_eval_reads_the_training_prompts_from_any_folder(root, tmp_path, monkeypatch):
    monkeypatch.chdir(root)
    out = tmp_path / "h.safetensors"
    res = run_cli("heads", "train", "--model", "tA", "--prompts", "p.jsonl", "--tokens", "64", "--epochs", "1",
                  "--out", out, "--device", "cpu", "--layers", "1,2")
    assert res.exit_code == 0, cli_output(res)
    assert read_heads_file(out)[1]["train"]["prompts"] == str(root / "p.jsonl")
    given = tmp_path / "given.json"
    res = run_cli("heads", "eval", "--model", "tA", "--heads", out, "--device", "cpu", "--prompts", "p.jsonl",
                  "--json", given)
    assert res.exit_code == 0, cli_output(res)
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "default.json"
    res = run_cli("heads", "eval", "--model", root / "tA", "--heads", out, "--device", "cpu", "--json", default)
    assert res.exit_code == 0, cli_output(res)
    assert json.loads(default.read_text())["layers"] == json.loads(given.read_text())["layers"]
    # prompts added to the training's file since: its split drawn again held prompts the heads were trained on
    changed = tmp_path / "changed.jsonl"
    changed.write_bytes((root / "p.jsonl").read_bytes())
    res = run_cli("heads", "train", "--model", root / "tA", "--prompts", changed, "--tokens", "64", "--epochs", "1",
                  "--out", out, "--device", "cpu", "--layers", "1,2")
    assert res.exit_code == 0, cli_output(res)
    with open(changed, "a") as f:
        f.write(json.dumps({"prompt": "w7 w8 w9"}) + "\n")
    for given_prompts in ((), ("--prompts", changed)):
        res = run_cli("heads", "eval", "--model", root / "tA", "--heads", out, "--device", "cpu", *given_prompts)
        assert res.exit_code == 2 and "which has changed since (train.prompts_sha256)" in cli_output(res), \
            cli_output(res)


def test_heads_eval_cuts_the_held_out_sequences_where_training_cut_them(root, tmp_path, monkeypatch):
    """Training reads at most ``max_len`` tokens of a sequence, held-out ones too (its recorded figures are over
    those); ``heads eval`` cuts where the heads file says training cut (it read them whole)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import hsd_opt.heads as heads_pkg
    from hsd_opt.heads.io import META_KEY

    out = tmp_path / "h.safetensors"
    res = run_cli("heads", "train", "--model", root / "tA", "--prompts", root / "p.jsonl", "--tokens", "64",
                  "--epochs", "1", "--out", out, "--device", "cpu", "--layers", "1,2")
    assert res.exit_code == 0, cli_output(res)
    with safe_open(str(out), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header = json.loads(meta[META_KEY])
    header["train"]["settings"]["max_len"] = 6
    cut = tmp_path / "cut.safetensors"
    save_file(tensors, str(cut), metadata={**meta, META_KEY: json.dumps(header)})
    lengths, real = [], heads_pkg.evaluate_heads

    def spy(model, heads, sequences, starts=None, **kw):
        lengths.append(max(len(s) for s in sequences))
        return real(model, heads, sequences, starts, **kw)

    monkeypatch.setattr(heads_pkg, "evaluate_heads", spy)
    for path in (out, cut):
        res = run_cli("heads", "eval", "--model", root / "tA", "--heads", path, "--device", "cpu")
        assert res.exit_code == 0, cli_output(res)
    assert lengths[0] == lengths[1] > 6 and lengths[2] == lengths[3] == 6, lengths


def test_heads_eval_says_when_the_training_prompts_are_gone(root, heads_a, tmp_path):
    gone = tmp_path / "gone.jsonl"
    path = _damaged(heads_a, tmp_path / "h.safetensors", train_prompts=str(gone))
    res = run_cli("heads", "eval", "--model", root / "tA", "--heads", path, "--device", "cpu")
    assert res.exit_code == 2, cli_output(res)
    assert f"the heads were trained on the prompts in {gone}, which is not there; give --prompts" in \
        " ".join(cli_output(res).split())


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_heads_eval_refuses_tokens_below_one_before_loading(heads_a, tokens):
    res = run_cli("heads", "eval", "--model", "no-such-model", "--heads", heads_a, "--tokens", tokens)
    assert res.exit_code == 2 and "--tokens: expected an integer >= 1" in cli_output(res), cli_output(res)


@pytest.mark.parametrize("rank", ["0", "-3"])
def test_heads_train_refuses_a_rank_below_one_before_loading(tmp_path, rank):
    res = run_cli("heads", "train", "--model", "no-such-model", "--kind", "lowrank", "--rank", rank,
                  "--out", tmp_path / "h.safetensors")
    assert res.exit_code == 2 and f"--rank: expected an integer >= 1, got {rank}" in cli_output(res), cli_output(res)


@pytest.mark.parametrize("flags, said", [
    (["--lr", "inf"], "--lr: expected a number in (0, 1] (Adam's step size), got inf"),
    (["--lr", "-1"], "--lr: expected a number in (0, 1] (Adam's step size), got -1"),
    (["--lr", "nan"], "--lr: expected a number in (0, 1] (Adam's step size), got nan"),
    (["--lr", "1e300"], "--lr: expected a number in (0, 1]"),        # past float32: a traceback at Adam's step
    (["--seed", str(10 ** 17)], "--seed: expected an integer of magnitude below"),
    (["--threads", "-1"], "--threads: expected an integer in 0..4096"),
    (["--threads", str(10 ** 20)], "--threads: expected an integer in 0..4096"),     # torch's C int overflowed
    # one line named four flags whichever was wrong
    (["--holdout", "1"], "--holdout: expected a fraction in (0, 1), got 1.0"),
    (["--epochs", "0"], "--epochs: expected an integer >= 1, got 0"),
    (["--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
    (["--vocab-subset", "-2"], "--vocab-subset: expected an integer >= 0 (0: all), got -2"),
    (["--layers", "none"], "--layers none: heads are trained for some layers"),      # refused once loaded
])
def test_heads_train_refuses_bad_numbers_before_loading(tmp_path, flags, said):
    """An infinite learning rate trained NaN heads and wrote them; a huge seed and negative threads were
    tracebacks after the training text was generated."""
    res = run_cli("heads", "train", "--model", "no-such-model", "--out", tmp_path / "h.safetensors", *flags)
    assert res.exit_code == 2 and said in cli_output(res) and "Traceback" not in cli_output(res), cli_output(res)


def test_heads_train_without_resume_keeps_an_interrupted_runs_checkpoint(tmp_path):
    """Rerun without ``--resume`` after a Ctrl-C, the training started over and its first save replaced the
    checkpoint the interruption had said was kept; now refused before anything loads, the checkpoint untouched."""
    ckpt = tmp_path / "h.safetensors.ckpt"
    ckpt.write_bytes(b"an interrupted training")
    res = run_cli("heads", "train", "--model", "no-such-model", "--out", tmp_path / "h.safetensors")
    out = " ".join(cli_output(res).split())
    assert res.exit_code == 2 and f"{ckpt}: a checkpoint of an interrupted training exists; pass --resume" in out, out
    assert ckpt.read_bytes() == b"an interrupted training"


def test_heads_outputs_never_replace_what_the_command_reads(root, heads_a, tmp_path):
    """``eval --json`` the heads file, ``train --out`` the prompts, a file in the model's folder or the model's
    own GGUF file, ``eval --json`` in the model's folder: refused before anything loads, the files untouched (each
    was overwritten; a GGUF was replaced by the heads)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF a model")
    before = {p: p.read_bytes() for p in (heads_a, root / "p.jsonl", root / "tA" / "config.json", gguf,
                                          root / "tA" / "tokenizer.json")}
    for args, said in ((["eval", "--model", "tA", "--heads", heads_a, "--json", heads_a], "the same file as --heads"),
                       (["train", "--model", "tA", "--prompts", root / "p.jsonl", "--out", root / "p.jsonl"],
                        "the same file as --prompts"),
                       (["train", "--model", str(root / "tA"), "--out", root / "tA" / "config.json"],
                        "a file of the model in the folder of --model"),
                       (["train", "--model", str(gguf), "--out", gguf], "the same file as --model"),
                       (["eval", "--model", str(root / "tA"), "--heads", heads_a, "--json",
                         root / "tA" / "tokenizer.json"], "a file of the model in the folder of --model")):
        res = run_cli("heads", *args)
        assert res.exit_code == 2 and said in " ".join(cli_output(res).split()), cli_output(res)
    assert all(p.read_bytes() == b for p, b in before.items())


def test_a_header_that_disagrees_with_the_tensors_is_refused(root, heads_a, tmp_path):
    """A header saying vocab_subset where no vocab_ids tensor is (or another count), or another rank than the
    tensors': refused naming the field (the heads loaded as something else)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")
    small = _heads_for(loaded, tmp_path / "small.safetensors")
    with safe_open(str(small), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    from hsd_opt.heads.io import META_KEY

    header = json.loads(meta[META_KEY])
    path = tmp_path / "subset.safetensors"
    save_file(tensors, str(path), metadata={**meta, META_KEY: json.dumps({**header, "vocab_subset": 4})})
    with pytest.raises(InputFileError, match=r"subset\.safetensors: vocab_ids: the header's vocab_subset 4 does not"):
        load_heads(path, loaded)


def test_train_heads_refuses_rank_zero():
    m = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32)
    with pytest.raises(HsdError, match="--rank: expected an integer >= 1, got 0"):
        train_heads(m, [1], [[5, 6, 7, 8]] * 4, kind="lowrank", rank=0, progress=False)


@pytest.mark.parametrize("kw, said", [
    ({"lr": -1}, "lr: expected a number in (0, 1]"),                      # Adam's own ValueError
    ({"lr": float("nan")}, "lr: expected a number in (0, 1]"),
    ({"batch_tokens": 0}, "batch_tokens: expected an integer >= 1"),      # ZeroDivisionError
    ({"epochs": 0}, "epochs: expected an integer >= 1"),                  # returned untrained heads
    ({"holdout": 1.5}, "holdout: expected a fraction in (0, 1)"),         # returned, nothing held out
    ({"layers": 1}, "layers: expected a non-empty list of layer numbers"),   # TypeError
    ({"layers": ["x"]}, "layers: expected a non-empty list of layer numbers"),   # ValueError of int()
    ({"token_sequences": [[5, 6, 7, 64]] * 4}, "token_sequences[0]: token ids must be in 0..63"),   # IndexError
    ({"token_sequences": [[5, 6.5, 7, 8]] * 4}, "token_sequences[0]: token ids must be in 0..63"),  # 6 silently
    ({"vocab_subset": -5}, "vocab_subset: expected None or an integer in 1..63"),      # torch's RuntimeError
    ({"vocab_subset": 64}, "vocab_subset: expected None or an integer in 1..63"),      # the whole vocabulary
    ({"vocab_subset": 2.5}, "vocab_subset: expected None or an integer in 1..63"),     # recorded 2.5, trained on 2
    ({"negatives": -1}, "negatives: expected an integer >= 0"),                        # math domain error
    ({"topk": -3}, "topk: expected an integer >= 0"),                                  # torch's RuntimeError
    ({"starts": [1]}, "starts: expected one integer >= 0 per sequence (4), got 1"),    # IndexError
    ({"held_out": [[5, 6, 99]]}, "held_out[0]: token ids must be in 0..63"),           # IndexError in embed
    ({"held_out": [[5, 6, 7]], "held_out_starts": [0, 1]}, "held_out_starts: expected one integer >= 0 per"),
])
def test_train_heads_refuses_bad_arguments_naming_them(kw, said):
    """The Python API's ``train_heads`` checks what the CLI's flags check (raw errors deep inside, or heads
    returned untrained)."""
    m = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32)
    args = {"layers": [1], "token_sequences": [[5, 6, 7, 8]] * 4, **kw}
    with pytest.raises(HsdError) as e:
        train_heads(m, args.pop("layers"), args.pop("token_sequences"), progress=False, evaluate=False, **args)
    assert str(e.value).startswith(said), str(e.value)


@pytest.mark.parametrize("model", [None, "smollm2-135m", 3])
def test_the_heads_functions_refuse_what_is_not_a_model_naming_it(tmp_path, model):
    """``train_heads`` and ``load_heads`` take a loaded model or a ``transformers`` one; a path, None or a number
    was an ``AttributeError`` deep inside."""
    with pytest.raises(HsdError, match="model: expected a LoadedModel"):
        train_heads(model, [1], [[5, 6, 7, 8]] * 4, progress=False, evaluate=False)
    with pytest.raises(HsdError, match="model: expected a LoadedModel"):
        load_heads(tmp_path / "h.safetensors", model)


def test_one_training_sequence_is_refused(root, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text((root / "p.jsonl").read_text().splitlines()[0] + "\n")
    res = run_cli("heads", "train", "--model", root / "tA", "--prompts", one, "--tokens", "32", "--epochs", "1",
                  "--out", tmp_path / "h.safetensors", "--device", "cpu")
    assert res.exit_code == 2, cli_output(res)
    assert "1 sequence of training text, and at least 2 are needed" in " ".join(cli_output(res).split())
    assert not (tmp_path / "h.safetensors").exists()


@pytest.mark.parametrize("content", [[1, 2], {"settings": None}, {"x": 1}])
def test_resuming_from_a_checkpoint_that_is_not_one_is_refused(tmp_path, content):
    ck = tmp_path / "h.ckpt"
    torch.save(content, str(ck))
    m = make_tiny_llama(seed=0, vocab_size=64, layers=4, hidden=32)
    seqs = [list(range(5, 25))] * 4
    with pytest.raises(HsdError, match=r"h\.ckpt: not a heads training checkpoint"):
        train_heads(m, [1], seqs, epochs=1, progress=False, checkpoint=ck, resume=True, evaluate=False)


def test_heads_eval_with_other_tokens_holds_out_the_prompts_training_held_out(root):
    """``heads eval --tokens`` other than training's made more samples of each prompt and split the sequences
    anew: prompts the heads were trained on came back as held-out text (the agreement inflated). Held out by
    prompt, the held-out prompts are training's whatever the tokens, and no prompt is on both sides."""
    from hsd_opt.commands.heads import _data

    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")

    def prompts_of(seqs, starts):
        return {tuple(s[:a]) for s, a in zip(seqs, starts)}

    tr, tr_st, ho, ho_st = _data(loaded, root / "p.jsonl", 300, 0.34, 0)      # train --tokens 300: 1 sample each
    _, _, ho2, ho2_st = _data(loaded, root / "p.jsonl", 3000, 0.34, 0)        # eval --tokens 3000: 2 samples each
    assert len(ho2) == 2 * len(ho)
    assert prompts_of(ho2, ho2_st) == prompts_of(ho, ho_st)
    assert not prompts_of(ho2, ho2_st) & prompts_of(tr, tr_st)


def test_training_text_is_cached_per_dtype(root):
    """A bfloat16 model writes other text than its float32 weights: each gets its own cached training text."""
    from hsd_opt.heads import generate_training_sequences

    prompts = ["w1 w2 w3", "w4 w5"]
    kw = dict(tokens=48, seed=3, progress=False)
    f32 = generate_training_sequences(load_model(str(root / "tA"), device="cpu", dtype="float32"), prompts, **kw)
    bf16 = load_model(str(root / "tA"), device="cpu", dtype="bfloat16")
    fresh = generate_training_sequences(bf16, prompts, cache=False, **kw)
    assert fresh != f32
    assert generate_training_sequences(bf16, prompts, **kw) == fresh


def test_training_text_is_cached_per_chat_template(root):
    """The cache was keyed by the prompts' texts: a local model whose chat template changed (its revision is its
    config and weights) got the text its old template had written, and its heads trained on it."""
    from hsd_opt.heads import generate_training_sequences
    from tests.helpers import TINY_CHAT_TEMPLATE

    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")
    kw = dict(tokens=24, seed=5, progress=False)
    old = generate_training_sequences(loaded, ["w1 w2"], **kw)
    loaded.tokenizer.chat_template = TINY_CHAT_TEMPLATE.replace("<s> assistant", "<s> w50 w51 assistant")
    try:
        new = generate_training_sequences(loaded, ["w1 w2"], **kw)
        assert new != old and new == generate_training_sequences(loaded, ["w1 w2"], cache=False, **kw)
    finally:
        loaded.tokenizer.chat_template = TINY_CHAT_TEMPLATE


def test_training_text_is_returned_where_the_cache_cannot_keep_it(root, tmp_path, monkeypatch):
    """The cache is only an optimisation: a cache whose ``heads-data`` cannot be written (here a file where its
    folder goes) used to end ``hsd heads train`` with exit 2 after the whole text was generated."""
    from hsd_opt.heads import generate_training_sequences

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "heads-data").write_text("not a folder")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "c"))
    loaded = load_model(str(root / "tA"), device="cpu", dtype="float32")
    kw = dict(tokens=24, seed=4, progress=False)
    assert generate_training_sequences(loaded, ["w1 w2"], **kw) == generate_training_sequences(
        loaded, ["w1 w2"], cache=False, **kw)
