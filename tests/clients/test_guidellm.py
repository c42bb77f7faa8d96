"""guidellm runs a short synthetic benchmark against ``pagedkv serve`` with no errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import guidellm  # noqa: F401  (the [clients] extra; make test installs it)


def test_guidellm_synthetic_benchmark_without_errors(serve_url, hf_tokenizer, tmp_path):
    tok_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tok_dir)  # the GGUF's tokenizer, for guidellm's token counts
    report = tmp_path / "report.json"
    exe = shutil.which("guidellm", path=str(Path(sys.executable).parent)) or "guidellm"
    proc = subprocess.run(
        [exe, "run", "--backend", f"kind=openai_http,target={serve_url},model=smol",
         "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
         "--tokenizer", f"kind=huggingface_auto,model={tok_dir}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"]
    assert len(bench) == 1
    totals = bench[0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] >= 3, totals
    out_tokens = bench[0]["metrics"]["output_token_count"]["successful"]
    assert out_tokens["min"] == out_tokens["max"] == 8.0  # each request asked for 8 tokens
