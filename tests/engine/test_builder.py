"""The feature builder (pagedkv/engine/builder.py) without a model: speculation off or
n-gram gives the scheduler's proposer and no step hook; a draft model's hook prefetches
before schedule() and frees the blocks of requests that stopped running; StepHook's
default does nothing; the grammar compiler is the model's."""

from types import SimpleNamespace

import pytest

from pagedkv.engine.builder import DraftModelHook, StepHook, load_speculation, make_grammar_compiler
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.spec_decode import NgramProposer
from pagedkv.errors import ConfigError


def test_speculation_off_or_ngram_needs_no_hook():
    off = load_speculation(EngineConfig.from_kwargs({}), None, 8, "m", 64)
    assert (off.proposer, off.draft, off.hooks) == (None, None, [])
    ngram = load_speculation(EngineConfig.from_kwargs({"speculative": "ngram", "num_speculative_tokens": 3}),
                             None, 8, "m", 64)
    assert ngram.proposer == NgramProposer(3, 2, 3) and ngram.draft is None and ngram.hooks == []


def test_a_bad_draft_model_is_a_config_error():
    cfg = EngineConfig.from_kwargs({"speculative": "draft:/no/such/model"})
    with pytest.raises(ConfigError, match="speculative draft model '/no/such/model'"):
        load_speculation(cfg, None, 8, "m", 64)


class _Draft:
    def __init__(self):
        self.calls = []

    def prefetch(self, running, max_model_len, budget):
        self.calls.append(("prefetch", [r.request_id for r in running], max_model_len, budget))

    def retain(self, ids):
        self.calls.append(("retain", sorted(ids)))


def test_draft_model_hook_prefetches_and_retains_the_running_rows():
    draft = _Draft()
    hook = DraftModelHook(draft, max_model_len=128, budget=32)
    running = [SimpleNamespace(request_id="b"), SimpleNamespace(request_id="a")]
    hook.before_schedule(running)
    hook.retain(running[1:])
    assert draft.calls == [("prefetch", ["b", "a"], 128, 32), ("retain", ["a"])]
    plain = StepHook()  # the default participant does nothing
    assert plain.before_schedule(running) is None and plain.retain(running) is None


def test_grammar_compiler_is_built_for_the_model():
    tok = object()
    gc = make_grammar_compiler(tok, 99, [7, 8])
    assert (gc.hf_tokenizer, gc.vocab_size, gc.eos_token_ids) == (tok, 99, [7, 8])
