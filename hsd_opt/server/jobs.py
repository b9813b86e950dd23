"""The server's job queue: a bounded FIFO queue in front of one worker thread that decodes up to ``max_batch``
requests together (continuous batching, :class:`~hsd_opt.runtime.batch.Batch`).

The worker admits queued jobs in arrival order while fewer than ``max_batch`` are in flight and runs the batch's
ticks: each tick prefills at most one new prompt and then serves the passes the batch's scheduler picks (the largest
group of one engine, those that waited long enough, a request's first token: :meth:`Batch.tick`), the passes on one
engine in one batched call; requests join and leave between ticks. ``max_batch=1`` decodes one request at a
time. torch releases the GIL in its kernels, so the server's event loop stays responsive meanwhile. Each job
reports through ``job.emit``, called from the worker thread with one event at a time:

- ``("text", str)``: text made final by committed blocks (:class:`~hsd_opt.server.text.TextStream`): the first
  at once, then once ``stream_interval`` tokens were committed since the last (the rest with the end);
- ``("logprobs", list)``: with log-probabilities asked for, just before each ``"text"`` event, the
  :class:`~hsd_opt.runtime.decode.TokenLogprob` of every token fed to the text since the last one (the tokens the
  text was made of, and those whose text is held back: a possible stop string);
- ``("done", Outcome)``: the generation ended (EOS, ``max_tokens`` or a stop string);
- ``("cancelled", None)``: the job was cancelled (the client went away, the server is stopping);
- ``("error", str)``: the generation failed (logged with its traceback: a bug, never a bad request);
- ``("error", ApiError)``: the request's grammar met a limit of the grammar engine partway (a 400 naming the
  field: :class:`~hsd_opt.errors.GrammarStopped`, logged on one line).

Cancelling a job (:meth:`Job.cancel`, thread-safe) frees its place at the next committed block: the ``on_tokens``
callback sees the flag and asks the decoding to stop. A job cancelled while it waits is skipped. Every request is
its own decoding (caches, token drafters, random generator), so one request's state never reaches another's, and
its greedy tokens are those it gets alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hsd_opt.errors import GrammarStopped
from hsd_opt.grammar.constraint import Constraint
from hsd_opt.prompts import JSON_TASK
from hsd_opt.runtime.batch import Batch
from hsd_opt.runtime.schedule import PREFILL_SHARE
from hsd_opt.server.errors import bad_request
from hsd_opt.server.metrics import Metrics, stats_line
from hsd_opt.server.requests import GenerationRequest
from hsd_opt.server.text import TextStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hsd_opt.runtime.decode import HSD, Decoding, GenerationResult, TokenLogprob

log = logging.getLogger("hsd_opt.server")


class QueueFull(Exception):
    """Raised by :meth:`JobQueue.submit` when ``max_queue`` requests already wait."""


class Stopping(Exception):
    """Raised by :meth:`JobQueue.submit` once the server began to stop (:meth:`JobQueue.stop_taking`)."""


@dataclass
class Outcome:
    """A finished generation.

    Attributes:
        token_ids: the generated ids the client gets (cut at the token completing a stop string).
        text: their text (before the stop string), as streamed.
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens`` reached).
        prompt_tokens: tokens of the prompt.
        stats: :meth:`HSD.generate`'s stats (``GenerationResult.stats``), every committed token counted.
        queue_seconds: seconds the job waited before its prompt's computation began.
        first_token_seconds: seconds from its arrival to its first token.
        logprobs: a :class:`~hsd_opt.runtime.decode.TokenLogprob` per returned id (log-probabilities asked for),
            else None.
        eos: whether the decoding ended at the model's end of sequence (not at a stop string or ``max_tokens``):
            the answer is whole (a function call's arguments complete).
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: dict[str, Any]
    queue_seconds: float
    first_token_seconds: float
    logprobs: "list[TokenLogprob] | None" = None
    eos: bool = False


@dataclass(eq=False)
class Job:
    """One request for the worker: ``request`` and where its events go (``emit``, called from the worker
    thread; it must be thread-safe and must not block)."""

    request: GenerationRequest
    emit: Callable[[tuple[str, Any]], None]
    submitted: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Ask the worker to drop this job (waiting) or stop it at the next committed block (running)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class JobQueue:
    """The worker thread and its queue.

    Args:
        runner: what decodes: one hierarchy (an :class:`HSD`), or load level -> hierarchy (a load-aware plan's).
        json_runner: what decodes a request under a grammar (``response_format``), the same way: the plan's plan
            for task ``json`` (None: ``runner``).
        seeded: the hierarchy of a seeded sampled request without a grammar, the plan's own, as ``hsd run`` decodes
            it (None: ``runner``'s level for one sequence).
        tokenizer: the model's tokenizer (decoding text, stop strings).
        max_queue: most requests that may wait while ``max_batch`` are decoded (>= 1); one more is refused
            (:class:`QueueFull`).
        max_batch: most requests decoded together (>= 1; 1: one at a time).
        stream_interval: tokens committed between two ``"text"`` events of a job (>= 1; 1: every committed block
            with text); fewer events cost the event loop and the clients less CPU, which a server on a few cores
            shares with its decoding.
        prefill_share: the share of the time prompt passes take at most while requests decode (the batch's,
            :class:`~hsd_opt.runtime.schedule.PrefillShare`).
    """

    def __init__(self, runner: "HSD | dict[int, HSD]", tokenizer: "PreTrainedTokenizerBase", max_queue: int = 16,
                 max_batch: int = 1, stream_interval: int = 1, json_runner: "HSD | dict[int, HSD] | None" = None,
                 metrics: Metrics | None = None, stats_interval: float = 0.0, seeded: "HSD | None" = None,
                 prefill_share: float = PREFILL_SHARE):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.runner, self.tokenizer, self.max_queue = runner, tokenizer, max_queue
        self.stream_interval = stream_interval
        self.batch = Batch(runner, max_batch, by_task={JSON_TASK: json_runner} if json_runner is not None else None,
                           seeded=seeded, prefill_share=prefill_share)
        #: waiting jobs, FIFO: at most ``max_queue`` not cancelled (a cancelled one's place is free at once; the
        #: worker takes it out at its next tick)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # waiting or running
        self._stopping = False        # no job is taken any more (stop_taking)
        self._thread: threading.Thread | None = None
        self.metrics = metrics if metrics is not None else Metrics()
        self.stats_interval = stats_interval
        self._stats_from = (time.perf_counter(), self.metrics.totals())

    # ------------------------------------------------------------------------------------------ control

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="hsd-jobs", daemon=True)
            self._thread.start()

    def cancel_all(self) -> None:
        """Cancel every waiting and running job (the server is stopping)."""
        with self._lock:
            for job in list(self._live):
                job.cancel()

    def stop_taking(self) -> None:
        """The server is stopping: cancel every waiting and running job and refuse every later one
        (:class:`Stopping`; a request whose body was still arriving would be decoded and then cut off)."""
        with self._lock:
            self._stopping = True
        self.cancel_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job, refuse new ones, let the worker finish the current tick and end (waits up to
        ``timeout`` s for it)."""
        self.stop_taking()
        if self._thread is not None:
            self._queue.put(None)            # the queue only holds cancelled jobs now, which the worker skips
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO). Raises :class:`QueueFull` when ``max_queue`` jobs already wait."""
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs`` (an answer's choices, FIFO) all or none: :class:`QueueFull` when fewer places than
        jobs are free, :class:`Stopping` once the server began to stop. The server holds ``max_batch`` jobs
        decoding and ``max_queue`` waiting: a place is taken by every job not ended and not cancelled, wherever it
        is (decoding, admitted, or still in the hand-off queue, which the worker empties only between its steps:
        counting those against ``max_queue`` alone refused a burst of requests that fit the batch). Only this adds
        jobs, so the places counted stay free."""
        with self._lock:
            if self._stopping:
                raise Stopping("the server is stopping")
            places = self.places
            taken = sum(1 for job in self._live if not job.cancelled)
            free = places - taken
            if free < len(jobs):
                self.metrics.ended("refused")
                raise QueueFull(f"{self.batch.max_active} requests are being decoded and {self.max_queue} already "
                                f"wait" if free <= 0 else
                                f"{taken} of {places} places ({self.batch.max_active} decoding, {self.max_queue} "
                                f"waiting) are taken, {len(jobs)} asked for")
            for job in jobs:
                self._queue.put_nowait(job)
                self._live.add(job)

    @property
    def places(self) -> int:
        """The most jobs the server holds at once: ``max_batch`` decoding and ``max_queue`` waiting."""
        return self.batch.max_active + self.max_queue

    def _queued(self) -> int:
        """Jobs in the queue that were not cancelled (those that were wait for the worker to take them out)."""
        with self._queue.mutex:
            return sum(1 for job in self._queue.queue if job is not None and not job.cancelled)

    def _drop_cancelled(self) -> None:
        """Take the cancelled jobs out of the queue and end them (``cancelled``): a client that left while its
        request waited is counted now, not when the request's turn would have come."""
        with self._queue.mutex:
            gone = [job for job in self._queue.queue if job is not None and job.cancelled]
            if gone:
                self._queue.queue = type(self._queue.queue)(job for job in self._queue.queue
                                                            if job is None or not job.cancelled)
        for job in gone:
            self._end(job, "cancelled", None)

    @property
    def waiting(self) -> int:
        """Jobs not yet in flight (queued and not cancelled, or admitted and waiting for their prefill to begin)."""
        return self._queued() + self.batch.queued

    def status(self) -> dict[str, Any]:
        """``waiting``, ``active`` (requests being decoded or prefilled), ``max_batch``, ``busy``, the load level's
        ``hierarchy`` (its level names, bottom first) and ``budgets``, the counts of ``completed``,
        ``cancelled``, ``failed`` and ``refused`` (queue full) requests since start, and ``generated_tokens``:
        every token the worker committed (of cancelled generations too, up to where they stopped)."""
        active = self.batch.in_flight          # decoding, or its prompt being computed
        level = self.batch.hierarchy_for(max(self.batch.load, 1))
        return {"waiting": self.waiting, "max_queue": self.max_queue, "busy": active > 0, "active": active,
                "max_batch": self.batch.max_active, "hierarchy": [lv.name for lv in level.levels],
                "budgets": list(level.budgets[: len(level.levels) - 1]), **self.metrics.requests,
                "generated_tokens": self.metrics.generated_tokens}

    def metrics_text(self) -> str:
        """``GET /metrics``: :attr:`metrics` with the gauges of the moment (requests waiting and in flight, the
        prompt cache's bytes), in Prometheus' text format."""
        pools = {id(h.pool): h.pool for lv in (self.batch.levels, *self.batch.tasks.values()) for h in lv.values()}
        held = sum(p.held_bytes() for p in pools.values() if p.reuse)    # without reuse, none serves a prompt
        return self.metrics.render({
            "hsd_requests_waiting": ("Requests queued, or admitted and waiting for their prompt's computation.",
                                     self.waiting),
            "hsd_requests_running": ("Requests being decoded or prefilled.", self.batch.in_flight),
            "hsd_max_batch": ("Most requests decoded together (--max-batch).", self.batch.max_active),
            "hsd_prompt_cache_bytes": ("Bytes of finished requests' decoding states kept for later prompts "
                                       "(--prompt-cache bounds those beyond each engine's most recent one).", held)})

    # ------------------------------------------------------------------------------------------ worker

    def _work(self) -> None:
        stopping = False
        while True:
            if not self.batch.busy:
                self._stats_line(idle=True)
                if stopping:
                    return
                job = self._queue.get()          # idle: wait for a request
                if job is None:
                    return
                self._stats_from = (time.perf_counter(), self._stats_from[1])   # the idle time is no period's
                self._admit(job)
            while self.batch.in_flight + self.batch.queued < self.batch.max_active:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                self._admit(job)
            self._drop_cancelled()
            for e in self.batch.starting:     # cancelled before their prefill ended: never decoded
                job = e.on_tokens.job
                if job.cancelled and self.batch.drop(e):
                    self._end(job, "cancelled", None)
            t = time.perf_counter()
            try:
                self.batch.tick()
            except Exception as e:  # a bug in the scheduler itself: fail what is in flight, keep serving
                log.exception("generation failed")
                for entry in self.batch.clear():
                    self._end(entry.on_tokens.job, "error", f"generation failed: {type(e).__name__}: {e}")
            self.metrics.busy(time.perf_counter() - t)
            self._stats_line()

    def _stats_line(self, idle: bool = False) -> None:
        """Log what the worker did since the last line, every :attr:`stats_interval` seconds, and when it turns
        idle after doing something; an idle worker's clock starts again at its next request."""
        if not self.stats_interval:
            return
        start, before = self._stats_from
        now = time.perf_counter()
        if not idle and now - start < self.stats_interval:
            return
        totals = self.metrics.totals()
        if totals == before:
            if idle:
                self._stats_from = (now, totals)
            return
        log.info("%s", stats_line(totals, before, now - start, self.batch.in_flight, self.waiting))
        self._stats_from = (now, totals)

    def _admit(self, job: Job) -> None:
        """Add ``job`` to the batch (or end it: cancelled while queued)."""
        if job.cancelled:
            self._end(job, "cancelled", None)
            return
        req = job.request
        text = TextStream(self.tokenizer, req.stop, req.prompt_ids, req.stop_ids)   # read after the prompt's ids
        on_tokens = _Stream(job, text, self.stream_interval, self.metrics)

        def on_done(res: "GenerationResult | None", err: BaseException | None) -> None:
            self._done(job, on_tokens, res, err)

        try:
            entry = self.batch.add(req.prompt_ids, req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                   seed=req.seed, on_tokens=on_tokens, on_done=on_done,
                                   constraint=Constraint(req.grammar) if req.grammar is not None else None,
                                   task=JSON_TASK if req.grammar is not None else None, logprobs=req.logprobs,
                                   penalties=req.penalties, top_k=req.top_k, min_p=req.min_p)
            on_tokens.decoding = entry.decoding
            if req.logprobs is not None:
                on_tokens.logprobs = entry.decoding.logprobs
        except Exception as e:  # noqa: BLE001 - arguments the request validation let through: a bug
            log.exception("generation failed")
            self._end(job, "error", f"generation failed: {type(e).__name__}: {e}")

    def _done(self, job: Job, stream: "_Stream", res: "GenerationResult | None", err: BaseException | None) -> None:
        if isinstance(err, GrammarStopped):     # the request's grammar, not a bug: its field is named
            log.warning("%s", err)
            self._end(job, "error", bad_request(str(err), err.source, "grammar_limit"))
            return
        if err is not None:
            log.error("generation failed", exc_info=err)
            self._end(job, "error", f"generation failed: {type(err).__name__}: {err}")
            return
        req, started = job.request, stream.started
        began = stream.decoding.t0 if stream.decoding is not None else job.submitted
        queued, first = began - job.submitted, (started[0] - job.submitted if started else None)
        self.metrics.decoded(res.stats, len(req.prompt_ids), queued, first)
        if job.cancelled:
            self._end(job, "cancelled", None)
            return
        text = stream.text
        rest = stream.held + text.finish()
        ids = list(text.ids) if text.stopped else list(res.token_ids)
        logprobs = res.logprobs[: len(ids)] if res.logprobs is not None else None
        if rest or (logprobs is not None and stream.sent_logprobs < len(ids)):
            if logprobs is not None:
                job.emit(("logprobs", logprobs[stream.sent_logprobs:]))
            job.emit(("text", rest))
        # at the end of sequence: also where a stop id is the end-of-sequence token that ended it (vLLM's clients
        # list it in stop_token_ids), not where a stop string or a stop id came before it
        eos = res.stats.get("stopped") == "eos" and (not text.stopped or len(ids) == len(res.token_ids))
        first = first if first is not None else time.perf_counter() - job.submitted
        self._end(job, "done", Outcome(ids, text.text, "stop" if text.stopped or eos else "length",
                                       len(req.prompt_ids), res.stats, queued, first, logprobs, eos))

    def _end(self, job: Job, kind: str, value: Any) -> None:
        self.metrics.ended({"done": "completed", "cancelled": "cancelled", "error": "failed"}[kind])
        with self._lock:
            self._live.discard(job)
        job.emit((kind, value))


class _Stream:
    """A job's ``on_tokens``: streams the final text of the committed blocks (the first text at once, then once
    ``interval`` tokens were committed since the last sent; :attr:`held` is what waits), and asks to stop at a stop
    string or when the job is cancelled. With log-probabilities (:attr:`logprobs`: the decoding's growing list),
    each text event follows a ``"logprobs"`` event with those of the tokens fed to the text since the last."""

    def __init__(self, job: Job, text: TextStream, interval: int = 1, metrics: Metrics | None = None):
        self.job, self.text, self.interval, self.metrics = job, text, interval, metrics
        self.started: list[float] = []
        self.held = ""          # final text not sent yet
        self._tokens = 0        # tokens committed since the last text sent
        self._sent = False
        self.logprobs: "list[TokenLogprob] | None" = None
        self.sent_logprobs = 0  # tokens whose log-probabilities were sent
        self.decoding: "Decoding | None" = None   # the job's decoding, once added to the batch

    def __call__(self, block: list[int]) -> bool:
        if not self.started:
            self.started.append(time.perf_counter())
        if self.metrics is not None:
            self.metrics.committed(len(block))
        if self.job.cancelled:
            return True
        self.held += self.text.feed(block)
        self._tokens += len(block)
        if self.held and (not self._sent or self._tokens >= self.interval):
            if self.logprobs is not None:
                n = len(self.text.ids)
                self.job.emit(("logprobs", self.logprobs[self.sent_logprobs:n]))
                self.sent_logprobs = n
            self.job.emit(("text", self.held))
            self.held, self._tokens, self._sent = "", 0, True
        return self.text.stopped
