"""The batch-1 comparison with native llama.cpp (``pagedkv bench peers --systems
pagedkv-b1,llama.cpp``): the protocol end to end with fake runners (a shell ``llama-bench`` and
``llama-quantize``, pagedkv's measured child replaced), and its summary arithmetic."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pagedkv.bench.peers import run as peers
from pagedkv.bench.peers import native as peers_native
from pagedkv.bench.peers.native_report import summarize
from pagedkv.bench.variants import cpu_class, read_variants


def _script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _run(rnd, system, decode, prefill, qtype="q4_0", status="ok"):
    return {"round": rnd, "type": qtype, "system": system, "status": status, "decode_tokens_per_s": decode,
            "prefill_tokens_per_s": prefill, "load_1m_start": 1.0 + rnd}


def _native_args(out: Path, types: str, rounds: int):
    from pagedkv.cli import build_parser

    return build_parser().parse_args(["bench", "peers", "--systems", "pagedkv-b1,llama.cpp", "--types", types,
                                      "--rounds", str(rounds), "--decode-tokens", "16", "--out-dir", str(out),
                                      "--no-plot"])


def test_summary_pairs_rounds_and_meets_goals_by_the_lower_quartile():
    # decode ratios per round 1.5, 1.4, 1.3, 1.1, 1.0: median 1.3 >= 1.2, lower quartile 1.1 < 1.2
    pairs = [(150, 100), (140, 100), (130, 100), (110, 100), (100, 100)]
    runs = [r for k, (a, b) in enumerate(pairs, start=1)
            for r in (_run(k, "pagedkv", a, 2.0 * a), _run(k, "llama.cpp", b, 100.0))]
    runs.append(_run(6, "pagedkv", None, None, status="killed_rss"))  # failed: kept, not counted, said
    data = {"config": {"types": ["q4_0"], "goal_decode_ratio": 1.2}, "runs": runs}
    s = summarize(data)["q4_0"]
    assert s["decode_tokens_per_s_ratio"]["median"] == pytest.approx(1.3)
    assert s["decode_tokens_per_s_ratio"]["q1"] == pytest.approx(1.1) and s["goal_met"] is False
    assert s["prefill_tokens_per_s_ratio"]["median"] == pytest.approx(2.6)
    assert s["pagedkv"]["decode_tokens_per_s"]["n"] == 5 and s["llama.cpp"]["decode_tokens_per_s"]["median"] == 100
    assert s["pagedkv"]["failed"] == ["round 6: killed_rss: None"] and s["pagedkv"]["load_1m"]["n"] == 6
    data["runs"] = [dict(r, decode_tokens_per_s=r["decode_tokens_per_s"] * 1.2) if r["system"] == "pagedkv"
                    and r["status"] == "ok" else r for r in runs]
    assert summarize(data)["q4_0"]["goal_met"] is True  # lower quartile 1.32


def test_native_run_makes_the_formats_interleaves_and_keeps_every_run(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    bin_dir = cache / "peers" / "bin"
    # llama-quantize --allow-requantize SRC OUT TYPE THREADS: a copy stands in for the quantised file
    _script(bin_dir / "llama-quantize", 'echo "$@" > "$3.args"; cp "$2" "$3"\n')
    rows = [{"build_commit": "abc", "cpu_info": "AMD EPYC", "n_threads": 2, "n_prompt": 512, "n_gen": 0,
             "avg_ts": 101.0, "samples_ts": [100.0, 90.0, 113.0]},
            {"build_commit": "abc", "cpu_info": "AMD EPYC", "n_threads": 2, "n_prompt": 0, "n_gen": 16,
             "avg_ts": 51.0, "samples_ts": [50.0, 40.0, 63.0]}]
    _script(bin_dir / "llama-bench", f"cat <<'EOF'\n{json.dumps(rows)}\nEOF\n")
    seen = []

    def fake_pagedkv(path, args, spec):
        seen.append((Path(path).name, spec["decode_tokens"], spec["repeats"]))
        return {"status": "ok", "reason": None, "weights": "gguf", "kv_cache_dtype": "float32",
                "decode_tokens_per_s": 65.0, "prefill_tokens_per_s": 300.0}

    monkeypatch.setattr(peers_native, "pagedkv_run", fake_pagedkv)
    out = tmp_path / "out"
    assert peers.run(_native_args(out, "q4_1,q4_0", 2)) == 0
    ((variant, data),) = read_variants(out / "peers.json").items()
    assert variant == "llama_cpp_" + cpu_class(data["machine"]["cpu_isa"])  # this host's CPU class
    made = Path(data["files"]["q4_0"]["path"])
    assert made.parent == cache / "models" and made.name.endswith("-q4_0-requant-from-q4_1.gguf")
    assert "--allow-requantize" in Path(str(made) + ".tmp.args").read_text()
    assert data["files"]["q4_1"]["maker"] == "as shipped" and "Q4_1" in data["files"]["q4_1"]["tensor_types"]
    # every run kept, in the order run: the systems alternate per round and per format
    order = [(r["round"], r["type"], r["system"]) for r in data["runs"]]
    assert order == [(1, "q4_1", "pagedkv"), (1, "q4_1", "llama.cpp"), (1, "q4_0", "llama.cpp"), (1, "q4_0", "pagedkv"),
                     (2, "q4_1", "llama.cpp"), (2, "q4_1", "pagedkv"), (2, "q4_0", "pagedkv"), (2, "q4_0", "llama.cpp")]
    assert all(r["load_1m_start"] is not None and r["wall_s"] >= 0 for r in data["runs"])
    peer = next(r for r in data["runs"] if r["system"] == "llama.cpp")
    assert peer["decode_tokens_per_s"] == 50.0 and peer["decode_tokens_per_s_mean"] == 51.0  # the median sample
    assert peer["command"].endswith("-p 512 -n 16 -r 3 -o json") and peer["system_info"]["cpu_info"] == "AMD EPYC"
    assert seen[0][1:] == (16, 3)
    s = data["summary"]["q4_0"]
    assert s["decode_tokens_per_s_ratio"]["median"] == pytest.approx(1.3) and s["goal_met"] is True
    for key in ("cpu_model", "llama_cpp", "machine"):
        assert data[key]
    assert "dirty" in data["machine"] and data["machine"]["cpu_isa"] and not data["partial"]
    md = (out / "peers.md").read_text()
    assert f"\n## {variant}\n" in md
    assert "| Q4_0 |" in md and "1.30x" in md and "met" in md and "--allow-requantize" in md
    # re-rendered from the JSON, the same report
    from pagedkv.cli import build_parser

    again = build_parser().parse_args(["bench", "peers", "--systems", "pagedkv-b1,llama.cpp", "--from-json",
                                       str(out / "peers.json"), "--out-dir", str(tmp_path / "again"),
                                       "--no-plot"])
    assert peers.run(again) == 0 and (tmp_path / "again" / "peers.md").read_text() == md


def test_formats_without_llama_quantize_say_why(tmp_path, monkeypatch):
    from pagedkv.bench.peers.systems import resolve_peer_model

    monkeypatch.setattr(peers_native, "find_tool", lambda name, bin_dir=None: None)
    files = peers_native.ensure_formats(resolve_peer_model(None), ["q4_1", "q4_0", "bf16"], 2, root=tmp_path,
                                        log_fn=lambda m: None)
    assert files["q4_1"]["maker"] == "as shipped" and files["q4_0"] == {"error": "llama-quantize not built (make peers)"}
    assert files["bf16"] == files["q4_0"]  # bf16 (same bytes on both sides) is made the same way


def test_a_source_change_during_a_run_stops_it(tmp_path, monkeypatch):
    """Each pagedkv round runs the checkout's code: its digest is checked before every pagedkv
    run, and a change stops the run with exit 2, the finished rounds written as partial."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    rows = [{"build_commit": "abc", "n_prompt": 512, "n_gen": 0, "avg_ts": 101.0, "samples_ts": [101.0]},
            {"build_commit": "abc", "n_prompt": 0, "n_gen": 16, "avg_ts": 51.0, "samples_ts": [51.0]}]
    _script(cache / "peers" / "bin" / "llama-bench", f"cat <<'EOF'\n{json.dumps(rows)}\nEOF\n")
    monkeypatch.setattr(peers_native, "pagedkv_run", lambda path, args, spec: {
        "status": "ok", "reason": None, "decode_tokens_per_s": 65.0, "prefill_tokens_per_s": 300.0})
    from pagedkv.bench import protocol

    digests = iter(["a", "a", "b"])  # at the start, before round 1's pagedkv run, before round 2's

    def digest(package=None):
        return next(digests)

    monkeypatch.setattr(peers_native, "source_digest", digest)
    monkeypatch.setattr(protocol, "source_digest", digest)
    out = tmp_path / "out"
    assert peers.run(_native_args(out, "q4_1", 3)) == 2
    ((variant, data),) = read_variants(out / "peers.json").items()
    assert data["partial"] and [(r["round"], r["system"]) for r in data["runs"]] == [(1, "pagedkv"), (1, "llama.cpp")]
