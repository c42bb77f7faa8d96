"""The on-disk caches of GGUF models under ``cache_root()`` (``$PAGEDKV_CACHE_DIR``, default
``~/.cache/pagedkv``): the tokenizer of each file and each file's identity. No weights: every
weight format loads from the GGUF file itself, tensor by tensor (``pagedkv.model.gguf_native``,
``pagedkv.model.gguf_formats``), so a cached copy would only duplicate the file (earlier
versions kept a dequantised fp32 entry ``<16 hex>/`` and one per format ``<16 hex>-<format>/``;
they are no longer read and may be deleted).

* ``<first 16 hex of the GGUF's sha256>-tokenizer/``: the tokenizer built from the file's
  vocabulary (seconds to build, about one to read back)::

      tokenizer/          tokenizer.save_pretrained()
      model.safetensors   an empty state dict (the entry layout is shared)
      manifest.json       {"format": CACHE_FORMAT_VERSION, "weights": "tokenizer", "source_sha256",
                           "source_path", "created_unix", "files": {relative path: bytes}}

* ``ids/<key>.json``: a file's full sha256, hashed once (``file_identity``).

An entry is written to a temporary sibling directory and renamed into place, so a crash never
leaves a half-written entry; readers treat any damage (missing or truncated file, wrong
format or source) as "no entry" and the loader rebuilds it (``pagedkv.model.loader``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.model.tokenizer import load_tokenizer

CACHE_FORMAT_VERSION = 2  # 2: int4 scale/min rounded to float16 (Q4_1) by from_float
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_TOKENIZER_DIR = "tokenizer"
_MANIFEST_FILE = "manifest.json"
log = logging.getLogger(__name__)


def cache_root() -> Path:
    """The weight cache's root: ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


#: bytes of a file's start that key its stored identity, beside its path, size and mtime
_ID_HEAD_BYTES = 1 << 16


def file_identity(path: str | Path, root: Path | None = None) -> str:
    """The hex sha256 of a model file's bytes, computed once: stored under ``root/ids/`` (default
    ``cache_root()``) keyed by the file's real path, size, modification time (ns) and a hash of
    its first 64 KiB, so a later start reads it back instead of hashing gigabytes again; a file
    changed in place gets a new key. A store that cannot be written is skipped (the hash is
    still returned). Raises ``OSError`` when the file cannot be read."""
    p = Path(path)
    st = p.stat()
    with open(p, "rb") as f:
        head = hashlib.sha256(f.read(_ID_HEAD_BYTES)).hexdigest()
    key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{head}".encode()).hexdigest()[:32]
    store = (root if root is not None else cache_root()) / "ids" / f"{key}.json"
    try:
        known = json.loads(store.read_text())
        if known.get("size") == st.st_size and len(known.get("sha256", "")) == 64:
            return str(known["sha256"])
    except (OSError, ValueError):
        pass
    sha = file_sha256(p)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"sha256": sha, "path": str(p.resolve()), "size": st.st_size,
                                   "mtime_ns": st.st_mtime_ns}))
        os.replace(tmp, store)
    except OSError:
        pass
    return sha


#: the files of an HF checkpoint directory whose bytes decide its K/V for given token ids (the
#: weights and config) or which ids a text becomes (the tokenizer): :func:`model_digest` hashes them
HF_DIGEST_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "config.json", "tokenizer.json",
                   "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json")


def model_digest(path: str | Path, root: Path | None = None) -> str:
    """The hex sha256 that identifies a checkpoint's bytes: for a GGUF file its
    :func:`file_identity` (weights and tokenizer are in the file); for an HF directory the
    sha256 of ``name:file_identity`` lines of every file matching ``HF_DIGEST_FILES`` (weights,
    config, tokenizer), sorted by name. Each file is hashed once and the result kept under
    ``root/ids/`` (see :func:`file_identity`), so a restart costs a ``stat`` and a 64 KiB read
    per file. Two checkpoints with the same names, config and shapes but other weights get
    different digests. Raises ``ConfigError`` naming the file when one cannot be read."""
    p = Path(path)
    try:
        if not p.is_dir():
            return file_identity(p, root)
        files = sorted({f for pat in HF_DIGEST_FILES for f in p.glob(pat) if f.is_file()}, key=lambda f: f.name)
        h = hashlib.sha256(b"pagedkv-hf-digest-v1\n")
        for f in files:
            h.update(f"{f.name}:{file_identity(f, root)}\n".encode())
        return h.hexdigest()
    except OSError as e:
        raise ConfigError(f"model: cannot read {e.filename or str(p)!r} to identify the checkpoint ({e.strerror or e})") from None


def entry_dir(root: Path, sha: str, weights: str = "fp32") -> Path:
    """The entry of the source file whose hex sha256 is ``sha``, in weight format ``weights``."""
    return root / (sha[:16] if weights == "fp32" else f"{sha[:16]}-{weights}")


def manifest_ok(entry: Path, sha: str, weights: str = "fp32") -> bool:
    """Cheap validity check of an entry: manifest of this format, source and weight format,
    files of the recorded sizes (contents are not hashed)."""
    try:
        _check_manifest(entry, sha, weights)
        return True
    except Exception:  # noqa: BLE001
        return False


def _check_manifest(entry: Path, sha: str, weights: str = "fp32") -> None:
    manifest = json.loads((entry / _MANIFEST_FILE).read_text())
    if manifest.get("format") != CACHE_FORMAT_VERSION:
        raise ValueError(f"cache format {manifest.get('format')!r} != {CACHE_FORMAT_VERSION}")
    if manifest.get("source_sha256") != sha:
        raise ValueError("cache entry belongs to another file")
    if manifest.get("weights", "fp32") != weights:
        raise ValueError(f"cache entry holds {manifest.get('weights')!r} weights, not {weights!r}")
    for rel, size in manifest["files"].items():
        actual = (entry / rel).stat().st_size
        if actual != size:
            raise ValueError(f"{rel} has {actual} bytes, expected {size}")


def read_tokenizer_entry(entry: Path, sha: str) -> Any:
    """The tokenizer of a tokenizer-only entry (``<16 hex>-tokenizer``, written by
    ``write_cache_entry(..., weights="tokenizer")``). Raises (any exception) if it is missing
    or damaged. A :class:`~pagedkv.model.fast_tokenizer.FastTokenizer` (no transformers
    import) where the entry records that it agrees with transformers' tokenizer; else
    transformers' tokenizer, and an entry without a record gets one (:func:`record_fast_tokenizer`)."""
    from pagedkv.model.fast_tokenizer import open_fast, read_marker

    _check_manifest(entry, sha, "tokenizer")
    verdict = read_marker(entry, entry / _TOKENIZER_DIR)
    if verdict:
        try:
            return open_fast(entry, entry / _TOKENIZER_DIR)
        except Exception as e:  # noqa: BLE001 - a damaged record: transformers' tokenizer, re-recorded
            log.warning("pagedkv: fast tokenizer record in %s is unusable (%s); re-checking it", entry, e)
            verdict = None
    tokenizer = load_tokenizer(entry / _TOKENIZER_DIR)
    if verdict is None:
        record_fast_tokenizer(entry, tokenizer)
    return tokenizer


def record_fast_tokenizer(entry: Path, tokenizer: Any) -> bool:
    """Check the fast tokenizer of the tokenizer entry ``entry`` against ``tokenizer`` (the
    transformers one, loaded from or written to it) and record the verdict beside the entry's
    manifest (``pagedkv.model.fast_tokenizer.write_marker``). Returns the verdict."""
    from pagedkv.model.fast_tokenizer import write_marker

    return write_marker(entry, tokenizer, entry / _TOKENIZER_DIR)


def write_cache_entry(
    entry: Path, sha: str, source: Path, config: ModelConfig | None, state: dict[str, torch.Tensor],
    tokenizer: Any, replace: bool = False, weights: str = "fp32",
) -> None:
    """Write the entry into a sibling temp dir, then rename it into place (atomic on POSIX).
    An existing entry is replaced if ``replace`` (it failed to load) or if its manifest does
    not check out; otherwise it was written by a concurrent loader that won the race and is
    kept. ``config``/``tokenizer`` ``None``: not written (a weight-format entry). Raises
    ``OSError`` (nothing left behind) if writing fails."""
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        if config is not None:
            (tmp / _CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / _TOKENIZER_DIR))
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        manifest = {
            "format": CACHE_FORMAT_VERSION,
            "weights": weights,
            "source_sha256": sha,
            "source_path": str(source),
            "created_unix": time.time(),
            "files": files,
        }
        (tmp / _MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        for p in tmp.rglob("*"):  # make the data durable before the rename publishes it
            if p.is_file():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        if entry.exists():
            if not replace and manifest_ok(entry, sha, weights):
                return  # a concurrent writer finished first; keep its (identical) entry
            stale = entry.parent / f".{entry.name}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(entry, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass  # someone else moved it; the rename below tells who won
        try:
            os.rename(tmp, entry)
        except OSError:
            if not manifest_ok(entry, sha, weights):
                raise  # not a lost race: a real failure
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
