"""Tensor-parallel sharding without processes: valid sizes and the error naming them, the
per-rank KV heads against the planner (KVCacheSpec), shard shapes, the CLI flag, and the
sharded bundled model run by N threads (a barrier-based all-reduce) against the whole model,
for tp 3 (1 KV head per rank) and tp 9 (each KV head replicated on 3 ranks)."""

from __future__ import annotations

import argparse
import glob
import os
import threading

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.distributed.parallel import (
    build_shard_model,
    check_tp_size,
    shard_config,
    shard_plan,
    shard_state_dict,
    valid_tp_sizes,
)
from pagedkv.errors import ConfigError
from pagedkv.kv import KVCacheSpec
from pagedkv.model.config import ModelConfig
from pagedkv.testing.caches import allocate_kv_caches


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


def _config(heads: int, kv_heads: int, inter: int = 64, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=inter,
        num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=None,
        eos_token_ids=[0], model_id="tiny",
    )


def test_valid_sizes_and_the_error_names_them():
    smol = _config(9, 3, inter=1536)
    assert valid_tp_sizes(smol) == [1, 3, 9]
    check_tp_size(smol, 3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 .*valid sizes: 1, 3, 9"):
        check_tp_size(smol, 2)
    with pytest.raises(ConfigError, match="positive integer"):
        check_tp_size(smol, 0)
    llama3 = ModelConfig.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "eos_token_id": 128001}
    )
    assert valid_tp_sizes(llama3) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8), (8, 1), (12, 4), (4, 4)])
def test_shards_partition_heads_and_match_the_planner(heads, kv_heads):
    cfg = _config(heads, kv_heads, inter=50)
    for tp in valid_tp_sizes(cfg):
        shards = [shard_plan(cfg, r, tp) for r in range(tp)]
        spec = KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=8, dtype="fp32", tp_size=tp)
        # query heads and MLP columns: a partition in rank order
        assert [s.q_heads for s in shards] == [(r * heads // tp, (r + 1) * heads // tp) for r in range(tp)]
        assert shards[0].mlp[0] == 0 and shards[-1].mlp[1] == 50
        assert all(a.mlp[1] == b.mlp[0] for a, b in zip(shards, shards[1:]))
        for s in shards:
            assert s.num_kv_heads == spec.kv_heads_per_rank
            # each rank's query heads read only KV heads it holds (GQA group = heads // kv_heads)
            group = heads // kv_heads
            assert {q // group for q in range(*s.q_heads)} <= set(range(*s.kv_heads))
        held = [h for s in shards for h in range(*s.kv_heads)]
        assert sorted(set(held)) == list(range(kv_heads))
        assert len(held) == kv_heads * spec.replication


def test_shard_state_dict_shapes():
    cfg = _config(9, 3, inter=50, head_dim=4)
    h, d = cfg.hidden_size, cfg.head_dim
    state = {
        "embed_tokens.weight": torch.randn(32, h), "norm.weight": torch.randn(h),
        "layers.0.qkv_proj.weight": torch.randn((9 + 6) * d, h),
        "layers.0.qkv_proj.bias": torch.randn((9 + 6) * d),
        "layers.0.o_proj.weight": torch.randn(h, 9 * d),
        "layers.0.gate_up_proj.weight": torch.randn(100, h),
        "layers.0.down_proj.weight": torch.randn(h, 50),
        "layers.0.input_layernorm.weight": torch.randn(h),
    }
    s = shard_plan(cfg, 1, 3)
    out = shard_state_dict(cfg, state, s)
    assert out["embed_tokens.weight"] is state["embed_tokens.weight"]  # replicated, not copied
    qkv = state["layers.0.qkv_proj.weight"]
    assert torch.equal(out["layers.0.qkv_proj.weight"],
                       torch.cat([qkv[3 * d : 6 * d], qkv[(9 + 1) * d : (9 + 2) * d], qkv[(9 + 3 + 1) * d : (9 + 3 + 2) * d]]))
    assert out["layers.0.qkv_proj.bias"].shape == ((3 + 2) * d,)
    assert torch.equal(out["layers.0.o_proj.weight"], state["layers.0.o_proj.weight"][:, 3 * d : 6 * d])
    m0, m1 = s.mlp
    gu = state["layers.0.gate_up_proj.weight"]
    assert torch.equal(out["layers.0.gate_up_proj.weight"], torch.cat([gu[m0:m1], gu[50 + m0 : 50 + m1]]))
    assert torch.equal(out["layers.0.down_proj.weight"], state["layers.0.down_proj.weight"][:, m0:m1])
    local = shard_config(cfg, s)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, m1 - m0)


def test_cli_flag_reaches_the_engine_options():
    from pagedkv.engine.cli import add_engine_args, engine_kwargs
    from pagedkv.engine.engine import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--tensor-parallel-size", "3"]))["tensor_parallel_size"] == 3
    assert engine_kwargs(p.parse_args([]))["tensor_parallel_size"] == 1
    assert EngineConfig().tensor_parallel_size == 1


@pytest.mark.slow
def test_bad_size_refused_before_any_process_starts(loaded_model):
    from pagedkv import LLM

    before = _children()
    with pytest.raises(ConfigError, match="valid sizes: 1, 3, 9"):
        LLM(loaded_model, tensor_parallel_size=2, num_blocks=16)
    assert _children() == before


class _ThreadAllReduce:
    """N threads stand in for N ranks: a sum in rank order, the same on every rank."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for x in self.slots[1:]:
                total += x
            self.barrier.wait()
            t.copy_(total)

        return all_reduce


@pytest.mark.slow
@pytest.mark.parametrize("tp", [3, 9])
def test_sharded_model_in_threads_matches_the_whole_model(loaded_model, tp):
    """Prefill of 21 tokens then one decode step (block size 8, paged): the sum of the shards'
    row-parallel outputs gives the whole model's logits (up to fp32 summation order) and the
    same greedy tokens; each rank's cache holds only its KV heads."""
    cfg, full = loaded_model.config, loaded_model.model
    backend = get_backend("reference")  # plain torch: safe to call from several threads at once
    state = full.state_dict()
    group = _ThreadAllReduce(tp)
    shards = [shard_plan(cfg, r, tp) for r in range(tp)]
    models = [build_shard_model(cfg, state, s, group.for_rank(s.rank)) for s in shards]
    caches = [allocate_kv_caches(m, backend, 8, 8) for m in models]
    full_caches = allocate_kv_caches(full, backend, 8, 8)
    assert caches[0][0].num_kv_heads == 1 and full_caches[0].num_kv_heads == 3
    table = [[5, 2, 7, 0]]
    ids = torch.tensor([1, 504, 3458, 282, 9529, 314, 260, 3213, 282, 4224, 28, 216, 5, 28, 3458,
                        30, 1117, 314, 9529, 314, 260])

    def run(ids_t, pos_t, seq_len, q_len):
        outs: list = [None] * tp
        md = AttentionMetadata.build([seq_len], [q_len], table, 8)

        def work(r: int) -> None:
            rank_md = AttentionMetadata.build([seq_len], [q_len], table, 8)  # each rank builds its own
            with torch.inference_mode():
                outs[r] = models[r](ids_t, pos_t, caches[r], rank_md, backend)

        threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with torch.inference_mode():
            want = full.compute_logits(full(ids_t, pos_t, full_caches, md, backend)[-1:])
            got = models[0].compute_logits(outs[0][-1:])
        return got, want

    got, want = run(ids, torch.arange(21), 21, 21)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert got.argmax(-1).item() == want.argmax(-1).item()
    nxt = torch.tensor([int(want.argmax(-1))])
    got, want = run(nxt, torch.tensor([21]), 22, 1)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert got.argmax(-1).item() == want.argmax(-1).item()
