"""One engine replica as a Ray Serve deployment (imports Ray: loaded only by the launcher).

:class:`EngineReplica` builds an :class:`pagedkv.engine.engine.LLMEngine`, wraps it in today's
server (:func:`pagedkv.serving.app.build_app`) and serves it with uvicorn in a thread on a free
port of its node's IP; the ingress sends HTTP there directly (streams included). Ray Serve owns
its life: ``check_health`` fails when the HTTP thread or the engine loop died, and the Serve
controller replaces a replica whose process ended (the new process reports a new ``pid`` and
``url``). Its methods, called through a ``DeploymentHandle``, report what the ingress needs:
``info`` (url, pid, model identity and KV format, block size, KV events endpoint), ``stats``, ``metrics_text``
and ``tokenizer``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from pagedkv.engine.engine import LLMEngine
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer
from pagedkv.utils import free_port


class EngineReplica:
    """Replica ``rank``. ``model``: as for ``LLMEngine`` (path, None = bundled), or
    ``model_factory()`` returning a ``LoadedModel`` (tests: a tiny random model).
    ``engine_kwargs`` / ``server_kwargs``: for ``LLMEngine`` / ``build_app``;
    ``engine_kwargs["kv_events"] == "auto"`` publishes KV events on a free port of this node.
    ``host``: the address to bind and advertise (default: this node's IP, as Ray sees it).
    ``num_threads``: torch intra-op threads of this process (default: torch's choice).
    Raises what ``LLMEngine`` raises (``ConfigError``); Ray Serve then retries the start."""

    def __init__(self, rank: int, model: Optional[str], engine_kwargs: dict[str, Any],
                 server_kwargs: dict[str, Any], host: Optional[str] = None,
                 model_factory: Optional[Callable[[], Any]] = None, num_threads: Optional[int] = None) -> None:
        import ray
        import torch

        if num_threads is not None:
            torch.set_num_threads(num_threads)

        self.rank = rank
        self.host = host or ray.util.get_node_ip_address()
        kw = dict(engine_kwargs)
        if kw.get("kv_events") == "auto":
            port = free_port()
            kw["kv_events"] = f"tcp://{self.host}:{port}"
            kw["kv_events_replay"] = f"tcp://{self.host}:{free_port()}"
        self.engine = LLMEngine(model_factory() if model_factory is not None else model, **kw)
        self.app = build_app(self.engine, **server_kwargs)
        self.server = ThreadedServer(self.app, host=self.host, port=0)
        self.kv_events = kw.get("kv_events")

    def info(self) -> dict[str, Any]:
        """Who and where: ``rank``, ``url``, ``pid``, ``model_id``, ``revision``, ``kv_format``
        (the cache format in its block hashes), ``block_size`` (tokens), ``num_blocks``, ``kv_events`` (endpoint or None)."""
        cfg = self.engine.config
        return {"rank": self.rank, "url": self.server.url, "pid": os.getpid(), "model_id": self.engine.model_id,
                "revision": self.engine.revision, "kv_format": self.engine.kv_format_id, "block_size": cfg.block_size, "num_blocks": self.engine.num_blocks,
                "kv_events": self.kv_events}

    def stats(self) -> dict[str, Any]:
        """``url``, ``pid`` and the engine's load: ``running``, ``waiting`` (requests),
        ``kv_usage`` (0-1), ``prefix_hit_tokens``, ``prompt_tokens``."""
        st = self.engine.get_stats()
        return {"url": self.server.url, "pid": os.getpid(), "running": st.num_running, "waiting": st.num_waiting,
                "kv_usage": st.kv_usage}

    def reset_prefix_cache(self) -> int:
        """Forget this replica's prefix cache (benchmarks). Returns the blocks unpublished."""
        return self.engine.reset_prefix_cache()

    def metrics_text(self) -> str:
        """This replica's ``/metrics`` exposition (no API key needed on this path)."""
        return self.app.state.pagedkv.metrics.render().decode()

    def tokenizer(self) -> Any:
        """The engine's HF tokenizer (pickled to the ingress: the same ids, the same template)."""
        return self.engine.tokenizer

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the HTTP thread or the engine loop stopped."""
        if not self.server.thread.is_alive():
            raise RuntimeError(f"replica {self.rank}: the HTTP server thread stopped")
        if not self.app.state.pagedkv.loop.running and self.server.server.started:
            raise RuntimeError(f"replica {self.rank}: the engine loop stopped")

    def __del__(self) -> None:  # Ray Serve calls it on a graceful shutdown
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(timeout_s=10.0)  # drains the engine loop (app lifespan)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


class ReplicaGroup:
    """The application's ingress deployment: it only holds the replicas so that one
    ``serve.run`` starts them all in parallel."""

    def __init__(self, *replicas: Any) -> None:
        self.replicas = replicas

    def size(self) -> int:
        return len(self.replicas)
