"""The step strategy (``pagedkv.model.step_strategy``): chosen once at engine start from the
backend's declared capabilities (``pagedkv.attention.base.BackendCapabilities``) and logged."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagedkv.attention.base import EAGER_ONLY, BackendCapabilities, backend_capabilities
from pagedkv.attention.registry import get_backend
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.model.step_strategy import EAGER_STEP, StepStrategy, choose_step_strategy

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def default_model(bundled_gguf):
    """The bundled model as ``LLM()`` loads it: default dtype and ``weights="auto"`` (its GGUF
    blocks on the integer kernels). Its own object: these tests switch its step path."""
    from pagedkv.model.loader import load_model

    return load_model(bundled_gguf, weights="auto")


def test_backends_declare_their_capabilities():
    cpu = backend_capabilities(get_backend("cpu"))
    assert cpu == BackendCapabilities(write_and_forward=True, native_step=True, step_attention=True, step_table=True,
                                      attention_sinks=True)
    assert cpu.fast_path() == "native step"
    assert backend_capabilities(get_backend("cpu-hnd")) == cpu
    assert backend_capabilities(get_backend("reference")).fast_path() == "none" and EAGER_ONLY.fast_path() == "none"
    # a backend from outside that declares nothing (or something else) gets the eager record
    assert backend_capabilities(object()) is EAGER_ONLY
    assert backend_capabilities(SimpleNamespace(capabilities={"native_step": True})) is EAGER_ONLY
    assert BackendCapabilities(write_and_forward=True).fast_path() == "fused layer"
    with pytest.raises(AttributeError):  # frozen: a backend's record is not changed in place
        cpu.native_step = False  # type: ignore[misc]


def test_the_bundled_model_runs_the_native_step_on_default_settings(default_model, caplog):
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        llm = LLM(default_model, num_blocks=32)
    s = llm.engine.step_strategy
    assert s == StepStrategy("native", "decoder.c runs a step's layers in one call; backend cpu declares "
                                       "native_step; steps it declines run fused")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step strategy:")] == [
        f"step strategy: {s}"]
    assert default_model.model.fused_state == default_model.model.native_state == "on"
    assert default_model.model.step_route == "native"
    out = llm.generate([[1, 2, 3, 4, 5]], GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 6


def test_float32_weights_run_the_fused_layers(loaded_model):
    """The suite's fp32 bundled model: plain linear layers, so decoder.c (integer kernels only)
    is off and the fused ops run per layer."""
    assert LLM(loaded_model, num_blocks=32).engine.step_strategy == StepStrategy(
        "fused", "fused CPU ops per layer; native step off (a linear layer without integer-kernel weights)")


def test_the_eager_override_and_a_backend_without_a_native_step(default_model, monkeypatch):
    model = default_model.model
    monkeypatch.setenv("PAGEDKV_STEP_STRATEGY", "eager")
    try:
        eager = LLM(default_model, num_blocks=32)
        assert eager.engine.step_strategy == StepStrategy("eager", "PAGEDKV_STEP_STRATEGY=eager: torch ops per layer")
        assert model.fused_state == model.native_state == EAGER_STEP and model.step_route == "eager"
        assert all(layer.fused is None for layer in model.layers)
        assert len(eager.generate([[1, 2, 3, 4, 5]], GREEDY, use_tqdm=False)[0].token_ids) == 6
        monkeypatch.setenv("PAGEDKV_STEP_STRATEGY", "fastest")
        with pytest.raises(ConfigError, match="PAGEDKV_STEP_STRATEGY must be one of auto, eager, got 'fastest'"):
            LLM(default_model, num_blocks=32)
        monkeypatch.delenv("PAGEDKV_STEP_STRATEGY")
        # the reference backend declares no fast path: the fused ops run, decoder.c does not
        ref = LLM(default_model, num_blocks=32, attention_backend="reference")
        assert ref.engine.step_strategy == StepStrategy(
            "fused", "fused CPU ops per layer; backend reference declares no native_step")
        # the forward dispatches on that choice: decoder.c is never asked, the layers run fused
        assert model.step_route == "fused" and model.native_state == "on"
        asked = []
        native_run, model._native.run = model._native.run, lambda *a: asked.append(1) or False
        try:
            assert len(ref.generate([[1, 2, 3, 4, 5]], GREEDY, use_tqdm=False)[0].token_ids) == 6
        finally:
            del model._native.run
        assert asked == [] and model._native.run == native_run
    finally:  # the session's shared model back on its default path
        model.prepare_step()
    assert model.fused_state == model.native_state == "on"
    assert LLM(default_model, num_blocks=32).engine.step_strategy.name == "native"


def test_compiled_steps_name_the_path_of_the_steps_they_leave(default_model):
    model, cpu = default_model.model, get_backend("cpu")
    ok = SimpleNamespace(failed=None, max_rows=64)
    assert choose_step_strategy(model, cpu, ok, eager=False) == StepStrategy(
        "compiled", "torch.compile'd steps of up to 64 rows with the backend's step_attention; other steps native")
    assert choose_step_strategy(model, get_backend("reference"), ok, eager=False) == StepStrategy(
        "compiled", "torch.compile'd steps of up to 64 rows with per-layer attention; other steps fused")
    failed = SimpleNamespace(failed="mixture-of-experts layers run eager", max_rows=64)
    s = choose_step_strategy(model, cpu, failed, eager=False)
    assert (s.name, s.reason.split(";")[0]) == ("native", "compiled steps off: mixture-of-experts layers run eager")
