"""The KV state machine of ``test_stateful`` on a hybrid manager: layers ``[full, window 6]``
(two layer groups, block 0 the null block), >= 10,000 random steps.

The fake device holds, per slot, a value depending on the group, the cache keys and the whole
token prefix (group 1's is the negation of group 0's), so after every step:

* every live request reads its own K/V through each group's table: the full group at every
  computed position, the window group at every position its table still maps to a real block
  (placeholders only ever cover positions behind the window, which ``check_invariants`` checks);
* a prefix hit serves, per group, exactly the hit prefix's K/V (never another group's);
* no block freshly handed out was held by a step fence; a failed allocation changed nothing;
* at the end every block is back and the window really freed blocks mid-request.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from pagedkv.errors import NoFreeBlocksError
from tests.kv import test_stateful as base
from tests.kv.test_stateful import BS, MAX_LIVE, KVMachine, _Req

NUM_BLOCKS = 33  # 32 usable + the null block
WINDOWS = [None, 6]
COVERED = {"window_freed_blocks": 0, "cow_copies": 0, "prefix_hits": 0, "deferred_frees": 0, "no_free": 0}


class HybridMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = base.KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, shuffle_seed=3,
                                     layer_windows=WINDOWS)
        self.device = np.full(NUM_BLOCKS * BS, -1, dtype=np.int64)

    def _live_ids(self, rid: str) -> set[int]:
        return {b.block_id for g in range(2) if rid in self.m.group_tables[g]
                for b in self.m.get_block_table(rid, g).live_blocks}

    def _write(self, rid: str, copies, start: int, end: int) -> None:
        for src, dst in copies:
            self.device[dst * BS:(dst + 1) * BS] = self.device[src * BS:(src + 1) * BS]
        if end > start:
            vals = np.asarray(self.reqs[rid].vals[start:end], dtype=np.int64)
            for g, sign in ((0, 1), (1, -1)):
                self.device[self.m.get_block_table(rid, g).slot_mapping(start, end)] = sign * vals

    def _state(self):
        m = self.m
        return ([(b.ref_cnt, b.block_hash) for b in m.pool.blocks], m.pool.free_queue.ids(),
                [{r: (t.ids, t.num_tokens, t.num_null) for r, t in tables.items()} for tables in m.group_tables])

    def _allocate(self, rid: str, n: int, computed: int, hits=()) -> list | None:
        before_ids = self._live_ids(rid)
        state = self._state()
        try:
            copies = self.m.allocate_slots(rid, n, computed, new_computed_blocks=hits)
        except NoFreeBlocksError:
            COVERED["no_free"] += 1
            # sliding (blocks behind every future window) is the one change a failure may keep
            after = self._state()
            assert after[2][0] == state[2][0], "a failed allocation changed the full group"
            return None
        hit_ids = {b.block_id for gh in hits for b in gh}
        fresh = self._live_ids(rid) - before_ids - hit_ids
        assert not fresh & self._fenced(), f"fence-held blocks {fresh & self._fenced()} handed out"
        assert all(dst in fresh for _src, dst in copies)
        return copies

    def _check_hits(self, req: _Req, hits, cached: int):
        """Per group, a hit serves exactly the hit prefix's K/V (the window group's leading
        null entries only behind the window of the hit point)."""
        if not cached:
            return ()
        assert len(hits[0]) * BS == cached < len(req.tokens)
        for g, sign in ((0, 1), (1, -1)):
            for i, b in enumerate(hits[g]):
                if b.block_id == 0:
                    assert g == 1 and (i + 1) * BS <= cached - WINDOWS[1] + 1
                    continue
                got = self.device[b.block_id * BS:(b.block_id + 1) * BS].tolist()
                assert got == [sign * v for v in req.vals[i * BS:(i + 1) * BS]], "hit served wrong K/V"
        return hits

    @precondition(lambda self: self.reqs and len(self.reqs) < MAX_LIVE)
    @rule(pick=st.integers(0, 63))
    def fork(self, pick):
        base.STEPS["n"] += 1
        parent = self._live(pick)
        child = f"r{self.ids}"
        self.ids += 1
        self.m.fork(parent, child)
        self.reqs[child] = self.reqs[parent].clone()
        assert self.m.get_group_block_ids(child) == self.m.get_group_block_ids(parent)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 63))
    def free(self, pick):
        base.STEPS["n"] += 1
        rid = self._live(pick)
        steps = {s for s, rids in self.open.items() if rid in rids}
        ids = sorted(self._live_ids(rid))
        self.m.free(rid)
        del self.reqs[rid]
        self.freed.append(rid)
        if steps:
            self.holds.append((steps, ids))

    @invariant()
    def consistent(self):
        base.check_invariants(self.m)
        for rid, req in self.reqs.items():
            if not req.computed:
                continue
            own = np.asarray(req.vals[: req.computed], dtype=np.int64)
            assert (self.device[self.m.slot_mapping(rid, 0, req.computed)] == own).all(), f"{rid}: full group"
            t = self.m.get_block_table(rid, 1)
            lo = t.num_null * BS
            if lo < req.computed:
                got = self.device[t.slot_mapping(lo, req.computed)]
                assert (got == -own[lo:]).all(), f"{rid}: window group reads foreign K/V"
        live = {b.block_id for tables in self.m.group_tables for t in tables.values() for b in t.live_blocks}
        held = {b.block_id for _r, blocks, _s in self.m.holds for b in blocks}
        assert self._fenced() <= held | live
        assert not self.open.keys() ^ self.m.open_steps.keys()

    covered_keys = ("window_freed_blocks", "cow_copies", "prefix_hits", "deferred_frees")
    covered = COVERED

    def teardown(self):
        super().teardown()
        assert self.m.num_free_blocks == NUM_BLOCKS - 1  # all but the null block


def test_hybrid_kv_state_machine_10k_steps():
    COVERED.update(dict.fromkeys(COVERED, 0))
    base.run_machine(HybridMachine)
    assert all(v > 0 for v in COVERED.values()), COVERED
