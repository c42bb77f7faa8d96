"""``pagedkv export-hf``: the Hugging Face directory written from the bundled GGUF gives
transformers the same model as the GGUF itself (logits, tokenizer, chat template)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model.export_hf import export_hf

PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def exported(bundled_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    info = export_hf(str(bundled_gguf), str(out), "float32")
    return out, info


def test_export_writes_a_hf_directory(exported, bundled_gguf):
    out, info = exported
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert name in info["files"], name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    assert info["parameters"] == 134515008  # SmolLM2-135M, embeddings tied
    assert info["source_gguf"] == str(bundled_gguf)


def test_same_logits_as_the_gguf(exported, hf_model, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    out, _ = exported
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    for text in PROMPTS:
        ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
        with torch.inference_mode():
            a = hf_model(ids).logits
            b = model(ids).logits
        assert a.shape == b.shape == (1, ids.shape[1], 49152)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert int(a[0, -1].argmax()) == int(b[0, -1].argmax())


def test_same_tokenizer_and_chat_template(exported, hf_tokenizer):
    from transformers import AutoTokenizer

    out, _ = exported
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in PROMPTS + ["héllo wörld 123 <|im_start|>"]:
        assert tok(text)["input_ids"] == hf_tokenizer(text)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert tok.chat_template == hf_tokenizer.chat_template and tok.chat_template
    a = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert a == hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert a.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == hf_tokenizer.eos_token


def test_bad_input(tmp_path, bundled_gguf):
    with pytest.raises(ConfigError, match="--dtype"):
        export_hf(str(bundled_gguf), str(tmp_path / "x"), "float16")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        export_hf(str(bundled_gguf), str(tmp_path / "f"), "float32")
