"""LLMEngine: add_request / step / abort_request over the paged KV memory system.

One ``step()`` = schedule → allocate slots (+ copy-on-write) → build the flat batch → model
forward (K/V written through ``slot_mapping``, read through ``block_tables``) → sample →
update (append tokens, stop checks, publish full blocks, free with a step fence).

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
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from pagedkv.engine.beam import BeamHypothesis, BeamSearch, beam_stop_ids
from pagedkv.engine.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    now,
)
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStallError
from pagedkv.engine.stats import EngineStats
from pagedkv.errors import ConfigError, InvalidRequestError

logger = logging.getLogger("pagedkv")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_SPEC_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _SPEC_DTYPE:
            raise ConfigError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


@dataclass
class EngineConfig:
    """Engine options (vLLM names). Memory: ``kv_cache_memory`` (bytes or "2GiB") or
    ``num_blocks``; if neither, 1 GiB. ``enable_paging=False`` = contiguous max reservation
    (each admitted request reserves ceil(max_model_len / block_size) blocks up front, the
    seed's baseline)."""

    block_size: int = 16
    kv_cache_memory: Union[int, str, None] = None
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = False
    enable_paging: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    watermark: float = 0.01
    dtype: Union[str, torch.dtype] = "float32"
    device: str = "cpu"
    attention_backend: str = "cpu"
    seed: int = 0
    shuffle_blocks: Optional[int] = None  # seed: randomise physical block order (tests)
    debug_invariants: bool = False  # run the KV invariant checker after every step
    max_n: int = 64
    model_revision: Optional[str] = None
    # ranks the model is split over (pagedkv.distributed); kv_cache_memory is then per rank
    tensor_parallel_size: int = 1


@dataclass
class _Group:
    """A user-visible request: its n sequences (index 0 is the one that prefills)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Request] = field(default_factory=list)
    pending_children: int = 0  # n - 1 until the prefill finishes and children fork
    stream: bool = False
    beam: Optional[BeamSearch] = None  # beam search state (SamplingParams.beam_width > 1)
    # counters of sequences that left the group before it finished (replaced beams)
    retired_cow_copies: int = 0
    retired_preemptions: int = 0
    retired_prefix_query: int = 0
    retired_prefix_hits: int = 0

    @property
    def finished(self) -> bool:
        return self.pending_children == 0 and all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The engine. ``model``: a path (GGUF file or HF safetensors directory), ``None`` for
    the bundled SmolLM2-135M-Instruct, or an already loaded ``pagedkv.model.loader.LoadedModel``
    (tests share one). Other keyword arguments: see :class:`EngineConfig`.

    Raises ``ConfigError`` for bad options and ``InvalidRequestError`` for bad requests."""

    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        from pagedkv.attention import get_backend
        from pagedkv.kv import KVCacheManager, KVCacheSpec, parse_size
        from pagedkv.model.loader import LoadedModel, load_model

        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {sorted(unknown)}")
        cfg = self.config = EngineConfig(**kwargs)
        _check_options(cfg)
        dtype = resolve_dtype(cfg.dtype)
        self.dtype = dtype

        if isinstance(model, LoadedModel):
            loaded = model
            model_dtype = next(loaded.model.parameters()).dtype
            if model_dtype != dtype:
                raise ConfigError(f"the loaded model is {model_dtype}; the engine dtype is {dtype}")
        else:
            loaded = load_model(model, dtype=dtype, device=cfg.device)
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_id = str(mc.model_id)
        self.revision = cfg.model_revision or str(getattr(mc, "revision", "") or "")

        max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's context "
                f"({mc.max_position_embeddings} tokens)"
            )
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_model_len = max_model_len

        tp = cfg.tensor_parallel_size
        if tp != 1:
            from pagedkv.distributed.parallel import check_tp_size

            check_tp_size(mc, tp)  # ConfigError naming the valid sizes
        self.kv_spec = KVCacheSpec(
            num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            dtype=_SPEC_DTYPE[dtype], tp_size=tp,
        )
        if cfg.num_blocks is not None:
            if not isinstance(cfg.num_blocks, int) or cfg.num_blocks < 1:
                raise ConfigError(f"num_blocks must be a positive integer, got {cfg.num_blocks!r}")
            num_blocks = cfg.num_blocks
        else:
            budget = parse_size(cfg.kv_cache_memory if cfg.kv_cache_memory is not None else "1GiB")
            num_blocks = self.kv_spec.num_blocks(budget, cfg.block_size)
        self.num_blocks = num_blocks

        self.kv = KVCacheManager(
            num_blocks, cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_paging=cfg.enable_paging,
            max_model_len=max_model_len,
            shuffle_seed=cfg.shuffle_blocks,
        )
        self.backend = get_backend(cfg.attention_backend)
        if tp == 1:
            self.runner = ModelRunner(
                loaded.model, self.backend, mc.num_layers, num_blocks, cfg.block_size,
                mc.num_kv_heads, mc.head_dim, dtype, cfg.device,
            )
        else:  # same prepare/copy_blocks/execute, run on tp ranks (this process is rank 0)
            from pagedkv.distributed import TPExecutor

            self.runner = TPExecutor(
                loaded, self.backend, cfg.attention_backend, tp_size=tp, num_blocks=num_blocks,
                block_size=cfg.block_size, dtype=dtype, device=cfg.device,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=max_model_len,
                policy=cfg.policy,
                watermark=cfg.watermark,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
            ),
            self.kv,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.sampler = Sampler(torch.Generator().manual_seed(cfg.seed))
        self.eos_token_ids = tuple(mc.eos_token_ids or ())
        self._groups: dict[str, _Group] = {}
        self._seq_group: dict[str, _Group] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_finished = 0
        self._beam_groups: set[str] = set()  # groups doing beam search
        self.scheduler.gang_ids = self._beam_groups  # their beams are scheduled all or nothing
        self.peak_used_blocks = 0  # max blocks in use right after a step's allocation
        self.peak_shared_blocks = 0  # max blocks held by more than one table (end of a step)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s, %d B/token); max concurrency at "
            "max_model_len %d: %.2f", num_blocks, cfg.block_size, num_blocks * cfg.block_size,
            _SPEC_DTYPE[dtype], self.kv_spec.bytes_per_token, max_model_len,
            num_blocks * cfg.block_size / max_model_len,
        )

    def close(self) -> None:
        """Release the step runner's resources: with tensor parallelism, stop every worker
        process. Idempotent; the engine cannot step afterwards (tensor parallel)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------
    def kv_summary(self) -> dict[str, Any]:
        """Size of the paged KV cache (blocks, tokens, bytes) and the max concurrency at
        max_model_len."""
        bs = self.config.block_size
        return {
            "num_blocks": self.num_blocks,
            "block_size": bs,
            "tokens": self.num_blocks * bs,
            "bytes_per_token": self.kv_spec.bytes_per_token,
            "bytes": self.num_blocks * self.kv_spec.block_bytes(bs),
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": (self.num_blocks * bs) / self.max_model_len
            if self.config.enable_paging
            else self.num_blocks // -(-self.max_model_len // bs),
        }

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

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
        the token ids): the engine's model id and revision, ``adapter_id``, ``cache_salt``,
        ``tenant`` (the isolation domain, e.g. the API key's owner: two tenants never share a
        block) and ``mm_hashes`` (``(content_hash, offset, length)`` per multimodal item)."""
        from pagedkv.kv import CacheKeys

        if tenant is not None and not isinstance(tenant, str):
            raise InvalidRequestError(f"tenant must be a string or None, got {type(tenant).__name__}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        params.validate(max_n=self.config.max_n)
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
        bs = self.config.block_size
        need = -(-total // bs) if self.config.enable_paging else -(-self.max_model_len // bs)
        if params.use_beam_search:
            # the shared prompt plus, per beam, its own output blocks and one partial copy
            if self.config.enable_paging:
                need = -(-len(token_ids) // bs) + params.beam_width * (-(-(total - len(token_ids)) // bs) + 1)
            else:
                need *= params.beam_width
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
            if request_id in self._groups:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            t = arrival_time if arrival_time is not None else now()
            keys = CacheKeys(
                model_id=self.model_id, revision=self.revision, adapter_id=adapter_id,
                cache_salt=cache_salt, mm_hashes=tuple(mm_hashes), tenant=tenant,
            )
            group = _Group(request_id, text, token_ids, params, t, pending_children=params.n - 1, stream=stream)
            seq = Request(
                request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                arrival_time=t, cache_keys=keys, priority=priority, prompt=text,
                eos_token_ids=self.eos_token_ids, max_total_tokens=total, parent_id=request_id,
            )
            group.seqs.append(seq)
            if params.use_beam_search:
                group.beam = BeamSearch(
                    params.beam_width, total - len(token_ids),
                    beam_stop_ids(self.eos_token_ids, params.ignore_eos, params.stop_token_ids),
                    params.length_penalty, params.early_stopping,
                )
                group.beam.start(seq)
                self._beam_groups.add(request_id)
            self._groups[request_id] = group
            self._seq_group[request_id] = group
            self.scheduler.add_request(seq)
            self.num_prompt_tokens += len(token_ids)
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
                group = self._groups.get(rid)
                if group is None:
                    continue
                group.pending_children = 0
                self.scheduler.abort([s.request_id for s in group.seqs])

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._groups)

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
                    self.kv.end_step(out.step_id)  # idempotent
            raise

    def _step(self, opened: list) -> list[RequestOutput]:
        with self._lock:
            out = self.scheduler.schedule()
            opened.append(out)
            touched: set[str] = set()
            if out.is_empty:
                self.kv.end_step(out.step_id)
                sch = self.scheduler
                if not out.preempted and sch.has_unfinished() and not self.kv.open_steps and not self.kv.holds:
                    # nothing runs, nothing frees blocks: every further step would do the same
                    raise SchedulerStallError(
                        f"scheduler stalled: {len(sch.running)} running / {len(sch.waiting)} waiting "
                        f"sequences but nothing can be scheduled ({self.kv.num_free_blocks} of "
                        f"{self.num_blocks} blocks free; running: "
                        f"{[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in sch.running][:8]}, "
                        f"waiting: {[(r.request_id, r.num_tokens) for r in sch.waiting][:8]}). "
                        "This is a bug; abort the requests to free their blocks."
                    )
                return self._collect(self._finished_groups())
            if self.kv.num_used_blocks > self.peak_used_blocks:
                self.peak_used_blocks = self.kv.num_used_blocks
            block_ids = [self.kv.get_block_ids(r.request_id) for r, _ in out.scheduled]
            inp = self.runner.prepare(out.scheduled, block_ids)
            self.runner.copy_blocks(out.copies)
        logits = self.runner.execute(inp)  # lock released: aborts may land now (fenced)
        with self._lock:
            rows, reqs = self._expand_forks(out, inp.sampling_requests)
            beam_touched: set[str] = set()
            if self._beam_groups:
                rows, reqs = self._offer_beam_rows(logits, rows, reqs, beam_touched)
            sample_reqs = [r for r in reqs if r.status == RequestStatus.RUNNING]
            keep = [i for i, r in zip(rows, reqs) if r.status == RequestStatus.RUNNING]
            sampled: dict[str, tuple[int, Optional[dict[int, float]]]] = {}
            if sample_reqs:
                so = self.sampler(logits[keep], sample_reqs)
                for r, t, lp in zip(sample_reqs, so.token_ids, so.logprobs):
                    sampled[r.request_id] = (t, lp)
            self.scheduler.update(out, sampled)
            self.num_generated_tokens += len(sampled)
            for gid in beam_touched:
                self._beam_step(self._groups[gid])
                touched.add(gid)
            self._track_shared_blocks()
            for r in sample_reqs:
                touched.add(r.parent_id)
                group = self._seq_group.get(r.request_id)
                if r.sampling_params.stop or (group is not None and group.stream):
                    self._detokenize(r)
            if self.config.debug_invariants:
                from pagedkv.kv import check_invariants

                check_invariants(self.kv)
            return self._collect(touched | self._finished_groups())

    def _expand_forks(self, out, sampling_requests: list[Request]) -> tuple[list[int], list[Request]]:
        """Parallel sampling (n > 1): when a sequence's prefill completes, fork its n - 1
        siblings from its block table (ref_cnt += 1; the partly filled last block is copied
        on the first divergent write). Every sibling samples from the same logits row."""
        rows: list[int] = []
        reqs: list[Request] = []
        for row, req in enumerate(sampling_requests):
            rows.append(row)
            reqs.append(req)
            group = self._seq_group.get(req.request_id)
            if group is None or group.pending_children == 0 or req.status != RequestStatus.RUNNING:
                continue
            base_seed = group.params.seed
            for idx in range(1, group.pending_children + 1):
                child_params = group.params
                if base_seed is not None:
                    child_params = _replace_seed(group.params, base_seed + idx)
                child = Request(
                    request_id=f"{group.request_id}#{idx}", prompt_token_ids=req.prompt_token_ids,
                    sampling_params=child_params, arrival_time=req.arrival_time,
                    cache_keys=req.cache_keys, priority=req.priority, prompt=req.prompt,
                    eos_token_ids=req.eos_token_ids, max_total_tokens=req.max_total_tokens,
                    parent_id=group.request_id, index=idx,
                )
                child.num_computed_tokens = req.num_computed_tokens
                child.num_cached_tokens = req.num_cached_tokens
                child.scheduled_time = req.scheduled_time
                child.status = RequestStatus.RUNNING
                self.kv.fork(req.request_id, child.request_id)
                self.scheduler.requests[child.request_id] = child
                self.scheduler.running.append(child)
                # the parent's count is advanced in update(); the child starts level with it
                n_new = next(n for r, n in out.scheduled if r is req)
                child.num_computed_tokens = req.num_computed_tokens + n_new
                out.scheduled.append((child, 0))
                group.seqs.append(child)
                self._seq_group[child.request_id] = group
                rows.append(row)
                reqs.append(child)
            group.pending_children = 0
        return rows, reqs

    # ---- beam search -------------------------------------------------------------------
    def _offer_beam_rows(self, logits, rows: list[int], reqs: list[Request], touched: set[str]):
        """Hand the logits rows of beam sequences to their beam search (they are not sampled);
        returns the remaining (rows, requests)."""
        keep_rows, keep_reqs = [], []
        for row, r in zip(rows, reqs):
            group = self._seq_group.get(r.request_id)
            if group is None or group.beam is None:
                keep_rows.append(row)
                keep_reqs.append(r)
            elif r.status == RequestStatus.RUNNING:
                group.beam.offer(r, logits[row])
                touched.add(group.request_id)
        return keep_rows, keep_reqs

    def _beam_step(self, group: _Group) -> None:
        """One beam-search step once every live beam has its logits: pick the next beams;
        the first child of a beam continues it in place, each further child forks the
        beam's block table (copy-on-write of the partly filled block on its first write),
        beams with no child are freed (through the step fence)."""
        bs = group.beam
        if bs is None or not bs.ready():
            return
        choices = bs.step()
        t = now()
        for b in bs.beams:
            if b.first_token_time is None:
                b.first_token_time = t
        if bs.done:
            self._finish_beams(group)
            return
        # forks first: they copy their source's tokens before an in-place append changes them
        continued: set[str] = set()
        new_beams: list[Request] = []
        in_place: list[tuple[Request, int]] = []
        for c in choices:
            src = c.source
            if src.request_id not in continued:
                continued.add(src.request_id)
                new_beams.append(src)
                in_place.append((src, c.token))
                continue
            bs.num_forks += 1
            child = Request(
                request_id=f"{group.request_id}#beam{bs.num_forks}", prompt_token_ids=src.prompt_token_ids,
                sampling_params=src.sampling_params, arrival_time=src.arrival_time,
                cache_keys=src.cache_keys, priority=src.priority, prompt=src.prompt,
                eos_token_ids=src.eos_token_ids, max_total_tokens=src.max_total_tokens,
                parent_id=group.request_id,
            )
            for tok in src.output_token_ids:
                child.append_output_token(tok)
            child.append_output_token(c.token)
            child.num_computed_tokens = src.num_computed_tokens
            child.num_cached_tokens = 0  # it never looked anything up itself
            child.scheduled_time = src.scheduled_time
            child.first_token_time = src.first_token_time
            child.status = RequestStatus.RUNNING
            self.kv.fork(src.request_id, child.request_id)
            self.scheduler.requests[child.request_id] = child
            self.scheduler.running.append(child)
            self._seq_group[child.request_id] = group
            new_beams.append(child)
        for src, tok in in_place:
            src.append_output_token(tok)
        for old in bs.beams:
            if old.request_id not in continued:
                self._retire(group, old)
        for i, b in enumerate(new_beams):
            b.index = i
        bs.advance(choices, new_beams)
        group.seqs = list(new_beams)
        self.num_generated_tokens += len(new_beams)

    def _retire(self, group: _Group, req: Request) -> None:
        """Drop a sequence from its group before the group ends (a replaced beam)."""
        group.retired_cow_copies += req.num_cow_copies
        group.retired_preemptions += req.num_preemptions
        group.retired_prefix_query += req.num_prefix_query_tokens
        if req.num_prefix_query_tokens:
            group.retired_prefix_hits += max(req.num_cached_tokens, 0)
        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
        self._seq_group.pop(req.request_id, None)

    def _finish_beams(self, group: _Group) -> None:
        """The search is over: free every live beam; the output is the hypotheses."""
        bs = group.beam
        skip = group.params.skip_special_tokens
        for h in bs.hypotheses:
            h.text = self.tokenizer.decode(h.token_ids, skip_special_tokens=skip)
        for b in list(bs.beams):
            self.scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED)
            b._text_tokens = b.num_output_tokens  # its text is not used
        self._beam_groups.discard(group.request_id)

    def _track_shared_blocks(self) -> None:
        n = self.num_shared_blocks()
        if n > self.peak_shared_blocks:
            self.peak_shared_blocks = n

    def num_shared_blocks(self) -> int:
        """Blocks referenced more than once right now (by several block tables, e.g. a
        prefix hit, a fork or a beam; a step-fence hold also counts as a reference)."""
        return sum(1 for b in self.kv.pool.blocks if b.ref_cnt > 1)

    def _detokenize(self, req: Request) -> None:
        """Bring ``req.output_text`` up to date (once per new token only for streamed
        requests or requests with stop strings; otherwise once at the end). A stop string
        finishes the request and is cut from the text (its tokens stay in token_ids)."""
        if req._text_tokens == req.num_output_tokens or (
            req.stop_reason is not None and isinstance(req.stop_reason, str)
        ):
            return
        text = self.tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        req._text_tokens = req.num_output_tokens
        stops = req.sampling_params.stop
        if stops:
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                pos, s = min(hits)
                text = text[:pos]
                if not req.is_finished or req.status == RequestStatus.FINISHED_LENGTH:
                    if not req.is_finished:
                        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    else:
                        req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = s
        req.output_text = text

    def _finished_groups(self) -> set[str]:
        return {rid for rid, g in self._groups.items() if g.finished}

    def _collect(self, group_ids: set[str]) -> list[RequestOutput]:
        outs = []
        for rid in sorted(group_ids, key=lambda r: self._groups[r].arrival_time if r in self._groups else 0):
            group = self._groups.get(rid)
            if group is None:
                continue
            for s in group.seqs:
                if s.is_finished or group.stream:
                    self._detokenize(s)
            outs.append(self._make_output(group))
            if group.finished:
                del self._groups[rid]
                self._beam_groups.discard(rid)
                for s in group.seqs:
                    self._seq_group.pop(s.request_id, None)
                self.num_finished += 1
        return outs

    def _make_output(self, group: _Group) -> RequestOutput:
        seqs = sorted(group.seqs, key=lambda s: s.index)
        first = seqs[0]
        finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=first.scheduled_time,
            first_token_time=first.first_token_time,
            finish_time=max(finish_times) if group.finished and finish_times else None,
            num_preemptions=sum(s.num_preemptions for s in seqs) + group.retired_preemptions,
            prefix_query_tokens=sum(s.num_prefix_query_tokens for s in seqs) + group.retired_prefix_query,
            prefix_hit_tokens=sum(max(s.num_cached_tokens, 0) for s in seqs if s.num_prefix_query_tokens)
            + group.retired_prefix_hits,
            num_cow_copies=sum(s.num_cow_copies for s in seqs) + group.retired_cow_copies,
        )
        if group.beam is not None and group.beam.done:
            return RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids,
                outputs=[_beam_output(i, h) for i, h in enumerate(group.beam.result())],
                finished=group.finished, metrics=metrics,
                num_cached_tokens=metrics.prefix_hit_tokens,
            )
        comps = [
            CompletionOutput(
                index=s.index, text=s.output_text, token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                logprobs=list(s.output_logprobs) if s.sampling_params.logprobs is not None else None,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=comps, finished=group.finished,
            metrics=metrics, num_cached_tokens=metrics.prefix_hit_tokens if group.beam is not None
            else max(first.num_cached_tokens, 0),
        )

    # ---- statistics ------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """One consistent view (taken under the engine lock) for live UIs: ``{"kv":
        KVCacheManager.snapshot(), "requests": [...running, then waiting], "stats":
        get_stats()}``; each request has request_id, parent_id, index, status,
        prompt_tokens, output_tokens, num_tokens, num_computed_tokens (tokens)."""
        with self._lock:
            reqs = [
                {
                    "request_id": r.request_id,
                    "parent_id": r.parent_id or r.request_id,
                    "index": r.index,
                    "status": r.status.name.lower(),
                    "prompt_tokens": r.num_prompt_tokens,
                    "output_tokens": r.num_output_tokens,
                    "num_tokens": r.num_tokens,
                    "num_computed_tokens": r.num_computed_tokens,
                }
                for r in list(self.scheduler.running) + list(self.scheduler.waiting)
            ]
            return {"kv": self.kv.snapshot(), "requests": reqs, "stats": self.get_stats()}

    def get_stats(self) -> EngineStats:
        """Engine statistics (:class:`EngineStats`): requests, KV blocks, prefix cache,
        preemptions, CoW copies."""
        with self._lock:
            kvs = self.kv.stats
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_blocks=self.num_blocks,
                num_used_blocks=self.kv.num_used_blocks,
                num_free_blocks=self.kv.num_free_blocks,
                kv_usage=self.kv.usage,
                num_preemptions=self.scheduler.stats.num_preemptions,
                num_steps=self.scheduler.stats.num_steps,
                peak_running=self.scheduler.stats.peak_running,
                num_generated_tokens=self.num_generated_tokens,
                num_prompt_tokens=self.num_prompt_tokens,
                num_finished_requests=self.num_finished,
                num_shared_blocks=self.num_shared_blocks(),
                peak_shared_blocks=self.peak_shared_blocks,
                peak_used_blocks=self.peak_used_blocks,
                kv_prefix_queries=kvs.prefix_queries,
                kv_prefix_hits=kvs.prefix_hits,
                kv_prefix_hit_rate=kvs.prefix_hit_rate,
                kv_cow_copies=kvs.cow_copies,
                kv_evictions=kvs.evictions,
                kv_allocated_blocks=kvs.allocated_blocks,
                kv_deferred_frees=kvs.deferred_frees,
            )


def _beam_output(index: int, h: BeamHypothesis) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=h.text, token_ids=list(h.token_ids), finish_reason=h.finish_reason,
        cumulative_logprob=h.cumulative_logprob, score=h.score,
    )


def _check_options(cfg: EngineConfig) -> None:
    """Types and ranges of the engine options; raises ``ConfigError`` naming the field."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_n"):
        v = getattr(cfg, name)
        if not is_int(v) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    for name in ("max_model_len", "num_blocks", "shuffle_blocks"):
        v = getattr(cfg, name)
        if v is not None and (not is_int(v) or (v < 1 and name != "shuffle_blocks")):
            raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
    if not is_int(cfg.seed) or not (0 <= cfg.seed < 2**63):
        raise ConfigError(f"seed must be an integer in [0, 2**63), got {cfg.seed!r}")
    if isinstance(cfg.watermark, bool) or not isinstance(cfg.watermark, (int, float)):
        raise ConfigError(f"watermark must be a number in [0, 1), got {cfg.watermark!r}")
    try:
        dev = torch.device(cfg.device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: unknown device {cfg.device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: CUDA is not available on this machine")


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed, n=1)
