"""``pagedkv bench step``: the runner and the torch.profiler breakdown."""
