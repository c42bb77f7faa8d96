"""Model loading: GGUF files and Hugging Face safetensors directories -> ``LoadedModel``.

``load_model(None)`` loads the bundled SmolLM2-135M-Instruct Q4_1 GGUF. A GGUF's weights are
read from the file on every load, tensor by tensor, in any format: its stored blocks
(``weights="gguf"``, ``pagedkv.model.gguf_native``) or converted as they stream in (fp32, bf16,
int8, int4, the model dtype: ``pagedkv.model.gguf_formats``); no fp32 weight cache is kept. Cached:
the tokenizer (building it from the file's vocabulary takes seconds), the file's sha256, and for
``gguf`` the matrices in the kernels' layout, memory-mapped back by the next load
(``pagedkv.model.packed_cache``), all under ``$PAGEDKV_CACHE_DIR`` (default ``~/.cache/pagedkv``,
``pagedkv.model.weight_cache``);
an entry that fails to load is rebuilt. Where the pieces live: the GGUF header reader
``pagedkv.gguf_header``; the GGUF naming and fusion rules and HF safetensors
``pagedkv.model.weights``; the tokenizer ``pagedkv.model.tokenizer``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv._bundled import BUNDLED_NAMES, resolve_bundled
from pagedkv.errors import ConfigError
from pagedkv.gguf_header import is_gguf_file, read_gguf_header
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.quant import resolve_weights
from pagedkv.model.quantize import install_linears, quantize_state
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.model.weight_cache import cache_root, entry_dir, file_identity, file_sha256
from pagedkv.model.weights import StateDict, gguf_config, hf_config, hf_state_dict
from pagedkv.utils import canonical_dtype, release_freed_memory, torch_dtype

log = logging.getLogger(__name__)

__all__ = [
    "LoadedModel", "auto_weights", "build_model", "cache_root", "check_memory", "file_identity", "file_sha256",
    "load_config", "load_model", "load_weights", "resolve_model_path",
]


@dataclass
class LoadedModel:
    """A ready-to-run model.

    ``model``: our ``LlamaForCausalLM`` (eval mode, requested dtype/device); ``config``: its
    ``ModelConfig``; ``tokenizer``: a transformers tokenizer (with the chat template when the
    source has one), or on a GGUF's warm start the ``FastTokenizer`` that answers as it does
    (``pagedkv.model.fast_tokenizer``); ``path``: the GGUF file or HF directory loaded; ``cache_dir``: a GGUF's
    tokenizer cache entry used or written (``<sha16>-tokenizer``; ``None`` for HF directories or
    when caching was off or failed; the packed matrices of ``gguf`` are ``packed_cache``'s); ``from_cache``: whether the
    tokenizer came from it; ``load_seconds``: wall time; ``weights``: the linear layers' weight
    format (``pagedkv.model.quant``) and ``weights_reason`` why it was chosen; ``report`` for a
    GGUF: a ``gguf_native.LoadReport`` (weights ``gguf``) or ``gguf_formats.StreamReport`` (the
    other formats: tensors, bytes read, state bytes, seconds), else ``None``; ``shard``: the
    ``TPShard`` whose slices ``model`` holds (weights ``gguf`` with tensor parallelism; ``config``
    is still the whole model's), else ``None``.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    path: Path
    cache_dir: Path | None = None
    from_cache: bool = False
    load_seconds: float = 0.0
    weights: str = "fp32"
    weights_reason: str = "requested"
    report: Any = None
    shard: Any = None


def resolve_model_path(model: str | Path | None = None) -> Path:
    """Where ``model`` lives: ``None`` (the default SmolLM2) or a bundled model's name
    (``pagedkv._bundled``: ``smollm2-135m-instruct``, ``gemma-3-270m``) -> its GGUF; a
    ``.gguf`` file; a directory with ``config.json`` (HF safetensors); or a directory holding
    exactly one ``.gguf`` file. Raises ``ConfigError`` naming the path otherwise."""
    if model is None or not Path(model).expanduser().exists():  # a local path wins over a name
        bundled = resolve_bundled(None if model is None else str(model))
        if bundled is not None:
            return bundled
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model: path {str(path)!r} does not exist and is not a bundled model name "
                          f"({', '.join(sorted(BUNDLED_NAMES))})")
    if path.is_file():
        if not is_gguf_file(path):
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


def auto_weights(model: str | Path | None, fmt: str, why: str, dtype: Any = "fp32", device: Any = "cpu",
                 tensor_parallel_size: int = 1) -> tuple[str, str]:
    """``weights="auto"`` for ``model``'s source, given the CPU's side (``fmt``, ``why`` from
    ``resolve_weights("auto", ...)``). Auto never changes a model's numbers on its own:

    * a GGUF file: ``gguf``, its stored blocks on the integer kernels, when every weight matrix
      is of a type they take (``gguf_native.supported``); else ``fp32``, its values dequantised
      (the reason says which types, and that ``weights="int8"`` requantises them if asked),
      or ``bf16`` for a file whose weight matrices are all BF16 where the CPU multiplies bf16
      natively (exact: the file's values, as for a bfloat16 checkpoint); a mixture-of-experts or
      MLA file, which loads on its stored blocks only, is a ``ConfigError`` saying why not
      (a matrix type the kernels do not take, e.g. an IQ quant);
    * an HF directory: its own dtype: ``bf16`` for a bfloat16 checkpoint where the CPU
      multiplies bf16 natively (exact: the checkpoint's values), else ``fp32``.

    With tensor parallelism a GGUF keeps its stored blocks too, each rank its slices of them,
    where every rank's slices are whole blocks (``gguf_shard.tp_problem``; else its values in
    fp32, the reason says why). A 16-bit model, another device, or tensor parallelism over an HF
    directory (``fmt`` is then the model dtype) keep ``fmt``. Reads the header or ``config.json``
    only; raises ``ConfigError`` as ``resolve_model_path`` does (and ``check_tp_size``'s)."""
    if canonical_dtype(dtype) != "fp32" or str(device).split(":")[0] != "cpu":
        return fmt, why
    path = resolve_model_path(model)
    if tensor_parallel_size != 1 and not path.is_file():
        return fmt, why
    if path.is_file():
        from pagedkv.model import gguf_native, gguf_shard

        header = read_gguf_header(path, reuse=True)
        problem = gguf_native.supported(header)
        if problem is None and tensor_parallel_size != 1:
            config = gguf_config(path, header, file_identity(path)[:16])
            problem = gguf_shard.tp_problem(header, config, tensor_parallel_size)
            if problem is not None and (config.num_experts or config.is_mla):  # no float load to fall back to
                raise ConfigError(f"tensor_parallel_size {tensor_parallel_size}: {path.name} loads on its stored "
                                  f"blocks only (weights='gguf'), and {problem}")
            if problem is not None:
                problem = f"tensor_parallel_size {tensor_parallel_size}: {problem}"
        if problem is not None and tensor_parallel_size == 1:
            config = gguf_config(path, header, "")
            if config.num_experts or config.is_mla:  # no float load to fall back to (gguf_groups)
                raise ConfigError(f"weights 'auto': {path.name} loads on its stored blocks only (weights='gguf'), "
                                  f"and {problem}")
        if problem is None:
            kinds = ", ".join(f"{k} x{v}" for k, v in sorted(gguf_native.linear_types(header).items()))
            split = f", each of {tensor_parallel_size} ranks holding its slices" if tensor_parallel_size != 1 else ""
            return "gguf", f"auto: the file's stored blocks ({kinds}) on the integer kernels{split}"
        from pagedkv.model.quant import cpu_features

        if (set(gguf_native.linear_types(header)) == {"BF16"} and tensor_parallel_size == 1
                and cpu_features().bf16_fast):
            return "bf16", "auto: the file's BF16 values as stored, multiplied in bf16 natively on this CPU"
        advice = "" if tensor_parallel_size != 1 else "; weights='int8' requantises them if asked"
        return "fp32", f"auto: the file's values in fp32 ({problem}{advice})"
    import json

    try:
        torch_dtype_name = str(json.loads((path / "config.json").read_text()).get("torch_dtype") or "float32")
    except (OSError, ValueError, AttributeError):  # not a JSON object: hf_config names it
        torch_dtype_name = "float32"
    from pagedkv.model.quant import cpu_features

    if torch_dtype_name == "bfloat16" and cpu_features().bf16_fast:
        return "bf16", "auto: the bfloat16 checkpoint's own values, multiplied in bf16 natively on this CPU"
    return "fp32", f"auto: the checkpoint's own values ({torch_dtype_name}) in fp32; int8/int4 only when asked"


def check_memory(need_bytes: int, what: str, available: int | None = None) -> None:
    """Raise ``ConfigError`` before loading when ``need_bytes`` (weights + KV budget, bytes)
    exceed the memory this host has available (``MemAvailable`` of ``/proc/meminfo``, or
    ``available``) less 256 MiB of headroom, with the numbers (``what`` says what was counted).
    Does nothing where ``/proc/meminfo`` cannot be read."""
    if available is None:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            available = int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return
    if need_bytes + (256 << 20) > available:
        raise ConfigError(f"not enough memory: {what} need {need_bytes / 2**30:.2f} GiB, this host has "
                          f"{available / 2**30:.2f} GiB available (MemAvailable, less 0.25 GiB headroom); "
                          f"free memory, lower kv_cache_memory, or pick a smaller model or weight format")


def load_config(model: str | Path | None = None) -> ModelConfig:
    """``ModelConfig`` of a GGUF file or HF directory (see ``resolve_model_path``), read from
    its metadata only (no weights). Raises ``ConfigError``."""
    path = resolve_model_path(model)
    if path.is_dir():
        return hf_config(path)
    return gguf_config(path, read_gguf_header(path, reuse=True), file_identity(path)[:16])


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    *,
    weights: str | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    route: str | None = None,
    kv_bytes: int = 0,
    tensor_parallel_size: int = 1,
    tp_rank: int = 0,
) -> LoadedModel:
    """Load weights, config and tokenizer.

    ``model``: see ``resolve_model_path`` (``None`` = bundled SmolLM2-135M-Instruct Q4_1).
    ``dtype``: float32 (default), bfloat16 or float16 parameters (a torch dtype or a name such
    as ``"bf16"``). ``device``: where the parameters live. ``weights``: the linear layers'
    format, ``None`` (default: unquantised in ``dtype``, exact) | ``fp32`` | ``bf16`` | ``int8``
    | ``int4`` | ``gguf`` | ``auto`` (see ``pagedkv.model.quant``; int4 keeps a Q4_0/Q4_1
    GGUF's stored codes; ``gguf`` streams a GGUF's stored blocks onto the integer kernels,
    ``pagedkv.model.gguf_native``, with no other copy; ``auto`` never changes the model's
    numbers, see ``auto_weights``); every other format of a GGUF is converted tensor by tensor
    as the file is read (``pagedkv.model.gguf_formats``: peak memory the converted weights plus
    a chunk, never an fp32 copy of the model). No format writes a weight cache.
    ``kv_bytes``: the KV cache the caller will allocate, counted with the
    weights when a GGUF's load checks the host's memory before reading them (``check_memory``). ``route``: ``fast`` | ``fallback`` kernel of the quantised
    layers (default: what this CPU runs fast). ``cache_dir``: root of the GGUF tokenizer cache
    and file identities (default ``cache_root()``); ``use_cache=False`` neither reads nor writes
    the tokenizer entry. ``tensor_parallel_size`` > 1 with weights ``gguf``: the model holds
    rank ``tp_rank``'s slices of the stored blocks only (``LoadedModel.shard``,
    ``pagedkv.model.gguf_shard``), and the memory check counts every rank's weights and KV
    cache (``kv_bytes`` each); other formats load whole (the ranks slice float weights).

    Raises ``ConfigError`` for a missing path, a directory without ``config.json``, an
    unsupported architecture/quantisation/dtype/weight format, or missing/mis-shaped weights.
    """
    t0 = time.perf_counter()
    dtype = torch_dtype(dtype)
    if weights is None:  # unquantised, in the model dtype
        fmt, why = canonical_dtype(dtype), "the model dtype"
    else:
        fmt, why = resolve_weights(weights, dtype, device=device, tensor_parallel_size=tensor_parallel_size)
        if weights == "auto":
            fmt, why = auto_weights(model, fmt, why, dtype, device, tensor_parallel_size)
    quantised = fmt != canonical_dtype(dtype)
    path = resolve_model_path(model)
    if fmt == "gguf":
        return _load_gguf_native(path, _root(cache_dir), use_cache, route, why, t0, kv_bytes,
                                 tensor_parallel_size, tp_rank)
    report = entry = None
    from_cache = False
    if path.is_dir():
        config = hf_config(path)
        state = hf_state_dict(path, config)
        tokenizer = load_tokenizer(path)
        if quantised:
            state = quantize_state(state, config, fmt)
    else:
        config, state, tokenizer, entry, from_cache, report = _load_gguf_stream(
            path, _root(cache_dir), use_cache, fmt if quantised else None, dtype, kv_bytes, tensor_parallel_size)
    net = build_model(config, state, dtype, device, route=route, formats=quantised or path.is_dir(), consume=True)
    del state
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tokenizer,
        path=path,
        cache_dir=entry,
        from_cache=from_cache,
        load_seconds=time.perf_counter() - t0,
        weights=fmt,
        weights_reason=why,
        report=report,
    )


def load_weights(
    model: str | Path | None = None, *, cache_dir: str | Path | None = None, use_cache: bool = True
) -> tuple[ModelConfig, StateDict, Path]:
    """``(config, state_dict, path)`` of a model without building the module or loading the
    tokenizer (what a tensor-parallel worker needs before it slices its shard). Tensors use our
    fused names (see ``pagedkv.model.llama``) in the source dtype: an HF checkpoint's own, fp32
    for a GGUF, streamed tensor by tensor (``gguf_formats.stream_state``: no second copy, no
    weight cache). ``cache_dir`` / ``use_cache``: where the GGUF's identity (its sha256, the
    config's revision) is kept (``file_identity``). Raises ``ConfigError`` like ``load_model``."""
    from pagedkv.model.gguf_formats import stream_state

    path = resolve_model_path(model)
    if path.is_dir():
        config = hf_config(path)
        return config, hf_state_dict(path, config), path
    header = read_gguf_header(path)
    config = gguf_config(path, header, file_identity(path, _root(cache_dir))[:16])
    state, _report = stream_state(path, header, config, None, torch.float32)
    return config, state, path


def load_gguf_shard(model: str | Path, tp_rank: int, tp_size: int, *, cache_dir: str | Path | None = None,
                    route: str | None = None) -> tuple[ModelConfig, Any]:
    """``(config, module)`` of a tensor-parallel worker: rank ``tp_rank`` of ``tp_size``'s slices
    of a GGUF's stored blocks (``gguf_shard``), no tokenizer, no packed cache; ``config`` is
    the whole model's. Raises ``ConfigError`` like ``load_model`` with weights ``gguf``."""
    from pagedkv.model import gguf_native
    from pagedkv.model.tp_plan import shard_plan

    path = resolve_model_path(model)
    header, _sha, config = _gguf_file(path, _root(cache_dir))
    net, report = gguf_native.build_gguf_model(path, header, config, route=route,
                                               shard=shard_plan(config, tp_rank, tp_size))
    log.info("pagedkv: rank %d of %d loaded %s: %s", tp_rank, tp_size, path.name, report.summary())
    return config, net


def build_model(
    config: ModelConfig, state: StateDict, dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu", route: str | None = None, formats: bool = True, consume: bool = False,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` for ``config`` holding ``state`` (converted to ``dtype`` on
    ``device``; eval mode, no grad). Linear layers whose ``state`` is in a quantised format
    (``pagedkv.model.quantize.quantize_state``) become that format's modules, on ``route``
    (default: the CPU's fast one where it has it); ``formats=False`` keeps every linear layer an
    ``nn.Linear`` (a state already in a 16-bit model dtype, not a ``BF16Linear``); ``consume``:
    the quantised layers' entries leave ``state`` as they are installed (the caller's state is
    spent: the codes a packed layer drops are freed at once, not at the end). Raises
    ``ConfigError`` on an unsupported dtype or a missing, unexpected or mis-shaped tensor."""
    dtype = torch_dtype(dtype)
    # parameters on the meta device until ``state``'s tensors are assigned: no second buffer
    net = LlamaForCausalLM(config, dtype=dtype, device=device, materialize=False)
    taken = install_linears(net, state, route, consume) if formats else set()  # quantised tensors keep their dtypes
    from pagedkv.model.quant import shapes_only

    with shapes_only():  # keys and shapes: no dropped codes unpacked
        expected = net.state_dict()
    missing = sorted(set(expected) - set(state) - taken)
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
    # the quantised modules already hold their tensors (copied where a kernel needs alignment)
    converted = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k not in taken}
    net.load_state_dict(converted, strict=False, assign=True)  # completeness checked above
    del converted
    release_freed_memory()  # the layers' freed copies (bf16 plain weights, dropped codes) back to the OS
    return net.eval().requires_grad_(False)


def _root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root()


def _gguf_file(path: Path, root: Path, reuse: bool = True) -> tuple[Any, str, ModelConfig]:
    """``(header, sha256 hex, config)`` of a GGUF about to be read: its header (``reuse``: the
    one read last for this unchanged file), ``ConfigError`` for a tensor past the file's end (a
    truncated download: checked before anything is read or cached), its identity
    (``file_identity`` under ``root``) and its ``ModelConfig``."""
    from pagedkv.model.gguf_read import check_extent

    header = read_gguf_header(path, reuse=reuse)
    check_extent(header.tensors, path.stat().st_size)
    sha = file_identity(path, root)
    return header, sha, gguf_config(path, header, sha[:16])


def _load_gguf_stream(path: Path, root: Path, use_cache: bool, fmt: str | None, dtype: torch.dtype,
                      kv_bytes: int, tp_size: int = 1) -> tuple[ModelConfig, StateDict, Any, Path | None, bool, Any]:
    """``(config, state, tokenizer, tokenizer entry or None, tokenizer from cache, StreamReport)``
    of a GGUF in an explicit format: ``fmt`` (bf16 | int8 | int4) or ``None`` (every tensor in
    ``dtype``), streamed tensor by tensor (``gguf_formats.stream_state``: no fp32 copy of the
    model, no weight cache) while the tokenizer loads from its cache entry in a thread. Before
    reading a tensor, the converted weights' bytes (``gguf_formats.state_bytes``) plus
    ``kv_bytes`` are checked against the host's memory (``check_memory``), ``tp_size`` times
    (every tensor-parallel rank on this host loads the whole state and its own KV cache)."""
    from pagedkv.model.gguf_formats import state_bytes, stream_state

    header, sha, config = _gguf_file(path, root, reuse=False)  # a truncated file: no tokenizer entry either
    need = state_bytes(header, config, fmt, dtype)
    what = fmt or canonical_dtype(dtype)
    ranks = f"{tp_size} x " if tp_size > 1 else ""  # each rank streams the whole state, then slices it
    check_memory(tp_size * (need + kv_bytes), f"{path.name}'s weights as {what} ({ranks}{need / 2**30:.2f} GiB, "
                                              f"kernel buffers not counted) and the KV cache ({ranks}"
                                              f"{kv_bytes / 2**30:.2f} GiB)")
    with ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenizer") as pool:
        tok = pool.submit(_gguf_tokenizer, path, root, sha, use_cache)
        state, report = stream_state(path, header, config, fmt, dtype)
        tokenizer, entry, hit = tok.result()
    log.info("pagedkv: loaded %s: %s", path.name, report.summary())
    return config, state, tokenizer, entry, hit, report


def _load_gguf_native(path: Path, root: Path, use_cache: bool, route: str | None, why: str, t0: float,
                      kv_bytes: int, tp_size: int = 1, tp_rank: int = 0) -> LoadedModel:
    """``load_model`` for weights ``gguf``: header, identity (``file_identity``), a memory check
    of the weights' bytes plus ``kv_bytes``, the streaming build (``gguf_native``; rank
    ``tp_rank``'s shard when ``tp_size`` > 1), and the tokenizer from its cache entry (built
    from the file and written there on the first load)."""
    from pagedkv.model import gguf_native, gguf_shard
    from pagedkv.model.packed_cache import PackedCache, packed_cache_enabled
    from pagedkv.model.tp_plan import shard_plan

    if path.is_dir():
        raise ConfigError(f"weights 'gguf': {str(path)!r} is a directory; 'gguf' keeps a GGUF file's stored blocks")
    header, sha, config = _gguf_file(path, root)  # a truncated file: no tokenizer entry either
    need = gguf_native.weight_bytes(header, config)
    shard = shard_plan(config, tp_rank, tp_size) if tp_size > 1 else None
    if shard is None:
        check_memory(need + kv_bytes, f"{path.name}'s weights ({need / 2**30:.2f} GiB as stored) and the KV cache "
                                      f"({kv_bytes / 2**30:.2f} GiB)")
    else:  # every rank runs on this host: the split matrices once, the replicated ones and the caches per rank
        need = gguf_shard.host_weight_bytes(header, config, tp_size, need, gguf_native.kernel_matrix)
        check_memory(need + tp_size * kv_bytes, f"{path.name}'s weights on {tp_size} ranks ({need / 2**30:.2f} GiB "
                                                f"as stored) and their KV caches ({tp_size} x {kv_bytes / 2**30:.2f} GiB)")
    # the tokenizer loads in a thread while the weights stream in (preadv and the C packers
    # release the GIL): on a warm start the fast tokenizer (milliseconds, pagedkv.model.fast_tokenizer),
    # on the first load transformers' (its import and the GGUF vocabulary: Python, seconds)
    with ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenizer") as pool:
        tok = pool.submit(_gguf_tokenizer, path, root, sha, use_cache)
        packed = None
        if use_cache and packed_cache_enabled() and shard is None:  # the matrices in the kernels' layout, stored earlier
            packed = PackedCache(root, sha)
            packed.open()
        net, report = gguf_native.build_gguf_model(path, header, config, route=route, packed_cache=packed, shard=shard)
        tokenizer, entry, hit = tok.result()
    log.info("pagedkv: loaded %s: %s", path.name, report.summary())
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, path=path, cache_dir=entry, from_cache=hit,
                       load_seconds=time.perf_counter() - t0, weights="gguf", weights_reason=why, report=report,
                       shard=shard)


def _gguf_tokenizer(path: Path, root: Path, sha: str, use_cache: bool) -> tuple[Any, Path | None, bool]:
    """``(tokenizer, cache entry or None, from cache)`` of a GGUF: its entry ``<sha16>-tokenizer``
    (the tokenizer only: building it from the file's vocabulary takes seconds), written on a
    miss; an entry that fails to load is rebuilt, one that cannot be written is skipped."""
    from pagedkv.model.weight_cache import read_tokenizer_entry, record_fast_tokenizer, write_cache_entry

    entry = entry_dir(root, sha, "tokenizer")
    damaged = False
    if use_cache and entry.is_dir():
        try:
            return read_tokenizer_entry(entry, sha), entry, True
        except Exception as e:  # noqa: BLE001 - any damage means "rebuild"
            log.warning("pagedkv: tokenizer cache %s is unusable (%s); rebuilding it", entry, e)
            damaged = True
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    if not use_cache:
        return tokenizer, None, False
    try:
        write_cache_entry(entry, sha, path, None, {}, tokenizer, replace=damaged, weights="tokenizer")
    except OSError as e:
        log.warning("pagedkv: could not write the tokenizer cache %s (%s); continuing without it", entry, e)
        return tokenizer, None, False
    record_fast_tokenizer(entry, tokenizer)  # the next start may skip transformers' import
    return tokenizer, entry, False
