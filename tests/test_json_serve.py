"""`benchmarks/json_serve.py` counts a request that fails (an HTTP error, a dropped connection) instead of losing it
with its client thread, which left the aggregate over fewer answers with nothing said."""

from __future__ import annotations

import json

from benchmarks.json_serve import TASKS, level
from benchmarks.serve_sweep import free_port


def test_failed_requests_are_counted_and_no_client_thread_dies():
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines() if x.strip()][:5]
    url = f"http://127.0.0.1:{free_port()}/v1"                 # nothing listens there: every request fails
    row = level(url, tasks, 2, 8)
    assert row["errors"] == 5 and row["answers"] == 0 and row["tokens"] == 0
    assert sorted(r["task"] for r in row["rows"]) == sorted(t["name"] for t in tasks)
    assert all("Error" in r["error"] for r in row["rows"])
