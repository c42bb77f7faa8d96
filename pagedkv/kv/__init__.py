"""The KV memory system (seed §01-§04, §07): sizing, block pool, block tables,
copy-on-write, prefix hashing, step fences and invariants. No model code, no engine imports."""

from pagedkv.kv.spec import KVCacheSpec, known_config, known_configs, parse_size

__all__ = ["KVCacheSpec", "known_config", "known_configs", "parse_size"]
