"""Triton paged-attention backend (NHD layout ``[num_blocks, block_size, Hkv, d]``).

Three kernels, all reading K/V through the block table (seed §02) and never touching a
block-table entry or slot past a sequence's ``seq_len``:

* ``_write_kv_kernel`` / ``_write_kv_quant_kernel`` (in :mod:`pagedkv.attention.triton_kv`,
  with the tile loader ``_load_kv``): scatter new K/V rows to ``slot_mapping`` (skipping
  ``-1``), quantising them for an int8 / fp8 cache.
* ``_decode_kernel``: sequences with one new token. Grid ``(num_seqs, Hkv, num_splits)``: a
  program loads the ``g = Hq/Hkv`` query heads of one KV head as one ``[G, D]`` tile (GQA
  packing: each K/V row is read once for all its query heads) and runs an online softmax over
  its split of the context, ``BLOCK_N`` tokens at a time. With ``num_splits > 1`` (long
  contexts: split-K / flash-decoding) partial ``(m, l, acc)`` go to a workspace and
  ``_reduce_kernel`` merges them.
* ``_prefill_kernel``: sequences with several new tokens (prefill, chunked prefill over cached
  context, the prefill part of a mixed batch). Grid ``(num_seqs, Hkv, cdiv(max_q_len, BLOCK_M))``;
  causal over positions ``seq_len - q_len .. seq_len - 1``; the GQA group's query heads are
  packed into the tile rows so each K/V tile is loaded once per group.

On an NVIDIA GPU it runs natively. Without CUDA, importing this module (through triton_kv) sets
``TRITON_INTERPRET=1`` (unless already set) so the kernels run on CPU tensors under Triton's
interpreter (tests; small shapes only). Under the interpreter ``tl.dot`` on bf16 inputs is
wrong, so dots are done in float32 there (and always for float32 caches, with
``input_precision="ieee"`` so GPUs do not silently use TF32). A quantised cache is dequantised
in the K/V tile loader (codes x their group's scale), never outside the kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedkv.utils import cdiv

from pagedkv.attention import layouts as L
from pagedkv.attention import quant as Q
from pagedkv.attention.base import AttentionMetadata, check_window
from pagedkv.attention.reference import check_inputs
from pagedkv.errors import BackendError

from pagedkv.attention.triton_kv import (  # noqa: F401 - sets TRITON_INTERPRET first
    _IMPORT_ERROR, _interpreter_state_error, _interpreting, tl, triton,
)

if triton is not None:
    from pagedkv.attention.triton_kv import _load_kv, _write_kv_kernel, _write_kv_quant_kernel

    @triton.jit
    def _program_seq(qsl_ptr, seq_lens_ptr):
        """This program's (sequence, KV head, tile) ids and its sequence's first query row,
        query length and context length."""
        s = tl.program_id(0)
        q_start = tl.load(qsl_ptr + s)
        q_len = tl.load(qsl_ptr + s + 1) - q_start
        return s, tl.program_id(1), tl.program_id(2), q_start, q_len, tl.load(seq_lens_ptr + s)

    @triton.jit
    def _attend_tile(
        q, m_i, l_i, acc, start, kv_end, q_pos, bt_row, k_cache_ptr, v_cache_ptr,
        s_blk, s_tok, s_head, h, x, xmask, block_size, ks_ptr, vs_ptr, ss_blk, ss_tok, ss_head,
        window, softcap,
        BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, GRP: tl.constexpr,
        KDT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        """One online-softmax update with the K/V tile of positions ``start ..
        start + BLOCK_N`` (< ``kv_end``), read through the block table row ``bt_row``;
        ``CAUSAL``: row i sees positions <= ``q_pos[i]`` (and, with ``WINDOW``, > ``q_pos[i] -
        window``); ``SOFTCAP``: scores become ``softcap * tanh(score / softcap)``. Returns the
        new (m, l, acc)."""
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        blk = tl.load(bt_row + n // block_size, mask=nmask, other=0).to(tl.int64)
        row = blk * s_blk + (n % block_size) * s_tok + h * s_head
        kv_mask = nmask[:, None] & xmask[None, :]
        srow = blk * ss_blk + (n % block_size) * ss_tok + h * ss_head  # quantised: scale rows
        k = _load_kv(k_cache_ptr, ks_ptr, row[:, None] + x[None, :], srow, x, kv_mask, GRP, KDT, DOT_F32)
        v = _load_kv(v_cache_ptr, vs_ptr, row[:, None] + x[None, :], srow, x, kv_mask, GRP, KDT, DOT_F32)
        if DOT_F32:
            sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q.to(k.dtype), tl.trans(k))
        if SOFTCAP:  # tanh from exp (no tanh in every Triton build): sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
            y = sc / softcap
            e = tl.exp(-2.0 * tl.abs(y))
            t = (1.0 - e) / (1.0 + e)
            sc = softcap * tl.where(y < 0, -t, t)
        if CAUSAL:
            valid = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
            if WINDOW:
                valid = valid & (n[None, :] > q_pos[:, None] - window)
        else:
            valid = nmask[None, :] & (q_pos[:, None] >= 0)
        sc = tl.where(valid, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr,
        scale,
        s_qt, s_qh, s_ot, s_oh,
        s_blk, s_tok, s_head, s_bt,
        block_size, head_dim, num_splits, split_len, ks_ptr, vs_ptr, ss_blk, ss_tok, ss_head,
        window, softcap,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_F32: tl.constexpr, SPLIT: tl.constexpr, GRP: tl.constexpr, KDT: tl.constexpr,
        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        s, h, c, q_start, q_len, seq_len = _program_seq(qsl_ptr, seq_lens_ptr)
        if q_len == 1:
            lo = 0
            if WINDOW:  # the window's first position: nothing before it is read
                lo = tl.maximum(seq_len - window, 0)
            t_begin = lo + c * split_len
            t_end = tl.minimum(seq_len, t_begin + split_len)
            g = tl.arange(0, G_PAD)
            x = tl.arange(0, D_PAD)
            gmask = g < GROUP
            xmask = x < head_dim
            qh = h * GROUP + g
            q = tl.load(q_ptr + q_start * s_qt + qh[:, None] * s_qh + x[None, :],
                        mask=gmask[:, None] & xmask[None, :], other=0.0)
            q = (q.to(tl.float32) * scale)
            m_i = tl.full([G_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], tl.float32)
            bt_row = bt_ptr + s.to(tl.int64) * s_bt
            for start in range(t_begin, t_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start, t_end, g, bt_row, k_cache_ptr, v_cache_ptr,
                    s_blk, s_tok, s_head, h, x, xmask, block_size, ks_ptr, vs_ptr, ss_blk, ss_tok, ss_head,
                    window, softcap, BLOCK_N, DOT_F32, False, GRP, KDT, False, SOFTCAP,
                )
            if SPLIT:
                # partials [num_seqs, Hq, num_splits] (+ D for acc)
                pidx = (s * (GROUP * tl.num_programs(1)) + qh) * num_splits + c
                tl.store(part_m_ptr + pidx, m_i, mask=gmask)
                tl.store(part_l_ptr + pidx, l_i, mask=gmask)
                tl.store(part_acc_ptr + pidx[:, None] * D_PAD + x[None, :], acc, mask=gmask[:, None])
            else:
                l_safe = tl.where(l_i > 0, l_i, 1.0)
                o = acc / l_safe[:, None]
                tl.store(out_ptr + q_start * s_ot + qh[:, None] * s_oh + x[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & xmask[None, :])

    @triton.jit
    def _reduce_kernel(
        out_ptr, qsl_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        s_ot, s_oh, head_dim, num_heads, num_splits, split_len, window,
        S_PAD: tl.constexpr, D_PAD: tl.constexpr, WINDOW: tl.constexpr,
    ):
        s = tl.program_id(0)
        qh = tl.program_id(1)
        q_start = tl.load(qsl_ptr + s)
        q_len = tl.load(qsl_ptr + s + 1) - q_start
        if q_len == 1:
            seq_len = tl.load(seq_lens_ptr + s)
            if WINDOW:
                seq_len = tl.minimum(seq_len, window)  # the splits cover the window only
            used = tl.cdiv(seq_len, split_len)  # splits that saw at least one token
            c = tl.arange(0, S_PAD)
            cmask = c < used
            x = tl.arange(0, D_PAD)
            base = (s * num_heads + qh) * num_splits
            m = tl.load(part_m_ptr + base + c, mask=cmask, other=-1.0e30)
            l = tl.load(part_l_ptr + base + c, mask=cmask, other=0.0)
            acc = tl.load(part_acc_ptr + (base + c)[:, None] * D_PAD + x[None, :], mask=cmask[:, None], other=0.0)
            m_all = tl.max(m, axis=0)
            w = tl.where(cmask, tl.exp(m - m_all), 0.0)
            l_all = tl.sum(w * l, axis=0)
            o = tl.sum(acc * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0)
            tl.store(out_ptr + q_start * s_ot + qh * s_oh + x, o.to(out_ptr.dtype.element_ty), mask=x < head_dim)

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        scale,
        s_qt, s_qh, s_ot, s_oh,
        s_blk, s_tok, s_head, s_bt,
        block_size, head_dim, ks_ptr, vs_ptr, ss_blk, ss_tok, ss_head, window, softcap,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, GRP: tl.constexpr, KDT: tl.constexpr,
        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        # one program: BLOCK_M query positions x the G query heads of KV head h, packed as
        # BLOCK_M * G_PAD tile rows (row i: position i // G_PAD, head i % G_PAD), so each K/V
        # tile is loaded once for the whole GQA group
        s, h, mt, q_start, q_len, seq_len = _program_seq(qsl_ptr, seq_lens_ptr)
        if (q_len > 1) & (mt * BLOCK_M < q_len):
            i = tl.arange(0, BLOCK_M * G_PAD)
            r = mt * BLOCK_M + i // G_PAD
            j = i % G_PAD
            rmask = (r < q_len) & (j < GROUP)
            qh = h * GROUP + j
            x = tl.arange(0, D_PAD)
            xmask = x < head_dim
            q_rows = (q_start + r).to(tl.int64)
            q = tl.load(q_ptr + q_rows[:, None] * s_qt + qh[:, None] * s_qh + x[None, :],
                        mask=rmask[:, None] & xmask[None, :], other=0.0)
            q = q.to(tl.float32) * scale
            q_pos = seq_len - q_len + r  # position of each tile row's query token
            m_i = tl.full([BLOCK_M * G_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
            acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
            # keys up to the last query position of this tile
            kv_end = tl.minimum(seq_len, seq_len - q_len + (mt + 1) * BLOCK_M)
            bt_row = bt_ptr + s.to(tl.int64) * s_bt
            kv_begin = 0
            if WINDOW:  # the window start of this tile's first query: nothing before it is read
                kv_begin = tl.maximum(seq_len - q_len + mt * BLOCK_M - window + 1, 0)
            for start in range(kv_begin, kv_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, start, kv_end, q_pos, bt_row, k_cache_ptr, v_cache_ptr,
                    s_blk, s_tok, s_head, h, x, xmask, block_size, ks_ptr, vs_ptr, ss_blk, ss_tok, ss_head,
                    window, softcap, BLOCK_N, DOT_F32, True, GRP, KDT, WINDOW, SOFTCAP,
                )
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + q_rows[:, None] * s_ot + qh[:, None] * s_oh + x[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & xmask[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonBackend(L.BlockTransfer):
    """Triton kernels over an NHD paged cache (see module doc).

    ``split_len``: context tokens per split of the decode kernel (split-K is used when a
    sequence is longer than this); ``block_n``: key tile (tokens); ``block_m``: prefill query
    tile rows (query positions x the GQA group, padded to a power of two; >= 16).
    Raises ``BackendError`` if Triton cannot be imported.
    """

    def __init__(self, layout: str = "nhd", name: str | None = None, split_len: int = 512,
                 block_n: int | None = None, block_m: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None) -> None:
        if triton is None:
            raise BackendError(f"the triton backend needs the `triton` package: {_IMPORT_ERROR}")
        err = _interpreter_state_error()
        if err:
            raise BackendError(err)
        self.layout = L.get_layout(layout)
        self.name = name or ("triton" if layout == "nhd" else f"triton-{layout}")
        # under the interpreter every program costs Python time: fewer, bigger tiles
        block_n = block_n or (64 if _interpreting() else 32)
        block_m = block_m or (128 if _interpreting() else 64)
        if split_len % block_n:
            raise BackendError(f"split_len {split_len} must be a multiple of block_n {block_n}")
        self.split_len = split_len
        self.block_n = block_n
        self.block_m = block_m
        self.num_warps = num_warps
        # software-pipelining depth of the K/V loads (None: Triton's default)
        self._launch = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
        self._ws: dict[tuple, torch.Tensor] = {}

    # -- memory ---------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype | str, device: torch.device | str = "cpu",
                          quant_group_size: int | None = None) -> L.PagedKVCache:
        """Zero-filled ``PagedKVCache`` (K and V ``[num_blocks, block_size, Hkv, d]``); ``dtype``
        float32/float16/bfloat16 or a quantised ``kv_cache_dtype`` (int8, fp8_e4m3, fp8_e5m2).
        Raises ``ConfigError`` for bad sizes, ``BackendError`` for an unsupported dtype."""
        plain, _ = Q.resolve(dtype)
        if plain is not None and plain not in (torch.float32, torch.float16, torch.bfloat16):
            raise BackendError(f"triton backend supports float32/float16/bfloat16, int8 and fp8, not {dtype}")
        return L.allocate(self.layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                          quant_group_size)

    def write_kv(self, kv_cache: L.PagedKVCache, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` ``[num_tokens, Hkv, d]`` to ``slot_mapping`` (``-1`` skipped)."""
        n = key.shape[0]
        if n == 0:
            return
        c = kv_cache
        if c.quant is None:
            key, value = key.to(c.dtype), value.to(c.dtype)
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
        kn = c.key_nhd()
        if c.quant is not None:
            ss = c.scale_nhd("key").stride()[:3]
            hg_pad = _next_pow2(c.num_kv_heads * c.num_groups)
            block_t = 256 if _interpreting() else max(1, min(16, 4096 // (hg_pad * _next_pow2(c.group_size))))
            _write_kv_quant_kernel[(triton.cdiv(n, block_t),)](
                key, value, c.key, c.value, c.key_scale, c.value_scale, slot_mapping.to(torch.int64), n,
                key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kn.stride()[:3], *ss,
                c.block_size, c.num_kv_heads, c.num_groups, c.quant.qmax,
                GRP=c.group_size, KDT=c.quant.kernel_id, BLOCK_T=block_t, HG_PAD=hg_pad,
                G_PAD=_next_pow2(c.group_size),
            )
            return
        d_pad = _next_pow2(c.head_dim)
        block_hd = _next_pow2(c.num_kv_heads) * d_pad
        # tokens per program: a few on a GPU; many under the interpreter (per-program cost)
        block_t = 256 if _interpreting() else max(1, min(16, 4096 // block_hd))
        _write_kv_kernel[(triton.cdiv(n, block_t),)](
            key, value, c.key, c.value, slot_mapping.to(torch.int64), n,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kn.stride(0), kn.stride(1), kn.stride(2),
            c.block_size, c.num_kv_heads, c.head_dim,
            BLOCK_T=block_t, BLOCK_HD=block_hd, D_PAD=d_pad,
        )

    def copy_blocks(self, kv_cache: L.PagedKVCache, copies: Sequence[tuple[int, int]]) -> None:
        """Copy physical blocks ``src -> dst`` (K and V)."""
        L.copy_blocks(kv_cache, copies)

    def gather_kv(self, kv_cache: L.PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, Hkv, d]`` at ``slots`` (int64 ``[n]``); float32 dequantised values for
        a quantised cache."""
        return L.gather(kv_cache, slots)

    def gather_kv_raw(self, kv_cache: L.PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(K, V, K scales, V scales)`` as stored at ``slots`` (see ``layouts.gather_raw``)."""
        return L.gather_raw(kv_cache, slots)

    # -- attention ------------------------------------------------------------------------
    def _workspace(self, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        k = (key, device)
        buf = self._ws.get(k)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(buf.numel() * 1.5) if buf is not None else 0), dtype=torch.float32, device=device)
            self._ws[k] = buf
        return buf[:numel].view(shape)

    def forward(self, query: torch.Tensor, kv_cache: L.PagedKVCache, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Causal paged attention; ``query`` ``[num_tokens, Hq, d]`` -> same shape and dtype.
        ``sliding_window`` (tokens) / ``logits_soft_cap``: see ``pagedkv.attention.base``; the
        kernels start each query tile at its window (out-of-window blocks are not read)."""
        n, hq, d = check_inputs(query, kv_cache, metadata)
        window, cap = check_window(sliding_window, logits_soft_cap)
        wargs = (window, cap or 1.0)
        wconst = {"WINDOW": window > 0, "SOFTCAP": cap > 0}
        c, md = kv_cache, metadata
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty((n, hq, d), dtype=query.dtype, device=query.device)
        num_seqs = md.num_seqs
        if num_seqs == 0:
            return out.zero_()
        if md.query_lens_list is not None:
            n_real = sum(md.query_lens_list)
            if n_real < n:
                out[n_real:].zero_()
        elif n > 0:
            out.zero_()  # padding rows (if any) must be defined; cheap next to attention
        group = hq // c.num_kv_heads
        d_pad = max(16, _next_pow2(d))
        kn = c.key_nhd()
        s_blk, s_tok, s_head = kn.stride(0), kn.stride(1), kn.stride(2)
        bt = md.block_tables
        if bt.dtype != torch.int32 or bt.stride(-1) != 1:
            bt = bt.to(torch.int32).contiguous()
        seq_lens = md.seq_lens.to(torch.int32)
        qsl = md.query_start_loc.to(torch.int32)
        dot_f32 = _interpreting() or c.dtype == torch.float32 or (c.quant is not None and query.dtype == torch.float32)
        if c.quant is not None:  # codes + scales (a plain cache passes K/V again as unused scale pointers)
            qargs = (c.key_scale, c.value_scale, *c.scale_nhd("key").stride()[:3])
            qconst = {"GRP": c.group_size, "KDT": c.quant.kernel_id}
        else:
            qargs, qconst = (c.key, c.value, 0, 0, 0), {"GRP": 1, "KDT": 0}
        # decode rows (q_len == 1), split-K when the longest context exceeds split_len
        longest = min(md.max_seq_len, window) if window else md.max_seq_len  # keys a decode row reads
        num_splits = max(1, cdiv(longest, self.split_len))
        split = num_splits > 1
        split_len = self.split_len if split else max(longest, 1)
        if split:
            pm = self._workspace("m", (num_seqs, hq, num_splits), query.device)
            pl = self._workspace("l", (num_seqs, hq, num_splits), query.device)
            pa = self._workspace("acc", (num_seqs, hq, num_splits, d_pad), query.device)
        else:
            pm = pl = pa = out  # unused
        if not (md.query_lens_list is not None and all(ql != 1 for ql in md.query_lens_list)):
            _decode_kernel[(num_seqs, c.num_kv_heads, num_splits)](
                query, c.key, c.value, out, bt, seq_lens, qsl, pm, pl, pa, float(scale),
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                s_blk, s_tok, s_head, bt.stride(0),
                c.block_size, d, num_splits, split_len, *qargs, *wargs,
                GROUP=group, G_PAD=max(16, _next_pow2(group)), D_PAD=d_pad, BLOCK_N=self.block_n,
                DOT_F32=dot_f32, SPLIT=split, **qconst, **wconst, **self._launch,
            )
            if split:
                _reduce_kernel[(num_seqs, hq)](
                    out, qsl, seq_lens, pm, pl, pa, out.stride(0), out.stride(1), d, hq, num_splits, split_len, window,
                    S_PAD=max(2, _next_pow2(num_splits)), D_PAD=d_pad, WINDOW=window > 0, num_warps=self.num_warps,
                )
        if md.max_query_len > 1:
            g_pad = _next_pow2(group)
            block_m = max(1, self.block_m // g_pad)  # query positions per tile (rows = block_m * g_pad)
            _prefill_kernel[(num_seqs, c.num_kv_heads, triton.cdiv(md.max_query_len, block_m))](
                query, c.key, c.value, out, bt, seq_lens, qsl, float(scale),
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                s_blk, s_tok, s_head, bt.stride(0),
                c.block_size, d, *qargs, *wargs,
                GROUP=group, G_PAD=g_pad, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=self.block_n,
                DOT_F32=dot_f32, **qconst, **wconst, **self._launch,
            )
        return out
