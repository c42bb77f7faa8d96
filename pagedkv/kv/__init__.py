"""The KV memory system (seed §01-§04, §07): sizing, block pool, block tables,
copy-on-write, prefix hashing, step fences and invariants. No model code, no engine imports."""

from pagedkv.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedkv.kv.block_table import BlockTable, cdiv, slot_mapping
from pagedkv.kv.invariants import check_invariants
from pagedkv.kv.manager import KVCacheManager, KVCacheStats
from pagedkv.kv.prefix_cache import CacheKeys, hash_blocks, sha256_block_hash
from pagedkv.kv.spec import KVCacheSpec, known_config, known_configs, parse_size

__all__ = [
    "BlockPool", "BlockTable", "CacheKeys", "FreeBlockQueue", "KVCacheBlock", "KVCacheManager",
    "KVCacheSpec", "KVCacheStats", "cdiv", "check_invariants", "hash_blocks", "known_config",
    "known_configs", "parse_size", "sha256_block_hash", "slot_mapping",
]
