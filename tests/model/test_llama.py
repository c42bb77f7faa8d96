"""Our Llama forward against Hugging Face transformers on the same weights (fp32).

The bundled GGUF through both loaders (prefill with a shuffled block table, decode through the
paged cache, chunked prefill, a mixed flat batch), plus tiny random Qwen2 / Mistral / Llama-3
models saved as HF safetensors directories (q/k/v bias, sliding-window config, llama3 RoPE).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.model.llama import LlamaForCausalLM, rope_inv_freq
from pagedkv.testing.caches import allocate_kv_caches

PROMPT = (
    "The paged KV cache splits every sequence into fixed-size blocks, much like the pages of "
    "virtual memory in an operating system"
)
BLOCK = 16
TABLE = [7, 2]  # shuffled physical blocks; 2 blocks of 16 hold the 23 tokens used below


def _tol(ref: torch.Tensor) -> float:
    return 1e-4 * max(1.0, ref.abs().max().item())


def _run(model: LlamaForCausalLM, backend, caches, ids, seq_lens, query_lens, tables, block=BLOCK):
    """One flat-batch step; ``ids`` is the concatenation of each sequence's new tokens."""
    md = AttentionMetadata.build(seq_lens, query_lens, tables, block)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    with torch.inference_mode():
        hidden = model(torch.as_tensor(ids, dtype=torch.long), positions, caches, md, backend)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def token_ids(hf_tokenizer):
    ids = hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 23, len(ids)
    return ids[:23]


@pytest.fixture(scope="module")
def hf_logits(hf_model, token_ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_prefill_matches_transformers(loaded_model, hf_logits, token_ids, backend_name):
    model, backend = loaded_model.model, get_backend(backend_name)
    caches = allocate_kv_caches(model, backend, num_blocks=10, block_size=BLOCK)
    logits = _run(model, backend, caches, token_ids[:20], [20], [20], [TABLE])
    ref = hf_logits[:20]
    assert logits.dtype == torch.float32 and logits.shape == (20, loaded_model.config.vocab_size)
    diff = (logits - ref).abs().max().item()
    assert diff < _tol(ref), diff
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_decode_through_paged_cache_matches_transformers(loaded_model, hf_logits, token_ids):
    model, backend = loaded_model.model, get_backend("reference")
    caches = allocate_kv_caches(model, backend, num_blocks=10, block_size=BLOCK)
    _run(model, backend, caches, token_ids[:20], [20], [20], [TABLE])
    for pos in (20, 21, 22):  # one token per step, read back through both physical blocks
        logits = _run(model, backend, caches, [token_ids[pos]], [pos + 1], [1], [TABLE])
        ref = hf_logits[pos : pos + 1]
        diff = (logits - ref).abs().max().item()
        assert diff < _tol(ref), (pos, diff)
        assert logits.argmax(-1).item() == ref.argmax(-1).item()
    # The cache holds exactly what a fresh prefill of all 23 tokens writes.
    fresh = allocate_kv_caches(model, backend, num_blocks=10, block_size=BLOCK)
    _run(model, backend, fresh, token_ids, [23], [23], [TABLE])
    slots = AttentionMetadata.build([23], [23], [TABLE], BLOCK).slot_mapping
    for layer in (0, 29):
        for a, b in zip(backend.gather_kv(caches[layer], slots), backend.gather_kv(fresh[layer], slots)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chunked_prefill_and_mixed_batch(loaded_model, hf_logits, token_ids):
    """Prefill in chunks 9 + 11 crossing a block edge, then one flat batch mixing a decode
    token of sequence A with an 8-token prefill of sequence B (other blocks)."""
    model, backend = loaded_model.model, get_backend("reference")
    caches = allocate_kv_caches(model, backend, num_blocks=12, block_size=BLOCK)
    first = _run(model, backend, caches, token_ids[:9], [9], [9], [TABLE])
    second = _run(model, backend, caches, token_ids[9:20], [20], [11], [TABLE])
    got = torch.cat([first, second])
    assert (got - hf_logits[:20]).abs().max().item() < _tol(hf_logits[:20])
    ids_b = token_ids[3:11]
    mixed = _run(model, backend, caches, [token_ids[20]] + ids_b, [21, 8], [1, 8], [TABLE, [11]])
    ref_a = hf_logits[20:21]
    assert (mixed[:1] - ref_a).abs().max().item() < _tol(ref_a)
    alone = allocate_kv_caches(model, backend, num_blocks=2, block_size=BLOCK)
    ref_b = _run(model, backend, alone, ids_b, [8], [8], [[1]])
    assert (mixed[1:] - ref_b).abs().max().item() < 1e-4 * max(1.0, ref_b.abs().max().item())


@pytest.mark.slow
def test_forward_rejects_bad_shapes(loaded_model):
    model, backend = loaded_model.model, get_backend("reference")
    caches = allocate_kv_caches(model, backend, num_blocks=2, block_size=BLOCK)
    md = AttentionMetadata.build([2], [2], [[0]], BLOCK)
    with pytest.raises(ValueError):
        model(torch.tensor([1, 2]), torch.tensor([0]), caches, md, backend)
    with pytest.raises(ValueError):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), caches[:3], md, backend)


@pytest.mark.slow
def test_kv_caches_have_the_model_shape(loaded_model):
    model = loaded_model.model
    c = model.config
    assert (c.num_layers, c.cache_kv_heads, c.cache_head_dim, model.dtype) == (30, 3, 64, torch.float32)
    caches = allocate_kv_caches(model, get_backend("reference"), num_blocks=2, block_size=BLOCK)
    assert len(caches) == 30
    assert {(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, c.dtype) for c in caches} == {
        (2, BLOCK, 3, 64, torch.float32)}
    assert all(c.key.numel() == c.value.numel() == 2 * BLOCK * 3 * 64 for c in caches)


# ---- tiny random HF models through the safetensors-directory loader ---------------------------


def _tiny_hf(tmp_path, kind: str):
    """Save a tiny random transformers model of ``kind`` and return (hf_model, directory)."""
    import transformers as tf

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if kind == "qwen2":
        cfg = tf.Qwen2Config(rope_theta=1_000_000.0, **common)
        cls = tf.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(rope_theta=10_000.0, sliding_window=None, head_dim=24, **common)
        cls = tf.MistralForCausalLM
    elif kind == "llama3":
        cfg = tf.LlamaConfig(
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            },
            **{**common, "tie_word_embeddings": True},
        )
        cls = tf.LlamaForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so that mistakes show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path / kind
    model.save_pretrained(out)
    _tiny_tokenizer().save_pretrained(out)
    return model, out


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3"])
def test_tiny_hf_models_match_transformers(tmp_path, kind):
    from pagedkv.model.loader import load_model

    hf, path = _tiny_hf(tmp_path, kind)
    lm = load_model(path)
    assert lm.tokenizer.eos_token == "</s>"
    cfg = lm.config
    assert cfg.architecture == ("llama" if kind == "llama3" else kind)
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.head_dim == (24 if kind == "mistral" else 16)
    if kind == "llama3":
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.tie_word_embeddings
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits[0].float()
    backend = get_backend("reference")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=8, block_size=8)
    table = [5, 0, 3, 7, 1]
    pre = _run(lm.model, backend, caches, ids[0, :37].tolist(), [37], [37], [table], block=8)
    dec = [_run(lm.model, backend, caches, [ids[0, p].item()], [p + 1], [1], [table], block=8) for p in (37, 38, 39)]
    got = torch.cat([pre, *dec])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedkv.model.config import ModelConfig

    params = {
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    hf_cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = ModelConfig.from_hf_config({**hf_cfg.to_dict(), "eos_token_id": 2, "bos_token_id": 1})
    assert ours.rope_scaling["factor"] == 32.0
    torch.testing.assert_close(rope_inv_freq(ours), ref, rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_model_runs_and_mostly_agrees(bundled_gguf, loaded_model, hf_logits, token_ids):
    from pagedkv.model.loader import load_model

    lm = load_model(bundled_gguf, dtype=torch.bfloat16)
    assert lm.model.dtype == torch.bfloat16
    backend = get_backend("reference")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=10, block_size=BLOCK)
    logits = _run(lm.model, backend, caches, token_ids[:20], [20], [20], [TABLE])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    agree = (logits.argmax(-1) == hf_logits[:20].argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
