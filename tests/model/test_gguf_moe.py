"""A mixture-of-experts GGUF (``qwen3moe``) on its stored blocks (``weights="gguf"``).

A tiny Qwen3-MoE (3 layers, 8 experts, 2 per token; llama.cpp's qwen3moe has no dense layers) built with
transformers is written to a GGUF as llama.cpp's ``convert_hf_to_gguf.py`` writes that
architecture: the experts stacked per layer (``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``,
``ffn_down_exps`` ``[E, H, I]``), names from the ``gguf`` package's tensor map, the router
(``ffn_gate_inp``) and norms F32, every other matrix Q8_0, the expert counts as
``{arch}.expert_*`` metadata. The transformers model then gets the file's dequantised values,
so both sides hold the same weights (model and writer: ``tests/model/builders.py``, ``moe_gguf_model``
and ``write_moe_gguf``). Checked: the config, that each expert is a ``GGUFLinear``
holding exactly its stored bytes, the logits against transformers' (within the Q8 activations'
error: the kernels quantise activations to int8 blocks), the engine's greedy tokens equal
``generate``'s, that a decode step multiplies only the routed experts, and that the formats
that would dequantise the file are a ``ConfigError``.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.model.gguf_native import GGUFLinear
from pagedkv.model.loader import load_config, load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import (
    E, I_EXP, K, chunked_logits, hf_logits, margin_prompts, moe_gguf_model, prompt, write_moe_gguf,
)


@pytest.fixture(scope="module", params=["qwen3moe", "llama"])
def case(request, tmp_path_factory):
    arch = request.param
    hf = moe_gguf_model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}-moe.gguf"
    write_moe_gguf(hf, path, arch)
    return hf, path, load_model(path, weights="auto")


def test_config_and_experts_hold_their_stored_blocks(case):
    from pagedkv.gguf_header import read_gguf_header

    hf, path, lm = case
    c = lm.config
    qwen = c.architecture == "qwen3_moe"
    assert c.architecture in ("qwen3_moe", "llama")
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (E, K, I_EXP)
    assert (c.moe_layers, c.norm_topk_prob, c.qk_norm) == (None, True, qwen)
    assert load_config(path) == c
    assert lm.weights == "gguf"
    names = {t.name: t for t in read_gguf_header(path).tensors}
    assert tuple(names["blk.0.ffn_gate_exps.weight"].shape) == (E, I_EXP, 64)
    assert tuple(names["blk.2.ffn_down_exps.weight"].shape) == (E, 64, I_EXP)
    for i in (0, 1, 2):
        mlp = lm.model.layers[i].mlp
        assert type(mlp.router) is torch.nn.Linear and tuple(mlp.router.weight.shape) == (E, 64)
        for e in range(E):
            gu, down = mlp.experts[e].gate_up_proj, mlp.experts[e].down_proj
            assert isinstance(gu, GGUFLinear) and isinstance(down, GGUFLinear)
            assert gu.types == ("Q8_0", "Q8_0") and down.types == ("Q8_0",)
            # the stored bytes of its rows: 2 x 32 rows (gate, up) of 64 values, 32 + 2 bytes per 32 values
            assert gu.packed.nbytes == 2 * I_EXP * (64 // 32) * 34 and down.packed.nbytes == 64 * (I_EXP // 32) * 34
            ref = torch.cat([hf.model.layers[i].mlp.experts.gate_up_proj[e]])
            torch.testing.assert_close(gu.dequantize(), ref, rtol=0, atol=1e-6)
            torch.testing.assert_close(down.dequantize(), hf.model.layers[i].mlp.experts.down_proj[e], rtol=0, atol=1e-6)


def test_logits_close_and_greedy_tokens_equal_transformers(case):
    hf, _, lm = case
    ids = prompt(30, 1, 0, 256)
    ref = hf_logits(hf, ids)
    got = chunked_logits(lm.model, ids, 16, get_backend("cpu"), chunks=((0, 13), (13, 29), (29, 30)), table=[2, 0],
                         num_blocks=4)
    err = (got - ref).abs().max().item()
    assert err < 0.02 * ref.abs().max().item()  # int8 activation blocks, not the weights, differ
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the first two prompts (of 20 seeded ones) whose greedy path in transformers keeps the top two
    # logits > 0.15 apart at every step: the int8 activation blocks move logits by ~0.02, so a
    # nearer tie (common in a random 260-token model) could flip either way. Chosen on
    # transformers' side alone.
    hf.generation_config.eos_token_id = None  # both sides run all 16 tokens (ignore_eos)
    prompts, refs = margin_prompts(hf, new=16, margin=0.15)
    assert len(prompts) == 2
    llm = LLM(lm, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_a_decode_step_multiplies_only_the_routed_experts(case):
    _, _, lm = case
    net = lm.model
    calls: list[tuple[int, int]] = []
    routed: dict[int, list[int]] = {}
    handles = []
    for i in (0, 1, 2):
        mlp = net.layers[i].mlp
        handles.append(mlp.register_forward_pre_hook(
            lambda m, args, i=i: routed.__setitem__(i, sorted(m.route(args[0])[1].flatten().tolist()))))
        for e, expert in enumerate(mlp.experts):
            for lin in (expert.gate_up_proj, expert.down_proj):
                handles.append(lin.register_forward_hook(lambda m, inp, out, i=i, e=e: calls.append((i, e))))
    backend = get_backend("cpu")
    caches = allocate_kv_caches(net, backend, num_blocks=2, block_size=16)
    net.prepare_step()  # now, not at the first forward below (it would set the native step again)
    saved, net._native = net._native, None  # the torch ops, whose modules the hooks see (native: test_native_qk_moe)
    try:
        with torch.inference_mode():
            net(torch.arange(5, 14), torch.arange(9), caches, AttentionMetadata.build([9], [9], [[0]], 16), backend)
            calls.clear()
            net(torch.tensor([77]), torch.tensor([9]), caches, AttentionMetadata.build([10], [1], [[0]], 16), backend)
    finally:
        net._native = saved
        for h in handles:
            h.remove()
    for i in (0, 1, 2):
        got = sorted(e for j, e in calls if j == i)
        assert got == sorted(routed[i] * 2) and len(set(got)) == K  # gate_up and down of each routed expert


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_dequantising_formats_are_refused(case, weights):
    _, path, _ = case
    with pytest.raises(ConfigError, match="weights='gguf'"):
        load_model(path, weights=weights)


def test_lazy_experts_read_only_the_experts_a_token_is_routed_to(case):
    """``lazy_experts=True`` (``PAGEDKV_LAZY_EXPERTS=1``): the load reads every tensor but the
    stacked experts; a one-token step then reads and packs exactly each layer's ``k`` routed
    experts (their stored bytes), and computes what the eagerly loaded model computes."""
    from pagedkv.gguf_header import read_gguf_header
    from pagedkv.model.gguf_moe import LazyExpertLinear
    from pagedkv.model.gguf_native import build_gguf_model, held_bytes
    from pagedkv.model.gguf_read import stored_bytes

    _, path, lm = case
    header = read_gguf_header(path)
    net, report = build_gguf_model(path, header, lm.config, progress=False, lazy_experts=True)
    experts = sum(stored_bytes(t) for t in header.tensors if t.name.endswith("_exps.weight"))
    _, eager = build_gguf_model(path, header, lm.config, progress=False)  # no packed store: every tensor read
    assert eager.bytes_read - report.bytes_read == experts  # (3 layers x 3 x 8 x 32 x 64 values as Q8_0)
    lazies = [m for m in net.modules() if isinstance(m, LazyExpertLinear)]
    assert len(lazies) == 3 * E * 2 and all(m.linear is None for m in lazies)
    held = held_bytes(net)
    backend = get_backend("cpu")
    logits, routed = [], {}
    for i, layer in enumerate(net.layers):
        layer.mlp.register_forward_pre_hook(
            lambda m, args, i=i: routed.__setitem__(i, sorted(m.route(args[0])[1].flatten().tolist())))
    for model in (lm.model, net):
        caches = allocate_kv_caches(model, backend, num_blocks=1, block_size=16)
        with torch.inference_mode():
            h = model(torch.tensor([77]), torch.tensor([0]), caches, AttentionMetadata.build([1], [1], [[0]], 16), backend)
            logits.append(model.compute_logits(h))
    assert torch.equal(logits[0], logits[1])
    for i, layer in enumerate(net.layers):
        read = [e for e, x in enumerate(layer.mlp.experts) if x.gate_up_proj.linear is not None]
        assert read == routed[i] and len(read) == K
        assert [e for e, x in enumerate(layer.mlp.experts) if x.down_proj.linear is not None] == read
    per_expert = (2 * I_EXP * 64 + 64 * I_EXP) // 32 * 34  # gate + up + down rows, Q8_0: 34 bytes per 32 values
    assert held_bytes(net) - held == 3 * K * per_expert


def test_lazy_experts_from_the_environment_generate_the_eager_tokens(case, monkeypatch):
    from pagedkv.model.gguf_moe import LazyExpertLinear

    _, path, lm = case
    monkeypatch.setenv("PAGEDKV_LAZY_EXPERTS", "1")
    lazy = load_model(path, weights="gguf")
    assert isinstance(lazy.model.layers[0].mlp.experts[0].gate_up_proj, LazyExpertLinear)
    prompts = [list(range(5, 17)), [100, 3, 200, 45, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [LLM(m, block_size=4, num_blocks=32, max_num_batched_tokens=8).generate(prompts, params, use_tqdm=False)
           for m in (lm, lazy)]
    assert [o.outputs[0].token_ids for o in got[0]] == [o.outputs[0].token_ids for o in got[1]]
    assert len({o.outputs[0].token_ids[0] for o in got[0]}) == 2
