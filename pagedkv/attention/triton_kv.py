"""Triton set-up and the K/V memory kernels of the Triton backend (``triton_backend``).

Importing this module sets ``TRITON_INTERPRET=1`` when there is no CUDA (unless already set),
then imports triton, so the kernels run on CPU tensors under Triton's interpreter.

* ``_write_kv_kernel``: scatters new K/V rows ``[T, Hkv, d]`` to ``slot_mapping`` (``-1``
  skipped), no host sync.
* ``_write_kv_quant_kernel``: the same for a quantised cache (:mod:`pagedkv.attention.quant`):
  one tile row per (token, head, group) computes its bf16 scale and one-byte codes.
* ``_load_kv``: one K or V tile of the attention kernels: plain values, or codes times their
  group's scale (dequantised in registers, never outside the kernel).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - reported when the backend is constructed
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _IMPORT_ERROR = exc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _interpreter_state_error() -> str | None:
    """Triton's own ``@jit`` helpers (``tl.sum``, ``tl.max``) are created when triton is first
    imported; if that happened before ``TRITON_INTERPRET=1`` was set they cannot run inside
    interpreted kernels."""
    if triton is None or not _interpreting():
        return None
    if type(tl.sum).__name__ == "JITFunction":
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
                "run here: set TRITON_INTERPRET=1 in the environment, or import "
                "pagedkv.attention.triton_backend before triton")
    return None


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
        s_kt, s_kh, s_vt, s_vh,  # new K/V strides (token, head); d contiguous
        s_blk, s_tok, s_head,  # cache strides
        block_size, num_kv_heads, head_dim,
        BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr, D_PAD: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < num_tokens
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
        tmask = tmask & (slot >= 0)
        blk = slot // block_size
        off = slot % block_size
        idx = tl.arange(0, BLOCK_HD)
        h = idx // D_PAD
        x = idx % D_PAD
        mask = tmask[:, None] & ((h < num_kv_heads) & (x < head_dim))[None, :]
        t64 = t.to(tl.int64)[:, None]
        k = tl.load(key_ptr + t64 * s_kt + (h * s_kh + x)[None, :], mask=mask)
        v = tl.load(value_ptr + t64 * s_vt + (h * s_vh + x)[None, :], mask=mask)
        dst = (blk * s_blk + off * s_tok)[:, None] + (h * s_head + x)[None, :]
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _round_fp8(y, M: tl.constexpr, EMIN: tl.constexpr):
        """``y`` rounded (half away from zero) to the grid of an fp8 format with ``M`` mantissa
        bits and smallest normal exponent ``EMIN``, as float32: the cast to fp8 is then exact.
        (Triton 3.9's interpreter drops the carry when float32 -> fp8 rounds up into the next
        binade, e.g. 124.2 -> 64 instead of 128.)"""
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        ulp = ((e - M + 127) << 23).to(tl.float32, bitcast=True)
        a = tl.floor(tl.abs(y) / ulp + 0.5) * ulp
        return tl.where(y < 0, -a, a)

    @triton.jit
    def _quant_store(src_ptr, s_t, s_h, cache_ptr, scale_ptr, src, dst, sdst, mask, rmask, qmax,
                     KDT: tl.constexpr):
        """Quantise tile rows (one group each) of ``src_ptr`` and store codes and bf16 scales."""
        x = tl.load(src_ptr + src, mask=mask, other=0.0).to(tl.float32)
        has_nan = tl.sum((x != x).to(tl.int32), axis=1) > 0  # keep NaN poison (GPU max drops NaN)
        amax = tl.max(tl.abs(x), axis=1)
        v = amax / qmax
        scale = v.to(tl.bfloat16)  # rounded up to bf16 (as quant.round_up_bf16): nothing clamps
        bumped = (scale.to(tl.int16, bitcast=True) + 1).to(tl.bfloat16, bitcast=True)
        scale = tl.where(scale.to(tl.float32) < v, bumped, scale)
        # a nonzero group's scale is at least 2^-126 (quant.MIN_SCALE), also under flush-to-zero
        s = tl.where(amax == 0, 0.0, tl.maximum(scale.to(tl.float32), 1.1754943508222875e-38))
        y = x / tl.where(s > 0, s, 1.0)[:, None]
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if KDT == 2:
            code = tl.floor(y + 0.5).to(tl.int8)
        elif KDT == 3:
            code = _round_fp8(y, 3, -6).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = _round_fp8(y, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)
        tl.store(cache_ptr + dst, code, mask=mask)
        tl.store(scale_ptr + sdst, tl.where(has_nan, float("nan"), s).to(tl.bfloat16), mask=rmask)

    @triton.jit
    def _write_kv_quant_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slot_ptr, num_tokens,
        s_kt, s_kh, s_vt, s_vh, s_blk, s_tok, s_head, ss_blk, ss_tok, ss_head,
        block_size, num_kv_heads, num_groups, qmax,
        GRP: tl.constexpr, KDT: tl.constexpr, BLOCK_T: tl.constexpr, HG_PAD: tl.constexpr, G_PAD: tl.constexpr,
    ):
        # tile row r: token t = r // HG_PAD, (head, group) = divmod(r % HG_PAD, num_groups)
        r = tl.arange(0, BLOCK_T * HG_PAD)
        t = tl.program_id(0) * BLOCK_T + r // HG_PAD
        h = (r % HG_PAD) // num_groups
        grp = (r % HG_PAD) % num_groups
        rmask = (t < num_tokens) & (h < num_kv_heads)
        slot = tl.load(slot_ptr + t, mask=rmask, other=-1).to(tl.int64)
        rmask = rmask & (slot >= 0)
        c = tl.arange(0, G_PAD)
        mask = rmask[:, None] & (c < GRP)[None, :]
        t64 = t.to(tl.int64)
        x0 = grp * GRP
        blk = slot // block_size
        off = slot % block_size
        dst = (blk * s_blk + off * s_tok + h * s_head + x0)[:, None] + c[None, :]
        sdst = blk * ss_blk + off * ss_tok + h * ss_head + grp
        _quant_store(key_ptr, s_kt, s_kh, k_cache_ptr, ks_ptr, (t64 * s_kt + h * s_kh + x0)[:, None] + c[None, :],
                     dst, sdst, mask, rmask, qmax, KDT)
        _quant_store(value_ptr, s_vt, s_vh, v_cache_ptr, vs_ptr, (t64 * s_vt + h * s_vh + x0)[:, None] + c[None, :],
                     dst, sdst, mask, rmask, qmax, KDT)

    @triton.jit
    def _load_kv(ptr, sc_ptr, offs, srow, x, mask, GRP: tl.constexpr, KDT: tl.constexpr, DOT_F32: tl.constexpr):
        """A K or V tile: plain values, or (KDT >= 2) codes x their group's bf16 scale."""
        if KDT == 0:
            return tl.load(ptr + offs, mask=mask, other=0.0)
        codes = tl.load(ptr + offs, mask=mask, other=0)
        if KDT == 2:
            vals = codes.to(tl.float32)
        elif KDT == 3:
            vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            vals = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        sc = tl.load(sc_ptr + srow[:, None] + (x // GRP)[None, :], mask=mask, other=0.0).to(tl.float32)
        vals = vals * sc
        if DOT_F32:
            return vals
        return vals.to(tl.bfloat16)
