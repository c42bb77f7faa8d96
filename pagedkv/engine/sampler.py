"""Turn the last-position logits of each scheduled sequence into a token.

Greedy rows take one vectorised argmax. Random rows draw from each request's own
``torch.Generator`` (seeded by ``SamplingParams.seed``), one row at a time, so a seeded
request samples the same tokens alone or in any batch. Sampling uses the exponential-race
form (``argmax(p / E)``, ``E ~ Exp(1)``), which consumes exactly ``vocab`` random numbers per
token whatever the filters keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedkv.engine.request import Request, SamplingParams


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
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop |= mass_before >= top_p[:, None]
    drop |= sorted_p < (min_p * sorted_p[:, 0])[:, None]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.empty_like(probs).scatter_(1, idx, sorted_p)


class Sampler:
    """Samples one token per row. ``generator`` is the engine-wide RNG used by requests
    without their own seed."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """``logits``: fp32 ``[num_rows, vocab]``, row i belongs to ``requests[i]``."""
        logits = logits.float()
        n = logits.shape[0]
        tokens: list[int] = [0] * n
        logprobs: list[Optional[dict[int, float]]] = [None] * n
        if any(r.sampling_params.uses_penalties for r in requests):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.sampling_params.uses_penalties:
                    apply_penalties(logits[i], r)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if greedy_rows:
            am = logits[greedy_rows].argmax(dim=-1).tolist()
            for i, t in zip(greedy_rows, am):
                tokens[i] = t
        rand_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rand_rows:
            params = [requests[i].sampling_params for i in rand_rows]
            temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
            probs = torch.softmax(logits[rand_rows] / temps[:, None], dim=-1)
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                probs = _filter_probs(probs, params)
            # exponential race: argmax(p / E), E ~ Exp(1) from the request's own generator
            race = torch.empty_like(probs)
            for row, i in enumerate(rand_rows):
                race[row].exponential_(1.0, generator=requests[i].generator or self.generator)
            picks = torch.argmax(probs / race, dim=-1).tolist()
            for i, t in zip(rand_rows, picks):
                tokens[i] = t
        want_lp = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if want_lp:
            lps = torch.log_softmax(logits[want_lp], dim=-1)
            for row, i in enumerate(want_lp):
                k = requests[i].sampling_params.logprobs
                d = {tokens[i]: float(lps[row, tokens[i]])}
                if k:
                    top = torch.topk(lps[row], k)
                    for v, t in zip(top.values.tolist(), top.indices.tolist()):
                        d.setdefault(t, v)
                logprobs[i] = d
        return SamplerOutput(tokens, logprobs)
