"""The feature builder (pagedkv/engine/builder.py) without a model: speculation off gives no
proposer, "ngram" the n-gram proposer, a bad draft model a ConfigError naming it; the grammar
compiler is the model's."""

import pytest

from pagedkv.engine.builder import make_grammar_compiler, make_proposer
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.ngram_proposer import NgramProposer


def test_speculation_off_or_ngram():
    assert make_proposer(EngineConfig.from_kwargs({}), None, "m") is None
    ngram = make_proposer(EngineConfig.from_kwargs({"speculative": "ngram", "num_speculative_tokens": 3}), None, "m")
    assert ngram == NgramProposer(3, 2, 3)


def test_a_bad_draft_model_is_a_config_error():
    cfg = EngineConfig.from_kwargs({"speculative": "draft:/no/such/model"})
    with pytest.raises(ConfigError, match="speculative draft model '/no/such/model'"):
        make_proposer(cfg, None, "m")


def test_grammar_compiler_is_built_for_the_model():
    tok = object()
    gc = make_grammar_compiler(tok, 99, [7, 8])
    assert (gc.hf_tokenizer, gc.vocab_size, gc.eos_token_ids) == (tok, 99, [7, 8])
