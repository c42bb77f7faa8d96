"""Speculative decoding in the engine: which requests draft, their lookahead rows, verification.

The drafts come from a proposer on the worker side (``pagedkv.worker.proposer``: n-gram
prompt lookup, a draft model), run after each step's forward and sampling for the rows of
:func:`draft_rows`; they ride on the request (``Request.draft_token_ids``) to the next step.
A decoding request with ``k`` pending drafts (:func:`pending_drafts`): the
scheduler gives that row ``1 + k`` query tokens (its last token and the drafts) and
allocates their **lookahead slots** all or nothing (no room: a plain one-token decode). One
forward pass returns the logits of every position of the row; the sampler draws a token
``y_j`` at each position ``j`` with the request's own parameters and generator, and the row
keeps ``y_0 .. y_m``, where ``m`` is the number of leading drafts that equal what was drawn
(``d_{j+1} == y_j``).

Why this is exact: the drafts are a point mass ``q = δ(d)``. Standard speculative sampling
(Leviathan et al. 2023; Chen et al. 2023) accepts ``d`` with probability ``min(1, p(d)/q(d))
= p(d)`` and otherwise samples from ``(p - q)+`` normalised, which is ``p`` with ``d``
removed. Drawing ``y ~ p`` and accepting when ``y == d`` (else emitting ``y``) has exactly
those probabilities, so the output distribution is plain sampling's; greedy rows draw the
argmax, so greedy output is token-identical to decoding without speculation. The scheduler
then keeps the accepted tokens' K/V (``num_computed_tokens`` advances by ``m + 1``), trims
the block table to them (a block that held only rejected tokens returns to the pool behind
the step fence) and publishes to the prefix cache only blocks whose tokens are all
confirmed.

A request whose drafts were all rejected backs off: it proposes again after 1, 2, 4 ... 16
plain decode steps (:func:`record_verify`), so free text that rarely repeats its context
pays for few rejected drafts. Requests that speculate: no beam search, no structured-output grammar, no repetition /
presence / frequency penalty (those depend on tokens not yet accepted); every other
parameter works (``n > 1`` siblings speculate one by one, logprobs are those of the kept
tokens, stop strings cut the kept run, ``min_tokens`` masks EOS / stop tokens at each draft
position before it (so no run ends early), ``max_tokens`` and ``max_model_len`` cap the drafts).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from pagedkv.engine.request import Request
from pagedkv.errors import NoFreeBlocksError
from pagedkv.kv.block_table import blocks_needed

#: one sampled token and its logprobs (``None`` unless asked for)
Sampled = tuple[int, Optional[dict[int, float]]]


def draft_rows(running: Sequence[Request], k: int, budget: int, max_model_len: int) -> list[tuple[str, list[int], int]]:
    """After a step, what the proposer (``pagedkv.worker.proposer``) drafts for: per running
    request ``(request id, its token ids, most drafts)``, the most ``min(k, budget - 1,
    draft_budget)`` for a request that decodes one token next, has an output token, may
    speculate and is not backing off, 0 for the others (``budget``: ``max_num_batched_tokens``; a row verifies at
    most ``budget - 1`` drafts; ``k`` 0: speculation off, no rows). The scheduler takes fewer
    when lookahead slots are short."""
    if k <= 0:
        return []
    rows = []
    for r in running:
        most = 0
        # a row that ends its prompt samples its first token alone (an n > 1 group forks its
        # siblings at that step, level with the prompt): drafts from the first output token on
        if r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens and r.spec_wait <= 0 and can_speculate(r):
            most = max(0, min(k, budget - 1, draft_budget(r, max_model_len)))
        rows.append((r.request_id, r.all_token_ids, most))
    return rows


def pending_drafts(req: Request) -> list[int]:
    """The draft token ids proposed for ``req``'s current context (``[]`` if none or if its
    tokens changed since)."""
    return req.draft_token_ids if req.draft_after == req.num_tokens else []


def set_drafts(requests: dict[str, Request], drafts: dict[str, list[int]]) -> None:
    """Hang the proposer's ``drafts`` (``{request id: token ids}``) on the requests still
    known (``requests``), for their current context."""
    for rid, d in drafts.items():
        req = requests.get(rid)
        if req is not None:
            req.draft_token_ids, req.draft_after = list(d), req.num_tokens


def can_speculate(req: Request) -> bool:
    """Whether ``req``'s tokens may be drafted (see the module doc): no beam search, no
    grammar, no repetition / presence / frequency penalty."""
    p = req.sampling_params
    return (not p.use_beam_search and p.structured is None and req.grammar is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


#: most decode steps a request waits before proposing again after fruitless verifies
MAX_BACKOFF = 16


def may_propose(req: Request) -> bool:
    """Whether ``req`` proposes this step: not while it backs off (counts one step down)."""
    if req.spec_wait > 0:
        req.spec_wait -= 1
        return False
    return True


def record_verify(req: Request, accepted: int) -> None:
    """After a verify: drafts accepted reset the back-off; none accepted doubles it (1, 2, 4
    ... ``MAX_BACKOFF`` plain decode steps before the next proposal), so a request whose text
    does not repeat its context soon stops paying for rejected drafts."""
    if accepted:
        req.spec_misses = 0
    else:
        req.spec_misses += 1
        req.spec_wait = min(MAX_BACKOFF, 1 << (req.spec_misses - 1))


def draft_budget(req: Request, max_model_len: int) -> int:
    """The most drafts ``req`` may take this step: one step emits up to ``drafts + 1``
    tokens, within ``max_tokens`` / ``max_total_tokens``, its positions below ``max_model_len``."""
    left = req.sampling_params.max_tokens - req.num_output_tokens - 1
    if req.max_total_tokens:
        left = min(left, req.max_total_tokens - req.num_tokens - 1)
    return max(0, min(left, max_model_len - req.num_tokens))


def lookahead_cap(num_computed: int, spare_blocks: int, block_size: int) -> int:
    """The most drafts a decode row may take (its positions ``num_computed`` (the decode token)
    ``+ 1 ..``) while it takes at most ``spare_blocks`` blocks beyond those its plain decode
    needs: the slots left in the decode token's block plus ``spare_blocks`` whole blocks
    (``spare_blocks < 0`` counts as 0). Units: token positions, blocks per layer group."""
    used = num_computed + 1
    return (blocks_needed(used, block_size) + max(0, spare_blocks)) * block_size - used


def draft_plan(kv: Any, running: Sequence[Request], config: Any,
               k: int) -> tuple[list[tuple[str, list[int], int, Any]], list[tuple[int, int]]]:
    """After a step, the proposer's rows ``(request id, token ids, most drafts, block ids)``
    (:func:`draft_rows`; ``[]`` when ``k`` is 0) and the block copies to apply before it runs:
    with ``config.draft_kv`` (a ``SchedulerConfig``; the draft model's K/V) the drafting rows'
    lookahead slots are reserved (:func:`reserve_draft_slots`), else no block ids, no copies."""
    rows = draft_rows(running, k, config.max_num_batched_tokens, config.max_model_len)
    if not config.draft_kv:
        return [(*r, ()) for r in rows], []
    return reserve_draft_slots(kv, running, rows, config.block_size)


def reserve_draft_slots(kv: Any, running: Sequence[Request], rows: Sequence[tuple[str, list[int], int]],
                        block_size: int) -> tuple[list[tuple[str, list[int], int, list[int]]], list[tuple[int, int]]]:
    """Before a proposer that writes K/V into the target's blocks runs (the draft model's):
    give every drafting row of ``rows`` (``draft_rows``' ``(request id, token ids, most)``,
    in ``running``'s order) the slots its draft K/V and next step's verification need,
    positions ``num_computed .. num_computed + most`` (``kv.allocate_slots``: copy-on-write
    of a shared last block done here), and return each row with its block table
    (group 0, full attention) and the block copies to apply now (target and draft caches).

    ``most`` shrinks to what fits: the slots the request holds, plus the free blocks beyond
    one per running request (a lookahead never takes the block a later decode needs; units:
    blocks per layer group); no room, or an allocation that fails, gives 0 (a plain decode
    next step, nothing written). A decode row's slots past ``num_computed + most`` (a
    reservation its last step did not verify) are given back (``kv.trim``, behind the step
    fence). Never preempts."""
    out, copies = [], []
    for req, (rid, toks, most) in zip(running, rows):
        c = req.num_computed_tokens
        held = kv.num_tokens(rid)
        if most > 0 and not kv.has_request(rid):
            most = 0  # no table to reserve in (never for a decoding request)
        if most > 0:
            spare = kv.num_free_blocks // kv.num_groups - len(running)
            most = min(most, max(held - c - 1, lookahead_cap(c, spare, block_size)))
        want = c + most + 1
        if c == req.num_tokens - 1 and held > want:
            kv.trim(rid, want)  # an unverified reservation: its blocks go back
        elif most > 0 and c < held < want:
            kv.trim(rid, c)
        if most > 0:  # slots held already: a shared block still gets its copy before the write
            try:
                copies += kv.allocate_slots(rid, want - c, c)
            except NoFreeBlocksError:
                most = 0
        out.append((rid, toks, max(0, most), kv.get_block_ids(rid)))
    return out, copies


def split_extra_rows(scheduled: Sequence[tuple[Request, int]], prompt_rows: Sequence[int],
                     drafts: dict[str, list[int]], extra: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split the runner's extra logits rows (``extra`` fp32 ``[rows, vocab]``: per scheduled
    sequence, its prompt-logprob rows or its draft rows, in order) into the prompt rows (in
    order) and ``{request id: [k, vocab]}`` of each speculating row's first ``k`` positions."""
    keep, out, at = [], {}, 0
    for (r, _), p in zip(scheduled, prompt_rows):
        d = drafts.get(r.request_id)
        if d:
            out[r.request_id] = extra[at:at + len(d)]
            at += len(d)
        else:
            keep.append(slice(at, at + p))
            at += p
    prompt = torch.cat([extra[s] for s in keep]) if keep else extra[:0]
    return prompt, out


def sample_with_drafts(sampler: Any, logits: torch.Tensor, reqs: Sequence[Request],
                       draft_logits: dict[str, torch.Tensor], drafts: dict[str, list[int]],
                       cut: Optional[Callable[[Request, list[Sampled]], list[Sampled]]] = None,
                       ) -> tuple[dict[str, Sampled], dict[str, list[Sampled]]]:
    """One sampler call over every row: a plain row's last-position logits (``logits[i]``
    for ``reqs[i]``, fp32 ``[vocab]``), and for a speculating request its ``k`` draft
    positions (``draft_logits``) then its last position. Returns ``({request id: token},
    {request id: kept run y_0 .. y_m})``, each run cut after a stop string completes
    (``cut(request, run)``: the output processor's ``cut_at_stop_string``; ``None``: no cut)."""
    rows, batch, offsets = [], [], []
    for i, r in enumerate(reqs):
        d = draft_logits.get(r.request_id)
        if d is not None:
            rows.append(d)
            batch += [r] * len(d)
            offsets += range(len(d))
        offsets.append(0 if d is None else len(d))
        rows.append(logits[i:i + 1])
        batch.append(r)
    # y_j is output token num_output_tokens + j: min_tokens masks EOS / stop tokens per position
    so = sampler(torch.cat(rows), batch, offsets)
    sampled: dict[str, Sampled] = {}
    runs: dict[str, list[Sampled]] = {}
    at = 0
    for r in reqs:
        d = drafts.get(r.request_id) if r.request_id in draft_logits else None
        n = 1 + (len(d) if d else 0)
        ys = list(zip(so.token_ids[at:at + n], so.logprobs[at:at + n]))
        at += n
        if d:
            m = 0
            while m < len(d) and ys[m][0] == d[m]:
                m += 1
            run = ys[:m + 1]
            runs[r.request_id] = run if cut is None else cut(r, run)
        else:
            sampled[r.request_id] = ys[0]
    return sampled, runs
