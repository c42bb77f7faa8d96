"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on GPUs); see docs/distributed.md.

* ``parallel``: Megatron-style sharding of the Llama-family model (pure functions).
* ``protocol``: what the driver broadcasts each step.
* ``worker``: process groups, one rank's shard + KV cache, the worker loop.
* ``executor``: ``TPExecutor``, the engine's step runner over N ranks (driver = rank 0).
"""

from pagedkv.distributed.executor import TPExecutor
from pagedkv.distributed.parallel import check_tp_size, shard_plan, valid_tp_sizes
from pagedkv.errors import DistributedError  # re-exported: it lives with every typed error

__all__ = ["TPExecutor", "DistributedError", "check_tp_size", "shard_plan", "valid_tp_sizes"]
