"""Result sets with variants (``pagedkv.bench.variants``): a rerun of one configuration replaces
its own JSON entry, Markdown section and PNG panel and keeps every other variant's; one set's
Markdown and PNG hold every variant; a single-configuration run with several figures still
writes one PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from pagedkv.bench.report import markdown_table, publish, pyplot, save_figure
from pagedkv.bench.variants import PANELS, cpu_class, read_variant, read_variants, variant_name
from pagedkv.errors import ConfigError

MACHINE = {"machine": "m", "cpu_count": 2, "torch_threads": 1, "packages": {"torch": "t"}, "commit": "c",
           "time_utc": "now", "cpu_isa": {"isa": "avx2", "native_isa": "avx2"}}


def _data(tok_s: float) -> dict:
    return {"config": {"model": "tiny"}, "rows": [{"system": "pagedkv", "tok_s": tok_s}], "machine": dict(MACHINE)}


def _render(d: dict, pngs: dict) -> str:
    return f"# Tiny benchmark\n\n## Rows\n\n{markdown_table(d['rows'])}"


def _plots(color: str, n: int = 1):
    def plots(d: dict, out) -> dict:
        names = {}
        for i in range(n):
            fig, ax = pyplot().subplots(figsize=(2 + i, 1.5))
            ax.bar(["tok/s"], [d["rows"][0]["tok_s"]], color=color)
            names[f"figure {i}"] = save_figure(fig, out / f"f{i}.png")
        return names
    return plots


def _panels(path) -> dict:
    with Image.open(path) as im:
        rows = json.loads(im.text[PANELS])
        arr = np.asarray(im.convert("RGBA"))
    return {v: arr[a:b, :w] for v, (a, b, w) in rows.items()}


def test_a_rerun_replaces_its_variant_and_keeps_the_others(tmp_path):
    publish("tiny", _data(10.0), _render, tmp_path, variant="avx512", plots=_plots("tab:blue"), echo=False)
    publish("tiny", _data(20.0), _render, tmp_path, variant="avx2", plots=_plots("tab:orange", 2), echo=False)
    before = _panels(tmp_path / "tiny.png")
    md_before = (tmp_path / "tiny.md").read_text()
    paths = publish("tiny", _data(11.5), _render, tmp_path, variant="avx512", plots=_plots("tab:green"), echo=False)

    doc = json.loads(paths["json"].read_text())
    assert doc["benchmark"] == "tiny" and list(doc["variants"]) == ["avx512", "avx2"]  # order kept
    assert doc["variants"]["avx512"]["rows"] == [{"system": "pagedkv", "tok_s": 11.5}]
    assert doc["variants"]["avx2"]["rows"] == [{"system": "pagedkv", "tok_s": 20.0}]
    assert read_variant(paths["json"], "avx2")["rows"][0]["tok_s"] == 20.0
    md = paths["md"].read_text()
    sections = md.split("\n## ")
    assert [s.split("\n", 1)[0] for s in sections[1:]] == ["avx512", "avx2"]
    assert "| pagedkv | 11.5 |" in sections[1] and "| pagedkv | 10 |" not in md
    assert sections[2] == md_before.split("\n## ")[2]  # the other variant's section, byte for byte
    after = _panels(paths["png"])
    assert list(after) == ["avx512", "avx2"]
    assert np.array_equal(after["avx2"], before["avx2"])  # its two figures, untouched
    assert not np.array_equal(after["avx512"], before["avx512"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.json", "tiny.md", "tiny.png"]


def test_the_markdown_and_png_of_a_set_hold_every_variant(tmp_path):
    for i, v in enumerate(("q4_k_m", "q4_1", "vllm")):
        publish("set", _data(100.0 + i), _render, tmp_path, variant=v, plots=_plots("tab:blue", 1 + i), echo=False)
    md = (tmp_path / "set.md").read_text()
    assert md.startswith("# set: results\n") and "[q4_k_m](#q4_k_m) · [q4_1](#q4_1) · [vllm](#vllm)" in md
    assert "![set: one panel per variant, top to bottom](set.png)" in md
    for i, v in enumerate(("q4_k_m", "q4_1", "vllm")):
        section = md.split(f"\n## {v}\n", 1)[1].split("\n## ", 1)[0]
        assert "### Tiny benchmark" in section and "#### Rows" in section  # headings two levels down
        assert f"| pagedkv | {100 + i} |" in section and "_Machine: m, 2 CPUs, CPU ISA avx2" in section
    panels = _panels(tmp_path / "set.png")
    assert list(panels) == ["q4_k_m", "q4_1", "vllm"]
    heights = [p.shape[0] for p in panels.values()]
    assert heights[0] < heights[1] < heights[2]  # 1, 2 and 3 figures under each name
    with Image.open(tmp_path / "set.png") as im:
        assert im.size[1] == sum(heights)


def test_a_variant_without_figures_drops_only_its_panel(tmp_path):
    publish("s", _data(1.0), _render, tmp_path, variant="a", plots=_plots("tab:blue"), echo=False)
    publish("s", _data(2.0), _render, tmp_path, variant="b", plots=_plots("tab:red"), echo=False)
    publish("s", _data(3.0), _render, tmp_path, variant="a", plots=None, echo=False)  # --no-plot
    assert list(_panels(tmp_path / "s.png")) == ["b"]
    assert list(read_variants(tmp_path / "s.json")) == ["a", "b"]
    publish("s", _data(4.0), _render, tmp_path, variant="b", plots=None, echo=False)
    assert not (tmp_path / "s.png").exists() and "![" not in (tmp_path / "s.md").read_text()


def test_one_configuration_writes_its_figures_as_one_png(tmp_path):
    paths = publish("plain", _data(5.0), lambda d, p: "# Plain\n\n" + "".join(f"![{k}]({v})\n" for k, v in p.items()),
                    tmp_path, plots=_plots("tab:blue", 3), echo=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "plain.md", "plain.png"]
    assert json.loads(paths["json"].read_text())["rows"][0]["tok_s"] == 5.0  # no variants wrapper
    assert read_variants(paths["json"]) == {"": json.loads(paths["json"].read_text())}
    assert "![figure 0 / figure 1 / figure 2](plain.png)" in paths["md"].read_text()
    with Image.open(tmp_path / "plain.png") as im:
        assert im.size[1] > 3 * 150  # three 1.5-inch figures at 110 dpi, stacked


def test_names_classes_and_reading():
    assert variant_name("Gemma-3-270M") == "gemma-3-270m" and variant_name("qwen2.5 0.5b") == "qwen2_5_0_5b"
    with pytest.raises(ConfigError):
        variant_name("..")
    assert cpu_class({"isa": "avx512", "native_isa": "avx512", "amx": True}) == "avx512_amx"
    assert cpu_class({"isa": "avx2", "native_isa": "avx512"}) == "avx2_on_avx512"
    assert cpu_class(None) == "unknown_cpu"


def test_read_variant_names_what_is_there(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"benchmark": "x", "variants": {"a": {"n": 1}, "b": {"n": 2}}}))
    assert read_variant(path, "b") == {"n": 2}
    with pytest.raises(ConfigError, match="name one of its variants with --variant \\(a, b\\)"):
        read_variant(path)
    with pytest.raises(ConfigError, match="no variant 'c'"):
        read_variant(path, "c")
    path.write_text(json.dumps({"n": 3}))
    assert read_variant(path) == {"n": 3}


def test_variant_option_parses_and_rejects(capsys):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "models", "--variant", "AVX2_Load"])
    assert args.variant == "avx2_load"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "spec", "--variant=!!"])
    assert exc.value.code == 2 and "names no variant" in capsys.readouterr().err


def test_a_corrupt_or_variantless_result_file_is_refused_and_left_as_it_was(tmp_path):
    """Numbers already written are never dropped: a JSON that does not parse, or one run without
    variants, stops the write with a ConfigError naming the file, and nothing is rewritten."""
    from pagedkv.bench.variants import write_variant
    from pagedkv.errors import ConfigError

    write_variant("x", "a", {"v": 1}, "# a\n", [], tmp_path, "_footer a_")
    write_variant("x", "b", {"v": 2}, "# b\n", [], tmp_path, "_footer b_")
    md = (tmp_path / "x.md").read_text()
    (tmp_path / "x.json").write_text('{"benchmark": "x", "variants": {"a": {"v": 1}, "b"')  # cut short
    with pytest.raises(ConfigError, match="x.json: not a result file"):
        write_variant("x", "a", {"v": 3}, "# a\n", [], tmp_path, "_footer a_")
    assert (tmp_path / "x.md").read_text() == md
    (tmp_path / "y.json").write_text('{"v": 7}')
    with pytest.raises(ConfigError, match="one run without variants"):
        write_variant("y", "a", {"v": 3}, "# a\n", [], tmp_path, "_footer_")
    assert (tmp_path / "y.json").read_text() == '{"v": 7}' and not (tmp_path / "y.md").exists()
