"""``pagedkv.attention.prefault``: the background population of a CPU KV cache's pages: every
page resident afterwards, contents never changed (also under concurrent writes), stoppable,
and an engine's tokens the same with it on and off."""

from __future__ import annotations

import ctypes
import errno
import platform
import threading

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import layouts, prefault
from pagedkv.attention.prefault import KVPrefault

pytestmark = pytest.mark.skipif(not platform.system() == "Linux", reason="madvise(MADV_POPULATE_WRITE) is Linux's")
_KERNEL = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) whole pages inside ``t``'s memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    lo = (t.data_ptr() + page - 1) // page * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    n = (hi - lo) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), n


def _caches(num_blocks: int, dtype="float32", layers: int = 3):
    layout = layouts.get_layout("nhd")
    return [layouts.allocate(layout, num_blocks, 16, 4, 64, dtype) for _ in range(layers)]


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_every_page_of_every_layer_becomes_resident_and_stays_zero():
    # 2176 blocks of 16 KiB: 34 MiB per tensor, above glibc's largest mmap threshold (32 MiB), so
    # calloc maps fresh zero pages whatever this process freed before (a smaller block may be
    # carved from the heap once the threshold has grown, and calloc then clears it: resident)
    caches = _caches(2176, layers=1)
    tensors = prefault.cache_tensors(caches)
    assert len(tensors) == 2
    assert all(_resident_pages(t)[0] < _resident_pages(t)[1] // 2 for t in tensors)  # lazily zeroed
    p = KVPrefault(tensors, 2176, chunk_bytes=1 << 20).start()
    assert p.chunk_blocks == (1 << 20) // (2 * 16 * 4 * 64 * 4)  # 32 blocks of 32 KiB a chunk
    assert p.wait(30)
    assert p.error is None and p.blocks_done == 2176
    assert p.nice == prefault.NICE == 19  # it yields the cores to a step's threads
    for t in tensors:
        resident, total = _resident_pages(t)
        assert resident == total
        assert int(torch.count_nonzero(t)) == 0


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_writes_during_the_prefault_are_kept():
    caches = _caches(1024, layers=2)  # 8 MiB per tensor
    tensors = prefault.cache_tensors(caches)
    g = torch.Generator().manual_seed(0)
    want = {}
    p = KVPrefault(tensors, 1024, chunk_bytes=256 << 10).start()  # 8 blocks a chunk: many calls
    for i in range(200):  # blocks ahead of, at and behind the populated front
        b = int(torch.randint(0, 1024, (1,), generator=g))
        t = tensors[i % len(tensors)]
        t[b] = torch.randn(t.shape[1:], generator=g)
        want[(i % len(tensors), b)] = t[b].clone()
    assert p.wait(30) and p.error is None and p.blocks_done == 1024
    for (j, b), v in want.items():
        assert torch.equal(tensors[j][b], v)
    written = {(j, b) for j, b in want}
    for j, t in enumerate(tensors):
        untouched = [b for b in range(1024) if (j, b) not in written]
        assert int(torch.count_nonzero(t[untouched])) == 0


def test_quantised_caches_give_their_scales_too_and_bad_tensors_are_refused():
    caches = _caches(64, dtype="int8", layers=1)
    tensors = prefault.cache_tensors(caches)
    assert [t.dtype for t in tensors] == [torch.int8, torch.int8, torch.bfloat16, torch.bfloat16]
    with pytest.raises(ValueError, match="num_blocks=65"):
        KVPrefault(tensors, 65)
    with pytest.raises(ValueError, match="contiguous"):
        KVPrefault([torch.zeros(64, 8).t().contiguous().t()], 64)


def test_stop_ends_the_thread_at_a_chunk_boundary():
    caches = _caches(2048, layers=2)
    tensors = prefault.cache_tensors(caches)
    p = KVPrefault(tensors, 2048, chunk_bytes=1)  # one block a chunk
    assert p.chunk_blocks == 1
    gate = threading.Event()
    real_run = p._run
    p._run = lambda: (gate.wait(10), real_run())  # type: ignore[method-assign]
    p.start()
    p._stop.set()
    gate.set()
    p.stop(10)
    assert not p._thread.is_alive()
    assert p.blocks_done == 0  # stopped before its first chunk


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_stop_all_at_exit_ends_every_started_thread():
    """``stop_all`` (registered with ``atexit``) stops every running prefault at its next
    chunk, so no daemon thread is inside ``madvise`` while the interpreter tears down."""
    caches = _caches(2048, layers=2)
    ps = [KVPrefault(prefault.cache_tensors(caches), 2048, chunk_bytes=1) for _ in range(2)]
    gate = threading.Event()
    for p in ps:
        real_run = p._run
        p._run = lambda run=real_run: (gate.wait(10), run())  # type: ignore[method-assign]
        p.start()
    assert set(ps) <= set(prefault._LIVE)
    gate.set()
    prefault.stop_all(10)
    assert not any(p._thread.is_alive() for p in ps)


def test_a_dropped_cache_is_neither_kept_alive_nor_populated():
    caches = _caches(2048, layers=2)
    tensors = prefault.cache_tensors(caches, 2048)
    p = KVPrefault(tensors, 2048, chunk_bytes=1)  # one block a chunk
    gate = threading.Event()
    real_run = p._run
    p._run = lambda: (gate.wait(10), real_run())  # type: ignore[method-assign]
    p.start()
    del caches, tensors  # the owner drops its cache before the first chunk
    assert p.tensors == []
    gate.set()
    assert p.wait(10)
    assert p.dropped and p.blocks_done == 0 and p.error is None


def test_tensors_of_another_shape_are_left_out():
    caches = _caches(64, layers=1)
    assert len(prefault.cache_tensors(caches, 64)) == 2
    assert prefault.cache_tensors(caches, 65) == []


def test_an_unsupported_advice_stops_with_its_errno(monkeypatch):
    monkeypatch.setattr(prefault, "MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    caches = _caches(64, layers=1)
    p = KVPrefault(prefault.cache_tensors(caches), 64).start()
    assert p.wait(10)
    assert p.error == errno.EINVAL and p.blocks_done == 0
    assert int(torch.count_nonzero(caches[0].key)) == 0


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_an_engine_prefaults_its_caches_and_generates_the_same_tokens(loaded_model, monkeypatch):
    prompts = [[1, 504, 3458, 314, 253, 1345], [1, 330, 2476, 282, 4219]]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("PAGEDKV_KV_PREFAULT", "0")
    off = LLM(loaded_model, block_size=16, num_blocks=96, max_model_len=256)
    assert off.engine.executor.runner.prefault is None
    want = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.close()
    monkeypatch.setenv("PAGEDKV_KV_PREFAULT", "1")
    on = LLM(loaded_model, block_size=16, num_blocks=96, max_model_len=256)
    runner = on.engine.executor.runner
    p = runner.prefault
    assert p is not None and len(p.tensors) == 2 * loaded_model.config.num_layers
    got = [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert p.wait(60) and p.error is None and p.blocks_done == 96
    assert all(r == n for r, n in map(_resident_pages, p.tensors))
    on.close()
    assert not p._thread.is_alive()


@pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_draft_models_caches_are_prefaulted_and_stopped_with_the_engine(loaded_model, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KV_PREFAULT", "1")
    llm = LLM(loaded_model, block_size=16, num_blocks=48, max_model_len=256, speculative="draft:smollm2",
              draft_weights="fp32")
    target = llm.engine.executor.runner.prefault
    draft = llm.engine.proposer.worker.runner.prefault
    assert target is not None and draft is not None and draft is not target
    assert draft.num_blocks == target.num_blocks == 48
    assert draft.wait(60) and draft.blocks_done == 48
    assert not draft._stop.is_set() and not target._stop.is_set()
    llm.close()  # reaches both threads: the target's runner and, through the proposer, the draft's
    assert draft._stop.is_set() and target._stop.is_set()
    assert not target._thread.is_alive() and not draft._thread.is_alive()
