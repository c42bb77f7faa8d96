"""``pagedkv bench offload``: the runner and the report."""
