"""``pagedkv bench spec``: the runner and the llama.cpp lookup peer."""
