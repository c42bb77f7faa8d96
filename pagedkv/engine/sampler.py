"""Turn the last-position logits of each scheduled sequence into a token.

Greedy rows take the first maximum of their row. Random rows draw from each request's own
``torch.Generator`` (seeded by ``SamplingParams.seed``), one row at a time, so a seeded
request samples the same tokens alone or in any batch. Sampling inverts each row's
cumulative distribution (:func:`_inverse_cdf_pick`): one uniform number per token from the
request's generator, whatever the vocabulary size and the filters. On the CPU both picks run in C
(:mod:`pagedkv.ops.sample_ops`, the same tokens but for fp64 rounding ties) when it builds,
else in torch.

Logits are adjusted per request before any pick: penalties (:func:`apply_penalties`), then
``logit_bias`` (:func:`apply_logit_bias`), then ``min_tokens`` (:func:`apply_min_tokens`: EOS and
``stop_token_ids`` at -inf until the request has ``min_tokens`` output tokens), then a structured-output grammar's token mask
(:mod:`pagedkv.engine.structured`, batched over the rows that have one). Logprobs are those of the adjusted logits
(before temperature). A row whose adjusted logits hold NaN or +inf, or are all -inf, or
whose sampled token would get a non-finite logprob, raises :class:`SamplingError` naming
its requests: the validated parameter ranges make this unreachable, and the guard keeps a
bug from becoming a NaN in a response. The sampler changes no request state, so the step
that raised can be retried without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedkv.ops import sample_ops
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.structured import apply_grammar_masks, constrained_rows
from pagedkv.errors import PagedKVError


class SamplingError(PagedKVError, ArithmeticError):
    """Sampling cannot give these requests a valid token: a non-finite logit or logprob, or
    a ``logit_bias`` token outside the vocabulary. ``request_ids``: the requests (engine
    sequence ids) at fault; the others of the batch are not."""

    def __init__(self, message: str, request_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[dict[int, float]]]  # per row: {token_id: logprob}, sampled first


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition (prompt + output tokens, divides positive / multiplies negative logits),
    presence and frequency penalties (output tokens). ``logits`` ``[vocab]`` fp32, in place."""
    p = req.sampling_params
    if p.repetition_penalty != 1.0 and req.num_tokens:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Add ``req``'s ``logit_bias`` (token id -> bias) to ``logits`` ``[vocab]`` fp32, in
    place. Raises :class:`SamplingError` for a token id outside ``[0, vocab)``."""
    bias = req.sampling_params.logit_bias or {}
    ids = list(bias)
    if not all(0 <= t < logits.shape[0] for t in ids):
        raise SamplingError(f"logit_bias token ids must be in [0, {logits.shape[0]})", [req.request_id])
    logits[torch.tensor(ids, dtype=torch.long)] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype)
    return logits


def min_tokens_stop_ids(req: Request) -> list[int]:
    """The tokens ``min_tokens`` holds back: EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    p = req.sampling_params
    ids = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        ids.update(req.eos_token_ids)
    return sorted(ids)


def apply_min_tokens(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Set the logits of :func:`min_tokens_stop_ids` (those in the vocabulary) to -inf, in
    place (``logits`` ``[vocab]`` fp32): ``req`` has fewer than ``min_tokens`` output
    tokens at this position."""
    ids = [t for t in min_tokens_stop_ids(req) if t < logits.shape[0]]
    if ids:
        logits[torch.tensor(ids, dtype=torch.long)] = float("-inf")
    return logits


def _check_finite(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Raise :class:`SamplingError` for rows of ``logits`` ``[R, vocab]`` with a NaN or +inf,
    or no finite value at all (softmax of those is NaN). One reduction when all are finite:
    the sum is finite only if every value is (a finite sum that overflows, or a -inf from a
    logit bias, takes the exact path below)."""
    if math.isfinite(float(logits.sum())):
        return
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    if bool(bad.any()):
        ids = [requests[i].request_id for i in bad.nonzero().flatten().tolist()]
        raise SamplingError(f"non-finite logits for {ids} (a sampling parameter out of range?)", ids)


def _filter_probs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p for a batch of rows: ``probs`` fp32 ``[R, vocab]`` (rows sum
    to 1), one ``SamplingParams`` per row. Returns the filtered (unnormalised) rows: one
    sort for the whole batch, no per-row loop."""
    R, V = probs.shape
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(V).expand(R, V)
    drop = rank >= top_k[:, None]
    # top-p: keep the smallest prefix whose mass reaches top_p (the top token always stays)
    # (only rows that ask: an fp32 row can sum a little above 1, and top_p = 1.0 would then cut
    # its tail, so a row's tokens would depend on a neighbour's filter)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop |= sorted_p < (min_p * sorted_p[:, 0])[:, None]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.empty_like(probs).scatter_(1, idx, sorted_p)


class Sampler:
    """Samples one token per row. ``generator`` is the engine-wide RNG used by requests
    without their own seed."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 offsets: Optional[Sequence[int]] = None) -> SamplerOutput:
        """``logits``: fp32 ``[num_rows, vocab]``, row i belongs to ``requests[i]``.
        ``offsets[i]``: output tokens that row i's position comes after beyond the request's
        own (a speculative row's draft positions: 0, 1, ...; ``None`` = all 0), for
        ``min_tokens``."""
        logits = logits.float()
        n = logits.shape[0]
        tokens: list[int] = [0] * n
        logprobs: list[Optional[dict[int, float]]] = [None] * n
        adjust = [i for i, r in enumerate(requests)
                  if r.sampling_params.uses_penalties or r.sampling_params.uses_logit_bias]
        held = [i for i, r in enumerate(requests)
                if r.num_output_tokens + (offsets[i] if offsets else 0) < r.sampling_params.min_tokens]
        if adjust or held:
            logits = logits.clone()
            for i in adjust:
                if requests[i].sampling_params.uses_penalties:
                    apply_penalties(logits[i], requests[i])
                if requests[i].sampling_params.uses_logit_bias:
                    apply_logit_bias(logits[i], requests[i])
            for i in held:
                apply_min_tokens(logits[i], requests[i])
            adjust = adjust or held
        grammar_rows = constrained_rows(requests)
        if grammar_rows:  # structured outputs: forbidden tokens -> -inf, one batched fill
            logits = apply_grammar_masks(logits if adjust else logits.clone(), requests, grammar_rows)
        _check_finite(logits, requests)
        on_cpu = logits.device.type == "cpu" and logits.stride(-1) == 1
        ops = sample_ops.get() if on_cpu else None  # the C picks, or None: torch's
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if greedy_rows:
            # the first maximum (C, or torch's max(dim).indices: half argmax's time here, 0.4 vs 1.0
            # ms for 32 x 49152); all rows greedy (the usual decode batch): no gathered copy
            rows_in = logits if len(greedy_rows) == n else logits[greedy_rows]
            am = ops.argmax_rows(rows_in) if ops is not None else rows_in.max(dim=-1).indices.tolist()
            for i, t in zip(greedy_rows, am):
                tokens[i] = t
        rand_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rand_rows:
            params = [requests[i].sampling_params for i in rand_rows]
            rows_in = logits if len(rand_rows) == n else logits[rand_rows]
            if any(p.temperature != 1.0 for p in params):  # temperature 1 (the API default): no pass
                rows_in = rows_in / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
            probs = torch.softmax(rows_in, dim=-1)
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                probs = _filter_probs(probs, params)
            u = _uniforms([requests[i].generator or self.generator for i in rand_rows])
            picks = ops.inverse_cdf_pick(probs, u, _PICK_BLOCK) if ops is not None else _inverse_cdf_pick(probs, u)
            for i, t in zip(rand_rows, picks):
                tokens[i] = t
        want_lp = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if want_lp:
            lps = torch.log_softmax(logits[want_lp], dim=-1)
            for row, i in enumerate(want_lp):
                logprobs[i] = _logprob_dict(lps[row], tokens[i], requests[i])
        return SamplerOutput(tokens, logprobs)


def _uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One ``u ~ U[0, 1)`` per row, fp64 ``[R]``, from ``generators[row]``: the only random
    numbers a sampled token consumes, so a seeded request's stream does not depend on its
    batch, its row, the vocabulary size or the filters."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])


_PICK_BLOCK = 256  # tokens per block of the two-level search in _inverse_cdf_pick


def _inverse_cdf_pick(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """One token per row of ``probs`` fp32 ``[R, vocab]`` (non-negative, rows need not sum to
    1, each with some positive entry) for ``u`` fp64 ``[R]`` in ``[0, 1)``: the first index
    whose cumulative sum exceeds ``u * total``, so token ``i`` comes out with probability
    ``probs[i] / total`` (to fp64 rounding: a token of probability 1e-12 keeps its share).
    Replaces the exponential race (``argmax(p / E)``), which drew ``vocab`` exponentials per
    row, serially: ~2.5 ms a row at 49,152 on this CPU, 15% of the served engine thread
    (docs/performance.md).

    Two levels, all sums in fp64 (an fp32 cumulative sum would round every token's share to
    ~6e-8, making tokens below that unreachable and doubling others): block sums of
    ``_PICK_BLOCK`` tokens and their cumulative sum find the block, then the cumulative sum of
    that one block finds the token, so the fp64 work is ``vocab / 256 + 256`` a row. Searches
    take the first prefix strictly above the target, so a zero-probability token (a masked one,
    or padding) is never returned; ``u * total`` is kept below ``total``; if the block's own sum
    rounds below the target (the two levels add in different orders) the block's last positive
    token is taken."""
    R, V = probs.shape
    B = _PICK_BLOCK
    nb = -(-V // B)
    p = probs if nb * B == V else torch.nn.functional.pad(probs, (0, nb * B - V))
    blocks = p.view(R, nb, B)
    bcum = torch.cumsum(blocks.sum(-1, dtype=torch.float64), dim=-1)  # [R, nb]
    total = bcum[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))[:, None]  # [R, 1]
    blk = torch.searchsorted(bcum, target, right=True).clamp_(max=nb - 1)
    before = torch.where(blk > 0, bcum.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, blk[:, :, None].expand(R, 1, B)).view(R, B)
    icum = torch.cumsum(inner, dim=-1, dtype=torch.float64) + before
    j = torch.searchsorted(icum, target, right=True)  # [R, 1], B if the block sum rounded low
    past = j >= B
    if bool(past.any()):
        last = B - 1 - torch.flip(inner > 0, dims=[-1]).to(torch.int8).argmax(dim=-1, keepdim=True)
        j = torch.where(past, last, j)
    return (blk * B + j).view(R).tolist()


def _logprob_dict(lps: torch.Tensor, token: int, req: Request) -> dict[int, float]:
    """``{sampled token: logprob, then the top-k}`` from one row of log-probabilities
    ``[vocab]``. Raises :class:`SamplingError` if the sampled token's logprob is not finite;
    alternatives with logprob -inf (probability 0) are left out."""
    d = {token: float(lps[token])}
    if not math.isfinite(d[token]):
        raise SamplingError(f"non-finite logprob {d[token]} for {req.request_id}", [req.request_id])
    k = req.sampling_params.logprobs
    if k:
        top = torch.topk(lps, k)
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            if math.isfinite(v):
                d.setdefault(t, v)
    return d


def prompt_logprob_dicts(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[dict[int, float]]:
    """Prompt logprobs from fp32 logits ``[R, vocab]`` of R prompt positions: row i gives
    ``{tokens[i]: logprob, then the top-k}`` (``tokens[i]``: the prompt token that follows
    row i's position)."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    chosen = lps[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.int64)].tolist()
    out = [{t: v} for t, v in zip(tokens, chosen)]
    if k:
        top = torch.topk(lps, k, dim=-1)
        for d, vals, ids in zip(out, top.values.tolist(), top.indices.tolist()):
            for v, t in zip(vals, ids):
                d.setdefault(t, v)
    return out
