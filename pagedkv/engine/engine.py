"""LLMEngine: add_request / step / abort_request over the paged KV memory system.

The vLLM v1 shape, in three parts:

* **input** (``pagedkv.engine.input_processor``): ``add_request`` checks, tokenises,
  compiles a structured-output grammar and builds the prefix-cache identity, then queues the
  request in the scheduler;
* **the core**, one ``step()`` read top to bottom: ``scheduler.schedule()`` (admission,
  preemption, block allocation and copy-on-write, lookahead slots for the drafts a request
  carries; the scheduler alone calls the KV manager) → the executor (``pagedkv.worker.worker.Executor``, one per engine from
  ``make_executor``: this process's ``Worker`` or tensor-parallel ranks; flat batch through
  the one slot-mapping builder, CoW copies, model forward writing K/V through
  ``slot_mapping`` and reading through ``block_tables``) → the step sampler
  (``step_sampler``: prompt logprob and draft rows, n > 1 forks, beam rows, the sampler) →
  ``scheduler.update`` (the forks, append tokens, stop checks, publish full blocks, free
  behind the step fence) → the output processor's decisions (beam steps, stop strings) →
  ``scheduler.apply`` (forks, finishes) → the executor's ``propose_drafts`` (the worker's
  speculative proposer, after the forward and sampling; ``{}`` when off) for the rows of
  ``scheduler.draft_rows()``, handed back with ``scheduler.set_drafts``;
* **output** (``pagedkv.engine.output``): detokenisation state, stop strings, streams,
  beams' final choice and the ``RequestOutput``s.

Groups, beams, the step sampler and the output processor never hold the scheduler; they
return ``pagedkv.engine.decisions`` records. The features (speculative decoding, structured
outputs) are wired by ``pagedkv.engine.builder``: this module imports none of them.
Speculation's proposer (``pagedkv.worker.proposer``) is owned by the executor's worker.

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

from pagedkv import cpu_isa
from pagedkv.ops import native
from pagedkv.distributed import check_tp_size, make_executor
from pagedkv.distributed.worker import env_rank
from pagedkv.engine.builder import make_grammar_compiler, make_proposer
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.input_processor import InputLimits, InputProcessor
from pagedkv.engine.output import OutputProcessor
from pagedkv.engine.request import RequestOutput, SamplingParams
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.sequence_group import SequenceGroups
from pagedkv.engine.step_sampler import StepSampler
from pagedkv.engine.stats import EngineStats
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.kv import KVCacheSpec, parse_size
from pagedkv.kv.tiers import StoreIdentity, ZmqEventPublisher, open_tiers, parse_tier_specs, replay_endpoint_for
from pagedkv.model.weight_cache import model_digest
from pagedkv.model.step_strategy import choose_step_strategy
from pagedkv.attention.quant import FORMATS, check_group_size
from pagedkv.utils import canonical_dtype, kv_cache_dtype, passive_wait_warning, profile_scope, torch_dtype
from pagedkv.worker.worker import Worker

logger = logging.getLogger("pagedkv")


def pool_bytes(model: Any, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of a pool of ``cfg.num_blocks`` blocks (one rank's, as a ``kv_cache_memory``
    budget is) of ``model`` given as a path or ``None`` (the bundled model), sized from its
    header alone (``load_config``), so the loader's host-memory check counts the KV cache when
    the pool is given in blocks too; 0 for an already loaded model, or a model or KV option
    that the loader and the engine refuse themselves (their ``ConfigError`` comes from there)."""
    from pathlib import PurePath

    from pagedkv.model.loader import load_config

    if not (model is None or isinstance(model, (str, PurePath))):
        return 0
    try:
        return kv_format(load_config(model), cfg, dtype)[2].block_bytes(cfg.block_size) * int(cfg.num_blocks)
    except (ConfigError, OSError, ValueError):
        return 0


def kv_format(mc: Any, cfg: EngineConfig, dtype: torch.dtype) -> tuple[str, Optional[int], KVCacheSpec]:
    """``(kv_cache_dtype, quant group size or None, KVCacheSpec)`` of the engine's cache for
    model config ``mc``: a plain dtype, or int8/fp8 codes with scales per group. Raises
    ``ConfigError`` for a group size the head dim does not take."""
    kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    quant = FORMATS.get(kv_dtype)  # a group size without one: EngineConfig raised
    group = check_group_size(cfg.kv_quant_group_size, mc.cache_head_dim) if quant else None
    spec = KVCacheSpec.from_model_config(mc, quant.spec_dtype if quant else canonical_dtype(kv_dtype),
                                         tp_size=cfg.tensor_parallel_size, quant_group_size=group)
    return kv_dtype, group, spec


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
        kv_bytes = pool_bytes(model, cfg, dtype) if cfg.num_blocks is not None else parse_size(
            cfg.kv_cache_memory if cfg.kv_cache_memory is not None else "1GiB")
        worker = Worker.load(model, dtype=dtype, device=cfg.device, weights=cfg.weights,
                             attention_backend=cfg.attention_backend, tensor_parallel_size=cfg.tensor_parallel_size,
                             kv_bytes=kv_bytes, deterministic=cfg.deterministic,
                             tp_rank=(env_rank() or (0,))[0] if cfg.tensor_parallel_size > 1 else 0)
        loaded = worker.loaded
        logger.info("weights: %s (%s)", loaded.weights, loaded.weights_reason)
        if (warning := passive_wait_warning(torch.get_num_threads())) is not None:
            logger.warning(warning)
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_id = str(mc.model_id)
        self.max_model_len = cfg.resolve_max_model_len(mc.max_position_embeddings)

        tp = cfg.tensor_parallel_size
        if tp != 1:
            check_tp_size(mc, tp)  # ConfigError naming the valid sizes
        # the KV cache format: a plain dtype, or int8/fp8 codes + bf16 scales per group
        self.kv_cache_dtype, self.kv_quant_group_size, self.kv_spec = kv_format(mc, cfg, dtype)
        # per layer its sliding window (None: full); all-full models keep one layer group
        windows = mc.layer_windows()
        self.layer_windows = windows if windows and any(w is not None for w in windows) else None
        # the prefix-cache identity of this cache's bytes (format and, when quantised, group)
        self.kv_format_id = (f"{self.kv_cache_dtype}/g{self.kv_quant_group_size}" if self.kv_cache_dtype in FORMATS
                             else self.kv_cache_dtype)
        # speculative decoding: the proposer (n-gram; a draft model: its own worker, its K/V in
        # the target's blocks), handed to the executor, which runs it after each step's sampling
        proposer = make_proposer(cfg, loaded, self.model_id)
        # bytes of one block id: the target's pages plus the draft's (the pool holds both)
        self.draft_block_bytes = proposer.kv_bytes_per_block(cfg.block_size) if proposer is not None else 0
        if cfg.num_blocks is not None:
            num_blocks = cfg.num_blocks
        else:
            budget = parse_size(cfg.kv_cache_memory if cfg.kv_cache_memory is not None else "1GiB")
            num_blocks = self.kv_spec.num_blocks(budget, cfg.block_size, extra_block_bytes=self.draft_block_bytes)
        self.num_blocks = num_blocks
        # requests in: validation, tokenisation, chat template (ConfigError for a bad one), grammars
        self.eos_token_ids = tuple(mc.eos_token_ids or ())
        self.grammars = make_grammar_compiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)  # structured outputs
        self.inputs = InputProcessor(
            self.tokenizer, InputLimits(mc.vocab_size, self.max_model_len, cfg.max_n, num_blocks, cfg.block_size,
                                        cfg.enable_paging, cfg.max_num_batched_tokens, self.kv_spec.groups.windows),
            model_id=self.model_id, revision=cfg.model_revision or str(getattr(mc, "revision", "") or ""),
            kv_format_id=self.kv_format_id, eos_token_ids=self.eos_token_ids, chat_template=cfg.chat_template,
            compile_grammar=self.grammars.compile,
        )
        if proposer is not None and proposer.writes_kv:
            if self.layer_windows and all(w is not None for w in self.layer_windows):
                raise ConfigError("speculative draft model: the target has no full-attention layer, whose block "
                                  "table the draft's K/V would share")
            proposer.init_cache(num_blocks, cfg.block_size)

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
        self.executor.attach_proposer(proposer)
        self.runner = self.executor.runner  # (rank 0's) ModelRunner: its KV caches, model, compiled step
        self.step_strategy = choose_step_strategy(self.runner.model, self.backend, self.runner.compiled)
        logger.info("step strategy: %s", self.step_strategy)
        self.kv_tiers, self.kv_stores, self.kv_events = self._open_kv_tiers(mc, dtype)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len,
            policy=cfg.policy, watermark=cfg.watermark, enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.prefix_caching, enable_paging=cfg.enable_paging,
            shuffle_seed=cfg.shuffle_blocks, kv_tiers=self.kv_tiers, layer_windows=self.layer_windows,
            num_speculative_tokens=cfg.num_speculative_tokens if proposer is not None else 0,
            draft_kv=proposer is not None and proposer.writes_kv,
        ))
        self.groups = SequenceGroups()
        self.output = OutputProcessor(self.tokenizer)
        self.sampler = Sampler(torch.Generator().manual_seed(cfg.seed))
        self.step_sampler = StepSampler(self.sampler, self.groups, cut=self.output.cut_at_stop_string)
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

    @property
    def proposer(self) -> Any:
        """The executor's speculative proposer (``pagedkv.worker.proposer.Proposer``; ``None``
        when off), for inspection (tests, tools). Only the worker runs it."""
        return self.executor.proposer

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
            "draft_bytes": self.num_blocks * self.draft_block_bytes,  # a draft model's K/V, same block ids
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": conc,
            "layer_groups": self.kv_spec.groups.describe() if self.layer_windows is not None else None,
        }

    @property
    def revision(self) -> str:
        """The model revision in this engine's prefix-cache identity (``model_revision`` or
        the model's own); settable (a reloaded model: its cached blocks are never served)."""
        return self.inputs.revision

    @revision.setter
    def revision(self, value: str) -> None:
        self.inputs.revision = value

    @property
    def chat_template(self) -> Optional[str]:
        """The ``chat_template`` option's text (``None``: the model's own template)."""
        return self.inputs.chat_template

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt, with the model's own BOS/EOS rule
        (``pagedkv.model.tokenizer.encode_prompt``)."""
        return self.inputs.tokenize(prompt)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be served: the engine's ``chat_template`` option or the
        model's own template (a base model such as Gemma-3-270M has none)."""
        return self.inputs.has_chat_template

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation (``pagedkv.model.tokenizer.apply_chat``: flags as there);
        ``InvalidRequestError``: bad messages or flags, no template."""
        return self.inputs.apply_chat_template(messages, add_generation_prompt, continue_final_message)

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
        a request that could never fit the whole pool, or a duplicate id (the checks are the
        input processor's: ``pagedkv.engine.input_processor``).

        Prefix-cache identity (a cached block is reused only when all of these match, besides
        the token ids): the engine's model id and revision, its KV cache format (an int8
        block is never served to an fp32 cache), ``adapter_id``, ``cache_salt``,
        ``tenant`` (the isolation domain, e.g. the API key's owner: two tenants never share a
        block) and ``mm_hashes`` (``(content_hash, offset, length)`` per multimodal item)."""
        req = self.inputs.process(prompt, sampling_params, arrival_time=arrival_time, priority=priority,
                                  cache_salt=cache_salt, adapter_id=adapter_id, mm_hashes=mm_hashes,
                                  stream=stream, tenant=tenant, tokenize=self.tokenize)
        with self._lock:
            rid = f"req-{next(self._ids)}" if request_id is None else request_id
            group, seq = self.inputs.make(rid, req, lambda r: self.groups.get(r) is not None)
            self.groups.add(group, seq)
            self.scheduler.add_request(seq, gang=req.params.use_beam_search)
        return seq.request_id

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
            aborted = [r.request_id for rid in ids for r in self.scheduler.abort(self.groups.abort(rid))]
            self.executor.finish_requests(aborted)  # e.g. their draft model blocks

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
            with profile_scope("pagedkv.schedule"):
                out = self.scheduler.schedule()
            opened.append(out)
            if out.is_empty:
                return self._idle(out)
            with profile_scope("pagedkv.prepare"):
                rows = self.step_sampler.rows(out)
                inp = self.executor.prepare(*out.model_inputs(), rows.extra)
                self._move_blocks(out)
        logits = self.executor.execute(inp)  # lock released: aborts may land now (fenced)
        with self._lock:
            chosen = self.step_sampler.choose(out, rows, logits, inp.num_sample_rows)
            with profile_scope("pagedkv.update"):
                self.scheduler.update(out, chosen.sampled, chosen.forks, chosen.runs)
                self.scheduler.apply(self.output.decide(chosen.seqs, chosen.beam_groups, self.groups))
            with profile_scope("pagedkv.draft"):  # speculative proposals for the next step
                self.scheduler.set_drafts(self._propose())
            if self.config.debug_invariants:
                self.scheduler.check_invariants()
            with profile_scope("pagedkv.output"):
                return self._collect(chosen.touched | self.groups.finished_ids())

    def _propose(self) -> dict[str, list[int]]:
        """The proposer's drafts for the next step (``{}`` when off): the drafting rows'
        lookahead slots are reserved and their copy-on-write copies applied first."""
        rows, copies = self.scheduler.draft_rows()
        self.executor.copy_blocks(copies)
        return self.executor.propose_drafts(rows)

    def _idle(self, out: Any) -> list[RequestOutput]:
        """A step that scheduled nothing: close its fence, raise ``SchedulerStallError`` if
        nothing can ever run, return the outputs of groups that finished meanwhile (aborts)."""
        self.scheduler.end_step(out)
        self.scheduler.check_stall(out)
        return self._collect(self.groups.finished_ids())

    def _move_blocks(self, out: Any) -> None:
        """The block moves ``out`` asks for before its forward: tier stores and loads (reading
        evicted blocks first), then copy-on-write copies."""
        if out.kv_transfer is not None:
            self.executor.transfer_kv(out.kv_transfer, self.kv_stores)
        self.executor.copy_blocks(out.copies)

    def _collect(self, group_ids: set[str]) -> list[RequestOutput]:
        """RequestOutputs of ``group_ids`` in arrival order; finished groups are forgotten."""
        groups = [g for g in (self.groups.get(r) for r in group_ids) if g is not None]
        outs = []
        for group in sorted(groups, key=lambda g: g.arrival_time):
            outs.append(self.output.make_output(group))
            if group.finished:
                self.groups.pop(group.request_id)
                self.output.forget(group.request_id)
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
