"""The fast CPU backend (the engine's default): paged attention without per-call gather
buffers.

Every query row goes to one small C kernel (``pagedkv/csrc/cpu_kernel.c``, built once with the
system C compiler and loaded with ``ctypes`` by ``pagedkv.ops.cpu_kernel``): prefill chunks, decode rows, speculative verify
rows and recomputes alike. It walks the block table in 16-token tiles and reads each K/V element
of a work item's context once for up to 4 consecutive query rows and all query heads of a
KV-head group, with an online softmax in float32 (bf16/fp16 caches are widened on load).

**Batch invariance** (docs/determinism.md): a row's output is a function of its query and its
visible keys/values only (tiles and context segments at absolute positions, one dot-product
and one reduction order), so the same prompt gets bit-identical attention alone or in any
batch, in any chunk, with or without a prefix-cache hit, on any thread count.

When the kernel cannot run (no compiler, ``use_kernel=False``, a head dim over 256 or not a
multiple of 8), the torch path gathers the sequence's blocks with ``index_select(out=...)``
into a persistent workspace and runs one ``scaled_dot_product_attention`` per chunk (decode
rows: float32 matmul / softmax / matmul); it is exact to float32 rounding but not batch-invariant.
Attention sinks (the ``sinks`` option, gpt-oss: one more logit per query head in each softmax's
denominator) run on both: the kernel joins each head's sink to a row's running max and sum where
it stores the row, the torch path appends it as one more score column (its quantised path starts
the online softmax from it).

Layouts: ``nhd`` (default), ``hnd`` and ``ascend``; the kernel takes the layout as strides.

Quantised caches (int8, fp8; :mod:`pagedkv.attention.quant`): the kernel dequantises each 16-token
K and V tile in L1; the torch path dequantises ``TILE_TOKENS`` of context at a time into a small
float32 tile and merges the tiles with an online softmax. Neither ever expands a whole context
(let alone the cache) to float32.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Sequence

import torch

from pagedkv.utils import cdiv
import torch.nn.functional as F

from pagedkv.attention import layouts as L
from pagedkv.attention import quant as Q
from pagedkv.attention.base import AttentionMetadata, BackendCapabilities, check_window, window_start
from pagedkv.errors import BackendError
from pagedkv.attention.reference import LayoutMemory, check_inputs, check_sinks, lists_of

# Context tokens the torch path dequantises at once for a quantised cache.
TILE_TOKENS = 256


class _Workspace:
    """Grow-only scratch buffers, one set per (dtype, device); reused by every call."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        k = (key, dtype, device)
        buf = self._bufs.get(k)
        if buf is None or buf.numel() < numel:
            # grow by 1.5x so that slowly growing contexts do not reallocate every step
            size = max(numel, int(buf.numel() * 1.5) if buf is not None else numel)
            buf = torch.empty(size, dtype=dtype, device=device)
            self._bufs[k] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._bufs.clear()


class CPUBackend(LayoutMemory):
    """Fast CPU paged attention (see module doc). ``layout``: ``nhd`` | ``hnd`` | ``ascend``.
    ``use_kernel=False`` forces the pure-torch path (used by tests and the benchmark)."""

    #: every optional method (pagedkv.attention.base): the fused layer, decoder.c's native step,
    #: and compiled steps' attention through the C++ op's StepTable (pagedkv.model.compiled)
    capabilities = BackendCapabilities(write_and_forward=True, native_step=True, step_attention=True,
                                       step_table=True, attention_sinks=True)

    def __init__(self, layout: str = "nhd", name: str | None = None, use_kernel: bool = True) -> None:
        self.layout = L.get_layout(layout)
        self.name = name or ("cpu" if layout == "nhd" else f"cpu-{layout}")
        self.use_kernel = use_kernel
        self._local = threading.local()  # scratch per thread: two engines may share a process

    @property
    def _ws(self) -> _Workspace:
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = _Workspace()
        return ws

    # -- attention ------------------------------------------------------------------------
    def _plan(self, md: AttentionMetadata, kernel) -> "_Plan":
        """Per-step facts shared by every layer (the metadata is built once per step): cached
        on the metadata object so 30 layers pay for them once."""
        plan = md.__dict__.get("_pagedkv_cpu_plan")
        # keyed on the lengths' values too, so metadata refilled in place is not served stale
        seq_lens = md.seq_lens_list if md.seq_lens_list is not None else md.seq_lens.tolist()
        q_lens = md.query_lens_list if md.query_lens_list is not None else md.query_start_loc.tolist()
        key = (tuple(seq_lens), tuple(q_lens), id(md.seq_lens), id(md.query_start_loc),
               id(md.block_tables), md.block_tables.data_ptr(), kernel is not None)
        if plan is not None and plan.key == key:
            return plan
        plan = _Plan(md, kernel, key)
        md.__dict__["_pagedkv_cpu_plan"] = plan
        return plan

    def forward(self, query: torch.Tensor, kv_cache: L.PagedKVCache, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal paged attention; ``query`` ``[num_tokens, num_heads, head_dim]`` -> output of
        the same shape and dtype; ``sliding_window`` (tokens) / ``logits_soft_cap`` / ``sinks``
        (float ``[num_heads]``) as in ``pagedkv.attention.base`` (out-of-window blocks
        are never read). Raises ``BackendError`` on shape mismatches or a bad window / cap / sinks."""
        n, hq, d = check_inputs(query, kv_cache, metadata)
        window, cap = check_window(sliding_window, logits_soft_cap)
        sink = check_sinks(sinks, hq, query.device)
        kernel = _kernel() if self.use_kernel and query.device.type == "cpu" else None
        if kernel is not None and not (isinstance(kv_cache, L.PagedKVCache) and kernel.supports(query, kv_cache)):
            kernel = None
        plan = self._plan(metadata, kernel)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.num_real < n:  # padding rows of the flat batch
            out[plan.num_real:].zero_()
        if plan.kernel_seqs:
            kernel.run(query, kv_cache, plan, scale, out, window=window, soft_cap=cap,
                       sinks=None if sink is None else sink.contiguous())
        for i in plan.torch_seqs:
            a, b = plan.starts[i], plan.starts[i + 1]
            out[a:b] = self._attend_torch(query[a:b], kv_cache, metadata.block_tables[i], plan.seq_lens[i], scale,
                                          window, cap, sink)
        return out

    def write_and_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: L.PagedKVCache, metadata: AttentionMetadata, scale: float,
                          sliding_window: int | None = None,
                          logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``write_kv(kv_cache, key, value, metadata.slot_mapping)`` then ``forward(query, ...)``
        (same results, same errors): a layer's whole attention. When every sequence of the
        step goes to the C kernel over a float32/bf16 cache, it is one call into
        ``pagedkv_write_attend`` with inputs prepared once per step (a decode layer costs a
        few microseconds of Python instead of ~60; ``sinks`` included); otherwise the two calls.
        Raises ``BackendError`` (shapes, options, a slot past the cache)."""
        sink = check_sinks(sinks, query.shape[1], query.device)  # (before anything is written)
        args = self._fused_args(query, key, value, kv_cache, metadata)
        if args is None:
            self.write_kv(kv_cache, key, value, metadata.slot_mapping)
            return self.forward(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap, sinks)
        window, cap = check_window(sliding_window, logits_soft_cap)
        return _write_attend(args, query, key, value, kv_cache, scale, window, cap,
                             None if sink is None else sink.contiguous())

    def native_step_args(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_caches: Sequence[L.PagedKVCache], metadata: AttentionMetadata):
        """The C kernel's prepared arguments ``(kernel, byref(LayerArgs), LayerArgs)`` for a step
        whose every layer attends ``query``-shaped rows over caches of ``kv_caches[0]``'s
        geometry with ``metadata`` (``pagedkv.model.native_step`` calls ``pagedkv_write_attend``
        itself with them); ``None`` when a cache differs in geometry or the step needs the
        torch path. The checks are :meth:`write_and_forward`'s (``BackendError``)."""
        geom = _geometry(kv_caches[0])
        if any(_geometry(c) != geom for c in kv_caches[1:]):
            return None
        return self._fused_args(query, key, value, kv_caches[0], metadata)

    def latent_step_args(self, kv_caches: Sequence[L.PagedKVCache], metadata: AttentionMetadata, num_tokens: int):
        """The C kernel's per-step ``LayerArgs`` (``pagedkv.ops.cpu_kernel``) for the layers of
        the multi-head latent attention caches ``kv_caches`` (each one float32 "head" of
        ``kv_lora_rank + qk_rope_head_dim`` per token, or int8 codes plus per-token bf16
        scales, ``pagedkv.model.mla``) over ``num_tokens``
        rows: block tables, lengths, slots and the caches' strides, which
        ``pagedkv/csrc/decoder.c``'s latent attention reads (``pagedkv.model.native_step``).
        ``None`` when it does not apply (a cache of another geometry than the first, an fp8 or
        a plain non-float32 cache, no kernel, a slot_mapping of another length or type). Built once
        per (step metadata, cache geometry), kept on the step's plan."""
        kv_cache = kv_caches[0]
        geom = _geometry(kv_cache)
        if any(_geometry(c) != geom for c in kv_caches[1:]):
            return None
        kernel = _kernel() if self.use_kernel else None
        if kernel is None or not isinstance(kv_cache, L.PagedKVCache) or kv_cache.num_kv_heads != 1:
            return None
        if (kv_cache.key.dtype != torch.float32 if kv_cache.quant is None
                else kv_cache.quant.name != "int8" or kv_cache.key_scale.dtype != torch.bfloat16):
            return None
        slots = metadata.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != num_tokens \
                or metadata.num_tokens != num_tokens:
            return None
        plan = self._plan(metadata, kernel)
        if not plan.kernel_seqs:
            return None
        if plan.fused_slots is not slots:  # a new slot_mapping tensor: nothing prepared is valid
            plan.fused_slots, plan.fused = slots, {}
        key = ("latent", geom)
        hit = plan.fused.get(key)
        if hit is None:
            hit = plan.fused[key] = kernel.latent_args(kv_cache, plan, slots)
        return hit

    def step_attention(self, kv_caches: Sequence[L.PagedKVCache], metadata: AttentionMetadata,
                       options: Sequence[tuple[float, int | None, float | None]], table=None):
        """Every layer's attention for one step whose layers share ``metadata`` (a compiled
        decode step, ``pagedkv.model.compiled``): returns ``attend(i, q, k, v) -> out``, the same
        as ``write_and_forward(q, k, v, kv_caches[i], metadata, *options[i])`` (``options[i]``:
        ``(scale, sliding_window, logits_soft_cap)``), with the work that cannot change within
        the step done once: the options checked here (``BackendError``), and for the first
        layer of each cache geometry the full checks and kernel arguments of
        :meth:`write_and_forward`; every layer of that geometry whose ``q``/``k``/``v`` have the
        first one's shapes and dtypes (contiguous) goes straight to the C kernel (~8 us of
        Python a layer instead of ~30). Anything else takes :meth:`write_and_forward`. ``attend`` is for this
        one step: ``metadata`` must not change while it is used (the engine builds it per step).
        ``table``: a ``step_op.StepTable`` to begin for this step (the caller ends it when the
        step is over): each geometry's prepared arguments also go there, so that
        ``pagedkv::step_layer_attention`` runs that geometry's later layers without Python.
        Raises ``BackendError`` for a bad window or cap."""
        checked = [(float(s), *check_window(w, c)) for s, w, c in options]
        prepared: dict = {}  # cache geometry -> ((kernel, args ref, LayerArgs), q/k/v signature) or None, this step
        groups = self._begin_step(table, kv_caches, checked) if table is not None else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = kv_caches[i]
            scale, window, cap = checked[i]
            geom = _geometry(cache)
            sig = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
            if geom not in prepared:  # the first layer of this geometry: the checked preparation
                args = self._fused_args(q, k, v, cache, metadata)
                prepared[geom] = None if args is None else (args, sig)
                if args is not None and groups is not None:
                    table.prepare(groups[geom], args[2])
            hit = prepared[geom]
            if hit is not None and sig == hit[1] and q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
                return _write_attend(hit[0], q, k, v, cache, scale, window, cap)
            return self.write_and_forward(q, k, v, cache, metadata, scale, window or None, cap or None)

        return attend

    def _begin_step(self, table, kv_caches: Sequence[L.PagedKVCache], checked: list) -> dict:
        """Begin ``table``'s step with every layer's cache buffers and checked options (the
        array is kept while the same cache objects, with the same key/value tensors, and the
        same options come back; held weakly, so it keeps no cache alive); returns the
        geometry -> group index map."""
        from pagedkv.ops import step_op

        memo = self.__dict__.get("_step_entries")
        objs = [o for c in kv_caches for o in (c, c.key, c.value)]
        if (memo is None or memo[0] != checked or len(memo[1]) != len(objs)
                or any(r() is not o for r, o in zip(memo[1], objs))):
            memo = (checked, [weakref.ref(o) for o in objs], *step_op.layer_entries(kv_caches, checked, _geometry))
            self._step_entries = memo
        table.begin(memo[2], len(memo[3]))
        return memo[3]

    def _fused_args(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: L.PagedKVCache,
                    md: AttentionMetadata):
        """``(kernel, byref(LayerArgs), LayerArgs)`` for :meth:`write_and_forward`'s one-call path, or
        ``None``. The arguments are built once per (step metadata, query/cache geometry); the
        last ones are kept on the metadata and reused while the next layer's shapes, dtypes,
        cache geometry, ``slot_mapping`` tensor and step plan are the same."""
        if not self.use_kernel or query.device.type != "cpu":
            return None
        slots = md.slot_mapping
        # the previous layer's answer when this layer looks the same (every layer of a decode
        # step does): the checks below cost ~9 us a layer hot, ~30 in a step's cold caches
        sig = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, _geometry(cache))
        last = md.__dict__.get("_pagedkv_cpu_fused_last")
        if (last is not None and last[0] == sig and last[1] is slots
                and query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
                and self._plan(md, last[2][0]) is last[3]):
            return last[2]
        kernel = _kernel()
        if (kernel is None or slots.dtype != torch.int64 or not slots.is_contiguous()
                or query.dim() != 3 or key.dim() != 3 or key.shape != value.shape
                or key.dtype != query.dtype or value.dtype != query.dtype or key.shape[0] != query.shape[0]
                or key.shape[1] != cache.num_kv_heads or key.shape[2] != cache.head_dim
                or not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous())):
            return None
        check_inputs(query, cache, md)
        plan = self._plan(md, kernel)
        gk = (query.dtype, query.shape[1], _geometry(cache))
        if plan.fused_slots is not slots:  # a new slot_mapping tensor: nothing prepared is valid
            plan.fused_slots, plan.fused = slots, {}
        hit = plan.fused.get(gk)
        if hit is None:
            la = kernel.layer_args(query, cache, plan, slots) if isinstance(cache, L.PagedKVCache) else None
            hit = plan.fused[gk] = (kernel, la.ref(), la) if la is not None else ()
        if not hit:
            return None
        md.__dict__["_pagedkv_cpu_fused_last"] = (sig, slots, hit, plan)
        return hit

    def _gather_seq(self, cache: L.PagedKVCache, table_row: torch.Tensor, seq_len: int, lo: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``lo .. seq_len-1`` of one sequence as ``[Hkv, seq_len - lo, d]``
        views into the workspace (blocks before ``lo``'s are not read)."""
        bs, h, d = cache.block_size, cache.num_kv_heads, cache.head_dim
        b0 = lo // bs
        nblk = cdiv(seq_len, bs) - b0
        idx = table_row[b0 : b0 + nblk]
        per_block = bs * h * d
        a, e = lo - b0 * bs, seq_len - b0 * bs
        res = []
        for name, t in (("k", cache.key), ("v", cache.value)):
            ws = self._ws.get(name, nblk * per_block, t.dtype, t.device)
            if self.layout.name == "hnd":
                src = t.view(t.shape[0], h, bs * d).transpose(0, 1)  # [h, nb, bs*d]
                torch.index_select(src, 1, idx, out=ws.view(h, nblk, bs * d))
                res.append(ws.view(h, nblk * bs, d)[:, a:e])
            else:
                torch.index_select(t.view(t.shape[0], per_block), 0, idx, out=ws.view(nblk, per_block))
                res.append(ws.view(nblk * bs, h, d)[a:e].transpose(0, 1))
        return res[0], res[1]

    def _attend_torch(self, q: torch.Tensor, cache: L.PagedKVCache, table_row: torch.Tensor,
                      seq_len: int, scale: float, window: int = 0, cap: float = 0.0,
                      sink: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: ``q`` ``[ql, hq, d]`` over its cached positions ``lo .. seq_len-1``
        (``lo`` = the first query's window start; 0 without a window); ``sink`` float32 ``[hq]``."""
        if cache.quant is not None:
            return _attend_quantized(q, cache, table_row, seq_len, scale, window, cap, sink)
        ql, hq, d = q.shape
        h = cache.num_kv_heads
        lo = window_start(seq_len - ql, window)
        n = seq_len - lo
        k, v = self._gather_seq(cache, table_row, seq_len, lo)  # [h, n, d] views of the workspace
        if k.dtype != torch.float32:  # compute in float32 like the decode kernel and the oracle
            k32 = self._ws.get("k32", h * n * d, torch.float32, k.device).view(h, n, d)
            v32 = self._ws.get("v32", h * n * d, torch.float32, v.device).view(h, n, d)
            k = k32.copy_(k)
            v = v32.copy_(v)
        if ql > 1 and not cap and sink is None:
            # a chunk: one fused SDPA call (flash kernel) with the chunk's bottom-right causal
            # mask (query row j sits at position seq_len - ql + j)
            qh = q.float().transpose(0, 1).unsqueeze(0)  # [1, hq, ql, d]
            if ql == seq_len and not window:
                o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0),
                                                   attn_mask=_visible(seq_len, ql, lo, window, q.device),
                                                   scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1).to(q.dtype)
        # decode rows (torch fallback), soft-capped chunks and sinks: float32 matmuls, the GQA group
        # and the query rows as rows of one matrix per KV head
        g = hq // h
        qh = q.float().reshape(ql, h, g, d).permute(1, 2, 0, 3).reshape(h, g * ql, d)
        scores = torch.bmm(qh, k.transpose(1, 2))  # [h, g*ql, n]
        scores.mul_(scale)
        if cap:
            scores = torch.tanh(scores.div_(cap)).mul_(cap)
        if ql > 1:
            mask = _visible(seq_len, ql, lo, window, q.device)  # [ql, n]
            scores = scores.view(h, g, ql, n).masked_fill(~mask, float("-inf")).view(h, g * ql, n)
        if sink is not None:  # each row's head's sink as one more logit, dropped after the softmax
            col = sink.view(h, g, 1, 1).expand(h, g, ql, 1).reshape(h, g * ql, 1)
            scores = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :n]
        else:
            torch.softmax(scores, dim=-1, out=scores)
        o = torch.bmm(scores, v)  # [h, g*ql, d]
        return o.view(h, g, ql, d).permute(2, 0, 1, 3).reshape(ql, hq, d).to(q.dtype)


def _visible(seq_len: int, ql: int, lo: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[ql, seq_len - lo]``: query row j (position ``seq_len - ql + j``) sees key
    position ``lo + c`` (causal, and inside the window when ``window`` > 0)."""
    q_pos = torch.arange(seq_len - ql, seq_len, device=device)[:, None]
    k_pos = torch.arange(lo, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return mask


def _attend_quantized(q: torch.Tensor, cache: L.PagedKVCache, table_row: torch.Tensor, seq_len: int,
                      scale: float, window: int = 0, cap: float = 0.0, sink: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence over a quantised cache, ``q`` ``[ql, hq, d]`` -> ``[ql, hq, d]``: the
    context (from the first query's window start) is dequantised ``TILE_TOKENS`` (whole
    blocks) at a time; scores of each tile are merged with an online softmax (running max
    ``m``, sum ``l``, accumulator ``acc``; float32), which starts from the sink (``m`` = sink,
    ``l`` = 1) when ``sink`` ``[hq]`` is given."""
    ql, hq, d = q.shape
    h, bs = cache.num_kv_heads, cache.block_size
    g = hq // h
    lo = window_start(seq_len - ql, window)
    nblk = cdiv(seq_len, bs)
    tile = max(1, TILE_TOKENS // bs)
    rows = g * ql  # per KV head: its g query heads x the ql query rows (row r: head r // ql)
    qh = q.float().reshape(ql, h, g, d).permute(1, 2, 0, 3).reshape(h, rows, d) * scale
    q_pos = torch.arange(seq_len - ql, seq_len, device=q.device).repeat(g)  # [rows]
    m = torch.full((h, rows, 1), float("-inf"), device=q.device)
    l = torch.zeros((h, rows, 1), device=q.device)
    if sink is not None:  # the sink is a logit already seen, with no value
        m = sink.view(h, g, 1, 1).expand(h, g, ql, 1).reshape(h, rows, 1).clone()
        l = torch.ones_like(m)
    acc = torch.zeros((h, rows, d), device=q.device)
    views = ((cache.key_nhd(), cache.scale_nhd("key")), (cache.value_nhd(), cache.scale_nhd("value")))
    for b0 in range(lo // bs, nblk, tile):
        idx = table_row[b0 : min(nblk, b0 + tile)].to(torch.int64)
        t0 = max(b0 * bs, lo)  # positions before lo are never read (they may be freed)
        n = min(seq_len, b0 * bs + idx.numel() * bs) - t0
        skip = t0 - b0 * bs
        k, v = (Q.dequantize(c.index_select(0, idx), s.index_select(0, idx), cache.quant)
                .view(-1, h, d)[skip : skip + n].transpose(0, 1) for c, s in views)  # [h, n, d] float32
        sc = torch.bmm(qh, k.transpose(1, 2))  # [h, rows, n]
        if cap:
            sc = torch.tanh(sc / cap) * cap
        k_pos = torch.arange(t0, t0 + n, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        sc.masked_fill_(hidden[None], float("-inf"))
        # a row may see nothing in a tile (window): keep its m at -inf and its p at 0
        m_new = torch.maximum(m, sc.amax(dim=-1, keepdim=True))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_use)
        p = torch.exp(sc - m_use)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v)
        m = m_new
    out = (acc / l).view(h, g, ql, d).permute(2, 0, 1, 3).reshape(ql, hq, d)
    return out.to(q.dtype)


class _Plan:
    """Which sequences go to the kernel / the torch path, plus the kernel's int32 inputs."""

    def __init__(self, md: AttentionMetadata, kernel, key) -> None:
        self.key = key
        self.fused_slots: torch.Tensor | None = None  # write_and_forward's prepared calls,
        self.fused: dict = {}  # keyed by query/cache geometry, valid for fused_slots
        self.seq_lens, self.q_lens, self.starts = lists_of(md)
        self.num_real = self.starts[-1]
        live = [i for i, ql in enumerate(self.q_lens) if ql > 0]
        self.kernel_seqs = live if kernel is not None else []
        self.torch_seqs = [] if kernel is not None else live
        if self.kernel_seqs:
            from pagedkv.ops.cpu_kernel import KernelInputs

            self.kernel_inputs = KernelInputs(md, self.kernel_seqs, [self.q_lens[i] for i in self.kernel_seqs])


def _write_attend(args, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: L.PagedKVCache,
                  scale: float, window: int, cap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer through the fused kernel with ``args`` = ``(kernel, ref, LayerArgs)`` from
    ``CPUBackend._fused_args`` (inputs already checked; ``sinks`` float32 ``[Hq]`` contiguous or
    ``None``); ``BackendError`` for a slot past the cache (nothing written)."""
    kernel, ref = args[0], args[1]
    out = torch.empty_like(query)
    rc = kernel.write_attend(ref, query, key, value, cache, out, scale, window, cap, sinks)
    if rc == -4:
        raise BackendError(f"slot_mapping has a slot >= the cache's {cache.num_blocks * cache.block_size} "
                           "slots (nothing written)")
    if rc != 0:
        raise RuntimeError(f"pagedkv CPU kernel failed with code {rc}")
    return out


def _geometry(cache: L.PagedKVCache) -> tuple:
    """What the fused kernel's prepared arguments depend on in a cache (not its buffers'
    addresses); remembered on the cache while its ``key`` and ``value`` tensors stay the same."""
    memo = cache.__dict__.get("_pagedkv_geometry")
    if memo is not None and memo[0] is cache.key and memo[1] is cache.value:
        return memo[2]
    geom = (cache.layout.name, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
            cache.key.dtype, tuple(cache.key.shape), tuple(cache.key.stride()), tuple(cache.value.shape),
            tuple(cache.value.stride()), cache.value.dtype, cache.quant, cache.group_size)
    cache.__dict__["_pagedkv_geometry"] = (cache.key, cache.value, geom)
    return geom


def _kernel():
    """The compiled decode kernel, or ``None`` when it cannot be built here."""
    from pagedkv.ops import cpu_kernel

    return cpu_kernel.get()
