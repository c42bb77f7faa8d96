"""Prometheus metrics of the server (``GET /metrics``).

Gauges and counters that the engine already keeps (requests running/waiting, KV blocks, the
KV cache format and its bytes per token,
prefix-cache hits, preemptions, copy-on-write copies, tokens) are read from
``engine.get_stats()`` at scrape time by a custom collector, so they are never stale and
cost nothing per step. Latency histograms are observed when a request finishes.

Every :class:`ServerMetrics` owns its own ``CollectorRegistry`` (several apps in one
process, e.g. tests, never clash). Units are in the metric names (seconds, tokens, blocks).
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedkv.engine.request import RequestOutput
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.structured import FAILURE_REASONS as GRAMMAR_FAILURE_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    """Reads ``engine.get_stats()`` once per scrape."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily; do not call get_stats() at registration

    def collect(self) -> Iterable[Metric]:
        st: EngineStats = self.engine.get_stats()
        labels = ["model_name"]
        val = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(val, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(val, float(value))
            return c

        yield gauge("pagedkv_num_requests_running", "Sequences in the running batch.", st.num_running)
        yield gauge("pagedkv_num_requests_waiting", "Sequences waiting (queued or preempted).", st.num_waiting)
        yield gauge("pagedkv_kv_blocks_total", "Physical KV blocks in the pool.", st.num_blocks)
        yield gauge("pagedkv_kv_blocks_used", "KV blocks with ref_cnt > 0 (tables and step fences).", st.num_used_blocks)
        yield gauge("pagedkv_kv_blocks_free", "KV blocks in the free queue (cached-but-free included).", st.num_free_blocks)
        yield gauge("pagedkv_kv_cache_usage_percent", "Used KV blocks, percent of the pool (0-100).", 100.0 * st.kv_usage)
        yield gauge("pagedkv_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up (0-1, since start).",
                    st.kv_prefix_hit_rate)
        yield counter("pagedkv_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache (at each request's first admission).", st.kv_prefix_queries)
        yield counter("pagedkv_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache (at each request's first admission).", st.kv_prefix_hits)
        yield counter("pagedkv_num_preemptions", "Sequences preempted (blocks freed, recomputed later).", st.num_preemptions)
        yield counter("pagedkv_cow_copies", "Copy-on-write block copies.", st.kv_cow_copies)
        yield counter("pagedkv_prefix_cache_evictions", "Cached free blocks evicted for reuse.", st.kv_evictions)
        yield counter("pagedkv_generation_tokens", "Tokens generated (all sequences).", st.num_generated_tokens)
        yield counter("pagedkv_prompt_tokens", "Prompt tokens admitted.", st.num_prompt_tokens)
        yield counter("pagedkv_engine_steps", "Engine steps run.", st.num_steps)
        yield counter("pagedkv_spec_decode_draft_tokens", "Speculative draft tokens proposed.", st.num_draft_tokens)
        yield counter("pagedkv_spec_decode_accepted_tokens", "Speculative draft tokens accepted.", st.num_accepted_tokens)
        yield gauge("pagedkv_spec_decode_acceptance_rate", "Accepted / proposed draft tokens (0-1, since start).",
                    st.spec_acceptance_rate)
        yield gauge("pagedkv_spec_decode_mean_accepted_length", "Tokens a verified decode row kept, on average "
                    "(accepted drafts + 1; 0 before any).", st.spec_mean_accepted_length)
        gf = CounterMetricFamily("pagedkv_grammar_failures", "Structured-output sequences ended by a run-time grammar "
                                 "failure (finish reason error), by reason.", labels=labels + ["reason"])
        for reason in GRAMMAR_FAILURE_REASONS:
            gf.add_metric(val + [reason], float(st.grammar_failures.get(reason, 0)))
        yield gf
        kv = self.engine.kv_summary()
        info = GaugeMetricFamily("pagedkv_kv_cache_info", "The KV cache format (value 1): kv_cache_dtype and, "
                                 "for int8/fp8, elements per bf16 scale (quant_group_size).",
                                 labels=labels + ["kv_cache_dtype", "quant_group_size"])
        info.add_metric(val + [kv["kv_cache_dtype"], str(kv["kv_quant_group_size"] or "")], 1.0)
        yield info
        yield gauge("pagedkv_kv_cache_bytes_per_token", "KV cache bytes per token (all layers, this rank; scales included).",
                    kv["bytes_per_token"])
        yield from _tier_metrics(st, labels, val)


def _tier_metrics(st: EngineStats, labels: list[str], val: list[str]) -> Iterable[Metric]:
    """Per tier (``pool``, ``host``, ``disk``): blocks held, prefix hits; per direction:
    blocks and bytes moved; per copy kind: seconds. Only with ``kv_offload``."""
    if not st.kv_tiers:
        return
    tiers = st.kv_tiers["tiers"]
    blocks = GaugeMetricFamily("pagedkv_kv_tier_blocks", "KV blocks held by a tier behind the pool.", labels=labels + ["tier"])
    cap = GaugeMetricFamily("pagedkv_kv_tier_capacity_blocks", "KV blocks a tier holds at most.", labels=labels + ["tier"])
    hit_t = CounterMetricFamily("pagedkv_kv_tier_hit_tokens", "Prompt tokens served from each tier (pool included).", labels=labels + ["tier"])
    hit_b = CounterMetricFamily("pagedkv_kv_tier_hit_blocks", "Prefix-hit blocks loaded from a tier into the pool.", labels=labels + ["tier"])
    hit_t.add_metric(val + ["pool"], float(st.kv_pool_hit_tokens))
    for name, t in tiers.items():
        blocks.add_metric(val + [name], float(t["blocks"]))
        cap.add_metric(val + [name], float(t["capacity_blocks"]))
        hit_t.add_metric(val + [name], float(t["hit_tokens"]))
        hit_b.add_metric(val + [name], float(t["hit_blocks"]))
    tr = st.kv_tiers["transfer"]
    moved = CounterMetricFamily("pagedkv_kv_transfer_bytes", "Bytes of K/V moved between the pool and the tiers, by direction.",
                                labels=labels + ["direction"])
    for d, n in tr.get("bytes", {}).items():
        moved.add_metric(val + [d], float(n))
    secs = CounterMetricFamily("pagedkv_kv_transfer_seconds", "Time spent copying K/V for the tiers (export, import, disk_read, disk_write, recompute).",
                               labels=labels + ["kind"])
    for k, s in tr.get("seconds", {}).items():
        secs.add_metric(val + [k], float(s))
    yield from (blocks, cap, hit_t, hit_b, moved, secs)


class ServerMetrics:
    """The server's metrics. ``observe_output`` is the engine loop's ``on_output`` hook."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))  # type: ignore[arg-type]
        self.model_name = model_name
        lbl = ["model_name"]
        self.ttft = Histogram("pagedkv_time_to_first_token_seconds", "Time to first token (arrival to first sampled token), seconds.",
                              lbl, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedkv_time_per_output_token_seconds", "Mean time per output token after the first, seconds (one sample per finished sequence set).",
                              lbl, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedkv_e2e_request_latency_seconds", "Arrival to finish, seconds.",
                             lbl, buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("pagedkv_requests_finished", "User requests finished, by finish reason (stop, length, abort, error).",
                                ["model_name", "finish_reason"], registry=self.registry)
        self.http_errors = Counter("pagedkv_http_errors", "Requests rejected with an error status.",
                                   ["model_name", "status"], registry=self.registry)
        self.disconnects = Counter("pagedkv_client_disconnects", "Requests aborted because the client went away.",
                                   lbl, registry=self.registry)
        # create the labelled series up front, so they are exported (as 0) before traffic
        for h in (self.ttft, self.tpot, self.e2e, self.disconnects):
            h.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(model_name, reason)

    def observe_output(self, out: RequestOutput) -> None:
        """Record a finished request's latencies (ignores unfinished outputs)."""
        if not out.finished:
            return
        m = out.metrics
        reason = (out.outputs[0].finish_reason or "unknown") if out.outputs else "unknown"
        self.finished.labels(self.model_name, reason).inc()
        if reason == "abort":
            return
        if m.first_token_time is not None:
            self.ttft.labels(self.model_name).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finish_time is not None:
            self.e2e.labels(self.model_name).observe(max(0.0, m.finish_time - m.arrival_time))
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.first_token_time is not None and n > 1:
                self.tpot.labels(self.model_name).observe(max(0.0, (m.finish_time - m.first_token_time) / (n - 1)))

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
