"""From one step's logits to the tokens the scheduler appends (the step's "sample" stage).

The engine core calls two methods, the same whatever features a request uses:
:meth:`StepSampler.rows` before the forward (which logits rows the runner returns: one per
sampling sequence, plus the *extra* rows of prompt logprobs and of speculative drafts) and
:meth:`StepSampler.choose` after it, which

* splits the extra rows off: prompt logprobs are stored in their groups, draft rows go to
  the verification of their drafts (``pagedkv.engine.spec_decode``);
* forks the ``n > 1`` siblings of a prefill that completes (``SequenceGroups.expand_forks``)
  and hands beam rows to their search (``SequenceGroups.offer_beam_rows``: not sampled);
* samples every other row (one sampler call; a speculating request keeps its accepted run,
  cut at a stop string by ``cut``).

It returns a :class:`Chosen` for ``Scheduler.update``. The step sampler never holds the
scheduler and changes no request state but the groups' prompt logprobs and forks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pagedkv.engine.decisions import Fork
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import prompt_logprob_dicts
from pagedkv.engine.sequence_group import SequenceGroups
from pagedkv.engine.spec_decode import sample_with_drafts, split_extra_rows
from pagedkv.utils import profile_scope

#: one sampled token and its logprobs (``None`` unless asked for)
Sampled = tuple[int, Optional[dict[int, float]]]


@dataclass(frozen=True)
class StepRows:
    """The logits rows of one scheduled step: ``sampling`` (row i belongs to ``sampling[i]``),
    per scheduled sequence its ``prompt`` logprob rows and its ``extra`` rows (prompt
    logprob rows, or a speculative row's draft positions)."""

    sampling: list[Request]
    prompt: list[int]
    extra: list[int]


@dataclass
class Chosen:
    """What one step chose: ``sampled`` (``{sequence id: (token, logprobs)}``), ``runs``
    (a speculative row's kept tokens), ``forks`` (``n > 1`` siblings joining the step),
    ``seqs`` (the sequences that sampled, siblings included, in row order) and
    ``beam_groups`` (ids of the groups whose beams were offered their rows)."""

    sampled: dict[str, Sampled] = field(default_factory=dict)
    runs: dict[str, list[Sampled]] = field(default_factory=dict)
    forks: list[Fork] = field(default_factory=list)
    seqs: list[Request] = field(default_factory=list)
    beam_groups: set[str] = field(default_factory=set)

    @property
    def touched(self) -> set[str]:
        """Ids of the user requests this step gave tokens or beam steps."""
        return self.beam_groups | {r.parent_id for r in self.seqs}


class StepSampler:
    """The sample stage (see the module doc). ``sampler``: a ``pagedkv.engine.sampler.Sampler``;
    ``groups``: the engine's ``SequenceGroups``; ``cut(request, run)``: a speculative run up
    to the token completing a stop string (``OutputProcessor.cut_at_stop_string``; ``None``:
    runs are kept whole)."""

    def __init__(self, sampler: Any, groups: SequenceGroups,
                 cut: Optional[Callable[[Request, list[Sampled]], list[Sampled]]] = None) -> None:
        self.sampler = sampler
        self.groups = groups
        self.cut = cut

    def rows(self, out: Any) -> StepRows:
        """The rows ``out`` (a ``SchedulerOutput``) asks of the runner."""
        prompt = out.prompt_rows()
        return StepRows(out.sampling_requests(), prompt, out.extra_rows(prompt))

    def choose(self, out: Any, rows: StepRows, logits: torch.Tensor, num_sample_rows: int) -> Chosen:
        """The tokens of one step: ``logits`` fp32 ``[num_sample_rows + sum(rows.extra),
        vocab]`` as the runner returned them (the sampling rows first, then the extra rows
        in scheduled order). Raises ``SamplingError`` (non-finite logits) before any state
        changes but the prompt logprobs."""
        draft_logits: dict[str, torch.Tensor] = {}
        if any(rows.extra):
            prompt_logits, draft_logits = split_extra_rows(out.scheduled, rows.prompt, out.drafts,
                                                           logits[num_sample_rows:])
            self._record_prompt_logprobs(out, rows.prompt, prompt_logits)
            logits = logits[:num_sample_rows]
        with profile_scope("pagedkv.sample"):
            idx, reqs, forks = self.groups.expand_forks(out, rows.sampling)  # running rows only
            idx, reqs, beam_groups = self.groups.offer_beam_rows(logits, idx, reqs)
            chosen = Chosen(forks=forks, seqs=list(reqs), beam_groups=beam_groups)
            if reqs and draft_logits:
                chosen.sampled, chosen.runs = sample_with_drafts(self.sampler, logits[idx], reqs, draft_logits,
                                                                 out.drafts, self.cut)
            elif reqs:  # every row in order (plain decode): no gathered copy
                so = self.sampler(logits if idx == list(range(len(logits))) else logits[idx], reqs)
                for r, t, lp in zip(reqs, so.token_ids, so.logprobs):
                    chosen.sampled[r.request_id] = (t, lp)
        return chosen

    def _record_prompt_logprobs(self, out: Any, prompt_rows: list[int], logits: torch.Tensor) -> None:
        """Store the prompt logprobs of this step's prompt rows (``logits``: fp32 ``[sum of
        prompt_rows, vocab]``, in scheduled order) in their groups."""
        at = 0
        for (r, _), k in zip(out.scheduled, prompt_rows):
            if not k:
                continue
            group = self.groups.of(r.request_id)
            start = r.num_computed_tokens
            if group is not None:
                if group.prompt_logprobs is None:
                    group.prompt_logprobs = [None] * r.num_prompt_tokens
                nxt = r.prompt_token_ids[start + 1 : start + 1 + k]
                dicts = prompt_logprob_dicts(logits[at : at + k], nxt, r.sampling_params.prompt_logprobs)
                group.prompt_logprobs[start + 1 : start + 1 + k] = dicts
            at += k
