"""gpt-oss shapes for ``pagedkv bench models`` (:mod:`pagedkv.bench.models.make`): the tensors,
metadata and tensor types of llama.cpp's ``gpt-oss`` architecture as its converter
(``conversion/gpt_oss.py``, ``GptOssModel``, in the llama-cpp-python 0.3.36 sdist) and
``llama-quantize MXFP4_MOE`` write them (``src/llama-quant.cpp``: expert tensors MXFP4, every
other weight Q8_0; ``src/models/openai-moe.cpp`` reads them), the shape ggml-org's
``gpt-oss-20b-mxfp4.gguf`` has.

Per layer: ``attn_norm``, ``attn_q`` / ``attn_k`` / ``attn_v`` with biases, ``attn_output``
with its bias, ``attn_sinks`` ``[heads]``, ``post_attention_norm``, the router ``ffn_gate_inp``
``[E, H]`` with its bias ``[E]``, and ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``,
``ffn_down_exps`` ``[E, H, I]`` with biases ``[E, I]`` / ``[E, H]`` (numpy order); keys
``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``attention.sliding_window`` (llama.cpp's pattern: even layers sliding, odd layers full, as
transformers' ``layer_types``), ``key_length`` / ``value_length`` and YaRN
(``rope.scaling.*``: type, factor, original context, beta fast / slow).

The experts are written as **random MXFP4 codes** (:func:`random_mxfp4`): every block's scale
byte is 120 (``2^(120 - 128)`` per unit of ggml's ``kvalues_mxfp4``, twice the E2M1 values,
so values of std ~0.023 like the other tensors' 0.02) and its 16 code bytes uniform. gguf-py's MXFP4 quantiser runs ~10 M values/s
here (16 minutes for a half-depth gpt-oss-20b's 9.6 G expert values), and no f16 file of the
shape is ever written (a half-depth one would be ~21 GB): speed does not depend on the values.
Q8_0 tensors go through gguf-py's quantiser (~190 M values/s); norms, biases, sinks and the
router are F32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCH = "gpt-oss"
#: the file type of llama-quantize's MXFP4_MOE (gguf ``LlamaFileType.MOSTLY_MXFP4_MOE``)
FILE_TYPE = 38
MXFP4_SCALE = 120  # E8M0: 2^(120 - 128) = 1/256 per unit of kvalues_mxfp4 (std ~5.85 over uniform codes)
YARN = {"factor": 32.0, "original_context": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def tensors(s: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, numpy shape)`` of every tensor of the ``gpt-oss`` shape ``s``, in llama.cpp's
    names and its converter's order."""
    h, d, e, f = s.hidden, s.head_dim, s.experts, s.expert_ffn
    q, kv = s.heads * d, s.kv_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, h))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_q.bias", (q,)),
                (b + "attn_k.weight", (kv, h)), (b + "attn_k.bias", (kv,)), (b + "attn_v.weight", (kv, h)),
                (b + "attn_v.bias", (kv,)), (b + "attn_output.weight", (h, q)), (b + "attn_output.bias", (h,)),
                (b + "attn_sinks.weight", (s.heads,)), (b + "post_attention_norm.weight", (h,)),
                (b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_inp.bias", (e,)),
                (b + "ffn_gate_exps.weight", (e, f, h)), (b + "ffn_gate_exps.bias", (e, f)),
                (b + "ffn_up_exps.weight", (e, f, h)), (b + "ffn_up_exps.bias", (e, f)),
                (b + "ffn_down_exps.weight", (e, h, f)), (b + "ffn_down_exps.bias", (e, h))]
    out += [("output_norm.weight", (h,)), ("output.weight", (s.vocab, h))]
    return out


def tensor_type(name: str, shape: tuple[int, ...]) -> str:
    """The type ``llama-quantize MXFP4_MOE`` gives tensor ``name``: ``"mxfp4"`` (the experts),
    ``"f32"`` (1-D tensors, biases, the router: llama.cpp's converter and quantiser keep them),
    else ``"q8_0"``."""
    if name.endswith("_exps.weight"):
        return "mxfp4"
    if len(shape) == 1 or name.endswith(".bias") or name.endswith("ffn_gate_inp.weight"):
        return "f32"
    return "q8_0"


def random_mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols / 32 * 17]`` uint8 MXFP4 blocks (GGML's ``block_mxfp4``: the E8M0 scale
    byte, then 16 bytes of two 4-bit E2M1 codes each) with scale byte :data:`MXFP4_SCALE` and
    uniform random codes. Raises ``ValueError`` when ``cols`` is not a multiple of 32."""
    if cols % 32:
        raise ValueError(f"{cols} columns is not a multiple of MXFP4's block of 32")
    out = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    out[:, :, 0] = MXFP4_SCALE
    return out.reshape(rows, cols // 32 * 17)


def add_metadata(w: Any, s: Any) -> None:
    """The ``gpt-oss.*`` keys of ``s`` beyond the ones every mixture-of-experts shape writes
    (head and expert sizes): the window and YaRN (module doc); ``w`` a ``GGUFWriter``."""
    from gguf import RopeScalingType

    w.add_sliding_window(s.sliding_window)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN["factor"])
    w.add_rope_scaling_orig_ctx_len(YARN["original_context"])
    w.add_rope_scaling_yarn_beta_fast(YARN["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(YARN["beta_slow"])
