"""Attention: paged vs contiguous attention (decode, and prefill over paged context), KV GB/s vs memory bandwidth.

Seed §05: "more requests fit" does not mean one request's attention is faster; block-table
lookups and scattered reads cost something. This benchmark measures that cost on this machine:

* **memory bandwidth**: best-of-N read bandwidth of a large float32 buffer (``tensor.sum()``,
  several times the last-level cache), measured in the same run with the same pinned threads;
* **decode** (one new token per sequence, batch ``--batch``, contexts ``--contexts``):
  ``contiguous`` = ``F.scaled_dot_product_attention`` over per-sequence contiguous K/V
  ``[B, Hkv, L, d]`` (``enable_gqa``); ``paged`` = the backend under test (default ``cpu``)
  over a block-shuffled paged cache; ``paged_torch`` = the same backend's pure-torch path
  (workspace gather + matmuls); ``naive_gather`` = fresh ``k_cache[block_table]`` gather per
  call, then SDPA. Reported: median time, KV bytes read per second (``2 * B * L * Hkv * d *
  bytes``), the fraction of measured bandwidth, and paged / contiguous;
* **prefill with paged context**: one chunk of ``--prefill-chunk`` new tokens at the end of a
  context of L tokens (causal over positions L-chunk..L-1): the backend vs SDPA over
  contiguous K/V with the equivalent bottom-right causal mask.

Each variant cycles through enough independent layer caches that the working set is at least
``--min-working-set-mb`` (default 2x the last-level cache), so KV comes from DRAM as in a real
model with many layers; variants are measured interleaved (round-robin) and the median is kept,
which makes the ratios robust to other load on a shared machine.

Results: ``attention.{json,md,png}``, the variant ``paged_vs_contiguous`` (or, with
``--kv-cache-dtypes``, ``kv_formats``; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from pagedkv.bench.common import add_options, add_run_options, log, machine_info, pin_threads
from pagedkv.bench.report import closing_lines, markdown_table, publish, pyplot, save_figure
from pagedkv.bench.variants import add_variant_option
from pagedkv.errors import ConfigError
from pagedkv.utils import cdiv

_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, [("--backend", "cpu", "paged backend under test (default cpu)"),
                    ("--dtypes", "float32,bfloat16", "KV/query dtypes (default float32,bfloat16)")])
    add_options(p.add_argument_group("attention shape"), [
        ("--heads", 9, "query heads (default 9: SmolLM2-135M)"),
        ("--kv-heads", 3, "KV heads (default 3)"),
        ("--head-dim", 64, "head dim (default 64)"),
        ("--block-size", 16, "tokens per block (default 16)"),
    ])
    w = p.add_argument_group("workload and timing")
    add_options(w, [("--batch", 8, "decode batch (default 8)"),
                    ("--contexts", "512,2048,8192", "context lengths, tokens (default 512,2048,8192)"),
                    ("--prefill-chunk", 256, "new tokens of the prefill chunk (default 256)"),
                    ("--repeats", 15, "timed rounds per variant (default 15)")])
    w.add_argument("--min-working-set-mb", type=float, default=None,
                   help="KV working set per variant, MB (default 2x the last-level cache, >= 64)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive-gather baseline")
    p.add_argument("--kv-cache-dtypes", default=None,
                   help="also time decode per KV cache format, float32 queries, e.g. float32,bfloat16,int8,fp8_e4m3 "
                        "(see pagedkv.bench.attention.kv)")
    add_variant_option(p, "kv_formats with --kv-cache-dtypes, else paged_vs_contiguous")
    add_run_options(p, tiny="batch 2, contexts 64,256, 3 repeats, small buffers (seconds)")


def _llc_bytes() -> int:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    try:
        for idx in base.glob("index*"):
            size = (idx / "size").read_text().strip()
            mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 * 1024 ** 2


def measure_bandwidth(nbytes: int, repeats: int = 7) -> dict[str, float]:
    """Best-of-``repeats`` read bandwidth (GB/s = 1e9 B/s) of a float32 buffer of ``nbytes``
    via ``sum()``, and copy bandwidth (read + write bytes) via ``copy_``."""
    import torch

    n = max(1, nbytes // 4)
    a = torch.ones(n)
    b = torch.empty(n)
    read, copy, read_cpu = math.inf, math.inf, math.inf
    for _ in range(repeats):
        c = time.thread_time()
        t = time.perf_counter()
        a.sum()
        read = min(read, time.perf_counter() - t)
        read_cpu = min(read_cpu, time.thread_time() - c)
        t = time.perf_counter()
        b.copy_(a)
        copy = min(copy, time.perf_counter() - t)
    return {"buffer_bytes": n * 4, "read_GBps": n * 4 / read / 1e9, "copy_GBps": 2 * n * 4 / copy / 1e9,
            "read_GBps_cpu_time": n * 4 / max(read_cpu, 1e-9) / 1e9}


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, float, float]]:
    """(median wall, best wall, median thread-CPU) seconds per call of each fn, timed
    round-robin after 2 warm-up rounds. Thread CPU time only counts the calling thread, so it
    is the whole cost only with one torch thread; it does not grow when other processes take
    the CPU (wall time does)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 2):
        for k, fn in fns.items():
            c = time.thread_time()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            dc = time.thread_time() - c
            if r >= 2:
                times[k].append(dt)
                cpu[k].append(dc)
    return {k: (statistics.median(v), min(v), statistics.median(cpu[k])) for k, v in times.items()}


class _Setup:
    """``layers`` independent paged caches + contiguous copies of the same sequences."""

    def __init__(self, args, backend_name: str, dtype, batch: int, ctx: int, working_set: int, seed: int = 0):
        import torch

        from pagedkv.attention import AttentionMetadata, get_backend

        self.torch = torch
        g = torch.Generator().manual_seed(seed)
        hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
        esz = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes = 2 * batch * ctx * hkv * d * esz
        self.layers = max(1, cdiv(working_set, self.kv_bytes))
        self.backend = get_backend(backend_name)
        nblk = cdiv(ctx, bs)
        num_blocks = batch * nblk + 1
        self.caches, self.contig = [], []
        for _ in range(self.layers):
            perm = torch.randperm(num_blocks, generator=g)[: batch * nblk].view(batch, nblk)
            cache = self.backend.allocate_kv_cache(num_blocks, bs, hkv, d, dtype)
            k = torch.randn(batch, ctx, hkv, d, generator=g).to(dtype)
            v = torch.randn(batch, ctx, hkv, d, generator=g).to(dtype)
            md = AttentionMetadata.build([ctx] * batch, [ctx] * batch, perm.tolist(), bs)
            self.backend.write_kv(cache, k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), md.slot_mapping)
            self.caches.append((cache, perm))
            self.contig.append((k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))  # [B, Hkv, L, d]
        self.tables = [p.tolist() for _, p in self.caches]
        self.hq, self.hkv, self.d, self.bs, self.ctx, self.batch, self.dtype = hq, hkv, d, bs, ctx, batch, dtype
        self.scale = d ** -0.5
        self.g = g
        self.i = 0

    def next(self) -> int:
        self.i = (self.i + 1) % self.layers
        return self.i


def bench_decode(args, dtype, ctx: int, working_set: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from pagedkv.attention import AttentionMetadata
    from pagedkv.attention.cpu import CPUBackend

    S = _Setup(args, args.backend, dtype, args.batch, ctx, working_set)
    B = args.batch
    mds = [AttentionMetadata.build([ctx] * B, [1] * B, t, S.bs) for t in S.tables]
    q = torch.randn(B, S.hq, S.d, generator=S.g).to(dtype)
    q4 = q.view(B, S.hq, 1, S.d)
    layout = S.backend.layout.name if hasattr(S.backend, "layout") else "nhd"
    torch_path = CPUBackend(layout=layout, use_kernel=False)
    nblk = cdiv(ctx, S.bs)

    def contiguous():
        k, v = S.contig[S.next()]
        return F.scaled_dot_product_attention(q4, k, v, scale=S.scale, enable_gqa=True)

    def paged():
        i = S.next()
        return S.backend.forward(q, S.caches[i][0], mds[i], S.scale)

    def paged_torch():
        i = S.next()
        return torch_path.forward(q, S.caches[i][0], mds[i], S.scale)

    def naive_gather():
        i = S.next()
        cache, perm = S.caches[i]
        kc = cache.key_nhd()
        vc = cache.value_nhd()
        k = kc[perm].reshape(B, nblk * S.bs, S.hkv, S.d)[:, :ctx].transpose(1, 2)
        v = vc[perm].reshape(B, nblk * S.bs, S.hkv, S.d)[:, :ctx].transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, scale=S.scale, enable_gqa=True)

    fns: dict[str, Callable[[], Any]] = {"contiguous": contiguous, "paged": paged}
    if S.backend.name.startswith("cpu"):
        fns["paged_torch"] = paged_torch
    if not args.no_naive:
        fns["naive_gather"] = naive_gather
    # correctness guard: the paged result must match contiguous SDPA (same layer)
    S.i = S.layers - 1
    ref = contiguous().squeeze(2).float()
    S.i = S.layers - 1
    got = paged().float()
    err = float((got - ref).abs().max())
    t = _interleaved(fns, args.repeats)
    row: dict[str, Any] = {"phase": "decode", "dtype": str(dtype).replace("torch.", ""), "context": ctx,
                           "batch": B, "kv_bytes": S.kv_bytes, "layers_cycled": S.layers, "max_abs_err": err}
    one_thread = torch.get_num_threads() == 1
    for k, (med, best, cpu) in t.items():
        row[f"{k}_ms"] = med * 1e3
        row[f"{k}_best_ms"] = best * 1e3
        row[f"{k}_GBps"] = S.kv_bytes / med / 1e9
        row[f"{k}_best_GBps"] = S.kv_bytes / best / 1e9
        if one_thread:
            row[f"{k}_cpu_ms"] = cpu * 1e3
            row[f"{k}_cpu_GBps"] = S.kv_bytes / max(cpu, 1e-9) / 1e9
    row["paged_vs_contiguous"] = t["paged"][0] / t["contiguous"][0]
    row["paged_vs_contiguous_best"] = t["paged"][1] / t["contiguous"][1]
    if "naive_gather" in t:
        row["naive_vs_contiguous"] = t["naive_gather"][0] / t["contiguous"][0]
    if "paged_torch" in t:
        row["torch_path_vs_contiguous"] = t["paged_torch"][0] / t["contiguous"][0]
    return row


def bench_prefill(args, dtype, ctx: int, working_set: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from pagedkv.attention import AttentionMetadata

    chunk = min(args.prefill_chunk, ctx)
    S = _Setup(args, args.backend, dtype, 1, ctx, working_set)
    mds = [AttentionMetadata.build([ctx], [chunk], t, S.bs) for t in S.tables]
    q = torch.randn(chunk, S.hq, S.d, generator=S.g).to(dtype)
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, chunk, d]
    qpos = torch.arange(ctx - chunk, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] <= qpos  # bottom-right causal, [chunk, ctx]

    def contiguous():
        k, v = S.contig[S.next()]
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=S.scale, enable_gqa=True)

    def paged():
        i = S.next()
        return S.backend.forward(q, S.caches[i][0], mds[i], S.scale)

    S.i = S.layers - 1
    ref = contiguous()[0].transpose(0, 1).float()
    S.i = S.layers - 1
    err = float((paged().float() - ref).abs().max())
    t = {k: v[0] for k, v in _interleaved({"contiguous": contiguous, "paged": paged}, max(3, args.repeats // 2)).items()}
    flops = 4 * chunk * ctx * S.hq * S.d  # QK^T + PV, no causal saving counted
    return {"phase": "prefill", "dtype": str(dtype).replace("torch.", ""), "context": ctx, "chunk": chunk,
            "layers_cycled": S.layers, "max_abs_err": err,
            "contiguous_ms": t["contiguous"] * 1e3, "paged_ms": t["paged"] * 1e3,
            "paged_GFLOPs": flops / t["paged"] / 1e9, "contiguous_GFLOPs": flops / t["contiguous"] / 1e9,
            "paged_tokens_per_s": chunk / t["paged"],
            "paged_vs_contiguous": t["paged"] / t["contiguous"]}


def run_attention(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.tiny:
        args.batch, args.contexts, args.repeats = 2, "64,256", 3
        args.prefill_chunk = min(args.prefill_chunk, 32)
    contexts = [int(x) for x in str(args.contexts).split(",") if x.strip()]
    dtypes = []
    for name in str(args.dtypes).split(","):
        name = name.strip()
        if name not in _DTYPES:
            raise ConfigError(f"--dtypes: {name!r} is not one of {', '.join(_DTYPES)}")
        dtypes.append(getattr(torch, name))
    if not contexts or min(contexts) <= 0 or args.batch <= 0:
        raise ConfigError("--contexts and --batch must be positive")
    if args.heads % args.kv_heads:
        raise ConfigError("--heads must be a multiple of --kv-heads")
    llc = _llc_bytes()
    ws_mb = args.min_working_set_mb
    if ws_mb is None:
        ws_mb = 4.0 if args.tiny else max(64.0, 2 * llc / 2 ** 20)
    working_set = int(ws_mb * 2 ** 20)
    t0 = time.perf_counter()
    bw = measure_bandwidth(16 * 2 ** 20 if args.tiny else max(256 * 2 ** 20, 4 * llc))
    rows = []
    for dt in dtypes:
        for ctx in contexts:
            row = bench_decode(args, dt, ctx, working_set)
            row["paged_bw_fraction"] = row["paged_GBps"] / bw["read_GBps"]
            row["paged_best_bw_fraction"] = row["paged_best_GBps"] / bw["read_GBps"]
            if "paged_cpu_GBps" in row:
                row["paged_cpu_bw_fraction"] = row["paged_cpu_GBps"] / bw["read_GBps_cpu_time"]
            row["contiguous_bw_fraction"] = row["contiguous_GBps"] / bw["read_GBps"]
            rows.append(row)
            log(f"decode {row['dtype']:8s} L={ctx:5d}: paged {row['paged_ms']:.3f} ms "
                f"({row['paged_GBps']:.1f} GB/s = {100 * row['paged_bw_fraction']:.0f}% of {bw['read_GBps']:.1f}; "
                f"best {row['paged_best_GBps']:.1f} = {100 * row['paged_best_bw_fraction']:.0f}%) "
                f"contiguous {row['contiguous_ms']:.3f} ms -> {row['paged_vs_contiguous']:.2f}x")
    kv_rows = []
    if args.kv_cache_dtypes:
        from pagedkv.bench.attention.kv import bench_kv_formats

        for ctx in contexts:
            kv_rows += bench_kv_formats(args, ctx, working_set, _interleaved)
            log("decode by KV format L=%d: %s" % (ctx, ", ".join(
                f"{r['kv_cache_dtype']} {r['ms']:.3f} ms ({r['time_vs_float32']:.2f}x time, "
                f"{r['bytes_vs_float32']:.2f}x bytes)" for r in kv_rows if r["context"] == ctx)))
    prefill_rows = []
    for dt in dtypes:
        for ctx in contexts:
            r = bench_prefill(args, dt, ctx, working_set)
            prefill_rows.append(r)
            log(f"prefill {r['dtype']:8s} L={ctx:5d} chunk {r['chunk']}: paged {r['paged_ms']:.2f} ms "
                f"contiguous {r['contiguous_ms']:.2f} ms -> {r['paged_vs_contiguous']:.2f}x")
    return {
        "config": {
            "backend": args.backend, "batch": args.batch, "contexts": contexts,
            "dtypes": [str(d).replace("torch.", "") for d in dtypes], "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
            "prefill_chunk": args.prefill_chunk, "repeats": args.repeats, "working_set_bytes": working_set,
            "llc_bytes": llc, "tiny": bool(args.tiny), "threads": torch.get_num_threads(),
            "timing": "median of round-robin rounds after 2 warm-up rounds",
        },
        "bandwidth": bw,
        "decode": rows,
        "decode_by_kv_format": kv_rows,
        "prefill": prefill_rows,
        "runtime_s": time.perf_counter() - t0,
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report (``plots``: label -> PNG file name)."""
    c = data["config"]
    bw = data["bandwidth"]
    lines = [
        "# Attention: paged vs contiguous",
        "",
        f"Backend `{c['backend']}`; {c['heads']} query heads, {c['kv_heads']} KV heads, head_dim "
        f"{c['head_dim']}, block_size {c['block_size']}; physical blocks shuffled. Each variant cycles "
        f"through layer caches totalling >= {c['working_set_bytes'] / 2 ** 20:.0f} MiB "
        f"(last-level cache {c['llc_bytes'] / 2 ** 20:.0f} MiB), timed round-robin, median of "
        f"{c['repeats']} rounds.",
        "",
        f"Measured memory bandwidth (same run, same threads, best of 7): read {bw['read_GBps']:.1f} GB/s "
        f"({bw['read_GBps_cpu_time']:.1f} by CPU time), copy {bw['copy_GBps']:.1f} GB/s (read+write "
        f"bytes), buffer {bw['buffer_bytes'] / 2 ** 20:.0f} MiB. Torch threads: {data['config'].get('threads')}.",
        "",
        f"## Decode (batch {c['batch']}, one new token per sequence)",
        "",
        "KV GB/s = 2 x B x L x Hkv x d x bytes / time. Times are medians of the round-robin rounds "
        "(`_best`: fastest round); `paged_bw_fraction` = median paged KV GB/s / measured read "
        "bandwidth, `paged_best_bw_fraction` = fastest round's KV GB/s / the same (best-of) bandwidth.",
        "With one torch thread, `paged_cpu_GBps` divides by the calling thread's CPU time instead of wall "
        "time (robust to other processes taking the CPU) and `paged_cpu_bw_fraction` compares it with "
        "the read bandwidth measured the same way.",
        "`paged_torch` is the backend's pure-torch path (workspace gather + matmuls), `naive_gather` "
        "a fresh `k_cache[block_table]` gather per call followed by SDPA.",
        "",
    ]
    cols = ["dtype", "context", "contiguous_ms", "paged_ms", "paged_vs_contiguous", "paged_GBps",
            "paged_bw_fraction", "paged_best_GBps", "paged_best_bw_fraction"]
    if "paged_cpu_GBps" in data["decode"][0]:
        cols += ["paged_cpu_GBps", "paged_cpu_bw_fraction"]
    extra = [k for k in ("paged_torch_ms", "torch_path_vs_contiguous", "naive_gather_ms", "naive_vs_contiguous")
             if k in data["decode"][0]]
    lines.append(markdown_table(data["decode"], cols + extra + ["max_abs_err"]))
    if data.get("decode_by_kv_format"):
        lines += ["", f"## Decode by KV cache format (batch {c['batch']}, float32 queries, one round-robin loop per context)",
                  "", "`kv_bytes`: codes + bf16 scales (quantised) or values, of the context read per call; "
                  "`time_vs_float32` / `bytes_vs_float32`: against the float32 cache in the same loop.", ""]
        lines.append(markdown_table(data["decode_by_kv_format"], [
            "kv_cache_dtype", "context", "ms", "best_ms", "kv_bytes", "GBps", "time_vs_float32", "bytes_vs_float32",
            "max_abs_diff_vs_float32"]))
    lines += ["", f"## Prefill over paged context (one chunk of {c['prefill_chunk']} new tokens at the end of L)", ""]
    lines.append(markdown_table(data["prefill"], ["dtype", "context", "chunk", "contiguous_ms", "paged_ms",
                                                  "paged_vs_contiguous", "paged_GFLOPs", "paged_tokens_per_s",
                                                  "max_abs_err"]))
    return "\n".join(lines + closing_lines(data, plots)) + "\n"


def make_plots(data: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Decode KV GB/s and paged / contiguous time against the context; sets ``data["plot"]``."""
    plt = pyplot()
    rows = data["decode"]
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: _DTYPES.index(d) if d in _DTYPES else 9)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for dt in dtypes:
        rs = [r for r in rows if r["dtype"] == dt]
        x = [r["context"] for r in rs]
        axes[0].plot(x, [r["paged_GBps"] for r in rs], "o-", label=f"paged {dt}")
        axes[0].plot(x, [r["contiguous_GBps"] for r in rs], "s--", label=f"contiguous SDPA {dt}")
        axes[1].plot(x, [r["paged_vs_contiguous"] for r in rs], "o-", label=f"paged / contiguous {dt}")
        if "naive_vs_contiguous" in rs[0]:
            axes[1].plot(x, [r["naive_vs_contiguous"] for r in rs], "x:", label=f"naive gather / contiguous {dt}")
    bw = data["bandwidth"]["read_GBps"]
    axes[0].axhline(bw, color="k", lw=1, label=f"measured read bandwidth {bw:.1f}")
    axes[0].axhline(bw / 2, color="gray", lw=1, ls=":", label="50% of it")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("context (tokens)")
    axes[0].set_ylabel("KV GB/s")
    axes[0].set_title(f"decode, batch {data['config']['batch']}")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.3, color="gray", lw=1, ls=":", label="1.3x goal")
    axes[1].axhline(1.0, color="k", lw=1)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("context (tokens)")
    axes[1].set_ylabel("time ratio (lower is better)")
    axes[1].set_title("paged / contiguous")
    axes[1].legend(fontsize=7)
    data["plot"] = save_figure(fig, out_dir / "attention.png")
    return {"paged vs contiguous": data["plot"]}


def run(args: argparse.Namespace) -> int:
    threads = pin_threads(args.threads)
    data = run_attention(args)
    data["machine"] = machine_info(threads)
    data["plot"] = None
    variant = args.variant or ("kv_formats" if args.kv_cache_dtypes else "paged_vs_contiguous")
    publish("attention", data, render_markdown, args.out_dir, variant=variant,
            plots=None if args.no_plot else make_plots,
            as_json=args.json, json_keys=("config", "bandwidth", "decode", "decode_by_kv_format", "prefill", "runtime_s"), summary=_summary)
    return 0


def _summary(data: dict[str, Any], paths: dict[str, Path]) -> str:
    png = f" and {data['plot']}" if data["plot"] else ""
    return (f"wrote {paths['json']} and {paths['md']}{png} in {data['runtime_s']:.1f} s "
            f"(torch threads {data['machine']['torch_threads']})")
