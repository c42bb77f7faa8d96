"""``pagedkv serve``: the OpenAI-compatible server over one engine (:func:`serve_one_engine`) or,
with ``--data-parallel-size N`` (N > 1), N engine replicas on Ray Serve behind one routing
ingress (:func:`serve_replicas`, :mod:`pagedkv.serving.replicas`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional

from pagedkv.engine.cli import add_engine_args, engine_kwargs
from pagedkv.serving.app import OPENABLE_ROUTES
from pagedkv.serving.http_protocol import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S, uvicorn_options
from pagedkv.serving.replicas.router import DEFAULT_LOAD_GAP, DEFAULT_POLICY, POLICIES


def cmd_serve(args: argparse.Namespace) -> int:
    """``pagedkv serve``: one engine, or replicas with ``--data-parallel-size N`` (N > 1).
    Raises ``ConfigError`` for a bad replica option."""
    from pagedkv.errors import ConfigError

    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size == 1:
        return serve_one_engine(args)
    if args.kv_events is not None:
        raise ConfigError("--kv-events names one endpoint; with replicas each publishes on its own port "
                          "(on by default, --no-replica-kv-events turns them off)")
    if args.route_load_gap < 0:
        raise ConfigError(f"--route-load-gap must be >= 0, got {args.route_load_gap}")
    return serve_replicas(args)


def serve_replicas(args: argparse.Namespace) -> int:
    """``pagedkv serve --data-parallel-size N`` (N > 1): N engine replicas on Ray Serve
    (:mod:`pagedkv.serving.replicas`) behind one routing ingress; returns 0 after shutdown."""
    from pagedkv.model.loader import resolve_model_path

    resolve_model_path(args.model)  # a missing model fails here, not in N replica starts
    import uvicorn

    from pagedkv.serving.replicas.launch import ReplicaService

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    keys = load_keys(args)
    ekw = engine_kwargs(args)
    if args.replica_kv_events:
        ekw["kv_events"] = "auto"
    if args.routing == "prefix-aware":  # routing by prefix needs replicas that cache prefixes
        ekw["enable_prefix_caching"] = True
    skw = {"served_model_name": args.served_model_name, "api_keys": keys, "max_body_bytes": args.max_body_bytes,
           "max_n": args.max_n, "shutdown_timeout_s": args.shutdown_timeout}
    t0 = time.time()
    svc = ReplicaService.start(args.data_parallel_size, args.model, ekw, skw, ray_address=args.ray_address,
                               num_cpus=args.ray_num_cpus, replica_cpus=args.replica_cpus,
                               replica_threads=args.replica_threads)
    try:
        app = svc.build_ingress(args.routing, args.route_load_gap, api_keys=keys, max_body_bytes=args.max_body_bytes,
                                open_routes=tuple(args.open_route or ()))
        print(f"[pagedkv] {args.data_parallel_size} replicas of {svc.info['model_id']} "
              f"(tensor parallel {getattr(args, 'tensor_parallel_size', 1)} each) ready in {time.time() - t0:.1f}s; "
              f"routing {args.routing}; serving on http://{args.host}:{args.port}/v1 (/ui, /metrics)", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=int(args.shutdown_timeout) + 1,
                    **uvicorn_options(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                      keep_alive_s=args.keep_alive_timeout))
    finally:
        svc.stop()
    return 0


def serve_one_engine(args: argparse.Namespace) -> int:
    """``pagedkv serve`` over one engine in this process (uvicorn); returns 0 after shutdown."""
    import uvicorn

    from pagedkv.engine.engine import LLMEngine
    from pagedkv.serving.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    keys = load_keys(args)
    args.threads = serve_threads(args)
    t0 = time.time()
    engine = LLMEngine(args.model, **engine_kwargs(args))
    kv = engine.kv_summary()
    print(f"[pagedkv] model {engine.model_id} loaded in {time.time() - t0:.1f}s, weights {engine.loaded.weights} "
          f"({engine.loaded.weights_reason}); KV cache ({kv['kv_cache_dtype']}) {kv['num_blocks']} "
          f"blocks x {kv['block_size']} tokens; torch threads {args.threads}; "
          f"tenants: {len(set(keys.values())) if keys else 'off'}",
          file=sys.stderr)
    if engine.loaded.report is not None:
        print(f"[pagedkv] weights: {engine.loaded.report.summary()}", file=sys.stderr)
    app = build_app(engine, served_model_name=args.served_model_name, api_keys=keys,
                    max_body_bytes=args.max_body_bytes, max_n=args.max_n,
                    shutdown_timeout_s=args.shutdown_timeout, open_routes=tuple(args.open_route or ()))
    print(f"[pagedkv] serving on http://{args.host}:{args.port}/v1  (live KV page: /ui, metrics: /metrics)",
          file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=int(args.shutdown_timeout) + 1,
                    **uvicorn_options(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                      keep_alive_s=args.keep_alive_timeout))
    finally:
        engine.close()  # a disk tier keeps the cached blocks for the next start
    return 0


def _positive_seconds(text: str) -> float:
    v = float(text)
    if not (v > 0 and v < 86400):
        raise argparse.ArgumentTypeError(f"must be seconds in (0, 86400), got {text}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {v}")
    return v


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` sub-command's parser with every server and engine option (``func``:
    :func:`serve_one_engine`); :func:`register` adds the data-parallel options to it."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /ui)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients pass as 'model' (repeatable; default: the model id)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="key -> tenant file (JSON object or 'KEY TENANT' lines); enables tenant cache isolation. "
                        "Every route but /health then needs a key (Authorization: Bearer KEY, or X-API-Key; "
                        "the /ui page also takes ?key=), else 401: /v1/*, /ui, /ui/state, /metrics, /openapi.json")
    p.add_argument("--open-route", action="append", choices=list(OPENABLE_ROUTES), default=None, metavar="PATH",
                   help="with --api-keys, serve this route without a key (repeatable): "
                        f"{', '.join(OPENABLE_ROUTES)}; /v1/* and /ui/state always need one")
    p.add_argument("--header-timeout", type=_positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help=f"seconds a client has to send a complete request head, from connecting or from the "
                        f"end of its previous response (then 408 and close; default {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=_positive_seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help=f"seconds a client has to send its request body after the head "
                        f"(then 408 and close; default {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--keep-alive-timeout", type=int, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_KEEP_ALIVE_S})")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit in bytes (default 1 MiB)")
    p.add_argument("--max-n", type=int, default=16, help="largest n per request (default 16)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may finish on shutdown before they are aborted (default 10)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--reserved-cpus", type=int, default=0, metavar="N",
                   help="without --threads: torch threads = usable cores - N (at least 1), the rest left to "
                        "the HTTP side and other processes (default 0)")
    add_engine_args(p)
    p.set_defaults(func=serve_one_engine)
    return p


def serve_threads(args: argparse.Namespace) -> int:
    """The server's torch threads: ``--threads``, else the cores this process may run on less
    ``--reserved-cpus`` (default 0, at least 1 thread). Reserved cores are left to the HTTP
    side (asyncio, tokenization, streaming) and whatever else shares the machine (vLLM's CPU
    backend has the same knob, ``VLLM_CPU_NUM_OF_RESERVED_CPU``). Measured on 2 cores with
    guidellm as the client, once the engine loop held the process's only OpenMP pool
    (docs/performance.md, "One OpenMP pool" and "Serving: threads"): 2 torch threads gave
    1.24-1.61x the tokens/s of 1 at concurrency 1 and 4, round by round (inter-token latency
    p50 30-33 against 44-55 ms at 1). Logs a warning when ``--threads`` exceeds the usable
    cores (libgomp then spins its waiting threads only 100 turns). Raises ``ConfigError`` for
    a negative ``--reserved-cpus``."""
    import os

    from pagedkv.errors import ConfigError

    if args.reserved_cpus < 0:
        raise ConfigError(f"--reserved-cpus must be >= 0, got {args.reserved_cpus}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if args.threads is not None:
        if args.threads > cores:
            logging.getLogger("pagedkv.serving").warning(
                "--threads %d is more than the %d usable cores: OpenMP's waiting threads then sleep after "
                "every parallel op (docs/performance.md, \"One OpenMP pool\")", args.threads, cores)
        return args.threads
    return max(1, cores - args.reserved_cpus)


def load_keys(args: argparse.Namespace) -> Optional[dict[str, str]]:
    """``--api-keys`` read (None without it); checks ``--max-body-bytes``. Raises ``ConfigError``."""
    from pagedkv.errors import ConfigError
    from pagedkv.serving.api_keys import load_api_keys

    if args.max_body_bytes < 1024:
        raise ConfigError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if not args.api_keys:
        return None
    try:
        return load_api_keys(args.api_keys)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--api-keys: {e}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_serve_parser(subparsers)
    g = p.add_argument_group("data-parallel replicas (Ray Serve; docs/replicas.md)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine replicas, each a Ray Serve deployment behind one ingress (default 1: no Ray)")
    g.add_argument("--routing", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"replica choice per request (default {DEFAULT_POLICY})")
    g.add_argument("--route-load-gap", type=int, default=DEFAULT_LOAD_GAP, metavar="K",
                   help="prefix-aware: go to the least-loaded replica when the prefix choice has more than K "
                        f"requests in flight beyond it (default {DEFAULT_LOAD_GAP})")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 'auto' after `ray start --head`, or HOST:6379); "
                        "default: start Ray on this machine")
    g.add_argument("--ray-num-cpus", type=int, default=None, metavar="N",
                   help="CPUs of a locally started Ray (default: all)")
    g.add_argument("--replica-cpus", type=float, default=0.0, metavar="C",
                   help="Ray CPUs each replica reserves (placement across nodes; default 0)")
    g.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="torch threads per replica (default: torch's choice; on one machine cores / N)")
    g.add_argument("--no-replica-kv-events", dest="replica_kv_events", action="store_false",
                   help="no KV events from the replicas: the prefix index learns only the prompts routed")
    p.set_defaults(func=cmd_serve)
