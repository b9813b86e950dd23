"""`hsd serve`: an OpenAI-compatible HTTP server for a plan (``hsd_opt.server``; its flags and routes: docs/cli.md)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from hsd_opt.commands.common import (
    TARGET_PRECISION_HELP,
    check_load,
    cli_command,
    load_plan_and_model,
    plan_check_for_retime,
    read_retime_profile,
    retimed_levels,
)
from hsd_opt.console import err_console
from hsd_opt.errors import HsdError
from hsd_opt.runtime.modes import check_mode
from hsd_opt.runtime.schedule import PREFILL_SHARE, PrefillShare


def served_name(model_id: str) -> str:
    """The model id clients send: ``embedded:smollm2-135m`` -> ``smollm2-135m``, a directory or file -> its
    name, a hub id as it is."""
    if model_id.startswith("embedded:"):
        return model_id.split(":", 1)[1]
    p = Path(model_id)
    return p.name if p.exists() else model_id


#: ``--max-body`` by default: bytes of a request body (a long prompt is well under it).
DEFAULT_MAX_BODY = 4 * 1024 * 1024

#: ``--log-stats`` by default: seconds between two lines of what the server did.
DEFAULT_LOG_STATS = 10.0

#: ``--prompt-cache`` by default: MiB of finished requests' decoding states kept for the prompts that start with
#: their tokens (the next turns of conversations).
DEFAULT_PROMPT_CACHE = 1024


def parse_origins(text: str) -> list[str]:
    """``--allowed-origins``: ``*`` (any), ``none`` or empty (none), or comma-separated origins, each
    ``scheme://host[:port]`` (a one-line :class:`HsdError` naming the flag otherwise), written as a browser sends
    its ``Origin`` header, which the server compares as a string: the host in lower case, a scheme's default port
    left out (``http://LocalHost:80`` allows ``http://localhost``)."""
    t = text.strip()
    if t in ("", "none"):
        return []
    if t == "*":
        return ["*"]
    return [_origin(o.strip()) for o in t.split(",")]


def _origin(o: str) -> str:
    """One origin of ``--allowed-origins`` as a browser writes it (:func:`parse_origins`)."""
    from urllib.parse import urlsplit

    bad = HsdError(f"--allowed-origins: {o!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000); "
                   f"'*' allows any, 'none' none")
    scheme, sep, rest = o.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or any(c in rest for c in "/?#@ \t"):
        raise bad
    try:
        parts = urlsplit(o)
        host, port = parts.hostname, parts.port
    except ValueError:                           # a port that is not a number in 0..65535
        raise bad from None
    if not host or rest.endswith(":") or port == 0:
        raise bad
    host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    default = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{host}" + ("" if port in (None, default) else f":{port}")


def check_serve_args(port: int, max_queue: int, default_max_tokens: int, model_name: Optional[str],
                     max_batch: int = 1, max_body: int = DEFAULT_MAX_BODY, stream_interval: int = 1,
                     prompt_cache: int = 0, log_stats: float = 0.0, api_key: Optional[str] = None,
                     prefill_share: float = PREFILL_SHARE, mode: str = "exact") -> None:
    """One-line :class:`HsdError` naming the flag for a ``--mode`` that is not one of
    :data:`~hsd_opt.runtime.modes.MODES`, a port outside 0..65535, ``--max-queue`` < 1,
    ``--default-max-tokens`` < 1, an empty ``--model-name``, ``--max-batch`` < 1, ``--max-body`` < 1,
    ``--stream-interval`` < 1, ``--prompt-cache`` < 0, ``--log-stats`` < 0, ``--prefill-share`` outside (0, 1],
    or an ``--api-key`` that is empty
    (``--api-key "$KEY"`` of an unset variable: a server open to anyone) or that no header can carry as given."""
    check_mode(mode)
    if api_key is not None:
        if not api_key.strip():
            raise HsdError("--api-key (or HSD_API_KEY): an empty key would leave the server open to anyone; give "
                           "a key, or leave both out for a server without one")
        if api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable():
            raise HsdError("--api-key (or HSD_API_KEY): a key must be printable ASCII without spaces around it "
                           "(what an Authorization header carries)")
    if not log_stats >= 0:
        raise HsdError(f"--log-stats: expected a number of seconds >= 0 (0: off), got {log_stats}")
    if prompt_cache < 0:
        raise HsdError(f"--prompt-cache: expected a number of MiB >= 0 (0: off), got {prompt_cache}")
    if not 0 <= port <= 65535:
        raise HsdError(f"--port: expected 0..65535, got {port}")
    if max_queue < 1:
        raise HsdError(f"--max-queue: expected >= 1, got {max_queue}")
    if max_batch < 1:
        raise HsdError(f"--max-batch: expected >= 1, got {max_batch}")
    if max_body < 1:
        raise HsdError(f"--max-body: expected a number of bytes >= 1, got {max_body}")
    if stream_interval < 1:
        raise HsdError(f"--stream-interval: expected a number of tokens >= 1, got {stream_interval}")
    if default_max_tokens < 1:
        raise HsdError(f"--default-max-tokens: expected >= 1, got {default_max_tokens}")
    if model_name is not None and not model_name.strip():
        raise HsdError("--model-name: empty name")
    PrefillShare(prefill_share)                 # its own check: one line naming the flag


def prepare_server(plan: Path, model: Optional[str] = None, device: str = "auto", dtype: Optional[str] = None,
                   mode: str = "exact", model_name: Optional[str] = None, default_max_tokens: int = 256,
                   max_queue: int = 16, api_key: Optional[str] = None, say=None,
                   target_precision: Optional[str] = None, max_batch: int = 8,
                   max_body: int = DEFAULT_MAX_BODY, retime: Optional[Path] = None,
                   stream_interval: int = 1, prompt_cache: int = DEFAULT_PROMPT_CACHE,
                   log_stats: float = 0.0, allowed_origins: Sequence[str] = ("*",),
                   prefill_share: float = PREFILL_SHARE) -> tuple[Any, Any]:
    """Load the plan and its model and build the hierarchy as ``hsd run`` does (quantized copies included; with
    a plan per load level, ``by_load``, every level's), warm it up, and return ``(app, jobs)``: the Starlette
    app and its :class:`~hsd_opt.server.JobQueue`, which decodes up to ``max_batch`` requests together and streams
    a request's text every ``stream_interval`` tokens (the app's lifespan starts and stops its worker); finished
    requests' decoding states are kept up to ``prompt_cache`` MiB for prompts that start with their tokens (a
    conversation's next turn; 0: none kept, none reused). ``log_stats``: seconds between two lines of what the
    worker did (logged at INFO; 0: none). ``allowed_origins``: the web origins whose scripts may call the server
    (CORS; empty: none). ``prefill_share``: the share of the time prompt passes take at most while requests decode
    (:class:`~hsd_opt.runtime.schedule.PrefillShare`).
    ``retime``: the profile the plan was solved from; each load level's hierarchy is then chosen again among the
    plan's at the engines' step times measured now (:func:`~hsd_opt.commands.common.retimed_levels`).
    ``say(message)`` reports progress."""
    from hsd_opt.grammar.compiler import compiler_for
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan
    from hsd_opt.runtime.state_pool import StatePool
    from hsd_opt.server import JobQueue, ModelInfo, create_app

    say = say or (lambda m: None)
    retime_profile = read_retime_profile(retime)     # before the long load, and against the plan
    say(f"loading {plan} and its model ...")
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision, engines_only=True,
                                    check_plan=plan_check_for_retime(retime_profile, plan, retime))
    chain = " -> ".join(p.hierarchy) + (f" (T={list(p.budgets)})" if p.budgets else "")
    profiled = p.provenance.sampling
    say(f"building the hierarchy {chain}{f' (profiled {profiled})' if profiled else ''} on {loaded.device} ...")
    models = PlanModels(loaded)
    on_cpu = str(loaded.device).startswith("cpu")       # elsewhere nothing is taken: keep no states beyond the latest
    models.pool = StatePool(prompt_cache << 20 if on_cpu else 0, reuse=prompt_cache > 0)
    runner = hsd_for_plan(p, loaded, mode=mode, source=str(plan), models=models)
    levels = hsd_by_load(p, loaded, models, mode=mode, source=str(plan), log=say, plan_runner=runner)
    retimed = None
    if retime_profile is not None:
        levels, retimed = retimed_levels(p, loaded, models, runner, levels, retime_profile, mode, str(plan), say)
    json_runner = _json_runner(p, loaded, models, mode, str(plan), say)
    built = list({id(h): h for h in (runner, *levels.values(), *([json_runner] if json_runner else []))}.values())
    models.release_unused_floats(p, [[lv.name for lv in h.levels] for h in built], log=say)
    tok = loaded.tokenizer
    for h in built:                                # warm-up: first passes allocate and compile
        h.generate(encode_prompt(tok, "Hello", raw=True), 2)
    max_positions = runner.max_positions or 2048          # the model's context (hsd_for_plan read it)
    name = model_name or served_name(loaded.model_id)
    info = ModelInfo(name, tok, max_positions, default_max_tokens, compiler_for(loaded))
    jobs = JobQueue(levels or runner, tok, max_queue=max_queue, max_batch=max_batch, stream_interval=stream_interval,
                    json_runner=json_runner, metrics=_metrics(p, name, str(plan), loaded.device),
                    stats_interval=log_stats, seeded=runner, prefill_share=prefill_share)
    about = {"plan": str(plan), "mode": mode, "max_positions": max_positions, "stream_interval": stream_interval,
             "prompt_cache_mib": prompt_cache, "prefill_share": prefill_share,
             "load_levels": {str(n): [lv.name for lv in h.levels] for n, h in levels.items()}}
    if json_runner is not None:
        about["json_hierarchy"] = [lv.name for lv in json_runner.levels]
    if retimed is not None:
        about["retime"] = retimed
    return create_app(jobs, info, api_key=api_key, about=about, max_body=max_body,
                      allowed_origins=allowed_origins), jobs


def _metrics(p, name: str, source: str, device) -> Any:
    """The server's :class:`~hsd_opt.server.metrics.Metrics`: ``hsd_info`` names the model, the plan, its hierarchy,
    the device and the kernel variant that runs (``hsd doctor``'s); the predictions are the plan's per load level
    (its own at load 1 without ``by_load``)."""
    from hsd_opt.engine import kernels
    from hsd_opt.server.metrics import Metrics
    from hsd_opt.version import __version__

    kinfo = kernels.info() if str(device).startswith("cpu") else None
    info = {"version": __version__, "model": name, "plan": source, "hierarchy": "<-".join(reversed(p.hierarchy)),
            "device": str(device), "kernels": kinfo.variant if kinfo is not None else "none"}
    predicted = {n: e.expected_latency for n, e in p.by_load.items()} or {1: p.expected_latency}
    return Metrics(info, {n: v for n, v in predicted.items() if v is not None})


def _json_runner(p, loaded, models, mode: str, source: str, say):
    """The hierarchy of requests under a grammar: the plan's plan for task ``json`` (``by_task``, e.g. solved with
    ``hsd profile --json-tasks N`` and ``hsd solve --per-task``), or None when it has none (they run the plan's)."""
    from hsd_opt.prompts import JSON_TASK
    from hsd_opt.runtime.runner import hsd_for_plan

    e = p.by_task.get(JSON_TASK)
    if e is None:
        return None
    say(f"requests under a grammar: the hierarchy {' -> '.join(e.hierarchy)} (the plan for task {JSON_TASK!r}) ...")
    return hsd_for_plan(p, loaded, mode=mode, source=source, hierarchy=list(e.hierarchy), budgets=list(e.budgets),
                        models=models)


def _serve(app, jobs, sock, what: str) -> None:
    """Run ``app`` on ``sock`` until Ctrl-C, saying when it is ready (its URL and ``what``) and when it stopped."""
    from hsd_opt.engine.kernels import release_thread_pool
    from hsd_opt.server.serving import log_config, make_server

    h, p = sock.getsockname()[:2]
    url = f"http://{h if ':' not in h else f'[{h}]'}:{p}"
    name = app.state.service.info.name
    server = make_server(app, on_ready=lambda: err_console.print(f"ready: {name} at {url}/v1 ({what}); Ctrl-C stops"),
                         on_stop=jobs.stop_taking, logging_config=log_config())
    release_thread_pool()    # the decoding thread's OpenMP pool the only one (kernels.release_thread_pool)
    # uvicorn handles SIGINT and SIGTERM, then raises the signal again with the handler it found: SIGTERM (what
    # systemd, docker and kubernetes send) then ends as Ctrl-C does, not killed with status 143
    before = signal.signal(signal.SIGTERM, _as_ctrl_c)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once it has shut down
        pass
    finally:
        signal.signal(signal.SIGTERM, before)
    err_console.print("stopped")


def _as_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


@cli_command
def serve_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="HSD_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every route but /health and "
                                               "/metrics."),
    max_queue: int = typer.Option(16, "--max-queue", help="Most requests waiting while --max-batch are decoded; "
                                                          "one more is answered 429."),
    max_batch: int = typer.Option(8, "--max-batch", help="Most requests decoded together (continuous batching; "
                                                         "1: one at a time). With a plan per load level "
                                                         "(hsd solve --batch-sizes) each load runs its own "
                                                         "hierarchy."),
    max_body: int = typer.Option(DEFAULT_MAX_BODY, "--max-body", help="Most bytes of a request body; a larger "
                                                                      "one is answered 413 unread."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens a streamed request's text waits "
                                                                     "for between chunks (the first is sent at "
                                                                     "once): fewer chunks cost the server and its "
                                                                     "clients less CPU under load. 1: every "
                                                                     "committed block."),
    prompt_cache: int = typer.Option(DEFAULT_PROMPT_CACHE, "--prompt-cache",
                                     help="MiB of finished requests' keys and values kept for later prompts "
                                          "that start with the same tokens (a conversation's next turn computes "
                                          "only its new tokens; the output is unchanged). 0: off."),
    log_stats: float = typer.Option(DEFAULT_LOG_STATS, "--log-stats",
                                    help="Seconds between two log lines of what the server did (tokens generated "
                                         "and their rate, requests running and waiting, the completed requests' "
                                         "tokens per target pass, prompt cache and acceptance rates). 0: none."),
    allowed_origins: str = typer.Option("*", "--allowed-origins",
                                        help="Web pages whose scripts may call the server (CORS): '*' any (as "
                                             "vLLM and llama-server), comma-separated origins "
                                             "(http://localhost:3000), or 'none'."),
    prefill_share: float = typer.Option(PREFILL_SHARE, "--prefill-share",
                                        help="The share of the time a long prompt takes at most while other "
                                             "requests decode: it is computed in passes of 256 positions, and "
                                             "the requests decoding get the rest of the time between them "
                                             "instead of a token per pass (a prompt's first pass and the "
                                             "target's last are never held). "
                                             "1: prompts first (the shortest time to a long prompt's first "
                                             "token, the longest stalls of the others)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id clients send (default: the "
                                                                        "plan's model, e.g. smollm2-135m)."),
    default_max_tokens: int = typer.Option(256, "--default-max-tokens",
                                           help="max_tokens of a chat request that gives none (completions: "
                                                "16, as the OpenAI API)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    target_precision: Optional[str] = typer.Option(None, "--target-precision", help=TARGET_PRECISION_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    mode: str = typer.Option("exact", "--mode", help="exact | eager (as `hsd run --mode`)."),
    retime: Optional[Path] = typer.Option(None, "--retime", help="The profile the plan was solved from: at start, "
                                                                 "time each engine's step and choose each load "
                                                                 "level's hierarchy again among the plan's at "
                                                                 "the machine's speed of the moment (a plan per "
                                                                 "load level only)."),
):
    """Serve the plan's hierarchy over an OpenAI-compatible HTTP API (chat and text completions, streamed or not),
    up to --max-batch requests decoded together, lossless."""
    from hsd_opt.packages import need

    need("starlette", "uvicorn", what="hsd serve")
    if api_key is None and os.environ.get("HSD_API_KEY") == "":    # set but empty: the option parser drops it
        api_key = ""
    check_serve_args(port, max_queue, default_max_tokens, model_name, max_batch, max_body, stream_interval,
                     prompt_cache, log_stats, api_key, prefill_share, mode)
    origins = parse_origins(allowed_origins)
    check_load(plan, model, device, dtype, target_precision, retime)     # said before the port is taken
    from hsd_opt.server.serving import bind_socket  # the server imports torch: after the flags' own checks

    sock = bind_socket(host, port)  # before the long load: a taken port fails at once
    try:
        app, jobs = prepare_server(plan, model, device, dtype, mode, model_name, default_max_tokens, max_queue,
                                     api_key, say=lambda m: err_console.print(m), target_precision=target_precision,
                                     max_batch=max_batch, max_body=max_body, retime=retime,
                                     stream_interval=stream_interval, prompt_cache=prompt_cache,
                                     log_stats=log_stats, allowed_origins=origins, prefill_share=prefill_share)
        _serve(app, jobs, sock, f"max batch {max_batch}, max queue {max_queue}"
                                f"{', API key required' if api_key else ''}")
    finally:
        sock.close()
