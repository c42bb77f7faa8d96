"""ModelRunner (pagedkv/worker/runner.py): the flat batch ``prepare`` builds from hand-made
block tables, copy-on-write ``copy_blocks``, the per-group caches of a hybrid model, and one
forward pass. Block size 4 throughout, so slot = block * 4 + position % 4."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.errors import InvalidRequestError
from pagedkv.worker.runner import ModelRunner

BS = 4


def _runner(num_layers: int = 2, num_blocks: int = 8, layer_windows=None, model=None) -> ModelRunner:
    return ModelRunner(model, get_backend("reference"), num_layers, num_blocks, BS, 2, 8, torch.float32,
                       layer_windows=layer_windows)


def test_prepare_builds_the_flat_batch_from_the_block_tables():
    r = _runner()
    # A: a 3-token prompt in blocks [5, 2]; B: one decode token at position 5, blocks [3, 7]
    inp = r.prepare([[11, 12, 13], [21]], [0, 5], [[5, 2], [3, 7]], [True, True])
    md = inp.metadata
    assert inp.input_ids.tolist() == [11, 12, 13, 21] and inp.input_ids.dtype == torch.int64
    assert inp.positions.tolist() == [0, 1, 2, 5]
    assert md.slot_mapping.tolist() == [20, 21, 22, 29]  # 5*4+0..2; block 7, offset 1
    assert md.block_tables.tolist() == [[5, 2], [3, 7]] and md.block_tables.dtype == torch.int32
    assert md.seq_lens.tolist() == [3, 6]
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert inp.logits_indices.tolist() == [2, 3]  # each sequence's last new token
    assert inp.num_sample_rows == 2


def test_prepare_pads_block_tables_and_returns_only_sampling_rows():
    r = _runner()
    inp = r.prepare([[1, 2, 3, 4, 5, 6], [9]], [0, 0], [[4, 1], [6]], [False, True])
    assert inp.metadata.block_tables.tolist() == [[4, 1], [6, 0]]  # padded with 0
    assert inp.metadata.slot_mapping.tolist() == [16, 17, 18, 19, 4, 5, 24]
    assert inp.logits_indices.tolist() == [6]  # the chunk that does not sample returns no row
    assert inp.num_sample_rows == 1


def test_prepare_appends_prompt_logprob_rows_after_the_sampled_rows():
    r = _runner()
    inp = r.prepare([[11, 12, 13], [21, 22]], [0, 0], [[5], [2]], [True, True], prompt_rows=[2, 0])
    assert inp.logits_indices.tolist() == [2, 4, 0, 1]
    assert inp.num_sample_rows == 2


def test_prepare_refuses_a_position_without_a_block():
    r = _runner()
    with pytest.raises(InvalidRequestError):
        r.prepare([[1, 2, 3, 4, 5]], [0], [[3]], [True])  # position 4 needs a second block


def _fill(r: ModelRunner) -> None:
    """Every slot of every cache gets K = V = a value unique to (cache, slot)."""
    slots = torch.arange(8 * BS, dtype=torch.int64)
    for i, cache in enumerate(r.shared_caches):
        kv = (slots.float() + 100 * i).view(-1, 1, 1).expand(-1, 2, 8).contiguous()
        r.backend.write_kv(cache, kv, -kv, slots)


def _block_values(r: ModelRunner, cache: int) -> list[float]:
    k, v = r.backend.gather_kv(r.shared_caches[cache], torch.arange(8 * BS, dtype=torch.int64))
    assert torch.equal(v, -k)
    return k[:, 0, 0].view(8, BS)[:, 0].tolist()  # the value of each block's first slot


def test_copy_blocks_copies_exactly_the_listed_blocks_in_every_layer():
    r = _runner()
    _fill(r)
    r.copy_blocks([(1, 6), (2, 3)])
    for i in range(2):
        base = 100 * i
        assert _block_values(r, i) == [base + 4 * b for b in (0, 1, 2, 2, 4, 5, 1, 7)]
        k, _ = r.backend.gather_kv(r.shared_caches[i], torch.arange(24, 28, dtype=torch.int64))
        assert k[:, 0, 0].tolist() == [base + 4, base + 5, base + 6, base + 7]  # block 6 = old block 1, whole


def test_copy_blocks_with_no_copies_changes_nothing():
    r = _runner()
    _fill(r)
    r.copy_blocks([])
    assert _block_values(r, 1) == [100 + 4 * b for b in range(8)]


def test_hybrid_layers_share_caches_by_slot_and_get_their_groups_block_tables():
    r = _runner(num_layers=4, layer_windows=[None, 4, None, 4])
    assert len(r.shared_caches) == 2  # max layers per group
    assert r.kv_caches[0] is r.kv_caches[1] is r.shared_caches[0]
    assert r.kv_caches[2] is r.kv_caches[3] is r.shared_caches[1]
    inp = r.prepare([[7, 8, 9, 10, 11]], [0], [[[1, 2], [5, 6]]], [True])  # full: [1, 2]; sliding: [5, 6]
    assert [g.slot_mapping.tolist() for g in inp.groups] == [[4, 5, 6, 7, 8], [20, 21, 22, 23, 24]]
    assert [md is inp.groups[g] for md, g in zip(inp.metadata, (0, 1, 0, 1))] == [True] * 4


def test_execute_returns_the_logits_of_the_sampled_rows(loaded_model):
    from pagedkv.testing.tiny import tiny_random_model

    tiny = tiny_random_model(loaded_model, seed=2)
    mc = tiny.config
    r = ModelRunner(tiny.model, get_backend("reference"), mc.num_layers, 8, BS, mc.num_kv_heads, mc.head_dim,
                    torch.float32)
    logits = r.execute(r.prepare([[5, 6, 7], [8]], [0, 0], [[1], [2]], [True, False]))
    assert logits.shape == (1, mc.vocab_size) and logits.dtype == torch.float32
    alone = ModelRunner(tiny.model, get_backend("reference"), mc.num_layers, 8, BS, mc.num_kv_heads,
                        mc.head_dim, torch.float32)
    ref = alone.execute(alone.prepare([[5, 6, 7]], [0], [[3]], [True]))  # same tokens, another block
    assert torch.allclose(logits, ref, atol=1e-5)
    assert r.execute(r.prepare([[9]], [3], [[1]], [False])).numel() == 0  # no row samples: no logits
