"""The slot mapping (pagedkv/kv/slot_mapping.py): build_slots over a flat batch, block size 4."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.slot_mapping import build_slots, slot_mapping

BS = 4


def test_build_slots_flattens_a_mixed_batch():
    # seq 0 decodes position 5 in [1, 6]; seq 1 prefills positions 0..2 in [3]
    s = build_slots([[1, 6], [3]], num_computed=[5, 0], query_lens=[1, 3], block_size=BS)
    assert s.block_tables.tolist() == [[1, 6], [3, 0]] and s.block_tables.dtype == np.int32
    assert s.positions.tolist() == [5, 0, 1, 2]
    assert s.slot_mapping.tolist() == [25, 12, 13, 14] and s.slot_mapping.dtype == np.int64
    assert s.query_start_loc.tolist() == [0, 1, 4] and s.seq_lens.tolist() == [6, 3]


def test_build_slots_refuses_a_position_without_a_block():
    with pytest.raises(InvalidRequestError, match="sequence 1: position 4 needs logical block 1"):
        build_slots([[0, 1], [2]], [0, 4], [8, 1], BS)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        build_slots([[0]], [0], [-1], BS)
    with pytest.raises(InvalidRequestError, match="bad position range"):
        slot_mapping([0], BS, 3, 2)


def test_empty_batch():
    s = build_slots([], [], [], BS)
    assert s.slot_mapping.tolist() == [] and s.query_start_loc.tolist() == [0]
    assert s.block_tables.shape == (0, 1)
