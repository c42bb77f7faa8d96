"""The mixture-of-experts families (Qwen3-MoE, Mixtral) against Hugging Face transformers on
the same tiny random weights (fp32).

For each family a tiny model (3 layers, hidden 64, 8 experts of which 2 per token; Qwen3-MoE
with a dense middle layer through ``mlp_only_layers``) is built with transformers from a
seeded config, given non-trivial norms and decisive routers, and saved with
``save_pretrained`` (one tensor per expert, transformers 5.24's on-disk form); pagedkv loads
the directory. Checked:

* the decoder's logits equal transformers' (one forward over the sequence) at every position,
  for a chunked prefill then decode steps, at block sizes 1 and 16 (atol = rtol = 1e-4);
* the engine's greedy tokens equal ``generate``'s (ordinary cache, 20 new tokens) at block
  sizes 1 and 16, with 16-token prefill chunks, three requests batched, preemption in a pool
  too small for them, and a prefix-cache hit;
* which path ran: the MoE layers on the torch ops (no fused ops, no native step loop, no
  compiled step); at a one-token decode step each MoE layer runs exactly its ``k`` routed
  experts;
* the stacked-tensor form (``experts.gate_up_proj`` ``[E, 2I, H]``) loads to the same model.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.model.loader import load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import (
    check_engine_greedy, check_two_greedy_completions, chunked_logits, decode_expert_calls, hf_logits, moe_config,
    moe_rules, prompt, save_tiny, seeded_model,
)

FAMILIES = ["qwen3_moe", "mixtral"]
NEW = 20


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, transformers model, directory, pagedkv LoadedModel): ``builders.moe_config`` with
    non-trivial norms and decisive routers (``builders.moe_rules``)."""
    kind = request.param
    hf = seeded_model(*moe_config(kind), moe_rules())
    out = save_tiny(hf, tmp_path_factory.mktemp(kind))
    return kind, hf, out, load_model(out)


def test_config_reads_the_family(family):
    kind, _, out, lm = family
    c = lm.config
    assert c.architecture == kind
    assert (c.num_experts, c.num_experts_per_tok) == (8, 2)
    if kind == "qwen3_moe":
        assert (c.moe_intermediate_size, c.moe_layers, c.norm_topk_prob, c.qk_norm) == (32, [0, 2], True, True)
    else:
        assert (c.moe_intermediate_size, c.moe_layers, c.norm_topk_prob, c.qk_norm) == (96, None, True, False)
    assert c.layer_windows() == [None] * 3
    assert [layer.mlp is not None for layer in lm.model.layers] == [True, kind == "mixtral", True]
    assert sum(1 for n in lm.model.state_dict() if n.endswith("gate_up_proj.weight")) == (17 if kind == "qwen3_moe" else 24)


@pytest.mark.parametrize("block", [1, 16])
def test_logits_equal_transformers(family, block):
    kind, hf, _, lm = family
    ids = prompt(40, 1)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(chunked_logits(lm.model, ids, block, get_backend("cpu")), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [1, 16])
def test_engine_greedy_tokens_equal_transformers(family, block):
    _, hf, _, lm = family
    # the three first sequences need 57-65 tokens each: a pool of ~2 sequences' blocks preempts
    check_engine_greedy(hf, lm, block, pool=130 // block + 1, new=NEW)


def test_two_completions_of_one_prompt_share_its_blocks_and_equal_transformers(family):
    """``n=2`` greedy: both completions fork from the one prefilled prompt and equal ``generate``'s."""
    _, hf, _, lm = family
    check_two_greedy_completions(hf, lm, NEW)


def test_moe_layers_run_eager_and_only_routed_experts_at_decode(family):
    kind, _, _, lm = family
    net = lm.model
    moe = [i for i, layer in enumerate(net.layers) if layer.mlp is not None]
    _, calls, routed = decode_expert_calls(net, moe, prompt(10, 9), get_backend("cpu"))
    assert set(calls) == ({0, 2} if kind == "qwen3_moe" else {0, 1, 2})
    for i, experts in calls.items():
        assert sorted(experts) == routed[i] and len(experts) == 2  # the k routed experts, once each
    # which path ran: softmax-routed MoE layers are fusable (the fused ops around the MoE's torch
    # ops); fp32 nn.Linear weights keep the native step loop off; no compiled step
    assert net.fused_state is not None  # the first forward decided
    assert all(layer.fusable for layer in net.layers)
    assert net._native is None
    assert net.native_state.startswith("off (")
    from pagedkv.model.compiled import compile_decode

    cd = compile_decode(net, max_rows=8, progress=False)
    assert cd.failed == "mixture-of-experts layers run eager" and not cd.accepts(1) and cd.steps == 0


def test_stacked_expert_tensors_load_to_the_same_model(family, tmp_path):
    """transformers' in-memory form (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
    ``[E, H, I]``) written to disk as is loads to the same weights as the per-expert files."""
    import shutil

    from safetensors.torch import load_file, save_file

    kind, hf, out, lm = family
    shutil.copytree(out, tmp_path / "m")
    moe = "mlp" if kind == "qwen3_moe" else "block_sparse_moe"
    stacked = {k: v for k, v in hf.state_dict().items() if ".experts." not in k}
    for i in ([0, 2] if kind == "qwen3_moe" else [0, 1, 2]):
        exp = hf.model.layers[i].mlp.experts
        stacked[f"model.layers.{i}.{moe}.experts.gate_up_proj"] = exp.gate_up_proj.detach().clone()
        stacked[f"model.layers.{i}.{moe}.experts.down_proj"] = exp.down_proj.detach().clone()
        stacked[f"model.layers.{i}.{moe}.gate.weight"] = stacked.pop(f"model.layers.{i}.mlp.gate.weight")
    save_file({k: v.contiguous() for k, v in stacked.items()}, str(tmp_path / "m" / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(tmp_path / "m" / "model.safetensors")))
    again = load_model(tmp_path / "m")
    ref = lm.model.state_dict()
    got = again.model.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("weights, cls, tol", [("int8", "Int8Linear", 0.03), ("bf16", "BF16Linear", 0.01)])
def test_quantised_experts_use_the_quantised_linear_modules(family, weights, cls, tol):
    """``weights="int8"`` / ``"bf16"`` make every expert's two matrices (and attention's) that
    format's module, the router staying float: logits within the format's error of fp32's."""
    kind, _, out, lm = family
    q = load_model(out, weights=weights)
    moe = [layer.mlp for layer in q.model.layers if layer.mlp is not None]
    assert {type(m).__name__ for mlp in moe for e in mlp.experts for m in (e.gate_up_proj, e.down_proj)} == {cls}
    assert all(type(mlp.router) is torch.nn.Linear and mlp.router.weight.dtype == torch.float32 for mlp in moe)
    ids = prompt(20, 11)
    logits = [chunked_logits(net, ids, 16, get_backend("cpu"), chunks=((0, 20),), table=[0, 1], num_blocks=2)
              for net in (lm.model, q.model)]
    diff = (logits[0] - logits[1]).abs().max().item()
    assert 0 < diff < tol


def test_planner_and_engine_agree_on_kv_bytes_per_token(family):
    """``pagedkv plan``'s sizing (``KVCacheSpec.from_hf_config``) knows the MoE families, and its
    bytes per token are what the model allocates (experts change no KV shape)."""
    from pagedkv.kv.spec import KVCacheSpec

    _, _, out, lm = family
    spec = KVCacheSpec.from_hf_config(out / "config.json", dtype="fp32")
    caches = allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=4, block_size=16)
    held = sum(t.numel() * t.element_size() for c in caches for t in (c.key, c.value))
    assert spec.bytes_per_token == held // 64 == 3 * 2 * (2 * 16) * 4  # layers x K,V x kv heads x d x fp32


def _cfg(**kw):
    base = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                eos_token_id=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return ModelConfig.from_hf_config({**base, **kw})


def test_qwen3_moe_sparse_step_and_dense_layers():
    assert _cfg(decoder_sparse_step=2).moe_layers == [1, 3, 5]
    assert _cfg(decoder_sparse_step=2, mlp_only_layers=[3]).moe_layers == [1, 5]
    assert _cfg().moe_layers is None and _cfg().is_moe_layer(4)
    dense = _cfg(num_experts=0)
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)
    assert _cfg(use_sliding_window=True, sliding_window=16).layer_windows() == [16] * 6
    assert _cfg(use_sliding_window=False, sliding_window=16).layer_windows() == [None] * 6
    mixtral = _cfg(model_type="mixtral", num_experts=None, num_local_experts=4, sliding_window=4096)
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.layer_windows()) == (4, 96, [4096] * 6)


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(model_type="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
          n_routed_experts=4, n_group=2, topk_group=1, scoring_func="softmax"), "scoring_func"),  # V3 routes by sigmoid
])
def test_unsupported_moe_configs_raise_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_tensor_parallel_sizes_of_moe():
    """Experts split along their width (``pagedkv.distributed.parallel``; engine runs:
    ``tests/distributed/test_tp_moe_mla.py``): sizes divide the heads and leave each rank a
    column of every expert."""
    from pagedkv.distributed.parallel import check_tp_size, valid_tp_sizes

    c = _cfg()
    assert valid_tp_sizes(c) == [1, 2, 4]
    check_tp_size(c, 2)
    assert valid_tp_sizes(_cfg(moe_intermediate_size=2)) == [1, 2]
    with pytest.raises(ConfigError, match="8 experts of width 2.*valid sizes: 1, 2"):
        check_tp_size(_cfg(moe_intermediate_size=2), 4)
