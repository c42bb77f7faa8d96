"""``pagedkv bench peers``: the runner, the peer systems, their venvs and worker, the native llama.cpp comparison, the reports."""
