"""Time the integer matmul kernels on GGUF blocks (``pagedkv.ops.qmm.pack_gguf``) beside the
int4 (fmt 4) and int8 (fmt 8) ones, at one input row (a batch-1 decode step's matmul) on an
8B-layer-like shape, and the packing throughput of ``pack_gguf``.

    PYTHONPATH=. python scripts/qmm_gguf_bench.py [--shapes 14336x4096,4096x14336] [--threads 1,2]
                                                   [--rows 1] [--seconds 1.0]

Prints, per shape, format and thread count, ms per call (the median of batches of about
20 ms, taken in rounds over all formats, and the best batch) and the weight bytes read per call over the median (GB/s, 1e9 bytes); then
``pack_gguf``'s throughput (file bytes per second) per thread count. The load average is
printed before and after: on a shared host the medians (2 threads above all: an OpenMP
barrier waits for a descheduled thread) measure the neighbours too. Weights are random valid
blocks (random code bytes, small fp16 scales); timing does not depend on their values.
``pack_gguf`` advises 2 MiB pages for its output (on Linux); the int4 / int8 references are
copied into memory advised the same way (``--small-pages``: left in 4 KiB pages), so every
format streams its weights through the same page size.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np
import torch

from pagedkv.ops import qmm


def _raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    _, per, bs = qmm.GGUF_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, bs), dtype=np.uint8)
    d = (rng.standard_normal((n, k // per, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == "MXFP4":  # e8m0 scales 2^(e - 128) about 2^-8
        raw[..., 0] = rng.integers(118, 124, size=(n, k // per), dtype=np.uint8)
    elif qtype == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        if qtype not in ("Q4_0", "Q8_0"):
            raw[..., 2:4] = d
    return raw.reshape(n, -1)


def _huge(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into fresh memory advised MADV_HUGEPAGE before its first touch (Linux)."""
    out = torch.empty(t.numel(), dtype=t.dtype)
    lo, hi = (out.data_ptr() + 4095) & ~4095, (out.data_ptr() + out.numel() * out.element_size()) & ~4095
    if hi > lo and hasattr(os, "MADV_HUGEPAGE"):
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), os.MADV_HUGEPAGE)
    return out.copy_(t.reshape(-1))


def _time(fn, seconds: float, best: bool = False) -> float | tuple[float, float]:
    """Median seconds per call over batches filling ``seconds`` (``(median, best)`` if ``best``)."""
    fn()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.05:
        fn()
        calls += 1
    per_batch = max(1, calls)
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 3:
        t = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t) / per_batch)
    return (statistics.median(samples), min(samples)) if best else statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="14336x4096,4096x14336", help="N x K pairs (out x in features)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1.0, help="timing per line")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--small-pages", action="store_true", help="leave the int4 / int8 references in 4 KiB pages")
    args = ap.parse_args()
    ops = qmm.get()
    assert ops is not None, qmm.build_error()
    rng = np.random.default_rng(0)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"qmm build: {ops.isa}; torch {torch.__version__}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        x = torch.randn(args.rows, k)
        packed: list[tuple[str, qmm.Packed, list[float]]] = []
        # the existing formats from random codes (int4: Q4_1-like blocks; int8: per-channel)
        codes4 = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = torch.full((n, k // 32), 1e-3)
        w4 = qmm.pack_int4(codes4, d, -8 * d)
        w8 = qmm.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.full((n,), 1e-3))
        del codes4
        if not args.small_pages:
            w4, w8 = qmm.Packed(4, n, k, _huge(w4.codes)), qmm.Packed(8, n, k, _huge(w8.codes), scale=w8.scale)
        packed += [("int4 (fmt 4)", w4, []), ("int8 (fmt 8)", w8, [])]
        for qtype in args.types.split(","):
            raw = _raw(qtype, n, k, rng)
            pack = []
            for nt in threads:
                torch.set_num_threads(nt)
                pack.append(raw.nbytes / _time(lambda: qmm.pack_gguf(qtype, raw, k), min(args.seconds, 0.5)) / 1e9)
            packed.append((f"{qtype} (fmt {4 if qtype in ('Q4_0', 'Q4_1') else 100 + qmm.GGUF_BLOCKS[qtype][0]})",
                           qmm.pack_gguf(qtype, raw, k), pack))
            del raw
        print(f"\nN={n} K={k} rows={args.rows}")
        print(f"{'format':<14} {'MB':>6} " + " ".join(f"{f'{nt}T ms':>8} {'(best)':>8} {'GB/s':>6}" for nt in threads)
              + "   pack GB/s " + "/".join(f"{nt}T" for nt in threads))
        # rounds over all formats, one batch of calls each per round: a neighbour's burst of load
        # falls on every format alike
        times: dict[tuple[int, int], list[float]] = {}
        for nt in threads:
            torch.set_num_threads(nt)
            calls = []
            for w in (w for _, w, _ in packed):
                ops.linear(x, w)
                t0 = time.perf_counter()
                ops.linear(x, w)
                calls.append(max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
            end = time.perf_counter() + args.seconds * len(packed)
            while time.perf_counter() < end or len(times.get((nt, 0), [])) < 5:
                for i, (_, w, _) in enumerate(packed):
                    t0 = time.perf_counter()
                    for _ in range(calls[i]):
                        ops.linear(x, w)
                    times.setdefault((nt, i), []).append((time.perf_counter() - t0) / calls[i])
        for i, (name, w, pack) in enumerate(packed):
            cols = []
            for nt in threads:
                med, best = statistics.median(times[nt, i]), min(times[nt, i])
                cols.append(f"{med * 1e3:8.3f} {f'({best * 1e3:.3f})':>8} {w.nbytes / med / 1e9:6.2f}")
            pk = "/".join(f"{v:.2f}" for v in pack)
            print(f"{name:<14} {w.nbytes / 1e6:6.1f} " + " ".join(cols) + (f"   {pk}" if pk else ""), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
