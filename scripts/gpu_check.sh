#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine (CUDA torch + Triton already installed; nothing is
# downloaded or installed). One command, under 5 minutes, one results file:
#
#   scripts/gpu_check.sh [RESULTS_JSON]      (default: $OUT/gpu_check.json if $OUT is set,
#                                             else ./gpu_check.json)
#
# 1. conformance kit on CUDA: triton (float32/bfloat16/float16, full-size cases) and the torch
#    backends (reference, cpu torch path) on the GPU;
# 2. decode kernel bandwidth: batch 64 x context 4096, Llama-3-8B-like heads (32 q / 8 kv,
#    head_dim 128, bf16, block_size 16): a small sweep of tile sizes, best achieved KV GB/s vs
#    the GPU's peak HBM bandwidth (goal on an H200: >= 70%) and vs a measured device copy;
# 3. engine greedy output on the bundled model: LLM(attention_backend="triton", device="cuda",
#    dtype="float32") vs LLM(attention_backend="reference", device="cpu", dtype="float32"),
#    32 tokens per prompt, token ids must be identical.
# Each part has its own time limit; a part that fails or times out is recorded, not fatal.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
RESULTS="${1:-${OUT:-.}/gpu_check.json}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY="$ROOT/.venv/bin/python"
  else
    PY="$(command -v python3 || command -v python)"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "gpu_check: python $PY, results -> $RESULTS"

run_part() {  # name, seconds, python file
  local name="$1" secs="$2" file="$3" t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$secs" "$PY" "$file" "$TMP/$name.json" >"$TMP/$name.log" 2>&1
  rc=$?
  echo "gpu_check: part $name rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 25 "$TMP/$name.log" | sed "s/^/  [$name] /"
  if [ ! -s "$TMP/$name.json" ]; then
    "$PY" - "$TMP/$name.json" "$rc" "$TMP/$name.log" <<'EOF'
import json, sys
path, rc, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tail = open(log, errors="replace").read()[-4000:]
json.dump({"ok": False, "rc": rc, "timed_out": rc in (124, 137), "log_tail": tail}, open(path, "w"), indent=2)
EOF
  fi
}

# ---------------------------------------------------------------- part 0: environment
cat >"$TMP/env.py" <<'EOF'
import json, subprocess, sys, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as e:  # noqa: BLE001
    info["triton"] = f"unavailable: {e}"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, sm_count=p.multi_processor_count, total_memory=p.total_memory,
                capability=f"{p.major}.{p.minor}")
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                                         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:  # noqa: BLE001
    info["nvidia_smi"] = f"unavailable: {e}"
info["ok"] = bool(info["cuda_available"])
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(info)
EOF
run_part env 30 "$TMP/env.py"

# ---------------------------------------------------------------- part 1: conformance on CUDA
cat >"$TMP/conformance.py" <<'EOF'
import json, sys, time, torch
from pagedkv.attention import get_backend
from pagedkv.testing import conformance_cases, run_case
T_END = time.time() + 80            # stop starting new cases after this (each compiles kernels)
out = {"device": "cuda", "backends": {}}
plan = [("triton", (torch.float32, torch.bfloat16)),
        ("reference", (torch.float32, torch.bfloat16)),
        ("cpu", (torch.float32, torch.bfloat16)),   # the cpu backend's torch path on CUDA tensors
        ("triton", (torch.float16,))]
for name, dtypes in plan:
    be = get_backend(name)
    res = out["backends"].setdefault(name, {"passed": 0, "total": 0, "failures": [], "skipped_for_time": 0})
    t0 = time.perf_counter()
    for case in conformance_cases():
        for dt in dtypes:
            if time.time() > T_END:
                res["skipped_for_time"] += 1
                continue
            r = run_case(be, case, dt, device="cuda")
            res["total"] += 1
            res["passed"] += r.ok
            if not r.ok:
                res["failures"].append(r.line())
            json.dump(out, open(sys.argv[1], "w"), indent=2)   # partial results survive a timeout
    res["seconds"] = round(res.get("seconds", 0) + time.perf_counter() - t0, 1)
    res["ok"] = res["passed"] == res["total"] and res["total"] > 0
    print("PASS" if res["ok"] else "FAIL", name, [str(d) for d in dtypes], res["passed"], "/", res["total"],
          "skipped for time:", res["skipped_for_time"], res["failures"][:5], flush=True)
out["ok"] = all(r["ok"] for r in out["backends"].values())
json.dump(out, open(sys.argv[1], "w"), indent=2)
EOF
run_part conformance 95 "$TMP/conformance.py"

# ---------------------------------------------------------------- part 2: decode bandwidth
cat >"$TMP/bandwidth.py" <<'EOF'
import json, statistics, sys, time, torch
from pagedkv.attention import AttentionMetadata
from pagedkv.attention.triton_backend import TritonBackend

B, L, HQ, HKV, D, BS = 64, 4096, 32, 8, 128, 16
dt = torch.bfloat16
dev = "cuda"
props = torch.cuda.get_device_properties(0)
name = props.name
# published peak HBM bandwidth (bytes/s) by product name; first match wins
PEAKS = [("H200", 4.8e12), ("GH200", 4.0e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
         ("H800", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
         ("A100", 1.555e12), ("L40S", 0.864e12), ("L40", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12),
         ("V100", 0.9e12), ("T4", 0.32e12)]
peak, peak_src = None, None
for key, val in PEAKS:
    if key.lower() in name.lower():
        peak, peak_src = val, f"published spec for {key}"
        break
clk, bus = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
if peak is None and clk and bus:
    peak, peak_src = 2 * clk * 1e3 * bus / 8, "2 x memory_clock_rate x bus_width (device properties)"

def cuda_time(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)

# measured device copy bandwidth (read + write bytes)
x = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
copy_s = cuda_time(lambda: y.copy_(x))
copy_bw = 2 * x.numel() / copy_s
del x, y

nblk = L // BS
num_blocks = B * nblk + 8
g = torch.Generator(device="cpu").manual_seed(0)
tables = torch.randperm(num_blocks, generator=g)[: B * nblk].view(B, nblk)
md = AttentionMetadata.build([L] * B, [1] * B, tables.tolist(), BS, device=dev)
q = torch.randn(B, HQ, D, device=dev, dtype=dt)
kv_bytes = 2 * B * L * HKV * D * 2
results, best = [], None
base = TritonBackend()
cache = base.allocate_kv_cache(num_blocks, BS, HKV, D, dt, dev)
cache.key.normal_(); cache.value.normal_()
# correctness spot check against SDPA on the gathered contiguous K/V (2 sequences)
ref_out = None
try:
    kk = cache.key[tables[:2].to(dev)].reshape(2, L, HKV, D).transpose(1, 2)
    vv = cache.value[tables[:2].to(dev)].reshape(2, L, HKV, D).transpose(1, 2)
    ref_out = torch.nn.functional.scaled_dot_product_attention(q[:2, :, None].float(), kk.float(), vv.float(),
                                                               scale=D ** -0.5, enable_gqa=True)[:, :, 0]
except Exception as e:  # noqa: BLE001
    print("reference check skipped:", e)
t_end = time.time() + 45
for split_len in (4096, 1024, 512):
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            if time.time() > t_end:
                break
            if split_len % block_n:
                continue
            cfg = dict(split_len=split_len, block_n=block_n, num_warps=warps)
            try:
                be = TritonBackend(**cfg)
                out = be.forward(q, cache, md, D ** -0.5)
                err = float((out[:2].float() - ref_out).abs().max()) if ref_out is not None else None
                s = cuda_time(lambda: be.forward(q, cache, md, D ** -0.5))
                r = dict(cfg, ms=s * 1e3, GBps=kv_bytes / s / 1e9, max_abs_err=err)
            except Exception as e:  # noqa: BLE001
                r = dict(cfg, error=f"{type(e).__name__}: {e}"[:300])
            results.append(r)
            print(r, flush=True)
            if "GBps" in r and (best is None or r["GBps"] > best["GBps"]):
                best = r
out = {"device": name, "shape": dict(batch=B, context=L, heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS,
                                     dtype="bfloat16"),
       "kv_bytes_per_call": kv_bytes, "peak_bytes_per_s": peak, "peak_source": peak_src,
       "measured_copy_bytes_per_s": copy_bw, "sweep": results, "best": best}
if best:
    out["best_fraction_of_peak"] = best["GBps"] * 1e9 / peak if peak else None
    out["best_fraction_of_copy"] = best["GBps"] * 1e9 / copy_bw
    out["goal_70pct_of_peak_met"] = bool(peak and best["GBps"] * 1e9 >= 0.7 * peak)
    out["ok"] = best.get("max_abs_err") is None or best["max_abs_err"] < 5e-2
else:
    out["ok"] = False
json.dump(out, open(sys.argv[1], "w"), indent=2)
print("best", best, "peak", peak, peak_src, "copy", copy_bw)
EOF
run_part bandwidth 75 "$TMP/bandwidth.py"

# ---------------------------------------------------------------- part 3: engine greedy output
cat >"$TMP/engine.py" <<'EOF'
import json, sys, time, torch
from pagedkv import LLM, SamplingParams
prompts = ["What is the capital of France? Answer in one sentence.", "Name three primary colours.",
           "Write a haiku about memory pages.", "Explain paged attention to a child in two sentences."]
sp = SamplingParams(temperature=0, max_tokens=32)
out = {"prompts": prompts, "max_tokens": 32}
t0 = time.perf_counter()
gpu = LLM(attention_backend="triton", device="cuda", dtype="float32").generate(prompts, sp, use_tqdm=False)
out["gpu_seconds"] = round(time.perf_counter() - t0, 1)
t0 = time.perf_counter()
torch.set_num_threads(min(8, torch.get_num_threads()))
cpu = LLM(attention_backend="reference", device="cpu", dtype="float32").generate(prompts, sp, use_tqdm=False)
out["cpu_seconds"] = round(time.perf_counter() - t0, 1)
g_ids = [list(o.token_ids) for o in gpu]
c_ids = [list(o.token_ids) for o in cpu]
def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
out["triton_cuda_token_ids"] = g_ids
out["reference_cpu_token_ids"] = c_ids
out["first_divergence"] = [first_diff(a, b) for a, b in zip(g_ids, c_ids)]
out["identical"] = g_ids == c_ids
out["ok"] = out["identical"]
json.dump(out, open(sys.argv[1], "w"), indent=2)
print("identical:", out["identical"], "first divergence per prompt:", out["first_divergence"])
EOF
run_part engine 85 "$TMP/engine.py"

# ---------------------------------------------------------------- one results file
mkdir -p "$(dirname "$RESULTS")"
"$PY" - "$TMP" "$RESULTS" <<'EOF'
import json, os, sys, time
tmp, dest = sys.argv[1], sys.argv[2]
res = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
for part in ("env", "conformance", "bandwidth", "engine"):
    p = os.path.join(tmp, part + ".json")
    try:
        res[part] = json.load(open(p))
    except Exception as e:  # noqa: BLE001
        res[part] = {"ok": False, "error": f"no result: {e}"}
res["ok"] = all(res[p].get("ok") for p in ("env", "conformance", "bandwidth", "engine"))
json.dump(res, open(dest, "w"), indent=2)
bw = res["bandwidth"]
print("gpu_check summary:",
      "conformance", "PASS" if res["conformance"].get("ok") else "FAIL",
      "| decode best", (bw.get("best") or {}).get("GBps"), "GB/s =",
      bw.get("best_fraction_of_peak"), "of peak (goal 0.7)",
      "| engine identical", res["engine"].get("identical"))
print("wrote", dest)
EOF
