"""``hsd serve``: an OpenAI-compatible HTTP server over one plan's hierarchy (``docs/design.md#server``).

    from hsd_opt.server import JobQueue, ModelInfo, create_app, BackgroundServer
    jobs = JobQueue(hsd_for_plan(plan, loaded), loaded.tokenizer, max_queue=16)
    app = create_app(jobs, ModelInfo("smollm2-135m", loaded.tokenizer, 8192))
    with BackgroundServer(app) as srv: ...        # srv.url, e.g. http://127.0.0.1:41234

Modules: :mod:`~hsd_opt.server.requests` (validating request bodies), :mod:`~hsd_opt.server.text` (streamed
text and stop strings), :mod:`~hsd_opt.server.jobs` (the job queue and the worker thread),
:mod:`~hsd_opt.server.responses` (OpenAI bodies and chunks), :mod:`~hsd_opt.server.app` (the Starlette routes),
:mod:`~hsd_opt.server.serving` (uvicorn).

The worker thread decodes; a thread that loaded the model beforehand holds an OpenMP pool of its own, which slows
the worker's passes (libgomp stops spinning once two pools outnumber the cores): call
:func:`hsd_opt.engine.kernels.release_thread_pool` on it before serving, as ``hsd serve`` does.
"""

from hsd_opt.server.app import create_app
from hsd_opt.server.jobs import Job, JobQueue, Outcome, QueueFull
from hsd_opt.server.requests import GenerationRequest, ModelInfo
from hsd_opt.server.serving import BackgroundServer

__all__ = ["create_app", "JobQueue", "Job", "Outcome", "QueueFull", "GenerationRequest", "ModelInfo",
           "BackgroundServer"]
