"""``pagedkv bench readme``: the README rows of the interleaved-rounds result sets regenerated
from their JSON (hand-made result files here), other rows left alone; and the real README is up
to date with the committed result files."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.bench import readme
from pagedkv.bench.serve import peer as serve_peer
from pagedkv.bench.common import REPO_ROOT
from pagedkv.bench.peers.native_report import summarize

AVX512 = {"isa": "avx512", "native_isa": "avx512", "vnni": True, "amx": False}


def _peers_data() -> dict:
    runs = [{"round": k, "type": "q4_0", "system": s, "status": "ok", "decode_tokens_per_s": v,
             "prefill_tokens_per_s": 10 * v, "load_1m_start": 1.0}
            for k, (a, b) in enumerate([(130, 100), (120, 100), (110, 100)], start=1)
            for s, v in (("pagedkv", a), ("llama.cpp", b))]
    data = {"benchmark": "peers_llama_cpp", "config": {"types": ["q4_0"], "goal_decode_ratio": 1.2, "rounds": 3,
                                                        "model_id": "SmolLM2"},
            "runs": runs, "llama_cpp": {"stamp": {"variant": "native"}}, "machine": {"cpu_isa": AVX512}}
    data["summary"] = summarize(data)
    return data


def _serving_data() -> dict:
    def run(server, rnd, tok_s):
        return {"server": server, "concurrency": 8, "round": rnd, "workload": "32/256", "output_tokens_per_s": tok_s,
                "itl_s": {"p50": 0.03}, "ttft_s": {"p50": 0.2}}

    runs = [run(s, k, v) for k in (1, 2) for s, v in (("pagedkv", 90.0 + k), ("llama-server", 60.0))]
    return {"benchmark": "serving_peer", "config": {"servers": ["pagedkv", "llama-server"], "rounds": 2,
                                                     "workloads": ["32/256"], "gguf_type": "q4_k_m"},
            "runs": runs, "ratios": serve_peer.ratios(runs, [8], workloads=["32/256"]),
            "machine": {"cpu_isa": dict(AVX512, isa="avx2")}}


def _variants(**runs) -> str:
    return json.dumps({"benchmark": "x", "variants": runs})


def test_generated_rows_replace_their_files_rows_and_leave_the_rest(tmp_path):
    bench = tmp_path / "docs" / "benchmarks"
    bench.mkdir(parents=True)
    avx2 = _peers_data()
    avx2["machine"] = {"cpu_isa": {"isa": "avx2", "native_isa": "avx2"}}
    (bench / "peers.json").write_text(_variants(llama_cpp_avx512=_peers_data(), llama_cpp_avx2=avx2,
                                                fp32={"benchmark": "peers", "systems": []}))
    (bench / "serving_peers.json").write_text(_variants(q4_k_m=_serving_data()))
    (bench / "step.json").write_text(json.dumps({"benchmark": "step"}))
    head = ["# x", "", "## Results", "", "| what | pagedkv | peer / baseline | ratio | CPU class | result |",
            "|---|---|---|---|---|---|"]
    keep = "| step | 1 | 2 | 0.5x | any | [step](docs/benchmarks/step.md) |"
    link = "[peers: llama_cpp_avx512](docs/benchmarks/peers.md#llama_cpp_avx512)"
    old = [keep, f"| stale | 1 | 1 | 1x | x | {link} |", f"| stale too | 1 | 1 | 1x | x | {link} |"]
    text = "\n".join(head + old + ["", "## Docs", ""]) + "\n"
    new = readme.regenerate(text, tmp_path, bench)
    rows = [x for x in new.splitlines() if x.startswith("| ") and "docs/benchmarks" in x]
    assert "stale" not in new and keep in rows
    # the runs with no row yet (the AVX2 peers variant, the serving one) go first, in file order;
    # the AVX-512 peers rows where its first row was; the fp32 peers variant has no generated rows
    assert [r.rsplit("|", 2)[-2].strip() for r in rows] == [
        "[peers: llama_cpp_avx2](docs/benchmarks/peers.md#llama_cpp_avx2)"] * 2 + [
        "[serving_peers: q4_k_m](docs/benchmarks/serving_peers.md#q4_k_m)"] * 2 + [
        "[step](docs/benchmarks/step.md)"] + [link] * 2
    assert all(len(r.strip("|").split("|")) == 6 for r in rows)
    decode = rows[5]
    assert "goal ≥ 1.2x by the lower quartile: Q4_0 NOT met" in decode  # ratios 1.3, 1.2, 1.1: q1 1.15
    assert "| 120.0 [115.0-125.0] | 100.0 [100.0-100.0] | 1.20x [1.15-1.25] | AVX-512 + VNNI |" in decode
    assert "| 1.20x [1.15-1.25] | AVX2 |" in rows[0]
    assert "| 91.5 [91.2-91.8] | 60.0 [60.0-60.0] | 1.52x [1.52-1.53] | AVX2 cap on an AVX-512 host |" in rows[2]
    assert "8: met" in rows[2] and "| 30; 200 | 30; 200 |" in rows[3]
    assert readme.regenerate(new, tmp_path, bench) == new  # idempotent


def test_the_readme_is_up_to_date():
    text = (REPO_ROOT / "README.md").read_text()
    assert readme.regenerate(text) == text, "run `pagedkv bench readme`"


def test_check_says_when_the_readme_is_stale(tmp_path):
    import argparse

    bench = tmp_path / "docs" / "benchmarks"
    bench.mkdir(parents=True)
    path = tmp_path / "README.md"
    path.write_text("## Results\n\n| what | a | b | c | d | e |\n|---|---|---|---|---|---|\n| x | 1 | 2 | 3 | any | y |\n")
    args = argparse.Namespace(check=True, readme=str(path))
    assert readme.run(args) == 0
    (bench / "peers.json").write_text(_variants(llama_cpp_avx512=_peers_data()))
    assert readme.run(args) == 1 and "peers" not in path.read_text()  # --check writes nothing
    assert readme.run(argparse.Namespace(check=False, readme=str(path))) == 0 and readme.run(args) == 0
