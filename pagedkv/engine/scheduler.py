"""Continuous batching at iteration level, with chunked prefill, admission control,
preemption by recompute and abort (Orca-style iteration scheduling; PagedAttention §4.5).

Every step the scheduler spends a token budget (``max_num_batched_tokens``): first on the
running requests (one decode token each, or the next chunk of an unfinished prefill), then
on waiting requests (a prefill chunk each), admitted only while blocks are available above a
small watermark and fewer than ``max_num_seqs`` requests run. When a running request cannot
get a block, the scheduler preempts a victim: FCFS, the latest admitted; the priority policy,
the running request with the largest ``priority`` value (lower = served first, vLLM's
convention), then the latest arrival, chosen among *all* running requests: one already
scheduled this step is taken back out of it (its tokens, copy-on-write copies and drafts; its
blocks are freed with its table before the step runs). The victim's blocks are freed, its
progress reset, and it is requeued first; on resume it recomputes prompt + outputs (hitting
its own cached blocks if prefix caching is on; the prefix-cache query/hit counters count only
a request's first admission, as vLLM's do).

Beam groups are gangs, scheduled all or nothing (see ``gangs.Gangs``): preempting a
member preempts the whole gang, and a waiting gang is admitted at once behind one leader that
recomputes the shared prefix, which the others then fork.

The scheduler alone changes its queues, the KV manager and a request's status. What the
sequence groups, the beam search and the stop strings decide reaches it as
:mod:`pagedkv.engine.decisions` records: ``update(out, sampled, forks)`` then
``apply(decisions)``. It needs no model: hand-made ``Request`` objects drive it (tests).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Optional

from pagedkv.engine.decisions import Decisions, Fork
from pagedkv.engine.gangs import Gangs
from pagedkv.engine.request import Request, RequestStatus, now
from pagedkv.engine.stats import EngineStats, collect_stats
from pagedkv.engine.spec_decode import can_speculate, draft_plan, lookahead_cap, may_propose, pending_drafts, record_verify, set_drafts
from pagedkv.engine.step_plan import SchedulerConfig, SchedulerOutput, SchedulerStallError, SchedulerStats, unschedule
from pagedkv.errors import NoFreeBlocksError
from pagedkv.kv import KVCacheManager, check_invariants
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.tiers import cached_tokens_by_tier


class Scheduler:
    """Owns the waiting queue and the running list; allocates through the KV manager."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = kv_manager = KVCacheManager(
            config.num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_paging=config.enable_paging,
            max_model_len=config.max_model_len,
            shuffle_seed=config.shuffle_seed, tiers=config.kv_tiers, layer_windows=config.layer_windows)
        self.enable_prefix_caching = config.enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # beam groups scheduled all or nothing (see the module doc)
        self.gangs = Gangs()
        self.num_spec = config.num_speculative_tokens  # most drafts per row (0: no speculation)
        # Head-room kept free for running requests to grow into. Without paging a request
        # reserves its whole max_model_len up front and never grows, so none is needed.
        self._watermark_blocks = (
            int(config.watermark * kv_manager.num_blocks) if config.enable_paging else 0
        )

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Request, gang: bool = False) -> None:
        """Queue a new request (its prompt tokens counted in ``stats``); ``gang``: it is the
        first sequence of a beam group, whose sequences are scheduled all or nothing."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if gang:
            self.gangs.ids.add(req.parent_id or req.request_id)
        self.stats.num_prompt_tokens += req.num_prompt_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, src: Request, child: Request, num_computed: int) -> None:
        """``child`` shares ``src``'s blocks (ref_cnt += 1; a partly filled last block is
        copied on its first divergent write) and runs from ``num_computed`` tokens."""
        self.kv.fork(src.request_id, child.request_id)
        child.num_computed_tokens = num_computed
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (stop, length or abort) a request; its blocks are freed through the KV
        manager, which defers the release while a step that used them is in flight."""
        if req.status.finished:
            return  # abort twice / abort while finishing: freed once
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.gangs.forget(req)
        req.status = status
        req.finish_time = now()
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        gid = req.parent_id
        if gid in self.gangs.ids and not any(r.parent_id == gid for r in self.requests.values()):
            self.gangs.ids.discard(gid)  # the gang's last sequence

    # ---- scheduling ------------------------------------------------------------------
    def _queue_key(self, req: Request):
        return (req.priority, req.arrival_time)

    def _next_waiting(self) -> Optional[Request]:
        cands = self.gangs.unparked(self.waiting)
        if not cands:
            return None
        if self.config.policy == "priority":
            return min(cands, key=self._queue_key)
        return cands[0]

    def _fork_members(self, leader: Request) -> None:
        """The leader computed the gang's shared prefix: its members share those blocks
        (copy-on-write of a partly filled last one) and run on from there."""
        at, members = self.gangs.release(leader)
        for m in members:
            if m.status.finished or m not in self.waiting:
                continue
            self.waiting.remove(m)
            self.fork(leader, m, at)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=self._queue_key)
        return candidates[-1]

    def _preempt(self, victim: Request) -> None:
        self.gangs.unpark(victim)
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _prefix_in_flight(self, req: Request, num_cached: int) -> bool:
        """Whether a running request is still computing the block right after ``req``'s
        prefix hit, with the same tokens and cache keys. Admitting ``req`` now would compute
        that block a second time; once it is published ``req`` hits it instead (seed §02:
        share, don't recompute). Only a block ``req`` could hit counts (a whole block before
        its last token). With chunked prefill the running request takes the whole token
        budget until its last chunk, so this rarely delays admission by more than a step."""
        bs = self.kv.block_size
        end = num_cached + bs
        if end > (req.num_tokens - 1) // bs * bs:
            return False
        toks = None
        for r in self.running:
            if r.num_computed_tokens < end <= r.num_tokens and r.cache_keys == req.cache_keys:
                if toks is None:
                    toks = req.all_token_ids[:end]
                if r.all_token_ids[:end] == toks:
                    return True
        return False

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Request] = []
        drafts: dict[str, list[int]] = {}
        step_copies: dict[str, list[tuple[int, int]]] = {}  # per request, the copies it added

        # 0) a gang split by last step's preemption: preempt its running members too (all or
        #    nothing; they would otherwise hold blocks waiting for siblings that can't get any)
        for r in self.gangs.split_members(self.waiting, self.running):
            self._preempt(r)
            preempted.append(r)

        # 1) running requests: decode tokens and unfinished prefill chunks
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            end = self.gangs.fork_point(req, req.num_tokens)  # a leader stops at the fork
            n = min(end - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            if n == end - req.num_computed_tokens == 1 and self.num_spec and can_speculate(req) and may_propose(req):
                # the lookahead may not take the blocks the later running rows' decodes need
                spare = self.kv.num_free_blocks // self.kv.num_groups - (len(self.running) - i - 1)
                cap = min(budget - 1, max(lookahead_cap(req.num_computed_tokens, spare, cfg.block_size),  # or reserved
                                          self.kv.num_tokens(req.request_id) - req.num_computed_tokens - 1))
                d = pending_drafts(req)[:max(0, cap)]  # proposed after the last step (worker side)
                try:  # lookahead slots for the drafts, all or nothing (else a plain decode)
                    c = self.kv.allocate_slots(req.request_id, 1 + len(d), req.num_computed_tokens) if d else None
                except NoFreeBlocksError:
                    c = None
                if c is not None:
                    req.num_cow_copies += len(c)
                    copies += c
                    step_copies[req.request_id] = c
                    drafts[req.request_id] = d
                    scheduled.append((req, 1 + len(d)))
                    budget -= 1 + len(d)
                    i += 1
                    continue
            while True:
                try:
                    c = self.kv.allocate_slots(req.request_id, n, req.num_computed_tokens)
                    if c:
                        req.num_cow_copies += len(c)
                        copies += c
                        step_copies[req.request_id] = c
                    ok = True
                    break
                except NoFreeBlocksError:
                    # the victim is chosen among *all* running requests: with the priority
                    # policy one already scheduled this step may be the least important
                    victim = self._pick_victim(self.running if self.config.policy == "priority"
                                               else self.running[i:])
                    j = self.running.index(victim)
                    if j < i:  # scheduled this step: take its tokens, slots and copies back
                        budget += unschedule(victim, scheduled, copies, drafts, step_copies)
                        i -= 1
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        ok = False
                        break
            if not ok:
                break  # the request itself was preempted; later ones were already victims
            scheduled.append((req, n))
            budget -= n
            i += 1

        # 2) waiting requests (not in a step that had to preempt)
        while self.waiting and budget > 0 and not preempted and len(self.running) < cfg.max_num_seqs:
            req = self._next_waiting()
            if req is None:
                break
            # a gang enters whole: req leads, computing the tokens every member shares (at
            # least one short of its end, so it samples nothing), then the others fork it
            members, end = self.gangs.members_and_fork_point(req, self.waiting)
            if members:
                if self.running and len(self.running) + 1 + len(members) > cfg.max_num_seqs:
                    break
            hit_blocks, num_cached = [], 0
            # prompt logprobs need every prompt position's logits: no lookup (see SamplingParams)
            if self.enable_prefix_caching and req.sampling_params.prompt_logprobs is None:
                # a gang's leader must compute up to the fork
                hit_blocks, num_cached = self.kv.get_computed_blocks(
                    req.request_id, req.all_token_ids, req.cache_keys, end - 1 if members else None,
                    record=req.num_cached_tokens < 0,  # the stats count a first computation only
                )
                if self._prefix_in_flight(req, num_cached):
                    break  # a running prefill is computing its next block: hit it next step
            remaining = end - num_cached
            n = min(remaining, budget)
            if not cfg.enable_chunked_prefill and n < remaining:
                break
            need = self.kv.num_blocks_needed(num_cached + n, hit_blocks)  # every layer group
            if members and self.running:
                # what the members' suffixes (and their copies of a shared partial block) take
                bs = self.kv.block_size
                need += self.kv.num_groups * sum(blocks_needed(r.num_tokens, bs) - end // bs for r in [req] + members)
            free_after = self.kv.num_free_blocks - need
            if free_after < 0 or (self.running and free_after < self._watermark_blocks):
                break  # head-of-line waits for blocks
            try:
                c = self.kv.allocate_slots(
                    req.request_id, n, num_cached, new_computed_blocks=hit_blocks
                )
            except NoFreeBlocksError:
                break
            self.waiting.remove(req)
            if c:
                req.num_cow_copies += len(c)
                copies += c
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.num_cached_tokens_by_tier = cached_tokens_by_tier(
                    hit_blocks[0] if self.kv.num_groups > 1 and hit_blocks else hit_blocks, self.kv.block_size)
                req.num_prefix_query_tokens = req.num_tokens if self.enable_prefix_caching else 0
            if req.scheduled_time is None:
                req.scheduled_time = now()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            if members:
                self.gangs.park(req, end, members)

        step_id = self.kv.begin_step([r.request_id for r, _ in scheduled])
        used = cfg.max_num_batched_tokens - budget
        st = self.stats
        st.num_steps += 1
        st.num_batched_tokens_total += used
        st.peak_running = max(st.peak_running, len(self.running))
        if scheduled:
            st.peak_used_blocks = max(st.peak_used_blocks, self.kv.num_used_blocks)
        get_ids = self.kv.get_block_ids if self.kv.num_groups == 1 else self.kv.get_group_block_ids
        block_ids = [get_ids(r.request_id) for r, _ in scheduled]
        transfer = self.kv.take_transfer() if scheduled else None  # else it waits for a step
        return SchedulerOutput(scheduled, copies, preempted, step_id, used, block_ids, transfer, drafts)

    def draft_rows(self) -> tuple[list[tuple[str, list[int], int, Any]], list[tuple[int, int]]]:
        """Rows for the worker's proposer after a step and the block copies to apply first (``spec_decode.draft_plan``)."""
        return draft_plan(self.kv, self.running, self.config, self.num_spec)

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Keep the proposer's ``{request id: draft ids}`` on the requests for the next step."""
        set_drafts(self.requests, drafts)

    def persist_kv(self) -> Any:
        """Before a shutdown (no step in flight): the ``KVTransfer`` that copies every cached
        block to the disk tier (``None`` without one)."""
        return self.kv.persist()

    def end_step(self, out: SchedulerOutput) -> None:
        """Close ``out``'s step fence (idempotent): blocks freed while it ran return to the
        pool. ``update`` does this; call it directly for an empty or a failed step."""
        self.kv.end_step(out.step_id)

    def check_stall(self, out: SchedulerOutput) -> None:
        """After an empty step: raise ``SchedulerStallError`` if nothing runs and nothing will
        ever free a block (every further step would do the same)."""
        if out.preempted or not self.has_unfinished() or self.kv.open_steps or self.kv.holds:
            return
        raise SchedulerStallError(
            f"scheduler stalled: {len(self.running)} running / {len(self.waiting)} waiting "
            f"sequences but nothing can be scheduled ({self.kv.num_free_blocks} of "
            f"{self.kv.num_blocks} blocks free; running: "
            f"{[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in self.running][:8]}, "
            f"waiting: {[(r.request_id, r.num_tokens) for r in self.waiting][:8]}). "
            "This is a bug; abort the requests to free their blocks."
        )

    # ---- after the model ran ---------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, tuple[int, Optional[dict[int, float]]]],
        forks: Iterable[Fork] = (),
        runs: Optional[dict[str, list[tuple[int, Optional[dict[int, float]]]]]] = None,
    ) -> list[Request]:
        """Apply ``forks`` first (``n > 1`` siblings of a prefill that ends this step: they
        join ``out.scheduled`` with 0 new tokens), then advance ``num_computed_tokens``,
        append the ``sampled`` tokens (``{sequence id: (token id, logprobs or None)}``),
        apply stop conditions (EOS, stop token ids, max_tokens, max_model_len), publish full
        blocks to the prefix cache, then close the step fence. A speculative row keeps its
        ``runs`` entry (``y_0 .. y_m``: ``m`` accepted drafts and one sampled token; see
        ``spec_decode``), up to a stop; its table is trimmed to the computed tokens. Returns the requests that
        finished this step (stop strings and beam steps come after, via :meth:`apply`)."""
        for f in forks:
            self.fork(f.parent, f.child, f.num_computed_tokens)
            out.scheduled.append((f.child, 0))
        self.stats.num_generated_tokens += len(sampled)
        finished: list[Request] = []
        t = now()
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step was in flight
            if req.request_id in out.drafts:
                self._keep_run(req, out.drafts[req.request_id], (runs or {})[req.request_id], t, finished)
                continue
            req.num_computed_tokens += n
            if self.enable_prefix_caching:
                self.kv.cache_blocks(
                    req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_keys
                )
            if self.gangs.ready_to_fork(req):
                self._fork_members(req)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue  # a prefill chunk that does not end the known tokens
            token_id, lp = tok
            if not req.append_output_token(token_id, lp):  # its grammar failed: token dropped
                self.grammar_failed(req)
                finished.append(req)
                continue
            if req.first_token_time is None:
                req.first_token_time = t
            status = req.stop_status(token_id)
            if status is not None:
                self.finish_request(req, status)
                finished.append(req)
        self.kv.end_step(out.step_id)
        return finished

    def _keep_run(self, req: Request, drafts: list[int], run: list, t: float, finished: list[Request]) -> None:
        """Append a speculative row's kept tokens up to a stop; the last token and the
        accepted drafts are computed; the lookahead past them is released."""
        status, kept = None, 0
        for token_id, lp in run:
            if not req.append_output_token(token_id, lp):  # a grammar (never speculates) failed
                status = req.grammar_failure(self.stats.grammar_failures)
                break
            kept += 1
            if (status := req.stop_status(token_id)) is not None:
                break
        req.first_token_time = req.first_token_time or t
        st = self.stats
        st.num_spec_rows, st.num_draft_tokens = st.num_spec_rows + 1, st.num_draft_tokens + len(drafts)
        st.num_accepted_tokens += len(run) - 1
        record_verify(req, len(run) - 1)
        st.num_generated_tokens += kept
        req.num_computed_tokens += kept
        self.kv.trim(req.request_id, req.num_computed_tokens)
        if self.enable_prefix_caching:  # every block up to num_computed holds confirmed tokens
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_keys)
        if status is not None:
            self.finish_request(req, status)
            finished.append(req)

    def apply(self, decisions: Decisions) -> None:
        """Apply the decisions taken after :meth:`update` (beam steps, stop strings): forks,
        then finishes (see ``decisions.Finish`` for one that already finished); count the
        tokens generated outside the sampler; update ``stats.peak_shared_blocks``."""
        for f in decisions.forks:
            self.fork(f.parent, f.child, f.num_computed_tokens)
        for d in decisions.finishes:
            req = d.request
            if d.stop_reason is not None:  # a stop string (the output processor found it)
                req.stop_reason = d.stop_reason
            if not req.status.finished and d.status == RequestStatus.FINISHED_ERROR:
                self.grammar_failed(req)  # a beam whose grammar failed: counted
            elif not req.status.finished:
                self.finish_request(req, d.status)
            elif req.status == RequestStatus.FINISHED_LENGTH and d.status == RequestStatus.FINISHED_STOPPED:
                req.status = d.status  # a stop string in the final text
        self.stats.num_generated_tokens += decisions.generated_tokens
        self.track_shared_blocks()

    def check_invariants(self) -> None:
        """Run the KV invariant checker (``InvariantViolation`` on inconsistent bookkeeping)."""
        check_invariants(self.kv)

    def track_shared_blocks(self) -> None:
        """Update ``stats.peak_shared_blocks`` (call at the end of a step, after forks)."""
        self.stats.peak_shared_blocks = max(self.stats.peak_shared_blocks, self.num_shared_blocks())

    def count_finished_request(self) -> None:
        """Count one user request (all its sequences) whose final output went out."""
        self.stats.num_finished_requests += 1

    def engine_stats(self) -> EngineStats:
        """The counters and the KV pool's state now, as :class:`EngineStats`."""
        return collect_stats(self.kv, self.stats, len(self.running), len(self.waiting))

    def num_shared_blocks(self) -> int:
        """Blocks referenced more than once right now (by several block tables, e.g. a
        prefix hit, a fork or a beam; a step-fence hold also counts as a reference)."""
        return self.kv.pool.num_shared

    def reset_prefix_cache(self) -> int:
        """Forget every published block hash (K/V and tables stay; a KV event
        ``AllBlocksCleared`` is published). Returns how many pool blocks were cached."""
        return self.kv.reset_prefix_cache()

    def snapshot(self) -> dict:
        """``{"kv": KVCacheManager.snapshot(), "requests": [...]}`` (running, then waiting);
        each request has request_id, parent_id, index, status, prompt_tokens, output_tokens,
        num_tokens, num_computed_tokens (tokens)."""
        reqs = [
            {
                "request_id": r.request_id,
                "parent_id": r.parent_id or r.request_id,
                "index": r.index,
                "status": r.status.name.lower(),
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "num_tokens": r.num_tokens,
                "num_computed_tokens": r.num_computed_tokens,
            }
            for r in list(self.running) + list(self.waiting)
        ]
        return {"kv": self.kv.snapshot(), "requests": reqs}

    def grammar_failed(self, req: Request) -> None:
        """Finish ``req`` whose structured-output grammar failed at run time (finish reason
        ``"error"``, its blocks freed, the failure counted); its text is what the grammar
        accepted so far."""
        if not req.status.finished:
            self.finish_request(req, req.grammar_failure(self.stats.grammar_failures))

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
                out.append(req)
        return out
