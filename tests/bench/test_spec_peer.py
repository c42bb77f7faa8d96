"""``pagedkv bench spec``'s llama.cpp side (``pagedkv.bench.spec.peer``): the lookup flags, the
arithmetic on the server's timings, and a run against a stand-in ``llama-server`` (a stdlib HTTP
script taking llama-server's flags and answering ``/completion`` with fixed timings: the real
one is a benchmark peer, never a test dependency)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from pagedkv.bench.spec import run as bench_spec
from pagedkv.bench.spec.peer import LookupPeer, lookup_flags
from pagedkv.bench.variants import read_variant

# plain: 9 tokens in 80 ms after the first; lookup (--spec-type given): 9 tokens in 40 ms, 8
# drafted and 6 accepted; both generate the same ids, unless the prompt starts with 999
_STAND_IN = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
a = sys.argv[1:]
if a == ["--version"]:
    print("stand-in llama-server"); sys.exit(0)
assert a[a.index("-np") + 1] == "1" and a[a.index("-t") + 1] == a[a.index("-tb") + 1]
lookup = "--spec-type" in a
if lookup:
    assert a[a.index("--spec-type") + 1] == "ngram-simple"
class H(BaseHTTPRequestHandler):
    def log_message(self, *x): pass
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0.0 and req["top_k"] == 1 and req["cache_prompt"] is False
        n = min(10, req["n_predict"])
        t = {{"predicted_n": n, "predicted_ms": 40.0 if lookup else 80.0, "prompt_n": len(req["prompt"])}}
        if lookup:
            t.update(draft_n=8, draft_n_accepted=6)
        ids = list(range(n)) if not (lookup and req["prompt"][0] == 999) else [7] * n
        self._send({{"content": "x", "tokens": ids, "timings": t}})
HTTPServer(("127.0.0.1", int(a[a.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(_STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_lookup_flags_name_llama_cpp_s_ngram_speculation():
    assert lookup_flags(3, 4) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                  "--spec-ngram-simple-size-m", "4"]


def test_lookup_peer_sums_the_servers_timings(stand_in, tmp_path):
    with LookupPeer(stand_in, str(tmp_path / "m.gguf"), threads=1, size_n=3, size_m=4) as peer:
        peer.run([1, 2, 3], max_tokens=10)
        peer.run([4, 5], max_tokens=10)
        assert peer.totals["plain"] == {"decode_tokens": 18, "decode_ms": 160.0, "draft_n": 0, "draft_accepted": 0}
        assert peer.totals["lookup"] == {"decode_tokens": 18, "decode_ms": 80.0, "draft_n": 16, "draft_accepted": 12}
        assert peer.rates() == {"plain": 112.5, "lookup": 225.0, "acceptance": 0.75}
        assert peer.same_tokens
        peer.run([999], max_tokens=10)  # the stand-in's lookup side answers other ids
        assert not peer.same_tokens
        peer.reset()
        assert peer.rates() == {"plain": 0.0, "lookup": 0.0, "acceptance": 0.0} and peer.same_tokens


def _args(*extra):
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    p.add_argument("--threads", type=int)  # the common options `pagedkv bench` adds to every command
    p.add_argument("--out-dir")
    p.add_argument("--json", action="store_true")
    return p.parse_args(["--max-tokens", "6", "--rounds", "1", "--threads", "1", *extra])


def test_bench_spec_runs_llama_cpp_lookup_interleaved(loaded_model, stand_in, tmp_path):
    args = _args("--llama-server", stand_in, "--out-dir", str(tmp_path))
    assert bench_spec.run(args, loaded_model) == 0
    data = read_variant(tmp_path / "spec.json", "ngram")
    lc = data["config"]["llama_cpp"]
    assert lc["measured"] and lc["server"]["version"] == "stand-in llama-server"
    assert lc["lookup_flags"] == lookup_flags(3, 4)
    for r in data["rows"]:  # 6 tokens per request: 5 after the first in 80 / 40 ms
        assert (r["llama_cpp_tok_s"], r["llama_cpp_lookup_tok_s"], r["llama_cpp_speedup"]) == (62.5, 125.0, 2.0)
        assert r["llama_cpp_acceptance"] == 0.75 and r["llama_cpp_same_tokens"] is True
        # ngram_tok_s is stored rounded to 0.01, the ratio from the unrounded rate: one unit of 0.001 apart at most
        assert abs(r["ngram_vs_llama_cpp_lookup"] - r["ngram_tok_s"] / 125.0) <= 0.0011
    md = (tmp_path / "spec.md").read_text()
    assert "C++ n-gram lookup" in md and "ngram_vs_llama_cpp_lookup" in md


def test_bench_spec_says_why_llama_cpp_was_not_measured(loaded_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))  # no peers built there
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("PAGEDKV_LLAMA_SERVER", raising=False)
    assert bench_spec.run(_args("--out-dir", str(tmp_path)), loaded_model) == 0
    data = read_variant(tmp_path / "spec.json", "ngram")
    assert data["config"]["llama_cpp"] == {"measured": False, "reason": "llama-server not found: run `make peers`"}
    assert "llama_cpp_tok_s" not in data["rows"][0]
    assert "llama.cpp: not measured (llama-server not found: run `make peers`)." in (tmp_path / "spec.md").read_text()


def test_bench_spec_keeps_every_round_and_its_spread(loaded_model, stand_in, tmp_path):
    """3 rounds: each side's rate per round kept, medians and ratios per round with their spread,
    the goal judged by the speedup's lower quartile; the stand-in's timings are the same every round."""
    import statistics

    args = _args("--llama-server", stand_in, "--out-dir", str(tmp_path), "--rounds", "3")
    assert bench_spec.run(args, loaded_model) == 0
    data = read_variant(tmp_path / "spec.json", "ngram")
    for r in data["rows"]:
        assert len(r["rounds"]) == 3
        assert [(x["llama_cpp"], x["llama_cpp_lookup"]) for x in r["rounds"]] == [(62.5, 125.0)] * 3
        assert r["spread"]["llama_cpp_speedup"] == {"median": 2.0, "q1": 2.0, "q3": 2.0, "n": 3}
        assert r["plain_tok_s"] == round(statistics.median(x["plain"] for x in r["rounds"]), 2)
        per_round = sorted(x["ngram"] / x["plain"] for x in r["rounds"])  # from rates rounded to 0.01
        assert abs(r["speedup"] - per_round[1]) < 1e-3 and r["spread"]["speedup"]["n"] == 3
        assert r["spread"]["speedup"]["q1"] <= r["speedup"] <= r["spread"]["speedup"]["q3"]
    sp = data["rows"][0]["spread"]["speedup"]
    assert data["goals"]["repetitive >= 2x"] == (sp["q1"] >= 2.0)
    md = (tmp_path / "spec.md").read_text()
    assert "| 62.5 [62.5-62.5] | 125.0 [125.0-125.0] | 2.00x [2.00-2.00] | 0.75 |" in md
    assert "ratios are taken per round" in md


def test_spec_rows_written_before_rounds_render_as_stored():
    row = {"workload": "repetitive", "plain_tok_s": 160.24, "ngram_tok_s": 255.95, "speedup": 1.597}
    data = {"config": {"max_tokens": 128, "num_speculative_tokens": 4, "weights": "gguf", "threads": 2, "rounds": 5,
                       "speculative": "ngram", "llama_cpp": {"measured": False, "reason": "--no-llama-cpp"}},
            "rows": [row], "acceptance_rate": 0.67, "mean_accepted_length": 3.65,
            "goals": {"repetitive >= 2x": False}}
    md = bench_spec.render_markdown(data, {})
    assert "| repetitive | 160.2 | 255.9 | 1.597 |" in md and "ratios are taken per round" not in md
