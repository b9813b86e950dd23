"""The server's job queue: one request decoded at a time, a bounded FIFO queue in front of one worker thread.

The worker runs :meth:`HSD.generate` (batch 1) for each :class:`Job` in arrival order; torch releases the GIL in
its kernels, so the server's event loop stays responsive meanwhile. Each job reports through ``job.emit``,
called from the worker thread with one event at a time:

- ``("text", str)``: text made final by a committed block (:class:`~hsd_opt.server.text.TextStream`);
- ``("done", Outcome)``: the generation ended (EOS, ``max_tokens`` or a stop string);
- ``("cancelled", None)``: the job was cancelled (the client went away, the server is stopping);
- ``("error", str)``: the generation failed (logged with its traceback: a bug, never a bad request).

Cancelling a job (:meth:`Job.cancel`, thread-safe) frees the worker at the next committed block: the
``on_tokens`` callback sees the flag and asks :meth:`HSD.generate` to stop. A job cancelled while it waits is
skipped. Every :meth:`HSD.generate` starts afresh (caches cropped, token drafters reset), so one request's state
never reaches the next.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from hsd_opt.server.requests import GenerationRequest
from hsd_opt.server.text import TextStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hsd_opt.runtime.decode import HSD

log = logging.getLogger("hsd_opt.server")


class QueueFull(Exception):
    """Raised by :meth:`JobQueue.submit` when ``max_queue`` requests already wait."""


@dataclass
class Outcome:
    """A finished generation.

    Attributes:
        token_ids: the generated ids the client gets (cut at the token completing a stop string).
        text: their text (before the stop string), as streamed.
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens`` reached).
        prompt_tokens: tokens of the prompt.
        stats: :meth:`HSD.generate`'s stats (``GenerationResult.stats``), every committed token counted.
        queue_seconds: seconds the job waited before the worker took it.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: dict[str, Any]
    queue_seconds: float


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
        runner: what decodes: an object with :meth:`HSD.generate`'s signature (an :class:`HSD`).
        tokenizer: the model's tokenizer (decoding text, stop strings).
        max_queue: most requests that may wait while one is decoded (>= 1); one more is refused
            (:class:`QueueFull`).
    """

    def __init__(self, runner: "HSD", tokenizer: "PreTrainedTokenizerBase", max_queue: int = 16):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.runner, self.tokenizer, self.max_queue = runner, tokenizer, max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # waiting or running
        self._thread: threading.Thread | None = None
        self.running: Job | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0, "generated_tokens": 0}

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

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job, let the worker finish the current block and end (waits up to ``timeout`` s)."""
        self.cancel_all()
        if self._thread is not None:
            try:  # the queue only holds cancelled jobs now, which the worker skips
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO). Raises :class:`QueueFull` when ``max_queue`` jobs already wait."""
        with self._lock:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.counts["refused"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting") from None
            self._live.add(job)

    @property
    def waiting(self) -> int:
        """Jobs in the queue (not counting the one being decoded)."""
        return self._queue.qsize()

    def status(self) -> dict[str, Any]:
        """``waiting``, ``busy``, the counts of ``completed``, ``cancelled``, ``failed`` and ``refused``
        (queue full) requests since start, and ``generated_tokens``: every token the worker committed (of
        cancelled generations too, up to where they stopped)."""
        return {"waiting": self.waiting, "max_queue": self.max_queue, "busy": self.running is not None,
                **self.counts}

    # ------------------------------------------------------------------------------------------ worker

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = job
            try:
                self._run(job)
            except Exception as e:  # a bug in the decoder: log it, tell the client, keep serving
                log.exception("generation failed")
                self.counts["failed"] += 1
                job.emit(("error", f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self.running = None
                with self._lock:
                    self._live.discard(job)

    def _run(self, job: Job) -> None:
        if job.cancelled:
            self.counts["cancelled"] += 1
            job.emit(("cancelled", None))
            return
        req = job.request
        waited = time.perf_counter() - job.submitted
        text = TextStream(self.tokenizer, req.stop)

        def on_tokens(block: list[int]) -> bool:
            if job.cancelled:
                return True
            delta = text.feed(block)
            if delta:
                job.emit(("text", delta))
            return text.stopped

        res = self.runner.generate(req.prompt_ids, req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                   seed=req.seed, on_tokens=on_tokens)
        self.counts["generated_tokens"] += len(res.token_ids)
        if job.cancelled:
            self.counts["cancelled"] += 1
            job.emit(("cancelled", None))
            return
        rest = text.finish()
        if rest:
            job.emit(("text", rest))
        ids = list(text.ids) if text.stopped else list(res.token_ids)
        stopped = text.stopped or res.stats.get("stopped") == "eos"
        self.counts["completed"] += 1
        job.emit(("done", Outcome(ids, text.text, "stop" if stopped else "length", len(req.prompt_ids),
                                  res.stats, waited)))
