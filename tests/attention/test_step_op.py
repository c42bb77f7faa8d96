"""pagedkv::step_layer_attention (pagedkv.ops.step_op): a compiled step's attention op in
C++. Layers whose kernel arguments the CPU backend prepared for the step run without Python,
with the same outputs and cache writes as ``write_and_forward``; everything else, and every
call outside a step, goes to the Python op and its checks."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import cpu_kernel, step_op
from pagedkv.errors import BackendError
from pagedkv.model import compiled as C  # defines the Python op the C++ one hands over to

from tests.attention.test_cpu import _fused_step


@pytest.fixture
def table():
    t = step_op.get()
    assert t is not None, step_op.build_error()
    t.end()
    t.direct_calls()  # restart the count
    yield t
    t.end()
    C.STEP_CONTEXT.attend = None


def _layers(be, a):
    def like(c, dtype):
        t = be.allocate_kv_cache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, dtype)
        t.key.copy_(c.key.to(dtype))
        t.value.copy_(c.value.to(dtype))
        return t

    # bf16, bf16, fp16 (no kernel), float32 (a geometry of its own), bf16, bf16 with a strided query
    return like, [a, like(a, torch.bfloat16), like(a, torch.float16), like(a, torch.float32), like(a, torch.bfloat16),
                  like(a, torch.bfloat16)]


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_prepared_layers_run_in_cpp_with_write_and_forwards_results(table, q_dtype):
    be, a, _, md, q, k, v = _fused_step("nhd", q_dtype, torch.bfloat16, [40, 70, 33], [1, 1, 1])
    like, layers = _layers(be, a)
    twins = [like(c, c.key.dtype) for c in layers]
    opts = [(0.125, None, None), (0.1, 30, 20.0), (0.125, None, None), (0.125, None, 20.0), (0.2, 12, 5.0),
            (0.1, 30, 20.0)]
    wide = torch.randn(3, 9, 128).to(q_dtype)[:, :, :64]
    inputs = [(q, k, v), (q * 2, k, v), (q, k, v), (q, k * 3, v), (q, k, v * 2), (wide, k, v)]
    python = []
    attend = be.step_attention(layers, md, opts, table=table)
    C.STEP_CONTEXT.attend = lambda i, *x: python.append(i) or attend(i, *x)
    got = [table.op(*inputs[i], i) for i in range(len(layers))]
    # layer 0 prepares the bf16 geometry, 3 the float32 one; 2 has no kernel, 5 a strided query
    assert python == [0, 2, 3, 5] and table.direct_calls() == 2
    for i, (s, w, c) in enumerate(opts):
        want = be.write_and_forward(*inputs[i], twins[i], md, s, sliding_window=w, logits_soft_cap=c)
        assert torch.equal(got[i], want), i
        assert torch.equal(layers[i].key, twins[i].key) and torch.equal(layers[i].value, twins[i].value)
    # layers 1 and 4 ran in C++ with their own scale / window / cap: layer 0's give other numbers
    for i in (1, 4):
        assert not torch.equal(got[i], be.write_and_forward(*inputs[i], like(a, torch.bfloat16), md, 0.125))
    # other shapes or dtypes than the prepared ones: the Python op
    python.clear()
    with pytest.raises(BackendError, match="query has 2 tokens but metadata has 3"):
        table.op(q[:2], k[:2], v[:2], 1)  # fewer rows: Python's checks
    other = torch.float32 if q_dtype == torch.bfloat16 else torch.bfloat16
    table.op(q.to(other), k.to(other), v.to(other), 4)  # another dtype
    assert python == [1, 4] and table.direct_calls() == 0
    # after the step nothing is prepared: outside a step the op is the Python op's error
    table.end()
    C.STEP_CONTEXT.attend = None
    with pytest.raises(RuntimeError, match="only inside a compiled decode step"):
        table.op(q, k, v, 1)
    assert table.direct_calls() == 0


def test_a_kernel_error_goes_to_the_checked_path_and_writes_nothing(table):
    be, a, _, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70, 33], [1, 1, 1])
    _, layers = _layers(be, a)
    attend = be.step_attention(layers[:2], md, [(0.125, None, None)] * 2, table=table)
    C.STEP_CONTEXT.attend = attend
    table.op(q, k, v, 0)  # prepares the geometry
    md.slot_mapping[2] = a.num_blocks * 16  # one past the cache
    before = layers[1].key.clone()
    with pytest.raises(BackendError, match="slot_mapping has a slot"):
        table.op(q, k, v, 1)
    assert torch.equal(layers[1].key, before) and table.direct_calls() == 0
    with pytest.raises(IndexError, match="no geometry group 5"):
        table.prepare(5, cpu_kernel.LayerArgs())


def test_steps_without_a_table_and_layers_out_of_range_take_the_python_op(table):
    be, a, _, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70], [1, 1])
    attend = be.step_attention([a], md, [(0.125, None, None)])  # no table: nothing prepared in C++
    seen = []
    C.STEP_CONTEXT.attend = lambda i, *x: seen.append(i) or attend(i, *x)
    out = table.op(q, k, v, 0)
    assert seen == [0] and out.shape == (2, 9, 64) and table.direct_calls() == 0
    attend = be.step_attention([a], md, [(0.125, None, None)], table=table)
    C.STEP_CONTEXT.attend = lambda i, *x: seen.append(i) or attend(i, *x)
    table.op(q, k, v, 0)
    with pytest.raises(IndexError):  # layer 7 of a one-layer step: the Python op's own lookup
        table.op(q, k, v, 7)
    assert seen == [0, 0, 7] and table.direct_calls() == 0


def test_new_caches_or_options_and_other_threads_never_see_old_pointers(table):
    """The layer array is reused only for the same cache objects and options: new caches on
    the same backend are the ones written, new options the ones used; another thread's calls
    find its own (empty) table."""
    import threading

    be, a, _, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70], [1, 1])
    fresh = [be.allocate_kv_cache(a.num_blocks, a.block_size, 3, 64, torch.bfloat16) for _ in range(2)]
    for c in fresh:
        c.key.copy_(a.key)
        c.value.copy_(a.value)
    outs, after_first = [], None
    for caches, scale in (([a, a], 0.125), (fresh, 0.125), (fresh, 0.3)):
        attend = be.step_attention(caches, md, [(scale, None, None)] * 2, table=table)
        C.STEP_CONTEXT.attend = attend
        table.op(q, k, v, 0)
        outs.append(table.op(q, k * 2, v, 1))  # C++
        table.end()
        after_first = after_first if after_first is not None else a.key.clone()
    assert table.direct_calls() == 3
    # the later steps wrote the fresh caches (layer 1's k * 2 into fresh[1]), not the first's
    assert torch.equal(a.key, after_first) and torch.equal(fresh[1].key, a.key)
    assert not torch.equal(fresh[0].key, fresh[1].key)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])  # scale 0.3 used
    twin = be.allocate_kv_cache(a.num_blocks, a.block_size, 3, 64, torch.bfloat16)
    twin.key.copy_(a.key)
    twin.value.copy_(a.value)
    assert torch.equal(outs[2], be.write_and_forward(q, k * 2, v, twin, md, 0.3))
    attend = be.step_attention([a, a], md, [(0.125, None, None)] * 2, table=table)
    C.STEP_CONTEXT.attend = attend
    table.op(q, k, v, 0)  # prepared in this thread
    seen = []

    def other():
        try:
            table.op(q, k, v, 1)
        except RuntimeError as exc:  # that thread is in no step: the Python op's error
            seen.append(str(exc))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(seen) == 1 and "only inside a compiled decode step" in seen[0]
    assert table.direct_calls() == 0
