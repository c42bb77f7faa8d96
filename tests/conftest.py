"""Shared fixtures: the expensive model loads happen once per test session.

* ``bundled_gguf``: path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (skips if absent)
* ``loaded_model``: our ``LoadedModel`` of it, float32 on CPU (weight cache in the default
  cache root, so after the first run it loads in about a second)
* ``hf_model``: transformers' ``LlamaForCausalLM`` from the same GGUF, float32, eval mode (~20 s)
* ``hf_tokenizer``: transformers' tokenizer read from the same GGUF
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


STRICT = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs the bundled model (loads weights)")


_MODEL_FIXTURES = {"bundled_gguf", "loaded_model", "hf_model", "hf_tokenizer"}


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


NEAR_TIE = 0.1  # nats between the top two log-probabilities


def _same_up_to_near_ties(got, want) -> int:
    """Each completion of ``got`` (RequestOutputs) equals the same prompt's first completion in
    ``want`` (a run with ``logprobs >= 2``), or first differs where ``want`` had a near tie (its
    top two tokens within ``NEAR_TIE`` nats). A quantised KV cache makes this the right test
    across schedules: float rounding differs between batch shapes and kernel paths, a value
    that close to a code boundary rounds to the neighbouring code, and a few such flips move
    the logits by a few hundredths of a nat (0.04-0.05 seen). A wrong scale or a block read
    from the wrong place moves them by nats. Returns how many completions differ."""
    differ = 0
    for g, w in zip(got, want):
        ref = w.outputs[0]
        for c in g.outputs:
            k = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref.token_ids)) if a != b), None)
            if k is None:
                continue
            top = sorted(ref.logprobs[k].values(), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (k, c.token_ids, ref.token_ids, ref.logprobs[k])
            differ += 1
    return differ


@pytest.fixture
def near_ties():
    """``near_ties(got, want) -> int``: see ``_same_up_to_near_ties``."""
    return _same_up_to_near_ties
