"""Trace-driven workloads for the serving and peer benchmarks, plus their latency arithmetic.

The Azure LLM inference trace (conversation service, 2023) gives one prompt length and one
output length per request (tokens) and an arrival timestamp. Prompt text is not part of the
trace: :func:`synth_prompts` makes token-id prompts of the sampled lengths, and benchmarks
force the sampled output length with ``ignore_eos``.

The trace's requests (median prompt ~1,020 tokens, median output ~129 tokens) are far too
long for a 135M-parameter model on a 2-core CPU, so :class:`LengthScaling` divides both
lengths by a factor and clips them to a range; every result file states the scaling used.

Units: lengths in tokens, times in seconds, rates in requests per second.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from pagedkv.bench.common import default_workload


@dataclass(frozen=True)
class TraceRequest:
    """One row of the trace: ``arrival_s`` is seconds since the trace's first request."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthScaling:
    """How trace lengths are shrunk to fit the bundled model and this CPU.

    ``prompt = clip(round(ContextTokens / prompt_divisor), min_prompt, max_prompt)`` and
    ``output = clip(round(GeneratedTokens / output_divisor), min_output, max_output)``
    (all in tokens)."""

    prompt_divisor: float = 8.0
    output_divisor: float = 8.0
    min_prompt: int = 4
    max_prompt: int = 512
    min_output: int = 2
    max_output: int = 64

    def __post_init__(self) -> None:
        if self.prompt_divisor <= 0 or self.output_divisor <= 0:
            raise ValueError("length divisors must be > 0")
        if not (1 <= self.min_prompt <= self.max_prompt):
            raise ValueError("need 1 <= min_prompt <= max_prompt")
        if not (1 <= self.min_output <= self.max_output):
            raise ValueError("need 1 <= min_output <= max_output")

    def prompt(self, context_tokens: int) -> int:
        return _clip(round(context_tokens / self.prompt_divisor), self.min_prompt, self.max_prompt)

    def output(self, generated_tokens: int) -> int:
        return _clip(round(generated_tokens / self.output_divisor), self.min_output, self.max_output)

    def describe(self) -> str:
        return (
            f"prompt = clip(ContextTokens / {self.prompt_divisor:g}, {self.min_prompt}, {self.max_prompt}); "
            f"output = clip(GeneratedTokens / {self.output_divisor:g}, {self.min_output}, {self.max_output}) tokens"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(x)))


def load_trace(path: Optional[Path | str] = None) -> list[TraceRequest]:
    """Read the trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; default: the shared
    Azure conversation trace beside the repository). Rows with non-positive lengths are
    skipped. Arrival times are seconds relative to the first row."""
    from datetime import datetime

    p = Path(path) if path is not None else default_workload()
    rows: list[TraceRequest] = []
    t0: Optional[float] = None
    with open(p, newline="") as f:
        for rec in csv.DictReader(f):
            try:
                ctx = int(rec["ContextTokens"])
                gen = int(rec["GeneratedTokens"])
            except (KeyError, ValueError):
                continue
            if ctx <= 0 or gen <= 0:
                continue
            ts = rec.get("TIMESTAMP", "")
            try:
                # Python's fromisoformat takes at most 6 fractional digits; the trace has 7.
                head, _, frac = ts.partition(".")
                t = datetime.fromisoformat(head + ("." + frac[:6] if frac else "")).timestamp()
            except ValueError:
                t = float(len(rows))
            if t0 is None:
                t0 = t
            rows.append(TraceRequest(t - t0, ctx, gen))
    if not rows:
        raise ValueError(f"no usable rows in {p}")
    return rows


@dataclass
class BenchRequest:
    """A benchmark request: token-id prompt, forced output length (tokens), and arrival
    offset (seconds from the start of the run; 0 for offline runs)."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0
    trace_prompt_tokens: int = 0
    trace_output_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sample_lengths(
    trace: Sequence[TraceRequest], n: int, scaling: LengthScaling, seed: int = 0
) -> list[tuple[int, int, TraceRequest]]:
    """Draw ``n`` trace rows uniformly (with replacement if ``n`` > rows) and scale them.
    Returns ``(prompt_len, output_len, row)`` tuples (tokens)."""
    rng = random.Random(seed)
    rows = rng.sample(list(trace), n) if n <= len(trace) else [rng.choice(trace) for _ in range(n)]
    return [(scaling.prompt(r.prompt_tokens), scaling.output(r.output_tokens), r) for r in rows]


def synth_prompts(
    prompt_lens: Sequence[int],
    vocab_size: int,
    seed: int = 0,
    shared_prefix_len: int = 0,
    low_token_id: int = 256,
) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids uniform in ``[low_token_id, vocab_size)``
    (clear of the special tokens at the bottom of the vocabulary).

    The first ``min(shared_prefix_len, len - 1)`` tokens of every prompt are one common
    "system prompt", so prefix caching has something to share (as in a real chat service);
    the rest are independent per prompt. ``shared_prefix_len=0``: nothing shared."""
    if vocab_size <= low_token_id:
        low_token_id = 0
    rng = random.Random(seed)
    prefix = [rng.randrange(low_token_id, vocab_size) for _ in range(max(0, shared_prefix_len))]
    out = []
    for n in prompt_lens:
        k = min(len(prefix), max(0, n - 1))
        out.append(prefix[:k] + [rng.randrange(low_token_id, vocab_size) for _ in range(n - k)])
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of ``rate`` requests/s: cumulative
    exponential gaps, the first request at its first gap. ``rate = inf``: all at 0."""
    if rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def make_requests(
    n: int,
    scaling: LengthScaling,
    vocab_size: int,
    seed: int = 0,
    shared_prefix_len: int = 0,
    rate: Optional[float] = None,
    trace_path: Optional[Path | str] = None,
    trace: Optional[Sequence[TraceRequest]] = None,
) -> list[BenchRequest]:
    """``n`` requests with trace-drawn, scaled lengths and synthetic token-id prompts;
    Poisson arrivals at ``rate`` requests/s if given (else all at 0)."""
    rows = trace if trace is not None else load_trace(trace_path)
    drawn = sample_lengths(rows, n, scaling, seed)
    prompts = synth_prompts([p for p, _, _ in drawn], vocab_size, seed + 1, shared_prefix_len)
    arrivals = poisson_arrivals(n, rate, seed + 2) if rate is not None else [0.0] * n
    return [
        BenchRequest(pr, o, a, r.prompt_tokens, r.output_tokens)
        for pr, (_, o, r), a in zip(prompts, drawn, arrivals)
    ]


# ---- latency arithmetic ------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method). NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99", "max"}`` of ``values`` (same unit); NaN when empty."""
    xs = [float(v) for v in values]
    if not xs:
        nan = float("nan")
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan}
    return {
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs),
    }


def ttft(arrival_time: float, first_token_time: float) -> float:
    """Time to first token, seconds: first token time minus arrival time."""
    return first_token_time - arrival_time


def tpot(first_token_time: float, finish_time: float, num_output_tokens: int) -> Optional[float]:
    """Time per output token after the first, seconds/token:
    ``(finish - first_token) / (num_output_tokens - 1)``. None for fewer than 2 tokens."""
    if num_output_tokens < 2:
        return None
    return (finish_time - first_token_time) / (num_output_tokens - 1)


def finite_or_none(x: Any) -> Any:
    """``x`` unless it is a non-finite float (JSON has no NaN): then None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
