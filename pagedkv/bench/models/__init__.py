"""``pagedkv bench models``: the runner, the child process and its guard, the model maker, the report."""
