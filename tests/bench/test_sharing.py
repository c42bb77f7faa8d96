"""``pagedkv bench ablation --tiny``: the four paging x caching cells and the sharing goals
run end to end in seconds; outputs agree across cells; the files are written."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.ablation import run as ablation


def _strict_json(text: str):
    """The JSON, failing the test on NaN or Infinity (result files must hold finite numbers)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the results"))


@pytest.mark.slow
def test_bench_ablation_tiny(loaded_model, tmp_path):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "ablation", "--tiny", "--out-dir", str(tmp_path)])
    assert args.threads == 2
    assert ablation.run(args, loaded=loaded_model) == 0

    both = _strict_json((tmp_path / "ablation.json").read_text())["variants"]
    assert list(both) == ["ablation", "sharing"]  # the two parts: variants of one result set
    data = both["ablation"]
    assert [c["cell"] for c in data["cells"]] == [c["cell"] for c in ablation.CELLS]
    assert data["same_outputs"] is True
    cells = {(c["enable_paging"], c["enable_prefix_caching"]): c for c in data["cells"]}
    n_turns = data["workload"]["conversations"] * data["workload"]["turns"]
    for c in data["cells"]:
        assert c["turns_completed"] == n_turns
        assert c["kv_slots_allocated_peak"] <= data["config"]["kv_budget_tokens"]
        for k in ("output_tokens_per_s", "turns_per_s", "peak_concurrency", "effective_tokens_mean"):
            assert c[k] > 0, k
        assert (c["prefix_hit_rate"] > 0) == c["enable_prefix_caching"]
    # caching computes fewer tokens; paging allocates fewer slots for the same tokens
    assert cells[(True, True)]["tokens_computed"] < cells[(True, False)]["tokens_computed"]
    assert cells[(False, True)]["tokens_computed"] < cells[(False, False)]["tokens_computed"]
    assert cells[(True, False)]["kv_slots_allocated_mean"] < cells[(False, False)]["kv_slots_allocated_mean"]
    assert (cells[(True, True)]["effective_per_allocated_slot"]
            > cells[(True, False)]["effective_per_allocated_slot"])
    md = (tmp_path / "ablation.md").read_text()
    assert "## ablation\n\n### Ablation" in md and "## sharing\n\n### Sharing" in md
    assert (tmp_path / "ablation.png").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ablation.json", "ablation.md", "ablation.png"]

    sh = both["sharing"]
    for mode in ("burst", "sequential"):
        m = sh["prefix_ttft"][mode]
        assert m["same_outputs"] is True
        assert m["on"]["tokens_computed"] < m["off"]["tokens_computed"]
        assert m["on"]["prefix_hit_rate"] > 0 and m["off"]["prefix_hit_rate"] == 0
    ps = sh["parallel_sampling"]
    assert ps["same_outputs"] is True
    assert ps["parallel"]["peak_used_blocks"] < ps["independent"]["peak_used_blocks"]

