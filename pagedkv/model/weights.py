"""Weight formats -> ``(ModelConfig, state dict)`` in our fused layout.

The state dict uses the names and shapes of ``pagedkv.model.llama`` (q/k/v fused into
``qkv_proj``, gate/up into ``gate_up_proj``; no ``lm_head.weight`` when embeddings are tied).

* GGUF files: the header comes from ``pagedkv.gguf_header``; tensors are dequantised to fp32
  with the ``gguf`` package (seconds for the bundled model, hence the weight cache of
  ``pagedkv.model.weight_cache``). llama.cpp's converter permutes the rows of Q and K (and
  their biases) of ``llama``-architecture models so that its RoPE rotates adjacent pairs; we
  undo that so our rotate-half RoPE (the HF convention) applies. ``qwen2`` GGUFs are not
  permuted.
* Hugging Face directories: ``config.json`` (+ ``generation_config.json``) and
  ``*.safetensors`` in the source dtype. Mixture-of-experts layers (``pagedkv.model.moe``) are
  read as transformers 5.24's ``save_pretrained`` writes them, one tensor per expert
  (Qwen3-MoE and DeepSeek-V2/V3 ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``, Mixtral
  ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``; router ``gate.weight``, DeepSeek-V3's
  ``gate.e_score_correction_bias``; DeepSeek's ``mlp.shared_experts.gate_proj``/``up_proj``/
  ``down_proj`` -> ``mlp.shared.gate_up_proj`` / ``down_proj``), or stacked
  (``experts.gate_up_proj`` ``[E, 2 I, H]``, ``experts.down_proj`` ``[E, H, I]``, sliced per
  expert without a copy); gpt-oss's sinks, biases and interleaved experts: ``pagedkv.model.gptoss``.

Every problem raises ``ConfigError`` naming the tensor, file or field.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from pagedkv._bundled import BUNDLED_MODEL_ID, bundled_model_path
from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader, GGUFTensorInfo
from pagedkv.kv.spec import json_object
from pagedkv.model.config import ModelConfig
from pagedkv.model.families import EXPERT_KEYS, GGUF_ARCHITECTURES, GGUF_CONVENTIONS
from pagedkv.model import gptoss

StateDict = dict[str, torch.Tensor]
# Tensors that are fused per layer, keyed by (layer index, part name) until fused.
_Parts = dict[tuple[int, str], torch.Tensor]

# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # the MLP input norm (Gemma: see _gguf_layer_name)
    "attn_output.weight": "o_proj.weight",
    "ffn_down.weight": "down_proj.weight",
    "attn_q_norm.weight": "q_norm.weight",  # Qwen3, Gemma-3
    "attn_k_norm.weight": "k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # Gemma: the attention output's norm
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_qkv.weight": "qkv_proj.weight",  # Phi-3: q, k, v rows fused
    "attn_sinks.weight": "sinks",  # gpt-oss (pagedkv.model.gguf_gptoss)
    "attn_output.bias": "o_proj.bias",
    "ffn_gate_inp.bias": "mlp.router.bias",
}
_GGUF_FUSED_PARTS = (
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
    "ffn_gate.weight", "ffn_up.weight",
)
#: a mixture-of-experts layer's GGUF tensors: the router and the stacked experts ``[E, rows, cols]``
GGUF_EXPERT_PARTS = ("ffn_gate_inp.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.")
_GGUF_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_blocks(path: Path, tensors: list[GGUFTensorInfo]) -> Iterator[tuple[GGUFTensorInfo, Any, np.ndarray]]:
    """Yield ``(info, GGMLQuantizationType, raw uint8 [*outer, row_bytes])`` for each of
    ``tensors``: the stored blocks, memory-mapped (valid until the next item). Raises
    ``ConfigError`` for an unknown GGML type, a row that is not whole blocks or a truncated
    file."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for info in tensors:
            try:
                qtype = gguf.GGMLQuantizationType(info.ggml_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ConfigError(f"weights: {info.name} has unknown GGML type {info.ggml_type}") from None
            *outer, inner = info.shape
            if inner % block:
                raise ConfigError(f"weights: {info.name} row length {inner} not a multiple of {qtype.name} blocks")
            row_bytes = inner // block * type_size
            n_bytes = row_bytes * int(np.prod(outer, dtype=np.int64))
            if info.offset + n_bytes > len(buf):
                raise ConfigError(f"weights: {info.name} extends past the end of the GGUF file (truncated?)")
            raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=info.offset).reshape(*outer, row_bytes)
            yield info, qtype, raw  # the consumer must drop ``raw`` before asking for the next
            del raw


def dequantize_gguf(path: Path, tensors: list[GGUFTensorInfo]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(gguf_name, float32 tensor)`` for each of ``tensors`` (numpy shape order).
    Raises ``ConfigError`` for an unknown or undequantisable GGML type or a truncated file."""
    import gguf

    for info, qtype, raw in gguf_blocks(path, tensors):
        try:
            values = gguf.dequantize(raw, qtype)
        except NotImplementedError:
            raise ConfigError(f"weights: {info.name} uses {qtype.name}, which gguf cannot dequantise") from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(info.shape)
        del raw, values  # the mmap closes after the last tensor only if no view of it is left
        yield info.name, tensor


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation: within each head its converter reorders rows
    (first half, second half) into interleaved pairs; we restore [first half; second half]."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def check_gguf_tensor_types(header: GGUFHeader) -> None:
    """Raise ``ConfigError`` naming the first tensor of ``header`` whose GGML type the ``gguf``
    package cannot dequantise to fp32: an unknown type id, or a known one without a dequantiser
    (e.g. Q8_1, Q8_K, the integer types). Reads no tensor data: each distinct type is probed
    once on one all-zero block."""
    import gguf

    problems: dict[int, str | None] = {}
    for info in header.tensors:
        if info.ggml_type not in problems:
            problems[info.ggml_type] = _gguf_type_problem(gguf, info.ggml_type)
        if problems[info.ggml_type] is not None:
            raise ConfigError(f"weights: {info.name} {problems[info.ggml_type]}")


def _gguf_type_problem(gguf: Any, type_id: int) -> str | None:
    """Why ``gguf`` cannot dequantise GGML type ``type_id`` (the end of an error message), or ``None``."""
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        _block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return f"has unknown GGML type {type_id}"
    try:
        gguf.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return f"uses GGML type {qtype.name} ({type_id}), which the gguf package cannot dequantise"
    return None


def gguf_config(path: Path, header: GGUFHeader, revision: str) -> ModelConfig:
    """``ModelConfig`` of a GGUF file from its header (plus its ``rope_freqs.weight`` values if
    it has one). ``model_id`` is the bundled model's id or the file's stem. Raises
    ``ConfigError`` for a tensor whose GGML type cannot be dequantised
    (``check_gguf_tensor_types``), before reading any tensor, or for unusable metadata."""
    check_gguf_tensor_types(header)
    names = [t.name for t in header.tensors]
    arch = header.metadata.get("general.architecture")
    n_layers = header.metadata.get(f"{arch}.block_count")
    present = {n.split(".", 2)[1] for n in names if n.startswith("blk.")}
    if arch in GGUF_ARCHITECTURES and isinstance(n_layers, int) and n_layers > len(present):  # before per-layer work
        raise ConfigError(f"{arch}.block_count: {n_layers} layers, but the tensor table holds {len(present)} (blk.*)")
    factors = None
    if "rope_freqs.weight" in names:
        info = next(t for t in header.tensors if t.name == "rope_freqs.weight")
        factors = next(dequantize_gguf(path, [info]))[1].tolist()
    try:
        bundled = path.resolve() == bundled_model_path().resolve()
    except ConfigError:
        bundled = False
    return ModelConfig.from_gguf_metadata(
        header.metadata,
        names,
        model_id=BUNDLED_MODEL_ID if bundled else path.stem,
        revision=revision,
        rope_freq_factors=factors,
    )


@dataclass(frozen=True)
class GGUFGroup:
    """One tensor of our state dict made from a GGUF's stored tensors: ``name`` (ours, e.g.
    ``"layers.3.qkv_proj.weight"``); ``parts``: ``(gguf name, heads)`` stacked along the rows in
    this order, ``heads`` the head count whose RoPE rows llama.cpp's converter permuted (undo with
    ``_unpermute_rope_rows``) or ``None``; ``plus_one``: stored as ``1 + w`` (Gemma's norms)."""

    name: str
    parts: tuple[tuple[str, int | None], ...]
    plus_one: bool = False


def gguf_groups(names: Iterable[str], config: ModelConfig) -> list[GGUFGroup]:
    """The state dict of a GGUF whose tensors are ``names``, as groups (``GGUFGroup``): one per
    tensor of ours, q/k/v (and their biases) and gate/up fused, Q/K rows to un-permute where the
    family's converter permuted them, ``rope_freqs.weight`` (folded into the config) and a tied
    ``output.weight`` left out. Raises ``ConfigError`` for an unexpected tensor name, a missing
    part of a fused tensor, or parts of a layer beyond ``config.num_layers``, and for an MLA
    file (``deepseek2``: ``weights="gguf"`` only, ``pagedkv.model.gguf_mla``)."""
    if config.is_mla:
        raise ConfigError("weights: a deepseek2 (multi-head latent attention) GGUF loads with weights='gguf' "
                          "(its stored blocks on the integer kernels) only")
    conv = GGUF_CONVENTIONS[config.architecture]
    permuted, plus_one = conv["rope_rows_permuted"], conv["norms_plus_one"]
    groups: list[GGUFGroup] = []
    parts: dict[tuple[int, str], tuple[str, int | None]] = {}
    for name in names:
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        one = plus_one and name.endswith("norm.weight")
        if name in _GGUF_TOP_NAMES:
            if not (_GGUF_TOP_NAMES[name] == "lm_head.weight" and config.tie_word_embeddings):
                groups.append(GGUFGroup(_GGUF_TOP_NAMES[name], ((name, None),), one))
            continue
        _, idx, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", "")
        ours = _gguf_layer_name(config.architecture, rest)
        if ours is not None:
            groups.append(GGUFGroup(f"layers.{int(idx)}.{ours}", ((name, None),), one))
        elif rest in _GGUF_FUSED_PARTS:
            heads = None
            if permuted and rest.startswith(("attn_q.", "attn_k.")):
                heads = config.num_heads if rest.startswith("attn_q") else config.num_kv_heads
            parts[(int(idx), rest)] = (name, heads)
        elif rest.startswith(GGUF_EXPERT_PARTS):
            raise ConfigError(f"weights: {name}: a mixture-of-experts GGUF loads with weights='gguf' "
                              "(its stored blocks on the integer kernels) only")
        else:  # not blk.<i>.<known part>
            raise ConfigError(f"weights: unexpected GGUF tensor {name!r}")

    def fused(i: int, ours: str, *keys: str) -> GGUFGroup:
        try:
            return GGUFGroup(f"layers.{i}.{ours}", tuple(parts.pop((i, key)) for key in keys))
        except KeyError as e:
            raise ConfigError(f"weights: layer {i} is missing {e.args[0][1]}") from None

    have = {g.name for g in groups}
    for i in range(config.num_layers):  # a checkpoint that stores them fused (Phi-3) has them already
        if f"layers.{i}.qkv_proj.weight" not in have:
            groups.append(fused(i, "qkv_proj.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight"))
        if (i, "attn_q.bias") in parts:
            groups.append(fused(i, "qkv_proj.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias"))
        if f"layers.{i}.gate_up_proj.weight" not in have:
            groups.append(fused(i, "gate_up_proj.weight", "ffn_gate.weight", "ffn_up.weight"))
    if parts:
        raise ConfigError(f"weights: tensors of layers beyond num_layers: {sorted(parts)[:3]}")
    return groups


def gguf_assemble(group: GGUFGroup, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``group``'s tensor from its parts' tensors (in ``group.parts`` order; whole tensors or
    the same rows of each, any per-row form such as ``pagedkv.model.quantize``'s 4-bit codes):
    rows un-permuted, stacked, ``1`` subtracted for ``plus_one``."""
    ts = [t if heads is None else _unpermute_rope_rows(t, heads) for t, (_, heads) in zip(tensors, group.parts)]
    t = ts[0] if len(ts) == 1 else torch.cat(ts)
    return t - 1.0 if group.plus_one else t


def gguf_state_dict(
    path: Path, header: GGUFHeader, config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> StateDict:
    """The whole model at once: every tensor dequantised (fp32) and mapped to our names
    (``gguf_groups``), q/k/v and gate/up fused. ``tensors``: other ``(gguf name, tensor
    [rows, ...])`` to map instead (any per-row form, e.g. the stored 4-bit codes of
    ``pagedkv.model.quantize``). The loader streams instead (``pagedkv.model.gguf_formats``,
    which never holds this fp32 state); this form is its reference in tests."""
    if tensors is None:
        wanted = {n for g in gguf_groups([t.name for t in header.tensors], config) for n, _ in g.parts}
        tensors = dequantize_gguf(path, [t for t in header.tensors if t.name in wanted])
    source = dict(tensors)
    state: StateDict = {}
    for group in gguf_groups(list(source), config):
        state[group.name] = gguf_assemble(group, [source.pop(n) for n, _ in group.parts])
    return state


def _gguf_layer_name(arch: str, rest: str) -> str | None:
    """Our name of GGUF layer tensor ``rest`` (``attn_q_norm.weight``), or ``None`` when it is
    a part to fuse. Gemma's ``ffn_norm`` is the pre-feed-forward norm; Phi-3's ``ffn_up``
    holds gate and up rows fused."""
    if GGUF_CONVENTIONS[arch]["ffn_norm_is_pre_feedforward"] and rest == "ffn_norm.weight":
        return "pre_feedforward_layernorm.weight"
    if GGUF_CONVENTIONS[arch]["fused_gate_up"] and rest == "ffn_up.weight":
        return "gate_up_proj.weight"
    return _GGUF_LAYER_NAMES.get(rest)


def _fuse_layers(state: StateDict, parts: _Parts, config: ModelConfig, names: tuple[str, ...]) -> StateDict:
    """Add every layer's fused ``qkv_proj`` (and bias) and ``gate_up_proj`` to ``state`` from
    ``parts`` (``names``: the q, k, v, gate, up part prefixes of the format); drop a tied
    ``lm_head.weight``. Raises ``ConfigError`` for a missing part or a layer beyond
    ``num_layers``."""
    def cat(i: int, *keys: str) -> torch.Tensor:
        try:
            return torch.cat([parts.pop((i, key)) for key in keys])
        except KeyError as e:
            raise ConfigError(f"weights: layer {i} is missing {e.args[0][1]}") from None

    q, k, v, gate, up = names
    for i in range(config.num_layers):  # a checkpoint that stores them fused (Phi-3, stacked experts) has them already
        for e in range(config.num_experts if config.is_moe_layer(i) else 0):
            if f"layers.{i}.mlp.experts.{e}.gate_up_proj.weight" not in state:
                state[f"layers.{i}.mlp.experts.{e}.gate_up_proj.weight"] = cat(i, f"experts.{e}.gate",
                                                                               f"experts.{e}.up")
        if config.is_moe_layer(i) and config.num_shared_experts and f"layers.{i}.mlp.shared.gate_up_proj.weight" \
                not in state:
            state[f"layers.{i}.mlp.shared.gate_up_proj.weight"] = cat(i, "shared.gate", "shared.up")
        if f"layers.{i}.qkv_proj.weight" not in state and not config.is_mla:
            state[f"layers.{i}.qkv_proj.weight"] = cat(i, f"{q}.weight", f"{k}.weight", f"{v}.weight")
        if (i, f"{q}.bias") in parts:
            state[f"layers.{i}.qkv_proj.bias"] = cat(i, f"{q}.bias", f"{k}.bias", f"{v}.bias")
        if f"layers.{i}.gate_up_proj.weight" not in state and not config.is_moe_layer(i):
            state[f"layers.{i}.gate_up_proj.weight"] = cat(i, f"{gate}.weight", f"{up}.weight")
    _check_leftovers(parts, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _check_leftovers(parts: _Parts, config: ModelConfig) -> None:
    """Raise ``ConfigError`` for checkpoint parts no fused tensor took, naming the config key
    that left them out: experts beyond the expert count, shared experts the config lacks,
    layers beyond the layer count."""
    if not parts:
        return
    left = sorted(parts)
    experts = [p for p in left if p[1].startswith("experts.") and p[0] < config.num_layers]
    if experts and config.is_moe_layer(experts[0][0]):
        key = EXPERT_KEYS.get(config.architecture, ("num_experts",))[0]
        raise ConfigError(f"{key}: the checkpoint has experts beyond {key}={config.num_experts}: {experts[:3]}")
    if experts:
        raise ConfigError(f"weights: expert tensors in layer {experts[0][0]}, a dense layer by the config: {experts[:3]}")
    shared = [p for p in left if p[1].startswith("shared.") and p[0] < config.num_layers]
    if shared:
        raise ConfigError(f"n_shared_experts: the checkpoint has shared experts the config lacks: {shared[:3]}")
    raise ConfigError(f"weights: tensors of layers beyond num_layers: {left[:3]}")


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight",  # Qwen3, Gemma-3
    "self_attn.k_norm.weight": "k_norm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",  # Gemma-2/3
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "self_attn.qkv_proj.weight": "qkv_proj.weight",  # Phi-3 stores them fused
    "mlp.gate_up_proj.weight": "gate_up_proj.weight",
}
_HF_FUSED_PARTS = {
    "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight", "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_proj.bias": "q.bias", "self_attn.k_proj.bias": "k.bias", "self_attn.v_proj.bias": "v.bias",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight",
}
_HF_TOP_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
#: multi-head latent attention (``pagedkv.model.mla``): ``self_attn.X`` -> ``mla.X``
_HF_MLA_NAMES = {f"self_attn.{n}.weight": f"mla.{n}.weight" for n in (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")}
# a mixture-of-experts layer's tensors: (mlp|block_sparse_moe).<what>
_HF_MOE = re.compile(r"(?:mlp|block_sparse_moe)\.(gate\.weight|(?:gate\.)?e_score_correction_bias|"
                     r"experts\.gate_up_proj|experts\.down_proj|experts\.(\d+)\.(gate_proj|w1|up_proj|w3|down_proj|w2)\.weight|"
                     r"shared_experts\.(gate_proj|up_proj|down_proj)\.weight)")


def hf_config(path: Path) -> ModelConfig:
    """``ModelConfig`` of an HF directory from ``config.json`` and, if present,
    ``generation_config.json``. Raises ``ConfigError`` for a missing or invalid file."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"model: directory {str(path)!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json: not valid JSON ({e})") from None
    cfg = json_object(cfg, path / "config.json")
    gen = None
    if (path / "generation_config.json").is_file():
        try:
            gen = json.loads((path / "generation_config.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"generation_config.json: not valid JSON ({e})") from None
        gen = json_object(gen, path / "generation_config.json")
    return ModelConfig.from_hf_config(cfg, gen, model_id=path.name, revision=_hf_revision(path))


def _hf_revision(path: Path) -> str:
    """The snapshot commit for an HF hub cache snapshot dir, else a content-ish hash of
    config.json plus weight file names and sizes."""
    if path.parent.name == "snapshots":
        return path.name
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def hf_state_dict(path: Path, config: ModelConfig) -> StateDict:
    """Every ``*.safetensors`` tensor of ``path`` (source dtype) under our names, fused;
    DeepSeek-V3's multi-token-prediction layers (``layers.{i}`` for ``i >= num_hidden_layers``,
    which transformers ignores too) are skipped. Raises ``ConfigError`` for no weight file, an
    unreadable file or an unexpected tensor."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"weights: no *.safetensors file in {str(path)!r}")
    state: StateDict = {}
    parts: _Parts = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except SafetensorError as e:
            raise ConfigError(f"weights: cannot read {f.name} ({e})") from None
        for name, w in tensors.items():
            key = name.removeprefix("model.")
            if key in _HF_TOP_NAMES:
                state[key] = w
                continue
            _, idx, rest = key.split(".", 2) if key.startswith("layers.") else ("", "", "")
            if idx and config.architecture == "deepseek_v3" and int(idx) >= config.num_layers:
                continue  # DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers): unused
            if idx and config.architecture == "gpt_oss" and gptoss.hf_tensor(state, int(idx), rest, w):
                continue  # sinks, o_proj bias, router and interleaved stacked experts (pagedkv.model.gptoss)
            moe = _HF_MOE.fullmatch(rest)
            if config.is_mla and rest in _HF_MLA_NAMES:
                state[f"layers.{int(idx)}.{_HF_MLA_NAMES[rest]}"] = w
            elif moe is not None:
                _hf_moe_tensor(state, parts, int(idx), moe, w)
            elif rest in _HF_LAYER_NAMES:
                state[f"layers.{int(idx)}.{_HF_LAYER_NAMES[rest]}"] = w
            elif rest in _HF_FUSED_PARTS:
                parts[(int(idx), _HF_FUSED_PARTS[rest])] = w
            elif not key.endswith("rotary_emb.inv_freq"):
                raise ConfigError(f"weights: unexpected tensor {name!r} in {f.name}")
    return _fuse_layers(state, parts, config, ("q", "k", "v", "gate", "up"))


def _hf_moe_tensor(state: StateDict, parts: _Parts, i: int, m: "re.Match[str]", w: torch.Tensor) -> None:
    """File a mixture-of-experts tensor of layer ``i`` (``_HF_MOE`` match ``m``) under our
    names (``pagedkv.model.moe``): per-expert gate/up into ``parts`` (fused later), stacked
    tensors sliced per expert."""
    what, expert, proj, shared = m.groups()
    pre = f"layers.{i}.mlp."
    if shared == "down_proj":  # DeepSeek's shared experts: one gated MLP
        state[pre + "shared.down_proj.weight"] = w
    elif shared is not None:
        parts[(i, f"shared.{shared.removesuffix('_proj')}")] = w
    elif what == "gate.weight":
        state[pre + "router.weight"] = w
    elif what.endswith("e_score_correction_bias"):
        state[pre + "e_score_correction_bias"] = w
    elif expert is None:  # stacked [E, rows, cols]
        name = "gate_up_proj" if what.endswith("gate_up_proj") else "down_proj"
        for e in range(w.shape[0]):
            state[f"{pre}experts.{e}.{name}.weight"] = w[e]
    elif proj in ("down_proj", "w2"):
        state[f"{pre}experts.{expert}.down_proj.weight"] = w
    else:
        parts[(i, f"experts.{expert}.{'gate' if proj in ('gate_proj', 'w1') else 'up'}")] = w
