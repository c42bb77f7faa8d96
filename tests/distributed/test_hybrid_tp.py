"""tensor_parallel_size 2 on a hybrid KV cache (tiny random Gemma-2: layers [window 6, full,
window 6], 2 KV heads, one per rank): the workers get every layer group's block tables and
slot mappings each step and hand each layer its group's; greedy tokens equal transformers'
while the window group frees blocks mid-request, and every rank reports the shared caches
(two per-layer tensors: the largest group's layer count)."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv import check_invariants
from tests.engine.test_hybrid_kv import BLOCK, NEW, gemma2, hf_greedy  # noqa: F401  (fixture)
from tests.model.test_families import _prompt, family  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("family", ["gemma2"], indirect=True)]


def test_tp2_hybrid_greedy_equals_transformers(gemma2, monkeypatch):  # noqa: F811
    hf, lm = gemma2
    prompts = [_prompt(37, 41), _prompt(29, 42)]
    refs = [hf_greedy(hf, p) for p in prompts]
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    llm = LLM(lm, tensor_parallel_size=2, block_size=BLOCK, num_blocks=48, max_num_batched_tokens=16,
              debug_invariants=True)
    try:
        eng = llm.engine
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert eng.kv.num_groups == 3 and eng.kv.stats.window_freed_blocks > 0
        infos = eng.executor.query_workers()
        assert [i["num_layers"] for i in infos] == [3, 3]
        assert [i["num_blocks"] for i in infos] == [48, 48]
        # 1 shared cache (three 1-layer groups) x 48 blocks x 4 tokens x K+V x 1 head x 16 dims x 4 bytes
        assert [i["kv_cache_bytes"] for i in infos] == [1 * 48 * 4 * 2 * 16 * 4] * 2
        assert eng.kv.num_used_blocks == 0
        check_invariants(eng.kv)
    finally:
        llm.engine.close()
