"""Beam search over engine sequences that share KV blocks (seed §02: shared prefixes by
reference count, writes by copy-on-write).

Each live beam is an ordinary engine :class:`Request` with its own block table. One beam
step, once every live beam has the next-token log-probabilities of its last position:

1. every (beam, token) pair is a candidate scored by the beam's cumulative log-probability
   plus ``log_softmax(logits)[token]``; the best ``max(2, 1 + #eos) * beam_width`` are kept,
   best first (ties: ``torch.topk`` order over the flattened ``[beams, vocab]`` scores);
2. a candidate that ends with an EOS / stop token, or reaches ``max_tokens`` (or the
   context limit), is *finished*; only candidates ranked among the first ``beam_width`` can
   become hypotheses, scored ``cumulative_logprob / generated_len ** length_penalty``
   (``generated_len`` counts the new token, EOS included); the best ``beam_width``
   hypotheses are kept;
3. the first ``beam_width`` unfinished candidates become the next beams. The first child of
   a beam continues that beam in place (same request, same table); every further child
   *forks* the beam's table (``ref_cnt += 1`` per block, the partly filled last block is
   copied on its first write); a beam with no child is freed (through the step fence).
4. the search ends when every candidate of the step finished, or when the best running beam
   cannot beat the worst of ``beam_width`` finished hypotheses (``early_stopping=False``:
   its score at the current length; ``"never"``: at ``max_tokens`` when the penalty is > 0;
   ``True``: as soon as ``beam_width`` hypotheses exist).

These are the semantics of transformers' ``generate(num_beams=k, do_sample=False,
length_penalty=..., early_stopping=...)`` (5.x), so the best hypothesis matches it token for
token (up to floating-point near-ties between different kernels). Scores are float32, as
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.structured import apply_grammar_masks


@dataclass
class BeamHypothesis:
    """A finished beam: generated ``token_ids`` (EOS / stop token included when it ended by
    one), ``cumulative_logprob`` (natural log) and ``score`` = cumulative_logprob /
    len(token_ids) ** length_penalty. ``finish_reason``: "stop" or "length"."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamChoice:
    """One next beam: continue ``source`` with ``token``; ``logprob`` is the new cumulative
    log-probability (a float32 0-d tensor, so later sums round exactly as in transformers)."""

    source: Request
    token: int
    logprob: torch.Tensor


class BeamSearch:
    """Per-request beam-search state. ``beam_width`` >= 2; ``max_new_tokens``: the cap on
    generated tokens (max_tokens, clipped by the context limit); ``stop_ids``: tokens that
    finish a beam (EOS unless ``ignore_eos``, plus ``stop_token_ids``)."""

    def __init__(
        self,
        beam_width: int,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        length_penalty: float = 1.0,
        early_stopping: object = False,
    ) -> None:
        self.k = beam_width
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.candidates_per_step = max(2, 1 + len(self.stop_ids)) * beam_width
        self.beams: list[Request] = []  # live beams, best first
        self.logprobs: dict[str, torch.Tensor] = {}  # req_id -> float32 scalar cumulative
        self.pending: dict[str, torch.Tensor] = {}  # req_id -> logits row of its last position
        self.hypotheses: list[BeamHypothesis] = []  # best first, at most k
        self._hyp_scores = torch.empty(0, dtype=torch.float32)
        self.improvable = True
        self.done = False
        self.num_steps = 0
        self.num_forks = 0

    # ---- state ----------------------------------------------------------------------
    def start(self, root: Request) -> None:
        """The prompt's sequence is the single beam of step 0 (cumulative logprob 0)."""
        self.beams = [root]
        self.logprobs = {root.request_id: torch.zeros((), dtype=torch.float32)}

    def is_beam(self, req_id: str) -> bool:
        return req_id in self.logprobs

    def offer(self, req: Request, logits_row: torch.Tensor) -> None:
        """The logits (fp32 ``[vocab]``) of ``req``'s last position, computed this step."""
        self.pending[req.request_id] = logits_row

    def ready(self) -> bool:
        """Whether every live beam is running with its next-token logits available (a beam
        preempted after offering recomputes and offers again)."""
        return bool(self.beams) and not self.done and all(
            b.request_id in self.pending and b.status == RequestStatus.RUNNING
            and b.num_computed_tokens == b.num_tokens
            for b in self.beams
        )

    # ---- one step -------------------------------------------------------------------
    def step(self) -> list[BeamChoice]:
        """Choose the next beams (best first) and record finished hypotheses. Sets ``done``
        when the search is over (the returned list is then what would have continued; the
        caller frees every beam instead). Call only when :meth:`ready`."""
        beams = self.beams
        rows = torch.stack([self.pending.pop(b.request_id) for b in beams]).float()
        if beams[0].sampling_params.structured is not None:  # each beam's grammar forbids tokens (-inf)
            rows = apply_grammar_masks(rows, beams, range(len(beams)))
        V = rows.shape[1]
        lp = torch.log_softmax(rows, dim=-1)
        acc = lp + torch.stack([self.logprobs[b.request_id] for b in beams])[:, None]
        K = min(self.candidates_per_step, acc.numel())
        vals, idx = torch.topk(acc.reshape(-1), K)
        src = (idx // V).tolist()
        tok = (idx % V).tolist()
        gen_len = beams[0].num_output_tokens + 1  # all beams have the same length
        at_cap = gen_len >= self.max_new_tokens or beams[0].num_tokens + 1 >= beams[0].max_total_tokens
        hits = [at_cap or t in self.stop_ids for t in tok]
        lpen = self.length_penalty

        # finished hypotheses: only the top-k ranked candidates, and only while improvable
        full = len(self.hypotheses) >= self.k
        if self.improvable and not (self.early_stopping is True and full):
            new = [j for j in range(min(self.k, K)) if hits[j]]
            if new:
                scores = vals[new] / (gen_len ** lpen)
                for j, s in zip(new, scores):
                    b = beams[src[j]]
                    self.hypotheses.append(BeamHypothesis(
                        token_ids=list(b.output_token_ids) + [tok[j]],
                        cumulative_logprob=float(vals[j]), score=float(s),
                        finish_reason="length" if (at_cap and tok[j] not in self.stop_ids) else "stop",
                    ))
                all_scores = torch.cat([self._hyp_scores, scores])
                order = torch.argsort(all_scores, descending=True, stable=True)[: self.k].tolist()
                self.hypotheses = [self.hypotheses[i] for i in order]
                self._hyp_scores = all_scores[order]

        choices = [
            BeamChoice(beams[src[j]], tok[j], vals[j]) for j in range(K) if not hits[j]
        ][: self.k]
        self.num_steps += 1
        full = len(self.hypotheses) >= self.k
        if full and choices:
            if self.early_stopping == "never" and lpen > 0.0:
                best_len = self.max_new_tokens
            else:
                best_len = gen_len
            best_running = choices[0].logprob / (best_len ** lpen)
            if not bool(best_running > self._hyp_scores.min()):
                self.improvable = False
        if not choices or not self.improvable or (self.early_stopping is True and full):
            self.done = True
        return choices

    def advance(self, choices: list[BeamChoice], new_beams: list[Request]) -> None:
        """Record the beams built from ``choices`` (same order)."""
        self.beams = list(new_beams)
        self.logprobs = {b.request_id: c.logprob for b, c in zip(new_beams, choices)}
        self.pending = {}

    def result(self) -> list[BeamHypothesis]:
        """The finished hypotheses, best first (at most ``beam_width``). If the search was
        cut short (abort) the live beams are not included."""
        return list(self.hypotheses)


def beam_stop_ids(eos_token_ids: Sequence[int], ignore_eos: bool,
                  stop_token_ids: Optional[Sequence[int]]) -> list[int]:
    """Tokens that finish a beam: EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    ids = [] if ignore_eos else list(eos_token_ids)
    for t in stop_token_ids or ():
        if t not in ids:
            ids.append(t)
    return ids
