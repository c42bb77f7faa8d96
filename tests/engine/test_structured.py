"""Structured outputs on the bundled model: JSON schemas, regex, choice and grammars constrain
the sampled tokens (100% valid at temperature 0 and 1), through n > 1, preemption and prefix
hits; bad specs are InvalidRequestError; unconstrained rows of the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedkv import LLM, InvalidRequestError, SamplingParams, StructuredSpec
from pagedkv.engine.structured import unpack_bitmask

# held-out schemas: nested objects, arrays, enums, bounded numbers, required fields
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"], "additionalProperties": False,
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
        "additionalProperties": False,
    },
    "reading": {
        "type": "object",
        "properties": {
            "sensor": {"type": "object", "properties": {"kind": {"enum": ["temp", "humidity"]},
                                                        "unit": {"type": "string", "maxLength": 4}},
                       "required": ["kind", "unit"], "additionalProperties": False},
            # multipleOf bounds the fraction: an unbounded one lets temperature-1 sampling
            # draw digits until max_tokens (valid JSON never comes)
            "value": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.01},
            "tags": {"type": "array", "items": {"enum": ["ok", "stale", "noisy"]}, "maxItems": 2},
        },
        "required": ["sensor", "value", "tags"],
        "additionalProperties": False,
    },
}
PROMPT = "Reply with a JSON object describing {}:"


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model, block_size=8, num_blocks=512, max_model_len=512, debug_invariants=True)


def _json(kind, value=None):
    return StructuredSpec(kind, value)


def _valid(out, schema):
    """Parse and validate every sample of ``out``; returns the parsed objects."""
    objs = []
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        obj = json.loads(c.text)
        jsonschema.validate(obj, schema)
        objs.append(obj)
    return objs


@pytest.mark.parametrize("temperature,seeds", [(0.0, [None]), (1.0, [1, 2, 3])])
def test_json_schemas_always_valid(llm, temperature, seeds):
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for seed in seeds:
            prompts.append(PROMPT.format(name))
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=160,
                                         structured=_json("json_schema", schema)))
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        _valid(out, schema)
        assert out.token_ids[-1] != llm.engine.eos_token_ids[0]  # the complete grammar stopped it


def test_json_object_mode(llm):
    out = llm.generate(["Give a JSON object with a name:"], SamplingParams(
        temperature=0, max_tokens=120, structured=_json("json_object")), use_tqdm=False)[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


def test_regex_choice_and_grammar_exact(llm):
    specs = [
        (_json("regex", r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (_json("choice", ["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (_json("grammar", 'root ::= "(" num " + " num ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]? \+ [1-9][0-9]?\)", t)),
        (_json("grammar", 'start: "yes" | "no"'), lambda t: t in ("yes", "no")),
    ]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=7, max_tokens=30, structured=s) for s, _ in specs]
        outs = llm.generate(["Answer:"] * len(specs), params, use_tqdm=False)
        for out, (_, ok) in zip(outs, specs):
            assert ok(out.text), out.text
            assert out.finish_reason == "stop"


def test_n_samples_each_keep_the_constraint(llm):
    schema = SCHEMAS["person"]
    out = llm.generate([PROMPT.format("a person")], SamplingParams(
        n=4, temperature=1.0, seed=11, max_tokens=160, structured=_json("json_schema", schema)), use_tqdm=False)[0]
    objs = _valid(out, schema)
    assert len(objs) == 4
    assert len({json.dumps(o, sort_keys=True) for o in objs}) > 1  # really sampled, not one copy


def test_preemption_keeps_the_constraint(loaded_model):
    # 24 blocks of 8 tokens for 6 requests of ~15 + up to 160 tokens: preemption (recompute) is forced
    small = LLM(loaded_model, block_size=8, num_blocks=24, max_model_len=512, debug_invariants=True)
    schema = SCHEMAS["order"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured=_json("json_schema", schema))
              for s in range(6)]
    outs = small.generate([PROMPT.format(f"order number {s}") for s in range(6)], params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for out in outs:
        _valid(out, schema)


def test_prefix_hit_keeps_the_constraint(loaded_model):
    eng = LLM(loaded_model, block_size=8, num_blocks=256, max_model_len=512, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=160, structured=_json("json_schema", SCHEMAS["reading"]))
    prompt = PROMPT.format("a sensor reading from the weather station on the roof of the old town hall")
    first = eng.generate([prompt], sp, use_tqdm=False)[0]
    second = eng.generate([prompt], sp, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.token_ids == first.token_ids
    _valid(second, SCHEMAS["reading"])


def test_unconstrained_rows_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].token_ids
    mixed = llm.generate(
        ["The capital of France is", "Answer:"],
        [plain, SamplingParams(temperature=0, max_tokens=30, structured=_json("choice", ["alpha", "beta"]))],
        use_tqdm=False,
    )
    assert mixed[0].token_ids == alone
    assert mixed[1].text in ("alpha", "beta")


def test_max_tokens_cuts_a_schema_with_length(llm):
    out = llm.generate([PROMPT.format("an order")], SamplingParams(
        temperature=0, max_tokens=4, structured=_json("json_schema", SCHEMAS["order"])), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.text.startswith("{")


@pytest.mark.parametrize("spec,needle", [
    (StructuredSpec("json_schema", {"type": "nope"}), "nope"),
    (StructuredSpec("json_schema", {"properties": {"a": {"$ref": "#/defs/x"}}}), "/defs/x"),
    (StructuredSpec("regex", "(ab"), "regex"),
    (StructuredSpec("grammar", "root ::= missing_rule"), "missing_rule"),
    (StructuredSpec("choice", []), "non-empty list"),
    (StructuredSpec("yaml", "x"), "kind must be one of"),
    (StructuredSpec("json_schema", "not a dict"), "JSON schema object"),
    (StructuredSpec("regex", "a" * 70000), "at most"),
    (StructuredSpec("json_schema", {"default": object()}), "is not JSON"),
])
def test_bad_specs_are_invalid_request_errors(llm, spec, needle):
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_structured_type_refused(llm):
    with pytest.raises(InvalidRequestError, match="StructuredSpec"):
        llm.generate(["x"], SamplingParams(structured={"type": "json_object"}), use_tqdm=False)


@pytest.mark.parametrize("name", ["person", "order"])
def test_beam_search_hypotheses_all_match_the_schema(llm, name):
    """Each beam's scores are masked by its own grammar state (forked beams replay their
    tokens): every returned hypothesis is schema-valid JSON, and no block leaks."""
    schema = SCHEMAS[name]
    out = llm.generate([PROMPT.format(name)], SamplingParams(
        beam_width=3, max_tokens=120, structured=_json("json_schema", schema)), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    texts = [c.text for c in out.outputs]
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert len(set(texts)) == 3  # three different hypotheses, each valid
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_blocks == 0


def test_compiled_once_cached_by_hash(llm):
    grammars = llm.engine.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 3, "maximum": 5}}, "required": ["k"]}
    misses, hits = grammars.misses, grammars.hits
    a, b = StructuredSpec("json_schema", schema), StructuredSpec("json_schema", json.loads(json.dumps(schema)))
    grammars.compile(a)
    grammars.compile(b)
    assert (grammars.misses - misses, grammars.hits - hits) == (1, 1)
    assert a.compiled is b.compiled


def test_fork_copy_is_independent(llm):
    compiled = llm.engine.grammars.compile(StructuredSpec("choice", ["ab", "cd"]))
    tok = llm.engine.tokenizer
    st = compiled.new_state()
    child = st.copy()
    for t in tok.encode("ab", add_special_tokens=False):
        st.accept(t)
    assert st.done and not child.done and child.consumed == 0
    for t in tok.encode("cd", add_special_tokens=False):
        child.accept(t)
    assert child.done and not child.failed


def test_unpack_bitmask_bits_to_tokens():
    import torch

    bm = torch.zeros((2, 2), dtype=torch.int32)
    bm[0, 0] = 1 | (1 << 5)  # tokens 0 and 5
    bm[1, 1] = 1 << 3  # token 35
    pen = unpack_bitmask(bm, 40)
    assert pen.shape == (2, 40)
    assert (pen[0] == 0).nonzero().flatten().tolist() == [0, 5]
    assert (pen[1] == 0).nonzero().flatten().tolist() == [35]
    assert torch.isneginf(pen[0, 1])


# ---- grammars fail closed --------------------------------------------------------------------

@pytest.mark.parametrize("spec,needle", [
    (StructuredSpec("grammar", "root ::= root"), "accepts no output"),  # no rule can start
    (StructuredSpec("regex", "\\"), "lone backslash"),  # llguidance would read it as ""
    (StructuredSpec("regex", "ab\\"), "lone backslash"),
    (StructuredSpec("regex", "[^\\x00-\\x{10FFFF}]"), "accepts no output"),  # no character at all
    (StructuredSpec("json_schema", {"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
])
def test_empty_languages_rejected_before_any_block(llm, spec, needle):
    free = llm.engine.kv.num_free_blocks
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == free and llm.engine.kv.num_used_blocks == 0


def test_escaped_backslash_regex_still_compiles(llm):
    out = llm.generate(["Write a backslash:"], SamplingParams(
        temperature=0, max_tokens=8, structured=StructuredSpec("regex", "\\\\\\\\")), use_tqdm=False)[0]
    assert out.text == "\\\\" and out.finish_reason == "stop"


def _failures(llm):
    return dict(llm.engine.get_stats().grammar_failures)


def test_endless_grammar_ends_within_the_grammar(llm):
    """``root ::= "ab" root`` never ends: llguidance hits its parser limit on the forced
    tokens. The sequence stops there (finish "error", the reason in stop_reason), its text a
    prefix of (ab)*, never unconstrained text; the failure is counted; no block leaks."""
    before = _failures(llm)
    outs = llm.generate(["Say ab:", "Repeat: abab"], [SamplingParams(
        temperature=t, seed=3, max_tokens=20, structured=StructuredSpec("grammar", 'root ::= "ab" root'))
        for t in (0.0, 1.0)], use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert re.fullmatch(r"(ab)*a?", c.text), c.text
        assert c.finish_reason == "error"
        assert c.stop_reason.startswith("grammar parser_limit: "), c.stop_reason
    after = _failures(llm)
    assert after.get("parser_limit", 0) - before.get("parser_limit", 0) == 2
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_blocks == 0


class _FlakyMatcher:
    """An llguidance matcher that raises after ``ok`` consumed tokens (or in the mask)."""

    def __init__(self, inner, ok, where="consume"):
        self.inner, self.ok, self.where, self.n = inner, ok, where, 0

    def consume_token(self, t):
        if self.where == "consume" and self.n >= self.ok:
            raise RuntimeError("injected consume failure")
        self.n += 1
        return self.inner.consume_token(t)

    def unsafe_compute_mask_ptr(self, ptr, size):
        if self.where == "mask" and self.n >= self.ok:
            raise RuntimeError("injected mask failure")
        return self.inner.unsafe_compute_mask_ptr(ptr, size)

    def deep_copy(self):
        return _FlakyMatcher(self.inner.deep_copy(), self.ok, self.where)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("where", ["consume", "mask"])
def test_runtime_failure_ends_with_the_text_so_far(llm, monkeypatch, where):
    """A matcher that raises mid-generation: the request ends with the tokens the grammar
    accepted (the failing one dropped), finish "error", the failure counted, every block
    back in the pool; the unconstrained request beside it is untouched."""
    from pagedkv.engine import structured

    schema = SCHEMAS["person"]
    spec = StructuredSpec("json_schema", schema)
    sp = SamplingParams(temperature=0, max_tokens=60, structured=spec)
    clean = llm.generate([PROMPT.format("a person")], sp, use_tqdm=False)[0]
    assert clean.finish_reason == "stop" and len(clean.token_ids) > 6
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].token_ids

    real_new_state = structured.CompiledGrammar.new_state

    def flaky_state(self):
        st = real_new_state(self)
        st.matcher = _FlakyMatcher(st.matcher, 5, where)
        return st

    monkeypatch.setattr(structured.CompiledGrammar, "new_state", flaky_state)
    before = _failures(llm)
    outs = llm.generate([PROMPT.format("a person"), "The capital of France is"],
                        [SamplingParams(temperature=0, max_tokens=60, structured=StructuredSpec("json_schema", schema)),
                         plain], use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.token_ids == clean.token_ids[:5]  # the five accepted tokens, nothing after
    assert c.text == llm.tokenizer.decode(clean.token_ids[:5], skip_special_tokens=True)
    assert c.finish_reason == "error" and c.stop_reason.startswith("grammar exception: ")
    assert f"injected {where} failure" in c.stop_reason
    assert outs[1].token_ids == alone
    after = _failures(llm)
    assert after.get("exception", 0) - before.get("exception", 0) == 1
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_blocks == 0


def test_failed_state_allows_only_eos(llm):
    import torch

    compiled = llm.engine.grammars.compile(StructuredSpec("choice", ["ab", "cd"]))
    st = compiled.new_state()
    st.failure = ("parser_error", "test")
    bm = torch.zeros((1, (llm.engine.model_config.vocab_size + 31) // 32), dtype=torch.int32)
    st.fill(bm, 0)
    allowed = unpack_bitmask(bm, llm.engine.model_config.vocab_size)[0].isfinite().nonzero().flatten().tolist()
    assert allowed == [llm.engine.eos_token_ids[0]]
    assert not st.accept(allowed[0]) and st.consumed == 0 and not st.done
