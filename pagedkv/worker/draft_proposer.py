"""Draft-model proposals (``speculative="draft:<model>"``).

A small model with the target's tokenizer proposes ``k`` tokens greedily (argmax) per
speculating request; the target verifies them exactly as it verifies n-gram drafts
(``spec_decode``: a deterministic proposer is a point mass, so the output distribution stays
plain sampling's and greedy output stays token-identical).

**The draft's K/V lives in the target's blocks** (vLLM's shape: draft layers share the
target's block table). The draft model runs through its own ``Worker`` (own ``ModelRunner``,
own per-layer caches), but those caches have the target's ``num_blocks`` blocks of the
target's ``block_size`` tokens and are indexed by the target's block ids: a row's slots are
its target block table's (``DraftRequest.block_ids``). There is no second block pool, block
table or allocator:

* the scheduler reserves each drafting row's lookahead slots in the target's table before
  the proposer runs (``spec_decode.reserve_draft_slots``: positions up to the last draft's,
  copy-on-write done there), and the proposer never writes past ``len(block_ids) *
  block_size``;
* the engine sizes the pool with the draft's bytes per block beside the target's
  (:meth:`DraftModelProposer.kv_bytes_per_block`), so ``kv_cache_memory`` holds both;
* every copy-on-write copy of the target's blocks is applied to the draft's caches too
  (:meth:`DraftModelProposer.copy_blocks`), and a block freed by the target is free for the
  draft as well, so an idle engine holds no draft K/V and finishes, aborts and preemptions
  need nothing from the proposer but forgetting the request.

**Which K/V is valid.** Per request the proposer keeps the token ids whose draft K/V it wrote
(``held``) and the block ids it wrote them into (``held_blocks``). Before proposing for a
context it keeps the longest prefix that matches both the context's tokens and the row's
current block ids (rejected drafts, a recompute after preemption, a trimmed lookahead block
given back and taken again all reduce to this), then extends it over whole blocks that
another running request's draft filled with the same tokens in the same block (a prefix-cache
hit or an ``n > 1`` sibling's shared prompt: computed once). It computes the missing tokens
(one forward, in chunks of ``chunk`` tokens when long), then runs ``k - 1`` one-token decode
steps: ``k`` drafts, ``k`` forwards.

**Batching.** :meth:`DraftModelProposer.propose` runs after a step's target forward and
sampling (the worker's ``propose_drafts``), for every running request at once: it forgets
requests no longer running, then drafts for each row with ``max_drafts > 0`` (the
scheduler's choice: decoding next, may speculate, not backing off, its lookahead slots
reserved), batching the draft's forwards across them. The drafts ride on the request; the
next step's scheduler verifies them in the slots already reserved.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from pagedkv.errors import ConfigError
from pagedkv.kv import KVCacheSpec
from pagedkv.utils import canonical_dtype, torch_dtype
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


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slices compared at C speed,
    64 at a time, then one by one)."""
    a, b = (x if isinstance(x, list) else list(x) for x in (a, b))
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i:i + 64] == b[i:i + 64]:
        i += 64
    while a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    """Greedy draft-model proposals of up to ``k`` tokens (see the module doc). ``worker``: the
    draft's ``Worker`` (caches built by :meth:`init_cache`); ``block_size``: the target's,
    in tokens; ``max_len``: the draft's context (positions it may compute); ``chunk``: most
    tokens of one request per catch-up forward; ``name``: the draft model. Raises
    ``ConfigError`` for a bad ``k``."""

    writes_kv = True

    def __init__(self, worker: Worker, k: int, block_size: int, max_len: int, chunk: int = 512,
                 name: str = "draft") -> None:
        check_k(k)
        self.worker, self.k, self.block_size = worker, k, block_size
        self.max_len, self.chunk, self.name = max_len, max(1, chunk), name
        #: request id -> the token ids whose draft K/V its blocks hold (positions 0 ..)
        self.held: dict[str, list[int]] = {}
        #: request id -> the target block ids that K/V was written into (logical order)
        self.held_blocks: dict[str, list[int]] = {}
        self.num_forwards = 0  # draft forward passes run (tests, profiling)
        self.num_shared_tokens = 0  # context tokens whose draft K/V came from another request's blocks
        #: (src, dst) block copies applied since the last proposal: K/V held in src is valid in dst
        self.copied: set[tuple[int, int]] = set()

    @classmethod
    def from_config(cls, config: Any, argument: Optional[str], target: Any,
                    target_name: str) -> "DraftModelProposer":
        """Load the draft ``argument`` (a GGUF / HF path or a bundled name) as ``config`` (an
        ``EngineConfig``: dtype, device, attention backend, ``draft_weights``, block size,
        ``num_speculative_tokens``) asks and check its tokenizer against ``target`` (the
        target's ``LoadedModel``). Raises ``ConfigError``: a bad path or format, another
        tokenizer (naming both models), a draft with sliding-window layers, tensor
        parallelism."""
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
        return cls(worker, config.num_speculative_tokens, config.block_size, mc.max_position_embeddings,
                   config.max_num_batched_tokens, str(model))

    # ---- its caches: the target's block ids ---------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the draft's caches (its model's)."""
        return next(self.worker.model.parameters()).dtype

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the draft's caches per block id: ``2 * L * Hkv * d * dtype bytes *
        block_size`` of the draft model (``KVCacheSpec``, the planner's formula)."""
        spec = KVCacheSpec.from_model_config(self.worker.config, canonical_dtype(self.kv_dtype))
        return spec.block_bytes(block_size)

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Build the draft's per-layer caches of ``num_blocks`` x ``block_size`` (the target's
        pool, so the target's block ids index them). Raises ``ConfigError`` for another
        ``block_size`` than the proposer's or a second call."""
        if block_size != self.block_size:
            raise ConfigError(f"draft caches: block_size {block_size} != the target's {self.block_size}")
        self.worker.init_cache(num_blocks, block_size, self.kv_dtype)

    def close(self) -> None:
        """Stop the draft's caches' background prefault (``Worker.close``)."""
        self.worker.close()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply the target's copy-on-write copies to the draft's caches (the K/V the draft
        wrote into ``src`` follows the request to ``dst``)."""
        if copies:
            self.worker.copy_blocks(copies)
            self.copied.update((int(a), int(b)) for a, b in copies)

    # ---- the worker's calls -----------------------------------------------------------------
    def propose(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """After a step: forget the requests not in ``rows`` (no longer running), then draft
        (batched) up to ``max_drafts`` tokens for every row that asks for some (``[]`` for the
        others)."""
        rows = [DraftRequest(*r) for r in rows]
        self.retain(r.request_id for r in rows)
        out = {r.request_id: [] for r in rows}
        out.update(self.propose_batch(rows))
        return out

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in ``request_ids`` (the running ones)."""
        keep = set(request_ids)
        for rid in [r for r in self.held if r not in keep]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s draft K/V (its blocks are the target's; unknown ids: no-op)."""
        self.held.pop(request_id, None)
        self.held_blocks.pop(request_id, None)

    # ---- which K/V is valid -------------------------------------------------------------------
    def _validate(self, rows: Sequence[DraftRequest]) -> None:
        """Cut every row's held K/V to the prefix its context's tokens and its current blocks
        still match (a block replaced by its copy-on-write copy counts as the same)."""
        bs = self.block_size
        copied, self.copied = self.copied, set()
        for rid, toks, _most, blocks in rows:
            if rid not in self.held:
                continue
            held, hb = self.held[rid], self.held_blocks[rid]
            same, m = _common_prefix(hb, blocks), min(len(hb), len(blocks))
            while same < m and (hb[same] == blocks[same] or (hb[same], blocks[same]) in copied):
                same += 1  # a block copied (copy-on-write) keeps the K/V held in it
            n = min(_common_prefix(held, toks), same * bs, max(0, len(toks) - 1))
            if n < len(held):
                del held[n:]
            self.held_blocks[rid] = blocks

    def _filled(self) -> dict[tuple[int, int], list[int]]:
        """``{(block id, logical index): its tokens}`` of every whole block a request holds
        valid draft K/V in (what another request may start from); built only when a row has
        a whole block to catch up (not in a steady decode)."""
        bs, whole = self.block_size, {}
        for rid, held in self.held.items():
            blocks = self.held_blocks[rid]
            for j in range(min(len(held) // bs, len(blocks))):
                whole.setdefault((blocks[j], j), held[j * bs:(j + 1) * bs])
        return whole

    def _shared(self, toks: Sequence[int], blocks: Sequence[int], n: int, whole: dict) -> int:
        """``n`` extended over whole blocks (from a block boundary) whose draft K/V another
        request wrote with the same tokens at the same positions in the same block."""
        bs = self.block_size
        j = n // bs
        if n % bs:
            return n
        while (j + 1) * bs <= len(toks) - 1 and j < len(blocks) and whole.get((blocks[j], j)) == toks[j * bs:(j + 1) * bs]:
            j += 1
        return max(n, j * bs)

    # ---- the draft model's forwards ---------------------------------------------------------
    def propose_batch(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """``{request id: drafts}`` (``[]`` for rows with ``max_drafts`` 0): each request's draft
        K/V is brought to its context (see the module doc), then up to ``max_drafts`` tokens
        are drafted greedily (no more than its slots and the draft's context allow), every
        forward batched over the requests."""
        rows = [DraftRequest(r[0], list(r[1]), r[2], list(r[3]) if len(r) > 3 else []) for r in rows]
        self._validate(rows)
        whole = None
        out: dict[str, list[int]] = {r.request_id: [] for r in rows}
        live = []  # [rid, context, drafts wanted]
        for rid, toks, most, blocks in rows:
            if most <= 0:
                continue
            # drafts at positions len(toks) ..: inside the draft's context; the K/V written
            # (positions .. len(toks) + most - 2) inside the row's slots
            most = min(most, self.max_len - len(toks), len(blocks) * self.block_size - len(toks) + 1)
            if most <= 0 or not toks:
                if len(toks) >= self.max_len:  # past the draft's context for good
                    self.release(rid)
                continue
            own = len(self.held.get(rid, ()))
            keep = own
            if own % self.block_size == 0 and own + self.block_size <= len(toks) - 1:  # a whole block to compute
                whole = self._filled() if whole is None else whole
                keep = self._shared(toks, blocks, own, whole)
            self.num_shared_tokens += keep - own
            self.held[rid], self.held_blocks[rid] = toks[:keep], blocks
            live.append([rid, toks, most])
        if not live:
            return out
        # catch-up: every request's missing context, in two waves: a row whose next whole
        # block an earlier row fills with the same tokens now (n > 1 siblings' prompt, two
        # hits on one prefix) waits for it and starts after it
        first, later, filling = [], [], {}
        for row in live:
            rid, toks = row[0], row[1]
            blocks, n = self.held_blocks[rid], len(self.held[rid])
            if self._shared(toks, blocks, n, filling) > n:
                later.append(row)
                continue
            first.append(row)
            for j in range(n // self.block_size, min(len(blocks), (len(toks) - 1) // self.block_size)):
                filling.setdefault((blocks[j], j), toks[j * self.block_size:(j + 1) * self.block_size])
        self._catch_up(first, out)
        if later:
            for rid, toks, _ in later:  # the blocks in filling are filled now
                own = len(self.held[rid])
                keep = self._shared(toks, self.held_blocks[rid], own, filling)
                self.num_shared_tokens += keep - own
                self.held[rid] = toks[:keep]
            self._catch_up(later, out)
        # k - 1 one-token decode steps over the requests still drafting
        for j in range(1, max(m for _, _, m in live)):
            step = [(rid, [out[rid][-1]], len(self.held[rid])) for rid, _, m in live if m > j]
            for (rid, fed, _), t in zip(step, self._forward(step)):
                self.held[rid] += fed
                out[rid].append(t)
        return out

    def _catch_up(self, live: Sequence[list], out: dict[str, list[int]]) -> None:
        """Compute each ``[request id, context, most]`` row's missing context (chunks of
        ``chunk`` tokens alone, the last chunk of every row in one forward) and append its
        first draft to ``out``."""
        if not live:
            return
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

    def _forward(self, rows: Sequence[tuple[str, list[int], int]], sample: bool = True) -> list[int]:
        """One draft forward over ``(request id, new token ids, their first position)`` rows
        through their target block tables; the argmax token after each row's last one
        (``[]`` when ``sample`` is False)."""
        runner = self.worker.runner
        inp = runner.prepare([t for _, t, _ in rows], [s for _, _, s in rows],
                             [self.held_blocks[rid] for rid, _, _ in rows], [sample] * len(rows))
        logits = runner.execute(inp)
        self.num_forwards += 1
        return logits.argmax(dim=-1).tolist() if sample else []
