"""KV cache layouts: one paging protocol, several memory layouts (seed §06).

Every layout keeps the *physical block* as the leading dimension, so a block id from the
memory system always selects one contiguous slab of ``block_size * num_kv_heads * head_dim``
elements; what differs is the order of the elements inside a block:

=========  ====================================  =============================================
name       K (and V) tensor shape                used by
=========  ====================================  =============================================
``nhd``    ``[num_blocks, block_size, Hkv, d]``  vLLM's FlashAttention backend, flash-attn's
                                                 ``block_table`` API, FlashInfer "NHD"
``hnd``    ``[num_blocks, Hkv, block_size, d]``  FlashInfer "HND" (one head's tokens together)
``ascend`` ``[num_blocks, block_size, Hkv*d]``   torch_npu paged attention ops (BSH: heads and
                                                 head_dim flattened into one hidden axis)
=========  ====================================  =============================================

A slot is ``physical_block * block_size + offset`` (seed §02); slot ``-1`` means "do not
write". K and V are two separate tensors of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.attention import quant as Q
from pagedkv.errors import BackendError, ConfigError
from pagedkv.ops import hugepages


class Layout:
    """How one layer's K (or V) tensor is shaped. Subclasses differ only in element order
    inside a block; the leading dimension is always the physical block."""

    name: str = ""
    description: str = ""

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        raise NotImplementedError

    def as_nhd(self, t: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """A view ``[num_blocks, block_size, Hkv, d]`` of a cache tensor (maybe strided)."""
        raise NotImplementedError

    def as_hnd(self, t: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """A view ``[num_blocks, Hkv, block_size, d]`` of a cache tensor (maybe strided)."""
        return self.as_nhd(t, num_kv_heads, head_dim).transpose(1, 2)

    def write(self, t: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
        """Scatter ``x`` ``[n, Hkv, d]`` to ``slots`` (int64 ``[n]``, all >= 0)."""
        nhd = self.as_nhd(t, x.shape[1], x.shape[2])
        if nhd.is_contiguous():
            nhd.view(-1, x.shape[1], x.shape[2]).index_copy_(0, slots, x if x.dtype == t.dtype else x.to(t.dtype))
        else:
            nhd[slots // block_size, slots % block_size] = x.to(t.dtype)

    def read(self, t: torch.Tensor, slots: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Gather ``[n, Hkv, d]`` at ``slots`` (int64 ``[n]``, all >= 0); a new tensor."""
        nhd = self.as_nhd(t, num_kv_heads, head_dim)
        if nhd.is_contiguous():
            return nhd.reshape(-1, num_kv_heads, head_dim).index_select(0, slots)
        return nhd[slots // block_size, slots % block_size]


class NHDLayout(Layout):
    name = "nhd"
    description = "[num_blocks, block_size, num_kv_heads, head_dim]"

    def shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def as_nhd(self, t, num_kv_heads, head_dim):
        return t


class HNDLayout(Layout):
    name = "hnd"
    description = "[num_blocks, num_kv_heads, block_size, head_dim]"

    def shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def as_nhd(self, t, num_kv_heads, head_dim):
        return t.transpose(1, 2)

    def as_hnd(self, t, num_kv_heads, head_dim):
        return t


class AscendLayout(Layout):
    name = "ascend"
    description = "[num_blocks, block_size, num_kv_heads * head_dim] (torch_npu BSH paged cache)"

    def shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_kv_heads * head_dim)

    def as_nhd(self, t, num_kv_heads, head_dim):
        return t.view(t.shape[0], t.shape[1], num_kv_heads, head_dim)


LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (NHDLayout, HNDLayout, AscendLayout)}


def get_layout(name: str) -> Layout:
    """The layout called ``name`` (``nhd``, ``hnd``, ``ascend``); ``ConfigError`` otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ConfigError(f"unknown KV layout {name!r}; valid: {', '.join(LAYOUTS)}") from None


def backend_layout(backend: object) -> tuple[Layout | None, str]:
    """``(layout, name)``: the :class:`Layout` of ``backend``'s ``PagedKVCache`` caches (its
    ``layout`` attribute; ``None`` for a backend that keeps its caches otherwise) and its
    ``name`` (the object itself as text when it has none), for messages. Never raises."""
    layout = getattr(backend, "layout", None)
    return (layout if isinstance(layout, Layout) else None), repr(getattr(backend, "name", backend))


@dataclass
class PagedKVCache:
    """One layer's paged K and V cache, in a backend's layout.

    ``key`` and ``value`` have ``layout.shape(num_blocks, block_size, num_kv_heads, head_dim)``
    and the cache dtype; for a quantised cache (``quant`` set, see
    :mod:`pagedkv.attention.quant`) they hold one-byte codes, and ``key_scale`` /
    ``value_scale`` (bf16, ``layout.shape(num_blocks, block_size, num_kv_heads, head_dim //
    group_size)``) one scale per group of ``group_size`` elements. Only the owning backend
    indexes them; other code uses the backend's ``write_kv`` / ``gather_kv`` / ``copy_blocks``.
    """

    key: torch.Tensor
    value: torch.Tensor
    layout: Layout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    quant: Q.QuantFormat | None = None
    group_size: int = 0  # elements per scale (quantised caches)

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype of ``key``/``value`` (the codes' storage dtype when quantised)."""
        return self.key.dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The format's name: ``int8``, ``fp8_e4m3``, ``fp8_e5m2``, or the torch dtype's
        (``float32``, ``bfloat16``, ``float16``)."""
        return self.quant.name if self.quant is not None else str(self.dtype).removeprefix("torch.")

    @property
    def num_groups(self) -> int:
        """Scales per head vector (1 for a plain cache)."""
        return self.head_dim // self.group_size if self.quant is not None else 1

    @property
    def device(self) -> torch.device:
        return self.key.device

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds this cache's blocks, the physical block id leading: K and
        V, then the scales of a quantised cache. ``copy_blocks`` / ``export_blocks`` /
        ``import_blocks`` move exactly these."""
        scales = (self.key_scale, self.value_scale) if self.quant is not None else ()
        return (self.key, self.value, *scales)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together, scales included."""
        return sum(t.numel() * t.element_size() for t in self.block_tensors())

    def key_nhd(self) -> torch.Tensor:
        """``[num_blocks, block_size, Hkv, d]`` view of K (strided for ``hnd``)."""
        return self.layout.as_nhd(self.key, self.num_kv_heads, self.head_dim)

    def value_nhd(self) -> torch.Tensor:
        return self.layout.as_nhd(self.value, self.num_kv_heads, self.head_dim)

    def scale_nhd(self, which: str) -> torch.Tensor:
        """``[num_blocks, block_size, Hkv, d / G]`` view of ``key_scale`` (``which="key"``)
        or ``value_scale``. Quantised caches only."""
        t = self.key_scale if which == "key" else self.value_scale
        return self.layout.as_nhd(t, self.num_kv_heads, self.num_groups)

    def fill_(self, value: float) -> "PagedKVCache":
        """Make every element read back as ``value`` (e.g. NaN in tests); returns self. A
        quantised cache gets the code of 1.0 and scale ``value``."""
        if self.quant is None:
            self.key.fill_(value)
            self.value.fill_(value)
            return self
        fmt = self.quant
        one = torch.ones(1).to(fmt.code_dtype).view(torch.uint8) if fmt.code_dtype is not None else 1
        for t in (self.key, self.value):
            t.fill_(int(one))  # the code whose value is exactly 1.0
        for t in (self.key_scale, self.value_scale):
            t.fill_(value)
        return self


def validate_cache_args(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ``ConfigError`` naming the bad field."""
    for field, v in (("num_blocks", num_blocks), ("block_size", block_size),
                     ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{field} must be a positive int, got {v!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")


#: from this size on a CPU cache comes from lazily zeroed pages (``lazy_zeros``)
LAZY_ZEROS_MIN_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, but on the CPU, from
    ``LAZY_ZEROS_MIN_BYTES`` on, in memory the OS hands out already zero (``calloc``, via
    numpy), 64-byte aligned: a page becomes resident when a block in it is first written,
    instead of every page of a multi-GiB KV budget being faulted in and cleared at start (~0.3 s
    per GiB on 2 cores). An engine then faults the pages in from a background thread
    (``pagedkv.attention.prefault``), so steps do not take those faults where it had idle time.
    Where ``pagedkv.ops.hugepages`` is on, the memory is its own mapping advised for 2 MiB pages
    (``hugepages.zeros``): decode streams a long context's blocks as it streams the weights."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    if hugepages.enabled():
        return hugepages.zeros(nbytes).view(dtype).view(shape)
    import numpy as np

    buf = np.zeros(nbytes + 64, dtype=np.uint8)
    off = -buf.ctypes.data % 64
    return torch.from_numpy(buf[off:off + nbytes]).view(dtype).view(shape)


def allocate(layout: Layout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype | str, device: torch.device | str = "cpu",
             quant_group_size: int | None = None) -> PagedKVCache:
    """Zero-filled ``PagedKVCache`` in ``layout``. ``dtype``: a floating torch dtype, or a
    ``kv_cache_dtype`` name (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` quantise, with
    ``quant_group_size`` elements per scale, default ``head_dim``). Raises ``ConfigError``."""
    plain, fmt = Q.resolve(dtype)
    if fmt is None:
        validate_cache_args(num_blocks, block_size, num_kv_heads, head_dim, plain)
        shape = layout.shape(num_blocks, block_size, num_kv_heads, head_dim)
        return PagedKVCache(lazy_zeros(shape, plain, device), lazy_zeros(shape, plain, device),
                            layout, num_blocks, block_size, num_kv_heads, head_dim)
    validate_cache_args(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    g = Q.check_group_size(quant_group_size, head_dim)
    shape = layout.shape(num_blocks, block_size, num_kv_heads, head_dim)
    sshape = layout.shape(num_blocks, block_size, num_kv_heads, head_dim // g)
    codes = [lazy_zeros(shape, fmt.storage, device) for _ in range(2)]
    scales = [lazy_zeros(sshape, Q.SCALE_DTYPE, device) for _ in range(2)]
    return PagedKVCache(codes[0], codes[1], layout, num_blocks, block_size, num_kv_heads, head_dim,
                        scales[0], scales[1], fmt, g)


def write(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[n, Hkv, d]`` at ``slots`` (int64 ``[n]``, all >= 0),
    quantising them for a quantised cache (codes and scales alike)."""
    lay, bs = cache.layout, cache.block_size
    if cache.quant is None:
        lay.write(cache.key, key, slots, bs)
        lay.write(cache.value, value, slots, bs)
        return
    for x, codes, scales in ((key, cache.key, cache.key_scale), (value, cache.value, cache.value_scale)):
        c, s = Q.quantize(x, cache.quant, cache.group_size)
        lay.write(codes, c, slots, bs)
        lay.write(scales, s, slots, bs)


def gather_raw(cache: PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """What is stored at ``slots`` (int64 ``[n]``): ``(K, V, K scales, V scales)``; K and V
    ``[n, Hkv, d]`` in the cache dtype (codes when quantised), scales ``[n, Hkv, d / G]`` bf16
    or ``None`` for a plain cache."""
    slots = slots.to(device=cache.device, dtype=torch.int64)
    out = [cache.layout.read(t, slots, cache.block_size, cache.num_kv_heads, cache.head_dim)
           for t in (cache.key, cache.value)]
    if cache.quant is None:
        return out[0], out[1], None, None
    ks, vs = (cache.layout.read(t, slots, cache.block_size, cache.num_kv_heads, cache.num_groups)
              for t in (cache.key_scale, cache.value_scale))
    return out[0], out[1], ks, vs


def gather(cache: PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, Hkv, d]`` at ``slots`` as attention sees them: the cache dtype, or
    float32 dequantised values for a quantised cache."""
    k, v, ks, vs = gather_raw(cache, slots)
    if cache.quant is None:
        return k, v
    return Q.dequantize(k, ks, cache.quant), Q.dequantize(v, vs, cache.quant)


def valid_slots(slot_mapping: torch.Tensor, *tensors: torch.Tensor, num_slots: int | None = None
                ) -> tuple[torch.Tensor, ...]:
    """Drop rows whose slot is ``-1``. Returns ``(slots, *tensors)`` filtered alike (no copy
    when every slot is valid). With ``num_slots`` (the cache's ``num_blocks * block_size``), a
    slot at or past it raises ``BackendError`` before anything is written (an index write would
    have stored the rows before the bad one)."""
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    # Every layer writes through the same slot_mapping, so the check is remembered on the tensor,
    # keyed by its version counter: any in-place refill invalidates it. Inference tensors have
    # no version counter and are checked every time (the engine builds its metadata outside
    # inference mode, so its steps check once).
    seen = getattr(slot_mapping, "_pagedkv_all_valid", None)
    if seen is not None and not slot_mapping.is_inference() and seen[0] == slot_mapping._version:
        all_valid, top = seen[1], seen[2]
    else:
        all_valid = slots.numel() == 0 or bool((slots >= 0).all())
        top = int(slots.max()) if slots.numel() else -1
        if not slot_mapping.is_inference():
            slot_mapping._pagedkv_all_valid = (slot_mapping._version, all_valid, top)
    if num_slots is not None and top >= num_slots:
        raise BackendError(f"slot_mapping has slot {top}, past the cache's {num_slots} slots (nothing written)")
    if all_valid:
        return (slots, *tensors)
    keep = slots >= 0
    return (slots[keep], *(t[keep] for t in tensors))


def copy_blocks(cache: PagedKVCache, copies) -> None:
    """Copy whole physical blocks ``src -> dst`` in K and V, and their scales when quantised
    (any layout: blocks lead)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=cache.device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=cache.device)
    for t in cache.block_tensors():
        t.index_copy_(0, dst, t.index_select(0, src))


def export_blocks(cache: PagedKVCache, block_ids: torch.Tensor) -> list[torch.Tensor]:
    """The raw storage of whole blocks ``block_ids`` (int64 ``[n]``): one new tensor
    ``[n, *block_shape]`` per ``cache.block_tensors()`` entry, in the cache's layout, dtype
    and device (what ``import_blocks`` takes back, bit for bit)."""
    ids = block_ids.to(device=cache.device, dtype=torch.int64)
    return [t.index_select(0, ids) for t in cache.block_tensors()]


def import_blocks(cache: PagedKVCache, block_ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Overwrite whole blocks ``block_ids`` (int64 ``[n]``) with ``parts`` as returned by
    ``export_blocks`` (same count, shapes and dtypes; any device). Raises ``BackendError``
    on a mismatch."""
    tensors = cache.block_tensors()
    n = int(block_ids.numel())
    if len(parts) != len(tensors) or any(
        p.dtype != t.dtype or tuple(p.shape) != (n, *t.shape[1:]) for p, t in zip(parts, tensors)
    ):
        raise BackendError(
            f"import_blocks: expected {[(n, *t.shape[1:]) for t in tensors]} "
            f"{[t.dtype for t in tensors]}, got {[tuple(p.shape) for p in parts]} {[p.dtype for p in parts]}")
    ids = block_ids.to(device=cache.device, dtype=torch.int64)
    for t, p in zip(tensors, parts):
        t.index_copy_(0, ids, p.to(t.device, non_blocking=True))


class BlockTransfer:
    """Whole-block export/import for backends whose caches are ``PagedKVCache`` (mixed into
    every built-in backend): how K/V leave the pool for a slower tier and come back
    (``pagedkv.kv.tiers``), through the cache's ``block_tensors``, never raw indexing."""

    def export_blocks(self, kv_cache: PagedKVCache, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """Raw storage of whole blocks (int64 ``[n]`` ids): see :func:`export_blocks`."""
        return export_blocks(kv_cache, block_ids)

    def import_blocks(self, kv_cache: PagedKVCache, block_ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Overwrite whole blocks with ``export_blocks`` output: see :func:`import_blocks`."""
        import_blocks(kv_cache, block_ids, parts)
