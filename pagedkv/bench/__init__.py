"""Benchmarks (seed §05). Each writes one result set, JSON + Markdown (+ PNG), under docs/benchmarks/;
a benchmark measured in several configurations keeps each as a variant of its set (:mod:`pagedkv.bench.variants`)."""
