"""Start N engine replicas on Ray Serve and the ingress in front of them.

``ReplicaService.start(...)`` joins a Ray cluster (``ray_address``) or starts Ray locally
(``num_cpus`` CPUs, no dashboard), starts Serve without its HTTP proxy (the ingress talks to
each replica's own HTTP server) and deploys one application ``pagedkv`` holding N deployments
``pagedkv-replica-<rank>`` (one replica each, so every rank is addressable and Serve restarts
a dead one under the same rank). :class:`RayReplicas` is the ingress's
:class:`pagedkv.serving.replicas.ingress.ReplicaControl` over their ``DeploymentHandle`` s.
``stop()`` deletes the application; a Ray this process started (no ``ray_address``) is shut
down with Serve, a cluster keeps running (the driver disconnects).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

import ray
from ray import serve

from pagedkv.errors import ConfigError
from pagedkv.serving.replicas.events import EventFeed
from pagedkv.serving.replicas.ingress import Ingress, build_ingress
from pagedkv.serving.replicas.replica import EngineReplica, ReplicaGroup
from pagedkv.serving.replicas.router import DEFAULT_LOAD_GAP, DEFAULT_POLICY, ReplicaView, Router

logger = logging.getLogger("pagedkv.serving.replicas")
APP = "pagedkv"
CALL_TIMEOUT_S = 2.0  # a replica that does not answer a stats call within this is out of routing


class RayReplicas:
    """Replica control over Serve handles: ``refresh`` asks every replica for its stats (in
    parallel, ``CALL_TIMEOUT_S`` each) and marks it up with its URL or down; a replica that
    comes back as a new process gets a fresh index and a new KV event feed."""

    def __init__(self, handles: list[Any], events: bool) -> None:
        self.handles = handles
        self.events = events
        self.feeds: dict[int, EventFeed] = {}

    async def _call(self, rank: int, method: str) -> Any:
        return await asyncio.wait_for(getattr(self.handles[rank], method).remote(), CALL_TIMEOUT_S)

    async def _refresh_one(self, router: Router, view: ReplicaView) -> None:
        try:
            st = await self._call(view.rank, "stats")
        except Exception:
            router.mark_down(view)
            return
        new_process = st["pid"] != view.pid
        if new_process and self.events:
            try:
                info = await self._call(view.rank, "info")
            except Exception:
                router.mark_down(view)
                return
            old = self.feeds.pop(view.rank, None)
            if old is not None:
                old.close()
            if info["kv_events"]:
                self.feeds[view.rank] = EventFeed(router, view, info["kv_events"])
        view.kv_usage = float(st["kv_usage"])
        router.mark_up(view, st["url"], st["pid"])

    async def refresh(self, router: Router) -> None:
        await asyncio.gather(*(self._refresh_one(router, v) for v in router.replicas))

    async def metrics_text(self, replica: ReplicaView) -> Optional[str]:
        try:
            return await self._call(replica.rank, "metrics_text")
        except Exception:
            return None

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.feeds.clear()


def _deploy_failure(exc: Exception) -> str:
    """The last error line of the first failed replica's status message (its constructor's
    exception), else of ``exc``."""
    texts = []
    try:
        for name, dep in serve.status().applications[APP].deployments.items():
            if dep.message:
                texts.append(dep.message)
    except Exception:  # no status: the exception is all there is
        pass
    texts.append(str(exc))
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines() if "Error" in ln and "Traceback" not in ln]
        if lines:
            return lines[-1][:2000]
    return str(exc)[:2000]


class ReplicaService:
    """N replicas on Ray Serve (see the module docstring); build with :meth:`start`."""

    def __init__(self, handles: list[Any], info: dict[str, Any], tokenizer: Any, connected: bool,
                 local: bool) -> None:
        self.handles, self.info, self.tokenizer = handles, info, tokenizer
        self.connected = connected  # this process called ray.init (disconnect at the end)
        self.local = local          # ... and that started Ray here (stop Serve and Ray at the end)

    @classmethod
    def start(cls, num_replicas: int, model: Optional[str], engine_kwargs: dict[str, Any],
              server_kwargs: dict[str, Any], *, ray_address: Optional[str] = None, num_cpus: Optional[int] = None,
              replica_cpus: float = 0.0, model_factory: Optional[Callable[[], Any]] = None,
              replica_threads: Optional[int] = None, health_check_period_s: float = 1.0) -> "ReplicaService":
        """Deploy ``num_replicas`` (>= 1) replicas and wait until each one serves. Ray starts
        locally with ``num_cpus`` unless ``ray_address`` names a cluster (``"auto"``: the one
        ``ray start`` made on this machine). ``replica_cpus``: Ray CPUs each replica reserves
        (0: none, the default, so small machines fit any N). A replica that fails to start (twice
more after its first try) raises ``ConfigError`` after stopping what was started. ``replica_threads``: torch threads
        per replica (default: torch's choice; on one machine, cores / N avoids oversubscription). Raises ``ValueError`` for N < 1."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        started = not ray.is_initialized()
        if started:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                         object_store_memory=128 << 20)
        serve.start(proxy_location="Disabled")
        dep = serve.deployment(EngineReplica, num_replicas=1, max_ongoing_requests=1000, max_constructor_retry_count=2,
                               health_check_period_s=health_check_period_s, health_check_timeout_s=30.0,
                               graceful_shutdown_timeout_s=15.0, ray_actor_options={"num_cpus": replica_cpus})
        reps = [dep.options(name=f"pagedkv-replica-{i}").bind(i, model, engine_kwargs, server_kwargs,
                                                             model_factory=model_factory, num_threads=replica_threads)
                for i in range(num_replicas)]
        group = serve.deployment(ReplicaGroup, name="pagedkv-group", ray_actor_options={"num_cpus": 0})
        svc = cls([], {}, None, started, started and not ray_address)
        try:
            serve.run(group.bind(*reps), name=APP, route_prefix=None)
            svc.handles = [serve.get_deployment_handle(f"pagedkv-replica-{i}", app_name=APP)
                           for i in range(num_replicas)]
            svc.info = svc.handles[0].info.remote().result()
            svc.tokenizer = svc.handles[0].tokenizer.remote().result()
        except Exception as e:  # a replica that cannot start (bad model, options): clean up, say why
            why = _deploy_failure(e)
            svc.stop()
            raise ConfigError(f"the replicas did not start: {why}") from None
        return svc

    def build_ingress(self, policy: str = DEFAULT_POLICY, load_gap: int = DEFAULT_LOAD_GAP, *,
                      api_keys: Optional[dict[str, str]] = None, max_body_bytes: int = 1 << 20,
                      open_routes: tuple[str, ...] = (), poll_s: float = 0.5) -> Any:
        """The ingress FastAPI app over these replicas (its state: ``app.state.ingress``)."""
        if getattr(self, "control", None) is not None:  # a new ingress replaces the old one's feeds
            self.control.close()
        views = [ReplicaView(rank=i) for i in range(len(self.handles))]
        for v in views:
            v.index.capacity = max(1, int(self.info["num_blocks"]))  # a replica holds no more
        router = Router(views, policy, load_gap)
        self.control = RayReplicas(self.handles, events=bool(self.info["kv_events"]))
        model = {k: self.info[k] for k in ("model_id", "revision", "kv_format", "block_size")}
        ing = Ingress(router, self.control, self.tokenizer, model, api_keys=api_keys,
                      max_body_bytes=max_body_bytes, open_routes=open_routes, poll_s=poll_s)
        return build_ingress(ing)

    def reset_prefix_caches(self) -> None:
        """Every replica forgets its prefix cache (benchmarks: each policy starts cold)."""
        for h in self.handles:
            h.reset_prefix_cache.remote().result()

    def pids(self) -> list[int]:
        """Each replica's process id (tests end one to see it replaced)."""
        return [h.info.remote().result()["pid"] for h in self.handles]

    def stop(self) -> None:
        """Delete the replicas (each drains its engine), then Serve and Ray if started here.
        Idempotent."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        control = getattr(self, "control", None)
        if control is not None:
            control.close()
        try:
            serve.delete(APP)
            if self.local:
                serve.shutdown()
        finally:
            if self.connected:
                ray.shutdown()  # a local Ray stops; a cluster stays, this driver disconnects
