"""Real clients against a ``pagedkv serve`` process the fixture starts and stops."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

# the clients' data come from tests/clients/data: no hub access (set before datasets loads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")
def serve_url(bundled_gguf):
    """``http://127.0.0.1:PORT`` of a ``pagedkv serve`` (bundled model, fp32 weights, model name
    "smol", prefix caching on), stopped (SIGTERM, then killed) after the package's tests."""
    port = _free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--weights", "fp32", "--num-blocks", "256",
         "--max-model-len", "1024", "--enable-prefix-caching", "--threads", "1",
         "--served-model-name", "smol", "--log-level", "warning"],
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None
