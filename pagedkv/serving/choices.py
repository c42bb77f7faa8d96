"""One code path for a choice's fields, streamed or not.

A :class:`ChoiceBuilder` turns the successive cumulative outputs of one choice into the
fields added since its last call: text, logprobs entries, finish reason. The non-streamed
response is one call with the final output; a stream makes one call per engine output.
So the joined stream equals the non-streamed response by construction: the same text
(echoed prompt first), the same ``tokens`` / ``token_logprobs`` / ``top_logprobs`` and
``text_offset`` (characters, cumulative over the token strings; the echoed prompt's tokens
from 0, the generated ones from the echoed text's length), the same finish reason.

Alternatives (``top_logprobs``) never collapse: in a completions entry (a dict, OpenAI's
shape) a candidate whose text is already a key (several tokens can decode to the same
text, e.g. parts of one multi-byte character) is keyed ``"token_id:<id>"`` instead; the
keys are in order of logprob, highest first. Chat entries are lists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.model.tokenizer import token_bytes


def _tok_str(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid])


def top_entries(tokenizer: Any, d: dict[int, float], k: int) -> list[tuple[int, str, float]]:
    """The top ``k`` of one engine logprob dict as ``(token id, text, logprob)``, highest
    logprob first (ties: the engine's order)."""
    top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
    return [(t, _tok_str(tokenizer, t), v) for t, v in top]


def top_dict(entries: list[tuple[int, str, float]]) -> dict[str, float]:
    """A completions ``top_logprobs`` entry keeping every candidate (see the module doc)."""
    out: dict[str, float] = {}
    for tid, s, v in entries:
        out[s if s not in out else f"token_id:{tid}"] = v
    return out


def zero_tokens(c: CompletionOutput) -> CompletionOutput:
    """``c`` without its generated tokens (``max_tokens=0`` with echo: the engine generates
    one token, the response returns none)."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason is not None else None)


class ChoiceBuilder:
    """The fields of one choice, built incrementally. ``kind``: "completion" or "chat";
    ``echo``: the prompt text to prefix (completions); ``k``: alternatives per token;
    ``logprobs``: whether the choice carries logprobs; ``holdback``: characters a
    non-final delta keeps back (the longest stop string - 1)."""

    def __init__(self, kind: str, tokenizer: Any, echo: Optional[str], logprobs: bool, k: int,
                 holdback: int) -> None:
        self.kind, self.tokenizer, self.echo = kind, tokenizer, echo
        self.logprobs, self.k, self.holdback = logprobs, k, holdback
        self.sent_chars = 0  # characters of the generated text sent
        self.sent_tokens = 0  # generated tokens whose logprobs were sent
        self.offset = len(echo) if echo else 0  # text_offset of the next generated token
        self.opened = False  # the echo (and the prompt's logprobs) sent
        self.done = False

    def advance(self, out: RequestOutput, c: CompletionOutput) -> Optional[tuple[str, Optional[dict[str, Any]], Optional[str]]]:
        """``(text, logprobs, finish_reason)`` added since the last call, or None when
        nothing is to be sent yet. ``c``: the choice's cumulative output; ``out``: its
        request's (prompt logprobs)."""
        finished = c.finish_reason is not None
        text = c.text
        safe = len(text) if finished else min(len(text) - self.holdback, len(text.rstrip("\ufffd")))
        safe = max(safe, self.sent_chars)
        delta = text[self.sent_chars:safe]
        rows: list[tuple[int, str, Optional[float], Optional[list]]] = []
        offsets: list[int] = []
        if not self.opened:
            self.opened = True
            if self.echo is not None:
                delta = self.echo + delta
                if self.logprobs:
                    rows, offsets = self._prompt_rows(out)
        new = c.token_ids[self.sent_tokens:]
        if self.logprobs and new and c.logprobs is not None:
            for tid, d in zip(new, c.logprobs[self.sent_tokens:]):
                s = _tok_str(self.tokenizer, tid)
                rows.append((tid, s, d.get(tid, float("-inf")), top_entries(self.tokenizer, d, self.k)))
                offsets.append(self.offset)
                self.offset += len(s)
        if not delta and not finished and not rows:
            return None
        self.sent_chars = safe
        self.sent_tokens = len(c.token_ids)
        self.done = finished
        return delta, (self._logprobs_json(rows, offsets) if self.logprobs else None), c.finish_reason

    def _prompt_rows(self, out: RequestOutput) -> tuple[list, list[int]]:
        """The echoed prompt's logprob rows (the first token's logprob and alternatives are
        null) and their offsets from 0."""
        rows, offsets, off = [], [], 0
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        for tid, d in zip(out.prompt_token_ids, plp):
            s = _tok_str(self.tokenizer, tid)
            rows.append((tid, s, None, None) if d is None else (tid, s, d[tid], top_entries(self.tokenizer, d, self.k)))
            offsets.append(off)
            off += len(s)
        return rows, offsets

    def _logprobs_json(self, rows: list, offsets: list[int]) -> Optional[dict[str, Any]]:
        if self.kind == "chat":  # bytes: the token's own (part of a character: not U+FFFD's)
            tb = self.tokenizer
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(token_bytes(tb, tid)),
                 "top_logprobs": [{"token": ts, "logprob": v, "bytes": list(token_bytes(tb, tt))}
                                  for tt, ts, v in top or ()]}
                for tid, s, lp, top in rows]}
        return {"tokens": [r[1] for r in rows], "token_logprobs": [r[2] for r in rows],
                "top_logprobs": [None if r[3] is None else top_dict(r[3]) for r in rows],
                "text_offset": offsets}
