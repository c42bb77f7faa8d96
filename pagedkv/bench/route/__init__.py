"""``pagedkv bench route``: the runner and the report."""
