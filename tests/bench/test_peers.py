"""``pagedkv bench peers``: its arithmetic on hand-made timings and a tiny end-to-end run."""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.bench.peers import run as peers
from pagedkv.bench.peers import systems as peers_systems
from pagedkv.bench.variants import read_variant, read_variants
from pagedkv.bench.workload import BenchRequest


def test_result_row_arithmetic_exact():
    reqs = [BenchRequest([1, 2, 3], 3), BenchRequest([4, 5], 5)]
    # request 0: first token at 1 s, its 3rd (last) at 2 s; request 1: first at 1 s, 5th at 3 s.
    # request 1 produced 6 tokens (a static batch runs past it): only 5 count.
    row = peers_systems.result_row("x", reqs, elapsed=4.0, cpu_s=2.0, first=[1.0, 1.0], finish=[2.0, 3.0], n_out=[3, 6])
    assert row["output_tokens"] == 8 and row["output_tokens_per_s"] == 2.0
    assert row["output_tokens_per_cpu_s"] == 4.0
    assert row["requests_per_s"] == 0.5 and row["completed"] == 2
    assert row["ttft_s"]["p50"] == 1.0
    assert row["tpot_s"]["p50"] == pytest.approx(0.5)  # both (2-1)/2 and (3-1)/4
    # decode: 2 tokens after the first in 1 s + 4 in 2 s = 6 tokens in 3 s
    assert (row["decode_tokens"], row["decode_s"], row["decode_tokens_per_s"]) == (6, 3.0, 2.0)
    agree = peers.agreement([[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9]])
    assert agree["identical_requests"] == 1 and agree["mean_common_prefix_fraction"] == pytest.approx(0.75)


def test_native_systems_run_on_their_own():
    from pagedkv.cli import build_parser
    from pagedkv.errors import ConfigError

    args = build_parser().parse_args(["bench", "peers", "--systems", "pagedkv,llama.cpp"])
    with pytest.raises(ConfigError, match="on their own"):
        peers.run(args)


@pytest.mark.slow
def test_bench_peers_tiny(loaded_model, hf_model, tmp_path):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "peers", "--tiny", "--out-dir", str(tmp_path)])
    attn = hf_model.config._attn_implementation
    assert peers.run(args, loaded=loaded_model, hf_model=hf_model) == 0
    assert hf_model.config._attn_implementation == attn  # the shared fixture is left as it was
    data = read_variant(tmp_path / "peers.json", "fp32")
    for key in ("benchmark", "config", "workload", "systems", "ratios", "goal", "machine"):
        assert key in data and data[key] not in (None, [], {}), key
    by = {r["name"]: r for r in data["systems"]}
    assert set(by) == {peers.PAGEDKV, peers.HF_GENERATE.format(bs=2), peers.HF_CB, peers.PAGEDKV_REPEAT}
    for name in (peers.PAGEDKV, peers.PAGEDKV_REPEAT, peers.HF_GENERATE.format(bs=2)):
        r = by[name]
        assert r["status"] == "ok", r
        assert r["completed"] == 4 and r["output_tokens"] == data["workload"]["output_tokens"]
        for k in ("output_tokens_per_s", "requests_per_s", "elapsed_s"):
            assert math.isfinite(r[k]) and r[k] > 0
        for k in ("ttft_s", "tpot_s"):
            assert all(math.isfinite(r[k][q]) and r[k][q] >= 0 for q in ("p50", "p90", "p99"))
    for name in (peers.HF_CB,):  # may fail or be absent, but never silently
        r = by[name]
        assert r["status"] in ("ok", "failed", "not installed")
        assert r["status"] == "ok" or r["reason"]
    for ratio in data["ratios"]:
        assert all(math.isfinite(ratio[k]) and ratio[k] > 0 for k in ("output_tok_s_ratio", "ttft_p50_ratio"))
    assert data["goal"]["ratio"] is not None and math.isfinite(data["goal"]["ratio"])
    # greedy fp32: pagedkv and transformers agree token for token on these tiny requests
    agree = data["greedy_agreement_with_pagedkv"][peers.HF_GENERATE.format(bs=2)]
    assert agree["requests"] == 4 and agree["identical_requests"] >= 3  # padding may flip a rare near-tie
    # the batch-1 comparison with llama.cpp is its own protocol now (--systems pagedkv-b1,llama.cpp,
    # tests/bench/test_peers_native.py): no one-at-a-time row or batch1 block here
    assert "batch1" not in data and "llama.cpp" not in by
    assert "## fp32\n\n### Peers" in (tmp_path / "peers.md").read_text()
    assert (tmp_path / "peers.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_peers_weights_int4(tmp_path):
    """--weights int4: pagedkv runs on the GGUF's Q4_1 codes (llama.cpp's weights) and the
    results are the variant int4 of peers.* with the format recorded."""
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "peers", "--tiny", "--weights", "int4", "--systems", "pagedkv",
                                      "--no-repeat", "--out-dir", str(tmp_path), "--no-plot"])
    assert peers.run(args) == 0
    data = read_variant(tmp_path / "peers.json", "int4")
    assert data["config"]["pagedkv_weights"] == "int4"
    assert data["config"]["command"].endswith("--systems pagedkv --weights int4 --no-repeat")
    (row,) = data["systems"]
    assert row["name"] == peers.PAGEDKV and row["status"] == "ok" and row["completed"] == 4
    assert "pagedkv weights int4" in (tmp_path / "peers.md").read_text()
    assert list(read_variants(tmp_path / "peers.json")) == ["int4"]  # never the fp32 variant


def test_bench_peers_weights_refused():
    from pagedkv.bench.common import load_fp32_model
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match="int3"):
        load_fp32_model(None, weights="int3")


def test_peer_model_bos_and_suffix():
    """A model whose tokenizer starts every prompt with BOS (Gemma-3) gets it as the first token
    of each synthetic prompt (same length); the default model's prompts are left as they are
    and its results keep their names."""
    from pathlib import Path

    gemma = peers_systems.PeerModel(path=Path("/m/gemma-3-270m-q4_k_m.gguf"), model_id="gemma-3-270m-q4_k_m",
                                    name="gemma-3-270m", default=False, file_type="Q4_K_M", vocab_size=262144,
                                    bos_token_id=2, adds_bos=True, has_chat_template=False, sliding_window=512)
    assert gemma.with_bos([7, 8, 9]) == [2, 8, 9] and gemma.with_bos([]) == []
    assert gemma.suffix == "_gemma-3-270m"
    cfg = gemma.as_config()
    assert (cfg["model_id"], cfg["model_file"], cfg["prompts_start_with_bos"]) == (
        "gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf", 2)
    smol = peers_systems.PeerModel(path=Path("/m/s.gguf"), model_id="s", name="smollm2-135m-instruct", default=True,
                                   file_type="Q4_1", vocab_size=49152, bos_token_id=1, adds_bos=False,
                                   has_chat_template=True)
    assert smol.with_bos([7, 8, 9]) == [7, 8, 9] and smol.suffix == ""
    assert smol.as_config()["prompts_start_with_bos"] is None


@pytest.mark.slow
def test_resolve_peer_model_default_by_path(bundled_gguf, tmp_path):
    """The bundled file named by its path is the default model; a copy of it under another
    name is not (its results get their own name); a directory is refused."""
    from pagedkv.errors import ConfigError

    m = peers_systems.resolve_peer_model(str(bundled_gguf))
    assert m.default and m.suffix == "" and m.file_type == "Q4_1" and not m.adds_bos and m.has_chat_template
    assert m.model_id == "SmolLM2-135M-Instruct-Q4_1" and m.vocab_size == 49152
    assert peers_systems.resolve_peer_model(None).path == bundled_gguf
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="directory"):
        peers_systems.resolve_peer_model(str(tmp_path / "d"))


@pytest.mark.slow
def test_bench_peers_tiny_on_gemma3(gemma3_gguf, tmp_path):
    """--model gemma-3-270m: pagedkv runs that GGUF (a base model, BOS-first prompts); the
    results record it and are the variant fp32_gemma-3-270m of peers.*, never the default model's."""
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "peers", "--tiny", "--model", "gemma-3-270m", "--systems",
                                      "pagedkv", "--no-repeat", "--out-dir", str(tmp_path), "--no-plot"])
    assert peers.run(args) == 0
    data = read_variant(tmp_path / "peers.json", "fp32_gemma-3-270m")
    c = data["config"]
    assert c["model"] == str(gemma3_gguf) and c["model_file"] == "gemma-3-270m-q4_k_m.gguf"
    assert c["model_id"] == "gemma-3-270m-q4_k_m" and c["model_is_default"] is False
    assert c["model_weights_as_stored"] == "Q4_K_M" and c["model_has_chat_template"] is False
    assert c["prompts_start_with_bos"] == 2 and "BOS (id 2)" in c["notes"]
    assert c["command"].startswith("pagedkv bench peers --model gemma-3-270m ")
    by = {r["name"]: r for r in data["systems"]}
    assert set(by) == {peers.PAGEDKV} and by[peers.PAGEDKV]["status"] == "ok" and by[peers.PAGEDKV]["completed"] == 4
    md = (tmp_path / "peers.md").read_text()
    assert "Model: gemma-3-270m-q4_k_m (`gemma-3-270m-q4_k_m.gguf`, Q4_K_M as stored)" in md
    assert list(read_variants(tmp_path / "peers.json")) == ["fp32_gemma-3-270m"]
