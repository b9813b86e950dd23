"""What a server has done since it started, for ``GET /metrics`` in Prometheus' text format (version 0.0.4):
requests by outcome, prompt tokens computed and taken from the prompt cache, tokens generated, the target's passes
and each level's drafts and acceptances (so an operator sees the acceptance rates the plan was solved for drift),
the worker's busy seconds, and histograms of waiting, time to the first token and decode seconds per token.

:class:`Metrics` is fed by the job queue's worker thread and read by the event loop's thread (a lock between
them). It keeps counts only: a scrape costs the decoding nothing. Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

#: Upper bounds (seconds) of the buckets of the waiting and time-to-first-token histograms.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Upper bounds (seconds) of the buckets of the decode-seconds-per-token histogram.
PER_TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)

#: The outcomes a request is counted under (``hsd_requests_total{outcome=...}``).
OUTCOMES = ("completed", "cancelled", "failed", "refused")

#: A level's counters summed over requests (:class:`~hsd_opt.runtime.decode.LevelStats`' fields).
LEVEL_COUNTERS = ("calls", "drafted", "accepted", "rejections", "abstained")


@dataclass
class Histogram:
    """Observations counted in cumulative buckets (``bounds``: upper bounds, ascending) with their sum."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
        self.total += value
        self.n += 1


def cached_tokens(prompt_tokens: int, stats: Mapping[str, Any]) -> int:
    """The prompt's tokens a decoding did not compute (taken from an earlier request's state or the kept chat-template
    head): ``prompt_tokens`` less its ``stats["prefill_tokens"]`` (0 where that is not reported)."""
    computed = stats.get("prefill_tokens")
    return 0 if computed is None else max(0, prompt_tokens - int(computed))


class Metrics:
    """Counters and histograms of one server (see the module doc). ``info``: labels of the constant
    ``hsd_info`` series (the model, the plan, the kernels that run); ``predicted``: the plan's predicted seconds per
    token at each load level (sequences in flight -> seconds/token)."""

    def __init__(self, info: Mapping[str, str] | None = None, predicted: Mapping[int, float] | None = None):
        self.info = dict(info or {})
        self.predicted = dict(predicted or {})
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0            # of the requests that ended (completed or cancelled while decoding)
        self.cached_tokens = 0            # of those, taken from an earlier request's state
        self.generated_tokens = 0         # committed, as they are (cancelled decodings' too)
        self.ended_tokens = 0             # committed, of the decodings that ended
        self.target_passes = 0
        self.busy_seconds = 0.0
        self.levels: dict[str, dict[str, int]] = {}
        self.queue = Histogram(LATENCY_BUCKETS)
        self.first_token = Histogram(LATENCY_BUCKETS)
        self.per_token = Histogram(PER_TOKEN_BUCKETS)

    def ended(self, outcome: str) -> None:
        """Count one request under ``outcome`` (one of :data:`OUTCOMES`)."""
        with self._lock:
            self.requests[outcome] += 1

    def busy(self, seconds: float) -> None:
        """Add ``seconds`` the worker spent decoding (one tick of the batch)."""
        with self._lock:
            self.busy_seconds += seconds

    def committed(self, tokens: int) -> None:
        """Count ``tokens`` the target just committed (a block)."""
        with self._lock:
            self.generated_tokens += tokens

    def decoded(self, stats: Mapping[str, Any], prompt_tokens: int, queue_seconds: float | None,
                first_token_seconds: float | None) -> None:
        """Add one decoding that ran (finished, or stopped because its request was cancelled): its
        :meth:`~hsd_opt.runtime.decode.Decoding.result` ``stats``, its prompt's length, the seconds it waited
        before its prefill began and to its first token (None: it never got one)."""
        cached = cached_tokens(prompt_tokens, stats)
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached
            self.ended_tokens += int(stats.get("tokens") or 0)
            self.target_passes += int(stats.get("target_calls") or 0)
            for lv in stats.get("levels") or []:
                mine = self.levels.setdefault(lv["name"], dict.fromkeys(LEVEL_COUNTERS, 0))
                for k in LEVEL_COUNTERS:
                    mine[k] += int(lv.get(k, 0))
            if queue_seconds is not None:
                self.queue.observe(queue_seconds)
            if first_token_seconds is not None:
                self.first_token.observe(first_token_seconds)
            if stats.get("seconds_per_token") is not None:
                self.per_token.observe(float(stats["seconds_per_token"]))

    def render(self, gauges: Mapping[str, tuple[str, float]] = ()) -> str:
        """The text a Prometheus server scrapes: every series with its ``# HELP`` and ``# TYPE`` lines, then
        ``gauges`` (name -> (help, value): what the caller reads at the moment, e.g. requests waiting)."""
        with self._lock:
            out: list[str] = []
            add = out.extend
            add(_series("hsd_info", "gauge", "The served model and plan, the kernels that run (value 1).",
                        [(self.info, 1)]))
            add(_series("hsd_requests_total", "counter",
                        "Decodings by outcome (a request's n sampled choices count n; greedy ones, decoded once, one): "
                        "completed, cancelled (client gone, server stopping), failed; and requests refused (queue "
                        "full).",
                        [({"outcome": k}, v) for k, v in self.requests.items()]))
            add(_series("hsd_prompt_tokens_total", "counter", "Prompt tokens of the decodings that ran.",
                        [({}, self.prompt_tokens)]))
            add(_series("hsd_prompt_tokens_cached_total", "counter",
                        "Of those, tokens taken from an earlier request's keys and values (the prompt cache).",
                        [({}, self.cached_tokens)]))
            add(_series("hsd_generation_tokens_total", "counter",
                        "Tokens the target committed, as it commits them (of cancelled requests too).",
                        [({}, self.generated_tokens)]))
            add(_series("hsd_ended_generation_tokens_total", "counter",
                        "Of those, the tokens of the decodings that ended (completed or cancelled).",
                        [({}, self.ended_tokens)]))
            add(_series("hsd_target_passes_total", "counter",
                        "The target's passes (steps and verify passes) of the decodings that ended; tokens per pass "
                        "= ended generation tokens / passes.", [({}, self.target_passes)]))
            names = sorted(self.levels)
            for k, what in (("calls", "Verify passes of a verifying level; draft calls of a bottom level."),
                            ("drafted", "Draft tokens a verifying level checked; tokens a bottom level proposed."),
                            ("accepted", "Draft tokens a verifying level accepted."),
                            ("rejections", "Rounds of a verifying level that ended in a rejection; acceptance "
                                           "rate = accepted / (accepted + rejections)."),
                            ("abstained", "Draft calls of a bottom token drafter that proposed nothing.")):
                add(_series(f"hsd_level_{k}_total", "counter", what,
                            [({"level": n}, self.levels[n][k]) for n in names]))
            add(_series("hsd_worker_busy_seconds_total", "counter",
                        "Seconds the worker spent decoding (throughput = generation tokens / busy seconds).",
                        [({}, self.busy_seconds)]))
            add(_series("hsd_plan_predicted_seconds_per_token", "gauge",
                        "The plan's predicted decode seconds per token, by load level (sequences in flight).",
                        [({"load": str(n)}, v) for n, v in sorted(self.predicted.items())]))
            add(_histogram("hsd_queue_seconds", "Seconds a request waited before its prompt's computation began.",
                           self.queue))
            add(_histogram("hsd_time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                                                               "token.", self.first_token))
            add(_histogram("hsd_decode_seconds_per_token", "A request's decode seconds (from its first token to its "
                                                            "end) per generated token.", self.per_token))
        for name, (what, value) in gauges.items():
            out.extend(_series(name, "gauge", what, [({}, value)]))
        return "\n".join(out) + "\n"


    def totals(self) -> dict[str, float]:
        """The counts a stats line compares between two moments: tokens committed, and of the decodings that
        ended, their tokens, prompt tokens, of those cached, the target's passes, each level's ``accepted`` and
        ``rejections``; requests completed."""
        with self._lock:
            t = {"generated": self.generated_tokens, "ended_tokens": self.ended_tokens, "prompt": self.prompt_tokens,
                 "cached": self.cached_tokens, "passes": self.target_passes, "completed": self.requests["completed"]}
            for name, c in self.levels.items():
                t[f"accepted:{name}"], t[f"rejections:{name}"] = c["accepted"], c["rejections"]
            return t


def stats_line(now: dict[str, float], before: dict[str, float], seconds: float, running: int, waiting: int) -> str:
    """One line of what a server did over the last ``seconds`` (``now`` and ``before``: :meth:`Metrics.totals`):
    tokens generated and their rate, tokens per target pass, prompt tokens computed and taken from the cache,
    requests completed, each verifying level's acceptance rate, requests in flight and waiting."""
    d = {k: v - before.get(k, 0) for k, v in now.items()}
    line = (f"last {seconds:.1f} s: {d['generated']:.0f} tokens generated ({d['generated'] / seconds:.1f} tok/s), "
            f"{running} running, {waiting} waiting")
    if not d["completed"]:
        return line
    ended = [f"{d['completed']:.0f} completed"]
    if d["passes"]:
        ended.append(f"{d['ended_tokens'] / d['passes']:.2f} tokens per target pass")
    if d["prompt"]:
        ended.append(f"prompts {d['prompt']:.0f} tokens, {d['cached']:.0f} taken from the cache")
    acc = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("accepted:")}
    ended += [f"{n} acceptance {a / (a + d[f'rejections:{n}']):.2f}" for n, a in sorted(acc.items())
              if a + d[f"rejections:{n}"] > 0]
    return line + "; " + ", ".join(ended)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _number(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _series(name: str, kind: str, what: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> list[str]:
    return [f"# HELP {name} {what}", f"# TYPE {name} {kind}",
            *(f"{name}{_labels(lab)} {_number(v)}" for lab, v in samples)]


def _histogram(name: str, what: str, h: Histogram) -> list[str]:
    lines = [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{_number(float(b))}"}} {c}' for b, c in zip(h.bounds, h.counts)]
    lines += [f'{name}_bucket{{le="+Inf"}} {h.n}', f"{name}_sum {_number(float(h.total))}", f"{name}_count {h.n}"]
    return lines
