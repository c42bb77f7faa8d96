"""``TPExecutor``: the engine's step runner when ``tensor_parallel_size`` > 1, and
``make_executor``, which the engine calls once for its executor (a ``Worker`` or this).

The engine keeps one scheduler and one ``KVCacheManager`` (on the driver, rank 0) and talks to
"something that runs a step" through three calls: ``prepare(token_ids, num_computed, block_ids, sample)``,
``copy_blocks(copies)`` and ``execute(inp) -> logits``. ``ModelRunner`` is that for one device;
``TPExecutor`` is it for ``N`` ranks: the driver process is rank 0 and computes its own shard,
``N - 1`` workers are started as their own processes (``python -m pagedkv.distributed.worker
--spawned``, whatever way the driver itself was started), or by torchrun.

Per step (``execute``) the driver broadcasts a header and one int64 payload (see
``pagedkv.distributed.protocol``: input ids, positions, slot mapping, block tables, sequence
lengths, query start offsets, logits rows and the step's copy-on-write copies); every rank
applies the copies to its own KV cache and runs its shard, all-reducing after each row-parallel
layer. Only the driver computes logits (the LM head is replicated) and samples, once; the
workers see the sampled tokens as the next step's input ids.

Faults: collectives run with a timeout (``PAGEDKV_TP_TIMEOUT`` seconds, default 120), and a
watchdog thread in the driver notices a worker that exits (at once) or a step that overruns the
timeout; either way the remaining workers are killed, which also unblocks the driver's pending
collective, and the engine raises ``DistributedError`` naming the cause. Every later call raises
the same error. ``close()`` (also run at interpreter exit) stops every worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from pagedkv.distributed.parallel import check_tp_size
from pagedkv.distributed.protocol import (
    CMD_INFO,
    CMD_SHUTDOWN,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    default_timeouts,
    header,
    pack_step,
)
from pagedkv.distributed.worker import (
    INIT_KEY, READY_KEY, Rank, env_rank, handshake, init_groups, load_rank, run_env_worker,
)
from pagedkv.errors import ConfigError, DistributedError
from pagedkv.utils import free_port
from pagedkv.worker.runner import ModelInput
from pagedkv.worker.worker import Executor, Worker

log = logging.getLogger("pagedkv.distributed")

_WATCH_INTERVAL_S = 0.1
_WATCHDOG_GRACE_S = 5.0  # the watchdog's step deadline is the collective timeout plus this


class WorkerProcess:
    """A spawned worker rank: ``pid``, ``exitcode`` (None while running, negative = killed by
    that signal), ``kill()`` and ``join(timeout)`` over a ``subprocess.Popen``."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pid = proc.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class TPExecutor:
    """Runs the engine's steps on ``tp_size`` ranks (the calling process is rank 0).

    ``loaded``: the driver's ``LoadedModel`` (full weights; rank 0 slices its shard from it,
    spawned workers load the same ``loaded.path`` through the weight cache and slice theirs).
    ``backend``: rank 0's attention backend object; ``backend_name``: what workers pass to
    ``get_backend``. ``num_blocks`` / ``block_size``: every rank allocates this many blocks for
    its own KV heads (block ids are the driver's, the same on every rank). ``dtype``,
    ``device``: model dtype, device (``cuda`` = ``cuda:<rank>`` per worker, NCCL
    all-reduce). ``kv_cache_dtype`` / ``kv_quant_group_size``: the cache format of every rank
    (None: the model dtype; else a ``ModelRunner`` cache dtype name and its group size). ``timeout_s`` / ``startup_timeout_s``: see ``default_timeouts``.
    ``worker_threads``: torch threads per worker (default ``PAGEDKV_TP_THREADS`` or
    ``cpu_count // tp_size``).

    With ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set (torchrun), no process is spawned: rank 0
    becomes the driver, and on any other rank the constructor serves as a worker until the
    driver shuts down and then raises ``SystemExit(0)``.

    Raises ``ConfigError`` (a size the model cannot be split over, ``WORLD_SIZE`` differing
    from ``tp_size``) and ``DistributedError`` (a worker failed to start; torch.distributed is
    already in use in this process).
    """

    def __init__(
        self,
        loaded: Any,
        backend: Any,
        backend_name: str,
        *,
        tp_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        kv_cache_dtype: Optional[str] = None,
        kv_quant_group_size: Optional[int] = None,
        timeout_s: Optional[float] = None,
        startup_timeout_s: Optional[float] = None,
        worker_threads: Optional[int] = None,
    ) -> None:
        config = loaded.config
        check_tp_size(config, tp_size)
        if tp_size < 2:
            raise ConfigError("TPExecutor needs tensor_parallel_size >= 2 (use ModelRunner for one device)")
        if not dist.is_available():
            raise ConfigError("tensor_parallel_size > 1 needs torch.distributed, which this torch lacks")
        t_default, s_default = default_timeouts()
        self.timeout_s = float(timeout_s or t_default)
        self.startup_timeout_s = float(startup_timeout_s or s_default)
        self.tp_size = tp_size
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._procs: dict[int, WorkerProcess] = {}  # rank -> spawned worker (spawn mode only)
        self._error: Optional[str] = None
        self._closed = False
        self._pending_copies: list[tuple[int, int]] = []
        self._step_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self._stop = threading.Event()
        self._step_started: Optional[float] = None
        self._watchdog: Optional[threading.Thread] = None
        self.groups = None
        self._owns_pg = False

        env = env_rank()
        if env is not None:
            rank, world, _ = env
            if world != tp_size:
                raise ConfigError(f"tensor_parallel_size {tp_size} but WORLD_SIZE is {world}")
            if rank != 0:
                run_env_worker(loaded, timeout_s=self.timeout_s, startup_timeout_s=self.startup_timeout_s)
                raise SystemExit(0)
        if dist.is_initialized():
            raise DistributedError(
                "torch.distributed is already initialised in this process (is another "
                "tensor-parallel engine still open? close it first)"
            )
        threads = worker_threads or int(os.environ.get("PAGEDKV_TP_THREADS", 0)) or max(1, (os.cpu_count() or 1) // tp_size)
        self.init = {
            "model_path": str(loaded.path),
            "cache_dir": str(loaded.cache_dir.parent) if getattr(loaded, "cache_dir", None) else None,
            "model_config": config.to_dict(),
            "weights": loaded.weights,  # gguf: every rank reads its own slices of the stored blocks
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv_cache_dtype,
            "kv_quant_group_size": kv_quant_group_size,
            "device": str(device),
            "backend": backend_name,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "tp_size": tp_size,
            "timeout_s": self.timeout_s,
            "startup_timeout_s": self.startup_timeout_s,
            "threads": threads,
        }
        try:
            store = None
            if env is None:
                store = self._spawn_workers()
            _, state, model = load_rank(self.init, 0, str(device), loaded)  # a state dict, or its shard itself
            self.rank0 = Rank(config, state, 0, tp_size, self.init, backend, str(device), model)
            del state, model
            self.runner = self.rank0.runner
            if env is None:
                self._wait_ready(store)
            self._owns_pg = True
            self.groups, _ = init_groups(
                0, tp_size, self.init, self.timeout_s, self.startup_timeout_s,
                store=store, init_method="env://" if env is not None else None,
            )
            self.rank0.connect(self.groups)
            self.rank_info = handshake(self.groups, tp_size, self.rank0.info())
            self._check_handshake(self.rank_info)
        except BaseException:
            self._teardown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="pagedkv-tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        log.info("tensor parallel: %d ranks, %s", tp_size,
                 ", ".join(f"rank {i['rank']} pid {i['pid']} kv heads {i['kv_heads']}" for i in self.rank_info))

    # ---- start-up ---------------------------------------------------------------------------
    def _spawn_workers(self):
        """Start ranks 1..N-1 as their own processes (``python -m pagedkv.distributed.worker
        --spawned ...``, as torchrun would), so it does not matter how the driver was started
        (a script with or without a ``__main__`` guard, ``python -c``, standard input, a
        notebook). The init message travels through the rendezvous store."""
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, self.tp_size, is_master=True,
                              timeout=timedelta(seconds=self.startup_timeout_s), wait_for_workers=False)
        store.set(INIT_KEY, json.dumps(self.init))
        env = dict(os.environ)
        # the package this driver runs, first on the workers' path (also when it is not installed)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        for rank in range(1, self.tp_size):
            cmd = [sys.executable, "-m", "pagedkv.distributed.worker", "--spawned",
                   str(rank), str(self.tp_size), "127.0.0.1", str(port), str(os.getpid())]
            self._procs[rank] = WorkerProcess(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        return store

    def _wait_ready(self, store: Any) -> None:
        """Poll the store until every worker says ``ok``; fail fast on an error report or a
        worker that exits, or after ``startup_timeout_s``."""
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(self._procs)
        while pending:
            for rank in sorted(pending):
                key = READY_KEY.format(rank=rank)
                if store.check([key]):
                    status = store.get(key).decode()
                    if status != "ok":
                        raise DistributedError(f"tensor-parallel worker rank {rank} failed to start: {status}")
                    pending.discard(rank)
                elif self._procs[rank].exitcode is not None:
                    p = self._procs[rank]
                    raise DistributedError(
                        f"tensor-parallel worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)} "
                        "during start-up (see its output above)"
                    )
            if pending and time.monotonic() > deadline:
                raise DistributedError(
                    f"tensor-parallel workers {sorted(pending)} not ready after {self.startup_timeout_s:.0f}s "
                    "(PAGEDKV_TP_STARTUP_TIMEOUT)"
                )
            if pending:
                time.sleep(0.05)

    def _check_handshake(self, infos: list[dict]) -> None:
        errors = [f"rank {i['rank']}: {i['error']}" for i in infos if "error" in i]
        if errors:
            raise DistributedError("tensor-parallel workers failed to start: " + "; ".join(errors))
        blocks = {i["num_blocks"] for i in infos}
        if blocks != {self.num_blocks}:
            raise DistributedError(f"ranks allocated different numbers of KV blocks: {[i['num_blocks'] for i in infos]}")

    # ---- the step ---------------------------------------------------------------------------
    @property
    def kv_caches(self) -> list[Any]:
        """Rank 0's per-layer KV caches (its own KV heads only)."""
        return self.runner.kv_caches

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the worker ranks 1..N-1 (from the start-up handshake)."""
        return [i["pid"] for i in self.rank_info[1:]]

    proposer: Any = None  # the speculative proposer (attach_proposer); it runs in this driver

    def attach_proposer(self, proposer: Any) -> None:
        """Own ``proposer`` (a ``pagedkv.worker.proposer.Proposer``; ``None``: off)."""
        self.proposer = proposer

    def propose_drafts(self, rows: Sequence[Any]) -> dict[str, list[int]]:
        """As ``Worker.propose_drafts``: the proposer's drafts for ``rows`` (``{}`` without one)."""
        return {} if self.proposer is None else self.proposer.propose(rows)

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """As ``Worker.finish_requests``: drop the proposer's state of ``request_ids``."""
        for rid in request_ids if self.proposer is not None else ():
            self.proposer.release(rid)

    def prepare(self, token_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                block_ids: Sequence[Sequence[int]], sample: Sequence[bool],
                prompt_rows: Sequence[int] = ()) -> ModelInput:
        """As ``ModelRunner.prepare`` (the flat batch, on rank 0's device)."""
        return self.runner.prepare(token_ids, num_computed, block_ids, sample, prompt_rows)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Queue copy-on-write copies ``(src, dst)``; every rank applies them at the start of
        the next ``execute``, before that step's writes."""
        self._raise_if_failed()
        self._pending_copies.extend((int(s), int(d)) for s, d in copies)

    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Broadcast the step, run rank 0's shard alongside the workers; returns fp32 logits
        ``[num_sampling, vocab]`` of rank 0 (computed there only). Raises ``DistributedError``
        when a worker died, hung past the timeout or a collective failed; the executor is then
        unusable and its workers are stopped."""
        with self._step_lock:
            self._raise_if_failed()
            copies, self._pending_copies = self._pending_copies, []
            h, payload = pack_step(inp, copies)
            self._step_started = time.monotonic()
            try:
                dist.broadcast(h, src=0, group=self.groups.ctrl)
                dist.broadcast(payload, src=0, group=self.groups.step)
                self.runner.copy_blocks(copies)
                return self.runner.execute(inp)
            except BaseException as e:
                if "timed out" in str(e).lower():
                    what = f"a step's collective timed out: a worker is hung or unreachable ({e})"
                else:
                    what = f"a step failed ({type(e).__name__}: {e})"
                raise self._failed(what) from e
            finally:
                self._step_started = None

    def query_workers(self) -> list[dict]:
        """Ask every rank (now, over the step group) what it holds: ``Rank.info()`` dicts by
        rank (``num_blocks``, ``kv_bytes_per_token``, ``kv_heads``, ``pid``, ...)."""
        with self._step_lock:
            self._raise_if_failed()
            out: list[Any] = [None] * self.tp_size
            try:
                dist.broadcast(header(CMD_INFO), src=0, group=self.groups.ctrl)
                dist.all_gather_object(out, self.rank0.info(), group=self.groups.step)
            except BaseException as e:
                raise self._failed(f"querying the workers failed ({type(e).__name__}: {e})") from e
            return out

    # ---- faults -------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._teardown()
            raise DistributedError(self._error)
        if self._closed:
            raise DistributedError("the tensor-parallel executor is closed")

    def _record(self, reason: str) -> str:
        with self._state_lock:
            if self._error is None:
                self._error = (
                    f"tensor parallelism failed: {reason}; the engine cannot continue "
                    f"(all {self.tp_size - 1} workers stopped)"
                )
            return self._error

    def _dead_worker(self, wait_s: float = 0.0) -> Optional[str]:
        """A description of the first worker that has exited, waiting up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in sorted(self._procs.items()):
                if p.exitcode is not None:
                    return f"worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _failed(self, what: str) -> DistributedError:
        """Record the failure (naming a dead worker when there is one), stop every worker and
        tear the process groups down; returns the error to raise."""
        dead = self._dead_worker(wait_s=1.0) if self._error is None else None
        msg = self._record(dead or f"{what} (timeout {self.timeout_s:.0f}s, PAGEDKV_TP_TIMEOUT)")
        self._teardown()
        return DistributedError(msg)

    def _watch(self) -> None:
        """Watchdog: a worker that exits, or a step running past ``timeout_s`` plus a grace
        period, fails the executor and kills the workers, so a blocked collective in the
        driver returns with an error instead of waiting."""
        while not self._stop.wait(_WATCH_INTERVAL_S):
            reason = self._dead_worker()
            started = self._step_started
            if reason is None and started is not None:
                late = time.monotonic() - started
                if late > self.timeout_s + _WATCHDOG_GRACE_S:
                    reason = f"a step has not finished after {late:.0f}s: a worker is hung or unreachable"
            if reason is not None:
                self._record(reason)
                self._kill_workers()
                return

    # ---- shutdown -------------------------------------------------------------------------------
    def _kill_workers(self, grace_s: float = 0.0) -> None:
        with self._kill_lock:
            self._kill_workers_locked(grace_s)

    def _kill_workers_locked(self, grace_s: float) -> None:
        for p in self._procs.values():
            if p.exitcode is None and grace_s > 0:
                p.join(timeout=grace_s)
            if p.exitcode is None:
                p.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        for p in self._procs.values():
            p.join(timeout=5)

    def _teardown(self) -> None:
        self._stop.set()
        rank0 = getattr(self, "rank0", None)  # its caches' prefault thread (and the draft's)
        if rank0 is not None and getattr(rank0, "runner", None) is not None:
            rank0.runner.close()
        if getattr(self, "proposer", None) is not None:
            self.proposer.close()
        self._kill_workers()
        if self._owns_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort after a failure
                pass
        self._owns_pg = False

    def close(self) -> None:
        """Stop every worker (a shutdown broadcast, then kill after a few seconds) and
        release the process groups. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        got = self._step_lock.acquire(timeout=self.timeout_s + _WATCHDOG_GRACE_S)
        try:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            if got and self._error is None and self.groups is not None:
                try:
                    dist.broadcast(header(CMD_SHUTDOWN), src=0, group=self.groups.ctrl)
                except Exception:  # noqa: BLE001 - the workers are killed below anyway
                    pass
            self._kill_workers(grace_s=5.0)
            self._teardown()
        finally:
            if got:
                self._step_lock.release()

    def __enter__(self) -> "TPExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_executor(worker: Worker, *, tp_size: int, num_blocks: int, block_size: int, kv_cache_dtype: str,
                  kv_quant_group_size: Optional[int] = None, layer_windows: Optional[Sequence[Optional[int]]] = None,
                  compile_max_rows: Optional[int] = None) -> Executor:
    """The engine's executor over ``worker`` (its model loaded by ``Worker.load``): with
    ``tp_size`` 1 the worker itself, its caches built (``num_blocks`` x ``block_size``,
    ``kv_cache_dtype`` a format name, ``kv_quant_group_size``, ``layer_windows``) and, with
    ``compile_max_rows``, its steps of 1 .. that many tokens compiled; else a ``TPExecutor``
    that shards the worker's model over ``tp_size`` ranks (every rank, this one too, allocates
    ``num_blocks`` blocks for its own KV heads). Raises ``ConfigError`` (a bad size, compiling
    with tensor parallelism) or ``DistributedError`` (see ``TPExecutor``)."""
    if tp_size == 1:
        worker.init_cache(num_blocks, block_size, kv_cache_dtype, quant_group_size=kv_quant_group_size,
                          layer_windows=layer_windows)
        if compile_max_rows is not None:
            worker.compile_steps(compile_max_rows)
        return worker
    if compile_max_rows is not None:
        raise ConfigError("compiled steps: tensor_parallel_size 1 only")
    dtype = next(worker.model.parameters()).dtype
    return TPExecutor(worker.loaded, worker.backend, worker.backend_name, tp_size=tp_size, num_blocks=num_blocks,
                      block_size=block_size, dtype=dtype, device=worker.device, kv_cache_dtype=kv_cache_dtype,
                      kv_quant_group_size=kv_quant_group_size)


def _close_at_exit(ref: "weakref.ReferenceType[TPExecutor]") -> None:
    ex = ref()
    if ex is not None:
        ex.close()
