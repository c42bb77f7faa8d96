"""``pagedkv bench serve --peer openvino`` (offline continuous batching) with stand-ins: the
timing arithmetic of :func:`peer_worker.measure_batched` on a fake engine, the ratios, a whole
run with a fake OpenVINO venv, and pagedkv's own batched engine on the bundled model. No real
OpenVINO."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.bench.peers import worker as peer_worker
from pagedkv.bench.peers import venv as peers_venv
from pagedkv.bench.serve import offline as serve_offline
from pagedkv.bench.serve import peer as serve_peer

SPEC = {"vocab_size": 1000, "prompt_tokens": 16, "output_tokens": 8, "min_requests": 8, "requests_per_stream": 2,
        "concurrency": [1, 4, 16], "threads": 2}


def test_measure_batched_counts_and_rate(monkeypatch):
    """A fake engine that costs 10 ms per decode step of up to ``c`` requests: n requests of 8
    tokens take ceil(n / c) x 8 steps."""
    clock = {"t": 0.0}
    calls = []

    def gen_many(prompts, k, c):
        calls.append((len(prompts), k, c))
        clock["t"] += 0.010 * k * -(-len(prompts) // c)
        return [[7] * k for _ in prompts]

    monkeypatch.setattr(peer_worker.time, "perf_counter", lambda: clock["t"])
    rows = peer_worker.measure_batched(gen_many, SPEC)
    # warm-up (1 request, 2 tokens) then the timed batch, per concurrency; n = max(8, 2c)
    assert calls == [(1, 2, 1), (8, 8, 1), (1, 2, 4), (8, 8, 4), (1, 2, 16), (32, 8, 16)]
    assert [(r["concurrency"], r["requests"], r["output_tokens"]) for r in rows] == [(1, 8, 64), (4, 8, 64),
                                                                                     (16, 32, 256)]
    assert [r["seconds"] for r in rows] == pytest.approx([0.64, 0.16, 0.16])
    assert [r["output_tokens_per_s"] for r in rows] == pytest.approx([100.0, 400.0, 1600.0])
    assert rows[0]["first_output"] == [7] * 8


def test_measure_batched_refuses_short_outputs():
    with pytest.raises(RuntimeError, match=r"asked for 8 x 8 tokens, got 8 outputs \(lengths \[7\]"):
        peer_worker.measure_batched(lambda ps, k, c: [[0] * (k - (i == 3 and k > 2)) for i, _ in enumerate(ps)],
                                    {**SPEC, "concurrency": [1]})


def test_batched_ratios():
    rows = [{"name": "pagedkv", "status": "ok", "batched": [{"concurrency": 1, "output_tokens_per_s": 30.0},
                                                             {"concurrency": 4, "output_tokens_per_s": 50.0}]},
            {"name": "openvino", "status": "ok", "batched": [{"concurrency": 1, "output_tokens_per_s": 20.0},
                                                              {"concurrency": 4, "output_tokens_per_s": 100.0},
                                                              {"concurrency": 16, "output_tokens_per_s": 90.0}]}]
    q = serve_offline.batched_ratios(rows)
    assert q == [{"concurrency": 1, "output_tok_s_ratio": 1.5, "goal_output_tok_s_ratio": 1.2,
                  "output_tok_s_goal_met": True},
                 {"concurrency": 4, "output_tok_s_ratio": 0.5, "goal_output_tok_s_ratio": 1.2,
                  "output_tok_s_goal_met": False},
                 {"concurrency": 16, "missing": True}]
    rows[1] = {"name": "openvino", "status": "failed", "reason": "exit 1"}
    assert serve_offline.batched_ratios(rows) == [{"concurrency": 1, "missing": True},
                                                  {"concurrency": 4, "missing": True}]


def _args(*extra):
    p = argparse.ArgumentParser()
    serve_peer.add_arguments(p)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--note", default=None)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(["--peer", "openvino", *extra])


class _Cfg:
    vocab_size = 1000


class _Loaded:
    config = _Cfg()


def test_run_offline_with_a_fake_openvino_venv(tmp_path, monkeypatch):
    """pagedkv's side replaced by fixed rows; OpenVINO's venv python is a script that checks the
    SPEC it is given and prints the worker's JSON among log lines."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    root = tmp_path / "peers"
    py = peers_venv.venv_python("openvino", root)
    py.parent.mkdir(parents=True)
    peers_venv.model_dir("openvino", root).mkdir(parents=True)
    result = {"system": "openvino", "version": "2026.4.1", "batched": [
        {"concurrency": 1, "requests": 8, "output_tokens": 512, "seconds": 16.0, "output_tokens_per_s": 32.0},
        {"concurrency": 4, "requests": 8, "output_tokens": 512, "seconds": 4.0, "output_tokens_per_s": 128.0}]}
    # the fake fails unless the spec asks for batched mode at concurrency 1 and 4 with the serve workload
    py.write_text("#!/bin/sh\n"
                  "grep -q '\"mode\": \"batched\"' \"$3\" && grep -q '\"concurrency\": \\[1, 4\\]' \"$3\" "
                  "&& grep -q '\"prompt_tokens\": 256' \"$3\" || exit 7\n"
                  f"echo 'compiling'\necho '{json.dumps(result)}'\n")
    py.chmod(0o755)
    ours = [{"concurrency": 1, "requests": 8, "output_tokens": 512, "seconds": 12.8, "output_tokens_per_s": 40.0},
            {"concurrency": 4, "requests": 8, "output_tokens": 512, "seconds": 5.12, "output_tokens_per_s": 100.0}]
    seen = {}

    def fake_pagedkv(loaded, spec):
        seen["spec"] = spec
        return {"name": "pagedkv", "status": "ok", "reason": None, "weights": "int4 (codes)", "batched": ours}

    monkeypatch.setattr(serve_offline, "measure_pagedkv_batched", fake_pagedkv)
    data = serve_offline.run_offline_openvino(_args("--concurrency", "1,4"), loaded=_Loaded())
    assert seen["spec"]["concurrency"] == [1, 4] and seen["spec"]["vocab_size"] == 1000
    assert seen["spec"]["min_requests"] == 8 and seen["spec"]["output_tokens"] == 64
    ov = data["rows"][1]
    assert ov["status"] == "ok" and ov["weights"].startswith("int4 asym, group 32")
    assert [(q["concurrency"], q["output_tok_s_ratio"], q["output_tok_s_goal_met"]) for q in data["ratios"]] == [
        (1, 1.25, True), (4, 100.0 / 128.0, False)]
    md = serve_offline.render_markdown(data, {})
    assert "- openvino: int4 asym, group 32" in md and "| openvino | 4 | 8 | 512 | 4.00 | 128.0 |" in md
    assert "| pagedkv | 1 | 8 | 512 | 12.80 | 40.0 |" in md and "- pagedkv: int4 (codes)" in md
    assert "- concurrency 1: 1.25× — met" in md and "- concurrency 4: 0.78× — NOT met" in md
    assert "no HTTP server" in md


def test_bench_serve_openvino_dispatches_offline(monkeypatch):
    from pagedkv.bench.serve import run as serve

    got = {}
    monkeypatch.setattr(serve_offline, "run", lambda args: got.setdefault("peer", args.peer) and 0)
    monkeypatch.setattr(serve_peer, "run", lambda args: 1 / 0)  # the HTTP sweep is not reached
    assert serve.run(_args()) == 0 and got == {"peer": "openvino"}


@pytest.mark.slow
def test_pagedkv_batched_on_the_bundled_model(loaded_model):
    """pagedkv's side for real: every request gets its tokens, and batching four at a time
    gives the first request the same greedy tokens as running it alone."""
    from pagedkv.bench.common import greedy
    from pagedkv.engine.llm import LLM

    spec = {**SPEC, "prompt_tokens": 8, "output_tokens": 4, "min_requests": 4, "requests_per_stream": 1,
            "concurrency": [1, 4], "vocab_size": 49152}
    row = serve_offline.measure_pagedkv_batched(loaded_model, spec)
    assert row["status"] == "ok" and [(b["concurrency"], b["requests"], b["output_tokens"]) for b in row["batched"]] == [
        (1, 4, 16), (4, 4, 16)]
    (alone,) = LLM(loaded_model, dtype="float32").generate([peer_worker.prompt_ids(8, 49152, 3000)], greedy(4),
                                                            use_tqdm=False)
    assert row["batched"][0]["first_output"] == list(alone.token_ids) == row["batched"][1]["first_output"]


def test_the_served_kv_flag_reaches_the_offline_engine(loaded_model, monkeypatch):
    """``--serve-arg=--kv-cache-dtype=bfloat16`` (the served runs' flag) makes the offline
    pagedkv engines use that KV format, and the row says so."""
    import argparse

    from pagedkv.engine import llm as llm_mod

    args = argparse.Namespace(concurrency="2", prompt_tokens=8, output_tokens=4, min_requests=2,
                              requests_per_stream=1, serve_arg=["--threads=2", "--kv-cache-dtype=bfloat16"])
    spec = serve_offline.batched_spec(args, 2, 49152)
    assert spec["pagedkv_kv_cache_dtype"] == "bfloat16"
    assert serve_offline.batched_spec(argparse.Namespace(**{**vars(args), "serve_arg": None}), 2, 49152)[
        "pagedkv_kv_cache_dtype"] == "auto"
    seen = []
    real = llm_mod.LLM

    def spy(*a, **kw):
        seen.append(kw.get("kv_cache_dtype"))
        return real(*a, **kw)

    monkeypatch.setattr(llm_mod, "LLM", spy)
    row = serve_offline.measure_pagedkv_batched(loaded_model, spec)
    assert seen == ["bfloat16"] and row["weights"].endswith("KV cache bfloat16")
    assert row["batched"][0]["output_tokens"] == 8
