"""``pagedkv bench ablation``: the runner, the prefix-sharing run, the report."""
