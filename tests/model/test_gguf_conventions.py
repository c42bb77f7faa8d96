"""One test per GGUF convention of ``pagedkv.model.families.GGUF_CONVENTIONS``: how llama.cpp's
converters change a family's tensors, undone by ``gguf_state_dict``; and the tokenizer's
special-token rule read from the file (the two real GGUFs: SmolLM2 adds no BOS, Gemma-3 does).

The state-dict tests feed ``gguf_state_dict`` hand-made tensors of a one-layer model (head_dim 4)
in place of a file's, so every value is known."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.config import ModelConfig
from pagedkv.model.families import GGUF_CONVENTIONS
from pagedkv.model.weights import gguf_state_dict

H, HEADS, KV, D, FF = 8, 2, 1, 4, 6


def _config(arch: str, names=()) -> ModelConfig:
    md = {"general.architecture": arch, f"{arch}.block_count": 1, f"{arch}.embedding_length": H,
          f"{arch}.feed_forward_length": FF, f"{arch}.attention.head_count": HEADS,
          f"{arch}.attention.head_count_kv": KV, f"{arch}.attention.key_length": D,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.context_length": 64, f"{arch}.vocab_size": 10,
          "tokenizer.ggml.eos_token_id": 1}
    return ModelConfig.from_gguf_metadata(md, names or _names(arch))


def _names(arch: str) -> list[str]:
    return list(_tensors(arch))


def _tensors(arch: str) -> dict[str, torch.Tensor]:
    """A one-layer model's GGUF tensors, each value distinct (row i of a matrix = i + column/100)."""
    def mat(rows: int, cols: int, base: float = 0.0) -> torch.Tensor:
        return base + torch.arange(rows, dtype=torch.float32)[:, None] + torch.arange(cols)[None, :] / 100

    t = {"token_embd.weight": mat(10, H), "output_norm.weight": torch.full((H,), 1.5),
         "blk.0.attn_norm.weight": torch.full((H,), 1.25), "blk.0.ffn_norm.weight": torch.full((H,), 1.75),
         "blk.0.attn_q.weight": mat(HEADS * D, H), "blk.0.attn_k.weight": mat(KV * D, H, 100),
         "blk.0.attn_v.weight": mat(KV * D, H, 200), "blk.0.attn_output.weight": mat(H, HEADS * D),
         "blk.0.ffn_down.weight": mat(H, FF)}
    if arch == "phi3":  # q/k/v and gate/up stored fused
        t["blk.0.attn_qkv.weight"] = torch.cat([t.pop("blk.0.attn_q.weight"), t.pop("blk.0.attn_k.weight"),
                                                t.pop("blk.0.attn_v.weight")])
        t["blk.0.ffn_up.weight"] = mat(2 * FF, H, 300)
    else:
        t["blk.0.ffn_gate.weight"], t["blk.0.ffn_up.weight"] = mat(FF, H, 300), mat(FF, H, 400)
    if arch.startswith("gemma"):
        t["blk.0.post_attention_norm.weight"] = torch.full((H,), 2.0)
        t["blk.0.post_ffw_norm.weight"] = torch.full((H,), 3.0)
    if arch in ("gemma3", "qwen3"):
        t["blk.0.attn_q_norm.weight"], t["blk.0.attn_k_norm.weight"] = torch.full((D,), 1.5), torch.full((D,), 0.5)
    return t


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to a Llama Q/K matrix: within each head, rows
    [first half; second half] become interleaved pairs (for its adjacent-pair RoPE)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _state(arch: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return gguf_state_dict(None, None, _config(arch, list(tensors)), tensors=list(tensors.items()))


def test_every_gguf_architecture_states_its_conventions():
    assert set(GGUF_CONVENTIONS) == {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe",
                                     "deepseek_v2", "deepseek_v3", "gpt_oss"}  # deepseek2: none of the four
    # (gguf_mla); gpt-oss: none either (its converter keeps q/k rows: llama.cpp runs NEOX rotate-half RoPE)
    assert [a for a, c in GGUF_CONVENTIONS.items() if c["rope_rows_permuted"]] == ["llama", "mistral"]
    assert [a for a, c in GGUF_CONVENTIONS.items() if c["norms_plus_one"]] == ["gemma2", "gemma3"]
    assert [a for a, c in GGUF_CONVENTIONS.items() if c["fused_gate_up"]] == ["phi3"]


def test_llama_q_and_k_rows_are_unpermuted_and_qwen2_rows_are_kept():
    t = _tensors("llama")
    q, k = t["blk.0.attn_q.weight"].clone(), t["blk.0.attn_k.weight"].clone()
    stored = dict(t, **{"blk.0.attn_q.weight": _llama_cpp_permute(q, HEADS),
                        "blk.0.attn_k.weight": _llama_cpp_permute(k, KV)})
    assert not torch.equal(stored["blk.0.attn_q.weight"], q)  # the permutation moves rows
    qkv = _state("llama", stored)["layers.0.qkv_proj.weight"]
    assert torch.equal(qkv[: HEADS * D], q) and torch.equal(qkv[HEADS * D: (HEADS + KV) * D], k)
    qkv2 = _state("qwen2", _tensors("qwen2"))["layers.0.qkv_proj.weight"]
    assert torch.equal(qkv2[: HEADS * D], q)  # qwen2's converter does not permute: taken as stored


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_norms_are_stored_as_one_plus_w(arch):
    s = _state(arch, _tensors(arch))
    assert s["layers.0.input_layernorm.weight"][0].item() == 0.25  # stored 1.25
    assert s["layers.0.pre_feedforward_layernorm.weight"][0].item() == 0.75  # ffn_norm, stored 1.75
    assert s["layers.0.post_attention_layernorm.weight"][0].item() == 1.0  # stored 2.0
    assert s["layers.0.post_feedforward_layernorm.weight"][0].item() == 2.0
    assert s["norm.weight"][0].item() == 0.5
    if arch == "gemma3":
        assert s["layers.0.q_norm.weight"][0].item() == 0.5 and s["layers.0.k_norm.weight"][0].item() == -0.5
    llama = _state("llama", _tensors("llama"))  # no offset elsewhere
    assert llama["layers.0.input_layernorm.weight"][0].item() == 1.25 and llama["norm.weight"][0].item() == 1.5


def test_ffn_norm_is_the_pre_feedforward_norm_in_gemma_and_the_mlp_input_norm_in_llama():
    g = _state("gemma2", _tensors("gemma2"))
    assert "layers.0.pre_feedforward_layernorm.weight" in g
    assert g["layers.0.post_attention_layernorm.weight"][0].item() == 1.0  # post_attention_norm, not ffn_norm
    assert _state("llama", _tensors("llama"))["layers.0.post_attention_layernorm.weight"][0].item() == 1.75


def test_phi3_gate_up_and_qkv_are_taken_fused():
    t = _tensors("phi3")
    s = _state("phi3", t)
    assert torch.equal(s["layers.0.gate_up_proj.weight"], t["blk.0.ffn_up.weight"])
    assert torch.equal(s["layers.0.qkv_proj.weight"], t["blk.0.attn_qkv.weight"])
    llama = _tensors("llama")
    gu = _state("llama", llama)["layers.0.gate_up_proj.weight"]
    assert torch.equal(gu, torch.cat([llama["blk.0.ffn_gate.weight"], llama["blk.0.ffn_up.weight"]]))


def test_no_output_tensor_means_tied_embeddings():
    t = _tensors("llama")
    assert _config("llama", list(t)).tie_word_embeddings is True
    assert "lm_head.weight" not in _state("llama", t)
    t["output.weight"] = torch.ones(10, H)
    assert _config("llama", list(t)).tie_word_embeddings is False
    assert torch.equal(_state("llama", t)["lm_head.weight"], torch.ones(10, H))


def test_the_files_bos_rule_reaches_the_engine_tokenizer(loaded_model, gemma3_loaded):
    from pagedkv.model.tokenizer import encode_prompt

    # SmolLM2: tokenizer.ggml.add_bos_token false -> nothing added
    assert encode_prompt(loaded_model.tokenizer, "Hello there") == [19556, 665]
    # Gemma-3: add_bos_token true -> <bos> (2) first; add_eos_token false -> no <eos> (1) last
    ids = encode_prompt(gemma3_loaded.tokenizer, "Once upon a time")
    assert ids == [2, 14946, 3324, 496, 990]
