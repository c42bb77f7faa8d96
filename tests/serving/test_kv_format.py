"""/metrics and /ui show the KV cache format."""

from __future__ import annotations

import httpx

from pagedkv.engine.engine import LLMEngine


# ------------------------------------------------------------------ metrics and /ui
def test_metrics_and_ui_show_the_kv_format(loaded_model):
    from pagedkv.serving.app import build_app
    from pagedkv.serving.threaded import ThreadedServer

    engine = LLMEngine(loaded_model, num_blocks=32, kv_cache_dtype="fp8_e4m3", kv_quant_group_size=32)
    srv = ThreadedServer(build_app(engine))
    try:
        text = httpx.get(srv.url + "/metrics").text
        assert 'kv_cache_dtype="fp8_e4m3"' in text and 'quant_group_size="32"' in text
        assert "pagedkv_kv_cache_bytes_per_token" in text and " 12240.0" in text  # 30*2*3*(64+4)
        state = httpx.get(srv.url + "/ui/state").json()
        assert (state["kv_cache_dtype"], state["kv_quant_group_size"], state["kv_bytes_per_token"]) == ("fp8_e4m3", 32, 12_240)
        assert 'id="kvdtype"' in httpx.get(srv.url + "/ui").text
    finally:
        srv.stop()


def test_int8_server_answers_a_chat_request(loaded_model):
    """A server on an int8 cache answers a chat request from int8 blocks (and frees them)
    and names the format on /metrics."""
    from pagedkv.serving.app import build_app
    from pagedkv.serving.threaded import ThreadedServer

    engine = LLMEngine(loaded_model, num_blocks=32, kv_cache_dtype="INT8")
    srv = ThreadedServer(build_app(engine, served_model_name="m"))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        text = httpx.get(srv.url + "/metrics").text
        assert 'kv_cache_dtype="int8"' in text and 'quant_group_size="64"' in text
        assert engine.kv.num_used_blocks == 0
    finally:
        srv.stop()
