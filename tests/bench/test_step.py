"""`pagedkv bench step`: the per-step profile runs on the real model and its numbers add up."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from pagedkv.bench.step import run as bench_step
from pagedkv.bench.step.profile import CATEGORIES, breakdown, is_linear_op, profile_steps, step_limit, weight_bytes
from pagedkv.bench.variants import cpu_class, read_variants


def test_weight_bytes_per_format():
    # 1000 linear weights + 576 LM-head weights: int8 adds one fp32 scale per 576, int4 a
    # 2-byte scale and minimum per 32 values
    wb = weight_bytes(1000, 576)
    assert wb == {"fp32": 6304, "bf16": 3152, "int8": 1576 + 4 * 2, "int4": 788 + 4 * 49}


def test_step_limit_takes_the_larger_bound():
    lim = step_limit(bytes_moved=2e9, flops=1e9, bandwidth=1e10, peak=1e11)
    assert lim["memory_ms"] == pytest.approx(200.0) and lim["compute_ms"] == pytest.approx(10.0)
    assert lim["limit_ms"] == pytest.approx(200.0) and lim["bound"] == "memory"


class _Ev:
    def __init__(self, name, total, self_time, parent=None):
        self.name, self.cpu_time_total, self.self_cpu_time_total, self.cpu_parent = name, total, self_time, parent


def test_breakdown_assigns_ops_to_their_regions():
    fwd = _Ev("pagedkv.forward", 8000, 100)
    att = _Ev("pagedkv.attention", 1000, 50, fwd)
    events = [
        _Ev("pagedkv.schedule", 500, 500), fwd, att,
        _Ev("aten::mm", 5000, 5000, fwd),          # a projection: linear
        _Ev("aten::bmm", 700, 700, att),            # inside attention: not linear
        _Ev("pagedkv.logits", 900, 10), _Ev("aten::mm", 890, 890, None),
        _Ev("pagedkv.sample", 100, 100),
    ]
    # 2 steps, 12 ms of wall time under the profiler
    parts = breakdown(events, wall_s=0.012, num_steps=2)
    assert parts["linear"] == pytest.approx(2.5)
    assert parts["attention"] == pytest.approx(0.5)
    assert parts["other_ops"] == pytest.approx(4.0 - 0.5 - 2.5)
    assert parts["logits_sampling"] == pytest.approx(0.5)
    # host: the scheduler's 0.25 ms + wall not covered by any region: 6 - (0.25 + 4 + 0.45 + 0.05)
    assert parts["host"] == pytest.approx(0.25 + 6 - 4.75)


def test_compiled_extern_matmuls_count_as_linear():
    # inductor's C++ wrapper calls aten::_int_mm as the shim aoti_torch_cpu__int_mm_out
    assert is_linear_op("aoti_torch_cpu__int_mm_out") and is_linear_op("aten::_int_mm")
    assert is_linear_op("aoti_torch_cpu_mm_out") and is_linear_op("aoti_torch_cpu__weight_int4pack_mm_for_cpu")
    assert not is_linear_op("aoti_torch_cpu_index_put_out") and not is_linear_op("graph_0_cpp_fused_mul_0")
    # dynamic int8: oneDNN's prepacked linear and the op compiled steps reach it through
    assert is_linear_op("onednn::qlinear_pointwise") and is_linear_op("pagedkv::int8_linear")
    fwd = _Ev("pagedkv.forward", 10000, 0)
    graph = _Ev("## Call CompiledFxGraph abc", 10000, 1000, fwd)
    events = [fwd, graph, _Ev("aoti_torch_cpu__int_mm_out", 6000, 6000, graph),
              _Ev("graph_0_cpp_fused_abs_amax_0", 3000, 3000, graph)]
    parts = breakdown(events, wall_s=0.010, num_steps=1)
    assert parts["linear"] == pytest.approx(6.0) and parts["other_ops"] == pytest.approx(4.0)


def test_profiled_steps_run_inside_the_profiled_context_and_plain_ones_outside():
    # the bench times plain compiled graphs and profiles an instrumented copy (swapped in by
    # the context): 2 warm-up + 3 plain steps outside, 2 warm-up + 3 profiled steps inside
    state = {"inside": False}
    calls = []

    @contextlib.contextmanager
    def swapped():
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    plain, parts = profile_steps(lambda: calls.append(state["inside"]), 3, warmup=2, profiled=swapped)
    assert calls == [False] * 5 + [True] * 5 and not state["inside"]
    assert plain >= 0 and set(parts) == set(CATEGORIES)


def test_bench_step_tiny(loaded_model, tmp_path):
    args = argparse.Namespace(batches="1,2", prefill_len=40, steps=2, block_size=16, model=None, weights="fp32",
                              threads=2, json=False, out_dir=str(tmp_path))
    assert bench_step.run(args, loaded=loaded_model) == 0
    ((variant, data),) = read_variants(tmp_path / "step.json").items()
    assert variant == "fp32_" + cpu_class(data["machine"]["cpu_isa"])  # weights and this host's CPU class
    assert [c["case"] for c in data["cases"]] == ["decode b=1", "decode b=2", "prefill 40"]
    assert data["weight_bytes"]["fp32"] == 4 * (106_168_320 + 49_152 * 576)  # SmolLM2-135M linears + tied head
    for c in data["cases"]:
        assert set(c["parts_ms"]) == set(CATEGORIES)
        assert c["parts_ms"]["linear"] > 0 and c["parts_ms"]["attention"] > 0 and c["plain_ms"] > 0
        assert c["x_limit"] == pytest.approx(c["plain_ms"] / c["limit"]["limit_ms"])
        assert c["tokens"] == {"decode b=1": 1, "decode b=2": 2, "prefill 40": 40}[c["case"]]
    assert f"## {variant}\n\n### Per-step profile" in (tmp_path / "step.md").read_text()
    assert (tmp_path / "step.png").stat().st_size > 1000


def test_bench_step_refuses_a_bad_kv_cache_dtype_before_measuring(monkeypatch, tmp_path):
    from pagedkv.errors import ConfigError

    monkeypatch.setattr(bench_step, "copy_bandwidth", lambda: pytest.fail("measured before checking"))
    args = argparse.Namespace(batches="1", prefill_len=40, steps=2, block_size=16, model=None, weights="fp32",
                              threads=2, json=False, out_dir=str(tmp_path), kv_cache_dtype="nope")
    with pytest.raises(ConfigError, match="kv_cache_dtype: unknown 'nope'"):
        bench_step.collect(args)
    assert list(tmp_path.iterdir()) == []
