"""Sequence groups: one user request's sequences (parallel sampling ``n > 1``, beam search).

A :class:`SequenceGroup` holds the sequences of one request; :class:`SequenceGroups` is the
engine's registry of them and decides everything that adds or drops a sequence of a group:

* parallel sampling: the prompt is prefilled once by sequence 0; when its prefill completes,
  the ``n - 1`` siblings fork its block table (``ref_cnt += 1`` per block; the partly filled
  last block is copied on the first divergent write, seed §02) and sample from the same
  logits row;
* beam search (:mod:`pagedkv.engine.beam` chooses): the first child of a beam continues it
  in place, each further child forks the beam's table, a beam with no child is freed;
* all-or-nothing admission and preemption of a beam group is the scheduler's
  (:class:`pagedkv.engine.gangs.Gangs`).

The groups decide; they never change the scheduler. Every fork and free they want is
returned as a :mod:`pagedkv.engine.decisions` record that the engine hands to the scheduler
(``Scheduler.update`` / ``Scheduler.apply``), the only caller of the KV manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from pagedkv.engine.beam import BeamSearch, beam_stop_ids
from pagedkv.engine.decisions import Decisions, Finish, Fork
from pagedkv.engine.request import Request, RequestMetrics, RequestStatus, SamplingParams, now
from pagedkv.kv.block_table import blocks_needed, request_blocks_needed


@dataclass
class SequenceGroup:
    """A user-visible request: its sequences (index 0 is the one that prefills)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Request] = field(default_factory=list)
    pending_children: int = 0  # n - 1 until the prefill finishes and children fork
    stream: bool = False
    beam: Optional[BeamSearch] = None  # beam search state (SamplingParams.beam_width > 1)
    # counters of sequences that left the group before it finished (replaced beams)
    retired_cow_copies: int = 0
    retired_preemptions: int = 0
    retired_prefix_query: int = 0
    retired_prefix_hits: int = 0
    # SamplingParams.prompt_logprobs: filled by the engine from the prefill's logits rows
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def finished(self) -> bool:
        return self.pending_children == 0 and all(s.is_finished for s in self.seqs)

    def retire(self, req: Request) -> None:
        """Keep the counters of ``req``, which leaves the group before it ends."""
        self.retired_cow_copies += req.num_cow_copies
        self.retired_preemptions += req.num_preemptions
        self.retired_prefix_query += req.num_prefix_query_tokens
        if req.num_prefix_query_tokens:
            self.retired_prefix_hits += max(req.num_cached_tokens, 0)

    def metrics(self) -> RequestMetrics:
        """Times (seconds) and counters summed over the group's sequences, retired ones too."""
        seqs = self.seqs
        first = min(seqs, key=lambda s: s.index)
        finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=first.scheduled_time,
            first_token_time=first.first_token_time,
            finish_time=max(finish_times) if self.finished and finish_times else None,
            num_preemptions=sum(s.num_preemptions for s in seqs) + self.retired_preemptions,
            prefix_query_tokens=sum(s.num_prefix_query_tokens for s in seqs) + self.retired_prefix_query,
            prefix_hit_tokens=sum(max(s.num_cached_tokens, 0) for s in seqs if s.num_prefix_query_tokens)
            + self.retired_prefix_hits,
            num_cow_copies=sum(s.num_cow_copies for s in seqs) + self.retired_cow_copies,
        )


def _sibling(src: Request, request_id: str, params: SamplingParams, parent_id: str, index: int) -> Request:
    """A new sequence with ``src``'s prompt, identity and limits, running from ``src``'s
    progress (its blocks are forked by the caller)."""
    child = Request(
        request_id=request_id, prompt_token_ids=src.prompt_token_ids, sampling_params=params,
        arrival_time=src.arrival_time, cache_keys=src.cache_keys, priority=src.priority,
        prompt=src.prompt, eos_token_ids=src.eos_token_ids, max_total_tokens=src.max_total_tokens,
        parent_id=parent_id, index=index,
    )
    child.scheduled_time = src.scheduled_time
    return child


class SequenceGroups:
    """The engine's registry of groups (by request id and by sequence id)."""

    def __init__(self) -> None:
        self.by_id: dict[str, SequenceGroup] = {}
        self.by_seq: dict[str, SequenceGroup] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, request_id: str) -> Optional[SequenceGroup]:
        return self.by_id.get(request_id)

    def of(self, seq_id: str) -> Optional[SequenceGroup]:
        """The group a sequence belongs to (None once the group is gone)."""
        return self.by_seq.get(seq_id)

    def add(self, group: SequenceGroup, first: Request) -> None:
        """Register ``group`` with its first sequence (the engine queues that sequence in
        the scheduler)."""
        group.seqs.append(first)
        p = group.params
        if p.use_beam_search:
            group.beam = BeamSearch(
                p.beam_width, first.max_total_tokens - first.num_prompt_tokens,
                beam_stop_ids(first.eos_token_ids, p.ignore_eos, p.stop_token_ids),
                p.length_penalty, p.early_stopping,
            )
            group.beam.start(first)
        self.by_id[group.request_id] = group
        self.by_seq[first.request_id] = group

    def abort(self, request_id: str) -> list[str]:
        """Stop a group from forking more sequences; returns the ids of its sequences, for
        the scheduler to abort (``[]`` for an unknown id)."""
        group = self.by_id.get(request_id)
        if group is None:
            return []
        group.pending_children = 0
        return [s.request_id for s in group.seqs]

    def finished_ids(self) -> set[str]:
        return {rid for rid, g in self.by_id.items() if g.finished}

    def pop(self, request_id: str) -> None:
        """Forget a finished group."""
        group = self.by_id.pop(request_id)
        for s in group.seqs:
            self.by_seq.pop(s.request_id, None)

    # ---- parallel sampling -------------------------------------------------------------
    def expand_forks(self, out: Any, sampling: list[Request]) -> tuple[list[int], list[Request], list[Fork]]:
        """``sampling``: the sequences whose logits rows the step returned (row i = sequence
        i). When one of them is a group's first sequence that just finished its prefill, its
        n - 1 siblings are made to fork it and join the step (``Scheduler.update`` applies
        the forks). Returns ``(rows, sequences, forks)`` of the running sequences only (an
        abort may have landed during the forward pass): every sibling reuses its parent's
        row."""
        rows: list[int] = []
        reqs: list[Request] = []
        forks: list[Fork] = []
        for row, req in enumerate(sampling):
            if req.status != RequestStatus.RUNNING:
                continue
            rows.append(row)
            reqs.append(req)
            group = self.by_seq.get(req.request_id)
            if group is None or group.pending_children == 0:
                continue
            # the parent's count is advanced in update(); the children start level with it
            n_new = next(n for r, n in out.scheduled if r is req)
            seed = group.params.seed
            for idx in range(1, group.pending_children + 1):
                params = group.params if seed is None else replace(group.params, seed=seed + idx, n=1)
                child = _sibling(req, f"{group.request_id}#{idx}", params, group.request_id, idx)
                child.num_cached_tokens = req.num_cached_tokens
                forks.append(Fork(req, child, req.num_computed_tokens + n_new))
                group.seqs.append(child)
                self.by_seq[child.request_id] = group
                rows.append(row)
                reqs.append(child)
            group.pending_children = 0
        return rows, reqs, forks

    # ---- beam search -------------------------------------------------------------------
    def offer_beam_rows(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]):
        """Hand the logits rows of beam sequences to their search (they are not sampled).
        Returns ``(rows, sequences, beam group ids offered to)`` of what remains to sample."""
        keep_rows, keep_reqs, touched = [], [], set()
        for row, r in zip(rows, reqs):
            group = self.by_seq.get(r.request_id)
            if group is None or group.beam is None:
                keep_rows.append(row)
                keep_reqs.append(r)
            elif r.status == RequestStatus.RUNNING:
                group.beam.offer(r, logits[row])
                touched.add(group.request_id)
        return keep_rows, keep_reqs, touched

    def beam_step(self, request_id: str) -> Decisions:
        """One beam-search step once every live beam has its logits (call after
        ``Scheduler.update``): pick the next beams; the first child of a beam continues it
        in place (its token appended here), each further child is to fork the beam's block
        table (copy-on-write of the partly filled block on its first write), beams with no
        child are to be freed (through the step fence). Returns those forks and finishes and
        the tokens generated, for ``Scheduler.apply``."""
        group = self.by_id[request_id]
        bs = group.beam
        dec = Decisions()
        if bs is None or not bs.ready():
            return dec
        choices = bs.step()
        t = now()
        for b in bs.beams:
            if b.first_token_time is None:
                b.first_token_time = t
        if bs.done:  # every live beam is freed; the output processor decodes the hypotheses
            dec.finishes = [Finish(b, RequestStatus.FINISHED_STOPPED) for b in bs.beams]
            return dec
        # forks first: they copy their source's tokens before an in-place append changes them
        # a beam whose grammar fails on its token (structured outputs) is dropped: a fork is
        # not made, a continued beam finishes with "error" (never extended unconstrained)
        continued: set[str] = set()
        order: list[tuple[Request, Any]] = []  # the new beams with their choices, best first
        in_place: list[tuple[Request, int]] = []
        for c in choices:
            src = c.source
            if src.request_id not in continued:
                continued.add(src.request_id)
                order.append((src, c))
                in_place.append((src, c.token))
                continue
            child = _sibling(src, f"{group.request_id}#beam{bs.num_forks + 1}", src.sampling_params,
                             group.request_id, 0)
            for tok in src.output_token_ids:
                child.append_output_token(tok)
            child.grammar = src.grammar.copy() if src.grammar is not None else None
            if not child.append_output_token(c.token):
                continue
            bs.num_forks += 1
            child.num_cached_tokens = 0  # it never looked anything up itself
            child.first_token_time = src.first_token_time
            dec.forks.append(Fork(src, child, src.num_computed_tokens))
            self.by_seq[child.request_id] = group
            order.append((child, c))
        failed: set[str] = set()
        for src, tok in in_place:
            if not src.append_output_token(tok):
                failed.add(src.request_id)
                group.retire(src)
                dec.finishes.append(Finish(src, RequestStatus.FINISHED_ERROR))
                self.by_seq.pop(src.request_id, None)
        order = [(b, c) for b, c in order if b.request_id not in failed]
        new_beams, kept = [b for b, _ in order], [c for _, c in order]
        for old in bs.beams:
            if old.request_id not in continued:
                group.retire(old)
                dec.finishes.append(Finish(old, RequestStatus.FINISHED_STOPPED))
                self.by_seq.pop(old.request_id, None)
        for i, b in enumerate(new_beams):
            b.index = i
        bs.advance(kept, new_beams)
        group.seqs = list(new_beams)
        dec.generated_tokens = len(new_beams)
        return dec


def request_blocks(num_prompt_tokens: int, total_tokens: int, params: SamplingParams, block_size: int,
                   enable_paging: bool, max_model_len: int, windows: Sequence[int | None] = (None,),
                   chunk: int | None = None) -> int:
    """KV blocks a request holds at its largest (``total_tokens`` = prompt + max output,
    clipped to ``max_model_len``), summed over the layer groups of ``windows`` (per group its
    sliding window in tokens, ``None`` = full; default one full group): paged, its own
    tokens; a beam search, the shared prompt plus, per beam, its own output blocks and one
    partly filled copy; without paging, the whole ``max_model_len`` reservation per
    sequence. A window group holds at most what ``pagedkv.kv.block_table.blocks_needed``
    gives for ``chunk`` tokens per step, per sequence. A request needing more than the pool
    could never run."""
    if enable_paging and not params.use_beam_search:  # its own tokens, per group
        return request_blocks_needed(total_tokens, block_size, windows, chunk)
    if enable_paging:  # a beam search
        per_beam = blocks_needed(total_tokens - num_prompt_tokens, block_size) + 1
        need = blocks_needed(num_prompt_tokens, block_size) + params.beam_width * per_beam
    else:
        need = blocks_needed(max_model_len, block_size) * (params.beam_width if params.use_beam_search else 1)
    per_seq = params.beam_width + 1 if params.use_beam_search else 1
    return sum(need if w is None else min(need, per_seq * blocks_needed(total_tokens, block_size, w, chunk))
               for w in windows)
