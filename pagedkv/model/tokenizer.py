"""The tokenizer of a model: a transformers ``AutoTokenizer`` from a directory (HF model or
weight-cache entry) or built from a GGUF file's vocabulary (seconds; the weight cache keeps
the result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError, InvalidRequestError


def load_tokenizer(directory: str | Path, gguf_file: str | None = None) -> Any:
    """A transformers tokenizer (with the chat template when the source has one) saved in
    ``directory``, or built from ``directory/gguf_file``. Raises ``ConfigError``."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tokenizer: cannot load from {str(directory)!r} ({e})") from None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt with the model's own special-token rule: a GGUF's
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (or an HF directory's
    ``tokenizer_config.json``), as transformers applies them and as vLLM and llama.cpp
    tokenize a completion prompt. SmolLM2 adds nothing; Gemma-3 starts every prompt with
    ``<bos>`` (id 2), without which its greedy completions degenerate."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])



def read_chat_template(template: str) -> str:
    """A chat template given as Jinja text, or as the path of a file holding it -> the text.
    Raises ``ConfigError`` for an unreadable file or an empty template."""
    text = template
    if "{" not in template:  # not Jinja: a path
        try:
            text = Path(template).expanduser().read_text()
        except OSError as e:
            raise ConfigError(f"chat_template: cannot read {template!r} ({e.strerror})") from None
    if not text.strip():
        raise ConfigError("chat_template: empty template")
    return text


def apply_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               chat_template: str | None = None, model_id: str = "the model") -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) through ``chat_template``
    (Jinja text) or the tokenizer's own template. Raises ``InvalidRequestError`` for malformed
    messages or when there is no template (a base model: send plain completions instead)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError(
            f"model {model_id} has no chat template (a base model): send a plain completion "
            "(/v1/completions, `pagedkv generate --raw`) or give one with the chat_template option "
            "(`--chat-template FILE`)")
    kw = {"chat_template": chat_template} if chat_template else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
