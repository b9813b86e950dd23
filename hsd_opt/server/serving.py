"""Running the app on uvicorn: binding the socket first (a clear error for a taken port), a ready callback once
the server accepts connections, cancelling every job when it stops, and a background server in a thread
(tests, benchmarks, embedding)."""

from __future__ import annotations

import copy
import socket
import threading
from typing import Any, Callable

import uvicorn

from hsd_opt.errors import HsdError

#: Seconds uvicorn waits for open connections after Ctrl-C (streams end sooner: their jobs are cancelled).
GRACEFUL_SECONDS = 5.0


#: Connections the kernel queues before the server accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (``port`` 0: a free port, read it with
    ``getsockname()``): a second server started before the first has loaded its model is refused at once.

    Raises:
        HsdError: the address cannot be resolved or bound (in use, not an address of this machine), naming the
            flags.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise HsdError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    except UnicodeError:                          # a label over 63 characters, a name the IDNA codec refuses
        raise HsdError(f"--host {host[:80]}: not a valid host name") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)     # claimed now: another bound-but-not-listening socket would share the port
    except OSError as e:
        sock.close()
        raise HsdError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def log_config() -> dict[str, Any]:
    """uvicorn's logging set-up with the access log on stderr too (stdout stays for results), and the package's
    own loggers (``hsd_opt``: the worker's stats lines, failures) through uvicorn's default handler at INFO."""
    cfg = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    cfg["handlers"]["access"]["stream"] = "ext://sys.stderr"
    cfg["loggers"]["hsd_opt"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return cfg


class Server(uvicorn.Server):
    """uvicorn's server with two hooks: ``on_ready()`` once it accepts connections, ``on_stop()`` as soon as it
    starts shutting down (before it waits for open connections: cancelling every job ends their
    streams)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None = None,
                 on_stop: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_ready, self.on_stop = on_ready, on_stop

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()

    async def shutdown(self, sockets=None) -> None:
        if self.on_stop is not None:
            self.on_stop()
        await super().shutdown(sockets=sockets)


def make_server(app, on_ready=None, on_stop=None, log_level: str = "info", logging_config: dict | None = None,
                access_log: bool = True) -> Server:
    """A :class:`Server` for ``app`` (``logging_config`` None leaves logging as the process has it)."""
    config = uvicorn.Config(app, log_level=log_level, log_config=logging_config, access_log=access_log,
                            timeout_graceful_shutdown=GRACEFUL_SECONDS, lifespan="on")
    return Server(config, on_ready, on_stop)


class BackgroundServer:
    """``app`` served on ``host`` (127.0.0.1) at a free port in a thread, as a context manager::

        with BackgroundServer(app) as srv:
            OpenAI(base_url=srv.url + "/v1", api_key="x")

    ``on_stop`` is called when the server begins to stop (e.g. ``jobs.stop_taking``). Logging is left as the
    process has it (uvicorn's loggers ``uvicorn.error`` and ``uvicorn.access`` propagate to the root).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, on_stop: Callable[[], None] | None = None,
                 timeout: float = 30.0):
        self.sock = bind_socket(host, port)
        h, p = self.sock.getsockname()[:2]
        self.url = f"http://{h if ':' not in h else f'[{h}]'}:{p}"
        self._ready = threading.Event()
        self.server = make_server(app, on_ready=self._ready.set, on_stop=on_stop)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="hsd-server", daemon=True)
        self.timeout = timeout

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(self.timeout):
            self.stop()
            raise RuntimeError(f"the server at {self.url} did not start within {self.timeout} s")
        return self

    def stop(self) -> None:
        """Ask the server to stop and wait for its thread."""
        self.server.should_exit = True
        self._thread.join(self.timeout + GRACEFUL_SECONDS)
        self.sock.close()

    def __exit__(self, *exc) -> None:
        self.stop()
