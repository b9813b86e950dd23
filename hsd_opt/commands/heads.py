"""`hsd heads train` (distil per-layer exit heads to the final layer) and `hsd heads eval` (before/after table)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hsd_opt.commands.common import check_outputs, cli_command, local_model
from hsd_opt.commands.options import MAX_THREADS
from hsd_opt.console import console, err_console
from hsd_opt.errors import HsdError
from hsd_opt.seeds import check_strided_seed


def results_table(title: str, before: dict, after: dict) -> Table:
    """Per-layer held-out acceptance / greedy agreement / KL vs the final layer, raw lens vs trained head; for heads
    over a reduced vocabulary also the final layer's mass outside it (their KL is to the final layer renormalised on
    their vocabulary, which alone would flatter them)."""
    reduced = any(d.get("outside", 0.0) > 0 for d in after.values())
    t = Table(title=title)
    cols = ["layer", "accept raw", "accept head", "greedy raw", "greedy head", "KL raw",
            "KL head (on its vocab)" if reduced else "KL head"] + (["mass outside its vocab"] if reduced else [])
    for c in cols:
        t.add_column(c, justify="right")
    for b in sorted(after):
        bf, af = before.get(b, {}), after[b]
        f = lambda d, k: f"{d[k]:.3f}" if k in d else "-"  # noqa: E731
        t.add_row(str(b), f(bf, "acceptance"), f(af, "acceptance"), f(bf, "greedy"), f(af, "greedy"),
                  f(bf, "kl"), f(af, "kl"), *([f(af, "outside")] if reduced else []))
    return t


def _data(loaded, prompts: Optional[Path], tokens: int, holdout: float, seed: int):
    """The target's own text from ``prompts`` (None: the shipped suite), about ``tokens`` tokens, split by ``seed``
    with a ``holdout`` share of the prompts held out (of the sequences, for one prompt): (train sequences, their
    prompt lengths, held-out ones, theirs). Fewer than two sequences (nothing to hold out) is an
    :class:`HsdError`."""
    from hsd_opt.heads.data import generate_training_sequences, split_indices
    from hsd_opt.prompts import load_prompts

    plist = load_prompts(prompts).texts
    seqs, plens = generate_training_sequences(loaded, plist, tokens=tokens, seed=seed, with_prompt_lens=True)
    if len(seqs) < 2:
        raise HsdError(f"{prompts or 'the prompt suite'}: {len(seqs)} sequence of training text, and at least 2 are "
                       f"needed (one is held out for the evaluation): give more prompts, or --tokens above 256")
    per = len(seqs) // len(plist)             # each prompt's samples, in the prompts' order
    if len(plist) >= 2 and per * len(plist) == len(seqs):
        # held out by prompt: the same prompts whatever --tokens (more tokens, more samples of each), and no
        # prompt on both sides (its samples split between training and evaluation)
        kept, held = split_indices(len(plist), holdout, seed)
        tr = [i for p in kept for i in range(p * per, (p + 1) * per)]
        ho = [i for p in held for i in range(p * per, (p + 1) * per)]
    else:
        tr, ho = split_indices(len(seqs), holdout, seed)
    return ([seqs[i] for i in tr], [plens[i] for i in tr], [seqs[i] for i in ho], [plens[i] for i in ho])


app = typer.Typer(help="Trained early-exit heads: distil each layer's exit to the final layer.",
                  no_args_is_help=True)


_TRAIN_VOCAB_HELP = ("auto (candidates on a CPU, full on CUDA) | full | candidates: the vocabulary the training "
                     "softmax runs over (docs/cli.md, hsd heads).")

@app.command("train")
@cli_command
def train(
    model: str = typer.Option("smollm2-135m", "--model", help="Target model (alias, hub id or path)."),
    layers: str = typer.Option("all", "--layers", help="'all' (1..n-1) or a list like 4,8,14 or 2-6."),
    out: Path = typer.Option(..., "--out", help="Heads file to write (.safetensors)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt suite (JSON lines with 'prompt'); "
                                                                   "default: the suite shipped with hsd-opt."),
    tokens: int = typer.Option(4096, "--tokens", help="Tokens of training text the target generates."),
    epochs: int = typer.Option(3, "--epochs"),
    lr: float = typer.Option(2e-3, "--lr"),
    kind: str = typer.Option("affine", "--kind", help="affine | lowrank"),
    rank: int = typer.Option(64, "--rank", help="Rank of the lowrank translator (>= 1)."),
    vocab_subset: int = typer.Option(0, "--vocab-subset", help="K > 0: draft heads over the K most frequent "
                                                                "tokens (cheaper shallow exits)."),
    train_vocab: str = typer.Option("auto", "--train-vocab", help=_TRAIN_VOCAB_HELP),
    holdout: float = typer.Option(0.2, "--holdout", help="Fraction of the prompts held out for evaluation (of "
                                                         "the sequences, for a single prompt)."),
    device: str = typer.Option("auto", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    threads: int = typer.Option(0, "--threads", help="CPU threads for torch (0: torch's default)."),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT.ckpt if present."),
):
    """Train per-layer exit heads on text the target generates from the prompt suite."""
    from hsd_opt.models.loading import file_sha256, load_model

    wanted = _check_train_flags(model, layers, out, prompts, tokens, epochs, lr, kind, rank, vocab_subset,
                                train_vocab, holdout, device, dtype, threads, seed, resume)
    ckpt = Path(str(out) + ".ckpt")
    # torch's import (seconds): after the flags are checked
    import torch

    from hsd_opt.heads import head_layers, save_heads, train_heads

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, device=device, dtype=dtype)
    n = loaded.model.config.num_hidden_layers
    bs = head_layers(wanted, n)
    if vocab_subset and vocab_subset >= loaded.model.lm_head.weight.shape[0]:
        raise HsdError(f"--vocab-subset {vocab_subset} is not smaller than the vocabulary")
    tr, tr_st, ho, ho_st = _data(loaded, prompts, tokens, holdout, seed)
    try:
        res = train_heads(loaded, bs, tr, starts=tr_st, held_out=ho, held_out_starts=ho_st, kind=kind, rank=rank,
                          vocab_subset=vocab_subset or None, epochs=epochs, lr=lr, train_vocab=train_vocab,
                          seed=seed, checkpoint=ckpt, resume=resume,
                          log=lambda s: err_console.print(s, markup=False))
    except KeyboardInterrupt:
        kept = (f"{ckpt} holds the training as of its last checkpoint; the same command with --resume goes on "
                f"from there" if ckpt.is_file() else "no checkpoint was written yet")
        err_console.print(f"stopped: {kept}", markup=False)
        raise typer.Exit(130) from None
    save_heads(out, res.heads, loaded, training_data_sha256=res.data_sha256,
               train=dict(res.summary(), prompts=str(prompts.resolve()) if prompts else None, tokens=tokens,
                          holdout=holdout, prompts_sha256=file_sha256(prompts) if prompts else None))
    ckpt.unlink(missing_ok=True)
    console.print(results_table(f"held-out agreement with layer {n} ({res.heldout_positions} positions)",
                                res.before, res.after))
    console.print(f"trained {len(bs)} heads in {res.seconds:.1f} s; wrote {out}")


def _check_train_flags(model: str, layers: str, out: Path, prompts: Optional[Path], tokens: int, epochs: int,
                       lr: float, kind: str, rank: int, vocab_subset: int, train_vocab: str, holdout: float,
                       device: str, dtype: str, threads: int, seed: int, resume: bool) -> Optional[list[int]]:
    """``hsd heads train``'s flags checked before torch's import, each refused in one line naming it; returns
    ``--layers`` as layer numbers (None: all; the range is checked once the model is loaded)."""
    from hsd_opt.commands.options import layer_numbers
    from hsd_opt.heads.settings import KINDS, MAX_LR, TRAIN_VOCABS, check_checkpoint
    from hsd_opt.models.loading import check_device_name, check_dtype_name

    if kind not in KINDS:
        raise HsdError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    _check_output_beside(out, model, prompts)
    if train_vocab not in TRAIN_VOCABS:
        raise HsdError(f"--train-vocab: expected auto, full or candidates, got {train_vocab!r}")
    for flag, value, ok, what in (("--epochs", epochs, epochs >= 1, "an integer >= 1"),
                                  ("--tokens", tokens, tokens >= 1, "an integer >= 1"),
                                  ("--vocab-subset", vocab_subset, vocab_subset >= 0, "an integer >= 0 (0: all)"),
                                  ("--holdout", holdout, 0 < holdout < 1, "a fraction in (0, 1)")):
        if not ok:
            raise HsdError(f"{flag}: expected {what}, got {value}")
    if rank < 1:
        raise HsdError(f"--rank: expected an integer >= 1, got {rank}")
    if not (math.isfinite(lr) and 0 < lr <= MAX_LR):   # past float32's range Adam's first step overflowed
        raise HsdError(f"--lr: expected a number in (0, {MAX_LR:g}] (Adam's step size), got {lr}")
    check_strided_seed(seed, "the training's draws")
    _check_threads(threads)
    _check_prompts(prompts)
    wanted = layer_numbers(layers)         # the syntax, before loading anything (the range once loaded)
    if wanted == []:
        raise HsdError("--layers none: heads are trained for some layers; give 'all' or layer numbers like 4,8,14")
    check_checkpoint(Path(str(out) + ".ckpt"), resume)
    check_device_name(device)
    check_dtype_name(dtype)
    return wanted


def _check_same_prompts(heads: Path, prompts: Path, tr: dict) -> None:
    """Refuse to draw the held-out split again from the training's prompt file where it changed since the heads
    were trained (``train.prompts_sha256``): with another number of prompts the split is another, and prompts the
    heads were trained on were scored as held out."""
    want = tr.get("prompts_sha256")
    if not want or not tr.get("prompts") or Path(tr["prompts"]).resolve() != prompts.resolve():
        return
    from hsd_opt.models.loading import file_sha256

    if file_sha256(prompts) != want:
        raise HsdError(f"{heads}: the heads were trained on {prompts}, which has changed since (train.prompts_sha256):"
                       f" its held-out split drawn again would hold prompts they were trained on; give --prompts with "
                       f"prompts they have not seen")


def _check_output_beside(out: Path, model: str, prompts: Optional[Path]) -> None:
    """Refuse an ``--out`` the training would destroy: the ``--prompts`` file, the local model file ``model`` (a
    GGUF) or a file inside its folder (its weights, config or tokenizer)."""
    check_outputs(("--out", out), inputs=[("--prompts", prompts), *local_model("--model", model)])


def _check_prompts(prompts: Optional[Path]) -> None:
    """Refuse a ``--prompts`` path that is not a file (missing, or a directory), naming the flag."""
    if prompts is not None and not prompts.is_file():
        why = "is a directory, expected a JSON-lines prompt file" if prompts.is_dir() else "file not found"
        raise HsdError(f"--prompts {prompts}: {why}")


def _check_threads(threads: int) -> None:
    if not 0 <= threads <= MAX_THREADS:
        raise HsdError(f"--threads: expected an integer in 0..{MAX_THREADS} (0: torch's default), got {threads}")


@app.command("eval")
@cli_command
def evaluate(
    model: str = typer.Option("smollm2-135m", "--model"),
    heads: Path = typer.Option(..., "--heads", help="Heads file (.safetensors) from `hsd heads train`."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt suite; default: the one the heads "
                                                                   "were trained on (held-out split)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Tokens of text the target generates (>= 1); "
                                                               "default: as in training."),
    device: str = typer.Option("auto", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    threads: int = typer.Option(0, "--threads"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the table as JSON."),
):
    """Per-layer held-out acceptance and greedy agreement with the final layer: raw exits vs trained heads."""
    from hsd_opt.heads.settings import MAX_LEN
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import check_device_name, check_dtype_name, load_model

    check_outputs(("--json", json_out), inputs=[("--heads", heads), ("--prompts", prompts),
                                                *local_model("--model", model)])
    _check_threads(threads)
    if tokens is not None and tokens < 1:
        raise HsdError(f"--tokens: expected an integer >= 1 (leave it out for the training's count), got {tokens}")
    _check_prompts(prompts)
    check_device_name(device)
    check_dtype_name(dtype)
    # torch's import (seconds): after the flags are checked
    import torch

    from hsd_opt.heads import RawHead, evaluate_heads, load_heads, read_heads_file

    _, header = read_heads_file(heads)  # a missing/corrupt file fails before the model loads
    tr = header.get("train") or {}
    if prompts is None and tr.get("prompts"):
        prompts = Path(tr["prompts"])
        if not prompts.is_file():
            raise HsdError(f"{heads}: the heads were trained on the prompts in {prompts}, which is not there; give "
                           f"--prompts (the held-out split is drawn from them)")
    if prompts is not None:
        _check_same_prompts(heads, prompts, tr)
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, device=device, dtype=dtype)
    hs, header = load_heads(heads, loaded)
    seed = int((tr.get("settings") or {}).get("seed") or 0)
    _, _, ho, ho_st = _data(loaded, prompts, tokens or int(tr.get("tokens") or 4096),
                            float(tr.get("holdout") or 0.2), seed)
    max_len = int((tr.get("settings") or {}).get("max_len") or MAX_LEN)
    ho = [list(s)[:max_len] for s in ho]        # cut where training cut its sequences (its held-out figures' too)
    before = evaluate_heads(loaded, {b: RawHead(loaded.model) for b in hs}, ho, ho_st)
    after = evaluate_heads(loaded, hs, ho, ho_st)
    n = loaded.model.config.num_hidden_layers
    console.print(results_table(f"{heads}: held-out agreement with layer {n} ({header['kind']}"
                                + (f", vocab {header['vocab_subset']}" if header.get("vocab_subset") else "")
                                + ")", before, after))
    if json_out:
        write_json(json_out, {"heads": str(heads), "model": loaded.model_id, "revision": loaded.revision,
                              "layers": {str(b): {"before": before[b], "after": after[b]} for b in hs}})
