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


def _filter_probs(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, top-p and min-p on one row of probabilities ``[vocab]`` (returns a new row)."""
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        # keep the smallest prefix whose mass reaches top_p (always keeps the top token)
        drop_sorted = (cum - sorted_p) >= p.top_p * cum[-1]
        drop = torch.zeros_like(drop_sorted).scatter_(0, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


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
        for i, r in enumerate(requests):
            p = r.sampling_params
            if p.greedy:
                continue
            probs = torch.softmax(logits[i] / p.temperature, dim=-1)
            probs = _filter_probs(probs, p)
            gen = r.generator or self.generator
            e = torch.empty_like(probs).exponential_(1.0, generator=gen)
            tokens[i] = int(torch.argmax(probs / e))
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
