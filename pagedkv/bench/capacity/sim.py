"""The capacity replay: requests against a pool of KV blocks, event by event.

The policy (strict FCFS admission, newest-first preemption, contiguous reservation as one
``max_model_len`` block) is described in :mod:`pagedkv.bench.capacity.run`; :func:`simulate`
computes it per event (arrival, finish, out-of-blocks), analytically between events, with no
per-token loop. Token and slot integrals are in token-steps; times in decode steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kv.block_table import blocks_needed


@dataclass
class SimResult:
    """One replay. Token/slot integrals are in token-steps; times in steps unless named ``_s``.

    ``series_*`` hold the state right after each event (step function between events; the
    effective/allocated values grow linearly until the next event).
    """

    block_size: int
    num_blocks: int
    entry_slots: float
    requests: int
    never_fit: int
    eff_token_steps: int = 0
    block_steps: int = 0
    request_steps: int = 0
    busy_steps: int = 0
    queue_steps: int = 0
    peak_concurrency: int = 0
    peak_blocks: int = 0
    peak_effective_tokens: int = 0
    peak_queue: int = 0
    preemptions: int = 0
    last_step: int = 0
    events: int = 0
    admit_step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    finish_step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    series_step: list[int] = field(default_factory=list)
    series_running: list[int] = field(default_factory=list)
    series_effective: list[int] = field(default_factory=list)
    series_blocks: list[int] = field(default_factory=list)
    series_queue: list[int] = field(default_factory=list)

    @property
    def slot_steps(self) -> float:
        """Allocated slot-steps: blocks x block_size plus block-table metadata slot-equivalents."""
        return self.block_steps * (self.block_size + self.entry_slots)

    @property
    def utilization(self) -> float:
        """Effective KV tokens / allocated slots, time-averaged over the busy period."""
        return self.eff_token_steps / self.slot_steps if self.slot_steps else float("nan")

    @property
    def utilization_no_metadata(self) -> float:
        """Like ``utilization`` but without the block-table metadata (internal fragmentation only)."""
        d = self.block_steps * self.block_size
        return self.eff_token_steps / d if d else float("nan")


def _sum_ceil(n: np.ndarray, b: int) -> np.ndarray:
    """``sum_{x=1..n} ceil(x / b)`` elementwise (n >= 0), in closed form."""
    q = n // b
    r = n - q * b
    return b * q * (q + 1) // 2 + r * (q + 1)


def _sum_floor(n: np.ndarray, b: int) -> np.ndarray:
    """``sum_{x=1..n} floor(x / b)`` elementwise (n >= 0), in closed form."""
    q = n // b
    r = n - q * b
    return b * q * (q - 1) // 2 + (r + 1) * q


class _Groups:
    """Blocks and effective token-slots of a request of ``len`` tokens over KV layer groups
    (``windows``: ``None`` = full attention, ``W`` = sliding window), with closed-form sums
    over ``len = 1 .. n``. A window group holds what ``pagedkv.kv`` keeps between steps:
    ``ceil(len / b) - floor(max(0, len - W) / b)`` blocks for its last ``min(len, W)`` tokens.
    ``(None,)`` is the plain paged cache."""

    def __init__(self, windows: tuple, b: int) -> None:
        self.windows, self.b = tuple(windows), b

    def blocks(self, lens):
        return sum(blocks_needed(lens, self.b, w) for w in self.windows)

    def sum_blocks(self, n):
        s = _sum_ceil(n, self.b)
        return sum(s if w is None else s - _sum_floor(np.maximum(0, n - w), self.b) for w in self.windows)

    def eff(self, lens):
        return sum(lens if w is None else np.minimum(lens, w) for w in self.windows)

    def sum_eff(self, n):
        def tri(x):
            return x * (x + 1) // 2
        return sum(tri(n) if w is None else np.where(n <= w, tri(n), tri(w) + (n - w) * w)
                   for w in self.windows)


def simulate(
    arrival_step: np.ndarray,
    context: np.ndarray,
    generated: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    entry_slots: float = 0.0,
    record_series: bool = True,
    progress: Callable[[int], None] | None = None,
    windows: tuple = (None,),
) -> SimResult:
    """Replay requests against a pool of ``num_blocks`` blocks of ``block_size`` token slots.

    ``arrival_step`` (int, sorted ascending): the first step each request may be scheduled;
    ``context`` / ``generated`` (tokens): in its j-th running step a request holds
    ``context + j`` tokens, j = 0 .. generated-1. A request holds ``ceil(len / block_size)``
    blocks; contiguous max reservation is the same pool with ``block_size = max_model_len``
    (every request then holds exactly one block). ``entry_slots``: block-table metadata per
    held block, in token-slot equivalents (bytes per entry / bytes per token).

    Requests whose final length needs more blocks than the pool has can never run; they are
    counted in ``never_fit`` and left out. Policy: strict FCFS admission of the queue head when
    its current blocks fit; when growing requests run out of blocks, the most recently admitted
    ones are preempted (back to the queue front, resumed later with their progress kept in the
    prompt) and nobody is admitted in that step.

    ``windows``: the KV layer groups (see ``_Groups``; default one full group). With a
    window, blocks and effective tokens count every group (token-slots of a block id), and a
    request's block count can drop by one as its window frees a block; the search for the
    first out-of-blocks step then finds a step where the pool is exceeded, which may be one
    or two steps after the first. The transient extra blocks of a chunked prefill (at most
    ``chunk / block_size`` per window group) are not modelled.
    """
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, not {block_size}")
    arr = np.asarray(arrival_step, dtype=np.int64)
    ctx = np.asarray(context, dtype=np.int64)
    gen = np.asarray(generated, dtype=np.int64)
    if not (arr.shape == ctx.shape == gen.shape):
        raise ConfigError("arrival_step, context and generated must have the same length")
    if arr.size and (np.any(np.diff(arr) < 0) or ctx.min() < 1 or gen.min() < 1):
        raise ConfigError("arrivals must be sorted and every request needs >= 1 prompt and output token")
    b = int(block_size)
    cap = int(num_blocks)
    G = _Groups(windows, b)
    # the most blocks a request holds over its life (full groups: at its end)
    fits = G.blocks(ctx + gen - 1) + sum(1 for w in windows if w is not None) <= cap
    res = SimResult(block_size=b, num_blocks=cap, entry_slots=float(entry_slots),
                    requests=int(fits.sum()), never_fit=int((~fits).sum()))
    arr, ctx, gen = arr[fits], ctx[fits], gen[fits]
    n_req = int(arr.size)
    admit = np.full(n_req, -1, dtype=np.int64)
    finish = np.full(n_req, -1, dtype=np.int64)
    res.admit_step, res.finish_step = admit, finish
    if n_req == 0:
        return res

    w_base = ctx.copy()  # prompt length at (re)admission
    w_rem = gen.copy()  # steps still to run at (re)admission
    empty = np.empty(0, dtype=np.int64)
    r_id, r_base, r_start, r_end = empty, empty, empty, empty
    waiting: deque[int] = deque()
    ptr = 0
    k = int(arr[0])
    arr_list = arr.tolist()
    finished = 0
    next_finish = k + 1
    while True:
        res.events += 1
        # 1. arrivals up to this step join the queue
        while ptr < n_req and arr_list[ptr] <= k:
            waiting.append(ptr)
            ptr += 1
        # 2. finishes
        if r_id.size and k >= next_finish:
            keep = r_end > k
            done_ids = r_id[~keep]
            finish[done_ids] = k
            finished += int(done_ids.size)
            r_id, r_base, r_start, r_end = r_id[keep], r_base[keep], r_start[keep], r_end[keep]
        # 3. the running requests' blocks at this step; preempt the newest while they do not fit
        lens = r_base + (k - r_start)
        blocks = G.blocks(lens)
        used = int(blocks.sum())
        preempted = False
        if used > cap:
            csum = np.cumsum(blocks)
            n_keep = int(np.searchsorted(csum, cap, side="right"))  # keep the oldest n_keep
            for j in range(r_id.size - 1, n_keep - 1, -1):
                i = int(r_id[j])
                w_base[i] = int(lens[j])
                w_rem[i] = int(r_end[j]) - k
                waiting.appendleft(i)
            res.preemptions += r_id.size - n_keep
            r_id, r_base, r_start, r_end = r_id[:n_keep], r_base[:n_keep], r_start[:n_keep], r_end[:n_keep]
            lens = lens[:n_keep]
            used = int(csum[n_keep - 1])
            preempted = True
        # 4. FCFS admission
        if not preempted and waiting:
            new: list[int] = []
            while waiting:
                i = waiting[0]
                need = int(G.blocks(w_base[i]))
                if used + need > cap:
                    break
                waiting.popleft()
                used += need
                new.append(i)
                if admit[i] < 0:
                    admit[i] = k
            if new:
                ids = np.asarray(new, dtype=np.int64)
                nb = w_base[ids]
                r_id = np.concatenate([r_id, ids])
                r_base = np.concatenate([r_base, nb])
                r_start = np.concatenate([r_start, np.full(ids.size, k, dtype=np.int64)])
                r_end = np.concatenate([r_end, k + w_rem[ids]])
                lens = np.concatenate([lens, nb])
        n_run = int(r_id.size)
        n_wait = len(waiting)
        eff_now = int(G.eff(lens).sum())
        if record_series:
            res.series_step.append(k)
            res.series_running.append(n_run)
            res.series_effective.append(eff_now)
            res.series_blocks.append(used)
            res.series_queue.append(n_wait)
        if n_run > res.peak_concurrency:
            res.peak_concurrency = n_run
        if n_wait > res.peak_queue:
            res.peak_queue = n_wait
        if progress is not None and res.events % 4096 == 0:
            progress(finished)
        # 5. the next event: a finish, an arrival, or running out of blocks
        if n_run == 0:
            if waiting:  # impossible: an empty pool admits any request that fits at all
                raise AssertionError("queue blocked with nothing running")
            if ptr >= n_req:
                break
            k = arr_list[ptr]
            continue
        next_finish = int(r_end.min())
        nxt = next_finish
        if ptr < n_req and arr_list[ptr] < nxt:
            nxt = arr_list[ptr]
        m = nxt - k
        if m == 1:
            blk, used_last = used, used
        else:
            used_last = int(G.blocks(lens + (m - 1)).sum())
            if used_last > cap:  # growth runs out of blocks before nxt: find the first step
                lo, hi = 1, m - 1  # smallest d in [lo, hi] with blocks(k + d) > cap
                while lo < hi:
                    mid = (lo + hi) // 2
                    if int(G.blocks(lens + mid).sum()) > cap:
                        hi = mid
                    else:
                        lo = mid + 1
                m = lo
                nxt = k + m
                used_last = int(G.blocks(lens + (m - 1)).sum())
            blk = int((G.sum_blocks(lens + (m - 1)) - G.sum_blocks(lens - 1)).sum())
        # integrals over steps k .. nxt-1 (nothing changes but growth)
        res.eff_token_steps += int((G.sum_eff(lens + (m - 1)) - G.sum_eff(lens - 1)).sum())
        res.block_steps += blk
        res.request_steps += n_run * m
        res.busy_steps += m
        res.queue_steps += n_wait * m
        top = int(G.eff(lens + (m - 1)).sum())
        if top > res.peak_effective_tokens:
            res.peak_effective_tokens = top
        if used_last > res.peak_blocks:
            res.peak_blocks = used_last
        k = nxt
    res.last_step = k
    if progress is not None:
        progress(finished)
    return res


def series_bins(res: SimResult, step_s: float, points: int) -> dict[str, list]:
    """The replay over time in ``points`` equal time bins (from the first arrival to the end).

    Per bin: ``t_s`` (bin start, seconds), time-weighted means of ``running`` (requests),
    ``effective_tokens``, ``allocated_slots`` (slot-equivalents, metadata included) and
    ``queue`` (waiting requests), and ``running_max``. Values are held constant between
    events (token counts actually grow by one per step in between; the exact time averages
    are the integrals in the results, not these).
    """
    keys = ("t_s", "running", "running_max", "effective_tokens", "allocated_slots", "queue")
    st = np.asarray(res.series_step, dtype=np.float64)
    if st.size == 0 or res.last_step <= st[0]:
        return {k: [] for k in keys}
    edges = np.linspace(st[0], res.last_step, num=max(points, 1) + 1)
    dt = np.diff(np.append(st, res.last_step))
    pos = np.clip(np.searchsorted(st, edges, side="right") - 1, 0, st.size - 1)
    width = np.diff(edges)

    def bin_mean(q: np.ndarray) -> np.ndarray:
        cum = np.concatenate([[0.0], np.cumsum(q * dt)])
        integral = cum[pos] + q[pos] * (edges - st[pos])
        return np.diff(integral) / width

    running = np.asarray(res.series_running, dtype=np.float64)
    slots = np.asarray(res.series_blocks, dtype=np.float64) * (res.block_size + res.entry_slots)
    # max per bin: the value holding at the bin start and every event inside the bin
    inside = np.searchsorted(st, edges[1:], side="left") - 1
    run_max = np.array([running[a:max(b, a) + 1].max() for a, b in zip(pos[:-1], inside)])
    return {
        "t_s": np.round(edges[:-1] * step_s, 3).tolist(),
        "running": np.round(bin_mean(running), 3).tolist(),
        "running_max": run_max.astype(int).tolist(),
        "effective_tokens": np.round(bin_mean(np.asarray(res.series_effective, np.float64)), 1).tolist(),
        "allocated_slots": np.round(bin_mean(slots), 1).tolist(),
        "queue": np.round(bin_mean(np.asarray(res.series_queue, np.float64)), 2).tolist(),
    }
