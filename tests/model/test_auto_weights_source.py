"""``weights="auto"`` never changes a model's numbers on its own: a GGUF keeps its stored blocks
(``gguf``), the Q4_1 SmolLM2 and the Q4_K_M Gemma-3 (Q5_0 / Q4_K / Q6_K / Q8_0 mix) alike;
int8/int4 requantisation happens only when asked."""

from __future__ import annotations

from pagedkv.gguf_header import read_gguf_header
from pagedkv.model.gguf_native import linear_types, supported


def test_both_bundled_files_are_taken_as_stored(bundled_gguf, gemma3_gguf):
    assert linear_types(read_gguf_header(bundled_gguf)) == {"Q4_1": 210, "Q8_0": 1}
    assert linear_types(read_gguf_header(gemma3_gguf)) == {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}
    assert supported(read_gguf_header(bundled_gguf)) is None
    assert supported(read_gguf_header(gemma3_gguf)) is None


def test_an_engine_on_gemma3_with_auto_weights_runs_its_stored_blocks(gemma3_gguf):
    from pagedkv import LLM

    llm = LLM(model="gemma-3-270m", num_blocks=16)
    loaded = llm.engine.loaded
    assert loaded.weights == "gguf" and "Q4_K x27" in loaded.weights_reason
    assert loaded.model.layers[0].qkv_proj.types == ("Q5_0", "Q5_0", "Q8_0")  # attn_v is Q8_0: a concat weight
    assert loaded.report.weight_bytes < 1.05 * gemma3_gguf.stat().st_size
