"""The output processor: detokenise, apply stop strings, build ``RequestOutput``s.

Text is brought up to date once per new token only for streamed requests and requests with
stop strings (a stop string must end the request as soon as it appears); otherwise once at
the end. A stop string is cut from the text (its tokens stay in ``token_ids``) and ends its
sequence: :meth:`OutputProcessor.detokenize` returns a ``Finish`` decision that the engine
hands to the scheduler (which frees the blocks behind the step fence).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedkv.engine.beam import BeamHypothesis
from pagedkv.engine.decisions import Finish
from pagedkv.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pagedkv.engine.sequence_group import SequenceGroup


class OutputProcessor:
    """Text and ``RequestOutput``s from the sequences' tokens (``tokenizer``: the model's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def detokenize(self, req: Request) -> Optional[Finish]:
        """Bring ``req.output_text`` up to date: the text of its output tokens, less the
        token that ended it when that was an EOS or a ``stop_token_ids`` token (unless
        ``include_stop_str_in_output``). If a stop string appeared (ending after the first
        ``min_tokens`` tokens' text): cut the text before it (after it with
        ``include_stop_str_in_output``), set ``req.stop_reason`` to it and return
        ``Finish(req, FINISHED_STOPPED)`` for the scheduler; else ``None``."""
        if req._text_tokens == req.num_output_tokens or (
            isinstance(req.stop_reason, str) and req.status != RequestStatus.FINISHED_ERROR
        ):  # text already cut at a stop string (a grammar failure's stop_reason is not one)
            return None
        p = req.sampling_params
        ids = req.output_token_ids
        if req.stopped_by_token and not p.include_stop_str_in_output:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        req._text_tokens = req.num_output_tokens
        finish = None
        if p.stop and not req.stopped_by_token:
            hit = find_stop_string(text, p.stop, stop_text_floor(self.tokenizer, req, req.output_token_ids))
            if hit is not None:
                pos, s = hit
                text = text[:pos + len(s)] if p.include_stop_str_in_output else text[:pos]
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


def find_stop_string(text: str, stops: Sequence[str], floor: Optional[int]) -> Optional[tuple[int, str]]:
    """The first stop string of ``stops`` in ``text`` that ends after character ``floor``
    (``None``: no stop string may end the text yet) as ``(position, string)``, else None."""
    if floor is None:
        return None
    hits = [(pos, s) for s in stops if (pos := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def stop_text_floor(tokenizer: Any, req: Request, ids: Sequence[int]) -> Optional[int]:
    """Characters of ``req``'s text a stop string must end after, when its output tokens are
    ``ids``: ``None`` while they are ``<= min_tokens`` (no stop string may end it yet), else
    the length of the first ``min_tokens`` tokens' text (0 without ``min_tokens``; vLLM's
    rule). The length is kept on ``req`` once its own tokens hold it."""
    p = req.sampling_params
    if not p.min_tokens:
        return 0
    if len(ids) <= p.min_tokens:
        return None
    if req._min_tokens_chars >= 0:
        return req._min_tokens_chars
    n = len(tokenizer.decode(list(ids[:p.min_tokens]), skip_special_tokens=p.skip_special_tokens))
    if req.num_output_tokens >= p.min_tokens:
        req._min_tokens_chars = n
    return n


def _beam_output(index: int, h: BeamHypothesis) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=h.text, token_ids=list(h.token_ids), finish_reason=h.finish_reason,
        cumulative_logprob=h.cumulative_logprob, score=h.score,
    )
