"""Tensor-parallel ranks: process groups, one rank's shard and KV cache, the worker loop.

Process groups (created in this order on every rank, see ``init_groups``):

* ``ctrl``: the default group, gloo, a very long timeout (``IDLE_TIMEOUT``). Carries the init
  message, the per-step **header** and shutdown. Workers wait on it between steps, so an idle
  engine (a server with no requests) never trips a timeout; a driver that dies closes its
  sockets and the waiting workers fail at once.
* ``startup``: gloo, ``startup_timeout_s``. The start-up handshake (every rank reports its shard
  and KV cache).
* ``step``: gloo, ``timeout_s``. The step **payload** and ``CMD_INFO`` answers.
* ``dev``: the all-reduce of the row-parallel layers, ``timeout_s``: the ``step`` group on CPU,
  an NCCL group on GPUs (tensors stay on the device).

A worker is started either by ``TPExecutor`` (``python -m pagedkv.distributed.worker --spawned``, ``spawn_main``)
or with torchrun-style environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK``): ``python -m pagedkv.distributed.worker`` or the same
``pagedkv`` command as the driver (``run_env_worker``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from pagedkv.errors import DistributedError
from pagedkv.worker.worker import Worker
from pagedkv.distributed.parallel import TPShard, build_shard_model, shard_plan
from pagedkv.model.gguf_native import held_bytes, iter_linears
from pagedkv.distributed.protocol import (
    CMD_INFO,
    CMD_SHUTDOWN,
    CMD_STEP,
    HEADER_LEN,
    default_timeouts,
    payload_len,
    unpack_step,
)

log = logging.getLogger("pagedkv.distributed")

#: timeout of the ``ctrl`` group, on which workers wait for the next step however long the
#: driver stays idle.
IDLE_TIMEOUT = timedelta(days=365)
READY_KEY = "pagedkv/ready/{rank}"
INIT_KEY = "pagedkv/init"  # the driver's init message (JSON) for spawned workers


@dataclass
class Groups:
    ctrl: Any
    startup: Any
    step: Any
    dev: Any


def device_backend(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_groups(
    rank: int, world_size: int, init: Optional[dict], timeout_s: float, startup_timeout_s: float,
    *, store: Any = None, init_method: Optional[str] = None,
) -> tuple[Groups, dict]:
    """Join the job and create the groups (see module doc). Rank 0 passes the init message
    ``init`` (a picklable dict: model, dtype, device, blocks, ...); other ranks pass ``None``
    and receive it. Returns ``(groups, init)``."""
    dist.init_process_group(
        "gloo", store=store, init_method=init_method, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT
    )
    ctrl = dist.group.WORLD
    box = [init]
    dist.broadcast_object_list(box, src=0, group=ctrl)
    init = box[0]
    startup = dist.new_group(backend="gloo", timeout=timedelta(seconds=startup_timeout_s))
    step = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    dev = step if device_backend(init["device"]) == "gloo" else dist.new_group(
        backend="nccl", timeout=timedelta(seconds=timeout_s)
    )
    return Groups(ctrl, startup, step, dev), init


def make_all_reduce(group: Any):
    """The in-place sum over ranks that the row-parallel layers call. Two ranks: one
    ``all_reduce`` (a + b is b + a: the same bits either way). More: every rank's tensor
    gathered and added in rank order, so each element's sum is the same at any batch or chunk
    size (gloo's ring adds an element's partials in an order set by where the buffer's length
    cuts it; with 8-bit activations that rounding shows in the tokens)."""
    n = dist.get_world_size(group)

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def ordered(t: torch.Tensor) -> None:
        parts = list(t.new_empty((n, *t.shape)).unbind(0))  # one allocation for the n ranks' tensors
        dist.all_gather(parts, t.contiguous(), group=group)
        total = parts[0]
        for p in parts[1:]:
            total += p
        t.copy_(total)

    return all_reduce if n <= 2 else ordered


def rank_device(device: str, local_rank: int) -> str:
    """The device of one rank: ``cuda`` becomes ``cuda:<local_rank>``; others are unchanged."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return f"cuda:{local_rank}"
    return str(d)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


class Rank:
    """One rank's shard of the model, its attention backend and its KV cache (a
    ``ModelRunner`` whose caches hold only this rank's KV heads)."""

    def __init__(self, config, state, rank: int, tp_size: int, init: dict, backend: Any, device: str,
                 model: Any = None) -> None:
        self.rank, self.tp_size, self.device = rank, tp_size, device
        self.shard: TPShard = shard_plan(config, rank, tp_size)
        dtype = getattr(torch, init["dtype"])
        # ``model``: the shard already built (a GGUF's stored blocks, pagedkv.model.gguf_shard); else sliced from ``state``
        self.model = model if model is not None else build_shard_model(config, state, self.shard, None, dtype, device)
        for layer in self.model.layers:  # until connect(): a layer never runs one-device code (native step, fused)
            layer.all_reduce = _unconnected
        self.backend = backend
        self.num_blocks, self.block_size = init["num_blocks"], init["block_size"]
        # the caches are built as in one process (the same Worker code), for this rank's KV heads
        self.worker = Worker(self.model, config, backend, device)
        self.runner = self.worker.init_cache(
            self.num_blocks, self.block_size, init.get("kv_cache_dtype") or dtype,
            quant_group_size=init.get("kv_quant_group_size"), layer_windows=config.layer_windows(),
            num_kv_heads=config.cache_kv_heads if config.is_mla else self.shard.num_kv_heads,  # MLA: the latent
        )

    def connect(self, groups: Groups) -> None:
        """Route the row-parallel outputs through ``groups.dev``'s all-reduce."""
        fn = make_all_reduce(groups.dev)
        for layer in self.model.layers:
            layer.all_reduce = fn

    def info(self) -> dict:
        """What this rank holds: ``rank``, ``pid``, ``host``, ``device``, ``q_heads`` /
        ``kv_heads`` / ``mlp`` ranges, ``num_kv_heads``, ``num_blocks`` and ``block_size`` of
        its allocated cache, ``kv_cache_bytes`` (all layers, K and V),
        ``kv_bytes_per_token`` (= ``kv_cache_bytes / (num_blocks * block_size)``), ``weights``
        (``gguf``: slices of a GGUF's stored blocks, else the parameters' dtype) and
        ``weight_bytes`` (what the shard holds: packed blocks and parameters,
        ``gguf_native.held_bytes``)."""
        caches = self.runner.shared_caches  # a hybrid model's layers share them by group
        nbytes = _tensor_bytes(caches)
        blocks = getattr(caches[0], "num_blocks", self.num_blocks) if caches else self.num_blocks
        return {
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(self.device),
            "q_heads": list(self.shard.q_heads), "kv_heads": list(self.shard.kv_heads),
            "mlp": list(self.shard.mlp), "moe": list(self.shard.moe), "num_kv_heads": self.shard.num_kv_heads,
            "num_blocks": int(blocks), "block_size": self.block_size, "num_layers": len(self.runner.kv_caches),
            "kv_cache_bytes": nbytes, "kv_bytes_per_token": nbytes // (int(blocks) * self.block_size),
            "weights": _weights_format(self.model),
            "weight_bytes": held_bytes(self.model),
        }


def handshake(groups: Groups, world_size: int, report: dict) -> list[dict]:
    """Every rank contributes ``report`` (its ``Rank.info()`` or ``{"rank", "error"}``);
    returns all of them, by rank."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, report, group=groups.startup)
    return out


def serve(rank: Rank, groups: Groups) -> None:
    """The worker loop: wait for a header; run a step (CoW copies, then the shard's forward:
    K/V written to this rank's cache, one all-reduce per row-parallel layer; no logits), answer
    ``CMD_INFO``, or return on ``CMD_SHUTDOWN``. Raises on a failed collective."""
    h = torch.empty(HEADER_LEN, dtype=torch.int64)
    world = dist.get_world_size()
    while True:
        dist.broadcast(h, src=0, group=groups.ctrl)
        cmd = int(h[0])
        if cmd == CMD_STEP:
            payload = torch.empty(payload_len(h), dtype=torch.int64)
            dist.broadcast(payload, src=0, group=groups.step)
            inp, copies = unpack_step(h, payload, rank.device)
            rank.runner.copy_blocks(copies)
            with torch.inference_mode():
                md = rank.runner.layer_metadata(inp.groups)
                rank.model(inp.input_ids, inp.positions, rank.runner.kv_caches, md, rank.backend)
        elif cmd == CMD_INFO:
            dist.all_gather_object([None] * world, rank.info(), group=groups.step)
        elif cmd == CMD_SHUTDOWN:
            return
        else:
            raise DistributedError(f"unknown command {cmd} from the driver")


def setup_process(threads: int) -> None:
    """Per-process settings of a worker: torch threads, logging to stderr."""
    torch.set_num_threads(max(1, int(threads)))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format=f"[pagedkv worker pid {os.getpid()}] %(message)s")


def _weights_format(model: Any) -> str:
    """``gguf`` for a shard on a GGUF's stored blocks, else its parameters' dtype name."""
    if next(iter_linears(model), None) is not None:
        return "gguf"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _unconnected(t: torch.Tensor) -> None:
    raise DistributedError("a tensor-parallel rank ran a layer before joining its process group")


def load_rank(init: dict, rank: int, device: str, loaded: Any = None):
    """``(config, state, model)`` for rank ``rank`` (the driver's rank 0 too): from an already
    loaded model (the driver's, or the same command on every rank: its state, or the module
    itself when it is this rank's shard) or by loading the driver's model path (weights only,
    no tokenizer): with weights ``gguf`` this rank's slices of the stored blocks (``model``,
    ``state`` None), else the float state dict (``model`` None). Raises ``DistributedError`` if the model differs from the driver's."""
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.loader import load_gguf_shard, load_weights

    model = state = None
    path = init.get("model_path_override") or init["model_path"]
    if loaded is not None and loaded.shard is not None and loaded.shard.rank == rank:
        config, model = loaded.config, loaded.model
    elif init.get("weights") == "gguf":
        config, model = load_gguf_shard(path, rank, init["tp_size"], cache_dir=init.get("cache_dir"))
    elif loaded is not None:
        config, state = loaded.config, loaded.model.state_dict()
    else:
        config, state, _ = load_weights(path, cache_dir=init.get("cache_dir"), use_cache=init.get("use_cache", True))
    want = ModelConfig.from_dict(init["model_config"])
    if config.to_dict() != want.to_dict():
        diff = sorted(k for k, v in want.to_dict().items() if config.to_dict().get(k) != v)
        raise DistributedError(f"rank {rank}: the model differs from the driver's (fields {diff})")
    return config, state, model


def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver process disappears (a spawned worker must never outlive it)."""

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=loop, name="pagedkv-parent-watch", daemon=True).start()


def spawn_main(rank: int, world_size: int, host: str, port: int, parent_pid: int) -> None:
    """Entry of a worker spawned by ``TPExecutor`` (``python -m pagedkv.distributed.worker
    --spawned``): read the init message from the rendezvous store, load and shard the model,
    allocate the KV cache, tell the driver through the store that it is ready (or why not),
    join the process groups, then ``serve`` until shutdown. Exits when the driver dies."""
    _watch_parent(parent_pid)
    _, startup_s = default_timeouts()
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=startup_s))
    init = json.loads(store.get(INIT_KEY).decode())
    store.set_timeout(timedelta(seconds=init["startup_timeout_s"]))
    setup_process(init["threads"])
    key = READY_KEY.format(rank=rank)
    try:
        from pagedkv.attention import get_backend

        device = rank_device(init["device"], rank)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        config, state, model = load_rank(init, rank, device)
        r = Rank(config, state, rank, world_size, init, get_backend(init["backend"]), device, model)
        del state, model
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit
        store.set(key, f"error: {type(e).__name__}: {e}")
        raise SystemExit(1) from None
    store.set(key, "ok")
    groups, _ = init_groups(rank, world_size, None, init["timeout_s"], init["startup_timeout_s"], store=store)
    _join_and_serve(r, groups, world_size)
    # Clean shutdown: skip the interpreter's teardown of torch (seconds), nothing is left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _destroy() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def env_rank() -> Optional[tuple[int, int, int]]:
    """``(rank, world_size, local_rank)`` from torchrun-style variables, or ``None`` when
    ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are not all set."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def run_env_worker(loaded: Any = None, *, timeout_s: float, startup_timeout_s: float,
                   model_path_override: Optional[str] = None) -> None:
    """A worker rank (``RANK`` > 0) started with torchrun-style variables: join the job
    (``MASTER_ADDR:MASTER_PORT``), receive the driver's init message, load (or take
    ``loaded``) and shard the model, then ``serve`` until the driver shuts down. Returns then;
    raises ``DistributedError`` (or the collective's error) on failure."""
    env = env_rank()
    if env is None:
        raise DistributedError("RANK, WORLD_SIZE and MASTER_ADDR must be set for a worker")
    rank, world, local_rank = env
    if rank == 0:
        raise DistributedError("rank 0 is the driver: run the engine there, not a worker")
    groups, init = init_groups(rank, world, None, timeout_s, startup_timeout_s, init_method="env://")
    setup_process(init["threads"] if os.environ.get("PAGEDKV_TP_THREADS") is None
                  else int(os.environ["PAGEDKV_TP_THREADS"]))
    try:
        from pagedkv.attention import get_backend

        if model_path_override:
            init = dict(init, model_path_override=model_path_override)
        device = rank_device(init["device"], local_rank)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        config, state, model = load_rank(init, rank, device, loaded)
        r = Rank(config, state, rank, world, init, get_backend(init["backend"]), device, model)
        del state, model
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        handshake(groups, world, {"rank": rank, "error": f"{type(e).__name__}: {e}"})
        _destroy()
        raise
    _join_and_serve(r, groups, world)


def _join_and_serve(r: "Rank", groups: Groups, world_size: int) -> None:
    """Wire ``r`` to the all-reduce group, report ready to the driver, serve steps until
    shutdown, then leave the process groups."""
    r.connect(groups)
    handshake(groups, world_size, r.info())
    try:
        serve(r, groups)
    finally:
        _destroy()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m pagedkv.distributed.worker [--model PATH]``: a worker rank under torchrun-style
    variables. ``--model`` overrides the driver's model path (the same weights in another
    place on this machine)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pagedkv.distributed.worker", description=main.__doc__)
    p.add_argument("--model", default=None, help="model path on this machine (default: the driver's)")
    p.add_argument("--spawned", nargs=5, metavar=("RANK", "WORLD", "HOST", "PORT", "PARENT_PID"),
                   help="started by TPExecutor (internal)")
    args = p.parse_args(argv)
    if args.spawned:
        rank, world, host, port, parent = args.spawned
        spawn_main(int(rank), int(world), host, int(port), int(parent))
        return 0
    timeout_s, startup_s = default_timeouts()
    run_env_worker(None, timeout_s=timeout_s, startup_timeout_s=startup_s, model_path_override=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
