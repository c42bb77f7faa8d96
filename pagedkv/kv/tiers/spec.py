"""What ``kv_offload`` says: the tiers behind the block pool (``host:4GiB``,
``disk:PATH:50GiB``), and the identity a disk store is written for.

Tiers are given fastest first: ``host`` (a second pool in host memory), then ``disk`` (an
LMDB store that survives restarts); either or both, each at most once, host before disk.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from pagedkv.errors import ConfigError
from pagedkv.kv.spec import parse_size

#: the hash chain every pagedkv block key uses (``prefix_cache.sha256_block_hash`` over
#: int64-LE tokens and typed extra keys); a store written under another scheme is not served
HASH_SCHEME = "sha256(parent|int64le tokens|typed extra keys) v1"

TIER_KINDS = ("host", "disk")


@dataclass(frozen=True)
class TierSpec:
    """One tier: ``kind`` (``host`` | ``disk``), ``capacity_bytes`` (its size limit, bytes)
    and, for ``disk``, the store's directory ``path``."""

    kind: str
    capacity_bytes: int
    path: str | None = None

    @property
    def name(self) -> str:
        return self.kind

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}:{self.capacity_bytes}" if self.path else f"{self.kind}:{self.capacity_bytes}"


def parse_tier_spec(text: str) -> TierSpec:
    """``"host:4GiB"`` or ``"disk:PATH:50GiB"`` (PATH may contain ``:``; the size is after the
    last one). Raises ``ConfigError`` naming the entry."""
    if not isinstance(text, str):
        raise ConfigError(f"kv_offload: each tier is a string like 'host:4GiB', got {text!r}")
    kind, _, rest = text.partition(":")
    if kind not in TIER_KINDS:
        raise ConfigError(f"kv_offload: {text!r}: the tier kind must be one of {TIER_KINDS} "
                          "('host:4GiB', 'disk:PATH:50GiB')")
    path = None
    if kind == "disk":
        path, _, rest = rest.rpartition(":")
        if not path:
            raise ConfigError(f"kv_offload: {text!r}: a disk tier is 'disk:PATH:SIZE'")
    elif ":" in rest:
        raise ConfigError(f"kv_offload: {text!r}: a host tier is 'host:SIZE'")
    try:
        size = parse_size(rest)
    except ConfigError:
        raise ConfigError(f"kv_offload: {text!r}: cannot parse the size {rest!r} (e.g. 4GiB, 512MiB)") from None
    if size <= 0:
        raise ConfigError(f"kv_offload: {text!r}: the size must be > 0")
    return TierSpec(kind, size, path)


def parse_tier_specs(specs: str | Sequence[str] | None) -> list[TierSpec]:
    """The tiers of ``kv_offload`` (a list of strings, or one string), fastest first.
    Raises ``ConfigError`` for a malformed entry, a repeated kind or disk before host."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"kv_offload: expected a list like ['host:4GiB', 'disk:PATH:50GiB'], got {specs!r}")
    tiers = [parse_tier_spec(s) for s in specs]
    kinds = [t.kind for t in tiers]
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"kv_offload: each tier kind at most once, got {kinds}")
    if kinds == ["disk", "host"]:
        raise ConfigError("kv_offload: tiers go fastest first: host before disk")
    return tiers


@dataclass(frozen=True)
class StoreIdentity:
    """Whose K/V a persistent store holds: a block written under one identity is never
    served under another (another model, revision, checkpoint bytes, weight format, KV dtype
    or layout, block size, layer count, tensor-parallel size, hash scheme or payload format).

    ``weights_digest``: ``pagedkv.model.weight_cache.model_digest`` of the checkpoint (GGUF
    file, or an HF directory's weight, config and tokenizer files): two checkpoints with the
    same name, revision and shapes but other weights differ here. A store written before this
    field existed has none, so it is refused too (its blocks cannot be attributed)."""

    model_id: str
    revision: str
    weights: str  # the linear layers' format (fp32, bf16, int8, int4): it changes the K/V
    kv_dtype: str
    block_size: int
    num_layers: int
    block_format: str  # the backend layout and storage tensors of one block, e.g. "nhd f32[16,3,64]x2/layer"
    block_nbytes: int  # bytes of one block's payload (every layer)
    hash_scheme: str = HASH_SCHEME
    weights_digest: str = ""  # hex sha256 of the checkpoint's bytes (weights, config, tokenizer)
    tp_size: int = 1  # tensor-parallel ranks whose heads a block holds

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes) -> dict[str, Any]:
        """The stored header as a dict (``{}`` if unreadable)."""
        try:
            out = json.loads(bytes(raw).decode())
        except (ValueError, UnicodeDecodeError):
            return {}
        return out if isinstance(out, dict) else {}

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """``field: stored != ours`` for every field that differs (empty when equal)."""
        mine = asdict(self)
        keys = sorted(set(mine) | set(stored))
        return [f"{k}: {stored.get(k)!r} != {mine.get(k)!r}" for k in keys if stored.get(k) != mine.get(k)]
