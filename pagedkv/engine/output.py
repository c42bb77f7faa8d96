"""The output processor: detokenise, apply stop strings, take the step's output decisions,
build ``RequestOutput``s.

It owns every sequence's detokeniser state (:class:`TextState`: the text, how many tokens it
reflects, whether a stop string froze it); the scheduler's ``Request`` holds none. Text is
brought up to date once per new token only for streamed requests and requests with stop
strings (a stop string must end the request as soon as it appears); otherwise once at the
end. A stop string is cut from the text (its tokens stay in ``token_ids``) and ends its
sequence: :meth:`OutputProcessor.detokenize` returns a ``Finish`` decision (carrying the
stop string as ``stop_reason``) that the engine hands to the scheduler (which frees the
blocks behind the step fence). After ``Scheduler.update``, :meth:`OutputProcessor.decide`
gathers one step's decisions: beam steps (``SequenceGroups.beam_step``) and stop strings.
A finished beam search's output is its hypotheses, decoded here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedkv.engine.beam import BeamHypothesis
from pagedkv.engine.decisions import Decisions, Finish
from pagedkv.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pagedkv.engine.sequence_group import SequenceGroup, SequenceGroups

#: one sampled token and its logprobs (``None`` unless asked for)
Sampled = tuple[int, Optional[dict[int, float]]]


@dataclass
class TextState:
    """One sequence's detokeniser state: ``text`` reflects its first ``num_tokens`` output
    tokens; ``cut``: a stop string ended it (the text is final); ``min_tokens_chars``:
    characters of its first ``min_tokens`` tokens' text (-1: not yet known)."""

    text: str = ""
    num_tokens: int = 0
    cut: bool = False
    min_tokens_chars: int = -1


class OutputProcessor:
    """Text and ``RequestOutput``s from the sequences' tokens (``tokenizer``: the model's).
    Per user request (a sequence's ``parent_id``) it keeps its sequences' :class:`TextState`
    until :meth:`forget`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, dict[str, TextState]] = {}

    def state(self, req: Request) -> TextState:
        """``req``'s detokeniser state (a new one the first time)."""
        seqs = self._texts.setdefault(req.parent_id or req.request_id, {})
        st = seqs.get(req.request_id)
        if st is None:
            st = seqs[req.request_id] = TextState()
        return st

    def text(self, req: Request) -> str:
        """``req``'s text as last brought up to date (``""`` before)."""
        st = self._texts.get(req.parent_id or req.request_id, {}).get(req.request_id)
        return st.text if st is not None else ""

    def forget(self, request_id: str) -> None:
        """Drop the text state of user request ``request_id``'s sequences (it finished)."""
        self._texts.pop(request_id, None)

    def detokenize(self, req: Request) -> Optional[Finish]:
        """Bring ``req``'s text up to date: the text of its output tokens, less the token
        that ended it when that was an EOS or a ``stop_token_ids`` token (unless
        ``include_stop_str_in_output``). If a stop string appeared (ending after the first
        ``min_tokens`` tokens' text): cut the text before it (after it with
        ``include_stop_str_in_output``), freeze it and return ``Finish(req,
        FINISHED_STOPPED, stop_reason=<the string>)`` for the scheduler; else ``None``."""
        st = self.state(req)
        if st.num_tokens == req.num_output_tokens or st.cut:  # nothing new / cut at a stop string
            return None
        p = req.sampling_params
        ids = req.output_token_ids
        if req.stopped_by_token and not p.include_stop_str_in_output:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        st.num_tokens = req.num_output_tokens
        finish = None
        if p.stop and not req.stopped_by_token:
            hit = find_stop_string(text, p.stop, self.stop_text_floor(req, req.output_token_ids),
                                   partial=not req.status.finished)
            if hit is not None:
                pos, s = hit
                text = text[:pos + len(s)] if p.include_stop_str_in_output else text[:pos]
                finish = Finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=s)
                st.cut = True
        st.text = text
        return finish

    def stop_text_floor(self, req: Request, ids: Sequence[int]) -> Optional[int]:
        """Characters of ``req``'s text a stop string must end after, when its output tokens
        are ``ids``: ``None`` while they are ``<= min_tokens`` (no stop string may end it yet),
        else the length of the first ``min_tokens`` tokens' text (0 without ``min_tokens``;
        vLLM's rule). The length is kept once ``req``'s own tokens hold it."""
        p = req.sampling_params
        if not p.min_tokens:
            return 0
        if len(ids) <= p.min_tokens:
            return None
        st = self.state(req)
        if st.min_tokens_chars >= 0:
            return st.min_tokens_chars
        n = len(self.tokenizer.decode(list(ids[:p.min_tokens]), skip_special_tokens=p.skip_special_tokens))
        if req.num_output_tokens >= p.min_tokens:
            st.min_tokens_chars = n
        return n

    def cut_at_stop_string(self, req: Request, run: list[Sampled]) -> list[Sampled]:
        """A speculative ``run`` up to the token that completes one of ``req``'s stop strings
        (plain decoding would stop there: the tokens after it are never emitted), else the
        whole run. A stop string counts only where plain decoding would take it (after
        ``min_tokens``, see :meth:`stop_text_floor`)."""
        stops = req.sampling_params.stop
        if not stops or len(run) < 2:
            return run
        skip = req.sampling_params.skip_special_tokens
        base = list(req.output_token_ids)
        for j in range(1, len(run)):
            ids = base + [t for t, _ in run[:j]]
            floor = self.stop_text_floor(req, ids)
            if floor is not None and find_stop_string(self.tokenizer.decode(ids, skip_special_tokens=skip), stops, floor):
                return run[:j]
        return run

    def decide(self, seqs: Sequence[Request], beam_groups: Sequence[str], groups: SequenceGroups) -> Decisions:
        """One step's decisions after ``Scheduler.update``: the beam step of each group in
        ``beam_groups``, then a ``Finish`` for each sequence of ``seqs`` (those that sampled)
        whose text (brought up to date when it has stop strings or is streamed) shows a stop
        string."""
        decisions = Decisions()
        for gid in beam_groups:
            decisions += groups.beam_step(gid)
        for r in seqs:
            group = groups.of(r.request_id)
            if r.sampling_params.stop or (group is not None and group.stream):
                if (stop := self.detokenize(r)) is not None:
                    decisions.finishes.append(stop)
        return decisions

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The group's cumulative ``RequestOutput`` (text, token ids, finish reasons,
        metrics); for a finished beam search, its hypotheses best first."""
        beams_done = group.beam is not None and group.beam.done
        for s in group.seqs:
            # a sequence with stop strings is detokenised in the step that sampled its tokens
            # (its Finish applied there), so this only decodes the text of the others; the
            # beams of a finished search are not decoded (its output is the hypotheses)
            if (s.is_finished or group.stream) and not s.sampling_params.stop and not beams_done:
                self.detokenize(s)
        metrics = group.metrics()
        common = dict(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            finished=group.finished, metrics=metrics, prompt_logprobs=group.prompt_logprobs,
        )
        if beams_done:
            stop_ids = group.beam.stop_ids
            outs = [self._beam_output(i, h, group, stop_ids) for i, h in enumerate(group.beam.result())]
            return RequestOutput(outputs=outs, num_cached_tokens=metrics.prefix_hit_tokens, **common)
        seqs = sorted(group.seqs, key=lambda s: s.index)
        comps = [
            CompletionOutput(
                index=s.index, text=self.text(s), token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                logprobs=list(s.output_logprobs) if s.sampling_params.logprobs is not None else None,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
        cached = metrics.prefix_hit_tokens if group.beam is not None else max(seqs[0].num_cached_tokens, 0)
        return RequestOutput(outputs=comps, num_cached_tokens=cached,
                             num_cached_tokens_by_tier=dict(seqs[0].num_cached_tokens_by_tier), **common)

    def _beam_output(self, index: int, h: BeamHypothesis, group: SequenceGroup, stop_ids: Any) -> CompletionOutput:
        """A finished hypothesis as a ``CompletionOutput``: the stop token that ended it is
        in its token ids but not in its text (unless ``include_stop_str_in_output``)."""
        ids = h.token_ids
        if (not group.params.include_stop_str_in_output and h.finish_reason == "stop" and ids
                and ids[-1] in stop_ids):
            ids = ids[:-1]
        return CompletionOutput(
            index=index, text=self.tokenizer.decode(ids, skip_special_tokens=group.params.skip_special_tokens),
            token_ids=list(h.token_ids), finish_reason=h.finish_reason,
            cumulative_logprob=h.cumulative_logprob, score=h.score,
        )


def find_stop_string(text: str, stops: Sequence[str], floor: Optional[int],
                     partial: bool = True) -> Optional[tuple[int, str]]:
    """The first stop string of ``stops`` in ``text`` that ends after character ``floor``
    (``None``: no stop string may end the text yet) as ``(position, string)``, else None.
    ``partial`` (the sequence goes on): trailing U+FFFD characters are left out of the
    search, as they stand for the bytes of a character whose remaining bytes are still to
    come (a stop string holding U+FFFD must not match a half-generated character)."""
    if floor is None:
        return None
    if partial:
        text = text.rstrip("\ufffd")
    hits = [(pos, s) for s in stops if (pos := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(hits) if hits else None
