"""The fast CPU backend: kernel paths (split-K, head groups, threads), the torch fallback,
strided queries, layouts agree with each other; ``pagedkv check-backend`` front end."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import AttentionMetadata, get_backend
from pagedkv.ops import cpu_kernel
from pagedkv.attention.cpu import CPUBackend
from pagedkv.testing import Case, check_backend, conformance_cases, run_case


def _kernel():
    k = cpu_kernel.get()
    if k is None:
        pytest.skip(f"CPU kernel not built here: {cpu_kernel.build_error()}")
    return k


def test_torch_fallback_path_passes_the_kit():
    report = check_backend(CPUBackend(use_kernel=False), dtypes=(torch.float32, torch.bfloat16))
    assert report.ok, report.summary()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("min_split", [0, 16])
def test_kernel_split_k_and_threads(threads, min_split, monkeypatch):
    k = _kernel()
    monkeypatch.setattr(k, "min_split_len", min_split)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [c for c in conformance_cases() if {"long", "decode", "prefix", "window", "softcap"} & set(c.tags)]
        cases.append(Case("batch1_gqa8_split", (333,), (2,), 7, 16, 2, 64, tags=("split",)))
        report = check_backend(CPUBackend(), cases=cases)
    finally:
        torch.set_num_threads(old)
    assert report.ok, report.summary()


def _random_step(layout: str, dtype: torch.dtype, seq_lens, q_lens, bs=16, hq=9, hkv=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    be = CPUBackend(layout)
    need = sum(-(-s // bs) for s in seq_lens)
    perm = torch.randperm(need + 4, generator=g).tolist()
    tables, p = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[p : p + n])
        p += n
    cache = be.allocate_kv_cache(need + 4, bs, hkv, d, dtype)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, bs)
    be.write_kv(cache, torch.randn(full.num_tokens, hkv, d, generator=g).to(dtype),
                torch.randn(full.num_tokens, hkv, d, generator=g).to(dtype), full.slot_mapping)
    md = AttentionMetadata.build(seq_lens, q_lens, tables, bs)
    return be, cache, md


def test_strided_query_view_matches_contiguous():
    """The model may pass q as a view of a fused qkv projection (row stride > Hq*d)."""
    be, cache, md = _random_step("nhd", torch.float32, [40, 70], [1, 1])
    qkv = torch.randn(md.num_tokens, (9 + 6) * 64)
    q = qkv[:, : 9 * 64].view(md.num_tokens, 9, 64)
    assert not q.is_contiguous()
    out = be.forward(q, cache, md, 0.125)
    ref = be.forward(q.contiguous(), cache, md, 0.125)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layouts_give_the_same_output(dtype):
    outs = []
    for layout in ("nhd", "hnd", "ascend"):
        be, cache, md = _random_step(layout, dtype, [50, 33, 17], [1, 12, 17], seed=3)
        q = torch.randn(md.num_tokens, 9, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
        outs.append(be.forward(q, cache, md, 0.125).float())
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[0], outs[2], atol=1e-6)


def test_kernel_and_fallback_agree_on_decode():
    _kernel()
    be, cache, md = _random_step("nhd", torch.float32, [300, 45, 128], [1, 1, 1])
    q = torch.randn(md.num_tokens, 9, 64)
    fast = be.forward(q, cache, md, 0.125)
    slow = CPUBackend(use_kernel=False).forward(q, cache, md, 0.125)
    assert (fast - slow).abs().max() < 1e-5


def test_fp16_falls_back_and_passes():
    case = next(c for c in conformance_cases() if c.name == "mixed_prefill_decode")
    res = run_case(get_backend("cpu"), case, torch.float16)
    assert res.ok, res.line()


def test_padding_rows_of_flat_batch_are_zero():
    be, cache, md = _random_step("nhd", torch.float32, [20], [1])
    q = torch.randn(3, 9, 64)  # 2 padding rows past query_start_loc[-1]
    md.slot_mapping = torch.cat([md.slot_mapping, torch.tensor([-1, -1])])
    out = be.forward(q, cache, md, 0.125)
    assert torch.isfinite(out).all() and (out[1:] == 0).all()


def test_check_backend_cli(capsys):
    from pagedkv.cli import main

    assert main(["check-backend", "cpu", "reference-hnd", "--dtype", "float32", "--small"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.startswith("PASS") for line in out)
    assert main(["check-backend", "no-such-backend"]) == 2  # ConfigError -> CLI error


def test_metadata_refilled_in_place_is_not_served_stale():
    """The per-step plan cached on the metadata must notice new lengths in the same object."""
    be, cache, md = _random_step("nhd", torch.float32, [40, 70], [1, 1])
    q = torch.randn(2, 9, 64)
    be.forward(q, cache, md, 0.125)
    md.seq_lens[:] = torch.tensor([30, 50], dtype=torch.int32)
    md.seq_lens_list = [30, 50]
    md.max_seq_len = 50
    got = be.forward(q, cache, md, 0.125)
    want = get_backend("reference").forward(q, cache, md, 0.125)
    assert (got - want).abs().max() < 1e-5


# -- write_and_forward: the one-call decode path (pagedkv_write_attend) -----------------------
def _fused_step(layout, q_dtype, cache_dtype, seq_lens, q_lens, seed=0):
    """A step whose context is in two identical caches; returns (backend, cache_a, cache_b, md,
    q, k, v) with the step's new rows not yet written."""
    be, cache, md = _random_step(layout, cache_dtype, seq_lens, q_lens, seed=seed)
    twin = be.allocate_kv_cache(cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim, cache_dtype)
    twin.key.copy_(cache.key)
    twin.value.copy_(cache.value)
    g = torch.Generator().manual_seed(seed + 1)
    n = md.num_tokens
    q, k, v = (torch.randn(n, h, 64, generator=g).to(q_dtype) for h in (9, 3, 3))
    return be, cache, twin, md, q, k, v


def _calls(monkeypatch):
    k = _kernel()
    seen = []
    orig = type(k).write_attend
    monkeypatch.setattr(type(k), "write_attend", lambda self, *a, **kw: seen.append(1) or orig(self, *a, **kw))
    return seen


@pytest.mark.parametrize("layout", ["nhd", "hnd", "ascend"])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_write_and_forward_equals_write_kv_then_forward(layout, q_dtype, cache_dtype, monkeypatch):
    seen = _calls(monkeypatch)
    be, a, b, md, q, k, v = _fused_step(layout, q_dtype, cache_dtype, [40, 70, 16, 33], [1, 1, 1, 8])
    got = be.write_and_forward(q, k, v, a, md, 0.125, sliding_window=30, logits_soft_cap=20.0)
    assert seen == [1]  # the one-call path ran
    be.write_kv(b, k, v, md.slot_mapping)
    want = be.forward(q, b, md, 0.125, sliding_window=30, logits_soft_cap=20.0)
    assert got.dtype == q_dtype and torch.equal(got, want)
    assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)  # same bits written, nothing else


def test_write_and_forward_padding_rows_are_zero_and_not_written(monkeypatch):
    seen = _calls(monkeypatch)
    be, a, b, md, _, _, _ = _fused_step("nhd", torch.float32, torch.float32, [20, 9], [1, 1])
    md.slot_mapping = torch.cat([md.slot_mapping, torch.tensor([-1, -1])])
    q, k, v = torch.randn(4, 9, 64), torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    k[2:] = float("nan")
    v[2:] = float("nan")
    out = be.write_and_forward(q, k, v, a, md, 0.125)
    assert seen == [1]
    assert torch.isfinite(out).all() and (out[2:] == 0).all() and not (out[:2] == 0).all()
    assert torch.isfinite(a.key).all() and torch.isfinite(a.value).all()
    be.write_kv(b, k, v, md.slot_mapping)
    assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)


def test_write_and_forward_slot_past_the_cache_raises_and_writes_nothing(monkeypatch):
    from pagedkv.errors import BackendError

    _calls(monkeypatch)
    be, a, b, md, q, k, v = _fused_step("nhd", torch.float32, torch.float32, [20, 9], [1, 1])
    md.slot_mapping = torch.tensor([int(md.slot_mapping[0]), a.num_blocks * a.block_size])
    with pytest.raises(BackendError, match="slot"):
        be.write_and_forward(q, k, v, a, md, 0.125)
    assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)


def test_write_and_forward_prepares_once_per_step_and_sees_a_new_slot_mapping(monkeypatch):
    seen = _calls(monkeypatch)
    be, a, b, md, q, k, v = _fused_step("nhd", torch.float32, torch.float32, [40, 70], [1, 1])
    for _ in range(3):  # three "layers" over caches of one geometry: one prepared call
        be.write_and_forward(q, k, v, a, md, 0.125)
    plan = md.__dict__["_pagedkv_cpu_plan"]
    assert len(seen) == 3 and len(plan.fused) == 1
    # a fresh slot_mapping tensor (other slots) must be used, not the prepared one's
    table0 = md.block_tables[0].tolist()
    md.slot_mapping = torch.tensor([table0[0] * 16 + 5, int(md.slot_mapping[1])])
    be.write_and_forward(q, k, v, a, md, 0.125)
    assert torch.equal(a.key.view(-1, 3, 64)[table0[0] * 16 + 5], k[0])


def test_write_and_forward_reuses_the_last_layers_arguments_only_while_they_hold():
    """The per-step memo of the fused call's arguments (one layer to the next) must give way to
    refilled lengths, another cache geometry and a non-contiguous query (a new slot_mapping:
    the test above)."""
    be, a, b, md, q, k, v = _fused_step("nhd", torch.float32, torch.float32, [40, 70], [1, 1])
    ref = get_backend("reference")
    twin = be.allocate_kv_cache(a.num_blocks, 16, 3, 64, torch.float32)  # the next layer's cache
    twin.key.copy_(b.key)
    twin.value.copy_(b.value)
    first = be.write_and_forward(q, k, v, a, md, 0.125)
    memo = md.__dict__["_pagedkv_cpu_fused_last"]
    second = be.write_and_forward(q, k, v, twin, md, 0.125)  # served by the memo, into its own cache
    assert second.equal(first) and md.__dict__["_pagedkv_cpu_fused_last"] is memo
    assert twin.key.equal(a.key) and twin.value.equal(a.value) and not twin.key.equal(b.key)
    md.seq_lens[:] = torch.tensor([30, 50], dtype=torch.int32)  # refilled in place: a new plan
    md.seq_lens_list = [30, 50]
    md.max_seq_len = 50  # (same slot_mapping tensor: only the lengths tell the memo apart)
    got = be.write_and_forward(q, k, v, a, md, 0.125)
    be.write_kv(b, k, v, md.slot_mapping)
    assert (got - ref.forward(q, b, md, 0.125)).abs().max() < 1e-5
    assert md.__dict__["_pagedkv_cpu_fused_last"] is not memo
    c16 = be.allocate_kv_cache(a.num_blocks, 16, 3, 64, torch.bfloat16)  # another geometry
    c16.key.copy_(b.key.to(torch.bfloat16))
    c16.value.copy_(b.value.to(torch.bfloat16))
    got16 = be.write_and_forward(q, k, v, c16, md, 0.125)
    assert c16.key.equal(b.key.to(torch.bfloat16))  # written as bf16 at the new slots
    assert (got16 - ref.forward(q, c16, md, 0.125)).abs().max() < 1e-5
    wide = torch.randn(2, 9, 128)[:, :, :64]  # a strided query: a checked path, same result
    assert be.write_and_forward(wide, k, v, a, md, 0.125).equal(be.write_and_forward(wide.contiguous(), k, v, a, md, 0.125))


def test_write_and_forward_takes_chunks_and_falls_back_for_quantised_caches(monkeypatch):
    """A prefill chunk goes through the one fused call like a decode row (one kernel for every
    row); a quantised cache takes write_kv + forward."""
    seen = _calls(monkeypatch)
    be, a, b, md, q, k, v = _fused_step("nhd", torch.float32, torch.float32, [40, 70], [1, 20])  # a 20-row chunk
    got = be.write_and_forward(q, k, v, a, md, 0.125)
    be.write_kv(b, k, v, md.slot_mapping)
    assert seen == [1] and torch.equal(got, be.forward(q, b, md, 0.125))
    seen.clear()
    qc = be.allocate_kv_cache(a.num_blocks, 16, 3, 64, "int8", quant_group_size=32)
    md1 = AttentionMetadata.build([5], [1], [[0]], 16)
    out = be.write_and_forward(q[:1], k[:1], v[:1], qc, md1, 0.125)
    assert seen == [] and out.shape == (1, 9, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["cpu", "reference", "cpu-hnd"])
def test_write_kv_slot_past_the_cache_raises_and_writes_nothing(backend):
    """The rows before a bad slot must not be stored either (an index write would have)."""
    from pagedkv.errors import BackendError

    be = get_backend(backend)
    cache = be.allocate_kv_cache(4, 16, 3, 64, torch.float32)
    k = torch.ones(3, 3, 64)
    with pytest.raises(BackendError, match="slot 64"):
        be.write_kv(cache, k, k, torch.tensor([1, -1, 64]))
    assert not cache.key.any() and not cache.value.any()
    be.write_kv(cache, k, k, torch.tensor([1, -1, 63]))  # the last slot is fine
    gk, gv = be.gather_kv(cache, torch.tensor([1, 63]))
    assert gk.eq(1).all() and gv.eq(1).all() and int(cache.key.ne(0).sum()) == 2 * 3 * 64


def test_step_attention_equals_write_and_forward_per_layer(monkeypatch):
    """A compiled step's per-step attention (``step_attention``): layer for layer the same
    outputs and cache writes as ``write_and_forward``; the first layer of each geometry
    prepares the kernel's arguments, and its layers go straight to the kernel with their own
    scale / window / cap; a kernel-less dtype in between, a strided query and a quantised cache
    take ``write_and_forward``;
    bad options and a slot past the cache raise ``BackendError``."""
    from pagedkv.errors import BackendError

    be, a, b, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70, 33], [1, 1, 1])

    def like(c, dtype):
        t = be.allocate_kv_cache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, dtype)
        t.key.copy_(c.key.to(dtype))
        t.value.copy_(c.value.to(dtype))
        return t

    # bf16, bf16, fp16 (no kernel: its own plan on the metadata), float32, bf16, strided query
    layers = [a, like(a, torch.bfloat16), like(a, torch.float16), like(a, torch.float32), like(a, torch.bfloat16),
              like(a, torch.bfloat16)]
    twins = [like(c, c.key.dtype) for c in layers]
    opts = [(0.125, None, None), (0.1, 30, 20.0), (0.125, None, None), (0.125, None, 20.0), (0.2, 12, 5.0),
            (0.1, 30, 20.0)]
    wide = torch.randn(3, 9, 128)[:, :, :64]
    inputs = [(q, k, v), (q * 2, k, v), (q, k, v), (q, k * 3, v), (q, k, v * 2), (wide, k, v)]
    checked = []
    orig = CPUBackend.write_and_forward
    monkeypatch.setattr(CPUBackend, "write_and_forward",
                        lambda self, *x, **kw: checked.append(1) or orig(self, *x, **kw))
    attend = be.step_attention(layers, md, opts)
    got = [attend(i, *inputs[i]) for i in range(len(layers))]
    assert len(checked) == 2  # layers 2 (fp16: no kernel) and 5 (strided query)
    checked.clear()
    for i in range(len(layers)):
        s, w, c = opts[i]
        want = be.write_and_forward(*inputs[i], twins[i], md, s, sliding_window=w, logits_soft_cap=c)
        assert torch.equal(got[i], want), i
        assert torch.equal(layers[i].key, twins[i].key) and torch.equal(layers[i].value, twins[i].value)
    # layers 1 and 4 ran direct with their own options: layer 0's would give other numbers
    for i in (1, 4):
        other = be.write_and_forward(*inputs[i], like(a, torch.bfloat16), md, 0.125)
        assert not torch.equal(got[i], other)
    checked.clear()
    qc = be.allocate_kv_cache(a.num_blocks, 16, 3, 64, "int8", quant_group_size=32)
    qt = be.allocate_kv_cache(a.num_blocks, 16, 3, 64, "int8", quant_group_size=32)
    out = be.step_attention([qc, qc], md, opts[:2])
    r0, r1 = out(0, q, k, v), out(1, q, k, v)
    assert len(checked) == 2  # both layers of a quantised cache through the checked call
    assert torch.equal(r0, orig(be, q, k, v, qt, md, 0.125)) and torch.equal(qc.key, qt.key)
    assert torch.isfinite(r1).all()
    with pytest.raises(BackendError, match="sliding_window"):
        be.step_attention(layers, md, [(0.125, 0, None)])
    with pytest.raises(BackendError, match="logits_soft_cap"):
        be.step_attention(layers, md, [(0.125, None, -1.0)])
    bad = be.step_attention(layers, md, opts)
    bad(0, q, k, v)  # prepares the bf16 geometry's kernel arguments
    md.slot_mapping[2] = a.num_blocks * 16  # one past the cache, seen by the prepared call
    before = layers[1].key.clone()
    checked.clear()
    with pytest.raises(BackendError, match="slot_mapping has a slot"):
        bad(1, q, k, v)
    assert checked == [] and torch.equal(layers[1].key, before)  # the direct path raised, wrote nothing
