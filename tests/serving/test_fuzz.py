"""Schema-driven fuzzing of the whole HTTP surface (schemathesis over ``/openapi.json``).

Every operation the server publishes in ``GET /openapi.json`` gets ``EXAMPLES`` generated
requests that fit its schema and ``EXAMPLES`` that break it (the same ones every run:
``derandomize``; ``PAGEDKV_FUZZ_EXAMPLES=N`` fuzzes deeper), once on a server without API
keys and once on a server with keys (then ``KEYLESS_EXAMPLES`` more without a key). Each
answer must be: no 5xx; every 4xx an OpenAI error object; every 200 parseable (strict
JSON, no NaN; every SSE event JSON or ``[DONE]``); a keyed route 401 without its key; and
schemathesis's own checks (status codes, content types and bodies as documented, invalid
data rejected, auth enforced). Afterwards each server is healthy, answers a good request,
and holds no KV block.

The engine is the bundled model's tokenizer and chat template over a tiny random-weight
decoder of the same vocabulary (2 layers, hidden 64), so a generation costs milliseconds
and the fuzzer can afford real completions; ``max_model_len`` 128 bounds every output.
One run sends about 1,200 requests (305 open, 841 keyed, 71 keyed without a key) in about
100 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter

import pytest
import requests
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "60"))  # per operation and mode (positive / negative)
KEYLESS_EXAMPLES = 5
MAX_MODEL_LEN = 128
KEYS = {"fuzz-key-a": "a", "fuzz-key-b": "b"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
# invalid data is rejected with one of these (413: a generated body over the size limit)
CONFIG = schemathesis.Config.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": [400, 401, 404, 413, 422]}}})


@pytest.fixture(scope="module")
def tiny_model(loaded_model):
    """A random 2-layer decoder with the bundled model's vocabulary, tokenizer and template."""
    cfg = dataclasses.replace(loaded_model.config, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                              model_id="tiny-random", revision="fuzz")
    model = LlamaForCausalLM(cfg)  # parameters allocated, not initialised; RoPE tables built
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.05)
    return LoadedModel(model=model.eval(), config=cfg, tokenizer=loaded_model.tokenizer, path=loaded_model.path)


def _engine(tiny_model):
    return LLMEngine(tiny_model, num_blocks=48, block_size=8, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=True, debug_invariants=True)


def _strict_json(text: str):
    def no_constant(c):
        raise ValueError(f"non-JSON constant {c}")

    return json.loads(text, parse_constant=no_constant)


def _problems(resp, keyed_without_key: bool, path: str) -> list[str]:
    """What is wrong with one answer (empty: nothing)."""
    out = []
    status = resp.status_code
    if status >= 500:
        out.append(f"{status}")
    if keyed_without_key and path != "/health" and status != 401:
        out.append(f"{status} without an API key")
    ctype = resp.headers.get("content-type") or [""]  # schemathesis: header -> list of values
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    if status >= 400:
        try:
            err = _strict_json(resp.text)["error"]
            ok = (set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
                  and err["message"] and isinstance(err["type"], str)
                  and (err["param"] is None or isinstance(err["param"], str)))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            out.append(f"{status} not an OpenAI error object: {resp.text[:200]!r}")
    elif ctype.startswith("application/json"):
        try:
            _strict_json(resp.text)
        except ValueError as e:
            out.append(f"{status} body is not strict JSON ({e})")
    elif ctype.startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    _strict_json(line[6:])
                except ValueError as e:
                    out.append(f"SSE event is not strict JSON ({e}): {line[:200]!r}")
                    break
    return out


class Fuzzer:
    """Runs the generated requests of every operation against one server; collects problems
    instead of stopping at the first, so one run reports all it found."""

    def __init__(self, url: str, schema, headers: dict, checks: list, keyed_without_key: bool = False):
        self.url, self.schema, self.headers, self.checks = url, schema, headers, checks
        self.keyed_without_key = keyed_without_key
        self.sent = 0
        self.statuses: Counter = Counter()
        self.problems: dict[str, str] = {}  # "METHOD path: problem" -> one example request
        self.session = requests.Session()
        self.unsatisfiable: list[str] = []
        self.errors: Counter = Counter()  # (label, status, start of the body) -> count

    def _one(self, case) -> None:
        label = f"{case.method.upper()} {case.operation.path}"
        try:
            resp = case.call(base_url=self.url, headers=self.headers, session=self.session, timeout=120)
        except requests.RequestException as e:
            self.problems.setdefault(f"{label}: connection failed ({type(e).__name__})", repr(case.body)[:300])
            return
        self.sent += 1
        self.statuses[(label, resp.status_code)] += 1
        if resp.status_code >= 400:
            self.errors[(label, resp.status_code, resp.text[:90])] += 1
        for p in _problems(resp, self.keyed_without_key, case.operation.path):
            self.problems.setdefault(f"{label}: {p}", repr(case.body)[:300])
        try:
            case.validate_response(resp, checks=self.checks, headers=self.headers,
                                   transport_kwargs={"base_url": self.url, "headers": self.headers})
        except (Exception, BaseExceptionGroup) as e:  # schemathesis FailureGroup: one per failed check
            for f in getattr(e, "exceptions", [e]):
                title = getattr(f, "title", type(f).__name__)
                self.problems.setdefault(f"{label}: {title} ({resp.status_code})", repr(case.body)[:300])

    def run(self, examples: int = EXAMPLES) -> None:
        for result in self.schema.get_all_operations():
            op = result.ok()
            modes = [GenerationMode.POSITIVE]
            if op.body or any(True for _ in op.iter_parameters()):
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                          print_blob=False)
                @given(case=op.as_strategy(generation_mode=mode))
                def fuzz(case):
                    self._one(case)

                try:
                    fuzz()
                except Unsatisfiable:  # nothing of this mode exists (e.g. no invalid path string)
                    self.unsatisfiable.append(f"{op.label} {mode.value}")


def _settle_and_check(srv_url: str, engine, headers: dict) -> None:
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)
    assert requests.get(srv_url + "/health", timeout=10).status_code == 200
    ok = requests.post(srv_url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1, ok.text


def _served_schema(url: str, headers: dict):
    """The schema the server publishes (fetched, as a client would)."""
    resp = requests.get(url + "/openapi.json", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return schemathesis.openapi.from_dict(resp.json(), config=CONFIG)


def _report(name: str, fz: Fuzzer) -> None:
    print(f"\n[fuzz {name}] {fz.sent} requests; statuses: "
          + ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(fz.statuses.items()))
          + f"; no cases for: {fz.unsatisfiable}")
    for (label, status, text), n in fz.errors.most_common(30):
        print(f"[fuzz {name}]   {n:4d} x {label} {status} {text}")
    for k, v in fz.problems.items():
        print(f"[fuzz {name}] PROBLEM {k}\n    e.g. body {v}")


def test_fuzz_without_keys(tiny_model):
    engine = _engine(tiny_model)
    app = build_app(engine, served_model_name="smol", max_n=2, max_body_bytes=64 * 1024)
    with ThreadedServer(app) as srv:
        fz = Fuzzer(srv.url, _served_schema(srv.url, {}), {}, CHECKS)
        fz.run()
        _report("open", fz)
        _settle_and_check(srv.url, engine, {})
    assert fz.sent >= 4 * EXAMPLES
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert fz.statuses[(f"POST {path}", 200)] >= 5, "the schema must let real requests reach the engine"
    assert not fz.problems, "\n".join(fz.problems)


def test_fuzz_with_keys(tiny_model):
    engine = _engine(tiny_model)
    app = build_app(engine, served_model_name="smol", max_n=2, max_body_bytes=64 * 1024, api_keys=KEYS)
    auth = {"Authorization": "Bearer fuzz-key-a"}
    with ThreadedServer(app) as srv:
        assert requests.get(srv.url + "/openapi.json", timeout=10).status_code == 401
        schema = _served_schema(srv.url, auth)
        fz = Fuzzer(srv.url, schema, auth, CHECKS + [ignored_auth])
        fz.run()
        anon = Fuzzer(srv.url, schema, {}, [not_a_server_error], keyed_without_key=True)
        anon.run(examples=KEYLESS_EXAMPLES)
        _report("keyed", fz)
        _report("keyed, no key", anon)
        _settle_and_check(srv.url, engine, auth)
    assert fz.sent >= 8 * EXAMPLES and anon.sent >= 7 * KEYLESS_EXAMPLES
    assert fz.statuses[("POST /v1/completions", 200)] >= 5
    assert not fz.problems, "\n".join(fz.problems)
    assert not anon.problems, "\n".join(anon.problems)
