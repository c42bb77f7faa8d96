"""gpt-oss (``GptOssForCausalLM``) against Hugging Face transformers on the same tiny random
weights (fp32).

A tiny model (3 layers: sliding window 8, full, sliding 8; hidden 64, 4 heads over 2 KV heads;
4 experts of which 2 per token; YaRN RoPE) is built with transformers from a seeded config,
given non-trivial norms, sinks, biases and decisive routers, and saved with
``save_pretrained`` (stacked, gate/up-interleaved experts: transformers 5.24's on-disk form);
pagedkv loads the directory. Checked:

* the config: windows per layer, yarn, the routing and expert switches, sinks and biases;
* the decoder's logits equal transformers' (one forward over 40 tokens, so the 8-token windows
  and the sinks matter) for a chunked prefill then decode steps, at block sizes 1 and 16, on
  the cpu and the reference backend (atol = rtol = 1e-4); with the sinks zeroed they do not;
* the engine's greedy tokens equal ``generate``'s (20 new tokens) at block sizes 1 and 16, with
  16-token prefill chunks, three requests batched, preemption in a pool too small for them,
  a prefix-cache hit, and ``n=2``;
* the paths: fp32 layers on the fused ops (attention sinks in the CPU kernel) with the MoE's
  torch ops (the native step needs integer-kernel weights: tests/model/test_native_gptoss.py;
  no compiled step), at a decode step only the ``k`` routed experts run; a backend without
  ``attention_sinks`` is refused; the cpu backend's sinks equal the reference's (float and int8
  caches).

A gpt-oss GGUF of the same shapes: ``test_gguf_gptoss.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.model.loader import load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import (
    GPTOSS_RULES, check_engine_greedy, check_two_greedy_completions, chunked_logits, decode_expert_calls,
    gptoss_config, hf_logits, prompt, save_tiny, seeded_model,
)

NEW = 20


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(transformers model, directory, pagedkv LoadedModel)."""
    hf = seeded_model(*gptoss_config(), GPTOSS_RULES)
    out = save_tiny(hf, tmp_path_factory.mktemp("gpt_oss"))
    hf.generation_config.eos_token_id = None  # generate runs all NEW tokens, as the engine's ignore_eos
    return hf, out, load_model(out)


def test_config_reads_gpt_oss(gptoss):
    _, _, lm = gptoss
    c = lm.config
    assert c.architecture == "gpt_oss"
    assert c.layer_windows() == [8, None, 8]
    assert c.rope_scaling == {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0,
                              "original_max_position_embeddings": 64, "truncate": False}
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_routing) == (4, 2, 32, "topk_softmax")
    assert (c.attention_sinks, c.attention_bias, c.o_proj_bias, c.moe_bias) == (True, True, True, True)
    assert (c.swiglu_limit, c.swiglu_alpha, c.moe_layers) == (7.0, 1.702, None)
    layer = lm.model.layers[0]
    assert layer.sinks.shape == (4,) and layer.o_proj.bias.shape == (64,) and layer.qkv_proj.bias.shape == (128,)
    assert layer.mlp.router.bias.shape == (4,)
    assert layer.mlp.experts[3].gate_up_proj.bias.shape == (64,) and layer.mlp.experts[3].down_proj.bias.shape == (64,)


def test_experts_deinterleave_gate_and_up(gptoss):
    """transformers' ``gate_up_proj`` ``[E, H, 2I]`` (gate columns even, up odd) becomes our
    ``[2I, H]`` of gate rows then up rows; ``down_proj`` ``[E, I, H]`` becomes ``[H, I]``."""
    hf, _, lm = gptoss
    ref, got = hf.model.layers[2].mlp.experts, lm.model.layers[2].mlp.experts[1]
    w = ref.gate_up_proj[1].detach()
    assert torch.equal(got.gate_up_proj.weight[:32], w[:, 0::2].t()) and torch.equal(got.gate_up_proj.weight[32:], w[:, 1::2].t())
    assert torch.equal(got.gate_up_proj.bias, torch.cat([ref.gate_up_proj_bias[1, 0::2], ref.gate_up_proj_bias[1, 1::2]]))
    assert torch.equal(got.down_proj.weight, ref.down_proj[1].t()) and torch.equal(got.down_proj.bias, ref.down_proj_bias[1])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():  # one expert through transformers' own gate (the clamp bites at this scale)
        gate_up = x @ ref.gate_up_proj[1] + ref.gate_up_proj_bias[1]
        assert gate_up.abs().max() > 7.0
        want = ref._apply_gate(gate_up) @ ref.down_proj[1] + ref.down_proj_bias[1]
        torch.testing.assert_close(got(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", ["cpu", "reference"])
@pytest.mark.parametrize("block", [1, 16])
def test_logits_equal_transformers(gptoss, block, backend_name):
    hf, _, lm = gptoss
    ids = prompt(40, 1)
    ref = hf_logits(hf, ids)
    got = chunked_logits(lm.model, ids, block, get_backend(backend_name))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert ref.abs().max() > 3.0


def test_sinks_change_the_logits(gptoss):
    """The equality above is not blind to the sinks: zeroed, the logits move well past 1e-4."""
    hf, _, lm = gptoss
    ids = prompt(40, 1)
    ref = hf_logits(hf, ids)
    saved = [layer.sinks.detach().clone() for layer in lm.model.layers]
    try:
        with torch.no_grad():
            for layer in lm.model.layers:
                layer.sinks.zero_()
        got = chunked_logits(lm.model, ids, 16, get_backend("cpu"))
    finally:
        with torch.no_grad():
            for layer, s in zip(lm.model.layers, saved):
                layer.sinks.copy_(s)
    assert (got - ref).abs().max() > 0.05


@pytest.mark.parametrize("block", [1, 16])
def test_engine_greedy_tokens_equal_transformers(gptoss, block):
    hf, _, lm = gptoss
    # the three first sequences need 57-65 tokens each (in the full layer's group, plus the
    # sliding layers' window and chunk): a pool of at most ~2 sequences' blocks preempts
    check_engine_greedy(hf, lm, block, pool={1: 131, 16: 14}[block], new=NEW)


def test_two_completions_of_one_prompt_equal_transformers(gptoss):
    """``n=2`` greedy: both completions fork from the one prefilled prompt and equal ``generate``'s."""
    hf, _, lm = gptoss
    check_two_greedy_completions(hf, lm, NEW)


def test_layers_run_fused_and_only_routed_experts_at_decode(gptoss):
    _, _, lm = gptoss
    net = lm.model
    _, calls, routed = decode_expert_calls(net, range(3), prompt(10, 9), get_backend("cpu"))
    for i, experts in calls.items():
        assert sorted(experts) == routed[i] and len(experts) == 2  # the k routed experts, once each
    assert all(layer.fusable and layer.mlp.native_ok for layer in net.layers) and net.fused_state == "on"
    assert net._native is None and "integer-kernel" in net.native_state  # fp32 weights: plain nn.Linear
    assert all(set(layer.attn_options) >= {"sinks"} for layer in net.layers)
    from pagedkv.model.compiled import compile_decode

    cd = compile_decode(net, max_rows=8, progress=False)
    assert cd.failed == "mixture-of-experts layers run eager" and not cd.accepts(1)


def test_backend_without_sinks_is_refused(gptoss):
    from pagedkv.model.step_strategy import choose_step_strategy

    _, _, lm = gptoss
    plain = SimpleNamespace(name="plain", write_kv=None, forward=None)  # declares no capabilities
    with pytest.raises(ConfigError, match="attention sinks"):
        choose_step_strategy(lm.model, plain, eager=True)
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ConfigError, match="attention sinks"):
        lm.model.layers[0].attention(q, q[:, :2], q[:, :2], None, None, plain)
    assert choose_step_strategy(lm.model, get_backend("cpu")).name == "fused"


@pytest.mark.parametrize("dtype", [torch.float32, "int8"])
def test_cpu_sinks_equal_reference(dtype):
    """The cpu backend's ``sinks`` (its C kernel, for the float and the int8 cache) equal the
    reference backend's, for a window and a chunk plus decode rows (tests/attention/test_sinks.py
    compares the kernel with the torch path)."""
    g = torch.Generator().manual_seed(5)
    block, lens, qlens = 4, [23, 9], [7, 1]
    md = AttentionMetadata.build(lens, qlens, [[5, 0, 3, 7, 1, 2], [4, 6, 8]], block)
    k, v = (torch.randn(sum(lens), 2, 16, generator=g) for _ in range(2))
    q = torch.randn(sum(qlens), 4, 16, generator=g)
    sinks = torch.randn(4, generator=g) * 2
    outs = []
    for name in ("cpu", "reference"):
        be = get_backend(name)
        cache = be.allocate_kv_cache(10, block, 2, 16, dtype)
        # write every position of each sequence (the context), then attend the last qlens rows
        full = AttentionMetadata.build(lens, lens, [[5, 0, 3, 7, 1, 2], [4, 6, 8]], block)
        be.write_kv(cache, k, v, full.slot_mapping)
        outs.append([be.forward(q, cache, md, 0.25, sliding_window=w, sinks=sinks) for w in (None, 6)])
        outs[-1].append(be.forward(q, cache, md, 0.25))
    for got, want in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (outs[1][0] - outs[1][2]).abs().max() > 1e-2  # the sinks matter


def test_planner_and_engine_agree_on_kv_bytes_per_token(gptoss):
    """``pagedkv plan``'s sizing knows gpt-oss's windows; the full layer's bytes per token are
    what the model allocates per layer."""
    from pagedkv.kv.spec import KVCacheSpec

    _, out, lm = gptoss
    spec = KVCacheSpec.from_hf_config(out / "config.json", dtype="fp32")
    assert spec.layer_windows == (8, None, 8)
    caches = allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=4, block_size=16)
    held = sum(t.numel() * t.element_size() for c in caches for t in (c.key, c.value))
    assert held // 64 == 3 * 2 * (2 * 16) * 4 == spec.bytes_per_token


def test_router_and_moe_block_equal_transformers(gptoss):
    """``MoE.route`` (``topk_softmax``: biased logits, top-k, softmax over the chosen) picks
    transformers' ``GptOssTopKRouter`` experts with its weights, and the whole block equals
    ``GptOssMLP`` on 7 tokens and on 1."""
    hf, _, lm = gptoss
    ref, ours = hf.model.layers[1].mlp, lm.model.layers[1].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, scores, idx = ref.router(x)
        weights, ids = ours.route(x)
        order = ids.argsort(dim=-1)
        hidx, horder = idx.sort(dim=-1)
        assert torch.equal(ids.gather(1, order), hidx)
        torch.testing.assert_close(weights.gather(1, order), scores.gather(1, horder), rtol=1e-6, atol=1e-6)
        for rows in (x, x[:1]):
            torch.testing.assert_close(ours(rows), ref(rows[None])[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights, cls, tol", [("int8", "Int8Linear", 0.03), ("bf16", "BF16Linear", 0.01)])
def test_quantised_weights_keep_the_biases(gptoss, weights, cls, tol):
    """``weights="int8"`` / ``"bf16"``: attention and expert matrices become that format's
    module with their biases (the router stays float); each module's output within the
    format's error of the fp32 one's. (Whole-model logits are not compared: on these decisive
    routers a rounding difference flips a token's expert choice now and then.)"""
    _, out, lm = gptoss
    q = load_model(out, weights=weights)
    ref, layer = lm.model.layers[0], q.model.layers[0]
    pairs = [(ref.qkv_proj, layer.qkv_proj), (ref.o_proj, layer.o_proj)] + [
        (a, b) for ea, eb in zip(ref.mlp.experts, layer.mlp.experts) for a, b in ((ea.gate_up_proj, eb.gate_up_proj),
                                                                                 (ea.down_proj, eb.down_proj))]
    assert {type(b).__name__ for _, b in pairs} == {cls}
    assert all(torch.equal(b.bias.float(), a.bias) for a, b in pairs)
    assert type(layer.mlp.router) is torch.nn.Linear and torch.equal(layer.mlp.router.bias, ref.mlp.router.bias)
    g = torch.Generator().manual_seed(13)
    with torch.inference_mode():
        for a, b in pairs:
            x = torch.randn(6, a.in_features, generator=g)
            want, got = a(x), b(x)
            assert 0 < (got - want).abs().max() < tol * want.abs().max()


def test_tensor_parallelism_refuses_what_it_does_not_split_yet(gptoss):
    """The shard plan slices heads, MLP and expert widths, not gpt-oss's sinks and biases: a size
    above 1 is a ConfigError naming them, before any worker starts."""
    from pagedkv.distributed.parallel import check_tp_size

    _, _, lm = gptoss
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2: .*attention sinks, an o_proj bias, expert biases"):
        check_tp_size(lm.config, 2)
    check_tp_size(lm.config, 1)
