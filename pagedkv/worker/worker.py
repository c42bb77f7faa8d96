"""The worker: the device side of one process, behind the executor interface.

The engine keeps everything about requests and KV *bookkeeping* (scheduler, block ids, KV
sizing, tiers, tokenizer use); the worker owns everything that touches the device:

1. **load** (:meth:`Worker.load`): resolve the weight format (``weights="auto"`` included,
   with its int4 rule: int4 only from an HF directory or a GGUF whose layer matrices are
   Q4_0/Q4_1 codes), load the model (or check an already loaded ``LoadedModel``) and create
   the attention backend;
2. **caches** (:meth:`Worker.init_cache`): once the engine has sized the pool, build the
   ``ModelRunner`` and its per-layer KV caches of ``num_blocks`` blocks;
3. **compile** (:meth:`Worker.compile_steps`): optionally compile the steps (the runner
   owns the compiled step);
4. **run steps** through the executor interface (:class:`Executor`);
5. **propose drafts** after a step (:meth:`Worker.propose_drafts`) with the speculative
   proposer it owns (``pagedkv.worker.proposer``; none when speculation is off).

:class:`Executor` is what the engine's step calls, whatever runs it: a ``Worker`` in this
process, or ``pagedkv.distributed.TPExecutor`` over tensor-parallel ranks (whose rank
processes build their caches through ``Worker.init_cache`` too).
``pagedkv.distributed.executor.make_executor`` picks one.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol, Sequence

import torch

from pagedkv.attention import get_backend
from pagedkv.attention.quant import FORMATS
from pagedkv.errors import ConfigError
from pagedkv.model.invariant import batch_invariant, set_deterministic
from pagedkv.model.loader import LoadedModel, auto_weights, load_model
from pagedkv.model.quant import resolve_weights
from pagedkv.utils import torch_dtype
from pagedkv.worker.kv_transfer import BlockPayloadCodec
from pagedkv.worker.proposer import DraftRequest, Proposer
from pagedkv.worker.runner import ModelInput, ModelRunner

logger = logging.getLogger("pagedkv")


class Executor(Protocol):
    """What the engine's step talks to (one process or tensor-parallel ranks).

    ``runner``: the (rank 0) ``ModelRunner`` holding the KV caches; ``backend``: the
    attention backend object; ``proposer``: the speculative proposer it owns
    (``attach_proposer``). ``prepare`` builds a step's ``ModelInput`` (see
    ``ModelRunner.prepare``); ``copy_blocks`` applies (or queues) copy-on-write block copies
    ``(src, dst)`` before the step's writes; ``execute`` runs the step and returns fp32 logits
    ``[sample rows + prompt rows, vocab]``; ``transfer_kv`` / ``kv_payload_codec`` serve the
    KV tiers (single process only); ``propose_drafts`` runs the speculative proposer after a
    step (``{}`` without one) and ``finish_requests`` drops its state of aborted requests;
    ``close`` releases what the executor started (idempotent)."""

    runner: Any
    backend: Any
    proposer: Any  # the speculative proposer it owns (None: off)

    def prepare(self, token_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                block_ids: Sequence[Sequence[int]], sample: Sequence[bool],
                prompt_rows: Sequence[int] = ()) -> ModelInput: ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def execute(self, inp: ModelInput) -> torch.Tensor: ...

    def propose_drafts(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]: ...

    def finish_requests(self, request_ids: Sequence[str]) -> None: ...

    def attach_proposer(self, proposer: Optional[Proposer]) -> None: ...

    def close(self) -> None: ...


def load_checked(model: Any, *, dtype: torch.dtype, device: str, weights: str,
                 tensor_parallel_size: int = 1, kv_bytes: int = 0, tp_rank: int = 0) -> LoadedModel:
    """The ``LoadedModel`` for ``model`` (a path, a bundled name, ``None`` for the bundled
    SmolLM2, or a ``LoadedModel``) in model ``dtype`` on ``device`` with the weight format
    ``weights`` (``"auto"`` or a format name, see ``pagedkv.model.quant.resolve_weights``).

    A ``LoadedModel`` passed in is used as it is, after checking it: raises ``ConfigError``
    when its parameters are another dtype than ``dtype``, or (``weights`` not ``"auto"``) its
    weight format is not the one asked for. Else the model is loaded (``ConfigError`` for a
    bad path or format); ``weights="auto"`` keeps the source's numbers
    (``pagedkv.model.loader.auto_weights``: a GGUF's stored blocks, a checkpoint's own dtype).
    ``kv_bytes``: the KV cache to come, checked with the weights against the host's memory
    before a ``gguf`` load. ``weights_reason`` says why the format was chosen. With
    ``tensor_parallel_size`` > 1 a ``gguf`` load holds rank ``tp_rank``'s slices only
    (``LoadedModel.shard``); a passed ``LoadedModel`` split for another size is refused."""
    fmt, why = resolve_weights(weights, dtype, device, tensor_parallel_size)
    if isinstance(model, LoadedModel):
        model_dtype = next(model.model.parameters()).dtype
        if model_dtype != dtype:
            raise ConfigError(f"the loaded model is {model_dtype}; the engine dtype is {dtype}")
        if weights != "auto" and model.weights != fmt:
            raise ConfigError(f"the loaded model has {model.weights} weights; the engine asks for {fmt}")
        if model.shard is not None and (model.shard.tp_size, model.shard.rank) != (tensor_parallel_size, tp_rank):
            raise ConfigError(f"the loaded model is rank {model.shard.rank} of {model.shard.tp_size}'s shard; the "
                              f"engine asks for rank {tp_rank} of tensor_parallel_size {tensor_parallel_size}")
        return model
    if weights == "auto":
        fmt, why = auto_weights(model, fmt, why, dtype, device, tensor_parallel_size)
    loaded = load_model(model, dtype=dtype, device=device, weights=fmt, kv_bytes=kv_bytes,
                        tensor_parallel_size=tensor_parallel_size, tp_rank=tp_rank)
    loaded.weights_reason = why
    return loaded


class Worker:
    """The device side of one process: a model (``torch.nn.Module``, our decoder or one
    rank's shard of it), its ``config`` (``ModelConfig``), the attention ``backend`` on
    ``device`` and, after :meth:`init_cache`, the ``runner`` (``ModelRunner``: KV caches and
    the compiled step). ``loaded``: the ``LoadedModel`` (tokenizer, weight format) when the
    worker loaded a whole model, None for a tensor-parallel shard. Implements
    :class:`Executor` (the calls go to ``runner`` as it is at call time)."""

    def __init__(self, model: torch.nn.Module, config: Any, backend: Any, device: str | torch.device = "cpu",
                 *, loaded: Optional[LoadedModel] = None, backend_name: Optional[str] = None) -> None:
        self.model, self.config, self.backend = model, config, backend
        self.device = str(device)
        self.loaded = loaded
        self.backend_name = backend_name
        self.runner: Optional[ModelRunner] = None
        self.proposer: Optional[Proposer] = None  # speculative decoding (attach_proposer)

    @classmethod
    def load(cls, model: Any, *, dtype: torch.dtype, device: str = "cpu", weights: str = "auto",
             attention_backend: str, tensor_parallel_size: int = 1, kv_bytes: int = 0,
             deterministic: bool = False, tp_rank: int = 0) -> "Worker":
        """Load ``model`` (see :func:`load_checked`, whose ``ConfigError`` it raises) and
        create the backend ``attention_backend`` (``ConfigError`` for an unknown name,
        ``BackendError`` when it cannot run here). ``deterministic``: batch-invariant dense
        layers (``pagedkv.model.invariant.set_deterministic``). The caches come later
        (:meth:`init_cache`)."""
        loaded = load_checked(model, dtype=dtype, device=device, weights=weights,
                              tensor_parallel_size=tensor_parallel_size, kv_bytes=kv_bytes, tp_rank=tp_rank)
        set_deterministic(loaded.model, deterministic)
        ok, why = batch_invariant(loaded.model)
        logger.info("batch-invariant: %s", "yes" if ok else f"no ({why}; deterministic=True makes it so)")
        backend = get_backend(attention_backend)
        return cls(loaded.model, loaded.config, backend, device, loaded=loaded, backend_name=attention_backend)

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer (None for a shard)."""
        return None if self.loaded is None else self.loaded.tokenizer

    def init_cache(self, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype | str, *,
                   quant_group_size: Optional[int] = None, layer_windows: Optional[Sequence[Optional[int]]] = None,
                   num_kv_heads: Optional[int] = None) -> ModelRunner:
        """Build the ``ModelRunner`` with one KV cache per layer (``max_layers`` of them with
        sliding-window layer groups) of ``num_blocks`` blocks x ``block_size`` tokens.
        ``kv_cache_dtype``: a torch dtype, a float name (``float32``, ``bfloat16``,
        ``float16``) or a quantised format (``int8``, ``fp8_e4m3``, ``fp8_e5m2``, with
        ``quant_group_size`` elements per scale). ``num_kv_heads``: this rank's KV heads
        (default: the model's). Raises ``ConfigError`` for a non-positive size or an unknown
        dtype name, and when the caches already exist."""
        if self.runner is not None:
            raise ConfigError("the worker's KV caches are already allocated")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1 \
                or isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"num_blocks and block_size must be positive integers, got {num_blocks!r}, {block_size!r}")
        dtype = kv_cache_dtype
        if isinstance(dtype, str) and dtype not in FORMATS:
            dtype = torch_dtype(dtype)
        mc = self.config
        self.runner = ModelRunner(
            self.model, self.backend, mc.num_layers, num_blocks, block_size,
            num_kv_heads if num_kv_heads is not None else mc.cache_kv_heads, mc.cache_head_dim, dtype, self.device,
            quant_group_size, layer_windows=layer_windows, latent=mc.is_mla,
        )
        return self.runner

    def compile_steps(self, max_rows: int) -> Any:
        """Compile the steps of 1 .. ``max_rows`` tokens (``ModelRunner.compile_steps``);
        returns the ``CompiledDecode``. Raises ``ConfigError`` before :meth:`init_cache`."""
        return self._ready().compile_steps(max_rows=max_rows)

    def _ready(self) -> ModelRunner:
        if self.runner is None:
            raise ConfigError("the worker has no KV caches yet (call init_cache first)")
        return self.runner

    # ---- the executor interface: each call goes to the runner ----------------------------
    def prepare(self, token_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                block_ids: Sequence[Sequence[int]], sample: Sequence[bool],
                prompt_rows: Sequence[int] = ()) -> ModelInput:
        """``ModelRunner.prepare`` (tensors on this worker's device)."""
        return self._ready().prepare(token_ids, num_computed, block_ids, sample, prompt_rows)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` in every layer's cache now, and in the proposer's caches
        (a draft model's K/V lives in the same block ids)."""
        self._ready().copy_blocks(copies)
        if copies and self.proposer is not None:
            self.proposer.copy_blocks(copies)

    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Run the step; fp32 logits ``[sample rows + prompt rows, vocab]``."""
        return self._ready().execute(inp)

    def attach_proposer(self, proposer: Optional[Proposer]) -> None:
        """Own ``proposer`` (a ``pagedkv.worker.proposer.Proposer``; ``None``: speculation off)."""
        self.proposer = proposer

    def propose_drafts(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """After a step's forward and sampling: ``{request id: draft token ids}`` from the
        proposer for ``rows`` (one per running request); ``{}`` without a proposer."""
        return {} if self.proposer is None else self.proposer.propose(rows)

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """Drop the proposer's state of ``request_ids`` (aborted) now."""
        for rid in request_ids if self.proposer is not None else ():
            self.proposer.release(rid)

    def transfer_kv(self, transfer: Any, stores: Any) -> None:
        """Run a step's ``KVTransfer`` against the tiers' ``TierStores`` (None: no-op)."""
        self._ready().transfer_kv(transfer, stores)

    def kv_payload_codec(self) -> BlockPayloadCodec:
        """How one block's K/V (every layer) travel to the KV tiers."""
        return self._ready().kv_payload_codec()

    def close(self) -> None:
        """Stop the caches' background prefault (``ModelRunner.close``) and the proposer's;
        the caches are freed with the worker. Idempotent."""
        if self.runner is not None:
            self.runner.close()
        if self.proposer is not None:
            self.proposer.close()
