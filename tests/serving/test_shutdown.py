"""Shutdown finishes or aborts in-flight requests cleanly (no block left, loop stopped), and
``pagedkv serve`` works end to end as a process (keys file, SIGINT)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import SamplingParams
from pagedkv.kv import check_invariants
from pagedkv.serving.app import build_app
from pagedkv.serving.engine_loop import EngineLoop, EngineStoppedError, PromptSpec
from pagedkv.serving.threaded import ThreadedServer


def _engine(loaded_model):
    return LLMEngine(loaded_model, num_blocks=64, block_size=16, max_model_len=256, enable_prefix_caching=True)


def _clean(engine):
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)


def test_graceful_shutdown_finishes_streams(loaded_model):
    engine = _engine(loaded_model)
    app = build_app(engine, served_model_name="smol", shutdown_timeout_s=30)
    srv = ThreadedServer(app, timeout_graceful_s=60)
    loop = app.state.pagedkv.loop
    body = {"model": "smol", "prompt": "Count slowly:", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, done = "", False
    with httpx.Client(base_url=srv.url, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        stopper = threading.Thread(target=srv.stop)
        stopper.start()  # shutdown begins while the stream is in flight
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        stopper.join(60)
    assert done, "the in-flight stream was finished, not cut"
    assert engine.get_stats().num_generated_tokens == 12
    assert not loop.running
    _clean(engine)
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.url + "/health", timeout=2)


def test_loop_shutdown_aborts_what_does_not_finish(loaded_model):
    engine = _engine(loaded_model)
    loop = EngineLoop(engine)
    loop.start()

    async def go():
        sub = await loop.submit(["long-0"], [PromptSpec("Once upon a time", SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True))], stream=True)
        outs = []
        stopper = None
        async for _, out in sub.outputs():  # ends with the aborted (finished) output
            outs.append(out)
            if stopper is None:  # after the first token: shut down with no grace
                stopper = asyncio.create_task(asyncio.to_thread(loop.shutdown, 0.0))
        res = await stopper
        return outs, res

    outs, res = asyncio.run(go())
    assert res["aborted"] == 1
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < 200
    assert not loop.running
    _clean(engine)
    with pytest.raises(EngineStoppedError):
        asyncio.run(loop.submit(["late"], [PromptSpec("x", SamplingParams(max_tokens=1))]))
    _clean(engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_cli_process(tmp_path, bundled_gguf, loaded_model):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a tenant-a\nsk-b tenant-b\n")
    port = _free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--num-blocks", "64",
         "--max-model-len", "256", "--enable-prefix-caching", "--api-keys", str(keys), "--threads", "1",
         "--served-model-name", "smol", "--log-level", "warning", "--open-route", "/metrics",
         "--header-timeout", "2", "--body-timeout", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer sk-a"}, timeout=120,
                       json={"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert "pagedkv_kv_blocks_used" in httpx.get(url + "/metrics").text  # opened by --open-route
        assert httpx.get(url + "/openapi.json").status_code == 401  # not opened
        with socket.create_connection(("127.0.0.1", port)) as s:  # --header-timeout reaches uvicorn
            s.sendall(b"GET /health HTTP/1.1\r\n")
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 408")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
