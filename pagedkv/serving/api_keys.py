"""API keys and tenants (``pagedkv serve --api-keys FILE``): key -> tenant.

The tenant is a typed key of the prefix-cache identity, so two tenants never share a
cached block. Keys are kept as SHA-256 digests, so a lookup never compares secrets byte
by byte. The HTTP side (401 on a missing or unknown key) is the ``tenant`` dependency in
:mod:`pagedkv.serving.dependencies`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional


def load_api_keys(path: str) -> dict[str, str]:
    """Read an API-key file: a JSON object ``{"key": "tenant", ...}``, or text lines
    ``KEY TENANT`` (``#`` comments and blank lines ignored). Raises ``ValueError`` on a
    malformed file, an empty key, or a tenant name with a NUL character."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    keys: dict[str, str] = {}
    stripped = text.strip()
    if stripped.startswith("{"):
        data = json.loads(stripped)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: expected a JSON object of key -> tenant strings")
        keys = dict(data)
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT'")
            keys[parts[0]] = parts[1]
    for k, t in keys.items():
        if not k or not t or "\x00" in t:
            raise ValueError(f"{path}: empty key/tenant or NUL in tenant {t!r}")
    return keys


class ApiKeys:
    """key -> tenant, held as digests of the keys."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._tenants = {_digest(k): t for k, t in keys.items()}

    def tenant(self, key: str) -> Optional[str]:
        """The tenant of ``key``, None if the key is unknown."""
        return self._tenants.get(_digest(key))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()
