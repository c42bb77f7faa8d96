"""Faults under tensor parallelism (bundled model, tp 3, gloo): a worker killed during
generation, or one that hangs (SIGSTOP), ends the engine with a DistributedError within a
bounded time, and no worker process is left (reaped: ``os.kill(pid, 0)`` fails)."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from pagedkv import LLM, SamplingParams
from pagedkv.distributed import DistributedError

pytestmark = pytest.mark.slow

def _children() -> set[int]:
    """PIDs of this process's live child processes (from /proc)."""
    kids = set()
    for st in glob.glob("/proc/[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in open(st) if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0").strip() or 0) == os.getpid() and not fields.get("State", "").startswith("Z"):
            kids.add(int(fields["Pid"].strip()))
    return kids


BOUND_S = 30.0


def _engine(loaded_model, monkeypatch, timeout_s: int):
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", str(timeout_s))
    return LLM(loaded_model, tensor_parallel_size=3, block_size=16, num_blocks=32)


def _assert_no_process_left(pids):
    assert not set(pids) & _children()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not dist.is_initialized()


def _step_until_error(eng) -> DistributedError:
    deadline = time.monotonic() + 2 * BOUND_S
    while time.monotonic() < deadline:
        try:
            eng.step()
        except DistributedError as e:
            return e
    pytest.fail("the engine kept stepping after a worker failed")


def test_killed_worker_ends_generation_with_an_error(loaded_model, monkeypatch):
    """Killed while requests are running (the kill lands from another thread, mid-step or
    between steps): the error names the rank and the signal; detection does not wait for the
    60 s collective timeout."""
    llm = _engine(loaded_model, monkeypatch, timeout_s=60)
    eng = llm.engine
    pids = eng.executor.worker_pids
    try:
        for i in range(2):
            eng.add_request(f"r{i}", [1, 504, 3458, 282, 9529, 314 + i], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(3):
            eng.step()
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(0.3)
            killed_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)  # rank 2

        threading.Thread(target=kill).start()
        err = _step_until_error(eng)
        elapsed = time.monotonic() - killed_at[0]
        print(f"kill -> error in {elapsed:.2f}s: {err}")
        assert elapsed < BOUND_S, elapsed
        assert "rank 2" in str(err) and "SIGKILL" in str(err), str(err)
        _assert_no_process_left(pids)
        with pytest.raises(DistributedError, match="rank 2"):  # the engine stays failed
            eng.step()
    finally:
        eng.close()
    _assert_no_process_left(pids)


def test_hung_worker_times_out(loaded_model, monkeypatch):
    """A stopped worker (alive, never answering): the step's collective times out after
    PAGEDKV_TP_TIMEOUT (4 s here) and the engine raises; the stopped process is killed too."""
    llm = _engine(loaded_model, monkeypatch, timeout_s=4)
    eng = llm.engine
    pids = eng.executor.worker_pids
    try:
        eng.add_request("r", [1, 504, 3458, 282], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        os.kill(pids[0], signal.SIGSTOP)  # rank 1
        t0 = time.monotonic()
        err = _step_until_error(eng)
        elapsed = time.monotonic() - t0
        print(f"SIGSTOP -> error in {elapsed:.2f}s: {err}")
        assert 3.0 < elapsed < BOUND_S, elapsed
        # Either the driver's own collective times out first, or the other worker's does and
        # it exits (the watchdog reports that): both end the engine in bounded time.
        assert "timeout 4s" in str(err) or "exited with code" in str(err), str(err)
        _assert_no_process_left(pids)
    finally:
        for pid in pids:  # never leave a stopped process behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        eng.close()
