"""Commands that explain the paged KV cache without running a model: the seed's worked example
(``pagedkv example``, :mod:`pagedkv.examples.seed_example`) and the capacity plan
(``pagedkv plan``, :mod:`pagedkv.examples.capacity_plan`). Nothing in the engine imports them."""
