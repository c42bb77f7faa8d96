"""One OpenMP pool per serving process: the thread that builds an engine gives its libgomp
helper threads back when the engine loop (which steps the engine in its own thread) is made.

Two pools on two cores make libgomp spin waiting threads only 100 turns before they sleep,
so every parallel op of a step wakes threads: served batch-1 inter-token latency p50 69-94 ms
against 23-26 ms with one pool (docs/performance.md, "One OpenMP pool"). The tests count the helper threads themselves
(Linux thread ids that are not Python threads), in fresh threads so no earlier test's pool is
involved."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from pagedkv.serving.engine_loop import EngineLoop
from pagedkv.utils import _loaded_libgomps, release_openmp_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task and libgomp: Linux")


def _tids() -> set[int]:
    """Thread ids of this process that are not Python threads (OpenMP helpers among them)."""
    return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}


def _gone(tids: set[int], timeout: float = 10.0) -> set[int]:
    """Thread ids of this process once ``tids`` have left it (or ``timeout`` seconds passed).

    libgomp's helper threads leave asynchronously: ``omp_pause_resource_all`` returns once they
    passed the pool's last barrier, and each then detaches and exits on its own (a busy 2-core
    CI host once listed the helper a moment after the release), so the tests wait for the exit
    instead of reading /proc/self/task at one instant."""
    deadline = time.monotonic() + timeout
    now = _tids()
    while tids & now and time.monotonic() < deadline:
        time.sleep(0.01)
        now = _tids()
    return now


def _parallel_op() -> None:
    # 1M elements: far above ATen's grain size (32,768), so the op runs as an OpenMP region
    torch.ones(1 << 20).exp_()


def _in_fresh_thread(fn):
    """Run ``fn`` in a new thread (no OpenMP pool yet) with 2 torch threads; its result."""
    box: dict = {}
    prev = torch.get_num_threads()
    torch.set_num_threads(2)

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised in the test
            box["err"] = e

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(120)
        assert not t.is_alive(), "the thread did not finish in 120 s"
    finally:
        torch.set_num_threads(prev)
    if "err" in box:
        raise box["err"]
    return box["out"]


def test_torch_runs_on_the_gnu_openmp_runtime():
    paths = _loaded_libgomps()
    assert paths and all(os.path.basename(p).startswith("libgomp") for p in paths)


def test_release_gives_back_the_helper_and_the_next_op_starts_a_new_one():
    def body():
        before = _tids()
        _parallel_op()
        helpers = _tids() - before
        released = release_openmp_pool()
        after_release = _gone(helpers)
        _parallel_op()
        again = _tids() - after_release
        release_openmp_pool()
        return helpers, released, after_release, again

    helpers, released, after_release, again = _in_fresh_thread(body)
    assert len(helpers) == 1  # 2 threads: the caller and one helper
    assert released is True
    assert not helpers & after_release  # the helper thread exited
    assert len(again) == 1 and not again & helpers  # a new pool, a new helper


def test_engine_loop_takes_the_pool_of_the_thread_that_made_it():
    def body():
        before = _tids()
        _parallel_op()  # "building the engine" in this thread
        helpers = _tids() - before
        loop = EngineLoop(engine=object())  # not started: only the constructor runs
        return helpers, _gone(helpers), loop.running

    helpers, after, running = _in_fresh_thread(body)
    assert len(helpers) == 1
    assert not helpers & after
    assert running is False


def test_build_app_takes_the_pool_of_the_thread_that_built_the_engine(loaded_model):
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.serving.app import build_app
    from pagedkv.testing.tiny import tiny_random_model

    def body():
        before = _tids()
        engine = LLMEngine(tiny_random_model(loaded_model), num_blocks=16, block_size=8)
        _parallel_op()  # a real model's load and warm-up run ops this large
        helpers = _tids() - before
        app = build_app(engine)
        return helpers, _gone(helpers), app.state.pagedkv.loop.running

    helpers, after, running = _in_fresh_thread(body)
    assert len(helpers) == 1
    assert not helpers & after
    assert running is False  # the loop's thread starts with the app (lifespan), not here
