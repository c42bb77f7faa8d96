"""The output processor: detokenise, apply stop strings, build ``RequestOutput``s.

Text is brought up to date once per new token only for streamed requests and requests with
stop strings (a stop string must end the request as soon as it appears); otherwise once at
the end. A stop string is cut from the text (its tokens stay in ``token_ids``) and ends its
sequence: :meth:`OutputProcessor.detokenize` returns a ``Finish`` decision that the engine
hands to the scheduler (which frees the blocks behind the step fence).
"""

from __future__ import annotations

from typing import Any

from typing import Optional

from pagedkv.engine.beam import BeamHypothesis
from pagedkv.engine.decisions import Finish
from pagedkv.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pagedkv.engine.sequence_group import SequenceGroup


class OutputProcessor:
    """Text and ``RequestOutput``s from the sequences' tokens (``tokenizer``: the model's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def detokenize(self, req: Request) -> Optional[Finish]:
        """Bring ``req.output_text`` up to date. If a stop string appeared: cut the text
        there, set ``req.stop_reason`` to it and return ``Finish(req, FINISHED_STOPPED)`` for
        the scheduler; else ``None``."""
        if req._text_tokens == req.num_output_tokens or (
            isinstance(req.stop_reason, str) and req.status != RequestStatus.FINISHED_ERROR
        ):  # text already cut at a stop string (a grammar failure's stop_reason is not one)
            return None
        text = self.tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        req._text_tokens = req.num_output_tokens
        stops = req.sampling_params.stop
        finish = None
        if stops:
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                pos, s = min(hits)
                text = text[:pos]
                finish = Finish(req, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = s
        req.output_text = text
        return finish

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The group's cumulative ``RequestOutput`` (text, token ids, finish reasons,
        metrics); for a finished beam search, its hypotheses best first."""
        for s in group.seqs:
            # a sequence with stop strings is detokenised in the step that sampled its tokens
            # (its Finish applied there), so this only decodes the text of the others
            if (s.is_finished or group.stream) and not s.sampling_params.stop:
                self.detokenize(s)
        metrics = group.metrics()
        common = dict(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            finished=group.finished, metrics=metrics, prompt_logprobs=group.prompt_logprobs,
        )
        if group.beam is not None and group.beam.done:
            outs = [_beam_output(i, h) for i, h in enumerate(group.beam.result())]
            return RequestOutput(outputs=outs, num_cached_tokens=metrics.prefix_hit_tokens, **common)
        seqs = sorted(group.seqs, key=lambda s: s.index)
        comps = [
            CompletionOutput(
                index=s.index, text=s.output_text, token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                logprobs=list(s.output_logprobs) if s.sampling_params.logprobs is not None else None,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
        cached = metrics.prefix_hit_tokens if group.beam is not None else max(seqs[0].num_cached_tokens, 0)
        return RequestOutput(outputs=comps, num_cached_tokens=cached,
                             num_cached_tokens_by_tier=dict(seqs[0].num_cached_tokens_by_tier), **common)


def _beam_output(index: int, h: BeamHypothesis) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=h.text, token_ids=list(h.token_ids), finish_reason=h.finish_reason,
        cumulative_logprob=h.cumulative_logprob, score=h.score,
    )
