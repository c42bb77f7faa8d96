"""The reference backend: gather each sequence's K/V through its block table, then a plain
softmax in float32. Slow and obviously correct; it is the oracle every other backend is
compared with (``pagedkv.testing``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pagedkv.utils import cdiv

from pagedkv.attention import layouts as L
from pagedkv.attention.base import AttentionMetadata, BackendCapabilities, check_window, window_start
from pagedkv.errors import BackendError


def context_slots(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots (int64 ``[seq_len]``) of positions ``0..seq_len-1`` (seed §02): only the first
    ``ceil(seq_len / block_size)`` entries of the row are looked at."""
    pos = torch.arange(seq_len, device=block_table_row.device)
    blocks = block_table_row[: cdiv(seq_len, block_size)].to(torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def check_inputs(query: torch.Tensor, cache: L.PagedKVCache, md: AttentionMetadata) -> tuple[int, int, int]:
    """Validate shapes; returns ``(num_tokens, num_heads, head_dim)``. Raises ``BackendError``."""
    if query.dim() != 3:
        raise BackendError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    n, hq, d = query.shape
    if d != cache.head_dim:
        raise BackendError(f"query head_dim {d} != cache head_dim {cache.head_dim}")
    if hq % cache.num_kv_heads:
        raise BackendError(f"num_heads {hq} is not a multiple of num_kv_heads {cache.num_kv_heads}")
    if n != md.num_tokens:
        raise BackendError(f"query has {n} tokens but metadata has {md.num_tokens}")
    return n, hq, d


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: Any = None) -> torch.Tensor | None:
    """``sinks`` as float32 ``[num_heads]`` (``None`` stays ``None``). Raises ``BackendError``
    for another shape, a non-floating tensor, or (given the queries' ``device``) a tensor on
    another device (a ``meta`` one has no values)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (num_heads,):
        raise BackendError(f"sinks must be a float tensor [num_heads={num_heads}], got "
                           f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if device is not None and sinks.device.type != torch.device(device).type:  # meta, another device
        raise BackendError(f"sinks must be on the queries' device ({device}), got a {sinks.device} tensor")
    return sinks.detach().float()


def lists_of(md: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """``(seq_lens, query_lens, query_starts)`` as Python lists (from the metadata's list
    copies when present, else one device->host copy)."""
    seq_lens = md.seq_lens_list if md.seq_lens_list is not None else md.seq_lens.tolist()
    qsl = md.query_start_loc.tolist() if md.query_lens_list is None else None
    if md.query_lens_list is not None:
        q_lens = list(md.query_lens_list)
        starts = [0]
        for ql in q_lens:
            starts.append(starts[-1] + ql)
    else:
        starts = qsl
        q_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
    return list(seq_lens), q_lens, starts


class LayoutMemory(L.BlockTransfer):
    """K/V memory handling shared by every backend that keeps its cache as a
    ``PagedKVCache`` in ``self.layout``: allocate, write by slot_mapping, copy blocks, gather,
    export/import whole blocks."""

    layout: L.Layout

    # -- memory ---------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype | str, device: torch.device | str = "cpu",
                          quant_group_size: int | None = None) -> L.PagedKVCache:
        """Zero-filled ``PagedKVCache``; K and V each ``layout.shape(...)`` in ``dtype`` (a
        floating torch dtype, or ``"int8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``: codes plus bf16
        scales per ``quant_group_size`` elements). Raises ``ConfigError`` for a non-positive
        size, an unknown dtype or a group size that does not divide ``head_dim``."""
        return L.allocate(self.layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                          quant_group_size)

    def write_kv(self, kv_cache: L.PagedKVCache, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, Hkv, d]`` at ``slot_mapping`` (int64
        ``[num_tokens]``; ``-1`` rows skipped), quantised for a quantised cache. A slot past the
        cache raises ``BackendError`` and nothing is written."""
        slots, key, value = L.valid_slots(slot_mapping, key, value,
                                          num_slots=kv_cache.num_blocks * kv_cache.block_size)
        if slots.numel() == 0:
            return
        L.write(kv_cache, key, value, slots)

    def copy_blocks(self, kv_cache: L.PagedKVCache, copies: Sequence[tuple[int, int]]) -> None:
        """Copy physical blocks ``src -> dst`` (K and V, and their scales)."""
        L.copy_blocks(kv_cache, copies)

    def gather_kv(self, kv_cache: L.PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, Hkv, d]`` at ``slots`` (int64 ``[n]``); float32 dequantised values
        for a quantised cache."""
        return L.gather(kv_cache, slots)

    def gather_kv_raw(self, kv_cache: L.PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(K, V, K scales, V scales)`` as stored at ``slots`` (see ``layouts.gather_raw``)."""
        return L.gather_raw(kv_cache, slots)


class ReferenceBackend(LayoutMemory):
    """Oracle backend: any layout (default NHD), any floating or quantised cache dtype, any
    device torch runs on.

    Per sequence: gather K/V ``[seq_len, Hkv, d]`` by slot (dequantised for a quantised cache), compute ``softmax(q k^T * scale)``
    with the causal mask (query row ``j`` of a ``q_len`` chunk sits at position
    ``seq_len - q_len + j``) in float32, cast back to the query dtype.
    """

    #: no fast path; takes the ``sinks`` option (``pagedkv.attention.base``)
    capabilities = BackendCapabilities(attention_sinks=True)

    def __init__(self, layout: str = "nhd", name: str | None = None) -> None:
        self.layout = L.get_layout(layout)
        self.name = name or ("reference" if layout == "nhd" else f"reference-{layout}")

    # -- attention ------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, kv_cache: L.PagedKVCache, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_tokens, num_heads, head_dim]`` output in ``query.dtype``. With a
        ``sliding_window`` only positions from the first query's window start on are gathered;
        ``logits_soft_cap`` caps the scores before the mask; ``sinks`` ``[num_heads]`` join the
        softmax's denominator (see ``base``; ``BackendError`` for a wrong shape)."""
        n, hq, d = check_inputs(query, kv_cache, metadata)
        window, cap = check_window(sliding_window, logits_soft_cap)
        sink = check_sinks(sinks, hq)
        out = torch.zeros_like(query)  # rows past query_start_loc[-1] (batch padding) stay 0
        seq_lens, q_lens, starts = lists_of(metadata)
        group = hq // kv_cache.num_kv_heads
        for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
            if ql == 0:
                continue
            lo = window_start(sl - ql, window)
            slots = context_slots(metadata.block_tables[i], sl, kv_cache.block_size)[lo:]
            k, v = self.gather_kv(kv_cache, slots)
            k = k.float().repeat_interleave(group, dim=1)  # [sl - lo, hq, d]
            v = v.float().repeat_interleave(group, dim=1)
            q = query[starts[i] : starts[i] + ql].float()  # [ql, hq, d]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [hq, ql, sl - lo]
            if cap:
                scores = torch.tanh(scores / cap) * cap
            q_pos = torch.arange(sl - ql, sl, device=query.device)[:, None]
            k_pos = torch.arange(lo, sl, device=query.device)[None, :]
            hidden = k_pos > q_pos
            if window:
                hidden |= k_pos <= q_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            if sink is not None:  # one more logit per head, dropped after the softmax
                scores = torch.cat([scores, sink[:, None, None].expand(hq, ql, 1)], dim=-1)
            p = torch.softmax(scores, dim=-1)[..., : sl - lo]
            out[starts[i] : starts[i] + ql] = torch.einsum("hqk,khd->qhd", p, v).to(query.dtype)
        return out
