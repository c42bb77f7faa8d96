"""`pagedkv bench quality` end to end (both parts) on a short text: the files it writes hold
real perplexities, agreement counts and per-route times."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.bench import quality
from pagedkv.bench.variants import read_variant


def _args(tmp_path, **kw):
    """The command's own parser supplies every option's default, so a new option cannot drift."""
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    args = parser.parse_args([])
    base = dict(part="quality", formats="fp32,int8", text=str(quality.TEXT), window=48, max_tokens=2, reps=1,
                variant=None, threads=2, json=False, out_dir=str(tmp_path))
    base.update(kw)
    for key, value in base.items():
        setattr(args, key, value)
    return args


@pytest.mark.slow
def test_bench_quality_writes_perplexity_per_format(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(quality.TEXT.read_text()[:600])
    assert quality.run(_args(tmp_path, text=str(text))) == 0
    data = read_variant(tmp_path / "weights_quality.json", "smollm2-135m")  # the bundled model's variant
    rows = {r["weights"]: r for r in data["rows"]}
    assert list(rows) == ["fp32", "int8"]
    fp32, int8 = rows["fp32"], rows["int8"]
    # fp32 against itself: exact, every completion identical, both routes the same perplexity
    assert fp32["vs fp32 (worse of the two)"] == "+0.00%" and fp32["identical completions"] == "16/16"
    assert fp32["perplexity"] == pytest.approx(fp32["perplexity 32-row steps"], rel=1e-4)
    assert 1.0 < fp32["perplexity"] < 1000.0 and fp32["text tokens"] > 48
    assert int8["perplexity"] != fp32["perplexity"] and int8["bound"] == "2%"
    md = (tmp_path / "weights_quality.md").read_text()
    assert "## smollm2-135m\n\n### Weight formats: quality vs fp32" in md and "| int8 |" in md


@pytest.mark.slow
def test_bench_quality_routes_times_every_route(tmp_path):
    assert quality.run(_args(tmp_path, part="routes", formats="fp32,int8")) == 0
    data = read_variant(tmp_path / "weights_quality.json", "routes")
    cells = {(r["weights"], r["route"].split()[0]) for r in data["rows"]}
    assert cells == {("fp32", "fast"), ("int8", "fast"), ("int8", "fallback")}
    for r in data["rows"]:
        assert all(r[f"{step} ms"] > 0 for step in quality.STEP_ROWS)
        if r["weights"] == "fp32":
            assert r["decode 1 vs fp32"] == 1.0


@pytest.mark.parametrize("change, message", [
    (dict(window=1), "--window: at least 2"),
    (dict(max_tokens=0), "--max-tokens: at least 1"),
    (dict(part="routes", reps=0), "--reps: at least 1"),
])
def test_bad_options_are_config_errors_before_any_model_loads(tmp_path, change, message):
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        quality.check_args(_args(tmp_path, **change))


def test_bad_text_and_out_dir_are_config_errors(tmp_path):
    from pagedkv.errors import ConfigError

    a_file = tmp_path / "f"
    a_file.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="--out-dir .* not a directory"):
        quality.check_args(_args(tmp_path, out_dir=str(a_file)))
    for bad in (tmp_path / "missing.txt", tmp_path, a_file):  # missing, a directory, not UTF-8
        with pytest.raises(ConfigError, match="--text"):
            quality._read_text(str(bad))


def test_perplexity_rejects_what_it_cannot_score(loaded_model):
    with pytest.raises(ValueError, match="window of >= 2"):
        quality.perplexity(loaded_model.model, [1, 2, 3], window=1)
    with pytest.raises(ValueError, match="text of >= 2"):
        quality.perplexity(loaded_model.model, [5], window=64)
