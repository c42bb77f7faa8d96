"""Benchmarks over HTTP: start a server on 127.0.0.1 and send requests to it.

Ways to start a server:

* :func:`serve_subprocess`: ``python -m pagedkv.cli serve`` in a child process (what a user
  runs; the benchmark process and the server do not share the GIL or torch threads);
* :func:`serve_in_thread`: uvicorn in a thread of this process over an engine built here
  (:class:`pagedkv.serving.threaded.ThreadedServer`; faster to start, used by the tests);
* :func:`serve_llama_server`: llama.cpp's ``llama-server`` (the peer of
  ``pagedkv bench serve --peer llama-server``) in a child process.

Two clients, both streamed ``/v1/completions`` (token-id prompts, greedy, ``ignore_eos``)
recording each request's first streamed text and finish time (``httpx``, from the ``[bench]``
extra): :func:`replay` sends requests at their arrival offsets (open loop);
:func:`run_closed_loop` keeps a fixed number of requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from pagedkv.bench.common import REPO_ROOT, llama_cpp_env
from pagedkv.bench.workload import BenchRequest, RequestRecord, RunStats
from pagedkv.utils import free_port

HOST = "127.0.0.1"


# ---- starting a server ------------------------------------------------------------------------
@contextmanager
def serve_in_thread(engine: Any, port: int = 0) -> Iterator[str]:
    """Serve ``engine`` with uvicorn in a thread of this process; yields the base URL."""
    from pagedkv.serving.app import build_app
    from pagedkv.serving.threaded import ThreadedServer

    srv = ThreadedServer(build_app(engine), host=HOST, port=port)
    try:
        yield srv.url
    finally:
        srv.stop()


@contextmanager
def serve_subprocess(serve_args: Sequence[str], port: int = 0, start_timeout_s: float = 300.0) -> Iterator[str]:
    """``python -m pagedkv.cli serve --host 127.0.0.1 --port PORT --log-level warning
    *serve_args`` as a child process (port 0: a free one); yields the base URL once
    ``/health`` answers. Raises ``RuntimeError`` if the server exits or is not ready within
    ``start_timeout_s`` seconds; the server is stopped on exit."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--host", HOST, "--port", str(port),
           "--log-level", "warning", *serve_args]
    with serve_process(cmd, f"http://{HOST}:{port}", "pagedkv serve", start_timeout_s) as url:
        yield url


def llama_server_command(binary: str, model: str, port: int, threads: int, parallel: int,
                         ctx_per_slot: int, extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's ``llama-server`` on 127.0.0.1:``port`` over the GGUF ``model``: ``threads``
    threads for decode and prompt batches, ``parallel`` slots with continuous batching
    (``-np N -cb``), a context of ``parallel * ctx_per_slot`` tokens (a slot gets its share),
    no web UI, then ``extra``. ``port`` 0 shows as ``PORT`` (for reports)."""
    return [binary, "-m", model, "--host", HOST, "--port", str(port or "PORT"), "-t", str(threads), "-tb", str(threads),
            "-np", str(parallel), "-cb", "-c", str(parallel * ctx_per_slot), "--no-webui", *extra]


@contextmanager
def serve_llama_server(binary: str, model: str, threads: int, parallel: int = 32, ctx_per_slot: int = 512,
                       port: int = 0, start_timeout_s: float = 300.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """:func:`llama_server_command` as a child process (port 0: a free one); yields the base
    URL once ``/health`` answers 200 (the model is loaded). Raises ``RuntimeError`` if it
    exits or is not ready within ``start_timeout_s`` s; stopped on exit."""
    port = port or free_port()
    cmd = llama_server_command(binary, model, port, threads, parallel, ctx_per_slot, extra)
    with serve_process(cmd, f"http://{HOST}:{port}", "llama-server", start_timeout_s, env=llama_cpp_env()) as url:
        yield url


@contextmanager
def serve_process(cmd: Sequence[str], url: str, name: str, start_timeout_s: float = 300.0,
                  env: Optional[dict[str, str]] = None) -> Iterator[str]:
    """Run the server command ``cmd`` (listening at ``url``) as a child process; yields ``url``
    once ``/health`` answers 200. Its output goes to a temporary file (a pipe nobody reads
    would fill and block a chatty server). Raises ``RuntimeError`` (naming ``name``, with the
    output's tail) if it exits or is not ready within ``start_timeout_s`` seconds; it is
    stopped (SIGTERM, then SIGKILL) on exit. The server inherits this process's environment
    as it is: with ``OMP_WAIT_POLICY`` unset (as benchmarks should run, docs/performance.md)
    it stays unset. Until 2026-12-01 this set ``PASSIVE`` for the child when the variable was
    unset, so every HTTP serving benchmark before then ran both servers with OpenMP threads
    that sleep after each parallel op (docs/performance.md, "One OpenMP pool per process").
    ``env``: the child's whole environment instead (llama-server: ``common.llama_cpp_env()``)."""
    env = dict(os.environ) if env is None else env
    with tempfile.TemporaryFile("w+") as log_file:
        proc = subprocess.Popen(list(cmd), stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                text=True)
        try:
            _wait_ready(url, proc, start_timeout_s, name, log_file)
            yield url
        finally:
            _stop(proc)


def _tail(log_file: Any, n: int = 800) -> str:
    log_file.flush()
    log_file.seek(0)
    return log_file.read()[-n:]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, name: str, log_file: Any) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {_tail(log_file)}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become ready within {timeout_s:.0f}s: {_tail(log_file)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


#: the sampling parameters every request of the built-in client sends, spelled out so that two
#: servers with other defaults (llama-server: top-k 40, top-p 0.95, min-p 0.05) run the same
#: greedy decoding: sampler stages off, no penalties (``repetition_penalty`` is pagedkv's / vLLM's
#: name, ``repeat_penalty`` llama-server's; each server ignores the other's)
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "repeat_penalty": 1.0}


# ---- the client -------------------------------------------------------------------------------
@dataclass
class StreamRecord(RequestRecord):
    """A :class:`RequestRecord` that also counts the streamed chunks carrying text and the
    time of the last one (what a request cut mid-stream had produced by then)."""

    chunks: int = 0
    last_chunk_time: Optional[float] = None
    text: str = ""  # the streamed text, joined


async def _stream_one(client: Any, url: str, model: str, req: BenchRequest, rec: StreamRecord,
                      deadline: float) -> None:
    """Send ``req`` at ``rec.arrival_time`` as a streamed completion; fill ``rec``."""
    delay = rec.arrival_time - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.output_len,
            **SAMPLING, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
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
                    if ch.get("text"):
                        rec.text += ch["text"]
                        rec.chunks += 1
                        rec.last_chunk_time = time.time()
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
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not raised
        import httpx

        rec.status = "unfinished" if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)) else "error"


async def _replay(url: str, reqs: Sequence[BenchRequest], max_run_s: float, desc: str,
                  progress: bool) -> tuple[list[RequestRecord], RunStats]:
    import httpx
    from tqdm.auto import tqdm

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(reqs) + 4)) as client:
        model = await _model_id(client, url)
        stats = RunStats()
        start = time.time() + 0.05
        stats.started = start
        deadline = start + max((q.arrival_s for q in reqs), default=0.0) + max_run_s
        records = [StreamRecord(start + q.arrival_s, expected_tokens=q.output_len) for q in reqs]
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)

        async def one(q: BenchRequest, rec: RequestRecord) -> None:
            await _stream_one(client, url, model, q, rec, deadline)
            bar.update(1)

        tasks = [asyncio.create_task(one(q, rec)) for q, rec in zip(reqs, records)]
        _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.time(), 1.0) + 5.0)
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
            stats.preemptions = int(prom_value(m, "preemption") or 0)
        except Exception:  # noqa: BLE001 - metrics are a bonus
            pass
    return records, stats


async def _model_id(client: Any, url: str) -> str:
    r = await client.get(url + "/v1/models", timeout=10.0)
    return r.json()["data"][0]["id"]


async def _closed_loop(url: str, reqs: Sequence[BenchRequest], concurrency: int, max_run_s: float, desc: str,
                       progress: bool) -> tuple[list[StreamRecord], RunStats]:
    import httpx
    from tqdm.auto import tqdm

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        model = await _model_id(client, url)
        stats = RunStats()
        records = [StreamRecord(0.0, expected_tokens=q.output_len, status="not sent") for q in reqs]
        todo = iter(range(len(reqs)))
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)
        stats.started = time.time()
        deadline = stats.started + max_run_s

        async def stream() -> None:
            for i in todo:  # one iterator shared by the streams: each takes the next request
                if time.time() >= deadline:
                    return
                records[i].arrival_time = time.time()
                records[i].status = "pending"
                await _stream_one(client, url, model, reqs[i], records[i], deadline)
                bar.update(1)

        tasks = [asyncio.create_task(stream()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max_run_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        cut = [r for r in records if r.status == "pending"]
        for r in cut:
            r.status = "unfinished"
        if cut:
            stats.notes.append(f"cut at {max_run_s:.0f}s: {len(cut)} requests in flight")
        bar.close()
        stats.ended = time.time()
    return records, stats


def run_closed_loop(url: str, reqs: Sequence[BenchRequest], concurrency: int, max_run_s: float,
                    desc: str = "http", progress: bool = True) -> tuple[list[StreamRecord], RunStats]:
    """Closed-loop load: ``concurrency`` streams, each sending the next of ``reqs`` (streamed
    ``/v1/completions``, token-id prompt, greedy, ``ignore_eos``) as soon as its previous
    request finished, until all are done or ``max_run_s`` seconds have passed; then requests
    in flight are cut (status ``unfinished``, with the chunks they had streamed) and requests
    never sent keep status ``not sent``. ``arrival_time`` = when the request was sent."""
    return asyncio.run(_closed_loop(url, reqs, concurrency, max_run_s, desc, progress))


def replay(url: str, reqs: Sequence[BenchRequest], max_run_s: float, desc: str = "http",
           progress: bool = True) -> tuple[list[RequestRecord], RunStats]:
    """Send ``reqs`` to the server at ``url`` at their arrival offsets (seconds from now),
    streamed; requests still running ``max_run_s`` seconds after the last arrival are cut
    (status ``unfinished``). Preemptions are read from ``/metrics`` afterwards."""
    return asyncio.run(_replay(url, reqs, max_run_s, desc, progress))


def prom_value(text: str, needle: str) -> Optional[float]:
    """The first Prometheus sample whose metric name contains ``needle`` (labels ignored)."""
    for line in text.splitlines():
        if line.startswith("#") or needle not in line.split(" ")[0].split("{")[0]:
            continue
        try:
            return float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return None
