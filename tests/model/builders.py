"""Tiny seeded random-weight models, their GGUF files and transformers references, shared by the
model tests (import as ``from tests.model.builders import ...``; not a test file: pytest
collects only ``test_*.py``).

* models: :func:`seeded_model` builds an fp32 transformers ``*ForCausalLM`` on CPU under
  ``torch.manual_seed(seed)`` (default 0), then makes its weights non-trivial by :func:`perturb`
  rules (the first matching rule per parameter, in ``named_parameters`` order, so the global RNG
  draws are those of the per-file copies this module replaced); :func:`moe_config` /
  :func:`deepseek_config` are the tiny MoE and DeepSeek families (3 layers, hidden 64, 4 heads);
  :func:`save_tiny` writes an HF directory (``config.json`` + ``model.safetensors`` + the
  97-word tokenizer of ``test_llama.py``);
* GGUF files: :func:`write_moe_gguf` / :func:`write_deepseek_gguf` / :func:`write_gptoss_gguf`
  write what llama-cpp-python 0.3.36's ``convert_hf_to_gguf.py`` writes for these models
  (``test_gguf_moe.py`` / ``test_gguf_deepseek.py`` / ``test_gguf_gptoss.py``) and leave the
  transformers model holding the file's dequantised values;
* references and runs: transformers' logits and greedy tokens (:func:`hf_logits`,
  :func:`hf_greedy`, ...), a pagedkv decoder's chunked logits, and ``check_*`` scenarios that
  assert (rewritten by pytest: ``tests/conftest.py`` registers this module);
* kernels: :func:`qmm_ops`, the ``qmm`` build a kernel test names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from pagedkv.attention.base import AttentionMetadata
from pagedkv.testing.caches import allocate_kv_caches

VOCAB = 97  # the tiny tokenizer's vocabulary (``test_llama._tiny_tokenizer``)
RANK, ROPE, NOPE, VDIM, MOE_I = 32, 8, 16, 24, 32  # DeepSeek: kv_lora_rank, rope / nope / v head dims, expert width
E, K, I_EXP = 8, 2, 32  # the MoE GGUFs (``moe_gguf_model``): experts, routed per token, expert width
QLORA = 64  # the DeepSeek-V2 GGUF's q_lora_rank: its q_b rows are whole Q8_0 blocks
CHUNKS_40 = ((0, 13), (13, 24), (24, 37), (37, 38), (38, 39), (39, 40))  # 3 prefill chunks, 3 decode steps

#: ``(predicate on the parameter name, op, value)``; op ``"mul"``: ``p *= value``; ``"noise"``:
#: ``p += randn_like(p) * value``; ``"randn"``: ``p = randn_like(p) * value``
Rule = tuple[Callable[[str], bool], str, float]


def qmm_ops(build: str):
    """``pagedkv.ops.qmm``'s kernels: ``"default"`` (this host's build), ``"tiles-ymm"`` (the
    8-column tiles AVX-VNNI CPUs run) or a ``-march`` target (``x86-64-v3``: AVX2; ``x86-64``:
    plain C; ``skylake-avx512``: AVX-512 without VNNI or BF16)."""
    from pagedkv.ops import qmm

    if build == "default":
        got = qmm.get()
        assert got is not None, qmm.build_error()
        return got
    return qmm.build(None, ["QMM_TILE_YMM"]) if build == "tiles-ymm" else qmm.build(build)


def match(*, has: Sequence[str] = (), ends: Sequence[str] = ()) -> Callable[[str], bool]:
    """A rule predicate: true where the name contains one of ``has`` or ends with one of ``ends``."""
    return lambda name: any(k in name for k in has) or name.endswith(tuple(ends))


NORM_NOISE: Rule = (match(has=("norm",)), "noise", 0.3)


def perturb(hf: torch.nn.Module, rules: Sequence[Rule]) -> None:
    """Apply to each of ``hf``'s parameters the first of ``rules`` whose predicate takes its name
    (in place, under ``no_grad``; ``"noise"`` / ``"randn"`` draw from the global RNG). An
    unknown op raises ``ValueError``."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            for pred, op, value in rules:
                if not pred(name):
                    continue
                if op == "mul":
                    p.mul_(value)
                elif op == "noise":
                    p.add_(torch.randn_like(p) * value)
                elif op == "randn":
                    p.copy_(torch.randn_like(p) * value)
                else:
                    raise ValueError(f"unknown op {op!r}")
                break


def seeded_model(cfg, cls, rules: Sequence[Rule] = (), *, seed: int = 0, eager: bool = True):
    """``cls(cfg)`` (a transformers ``*ForCausalLM``, fp32, eval mode) initialised under
    ``torch.manual_seed(seed)``, then :func:`perturb` ed by ``rules``; ``eager``: set
    ``cfg._attn_implementation = "eager"`` first (left as is when false). Returns the model."""
    if eager:
        cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    perturb(hf, rules)
    return hf


def save_tiny(hf, out: Path) -> Path:
    """``hf.save_pretrained(out)`` plus the 97-word tokenizer of ``test_llama.py``; returns ``out``."""
    from tests.model.test_llama import _tiny_tokenizer

    hf.save_pretrained(out)
    _tiny_tokenizer().save_pretrained(out)
    return out


def prompt(n: int, seed: int, low: int = 3, high: int = VOCAB) -> list[int]:
    """``n`` token ids uniform in ``[low, high)`` from ``torch.Generator().manual_seed(seed)``."""
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the families' configs and models ---------------------------------------------------------

def moe_config(kind: str, *, vocab: int = VOCAB, special: tuple[int, int, int] = (1, 2, 0), **kw):
    """``(config, model class)`` of the tiny ``qwen3_moe`` (8 experts of width 32, head_dim 16,
    layer 1 dense through ``mlp_only_layers``, renormalised top-2) or ``mixtral`` (8 experts of
    width ``intermediate_size`` 96, no window): 3 layers, hidden 64, 4 heads over 2 KV heads,
    256 positions; ``special``: (bos, eos, pad) ids; ``kw``: config keys over these defaults.
    Another ``kind`` raises ``AssertionError``."""
    import transformers as tf

    bos, eos, pad = special
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=pad, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**dict(intermediate_size=96, num_experts=8, moe_intermediate_size=32, head_dim=16,
                                           mlp_only_layers=[1], norm_topk_prob=True), **kw}, **common), \
            tf.Qwen3MoeForCausalLM
    if kind == "mixtral":
        return tf.MixtralConfig(**{**dict(intermediate_size=96, num_local_experts=8, sliding_window=None), **kw},
                                **common), tf.MixtralForCausalLM
    raise AssertionError(kind)


def moe_rules(lm_head: float | None = None) -> list[Rule]:
    """The MoE families' weights: norms + N(0, 0.3), q/k projections and embeddings x 8, routers
    (``gate.weight``) x 20 for decisive choices, and ``lm_head`` x ``lm_head`` when given."""
    rules = [NORM_NOISE, (match(has=("q_proj", "k_proj"), ends=("embed_tokens.weight",)), "mul", 8.0),
             (match(ends=("gate.weight",)), "mul", 20.0)]
    return rules + [(match(ends=("lm_head.weight",)), "mul", lm_head)] if lm_head else rules


def deepseek_config(kind: str, *, vocab: int = VOCAB, special: tuple[int, int, int] = (1, 2, 0),
                    v2: dict | None = None, v3: dict | None = None, **extra):
    """``(config, model class)`` of the tiny DeepSeek-V2 / V3: 3 layers (layer 0 dense MLP of 96,
    ``first_k_dense_replace`` 1), hidden 64, 4 heads, MLA ``kv_lora_rank`` 32 / rope 8 / nope 16 /
    v 24, 8 experts of width 32 in 2 groups (1 chosen), top-2, init range 0.1. V2: ``q_lora_rank``
    48, ``group_limited_greedy``, 2 shared experts, x 1.5, ``norm_topk_prob`` true; V3: no
    ``q_lora_rank``, 1 shared expert, ``rope_interleave``. ``v2`` / ``v3``: keys over that
    kind's defaults; ``extra``: keys for both; ``special``: (bos, eos, pad). Another ``kind``
    raises ``AssertionError``."""
    import transformers as tf

    bos, eos, pad = special
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad, initializer_range=0.1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
        v_head_dim=VDIM, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=MOE_I, n_group=2, topk_group=1, tie_word_embeddings=False, **extra,
    )
    if kind == "deepseek_v2":
        own = dict(q_lora_rank=48, topk_method="group_limited_greedy", n_shared_experts=2, routed_scaling_factor=1.5,
                   norm_topk_prob=True)
        return tf.DeepseekV2Config(**{**own, **(v2 or {})}, **common), tf.DeepseekV2ForCausalLM
    if kind == "deepseek_v3":
        own = dict(q_lora_rank=None, n_shared_experts=1, rope_interleave=True)
        return tf.DeepseekV3Config(**{**own, **(v3 or {})}, **common), tf.DeepseekV3ForCausalLM
    raise AssertionError(kind)


def deepseek_model(kind: str, *, scale: float = 3.0, lm_head: float | None = None, **config):
    """:func:`deepseek_config` (``config``: its keywords) built by :func:`seeded_model` (seed 0,
    eager): norms + N(0, 0.3), the attention projections and embeddings x ``scale``, routers
    (``mlp.gate.weight``) x 10, ``lm_head`` x ``lm_head`` when given; V3's
    ``e_score_correction_bias`` (zeros in transformers) N(0, 0.5) in the MoE layers so it
    changes choices. Returns the transformers model."""
    cfg, cls = deepseek_config(kind, **config)
    big = ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")
    rules = [NORM_NOISE, (match(has=big), "mul", scale), (match(ends=("mlp.gate.weight",)), "mul", 10.0)]
    if lm_head:
        rules.append((match(ends=("lm_head.weight",)), "mul", lm_head))
    hf = seeded_model(cfg, cls, rules)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            if kind == "deepseek_v3":
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    return hf


#: gpt-oss's weights: non-trivial norms, sinks and biases, decisive routers, experts big enough
#: that the SwiGLU clamp (limit 7) bites
GPTOSS_RULES: list[Rule] = [
    NORM_NOISE, (match(ends=("sinks",)), "randn", 2.0),
    (match(has=("q_proj.weight", "k_proj.weight"), ends=("embed_tokens.weight",)), "mul", 8.0),
    (match(has=("router",)), "mul", 20.0), (match(ends=("bias",)), "randn", 0.1),
    (match(has=("experts",)), "mul", 10.0), (lambda name: name == "lm_head.weight", "mul", 10.0)]


def gptoss_config(*, vocab: int = VOCAB, special: tuple[int, int, int] = (1, 2, 0), **kw):
    """``(config, model class)`` of the tiny gpt-oss: 3 layers (window 8, full, window 8), hidden
    64, 4 heads of 16 over 2 KV heads, 4 experts of width 32 (``intermediate_size``), top-2, YaRN
    factor 4 over 64 positions (base 150000, ``truncate: false`` as gpt-oss's config); ``kw``:
    keys over these; ``special``: (bos, eos, pad)."""
    import transformers as tf

    bos, eos, pad = special
    own = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=64, rope_theta=150000.0),
    )
    return tf.GptOssConfig(**{**own, **kw}), tf.GptOssForCausalLM


# --- references and runs ---------------------------------------------------------------------

def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits ``[len(ids), vocab]`` of one forward over ``ids``."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, prompts: list[list[int]], new: int, pad_token_id: int = 0) -> list[list[int]]:
    """transformers' greedy ``generate`` (ordinary cache, one prompt at a time): the ``new``
    token ids after each prompt (``new`` of them unless ``hf.generation_config`` stops at eos)."""
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=pad_token_id)
        refs.append(out[0, len(p):].tolist())
    return refs


def hf_greedy_logprobs(hf, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """As :func:`hf_greedy` (pad id 0), with each generated token's log-probability under
    transformers' fp32 logits: ``[(token ids, log-probabilities)]`` per prompt."""
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, num_beams=1, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        toks = out.sequences[0, len(p):].tolist()
        refs.append((toks, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]))
    return refs


def margin_prompts(hf, new: int, margin: float, count: int = 2, tries: int = 20) -> tuple[list, list]:
    """The first ``count`` of ``tries`` seeded 10-token prompts (ids in ``[0, 256)``, seeds 0..)
    whose greedy path in transformers keeps its top two logits more than ``margin`` apart for
    all ``new`` steps; returns ``(prompts, their generated ids)`` (fewer when too few pass)."""
    prompts, refs = [], []
    for seed in range(tries):
        p = prompt(10, seed, 0, 256)
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=new, pad_token_id=hf.config.pad_token_id, output_logits=True,
                          return_dict_in_generate=True)
        if min((lg[0].topk(2).values[0] - lg[0].topk(2).values[1]).item() for lg in out.logits) > margin:
            prompts.append(p)
            refs.append(out.sequences[0, len(p):].tolist())
        if len(prompts) == count:
            break
    return prompts, refs


def chunked_logits(net, ids: list[int], block: int, backend, chunks=CHUNKS_40, table: list[int] | None = None,
                   num_blocks: int | None = None) -> torch.Tensor:
    """``net``'s (a pagedkv decoder) logits ``[chunks[-1][1], vocab]`` over ``ids`` run chunk by
    chunk (``(start, end)`` pairs) on one fresh paged cache of ``block``-token blocks. Default
    table: the ``ceil(len(ids) / block)`` highest of ``blocks + 3`` physical blocks, reversed."""
    if table is None:
        blocks = -(-len(ids) // block)
        num_blocks, table = blocks + 3, list(range(blocks + 3))[::-1][:blocks]
    caches = allocate_kv_caches(net, backend, num_blocks=num_blocks, block_size=block)
    got = []
    for start, end in chunks:
        md = AttentionMetadata.build([end], [end - start], [table], block)
        with torch.inference_mode():
            got.append(net.compute_logits(net(torch.tensor(ids[start:end]), torch.arange(start, end), caches, md,
                                              backend)))
    return torch.cat(got)


def decode_expert_calls(net, layers, ids: list[int], backend, shared: bool = False):
    """Hooks the experts (and with ``shared`` the shared expert, recorded as ``"shared"``) of
    ``net.layers[i].mlp`` for ``i`` in ``layers``, runs ``ids[:-1]`` as a prefill and the last id
    as a decode step (block 0 of 16 tokens); returns ``(prefill, decode, routed)``: the experts
    each layer ran per step, and the sorted ids its router chose for the decode token."""
    caches = allocate_kv_caches(net, backend, num_blocks=4, block_size=16)
    calls: dict[int, list] = {i: [] for i in layers}
    routed: dict[int, list[int]] = {}
    handles = []
    for i in calls:
        mlp = net.layers[i].mlp
        for e, expert in enumerate(mlp.experts):
            handles.append(expert.register_forward_hook(lambda m, inp, out, i=i, e=e: calls[i].append(e)))
        if shared:
            handles.append(mlp.shared.register_forward_hook(lambda m, inp, out, i=i: calls[i].append("shared")))
        handles.append(mlp.register_forward_pre_hook(
            lambda m, args, i=i: routed.__setitem__(i, sorted(m.route(args[0])[1].flatten().tolist()))))
    n = len(ids) - 1
    try:
        with torch.inference_mode():
            net(torch.tensor(ids[:n]), torch.arange(n), caches, AttentionMetadata.build([n], [n], [[0]], 16), backend)
            prefill = {i: list(v) for i, v in calls.items()}
            for v in calls.values():
                v.clear()
            net(torch.tensor(ids[n:]), torch.tensor([n]), caches, AttentionMetadata.build([n + 1], [1], [[0]], 16),
                backend)
    finally:
        for h in handles:
            h.remove()
    return prefill, calls, routed


def check_engine_greedy(hf, lm, block: int, pool: int, new: int) -> None:
    """The engine's greedy tokens equal :func:`hf_greedy`'s (``hf.generation_config`` must not stop
    at eos) for 4 prompts of ``VOCAB`` ids (45, 37, and 11 / 13 after a shared 32-token prefix),
    ``new`` tokens each, 16-token prefill chunks, block size ``block``: the first three batched
    in a pool of ``pool`` blocks must preempt and free every block; in a pool of ``512 // block``
    the third gives the same tokens and the fourth hits the prefix it left cached. Raises
    ``AssertionError`` otherwise."""
    from pagedkv import LLM, SamplingParams

    shared = prompt(32, 7)
    prompts = [prompt(45, 2), prompt(37, 3), shared + prompt(11, 4), shared + prompt(13, 5)]
    refs = hf_greedy(hf, prompts, new)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm = LLM(lm, block_size=block, num_blocks=pool, max_num_batched_tokens=16, enable_prefix_caching=True,
              debug_invariants=True)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_used_blocks == 0
    big = LLM(lm, block_size=block, num_blocks=512 // block, max_num_batched_tokens=16, enable_prefix_caching=True,
              debug_invariants=True)
    assert big.generate(prompts[2:3], params, use_tqdm=False)[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    outs += big.generate(prompts[3:], params, use_tqdm=False)  # its 32-token prefix is cached by now
    assert outs[3].num_cached_tokens >= 32 - block
    assert big.engine.kv.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert len({t for r in refs for t in r}) > 12  # not a few tokens repeated


def check_two_greedy_completions(hf, lm, new: int) -> None:
    """``n=2`` greedy sampling of ``prompt(30, 12)`` (4-token blocks, 16-token chunks): both
    completions (forked from the one prefilled prompt) equal :func:`hf_greedy`'s ``new`` tokens
    and every block is freed after. Raises ``AssertionError`` otherwise."""
    from pagedkv import LLM, SamplingParams

    p = prompt(30, 12)
    ref = hf_greedy(hf, [p], new)[0]
    llm = LLM(lm, block_size=4, num_blocks=64, max_num_batched_tokens=16, debug_invariants=True)
    out = llm.generate([p], SamplingParams(n=2, temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert llm.engine.kv.num_used_blocks == 0


# --- GGUF files --------------------------------------------------------------------------------

def gguf_special() -> tuple[int, tuple[int, int, int]]:
    """``(vocab size, (bos, eos, pad))`` of the GGUF tests' byte-level vocabulary
    (``test_gguf_types._vocab``: 256 byte tokens, ``hi``, then bos, eos, pad)."""
    from tests.model.test_gguf_types import _vocab

    n = len(_vocab())
    return n, (n - 3, n - 2, n - 1)


def add_tiny_vocab(w, c, pre: str = "default") -> None:
    """Write the byte-level gpt2 vocabulary of ``test_gguf_types._vocab`` (one merge, the last 3
    tokens control tokens) and ``c``'s bos / eos ids to GGUFWriter ``w``; no bos added; ``pre``:
    the ``tokenizer.ggml.pre`` name (llama.cpp's pre-tokenizer, e.g. gpt-oss's ``gpt-4o``)."""
    from tests.model.test_gguf_types import _vocab

    tokens = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_add_bos_token(False)


def finish_gguf(w) -> None:
    """Write GGUFWriter ``w``'s header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def put_tensor(w, name: str, t: torch.Tensor, *, f32: tuple[str, ...], f16_fallback: bool = False,
               permute_heads: int | None = None, qtype: str = "Q8_0") -> torch.Tensor:
    """Add ``t`` to GGUFWriter ``w`` as tensor ``name``: F32 when 1-D or ``name`` ends with one of
    ``f32``, else ``qtype`` (Q8_0; ``f16_fallback``: F16 where a row is no whole 32-value block;
    a K-quant, which ``gguf`` cannot quantise: random blocks of ``t``'s spread,
    ``test_gguf_types._k_blocks`` seeded by ``name``), its rows in llama.cpp's Q/K order for
    ``permute_heads`` heads when given. Returns the values the file holds (fp32, ``t``'s shape
    and row order)."""
    import zlib

    import gguf

    x = t.detach().float().contiguous().numpy()
    if x.ndim == 1 or name.endswith(f32):
        w.add_tensor(name, x)
        return t
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        from tests.model.test_gguf_types import _k_blocks

        rng = np.random.default_rng(zlib.crc32(name.encode()))
        raw = _k_blocks(qt, int(np.prod(x.shape[:-1])), x.shape[-1], float(x.std()), rng)
        w.add_tensor(name, raw.reshape(*x.shape[:-1], -1), raw_dtype=qt)
        return torch.from_numpy(gguf.dequantize(raw, qt).reshape(x.shape).astype(np.float32))
    if f16_fallback and x.shape[-1] % 32:
        qt = gguf.GGMLQuantizationType.F16
    stored = x
    if permute_heads is not None:
        from tests.model.test_gguf_types import llama_cpp_permute

        stored = llama_cpp_permute(t.detach().float(), permute_heads).numpy()
    w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(stored), qt), raw_dtype=qt)
    # Q8_0 blocks run along a row, so permuting rows commutes with quantising them
    return torch.from_numpy(gguf.dequantize(gguf.quants.quantize(x, qt), qt).reshape(x.shape).astype(np.float32))


def put_experts(name: str, t: torch.Tensor, width: int, put: Callable[[str, torch.Tensor], torch.Tensor]) -> bool:
    """If ``name`` is transformers' stacked ``...mlp.experts.gate_up_proj`` ``[E, 2 width, H]`` or
    ``down_proj`` ``[E, H, width]``, write it as the converter's per-projection tensors through
    ``put(hf_name, values)`` (which returns the stored values) and copy those into ``t``; returns
    whether it was one."""
    if ".mlp.experts." not in name:
        return False
    base = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
    if name.endswith("gate_up_proj"):
        t[:, :width] = put(f"{base}.gate_proj.weight", t[:, :width])
        t[:, width:] = put(f"{base}.up_proj.weight", t[:, width:])
    else:
        t.copy_(put(f"{base}.down_proj.weight", t))
    return True


def moe_gguf_model(arch: str = "qwen3moe", width: int = I_EXP):
    """The tiny MoE model for GGUF architecture ``arch`` (:func:`moe_config` on the GGUF
    vocabulary, seed 0, eager): ``qwen3moe`` (Qwen3-MoE, no dense layer: llama.cpp's qwen3moe
    has none) or ``llama`` (Mixtral, experts ``intermediate_size`` 32 wide, head_dim 16); weights
    as :func:`moe_rules` with ``lm_head`` x 30; ``width``: a ``qwen3moe``'s expert width. Returns
    the transformers model."""
    vocab, special = gguf_special()
    if arch == "qwen3moe":
        cfg, cls = moe_config("qwen3_moe", vocab=vocab, special=special, mlp_only_layers=[], moe_intermediate_size=width)
    else:
        cfg, cls = moe_config("mixtral", vocab=vocab, special=special, intermediate_size=I_EXP, head_dim=16)
    return seeded_model(cfg, cls, moe_rules(lm_head=30.0))


def write_moe_gguf(hf, path: Path, arch: str = "qwen3moe") -> None:
    """``hf`` (a :func:`moe_gguf_model`) as llama.cpp's converter writes ``arch`` to ``path``:
    experts stacked per layer (``ffn_{gate,up}_exps`` ``[E, I, H]``, ``ffn_down_exps``
    ``[E, H, I]``), the router, norms and embeddings F32, other matrices Q8_0 (``llama``: Q/K
    rows permuted for adjacent-pair RoPE), ``{arch}.expert_*`` metadata; ``hf`` then holds the
    file's dequantised values."""
    import gguf

    c = hf.config
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE if arch == "qwen3moe" else gguf.MODEL_ARCH.LLAMA,
                                    c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    for add, v in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                   (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                   (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                   (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                   (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                   (w.add_expert_count, E), (w.add_expert_used_count, K), (w.add_vocab_size, c.vocab_size)):
        add(v)
    width = c.moe_intermediate_size if arch == "qwen3moe" else I_EXP
    if arch == "qwen3moe":  # (the llama converter writes none: its experts are feed_forward_length wide)
        w.add_expert_feed_forward_length(width)
    add_tiny_vocab(w, c)

    def put(hf_name: str, t: torch.Tensor) -> torch.Tensor:
        name = tmap.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        heads = {"attn_q.weight": c.num_attention_heads,
                 "attn_k.weight": c.num_key_value_heads}.get(name.split(".", 2)[-1])
        return put_tensor(w, name, t, f32=("ffn_gate_inp.weight", "token_embd.weight"),
                          permute_heads=heads if arch == "llama" else None)

    state = hf.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if not put_experts(name, t, width, put):
                t.copy_(put(name, t))
    finish_gguf(w)


def deepseek_gguf_model(kind: str, **extra):
    """The tiny DeepSeek-V2 / V3 of the GGUF tests: :func:`deepseek_model` on the GGUF vocabulary
    with V2's ``q_lora_rank`` ``QLORA`` (64), ``norm_topk_prob`` false and ``scoring_func`` set as
    DeepSeek's configs set it, attention projections x 1.5 (scores grow with its 4th power),
    ``lm_head`` x 10; ``extra``: more config keys (e.g. ``rope_parameters``)."""
    vocab, special = gguf_special()
    return deepseek_model(kind, scale=1.5, lm_head=10.0, vocab=vocab, special=special,
                          v2=dict(q_lora_rank=QLORA, norm_topk_prob=False, scoring_func="softmax"),
                          v3=dict(scoring_func="sigmoid"), **extra)


def write_deepseek_gguf(hf, path: Path, legacy: bool = False, gating: int | None = None,
                        drop: str | None = None) -> None:
    """``hf`` (a :func:`deepseek_gguf_model`) as the converter writes llama.cpp's ``deepseek2``
    (``test_gguf_deepseek.py``'s module doc) to ``path``; ``legacy``: the older one-tensor
    ``attn_kv_b`` form; ``gating``: another ``expert_gating_func``; ``drop``: leave out the
    tensors whose names end so. ``hf`` then holds the file's dequantised values."""
    import gguf

    c = hf.config
    v3 = c.model_type == "deepseek_v3"
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    n = c.num_attention_heads
    for add, v in ((w.add_block_count, 3), (w.add_context_length, 256), (w.add_embedding_length, 64),
                   (w.add_feed_forward_length, 96), (w.add_head_count, n), (w.add_head_count_kv, n if legacy else 1),
                   (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_expert_count, E),
                   (w.add_expert_used_count, K), (w.add_expert_group_count, 2), (w.add_expert_group_used_count, 1),
                   (lambda v: w.add_uint32("deepseek2.expert_gating_func", v), gating or (2 if v3 else 1)),
                   (w.add_key_length, NOPE + ROPE if legacy else RANK + ROPE),
                   (w.add_value_length, VDIM if legacy else RANK),
                   (w.add_leading_dense_block_count, 1), (w.add_vocab_size, c.vocab_size)):
        add(v)
    if not v3:
        w.add_q_lora_rank(QLORA)
    w.add_kv_lora_rank(RANK)
    if not legacy:
        w.add_key_length_mla(NOPE + ROPE)
        w.add_value_length_mla(VDIM)
    w.add_expert_feed_forward_length(MOE_I)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if v3:  # written only when true
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(ROPE)
    rp = c.rope_parameters
    if rp.get("rope_type") == "yarn":  # the converter's yarn keys (log multiplier: 0.1 * mscale_all_dim)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    add_tiny_vocab(w, c)

    def put(name: str, t: torch.Tensor) -> torch.Tensor:
        """F32 for norms, the router and the bias; Q8_0, or F16 where a row is no whole block."""
        if drop is not None and name.endswith(drop):
            return t
        return put_tensor(w, name, t, f32=("ffn_gate_inp.weight",), f16_fallback=True)

    def name_of(hf_name: str) -> str:
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")  # -> exp_probs_b.bias
        out = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert out is not None, hf_name
        return out

    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if put_experts(name, t, MOE_I, lambda hf_name, x: put(name_of(hf_name), x)):
                continue
            if name.endswith("kv_b_proj.weight") and not legacy:  # split as the converter splits it
                kv = t.view(n, NOPE + VDIM, RANK)
                k_b = put(name_of(name.replace("kv_b_proj", "k_b_proj")), kv[:, :NOPE].transpose(1, 2))
                v_b = put(name_of(name.replace("kv_b_proj", "v_b_proj")), kv[:, NOPE:])
                t.copy_(torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(t.shape))
            else:
                t.copy_(put(name_of(name), t))
    finish_gguf(w)


def gptoss_gguf_model(hidden: int = 64, width: int = 32, soft: bool = False):
    """The tiny gpt-oss of the GGUF tests: :func:`gptoss_config` on the GGUF vocabulary with
    ``hidden_size`` ``hidden`` and experts of width ``width`` (256 / 256 for K-quant experts),
    seed 0, eager, weights by ``GPTOSS_RULES``; ``soft``: without their q/k projections and
    embeddings x 8 (attention that sharp turns the kernels' int8 activation blocks into flipped
    attention choices, logits up to 17% of their range apart where the soft model stays within
    6%; the soft model's greedy paths repeat a few tokens). Returns the transformers model."""
    vocab, special = gguf_special()
    cfg, cls = gptoss_config(vocab=vocab, special=special, hidden_size=hidden, intermediate_size=width)
    return seeded_model(cfg, cls, [r for r in GPTOSS_RULES if not (soft and r[1:] == ("mul", 8.0))])


def write_gptoss_gguf(hf, path: Path, experts: str = "Q8_0", meta: dict | None = None) -> None:
    """``hf`` (a :func:`gptoss_gguf_model`) as llama.cpp's converter writes ``gpt-oss``
    (``conversion/gpt_oss.py`` from a checkpoint whose experts are not MXFP4, ``--outtype q8_0``)
    to ``path``: ``TextModel``'s keys (``block_count``, ``context_length``, ``embedding_length``,
    ``feed_forward_length``, heads, ``key_length`` / ``value_length``, the yarn
    ``rope.scaling.*`` keys, ``rope.freq_base``, ``layer_norm_rms_epsilon``, ``expert_count`` /
    ``expert_used_count``, ``file_type``) plus ``attention.sliding_window`` and
    ``expert_feed_forward_length``; the gpt2 vocabulary of :func:`add_tiny_vocab` named
    ``gpt-4o`` as gpt-oss's. Tensors in the converter's names: ``attn_sinks.weight``, the
    interleaved ``gate_up_proj`` de-interleaved into ``ffn_gate_exps`` / ``ffn_up_exps``
    ``[E, I, H]`` (+ ``.bias`` ``[E, I]``), ``ffn_down_exps`` ``[E, H, I]`` (+ ``.bias``
    ``[E, H]``) stored as ``experts`` (:func:`put_tensor`'s ``qtype``: Q8_0, Q4_0, MXFP4, Q4_K);
    norms, biases, sinks and the router F32 (the converter's rules), every other matrix Q8_0.
    ``meta``: keys (after ``gpt-oss.``) written with another value, ``None`` to leave one out;
    ``attention.sliding_window_pattern`` too (not written otherwise). ``hf`` then holds the
    file's dequantised values."""
    import gguf

    c, meta = hf.config, dict(meta or {})
    rp = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    keys = {"block_count": (w.add_block_count, c.num_hidden_layers),
            "context_length": (w.add_context_length, c.max_position_embeddings),
            "embedding_length": (w.add_embedding_length, c.hidden_size),
            "feed_forward_length": (w.add_feed_forward_length, c.intermediate_size),
            "attention.head_count": (w.add_head_count, c.num_attention_heads),
            "attention.head_count_kv": (w.add_head_count_kv, c.num_key_value_heads),
            "rope.scaling.type": (w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
            "rope.scaling.factor": (w.add_rope_scaling_factor, rp["factor"]),
            "rope.scaling.original_context_length": (w.add_rope_scaling_orig_ctx_len,
                                                     rp["original_max_position_embeddings"]),
            "rope.scaling.yarn_beta_fast": (w.add_rope_scaling_yarn_beta_fast, rp["beta_fast"]),
            "rope.scaling.yarn_beta_slow": (w.add_rope_scaling_yarn_beta_slow, rp["beta_slow"]),
            "rope.freq_base": (w.add_rope_freq_base, rp["rope_theta"]),
            "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, c.rms_norm_eps),
            "expert_count": (w.add_expert_count, c.num_local_experts),
            "expert_used_count": (w.add_expert_used_count, c.num_experts_per_tok),
            "attention.key_length": (w.add_key_length, c.head_dim),
            "attention.value_length": (w.add_value_length, c.head_dim),
            "attention.sliding_window": (w.add_sliding_window, c.sliding_window),
            "expert_feed_forward_length": (w.add_expert_feed_forward_length, c.intermediate_size),
            "attention.sliding_window_pattern": (w.add_sliding_window_pattern, None),
            "expert_weights_scale": (w.add_expert_weights_scale, None),
            "rope.freq_base_swa": (w.add_rope_freq_base_swa, None)}
    assert set(meta) <= set(keys), sorted(set(meta) - set(keys))
    for key, (add, v) in keys.items():
        v = meta.get(key, v)
        if v is not None:
            add(v)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    add_tiny_vocab(w, c, pre="gpt-4o")
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)

    def put(hf_name: str, t: torch.Tensor, qtype: str = "Q8_0") -> torch.Tensor:
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        return put_tensor(w, name, t.contiguous(), f32=(".bias", "ffn_gate_inp.weight"), qtype=qtype)

    with torch.no_grad():
        for name, t in hf.state_dict().items():
            base = name.rpartition(".")[0] + "."
            if name.endswith("experts.gate_up_proj"):  # [E, H, 2I], gate columns even, up odd
                for j, part in enumerate(("gate_proj", "up_proj")):
                    t[:, :, j::2] = put(f"{base}{part}.weight", t[:, :, j::2].transpose(1, 2), experts).transpose(1, 2)
            elif name.endswith("experts.gate_up_proj_bias"):
                for j, part in enumerate(("gate_proj", "up_proj")):
                    put(f"{base}{part}.bias", t[:, j::2])
            elif name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
                t.copy_(put(f"{base}down_proj.weight", t.transpose(1, 2), experts).transpose(1, 2))
            elif name.endswith("experts.down_proj_bias"):
                put(f"{base}down_proj.bias", t)
            else:  # the converter names the sinks ``.weight``
                t.copy_(put(name + (".weight" if name.endswith("sinks") else ""), t))
    finish_gguf(w)
