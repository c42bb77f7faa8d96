"""Draft-model proposals (``speculative="draft:<model>"``).

A small model with the target's tokenizer proposes ``k`` tokens greedily (argmax) per
speculating request; the target verifies them exactly as it verifies n-gram drafts
(``spec_decode``: a deterministic proposer is a point mass, so the output distribution stays
plain sampling's and greedy output stays token-identical).

**The draft's own paged KV.** The draft model runs through its own ``Worker`` (own
``ModelRunner``, own per-layer caches) over its own ``KVCacheManager`` (no prefix caching,
no step fences: its forwards run synchronously under the engine lock). Its pool has the
target's ``num_blocks`` blocks of the target's ``block_size`` tokens, in the draft model's
dtype: per request the draft holds at most the target's computed tokens plus ``k - 1``
drafts, so it fits wherever the target's requests fit; without prefix sharing (``n > 1``
siblings, prefix hits) it can still run out, and then the request proposes nothing that
step (a plain decode row), never an error.

**Bookkeeping.** Per request the proposer keeps the token ids whose K/V the draft holds.
Before proposing for a context ``token_ids`` it keeps the longest common prefix of the two
(rejected drafts, a recompute after preemption and a new ``n > 1`` sibling all reduce to
this), trims the draft's block table to it (the blocks past it return to the draft pool),
computes the missing tokens (one forward, in chunks of ``chunk`` tokens when long), then
runs ``k - 1`` one-token decode steps: ``k`` drafts, ``k`` forwards. A request's draft
blocks are freed when it leaves the running list (finish, abort, preemption:
:meth:`DraftModelProposer.propose`, :meth:`DraftModelProposer.release`), so an idle engine
holds no draft block.

**Batching.** :meth:`DraftModelProposer.propose` runs after a step's target forward and
sampling (the worker's ``propose_drafts``), for every running request at once: it frees the
draft blocks of requests no longer running, then drafts for each row with ``max_drafts > 0``
(the scheduler's choice: decoding next, may speculate, not backing off; at most
``min(k, draft budget, max_num_batched_tokens - 1)``), batching the draft's forwards across
them. The drafts ride on the request; the next step's scheduler takes the first ``cap`` of
them that its lookahead slots allow.

**The draft's KV** is this proposer's own ``KVCacheManager`` (not a KV group of the target's
manager); the proposer is owned by the worker, never by the scheduler or the engine.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from pagedkv.errors import ConfigError, NoFreeBlocksError
from pagedkv.kv import KVCacheManager
from pagedkv.utils import torch_dtype
from pagedkv.worker.proposer import DraftRequest, Proposer, check_k
from pagedkv.worker.worker import Worker

#: texts both tokenizers must turn into the same ids (plain, code, digits, non-ASCII, spaces)
PROBES = ("Hello, world! How are you today?", "def f(x):\n    return x * 2  # double",
          "3.14159 + 2 = 5.14159", "Ünïcödé: naïve café, 東京, 🙂", "  two  spaces\tand a tab")


def check_same_tokenizer(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Raise ``ConfigError`` naming both models unless ``draft`` (a ``LoadedModel``) has the
    vocabulary size of ``target`` and its tokenizer gives the same ids for every probe text."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ConfigError(f"speculative draft model {draft_name!r} has a vocabulary of {dv} tokens, the target "
                          f"{target_name!r} {tv}: the draft must share the target's tokenizer")
    for text in PROBES:
        a = list(target.tokenizer(text, add_special_tokens=False)["input_ids"])
        b = list(draft.tokenizer(text, add_special_tokens=False)["input_ids"])
        if a != b:
            raise ConfigError(f"speculative draft model {draft_name!r} tokenizes {text!r} as {b[:8]}..., the "
                              f"target {target_name!r} as {a[:8]}...: the draft must share the target's tokenizer")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    """Greedy draft-model proposals of up to ``k`` tokens (see the module doc). ``worker``: the
    draft's ``Worker`` with its caches built (``init_cache``) over ``num_blocks`` blocks of
    ``block_size`` tokens; ``max_len``: the draft's context (positions it may compute);
    ``chunk``: most tokens of one request per catch-up forward. ``name``: the draft model.
    Raises ``ConfigError`` for a bad ``k``."""

    def __init__(self, worker: Worker, k: int, num_blocks: int, block_size: int, max_len: int,
                 chunk: int = 512, name: str = "draft") -> None:
        check_k(k)
        self.worker, self.k, self.max_len, self.chunk, self.name = worker, k, max_len, max(1, chunk), name
        self.kv = KVCacheManager(num_blocks, block_size)
        #: request id -> the token ids whose K/V the draft's cache holds (its block table's tokens)
        self.held: dict[str, list[int]] = {}
        self.num_forwards = 0  # draft forward passes run (tests, profiling)

    @classmethod
    def from_config(cls, config: Any, argument: Optional[str], target: Any, num_blocks: int,
                    target_name: str) -> "DraftModelProposer":
        """Load the draft ``argument`` (a GGUF / HF path or a bundled name) as ``config`` (an
        ``EngineConfig``: dtype, device, attention backend, ``draft_weights``, block size,
        ``num_speculative_tokens``) asks, check its tokenizer against ``target`` (the
        target's ``LoadedModel``) and build its caches of ``num_blocks`` blocks. Raises
        ``ConfigError``: a bad path or format, another tokenizer (naming both models), a
        draft with sliding-window layers, tensor parallelism."""
        model = argument
        if config.tensor_parallel_size != 1:
            raise ConfigError("speculative draft model: not supported with tensor_parallel_size > 1")
        try:
            worker = Worker.load(model, dtype=torch_dtype(config.dtype), device=config.device,
                                 weights=config.draft_weights, attention_backend=config.attention_backend,
                                 deterministic=config.deterministic)
        except ConfigError as e:  # the loader says "model: ...": name the draft, not the target
            raise ConfigError(f"speculative draft model {model!r}: {e}") from e
        mc = worker.config
        check_same_tokenizer(target, worker.loaded, target_name, str(model))
        windows = mc.layer_windows()
        if windows and any(w is not None for w in windows):
            raise ConfigError(f"speculative draft model {model!r} has sliding-window layers: not supported as a draft")
        worker.init_cache(num_blocks, config.block_size, next(worker.model.parameters()).dtype)
        return cls(worker, config.num_speculative_tokens, num_blocks, config.block_size,
                   mc.max_position_embeddings, config.max_num_batched_tokens, str(model))

    # ---- the worker's calls -----------------------------------------------------------------
    def propose(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """After a step: free the draft blocks of requests not in ``rows`` (no longer
        running), then draft (batched) up to ``max_drafts`` tokens for every row that asks
        for some (``[]`` for the others)."""
        self.retain(r[0] for r in rows)
        out = {r[0]: [] for r in rows}
        out.update(self.propose_batch([r for r in rows if r[2] > 0]))
        return out

    def retain(self, request_ids: Iterable[str]) -> None:
        """Free the draft blocks of every request not in ``request_ids`` (the running ones)."""
        keep = set(request_ids)
        for rid in [r for r in self.held if r not in keep]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """Free ``request_id``'s draft blocks and state (unknown ids: no-op)."""
        self.held.pop(request_id, None)
        self.kv.free(request_id)

    # ---- the draft model's forwards ---------------------------------------------------------
    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """``{request id: drafts}`` for ``(request id, context token ids, most drafts)`` items:
        each request's draft K/V is brought to its context (see the module doc), then up to
        ``most`` tokens are drafted greedily, every forward batched over the requests."""
        out: dict[str, list[int]] = {rid: [] for rid, _, _ in items}
        live = []  # [rid, context, drafts wanted]
        for rid, token_ids, most in items:
            toks = list(token_ids)
            most = min(most, self.max_len - len(toks))  # draft positions stay inside its context
            if most <= 0 or not toks:
                if len(toks) >= self.max_len:  # past the draft's context for good: its blocks go back
                    self.release(rid)
                continue
            keep = min(_common_prefix(self.held.get(rid, ()), toks), len(toks) - 1)
            try:
                if rid in self.held:
                    self.kv.trim(rid, keep)
                # slots for the missing context and the k - 1 drafts fed back: all or nothing
                self.kv.allocate_slots(rid, len(toks) - keep + most - 1, keep)
            except NoFreeBlocksError:
                self.release(rid)  # the draft pool is full: no drafts for it this step
                continue
            self.held[rid] = toks[:keep]
            live.append([rid, toks, most])
        if not live:
            return out
        # catch-up: every request's missing context; the last chunk of each in one forward
        for rid, toks, _ in live:
            held = self.held[rid]
            while len(toks) - len(held) > self.chunk:
                piece = toks[len(held):len(held) + self.chunk]
                self._forward([(rid, piece, len(held))], sample=False)
                held += piece
        last = self._forward([(rid, toks[len(self.held[rid]):], len(self.held[rid])) for rid, toks, _ in live])
        for (rid, toks, _), t in zip(live, last):
            self.held[rid] = list(toks)
            out[rid].append(t)
        # k - 1 one-token decode steps over the requests still drafting
        for j in range(1, max(m for _, _, m in live)):
            step = [(rid, [out[rid][-1]], len(self.held[rid])) for rid, _, m in live if m > j]
            for (rid, fed, _), t in zip(step, self._forward(step)):
                self.held[rid] += fed
                out[rid].append(t)
        return out

    def _forward(self, rows: Sequence[tuple[str, list[int], int]], sample: bool = True) -> list[int]:
        """One draft forward over ``(request id, new token ids, their first position)`` rows;
        the argmax token after each row's last one (``[]`` when ``sample`` is False)."""
        runner = self.worker.runner
        inp = runner.prepare([t for _, t, _ in rows], [s for _, _, s in rows],
                             [self.kv.get_block_ids(rid) for rid, _, _ in rows], [sample] * len(rows))
        logits = runner.execute(inp)
        self.num_forwards += 1
        return logits.argmax(dim=-1).tolist() if sample else []

    @property
    def num_used_blocks(self) -> int:
        """Blocks of the draft's pool held by requests now."""
        return self.kv.num_used_blocks

