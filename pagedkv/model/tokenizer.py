"""The tokenizer of a model: a transformers ``AutoTokenizer`` from a directory (HF model or
weight-cache entry) or built from a GGUF file's vocabulary (seconds; the weight cache keeps
the result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError


def load_tokenizer(directory: str | Path, gguf_file: str | None = None) -> Any:
    """A transformers tokenizer (with the chat template when the source has one) saved in
    ``directory``, or built from ``directory/gguf_file``. Raises ``ConfigError``."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tokenizer: cannot load from {str(directory)!r} ({e})") from None
