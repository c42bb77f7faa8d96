"""The offline-trace section of ``pagedkv bench peers --systems vllm,openvino`` with stand-ins:
the worker's trace mode on fake engines, the SPEC through a file and the worker's ``main``,
OpenVINO's add_request/step loop on a fake pipeline, the report with a peer not installed,
and pagedkv's in-process side on the tiny random model. No real peer runs."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from pagedkv.bench.peers import worker as peer_worker
from pagedkv.bench.peers import trace as peers_trace
from pagedkv.bench.variants import read_variant
from pagedkv.bench.workload import BenchRequest


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _spec(reqs, **kw):
    return {"mode": "trace", "threads": 2, "vocab_size": 1000, "requests": reqs, **kw}


def test_measure_trace_hands_every_request_over_at_once(monkeypatch):
    """A fake engine that costs 1 ms per prompt token and 10 ms per output token: 3 requests
    of 5+3, 2+4 and 7+1 tokens in one call take 0.014 + 0.080 = 0.094 s."""
    clock = _Clock()
    monkeypatch.setattr(peer_worker.time, "perf_counter", clock)
    calls = []

    def gen_trace(prompts, lens):
        calls.append(([list(p) for p in prompts], list(lens)))
        clock.t += 0.001 * sum(map(len, prompts)) + 0.010 * sum(lens)
        return [[100 + i] * k for i, k in enumerate(lens)]

    reqs = [[[1, 2, 3, 4, 5], 3], [[6, 7], 4], [[8, 9, 10, 11, 12, 13, 14], 1]]
    r = peer_worker.measure_trace(gen_trace, _spec(reqs, max_num_seqs=16))
    assert len(calls) == 2  # the warm-up, then every request in one call
    warm_prompts, warm_lens = calls[0]
    assert warm_lens == [2] and warm_prompts == [peer_worker.prompt_ids(8, 1000, 99)]
    assert calls[1] == ([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]], [3, 4, 1])
    assert r["requests"] == 3 and r["max_num_seqs"] == 16
    assert r["prompt_tokens"] == 14 and r["output_tokens"] == 8
    assert r["seconds"] == pytest.approx(0.094)
    assert r["output_tokens_per_s"] == pytest.approx(8 / 0.094)
    assert r["total_tokens_per_s"] == pytest.approx(22 / 0.094)
    assert r["first_output"] == [100, 100, 100]


def test_measure_trace_refuses_a_wrong_length_or_count():
    reqs = [[[1, 2], 3], [[3, 4], 2]]
    with pytest.raises(RuntimeError, match=r"\(request, got, asked\) that differ: \[\(1, 1, 2\)\]"):
        peer_worker.measure_trace(lambda p, ks: [[0] * ks[0]] + [[0] * (k - 1) for k in ks[1:]], _spec(reqs))
    with pytest.raises(RuntimeError, match="asked for 2 outputs, got 1"):
        peer_worker.measure_trace(lambda p, ks: [[0] * k for k in ks][:1] if len(ks) > 1 else [[0] * ks[0]],
                                  _spec(reqs))
    with pytest.raises(ValueError, match="at least one request"):
        peer_worker.measure_trace(lambda p, ks: [], _spec([]))
    with pytest.raises(ValueError, match="at least 1 output token"):
        peer_worker.trace_requests(_spec([[[1], 0]]))


def _reqs():
    return [BenchRequest([300, 301, 302, 303], 3), BenchRequest([400, 401], 2), BenchRequest([500] * 6, 5)]


def test_spec_round_trip_through_the_worker_main(tmp_path, monkeypatch, capsys):
    """pagedkv's SPEC, written as JSON and read by the worker's main, reaches the peer's
    engine as the same prompts and lengths; the JSON line printed carries the trace result."""
    spec = peers_trace.trace_spec(_reqs(), threads=2, vocab_size=49152)
    assert spec["requests"] == [[[300, 301, 302, 303], 3], [[400, 401], 2], [[500] * 6, 5]]
    assert (spec["mode"], spec["max_num_seqs"], spec["dtype"], spec["max_model_len"]) == ("trace", 64, "bfloat16", 1024)
    seen = []

    def fake_runner(s):
        def gen_trace(prompts, lens):
            seen.append((prompts, lens))
            return [[7] * k for k in lens]
        return gen_trace, {"version": "0.0-fake", "weights": "bf16", "max_num_seqs": s["max_num_seqs"]}

    monkeypatch.setitem(peer_worker.TRACE_RUNNERS, "vllm", fake_runner)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "system": "vllm", "model": "/m"}))
    assert peer_worker.main([str(path)]) == 0
    assert seen[1] == ([[300, 301, 302, 303], [400, 401], [500] * 6], [3, 2, 5])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["system"] == "vllm" and printed["version"] == "0.0-fake" and printed["threads"] == 2
    t = printed["trace"]
    assert (t["requests"], t["prompt_tokens"], t["output_tokens"], t["first_output"]) == (3, 12, 10, [7, 7, 7])


def test_run_trace_peer_lifts_the_trace_result(tmp_path):
    py = tmp_path / "venvs" / "openvino" / "bin" / "python"
    py.parent.mkdir(parents=True)
    result = {"system": "openvino", "version": "2026.4.1", "threads": 2,
              "trace": {"requests": 3, "prompt_tokens": 12, "output_tokens": 10, "seconds": 0.5,
                        "output_tokens_per_s": 20.0, "total_tokens_per_s": 44.0, "max_num_seqs": 64}}
    py.write_text(f"#!/bin/sh\necho 'compiling'\necho '{json.dumps(result)}'\n")
    py.chmod(0o755)
    from pagedkv.bench.peers.venv import model_dir

    model_dir("openvino", tmp_path).mkdir(parents=True)
    row = peers_trace.run_trace_peer("openvino", peers_trace.trace_spec(_reqs(), 2, 49152), root=tmp_path)
    assert row["status"] == "ok" and "trace" not in row
    assert (row["requests"], row["output_tokens"], row["output_tokens_per_s"]) == (3, 10, 20.0)
    assert row["weights"].startswith("int4 asym, group 32")
    py.write_text(f"#!/bin/sh\necho '{json.dumps({'system': 'openvino'})}'\n")
    row = peers_trace.run_trace_peer("openvino", {"threads": 2}, root=tmp_path)
    assert row == {"name": "openvino", "status": "failed", "reason": "the worker printed no trace result"}
    assert peers_trace.run_trace_peer("vllm", {"threads": 2}, root=tmp_path)["status"] == "not installed"


class _Handle:
    def __init__(self, k: int) -> None:
        self.k, self.done = k, 0

    def get_status(self) -> str:
        return "FINISHED" if self.done >= self.k else "RUNNING"

    def read_all(self):
        return [types.SimpleNamespace(generated_ids=list(range(self.k)))]


class _Pipe:
    """Generates one token per step for every request in it; records the in-flight count."""

    def __init__(self) -> None:
        self.handles, self.ids, self.in_flight = [], [], []

    def add_request(self, rid, tensor, cfg):
        self.ids.append((rid, tensor, cfg))
        h = _Handle(cfg)
        self.handles.append(h)
        return h

    def step(self) -> None:
        live = [h for h in self.handles if h.done < h.k]
        self.in_flight.append(len(live))
        for h in live:
            h.done += 1


def test_drive_closed_loop_gives_each_request_its_own_config():
    """Configs are per request (here the fake's config is the length itself); at most c in
    flight, request ids continue from ``next_id``."""
    pipe, next_id = _Pipe(), [10]
    status = types.SimpleNamespace(RUNNING="RUNNING", FINISHED="FINISHED")
    out = peer_worker.drive_closed_loop(pipe, ["a", "b", "c"], [3, 1, 2], 2, status, next_id)
    assert out == [[0, 1, 2], [0], [0, 1]]
    assert [(i, t) for i, t, _ in pipe.ids] == [(11, "a"), (12, "b"), (13, "c")] and next_id == [13]
    assert max(pipe.in_flight) == 2 and pipe.in_flight == [2, 2, 2]

    class _Bad(_Handle):
        def get_status(self) -> str:
            return "IGNORED"

    pipe.add_request = lambda rid, t, cfg: _Bad(cfg)
    with pytest.raises(RuntimeError, match="request 0 ended IGNORED"):
        peer_worker.drive_closed_loop(pipe, ["a"], [1], 1, status, [0])


def test_render_trace_with_a_peer_not_installed(tmp_path):
    rows = [{"name": "pagedkv", "status": "ok", "version": "0.1.0", "weights": "int4", "requests": 32,
             "prompt_tokens": 4000, "output_tokens": 1000, "seconds": 10.0, "output_tokens_per_s": 100.0,
             "total_tokens_per_s": 500.0},
            {"name": "vllm", "status": "ok", "version": "0.32.0", "weights": "bf16", "requests": 32,
             "prompt_tokens": 4000, "output_tokens": 1000, "seconds": 25.0, "output_tokens_per_s": 40.0,
             "total_tokens_per_s": 200.0},
            {"name": "openvino", "status": "not installed", "reason": "no /x/python: run `make peers`"}]
    q = [{"peer": "vllm", "output_ratio": 2.5, "total_ratio": 2.5}]  # a result from before rounds stores these
    md = peers_trace.render_trace({"method": "m", "rows": rows, "ratios": q})
    assert "| pagedkv | 0.1.0 | int4 | 32 | 4000 / 1000 | 10.00 | 100.0 | 500.0 |  |" in md
    assert "| vllm | 0.32.0 | bf16 | 32 | 4000 / 1000 | 25.00 | 40.0 | 200.0 | 2.50x, 2.50x |" in md
    assert "| openvino | | not installed: no /x/python: run `make peers` | | | | | | |" in md
    data = {"config": {"model_id": "m", "threads": 2},
            "trace_offline": {"spec": {"requests": 32}, "rows": rows, "ratios": q}}
    peers_trace.plot_trace(data, tmp_path / "t.png")  # the two systems that ran, as bars
    assert (tmp_path / "t.png").stat().st_size > 1000


def _trace_args(**kw):
    base = dict(num_requests=64, length_divisor=8.0, max_prompt=32, max_output=4, seed=0, trace=None)
    return argparse.Namespace(**{**base, **kw})


def test_draw_trace_requests_follows_the_trace_flags():
    a = peers_trace.draw_trace_requests(_trace_args(), 6, 49152)
    assert len(a) == 6 and a == peers_trace.draw_trace_requests(_trace_args(), 6, 49152)
    assert all(4 <= r.prompt_len <= 32 and 2 <= r.output_len <= 4 for r in a)
    bos = peers_trace.draw_trace_requests(_trace_args(), 6, 49152, lambda p: [2] + list(p)[1:])
    assert [r.prompt_token_ids[0] for r in bos] == [2] * 6 and [r.output_len for r in bos] == [r.output_len for r in a]
    with pytest.raises(ValueError, match=">= 1"):
        peers_trace.draw_trace_requests(_trace_args(), 0, 49152)


def test_pagedkv_trace_side_on_the_tiny_model(loaded_model):
    from pagedkv.testing.tiny import tiny_random_model

    tiny = tiny_random_model(loaded_model)
    spec = peers_trace.trace_spec(_reqs(), threads=1, vocab_size=int(tiny.config.vocab_size))
    row = peers_trace.measure_pagedkv_trace(tiny, spec, dict(kv_cache_memory="16MiB", dtype="float32",
                                                              max_model_len=64, max_num_batched_tokens=64))
    assert row["name"] == "pagedkv" and row["status"] == "ok" and row["weights"] == "fp32"
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"], row["max_num_seqs"]) == (3, 12, 10, 64)
    assert row["seconds"] > 0 and row["output_tokens_per_s"] == pytest.approx(10 / row["seconds"])
    assert len(row["first_output"]) == 3 and all(0 <= t < tiny.config.vocab_size for t in row["first_output"])


def test_bench_peers_venv_section_with_no_peer_installed(loaded_model, tmp_path, monkeypatch):
    """``bench peers --systems vllm,openvino --tiny`` with no peer venv: pagedkv's own trace
    row (4 requests), both peers "not installed" with the reason, in the JSON and Markdown."""
    from pagedkv.bench.peers import run as peers
    from pagedkv.cli import build_parser

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    args = build_parser().parse_args(["bench", "peers", "--tiny", "--systems", "vllm,openvino", "--trace-requests", "8",
                                      "--out-dir", str(tmp_path), "--no-plot"])
    assert peers.run(args, loaded=loaded_model) == 0
    data = read_variant(tmp_path / "peers.json", "fp32_venv")
    sec = data["trace_offline"]
    assert data["config"]["command"].endswith("--systems vllm,openvino --trace-requests 4 --rounds 2")
    assert [(r["round"], r["name"], r["status"]) for r in sec["rows"]] == [
        (1, "pagedkv", "ok"), (1, "vllm", "not installed"), (1, "openvino", "not installed"),
        (2, "openvino", "not installed"), (2, "vllm", "not installed"), (2, "pagedkv", "ok")]
    assert sec["rounds"] == 2 and [(s["name"], s["ok"]) for s in sec["systems"]] == [("pagedkv", 2), ("vllm", 0),
                                                                                      ("openvino", 0)]
    ours = sec["rows"][0]
    assert ours["requests"] == sec["spec"]["requests"] == 4 and ours["max_num_seqs"] == 64
    assert ours["output_tokens"] == pytest.approx(sec["spec"]["output_len"]["mean"] * 4) and sec["ratios"] == []
    md = (tmp_path / "peers.md").read_text()
    assert "\n## fp32_venv\n" in md and "#### Offline throughput on the trace requests" in md
    assert f"| vllm | | not installed: no {tmp_path}/cache/peers/venvs/vllm/bin/python: run `make peers` |" in md
    assert "2 round(s), pagedkv and the peers interleaved" in md and "| 2 | pagedkv | ok |" in md


def test_trace_rounds_pair_output_and_total_rates_by_round(monkeypatch, tmp_path):
    out = {"pagedkv": iter([100.0, 120.0]), "vllm": iter([50.0, 40.0])}

    def row(name, v):
        return {"name": name, "status": "ok", "version": "v", "weights": "bf16", "requests": 2, "prompt_tokens": 10,
                "output_tokens": 4, "seconds": 1.0, "output_tokens_per_s": v, "total_tokens_per_s": 3 * v}

    monkeypatch.setattr(peers_trace, "measure_pagedkv_trace", lambda loaded, spec, kw: row("pagedkv", next(out["pagedkv"])))
    monkeypatch.setattr(peers_trace, "run_trace_peer", lambda name, spec, pagedkv_weights: row(name, next(out[name])))
    sec = peers_trace.run_trace({"vllm"}, object(), {}, _reqs(), 2, 1000, log=lambda *a: None, rounds=2)
    assert [(r["round"], r["name"]) for r in sec["rows"]] == [(1, "pagedkv"), (1, "vllm"), (2, "vllm"), (2, "pagedkv")]
    (q,) = sec["ratios"]
    assert q["output_tokens_per_s"]["values"] == [2.0, 3.0] and q["total_tokens_per_s"]["median"] == 2.5
    md = peers_trace.render_trace(sec)
    assert "| pagedkv | v | bf16 | 2 | 10 / 4 | 2 of 2 | 110.0 [105.0-115.0] | 330.0 [315.0-345.0] |  |" in md
    assert "| vllm | v | bf16 | 2 | 10 / 4 | 2 of 2 | 45.0 [42.5-47.5] | 135.0 [127.5-142.5] | 2.50x [2.25-2.75]; " \
           "2.50x [2.25-2.75] |" in md
    peers_trace.plot_trace({"config": {"model_id": "m", "threads": 2}, "trace_offline": sec}, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000  # medians with their IQRs as error bars
