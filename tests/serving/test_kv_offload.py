"""``pagedkv serve --kv-offload disk:...`` across restarts and crashes.

1. A graceful stop (SIGINT) persists the cached blocks; the next ``serve`` serves the same
   prompt's prefix from disk (usage and /metrics show it).
2. ``kill -9`` while requests run and the copy thread writes: the store reopens, every entry
   that could ever be served (its whole chain is on disk) holds the K/V recomputation gives
   (or fails verification: a miss), and an engine serving from it gives the outputs of a
   cold run with a clean pool invariant checker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.kv import check_invariants
from pagedkv.utils import free_port

BS = 4
P = [(13 * j + 7) % 5000 + 300 for j in range(41)]  # 10 full blocks looked up
BLOCK = 184_320  # bytes of one block's K/V (SmolLM2, fp32, 4 tokens)
QS = [[(i * 997 + 13 * j) % 5000 + 300 for j in range(61)] for i in range(1, 25)]


def serve(port: int, path) -> subprocess.Popen:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--block-size", str(BS),
         "--num-blocks", "24", "--max-model-len", "256", "--max-num-seqs", "4", "--threads", "1",
         "--kv-offload", f"disk:{path}:32MiB", "--weights", "fp32", "--log-level", "warning", "--served-model-name", "x"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.3)


def complete(port: int, prompt: list[int]) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                   json={"model": "x", "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def metric(port: int, name: str, label: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m = re.search(rf'^{name}{{[^}}]*{label}[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_serve_restart_and_kill_9_mid_write(tmp_path, loaded_model):
    path = tmp_path / "kv"
    port = free_port()
    proc = serve(port, path)
    try:
        first = complete(port, P)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out

    proc = serve(port, path)  # 1. a restart finds the previous run's blocks
    try:
        again = complete(port, P)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert metric(port, "pagedkv_kv_tier_hit_tokens_total", 'tier="disk"') == 40
        ui = httpx.get(f"http://127.0.0.1:{port}/ui/state", timeout=10).json()["stats"]
        assert ui["kv_tiers"]["tiers"]["disk"]["hit_tokens"] == 40 and ui["kv_pool_hit_tokens"] == 0
        # 2. many prompts through a 24-block pool: evictions keep the copy thread writing
        threads = [threading.Thread(target=lambda q=q: _swallow(complete, port, q)) for q in QS]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        # kill once writes have committed and ~60 more blocks went to the copy thread,
        # with most requests still running: the crash lands among disk writes
        while (metric(port, "pagedkv_kv_transfer_seconds_total", 'kind="disk_write"') == 0
               or metric(port, "pagedkv_kv_transfer_bytes_total", 'direction="pool->disk"') < 60 * BLOCK):
            assert time.monotonic() < deadline and proc.poll() is None, "no disk writes"
            time.sleep(0.05)
        running = sum(t.is_alive() for t in threads)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert running >= 4, "the requests finished before the kill"
    for t in threads:
        t.join(timeout=60)

    llm = LLM(loaded_model, block_size=BS, num_blocks=24, max_model_len=256, debug_invariants=True,
              kv_offload=[f"disk:{path}:32MiB"])  # the store opens
    disk, index = llm.engine.kv_stores.disk(), llm.engine.kv.tiers.indexes[-1]
    entries = {e.block_hash: e for e in index}
    assert len(entries) >= 10
    cold = LLM(loaded_model, block_size=BS, num_blocks=96, max_model_len=256, enable_prefix_caching=True)
    codec = cold.engine.runner.kv_payload_codec()
    parents = {e.parent_hash for e in entries.values()}
    checked = 0
    for leaf in [e for h, e in entries.items() if h not in parents]:
        chain = _chain(leaf, entries)
        if chain is None:
            continue  # an ancestor is gone: a lookup can never reach this entry
        tokens = [t for e in chain for t in np.frombuffer(e.token_bytes, dtype="<i8").tolist()]
        cold.generate([tokens + [1]], SamplingParams(max_tokens=1), use_tqdm=False)
        ids = [cold.engine.kv.pool.cached[e.block_hash].block_id for e in chain]
        computed = torch.from_numpy(codec.export(ids)[0].copy()).view(torch.float32)
        for e, want in zip(chain, computed):
            stored = disk.get(e)
            if stored is not None:  # None: fails verification, a miss
                got = torch.from_numpy(stored.copy()).view(torch.float32)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked > 10  # P's 10 blocks and whole chains written before the kill

    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    served = [P] + [q for q in QS if _first_hash_on_disk(llm, q, entries)][:2]
    assert len(served) == 3
    outs = llm.generate(served, sp, use_tqdm=False)
    want = cold.generate(served, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert all(o.num_cached_tokens_by_tier.get("disk", 0) > 0 for o in outs)
    check_invariants(llm.engine.kv)
    llm.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except (httpx.HTTPError, AssertionError):
        pass  # the server is killed under it


def _chain(leaf, entries):
    chain = [leaf]
    while chain[0].parent_hash is not None:
        parent = entries.get(chain[0].parent_hash)
        if parent is None:
            return None
        chain.insert(0, parent)
    return chain


def _first_hash_on_disk(llm, tokens, entries) -> bool:
    from pagedkv.kv import CacheKeys, hash_blocks

    keys = CacheKeys(model_id=llm.engine.model_id, revision=llm.engine.revision, kv_cache_dtype=llm.engine.kv_format_id)
    return hash_blocks(tokens[:BS], BS, keys)[0] in entries
