"""Seed §03 and §07 with the real manager, plus the `pagedkv example` command."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.examples.seed_example import EXAMPLE_SHUFFLE_SEED, worked_example
from pagedkv.kv import KVCacheManager, check_invariants


def _seed_manager():
    # 12 blocks = 3 requests x 64/16, shuffled as in seed §03.
    return KVCacheManager(12, 16, shuffle_seed=EXAMPLE_SHUFFLE_SEED)


def test_seed03_mapping_and_counts():
    m = _seed_manager()
    assert m.allocate_slots("A", 17, 0) == []
    assert m.allocate_slots("B", 33, 0) == []
    assert m.allocate_slots("C", 8, 0) == []
    assert m.get_block_ids("A") == [7, 2]
    assert m.get_block_ids("B") == [4, 9, 1]
    assert m.get_block_ids("C") == [5]
    assert m.num_used_blocks == 6 and m.num_free_blocks == 6
    slots = m.num_used_blocks * 16
    assert (slots, slots - 58) == (96, 38)
    # Slot mapping: slot = physical * 16 + offset.
    assert m.slot_mapping("A", 15, 17).tolist() == [7 * 16 + 15, 2 * 16 + 0]
    assert m.slot_mapping("B", 32, 33).tolist() == [16]
    check_invariants(m)


def test_seed03_contiguous_max_reservation():
    m = KVCacheManager(12, 16, enable_paging=False, max_model_len=64)
    for r, n in (("A", 17), ("B", 33), ("C", 8)):
        m.allocate_slots(r, n, 0)
        assert len(m.get_block_ids(r)) == 4
    assert m.num_used_blocks * 16 == 192
    assert 192 - 58 == 134
    # Growth inside the reservation never takes a block.
    m.allocate_slots("A", 47, 17)
    assert m.num_used_blocks == 12
    check_invariants(m)


def test_seed03_growth_takes_a_block_only_on_entering_a_new_logical_block():
    m = _seed_manager()
    m.allocate_slots("A", 17, 0)
    m.allocate_slots("B", 32, 0)
    assert m.get_block_ids("B") == [4, 9]
    m.allocate_slots("A", 1, 17)  # 17 -> 18: same logical block 1
    assert m.get_block_ids("A") == [7, 2] and m.num_used_blocks == 4
    m.allocate_slots("B", 1, 32)  # 32 -> 33: enters logical block 2
    assert m.get_block_ids("B") == [4, 9, 1] and m.num_used_blocks == 5


def test_seed03_freeing_c_returns_its_block():
    m = _seed_manager()
    for r, n in (("A", 17), ("B", 33), ("C", 8)):
        m.allocate_slots(r, n, 0)
    m.free("C")
    assert m.pool.blocks[5].ref_cnt == 0
    assert m.pool.free_queue.ids()[-1] == 5
    assert m.num_free_blocks == 7
    # Once everything else is taken, block 5 serves a new request.
    m.allocate_slots("D", 6 * 16, 0)
    m.allocate_slots("E", 1, 0)
    assert m.get_block_ids("E") == [5]
    check_invariants(m)


def test_seed07_free_b_then_new_request_never_gets_a_block_of_a():
    m = _seed_manager()
    for r, n in (("A", 17), ("B", 33), ("C", 8)):
        m.allocate_slots(r, n, 0)
    a_before = m.get_block_ids("A")
    refs_before = [m.pool.blocks[i].ref_cnt for i in a_before]
    m.free("B")
    # Take every free block there is: A's blocks must not be among them.
    m.allocate_slots("N", m.num_free_blocks * 16, 0)
    new = m.get_block_ids("N")
    assert len(new) == 9 and not set(new) & {7, 2}
    assert sorted(new + [7, 2, 5]) == list(range(12))
    assert m.get_block_ids("A") == a_before == [7, 2]
    assert [m.pool.blocks[i].ref_cnt for i in a_before] == refs_before == [1, 1]
    check_invariants(m)


def test_worked_example_numbers_for_8_16_32():
    expect = {8: (9, 72, 14, 96), 16: (6, 96, 38, 48), 32: (4, 128, 70, 24)}
    for bs, (blocks, slots, free, meta) in expect.items():
        r = worked_example((17, 33, 8), 64, bs)
        p, c = r["paged"], r["contiguous"]
        assert (p["blocks"], p["slots"], p["valid_tokens"], p["free_slots"], p["metadata_bytes"]) == (
            blocks, slots, 58, free, meta)
        assert (c["slots"], c["free_slots"]) == (192, 134)
        assert r["seed07"]["overlap"] == [] and r["seed07"]["kept_table_unchanged"]
    r16 = worked_example((17, 33, 8), 64, 16)
    assert [q["block_ids"] for q in r16["requests"]] == [[7, 2], [4, 9, 1], [5]]
    assert [g["new_blocks"] for g in r16["growth"]] == [1, 1, 0]
    assert r16["extra_growth"]["new_blocks"] == 0
    assert r16["free_last"]["returned"] is True


def test_example_command_text(capsys):
    assert main(["example", "--lengths", "17,33,8", "--max-len", "64", "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "A/17   0->7 (16)  1->2 (1)" in out
    assert "B/33   0->4 (16)  1->9 (16)  2->1 (1)" in out
    assert "C/8    0->5 (8)" in out
    assert "free slots            38         134" in out


def test_example_command_json(capsys):
    assert main(["example", "--block-size", "8,16,32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["block_size"] for d in data] == [8, 16, 32]
    assert data[1]["paged"] == {"blocks": 6, "slots": 96, "valid_tokens": 58, "free_slots": 38,
                                "metadata_bytes": 48}
    assert data[1]["contiguous"] == {"slots": 192, "free_slots": 134}


def test_example_bad_input(capsys):
    assert main(["example", "--lengths", "17,-1"]) == 2
    assert "lengths" in capsys.readouterr().err
    assert main(["example", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lengths"):
        worked_example((65,), 64, 16)
