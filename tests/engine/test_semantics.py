"""Output semantics as vLLM defines them, in the engine (SmolLM2, greedy).

* the token that ends a request (EOS or one of ``stop_token_ids``) stays in ``token_ids``
  but its text is not in ``text``, also with ``skip_special_tokens=False``, unless
  ``include_stop_str_in_output`` (which also keeps a matched stop string); streamed text
  agrees with the final text;
* ``min_tokens``: EOS / stop_token_ids masked and stop strings ignored until that many
  tokens, speculative decoding included; validated;
* ``continue_final_message``: the last assistant message is left open;
* Gemma-3: a prompt that starts with ``<bos>`` gets no second one.

The expected tokens are this model's greedy outputs (fp32 on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.spec_decode import sample_with_drafts
from pagedkv.engine.structured import StructuredSpec
from pagedkv.errors import InvalidRequestError
from pagedkv.kv import check_invariants

EOS = 2  # <|im_end|>
PARIS = "The capital of France is"  # greedy: ' Paris', '.', '\n', '\n', 'The', ' answer', ' is', ':', ' ', '2', '0', '1'
PARIS_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]
SUM_Q = "What is 2+2? Answer with a number only."  # greedy chat answer: '2 + 2 = 4' <|im_end|>
SUM_IDS = [34, 1232, 216, 34, 446, 216, 36, EOS]
YES_NO = "Reply with one word: yes or no? Is the sky blue?"  # greedy: 'No' <|im_end|>


@pytest.fixture(scope="module")
def engine(loaded_model):
    return LLMEngine(loaded_model, num_blocks=64, block_size=16, max_model_len=256, debug_invariants=True)


def run(engine, prompt, stream: bool = False, **params):
    """The final output, and the texts of every output on the way (with ``stream``)."""
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, **params), stream=stream)
    texts = []
    while True:
        for o in engine.step():
            if o.request_id == rid:
                texts.append(o.text)
                if o.finished:
                    assert engine.kv.num_used_blocks == 0
                    return o, texts


def chat(engine, q):
    return engine.apply_chat_template([{"role": "user", "content": q}])


# ---- the stop token's text; include_stop_str_in_output -------------------------
def test_greedy_references(engine):
    assert run(engine, PARIS, max_tokens=12)[0].token_ids == PARIS_IDS
    o, _ = run(engine, chat(engine, SUM_Q), max_tokens=20)
    assert o.token_ids == SUM_IDS and o.text == "2 + 2 = 4"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_id_stays_in_token_ids_but_not_in_text(engine, stream):
    o, texts = run(engine, PARIS, stream=stream, max_tokens=12, stop_token_ids=[30])
    assert o.token_ids == [7042, 30] and o.text == " Paris"
    assert o.finish_reason == "stop" and o.outputs[0].stop_reason == 30
    o, texts2 = run(engine, PARIS, stream=stream, max_tokens=12, stop_token_ids=[30],
                    include_stop_str_in_output=True)
    assert o.token_ids == [7042, 30] and o.text == " Paris."
    if stream:  # every streamed text is a prefix of the final one
        assert texts == [" Paris", " Paris"] and texts2 == [" Paris", " Paris."]


@pytest.mark.parametrize("stream", [False, True])
def test_eos_text_is_left_out_with_skip_special_tokens_false(engine, stream):
    ids = chat(engine, SUM_Q)
    o, texts = run(engine, ids, stream=stream, max_tokens=20, skip_special_tokens=False)
    assert o.token_ids == SUM_IDS and o.text == "2 + 2 = 4" and o.outputs[0].stop_reason is None
    o, _ = run(engine, ids, stream=stream, max_tokens=20, skip_special_tokens=False, include_stop_str_in_output=True)
    assert o.token_ids == SUM_IDS and o.text == "2 + 2 = 4<|im_end|>"
    if stream:
        assert all("2 + 2 = 4".startswith(t) for t in texts) and texts[-1] == "2 + 2 = 4"


def test_stop_string_is_cut_or_kept(engine):
    o, _ = run(engine, PARIS, max_tokens=12, stop=["."])
    assert (o.text, o.token_ids, o.outputs[0].stop_reason) == (" Paris", [7042, 30], ".")
    o, _ = run(engine, PARIS, max_tokens=12, stop=[" is"], include_stop_str_in_output=True)
    assert o.text == " Paris.\n\nThe answer is" and o.token_ids == PARIS_IDS[:7]


def test_beam_hypotheses_leave_the_eos_text_out(engine):
    o, _ = run(engine, chat(engine, SUM_Q), max_tokens=12, beam_width=2, skip_special_tokens=False)
    stopped = [c for c in o.outputs if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        assert c.token_ids[-1] == EOS and "<|im_end|>" not in c.text
        assert c.text == engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=False)


# ---- min_tokens ----------------------------------------------------------------
def test_min_tokens_masks_eos_until_reached(engine):
    ids = chat(engine, YES_NO)
    o, _ = run(engine, ids, max_tokens=10)
    assert o.token_ids == [5230, EOS] and o.text == "No"
    o, _ = run(engine, ids, max_tokens=10, min_tokens=1)  # one token generated: EOS may follow
    assert o.token_ids == [5230, EOS]
    o, _ = run(engine, ids, max_tokens=10, min_tokens=4)
    assert o.token_ids[0] == 5230 and EOS not in o.token_ids[:4] and len(o.token_ids) >= 4


def test_min_tokens_masks_stop_token_ids_and_defers_stop_strings(engine):
    o, _ = run(engine, PARIS, max_tokens=12, stop_token_ids=[30], min_tokens=3)
    assert o.token_ids[0] == 7042 and 30 not in o.token_ids[:3]
    # the '.' of token 2 ends inside the first 3 tokens' text (" Paris.\n"): no stop there
    o, _ = run(engine, PARIS, max_tokens=12, stop=["."], min_tokens=3)
    assert o.token_ids == PARIS_IDS and o.text == " Paris.\n\nThe answer is: 201" and o.finish_reason == "length"
    o, _ = run(engine, PARIS, max_tokens=12, stop=[" is"], min_tokens=3)  # one that ends later does stop
    assert o.text == " Paris.\n\nThe answer" and o.finish_reason == "stop"


def test_min_tokens_validation(engine):
    for bad in (dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4), dict(min_tokens=1.5),
                dict(min_tokens=2, beam_width=2), dict(min_tokens=2, structured=StructuredSpec("json_object")),
                dict(include_stop_str_in_output=1)):
        with pytest.raises(InvalidRequestError, match="min_tokens|include_stop_str_in_output"):
            engine.add_request(None, PARIS, SamplingParams(**bad))
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    SamplingParams(min_tokens=4, max_tokens=4).validate()


def test_draft_positions_before_min_tokens_cannot_take_eos():
    """The speculative verify: EOS is every position's argmax; the drafts are 3, 4, EOS."""
    req = Request("r", [5, 6], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3), 0.0,
                  eos_token_ids=(0,), max_total_tokens=10)
    logits = torch.full((4, 10), -5.0)
    logits[:, 0] = 10.0  # EOS
    logits[0, 3] = logits[1, 4] = 5.0  # the drafts' tokens second
    logits[2, 7] = logits[3, 8] = 5.0
    drafts = {"r": [3, 4, 0]}
    _, runs = sample_with_drafts(Sampler(), logits[3:], [req], {"r": logits[:3]}, drafts)
    assert [t for t, _ in runs["r"]] == [3, 4, 7]  # EOS (draft 3) rejected before 3 tokens
    req.sampling_params.min_tokens = 0
    _, runs = sample_with_drafts(Sampler(), logits[3:], [req], {"r": logits[:3]}, drafts)
    assert [t for t, _ in runs["r"]] == [0]


def test_min_tokens_with_speculative_decoding_matches_plain_decoding(engine, loaded_model):
    spec = LLMEngine(loaded_model, num_blocks=64, block_size=16, max_model_len=256, speculative="ngram",
                     num_speculative_tokens=4, debug_invariants=True)
    rep = "one two three four five one two three four five one two three four five one two"
    cases = [(chat(engine, YES_NO), dict(max_tokens=12, min_tokens=6)),
             (chat(engine, SUM_Q), dict(max_tokens=16, min_tokens=10)),
             (chat(engine, "Repeat exactly: " + rep), dict(max_tokens=24, min_tokens=20))]
    for prompt, params in cases:
        want, _ = run(engine, prompt, **params)
        got, _ = run(spec, prompt, **params)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert EOS not in got.token_ids[:params["min_tokens"]]
    assert spec.get_stats().num_accepted_tokens > 0  # drafts were kept on the way
    check_invariants(spec.kv)


# ---- continue_final_message ----------------------------------------------------
def test_continue_final_message(engine, loaded_model):
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    ids = engine.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    closed = engine.apply_chat_template(conv, add_generation_prompt=False)
    tok = engine.tokenizer
    assert tok.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    assert tok.decode(closed).endswith("The capital of France is<|im_end|>\n")
    assert ids == closed[:len(ids)] and closed[len(ids)] == EOS
    o, _ = run(engine, ids, max_tokens=8)
    assert o.token_ids == [7042, 30, EOS] and o.text == " Paris."
    llm = LLM(loaded_model, num_blocks=32)
    [out] = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                     add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == ids and out.text == " Paris."
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        engine.apply_chat_template(conv, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="assistant"):
        engine.apply_chat_template(conv[:1], add_generation_prompt=False, continue_final_message=True)


# ---- no second BOS (Gemma-3) ---------------------------------------------------
def test_gemma3_prompt_starting_with_bos_gets_one(gemma3_loaded):
    template = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    eng = LLMEngine(gemma3_loaded, num_blocks=32, block_size=16, chat_template=template)
    want = [2, 818, 5279, 529, 7001, 563]  # <bos> The capital of France is
    assert eng.tokenize("The capital of France is") == want
    assert eng.tokenize("<bos>The capital of France is") == want
    assert eng.tokenize("<bos><bos>x")[:2] == [2, 2]  # two in the text: kept as written
    outs = {}
    for p in ("The capital of France is", "<bos>The capital of France is"):
        rid = eng.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=6))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[p] = o
        assert outs[p].prompt_token_ids == want
    assert outs["The capital of France is"].token_ids == outs["<bos>The capital of France is"].token_ids
    ids = eng.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert eng.kv.num_used_blocks == 0


def test_a_model_that_adds_no_bos_keeps_the_texts_own(engine):
    # SmolLM2's BOS is <|im_start|> (1) and its tokenizer adds none: nothing is dropped
    assert engine.tokenize("<|im_start|><|im_start|>hi") == [1, 1, 6004]
    assert engine.tokenize("<|im_start|>hi") == [1, 6004]


def test_priority_preemption_unschedules_the_low_priority_request_cleanly(loaded_model):
    """6 blocks of 4 tokens: A (priority 10, running first) and B (priority 0). When B needs a
    block A was already scheduled in that step; A is taken back out and preempted (before,
    B was), and both still give their greedy tokens alone."""
    tok = loaded_model.tokenizer
    pa, pb = tok("The capital of France is")["input_ids"], tok("Once upon a time, in a small village")["input_ids"]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = {}
    ref = LLMEngine(loaded_model, num_blocks=64, block_size=4, max_model_len=64)
    for rid, p in (("A", pa), ("B", pb)):
        ref.add_request(rid, p, sp)
        while ref.has_unfinished_requests():
            alone.update({o.request_id: o.token_ids for o in ref.step() if o.finished})
    eng = LLMEngine(loaded_model, num_blocks=6, block_size=4, max_model_len=64, policy="priority",
                    debug_invariants=True)
    eng.add_request("A", pa, sp, priority=10)
    eng.step()
    eng.add_request("B", pb, sp, priority=0)
    outs, preempted = {}, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        preempted += [r.request_id for r in eng.scheduler.waiting if r.status.name == "PREEMPTED"
                      and r.request_id not in preempted]
    assert preempted == ["A"]
    assert (outs["A"].metrics.num_preemptions, outs["B"].metrics.num_preemptions) == (1, 0)
    assert outs["A"].token_ids == alone["A"] and outs["B"].token_ids == alone["B"]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks == 6
    check_invariants(eng.kv)
