"""Shared fixtures: the expensive model loads happen once per test session.

* ``bundled_gguf``: path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (skips if absent)
* ``loaded_model``: our ``LoadedModel`` of it, float32 on CPU (weights streamed from the file,
  the tokenizer's cache entry in the default cache root: after the first run a few seconds)
* ``hf_model``: transformers' ``LlamaForCausalLM`` from the same GGUF, float32, eval mode (~20 s)
* ``hf_tokenizer``: transformers' tokenizer read from the same GGUF
* ``gemma3_gguf`` / ``gemma3_loaded`` / ``gemma3_hf``: the second bundled real model,
  Gemma-3-270M Q4_K_M (path; our fp32 ``LoadedModel``; transformers' model from the same GGUF,
  fp32, about a minute to dequantise)
* ``browser``: headless Chromium driven by selenium (installed by scripts/install_browser.sh
  when missing; a failure under CI=1)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the hundreds of engines the suite builds keep their caches lazily resident (each would fault
# in its whole KV budget in the background); tests/attention/test_prefault.py turns it on
os.environ.setdefault("PAGEDKV_KV_PREFAULT", "0")

import pagedkv  # noqa: E402,F401 - first: applies $PAGEDKV_CPU_ISA's caps before torch is imported
import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores: run alone, a test process uses both; as one of `make test`'s two pytest-xdist
# workers (PYTEST_XDIST_WORKER set), one each, so the workers never oversubscribe the cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
if not torch.cuda.is_available():
    # Triton runs its CPU interpreter only if this is set before triton is first imported, and
    # torch._dynamo (compiled decode, tests/model/test_compiled.py) imports triton: set it
    # before any test module can, whatever order the tests are collected in
    os.environ.setdefault("TRITON_INTERPRET", "1")


STRICT = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

# the shared model builders' check_* helpers assert for the tests that call them: rewrite their
# asserts as pytest rewrites a test module's, so a failure shows the compared values
pytest.register_assert_rewrite("tests.model.builders")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs the bundled model (loads weights)")


_MODEL_FIXTURES = {"bundled_gguf", "loaded_model", "hf_model", "hf_tokenizer", "gemma3_gguf"}


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """A test that uses a model fixture (directly or through another fixture) is ``slow``;
    ``make test-fast`` runs ``-m "not slow"``."""
    for item in items:
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _fail_skip(report) -> None:
    """Under CI=1 a skip is a failure: a missing C compiler, ``openai`` package, browser,
    model or trace means the set-up is broken, not that the feature may go untested."""
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=1 (a skip is a set-up failure in CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.fixture(scope="session")
def bundled_gguf():
    from pagedkv._bundled import bundled_model_path
    from pagedkv.errors import ConfigError

    try:
        return bundled_model_path()
    except ConfigError as e:  # a missing model is a set-up failure, never a skip
        pytest.fail(f"{e} (make test installs it)")


@pytest.fixture(scope="session")
def loaded_model(bundled_gguf):
    from pagedkv.model.loader import load_model

    return load_model(bundled_gguf, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_model(bundled_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(bundled_gguf.parent), gguf_file=bundled_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled_gguf.parent), gguf_file=bundled_gguf.name)


@pytest.fixture(scope="session")
def gemma3_gguf():
    from pagedkv._bundled import gemma3_model_path
    from pagedkv.errors import ConfigError

    try:
        return gemma3_model_path()
    except ConfigError as e:  # a missing model is a set-up failure, never a skip
        pytest.fail(f"{e} (make test installs it)")


@pytest.fixture(scope="session")
def gemma3_loaded(gemma3_gguf):
    from pagedkv.model.loader import load_model

    return load_model(gemma3_gguf, dtype=torch.float32, weights="fp32")


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


def _agreement(got, want) -> tuple[int, int, int]:
    """``(identical, total, shortest common prefix)`` of the completions of ``got`` against the
    same prompts' first completion in ``want`` (RequestOutputs). With a quantised KV cache two
    schedules of the same requests (batch shapes, chunking, recomputation after preemption,
    tensor-parallel shards) round differently in float32, a K/V element near a code boundary
    lands on the neighbouring code, and through 30 layers that re-draws the quantisation
    noise: completions then part at a close call, as an int8 and a float32 cache do. A wrong
    scale, a block read from the wrong place or a copy that misses the scales parts them at
    once. Tests bound both: the first tokens and most completions must agree."""
    same, total, shortest = 0, 0, None
    for g, w in zip(got, want):
        ref = w.outputs[0].token_ids
        for c in g.outputs:
            k = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), len(ref))
            shortest = k if shortest is None else min(shortest, k)
            same += list(c.token_ids) == list(ref)
            total += 1
    return same, total, shortest or 0


@pytest.fixture
def agreement():
    """``agreement(got, want) -> (identical, total, shortest common prefix)``: see ``_agreement``."""
    return _agreement


# ---- the /ui pages in headless Chromium (tests/serving/test_ui.py, tests/serving/replicas) ----------------
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _browser_ready() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


@pytest.fixture(scope="module")
def browser():
    if not _browser_ready():
        proc = subprocess.run(["bash", str(Path(__file__).resolve().parents[1] / "scripts" / "install_browser.sh"), sys.executable],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not _browser_ready():
            msg = f"cannot install chromium/selenium:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            if os.environ.get("CI"):
                pytest.fail(msg)
            pytest.skip(msg)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pagedkv-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,1000"):
        opts.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not fetch anything
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
