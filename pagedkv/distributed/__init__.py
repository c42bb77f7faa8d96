"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on GPUs); see docs/distributed.md.

* ``parallel``: Megatron-style sharding of the Llama-family model (pure functions).
* ``protocol``: what the driver broadcasts each step.
* ``worker``: process groups, one rank's shard + KV cache, the worker loop.
* ``executor``: ``TPExecutor``, the engine's step runner over N ranks (driver = rank 0).
"""

from pagedkv.errors import PagedKVError


class DistributedError(PagedKVError, RuntimeError):
    """Tensor parallelism failed: a worker died, hung past the timeout, or could not start.
    The engine that raised it cannot continue (its workers have been stopped)."""


from pagedkv.distributed.parallel import check_tp_size, shard_plan, valid_tp_sizes  # noqa: E402,F401


def __getattr__(name):  # lazy: the executor imports the engine's runner
    if name == "TPExecutor":
        from pagedkv.distributed.executor import TPExecutor

        return TPExecutor
    raise AttributeError(name)


__all__ = ["TPExecutor", "DistributedError", "check_tp_size", "shard_plan", "valid_tp_sizes"]
