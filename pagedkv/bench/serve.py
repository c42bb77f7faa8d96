"""Serving: Poisson arrivals of trace-sized requests, paging on/off and prefix caching on/off, rate sweep.

Seed §05 "serving performance": fix the arrival rate, the KV budget and a latency target,
then compare sustainable throughput, preemptions/rejections, TTFT and TPOT.

* Requests: prompt and output lengths drawn from the Azure LLM conversation trace and scaled
  (``LengthScaling``: divided by ``--length-divisor`` and clipped); prompts are synthetic token
  ids whose first ``--shared-prefix-len`` tokens are one common "system prompt" (so prefix
  caching has something to find); outputs are forced to the drawn length (``ignore_eos``),
  greedy.
* Arrivals: a Poisson process at ``rate`` requests/s. One unit-rate draw is divided by the
  rate, so every rate replays the same requests in the same order.
* In-process replay in real time: a request is added (with its scheduled arrival time) as
  soon as that time has passed, and the engine steps in between; TTFT therefore includes the
  wait for the step in flight. With ``--http`` the same workload is also sent to
  ``pagedkv serve`` on 127.0.0.1 (``/v1/completions``, streamed; TTFT = first streamed text).
* Cells (one fixed rate, the same KV budget): paging on/off x prefix caching on/off.
  ``enable_paging=False`` is contiguous max reservation: each admitted request reserves
  ``ceil(max_model_len / block_size)`` blocks.
* Rate sweep (prefix caching off): the highest rate whose p90 TTFT and p90 TPOT meet the
  target (and nothing rejected or left unfinished), for paging on and off.

Definitions (seconds): TTFT = first token time - arrival time; TPOT = (finish time - first
token time) / (output tokens - 1); duration = last finish - first arrival; throughput =
completed requests / duration and output tokens / duration. Percentiles interpolate
linearly between closest ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedkv.bench.common import RESULTS_DIR, machine_info, markdown_table, pin_threads, write_results
from pagedkv.bench.workload import (
    BenchRequest,
    LengthScaling,
    finite_or_none,
    load_trace,
    make_requests,
    poisson_arrivals,
    summarize,
    tpot,
    ttft,
)

NAME = "serving"


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=16, help="requests per run (default 16)")
    w.add_argument("--rate", type=float, default=0.3, help="arrival rate of the cell comparison, requests/s (default 0.3)")
    w.add_argument("--rates", default="0.2,0.3,0.45,0.6,0.9,1.2",
                   help="rate sweep, requests/s, comma-separated ('' = no sweep; default 0.2,0.3,0.45,0.6,0.9,1.2)")
    w.add_argument("--length-divisor", type=float, default=8.0, help="trace lengths are divided by this (default 8)")
    w.add_argument("--max-prompt", type=int, default=512, help="clip prompts to this many tokens (default 512)")
    w.add_argument("--max-output", type=int, default=64, help="clip outputs to this many tokens (default 64)")
    w.add_argument("--shared-prefix-len", type=int, default=64,
                   help="tokens of common system prompt at the start of every prompt (default 64)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--trace", default=None, help="trace CSV (default: the shared Azure conversation trace)")
    e = p.add_argument_group("engine (the same KV budget in every cell)")
    e.add_argument("--max-model-len", type=int, default=1024, help="context limit, tokens; the contiguous reservation (default 1024)")
    e.add_argument("--num-blocks", type=int, default=128, help="KV budget in blocks (default 128 = 2 x max_model_len at block 16)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=32,
                   help="tokens per engine step (default 32: a step of 512 tokens takes ~2 s on 2 idle cores and one "
                        "of 32 ~0.2 s, so larger steps put every running request past a TPOT target)")
    t = p.add_argument_group("target and limits")
    t.add_argument("--target-ttft-p90", type=float, default=2.0, help="latency target: p90 TTFT, s (default 2)")
    t.add_argument("--target-tpot-p90", type=float, default=0.2, help="latency target: p90 TPOT, s (default 0.2)")
    t.add_argument("--relaxed-factor", type=float, default=3.0,
                   help="also report a relaxed target, both limits times this factor (0 = off; default 3): on a "
                        "loaded shared machine the strict target may be out of reach at any rate")
    t.add_argument("--max-run-seconds", type=float, default=90.0,
                   help="a run still busy this many seconds after its last arrival aborts the rest (they count as "
                        "unfinished; default 90)")
    t.add_argument("--stop-after-misses", type=int, default=2,
                   help="stop sweeping a mode after it misses the (relaxed) target at this many rates in a row (default 2)")
    t.add_argument("--sweep-all", action="store_true", help="sweep every rate whatever the misses")
    h = p.add_argument_group("http")
    h.add_argument("--http", action="store_true", help="also run the paging-on cell against `pagedkv serve` over HTTP")
    h.add_argument("--http-server", choices=["subprocess", "thread"], default="subprocess",
                   help="`python -m pagedkv.cli serve` in a subprocess (default) or uvicorn in a thread of this process")
    h.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--cells", default="all", help="'all' or 'none' (only the sweep)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--note", default=None, help="free text recorded in the results (e.g. why a run was shrunk)")
    p.add_argument("--tiny", action="store_true", help="test-sized run: 4 requests, short lengths, 2 sweep rates")


# --------------------------------------------------------------------------------------------
# Per-request records and run summaries
# --------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """Timing of one request (seconds since the epoch) and its output token count."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    output_tokens: int = 0
    expected_tokens: int = 0
    preemptions: int = 0
    cached_tokens: int = 0
    status: str = "pending"  # ok | rejected | unfinished | error


@dataclass
class RunStats:
    """What a run observed besides the per-request records."""

    started: float = 0.0
    ended: float = 0.0
    steps: int = 0
    running_samples: list[int] = field(default_factory=list)
    kv_usage_samples: list[float] = field(default_factory=list)
    preemptions: int = 0
    peak_running: int = 0
    cpu_s: Optional[float] = None  # this process's CPU seconds over the run (in-process runs)
    notes: list[str] = field(default_factory=list)


def summarize_run(records: Sequence[RequestRecord], stats: RunStats) -> dict[str, Any]:
    """Throughput, latency percentiles and counts of one run (see the module docstring for
    the definitions; times in seconds, rates per second)."""
    ok = [r for r in records if r.status == "ok"]
    ttfts = [ttft(r.arrival_time, r.first_token_time) for r in ok if r.first_token_time is not None]
    tpots = [x for x in (tpot(r.first_token_time, r.finish_time, r.output_tokens) for r in ok
                         if r.first_token_time is not None and r.finish_time is not None) if x is not None]
    e2e = [r.finish_time - r.arrival_time for r in ok if r.finish_time is not None]
    first_arrival = min((r.arrival_time for r in records), default=stats.started)
    last_finish = max((r.finish_time for r in ok if r.finish_time is not None), default=stats.ended)
    duration = max(last_finish - first_arrival, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "unfinished": sum(1 for r in records if r.status in ("unfinished", "pending")),
        "errors": sum(1 for r in records if r.status == "error"),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_s": summarize(ttfts),
        "tpot_s": summarize(tpots),
        "e2e_latency_s": summarize(e2e),
        "preemptions": stats.preemptions,
        "peak_running": stats.peak_running,
        "mean_running": (sum(stats.running_samples) / len(stats.running_samples)) if stats.running_samples else float("nan"),
        "mean_kv_usage": (sum(stats.kv_usage_samples) / len(stats.kv_usage_samples)) if stats.kv_usage_samples else float("nan"),
        "engine_steps": stats.steps,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "cpu_s": stats.cpu_s,
        "notes": stats.notes,
    }


def meets_target(summary: dict[str, Any], ttft_p90: float, tpot_p90: float) -> bool:
    """p90 TTFT <= ``ttft_p90`` s, p90 TPOT <= ``tpot_p90`` s, every request completed."""
    if summary["completed"] == 0 or summary["completed"] < summary["requests"]:
        return False
    t, p = summary["ttft_s"]["p90"], summary["tpot_s"]["p90"]
    if t is None or not math.isfinite(t) or t > ttft_p90:
        return False
    if p is not None and math.isfinite(p) and p > tpot_p90:
        return False
    return True


# --------------------------------------------------------------------------------------------
# In-process replay
# --------------------------------------------------------------------------------------------


def replay_in_process(engine: Any, reqs: Sequence[BenchRequest], max_run_s: float,
                      desc: str = "serve", progress: bool = True) -> tuple[list[RequestRecord], RunStats]:
    """Replay ``reqs`` (arrival offsets in seconds) against ``engine`` in real time: add each
    request once its arrival time has passed (with that time as ``arrival_time``), step the
    engine in between, sleep when idle. ``max_run_s`` seconds after the last arrival the rest
    is aborted (counted as unfinished)."""
    from tqdm.auto import tqdm

    from pagedkv.engine.request import SamplingParams
    from pagedkv.errors import InvalidRequestError

    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    st0 = engine.get_stats()
    stats = RunStats()
    records: list[RequestRecord] = [RequestRecord(0.0, expected_tokens=r.output_len) for r in reqs]
    ids = {f"r{i}": i for i in range(len(reqs))}
    bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)
    start = time.time() + 0.01
    for i, r in enumerate(reqs):
        records[i].arrival_time = start + r.arrival_s
    stats.started = start
    c0 = time.process_time()
    k = 0
    done = 0
    deadline = start + max((r.arrival_s for r in reqs), default=0.0) + max_run_s
    try:
        while True:
            now = time.time()
            while k < len(order) and records[order[k]].arrival_time <= now:
                i = order[k]
                k += 1
                sp = SamplingParams(temperature=0.0, max_tokens=reqs[i].output_len, ignore_eos=True)
                try:
                    engine.add_request(f"r{i}", reqs[i].prompt_token_ids, sp, arrival_time=records[i].arrival_time)
                except InvalidRequestError as exc:
                    records[i].status = "rejected"
                    stats.notes.append(f"r{i} rejected: {exc}")
                    done += 1
                    bar.update(1)
            if now > deadline:
                left = [rid for rid, i in ids.items() if records[i].status == "pending"]
                stats.notes.append(f"stopped {max_run_s:.0f}s after the last arrival: {len(left)} requests unfinished")
                engine.abort_request(left)
                while engine.has_unfinished_requests():
                    engine.step()
                for rid in left:
                    records[ids[rid]].status = "unfinished"
                break
            if engine.has_unfinished_requests():
                outs = engine.step()
                stats.steps += 1
                s = engine.get_stats()
                stats.running_samples.append(s.num_running)
                stats.kv_usage_samples.append(float(s.kv_usage))
                for o in outs:
                    if not o.finished or o.request_id not in ids:
                        continue
                    rec = records[ids[o.request_id]]
                    rec.first_token_time = o.metrics.first_token_time
                    rec.finish_time = o.metrics.finish_time
                    rec.output_tokens = len(o.token_ids)
                    rec.preemptions = o.metrics.num_preemptions
                    rec.cached_tokens = o.num_cached_tokens
                    rec.status = "ok" if o.finish_reason in ("length", "stop") else "error"
                    done += 1
                    bar.update(1)
            elif k < len(order):
                time.sleep(min(max(records[order[k]].arrival_time - time.time(), 0.0), 0.05))
            else:
                break
    finally:
        bar.close()
    stats.ended = time.time()
    stats.cpu_s = time.process_time() - c0
    st1 = engine.get_stats()
    stats.preemptions = st1.num_preemptions - st0.num_preemptions
    stats.peak_running = max(stats.running_samples, default=0)
    return records, stats


def make_engine(loaded: Any, cell: dict[str, Any], args: argparse.Namespace) -> Any:
    from pagedkv.engine.engine import LLMEngine

    return LLMEngine(
        loaded, dtype="float32", block_size=args.block_size, num_blocks=args.num_blocks,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        enable_paging=cell["enable_paging"], enable_prefix_caching=cell["enable_prefix_caching"],
    )


def _warm_up(engine: Any, vocab: int) -> None:
    from pagedkv.engine.request import SamplingParams

    engine.add_request("warmup", [vocab - 1 - j for j in range(20)],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_cell_in_process(loaded: Any, cell: dict[str, Any], reqs: Sequence[BenchRequest],
                        args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    engine = make_engine(loaded, cell, args)
    _warm_up(engine, int(loaded.config.vocab_size))
    records, stats = replay_in_process(engine, reqs, args.max_run_seconds, desc=cell["name"], progress=progress)
    summary = summarize_run(records, stats)
    kv = engine.kv_summary()
    summary["max_concurrency_by_reservation"] = kv["max_concurrency_at_max_model_len"]
    return summary


# --------------------------------------------------------------------------------------------
# HTTP replay
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m pagedkv.cli serve`` on 127.0.0.1 as a subprocess (bounded start time)."""

    def __init__(self, cell: dict[str, Any], args: argparse.Namespace, port: int, start_timeout_s: float = 300.0):
        cmd = [
            sys.executable, "-m", "pagedkv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--dtype", "float32", "--block-size", str(args.block_size),
            "--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--threads", str(args.threads), "--seed", str(args.seed),
        ]
        if not cell["enable_paging"]:
            cmd.append("--disable-paging")
        if cell["enable_prefix_caching"]:
            cmd.append("--enable-prefix-caching")
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.PIPE, env=env,
                                     cwd=str(RESULTS_DIR.parents[1]), text=True)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"pagedkv serve exited with {self.proc.returncode}: {err[-800:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"pagedkv serve did not become ready within {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def _http_one(client: Any, url: str, model: str, req: BenchRequest, rec: RequestRecord,
                    start: float, deadline: float) -> None:
    delay = rec.arrival_time - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=max(deadline - time.time(), 1.0)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.status = "rejected"
                return
            finish_reason = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec.status = "error"
                    return
                for ch in obj.get("choices") or []:
                    if rec.first_token_time is None and (ch.get("text") or ch.get("finish_reason")):
                        rec.first_token_time = time.time()
                    if ch.get("finish_reason"):
                        finish_reason = ch["finish_reason"]
                        rec.finish_time = time.time()
                usage = obj.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens", 0))
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if finish_reason in ("length", "stop"):
                rec.status = "ok"
                if not rec.output_tokens:
                    rec.output_tokens = req.output_len
            else:
                rec.status = "error"
    except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - a failed request is counted
        import httpx

        rec.status = "unfinished" if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)) else "error"


async def _http_replay(url: str, reqs: Sequence[BenchRequest], max_run_s: float, desc: str,
                       progress: bool) -> tuple[list[RequestRecord], RunStats]:
    import httpx
    from tqdm.auto import tqdm

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(reqs) + 4)) as client:
        r = await client.get(url + "/v1/models", timeout=10.0)
        model = r.json()["data"][0]["id"]
        stats = RunStats()
        start = time.time() + 0.05
        stats.started = start
        deadline = start + max((q.arrival_s for q in reqs), default=0.0) + max_run_s
        records = [RequestRecord(start + q.arrival_s, expected_tokens=q.output_len) for q in reqs]
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)

        async def one(q: BenchRequest, rec: RequestRecord) -> None:
            await _http_one(client, url, model, q, rec, start, deadline)
            bar.update(1)

        tasks = [asyncio.create_task(one(q, rec)) for q, rec in zip(reqs, records)]
        done, pending = await asyncio.wait(tasks, timeout=max(deadline - time.time(), 1.0) + 5.0)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            stats.notes.append(f"stopped {max_run_s:.0f}s after the last arrival: {len(pending)} requests unfinished")
        for rec in records:
            if rec.status == "pending":
                rec.status = "unfinished"
        bar.close()
        stats.ended = time.time()
        try:
            m = (await client.get(url + "/metrics", timeout=10.0)).text
            stats.preemptions = int(_prom_value(m, "preemption") or 0)
        except Exception:  # noqa: BLE001 - metrics are a bonus
            pass
    return records, stats


def _prom_value(text: str, needle: str) -> Optional[float]:
    """The first Prometheus sample whose metric name contains ``needle`` (no labels matter)."""
    for line in text.splitlines():
        if line.startswith("#") or needle not in line.split(" ")[0].split("{")[0]:
            continue
        try:
            return float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return None


def run_cell_http(loaded: Any, cell: dict[str, Any], reqs: Sequence[BenchRequest], args: argparse.Namespace,
                  progress: bool = True) -> dict[str, Any]:
    """The cell against ``pagedkv serve`` over HTTP on 127.0.0.1."""
    port = args.port or _free_port()
    desc = cell["name"] + " (http)"
    if args.http_server == "thread":
        from pagedkv.server.app import build_app
        from pagedkv.server.threaded import ThreadedServer

        engine = make_engine(loaded, cell, args)
        _warm_up(engine, int(loaded.config.vocab_size))
        srv = ThreadedServer(build_app(engine), host="127.0.0.1", port=port)
        try:
            records, stats = asyncio.run(_http_replay(srv.url, reqs, args.max_run_seconds, desc, progress))
            stats.preemptions = stats.preemptions or engine.get_stats().num_preemptions
        finally:
            srv.stop()
        server = "uvicorn thread in the benchmark process"
    else:
        with ServerProcess(cell, args, port) as srv:
            # one warm-up request through the server, not timed
            warm = BenchRequest([int(loaded.config.vocab_size) - 1 - j for j in range(20)] if loaded is not None
                                else list(range(300, 320)), 3)
            asyncio.run(_http_replay(srv.url, [warm], 120.0, "warm-up", False))
            records, stats = asyncio.run(_http_replay(srv.url, reqs, args.max_run_seconds, desc, progress))
        server = "`python -m pagedkv.cli serve` subprocess"
    summary = summarize_run(records, stats)
    summary["server"] = server
    return summary


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

CELLS = [
    {"name": "paging on", "enable_paging": True, "enable_prefix_caching": False},
    {"name": "paging off", "enable_paging": False, "enable_prefix_caching": False},
    {"name": "paging on + prefix caching", "enable_paging": True, "enable_prefix_caching": True},
    {"name": "paging off + prefix caching", "enable_paging": False, "enable_prefix_caching": True},
]


def _at_rate(reqs: Sequence[BenchRequest], unit_arrivals: Sequence[float], rate: float) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_token_ids, r.output_len, a / rate, r.trace_prompt_tokens, r.trace_output_tokens)
            for r, a in zip(reqs, unit_arrivals)]


def _row(name: str, rate: float, s: dict[str, Any], target: tuple[float, float],
         relaxed: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    row = {"cell": name, "rate": rate, **s, "meets_target": meets_target(s, *target)}
    if relaxed is not None:
        row["meets_relaxed_target"] = meets_target(s, *relaxed)
    return row


def run_serving(args: argparse.Namespace, loaded: Any = None, progress: bool = True) -> dict[str, Any]:
    """Run the cells, the sweep and (``args.http``) the HTTP cell; ``loaded`` (a pagedkv
    LoadedModel, fp32) may be passed in to avoid reloading. Returns the results dict."""
    if args.tiny:
        args.num_requests = min(args.num_requests, 4)
        args.max_prompt = min(args.max_prompt, 48)
        args.max_output = min(args.max_output, 4)
        args.max_model_len = min(args.max_model_len, 64)
        args.num_blocks = min(args.num_blocks, 16)
        args.shared_prefix_len = min(args.shared_prefix_len, 16)
        args.rates = ",".join(args.rates.split(",")[:2]) if args.rates else args.rates
        args.max_run_seconds = min(args.max_run_seconds, 60.0)
    threads = pin_threads(args.threads)
    load_start = _loadavg()
    t_all = time.time()
    if loaded is None:
        import torch

        from pagedkv.model.loader import load_model

        loaded = load_model(None, dtype=torch.float32)
    vocab = int(loaded.config.vocab_size)
    scaling = LengthScaling(prompt_divisor=args.length_divisor, output_divisor=args.length_divisor,
                            min_prompt=4, max_prompt=args.max_prompt, min_output=2, max_output=args.max_output)
    base = make_requests(args.num_requests, scaling, vocab, seed=args.seed,
                         shared_prefix_len=args.shared_prefix_len, trace=load_trace(args.trace))
    unit = poisson_arrivals(args.num_requests, 1.0, seed=args.seed + 2)
    target = (args.target_ttft_p90, args.target_tpot_p90)
    relaxed = (target[0] * args.relaxed_factor, target[1] * args.relaxed_factor) if args.relaxed_factor > 0 else None
    stop_key = "meets_relaxed_target" if relaxed is not None else "meets_target"
    cache: dict[tuple[str, float], dict[str, Any]] = {}

    def measure(cell: dict[str, Any], rate: float) -> dict[str, Any]:
        key = (cell["name"], rate)
        if key not in cache:
            t = time.time()
            s = run_cell_in_process(loaded, cell, _at_rate(base, unit, rate), args, progress)
            cache[key] = _row(cell["name"], rate, s, target, relaxed)
            _log(f"[serve] {cell['name']} @ {rate:g} req/s: {s['output_tokens_per_s']:.1f} tok/s, TTFT p90 "
                 f"{s['ttft_s']['p90']:.2f}s, TPOT p90 {s['tpot_s']['p90'] * 1e3:.0f}ms, preempt {s['preemptions']}, "
                 f"done {s['completed']}/{s['requests']} ({time.time() - t:.0f}s)")
        return cache[key]

    cells = []
    if args.cells != "none":
        cells = [measure(c, args.rate) for c in CELLS]

    sweep: dict[str, list[dict[str, Any]]] = {}
    sustainable: dict[str, Optional[float]] = {}
    rates = sorted({float(x) for x in args.rates.split(",") if x.strip()}) if args.rates else []
    # rates outer, cells inner: paging on and off at one rate run back to back, so a change in
    # the machine's load hits both alike. A mode stops after missing the (relaxed) target at
    # --stop-after-misses rates in a row (one miss can be a burst of load from other jobs).
    misses = {c["name"]: 0 for c in CELLS[:2]}
    for c in CELLS[:2]:
        sweep[c["name"]] = []
    for r in rates:
        for cell in CELLS[:2]:
            name = cell["name"]
            if (misses[name] >= args.stop_after_misses and not args.sweep_all
                    and (name, r) not in cache):
                sweep[name].append({"cell": name, "rate": r, "skipped": "missed the "
                                    + ("relaxed target" if relaxed is not None else "target")
                                    + f" at {misses[name]} lower rates in a row"})
                continue
            row = measure(cell, r)
            sweep[name].append(row)
            misses[name] = 0 if row[stop_key] else misses[name] + 1
    sustainable_relaxed: dict[str, Optional[float]] = {}
    for name, rows in sweep.items():
        ok = [x["rate"] for x in rows if x.get("meets_target")]
        sustainable[name] = max(ok) if ok else None
        ok = [x["rate"] for x in rows if x.get("meets_relaxed_target")]
        sustainable_relaxed[name] = max(ok) if ok else None

    http_rows = []
    if args.http:
        cell = CELLS[0]
        t = time.time()
        try:
            s = run_cell_http(loaded, cell, _at_rate(base, unit, args.rate), args, progress)
            row = _row(cell["name"] + " (HTTP)", args.rate, s, target, relaxed)
            _log(f"[serve] HTTP {cell['name']} @ {args.rate:g} req/s: {s['output_tokens_per_s']:.1f} tok/s, "
                 f"TTFT p90 {s['ttft_s']['p90']:.2f}s ({time.time() - t:.0f}s)")
        except Exception as exc:  # noqa: BLE001 - reported in the results
            row = {"cell": cell["name"] + " (HTTP)", "rate": args.rate, "error": f"{type(exc).__name__}: {exc}"[:600]}
            _log(f"[serve] HTTP failed: {row['error']}")
        http_rows.append(row)

    bpt = _bytes_per_token(loaded)
    data = {
        "benchmark": NAME,
        "description": (__doc__ or "").strip().splitlines()[0],
        "config": {
            "num_requests": args.num_requests,
            "rate_cells": args.rate,
            "rates_sweep": rates,
            "length_scaling": scaling.as_dict(),
            "length_scaling_text": scaling.describe(),
            "shared_prefix_len": args.shared_prefix_len,
            "seed": args.seed,
            "threads": threads,
            "dtype": "float32",
            "decoding": "greedy, ignore_eos",
            "block_size": args.block_size,
            "num_blocks": args.num_blocks,
            "kv_budget_tokens": args.num_blocks * args.block_size,
            "kv_budget_bytes": args.num_blocks * args.block_size * bpt if bpt else None,
            "kv_bytes_per_token": bpt,
            "max_model_len": args.max_model_len,
            "contiguous_max_concurrency": args.num_blocks // -(-args.max_model_len // args.block_size),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "target": {"ttft_p90_s": args.target_ttft_p90, "tpot_p90_s": args.target_tpot_p90,
                       "also": "every request completed, none rejected"},
            "relaxed_target": {"ttft_p90_s": relaxed[0], "tpot_p90_s": relaxed[1]} if relaxed else None,
            "max_run_seconds": args.max_run_seconds,
            "tiny": bool(args.tiny),
            "notes": args.note,
        },
        "workload": {
            "prompt_len": summarize(r.prompt_len for r in base),
            "output_len": summarize(r.output_len for r in base),
            "prompt_tokens": sum(r.prompt_len for r in base),
            "output_tokens": sum(r.output_len for r in base),
        },
        "cells": cells,
        "sweep": sweep,
        "sustainable_rate": sustainable,
        "sustainable_rate_relaxed": sustainable_relaxed if relaxed is not None else None,
        "http": http_rows,
        "elapsed_s": time.time() - t_all,
        "load_average_1m": {"start": load_start, "end": _loadavg()},
        "machine": machine_info(threads),
    }
    return _clean(data)


def _bytes_per_token(loaded: Any) -> Optional[int]:
    try:
        from pagedkv.kv import KVCacheSpec

        mc = loaded.config
        return int(KVCacheSpec(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                               dtype="fp32").bytes_per_token)
    except Exception:  # noqa: BLE001
        return None


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return finite_or_none(obj)


def _loadavg() -> Optional[float]:
    """The 1-minute load average (the machine is shared: a busy machine slows every system)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ms(x: Any) -> Any:
    return x * 1000.0 if isinstance(x, (int, float)) else "n/a"


def _table_row(r: dict[str, Any]) -> dict[str, Any]:
    if "skipped" in r:
        return {"cell": r["cell"], "rate (req/s)": r["rate"], "meets target (strict/relaxed)": f"skipped: {r['skipped']}"}
    if "error" in r:
        return {"cell": r["cell"], "rate (req/s)": r["rate"], "meets target (strict/relaxed)": f"error: {r['error']}"}
    return {
        "cell": r["cell"],
        "rate (req/s)": r["rate"],
        "done/rej/unfin": f"{r['completed']}/{r['rejected']}/{r['unfinished']}",
        "req/s": r["requests_per_s"],
        "out tok/s": r["output_tokens_per_s"],
        "TTFT p50/p90/p99 (s)": "/".join(f"{r['ttft_s'][k]:.2f}" if r["ttft_s"][k] is not None else "n/a"
                                        for k in ("p50", "p90", "p99")),
        "TPOT p50/p90/p99 (ms)": "/".join(f"{_ms(r['tpot_s'][k]):.0f}" if r["tpot_s"][k] is not None else "n/a"
                                         for k in ("p50", "p90", "p99")),
        "preempt": r["preemptions"],
        "running per step (mean/peak)": f"{r['mean_running']:.1f}/{r['peak_running']}" if r["mean_running"] is not None else "n/a",
        "cached prompt tok": r["cached_prompt_tokens"],
        "meets target (strict/relaxed)": ("yes" if r["meets_target"] else "no") + (
            "/" + ("yes" if r["meets_relaxed_target"] else "no") if "meets_relaxed_target" in r else ""),
    }


def render_markdown(data: dict[str, Any]) -> str:
    c = data["config"]
    w = data["workload"]
    tg = c["target"]
    budget_mib = (c["kv_budget_bytes"] or 0) / 2**20
    lines = [
        "# Serving: paging and prefix caching under Poisson arrivals",
        "",
        f"{c['num_requests']} requests per run, lengths drawn from the Azure LLM conversation trace (2023) and "
        f"scaled: {c['length_scaling_text']} (prompt p50 {w['prompt_len']['p50']:.0f}, output p50 "
        f"{w['output_len']['p50']:.0f} tokens). Synthetic token-id prompts whose first {c['shared_prefix_len']} "
        f"tokens are a shared system prompt; {c['decoding']}; {c['dtype']}; {c['threads']} torch threads.",
        "",
        f"Same KV budget in every cell: {c['num_blocks']} blocks x {c['block_size']} tokens = {c['kv_budget_tokens']} "
        f"tokens = {budget_mib:.0f} MiB ({c['kv_bytes_per_token']} B/token); max_model_len {c['max_model_len']}, so "
        f"contiguous max reservation admits at most {c['contiguous_max_concurrency']} requests at once. "
        f"max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}.",
        "",
        f"Latency target: p90 TTFT <= {tg['ttft_p90_s']:g} s and p90 TPOT <= {tg['tpot_p90_s'] * 1000:g} ms, "
        f"{tg['also']}" + (f"; relaxed target: p90 TTFT <= {c['relaxed_target']['ttft_p90_s']:g} s and p90 TPOT "
                            f"<= {c['relaxed_target']['tpot_p90_s'] * 1000:g} ms" if c.get("relaxed_target") else "")
        + f". Runs still busy {c['max_run_seconds']:.0f} s after their last arrival are cut (the rest counts as "
        "unfinished).",
        "",
    ]
    if data["cells"]:
        lines += [f"## Cells at {c['rate_cells']:g} requests/s", "", markdown_table([_table_row(r) for r in data["cells"]])]
    if data["sweep"]:
        lines += ["## Rate sweep (prefix caching off)", ""]
        relaxed_rates = data.get("sustainable_rate_relaxed") or {}
        for name, rate in data["sustainable_rate"].items():
            line = (f"- **{name}**: highest rate meeting the target: "
                    f"{'%g req/s' % rate if rate is not None else 'none of the rates tried'}")
            if name in relaxed_rates:
                rr = relaxed_rates[name]
                line += f"; the relaxed target: {'%g req/s' % rr if rr is not None else 'none of the rates tried'}"
            lines.append(line)
        lines += ["", markdown_table([_table_row(r) for rows in data["sweep"].values() for r in rows])]
        lines.append("Rates are a grid: the sustainable rate lies between the highest passing rate and the next one. "
                     "Paging on and off run back to back at each rate; a burst of load from other jobs can still make "
                     "one rate look worse than a higher one.")
        lines.append("")
    if data["sweep"]:
        lines += ["## Reading the numbers", ""] + _reading(data) + [""]
    if data["http"]:
        lines += ["## Over HTTP (`pagedkv serve`, streamed /v1/completions on 127.0.0.1)", "",
                  markdown_table([_table_row(r) for r in data["http"]])]
        srv = next((r.get("server") for r in data["http"] if r.get("server")), None)
        if srv:
            lines.append(f"Server: {srv}; TTFT = first streamed text chunk.")
        lines.append("")
    lines += [
        "Definitions: TTFT = first token - arrival (includes queueing and the step in flight when the request "
        "arrived); TPOT = (finish - first token) / (output tokens - 1); throughput = completed / (last finish - "
        "first arrival). Low rates are arrival-bound (throughput ~ rate). The machine is shared with other jobs: "
        "compare cells measured in the same run.",
    ]
    if c.get("notes"):
        lines += ["", c["notes"]]
    la = data.get("load_average_1m") or {}
    if la.get("start") is not None:
        lines += ["", f"1-minute load average at start / end: {la['start']:.1f} / {la['end']:.1f} "
                  f"(on {data['machine']['cpu_count']} CPUs; other jobs share the machine)."]
    return "\n".join(lines) + "\n"


def _misses(r: dict[str, Any], ttft_p90: float, tpot_p90: float) -> list[str]:
    out = []
    if r["completed"] < r["requests"]:
        out.append(f"{r['requests'] - r['completed']} requests not completed")
    t, p = r["ttft_s"]["p90"], r["tpot_s"]["p90"]
    if t is not None and t > ttft_p90:
        out.append(f"p90 TTFT {t:.2f} s > {ttft_p90:g} s")
    if p is not None and p > tpot_p90:
        out.append(f"p90 TPOT {p * 1000:.0f} ms > {tpot_p90 * 1000:g} ms")
    return out


def _reading(data: dict[str, Any]) -> list[str]:
    """Generated observations: which limit binds for each mode, and the ratio of rates."""
    c = data["config"]
    tg, rt = c["target"], c.get("relaxed_target")
    lines = []
    for name, rows in data["sweep"].items():
        done = [r for r in rows if "skipped" not in r and "error" not in r]
        if not done:
            continue
        low = min(done, key=lambda r: r["rate"])
        why = _misses(low, tg["ttft_p90_s"], tg["tpot_p90_s"])
        if why:
            lines.append(f"- {name}: at its lowest rate ({low['rate']:g} req/s) the strict target is missed by "
                         + " and ".join(why) + ".")
        peak = max(done, key=lambda r: r["output_tokens_per_s"])
        lines.append(f"- {name}: highest measured throughput {peak['output_tokens_per_s']:.1f} output tok/s "
                     f"({peak['requests_per_s']:.2f} req/s completed) at {peak['rate']:g} req/s offered; "
                     f"peak {peak['peak_running']} requests running at once.")
    sr = data.get("sustainable_rate_relaxed") or {}
    on, off = sr.get("paging on"), sr.get("paging off")
    if rt and on and off:
        lines.append(f"- Relaxed target: paging sustains {on:g} req/s against {off:g} req/s without it "
                     f"({on / off:.1f}x) in the same {c['kv_budget_tokens']}-token KV budget: contiguous reservation "
                     f"runs at most {c['contiguous_max_concurrency']} requests, so arrivals queue and TTFT grows, "
                     "while paged blocks let more requests share the batch.")
    lines.append("- The trade-off shows in TPOT: with more requests admitted, their prefill chunks share steps "
                 "with the running decodes (chunked prefill, "
                 f"{c['max_num_batched_tokens']} tokens per step), so paging's p90 TPOT sits above the "
                 "contiguous baseline's, which rarely has more than two requests in a step.")
    return lines


def plot(data: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = data["config"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rt = c.get("relaxed_target") or {}
    panels = [("ttft_s", "p90 TTFT (s)", c["target"]["ttft_p90_s"], rt.get("ttft_p90_s"), 1.0),
              ("tpot_s", "p90 TPOT (ms)", c["target"]["tpot_p90_s"] * 1000,
               rt["tpot_p90_s"] * 1000 if rt else None, 1000.0),
              ("output_tokens_per_s", "output tokens/s", None, None, 1.0)]
    for ax, (key, label, tgt, rtgt, mult) in zip(axes, panels):
        for name, rows in data["sweep"].items():
            pts = [(r["rate"], r[key]["p90"] if isinstance(r.get(key), dict) else r.get(key))
                   for r in rows if "skipped" not in r and "error" not in r]
            pts = [(x, y * mult) for x, y in pts if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if tgt is not None:
            ax.axhline(tgt, color="grey", linestyle="--", linewidth=1, label="target")
        if rtgt is not None:
            ax.axhline(rtgt, color="grey", linestyle=":", linewidth=1, label="relaxed target")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Serving sweep: KV budget {c['kv_budget_tokens']} tokens, max_model_len {c['max_model_len']}, "
                 f"{c['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = run_serving(args, loaded=loaded, progress=not args.json)
    paths = write_results(NAME, data, render_markdown(data), args.out_dir)
    if not args.no_plot:
        out = Path(args.out_dir) if args.out_dir else RESULTS_DIR
        plot(data, out / f"{NAME}.png")
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(paths["md"].read_text())
    return 0
