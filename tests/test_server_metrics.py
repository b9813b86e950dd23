"""`hsd serve`'s ``GET /metrics``: Prometheus' text format (every sample after its ``# TYPE``, histograms'
buckets cumulative), and counts that are the sums of what the answers themselves report (usage, the ``hsd``
object), on a tiny random Llama with a depth-3 plan; the times an answer reports in their order (waiting before
the prompt's computation, then the prefill, then the first token)."""

from __future__ import annotations

import logging
import math
import re
import time

import httpx
import pytest
from openai import OpenAI

from hsd_opt.commands.serve import prepare_server
from hsd_opt.server import BackgroundServer
from hsd_opt.server.metrics import Metrics, stats_line
from tests.helpers import TINY_CHAT_TEMPLATE, save_tiny, write_plan

MODEL = "m"
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus' text format read strictly: name -> [(labels, value)]; every sample's family declared by a
    ``# TYPE`` line before it, histograms' buckets cumulative and ending at ``+Inf`` with the count."""
    kinds: dict[str, str] = {}
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in kinds
            kinds[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, line
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in kinds else name
        assert family in kinds, f"{name} before its # TYPE"
        if kinds[family] == "counter":
            assert name.endswith("_total")
        pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
        out.setdefault(name, []).append((pairs, float(value.replace("+Inf", "inf"))))
    for family, kind in kinds.items():
        if kind == "histogram":
            buckets = out[f"{family}_bucket"]
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and buckets[-1][0]["le"] == "+Inf"
            assert counts[-1] == out[f"{family}_count"][0][1]
    return out


def value(m: dict, name: str, **labels) -> float:
    hits = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, m.get(name))
    return hits[0]


def test_histograms_count_each_value_in_every_bucket_at_or_above_it_and_labels_are_escaped():
    met = Metrics({"plan": 'a "b"\\c\nd'}, {1: 0.004})
    met.decoded({"tokens": 3, "target_calls": 2, "seconds_per_token": 0.002,
                 "levels": [{"name": "ngram", "calls": 3, "drafted": 3}, {"name": "t", "calls": 2, "drafted": 3,
                                                                          "accepted": 1, "rejections": 1}]},
                prompt_tokens=10, queue_seconds=0.01, first_token_seconds=0.3)
    met.decoded({"tokens": 1, "target_calls": 1, "prefill_tokens": 4, "levels": []}, prompt_tokens=10,
                queue_seconds=0.5, first_token_seconds=None)
    m = parse(met.render({"hsd_requests_waiting": ("w", 2)}))
    assert value(m, "hsd_info", plan='a \\"b\\"\\\\c\\nd') == 1
    buckets = {lab["le"]: v for lab, v in m["hsd_queue_seconds_bucket"]}
    assert buckets["0.005"] == 0 and buckets["0.01"] == 1 and buckets["0.25"] == 1 and buckets["0.5"] == 2
    assert value(m, "hsd_queue_seconds_sum") == pytest.approx(0.51)
    assert value(m, "hsd_time_to_first_token_seconds_count") == 1          # the second never got a first token
    assert value(m, "hsd_decode_seconds_per_token_count") == 1
    assert value(m, "hsd_prompt_tokens_total") == 20 and value(m, "hsd_prompt_tokens_cached_total") == 6
    assert value(m, "hsd_generation_tokens_total") == 0            # counted as committed (Metrics.committed)
    assert value(m, "hsd_ended_generation_tokens_total") == 4 and value(m, "hsd_target_passes_total") == 3
    assert value(m, "hsd_level_accepted_total", level="t") == 1
    assert value(m, "hsd_level_drafted_total", level="ngram") == 3
    assert value(m, "hsd_plan_predicted_seconds_per_token", load="1") == 0.004
    assert value(m, "hsd_requests_waiting") == 2


def test_a_stats_line_says_what_changed_over_its_period():
    met = Metrics()
    before = met.totals()
    met.committed(30)
    line = stats_line(met.totals(), before, 2.0, 1, 0)
    assert line == "last 2.0 s: 30 tokens generated (15.0 tok/s), 1 running, 0 waiting"
    met.decoded({"tokens": 30, "target_calls": 12, "prefill_tokens": 5,
                 "levels": [{"name": "ngram", "calls": 12}, {"name": "layer30", "accepted": 18, "rejections": 6}]},
                prompt_tokens=20, queue_seconds=0.0, first_token_seconds=0.1)
    met.ended("completed")
    line = stats_line(met.totals(), before, 2.0, 0, 0)
    assert line.endswith("; 1 completed, 2.50 tokens per target pass, prompts 20 tokens, 15 taken from the cache, "
                         "layer30 acceptance 0.75"), line


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    model_dir = save_tiny(root / MODEL, chat_template=TINY_CHAT_TEMPLATE)
    plan = write_plan(root / "plan.json", model_dir, hierarchy=("ngram", "layer2", "layer4"), budgets=(1, 3))
    app, jobs = prepare_server(plan, device="cpu", max_queue=16, api_key="k", log_stats=0.01)
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        yield srv


def scrape(srv) -> dict:
    r = httpx.get(srv.url + "/metrics", timeout=30)       # open, as /health, with an API key set
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.text)


def test_metrics_are_the_sums_of_what_the_answers_report(served, caplog):
    caplog.set_level(logging.INFO, logger="hsd_opt.server")
    c = OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0, timeout=60)
    before = scrape(served)
    assert value(before, "hsd_info", model=MODEL, hierarchy="layer4<-layer2<-ngram") == 1
    assert value(before, "hsd_requests_total", outcome="completed") == 0
    answers = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
               for p in ("w1 w2 w3 w4", "w20 w3 w20 w3 w20")]
    msgs = [{"role": "user", "content": "w5 w6 w7 w8 w9"}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "w11"}]
    answers += [first, c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)]
    with c.completions.create(model=MODEL, prompt="w30 w31", max_tokens=400, temperature=0, stream=True) as s:
        next(iter(s))                                     # a client that goes away after one chunk
    end = time.monotonic() + 60
    while (m := scrape(served)) and value(m, "hsd_requests_total", outcome="cancelled") < 1:
        assert time.monotonic() < end
        time.sleep(0.05)
    figures = [a.model_extra["hsd"] for a in answers]
    assert value(m, "hsd_requests_total", outcome="completed") == 4
    assert value(m, "hsd_requests_total", outcome="failed") == 0
    # the cancelled decoding ran too: its prompt and the tokens it committed count
    cancelled_prompt = value(m, "hsd_prompt_tokens_total") - sum(a.usage.prompt_tokens for a in answers)
    assert cancelled_prompt >= 2
    cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert cached > 0 and value(m, "hsd_prompt_tokens_cached_total") >= cached
    assert value(m, "hsd_generation_tokens_total") >= sum(f["generated_tokens"] for f in figures) + 1
    assert value(m, "hsd_generation_tokens_total") == value(m, "hsd_ended_generation_tokens_total")
    assert value(m, "hsd_target_passes_total") > sum(f["target_calls"] for f in figures)
    for name in ("layer2", "layer4"):
        level = [lv for f in figures for lv in f["levels"] if lv["name"] == name]
        assert value(m, "hsd_level_drafted_total", level=name) >= sum(lv["drafted"] for lv in level) > 0
    assert value(m, "hsd_time_to_first_token_seconds_count") == 5
    assert value(m, "hsd_queue_seconds_count") == 5
    assert value(m, "hsd_worker_busy_seconds_total") > 0
    assert value(m, "hsd_requests_running") == 0 and value(m, "hsd_requests_waiting") == 0
    assert value(m, "hsd_prompt_cache_bytes") > 0
    assert math.isfinite(value(m, "hsd_plan_predicted_seconds_per_token", load="1"))
    for f in figures:       # waiting, then the prefill (to the first token), within the time to the first token
        assert 0 <= f["queue_seconds"] and f["queue_seconds"] + f["prefill_seconds"] <= f["first_token_seconds"] + 1e-6
    assert httpx.get(served.url + "/v1/models", timeout=30).status_code == 401


    def logged() -> int:      # the worker logs the last period once it is idle: every token in one period
        lines = [r.getMessage() for r in caplog.records if r.name == "hsd_opt.server"]
        return sum(int(x.group(1)) for x in (re.search(r": (\d+) tokens generated", y) for y in lines) if x)

    end = time.monotonic() + 30
    while logged() < value(m, "hsd_generation_tokens_total") and time.monotonic() < end:
        time.sleep(0.05)
    assert logged() == value(m, "hsd_generation_tokens_total")
