"""The mixture-of-experts feed-forward (``pagedkv.model.moe``) against plain references.

* ``route`` against a per-token Python reference written from the papers' rules (every routing
  kind: softmax with and without renormalisation, DeepSeek-V2's group-limited softmax,
  DeepSeek-V3's sigmoid + correction bias with groups, scaling factors) and against
  transformers 5.24's own router modules (Mixtral, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3);
* ``MoE.forward`` against a dense reference that runs every token through each of its chosen
  experts one by one (1, 7 and 64 tokens; configurations where some experts get no token;
  shared experts);
* which experts run: at a one-token step exactly the ``k`` routed ones, each once; at a prefill
  each expert that got tokens once (one matmul pair over its rows), the others never;
* the ``ConfigError`` of every bad field.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.model.moe import MoE, MoESpec, moe_layer_indices, route

H, I = 64, 32

SPECS = {
    "softmax": MoESpec(8, 2, I),
    "softmax_norm": MoESpec(8, 2, I, norm_topk_prob=True),
    "softmax_group": MoESpec(8, 3, I, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "sigmoid_group": MoESpec(8, 2, I, routing="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                             routed_scaling_factor=2.5),
    "sigmoid_plain": MoESpec(6, 2, I, routing="sigmoid"),
    "shared": MoESpec(8, 2, I, num_shared_experts=2, routing="sigmoid", norm_topk_prob=True, n_group=2,
                      topk_group=1, routed_scaling_factor=1.5),
}


def _ref_route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None) -> list[dict[int, float]]:
    """Per token ``{expert: weight}``, by the rules as written, one token at a time."""
    out = []
    size = spec.num_experts // spec.n_group
    for row in logits.double():
        if spec.routing == "softmax":
            p = torch.exp(row - row.max())
            p = (p / p.sum()).tolist()
            choice = list(p)
            group_score = [max(choice[g * size:(g + 1) * size]) for g in range(spec.n_group)]
        else:
            p = (1 / (1 + torch.exp(-row))).tolist()
            choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(p)]
            group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(spec.n_group)]
        groups = sorted(range(spec.n_group), key=lambda g: -group_score[g])[:spec.topk_group]
        eligible = [e for e in range(spec.num_experts) if e // size in groups]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:spec.top_k]
        w = {e: p[e] for e in chosen}
        if spec.norm_topk_prob:
            total = sum(w.values()) + (1e-20 if spec.routing == "sigmoid" else 0.0)
            w = {e: v / total for e, v in w.items()}
        out.append({e: v * spec.routed_scaling_factor for e, v in w.items()})
    return out


def _as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


def _moe(spec: MoESpec, seed: int = 0, dead: tuple[int, ...] = ()) -> MoE:
    """A random-weight MoE; the router rows of ``dead`` experts point against every positive
    input (``_tokens``), so those experts never get a token."""
    g = torch.Generator().manual_seed(seed)
    m = MoE(spec, H, torch.float32, "cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        m.router.weight.mul_(5.0)
        for e in dead:
            m.router.weight[e] = -1.0
    return m.eval()


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).abs()


def _ref_forward(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone through each of its chosen experts (plain torch ops), weighted, summed."""
    logits = x @ m.router.weight.T
    routes = _ref_route(logits, m.spec, m.e_score_correction_bias)
    out = torch.zeros_like(x)

    def mlp(expert, v):
        w1, w3 = expert.gate_up_proj.weight.split(expert.intermediate_size)
        return (F.silu(v @ w1.T) * (v @ w3.T)) @ expert.down_proj.weight.T

    for t, r in enumerate(routes):
        for e, w in r.items():
            out[t] += w * mlp(m.experts[e], x[t:t + 1])[0]
        if m.shared is not None:
            out[t] += mlp(m.shared, x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_route_equals_the_per_token_reference(kind, tokens):
    spec = SPECS[kind]
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, spec.num_experts, generator=g) * 3
    bias = torch.randn(spec.num_experts, generator=g) * 0.5 if spec.routing == "sigmoid" else None
    weights, ids = route(logits, spec, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert tuple(ids.shape) == (tokens, spec.top_k)
    got, ref = _as_dicts(weights, ids), _ref_route(logits, spec, bias)
    for a, b in zip(got, ref):
        assert sorted(a) == sorted(b)
        assert all(abs(a[e] - b[e]) < 1e-6 for e in a)


def test_route_sigmoid_chooses_by_the_biased_score_but_weighs_by_the_plain_one():
    spec = MoESpec(4, 1, I, routing="sigmoid")
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, spec, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3]]  # sigmoid(-1) + 5 wins the choice
    assert abs(w.item() - torch.sigmoid(torch.tensor(-1.0)).item()) < 1e-7  # weight without the bias


def test_route_equals_transformers_routers():
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, H, generator=g)
    cases = [
        (MixtralTopKRouter(tf.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)),
         MoESpec(8, 2, I, norm_topk_prob=True)),
        (Qwen3MoeTopKRouter(tf.Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=3)),
         MoESpec(8, 3, I)),
        (DeepseekV2TopkRouter(tf.DeepseekV2Config(hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                                   topk_group=2, topk_method="group_limited_greedy",
                                                   routed_scaling_factor=2.0)),
         MoESpec(8, 3, I, n_group=4, topk_group=2, routed_scaling_factor=2.0)),
        (DeepseekV3TopkRouter(tf.DeepseekV3Config(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                                   topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
         MoESpec(8, 2, I, routing="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    ]
    for router, spec in cases:
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.3)
            _, ref_w, ref_ids = router(x)
        w, ids = route(x @ router.weight.T, spec, bias)
        got, ref = _as_dicts(w, ids), _as_dicts(ref_w, ref_ids)
        assert [sorted(a) for a in got] == [sorted(b) for b in ref], type(router).__name__
        assert max(abs(a[e] - b[e]) for a, b in zip(got, ref) for e in a) < 1e-6


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_moe_forward_equals_the_dense_reference(kind, tokens):
    spec = SPECS[kind]
    dead = (4, 5) if spec.routing == "softmax" else ()  # one whole group of softmax_group
    m = _moe(spec, dead=dead)
    if spec.routing == "sigmoid":
        with torch.no_grad():
            m.e_score_correction_bias[1] = -100.0  # never chosen
        dead = (1,)
    x = _tokens(tokens)
    with torch.inference_mode():
        got = m(x)
        ref = _ref_forward(m, x)
        used = set(m.route(x)[1].flatten().tolist())
    assert not used & set(dead)  # these experts got no token
    assert len(used) < spec.num_experts
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _record(m: MoE) -> list[int]:
    calls: list[int] = []
    for e, expert in enumerate(m.experts):
        expert.register_forward_hook(lambda mod, inp, out, e=e: calls.append((e, inp[0].shape[0])))
    return calls


def test_one_token_runs_only_its_k_routed_experts_once_each():
    m = _moe(SPECS["softmax_norm"])
    calls = _record(m)
    x = _tokens(1, seed=5)
    with torch.inference_mode():
        ids = m.route(x)[1][0].tolist()
        m(x)
    assert sorted(calls) == sorted((e, 1) for e in ids) and len(calls) == 2


def test_prefill_groups_tokens_one_call_per_active_expert():
    m = _moe(SPECS["softmax"], dead=(5, 6))
    calls = _record(m)
    x = _tokens(64, seed=6)
    with torch.inference_mode():
        ids = m.route(x)[1]
        m(x)
    counts = torch.bincount(ids.flatten(), minlength=8).tolist()
    assert calls == [(e, n) for e, n in enumerate(counts) if n]  # increasing expert id, rows grouped
    assert counts[5] == counts[6] == 0 and sum(counts) == 128


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=4, top_k=5, intermediate_size=I), "num_experts_per_tok"),
    (dict(num_experts=0, top_k=1, intermediate_size=I), "num_experts"),
    (dict(num_experts=8, top_k=2, intermediate_size=I, routing="topk"), "moe_routing"),
    (dict(num_experts=8, top_k=2, intermediate_size=I, n_group=3), "n_group"),
    (dict(num_experts=8, top_k=2, intermediate_size=I, n_group=4, topk_group=5), "n_group"),
    (dict(num_experts=8, top_k=5, intermediate_size=I, n_group=4, topk_group=2), "topk_group"),
    (dict(num_experts=8, top_k=2, intermediate_size=I, num_shared_experts=-1), "num_shared_experts"),
    (dict(num_experts=8, top_k=2, intermediate_size=I, routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_bad_fields_raise_config_error_naming_them(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MoESpec(**kwargs)


def test_moe_layer_indices_follow_deepseek_and_qwen3_moe_rules():
    assert moe_layer_indices(6) == [0, 1, 2, 3, 4, 5]
    assert moe_layer_indices(6, first_k_dense_replace=1) == [1, 2, 3, 4, 5]  # DeepSeek-V2-Lite: layer 0 dense
    assert moe_layer_indices(61, first_k_dense_replace=3)[:2] == [3, 4]  # DeepSeek-V3: 3 dense layers
    assert moe_layer_indices(6, decoder_sparse_step=2, mlp_only_layers=[3]) == [1, 5]  # Qwen3-MoE
    for kw, field in ((dict(first_k_dense_replace=-1), "first_k_dense_replace"),
                      (dict(decoder_sparse_step=0), "decoder_sparse_step"),
                      (dict(mlp_only_layers=3), "mlp_only_layers")):
        with pytest.raises(ConfigError, match=field):
            moe_layer_indices(6, **kw)


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_deepseek_moe_blocks_equal_transformers(version, tokens):
    """transformers 5.24's whole DeepSeek-V2 / V3 MoE block (router, routed experts, shared
    experts) against ours holding its weights (the block on its own; the whole models:
    ``tests/model/test_deepseek.py``)."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    common = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                  topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5)
    if version == "v2":
        ref = DeepseekV2Moe(tf.DeepseekV2Config(topk_method="group_limited_greedy", **common))
        spec = MoESpec(8, 3, I, num_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    else:
        ref = DeepseekV3MoE(tf.DeepseekV3Config(norm_topk_prob=True, **common))
        spec = MoESpec(8, 3, I, num_shared_experts=2, routing="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        ref.gate.weight.mul_(5.0)
        if version == "v3":
            ref.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    ours = MoE(spec, H, torch.float32, "cpu")
    with torch.no_grad():
        ours.router.weight.copy_(ref.gate.weight)
        if version == "v3":
            ours.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(ref.experts.gate_up_proj[e])  # gate rows then up rows, as ours
            expert.down_proj.weight.copy_(ref.experts.down_proj[e])
        sh = ref.shared_experts
        ours.shared.gate_up_proj.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        ours.shared.down_proj.weight.copy_(sh.down_proj.weight)
    x = torch.randn(tokens, H, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), ref(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_meta_linear_layer_is_an_nn_linear_without_init(bias):
    """``utils.linear_layer`` on the meta device: exactly ``nn.Linear`` (``invariant`` checks the
    type), the same parameters, shapes, dtype and repr as ``nn.Linear(..., device="meta")``;
    elsewhere it is ``nn.Linear`` itself (initialised)."""
    from pagedkv.utils import linear_layer

    got = linear_layer(48, 80, bias, torch.bfloat16, "meta")
    want = nn.Linear(48, 80, bias=bias, dtype=torch.bfloat16, device="meta")
    assert type(got) is nn.Linear and repr(got) == repr(want) == f"Linear(in_features=48, out_features=80, bias={bias})"
    assert [(k, tuple(p.shape), p.dtype, p.is_meta) for k, p in got.named_parameters()] == \
        [(k, tuple(p.shape), p.dtype, p.is_meta) for k, p in want.named_parameters()]
    assert got.weight.requires_grad and (got.bias is None) == (not bias)
    cpu = linear_layer(48, 80, bias, torch.float32, "cpu")
    assert type(cpu) is nn.Linear and not cpu.weight.is_meta and float(cpu.weight.abs().sum()) > 0
