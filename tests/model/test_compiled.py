"""Compiled decode steps (pagedkv.model.compiled) against the eager model: the same greedy tokens
through the engine, the same hidden states, eager fallback when the compiler fails."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.model import compiled as C
from pagedkv.testing.tiny import tiny_random_model
from pagedkv.testing.caches import allocate_kv_caches


@pytest.fixture(scope="module")
def tiny(loaded_model):
    return tiny_random_model(loaded_model, seed=5)


def _greedy(loaded, **kw):
    """Three requests of different lengths (decode steps of 3, 2, then 1 rows) -> token ids."""
    eng = LLMEngine(loaded, dtype="float32", block_size=16, num_blocks=64, max_num_seqs=4, **kw)
    prompts = {"a": [(i * 37 + 3) % 3000 + 5 for i in range(21)], "b": [7, 99, 1234, 56], "c": list(range(300, 340))}
    for rid, n in zip(prompts, (30, 12, 6)):
        eng.add_request(rid, prompts[rid], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = {}
    graphs = counters["stats"]["unique_graphs"]
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.token_ids)
    # the warm-up compiled every graph the steps need (a miss recompiles: ~80 s per graph
    # on the bundled model, e.g. for inputs that differ from the warm-up's in dispatch keys)
    assert counters["stats"]["unique_graphs"] == graphs
    return eng, out


def test_compiled_decode_gives_the_eager_tokens(tiny):
    eager_eng, eager = _greedy(tiny)
    assert eager_eng.runner.compiled is None and not hasattr(tiny.model, "compiled")  # the runner owns it
    from pagedkv.ops import step_op

    table = step_op.get()
    assert table is not None, step_op.build_error()
    table.direct_calls()  # restart the count
    eng, comp = _greedy(tiny, compile_decode=True)
    cd = eng.runner.compiled
    assert isinstance(cd, C.CompiledDecode) and cd.failed is None, cd.failed
    # the graphs call the C++ attention op: in each of the 29 decode steps and the prefill's
    # 65-row chunk (one kernel for every row) every layer after the first ran without Python
    assert cd._op is table.op and table.direct_calls() == 30 * (len(tiny.model.layers) - 1)
    # every step ran compiled, the 65-row prefill of the three prompts included (the graphs
    # take up to the engine's token budget): 1 prefill + 29 decode steps, after 2 warm-up steps
    assert cd.max_rows == 512 and cd.warm_up_sizes() == [1, 2]
    assert cd.steps == 2 + 30
    assert comp == eager and [len(comp[k]) for k in "abc"] == [30, 12, 6]
    # one step by hand, decode rows of two sequences in shuffled blocks: the same hidden states
    # and the same cache contents as eager, to float32 rounding
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata

    backend = get_backend("cpu")
    md = AttentionMetadata.build([9, 20], [1, 2], [[3], [5, 1]], 16)
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([8, 18, 19])
    outs, before = [], cd.steps
    for forward in (cd, tiny.model):  # the compiled step, then the model's own forward
        caches = allocate_kv_caches(tiny.model, backend, num_blocks=8, block_size=16)
        gen = torch.Generator().manual_seed(0)
        for c in caches:  # the context before this step
            c.key.copy_(torch.randn(c.key.shape, generator=gen))
            c.value.copy_(torch.randn(c.value.shape, generator=gen))
        with torch.inference_mode():
            outs.append((forward(ids, pos, caches, md, backend), caches))
    assert cd.steps == before + 1  # the first run was compiled, the second eager
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a.key, b.key, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.value, b.value, rtol=1e-5, atol=1e-5)
    assert LLMEngine(tiny, dtype="float32", num_blocks=8).runner.compiled is None  # without the option: eager


def test_compiler_failure_falls_back_to_eager(tiny, monkeypatch):
    _, eager = _greedy(tiny)

    class InductorError(Exception):
        pass

    InductorError.__module__ = "torch._inductor.exc"

    def broken(*a, **k):
        raise InductorError("C++ compile failed: no compiler")

    monkeypatch.setattr(tiny.model, "_pagedkv_compiled_decode", None, raising=False)  # build anew (restored after)
    monkeypatch.setattr(C.CompiledDecode, "warm_up", lambda self, progress=True: 0.0)
    monkeypatch.setattr(C.CompiledDecode, "__init__", _init_with(broken))
    eng, got = _greedy(tiny, compile_decode=True)
    cd = eng.runner.compiled
    assert cd.failed == "InductorError: C++ compile failed: no compiler" and cd.steps == 0
    assert not cd.accepts(1)
    assert got == eager


def test_without_the_cpp_op_the_graph_calls_the_python_op(tiny, monkeypatch):
    from pagedkv.ops import step_op

    monkeypatch.setattr(step_op, "get", lambda: None)  # no C++ compiler, say
    cd = C.CompiledDecode(tiny.model)  # (compiles nothing before its first call)
    assert cd._table is None and cd._op is torch.ops.pagedkv.layer_attention


def _init_with(fn):
    def init(self, model, max_rows=64):
        self.model, self.max_rows, self.failed, self.steps, self.cache_dir = model, max_rows, None, 0, "-"
        self._options, self._table = None, None
        self._fn = fn
    return init


def test_model_errors_are_not_swallowed(tiny, monkeypatch):
    def boom(*a, **k):
        raise ValueError("a bug in the model code")

    monkeypatch.setattr(C.CompiledDecode, "__init__", _init_with(boom))
    cd = C.CompiledDecode(tiny.model)
    with pytest.raises(ValueError, match="a bug"):
        cd._run(lambda *a: None, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert cd.failed is None


def test_layer_attention_outside_a_step_and_bad_options():
    with pytest.raises(RuntimeError, match="only inside a compiled decode step"):
        torch.ops.pagedkv.layer_attention(torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), 0)
    # the graphs run without inductor's size asserts: what the op returns is a contiguous
    # tensor of q's shape and dtype, or an error
    q, kv = torch.randn(3, 2, 4), torch.zeros(3, 1, 4)
    strided = torch.randn(2, 3, 4).transpose(0, 1)
    C.STEP_CONTEXT.attend = lambda i, q, k, v: strided
    try:
        out = torch.ops.pagedkv.layer_attention(q, kv, kv, 0)
        assert out.is_contiguous() and out.equal(strided)
        C.STEP_CONTEXT.attend = lambda i, q, k, v: q[:2]
        from pagedkv.errors import BackendError

        with pytest.raises(BackendError, match=r"layer 3: attention returned torch.float32 \(2, 2, 4\) on cpu"):
            torch.ops.pagedkv.layer_attention(q, kv, kv, 3)
        C.STEP_CONTEXT.attend = lambda i, q, k, v: q.double()
        with pytest.raises(BackendError, match="expected torch.float32"):
            torch.ops.pagedkv.layer_attention(q, kv, kv, 0)
    finally:
        C.STEP_CONTEXT.attend = None
    with pytest.raises(ConfigError, match="compile_decode must be True or False"):
        LLMEngine(None, compile_decode="yes")
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        LLMEngine(None, compile_decode=True, tensor_parallel_size=2)


def test_engines_over_one_model_share_its_compiled_steps(tiny):
    """A second engine (a benchmark sweep builds one per cell) reuses the model's compiled
    steps: no new graph, and dynamo's per-code cache does not fill up (it then runs eager)."""
    eng1, out1 = _greedy(tiny, compile_decode=True)
    first = eng1.runner.compiled
    graphs = counters["stats"]["unique_graphs"]
    eager = LLMEngine(tiny, dtype="float32", block_size=16, num_blocks=64)  # an eager engine between
    assert eager.runner.compiled is None
    eng2, out2 = _greedy(tiny, compile_decode=True)
    assert eng2.runner.compiled is first and first.failed is None
    assert counters["stats"]["unique_graphs"] == graphs and out2 == out1


def test_two_models_of_one_shape_each_run_their_own_weights(tiny, loaded_model):
    """Guards on the model's modules are skipped (the weights are frozen into the graph): a
    second model of the same shape must still get its own graphs, not the first one's."""
    other = tiny_random_model(loaded_model, seed=11)
    _, eager_other = _greedy(other)
    _, eager_tiny = _greedy(tiny)
    assert eager_other != eager_tiny  # different weights, different tokens
    eng_tiny, got_tiny = _greedy(tiny, compile_decode=True)
    eng_other, got_other = _greedy(other, compile_decode=True)
    assert got_tiny == eager_tiny and got_other == eager_other
    assert eng_other.runner.compiled is not eng_tiny.runner.compiled and eng_other.runner.compiled.steps > 0
    # a constant inside the graph (Gemma's norm offset) differs between models of one shape
    offset = tiny_random_model(loaded_model, seed=11)
    for layer in offset.model.layers:
        layer.norm_offset = 1.0
    _, eager_offset = _greedy(offset)
    assert eager_offset != eager_other
    _, got_offset = _greedy(offset, compile_decode=True)
    assert got_offset == eager_offset


def test_a_backend_error_inside_a_compiled_step_keeps_its_type(tiny):
    """An error raised by attention inside the graph (here a slot past the cache) reaches the
    caller as itself, not as the C++ wrapper's RuntimeError; the step counter does not move."""
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata
    from pagedkv.errors import BackendError

    cd = LLMEngine(tiny, dtype="float32", block_size=16, num_blocks=64, compile_decode=True).runner.compiled
    assert isinstance(cd, C.CompiledDecode) and cd.failed is None
    backend = get_backend("cpu")
    caches = allocate_kv_caches(tiny.model, backend, num_blocks=2, block_size=16)
    md = AttentionMetadata.build([9], [1], [[1]], 16)
    md.slot_mapping[0] = 2 * 16  # one past the cache
    before = cd.steps
    with torch.inference_mode(), pytest.raises(BackendError, match="slot_mapping has a slot >= the cache's 32 slots"):
        cd(torch.tensor([11]), torch.tensor([8]), caches, md, backend)
    assert cd.steps == before and cd.failed is None
    assert not any(c.key.any() or c.value.any() for c in caches)  # nothing written


def test_compiled_int4_steps_give_the_eager_hidden_states(loaded_model):
    """The graphs run without inductor's size asserts: the quantised kernels' outputs (int4
    weight-only at 1-7 rows, dynamic int8 from ``route_boundaries`` on: 8 here) must be laid out as the
    graph assumes. A tiny model in int4, one step of 1, 3 and 8 decode rows compiled and eager:
    the same hidden states to bf16 rounding and the same cache contents."""
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata
    from pagedkv.model.compiled import route_boundaries
    from pagedkv.model.quantize import install_linears, quantize_state

    lm = tiny_random_model(loaded_model, seed=11)
    install_linears(lm.model, quantize_state(dict(lm.model.state_dict()), lm.config, "int4"))
    assert type(lm.model.layers[0].down_proj).__name__ == "Int4Linear"
    cd = C.compile_decode(lm.model, max_rows=16, progress=False)
    assert cd.failed is None, cd.failed
    sizes = [1, 3] + [n for n in route_boundaries(lm.model) if n <= 16]
    backend = get_backend("cpu")
    for n in sizes:
        md = AttentionMetadata.build([5 + i for i in range(n)], [1] * n, [[i] for i in range(n)], 16)
        ids, pos = torch.arange(n) * 7 + 3, torch.tensor([4 + i for i in range(n)])
        outs = []
        for forward in (cd, lm.model):
            caches = allocate_kv_caches(lm.model, backend, num_blocks=16, block_size=16)
            gen = torch.Generator().manual_seed(n)
            for c in caches:
                c.key.copy_(torch.randn(c.key.shape, generator=gen))
                c.value.copy_(torch.randn(c.value.shape, generator=gen))
            with torch.inference_mode():
                outs.append((forward(ids, pos, caches, md, backend), caches))
        (got, gc), (want, wc) = outs
        assert got.shape == want.shape == (n, lm.config.hidden_size)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), n
        for a, b in zip(gc, wc):
            torch.testing.assert_close(a.key, b.key, rtol=2e-2, atol=2e-2)
    assert cd.steps == len(cd.warm_up_sizes()) + len(sizes)


def test_inductor_cache_is_one_folder_per_cpu_profile(tmp_path, monkeypatch):
    """Inductor's graph cache does not key by ATen's CPU capability: the compiled steps keep
    one folder per profile, so a graph compiled under one class is never loaded under another."""
    from pagedkv import cpu_isa

    flags = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl"}
    native = cpu_isa.build_profile(flags, "native", "AVX512")
    avx2 = cpu_isa.build_profile(flags, "avx2", "AVX2")
    tags = C.profile_cache_tag(native), C.profile_cache_tag(avx2)
    assert tags[0].startswith("avx512-") and tags[1].startswith("avx2-") and len(set(tags)) == 2
    assert C.profile_cache_tag(avx2) == tags[1]  # stable for one profile
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert C.inductor_cache_dir() == str(tmp_path / "inductor" / C.profile_cache_tag())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # the user's own choice wins
    assert C.inductor_cache_dir() == "/somewhere/else"


def test_a_capped_profile_compiles_afresh(tiny, monkeypatch):
    """Under a cap below the CPU's class the graphs never come from inductor's disk cache (a
    cached graph gave zero/NaN hidden states there); at the CPU's own class they do."""
    from pagedkv import cpu_isa

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    flags = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl"}
    for cap, aten in (("avx2", "AVX2"), ("native", "AVX512")):
        monkeypatch.setattr(cpu_isa, "profile", lambda: cpu_isa.build_profile(flags, cap, aten))
        C.CompiledDecode(tiny.model, max_rows=4)
    assert seen[0]["fx_graph_cache"] is False and "fx_graph_cache" not in seen[1]


def test_a_capped_profile_compiles_afresh(tiny, monkeypatch):
    """Under a cap below the CPU's class the graphs never come from inductor's disk cache (a
    cached graph gave zero/NaN hidden states there); at the CPU's own class they do."""
    from pagedkv import cpu_isa

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    flags = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl"}
    for cap, aten in (("avx2", "AVX2"), ("native", "AVX512")):
        monkeypatch.setattr(cpu_isa, "profile", lambda: cpu_isa.build_profile(flags, cap, aten))
        C.CompiledDecode(tiny.model, max_rows=4)
    assert seen[0]["fx_graph_cache"] is False and "fx_graph_cache" not in seen[1]


_HAND_STEP = """
import torch
from pagedkv._bundled import bundled_model_path
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.loader import load_model
from pagedkv.testing.tiny import tiny_random_model
from pagedkv.testing.caches import allocate_kv_caches

tiny = tiny_random_model(load_model(bundled_model_path(), dtype=torch.float32), seed=5)
eng = LLMEngine(tiny, dtype="float32", block_size=16, num_blocks=64, max_num_seqs=4, compile_decode=True)
cd, backend = eng.runner.compiled, get_backend("cpu")
md = AttentionMetadata.build([9, 20], [1, 2], [[3], [5, 1]], 16)
outs = []
for forward in (cd, tiny.model):
    caches = allocate_kv_caches(tiny.model, backend, num_blocks=8, block_size=16)
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        c.key.copy_(torch.randn(c.key.shape, generator=gen))
        c.value.copy_(torch.randn(c.value.shape, generator=gen))
    with torch.inference_mode():
        outs.append(forward(torch.tensor([11, 12, 13]), torch.tensor([8, 18, 19]), caches, md, backend))
print("MAXDIFF", float((outs[0] - outs[1]).abs().max()), cd.cache_dir)
"""


def test_compiled_steps_right_under_each_profile_in_one_cache(tmp_path):
    """The case that failed: graphs compiled natively, then the same cache under
    ``PAGEDKV_CPU_ISA=avx2`` (zero/NaN hidden states; the reverse order corrupted the heap).
    Each run's compiled step equals the eager forward."""
    import os
    import subprocess
    import sys

    from pagedkv.model.weight_cache import cache_root

    # a cache root of its own for inductor's graphs; the native kernels and the weight cache
    # are linked in from the real root, so that the runs compile graphs only (not ~80 s of
    # kernels and dequantisation)
    for entry in cache_root().iterdir() if cache_root().is_dir() else ():
        if entry.name != "inductor":
            (tmp_path / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "PAGEDKV_CPU_ISA")}
    env["PAGEDKV_CACHE_DIR"] = str(tmp_path)
    dirs = []
    for isa in ("native", "avx2"):
        run = subprocess.run([sys.executable, "-c", _HAND_STEP], env={**env, "PAGEDKV_CPU_ISA": isa},
                             capture_output=True, text=True, timeout=600)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("MAXDIFF")]
        assert run.returncode == 0 and line, run.stderr[-2000:]
        _, diff, cache = line[0].split()
        assert float(diff) < 1e-4, (isa, diff)
        dirs.append(cache)
    assert os.path.dirname(dirs[0]) == os.path.dirname(dirs[1]) == str(tmp_path / "inductor")
