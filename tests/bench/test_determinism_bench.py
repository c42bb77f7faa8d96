"""``pagedkv bench determinism``: the report's cells (median [IQR] and the ratio to
``deterministic=False`` of the same format) from recorded runs."""

from __future__ import annotations

from pagedkv.bench import determinism as D


def test_quartiles_and_the_rendered_ratio():
    assert D._quartiles([3.0]) == {"median": 3.0, "q1": 3.0, "q3": 3.0}
    assert D._quartiles([1.0, 2.0, 4.0]) == {"median": 2.0, "q1": 1.5, "q3": 3.0}
    cell = {k: D._quartiles([100.0, 110.0, 120.0]) for k in D.WORKLOADS}
    half = {k: D._quartiles([50.0, 55.0, 60.0]) for k in D.WORKLOADS}
    data = {"description": "d", "model": "m", "rounds": 3, "note": "n",
            "summary": [{"weights": "auto (gguf)", "system": "not deterministic", **cell},
                        {"weights": "auto (gguf)", "system": "deterministic", **half}]}
    md = D.render(data, {})
    assert "| auto (gguf) | deterministic | 55.0 [52.5-57.5] (0.500x) |" in md
    assert "| auto (gguf) | not deterministic | 110.0 [105.0-115.0] (1.000x) |" in md
    assert md.rstrip().endswith("n")


def test_the_tiny_sizes_are_smaller_than_the_real_ones():
    tiny, full = D._sizes(True), D._sizes(False)
    assert full["prefill_2048"] == 2048 and full["offline_32_256"] == (8, 32, 256)
    assert all(tiny[k] < full[k] for k in ("prefill_512", "prefill_2048", "decode"))
