"""Structured output under sustained load: `hsd serve` answers many JSON-schema requests from concurrent clients,
a mix of kinds, and every answer is checked (no grammar state lost or crossed between sequences, no crash):

    .venv/bin/python -m benchmarks.json_soak --plan PLAN [--requests 1000] [--clients 8] [--max-tokens 64] \\
        [--out benchmarks/results/json_soak.json]

Request ``i`` takes task ``i % 60`` of ``hsd_opt/data/json_tasks.jsonl`` and kind ``i % 5``: greedy, greedy streamed,
sampled (temperature 0.8, a seed), ``{"type": "json_object"}`` greedy, and greedy streamed with the client hanging
up after three events. Checked: every request but the hang-ups answers 200; an answer that ended (``finish_reason``
``"stop"``) parses as JSON and, where the ``jsonschema`` package is installed, is valid against its schema (a
``json_object`` answer: an object); every greedy answer to a task (plain or streamed, whatever else shared its
passes) is the same text; after the run the server is alive and counts every request. Reported: the counts, the
failures, the non-streamed answers' completion tokens and the latency p50/p99 of the answered requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.entry import count, run, seconds
from benchmarks.json_serve import TASKS, _name, run_clients
from benchmarks.server_load import start_server, stop_server
from hsd_opt.engine.variants import host
from hsd_opt.jsonio import write_json

KINDS = ("greedy", "greedy_stream", "sampled", "json_object", "hang_up")


def _body(url: str, task: dict, kind: str, i: int, max_tokens: int) -> dict:
    fmt = ({"type": "json_object"} if kind == "json_object" else
           {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"]}})
    body = {"model": _name(url), "messages": [{"role": "user", "content": task["prompt"]}],
            "max_tokens": max_tokens, "temperature": 0, "response_format": fmt}
    if kind == "sampled":
        body.update(temperature=0.8, seed=i)
    if kind in ("greedy_stream", "hang_up"):
        body["stream"] = True
    return body


def _streamed(client: httpx.Client, url: str, body: dict, hang_up: bool) -> tuple[int, str, str | None]:
    """``(status, text, finish_reason)`` of a streamed request; with ``hang_up`` the client closes after three
    events."""
    text, finish, events = [], None, 0
    with client.stream("POST", url + "/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, "", None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if hang_up and events >= 3:
                return 200, "", "hung_up"
            ch = json.loads(line[6:])["choices"]
            if ch:
                text.append(ch[0]["delta"].get("content") or "")
                finish = ch[0].get("finish_reason") or finish
    return 200, "".join(text), finish


def _can_check_schemas() -> bool:
    """Whether the ``jsonschema`` package is here to check answers against their schemas (else they are checked to
    parse only, which the report says: ``schemas_checked``)."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def _check(task: dict, kind: str, status: int, text: str, finish: str | None) -> str | None:
    """What is wrong with an answer, or None."""
    if status != 200:
        return f"status {status}"
    if kind == "hang_up" or finish != "stop":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return "ended but does not parse"
    if kind == "json_object":
        return None if isinstance(value, dict) else "json_object answer is not an object"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(value, task["schema"])
    except jsonschema.ValidationError as e:
        return f"not valid against its schema: {e.message[:120]}"
    return None


def _one(client: httpx.Client, url: str, tasks: list[dict], i: int, max_tokens: int) -> dict:
    """Request ``i`` (task ``i % len(tasks)``, kind ``i % 5``) sent and checked: its row."""
    task, kind = tasks[i % len(tasks)], KINDS[i % len(KINDS)]
    body = _body(url, task, kind, i, max_tokens)
    t0 = time.perf_counter()
    try:
        if body.get("stream"):
            status, text, finish = _streamed(client, url, body, kind == "hang_up")
            tokens = None
        else:
            r = client.post(url + "/chat/completions", json=body, timeout=600)
            status = r.status_code
            d = r.json() if status == 200 else {}
            text = d["choices"][0]["message"]["content"] if d else ""
            finish = d["choices"][0]["finish_reason"] if d else None
            tokens = d["usage"]["completion_tokens"] if d else None
    except httpx.HTTPError as e:
        status, text, finish, tokens = -1, "", f"{type(e).__name__}", None
    return {"i": i, "task": task["name"], "kind": kind, "status": status, "finish": finish, "text": text,
            "tokens": tokens, "seconds": time.perf_counter() - t0,
            "problem": _check(task, kind, status, text, finish)}


def soak(url: str, tasks: list[dict], n: int, clients: int, max_tokens: int) -> dict:
    """``n`` requests from ``clients`` threads (:func:`_one` each): their rows and the wall seconds."""
    rows, wall = run_clients(list(range(n)), clients, lambda client, i: _one(client, url, tasks, i, max_tokens))
    return {"rows": rows, "wall_seconds": wall}


def _greedy_disagreements(rows: list[dict]) -> list[str]:
    """Tasks whose greedy answers (plain and streamed, hang-ups aside) are not all the same text."""
    by: dict[str, set] = {}
    for r in rows:
        if r["kind"] in ("greedy", "greedy_stream") and r["status"] == 200:
            by.setdefault(r["task"], set()).add(r["text"])
    return sorted(t for t, texts in by.items() if len(texts) > 1)


def _spread(xs: list[float]) -> dict | None:
    """p50, p99 and max of ``xs`` (seconds), or None when empty."""
    if not xs:
        return None
    return {"p50": statistics.median(xs), "p99": statistics.quantiles(xs, n=100)[98] if len(xs) > 1 else xs[0],
            "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--requests", type=count, default=1000)
    ap.add_argument("--clients", type=count, default=8)
    ap.add_argument("--max-tokens", type=count, default=64)
    ap.add_argument("--timeout", type=seconds, default=300)
    ap.add_argument("--out", default="benchmarks/results/json_soak.json")
    a = ap.parse_args()
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines() if x.strip()]
    hsd, url, _ = start_server(a.plan, 64, None, "cpu", a.timeout)
    try:
        res = soak(url, tasks, a.requests, a.clients, a.max_tokens)
        health = httpx.get(url.rsplit("/v1", 1)[0] + "/health", timeout=30).json()
    finally:
        code = stop_server(hsd)
    rows = res["rows"]
    problems = [{"i": r["i"], "task": r["task"], "kind": r["kind"], "problem": r["problem"]} for r in rows
                if r["problem"]]
    answered = [r for r in rows if r["kind"] != "hang_up" and r["status"] == 200]
    secs = [r["seconds"] for r in answered]
    tokens = sum(r["tokens"] or 0 for r in rows)
    report = {"host": host(), "plan": a.plan, "requests": len(rows),
              "clients": a.clients, "max_tokens": a.max_tokens, "wall_seconds": res["wall_seconds"],
              "by_kind": {k: sum(r["kind"] == k for r in rows) for k in KINDS},
              "answered_200": len(answered), "ended": sum(r["finish"] == "stop" for r in answered),
              "problems": problems, "greedy_disagreements": _greedy_disagreements(rows),
              "non_streamed_completion_tokens": tokens,
              "latency_p50_s": statistics.median(secs) if secs else None,
              "latency_p99_s": statistics.quantiles(secs, n=100)[98] if len(secs) > 1 else None,
              "latency_by_kind": {k: _spread([r["seconds"] for r in answered if r["kind"] == k]) for k in KINDS},
              "slowest": sorted(({"i": r["i"], "task": r["task"], "kind": r["kind"], "seconds": r["seconds"],
                                  "finish": r["finish"]} for r in answered), key=lambda r: -r["seconds"])[:10],
              "health_after": health, "server_exit_code": code,
              "schemas_checked": _can_check_schemas()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, report, indent=2)
    if not report["schemas_checked"]:
        print("note: jsonschema is not installed here: answers were checked to parse, not against their schemas "
              "(pip install jsonschema)")
    print(f"{len(rows)} requests, {report['answered_200']} answered (200), {report['ended']} ended; problems: "
          f"{len(problems)}; greedy answers that differ: {report['greedy_disagreements']}; server exit "
          f"{code}; {res['wall_seconds']:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    run(main)
