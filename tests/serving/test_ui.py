"""The /ui page in headless Chromium (Debian ``chromium`` + ``chromedriver``, driven by
selenium; ``scripts/install_browser.sh`` installs them, and this module runs it when they
are missing: the ``browser`` fixture of tests/conftest.py). While requests run, the page's block cells carry the owners of the engine's
block tables; the seed §03 calculator shows 6 blocks / 96 slots for 17,33,8 at block size 16.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=96, block_size=8, max_model_len=256,
                       enable_prefix_caching=True, shuffle_blocks=1234)
    srv = ThreadedServer(build_app(engine, served_model_name="smol"))
    yield srv, engine
    srv.stop()


def _wait(cond, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _stream(http, prompt, n=1):
    body = {"model": "smol", "prompt": prompt, "max_tokens": 100, "temperature": 0.8, "seed": 1, "n": n,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep a reference: a collected iterator closes the connection
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # generating
        yield json.loads(line[6:])["id"]
        del lines


DOM_CELLS = """
const g = document.getElementById('grid');
return {step: Number(g.dataset.step), cells: Array.from(g.children).map(c => ({
  block: Number(c.dataset.block), ref: Number(c.dataset.ref), owners: c.dataset.owners,
  cls: c.className, text: c.textContent}))};
"""
DOM_ROWS = """
return Array.from(document.querySelectorAll('#requests tr')).map(r => ({
  id: r.dataset.request, table: r.dataset.blockTable}));
"""


def test_ui_shows_engine_block_tables(server, browser):
    srv, engine = server
    loop = srv.server.config.app.state.pagedkv.loop
    browser.get(srv.url + "/ui?interval=100")
    assert "pagedkv" in browser.title
    http = httpx.Client(base_url=srv.url, timeout=120)
    with _stream(http, "Tell me a long story about a lighthouse keeper and the sea.", n=2), \
            _stream(http, "Explain how a paged KV cache works, step by step:"):
        assert loop.pause()
        try:
            step = loop.num_steps
            # the page catches up with the paused engine
            dom = _wait(lambda: (d := browser.execute_script(DOM_CELLS))["step"] == step and d,
                        what="the page to show the paused step")
            tables = {rid: t.ids for rid, t in engine.kv.tables.items()}
            assert len(tables) == 3  # two samples of one request + one request
            owners_of: dict[int, set[str]] = {}
            for rid, ids in tables.items():
                for b in ids:
                    owners_of.setdefault(b, set()).add(rid)
            refs = [blk.ref_cnt for blk in engine.kv.pool.blocks]
            assert len(dom["cells"]) == engine.num_blocks
            for cell in dom["cells"]:
                b = cell["block"]
                assert set(cell["owners"].split()) == owners_of.get(b, set()), cell
                assert cell["ref"] == refs[b]
                if refs[b] > 1:  # shared: marked and showing the count
                    assert "shared" in cell["cls"] and cell["text"] == str(refs[b])
                elif refs[b] == 0:
                    assert "free" in cell["cls"] or "cached" in cell["cls"]
            assert any(refs[b] > 1 for b in owners_of)  # the n=2 siblings share prompt blocks
            rows = {r["id"]: r["table"] for r in browser.execute_script(DOM_ROWS)}
            for rid, ids in tables.items():
                assert rows[rid] == " ".join(map(str, ids))
            used = browser.find_element("id", "used").text
            assert int(used) == engine.kv.num_used_blocks
        finally:
            loop.resume()
    http.close()
    # the clients left: their blocks are freed and the page shows no owner any more
    _wait(lambda: not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0, what="aborts")
    check_invariants(engine.kv)
    _wait(lambda: all(not c["owners"] for c in browser.execute_script(DOM_CELLS)["cells"]),
          what="the page to show every block free")


def test_ui_calculator(server, browser):
    srv, _ = server
    browser.get(srv.url + "/ui")
    by_id = lambda i: browser.find_element("id", i)  # noqa: E731

    def set_value(i, v):
        el = by_id(i)
        el.clear()
        el.send_keys(v)

    set_value("calc-lengths", "17,33,8")
    set_value("calc-block-size", "16")
    set_value("calc-max-len", "64")
    assert by_id("calc-paged-blocks").text == "6"
    assert by_id("calc-paged-slots").text == "96"
    assert by_id("calc-valid").text == "58"
    assert by_id("calc-paged-free").text == "38"
    assert by_id("calc-contig-slots").text == "192"
    assert by_id("calc-contig-free").text == "134"
    set_value("calc-block-size", "8")  # seed §07: smaller blocks, less internal free space
    assert by_id("calc-paged-blocks").text == "9"
    assert by_id("calc-paged-free").text == "14"
    set_value("calc-block-size", "32")
    assert by_id("calc-paged-blocks").text == "4"
    assert by_id("calc-paged-free").text == "70"
