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

from pagedkv.errors import BackendError, ConfigError


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
            nhd.view(-1, x.shape[1], x.shape[2]).index_copy_(0, slots, x.to(t.dtype))
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


@dataclass
class PagedKVCache:
    """One layer's paged K and V cache, in a backend's layout.

    ``key`` and ``value`` have ``layout.shape(num_blocks, block_size, num_kv_heads, head_dim)``
    and the cache dtype. Only the owning backend indexes them; other code uses the backend's
    ``write_kv`` / ``gather_kv`` / ``copy_blocks``.
    """

    key: torch.Tensor
    value: torch.Tensor
    layout: Layout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        return self.key.device

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together."""
        return self.key.numel() * self.key.element_size() * 2

    def key_nhd(self) -> torch.Tensor:
        """``[num_blocks, block_size, Hkv, d]`` view of K (strided for ``hnd``)."""
        return self.layout.as_nhd(self.key, self.num_kv_heads, self.head_dim)

    def value_nhd(self) -> torch.Tensor:
        return self.layout.as_nhd(self.value, self.num_kv_heads, self.head_dim)

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds this cache's blocks, the physical block id leading: K and
        V (a cache with more per-block state, e.g. quantisation scales, lists it too).
        ``copy_blocks`` / ``export_blocks`` / ``import_blocks`` move exactly these."""
        return (self.key, self.value)

    def fill_(self, value: float) -> "PagedKVCache":
        """Fill K and V with ``value`` (e.g. NaN in tests); returns self."""
        self.key.fill_(value)
        self.value.fill_(value)
        return self


def validate_cache_args(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ``ConfigError`` naming the bad field."""
    for field, v in (("num_blocks", num_blocks), ("block_size", block_size),
                     ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{field} must be a positive int, got {v!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")


def allocate(layout: Layout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device | str = "cpu") -> PagedKVCache:
    """Zero-filled ``PagedKVCache`` in ``layout``."""
    validate_cache_args(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    shape = layout.shape(num_blocks, block_size, num_kv_heads, head_dim)
    return PagedKVCache(
        key=torch.zeros(shape, dtype=dtype, device=device),
        value=torch.zeros(shape, dtype=dtype, device=device),
        layout=layout, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
    )


def valid_slots(slot_mapping: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Drop rows whose slot is ``-1``. Returns ``(slots, *tensors)`` filtered alike (no copy
    when every slot is valid)."""
    slots = slot_mapping.to(torch.int64)
    if slots.numel() == 0 or bool((slots >= 0).all()):
        return (slots, *tensors)
    keep = slots >= 0
    return (slots[keep], *(t[keep] for t in tensors))


def copy_blocks(cache: PagedKVCache, copies) -> None:
    """Copy whole physical blocks ``src -> dst`` in K and V (any layout: blocks lead)."""
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
