"""tensor_parallel_size 3 on the bundled model (9 heads, 3 KV heads: 3 query heads and 1 KV
head per rank), over gloo with two spawned workers, against size 1 with the same engine
options: greedy tokens with a pool small enough to preempt and prefix caching on, prefix hits,
n=2 seeded sampling (copy-on-write copies broadcast), the per-rank KV size the planner reports,
the same blocks on every rank (asked of the workers), and a close that leaves no process.

One tp-3 engine serves the whole module (start-up costs seconds); each scenario runs the same
requests on the size-1 engine in the same order, so both engines' prefix caches stay in step.
The prompts are a subset of the engine correctness prompts (same text, shorter outputs: every
step pays ~60 all-reduces, slow on a shared 2-core machine).
"""

from __future__ import annotations

import glob
import os

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.distributed import DistributedError
from pagedkv.kv import KVCacheSpec, check_invariants

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


TEXT = (
    "The history of computing is a story of memory. Early machines stored programs on punched "
    "cards and paper tape; later, magnetic cores and then semiconductor memory made random "
    "access cheap. Operating systems introduced virtual memory, splitting address spaces into "
    "fixed-size pages so that programs could use more memory than the machine physically had, "
    "and so that fragmentation would not waste what it did have."
)
# block size 4 and 40 blocks (160 tokens): the preemption batch below needs ~55 blocks
ENGINE = dict(block_size=4, num_blocks=40, enable_prefix_caching=True, max_num_batched_tokens=64,
              debug_invariants=True)


@pytest.fixture(scope="module")
def engines(loaded_model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_TP_THREADS", "1")
        mp.setenv("PAGEDKV_TP_TIMEOUT", "60")
        tp3 = LLM(loaded_model, tensor_parallel_size=3, **ENGINE)
    tp1 = LLM(loaded_model, **ENGINE)
    yield tp1, tp3
    tp3.engine.close()


@pytest.fixture(scope="module")
def base_ids(engines):
    return engines[0].engine.tokenize(TEXT)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    check_invariants(eng.kv)
    return outs


def _parent_pid(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_every_rank_holds_its_kv_heads_with_the_same_blocks(engines):
    tp1, tp3 = engines
    ex = tp3.engine.executor
    infos = ex.query_workers()  # asked now, over the step group
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype="fp32", tp_size=3)
    assert spec.bytes_per_token == 30 * 2 * 1 * 64 * 4  # one KV head per rank
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert [i["kv_heads"] for i in infos] == [[0, 1], [1, 2], [2, 3]]
    assert [i["q_heads"] for i in infos] == [[0, 3], [3, 6], [6, 9]]
    for i in infos:
        assert i["kv_bytes_per_token"] == spec.bytes_per_token
        assert i["num_blocks"] == tp3.engine.num_blocks == ENGINE["num_blocks"]
        assert i["block_size"] == ENGINE["block_size"]
    assert tp3.engine.kv_spec.bytes_per_token == spec.bytes_per_token
    assert tp1.engine.kv_spec.bytes_per_token == 3 * spec.bytes_per_token
    pids = [i["pid"] for i in infos]
    assert pids[0] == os.getpid() and len(set(pids)) == 3
    assert set(pids[1:]) == {p.pid for p in ex._procs.values()}
    assert all(_parent_pid(p) == os.getpid() for p in pids[1:])  # this driver's own children


def test_greedy_tokens_equal_with_preemption(engines, base_ids):
    tp1, tp3 = engines
    lens = [1, 15, 16, 17, 33, 47]
    prompts = [base_ids[i : i + n] for i, n in enumerate(lens)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pre1 = tp1.engine.scheduler.stats.num_preemptions
    pre3 = tp3.engine.scheduler.stats.num_preemptions
    want = _tokens(_run(tp1, prompts, params))
    got = _tokens(_run(tp3, prompts, params))
    assert got == want
    assert tp3.engine.scheduler.stats.num_preemptions > pre3  # the pool really was too small
    assert tp1.engine.scheduler.stats.num_preemptions > pre1


def test_greedy_tokens_equal_with_prefix_hits(engines, base_ids):
    tp1, tp3 = engines
    prefix = base_ids[:32]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    warm = [prefix + base_ids[40:42]]
    batch = [prefix + base_ids[50 + 3 * i : 53 + 3 * i] for i in range(3)]
    results = {}
    for name, llm in (("tp1", tp1), ("tp3", tp3)):
        a = _run(llm, warm, params)
        b = _run(llm, batch, params)
        results[name] = (_tokens(a + b), [o.num_cached_tokens for o in b])
    assert results["tp3"] == results["tp1"]
    assert all(n >= 32 for n in results["tp3"][1])  # the shared prefix came from the cache


def test_prompt_logprobs_equal(engines, base_ids):
    """prompt_logprobs through the tensor-parallel executor (the prompt rows' logits come back
    after the sampled rows; a 70-token prompt prefills in two chunks of <= 64)."""
    tp1, tp3 = engines
    prompt = base_ids[:70]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    (want,) = _run(tp1, [prompt], params)
    (got,) = _run(tp3, [prompt], params)
    assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == 70
    for j in range(1, 70):
        g, w = got.prompt_logprobs[j], want.prompt_logprobs[j]
        assert abs(g[prompt[j]] - w[prompt[j]]) < 1e-4 and 2 <= len(g) <= 3
    assert _tokens([got]) == _tokens([want])


def test_parallel_sampling_n2_equal_and_copy_on_write_broadcast(engines, base_ids):
    tp1, tp3 = engines
    prompts = [base_ids[:10], base_ids[20:33]]  # partial last blocks: the siblings' first writes copy them
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    want = _run(tp1, prompts, params)
    got = _run(tp3, prompts, params)
    assert _tokens(got) == _tokens(want)
    assert all(len(o.outputs) == 2 for o in got)
    assert sum(o.metrics.num_cow_copies for o in got) > 0


def test_close_leaves_no_process(engines):
    _, tp3 = engines
    import torch.distributed as dist

    pids = tp3.engine.executor.worker_pids
    tp3.engine.close()
    assert not set(pids) & _children()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="closed"):
        tp3.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
