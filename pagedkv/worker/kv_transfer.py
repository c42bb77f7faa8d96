"""The runner's half of the KV tiers: block payloads in and out of the paged caches.

A *payload* is one block's K/V of every layer flattened to uint8 ``[nbytes]``: for each
layer, the tensors the backend's ``export_blocks`` returns (K and V in the layout's own
order and dtype, plus whatever else a layout keeps per block, e.g. quantisation scales),
concatenated. Export and import go through the backend (``export_blocks`` /
``import_blocks``), never by indexing the cache tensors, so every layout (and a quantised
cache) round-trips bit for bit.

:func:`run_transfer` executes a step's ``KVTransfer`` (decided by the KV manager at
schedule time) before anything else writes the pool in that step: export the evicted
blocks, run the tier ops (``TierStores.execute``), import the loaded blocks; a load that
cannot be served is recomputed from its tokens over its context blocks, so a missing or
corrupt entry costs time, never correctness.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pagedkv.attention.layouts import backend_layout


class BlockPayloadCodec:
    """Payload layout for ``kv_caches`` (one per layer) of ``backend`` on ``device``:
    ``nbytes`` per block and a ``format`` string naming layout (the backend's name when it keeps
    its caches in no ``pagedkv.attention.layouts.Layout``), dtypes and shapes (a disk store
    written in another format is refused)."""

    def __init__(self, backend: Any, kv_caches: Sequence[Any], device: torch.device) -> None:
        self.backend, self.kv_caches, self.device = backend, list(kv_caches), device
        probe = torch.zeros(1, dtype=torch.int64, device=device)
        self.parts = [
            [(p.dtype, tuple(p.shape[1:]), p[0].numel() * p.element_size()) for p in backend.export_blocks(c, probe)]
            for c in self.kv_caches
        ]
        self.nbytes = sum(nb for layer in self.parts for _, _, nb in layer)
        layout_of, _ = backend_layout(backend)
        layout = layout_of.name if layout_of is not None else str(backend.name)  # its own caches: its name
        desc = [",".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, s, _ in layer) for layer in self.parts]
        body = desc[0] if len(set(desc)) == 1 else ";".join(desc)
        self.format = f"{layout} {body} x{len(self.parts)} layers"

    def export(self, block_ids: Sequence[int]) -> tuple[np.ndarray, Callable[[], None] | None]:
        """Payloads of ``block_ids`` as uint8 ``[n, nbytes]`` (host memory) and a ``wait()``
        to call before reading them (a device-to-host copy still in flight), or None."""
        n = len(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        chunks = [p.reshape(n, -1).view(torch.uint8)
                  for cache in self.kv_caches for p in self.backend.export_blocks(cache, ids)]
        flat = torch.cat(chunks, dim=1)  # [n, nbytes] on the cache's device
        if flat.device.type == "cpu":
            return flat.numpy(), None
        host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)  # stream-ordered before this step's writes
        done = torch.cuda.Event()
        done.record()
        return host.numpy(), done.synchronize

    def import_blocks(self, block_ids: Sequence[int], payloads: np.ndarray) -> None:
        """Write payloads (uint8 ``[n, nbytes]``) into blocks ``block_ids``."""
        n = len(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        flat = torch.from_numpy(payloads).to(self.device)
        off = 0
        for cache, layer in zip(self.kv_caches, self.parts):
            tensors = []
            for dtype, shape, nb in layer:  # strided views of the rows: no copy until the import
                tensors.append(flat[:, off:off + nb].view(dtype).view(n, *shape))
                off += nb
            self.backend.import_blocks(cache, ids, tensors)


def run_transfer(codec: BlockPayloadCodec, transfer: Any, stores: Any,
                 recompute: Callable[[Any], None]) -> None:
    """Execute ``transfer`` (a ``pagedkv.kv.tiers.KVTransfer``) against ``stores`` (its
    ``TierStores``); ``recompute(load)`` rebuilds a block whose load failed. Times go to
    ``stores.record`` (export, import, recompute; seconds)."""
    t0 = time.perf_counter()
    payloads, wait = codec.export(transfer.store_block_ids) if transfer.store_block_ids else (None, None)
    t1 = time.perf_counter()
    stores.record("export", t1 - t0)
    loaded, failed = stores.execute(transfer.ops, payloads, wait)
    if loaded:
        t1 = time.perf_counter()
        codec.import_blocks([ld.block_id for ld, _ in loaded], np.stack([p for _, p in loaded]))
        stores.record("import", time.perf_counter() - t1)
    for ld in failed:  # in chain order: a block's context is in place before it is rebuilt
        t1 = time.perf_counter()
        recompute(ld)
        stores.record("recompute", time.perf_counter() - t1)
