"""Trace-driven workloads for every benchmark, and their latency arithmetic.

The Azure LLM inference trace (conversation service, 2023) gives one prompt length and one
output length per request (tokens) and an arrival timestamp. :func:`load_trace` is the one
reader of it: the capacity replay uses every row (clipped to ``max_model_len``), the serving
and peer benchmarks draw requests from it.

Prompt text is not part of the trace: :func:`synth_prompts` makes token-id prompts of the
sampled lengths, and benchmarks force the sampled output length with ``ignore_eos``. The
trace's requests (median prompt ~1,020 tokens, median output ~129 tokens) are far too long
for a 135M-parameter model on a 2-core CPU, so :class:`LengthScaling` divides both lengths by
a factor and clips them to a range; every result file states the scaling used.

Units: lengths in tokens, times in seconds, rates in requests per second.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from pagedkv.bench.common import default_workload
from pagedkv.errors import ConfigError


# ---- the trace ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    """One row of the trace: ``arrival_s`` is seconds since the trace's first request."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    """Request lengths and arrivals in arrival order, after clipping/skipping.

    ``arrival_s``: seconds since the first row (already multiplied by the time scale);
    ``context`` / ``generated``: tokens (int64). The counts describe what was changed.
    """

    arrival_s: np.ndarray
    context: np.ndarray
    generated: np.ndarray
    rows_read: int
    clipped: int = 0
    clipped_tokens: int = 0
    skipped_overlong: int = 0
    skipped_invalid: int = 0
    max_model_len: Optional[int] = None
    overlong: str = "clip"

    def __len__(self) -> int:
        return int(self.context.size)

    def requests(self) -> list[TraceRequest]:
        """The rows as :class:`TraceRequest` (what the request samplers draw from)."""
        return [TraceRequest(float(a), int(c), int(g))
                for a, c, g in zip(self.arrival_s.tolist(), self.context.tolist(), self.generated.tolist())]


def _parse_timestamps(col: Sequence[str]) -> np.ndarray:
    """Seconds (float64) relative to the first row: ISO date-times or plain numbers."""
    try:
        t = np.asarray([float(x) for x in col], dtype=np.float64)
    except ValueError:
        try:
            stamps = np.asarray([s.strip().replace(" ", "T", 1) for s in col], dtype="datetime64[ns]")
        except ValueError as exc:
            raise ConfigError(f"trace: TIMESTAMP must be ISO date-times or numbers ({exc})") from None
        t = (stamps - stamps[0]).astype(np.int64) / 1e9
    return t - t[0] if t.size else t


def _int_or_zero(text: Any) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return 0


def load_trace(
    path: Optional[Path | str] = None,
    *,
    limit: Optional[int] = None,
    time_scale: float = 1.0,
    max_model_len: Optional[int] = None,
    overlong: str = "clip",
) -> Trace:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV (default: the shared Azure
    conversation trace beside the repository; only its first ``limit`` rows if given).

    ``time_scale`` multiplies the arrival offsets (0.5 = the same requests twice as fast).
    Rows whose prompt or output is not a whole number >= 1 are skipped (counted as invalid).
    With ``max_model_len``, requests with ``ContextTokens + GeneratedTokens > max_model_len``
    are clipped (prompt left-truncated to ``max_model_len - GeneratedTokens``, at least 1
    token; output cut only if it alone is too long) or skipped, per ``overlong``; without it
    lengths are kept. Requests come back sorted by arrival (stable). Raises ``ConfigError``.
    """
    path = Path(path) if path is not None else default_workload()
    if not path.is_file():
        raise ConfigError(f"no such trace file: {path}")
    if overlong not in ("clip", "skip"):
        raise ConfigError(f"--overlong must be 'clip' or 'skip', not {overlong!r}")
    if max_model_len is not None and max_model_len < 2:
        raise ConfigError(f"--max-model-len must be >= 2, not {max_model_len}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ConfigError(f"--time-scale must be a positive number, not {time_scale}")
    ts: list[str] = []
    ctx: list[int] = []
    gen: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise ConfigError(f"trace {path}: needs columns {sorted(need)}, has {reader.fieldnames}")
        for i, row in enumerate(reader):
            if limit is not None and i >= limit:
                break
            ts.append(row["TIMESTAMP"])
            ctx.append(_int_or_zero(row["ContextTokens"]))
            gen.append(_int_or_zero(row["GeneratedTokens"]))
    if not ts:
        raise ConfigError(f"trace {path}: no rows")
    c = np.asarray(ctx, dtype=np.int64)
    g = np.asarray(gen, dtype=np.int64)
    valid = (c >= 1) & (g >= 1)
    if not valid.any():
        raise ConfigError(f"trace {path}: no usable rows")
    arrival = _parse_timestamps([t for t, ok in zip(ts, valid.tolist()) if ok]) * time_scale
    skipped_invalid = int((~valid).sum())
    c, g = c[valid], g[valid]
    clipped = clipped_tokens = skipped_overlong = 0
    if max_model_len is not None:
        over = c + g > max_model_len
        if overlong == "skip":
            skipped_overlong = int(over.sum())
            arrival, c, g = arrival[~over], c[~over], g[~over]
        else:
            g2 = np.minimum(g, max_model_len - 1)
            c2 = np.where(over, np.maximum(max_model_len - g2, 1), c)
            clipped = int(over.sum())
            clipped_tokens = int((c + g - c2 - g2).sum())
            c, g = c2, g2
    order = np.argsort(arrival, kind="stable")
    return Trace(
        arrival_s=arrival[order], context=c[order], generated=g[order], rows_read=len(ts),
        clipped=clipped, clipped_tokens=clipped_tokens, skipped_overlong=skipped_overlong,
        skipped_invalid=skipped_invalid, max_model_len=max_model_len, overlong=overlong,
    )


# ---- requests drawn from the trace ----------------------------------------------------------
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
    trace: Trace | Sequence[TraceRequest], n: int, scaling: LengthScaling, seed: int = 0
) -> list[tuple[int, int, TraceRequest]]:
    """Draw ``n`` trace rows uniformly (with replacement if ``n`` > rows) and scale them.
    Returns ``(prompt_len, output_len, row)`` tuples (tokens)."""
    rng = random.Random(seed)
    pool = trace.requests() if isinstance(trace, Trace) else list(trace)
    rows = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
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


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids uniform in ``[1000, min(vocab_size, 30000))``: ordinary tokens, clear of
    the special ones at the bottom of the vocabulary and of the rarest at the top."""
    hi = min(vocab_size, 30000)
    return [rng.randrange(1000, hi) for _ in range(n)]


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
    trace: Optional[Trace | Sequence[TraceRequest]] = None,
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


@dataclass
class RequestRecord:
    """Timing of one served request (seconds since the epoch) and its output token count."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    output_tokens: int = 0
    expected_tokens: int = 0
    preemptions: int = 0
    cached_tokens: int = 0
    status: str = "pending"  # ok | rejected | unfinished | error


@dataclass
class RunStats:
    """What a serving run observed besides the per-request records."""

    started: float = 0.0
    ended: float = 0.0
    steps: int = 0
    running_samples: list[int] = field(default_factory=list)
    kv_usage_samples: list[float] = field(default_factory=list)
    preemptions: int = 0
    peak_running: int = 0
    cpu_s: Optional[float] = None  # this process's CPU seconds over the run (in-process runs)
    notes: list[str] = field(default_factory=list)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_run(records: Sequence[RequestRecord], stats: RunStats) -> dict[str, Any]:
    """Throughput, latency percentiles and counts of one run. TTFT = first token - arrival;
    TPOT = (finish - first token) / (output tokens - 1); duration = last finish - first
    arrival; throughput = completed requests (and their output tokens) / duration."""
    ok = [r for r in records if r.status == "ok"]
    ttfts = [ttft(r.arrival_time, r.first_token_time) for r in ok if r.first_token_time is not None]
    tpots = [x for x in (tpot(r.first_token_time, r.finish_time, r.output_tokens) for r in ok
                         if r.first_token_time is not None and r.finish_time is not None) if x is not None]
    e2e = [r.finish_time - r.arrival_time for r in ok if r.finish_time is not None]
    first_arrival = min((r.arrival_time for r in records), default=stats.started)
    last_finish = max((r.finish_time for r in ok if r.finish_time is not None), default=stats.ended)
    duration = max(last_finish - first_arrival, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "unfinished": sum(1 for r in records if r.status in ("unfinished", "pending")),
        "errors": sum(1 for r in records if r.status == "error"),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_s": summarize(ttfts),
        "tpot_s": summarize(tpots),
        "e2e_latency_s": summarize(e2e),
        "preemptions": stats.preemptions,
        "peak_running": stats.peak_running,
        "mean_running": _mean(stats.running_samples),
        "mean_kv_usage": _mean(stats.kv_usage_samples),
        "engine_steps": stats.steps,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "cpu_s": stats.cpu_s,
        "notes": stats.notes,
    }


def meets_target(summary: dict[str, Any], ttft_p90: float, tpot_p90: float) -> bool:
    """p90 TTFT <= ``ttft_p90`` s, p90 TPOT <= ``tpot_p90`` s, every request completed."""
    if summary["completed"] == 0 or summary["completed"] < summary["requests"]:
        return False
    t, p = summary["ttft_s"]["p90"], summary["tpot_s"]["p90"]
    if t is None or not math.isfinite(t) or t > ttft_p90:
        return False
    if p is not None and math.isfinite(p) and p > tpot_p90:
        return False
    return True


# ---- the trace-request flags of serve and peers ----------------------------------------------
def add_trace_arguments(p: Any, num_requests: int) -> None:
    """``--num-requests --length-divisor --max-prompt --max-output --seed --trace``."""
    p.add_argument("--num-requests", type=int, default=num_requests,
                   help=f"requests drawn from the trace per run (default {num_requests})")
    p.add_argument("--length-divisor", type=float, default=8.0, help="trace lengths are divided by this (default 8)")
    p.add_argument("--max-prompt", type=int, default=512, help="clip prompts to this many tokens (default 512)")
    p.add_argument("--max-output", type=int, default=64, help="clip outputs to this many tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="request sampling seed (default 0)")
    p.add_argument("--trace", default=None, help="trace CSV (default: the shared Azure conversation trace)")


def requests_from_args(args: Any, vocab_size: int, shared_prefix_len: int = 0) -> tuple[list[BenchRequest], LengthScaling]:
    """``args.num_requests`` requests drawn from ``args.trace`` with the flags of
    :func:`add_trace_arguments` (prompts of at least 4 tokens, outputs of at least 2)."""
    scaling = LengthScaling(prompt_divisor=args.length_divisor, output_divisor=args.length_divisor,
                            min_prompt=4, max_prompt=args.max_prompt, min_output=2, max_output=args.max_output)
    reqs = make_requests(args.num_requests, scaling, vocab_size, seed=args.seed,
                         shared_prefix_len=shared_prefix_len, trace=load_trace(args.trace))
    return reqs, scaling
