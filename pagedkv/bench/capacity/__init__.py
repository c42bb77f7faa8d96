"""``pagedkv bench capacity``: the runner, the simulator, the hybrid comparison, the report."""
