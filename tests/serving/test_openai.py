"""The server through the official ``openai`` client: completions and chat, streaming and
not, n=2, logprobs, stop, usage; streamed text == non-streamed text for the same seed."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from pagedkv.engine.engine import LLMEngine  # noqa: E402
from pagedkv.kv import check_invariants  # noqa: E402
from pagedkv.serving.app import build_app  # noqa: E402
from pagedkv.serving.threaded import ThreadedServer  # noqa: E402


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=192, block_size=16, max_model_len=512,
                       enable_prefix_caching=True, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name=["smol", engine.model_id]))
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    srv, _ = server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)


def _wait_idle(engine, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    _idle(engine)


def test_models_health_metrics(server, client):
    srv, engine = server
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    text = httpx.get(srv.url + "/metrics").text
    for name in ("pagedkv_num_requests_running", "pagedkv_num_requests_waiting", "pagedkv_kv_blocks_used",
                 "pagedkv_kv_blocks_free", "pagedkv_kv_cache_usage_percent", "pagedkv_prefix_cache_hit_rate",
                 "pagedkv_num_preemptions_total", "pagedkv_cow_copies_total",
                 "pagedkv_time_to_first_token_seconds_bucket", "pagedkv_time_per_output_token_seconds_bucket",
                 "pagedkv_generation_tokens_total"):
        assert name in text, name


def test_completion_stream_equals_nonstream(server, client):
    _, engine = server
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=12, temperature=0.8, top_p=0.95, seed=7)
    full = client.completions.create(**kw)
    assert full.object == "text_completion"
    assert len(full.choices) == 1 and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len(engine.tokenize("Once upon a time"))
    assert 1 <= full.usage.completion_tokens <= 12
    pieces = []
    chunks = 0
    for ch in client.completions.create(stream=True, **kw):
        chunks += 1
        for c in ch.choices:
            pieces.append(c.text)
    assert chunks >= 3  # tokens arrive as generated, not in one piece
    assert "".join(pieces) == full.choices[0].text
    _wait_idle(engine)


def test_chat_stream_equals_nonstream_n2(server, client):
    _, engine = server
    kw = dict(model="smol", messages=[{"role": "user", "content": "Name a colour."}],
              max_tokens=10, temperature=1.0, seed=11, n=2)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in full.choices)
    texts = {c.index: c.message.content for c in full.choices}
    streamed = {0: "", 1: ""}
    finish = {}
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if ch.usage is not None:
            assert ch.usage.completion_tokens == full.usage.completion_tokens
    assert streamed == texts
    assert set(finish) == {0, 1}
    _wait_idle(engine)


def test_completion_n2_and_prompt_list(server, client):
    _, engine = server
    out = client.completions.create(model="smol", prompt=["Hello", "The sky is"], n=2, max_tokens=4,
                                    temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 4
    assert all(c.finish_reason == "length" for c in out.choices)
    greedy = client.completions.create(model="smol", prompt="The sky is", n=2, max_tokens=6, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy children agree
    _wait_idle(engine)


def test_logprobs_and_stop(server, client):
    _, engine = server
    out = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # a stop string taken from the free continuation ends the text before it, streamed or not
    free = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = free[4:6]
    assert stop.strip()
    cut = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert free.startswith(cut.choices[0].text) and stop not in cut.choices[0].text
    streamed = "".join(c.text for ch in client.completions.create(
        model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop], stream=True) for c in ch.choices)
    assert streamed == cut.choices[0].text
    _wait_idle(engine)


def test_user_and_cache_salt_extension(server, client):
    _, engine = server
    prompt = "A fairly long shared prompt that spans more than one block of sixteen tokens, so that it can be cached."
    a = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0, user="alice",
                                  extra_body={"cache_salt": "s1"})
    b = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0, user="alice",
                                  extra_body={"cache_salt": "s1"})
    c = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"cache_salt": "s2"})
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens >= 16
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text
    _wait_idle(engine)


def test_metrics_count_requests(server, client):
    srv, engine = server
    client.completions.create(model="smol", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(srv.url + "/metrics").text
    ttft_count = [line for line in text.splitlines() if line.startswith("pagedkv_time_to_first_token_seconds_count")]
    assert ttft_count and float(ttft_count[0].split()[-1]) >= 1
    gen = [line for line in text.splitlines() if line.startswith("pagedkv_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3
    assert 'pagedkv_requests_finished_total{finish_reason="length"' in text
