"""The venv peers of ``pagedkv bench peers`` / ``bench serve --peer vllm`` with stand-ins: a
fake venv python that prints the worker's JSON (or fails), the timing arithmetic of
:func:`peer_worker.measure` on a fake generator, and vLLM's server command. No real peer."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from pagedkv.bench.peers import worker as peer_worker
from pagedkv.bench.peers import venv as peers_venv
from pagedkv.bench.serve import peer as serve_peer
from pagedkv.errors import ConfigError


def test_measure_differences_out_the_prefill():
    """A generator that costs 2 ms per prompt token and 10 ms per output token after the
    first: prefill 512 = 1.024 s (plus the first token), decode = 100 tok/s."""
    clock = {"t": 0.0}

    def fake_perf():
        return clock["t"]

    def gen(prompt, k):
        clock["t"] += 0.002 * len(prompt) + 0.010 * (k - 1)
        return list(range(k))

    real = peer_worker.time.perf_counter
    peer_worker.time.perf_counter = fake_perf
    try:
        r = peer_worker.measure(gen, {"vocab_size": 1000, "prefill_tokens": 512, "decode_prompt": 32,
                                      "decode_tokens": 64, "repeats": 3})
    finally:
        peer_worker.time.perf_counter = real
    assert r["prefill_s"] == pytest.approx(1.024)
    assert r["prefill_tokens_per_s"] == pytest.approx(500.0)
    assert r["decode_tokens_per_s"] == pytest.approx(100.0)
    assert r["tpot_s"] == pytest.approx(0.010)
    assert r["output"] == list(range(64)) and len(r["prefill_runs_s"]) == 3


def test_measure_refuses_a_short_output():
    with pytest.raises(RuntimeError, match="asked for 2 tokens, got 1"):
        peer_worker.measure(lambda p, k: [0], {"vocab_size": 1000, "prefill_tokens": 8, "decode_prompt": 4,
                                                "decode_tokens": 4, "repeats": 1})


def test_prompts_are_the_same_for_every_system():
    a = peer_worker.prompt_ids(512, 49152, 1000)
    assert a == peer_worker.prompt_ids(512, 49152, 1000) and len(a) == 512
    assert min(a) >= 100 and max(a) < 49152 and a != peer_worker.prompt_ids(512, 49152, 1001)


def _fake_venv(root, name, script):
    py = root / "venvs" / name / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + script)
    py.chmod(0o755)
    peers_venv.model_dir(name, root).mkdir(parents=True)
    return py


def test_run_venv_peer_reads_the_last_json_line(tmp_path):
    result = {"system": "vllm", "version": "0.32.0", "decode_tokens_per_s": 41.5, "prefill_tokens_per_s": 900.0}
    _fake_venv(tmp_path, "vllm", f"echo 'INFO starting {{not json'\necho '{json.dumps(result)}'\n"
                                 "echo 'INFO shutting down'\n")
    row = peers_venv.run_venv_peer("vllm", peers_venv.b1_prefill_spec(2, 49152, tiny=True), root=tmp_path)
    assert row["status"] == "ok" and row["decode_tokens_per_s"] == 41.5 and row["version"] == "0.32.0"
    assert row["weights"].startswith("bf16") and "not same bytes" in row["weights"]
    # beside pagedkv at bf16 the same row is the same bytes
    row = peers_venv.run_venv_peer("vllm", peers_venv.b1_prefill_spec(2, 49152, tiny=True), root=tmp_path,
                                   pagedkv_weights="bf16")
    assert row["weights"] == "bf16 (vLLM-CPU's default, from the fp32 export): the same bytes as pagedkv's bf16"


def test_weight_class_names_what_each_side_ran():
    """The weights column follows pagedkv's format in the run: int4 names the Q4_1 codes, bf16
    says the values vLLM gets too, another format is its name; a peer's label is its own
    except vLLM's beside pagedkv bf16 (same bytes)."""
    wc = peers_venv.weight_class
    assert wc("pagedkv", "int4").startswith("int4: the GGUF's Q4_1 codes as stored")
    assert wc("pagedkv", "bf16").startswith("bf16: the GGUF's values rounded to bf16")
    assert wc("pagedkv", "fp32") == "fp32" and wc("pagedkv", "gguf") == "gguf"
    assert "not same bytes" in wc("vllm", "int4") and "not same bytes" in wc("vllm", "fp32")
    assert "the same bytes as pagedkv's bf16" in wc("vllm", "bf16")
    assert wc("openvino", "bf16") == wc("openvino", "int4") == peers_venv.WEIGHT_CLASS["openvino"]


def test_openvino_fp16_runs_in_openvinos_venv_on_the_fp16_ir(tmp_path):
    """OpenVINO's best default: the openvino venv, the fp16 IR directory, its own weights label;
    the worker gets that directory as its model and the system name picks OpenVINO's runner."""
    assert peers_venv.venv_python("openvino-fp16", tmp_path) == tmp_path / "venvs/openvino/bin/python"
    assert peers_venv.model_dir("openvino-fp16", tmp_path) == tmp_path / "ov/smollm2-135m-instruct-fp16"
    assert peers_venv.model_dir("openvino", tmp_path) == tmp_path / "ov/smollm2-135m-instruct-int4"
    assert peer_worker.RUNNERS["openvino-fp16"] is peer_worker.RUNNERS["openvino"]
    # the fake python prints the SPEC file it was given (args: -I worker.py SPEC): the system
    # and model the worker would see
    _fake_venv(tmp_path, "openvino", 'cat "$3"; echo\n')
    peers_venv.model_dir("openvino-fp16", tmp_path).mkdir(parents=True)
    row = peers_venv.run_venv_peer("openvino-fp16", {"threads": 2}, root=tmp_path)
    assert row["status"] == "ok" and row["system"] == "openvino-fp16", row
    assert row["model"] == str(tmp_path / "ov/smollm2-135m-instruct-fp16")
    assert row["weights"].startswith("fp16 IR") and "best default" in row["weights"]


def test_run_venv_peer_reports_failures(tmp_path):
    assert peers_venv.run_venv_peer("openvino", {"threads": 2}, root=tmp_path)["status"] == "not installed"
    _fake_venv(tmp_path, "openvino", "echo 'RuntimeError: Exception from src/inference: boom' >&2\nexit 3\n")
    row = peers_venv.run_venv_peer("openvino", {"threads": 2}, root=tmp_path)
    assert row["status"] == "failed" and row["reason"] == "exit 3: RuntimeError: Exception from src/inference: boom"


def test_a_section_from_before_rounds_renders_as_it_was():
    rows = [{"name": "pagedkv", "status": "ok", "decode_tokens_per_s": 60.0, "prefill_tokens_per_s": 1500.0,
             "weights": "int4", "tpot_s": 1 / 60, "prefill_s": 512 / 1500},
            {"name": "vllm", "status": "ok", "decode_tokens_per_s": 40.0, "prefill_tokens_per_s": 3000.0,
             "weights": "bf16", "version": "0.32.0", "tpot_s": 0.025, "prefill_s": 512 / 3000},
            {"name": "openvino", "status": "failed", "reason": "exit 1: no IR"}]
    q = [{"peer": "vllm", "decode_ratio": 1.5, "prefill_ratio": 0.5}]  # as such a result file stores them
    md = peers_venv.render_b1_prefill({"method": "m", "rows": rows, "ratios": q})
    assert "| vllm | 0.32.0 | bf16 | 40.0 | 25.00 | 3000 | 0.171 | nan / nan |" in md
    assert "| openvino | | failed: exit 1: no IR | | | | | |" in md
    assert "pagedkv / vllm: batch-1 decode 1.50x, prefill 0.50x" in md


def test_worker_command_and_env(tmp_path):
    cmd = peers_venv.worker_command("vllm", "/s.json", tmp_path)
    assert cmd == [str(tmp_path / "venvs/vllm/bin/python"), "-I", peer_worker.__file__, "/s.json"]
    env = peers_venv.peer_env("vllm", 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and "PYTHONPATH" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in peers_venv.peer_env("openvino", 2)


def test_vllm_server_command():
    cmd = peers_venv.vllm_server_command(8123, 2, 32, python="/v/bin/python", model="/m")
    assert cmd[:7] == ["env", "-u", "PYTHONPATH", "OMP_NUM_THREADS=2", "VLLM_CPU_KVCACHE_SPACE=1",
                       "VLLM_CPU_OMP_THREADS_BIND=0-1", "HF_HUB_OFFLINE=1"]
    assert cmd[7:11] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert "--no-enable-prefix-caching" in cmd and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32" and cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_serve_peer_openvino_says_why_not(monkeypatch):
    p = argparse.ArgumentParser()
    serve_peer.add_arguments(p)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(["--peer", "openvino"])
    with pytest.raises(ConfigError, match="no HTTP server"):
        serve_peer.run_serving_peer(args)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "/nonexistent-pagedkv")
    with pytest.raises(ConfigError, match="vLLM-CPU is not installed"):
        serve_peer.run_serving_peer(p.parse_args(["--peer", "vllm"]))


def test_ratios_name_the_peer():
    runs = [{"server": "pagedkv", "concurrency": 4, "output_tokens_per_s": 120.0, "itl_s": {"p50": 0.02},
             "ttft_s": {"p50": 0.2}},
            {"server": "vllm", "concurrency": 4, "output_tokens_per_s": 60.0, "itl_s": {"p50": 0.04},
             "ttft_s": {"p50": 0.1}}]
    (r,) = serve_peer.ratios(runs, [4], "vllm")
    assert r["output_tok_s_ratio"] == 2.0 and r["itl_p50_ratio"] == 0.5 and r["ttft_p50_ratio"] == 2.0
    assert serve_peer.ratios(runs, [4])[0] == {"concurrency": 4, "missing": True}  # llama-server absent


def test_worker_runs_without_pagedkv(tmp_path):
    """The worker file imports under ``-I`` with no pagedkv on the path (as in a peer's venv)
    and rejects an unknown system with a KeyError."""
    import subprocess

    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"system": "nope"}))
    r = subprocess.run([sys.executable, "-I", peer_worker.__file__, str(spec)], capture_output=True, text=True)
    assert r.returncode == 1 and "KeyError: 'nope'" in r.stderr


def test_rounds_interleave_keep_every_run_and_pair_the_ratios_by_round(monkeypatch, tmp_path):
    """Three rounds: pagedkv and vLLM alternate (pagedkv first in rounds 1 and 3), OpenVINO
    (not installed) is asked once; medians and quartiles per system, ratios per round."""
    dec = {"pagedkv": iter([60.0, 90.0, 66.0]), "vllm": iter([40.0, 45.0, 30.0])}
    calls = []

    def fake_ours(loaded, spec, kw):
        calls.append("pagedkv")
        return {"name": "pagedkv", "status": "ok", "weights": "bf16", "decode_tokens_per_s": next(dec["pagedkv"]),
                "prefill_tokens_per_s": 1000.0, "tpot_s": 0.02}

    def fake_peer(name, spec, pagedkv_weights):
        calls.append(name)
        if name == "openvino":
            return {"name": name, "status": "not installed", "reason": "no venv"}
        return {"name": name, "status": "ok", "weights": "bf16", "version": "0.32.0",
                "decode_tokens_per_s": next(dec[name]), "prefill_tokens_per_s": 2000.0, "tpot_s": 0.025}

    monkeypatch.setattr(peers_venv, "measure_pagedkv", fake_ours)
    monkeypatch.setattr(peers_venv, "run_venv_peer", fake_peer)
    sec = peers_venv.run_b1_prefill({"vllm", "openvino"}, object(), {}, 2, 1000, log=lambda *a: None, rounds=3)
    assert calls == ["pagedkv", "vllm", "openvino", "vllm", "pagedkv", "pagedkv", "vllm"]
    assert [(r["round"], r["name"]) for r in sec["rows"]] == [
        (1, "pagedkv"), (1, "vllm"), (1, "openvino"), (2, "openvino"), (2, "vllm"), (2, "pagedkv"),
        (3, "pagedkv"), (3, "vllm"), (3, "openvino")]
    assert all(r["load_1m_start"] is not None and r["wall_s"] >= 0 for r in sec["rows"] if r["name"] != "openvino")
    assert [r["load_1m_start"] for r in sec["rows"] if r["name"] == "openvino"][1:] == [None, None]  # not run again
    ours, vllm, ov = sec["systems"]
    assert (ours["name"], ours["ok"], ours["runs"]) == ("pagedkv", 3, 3) and (ov["ok"], ov["runs"]) == (0, 3)
    assert ours["decode_tokens_per_s"]["values"] == [60.0, 90.0, 66.0] and ours["decode_tokens_per_s"]["median"] == 66.0
    assert (ours["decode_tokens_per_s"]["q1"], ours["decode_tokens_per_s"]["q3"]) == (63.0, 78.0)
    assert vllm["decode_tokens_per_s"]["median"] == 40.0 and ov["decode_tokens_per_s"] is None
    (q,) = sec["ratios"]  # round by round: 60/40, 90/45, 66/30
    assert q["peer"] == "vllm" and q["decode_tokens_per_s"]["values"] == [1.5, 2.0, 2.2]
    assert q["decode_tokens_per_s"]["median"] == 2.0 and q["prefill_tokens_per_s"]["median"] == 0.5
    md = peers_venv.render_b1_prefill(sec)
    assert "| pagedkv |  | bf16 | 3 of 3 | 66.0 [63.0-78.0] | 1000 [1000-1000] |" in md
    assert "| openvino | | not installed: no venv | 0 of 3 | | |" in md
    assert "pagedkv / vllm: batch-1 decode 2.00x [1.75-2.10], prefill 0.50x [0.50-0.50]" in md
    assert "| 2 | vllm | ok | 45.0 | 25.00 | 2000 |" in md and "| 3 | openvino | not installed |  |  |  |" in md
    data = {"config": {"model_id": "m", "threads": 2}, "batch1_prefill": sec}
    peers_venv.plot_b1_prefill(data, tmp_path / "b1.png")
    assert (tmp_path / "b1.png").stat().st_size > 1000
    with pytest.raises(ValueError, match=">= 1"):
        peers_venv.run_b1_prefill({"vllm"}, object(), {}, 2, 1000, log=lambda *a: None, rounds=0)


def test_a_source_change_stops_the_rounds_and_keeps_what_finished(monkeypatch):
    """pagedkv's sources are checked before each of its runs: a change after round 1 stops the
    rounds before round 2's pagedkv run; round 1 and round 2's vLLM run stay, marked partial."""
    from pagedkv.bench import protocol

    digests = iter(["a", "b"])  # before round 1's pagedkv run, before round 2's
    monkeypatch.setattr(protocol, "source_digest", lambda package=None: next(digests))
    monkeypatch.setattr(peers_venv, "measure_pagedkv", lambda loaded, spec, kw: {
        "name": "pagedkv", "status": "ok", "weights": "bf16", "decode_tokens_per_s": 60.0, "prefill_tokens_per_s": 900.0})
    monkeypatch.setattr(peers_venv, "run_venv_peer", lambda name, spec, pagedkv_weights: {
        "name": name, "status": "ok", "weights": "bf16", "decode_tokens_per_s": 30.0, "prefill_tokens_per_s": 1000.0})
    sec = peers_venv.run_b1_prefill({"vllm"}, object(), {}, 2, 1000, log=lambda *a: None, rounds=3, digest="a")
    assert [(r["round"], r["name"]) for r in sec["rows"]] == [(1, "pagedkv"), (1, "vllm"), (2, "vllm")]
    assert "changed" in sec["partial"] and sec["ratios"][0]["decode_tokens_per_s"]["values"] == [2.0]
    assert "**Partial**: " in peers_venv.render_b1_prefill(sec)
