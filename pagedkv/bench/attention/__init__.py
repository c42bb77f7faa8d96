"""``pagedkv bench attention``: the runner and the KV-format kernels' timing."""
