"""Typed errors raised by pagedkv.

Every public entry point raises one of these (never a bare ``ValueError`` from deep
inside), so that the engine, the CLI and the server can turn bad input into a clear
message (CLI) or a 4xx JSON error (server) without crashing or leaking blocks.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A configuration value is invalid (block_size <= 0, unknown architecture, budget
    smaller than one block, a GGUF missing a needed key, ...). The message names the field."""


class NoFreeBlocksError(PagedKVError):
    """The block pool cannot satisfy an allocation. Allocation is all-or-nothing: when this
    is raised, no block was taken."""


class InvalidRequestError(PagedKVError, ValueError):
    """A request is malformed (empty prompt, prompt longer than max_model_len, bad sampling
    parameters, a request that could never fit the pool). Nothing was admitted."""


class InvariantViolation(PagedKVError, AssertionError):
    """The KV memory system's bookkeeping is inconsistent (see ``pagedkv.kv.invariants``)."""


class BackendError(PagedKVError):
    """An attention backend cannot run here (missing package, unsupported dtype/layout)."""


class DistributedError(PagedKVError, RuntimeError):
    """Tensor parallelism failed: a worker died, hung past the timeout, or could not start.
    The engine that raised it cannot continue (its workers have been stopped)."""
