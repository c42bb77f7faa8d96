"""The slot mapping (seed §02): where each token position's K/V lives in the paged cache.

```
logical_block  = pos // block_size
offset         = pos %  block_size
physical_block = table[logical_block]
slot           = physical_block * block_size + offset
```

``build_slots`` is THE builder (the model runner, the attention metadata and the conformance
kit use it); ``slot_mapping`` is a batch of one. ``pagedkv.kv.block_table.BlockTable`` holds the
``table`` of one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pagedkv.errors import InvalidRequestError


@dataclass
class BatchSlots:
    """Flat-batch addressing of one step (numpy; the model runner moves it to the device).

    ``block_tables`` int32 ``[num_seqs, max_blocks]`` (rows padded with block 0),
    ``positions`` / ``slot_mapping`` int64 ``[num_tokens]`` (sequence by sequence, the new
    tokens in order), ``query_start_loc`` int32 ``[num_seqs + 1]``, ``seq_lens`` int32
    ``[num_seqs]`` (tokens, the new ones included)."""

    block_tables: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


def build_slots(
    block_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
) -> BatchSlots:
    """THE slot-mapping builder (seed §02), used by the model runner, the attention
    metadata and the conformance kit. Sequence ``i`` computes ``query_lens[i]`` new tokens at
    positions ``num_computed[i] ...``; ``block_ids[i]`` is its block table (physical ids in
    logical order). One vectorised gather, no per-token Python loop. Raises
    ``InvalidRequestError`` when a position has no block or a length is negative."""
    num_seqs = len(block_ids)
    starts = np.asarray(num_computed, dtype=np.int64).reshape(num_seqs)
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    nblocks = np.fromiter((len(b) for b in block_ids), dtype=np.int64, count=num_seqs)
    seq_lens = starts + qlens
    if num_seqs and (starts.min() < 0 or qlens.min() < 0):
        raise InvalidRequestError("num_computed and query_lens must be >= 0")
    short = np.nonzero(nblocks * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise InvalidRequestError(
            f"sequence {i}: position {int(seq_lens[i]) - 1} needs logical block "
            f"{(int(seq_lens[i]) - 1) // block_size}, the table has {int(nblocks[i])} blocks"
        )
    table = np.zeros((num_seqs, max(int(nblocks.max(initial=0)), 1)), dtype=np.int64)
    if num_seqs:
        rows = np.repeat(np.arange(num_seqs), nblocks)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
        table[rows, cols] = np.fromiter(
            (b for ids in block_ids for b in ids), dtype=np.int64, count=rows.size
        )
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    seq_idx = np.repeat(np.arange(num_seqs), qlens)
    positions = np.arange(qsl[-1], dtype=np.int64) - qsl[:-1][seq_idx] + starts[seq_idx]
    slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
    return BatchSlots(
        block_tables=table.astype(np.int32), positions=positions, slot_mapping=slots,
        query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
    )


def slot_mapping(block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, end: int) -> np.ndarray:
    """Slots (int64 ``[end - start]``) of token positions ``start .. end-1`` for one request
    whose logical blocks map to ``block_ids`` (:func:`build_slots` for a batch of one).
    Raises ``InvalidRequestError`` if a position has no block."""
    if start < 0 or end < start:
        raise InvalidRequestError(f"bad position range [{start}, {end})")
    return build_slots([list(block_ids)], [start], [end - start], block_size).slot_mapping
