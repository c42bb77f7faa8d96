"""The fused CPU element-wise ops (pagedkv.ops.fused_ops) against the torch ops they replace, and
a model with them against the same model without (same logits, same greedy tokens)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.ops import fused_ops as fused
from pagedkv.model.llama import _apply_rope, _rms_norm

OPS = fused.get()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"fused ops not built: {fused.build_error()}")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 3, 9])  # 9: the OpenMP row-parallel branch (>= 8 rows)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_matches_torch_and_updates_the_residual(rows, offset):
    res, delta, w = _rand(rows, 576), _rand(rows, 576, seed=1), _rand(576, seed=2)
    want_res = res + delta
    want = _rms_norm(want_res, w, 1e-5, offset)
    got = OPS.add_rms_norm(res, delta, w, 1e-5, offset)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # bf16 output: the float32 result rounded to nearest even, bit for bit as torch rounds it
    res2 = want_res.clone()
    got16 = OPS.add_rms_norm(res2, None, w, 1e-5, offset, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, OPS.add_rms_norm(want_res.clone(), None, w, 1e-5, offset).to(torch.bfloat16))


def test_add_rms_norm_takes_a_bf16_delta_and_strided_rows():
    base = _rand(4, 1000)
    res = base[:, :576]  # row stride 1000
    delta = _rand(4, 576, seed=3).to(torch.bfloat16)
    want = base[:, :576] + delta.float()
    OPS.add_rms_norm(res, delta, torch.ones(576), 1e-6)
    assert torch.equal(res, want)
    assert torch.equal(base[:, 576:], _rand(4, 1000)[:, 576:])  # nothing past the row written


def test_bf16_rounding_ties_to_even_and_keeps_nan():
    # values on either side of and exactly at bf16 rounding ties, through act_mul's store:
    # silu(g) * u with u chosen so the product is the target value
    vals = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 2**-8), float("inf"),
                         float("nan"), 3.0e38, 1e-40])
    g = torch.full_like(vals, 30.0)  # silu(30) == 30 in float32
    gate_up = torch.cat([g, vals / 30.0]).reshape(1, -1)
    out = OPS.act_mul(gate_up, len(vals), out_dtype=torch.bfloat16)
    f32 = OPS.act_mul(gate_up, len(vals))
    assert torch.equal(out.float().isnan(), f32.isnan())
    finite = ~f32.isnan()
    assert torch.equal(out[0, finite[0]], f32[0, finite[0]].to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_split_matches_torch_rope(rows, dtype):
    nq, nkv, d = 9, 3, 64
    qkv = _rand(rows, (nq + 2 * nkv) * d).to(dtype)
    pos = torch.arange(rows) * 37 + 5
    ang = pos[:, None].float() * (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [T, 1, d/2] as the model passes them
    q, k, v = OPS.rope_split(qkv, cos, sin, nq, nkv, d)
    x = qkv.float()
    torch.testing.assert_close(q, _apply_rope(x[:, : nq * d].view(rows, nq, d), cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, _apply_rope(x[:, nq * d : (nq + nkv) * d].view(rows, nkv, d), cos, sin),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(v, x[:, (nq + nkv) * d :].view(rows, nkv, d))
    assert q.shape == (rows, nq, d) and k.shape == v.shape == (rows, nkv, d) and q.dtype == torch.float32


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_act_mul_matches_torch(gelu, rows):
    gu = _rand(rows, 2 * 1536) * 4
    g, u = gu[:, :1536], gu[:, 1536:]
    want = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
    torch.testing.assert_close(OPS.act_mul(gu, 1536, gelu), want, rtol=2e-6, atol=2e-6)
    got16 = OPS.act_mul(gu.to(torch.bfloat16), 1536, gelu, torch.bfloat16)
    g16, u16 = gu.to(torch.bfloat16).float()[:, :1536], gu.to(torch.bfloat16).float()[:, 1536:]
    want16 = ((F.gelu(g16, approximate="tanh") if gelu else F.silu(g16)) * u16).to(torch.bfloat16)
    assert (got16.float() - want16.float()).abs().max() <= 2**-7 * want16.float().abs().max()


def test_act_mul_at_the_ends_of_the_exp_range():
    """The vectorised exp is clamped to [-87.3, 88.3]: gates far past either end (and the
    columns after the last whole group of 8, which take the scalar path) still give torch's
    values to 2e-6; a NaN gate stays NaN."""
    g = torch.tensor([-1e4, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 100.0, 1e4,
                      float("nan"), 3.0])  # 15 columns: one group of 8 and 7 scalar ones
    u = torch.linspace(-2.0, 2.0, len(g))
    for gelu in (False, True):
        got = OPS.act_mul(torch.cat([g, u]).unsqueeze(0), len(g), gelu)[0]
        want = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
        torch.testing.assert_close(got[:13], want[:13], rtol=2e-6, atol=2e-6)
        assert torch.isnan(got[13]) and got[14] == pytest.approx(want[14].item(), rel=2e-6)


def test_act_mul_of_huge_negative_gates_is_zero_in_vector_and_scalar_columns():
    """act(g) * u for g far below -88 (SiLU) or g^3 overflowing (GELU): 0 as torch computes it
    (-inf: NaN, as torch), the same in the 8-wide columns and the scalar tail."""
    g = torch.tensor([-3e38, -1e38, -1e36, -1e32, float("-inf"), -1e13, -200.0, 1.0, -3e38, -1e38, -1e36, -1e32,
                      float("-inf")])  # one group of 8, then 5 scalar columns
    u = torch.full_like(g, 2.0)
    for gelu in (False, True):
        got = OPS.act_mul(torch.cat([g, u]).unsqueeze(0), len(g), gelu)[0]
        want = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
        assert got[[0, 1, 2, 3, 8, 9, 10, 11]].abs().max().item() == 0.0
        assert torch.isnan(got[4]) and torch.isnan(got[12]) and torch.isnan(want[4])
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30, equal_nan=True)


def test_bad_inputs_raise_value_error_before_touching_memory():
    res = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="delta"):
        OPS.add_rms_norm(res, torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        OPS.add_rms_norm(res.double(), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="unit column stride"):
        OPS.add_rms_norm(torch.zeros(8, 2).t(), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="heads"):
        OPS.rope_split(torch.zeros(1, 100), torch.zeros(1, 8), torch.zeros(1, 8), 1, 1, 16)
    with pytest.raises(ValueError, match="cos"):
        OPS.rope_split(torch.zeros(2, 48), torch.zeros(1, 8), torch.zeros(2, 8), 1, 1, 16)
    with pytest.raises(ValueError, match="gate_up"):
        OPS.act_mul(torch.zeros(2, 10), 4)
    assert torch.equal(res, torch.zeros(2, 8))


def _greedy(loaded, prompt_ids, n):
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.request import SamplingParams

    eng = LLMEngine(loaded, dtype="float32", block_size=16, num_blocks=64, max_num_seqs=4)
    eng.add_request("a", prompt_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    eng.add_request("b", prompt_ids[:5], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.token_ids)
    return out


def test_model_with_and_without_fused_ops_agree(loaded_model, monkeypatch):
    """The tiny random decoder, greedy through the engine (prefill chunks and decode), and one
    forward's logits: fused ops on vs off."""
    from pagedkv.testing.tiny import tiny_random_model

    tiny = tiny_random_model(loaded_model, seed=3)
    prompt = [(i * 97 + 11) % 4000 + 10 for i in range(40)]
    on = _greedy(tiny, prompt, 24)
    assert tiny.model.fused_state == "on"
    assert all(layer.fused is OPS for layer in tiny.model.layers)
    monkeypatch.setattr(fused, "get", lambda: None)
    tiny.model.prepare_step(again=True)
    assert tiny.model.fused_state.startswith("off") and all(layer.fused is None for layer in tiny.model.layers)
    off = _greedy(tiny, prompt, 24)
    assert on == off and len(on["a"]) == 24


def test_fused_ops_only_for_float32_cpu_models_and_plain_layers(loaded_model):
    import dataclasses

    from pagedkv.model.llama import LlamaForCausalLM

    cfg = dataclasses.replace(loaded_model.config, num_layers=1, hidden_size=64, intermediate_size=128,
                              num_heads=4, num_kv_heads=2, head_dim=16)
    bf = LlamaForCausalLM(cfg, dtype=torch.bfloat16)
    bf.prepare_step(again=True)
    assert bf.fused_state == "off (not a float32 CPU model)" and bf.layers[0].fused is None
    gemma = LlamaForCausalLM(dataclasses.replace(cfg, sandwich_norms=True, norm_offset=1.0))
    gemma.prepare_step(again=True)
    assert gemma.fused_state == "on" and gemma.layers[0].fused is not None  # sandwich norms: fused too
    qwen3 = LlamaForCausalLM(dataclasses.replace(cfg, qk_norm=True))
    qwen3.prepare_step(again=True)
    assert qwen3.layers[0].fusable and qwen3.layers[0].fused is not None  # q/k norms: fused (head_rms_norm)
