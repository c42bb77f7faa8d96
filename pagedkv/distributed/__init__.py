"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on GPUs); see docs/distributed.md.

* ``parallel``: Megatron-style sharding of the Llama-family model (pure functions).
* ``protocol``: what the driver broadcasts each step.
* ``worker``: process groups, one rank's shard + KV cache, the worker loop.
* ``executor``: ``TPExecutor``, the engine's step runner over N ranks (driver = rank 0), and
  ``make_executor`` (one process's ``Worker`` or a ``TPExecutor``).
"""

from pagedkv.distributed.executor import TPExecutor, make_executor
from pagedkv.distributed.parallel import check_tp_size, shard_plan, valid_tp_sizes
from pagedkv.errors import DistributedError  # re-exported: it lives with every typed error

__all__ = ["TPExecutor", "make_executor", "DistributedError", "check_tp_size", "shard_plan", "valid_tp_sizes"]
