"""`pagedkv plan` (pagedkv.examples.capacity_plan): blocks, bytes and concurrency for a KV budget."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.common import default_workload
from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.examples.capacity_plan import load_workload, plan


# ---------------------------------------------------------------- plan
def test_plan_llama3_8b_20gib():
    p = plan("llama-3-8b", "20GiB", block_size=16, max_model_len=8192)
    assert p["bytes_per_token"] == 131_072
    assert p["block_bytes"] == 2_097_152
    assert p["num_blocks"] == 10_240
    assert p["tokens_held"] == 163_840
    assert p["max_concurrency_at_max_model_len"] == 20


def test_plan_bundled_model_default():
    p = plan(None, "1GiB", block_size=16, max_model_len=2048)
    assert p["bytes_per_token"] == 46_080  # fp32 cache of SmolLM2-135M
    assert p["num_blocks"] == 1_073_741_824 // (16 * 46_080) == 1456
    assert p["max_concurrency_at_max_model_len"] == 1456 // 128 == 11


def test_plan_tp_and_dtype():
    p = plan("llama-3-8b", "1GiB", dtype="fp8", block_size=16, tp_size=16, max_model_len=4096)
    assert p["spec"]["kv_heads_per_rank"] == 1 and p["spec"]["replication"] == 2
    # 1 byte/element + one bf16 scale per head vector (K and V)
    assert p["bytes_per_token"] == 2 * 32 * (128 + 2) == 8320
    assert p["bytes_per_token_total"] == 16 * 8320
    assert p["num_blocks"] == 1_073_741_824 // (16 * 8320) == 8065


def test_plan_with_workload(tmp_path):
    csv = tmp_path / "w.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "t0,10,6\nt1,30,3\nt2,100,28\nt3,5000,10\n")
    assert load_workload(csv).tolist() == [16, 33, 128, 5010]
    p = plan("llama-3-8b", 2_097_152 * 100, block_size=16, max_model_len=256, workload=csv)
    w = p["workload"]
    # Lengths clipped to 256: 16, 33, 128, 256 -> blocks 1, 3, 8, 16 (mean 7).
    assert w["clipped_to_max_model_len"] == 1
    assert w["mean_tokens"] == (16 + 33 + 128 + 256) / 4 == 108.25
    assert w["paged"]["mean_blocks_per_request"] == 7.0
    assert w["paged"]["concurrency"] == 100 // 7 == 14
    assert w["paged"]["slot_utilisation"] == pytest.approx(108.25 / 112)
    assert w["contiguous"] == {"blocks_per_request": 16, "concurrency": 6,
                               "slot_utilisation": pytest.approx(108.25 / 256)}


def test_plan_with_the_azure_trace():
    path = default_workload()
    if not path.is_file():
        pytest.skip("shared workload trace not present")
    p = plan("llama-3-8b", "20GiB", block_size=16, max_model_len=8192, workload=path)
    w = p["workload"]
    assert w["requests"] == 19_366
    assert w["paged"]["concurrency"] > 5 * w["contiguous"]["concurrency"] == 100


def test_plan_command(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--kv-budget", "20GiB", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["bytes_per_token"] == 70_272 and p["num_blocks"] == 21_474_836_480 // (16 * 70_272)
    assert main(["plan", "--model", "llama-2-7b", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "524,288 per rank" in out and "max concurrency  10 requests" in out
    assert main(["plan", "--model", "llama-3-8b", "--kv-budget", "1MiB"]) == 2
    assert "kv_budget" in capsys.readouterr().err
    assert main(["plan", "--model", "nonexistent-model"]) == 2
    assert "unknown config name" in capsys.readouterr().err


def test_plan_bad_workload(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="workload"):
        plan("llama-3-8b", "20GiB", workload=bad)


def test_plan_sizes_gemma2_per_layer_group(tmp_path, capsys):
    p = plan(model="gemma-2-9b", kv_budget="40GiB", dtype="bf16", max_model_len=32768)
    lg = p["layer_groups"]
    assert [(g["window"], g["num_layers"], g["blocks_per_request"]) for g in lg["groups"]] == [
        (None, 21, 2048), (4096, 21, 256)]
    assert p["block_bytes"] == lg["hybrid"]["block_bytes"] == 21 * 16 * 2 * 8 * 256 * 2 == 2_752_512
    assert lg["all_full"]["block_bytes"] == 2 * 2_752_512
    assert (lg["hybrid"]["blocks_per_request"], lg["all_full"]["blocks_per_request"]) == (2304, 2048)
    assert lg["hybrid"]["num_blocks"] == p["num_blocks"] == 40 * 2**30 // 2_752_512 == 15603
    assert (lg["hybrid"]["max_concurrency"], lg["all_full"]["max_concurrency"]) == (6, 3)
    assert lg["bytes_per_request_ratio"] == 0.5625 and lg["page_waste"] == 0.0
    assert plan(model="llama-3-8b").get("layer_groups") is None
    w = tmp_path / "w.csv"
    w.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5000,100\n1,100,28\n")
    pw = plan(model="gemma-2-9b", dtype="bf16", max_model_len=32768, workload=str(w))["workload"]["paged"]
    # 5100 tokens: 319 full + (319 - (5100 - 4096) // 16 = 257) window blocks; 128 tokens: 8 + 8
    assert pw["mean_blocks_per_request"] == (319 + 257 + 16) / 2
    assert main(["plan", "--model", "gemma-2-9b", "--dtype", "bf16", "--max-model-len", "32768"]) == 0
    assert "0.5625 of the all-full bytes per request" in capsys.readouterr().out
