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


def test_auto_takes_a_bf16_gguf_s_own_values(tmp_path):
    """A file whose weight matrices are all BF16 (many published ``*-BF16.gguf``): ``auto`` keeps
    its values, as bf16 where the CPU multiplies bf16 natively (AVX512-BF16 / AMX), else fp32;
    either way every weight equals the stored one (bf16 values are exact in both), and the
    reason says which."""
    import torch

    from pagedkv import LLM, SamplingParams
    from pagedkv.model import loader
    from pagedkv.model.quant import cpu_features
    from tests.model.test_gguf_types import stored_values, write_tiny_gguf

    path = tmp_path / "tiny-BF16.gguf"
    write_tiny_gguf(path, "BF16")
    assert linear_types(read_gguf_header(path)) == {"BF16": 15}
    native = cpu_features().bf16_fast
    fmt, why = loader.auto_weights(path, "int4", "auto: int4 here")
    if native:
        assert (fmt, why) == ("bf16", "auto: the file's BF16 values as stored, multiplied in bf16 natively on this CPU")
    else:
        assert fmt == "fp32" and why.startswith("auto: the file's values in fp32 (weight matrices stored as BF16")
    llm = LLM(model=str(path), num_blocks=16, block_size=16)
    loaded = llm.engine.loaded
    assert loaded.weights == fmt
    layer = loaded.model.layers[1]
    want = stored_values(path)["blk.1.ffn_down.weight"][1]
    assert layer.down_proj.weight.dtype == (torch.bfloat16 if native else torch.float32)
    assert torch.equal(layer.down_proj.weight.float(), want)
    (o,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 4


def test_auto_keeps_an_f16_gguf_as_stored_and_gives_the_fp32_tokens(tmp_path):
    """A ``*-F16.gguf``: ``auto`` runs its half values as stored (2 bytes per weight held, not 4),
    in the native one-call step, with float32 activations: the greedy tokens of the file's fp32
    values."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.model import gguf_native, loader
    from tests.model.test_gguf_types import PROMPTS, write_tiny_gguf

    path = tmp_path / "tiny-F16.gguf"
    write_tiny_gguf(path, "F16")
    header = read_gguf_header(path)
    assert linear_types(header) == {"F16": 15} and supported(header) is None
    fmt, why = loader.auto_weights(path, "int4", "auto: int4 here")
    assert fmt == "gguf" and "F16 x15" in why
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=str(path), num_blocks=16, block_size=16)
    lm = llm.engine.loaded
    assert lm.weights == "gguf" and lm.model.step_route == "native"
    held = sum(m.packed.nbytes for m in gguf_native.iter_linears(lm.model))
    stored = sum(gguf_native._nbytes(t) for t in header.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    assert stored <= held <= stored + 4 * 2 * 256  # the file's bytes (+ the head's 4 zero pad rows)
    # what the memory check counts before loading: the stored F16 bytes (not 4 per weight) + F32 norms
    assert gguf_native.weight_bytes(header, lm.config) == sum(
        gguf_native._nbytes(t) for t in header.tensors if t.name != "token_embd.weight")
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    fp32 = LLM(model=str(path), weights="fp32", num_blocks=16, block_size=16)
    assert ours == [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, sp, use_tqdm=False)]


def test_f16_rows_the_kernel_cannot_take_keep_the_fp32_route(tmp_path, monkeypatch):
    """The file does not store F16 in blocks: ``supported`` checks the kernels' 32 values per
    row itself, so such a file is loaded in fp32 under ``auto`` rather than failing in ``gguf``."""
    from pagedkv.model import loader
    from pagedkv.ops import qmm
    from tests.model.test_gguf_types import write_tiny_gguf

    path = tmp_path / "tiny-F16.gguf"
    write_tiny_gguf(path, "F16")
    monkeypatch.setitem(qmm.GGUF_BLOCKS, "F16", (1, 512, 1024))  # as if rows of 256 were not whole
    why = supported(read_gguf_header(path))
    assert why is not None and "has rows of 256 values, not a multiple of the kernels' 512" in why
    assert loader.auto_weights(path, "int4", "x")[0] == "fp32"
