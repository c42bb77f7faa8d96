"""Benchmarks (seed §05). Each writes JSON + Markdown (+ PNG) under docs/benchmarks/."""
