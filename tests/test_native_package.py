"""The native kernels as a package: every C/C++ source lives in ``pagedkv/csrc``, is listed in
``pyproject.toml``'s package-data and is used by a loader; a wheel built from the checkout
carries every source, and an engine running from the installed wheel has every kernel in use
and generates what the checkout's engine generates."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from pagedkv.ops import build as csrc, native

REPO = Path(__file__).resolve().parents[1]
NATIVE_EXTS = (".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu")


def _repo_native_files() -> list[str]:
    """Every tracked or new (not ignored) native file of the checkout, repo-relative."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return sorted(p for p in out if p.endswith(NATIVE_EXTS) and (REPO / p).exists())


def _package_data_globs() -> list[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return list(data.get("pagedkv.csrc", []))


def test_every_native_source_lives_in_csrc_and_is_package_data():
    files = _repo_native_files()
    assert files, "no native source found: the check would pass vacuously"
    outside = [f for f in files if Path(f).parent != Path("pagedkv/csrc")]
    assert not outside, f"native sources outside pagedkv/csrc: {outside}"
    globs = _package_data_globs()
    assert sorted(globs) == sorted(csrc.SOURCE_GLOBS), (globs, csrc.SOURCE_GLOBS)
    unlisted = [f for f in files if not any(fnmatch.fnmatch(Path(f).name, g) for g in globs)]
    assert not unlisted, f"not in pagedkv.csrc's package-data {globs}: {unlisted}"
    assert [p.relative_to(REPO).as_posix() for p in csrc.sources()] == files
    assert {p.name for p in csrc.sources()} == {"cpu_kernel.c", "decoder.c", "fused_ops.c", "qmm.c",
                                                 "sample_ops.c", "step_op.cpp"}


def test_every_source_has_a_loader_and_every_loader_a_source():
    """The loaders name their source through ``csrc.source``; each names one that exists,
    and no source sits unused."""
    named = {}
    for path in (REPO / "pagedkv").rglob("*.py"):
        for name in re.findall(r"\bsource\(\"([^\"]+)\"\)", path.read_text()):
            named.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    assert set(named) == {p.name for p in csrc.sources()}, named
    for name in named:
        assert csrc.source(name) == csrc.SRC_DIR / name


def test_source_names_a_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.c is missing"):
        csrc.source("nope.c")


def test_status_says_in_use_or_off_with_the_reason(monkeypatch):
    from pagedkv.ops import qmm

    if csrc.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("PAGEDKV_QMM", "0")
    monkeypatch.setattr(qmm, "_OPS", csrc.BuiltOnce("PAGEDKV_QMM", qmm.build))
    st = native.status()
    assert list(st) == ["attention", "fused", "sampler", "qmm", "decoder"]
    assert st["qmm"] == "off (disabled by PAGEDKV_QMM=0)"
    assert {k: v for k, v in st.items() if k != "qmm"} == dict.fromkeys(["attention", "fused", "sampler",
                                                                          "decoder"], "in use")
    assert native.summary().startswith("attention in use, fused in use, sampler in use, qmm off (disabled")
    assert list(native.status(compiled=True)) == list(native.KERNELS)


_IN_WHEEL = r"""
import io, json, logging, sys
import pagedkv
from pagedkv import LLM, SamplingParams
from pagedkv.ops import build as csrc, native
from pagedkv.testing.tiny import tiny_random_model

buf = io.StringIO()
log = logging.getLogger("pagedkv")
log.addHandler(logging.StreamHandler(buf))
log.setLevel(logging.INFO)
llm = LLM(tiny_random_model(seed=3), num_blocks=32)
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
print(json.dumps({"pagedkv": pagedkv.__file__, "csrc": str(csrc.SRC_DIR),
                  "status": native.status(compiled=True), "tokens": out[0].token_ids,
                  "log": [l for l in buf.getvalue().splitlines() if l.startswith("native kernels:")]}))
"""


@pytest.mark.slow
def test_wheel_carries_the_native_sources_and_its_engine_uses_them(tmp_path, loaded_model):
    import shutil

    from pagedkv import LLM, SamplingParams
    from pagedkv.testing.tiny import tiny_random_model

    if csrc.compiler() is None:
        pytest.skip("no C compiler here")
    # build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "pagedkv", src / "pagedkv", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    res = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pagedkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"pagedkv/csrc/{p.name}" for p in csrc.sources()}
    assert len(expected) == 6 and expected <= names, sorted(expected - names)

    site = tmp_path / "site"
    res = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}  # the cache dir stays: keyed by source, it is reused
    res = subprocess.run([sys.executable, "-c", _IN_WHEEL], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(got["pagedkv"]).resolve() == (site / "pagedkv" / "__init__.py").resolve()
    assert Path(got["csrc"]).resolve() == (site / "pagedkv" / "csrc").resolve()
    assert got["status"] == dict.fromkeys(native.KERNELS, "in use")
    assert got["log"] == ["native kernels: attention in use, fused in use, sampler in use, qmm in use, "
                          "decoder in use"]
    # the same tokens as the checkout's engine on the same weights
    llm = LLM(tiny_random_model(loaded_model, seed=3), num_blocks=32)
    want = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(got["tokens"]) == 6 and got["tokens"] == want[0].token_ids


def test_a_compile_is_announced_once_per_process(tmp_path, monkeypatch, caplog):
    """A first start on an empty cache spends tens of seconds compiling: the first build of a
    process says so (once), a cached object says nothing."""
    import logging

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(csrc, "_ANNOUNCED", type(csrc._ANNOUNCED)())
    src = tmp_path / "k.c"
    src.write_text("int pagedkv_answer(void) { return 42; }\n")
    flags = ["-O1", "-fPIC", "-shared"]
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert csrc.compile_c(src, "answer", flags).pagedkv_answer() == 42
        src.write_text("int pagedkv_answer(void) { return 43; }\n")  # another object: built, not announced again
        assert csrc.compile_c(src, "answer", flags).pagedkv_answer() == 43
    msgs = [r.getMessage() for r in caplog.records if r.name == "pagedkv"]
    assert len(msgs) == 1 and "compiling the C kernels" in msgs[0] and str(tmp_path / "cache") in msgs[0], msgs
    caplog.clear()
    monkeypatch.setattr(csrc, "_ANNOUNCED", type(csrc._ANNOUNCED)())  # a new process, everything cached
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert csrc.compile_c(src, "answer", flags).pagedkv_answer() == 43
    assert not [r for r in caplog.records if r.name == "pagedkv"]
