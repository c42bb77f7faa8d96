"""LayerGroups and longest_valid_hit (pagedkv/kv/groups.py) on hand-made layer patterns:
grouping and splitting of unequal kinds, slots, page waste, the window rule, and prefix hits
valid in every group."""

import pytest

from pagedkv.errors import ConfigError
from pagedkv.kv.groups import MAX_GROUPS, LayerGroups, longest_valid_hit


def test_all_full_layers_are_one_group():
    g = LayerGroups.from_layer_windows(None, num_layers=3)
    assert g.windows == (None,) and g.layer_group == (0, 0, 0)
    assert (g.num_groups, g.is_hybrid, g.max_layers, g.page_waste) == (1, False, 3, 0.0)
    assert g.slot_of_layer == [0, 1, 2]


def test_alternating_kinds_full_first():
    g = LayerGroups.from_layer_windows([8, None, 8, None])
    assert g.windows == (None, 8) and g.layer_group == (1, 0, 1, 0)
    assert g.layers_of(0) == [1, 3] and g.layers_of(1) == [0, 2]
    assert g.slot_of_layer == [0, 0, 1, 1] and g.is_hybrid and g.max_layers == 2
    assert g.describe() == [{"group": 0, "window": None, "layers": [1, 3]},
                            {"group": 1, "window": 8, "layers": [0, 2]}]


def test_unequal_kinds_are_cut_into_groups_of_the_smallest_kind():
    # 2 full + 5 window layers: groups of 2 layers -> full, win, win, win (the last of 1 layer)
    lw = [None, 4, 4, None, 4, 4, 4]
    g = LayerGroups.from_layer_windows(lw)
    assert g.windows == (None, 4, 4, 4)
    assert g.layer_group == (0, 1, 1, 0, 2, 2, 3)
    assert g.max_layers == 2 and g.page_waste == pytest.approx(1 - 7 / 8)
    # windows ascending, each its own kind
    assert LayerGroups.from_layer_windows([16, None, 4]).windows == (None, 4, 16)


def test_at_most_about_max_groups_groups():
    lw = [None] + [8] * 31  # the smallest kind has 1 layer, but 32 layers need groups of >= 4
    g = LayerGroups.from_layer_windows(lw)
    assert g.windows == (None,) + (8,) * 8 and g.num_groups == MAX_GROUPS + 1
    assert g.layers_of(1) == [1, 2, 3, 4] and g.max_layers == 4


@pytest.mark.parametrize("lw, fragment", [
    ([], "layer_windows: give one entry per layer"),
    ([None, 0], "a window must be a positive integer or None, got 0"),
    ([True], "a window must be a positive integer or None, got True"),
    ([4.0], "a window must be a positive integer or None, got 4.0"),
])
def test_bad_layer_windows(lw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        LayerGroups.from_layer_windows(lw)


def test_window_rule_first_live_block_and_blocks_held():
    g = LayerGroups.from_layer_windows([None, 8])
    assert [g.first_live_block(0, p, 4) for p in (0, 20, 100)] == [0, 0, 0]
    # window 8 at position p sees keys p-7..p: the first live block is (p - 7) // 4
    assert [g.first_live_block(1, p, 4) for p in (0, 7, 8, 11, 12, 20)] == [0, 0, 0, 1, 1, 3]
    assert g.blocks_held(0, 20, 4) == 5
    assert g.blocks_held(1, 0, 4) == 0


def test_longest_valid_hit_full_group_stops_at_its_first_miss():
    g = LayerGroups.from_layer_windows([None])
    assert longest_valid_hit([[True, True, False, True]], g, 4, 4) == 2
    assert longest_valid_hit([[True, True, True, True]], g, 4, 3) == 3
    assert longest_valid_hit([[False, True]], g, 4, 2) == 0


def test_longest_valid_hit_window_group_needs_only_the_window():
    g = LayerGroups.from_layer_windows([None, 8])
    full = [True] * 6
    # window group: blocks 0..2 evicted, 3..5 cached. A hit of k blocks ends at k*4 tokens and
    # needs blocks first_live_block(k*4) = (4k - 7) // 4 .. k-1: k=6 needs 4..5 -> valid
    assert longest_valid_hit([full, [False, False, False, True, True, True]], g, 4, 6) == 6
    # a hole at block 4: k=6 needs 4..5 (no), k=5 needs 3..4 (no), k=4 needs 2..3 (no),
    # k=3 needs 1..2 (no), k=2 needs 0..1 (no), k=1 needs 0 (no) -> 0
    assert longest_valid_hit([full, [False, False, False, True, False, True]], g, 4, 6) == 0
    # the full group's miss at block 3 caps the hit at 3 blocks, which needs window blocks 1..2
    assert longest_valid_hit([[True, True, True, False, True, True], [False, True, True, False, False, False]],
                             g, 4, 6) == 3
