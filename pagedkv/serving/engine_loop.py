"""One engine loop for the whole server.

:class:`EngineLoop` owns a background thread that calls ``engine.step()`` while the engine
has work and sleeps on an event while it has none. HTTP handlers (asyncio) submit requests
with :meth:`EngineLoop.submit` and iterate :meth:`Submission.outputs`, which yields the
engine's cumulative ``RequestOutput`` for each step that touched one of their requests, as
soon as the step returns (the step thread hands them over with
``loop.call_soon_threadsafe``). Leaving the iteration early — a client disconnect cancels
the handler — aborts the submission's requests; the KV manager returns their blocks at the
next step fence, never while a step that used them runs.

Shutdown (:meth:`EngineLoop.shutdown`) refuses new work, lets in-flight requests finish
for up to ``timeout_s`` seconds, aborts the rest, keeps stepping until the engine holds no
request (so every deferred free has happened), then stops the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from pagedkv.engine.request import RequestOutput, SamplingParams
from pagedkv.engine.sampler import SamplingError
from pagedkv.utils import release_openmp_pool

logger = logging.getLogger("pagedkv.serving")


class EngineStoppedError(RuntimeError):
    """The loop is shutting down or stopped: no new requests are accepted."""


class EngineStepError(RuntimeError):
    """``engine.step()`` raised while this request was in flight (the request was aborted).
    ``code``: ``"engine_error"``, or ``"sampling_error"`` when the sampler refused this
    request alone (:class:`pagedkv.engine.sampler.SamplingError`)."""

    def __init__(self, message: str, code: str = "engine_error") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PromptSpec:
    """One engine request of a submission: the prompt (text or token ids), its sampling
    parameters and its prefix-cache salt."""

    prompt: Union[str, Sequence[int]]
    params: SamplingParams
    cache_salt: Optional[str] = None


@dataclass
class Submission:
    """Requests submitted together (one HTTP call). ``request_ids[i]`` is the engine id of
    prompt ``i``. Iterate :meth:`outputs` exactly once."""

    loop_ref: "EngineLoop"
    request_ids: list[str]
    queue: asyncio.Queue
    finished: set[str] = field(default_factory=set)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt_index, output)`` until every request finished. Raises
        :class:`EngineStepError` if the engine failed, :class:`EngineStoppedError` if the
        loop stopped. Aborts the unfinished requests when the iteration ends early
        (cancellation, ``aclose``, an exception)."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        try:
            while len(self.finished) < len(self.request_ids):
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                out: RequestOutput = item
                if out.finished:
                    self.finished.add(out.request_id)
                yield index[out.request_id], out
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever has not finished and stop routing outputs here (idempotent)."""
        pending = [r for r in self.request_ids if r not in self.finished]
        self.loop_ref._unregister(self.request_ids)
        if pending:
            self.loop_ref.abort(pending)


class EngineLoop:
    """Runs one :class:`pagedkv.engine.engine.LLMEngine` in a background thread.

    The thread that creates the loop (the one that built the engine) gives back its OpenMP
    threads (:func:`pagedkv.utils.release_openmp_pool`): the engine's parallel ops run in the
    loop's thread from then on, and a second pool would make libgomp put waiting threads to
    sleep after every op (served batch-1 inter-token latency p50 69-94 against 23-26 ms here;
    docs/performance.md, "One OpenMP pool"). A later parallel torch op in the creating thread,
    or in any other thread but the loop's, starts a new pool; the server runs none.

    ``on_output(out)`` is called in the step thread for every output (metrics); it must be
    quick and must not raise. ``idle_wait_s``: how long the idle thread sleeps between checks
    when nothing wakes it (seconds)."""

    def __init__(
        self,
        engine: Any,
        *,
        on_output: Optional[Callable[[RequestOutput], None]] = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self.on_output = on_output
        self.idle_wait_s = idle_wait_s
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._owners: dict[str, Optional[str]] = {}  # engine request id -> tenant (live ones)
        self._routes_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._thread: Optional[threading.Thread] = None
        self._pause_req = threading.Event()
        self._paused = threading.Event()
        self._resume = threading.Event()
        self.num_steps = 0
        self.num_step_errors = 0
        self.last_step_time: Optional[float] = None
        release_openmp_pool()

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def paused(self) -> bool:
        """True while :meth:`pause` holds the loop between two steps."""
        return self._paused.is_set()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.running

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self.running:
            return
        self._stop.clear()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> dict[str, int]:
        """Stop accepting, wait up to ``timeout_s`` seconds for in-flight requests, abort
        the rest, drain the engine and stop the thread. Blocking; returns
        ``{"finished_during_shutdown": .., "aborted": ..}``."""
        self._accepting = False
        self.resume()
        eng = self.engine
        before = eng.get_num_unfinished_requests() if self.running else 0
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.running and eng.has_unfinished_requests() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        leftover: list[str] = []
        if eng.has_unfinished_requests():
            with self._routes_lock:
                leftover = list(self._routes)
            eng.abort_request(leftover)
        if self.running:
            # keep stepping until aborted requests are collected and their blocks freed
            deadline = time.monotonic() + 5.0
            while eng.has_unfinished_requests() and time.monotonic() < deadline:
                self._wake.set()
                time.sleep(0.01)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=10.0)  # type: ignore[union-attr]
        else:
            while eng.has_unfinished_requests():
                self._dispatch(eng.step())
        self._fail_all(EngineStoppedError("the server is shutting down"))
        return {"finished_during_shutdown": max(0, before - len(leftover)), "aborted": len(leftover)}

    # ---- test/inspection hooks ------------------------------------------------------
    def pause(self, timeout_s: float = 10.0) -> bool:
        """Hold the loop between two steps (the KV state stays still while paused); returns
        when it is held. Returns False if the loop did not stop within ``timeout_s``."""
        self._resume.clear()
        self._pause_req.set()
        self._wake.set()
        if not self.running:
            return True
        return self._paused.wait(timeout_s)

    def resume(self) -> None:
        self._pause_req.clear()
        self._resume.set()

    # ---- requests -----------------------------------------------------------------------
    async def submit(
        self,
        request_ids: Sequence[str],
        specs: Sequence[PromptSpec],
        *,
        stream: bool = False,
        tenant: Optional[str] = None,
    ) -> Submission:
        """Queue one engine request per spec (ids given by the caller). All or nothing: if
        one is rejected (``InvalidRequestError``), those already queued are aborted and the
        error is raised. ``tenant`` is remembered for :meth:`tenant_of` while the requests
        live. Raises :class:`EngineStoppedError` while shutting down."""
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ids = list(request_ids)
        with self._routes_lock:
            for rid in ids:
                self._routes[rid] = (loop, queue)
                self._owners[rid] = tenant
        added: list[str] = []
        try:
            for rid, spec in zip(ids, specs):
                await asyncio.to_thread(
                    self.engine.add_request, rid, spec.prompt, spec.params,
                    cache_salt=spec.cache_salt, tenant=tenant, stream=stream,
                )
                added.append(rid)
        except BaseException:
            self._unregister(ids)
            if added:
                self.abort(added)
            raise
        self._wake.set()
        return Submission(self, ids, queue)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort engine requests (thread-safe; blocks are freed at the next step fence)."""
        self.engine.abort_request(list(request_ids))
        self._wake.set()

    def tenant_of(self, request_id: str) -> Optional[str]:
        """The tenant that submitted a live engine request (a parallel-sampling child
        ``"<id>#<k>"`` belongs to ``<id>``); None if unknown or without tenants."""
        with self._routes_lock:
            return self._owners.get(request_id.split("#", 1)[0])

    def _unregister(self, request_ids: Sequence[str]) -> None:
        with self._routes_lock:
            for rid in request_ids:
                self._routes.pop(rid, None)
                self._owners.pop(rid, None)

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            if self._pause_req.is_set():
                self._paused.set()
                self._resume.wait()
                self._paused.clear()
                continue
            if not eng.has_unfinished_requests():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except SamplingError as exc:  # only these requests are at fault: fail them alone
                self.num_step_errors += 1
                self._fail_requests(exc)
                continue
            except Exception as exc:  # keep serving: fail the in-flight requests
                self.num_step_errors += 1
                logger.exception("engine step failed; aborting in-flight requests")
                with self._routes_lock:
                    ids = list(self._routes)
                try:
                    eng.abort_request(ids)
                except Exception:
                    logger.exception("abort after a failed step failed")
                self._fail_all(EngineStepError(f"engine step failed: {exc}"))
                time.sleep(0.05)
                continue
            self.num_steps += 1
            self.last_step_time = time.time()
            self._dispatch(outs)

    def _fail_requests(self, exc: SamplingError) -> None:
        """Abort the user requests of ``exc.request_ids`` (a fork ``"<id>#<k>"`` belongs to
        ``<id>``) and fail their submissions; the rest of the batch recomputes next step."""
        parents = sorted({rid.split("#", 1)[0] for rid in exc.request_ids})
        logger.error("sampling failed for %s: %s", parents, exc)
        try:
            self.engine.abort_request(parents)
        except Exception:
            logger.exception("abort after a sampling error failed")
        with self._routes_lock:
            routes = [self._routes.pop(rid) for rid in parents if rid in self._routes]
        err = EngineStepError(f"sampling failed: {exc}", code="sampling_error")
        for loop, queue in {id(q): (lp, q) for lp, q in routes}.values():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, err)
            except RuntimeError:
                pass

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:
                    logger.exception("on_output hook failed")
            with self._routes_lock:
                route = self._routes.get(out.request_id)
                if out.finished:
                    self._routes.pop(out.request_id, None)
            if route is not None:
                loop, queue = route
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                except RuntimeError:  # the handler's event loop is closed
                    pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._routes_lock:
            routes = list(self._routes.items())
            self._routes.clear()
        seen: set[int] = set()
        for _, (loop, queue) in routes:
            if id(queue) in seen:
                continue
            seen.add(id(queue))
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:
                pass
