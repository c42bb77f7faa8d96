"""Backend conformance kit: run any ``AttentionBackend`` through the paging protocol's hard
cases and compare with a dense float64 oracle.

Every case builds its cache **only through the protocol** (``allocate_kv_cache``,
``write_kv``, ``forward``, ``gather_kv``, ``copy_blocks``), so it works for any layout:

1. every slot of every physical block is first written with NaN (so a read of anything outside
   a sequence's context — an unused block, the tail of a partial last block, a padding entry
   of a block table — poisons the output and is caught);
2. physical blocks are handed out in a shuffled order; block tables get extra padding entries
   that point at NaN blocks;
3. the cached context is written (in shuffled token order), then the step's new tokens with the
   step's ``slot_mapping`` — plus rows with slot ``-1`` carrying NaN, which must be skipped;
   (a backend that offers the optional ``write_and_forward(q, k, v, cache, md, scale, ...)``,
   write and attend in one call, gets the step's rows through it instead; the ``-1`` rows still
   go through ``write_kv``);
4. ``forward`` runs and its output must be finite and match the oracle within the dtype's
   tolerance; ``gather_kv`` must return what was written; ``copy_blocks`` must copy.

Quantised cases (``Case.kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2, from
:func:`quantized_cases`) read the stored codes and scales back with ``gather_kv_raw`` and the
oracle dequantises them itself (float64 ``code * scale``). Their tolerances are derived from
the format, not tuned: (a) each stored value is within the format's error bound of the value
written (:func:`pagedkv.attention.quant.error_bound`: int8 ``scale/2``, fp8 half an ulp);
(b) the output matches attention over the explicitly dequantised K/V within the query
dtype's tolerance (the dequantised values are exact in float32); (c) the output is within
the propagated bound of attention over the unquantised K/V: with per-key score errors at most
``delta = scale * sum_i |q_i| e_k[i]``, ``|out' - out| <= max e_v + (exp(2 delta) - 1) max |v|``.

Public API::

    from pagedkv.testing import check_backend, conformance_cases, run_case
    report = check_backend("cpu")            # or a backend instance
    assert report.ok, report.summary()

For pytest: ``pagedkv.testing.pytest_params(backends)`` gives ``(backend_name, case, dtype)``
parameters with readable ids (see ``tests/testing/test_conformance.py``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from pagedkv.attention.base import AttentionBackend, AttentionMetadata
from pagedkv.kv.block_table import blocks_needed, slot_mapping
from pagedkv.testing.cases import Case, conformance_cases, quantized_cases, window_cases  # noqa: F401 - re-exported

# max |out - expected| allowed: atol + rtol * |expected|. float32: a correct backend lands near
# 3e-7 on the kit's cases here, but the BLAS picks its own kernels and summation order per CPU
# (CI saw 3.1e-5 on the soft-capped torch path); every indexing or masking bug seen so far
# errs by 1e-2 or more, so 1e-4 keeps the kit sharp without failing on another CPU.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


@dataclass
class CaseResult:
    backend: str
    case: str
    dtype: str
    ok: bool
    max_abs_err: float = float("nan")
    message: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        return f"{status} {self.backend} {self.case} {self.dtype} err={self.max_abs_err:.2e} {self.message}".rstrip()


@dataclass
class Report:
    backend: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        n_ok = sum(r.ok for r in self.results)
        secs = sum(r.seconds for r in self.results)
        head = f"{'PASS' if self.ok else 'FAIL'} {self.backend}: {n_ok}/{len(self.results)} cases ({secs:.1f}s)"
        if self.ok:
            return head
        return head + "\n" + "\n".join("  " + r.line() for r in self.failures)


class ConformanceError(AssertionError):
    """A backend broke the protocol (message says how)."""


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, cap: float | None = None) -> torch.Tensor:
    """float64 causal attention of ``q`` [ql, hq, d] over ``k``/``v`` [sl, hkv, d]; the new
    tokens sit at the last ``ql`` positions. ``window``: the query at ``p`` sees ``p - window <
    k <= p``; ``cap``: scores ``cap * tanh(s / cap)`` before the mask (transformers' Gemma-2)."""
    ql, hq, d = q.shape
    sl, hkv, _ = k.shape
    g = hq // hkv
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(sl - ql, sl)[:, None]
    kpos = torch.arange(sl)[None, :]
    hidden = kpos > qpos
    if window:
        hidden = hidden | (kpos <= qpos - window)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def run_case(backend: AttentionBackend, case: Case, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", seed: int = 0) -> CaseResult:
    """Run ``case`` through ``backend`` and check it. Never raises for a backend failure: the
    result says what went wrong (``ok=False``)."""
    t0 = time.perf_counter()
    res = CaseResult(getattr(backend, "name", type(backend).__name__), case.name, str(dtype).replace("torch.", ""), False)
    try:
        res.max_abs_err = _run(backend, case, dtype, torch.device(device), seed)
        res.ok = True
    except ConformanceError as exc:
        res.message = str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash is a failure, reported not raised
        res.message = f"{type(exc).__name__}: {exc}"
    res.seconds = time.perf_counter() - t0
    return res


def _layout_blocks(case: Case, rng: random.Random) -> tuple[list[list[int]], int]:
    """Shuffled physical block ids per sequence (shared prefix blocks first), padded tables."""
    bs = case.block_size
    need = [blocks_needed(sl, bs) for sl in case.seq_lens]
    p = case.shared_prefix_blocks
    if any(sl < p * bs for sl in case.seq_lens):
        raise ValueError(f"case {case.name}: a sequence is shorter than the shared prefix")
    total = p + sum(n - p for n in need) + case.spare_blocks
    ids = list(range(total))
    rng.shuffle(ids)
    shared, rest = ids[:p], ids[p:]
    tables = []
    for n in need:
        own, rest = rest[: n - p], rest[n - p :]
        tables.append(shared + own)
    spare = rest  # never written with real data: NaN
    for t in tables:
        for _ in range(case.table_padding):
            t.append(rng.choice(spare) if spare else t[0])
    return tables, total


def _run(backend: AttentionBackend, case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> float:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, hq, hkv, d = case.block_size, case.num_heads, case.num_kv_heads, case.head_dim
    tables, num_blocks = _layout_blocks(case, rng)
    los = [case.window_start(i) for i in range(len(case.seq_lens))]
    if any(los):  # blocks wholly before the window: the null block (never written: NaN)
        if case.shared_prefix_blocks:
            raise ValueError(f"case {case.name}: windows with a shared prefix are not generated")
        null = num_blocks  # one more physical block, left NaN
        num_blocks += 1
        for t, lo in zip(tables, los):
            t[: lo // bs] = [null] * (lo // bs)
    if case.kv_cache_dtype is None:
        cache = backend.allocate_kv_cache(num_blocks, bs, hkv, d, dtype, device)
    else:
        cache = backend.allocate_kv_cache(num_blocks, bs, hkv, d, case.kv_cache_dtype, device,
                                          quant_group_size=case.quant_group_size)

    def write(k: torch.Tensor, v: torch.Tensor, slots: Sequence[int] | torch.Tensor) -> None:
        slots_t = torch.as_tensor(slots, dtype=torch.int64).to(device)
        backend.write_kv(cache, k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype), slots_t)

    # 1. poison every slot
    n_slots = num_blocks * bs
    nan = torch.full((n_slots, hkv, d), float("nan"))
    write(nan, nan, list(range(n_slots)))

    # 2. per-sequence dense K/V (shared prefix tokens identical across sequences)
    p_tokens = case.shared_prefix_blocks * bs
    prefix_k = torch.randn(p_tokens, hkv, d, generator=gen)
    prefix_v = torch.randn(p_tokens, hkv, d, generator=gen)
    dense_k, dense_v = [], []
    for sl in case.seq_lens:
        own = sl - p_tokens
        dense_k.append(torch.cat([prefix_k, torch.randn(own, hkv, d, generator=gen)])[:sl])
        dense_v.append(torch.cat([prefix_v, torch.randn(own, hkv, d, generator=gen)])[:sl])
    # the cache stores dtype values: the oracle must see the same rounding
    dense_k = [x.to(dtype).double() for x in dense_k]
    dense_v = [x.to(dtype).double() for x in dense_v]

    # 3a. cached context (positions < seq_len - q_len), shuffled order; the shared prefix is
    # written once (by sequence 0), as the prefix cache would have
    for i, (sl, ql) in enumerate(zip(case.seq_lens, case.query_lens)):
        if sl - ql < p_tokens:
            raise ValueError(f"case {case.name}: a new token of sequence {i} falls inside the shared prefix")
    rows = []
    for i, (sl, ql) in enumerate(zip(case.seq_lens, case.query_lens)):
        start = max(p_tokens if i > 0 else 0, los[i])  # before the window: never written
        rows += [(i, pos) for pos in range(start, sl - ql)]
    rng.shuffle(rows)
    if rows:
        write(torch.stack([dense_k[i][pos] for i, pos in rows]).to(dtype),
              torch.stack([dense_v[i][pos] for i, pos in rows]).to(dtype),
              [int(slot_mapping(tables[i], bs, pos, pos + 1)[0]) for i, pos in rows])

    # 3b. the step: metadata built from (padded) tables; new tokens written via slot_mapping,
    # with NaN rows at slot -1 interleaved (must be skipped)
    md = AttentionMetadata.build(list(case.seq_lens), list(case.query_lens), tables, bs, device=device)
    new_k = torch.cat([dense_k[i][sl - ql : sl] for i, (sl, ql) in enumerate(zip(case.seq_lens, case.query_lens))])
    new_v = torch.cat([dense_v[i][sl - ql : sl] for i, (sl, ql) in enumerate(zip(case.seq_lens, case.query_lens))])
    n_new = new_k.shape[0]
    pad_at = sorted(rng.sample(range(n_new + 1), k=min(2, n_new + 1)))
    # A backend with the optional ``write_and_forward`` (write + attend in one call) gets the
    # step's rows through it; the NaN rows at slot -1 still go through write_kv (skipped).
    fused = getattr(backend, "write_and_forward", None)
    slots = md.slot_mapping.cpu().tolist()
    wk, wv, ws = ([], [], []) if fused is not None else (list(new_k), list(new_v), list(slots))
    for j, at in enumerate(pad_at):
        at = 0 if fused is not None else at + j
        wk.insert(at, torch.full((hkv, d), float("nan"), dtype=torch.float64))
        wv.insert(at, torch.full((hkv, d), float("nan"), dtype=torch.float64))
        ws.insert(at, -1)
    write(torch.stack(wk).to(dtype), torch.stack(wv).to(dtype), ws)

    # 4. forward
    q = torch.randn(md.num_tokens, hq, d, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    opts = {k: v for k, v in (("sliding_window", case.sliding_window), ("logits_soft_cap", case.logits_soft_cap))
            if v is not None}  # only what the case uses: backends written before these options still run
    if fused is not None:
        out = fused(q.to(device), new_k.to(device=device, dtype=dtype), new_v.to(device=device, dtype=dtype),
                    cache, md, scale, **opts)
    else:
        out = backend.forward(q.to(device), cache, md, scale, **opts)
    if tuple(out.shape) != (md.num_tokens, hq, d):
        raise ConformanceError(f"output shape {tuple(out.shape)} != {(md.num_tokens, hq, d)}")
    if out.dtype != dtype:
        raise ConformanceError(f"output dtype {out.dtype} != query dtype {dtype}")
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).any(-1).any(-1).nonzero().flatten().tolist()
        raise ConformanceError(f"non-finite output rows {bad[:8]}: a padding/unused slot was read")
    atol, rtol = TOLERANCES.get(dtype, (1e-2, 1e-2))
    qsl = md.query_start_loc.cpu().tolist()
    qs = [q[qsl[i] : qsl[i + 1]].double() for i in range(len(case.seq_lens))]
    if case.kv_cache_dtype is None:
        exp = torch.cat([_dense_attention(qs[i], dense_k[i], dense_v[i], scale, case.sliding_window, case.logits_soft_cap)
                         for i in range(len(qs))])
        max_err = _check_close(out, exp, atol + rtol * exp.abs(), qsl, f" (atol {atol}, rtol {rtol})")
    else:
        max_err = _check_quantized(backend, cache, case, tables, qs, dense_k, dense_v, out, scale, atol, rtol, qsl,
                                   device, los)

    # 5. gather_kv returns what was written (new tokens), NaN rows were not written
    gk, gv = backend.gather_kv(cache, md.slot_mapping)
    if case.kv_cache_dtype is not None:
        rk, rv, rks, rvs = backend.gather_kv_raw(cache, md.slot_mapping)
        same = torch.equal(gk.cpu().double(), _dequantize(rk, rks, cache)) and torch.equal(gv.cpu().double(), _dequantize(rv, rvs, cache))
        if not same:
            raise ConformanceError("gather_kv(slot_mapping) differs from the stored codes x scales")
        gk, gv = _dequantize(rk, rks, cache), _dequantize(rv, rvs, cache)
        _check_stored(cache, new_k, rk, rks, "new K")
        _check_stored(cache, new_v, rv, rvs, "new V")
    elif not (torch.equal(gk.cpu().to(dtype), new_k.to(dtype)) and torch.equal(gv.cpu().to(dtype), new_v.to(dtype))):
        raise ConformanceError("gather_kv(slot_mapping) differs from what write_kv wrote")

    # 6. copy_blocks: copy sequence 0's first block onto an unused block, read it back
    used = {b for t, sl in zip(tables, case.seq_lens) for b in t[: blocks_needed(sl, bs)]}
    spare = sorted(set(range(num_blocks)) - used)
    if spare:
        first = los[0] // bs  # sequence 0's first real block
        src, dst = tables[0][first], spare[0]
        backend.copy_blocks(cache, [(src, dst)])
        n_written = min(bs, case.seq_lens[0] - first * bs)
        read = backend.gather_kv if case.kv_cache_dtype is None else backend.gather_kv_raw  # codes and scales
        a = read(cache, torch.arange(src * bs, src * bs + n_written, device=device))
        b = read(cache, torch.arange(dst * bs, dst * bs + n_written, device=device))
        if not all(_same_bits(x, y) for x, y in zip(a, b)):
            raise ConformanceError("copy_blocks did not copy the block")
    return max_err


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (a copied NaN equals itself)."""
    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def _check_close(out: torch.Tensor, exp: torch.Tensor, tol: torch.Tensor, qsl: list[int], what: str) -> float:
    """Raise ``ConformanceError`` unless ``|out - exp| <= tol`` everywhere; returns max |err|."""
    err = (out - exp).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    if not bool((err <= tol).all()):
        row = int((err - tol).amax(dim=(1, 2)).argmax())
        seq = max(i for i in range(len(qsl) - 1) if qsl[i] <= row)
        raise ConformanceError(f"max |err| {max_err:.3e} > tol{what} at token {row} (sequence {seq})")
    return max_err


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, cache: Any) -> torch.Tensor:
    """The oracle's own dequantisation: float64 ``code * scale`` of stored codes ``[n, H, d]``
    (fp8 codes are uint8 bits of the format's float8 dtype) and scales ``[n, H, d / G]``."""
    fmt = cache.quant
    vals = (codes.cpu().view(fmt.code_dtype) if fmt.code_dtype is not None else codes.cpu()).double()
    return vals * scales.cpu().double().repeat_interleave(codes.shape[-1] // scales.shape[-1], dim=-1)


def _check_stored(cache: Any, written: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    """Each stored value is within the format's error bound of the value written."""
    from pagedkv.attention.quant import error_bound

    bound = error_bound(written, scales.cpu(), cache.quant)
    if not bool(((_dequantize(codes, scales, cache) - written.double()).abs() <= bound).all()):
        raise ConformanceError(f"{what}: a stored value is outside the {cache.quant.name} error bound of what was written")


def _check_quantized(backend: Any, cache: Any, case: Case, tables: list[list[int]], qs: list[torch.Tensor],
                     dense_k: list[torch.Tensor], dense_v: list[torch.Tensor], out: torch.Tensor, scale: float,
                     atol: float, rtol: float, qsl: list[int], device: torch.device, los: list[int]) -> float:
    """Checks (a)-(c) of the module doc for a quantised case; returns max |out - oracle|.
    Positions before ``los[i]`` (outside every window of sequence i) were never stored: the
    oracle masks them, so they keep their unquantised values and a zero error bound."""
    from pagedkv.attention.quant import error_bound

    exact, exp_full, bounds = [], [], []
    w, cap = case.sliding_window, case.logits_soft_cap
    for i, sl in enumerate(case.seq_lens):
        lo = los[i]
        slots = torch.tensor([int(slot_mapping(tables[i], case.block_size, p, p + 1)[0]) for p in range(lo, sl)],
                             dtype=torch.int64, device=device)
        k, v, ks, vs = backend.gather_kv_raw(cache, slots)
        _check_stored(cache, dense_k[i][lo:], k, ks, f"sequence {i} K")
        _check_stored(cache, dense_v[i][lo:], v, vs, f"sequence {i} V")
        kq, vq = dense_k[i].clone(), dense_v[i].clone()
        kq[lo:], vq[lo:] = _dequantize(k, ks, cache), _dequantize(v, vs, cache)
        exact.append(_dense_attention(qs[i], kq, vq, scale, w, cap))
        exp_full.append(_dense_attention(qs[i], dense_k[i], dense_v[i], scale, w, cap))
        g = case.num_heads // case.num_kv_heads
        pad = torch.zeros(lo, case.num_kv_heads, case.head_dim, dtype=torch.float64)
        e_k = torch.cat([pad, error_bound(dense_k[i][lo:], ks.cpu(), cache.quant)]).repeat_interleave(g, dim=1)
        e_v = error_bound(dense_v[i][lo:], vs.cpu(), cache.quant).repeat_interleave(g, dim=1)
        delta = scale * torch.einsum("qhd,khd->qhk", qs[i].abs(), e_k).amax(dim=-1, keepdim=True)  # [ql, hq, 1]
        v_max = dense_v[i].abs().repeat_interleave(g, dim=1).amax(dim=0)  # [hq, d]
        bounds.append(e_v.amax(dim=0) + torch.expm1(2 * delta) * v_max)
    exact_t, full_t = torch.cat(exact), torch.cat(exp_full)
    err = _check_close(out, exact_t, atol + rtol * exact_t.abs(), qsl, f" (atol {atol}, rtol {rtol}) vs the dequantised oracle")
    _check_close(out, full_t, torch.cat(bounds) + atol + rtol * full_t.abs(), qsl,
                 f" (the {cache.quant.name} error bound) vs the unquantised oracle")
    return err


def _resolve(backend: AttentionBackend | str) -> AttentionBackend:
    if isinstance(backend, str):
        from pagedkv.attention.registry import get_backend

        return get_backend(backend)
    return backend


def check_backend(backend: AttentionBackend | str, device: torch.device | str = "cpu",
                  dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16),
                  cases: Sequence[Case] | None = None, small: bool = False, seed: int = 0) -> Report:
    """Run every case in every dtype; returns a ``Report`` (``.ok``, ``.summary()``).
    ``backend`` is an instance or a registered name (``ConfigError`` if unknown)."""
    be = _resolve(backend)
    report = Report(getattr(be, "name", str(backend)))
    for case in cases if cases is not None else conformance_cases(small=small):
        for dt in dtypes:
            report.results.append(run_case(be, case, dt, device, seed))
    return report


def default_dtypes(backend_name: str) -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16)


def is_small_backend(backend_name: str, device: str = "cpu") -> bool:
    """Backends that run under an interpreter on this device get the small cases."""
    return backend_name.startswith("triton") and str(device).startswith("cpu")


def pytest_params(backends: Sequence[str] | None = None, device: str = "cpu") -> list[Any]:
    """``pytest.param((backend_name, case, dtype), id=...)`` for every registered backend (or
    ``backends``), case and dtype: use with ``@pytest.mark.parametrize("backend_case", ...)``
    and ``run_case``. Triton on CPU gets the small cases (interpreter)."""
    import pytest

    from pagedkv.attention.registry import list_backends

    params = []
    for name in backends if backends is not None else list_backends():
        small = is_small_backend(name, device)
        for case in conformance_cases(small=small):
            for dt in default_dtypes(name):
                params.append(pytest.param((name, case, dt), id=f"{name}-{case.name}-{str(dt).replace('torch.', '')}"))
    return params
