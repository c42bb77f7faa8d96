"""The n-gram (prompt lookup) proposer (pagedkv/worker/ngram_proposer.py): the longest
n-gram first, its most recent earlier match, ``ngram_min``, ``max_tokens`` and ``k`` caps,
bad options as ConfigErrors (no model)."""

import pytest

from pagedkv.errors import ConfigError
from pagedkv.worker.ngram_proposer import NgramProposer


def test_longest_ngram_first_most_recent_match():
    p = NgramProposer(k=3, ngram_min=1, ngram_max=3)
    # last 3 tokens (7, 8, 9) occurred at 1..3, followed by 4, 5, 6
    assert p.lookup([0, 7, 8, 9, 4, 5, 6, 1, 7, 8, 9]) == [4, 5, 6]
    # the most recent of two matches of (8, 9) wins
    assert p.lookup([8, 9, 1, 2, 8, 9, 3, 4, 8, 9]) == [3, 4, 8]
    # no 3- or 2-gram match: the last token alone (5 at index 0 -> 6, 7, 8)
    assert p.lookup([5, 6, 7, 8, 1, 2, 5]) == [6, 7, 8]
    # the continuation may be shorter than k
    assert p.lookup([3, 4, 3]) == [4, 3]
    assert p.lookup([1, 2, 3]) == []
    assert p.lookup([1]) == []
    assert p.lookup([1, 2, 1, 2, 1], max_tokens=1) == [2]
    assert p.lookup([1, 2, 1, 2, 1], max_tokens=0) == []


def test_ngram_min_limits_the_match():
    p = NgramProposer(k=2, ngram_min=2, ngram_max=2)
    assert p.lookup([5, 6, 7, 8, 1, 2, 5]) == []  # only a 1-gram matches
    assert p.lookup([1, 5, 6, 7, 1, 5]) == [6, 7]


@pytest.mark.parametrize("kw, msg", [
    ({"k": 0}, "num_speculative_tokens must be a positive integer"),
    ({"ngram_min": 0}, "ngram_min must be a positive integer"),
    ({"ngram_max": True}, "ngram_max must be a positive integer"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min (3) must be <= ngram_max (2)"),
])
def test_bad_proposer_options_are_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        NgramProposer(**kw)
