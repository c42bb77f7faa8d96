"""pagedkv::step_layer_attention (pagedkv.attention.step_op): a compiled step's attention op in
C++. Layers whose kernel arguments the CPU backend prepared for the step run without Python,
with the same outputs and cache writes as ``write_and_forward``; everything else, and every
call outside a step, goes to the Python op and its checks."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import cpu_kernel, step_op
from pagedkv.attention.cpu import CPUBackend
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
    C._STEP.attend = None


def _layers(be, a):
    def like(c, dtype):
        t = be.allocate_kv_cache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, dtype)
        t.key.copy_(c.key.to(dtype))
        t.value.copy_(c.value.to(dtype))
        return t

    # bf16, bf16, fp16 (no kernel), float32 (a geometry of its own), bf16, bf16 with a strided query
    return like, [a, like(a, torch.bfloat16), like(a, torch.float16), like(a, torch.float32), like(a, torch.bfloat16),
                  like(a, torch.bfloat16)]


def test_prepared_layers_run_in_cpp_with_write_and_forwards_results(table, monkeypatch):
    be, a, _, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70, 33], [1, 1, 1])
    like, layers = _layers(be, a)
    twins = [like(c, c.key.dtype) for c in layers]
    opts = [(0.125, None, None), (0.1, 30, 20.0), (0.125, None, None), (0.125, None, 20.0), (0.2, 12, 5.0),
            (0.1, 30, 20.0)]
    wide = torch.randn(3, 9, 128)[:, :, :64]
    inputs = [(q, k, v), (q * 2, k, v), (q, k, v), (q, k * 3, v), (q, k, v * 2), (wide, k, v)]
    python = []
    attend = be.step_attention(layers, md, opts, table=table)
    C._STEP.attend = lambda i, *x: python.append(i) or attend(i, *x)
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
    table.op(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), 4)  # another dtype
    assert python == [1, 4] and table.direct_calls() == 0
    # after the step nothing is prepared: outside a step the op is the Python op's error
    table.end()
    C._STEP.attend = None
    with pytest.raises(RuntimeError, match="only inside a compiled decode step"):
        table.op(q, k, v, 1)
    assert table.direct_calls() == 0


def test_a_kernel_error_goes_to_the_checked_path_and_writes_nothing(table):
    be, a, _, md, q, k, v = _fused_step("nhd", torch.float32, torch.bfloat16, [40, 70, 33], [1, 1, 1])
    _, layers = _layers(be, a)
    attend = be.step_attention(layers[:2], md, [(0.125, None, None)] * 2, table=table)
    C._STEP.attend = attend
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
    C._STEP.attend = lambda i, *x: seen.append(i) or attend(i, *x)
    out = table.op(q, k, v, 0)
    assert seen == [0] and out.shape == (2, 9, 64) and table.direct_calls() == 0
    attend = be.step_attention([a], md, [(0.125, None, None)], table=table)
    C._STEP.attend = lambda i, *x: seen.append(i) or attend(i, *x)
    table.op(q, k, v, 0)
    with pytest.raises(IndexError):  # layer 7 of a one-layer step: the Python op's own lookup
        table.op(q, k, v, 7)
    assert seen == [0, 0, 7] and table.direct_calls() == 0
    assert isinstance(be, CPUBackend) and CPUBackend.step_table
