"""``weights="auto"`` on a CPU whose fastest format is int4 keeps int4 only where the GGUF stores
Q4_0/Q4_1 codes: Gemma-3-270M Q4_K_M requantised to int4 measured +126% perplexity (bound 6%),
int8 +1.5% (docs/benchmarks/weights_quality_gemma-3-270m.md)."""

from __future__ import annotations

from pagedkv.gguf_header import read_gguf_header
from pagedkv.model.loader import auto_int4_source
from pagedkv.model.quantize import has_q4_linears


def test_auto_int4_is_kept_for_q4_codes_and_becomes_int8_for_k_quants(bundled_gguf, gemma3_gguf):
    assert has_q4_linears(read_gguf_header(bundled_gguf)) is True  # SmolLM2: 210 Q4_1 layer matrices
    assert has_q4_linears(read_gguf_header(gemma3_gguf)) is False  # Q5_0 / Q4_K / Q6_K / Q8_0
    assert auto_int4_source(bundled_gguf, "fast here") == ("int4", "fast here")
    fmt, why = auto_int4_source("gemma-3-270m", "fast here")
    assert fmt == "int8" and why.startswith("fast here; int8, not int4")


def test_an_engine_on_gemma3_with_auto_weights_runs_int8(gemma3_gguf):
    from pagedkv import LLM
    from pagedkv.model.quant import resolve_weights

    llm = LLM(model="gemma-3-270m", num_blocks=16)
    expected = "int8" if resolve_weights("auto")[0] in ("int4", "int8") else resolve_weights("auto")[0]
    assert llm.engine.loaded.weights == expected
