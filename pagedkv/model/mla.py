"""Multi-head latent attention (MLA) over the paged KV cache: MiniCPM3, DeepSeek-V2/V3.

Source: DeepSeek-V2 (arXiv 2405.04434) §2.1 "Multi-Head Latent Attention", and transformers 5.24's
``DeepseekV2Attention`` / ``DeepseekV3Attention`` / ``MiniCPM3Attention`` (the numbers this module
is tested against). Seed §01 sizes its cache: ``L . (kv_lora_rank + qk_rope_head_dim) . b`` bytes
per token (``pagedkv.kv.spec.KVCacheSpec`` with ``kv_lora_rank``), no factor 2 and no heads.

Per token ``x`` ``[H]`` of a layer (``n`` heads, ``r`` = ``kv_lora_rank``, ``nope`` / ``rope`` =
``qk_nope_head_dim`` / ``qk_rope_head_dim``, ``v`` = ``v_head_dim``):

* queries ``q = q_proj(x)`` or ``q_b_proj(rms(q_a_proj(x)))`` ``[n, nope + rope]`` = ``(q_nope, q_pe)``;
* ``kv_a_proj_with_mqa(x)`` ``[r + rope]`` = ``(c, k_pe)``; the latent ``c_kv = rms(c)``
  (``kv_a_layernorm``) and the rope key ``k_pe`` (one, shared by every head), RoPE'd at the
  token's position with ``q_pe``;
* **the cache holds one vector per token and layer**: ``[c_kv, k_pe]`` (``r + rope`` elements),
  stored as a one-head K of a ``PagedKVCache`` whose V is zero-width
  (:func:`allocate_latent_cache`), written through ``slot_mapping`` and read through
  ``block_tables`` like every other layer's K; a quantised cache (int8 / fp8) keeps its codes and
  per-group scales (``pagedkv.attention.quant``; default one group = the whole latent);
* ``kv_b_proj.weight`` ``[n (nope + v), r]`` holds per head ``W_UK`` ``[nope, r]`` then ``W_UV``
  ``[v, r]``: ``k_nope = W_UK c_kv``, ``value = W_UV c_kv``;
* scores ``(q_nope . k_nope + q_pe . k_pe) * scale``, causal softmax, output ``[n, v]`` -> ``o_proj``.

Per sequence, the form with fewer multiply-adds (:func:`absorb`) runs, both in float32:

* **absorbed** (every decode row, short chunks): ``q_lat = W_UK^T q_nope`` ``[n, r]``, scores
  ``q_lat . c_kv + q_pe . k_pe``, ``o_lat = softmax . c_kv`` ``[n, r]``, output ``W_UV o_lat``: no
  per-head K or V is materialised; cost per row ``~ n (2 S r + S rope + (nope + v) r)``;
* **expanded** (long prefill chunks): the ``S`` gathered latents up-projected to per-head K/V once
  (``S r n (nope + v)``), then ``S n (nope + rope + v)`` per row.

Measured at DeepSeek-V2-Lite's shape (16 heads, r 512, 128 + 64, v 128; 512 tokens of context;
one CPU thread): 1 row 1.9 ms absorbed vs 55.6 ms expanded, 16 rows 10.2 vs 61.3 ms, 256 rows
153 vs 91 ms; the cost model switches at ~128 rows there.

RoPE: rotate-half (MiniCPM3, DeepSeek-V3 without ``rope_interleave``) or DeepSeek's interleaved
pairs ``(x0, x1), (x2, x3) ...`` (V2, V3 ``rope_interleave``), computed as transformers' V3 does:
``cat(x_even cos - x_odd sin, x_odd cos + x_even sin)``; the cached ``k_pe`` and ``q_pe`` share
that order, so their dot products are V2's complex rotary's. Yarn scaling (:func:`yarn_inv_freq`)
scales cos/sin by its attention factor and the softmax scale by ``mscale(factor,
mscale_all_dim)^2``, as transformers does.

Errors: ``ConfigError`` for a backend without a ``PagedKVCache`` layout or a bad cache argument,
``BackendError`` for a slot past the cache.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention import layouts as L
from pagedkv.attention import quant as Q
from pagedkv.attention.base import AttentionMetadata
from pagedkv.attention.reference import context_slots, lists_of
from pagedkv.errors import ConfigError
from pagedkv.utils import linear_layer

#: eps of ``q_a_layernorm`` / ``kv_a_layernorm`` (transformers builds them with its RMSNorm default)
INNER_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rs: dict[str, Any], dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] fp32, attention_factor)`` of yarn RoPE scaling (transformers'
    ``_compute_yarn_parameters``): ``rs`` holds ``factor``, ``original_max_position_embeddings``
    and optionally ``beta_fast`` (32), ``beta_slow`` (1), ``attention_factor``, ``mscale``,
    ``mscale_all_dim``, ``truncate`` (True)."""
    factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])
    att = rs.get("attention_factor")
    if att is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        att = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, float(att)


def absorb(rows: int, context: int, heads: int, rank: int, nope: int, rope: int, v: int) -> bool:
    """Whether ``rows`` query rows of one sequence over ``context`` tokens take the absorbed form:
    its multiply-adds (module doc) are at most the expanded form's."""
    absorbed = rows * heads * (context * (2 * rank + rope) + (nope + v) * rank)
    expanded = context * heads * (rank * (nope + v) + rows * (nope + rope + v))
    return absorbed <= expanded


def softmax_scale(config: Any) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn
    scaling with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = config.head_dim ** -0.5
    rs = config.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale = scale * m * m
    return scale


# ---- the latent paged cache ---------------------------------------------------------------
def allocate_latent_cache(backend: Any, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype | str, device: torch.device | str = "cpu",
                          quant_group_size: int | None = None) -> L.PagedKVCache:
    """One MLA layer's zero-filled cache in ``backend``'s layout: K ``layout.shape(num_blocks,
    block_size, 1, head_dim)`` (``head_dim`` = ``kv_lora_rank + qk_rope_head_dim``) and a
    zero-width V (no storage), so its ``nbytes`` are exactly ``KVCacheSpec(kv_lora_rank=...)``'s.
    ``dtype``: a floating torch dtype or ``"int8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (codes plus
    bf16 scales per ``quant_group_size`` elements, default the whole latent). Raises
    ``ConfigError`` for ``num_kv_heads != 1``, a backend without a ``layout``, bad sizes."""
    layout, name = L.backend_layout(backend)
    if layout is None:
        raise ConfigError(f"attention_backend {name}: MLA models need a backend "
                          "with a PagedKVCache layout (cpu, reference)")
    if num_kv_heads != 1:
        raise ConfigError(f"num_kv_heads: an MLA cache holds one latent per token, got {num_kv_heads} heads")
    plain, fmt = Q.resolve(dtype)
    L.validate_cache_args(num_blocks, block_size, 1, head_dim, plain if fmt is None else torch.float32)
    shape, none = layout.shape(num_blocks, block_size, 1, head_dim), layout.shape(num_blocks, block_size, 1, 0)
    if fmt is None:
        return L.PagedKVCache(torch.zeros(shape, dtype=plain, device=device), torch.zeros(none, dtype=plain, device=device),
                              layout, num_blocks, block_size, 1, head_dim)
    g = Q.check_group_size(quant_group_size, head_dim)
    return L.PagedKVCache(
        torch.zeros(shape, dtype=fmt.storage, device=device), torch.zeros(none, dtype=fmt.storage, device=device),
        layout, num_blocks, block_size, 1, head_dim,
        torch.zeros(layout.shape(num_blocks, block_size, 1, head_dim // g), dtype=Q.SCALE_DTYPE, device=device),
        torch.zeros(none, dtype=Q.SCALE_DTYPE, device=device), fmt, g)


def write_latent(cache: L.PagedKVCache, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``latent`` ``[T, 1, r + rope]`` at ``slot_mapping`` (int64 ``[T]``, ``-1`` skipped),
    quantised for a quantised cache. Raises ``BackendError`` for a slot past the cache."""
    slots, latent = L.valid_slots(slot_mapping, latent, num_slots=cache.num_blocks * cache.block_size)
    if slots.numel() == 0:
        return
    lay, bs = cache.layout, cache.block_size
    if cache.quant is None:
        lay.write(cache.key, latent, slots, bs)
        return
    codes, scales = Q.quantize(latent, cache.quant, cache.group_size)
    lay.write(cache.key, codes, slots, bs)
    lay.write(cache.key_scale, scales, slots, bs)


def read_latent(cache: L.PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
    """The latents ``[n, r + rope]`` at ``slots`` (int64 ``[n]``): the cache dtype, or float32
    dequantised values for a quantised cache."""
    lay, bs = cache.layout, cache.block_size
    k = lay.read(cache.key, slots, bs, 1, cache.head_dim)
    if cache.quant is not None:
        k = Q.dequantize(k, lay.read(cache.key_scale, slots, bs, 1, cache.num_groups), cache.quant)
    return k[:, 0]


# ---- the layer ----------------------------------------------------------------------------
class _NormWeight(nn.Module):
    """An RMSNorm weight, so state-dict names read ``...layernorm.weight``."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, INNER_NORM_EPS)
    return F.rms_norm(x.float(), (x.shape[-1],), None, INNER_NORM_EPS).to(x.dtype).mul_(w)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of ``x`` ``[T, heads, rope]`` with ``cos``/``sin`` ``[T, 1, rope / 2]``: rotate-half,
    or (``interleave``) adjacent pairs, output in rotate-half order (see the module doc)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """One layer's MLA projections and attention (state-dict names as transformers' under
    ``self_attn.``, here under the decoder layer's ``mla.``; ``o_proj`` stays the layer's):

    * ``q_proj.weight`` ``[n (nope + rope), H]`` when ``q_lora_rank`` is ``None``, else
      ``q_a_proj.weight`` ``[q_lora_rank, H]``, ``q_a_layernorm.weight`` ``[q_lora_rank]``,
      ``q_b_proj.weight`` ``[n (nope + rope), q_lora_rank]``;
    * ``kv_a_proj_with_mqa.weight`` ``[r + rope, H]``, ``kv_a_layernorm.weight`` ``[r]``,
      ``kv_b_proj.weight`` ``[n (nope + v), r]`` (read as a tensor: never quantised).
    """

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        h, n = config.hidden_size, config.num_heads
        self.num_heads, self.nope, self.rope_dim = n, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim, self.interleave = config.kv_lora_rank, config.v_head_dim, config.rope_interleave
        self.scale = softmax_scale(config)
        qk = self.nope + self.rope_dim
        ql = config.q_lora_rank
        self.q_proj = linear_layer(h, n * qk, False, **kw) if ql is None else None
        self.q_a_proj = linear_layer(h, ql, False, **kw) if ql is not None else None
        self.q_a_layernorm = _NormWeight(ql, **kw) if ql is not None else None
        self.q_b_proj = linear_layer(ql, n * qk, False, **kw) if ql is not None else None
        self.kv_a_proj_with_mqa = linear_layer(h, self.rank + self.rope_dim, False, **kw)
        self.kv_a_layernorm = _NormWeight(self.rank, **kw)
        self.kv_b_proj = linear_layer(self.rank, n * (self.nope + self.v_dim), False, **kw)
        #: query rows of each form the last forward ran (tests read it)
        self.rows = {"absorbed": 0, "expanded": 0}
        #: a GGUF's ``attn_k_b`` ``[n r, nope]`` / ``attn_v_b`` ``[n v, r]`` as stored (``GGUFLinear``,
        #: ``pagedkv.model.gguf_mla``), for the native step's absorbed form; ``None`` elsewhere
        self.k_b_stored: Any = None
        self.v_b_stored: Any = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: L.PagedKVCache,
                md: AttentionMetadata) -> torch.Tensor:
        """Attention output ``[T, n * v]`` (model dtype) of the normed hidden states ``x``
        ``[T, H]``; writes the tokens' latents at ``md.slot_mapping`` first. ``cos``/``sin``
        ``[T, 1, rope / 2]``: the tokens' RoPE rows."""
        t, n = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(_rms(self.q_a_proj(x), self.q_a_layernorm.weight))
        q = q.view(t, n, self.nope + self.rope_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        c = _rms(ckv[:, : self.rank], self.kv_a_layernorm.weight)
        q_pe = rope(q[..., self.nope:], cos, sin, self.interleave)
        k_pe = rope(ckv[:, None, self.rank:], cos, sin, self.interleave)
        write_latent(kv_cache, torch.cat([c, k_pe[:, 0]], dim=-1).unsqueeze(1), md.slot_mapping)
        return self._attend(q[..., : self.nope], q_pe, kv_cache, md).reshape(t, n * self.v_dim)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: L.PagedKVCache,
                md: AttentionMetadata) -> torch.Tensor:
        """Per sequence over its paged latents: ``[T, n, v]`` in ``q_nope``'s dtype."""
        n, r, nope = self.num_heads, self.rank, self.nope
        w = self.kv_b_proj.weight.float().view(n, nope + self.v_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [n, nope, r], [n, v, r]
        out = q_nope.new_zeros(q_nope.shape[0], n, self.v_dim)  # padding rows stay 0
        seq_lens, q_lens, starts = lists_of(md)
        self.rows = {"absorbed": 0, "expanded": 0}
        for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
            if ql == 0:
                continue
            a, b = starts[i], starts[i] + ql
            ctx = read_latent(cache, context_slots(md.block_tables[i], sl, cache.block_size)).float()
            c_kv, k_pe = ctx[:, :r], ctx[:, r:]  # [sl, r], [sl, rope]
            qn, qp = q_nope[a:b].float(), q_pe[a:b].float()  # [ql, n, nope], [ql, n, rope]
            hidden = torch.arange(sl, device=ctx.device)[None, :] > torch.arange(sl - ql, sl, device=ctx.device)[:, None]
            if absorb(ql, sl, n, r, nope, self.rope_dim, self.v_dim):  # scores and output in the latent space
                q_lat = torch.einsum("qhd,hdr->qhr", qn, w_uk)
                scores = torch.einsum("qhr,kr->hqk", q_lat, c_kv) + torch.einsum("qhd,kd->hqk", qp, k_pe)
                p = torch.softmax((scores * self.scale).masked_fill(hidden, float("-inf")), dim=-1)
                o = torch.einsum("qhr,hvr->qhv", torch.einsum("hqk,kr->qhr", p, c_kv), w_uv)
                self.rows["absorbed"] += ql
            else:  # expanded: per-head K/V up-projected from the latents once for ql rows
                kv = F.linear(c_kv, w.view(n * (nope + self.v_dim), r)).view(sl, n, nope + self.v_dim)
                k = torch.cat([kv[..., :nope], k_pe[:, None].expand(sl, n, self.rope_dim)], dim=-1)
                scores = torch.einsum("qhd,khd->hqk", torch.cat([qn, qp], dim=-1), k)
                p = torch.softmax((scores * self.scale).masked_fill(hidden, float("-inf")), dim=-1)
                o = torch.einsum("hqk,khd->qhd", p, kv[..., nope:])
                self.rows["expanded"] += ql
            out[a:b] = o.to(out.dtype)
        return out
