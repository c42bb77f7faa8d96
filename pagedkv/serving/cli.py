"""``pagedkv serve``: one engine (:mod:`pagedkv.server.cli`) or, with
``--data-parallel-size N`` (N > 1), N engine replicas on Ray Serve behind one routing ingress."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedkv.engine.cli import engine_kwargs
from pagedkv.server import cli as server_cli
from pagedkv.server.http_protocol import uvicorn_options
from pagedkv.serving.router import DEFAULT_LOAD_GAP, DEFAULT_POLICY, POLICIES


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.errors import ConfigError

    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size == 1:
        return server_cli.cmd_serve(args)
    if args.kv_events is not None:
        raise ConfigError("--kv-events names one endpoint; with replicas each publishes on its own port "
                          "(on by default, --no-replica-kv-events turns them off)")
    if args.route_load_gap < 0:
        raise ConfigError(f"--route-load-gap must be >= 0, got {args.route_load_gap}")
    from pagedkv.model.loader import resolve_model_path

    resolve_model_path(args.model)  # a missing model fails here, not in N replica starts
    import uvicorn

    from pagedkv.serving.launch import ReplicaService

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    keys = server_cli.load_keys(args)
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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = server_cli.add_serve_parser(subparsers)
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
