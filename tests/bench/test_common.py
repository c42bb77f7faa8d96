"""The benchmarks' shared plumbing: the documented commands parse, the one trace loader,
result files, JSON clean-up and the Prometheus reader of the HTTP client."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from pagedkv.bench.cli import BENCHES
from pagedkv.bench.common import default_workload, json_clean
from pagedkv.bench.http import prom_value
from pagedkv.bench.report import markdown_table, publish
from pagedkv.bench.workload import LengthScaling, TraceRequest, load_trace, sample_lengths
from pagedkv.cli import build_parser
from pagedkv.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TRACE = default_workload()


def _documented_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    for md in sorted((ROOT / "docs").rglob("*.md")):
        text += md.read_text()
    return sorted(set(re.findall(r"`pagedkv (bench [^`]*)`", text)))


def test_every_documented_bench_command_parses():
    cmds = _documented_commands()
    assert {c.split()[1] for c in cmds} == set(BENCHES)  # every benchmark is documented
    parser = build_parser()
    for cmd in cmds:
        args = parser.parse_args([*shlex.split(cmd), "--json", "--out-dir", "x", "--threads", "3"])
        assert args.bench == cmd.split()[1] and callable(args.func)
        assert (args.json, args.out_dir, args.threads) == (True, "x", 3)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_help_renders(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", name, "--help"])
    assert exc.value.code == 0
    assert "--out-dir" in capsys.readouterr().out


# ------------------------------------------------------------------ the one trace loader
def _csv(path: Path, rows: list[tuple]) -> Path:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    return path


def test_load_trace_keeps_lengths_skips_invalid_and_sorts(tmp_path):
    csv = _csv(tmp_path / "t.csv", [(0, 100, 10), (3.0, 0, 5), (2.5, 7, "x"), (1.5, 20, 5), (1.0, 30, 6)])
    tr = load_trace(csv)  # no max_model_len: lengths kept
    assert (tr.rows_read, len(tr), tr.skipped_invalid, tr.clipped) == (5, 3, 2, 0)
    assert tr.context.tolist() == [100, 30, 20] and tr.generated.tolist() == [10, 6, 5]
    assert tr.arrival_s.tolist() == [0.0, 1.0, 1.5]
    assert tr.requests()[1] == TraceRequest(1.0, 30, 6)
    assert len(load_trace(csv, limit=2)) == 1
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(ConfigError):
        load_trace(csv, time_scale=0)


def test_load_trace_iso_timestamps(tmp_path):
    csv = _csv(tmp_path / "t.csv", [("2023-11-16 18:15:46.6805900", 5, 2), ("2023-11-16 18:15:48.1805900", 6, 3)])
    assert load_trace(csv, time_scale=2.0).arrival_s.tolist() == pytest.approx([0.0, 3.0])


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not beside the repository")
def test_sampling_from_the_trace_or_its_rows_is_the_same():
    tr = load_trace()
    assert len(tr) == 19366 and tr.skipped_invalid == 0
    sc = LengthScaling()
    assert sample_lengths(tr, 50, sc, seed=3) == sample_lengths(tr.requests(), 50, sc, seed=3)


# ------------------------------------------------------------------ results and helpers
def test_publish_writes_json_markdown_and_prints_json(tmp_path, capsys):
    data = {"config": {"a": 1}, "rows": [{"x": 1.23456, "y": "b"}], "machine": {
        "machine": "m", "cpu_count": 2, "torch_threads": 1, "packages": {"torch": "t"}, "commit": "c", "time_utc": "now"}}

    def render(d, plots):
        return "# T\n\n" + markdown_table(d["rows"])

    paths = publish("t", data, render, tmp_path, as_json=True, json_keys=("config",))
    assert json.loads(capsys.readouterr().out) == {"config": {"a": 1}}
    assert json.loads(paths["json"].read_text())["rows"] == data["rows"]
    md = paths["md"].read_text()
    assert "| x | y |" in md and "| 1.235 | b |" in md and "commit c" in md
    assert "CPU ISA" not in md  # a machine record without the ISA profile
    publish("t", data, render, tmp_path, echo=False)
    assert capsys.readouterr().out == ""
    data["machine"]["cpu_isa"] = {"isa": "avx512", "onednn_isa": "AVX512_CORE_BF16", "vnni": True, "amx": False}
    md = publish("t", data, render, tmp_path, echo=False)["md"].read_text()
    assert "2 CPUs, CPU ISA avx512 (oneDNN AVX512_CORE_BF16, VNNI yes, AMX no), torch threads 1" in md


def test_json_clean_and_prom_value():
    assert json_clean({"a": [1.0, math.nan, (math.inf, 2)], "b": {"c": -math.inf}}) == {"a": [1.0, None, [None, 2]],
                                                                                       "b": {"c": None}}
    text = "# HELP x\npagedkv_num_preemptions_total 3.0\npagedkv_other{a=\"b\"} 7\n"
    assert prom_value(text, "preemption") == 3.0
    assert prom_value(text, "other") == 7.0
    assert prom_value(text, "missing") is None
