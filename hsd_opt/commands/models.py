"""`hsd models`: list the known aliases, fetch (convert and cache) a model."""

from __future__ import annotations

import time

import typer

from hsd_opt.commands.common import cli_command
from hsd_opt.console import console

app = typer.Typer(help="Known model aliases; fetch and cache a model.", no_args_is_help=True)


@app.command("list")
@cli_command
def list_models() -> None:
    """Print the aliases ``--model`` accepts and what they resolve to."""
    from hsd_opt.models.loading import ALIASES

    for alias, target in sorted(ALIASES.items()):
        console.print(f"{alias:28s} {target}")


@app.command("fetch")
@cli_command
def fetch(name: str = typer.Argument("smollm2-135m", help="alias, hub id, directory or .gguf file"),
          device: str = typer.Option("cpu", help="auto | cpu | cuda"),
          dtype: str = typer.Option("auto", help="auto | float32 | float16 | bfloat16")) -> None:
    """Load a model once (de-quantizing and caching GGUF files) and print what was loaded."""
    from hsd_opt.models.loading import load_model

    t0 = time.perf_counter()
    lm = load_model(name, device=device, dtype=dtype)
    cfg = lm.model.config
    console.print(f"{lm.model_id}: {cfg.model_type}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
                  f"{lm.dtype} on {lm.device}, revision {lm.revision or '-'} "
                  f"(loaded in {time.perf_counter() - t0:.1f} s)")
