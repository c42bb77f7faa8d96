"""llama.cpp's own C++ lookup decoding as the peer of ``pagedkv bench spec``.

Two ``llama-server`` processes on the bundled (or ``--model``) GGUF, one slot each: **plain**,
and **lookup** with llama.cpp's n-gram speculative decoding (``--spec-type ngram-simple``, the
C++ counterpart of prompt lookup: the last ``size_n`` tokens are looked up in the context and
the ``size_m`` tokens that followed them are drafted, ``--spec-ngram-simple-size-n`` /
``-size-m``). Both stay up for the whole benchmark, so their requests can be interleaved with
pagedkv's, request by request (:class:`LookupPeer`). Each request is ``POST /completion`` with
the same prompt token ids pagedkv gets (its chat template applied), greedy (``temperature`` 0,
``top_k`` 1), up to EOS or ``n_predict`` tokens, no prompt cache. The server's own timings give
decode tok/s on pagedkv's definition: ``predicted_per_second`` = (generated tokens - 1) /
time after the first token (``timings.predicted_n``, ``predicted_ms``), and the drafts
(``draft_n``, ``draft_n_accepted``). Replaces llama-cpp-python's ``LlamaPromptLookupDecoding``
(a Python class, per-token wrapper overhead included) used until 2026-12-05.
"""

from __future__ import annotations

import json
import urllib.request
from contextlib import ExitStack
from typing import Any, Optional, Sequence

from pagedkv.bench.http import serve_llama_server

#: llama-server's speculative flags for the ``lookup`` side, given ``size_n`` / ``size_m``
SPEC_TYPE = "ngram-simple"


def lookup_flags(size_n: int, size_m: int) -> list[str]:
    """The extra ``llama-server`` arguments of the lookup side: n-gram speculation looking up
    the last ``size_n`` tokens and drafting up to ``size_m`` (pagedkv's ``ngram_max`` and
    ``num_speculative_tokens``)."""
    return ["--spec-type", SPEC_TYPE, "--spec-ngram-simple-size-n", str(size_n),
            "--spec-ngram-simple-size-m", str(size_m)]


def completion(url: str, prompt_ids: Sequence[int], max_tokens: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """One greedy ``POST {url}/completion`` of ``prompt_ids`` (token ids): ``{"tokens": n
    generated, "decode_tokens": n - 1, "decode_ms": ms after the first token, "draft_n",
    "draft_accepted"}`` from the response's ``timings``. Raises ``RuntimeError`` on a response
    without timings."""
    body = {"prompt": list(prompt_ids), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": False, "stream": False, "return_tokens": True}
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data = json.loads(resp.read())
    t = data.get("timings")
    if not isinstance(t, dict) or "predicted_n" not in t:
        raise RuntimeError(f"llama-server: a /completion response without timings: {str(data)[:300]}")
    n = int(t["predicted_n"])
    return {"tokens": n, "decode_tokens": max(0, n - 1), "decode_ms": float(t.get("predicted_ms", 0.0)),
            "draft_n": int(t.get("draft_n", 0)), "draft_accepted": int(t.get("draft_n_accepted", 0)),
            "token_ids": [int(x) for x in data.get("tokens", [])]}


class LookupPeer:
    """The two llama-server sides (``plain``, ``lookup``), started on ``__enter__`` and stopped
    on exit. :meth:`run` sends one prompt to one side and adds its numbers to that side's
    totals; :meth:`rates` gives each side's decode tok/s over what it ran since
    :meth:`reset`. ``binary``: the ``llama-server`` executable; ``gguf``: the model file;
    ``threads``: ``-t``/``-tb``; ``ctx``: context tokens of the one slot."""

    SIDES = ("plain", "lookup")

    def __init__(self, binary: str, gguf: str, threads: int, size_n: int, size_m: int, ctx: int = 2048) -> None:
        self.binary, self.gguf, self.threads, self.ctx = binary, gguf, threads, ctx
        self.extra = {"plain": [], "lookup": lookup_flags(size_n, size_m)}
        self.urls: dict[str, str] = {}
        self._stack: Optional[ExitStack] = None
        self.reset()

    def __enter__(self) -> "LookupPeer":
        self._stack = ExitStack()
        for side in self.SIDES:
            self.urls[side] = self._stack.enter_context(serve_llama_server(
                self.binary, self.gguf, self.threads, parallel=1, ctx_per_slot=self.ctx, extra=self.extra[side]))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def reset(self) -> None:
        """Zero the per-side totals (one workload's numbers start)."""
        self.totals = {s: {"decode_tokens": 0, "decode_ms": 0.0, "draft_n": 0, "draft_accepted": 0}
                       for s in self.SIDES}
        self.same_tokens = True  # greedy: lookup must generate what plain generates

    def run(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Both sides on ``prompt_ids``, plain first (one request each, alone on its server)."""
        got = {}
        for side in self.SIDES:
            r = completion(self.urls[side], prompt_ids, max_tokens)
            got[side] = r["token_ids"]
            for k in self.totals[side]:
                self.totals[side][k] += r[k]
        self.same_tokens &= got["plain"] == got["lookup"]

    def rates(self) -> dict[str, float]:
        """``{side: decode tok/s}`` (0.0 for a side that decoded nothing) and the lookup side's
        ``acceptance`` (accepted / drafted tokens, 0.0 without drafts)."""
        out = {s: (t["decode_tokens"] / t["decode_ms"] * 1e3 if t["decode_ms"] > 0 else 0.0)
               for s, t in self.totals.items()}
        lk = self.totals["lookup"]
        out["acceptance"] = lk["draft_accepted"] / lk["draft_n"] if lk["draft_n"] else 0.0
        return out
