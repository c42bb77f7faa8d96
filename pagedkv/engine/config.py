"""EngineConfig: every engine option (vLLM's names), validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pagedkv.errors import ConfigError
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.tiers.spec import parse_tier_specs
from pagedkv.utils import MODEL_DTYPES, canonical_dtype, kv_cache_dtype


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class EngineConfig:
    """Engine options. Memory: ``kv_cache_memory`` (bytes or "2GiB") or ``num_blocks``; if
    neither, 1 GiB. ``enable_paging=False`` = contiguous max reservation (each admitted
    request reserves ceil(max_model_len / block_size) blocks up front, the seed's baseline,
    seed §07). ``max_model_len`` None = the model's context. Units: tokens, sequences,
    blocks; ``watermark`` is a fraction of the pool.

    Build with :meth:`from_kwargs` (rejects unknown names) or construct and call
    :meth:`validate`; both raise ``ConfigError`` naming the field."""

    block_size: int = 16
    kv_cache_memory: Union[int, str, None] = None
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = False
    enable_paging: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    watermark: float = 0.01
    dtype: Any = "float32"  # float32 | bfloat16 | float16 (a name or a torch dtype)
    # KV cache storage (vLLM's names): auto (= dtype) | float32 | bfloat16 | float16 | int8 |
    # fp8_e4m3 | fp8_e5m2; quantised formats keep one bf16 scale per kv_quant_group_size
    # elements of each head vector (None = one per head vector; must divide head_dim)
    kv_cache_dtype: str = "auto"
    kv_quant_group_size: Optional[int] = None
    device: str = "cpu"
    attention_backend: str = "cpu"
    seed: int = 0
    shuffle_blocks: Optional[int] = None  # seed: randomise physical block order (tests)
    debug_invariants: bool = False  # run the KV invariant checker after every step
    max_n: int = 64
    model_revision: Optional[str] = None
    # ranks the model is split over (pagedkv.distributed); kv_cache_memory is then per rank
    tensor_parallel_size: int = 1
    # linear layers' weight format: auto | gguf | fp32 | bf16 | int8 | int4 (pagedkv.model.quant;
    # auto keeps the model's numbers: a GGUF's stored blocks, a checkpoint's own dtype)
    weights: str = "auto"
    # batch invariance (docs/determinism.md): attention and the integer kernels (every GGUF
    # model's route) are invariant anyway; True also makes the dense fp32/bf16 layers and
    # int8/int4 on AMX hosts invariant, at a cost (fp32 batch-1 decode ~0.69x)
    deterministic: bool = False
    # tiers behind the block pool, fastest first: ["host:4GiB", "disk:PATH:50GiB"]
    # (pagedkv.kv.tiers); turns prefix caching on
    kv_offload: Optional[list[str]] = None
    # KV events over ZeroMQ: the PUB endpoint ("tcp://127.0.0.1:5557") and the replay
    # endpoint (default: the same host, port + 1); turns prefix caching on
    kv_events: Optional[str] = None
    kv_events_replay: Optional[str] = None
    # decode steps (up to 64 tokens) through torch.compile (pagedkv.model.compiled): compiled at
    # start-up, ~80 s per graph the first time on a 2-core CPU, cached afterwards
    compile_decode: bool = False
    # chat template (Jinja text or a file holding it) in place of the model's own; a model
    # without one (a base model) refuses chat requests unless this is set
    chat_template: Optional[str] = None
    # speculative decoding: None (off) | "ngram" (prompt lookup, pagedkv.worker.ngram_proposer):
    # up to num_speculative_tokens drafts from the last ngram_max..ngram_min tokens' earlier match
    # | "draft:<model>" (a GGUF/HF path or a bundled name, same tokenizer; greedy drafts from it,
    # pagedkv.worker.draft_proposer), its linear layers in draft_weights (same values as weights)
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 3
    draft_weights: str = "auto"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineConfig":
        """The config of ``LLMEngine(**kwargs)``; raises ``ConfigError`` for an unknown name
        or a bad value."""
        unknown = set(kwargs) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown engine option(s): {sorted(unknown)}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Types and ranges of every option that does not depend on the model; raises
        ``ConfigError`` naming the field."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_n"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "num_blocks", "shuffle_blocks"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or (v < 1 and name != "shuffle_blocks")):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        if not _is_int(self.seed) or not (0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise ConfigError(f"watermark must be a number in [0, 1), got {self.watermark!r}")
        if not (0.0 <= self.watermark < 1.0):
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        canonical_dtype(self.dtype, MODEL_DTYPES)
        from pagedkv.model.quant import check_weights

        check_weights(self.weights)
        try:
            check_weights(self.draft_weights)
        except ConfigError as e:
            raise ConfigError(f"draft_{e}") from None
        kv_name = kv_cache_dtype(self.kv_cache_dtype, self.dtype)  # names the valid values
        g = self.kv_quant_group_size
        if g is not None and (not _is_int(g) or g < 1):
            raise ConfigError(f"kv_quant_group_size must be a positive integer or None, got {g!r}")
        from pagedkv.attention.quant import FORMATS

        if g is not None and kv_name not in FORMATS:  # before any model is loaded
            raise ConfigError(f"kv_quant_group_size applies to a quantised kv_cache_dtype "
                              f"({', '.join(FORMATS)}), not {kv_name}")
        import torch

        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device: unknown device {self.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: CUDA is not available on this machine")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        for name in ("compile_decode", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile_decode and (dev.type != "cpu" or self.tensor_parallel_size != 1):
            raise ConfigError("compile_decode: CPU and tensor_parallel_size 1 only")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ConfigError(f"chat_template: expected Jinja text or a file path, got {self.chat_template!r}")
        self._validate_kv_tiers()
        from pagedkv.worker.proposer import check_speculative

        check_speculative(self)  # speculative options (the registered proposer's own checks)

    def _validate_kv_tiers(self) -> None:
        if parse_tier_specs(self.kv_offload) and self.tensor_parallel_size != 1:
            raise ConfigError("kv_offload: not supported with tensor_parallel_size > 1 (each rank holds its own heads)")
        for name in ("kv_events", "kv_events_replay"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://"))):
                raise ConfigError(f"{name}: expected a ZeroMQ endpoint like tcp://127.0.0.1:5557, got {v!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("kv_events_replay needs kv_events")

    @property
    def prefix_caching(self) -> bool:
        """Whether the prefix cache is on: asked for, or needed by ``kv_offload`` / ``kv_events``."""
        return bool(self.enable_prefix_caching or self.kv_offload or self.kv_events)

    def resolve_max_model_len(self, model_context: int) -> int:
        """``max_model_len`` (tokens) for a model whose context is ``model_context``; raises
        ``ConfigError`` if it exceeds the context or is < 2, or if chunked prefill is off
        and the step budget cannot hold one whole prompt."""
        max_model_len = self.max_model_len or model_context
        if max_model_len > model_context:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's context ({model_context} tokens)"
            )
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {max_model_len})"
            )
        return max_model_len

    def max_concurrency(self, num_blocks: int, max_model_len: int) -> float:
        """Requests of ``max_model_len`` tokens the pool holds at once (paged: tokens /
        max_model_len; contiguous: whole reservations)."""
        bs = self.block_size
        if self.enable_paging:
            return num_blocks * bs / max_model_len
        return num_blocks // blocks_needed(max_model_len, bs)
