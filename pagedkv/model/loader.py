"""Model loading: GGUF files and Hugging Face safetensors directories -> ``LoadedModel``.

``load_model(None)`` loads the bundled SmolLM2-135M-Instruct Q4_1 GGUF. GGUF weights are
dequantised with the ``gguf`` package (seconds), so the result — weights already in our fused
layout, the tokenizer and the config — is cached under
``$PAGEDKV_CACHE_DIR`` (default ``~/.cache/pagedkv``) ``/<first 16 hex of the GGUF's
sha256>/``; later loads read that and take about a second. The cache entry is written to a
temporary directory and renamed into place, so a crash never leaves a half-written entry; an
entry that fails to load (missing or truncated file, wrong format) is rebuilt.

llama.cpp's converter permutes the rows of Q and K (and their biases) of ``llama``-architecture
models so that its RoPE rotates adjacent pairs; we undo that so our rotate-half RoPE (the HF
convention) applies. ``qwen2`` GGUFs are not permuted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from pagedkv._bundled import BUNDLED_MODEL_ID, bundled_model_path
from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import SUPPORTED_DTYPES, LlamaForCausalLM

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_TOKENIZER_DIR = "tokenizer"
_MANIFEST_FILE = "manifest.json"


@dataclass
class LoadedModel:
    """A ready-to-run model.

    ``model``: our ``LlamaForCausalLM`` (eval mode, requested dtype/device); ``config``: its
    ``ModelConfig``; ``tokenizer``: a transformers tokenizer (with the chat template when the
    source has one); ``path``: the GGUF file or HF directory loaded; ``cache_dir``: the weight
    cache entry used or written (``None`` for HF directories or when caching was off or
    failed); ``from_cache``: whether weights came from the cache; ``load_seconds``: wall time.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    path: Path
    cache_dir: Path | None = None
    from_cache: bool = False
    load_seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def resolve_model_path(model: str | Path | None = None) -> Path:
    """Where ``model`` lives: ``None`` / ``"bundled"`` / the bundled model id -> the bundled
    GGUF; a ``.gguf`` file; a directory with ``config.json`` (HF safetensors); or a directory
    holding exactly one ``.gguf`` file. Raises ``ConfigError`` naming the path otherwise."""
    if model is None or str(model) in ("bundled", BUNDLED_MODEL_ID):
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model: path {str(path)!r} does not exist (only local models are supported)")
    if path.is_file():
        if not _is_gguf_file(path):
            raise ConfigError(f"model: {str(path)!r} is not a GGUF file (bad magic)")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ConfigError(
        f"model: directory {str(path)!r} has no config.json"
        + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " (and no .gguf file)")
    )


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


def load_config(model: str | Path | None = None) -> ModelConfig:
    """``ModelConfig`` of a GGUF file or HF directory (see ``resolve_model_path``), read from
    its metadata only (no weights). Raises ``ConfigError``."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _hf_config(path)
    header = read_gguf_header(path)
    return _gguf_config(path, header, _gguf_revision(path))


_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported torch dtype from a dtype or its name; ``ConfigError`` otherwise."""
    if isinstance(dtype, str):
        dtype = _DTYPE_NAMES.get(dtype.lower(), dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype: unsupported {dtype!r} (supported: float32, bfloat16, float16, or their names)")
    return dtype


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> LoadedModel:
    """Load weights, config and tokenizer.

    ``model``: see ``resolve_model_path`` (``None`` = bundled SmolLM2-135M-Instruct Q4_1).
    ``dtype``: float32 (default), bfloat16 or float16 parameters. ``device``: where the
    parameters live. ``cache_dir``: root of the GGUF weight cache (default ``cache_root()``);
    ``use_cache=False`` neither reads nor writes it.

    Raises ``ConfigError`` for a missing path, a directory without ``config.json``, an
    unsupported architecture/quantisation/dtype, or missing/mis-shaped weights.
    """
    t0 = time.perf_counter()
    dtype = _as_dtype(dtype)
    path = resolve_model_path(model)
    if path.is_dir():
        config = _hf_config(path)
        state = _hf_state_dict(path, config)
        tokenizer = _load_tokenizer(path)
        entry, from_cache = None, False
    else:
        config, state, tokenizer, entry, from_cache = _load_gguf_cached(
            path, Path(cache_dir) if cache_dir is not None else cache_root(), use_cache
        )
    net = _build_model(config, state, dtype, device)
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tokenizer,
        path=path,
        cache_dir=entry,
        from_cache=from_cache,
        load_seconds=time.perf_counter() - t0,
    )


def load_weights(
    model: str | Path | None = None, *, cache_dir: str | Path | None = None, use_cache: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """``(config, state_dict, path)`` of a model without building the module or loading the
    tokenizer (what a tensor-parallel worker needs before it slices its shard). Tensors use our
    fused names (see ``pagedkv.model.llama``) in the source dtype (fp32 for GGUF). A valid GGUF
    cache entry is read directly (weights memory-mapped); otherwise this is ``load_model``'s
    path (which writes the cache). Raises ``ConfigError`` like ``load_model``."""
    path = resolve_model_path(model)
    if path.is_dir():
        config = _hf_config(path)
        return config, _hf_state_dict(path, config), path
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if use_cache:
        sha = file_sha256(path)
        entry = root / sha[:16]
        if _manifest_ok(entry, sha):
            from safetensors.torch import load_file

            try:
                config = ModelConfig.from_dict(json.loads((entry / _CONFIG_FILE).read_text()))
                return config, load_file(str(entry / _WEIGHTS_FILE)), path
            except Exception as e:  # noqa: BLE001 - fall back to the rebuilding path
                log.warning("pagedkv: weight cache %s is unusable (%s); rebuilding it", entry, e)
    config, state, _tok, _entry, _hit = _load_gguf_cached(path, root, use_cache)
    return config, state, path


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` for ``config`` holding ``state`` (converted to ``dtype`` on
    ``device``; eval mode, no grad). Raises ``ConfigError`` on a missing, unexpected or
    mis-shaped tensor."""
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype: unsupported {dtype} (supported: float32, bfloat16, float16)")
    return _build_model(config, state, dtype, device)


# ---------------------------------------------------------------------------------------------
# Building the module
# ---------------------------------------------------------------------------------------------


def _build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str
) -> LlamaForCausalLM:
    net = LlamaForCausalLM(config, dtype=dtype, device=device)
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"weights: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    del expected
    converted = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    net.load_state_dict(converted, strict=True, assign=True)
    return net.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# GGUF: header parsing (fast, pure Python) and dequantisation (gguf package)
# ---------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
# GGUF value type id -> struct format of one scalar.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFStringArray:
    """A string array from GGUF metadata kept undecoded (only its length is needed here)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"<{self.count} strings>"


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF's ne reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


def _is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF (v2/v3, little-endian) file's metadata and tensor table without touching
    tensor data (~0.1 s even for large vocabularies). Arrays longer than 256 entries come back
    as numpy arrays, or for strings as an undecoded ``GGUFStringArray``. Raises ``ConfigError`` for a malformed file."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_gguf(buf)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"model: {str(path)!r} is not a readable GGUF file ({e})") from None


def _parse_gguf(buf: Any) -> GGUFHeader:
    if buf[:4] != _GGUF_MAGIC:
        raise ConfigError("GGUF: bad magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ConfigError(f"GGUF.version: unsupported {version} (supported: 2, 3)")
    pos = 24

    def read_str(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return bytes(buf[p + 8 : p + 8 + n]).decode("utf-8"), p + 8 + n

    def read_value(vtype: int, p: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return read_str(p)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype == _STRING:
                if count > 256:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, p)
                        p += 8 + n
                    return GGUFStringArray(count), p
                items = []
                for _ in range(count):
                    s, p = read_str(p)
                    items.append(s)
                return items, p
            if etype in _NP_DTYPE:
                arr = np.frombuffer(buf, dtype=_NP_DTYPE[etype], count=count, offset=p).copy()
                return (arr.tolist() if count <= 256 else arr), p + arr.nbytes
            raise ConfigError(f"GGUF: unsupported array element type {etype}")
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ConfigError(f"GGUF: unsupported value type {vtype}")
        return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = read_value(vtype, pos + 4)

    raw_tensors = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw_tensors.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = [GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in raw_tensors]
    return GGUFHeader(metadata, tensors)


def _dequantize_gguf(path: Path, tensors: list[GGUFTensorInfo]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(gguf_name, float32 tensor)`` for each tensor, in numpy shape order."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for info in tensors:
            try:
                qtype = gguf.GGMLQuantizationType(info.ggml_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ConfigError(f"weights: {info.name} has unknown GGML type {info.ggml_type}") from None
            *outer, inner = info.shape
            if inner % block:
                raise ConfigError(f"weights: {info.name} row length {inner} not a multiple of {qtype.name} blocks")
            row_bytes = inner // block * type_size
            n_bytes = row_bytes * int(np.prod(outer, dtype=np.int64))
            if info.offset + n_bytes > len(buf):
                raise ConfigError(f"weights: {info.name} extends past the end of the GGUF file (truncated?)")
            raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=info.offset).reshape(*outer, row_bytes)
            try:
                values = gguf.dequantize(raw, qtype)
            except NotImplementedError:
                raise ConfigError(
                    f"weights: {info.name} uses {qtype.name}, which gguf cannot dequantise"
                ) from None
            tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(info.shape)
            del raw, values
            yield info.name, tensor


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation: within each head its converter reorders rows
    (first half, second half) into interleaved pairs; we restore [first half; second half]."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_config(path: Path, header: GGUFHeader, revision: str) -> ModelConfig:
    names = [t.name for t in header.tensors]
    factors = None
    if "rope_freqs.weight" in names:
        info = next(t for t in header.tensors if t.name == "rope_freqs.weight")
        factors = next(_dequantize_gguf(path, [info]))[1].tolist()
    try:
        bundled = path.resolve() == bundled_model_path().resolve()
    except ConfigError:
        bundled = False
    return ModelConfig.from_gguf_metadata(
        header.metadata,
        names,
        model_id=BUNDLED_MODEL_ID if bundled else path.stem,
        revision=revision,
        rope_freq_factors=factors,
    )


def _gguf_revision(path: Path) -> str:
    return file_sha256(path)[:16]


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "o_proj.weight",
    "ffn_down.weight": "down_proj.weight",
}


def _gguf_state_dict(path: Path, header: GGUFHeader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantise every tensor and map it to our names, fusing q/k/v and gate/up."""
    permuted = config.architecture in ("llama", "mistral")  # llama.cpp permutes llama-arch Q/K
    state: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for name, w in _dequantize_gguf(path, header.tensors):
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        if name == "token_embd.weight":
            state["embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            state["norm.weight"] = w
        elif name == "output.weight":
            state["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            i = int(idx)
            if rest in _GGUF_LAYER_NAMES:
                state[f"layers.{i}.{_GGUF_LAYER_NAMES[rest]}"] = w
            elif rest in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias",
                          "attn_v.bias", "ffn_gate.weight", "ffn_up.weight"):
                if permuted and rest.startswith(("attn_q.", "attn_k.")):
                    w = _unpermute_rope_rows(w, config.num_heads if rest.startswith("attn_q") else config.num_kv_heads)
                parts[(i, rest)] = w
            else:
                raise ConfigError(f"weights: unexpected GGUF tensor {name!r}")
        else:
            raise ConfigError(f"weights: unexpected GGUF tensor {name!r}")
    for i in range(config.num_layers):
        _fuse_layer(state, parts, i, "attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    if parts:
        raise ConfigError(f"weights: tensors of layers beyond num_layers: {sorted(parts)[:3]}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _fuse_layer(
    state: dict[str, torch.Tensor], parts: dict[tuple[int, str], torch.Tensor], i: int,
    q: str, k: str, v: str, gate: str, up: str,
) -> None:
    def take(key: str) -> torch.Tensor:
        try:
            return parts.pop((i, key))
        except KeyError:
            raise ConfigError(f"weights: layer {i} is missing {key}") from None

    state[f"layers.{i}.qkv_proj.weight"] = torch.cat([take(f"{q}.weight"), take(f"{k}.weight"), take(f"{v}.weight")])
    if (i, f"{q}.bias") in parts:
        state[f"layers.{i}.qkv_proj.bias"] = torch.cat([take(f"{q}.bias"), take(f"{k}.bias"), take(f"{v}.bias")])
    state[f"layers.{i}.gate_up_proj.weight"] = torch.cat([take(f"{gate}.weight"), take(f"{up}.weight")])


# ---------------------------------------------------------------------------------------------
# GGUF weight cache
# ---------------------------------------------------------------------------------------------


def _load_gguf_cached(
    path: Path, root: Path, use_cache: bool
) -> tuple[ModelConfig, dict[str, torch.Tensor], Any, Path | None, bool]:
    sha = file_sha256(path)
    entry = root / sha[:16]
    damaged = False
    if use_cache and entry.is_dir():
        try:
            config, state, tokenizer = _read_cache_entry(entry, sha)
            return config, state, tokenizer, entry, True
        except Exception as e:  # noqa: BLE001 - any damage means "rebuild"
            log.warning("pagedkv: weight cache %s is unusable (%s); rebuilding it", entry, e)
            damaged = True

    header = read_gguf_header(path)
    config = _gguf_config(path, header, sha[:16])
    state = _gguf_state_dict(path, header, config)
    tokenizer = _load_tokenizer(path.parent, gguf_file=path.name)
    if not use_cache:
        return config, state, tokenizer, None, False
    try:
        _write_cache_entry(entry, sha, path, config, state, tokenizer, replace=damaged)
    except OSError as e:
        log.warning("pagedkv: could not write the weight cache %s (%s); continuing without it", entry, e)
        return config, state, tokenizer, None, False
    return config, state, tokenizer, entry, False


def _manifest_ok(entry: Path, sha: str) -> bool:
    """Cheap validity check of an entry: manifest of this format and source, files of the
    recorded sizes (contents are not hashed)."""
    try:
        _check_manifest(entry, sha)
        return True
    except Exception:  # noqa: BLE001
        return False


def _check_manifest(entry: Path, sha: str) -> None:
    manifest = json.loads((entry / _MANIFEST_FILE).read_text())
    if manifest.get("format") != CACHE_FORMAT_VERSION:
        raise ValueError(f"cache format {manifest.get('format')!r} != {CACHE_FORMAT_VERSION}")
    if manifest.get("source_sha256") != sha:
        raise ValueError("cache entry belongs to another file")
    for rel, size in manifest["files"].items():
        actual = (entry / rel).stat().st_size
        if actual != size:
            raise ValueError(f"{rel} has {actual} bytes, expected {size}")


def _read_cache_entry(entry: Path, sha: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    from safetensors.torch import load_file

    _check_manifest(entry, sha)
    config = ModelConfig.from_dict(json.loads((entry / _CONFIG_FILE).read_text()))
    state = load_file(str(entry / _WEIGHTS_FILE))
    tokenizer = _load_tokenizer(entry / _TOKENIZER_DIR)
    return config, state, tokenizer


def _write_cache_entry(
    entry: Path, sha: str, source: Path, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Any,
    replace: bool = False,
) -> None:
    """Write the entry into a sibling temp dir, then rename it into place (atomic on POSIX).
    An existing entry is replaced if ``replace`` (it failed to load) or if its manifest does
    not check out; otherwise it was written by a concurrent loader that won the race and is
    kept."""
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / _CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=1))
        tokenizer.save_pretrained(str(tmp / _TOKENIZER_DIR))
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        manifest = {
            "format": CACHE_FORMAT_VERSION,
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
            if not replace and _manifest_ok(entry, sha):
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
            if not _manifest_ok(entry, sha):
                raise  # not a lost race: a real failure
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------


def _hf_config(path: Path) -> ModelConfig:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"model: directory {str(path)!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json: not valid JSON ({e})") from None
    gen = None
    if (path / "generation_config.json").is_file():
        try:
            gen = json.loads((path / "generation_config.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"generation_config.json: not valid JSON ({e})") from None
    return ModelConfig.from_hf_config(cfg, gen, model_id=path.name, revision=_hf_revision(path))


def _hf_weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"weights: no *.safetensors file in {str(path)!r}")
    return files


def _hf_revision(path: Path) -> str:
    """The snapshot commit for an HF hub cache snapshot dir, else a content-ish hash of
    config.json plus weight file names and sizes."""
    if path.parent.name == "snapshots":
        return path.name
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}
_HF_FUSED_PARTS = {
    "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight", "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_proj.bias": "q.bias", "self_attn.k_proj.bias": "k.bias", "self_attn.v_proj.bias": "v.bias",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight",
}


def _hf_state_dict(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for f in _hf_weight_files(path):
        try:
            tensors = load_file(str(f))
        except SafetensorError as e:
            raise ConfigError(f"weights: cannot read {f.name} ({e})") from None
        for name, w in tensors.items():
            key = name[len("model."):] if name.startswith("model.") else name
            if key == "embed_tokens.weight" or key == "norm.weight" or key == "lm_head.weight":
                state[key] = w
            elif key.startswith("layers."):
                _, idx, rest = key.split(".", 2)
                if rest in _HF_LAYER_NAMES:
                    state[f"layers.{int(idx)}.{_HF_LAYER_NAMES[rest]}"] = w
                elif rest in _HF_FUSED_PARTS:
                    parts[(int(idx), _HF_FUSED_PARTS[rest])] = w
                elif not rest.endswith("rotary_emb.inv_freq"):
                    raise ConfigError(f"weights: unexpected tensor {name!r} in {f.name}")
            elif not key.endswith("rotary_emb.inv_freq"):
                raise ConfigError(f"weights: unexpected tensor {name!r} in {f.name}")
    for i in range(config.num_layers):
        _fuse_layer(state, parts, i, "q", "k", "v", "gate", "up")
    if parts:
        raise ConfigError(f"weights: tensors of layers beyond num_layers: {sorted(parts)[:3]}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _load_tokenizer(directory: Path, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tokenizer: cannot load from {str(directory)!r} ({e})") from None
