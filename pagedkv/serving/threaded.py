"""Run the app with uvicorn in a background thread (tests, notebooks, benchmarks).

    with ThreadedServer(build_app(engine)) as srv:
        OpenAI(base_url=srv.url + "/v1", api_key="x")...

The socket is bound before the thread starts (``port=0``: any free port), so ``url`` is
valid as soon as the constructor returns; ``stop()`` runs uvicorn's graceful shutdown
(in-flight responses may finish for ``timeout_graceful_s`` seconds) and the app's lifespan
shutdown (the engine loop drains). Slow clients are cut as by ``pagedkv serve``
(:mod:`pagedkv.serving.http_protocol`).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

from pagedkv.serving.http_protocol import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, uvicorn_options


class ThreadedServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread. Raises ``RuntimeError``
    if the server does not start within ``start_timeout_s`` seconds. ``header_timeout_s`` /
    ``body_timeout_s``: deadlines of a request's head and body (seconds)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 timeout_graceful_s: Optional[int] = 5, start_timeout_s: float = 30.0,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        cfg = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=timeout_graceful_s,
                             lifespan="on", access_log=False,
                             **uvicorn_options(header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s))
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="pagedkv-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown; blocks until the server thread ends (or ``timeout_s``)."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ThreadedServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
