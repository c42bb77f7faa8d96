"""Every registered attention backend (and layout) passes the conformance kit; the kit itself
catches broken backends (it is not vacuous)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.reference import ReferenceBackend
from pagedkv.testing import check_backend, conformance_cases, pytest_params, run_case


def _backend(name: str):
    from pagedkv.attention import get_backend
    from pagedkv.errors import BackendError

    try:
        return get_backend(name)  # the triton backend sets TRITON_INTERPRET=1 without CUDA
    except BackendError as exc:
        pytest.skip(str(exc))


_CACHE: dict[str, object] = {}


@pytest.mark.parametrize("backend_case", pytest_params())
def test_backend_conformance(backend_case):
    name, case, dtype = backend_case
    be = _CACHE.get(name) or _CACHE.setdefault(name, _backend(name))
    res = run_case(be, case, dtype)
    assert res.ok, res.line()


# --- the kit must fail backends that break the protocol -----------------------------------

class _ReadsOneBlockTooMany(ReferenceBackend):
    """Reads the block-table entry after the last needed one (a padding entry)."""

    def forward(self, query, kv_cache, metadata, scale):
        md = metadata
        bs = kv_cache.block_size
        # pretend each sequence is one block longer when reading, then drop the extra keys'
        # scores only *after* multiplying by V (the classic 0 * NaN bug)
        out = super().forward(query, kv_cache, md, scale)
        extra = []
        for i, sl in enumerate(md.seq_lens.tolist()):
            nblk = -(-sl // bs)
            blk = int(md.block_tables[i, nblk]) if nblk < md.block_tables.shape[1] else 0
            k, v = self.gather_kv(kv_cache, torch.arange(blk * bs, blk * bs + bs))
            extra.append(v.float().sum() * 0.0)
        qsl = md.query_start_loc.tolist()
        for i, e in enumerate(extra):
            out[qsl[i] : qsl[i + 1]] += e.to(out.dtype)
        return out


class _TopLeftCausal(ReferenceBackend):
    """Causal mask aligned top-left (ignores cached context positions): wrong for chunks."""

    def forward(self, query, kv_cache, metadata, scale):
        out = torch.empty_like(query)
        qsl = metadata.query_start_loc.tolist()
        g = query.shape[1] // kv_cache.num_kv_heads
        from pagedkv.attention.reference import context_slots

        for i, sl in enumerate(metadata.seq_lens.tolist()):
            q = query[qsl[i] : qsl[i + 1]].float()
            k, v = self.gather_kv(kv_cache, context_slots(metadata.block_tables[i], sl, kv_cache.block_size))
            k = k.float().repeat_interleave(g, 1)
            v = v.float().repeat_interleave(g, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            mask = torch.ones(q.shape[0], sl, dtype=torch.bool).tril()
            s = s.masked_fill(~mask, float("-inf"))
            out[qsl[i] : qsl[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(query.dtype)
        return out


class _WrongGQAMapping(ReferenceBackend):
    """Maps query head h to KV head h % Hkv instead of h // (Hq / Hkv)."""

    def forward(self, query, kv_cache, metadata, scale):
        hq, hkv = query.shape[1], kv_cache.num_kv_heads
        perm = torch.tensor([(h % hkv) * (hq // hkv) + h // hkv for h in range(hq)])
        inv = torch.argsort(perm)
        return super().forward(query[:, perm], kv_cache, metadata, scale)[:, inv]


class _IgnoresMinusOneSlots(ReferenceBackend):
    """Writes slot -1 rows to the last slot of the cache (python-style negative index)."""

    def write_kv(self, kv_cache, key, value, slot_mapping):
        slots = slot_mapping.clone()
        slots[slots < 0] = kv_cache.num_blocks * kv_cache.block_size - 1
        self.layout.write(kv_cache.key, key, slots, kv_cache.block_size)
        self.layout.write(kv_cache.value, value, slots, kv_cache.block_size)


class _IgnoresWindow(ReferenceBackend):
    """Attends over the whole context whatever the window (reads freed blocks)."""

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, logits_soft_cap=None):
        return super().forward(query, kv_cache, metadata, scale, logits_soft_cap=logits_soft_cap)


class _WindowOffByOne(ReferenceBackend):
    """Sees one key more than the window (p - window <= k <= p) by widening it by one."""

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, logits_soft_cap=None):
        w = sliding_window + 1 if sliding_window else None
        return super().forward(query, kv_cache, metadata, scale, sliding_window=w, logits_soft_cap=logits_soft_cap)


class _CapsAfterMask(ReferenceBackend):
    """Ignores the soft cap (softmax of raw scores)."""

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, logits_soft_cap=None):
        return super().forward(query, kv_cache, metadata, scale, sliding_window=sliding_window)


@pytest.mark.parametrize("broken", [_IgnoresWindow, _WindowOffByOne, _CapsAfterMask])
def test_kit_rejects_wrong_windows_and_caps(broken):
    from pagedkv.testing import window_cases

    report = check_backend(broken(), dtypes=(torch.float32,), cases=window_cases(small=True))
    failed = {r.case for r in report.failures}
    if broken is _CapsAfterMask:
        assert failed == {"softcap_mixed", "window_softcap"}
    else:
        assert failed >= {"window_lt_block", "window_eq_block", "window_spans_blocks", "window_bs1", "window_softcap"}


def test_bad_window_or_cap_is_a_backend_error():
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata
    from pagedkv.errors import BackendError

    for name in ("reference", "cpu"):
        be = get_backend(name)
        cache = be.allocate_kv_cache(2, 4, 1, 8, torch.float32)
        md = AttentionMetadata.build([3], [3], [[0]], 4)
        q = torch.zeros(3, 1, 8)
        for kw in ({"sliding_window": 0}, {"sliding_window": 2.5}, {"logits_soft_cap": 0.0},
                   {"logits_soft_cap": float("inf")}):
            with pytest.raises(BackendError):
                be.forward(q, cache, md, 1.0, **kw)


@pytest.mark.parametrize("broken", [_ReadsOneBlockTooMany, _TopLeftCausal, _WrongGQAMapping, _IgnoresMinusOneSlots])
def test_kit_rejects_broken_backends(broken):
    report = check_backend(broken(), dtypes=(torch.float32,))
    assert not report.ok
    assert "FAIL" in report.summary()


def test_cases_cover_the_issue_list():
    cases = conformance_cases()
    tags = {t for c in cases for t in c.tags}
    assert {"bs1", "bs128", "gqa1", "gqa3", "gqa8", "mqa", "long", "mixed", "prefix",
            "cached_all_but_last", "partial_block", "chunked", "window", "softcap"} <= tags
    # windows below, at and above the block size; one window longer than a split-K split
    assert {(c.sliding_window > c.block_size) - (c.sliding_window < c.block_size) for c in cases if c.sliding_window} == {-1, 0, 1}
    assert any(c.sliding_window and c.sliding_window > 512 for c in cases)
    assert any(c.num_kv_heads == 1 for c in cases)
    assert {c.gqa_ratio for c in cases} >= {1, 3, 8}
    assert all(c.table_padding > 0 and c.spare_blocks > 0 for c in cases)
