"""The multi-machine path on one machine: ranks 1 and 2 started by hand as
``python -m pagedkv.distributed.worker`` with torchrun-style variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK), the driver (rank 0) is this process with the same
variables. Greedy tokens equal size 1; closing the engine makes both workers exit 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pagedkv import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env_started_workers_match_size_one(loaded_model, monkeypatch, tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="3",
               PAGEDKV_TP_THREADS="1", PAGEDKV_TP_TIMEOUT="60", PAGEDKV_TP_STARTUP_TIMEOUT="120")
    procs, logs = [], []
    for rank in (1, 2):
        log = open(tmp_path / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pagedkv.distributed.worker"],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT,
        ))
    try:
        for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "PAGEDKV_TP_TIMEOUT", "PAGEDKV_TP_STARTUP_TIMEOUT"):
            monkeypatch.setenv(k, env[k])
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        tp3 = LLM(loaded_model, tensor_parallel_size=3, block_size=8, num_blocks=32)
        assert tp3.engine.executor.worker_pids == [p.pid for p in procs]
        prompts = [[1, 504, 3458, 282, 9529], [1, 504, 3458, 282, 9529, 314, 260, 3213, 282]]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = [o.token_ids for o in tp3.generate(prompts, params, use_tqdm=False)]
        tp3.engine.close()
        for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "WORLD_SIZE"):
            monkeypatch.delenv(k)
        want = [o.token_ids for o in LLM(loaded_model, block_size=8, num_blocks=32).generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert [p.wait(timeout=30) for p in procs] == [0, 0], [(tmp_path / f"rank{r}.log").read_text() for r in (1, 2)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
