"""Worker (pagedkv/worker/worker.py): loading with the engine's checks, caches of the asked
size and dtype, the executor calls, and ``make_executor`` for one process."""

from __future__ import annotations

import pytest
import torch

from pagedkv.distributed.executor import make_executor
from pagedkv.errors import ConfigError
from pagedkv.testing.tiny import tiny_random_model
from pagedkv.worker.worker import Worker, load_checked


@pytest.fixture(scope="module")
def tiny(loaded_model):
    return tiny_random_model(loaded_model, seed=4)


def test_worker_takes_a_loaded_model_and_builds_caches_of_the_asked_size(tiny):
    w = Worker.load(tiny, dtype=torch.float32, weights="auto", attention_backend="reference")
    assert w.loaded is tiny and w.model is tiny.model and w.tokenizer is tiny.tokenizer
    assert w.backend_name == "reference" and w.runner is None
    runner = w.init_cache(12, 4, "float32")
    assert w.runner is runner and len(runner.kv_caches) == 2  # one per layer
    c = runner.kv_caches[1]
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim) == (12, 4, 2, 16)
    assert c.key.dtype == c.value.dtype == torch.float32 and c.key_scale is None
    with pytest.raises(ConfigError, match="already allocated"):
        w.init_cache(12, 4, "float32")


def test_worker_builds_a_quantised_cache(tiny):
    w = Worker.load(tiny, dtype=torch.float32, attention_backend="reference")
    runner = w.init_cache(6, 4, "int8", quant_group_size=8)
    assert all(c.kv_cache_dtype == "int8" for c in runner.kv_caches)
    c = runner.kv_caches[1]
    assert c.num_blocks == 6 and c.key.dtype == torch.int8 and c.group_size == 8
    assert c.key_scale.dtype == torch.bfloat16 and c.key_scale.shape[-1] == 16 // 8


def test_a_loaded_model_of_another_dtype_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match=r"the loaded model is torch.float32; the engine dtype is torch.bfloat16"):
        load_checked(tiny, dtype=torch.bfloat16, device="cpu", weights="auto")


def test_a_loaded_model_with_other_weights_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="the loaded model has fp32 weights; the engine asks for int8"):
        load_checked(tiny, dtype=torch.float32, device="cpu", weights="int8")


def test_the_executor_calls_need_the_caches_and_go_to_the_runner(tiny):
    w = Worker.load(tiny, dtype=torch.float32, attention_backend="reference")
    with pytest.raises(ConfigError, match="no KV caches yet"):
        w.prepare([[1]], [0], [[0]], [True])
    ex = make_executor(w, tp_size=1, num_blocks=8, block_size=4, kv_cache_dtype="float32")
    assert ex is w and w.runner.kv_caches[0].num_blocks == 8
    seen = []
    real = w.runner.execute
    w.runner.execute = lambda inp: (seen.append(inp.input_ids.tolist()), real(inp))[1]  # the engine's tests patch so
    inp = ex.prepare([[5, 6, 7]], [0], [[2]], [True])
    assert inp.metadata.slot_mapping.tolist() == [8, 9, 10]
    logits = ex.execute(inp)
    assert seen == [[5, 6, 7]] and logits.shape == (1, tiny.config.vocab_size)
    ex.copy_blocks([(2, 5)])
    k, _ = w.backend.gather_kv(w.runner.kv_caches[0], torch.tensor([8, 9, 10, 20, 21, 22]))
    assert torch.equal(k[:3], k[3:])  # block 5 now holds block 2's K
    ex.close()
    ex.close()  # idempotent


def test_make_executor_refuses_compiled_steps_with_tensor_parallelism(tiny):
    w = Worker.load(tiny, dtype=torch.float32, attention_backend="reference")
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        make_executor(w, tp_size=2, num_blocks=8, block_size=4, kv_cache_dtype="float32", compile_max_rows=64)
