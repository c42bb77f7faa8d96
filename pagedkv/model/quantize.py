"""Turning a float state dict into a weight format (``pagedkv.model.quant``), and installing
a quantised state dict into a ``LlamaForCausalLM``.

* ``gguf_q4_codes``: the stored 4-bit codes, scales and mins of a GGUF's Q4_0/Q4_1 linear
  tensors, fused and un-permuted exactly like their dequantised values
  (``pagedkv.model.weights.gguf_state_dict``), so int4 keeps a Q4 source's codes bit for bit.
* ``quantize_state``: fp32 state (+ those codes) -> the portable state of a format: what the
  weight cache stores and ``install_linears`` reads back.

Only Q4_0/Q4_1 codes are kept (int4, and only if all q/k/v and gate/up parts have them, see
``gguf_q4_codes``); every other GGML type (F32/F16/BF16, Q5/Q8, the K-quants
Q2_K..Q6_K) is requantised from its dequantised fp32 values by the format's ``from_float``
(``Int4Linear.from_float``: Q4_1's min/max rule; ``Int8Linear.from_float``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader
from pagedkv.model.config import ModelConfig
from pagedkv.model.quant import GROUP_SIZE, BF16Linear, Int4Linear, Int8Linear, QuantLinear, module_from_state
from pagedkv.model.weights import StateDict, gguf_blocks, gguf_groups, gguf_state_dict

#: the linear layers of one decoder layer (``pagedkv.model.llama.DecoderLayer``)
LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
#: GGML types whose blocks are (scale, min, 32 codes) in our int4 sense: name -> bytes of (d, m)
_Q4_TYPES = {"Q4_0": 2, "Q4_1": 4}


def linear_prefixes(config: ModelConfig) -> list[str]:
    """State-dict prefixes (``"layers.3.o_proj."``, ..., ``"lm_head."``) of every linear layer
    (MLA layers: their q and ``kv_a`` projections; ``mla.kv_b_proj`` is read as a tensor, never
    quantised); a mixture-of-experts layer's MLP linears are its experts'
    (``"layers.3.mlp.experts.5.gate_up_proj."``, shared experts too; the router stays in the
    model dtype)."""
    attn = LAYER_LINEARS[:2]
    if config.is_mla:
        q = ("mla.q_proj",) if config.q_lora_rank is None else ("mla.q_a_proj", "mla.q_b_proj")
        attn = (*q, "mla.kv_a_proj_with_mqa", "o_proj")
    out = []
    for i in range(config.num_layers):
        out += [f"layers.{i}.{name}." for name in attn]
        if not config.is_moe_layer(i):
            out += [f"layers.{i}.{name}." for name in LAYER_LINEARS[2:]]
            continue
        experts = [f"experts.{e}" for e in range(config.num_experts)]
        experts += ["shared"] if config.num_shared_experts else []
        out += [f"layers.{i}.mlp.{x}.{name}." for x in experts for name in LAYER_LINEARS[2:]]
    return out + ["lm_head."]


def _q4_rows(qtype_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored Q4_0/Q4_1 blocks ``raw`` ``[rows, row_bytes]`` -> float32 ``[rows, K + 2K/32]``:
    codes 0..15 (columns ``0..K-1``), then the groups' scales, then their mins (``w = scale *
    q + min``). One row stays one row, so the loader's row permutation and fusion apply."""
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    groups = k // GROUP_SIZE
    dm = _Q4_TYPES[qtype_name]
    blocks = raw.reshape(rows, groups, dm + GROUP_SIZE // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., dm:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, k).astype(np.float32)
    if qtype_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # Q4_0: w = d * (q - 8)
        m = -8.0 * d
    return torch.from_numpy(np.concatenate([codes, d, m], axis=-1))


def has_q4_linears(header: GGUFHeader) -> bool:
    """Whether every layer's attention and MLP matrices are stored as Q4_0/Q4_1, the codes
    ``weights="int4"`` keeps as they are. ``weights="auto"`` picks int4 only then: requantising
    other types (K-quants, Q5_0, Q8_0) to int4 was measured outside int4's perplexity bound on
    Gemma-3-270M Q4_K_M (+126% vs fp32; int8 +1.5%, docs/benchmarks/weights_quality.md#gemma-3-270m)."""
    import gguf

    parts = [t for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return bool(parts) and all(gguf.GGMLQuantizationType(t.ggml_type).name in _Q4_TYPES for t in parts)


def q4_code_names(header: GGUFHeader, config: ModelConfig) -> set[str]:
    """GGUF names of the matrices whose stored Q4_0/Q4_1 codes ``weights="int4"`` keeps: every
    2-D Q4_0/Q4_1 tensor, but only when every layer's q/k/v and gate/up parts are of those
    types (a fused tensor is one format); else the empty set (int4 then quantises every layer
    from the dequantised values)."""
    import gguf

    names = [t.name for t in header.tensors
             if len(t.shape) == 2 and gguf.GGMLQuantizationType(t.ggml_type).name in _Q4_TYPES]
    try:
        gguf_groups(names, config)
    except ConfigError:  # some fused part is stored in another type
        return set()
    return set(names)


def gguf_q4_codes(path: Path, header: GGUFHeader, config: ModelConfig) -> StateDict:
    """``{"layers.{i}.qkv_proj.weight": float32 [rows, K + 2K/32], ...}`` (see ``_q4_rows``)
    for the linear weights of ``q4_code_names``, under our fused names (``lm_head.weight`` or,
    tied, ``embed_tokens.weight`` for the head), the whole model at once: the reference form of
    what ``pagedkv.model.gguf_formats`` streams."""
    keep = q4_code_names(header, config)
    infos = [t for t in header.tensors if t.name in keep]

    def read():
        for info, qtype, raw in gguf_blocks(path, infos):
            t = _q4_rows(qtype.name, raw, tuple(info.shape))
            del raw
            yield info.name, t

    return gguf_state_dict(path, header, config, tensors=read()) if keep else {}


def quantize_state(state: StateDict, config: ModelConfig, fmt: str, q4_codes: StateDict | None = None) -> StateDict:
    """The portable state of format ``fmt`` (bf16 | int8 | int4) from an fp32 ``state`` in our
    names: every linear layer replaced by its module's buffers (``Int8Linear.qweight``/
    ``scale``, ``Int4Linear.qcodes``/``scale``/``min``, ``BF16Linear.weight``), the head
    included (``lm_head.*``, also when tied to ``embed_tokens``); everything else as is.
    ``q4_codes`` (``gguf_q4_codes``): int4 takes these codes where present and otherwise
    requantises the fp32 weight with ``Int4Linear.from_float`` (a K-quant source included); a
    head without stored 4-bit codes is int8 in int4 (``Int8Linear.from_float``, whatever its
    source type, a 4-bit K-quant head included). Raises ``ConfigError`` for a missing linear
    weight or an unknown ``fmt``."""
    q4_codes = q4_codes or {}
    out = dict(state)
    for prefix in linear_prefixes(config):
        source = prefix + "weight"
        if source not in state and prefix == "lm_head." and config.tie_word_embeddings:
            source = "embed_tokens.weight"
        if source not in state:
            raise ConfigError(f"weights: {prefix}weight is missing")
        weight = state[source]
        out.pop(prefix + "weight", None)
        bias = out.pop(prefix + "bias", None)
        module = quantize_linear(weight, bias, fmt, q4_codes.get(source), head=prefix == "lm_head.")
        for name, t in module.state_dict().items():
            out[prefix + name] = t
    return out


def quantize_linear(weight: torch.Tensor | None, bias: torch.Tensor | None, fmt: str,
                    codes: torch.Tensor | None = None, head: bool = False) -> QuantLinear:
    """One linear layer in format ``fmt`` (bf16 | int8 | int4) from its float ``weight`` ``[out,
    in]``, or for int4 from stored 4-bit ``codes`` (``_q4_rows``'s float32 ``[out, in + 2 in /
    32]``; ``weight`` may then be ``None``). ``head``: the LM head, which int4 without codes
    makes int8. Every format is per output row, so rows converted apart and stacked equal the
    whole matrix converted. Raises ``ConfigError`` for an unknown ``fmt``."""
    if fmt == "int4" and codes is not None:
        k = codes.shape[1] * GROUP_SIZE // (GROUP_SIZE + 2)
        groups = k // GROUP_SIZE
        return Int4Linear.from_codes(codes[:, :k], codes[:, k:k + groups], codes[:, k + groups:], bias)
    if weight is None:
        raise ConfigError(f"weights: {fmt!r} needs the float weight")
    if fmt == "bf16":
        return BF16Linear(weight, bias)
    if fmt == "int8" or (fmt == "int4" and head):
        return Int8Linear.from_float(weight, bias)
    if fmt != "int4":
        raise ConfigError(f"weights: cannot quantise to {fmt!r}")
    return Int4Linear.from_float(weight, bias)


def install_linears(net: nn.Module, state: StateDict, route: str | None = None, consume: bool = False) -> set[str]:
    """Replace each linear layer of ``net`` (a ``LlamaForCausalLM``) whose ``state`` entries
    are quantised by the module they describe, its route prepared (``route`` None: the CPU's
    ``auto_route``). Returns the state keys these modules took (they are not to be converted to
    the model dtype). ``consume``: those entries leave ``state`` as each module is installed, so
    codes a module drops once packed (``QuantLinear._drop_codes``) are freed layer by layer."""
    from pagedkv.model.quant import shapes_only

    taken: set[str] = set()
    for prefix in linear_prefixes(net.config):
        module = module_from_state(state, prefix)
        if module is None:
            continue
        parent_name, _, attr = prefix[:-1].rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        setattr(parent, attr, module.prepare(route))
        with shapes_only():
            names = [prefix + name for name in module.state_dict()]
        taken.update(names)
        if consume:
            for name in names:
                state.pop(name, None)
    return taken
