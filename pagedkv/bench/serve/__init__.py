"""``pagedkv bench serve``: the runner, the offline comparison, the HTTP peers and their reports."""
