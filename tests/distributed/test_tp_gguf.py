"""``weights="gguf"`` under tensor parallelism (``pagedkv.model.gguf_shard``): each rank reads the
GGUF and keeps only its slices of the stored blocks (q/k/v rows of its heads and its MLP rows
whole; ``o_proj`` / ``down_proj`` columns as whole blocks), never the model in fp32.

Checked: every rank's matrices equal the one-device model's slices exactly and their bytes add
up to the file's; two ranks in threads give the one-device logits within the 8-bit activation
error (each rank quantises its own columns; the partial sums add in another order); two spawned
ranks on a path give the one-device greedy tokens through chunked prefill, preemption and a
prefix hit, and report the bytes they hold; a size whose columns are not whole blocks falls
back to fp32 under ``auto`` (and is refused for ``weights="gguf"``), with the reason.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.distributed.parallel import shard_state_dict
from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_header
from pagedkv.model import loader
from pagedkv.model.gguf_native import GGUFLinear, build_gguf_model, held_bytes, iter_linears
from pagedkv.model.tp_plan import shard_plan
from pagedkv.testing.caches import allocate_kv_caches
from tests.distributed.test_tp_moe_mla import _thread_all_reduce
from tests.model.builders import moe_gguf_model, write_moe_gguf
from tests.model.test_gguf_types import write_tiny_gguf


def _build(path, n: int = 1):
    """The one-device model of ``path`` and its ``n`` rank shards (in-process, no all-reduce)."""
    header = read_gguf_header(path)
    config = loader.gguf_config(path, header, "test")
    one, _ = build_gguf_model(path, header, config, progress=False)
    shards = [build_gguf_model(path, header, config, progress=False, shard=shard_plan(config, r, n))[0]
              for r in range(n)] if n > 1 else []
    return config, one, shards


def _dequantised(net) -> dict[str, torch.Tensor]:
    return {name + ".weight": m.dequantize() for name, m in net.named_modules() if isinstance(m, GGUFLinear)}


@pytest.mark.slow
def test_each_rank_keeps_exactly_its_slices_of_the_stored_blocks(bundled_gguf):
    """SmolLM2 (Q4_1 layers, Q8_0 tied head) over 3 ranks: each rank's 120 fused layer matrices
    dequantise to the one-device model's slices (``shard_state_dict``) bit for bit, they hold a
    third of the layers' stored bytes each, and the three add up to the file's; the head is
    replicated."""
    config, one, shards = _build(bundled_gguf, 3)
    full = _dequantised(one)
    layer_bytes = sum(m.packed.nbytes for m in iter_linears(one.layers))
    head = one.lm_head.packed.nbytes
    assert head == 49152 * 18 * 34
    per_rank = []
    for rank, net in enumerate(shards):
        shard = shard_plan(config, rank, 3)
        want, got = shard_state_dict(config, full, shard), _dequantised(net)
        assert sorted(got) == sorted(want) and len(got) == 30 * 4 + 1
        for name, w in want.items():
            assert torch.equal(got[name], w), name
        assert net.layers[0].qkv_proj.out_features == (3 + 1 + 1) * 64 and net.layers[0].o_proj.in_features == 192
        assert net.layers[0].gate_up_proj.out_features == 2 * 512 and net.layers[0].down_proj.in_features == 512
        assert net.lm_head.packed.nbytes == head
        per_rank.append(sum(m.packed.nbytes for m in iter_linears(net.layers)))
    assert per_rank == [layer_bytes // 3] * 3 and sum(per_rank) == layer_bytes
    floats = sum(p.numel() * 4 for p in one.parameters())
    assert [held_bytes(n) for n in shards] == [layer_bytes // 3 + head + floats] * 3


def _steps(net, ids: list[int]) -> torch.Tensor:
    """Logits of a 2-chunk prefill and three decode steps (16-token blocks 3 and 1)."""
    backend = get_backend("cpu")
    caches = allocate_kv_caches(net, backend, num_blocks=4, block_size=16)
    out = []
    for start, end in ((0, 11), (11, 27), (27, 28), (28, 29), (29, 30)):
        md = AttentionMetadata.build([end], [end - start], [[3, 1]], 16)
        with torch.inference_mode():
            out.append(net.compute_logits(net(torch.tensor(ids[start:end]), torch.arange(start, end), caches, md,
                                              backend)))
    return torch.cat(out)


def _thread_ranks(shards, ids: list[int]) -> list[torch.Tensor]:
    reducers, barrier = _thread_all_reduce(len(shards))
    results: list = [None] * len(shards)
    errors: list = []

    def run(rank: int) -> None:
        try:
            for layer in shards[rank].layers:
                layer.all_reduce = reducers[rank]
            results[rank] = _steps(shards[rank], ids)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_1", "moe"])
def test_two_thread_ranks_give_one_device_logits_within_the_activation_error(kind, tmp_path):
    """The tiny llama of ``test_gguf_types`` (every matrix in ``kind``) and a tiny Qwen3-MoE
    (Q8_0 experts 64 wide: 32 columns, one block, per rank): two ranks' logits over a chunked
    prefill and decode steps are the same on both ranks, within 4% of the one-device model's
    (measured 0.1-3%: 8-bit activation blocks, partial sums in another order), no further than
    it from the fp32 model, and pick the same greedy token at every position."""
    path = tmp_path / f"tiny-{kind}.gguf"
    if kind == "moe":
        write_moe_gguf(moe_gguf_model("qwen3moe", width=64), path, "qwen3moe")
    else:
        write_tiny_gguf(path, kind)
    config, one, shards = _build(path, 2)
    ids = [int(x) for x in torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(1))]
    ref = _steps(one, ids)
    got = _thread_ranks(shards, ids)
    assert torch.equal(got[0], got[1])
    rel = ((got[0] - ref).norm() / ref.norm()).item()
    assert rel <= 0.04, rel
    assert torch.equal(got[0].argmax(-1), ref.argmax(-1))
    if kind != "moe":  # a MoE GGUF has no fp32 load; the dense ones: no further from fp32 than one device
        fp32 = _steps(loader.load_model(path, weights="fp32", use_cache=False).model, ids)
        err_one, err_tp = (((x - fp32).norm() / fp32.norm()).item() for x in (ref, got[0]))
        assert err_tp <= 0.06 and err_tp <= err_one + 0.01, (err_tp, err_one)


def test_columns_that_are_not_whole_blocks_fall_back_or_are_refused(tmp_path):
    """Q4_K at 2 ranks: ``o_proj``'s 128 columns per rank are half a 256-value super-block, so
    ``auto`` keeps the fp32 values and says why, and ``weights="gguf"`` is a ``ConfigError``
    naming the tensor; Q4_0 (32-value blocks) splits. A MoE GGUF whose experts' columns do not
    split (Q8_0, 32 wide: 16 per rank) has no fp32 load: ``ConfigError`` before any worker starts."""
    k, q = tmp_path / "tiny-Q4_K.gguf", tmp_path / "tiny-Q4_0.gguf"
    write_tiny_gguf(k, "Q4_K")
    write_tiny_gguf(q, "Q4_0")
    fmt, why = loader.auto_weights(k, "fp32", "auto", tensor_parallel_size=2)
    assert fmt == "fp32" and "blk.0.attn_output.weight is stored in Q4_K blocks of 256 values" in why, why
    assert "columns 0..128" in why and "tensor_parallel_size 2" in why
    assert loader.auto_weights(k, "fp32", "auto")[0] == "gguf"
    fmt, why = loader.auto_weights(q, "fp32", "auto", tensor_parallel_size=2)
    assert fmt == "gguf" and "each of 2 ranks holding its slices" in why
    with pytest.raises(ConfigError, match="attn_output.weight is stored in Q4_K blocks of 256"):
        loader.load_model(k, weights="gguf", tensor_parallel_size=2, use_cache=False)
    moe = tmp_path / "moe32.gguf"
    write_moe_gguf(moe_gguf_model("qwen3moe"), moe, "qwen3moe")
    with pytest.raises(ConfigError, match="ffn_down_exps.weight is stored in Q8_0 blocks of 32 values, and rank 0 "
                                          "of 2 would keep its columns 0..16"):
        LLM(str(moe), tensor_parallel_size=2, num_blocks=8, block_size=16)


@pytest.mark.slow
def test_tp2_engine_on_a_gguf_path_keeps_stored_blocks_and_gives_one_device_tokens(tmp_path, monkeypatch):
    """Two spawned ranks on the tiny Q4_0 llama's path: the driver loads rank 0's slices only
    (``LoadedModel.shard``), each rank reports its ``gguf`` weights and the bytes it holds (the
    layers' blocks split in two, the head and norms on both); greedy tokens with 8-token prefill
    chunks, a pool small enough to preempt and a prefix hit equal one device's."""
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    path = tmp_path / "tiny-Q4_0.gguf"
    write_tiny_gguf(path, "Q4_0")
    gen = torch.Generator().manual_seed(3)
    shared = [int(x) for x in torch.randint(3, 250, (16,), generator=gen)]
    prompts = [[int(x) for x in torch.randint(3, 250, (n,), generator=gen)] for n in (30, 22)]
    prompts += [shared + [5, 6, 7, 8, 9], shared + [10, 11, 12]]
    opts = dict(block_size=4, num_blocks=24, max_num_batched_tokens=8, enable_prefix_caching=True,
                debug_invariants=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = LLM(str(path), **opts)
    refs = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    tp = LLM(str(path), tensor_parallel_size=2, **opts)
    try:
        loaded = tp.engine.loaded
        assert loaded.weights == "gguf" and loaded.shard is not None and loaded.shard.rank == 0
        assert "each of 2 ranks holding its slices" in loaded.weights_reason
        outs = tp.generate(prompts[:3], params, use_tqdm=False)
        assert tp.engine.scheduler.stats.num_preemptions > 0
        outs += tp.generate(prompts[3:], params, use_tqdm=False)
        assert outs[3].num_cached_tokens >= 16
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert len({t for r in refs for t in r}) > 8
        assert tp.engine.kv.num_used_blocks == 0
        ranks = tp.engine.executor.query_workers()
        full = one.engine.loaded.model
        layers = sum(m.packed.nbytes for m in iter_linears(full.layers))
        replicated = held_bytes(full) - layers
        assert [r["weights"] for r in ranks] == ["gguf", "gguf"]
        assert [r["weight_bytes"] for r in ranks] == [layers // 2 + replicated] * 2
    finally:
        tp.engine.close()


@pytest.mark.slow
def test_three_ranks_give_a_request_the_same_logprobs_alone_batched_and_chunked(monkeypatch):
    """SmolLM2 over 3 ranks (``auto``: the stored blocks): a prompt's first-token logprobs are
    the same bits alone, batched behind another prompt, and in 4-token prefill chunks. Every
    row-parallel sum adds the ranks' partials in rank order (``make_all_reduce``); gloo's ring
    added them in an order set by the buffer's length, which 8-bit activations turned into other
    tokens (a greedy pick flipped between ids 27 and 109)."""
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    gen = torch.Generator().manual_seed(7)
    first, second = ([int(x) for x in torch.randint(3, 250, (n,), generator=gen)] for n in (33, 22))
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    got = []
    for chunk in (None, 4):
        opts = {} if chunk is None else {"max_num_batched_tokens": chunk}
        llm = LLM(None, tensor_parallel_size=3, block_size=16, num_blocks=32, **opts)
        try:
            assert llm.engine.loaded.weights == "gguf"
            got.append(llm.generate([second], params, use_tqdm=False)[0].outputs[0].logprobs[0])
            got.append(llm.generate([first, second], params, use_tqdm=False)[1].outputs[0].logprobs[0])
        finally:
            llm.engine.close()
    assert all(g == got[0] for g in got[1:]), got


def test_a_stored_matrix_of_another_size_than_the_config_is_refused(tmp_path):
    """A GGUF whose ``attn_k`` holds 4 KV heads' rows where its header says 2 is a
    ``ConfigError`` naming the tensor at load (one device or a rank's shard), not rows of the
    wrong matrix sliced into a rank's ``qkv_proj`` (it generated tokens before)."""
    import gguf
    import numpy as np

    from tests.model import test_gguf_types as tiny

    path = tmp_path / "bad-k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tiny._add_header(w)
    rng = np.random.default_rng(0)
    for name, rows, cols, std in tiny._linears():  # the norms where write_tiny_gguf puts them
        norm = ("output_norm.weight" if name == "output.weight" else name.replace("attn_q", "attn_norm")
                if ".attn_q." in name else name.replace("ffn_gate", "ffn_norm") if ".ffn_gate." in name else None)
        if norm is not None:
            w.add_tensor(norm, np.ones(tiny.HIDDEN, np.float32))
        rows = 4 * tiny.HEAD_DIM if ".attn_k." in name else rows
        x = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = r"blk.0.attn_k.weight has shape \(256, 256\); the model's config \(4 heads, 2 KV heads of 64, hidden 256, MLP 512\) gives \(128, 256\)"
    with pytest.raises(ConfigError, match=want):
        loader.load_model(path, weights="gguf", use_cache=False)
    with pytest.raises(ConfigError, match=want):
        loader.load_model(path, weights="gguf", tensor_parallel_size=2, use_cache=False)

