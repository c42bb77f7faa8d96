"""LLMEngine: add_request / step / abort_request over the paged KV memory system.

One ``step()``, read top to bottom: ``scheduler.schedule()`` (admission, preemption, block
allocation and copy-on-write; the scheduler alone calls the KV manager) → the executor
(``pagedkv.worker.worker.Executor``, one per engine from ``make_executor``: this process's
``Worker`` or tensor-parallel ranks; flat batch through the one slot-mapping builder, CoW
copies, model forward writing K/V through ``slot_mapping`` and reading through
``block_tables``) → sampler (sequence groups decide n > 1 forks and which rows beam search takes) →
``scheduler.update`` (the forks, append tokens, stop checks, publish full blocks, free
behind the step fence) → beam steps and stop strings decide → ``scheduler.apply`` (forks,
finishes) → output processor (``RequestOutput``). Groups, beams and the output processor
never hold the scheduler; they return ``pagedkv.engine.decisions`` records.

Thread-safety: ``add_request`` and ``abort_request`` may be called from other threads (the
server). The engine lock is *released* during the forward pass, so an abort can land while
the step is in flight; the KV manager then defers returning the aborted request's blocks
until the step's fence closes (seed §04), so no other request can be handed a block the
running step still writes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Optional, Sequence, Union

import torch

from pagedkv import cpu_isa, native
from pagedkv.distributed import check_tp_size, make_executor
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.decisions import Decisions
from pagedkv.engine.output import OutputProcessor
from pagedkv.engine.request import Request, RequestOutput, SamplingParams, now
from pagedkv.engine.sampler import Sampler, prompt_logprob_dicts
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.spec_decode import draft_model_name, make_proposer, sample_with_drafts, split_extra_rows
from pagedkv.engine.spec_draft import DraftProposer
from pagedkv.engine.sequence_group import SequenceGroup, SequenceGroups, request_blocks
from pagedkv.engine.structured import GrammarCompiler
from pagedkv.engine.stats import EngineStats
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.kv import CacheKeys, KVCacheSpec, parse_size
from pagedkv.kv.tiers import StoreIdentity, ZmqEventPublisher, open_tiers, parse_tier_specs, replay_endpoint_for
from pagedkv.model.tokenizer import apply_chat, encode_prompt, read_chat_template
from pagedkv.model.weight_cache import model_digest
from pagedkv.attention.quant import FORMATS, check_group_size
from pagedkv.utils import canonical_dtype, kv_cache_dtype, passive_wait_warning, profile_scope, torch_dtype
from pagedkv.worker.worker import Worker

logger = logging.getLogger("pagedkv")


class LLMEngine:
    """The engine. ``model``: a path (GGUF file or HF safetensors directory), ``None`` for
    the bundled SmolLM2-135M-Instruct, or an already loaded ``pagedkv.model.loader.LoadedModel``
    (tests share one). Other keyword arguments: see :class:`EngineConfig`.

    Raises ``ConfigError`` for bad options and ``InvalidRequestError`` for bad requests."""

    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        cfg = self.config = EngineConfig.from_kwargs(kwargs)
        self.dtype = dtype = torch_dtype(cfg.dtype)
        logger.info("CPU: %s", cpu_isa.profile().summary())  # ConfigError for a bad $PAGEDKV_CPU_ISA
        # the device side (weights, backend, caches, compiled steps) is the worker's
        kv_bytes = 0 if cfg.num_blocks is not None else parse_size(
            cfg.kv_cache_memory if cfg.kv_cache_memory is not None else "1GiB")
        worker = Worker.load(model, dtype=dtype, device=cfg.device, weights=cfg.weights,
                             attention_backend=cfg.attention_backend, tensor_parallel_size=cfg.tensor_parallel_size,
                             kv_bytes=kv_bytes, deterministic=cfg.deterministic)
        loaded = worker.loaded
        logger.info("weights: %s (%s)", loaded.weights, loaded.weights_reason)
        if (warning := passive_wait_warning(torch.get_num_threads())) is not None:
            logger.warning(warning)
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = None if cfg.chat_template is None else read_chat_template(cfg.chat_template)
        self.model_id = str(mc.model_id)
        self.revision = cfg.model_revision or str(getattr(mc, "revision", "") or "")
        self.max_model_len = cfg.resolve_max_model_len(mc.max_position_embeddings)

        tp = cfg.tensor_parallel_size
        if tp != 1:
            check_tp_size(mc, tp)  # ConfigError naming the valid sizes
        # the KV cache format: a plain dtype, or int8/fp8 codes + bf16 scales per group
        self.kv_cache_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype)
        quant = FORMATS.get(self.kv_cache_dtype)  # a group size without one: EngineConfig raised
        self.kv_quant_group_size = check_group_size(cfg.kv_quant_group_size, mc.cache_head_dim) if quant else None
        # per layer its sliding window (None: full); all-full models keep one layer group
        windows = mc.layer_windows()
        self.layer_windows = windows if windows and any(w is not None for w in windows) else None
        self.kv_spec = KVCacheSpec.from_model_config(
            mc, quant.spec_dtype if quant else canonical_dtype(self.kv_cache_dtype), tp_size=tp,
            quant_group_size=self.kv_quant_group_size,
        )
        # the prefix-cache identity of this cache's bytes (format and, when quantised, group)
        self.kv_format_id = f"{self.kv_cache_dtype}/g{self.kv_quant_group_size}" if quant else self.kv_cache_dtype
        if cfg.num_blocks is not None:
            num_blocks = cfg.num_blocks
        else:
            budget = parse_size(cfg.kv_cache_memory if cfg.kv_cache_memory is not None else "1GiB")
            num_blocks = self.kv_spec.num_blocks(budget, cfg.block_size)
        self.num_blocks = num_blocks
        # a draft model (its own worker and KV pool of num_blocks blocks) or None
        draft = draft_model_name(cfg.speculative)
        self.draft = None if draft is None else DraftProposer.load(draft, cfg, loaded, num_blocks, self.model_id)

        self.backend = worker.backend
        if torch.device(cfg.device).type == "cpu":
            logger.info("native kernels: %s", native.summary(cfg.compile_decode))  # built (first start) or loaded now
        # one executor: this process's worker, or tp ranks (this process is rank 0); every step
        # compiled, prefill chunks and mixed steps included (up to the step's token budget)
        self.executor = make_executor(
            worker, tp_size=tp, num_blocks=num_blocks, block_size=cfg.block_size,
            kv_cache_dtype=self.kv_cache_dtype, kv_quant_group_size=self.kv_quant_group_size,
            layer_windows=self.layer_windows,
            compile_max_rows=max(64, cfg.max_num_batched_tokens) if cfg.compile_decode else None,
        )
        self.runner = self.executor.runner  # (rank 0's) ModelRunner: its KV caches, model, compiled step
        self.kv_tiers, self.kv_stores, self.kv_events = self._open_kv_tiers(mc, dtype)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len,
            policy=cfg.policy, watermark=cfg.watermark, enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.prefix_caching, enable_paging=cfg.enable_paging,
            shuffle_seed=cfg.shuffle_blocks, kv_tiers=self.kv_tiers, layer_windows=self.layer_windows,
            speculative=self.draft or make_proposer(cfg),
        ))
        self.groups = SequenceGroups()
        self.output = OutputProcessor(self.tokenizer)
        self.sampler = Sampler(torch.Generator().manual_seed(cfg.seed))
        self.eos_token_ids = tuple(mc.eos_token_ids or ())
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)  # structured outputs
        self._lock = threading.RLock()
        self._ids = itertools.count()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s, %d B/token); max concurrency at "
            "max_model_len %d: %.2f", num_blocks, cfg.block_size, num_blocks * cfg.block_size,
            self.kv_cache_dtype, self.kv_spec.bytes_per_token, self.max_model_len,
            num_blocks * cfg.block_size / self.max_model_len,
        )

    def _open_kv_tiers(self, mc: Any, dtype: torch.dtype) -> tuple[Any, Any, Any]:
        """``(KVTiers, TierStores, publisher)`` for ``kv_offload`` / ``kv_events`` (Nones
        when both are off). Raises ``ConfigError`` (bad spec, unwritable or full disk,
        endpoint in use) or ``KVStoreMismatchError`` (a store of another model/format)."""
        cfg = self.config
        specs = parse_tier_specs(cfg.kv_offload)
        if not specs and not cfg.kv_events:
            return None, None, None
        if self.layer_windows is not None:  # before a store or a socket is opened
            raise ConfigError("kv_offload / kv_events: not supported for a model with sliding-window "
                              "layers (its KV block ids hold one layer group each; docs/hybrid_kv.md)")
        publisher = identity = None
        try:
            if cfg.kv_events:
                publisher = ZmqEventPublisher(cfg.kv_events, cfg.kv_events_replay or replay_endpoint_for(cfg.kv_events))
            if specs:  # tensor parallelism is refused with tiers: one runner holds every head
                codec = self.executor.kv_payload_codec()
                identity = StoreIdentity(
                    model_id=self.model_id, revision=self.revision, weights=str(self.loaded.weights),
                    kv_dtype=self.kv_format_id,  # the cache format: int8/g64 blocks are not float32 ones
                    block_size=cfg.block_size, num_layers=mc.num_layers, block_format=codec.format,
                    block_nbytes=codec.nbytes,
                    weights_digest=model_digest(self.loaded.path), tp_size=cfg.tensor_parallel_size,
                )
            tiers, stores = open_tiers(specs, identity, cfg.block_size, publisher)
        except BaseException:
            for obj in (publisher, self.executor):  # TP workers too: nothing outlives a failed start
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
            raise
        logger.info("KV tiers: %s; KV events: %s", ", ".join(map(str, specs)) or "none", cfg.kv_events or "off")
        return tiers, stores, publisher

    @property
    def kv(self) -> Any:
        """The scheduler's ``KVCacheManager``, for inspection (tests, tools). Only the
        scheduler changes it."""
        return self.scheduler.kv

    def close(self) -> None:
        """Release the step runner's resources: with tensor parallelism, stop every worker
        process; with a disk tier, first copy every cached block there (the next start
        finds them) and commit; stop the KV event publisher. Idempotent; the engine cannot
        step afterwards (tensor parallel, tiers)."""
        stores, self.kv_stores = self.kv_stores, None
        if stores is not None:
            with self._lock:
                self.executor.transfer_kv(self.scheduler.persist_kv(), stores)
            stores.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.executor.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------
    def kv_summary(self) -> dict[str, Any]:
        """The paged KV cache: its format (``kv_cache_dtype``, ``kv_quant_group_size``), size
        (blocks, tokens, bytes) and the max concurrency at max_model_len (with sliding-window
        layers: ``layer_groups`` and usable blocks / the blocks one max_model_len request holds
        over every group)."""
        bs = self.config.block_size
        conc = self.config.max_concurrency(self.num_blocks, self.max_model_len)
        if self.layer_windows is not None:
            conc = (self.num_blocks - 1) / self.kv_spec.blocks_per_request(self.max_model_len, bs)
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_quant_group_size": self.kv_quant_group_size,
            "num_blocks": self.num_blocks,
            "block_size": bs,
            "tokens": self.num_blocks * bs,
            "bytes_per_token": self.kv_spec.bytes_per_token,
            "bytes": self.num_blocks * self.kv_spec.block_bytes(bs),
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": conc,
            "layer_groups": self.kv_spec.groups.describe() if self.layer_windows is not None else None,
        }

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt, with the model's own BOS/EOS rule
        (``pagedkv.model.tokenizer.encode_prompt``)."""
        return encode_prompt(self.tokenizer, prompt)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be served: the engine's ``chat_template`` option or the
        model's own template (a base model such as Gemma-3-270M has none)."""
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation (``pagedkv.model.tokenizer.apply_chat``: flags as there);
        ``InvalidRequestError``: bad messages or flags, no template."""
        return apply_chat(self.tokenizer, messages, add_generation_prompt, self.chat_template, self.model_id,
                          continue_final_message=continue_final_message)

    def add_request(
        self,
        request_id: Optional[str],
        prompt: Union[str, Sequence[int]],
        sampling_params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        adapter_id: Optional[str] = None,
        mm_hashes: Sequence[tuple] = (),
        stream: bool = False,
        tenant: Optional[str] = None,
    ) -> str:
        """Queue a request; returns its id. ``prompt`` is text (tokenised without special
        tokens: use :meth:`apply_chat_template` for chat) or token ids. Raises
        ``InvalidRequestError`` (nothing admitted, nothing allocated) for an empty prompt, a
        prompt with no room for one output token within max_model_len, bad sampling params,
        a request that could never fit the whole pool, or a duplicate id.

        Prefix-cache identity (a cached block is reused only when all of these match, besides
        the token ids): the engine's model id and revision, its KV cache format (an int8
        block is never served to an fp32 cache), ``adapter_id``, ``cache_salt``,
        ``tenant`` (the isolation domain, e.g. the API key's owner: two tenants never share a
        block) and ``mm_hashes`` (``(content_hash, offset, length)`` per multimodal item)."""
        if tenant is not None and not isinstance(tenant, str):
            raise InvalidRequestError(f"tenant must be a string or None, got {type(tenant).__name__}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        params.validate(max_n=self.config.max_n, vocab_size=self.model_config.vocab_size)
        if params.structured is not None:  # a bad schema/regex/grammar: InvalidRequestError
            self.grammars.compile(params.structured)
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
            or arrival_time != arrival_time
        ):
            raise InvalidRequestError(f"arrival_time must be seconds (a number), got {arrival_time!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        for name, v in (("cache_salt", cache_salt), ("adapter_id", adapter_id)):
            if v is not None and not isinstance(v, str):
                raise InvalidRequestError(f"{name} must be a string or None, got {type(v).__name__}")
        if not isinstance(mm_hashes, (list, tuple)) or not all(
            isinstance(m, tuple) and len(m) == 3 and isinstance(m[0], str)
            and all(type(x) is int and x >= 0 for x in m[1:]) for m in mm_hashes
        ):
            raise InvalidRequestError("mm_hashes must be a list of (content_hash: str, offset, length) tuples")
        if isinstance(prompt, str):
            text: Optional[str] = prompt
            token_ids = self.tokenize(prompt)
        else:
            if not isinstance(prompt, (list, tuple)):
                raise InvalidRequestError(
                    f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
                )
            text = None
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(type(t) is int and 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one output token must fit)"
            )
        total = min(len(token_ids) + params.max_tokens, self.max_model_len)
        cfg = self.config
        need = request_blocks(len(token_ids), total, params, cfg.block_size, cfg.enable_paging, self.max_model_len,
                              self.kv_spec.groups.windows, chunk=cfg.max_num_batched_tokens)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({total} tokens) but the pool has only "
                f"{self.num_blocks}: it could never fit"
            )
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            request_id = str(request_id)
            if "#" in request_id:  # reserved for the engine's n > 1 / beam sequence ids
                raise InvalidRequestError(f"request id {request_id!r} must not contain '#'")
            if self.groups.get(request_id) is not None:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            t = arrival_time if arrival_time is not None else now()
            keys = CacheKeys(
                model_id=self.model_id, revision=self.revision, adapter_id=adapter_id,
                cache_salt=cache_salt, mm_hashes=tuple(mm_hashes), tenant=tenant,
                kv_cache_dtype=self.kv_format_id,
            )
            group = SequenceGroup(request_id, text, token_ids, params, t, pending_children=params.n - 1, stream=stream)
            seq = Request(
                request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                arrival_time=t, cache_keys=keys, priority=priority, prompt=text,
                eos_token_ids=self.eos_token_ids, max_total_tokens=total, parent_id=request_id,
            )
            self.groups.add(group, seq)
            self.scheduler.add_request(seq, gang=params.use_beam_search)
        return request_id

    def abort_request(self, request_id: Union[str, Sequence[str]]) -> None:
        """Abort requests (all n sequences). Safe at any time, also while a step runs and
        more than once. Unknown or finished ids are ignored."""
        if isinstance(request_id, str):
            ids = [request_id]
        elif isinstance(request_id, (list, tuple, set)) and all(isinstance(r, str) for r in request_id):
            ids = list(request_id)
        else:
            raise InvalidRequestError("abort_request takes a request id or a list of them")
        with self._lock:
            for rid in ids:
                self.scheduler.abort(self.groups.abort(rid))
            if self.draft is not None:  # the aborted requests' draft blocks
                self.draft.retain(r.request_id for r in self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(len(self.groups))

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self.groups)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns a RequestOutput for each user request that got new
        tokens or finished in this step (cumulative text and token ids).

        If the step raises (a kernel error, KeyboardInterrupt), its fence is still closed,
        so blocks freed meanwhile return to the pool; the scheduled requests keep their
        progress and recompute the failed step's tokens next time."""
        opened: list = []
        try:
            return self._step(opened)
        except BaseException:
            with self._lock:
                for out in opened:
                    self.scheduler.end_step(out)  # idempotent
            raise

    def _step(self, opened: list) -> list[RequestOutput]:
        with self._lock:
            if self.draft is not None:  # the draft model's proposals, batched over the running rows
                with profile_scope("pagedkv.draft"):
                    self.draft.prefetch(self.scheduler.running, self.max_model_len, self.config.max_num_batched_tokens)
            with profile_scope("pagedkv.schedule"):
                out = self.scheduler.schedule()
            opened.append(out)
            if out.is_empty:
                self.scheduler.end_step(out)
                self.scheduler.check_stall(out)
                return self._collect(self.groups.finished_ids())
            with profile_scope("pagedkv.prepare"):
                sampling = out.sampling_requests()
                prompt_rows = out.prompt_rows()
                extra_rows = out.extra_rows(prompt_rows)  # prompt logprobs, speculative rows
                inp = self.executor.prepare(*out.model_inputs(), extra_rows)
                if out.kv_transfer is not None:  # tier stores/loads: reads evicted blocks first
                    self.executor.transfer_kv(out.kv_transfer, self.kv_stores)
                self.executor.copy_blocks(out.copies)
        logits = self.executor.execute(inp)  # lock released: aborts may land now (fenced)
        with self._lock:
            draft_logits: dict = {}
            if any(extra_rows):
                prompt_logits, draft_logits = split_extra_rows(out.scheduled, prompt_rows, out.drafts,
                                                               logits[inp.num_sample_rows:])
                self._record_prompt_logprobs(out, prompt_rows, prompt_logits)
                logits = logits[:inp.num_sample_rows]
            with profile_scope("pagedkv.sample"):
                rows, reqs, forks = self.groups.expand_forks(out, sampling)  # running rows only
                rows, reqs, beam_groups = self.groups.offer_beam_rows(logits, rows, reqs)
                keep = list(zip(rows, reqs))
                sampled: dict[str, tuple[int, Optional[dict[int, float]]]] = {}
                runs: dict = {}
                if keep and draft_logits:
                    sampled, runs = sample_with_drafts(self.sampler, logits[[i for i, _ in keep]], [r for _, r in keep],
                                                       draft_logits, out.drafts, self.tokenizer)
                elif keep:
                    idx = [i for i, _ in keep]  # every row in order (plain decode): no gathered copy
                    so = self.sampler(logits if idx == list(range(len(logits))) else logits[idx], [r for _, r in keep])
                    for (_, r), t, lp in zip(keep, so.token_ids, so.logprobs):
                        sampled[r.request_id] = (t, lp)
            with profile_scope("pagedkv.update"):
                self.scheduler.update(out, sampled, forks, runs)
                decisions = Decisions()
                for gid in beam_groups:
                    decisions += self.groups.beam_step(gid, self.tokenizer)
                touched = set(beam_groups)
                for _, r in keep:
                    touched.add(r.parent_id)
                    group = self.groups.of(r.request_id)
                    if r.sampling_params.stop or (group is not None and group.stream):
                        if (stop := self.output.detokenize(r)) is not None:
                            decisions.finishes.append(stop)
                self.scheduler.apply(decisions)
                if self.draft is not None:  # finished / preempted requests' draft blocks
                    self.draft.retain(r.request_id for r in self.scheduler.running)
            if self.config.debug_invariants:
                self.scheduler.check_invariants()
            with profile_scope("pagedkv.output"):
                return self._collect(touched | self.groups.finished_ids())

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

    def _collect(self, group_ids: set[str]) -> list[RequestOutput]:
        """RequestOutputs of ``group_ids`` in arrival order; finished groups are forgotten."""
        groups = [g for g in (self.groups.get(r) for r in group_ids) if g is not None]
        outs = []
        for group in sorted(groups, key=lambda g: g.arrival_time):
            outs.append(self.output.make_output(group))
            if group.finished:
                self.groups.pop(group.request_id)
                self.scheduler.count_finished_request()
        return outs

    # ---- statistics ------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """One consistent view (taken under the engine lock) for live UIs: ``{"kv":
        KVCacheManager.snapshot(), "requests": [...running, then waiting], "stats":
        EngineStats}``; see ``Scheduler.snapshot`` for the request fields."""
        with self._lock:
            return {**self.scheduler.snapshot(), "stats": self.scheduler.engine_stats()}

    def get_stats(self) -> EngineStats:
        """Engine statistics (:class:`EngineStats`): requests, KV blocks, prefix cache,
        preemptions, CoW copies."""
        with self._lock:
            return self.scheduler.engine_stats()

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (benchmarks: every policy starts cold). Safe at any time;
        running requests keep their blocks. Returns how many pool blocks were cached."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    def num_shared_blocks(self) -> int:
        """Blocks referenced more than once right now (see ``Scheduler.num_shared_blocks``)."""
        with self._lock:
            return self.scheduler.num_shared_blocks()
