"""``tensor_parallel_size=2`` on the mixture-of-experts and multi-head latent attention families
against transformers 5.24 (fp32, eager), on the tiny seeded random-weight models of
``tests/model/test_families_moe.py`` (Qwen3-MoE, Mixtral), ``tests/model/test_deepseek.py``
(DeepSeek-V2 / V3: MLA + MoE with shared experts) and ``tests/model/test_mla.py`` (MiniCPM3: MLA,
dense).

Sharding (``pagedkv.distributed.parallel``): every rank holds all experts, each split along its
width (gate/up column-parallel, down row-parallel), the shared experts likewise, the router
replicated; MLA splits its heads and replicates the latent. Checked:

* the sliced shards: expert / shared-expert / dense widths per rank, the router and latent
  projections whole, and two ranks run in two threads (their all-reduce a sum in this
  process) give transformers' logits at every position over a chunked prefill and decode steps;
* two spawned ranks over gloo: greedy tokens == transformers' with chunked prefill, preemption,
  a prefix hit and ``n=2`` sampling equal to one device's, at block sizes 1 and 16; every rank's
  KV bytes per token == the planner's at ``tp_size=2`` (MLA: the whole latent on each rank);
* sizes that do not fit raise ``ConfigError`` naming the valid ones.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.distributed.parallel import build_shard_model, check_tp_size, shard_plan, valid_tp_sizes
from pagedkv.errors import ConfigError
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.model.loader import load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import NORM_NOISE, hf_greedy, hf_logits, match, save_tiny, seeded_model
from tests.model.builders import prompt as _prompt

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "minicpm3"]
NEW = 12


def _hf(kind: str):
    if kind in ("qwen3_moe", "mixtral"):
        from tests.model.builders import moe_config as _hf_config
    elif kind == "minicpm3":
        from tests.model.test_mla import _hf_config
    else:
        from tests.model.builders import deepseek_config as _hf_config
    return _hf_config(kind)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, transformers model, pagedkv LoadedModel): the family tests' weights, scaled as they
    scale them (non-trivial norms, large scores, decisive routers, a V3 bias that steers)."""
    return _build(request.param, tmp_path_factory.mktemp(request.param))


def _build(kind: str, out, **changes):
    cfg, cls = _hf(kind)
    for key, value in changes.items():
        setattr(cfg, key, value)
    cfg._experts_implementation = "eager"  # the reference loops over experts (any width)
    moe = kind in ("qwen3_moe", "mixtral")
    big = ("q_proj", "k_proj") if moe else ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
    rules = [NORM_NOISE, (match(has=big, ends=("embed_tokens.weight",)), "mul", 8.0 if moe else 3.0),
             (match(ends=("gate.weight",)), "mul", 20.0 if moe else 10.0)]  # routers
    hf = seeded_model(cfg, cls, rules)
    if kind == "deepseek_v3":
        with torch.no_grad():
            for layer in hf.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    save_tiny(hf, out)
    hf.generation_config.eos_token_id = None  # NEW tokens, as ignore_eos
    return kind, hf, load_model(out)


def test_shards_hold_split_experts_and_replicated_router_and_latent(family):
    kind, _, lm = family
    c = lm.config
    assert valid_tp_sizes(c) == [1, 2, 4]  # 4 heads; experts of width >= 32
    for rank in (0, 1):
        shard = shard_plan(c, rank, 2)
        net = build_shard_model(c, lm.model.state_dict(), shard, None)
        moe = [layer.mlp for layer in net.layers if layer.mlp is not None]
        if c.num_experts:
            half = c.moe_intermediate_size // 2
            assert shard.moe == (rank * half, (rank + 1) * half)
            assert moe and all(len(m.experts) == c.num_experts for m in moe)
            assert {tuple(e.gate_up_proj.weight.shape) for m in moe for e in m.experts} == {(2 * half, 64)}
            assert {tuple(e.down_proj.weight.shape) for m in moe for e in m.experts} == {(64, half)}
            assert all(m.router.weight.shape == (8, 64) for m in moe)
            if c.num_shared_experts:
                s = c.num_shared_experts * half
                assert all(m.shared.gate_up_proj.weight.shape == (2 * s, 64) for m in moe)
            full = lm.model.layers[-1].mlp
            torch.testing.assert_close(moe[-1].router.weight, full.router.weight, rtol=0, atol=0)
            up = full.experts[3].gate_up_proj.weight  # this rank's gate rows then the same up rows
            want = torch.cat([up[rank * half:(rank + 1) * half], up[c.moe_intermediate_size + rank * half:]
                              [:half]])
            torch.testing.assert_close(moe[-1].experts[3].gate_up_proj.weight, want, rtol=0, atol=0)
        else:
            assert not moe and shard.moe == (0, 0)
        if c.is_mla:
            a = net.layers[0].mla
            assert a.num_heads == 2 and a.kv_b_proj.weight.shape[0] == 2 * (c.qk_nope_head_dim + c.v_head_dim)
            torch.testing.assert_close(a.kv_a_proj_with_mqa.weight, lm.model.layers[0].mla.kv_a_proj_with_mqa.weight,
                                       rtol=0, atol=0)


def _thread_all_reduce(n: int):
    """In-process sum over ``n`` threads: each rank's call deposits its tensor, waits for all,
    adds them in rank order (the same bits on every rank) and copies the sum back."""
    slots: list = [None] * n
    barrier = threading.Barrier(n)

    def make(rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0].clone()
            for s in slots[1:]:
                total += s
            barrier.wait()
            t.copy_(total)

        return all_reduce

    return [make(r) for r in range(n)], barrier


def test_two_thread_ranks_give_transformers_logits(family):
    """Two shard models, one thread each, every row-parallel output summed over both: each
    rank's logits over a chunked prefill and three decode steps (16-token blocks, reversed
    physical order) equal transformers' at every position (1e-4)."""
    _, hf, lm = family
    _check_two_thread_ranks(hf, lm)


def test_uneven_expert_and_mlp_widths(tmp_path):
    """DeepSeek-V2 with experts of width 33 (2 shared: 66) and a dense MLP of 97: rank 0 holds
    17 / 34 / 49 columns, rank 1 16 / 32 / 48, and the two ranks still give transformers' logits."""
    _, hf, lm = _build("deepseek_v2", tmp_path, moe_intermediate_size=33, intermediate_size=97)
    shards = [shard_plan(lm.config, r, 2) for r in (0, 1)]
    assert [(s.moe, s.mlp) for s in shards] == [((0, 17), (0, 49)), ((17, 33), (49, 97))]
    net = build_shard_model(lm.config, lm.model.state_dict(), shards[1], None)
    assert net.layers[1].mlp.shared.down_proj.weight.shape == (64, 32)
    assert net.layers[1].mlp.experts[0].down_proj.weight.shape == (64, 16)
    assert net.layers[0].down_proj.weight.shape == (64, 48)
    _check_two_thread_ranks(hf, lm)


def _check_two_thread_ranks(hf, lm) -> None:
    ids = _prompt(30, 1)
    ref = hf_logits(hf, ids)
    backend = get_backend("cpu")
    reducers, barrier = _thread_all_reduce(2)
    results: list = [None, None]
    errors: list = []

    def run(rank: int) -> None:
        try:
            net = build_shard_model(lm.config, lm.model.state_dict(), shard_plan(lm.config, rank, 2), reducers[rank])
            caches = allocate_kv_caches(net, backend, num_blocks=4, block_size=16)
            got = []
            for start, end in ((0, 11), (11, 27), (27, 28), (28, 29), (29, 30)):
                md = AttentionMetadata.build([end], [end - start], [[3, 1]], 16)
                with torch.inference_mode():
                    got.append(net.compute_logits(net(torch.tensor(ids[start:end]), torch.arange(start, end),
                                                      caches, md, backend)))
            results[rank] = torch.cat(got)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()  # the other rank's pending all-reduce fails instead of waiting

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for got in results:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [1, 16])
def test_tp2_engine_greedy_equals_transformers(family, block, monkeypatch):
    """Two spawned ranks: 8-token prefill chunks, three requests in a pool of ~2 sequences'
    blocks (preemption), a fourth hitting the third's cached 16-token prefix, and ``n=2``
    sampling equal to one device's; every rank holds the planner's bytes per token."""
    kind, hf, lm = family
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    shared = _prompt(16, 7)
    prompts = [_prompt(30, 2), _prompt(22, 3), shared + _prompt(9, 4), shared + _prompt(7, 5)]
    refs = hf_greedy(hf, prompts, NEW)
    opts = dict(block_size=block, num_blocks=80 // block + 1, max_num_batched_tokens=8, enable_prefix_caching=True)
    tp = LLM(lm, tensor_parallel_size=2, **opts)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        outs = tp.generate(prompts[:3], params, use_tqdm=False)
        assert tp.engine.scheduler.stats.num_preemptions > 0
        outs += tp.generate(prompts[3:], params, use_tqdm=False)
        assert outs[3].num_cached_tokens >= 16 - block + 1
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert len({t for r in refs for t in r}) > 8  # not a few tokens repeated
        sp = SamplingParams(n=2, seed=7, temperature=0.8, max_tokens=8, ignore_eos=True)
        one = LLM(lm, **opts).generate(prompts[:1], sp, use_tqdm=False)[0]
        two = tp.generate(prompts[:1], sp, use_tqdm=False)[0]
        assert [c.token_ids for c in two.outputs] == [c.token_ids for c in one.outputs]
        assert tp.engine.kv.num_used_blocks == 0
        ranks = tp.engine.executor.query_workers()
        planned = KVCacheSpec.from_model_config(lm.config, "fp32", tp_size=2).bytes_per_token
        c = lm.config
        # MLA: the whole latent per layer on every rank; else each rank's one KV head of two
        per_layer = (c.kv_lora_rank + c.qk_rope_head_dim) * 4 if c.is_mla else 2 * 1 * c.head_dim * 4
        assert [r["kv_bytes_per_token"] for r in ranks] == [planned, planned] == [c.num_layers * per_layer] * 2
        half = c.moe_intermediate_size // 2
        assert [r["moe"] for r in ranks] == ([[0, half], [half, 2 * half]] if c.num_experts else [[0, 0], [0, 0]])
    finally:
        tp.engine.close()


def test_sizes_that_do_not_fit_raise_config_error(family):
    kind, _, lm = family
    c = lm.config
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 .*valid sizes: 1, 2, 4"):
        check_tp_size(c, 3)
    if c.num_experts:  # 8 ranks would leave the experts' columns thinner than the heads allow
        import dataclasses

        narrow = dataclasses.replace(c, moe_intermediate_size=1)
        assert valid_tp_sizes(narrow) == [1]
        with pytest.raises(ConfigError, match="experts of width 1"):
            check_tp_size(narrow, 2)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek_v2"])
def test_moe_and_mla_gguf_that_do_not_split_raise_config_error(arch, tmp_path):
    """A MoE or MLA GGUF loads only on its stored blocks (``weights="gguf"``), which tensor
    parallelism splits per rank (``tests/distributed/test_tp_gguf.py``) where every rank's columns
    are whole blocks. The tiny Qwen3-MoE's experts (32 wide: 16 columns per rank, half a Q8_0
    block) and an MLA file (its blocks are not split yet) are a ``ConfigError`` naming why,
    before any worker starts."""
    path = tmp_path / "tiny.gguf"
    if arch == "qwen3moe":
        from tests.model.builders import moe_gguf_model, write_moe_gguf

        write_moe_gguf(moe_gguf_model(arch), path, arch)
        why = "ffn_down_exps.weight is stored in Q8_0 blocks of 32 values"
    else:
        from tests.model.builders import deepseek_gguf_model, write_deepseek_gguf

        write_deepseek_gguf(deepseek_gguf_model(arch), path)
        why = "does not split a multi-head latent attention file's stored blocks"
    with pytest.raises(ConfigError, match=f"tensor_parallel_size 2: tiny.gguf loads on its stored blocks only .*{why}"):
        LLM(str(path), tensor_parallel_size=2, num_blocks=8, block_size=16)


def test_tp2_int8_latent_cache_equals_one_device(tmp_path, monkeypatch):
    """DeepSeek-V2 (MLA + MoE) with an int8 latent cache (codes + one bf16 scale per latent):
    two ranks' greedy tokens equal one device's with the same cache, and each rank holds the
    planner's 126 B/token (3 layers x (40 codes + 2 scale bytes))."""
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    _, _, lm = _build("deepseek_v2", tmp_path)
    prompts = [_prompt(30, 2), _prompt(22, 3)]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    opts = dict(block_size=16, num_blocks=16, kv_cache_dtype="int8", max_num_batched_tokens=8)
    one = LLM(lm, **opts).generate(prompts, sp, use_tqdm=False)
    tp = LLM(lm, tensor_parallel_size=2, **opts)
    try:
        two = tp.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        planned = KVCacheSpec.from_model_config(lm.config, "int8", tp_size=2).bytes_per_token
        assert [r["kv_bytes_per_token"] for r in tp.engine.executor.query_workers()] == [planned] * 2 == [126] * 2
    finally:
        tp.engine.close()
