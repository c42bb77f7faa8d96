"""The second bundled real model, Gemma-3-270M Q4_K_M (``--model gemma-3-270m``), against
transformers on the same GGUF (fp32 weights on both sides, greedy).

The file is the base model: plain completions, ``<bos>`` first (the GGUF's
``tokenizer.ggml.add_bos_token``), no chat template. Its K-quant tensors (Q4_K, Q5_0, Q6_K,
Q8_0) are dequantised by the ``gguf`` package on both sides, so the weights are the same and
the tokens must be too: across block sizes, chunked prefill, preemption and prefix hits, and on
a prompt longer than the 512-token window of its 15 sliding layers, where those layers' groups
free their out-of-window blocks and the request holds what the planner says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.errors import InvalidRequestError
from pagedkv.kv import check_invariants

NEW = 12
PROMPTS = [  # held out: no test tunes anything on them
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
]
TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"


@pytest.fixture(scope="module")
def refs(gemma3_hf, gemma3_loaded):
    """transformers' greedy tokens for each prompt (ids with <bos>)."""
    tok = gemma3_loaded.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return ids, [_hf_greedy(gemma3_hf, i) for i in ids]


def _hf_greedy(hf, ids, n=NEW):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, num_beams=1)
    toks = out[0, len(ids):].tolist()
    return toks[: toks.index(1) + 1] if 1 in toks else toks  # the engine stops at <eos> (1)


def _greedy(llm, prompts, n=NEW):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3_is_the_hybrid_base_model_the_file_describes(gemma3_loaded):
    c, tok = gemma3_loaded.config, gemma3_loaded.tokenizer
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert c.layer_windows() == ([512] * 5 + [None]) * 3
    assert (c.rope_theta, c.rope_local_theta, c.norm_offset, c.attn_scale) == (1e6, 1e4, 1.0, 0.0625)
    assert tok("The capital of France is")["input_ids"] == [2, 818, 5279, 529, 7001, 563]
    assert not getattr(tok, "chat_template", None)


def test_gemma3_greedy_equals_transformers_across_block_sizes_and_chunks(gemma3_loaded, refs):
    ids, want = refs
    assert all(len(set(r)) >= 5 for r in want)  # sensible text, not one repeated token
    for kw in ({"block_size": 16}, {"block_size": 32, "max_num_batched_tokens": 4}):  # 4: chunked prefill
        llm = LLM(gemma3_loaded, num_blocks=64, debug_invariants=True, **kw)
        assert _greedy(llm, PROMPTS) == want, kw  # text prompts: the engine adds <bos> itself
        assert llm.engine.kv.num_used_blocks == 0


def test_gemma3_preemption_and_prefix_hits_keep_the_tokens(gemma3_hf, gemma3_loaded, refs):
    ids, want = refs
    small = LLM(gemma3_loaded, block_size=4, num_blocks=48, max_num_batched_tokens=8)
    assert _greedy(small, ids) == want
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert small.engine.kv.num_used_blocks == 0
    shared = "A paged KV cache stores keys and values in fixed-size blocks. "
    prompts = [shared + p for p in PROMPTS[:2]]
    tok = gemma3_loaded.tokenizer
    want2 = [_hf_greedy(gemma3_hf, tok(p)["input_ids"]) for p in prompts]
    llm = LLM(gemma3_loaded, block_size=4, num_blocks=128, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)[0]
    second = llm.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == want2
    n_shared = len(tok(shared)["input_ids"])  # <bos> + the shared sentence
    assert second.num_cached_tokens == (n_shared // 4) * 4 > 0


def test_gemma3_long_prompt_frees_window_blocks_and_holds_the_planned_number(gemma3_hf, gemma3_loaded):
    tok = gemma3_loaded.tokenizer
    ids = tok(TEXT.read_text())["input_ids"][:700]  # longer than the 512-token window
    want = _hf_greedy(gemma3_hf, ids, n=4)
    llm = LLM(gemma3_loaded, block_size=16, num_blocks=512, max_num_batched_tokens=256, debug_invariants=True)
    eng, kv = llm.engine, llm.engine.kv
    eng.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=4))
    held, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o.outputs[0].token_ids
        if "long" in kv.tables:
            held.append((kv.num_tokens("long"), sum(kv.held_blocks("long"))))
    assert out == want
    # after each decode step: 3 full layers keep every block, 15 sliding ones only the window's
    # (the request is freed in the step that samples its 4th token: the last one seen computed 701)
    decode = [(n, b) for n, b in held if n > 700]
    assert [n for n, _ in decode] == [701, 702]
    for n_tokens, blocks in decode:
        assert blocks == eng.kv_spec.blocks_per_request(n_tokens, 16) < kv.num_groups * -(-n_tokens // 16)
    assert kv.stats.window_freed_blocks > 0
    assert kv.num_used_blocks == 0
    check_invariants(kv)


def test_gemma3_chat_without_a_template_is_a_clear_error_and_a_given_one_works(gemma3_loaded):
    llm = LLM(gemma3_loaded, num_blocks=32)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    llm2 = LLM(gemma3_loaded, num_blocks=32, chat_template=template)
    ids = llm2.engine.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert ids == gemma3_loaded.tokenizer("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False)["input_ids"]
