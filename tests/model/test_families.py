"""Every model family against Hugging Face transformers on the same tiny random weights (fp32).

For each family a tiny model (3 layers, hidden 64, windows of 6-10 tokens, far shorter than the
35-45 token prompts) is built with transformers from a small config, given non-trivial norms and
biases, and saved with ``save_pretrained``; pagedkv loads the directory. Checked:

* the decoder's logits equal transformers' (eager attention, one forward over the sequence) at
  every position, for a prefill split into chunks that cross blocks and windows, then decode
  steps, through the reference, CPU and Triton (interpreter on CPU) backends (atol = rtol =
  1e-4);
* the engine's greedy tokens equal ``generate``'s (ordinary cache), and the log-probability of
  every generated token equals transformers' (abs 1e-4), with chunked prefill (16-token
  chunks), a prefix-cache hit, and preemption in a pool too small for the batch.

Sliding layers get their own KV layer group (``pagedkv.kv.groups``): blocks behind the window
are freed mid-request, so these runs also check that nothing reads a freed block.
"""

from __future__ import annotations

import pytest
import torch

import pagedkv.attention.triton_backend  # noqa: F401 - before transformers imports triton (sets TRITON_INTERPRET=1 without CUDA)
from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.model.loader import load_model
from tests.model.builders import (
    CHUNKS_40, VOCAB, chunked_logits, hf_greedy_logprobs, hf_logits, match, save_tiny, seeded_model,
)
from tests.model.builders import prompt as _prompt

FAMILIES = ["qwen3", "mistral", "phi3", "gemma2", "gemma3"]
BLOCK = 4
NEW = 12


def _hf_config(kind: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "qwen3":  # layers >= max_window_layers slide
        return tf.Qwen3Config(use_sliding_window=True, sliding_window=7, max_window_layers=1, head_dim=16,
                              tie_word_embeddings=False, **common), tf.Qwen3ForCausalLM
    if kind == "mistral":
        return tf.MistralConfig(sliding_window=10, head_dim=24, tie_word_embeddings=False, **common), tf.MistralForCausalLM
    if kind == "phi3":
        return tf.Phi3Config(sliding_window=9, tie_word_embeddings=False, **common), tf.Phi3ForCausalLM
    if kind == "gemma2":  # alternating sliding / full; soft caps small enough to bite
        return tf.Gemma2Config(sliding_window=6, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                               final_logit_softcapping=0.5, **common), tf.Gemma2ForCausalLM
    if kind == "gemma3":  # q/k norms, local RoPE base for the sliding layers
        return tf.Gemma3TextConfig(
            sliding_window=8, head_dim=16, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            **common), tf.Gemma3ForCausalLM
    raise AssertionError(kind)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, transformers model, directory, pagedkv LoadedModel)."""
    kind = request.param
    # non-trivial norms and biases, and scores / logits large enough for the soft caps to bite, so
    # that mistakes show (Gemma scales its tied embeddings itself: more makes it repeat one token)
    embed = () if kind.startswith("gemma") else ("embed_tokens.weight",)
    rules = [(match(has=("norm",), ends=("bias",)), "noise", 0.3),
             (match(has=("q_proj", "k_proj", "qkv_proj"), ends=embed), "mul", 8.0)]
    hf = seeded_model(*_hf_config(kind), rules)
    out = save_tiny(hf, tmp_path_factory.mktemp(kind))
    return kind, hf, out, load_model(out)


def test_config_reads_the_family(family):
    kind, hf, _, lm = family
    c = lm.config
    assert c.architecture == kind
    windows = {"qwen3": [None, 7, 7], "mistral": [10] * 3, "phi3": [9] * 3, "gemma2": [6, None, 6],
               "gemma3": [8, None, 8]}[kind]
    assert c.layer_windows() == windows
    assert c.qk_norm == (kind in ("qwen3", "gemma3"))
    assert (c.attn_logit_softcap, c.final_logit_softcap) == ((3.0, 0.5) if kind == "gemma2" else (None, None))
    assert c.max_position_embeddings == 128  # a window no longer caps the context
    if kind == "gemma3":
        assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)


@pytest.mark.parametrize("backend_name", ["reference", "cpu", "triton"])
def test_logits_equal_transformers_across_blocks_and_windows(family, backend_name):
    kind, hf, _, lm = family
    ids = _prompt(40, 1)
    ref = hf_logits(hf, ids)
    table = [9, 2, 14, 0, 7, 11, 3, 5, 12, 1]  # shuffled physical blocks, 10 x 4 tokens
    # chunks of 13, 11 and 13 tokens (each crossing blocks and every window), then 3 decodes
    got = chunked_logits(lm.model, ids, BLOCK, get_backend(backend_name), CHUNKS_40, table=table, num_blocks=16)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_engine_greedy_tokens_and_logprobs_equal_transformers(family):
    kind, hf, _, lm = family
    shared = _prompt(24, 7)
    prompts = [_prompt(45, 2), _prompt(37, 3), shared + _prompt(11, 4), shared + _prompt(13, 5)]
    refs = hf_greedy_logprobs(hf, prompts, NEW)
    # 16-token chunks; the small pool (4-token blocks; an all-window model holds only ~8 blocks per
    # sequence, so its pool is smaller) cannot hold the first three sequences (47-57 tokens each): the
    # scheduler preempts. Then, in an ample pool, the last prompt hits the 6 blocks it shares with the third
    # (a window group's blocks freed early are the first evicted under pressure, so a tight pool may drop them)
    pool = {"mistral": 12, "phi3": 12}.get(kind, 32)  # 1 full + 2 window layers: three 1-layer groups
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1)
    llm = LLM(lm, block_size=BLOCK, num_blocks=pool, max_num_batched_tokens=16, enable_prefix_caching=True,
              debug_invariants=True)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_used_blocks == 0
    big = LLM(lm, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=True,
              debug_invariants=True)
    assert big.generate(prompts[2:3], params, use_tqdm=False)[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    outs += big.generate(prompts[3:], params, use_tqdm=False)  # its prefix is cached by now
    assert outs[3].num_cached_tokens >= 20
    assert big.engine.kv.num_used_blocks == 0
    for o, (toks, lps) in zip(outs, refs):
        c = o.outputs[0]
        assert c.token_ids == toks
        got = [step[t] for step, t in zip(c.logprobs, toks)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4
