"""``hsd bench --concurrency``: serving under load in one process, closed-loop clients against the batch scheduler
``hsd serve`` runs (:class:`~hsd_opt.runtime.batch.Batch`), without HTTP.

At each concurrency ``c``, each method serves ``c`` clients; each client sends ``requests`` requests one after the
other (greedy, or sampled as a :class:`~hsd_opt.measure.methods.Sampling` says, without a seed, as an API client that
sends none: each then follows the load), the next as soon as the previous answer ends, all ``c`` first requests
at once. Client ``i``'s ``k``-th request takes prompt ``(start + i * requests + k) mod n`` of the ``n`` prompts
(``start`` advances by ``c * requests`` per level, so levels and rounds see different prompts where there are
enough).

Methods (:data:`~hsd_opt.measure.methods.LOAD_METHODS`):

- ``hsd``: the plan, with its hierarchy per load level (``by_load``; a plan without them runs its own hierarchy at
  every load), ``max_batch`` sequences decoded together (``hsd serve --plan PLAN --max-batch MAX``);
- ``hsd_batch1``: the same plan, one request at a time (``--max-batch 1``);
- ``hsd_plain``: the plan's target alone, ``max_batch`` sequences batched: decoding without speculation.

Reported per method and concurrency (:func:`level_figures`): aggregate tokens/s (every generated token over the
seconds from the first request to the last answer), time to the first token p50 / p95 (seconds from a request's
submission to its first committed tokens, waiting for a place and the prompt included), tokens/s per stream p50
(a request's tokens after the first over the seconds from its first tokens to its end), and, greedy, whether every
answer equals the target's greedy answer alone (``HSD.generate`` of the target, one prompt at a time; sampled
answers are not compared: None). For ``hsd``: the
load level it ran at, that level's hierarchy and budgets, and where the concurrency is that level and the
hierarchy the plan's there, the plan's predicted aggregate (``by_load``, the profile's costs, not re-timed). With
several rounds the methods run in rotating order at each concurrency (what runs before a method changes its
figures) and the report holds each round and the medians.

With a :class:`~hsd_opt.measure.load_predictor.LoadPredictor` (``--retime PROFILE``), each method's run of a level is
also predicted whole, prompts and ramps included, at the engines' speed timed right before and right after it
(the mean of the two): per round and as
medians ``predicted_run_tokens_per_s``, ``predicted_wall_seconds``, ``predicted_ttft_p50_s`` and
``measured_over_predicted`` (measured aggregate over predicted).

What this leaves out, and ``benchmarks/serve_sweep.py`` measures: HTTP, the server's text decoding and streaming,
and clients in other processes. Units: seconds, tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from hsd_opt.errors import HsdError, one_line
from hsd_opt.formats import nearest_level
from hsd_opt.jsonio import atomic_write
from hsd_opt.measure.load_predictor import LoadPredictor, ratio
from hsd_opt.measure.methods import Sampling
from hsd_opt.runtime.batch import Batch
from hsd_opt.runtime.decode import HSD
from hsd_opt.runtime.schedule import PREFILL_SHARE

if TYPE_CHECKING:
    from hsd_opt.formats import Plan


@dataclass
class Request:
    """One client request of a level: the client sending it, the prompt's index, when it was submitted, when its
    first tokens were committed and when it ended (``time.perf_counter`` seconds; None until then), and its
    generated ids."""

    client: int
    prompt: int
    submitted: float
    first: float | None = None
    ended: float | None = None
    token_ids: list[int] | None = None


def serve_clients(hierarchies: HSD | Mapping[int, HSD], prompts: Sequence[Sequence[int]], clients: int,
                  requests: int, max_new_tokens: int, max_batch: int, start: int = 0,
                  sampling: Sampling | None = None, prefill_share: float = PREFILL_SHARE) -> list[Request]:
    """Serve ``clients`` closed-loop clients of ``requests`` requests each (see the module doc; greedy, or sampled
    as ``sampling`` says, unseeded) with a :class:`Batch` of ``hierarchies`` decoding at most ``max_batch``
    sequences together, prompt passes taking at most ``prefill_share`` of the time while others decode (as
    ``hsd serve``); returns every request in submission order. A request that fails raises its error."""
    batch = Batch(hierarchies, max_batch, prefill_share=prefill_share)
    how = {} if sampling is None or sampling.greedy else {"temperature": sampling.temperature, "seed": None,
                                                          **sampling.filters}
    done: list[Request] = []
    errors: list[BaseException] = []

    def submit(client: int, k: int) -> None:
        idx = (start + client * requests + k) % len(prompts)
        req = Request(client, idx, time.perf_counter())
        done.append(req)

        def on_tokens(_toks: list[int]) -> None:
            if req.first is None:
                req.first = time.perf_counter()

        def on_done(res, err) -> None:
            req.ended = time.perf_counter()
            if err is not None:
                errors.append(err)
                return
            req.token_ids = list(res.token_ids)
            if k + 1 < requests:
                submit(client, k + 1)

        batch.add(prompts[idx], max_new_tokens, on_tokens=on_tokens, on_done=on_done, **how)

    for i in range(clients):
        submit(i, 0)
    batch.run()
    if errors:
        raise errors[0]
    return done


def answer_lengths(reqs: Sequence[Request]) -> dict[tuple[int, int], int]:
    """Each sampled request's answer length in tokens, by ``(client, k)`` (its client's ``k``-th request; ``reqs``
    in submission order, as :func:`serve_clients` returns them): requests on one prompt answer at lengths of their
    own."""
    seen: dict[int, int] = {}
    out = {}
    for q in reqs:
        k = seen.get(q.client, 0)
        seen[q.client] = k + 1
        out[(q.client, k)] = len(q.token_ids or [])
    return out


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``xs`` (linear between order statistics); None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def level_figures(reqs: Sequence[Request], reference: Mapping[int, list[int]] | None = None) -> dict[str, Any]:
    """The figures of one method at one concurrency (see the module doc) from its requests; ``reference``: prompt
    index -> the target's greedy ids (``equal_to_target`` is None without it)."""
    tokens = sum(len(r.token_ids or []) for r in reqs)
    wall = max(r.ended for r in reqs) - min(r.submitted for r in reqs)
    ttft = [r.first - r.submitted for r in reqs if r.first is not None]
    streams = [(len(r.token_ids) - 1) / (r.ended - r.first) for r in reqs
               if r.first is not None and r.token_ids and len(r.token_ids) > 1 and r.ended > r.first]
    equal = None
    if reference is not None:
        equal = all(r.token_ids == reference[r.prompt] for r in reqs)
    return {"requests": len(reqs), "tokens": tokens, "wall_seconds": wall,
            "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "stream_tokens_per_s_p50": percentile(streams, 50), "equal_to_target": equal}


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


MEDIAN_KEYS = ("aggregate_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "stream_tokens_per_s_p50")
#: The figures of a whole level predicted at the speed of the moment (with a :class:`LoadPredictor`).
PREDICTED_KEYS = ("predicted_run_tokens_per_s", "predicted_wall_seconds", "predicted_ttft_p50_s",
                  "measured_over_predicted")


def run_load_bench(plan: "Plan", runners: Mapping[str, tuple[HSD | Mapping[int, HSD], int]],
                   target: HSD, prompts: Sequence[Sequence[int]], concurrency: Sequence[int], requests: int = 2,
                   max_new_tokens: int = 64, rounds: int = 1, log: Callable[[str], None] | None = None,
                   predictor: LoadPredictor | None = None, sampling: Sampling | None = None) -> dict[str, Any]:
    """Run every method of ``runners`` (name -> (hierarchies, max_batch), names from :data:`LOAD_METHODS`) at each
    client count of ``concurrency`` for ``rounds`` rounds (see the module doc) on ``prompts`` (token ids), each
    answer checked against ``target``'s (the target alone, one prompt at a time) when greedy; ``sampling``: how the
    requests sample (None or greedy: greedy; sampled answers are not compared). Returns the report:
    ``levels`` (one entry per client count: per method the medians over rounds, each round's figures, and for
    ``hsd`` the hierarchy and predicted aggregate of the plan's load level), and the settings. With
    ``predictor``, every method's run of a level is timed again right before and after it and replayed on the
    re-timed costs (:class:`~hsd_opt.measure.load_predictor.LoadPredictor`): per round and as medians
    ``PREDICTED_KEYS`` (sampled: over the lengths the answers had). Stopped by Ctrl-C after a level, the report
    of the levels finished, with ``stopped``."""
    if requests < 1:
        raise HsdError(f"--requests: expected >= 1, got {requests}")
    if rounds < 1:
        raise HsdError(f"--rounds: expected >= 1, got {rounds}")
    if not prompts:
        raise HsdError("no prompts to send")
    log = log or (lambda s: None)
    for name, (h, _) in runners.items():                  # first passes allocate: not timed
        for one in ({id(x): x for x in (h.values() if isinstance(h, Mapping) else [h])}).values():
            one.generate(list(prompts[0]), 2)
    reference: dict[int, list[int]] = {}
    greedy = sampling is None or sampling.greedy
    methods = list(runners)
    levels: list[dict[str, Any]] = []
    start = 0
    stopped = None
    try:
        for li, c in enumerate(concurrency):
            per_round: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for r in range(rounds):
                picks = {(start + i) % len(prompts) for i in range(c * requests)}
                for j in sorted(picks - set(reference)) if greedy else ():
                    reference[j] = list(target.generate(list(prompts[j]), max_new_tokens).token_ids)
                shift = (r + li) % len(methods)
                for m in methods[shift:] + methods[:shift]:
                    h, mb = runners[m]
                    if predictor is not None:
                        predictor.retime(h, mb)
                    reqs = serve_clients(h, prompts, c, requests, max_new_tokens, mb, start=start, sampling=sampling)
                    fig = level_figures(reqs, reference if greedy else None)
                    fig["round"] = r + 1
                    if predictor is not None:
                        lengths = {j: len(ids) for j, ids in reference.items()} if greedy else answer_lengths(reqs)
                        fig.update(predictor.after(h, mb, predictor.jobs(prompts, lengths, c, requests, start),
                                                   fig["aggregate_tokens_per_s"]))
                    per_round[m].append(fig)
                    pred = fig.get("predicted_run_tokens_per_s")
                    log(f"{c} client{'s' * (c != 1)}, round {r + 1}: {m} {fig['aggregate_tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {fig['ttft_p50_s']:.2f} s" + (f" (predicted {pred:.1f})" if pred else ""))
                start += c * requests
            levels.append(_level_entry(plan, runners, c, per_round, predictor is not None, greedy))
    except KeyboardInterrupt:             # Ctrl-C: the levels every method finished are reported
        if not levels:
            raise
        stopped = {"levels_done": len(levels), "levels_asked": len(concurrency),
                   "said": f"the report holds the {len(levels)} of {len(concurrency)} load levels every method "
                           f"finished"}
    except Exception as e:  # noqa: BLE001 - a request failed (out of memory at a larger batch): what finished stays
        why = one_line(e)
        if not levels:
            raise HsdError(f"the load bench failed before its first level finished: {why}") from None
        stopped = {"levels_done": len(levels), "levels_asked": len(concurrency), "failed": why,
                   "said": f"a request failed ({why}); the report holds the {len(levels)} of {len(concurrency)} "
                           f"load levels every method finished"}
    return {"kind": "load", "concurrency": list(concurrency), "requests": requests,
            "max_new_tokens": max_new_tokens,
            "sampling": None if greedy else {**sampling.to_dict(), "seed": None},
            "rounds": rounds, "prompts": len(prompts),
            "max_batch": {m: mb for m, (_, mb) in runners.items()}, "methods": methods, "levels": levels,
            **({"stopped": stopped} if stopped else {})}


def _level_entry(plan: "Plan", runners: Mapping[str, tuple[HSD | Mapping[int, HSD], int]], c: int,
                 per_round: dict[str, list[dict[str, Any]]], predicted: bool, greedy: bool) -> dict[str, Any]:
    """The report's entry of the level of ``c`` clients: per method the medians over its rounds (``per_round``),
    whether every answer equalled the target's (greedy), what ``hsd`` ran, and ``hsd``'s ratios to the others."""
    entry: dict[str, Any] = {"clients": c, "methods": {}}
    for m, figs in per_round.items():
        keys = MEDIAN_KEYS + (PREDICTED_KEYS if predicted else ())
        med = {k: _median([f.get(k) for f in figs]) for k in keys}
        med["equal_to_target"] = all(f["equal_to_target"] for f in figs) if greedy else None
        med["rounds"] = figs
        entry["methods"][m] = med
    if "hsd" in entry["methods"]:
        entry["methods"]["hsd"].update(_ran(plan, runners["hsd"][0], min(c, runners["hsd"][1])))
    agg = {m: e["aggregate_tokens_per_s"] for m, e in entry["methods"].items()}
    if "hsd" in agg:
        entry["hsd_over_batch1"] = ratio(agg.get("hsd"), agg.get("hsd_batch1"))
        entry["hsd_over_plain"] = ratio(agg.get("hsd"), agg.get("hsd_plain"))
    return entry


def _ran(plan: "Plan", hierarchies: HSD | Mapping[int, HSD], c: int) -> dict[str, Any]:
    """What ``hsd`` ran at ``c`` sequences: the load level (None without levels), its hierarchy and budgets, and
    the plan's predicted aggregate where ``c`` is that level and it runs the plan's hierarchy there."""
    level = nearest_level(hierarchies, c) if isinstance(hierarchies, Mapping) else None
    run = hierarchies[level] if level is not None else hierarchies
    names = [lv.name for lv in run.levels]
    budgets = list(run.budgets) if len(names) > 1 else []
    e = plan.by_load.get(level) if level is not None else None
    pred = None
    if e is not None and level == c and (list(e.hierarchy), list(e.budgets)) == (names, budgets):
        pred = e.tokens_per_s or level / e.expected_latency
    return {"load_level": level, "hierarchy": names, "budgets": budgets, "predicted_tokens_per_s": pred}


def plot_load(report: Mapping[str, Any], path) -> None:
    """PNG: aggregate tokens/s (median over rounds) against the number of clients, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [lv["clients"] for lv in report["levels"]]
    for m in report["methods"]:
        ys = [lv["methods"][m]["aggregate_tokens_per_s"] for lv in report["levels"]]
        ax.plot(xs, ys, marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title(f"serving under load ({report['max_new_tokens']} new tokens, {report['requests']} requests "
                 f"per client)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
