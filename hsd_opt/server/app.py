"""The ASGI application (Starlette): OpenAI-compatible routes over one :class:`~hsd_opt.server.jobs.JobQueue`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize`` (the
ids a request decodes from, as vLLM and llama.cpp's server answer them), ``GET /health``, ``GET /metrics``
(Prometheus' text format: :mod:`hsd_opt.server.metrics`). Every error is an OpenAI-style body
(:mod:`hsd_opt.server.errors`); a refused request is logged as one access-log line, never a traceback. With an API
key, every route but ``/health`` and ``/metrics`` wants ``Authorization: Bearer KEY`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hsd_opt.server.errors import ApiError, error_body
from hsd_opt.server.jobs import Job, JobQueue, QueueFull, Stopping
from hsd_opt.server.requests import (
    GenerationRequest,
    ModelInfo,
    choice_requests,
    parse_detokenize,
    parse_json,
    parse_request,
    parse_tokenize,
)
from hsd_opt.server.responses import DONE, ChoiceStream, completion_body, new_id, now, sse, usage_chunk

log = logging.getLogger("hsd_opt.server")
Event = tuple[str, Any]


def _stopping_error(taken: bool = False) -> ApiError:
    """The 503 of a request the server is stopping for: one it did not take (or stopped reading), or one it had
    ``taken`` (waiting or decoding) and cancelled."""
    msg = "the request was cancelled: the server is stopping" if taken else \
        "the server is stopping; the request was not taken"
    return ApiError(503, msg, "server_error", None, "cancelled")


def _error(e: ApiError) -> JSONResponse:
    headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"}}.get(e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


#: The routes open without the API key (what a load balancer and a monitoring scraper read).
OPEN_PATHS = ("/health", "/metrics")


class ApiKeyMiddleware:
    """Pure ASGI middleware: every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>``
    (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "a wrong API key" if token.strip() else "no API key"
                err = ApiError(401, f"{what}: send 'Authorization: Bearer KEY' with the server's --api-key",
                               "invalid_request_error", None, "invalid_api_key")
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflight (an origin, method or header not allowed) answers the
    API's JSON error body, as every other refusal does (Starlette answers plain text)."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        what = response.body.decode("utf-8", "replace")          # "Disallowed CORS origin, private-network"
        failed = what.removeprefix("Disallowed CORS ").split(", ")
        why = [h for f, h in (("origin", "the server's --allowed-origins names the pages allowed"),
                              ("private-network", "a public page may not call this server at a private address: "
                                                  "it grants no Private Network Access")) if f in failed]
        err = ApiError(response.status_code, f"{what} ({'; '.join(why)})" if why else what,
                       "invalid_request_error", None, "cors_refused")
        kept = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return JSONResponse(err.body(), status_code=err.status, headers=kept)


class TrailingSlashMiddleware:
    """Pure ASGI middleware: ``/v1/completions/`` is ``/v1/completions`` (a client's base URL with a slash too
    many), answered in place instead of Starlette's redirect, which clients do not follow for a ``POST``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            scope["raw_path"] = scope["path"].encode()
        await self.app(scope, receive, send)


class EventStream:
    """An ASGI response of server-sent events from ``chunks``; when the client disconnects, ``on_disconnect``
    is called at once (it cancels the job and wakes ``chunks``), and nothing more is sent."""

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.chunks, self.on_disconnect = chunks, on_disconnect

    async def __call__(self, scope, receive, send):
        gone = asyncio.Event()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            self.on_disconnect()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for data in self.chunks:
                if gone.is_set():
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            self.on_disconnect()  # harmless once the job ended
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


async def _disconnected(receive) -> None:
    """Returns when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Service:
    """What the routes share: the job queue, the served model and what ``/health`` tells about the plan."""

    def __init__(self, jobs: JobQueue, info: ModelInfo, about: dict[str, Any] | None = None,
                 max_body: int = 4 * 1024 * 1024):
        self.jobs, self.info, self.about, self.max_body = jobs, info, dict(about or {}), max_body

    async def body(self, request: Request) -> bytes:
        """The request body, refused with 413 once it is known to exceed ``max_body`` bytes (from its
        Content-Length before reading, else while reading): a huge body is never read whole."""
        too_big = ApiError(413, f"the request body is over {self.max_body} bytes", "invalid_request_error", None,
                           "body_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise too_big
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > self.max_body:
                raise too_big
            parts.append(part)
        return b"".join(parts)

    async def tokenize(self, request: Request) -> JSONResponse:
        """``POST /tokenize``: ``{"tokens", "count", "max_model_len"}`` (:func:`parse_tokenize`)."""
        raw = await self.body(request)
        ids = await asyncio.to_thread(lambda: parse_tokenize(parse_json(raw), self.info))    # off the event loop
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.info.max_positions})

    async def detokenize(self, request: Request) -> JSONResponse:
        """``POST /detokenize``: ``{"prompt": text, "content": text}`` (:func:`parse_detokenize`)."""
        raw = await self.body(request)
        text = await asyncio.to_thread(lambda: self.info.tokenizer.decode(parse_detokenize(parse_json(raw),
                                                                                           self.info)))
        return JSONResponse({"prompt": text, "content": text})

    def submit(self, reqs: list[GenerationRequest], n: int = 1) -> tuple[list[Job], asyncio.Queue]:
        """Queue the decodings of an answer's ``n`` choices (``reqs``: one per choice, or one whose answer is every
        choice's: :func:`~hsd_opt.server.requests.choice_requests`); their events arrive on the returned asyncio
        queue as ``(choice index, event)``. 429 when the queue has fewer free places than decodings (none is
        queued then)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(choices: range) -> Callable[[Event], None]:
            def emit(ev: Event) -> None:  # called from the worker thread
                try:
                    for i in choices:
                        loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                except RuntimeError:  # the event loop has closed: the server is gone
                    pass
            return emit

        jobs = [Job(req, emitter(range(n) if len(reqs) == 1 else range(i, i + 1))) for i, req in enumerate(reqs)]
        try:
            self.jobs.submit_all(jobs)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", "rate_limit_error", None,
                           "queue_full") from None
        except Stopping:
            raise _stopping_error() from None
        return jobs, events

    async def generate(self, request: Request, kind: str) -> Response | EventStream:
        try:
            raw = await self.body(request)
        except ClientDisconnect:
            return Response(status_code=400)
        # read, tokenized and checked in a thread: a prompt of megabytes takes seconds to tokenize, which on the
        # event loop would stall every other client's stream
        req = await asyncio.to_thread(lambda: parse_request(parse_json(raw), kind, self.info))
        runs = choice_requests(req)
        if len(runs) > self.jobs.places:     # never admitted, however idle the server
            raise ApiError(400, f"'n' asks for {len(runs)} sampled choices; this server holds at most "
                                f"{self.jobs.places} requests ({self.jobs.batch.max_active} decoding, "
                                f"{self.jobs.max_queue} waiting: hsd serve --max-batch, --max-queue)",
                           "invalid_request_error", "n")
        jobs, events = self.submit(runs, req.n)
        rid, created = new_id(kind), now()
        if req.stream:
            def gone():
                for job in jobs:
                    job.cancel()
                events.put_nowait((-1, ("gone", None)))

            return EventStream(self._chunks(req, events, rid, created), gone)
        outcomes = await self._wait(request, jobs, events, req.n)
        if outcomes is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(completion_body(kind, rid, created, req.model, outcomes, req.tool, self.info.tokenizer))

    async def _wait(self, request: Request, jobs: list[Job], events: asyncio.Queue, n: int):
        """The :class:`Outcome` of each of the ``n`` choices, or None if the client disconnected first (the jobs
        are then cancelled)."""
        disconnect = asyncio.ensure_future(_disconnected(request.receive))
        outcomes: list = [None] * n
        try:
            while any(o is None for o in outcomes):
                get = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                i, (kind, val) = get.result()
                if kind == "done":
                    outcomes[i] = val
                elif kind == "cancelled":
                    raise _stopping_error(taken=True)
                elif kind == "error":
                    raise val if isinstance(val, ApiError) else ApiError(500, val, "server_error")
            return outcomes
        finally:
            disconnect.cancel()
            for job in jobs:
                job.cancel()  # a no-op once it ended

    async def _chunks(self, req: GenerationRequest, events: asyncio.Queue, rid: str,
                      created: int) -> AsyncIterator[bytes]:
        """The stream of an answer: each choice's chunks (:class:`ChoiceStream`) as its events come, choices
        interleaved; after the last choice's end, the usage (asked for) and ``[DONE]``; an error ends it."""
        kind, model = req.kind, req.model
        streams = [ChoiceStream(self.info.tokenizer, kind, model, req.tool, rid, created, i) for i in range(req.n)]
        for c in streams:
            for e in c.opening():
                yield e
        outcomes: list = [None] * req.n
        while True:
            i, (what, val) = await events.get()
            if what in ("logprobs", "text"):
                for e in streams[i].event(what, val):
                    yield e
            elif what == "done":
                outcomes[i] = val
                for e in streams[i].end(val):
                    yield e
                if all(o is not None for o in outcomes):
                    if req.include_usage:
                        yield sse(usage_chunk(kind, rid, created, model, outcomes))
                    yield DONE
                    return
            elif what == "cancelled":
                yield sse(_stopping_error(taken=True).body())
                return
            elif what == "error":
                yield sse(val.body() if isinstance(val, ApiError) else error_body(val, "server_error"))
                return
            else:  # "gone": the client disconnected
                return


async def _http_error(request: Request, exc: HTTPException):
    """Starlette's own 404 and 405 (and any other HTTP error) as OpenAI-style error bodies."""
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}; see /v1/chat/completions, /v1/completions, " \
              f"/v1/models, /tokenize, /detokenize, /health, /metrics"
        return _error(ApiError(404, msg, "invalid_request_error", None, "not_found"))
    if exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}"
        resp = _error(ApiError(405, msg, "invalid_request_error", None, "method_not_allowed"))
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp
    return _error(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"))


def create_app(jobs: JobQueue, info: ModelInfo, api_key: str | None = None,
               about: dict[str, Any] | None = None, max_body: int = 4 * 1024 * 1024,
               allowed_origins: Sequence[str] = ("*",)) -> Starlette:
    """The Starlette app serving ``jobs`` as the model ``info.name``. Its lifespan starts the queue's worker
    and stops it (cancelling what is queued or running). ``allowed_origins``: the web pages' origins whose scripts
    may call it (CORS; ``"*"``: any, as vLLM's and llama.cpp's servers by default; empty: none); a browser's
    preflight is answered before the API key is asked for. ``about``: extra fields for ``GET /health`` (the plan,
    its hierarchy). ``max_body``: bytes of a request body at most (413 beyond)."""
    svc = Service(jobs, info, about, max_body)

    def guarded(fn: Callable[[Request], Awaitable[Any]]):
        async def endpoint(request: Request):
            try:
                return await fn(request)
            except ApiError as e:
                return _error(e)
            except ClientDisconnect:                # the client left while sending its body: no one to answer
                return Response(status_code=400)
            except asyncio.CancelledError:          # the server stopped waiting for it (its body still arriving,
                return _error(_stopping_error())     # past the grace period): an answer, not uvicorn's traceback
            except Exception as e:  # a bug: logged with its traceback, answered with an error body
                log.exception("%s %s failed", request.method, request.url.path)
                return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

        return endpoint

    async def chat(request: Request):
        return await svc.generate(request, "chat")

    async def completions(request: Request):
        return await svc.generate(request, "completion")

    def model_card() -> dict[str, Any]:
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "hsd-opt"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request):
        if request.path_params["model"] != info.name:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist; this server serves "
                                f"{info.name!r}", "invalid_request_error", "model", "model_not_found")
        return JSONResponse(model_card())

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": info.name, **svc.about, **jobs.status()})

    async def metrics(request: Request):
        return PlainTextResponse(jobs.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        jobs.start()
        try:
            yield
        finally:
            await asyncio.to_thread(jobs.stop)

    routes = [
        *(Route(prefix + path, guarded(fn), methods=[method]) for prefix in ("/v1", "")   # llama-server's too
          for path, fn, method in (("/chat/completions", chat, "POST"), ("/completions", completions, "POST"),
                                   ("/models", models, "GET"), ("/models/{model:path}", model, "GET"))),
        Route("/tokenize", guarded(svc.tokenize), methods=["POST"]),
        Route("/detokenize", guarded(svc.detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.service = svc
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:                 # added last: outermost, so a preflight never meets the API key
        app.add_middleware(CorsMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(TrailingSlashMiddleware)     # outermost: the API key's open paths see the plain path
    return app
