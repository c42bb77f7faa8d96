"""The compiled sampler picks (pagedkv/ops/sample_ops.py) on hand-made rows: first maximum
with ties and strided rows, the two-level inverse-CDF pick at every block size, the input
checks, and the PAGEDKV_FUSED switch."""

import pytest
import torch

from pagedkv.ops import sample_ops


@pytest.fixture(scope="module")
def ops():
    o = sample_ops.get()
    assert o is not None, sample_ops.build_error()  # a C compiler is part of the set-up
    assert sample_ops.build_error() is None
    return o


def test_argmax_first_maximum_per_row(ops):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                      [-float("inf"), -5.0, -float("inf"), -5.0],
                      [7.0, 7.0, 7.0, 7.0]])
    assert ops.argmax_rows(x) == [1, 1, 0]
    assert ops.argmax_rows(torch.tensor([[2.5]])) == [0]


def test_argmax_across_its_1024_token_blocks_and_on_strided_rows(ops):
    x = torch.zeros(2, 3000)
    x[0, 2999] = 1.0  # in the last, partial block
    x[1, 1024] = 1.0
    x[1, 2048] = 1.0  # a tie in a later block: the first wins
    assert ops.argmax_rows(x) == [2999, 1024]
    wide = torch.zeros(3, 10)
    wide[:, 7] = 5.0  # outside the view
    wide[0, 2], wide[1, 0], wide[2, 4] = 1.0, 1.0, 1.0
    view = wide[:, :5]  # row stride 10, column stride 1
    assert view.stride() == (10, 1) and ops.argmax_rows(view) == [2, 0, 4]


@pytest.mark.parametrize("block", [1, 2, 3, 256])
def test_inverse_cdf_pick_at_every_block_size(ops, block):
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],   # cumsum .5 .5 .75 1
                          [0.0, 0.0, 0.0, 0.0, 0.0, 4.0],     # only the last token
                          [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])    # unnormalised, total 4
    u = torch.tensor([0.6, 0.0, 0.5], dtype=torch.float64)
    assert ops.inverse_cdf_pick(probs, u, block) == [3, 5, 2]
    u = torch.tensor([0.4999, 0.999, 0.2499], dtype=torch.float64)
    assert ops.inverse_cdf_pick(probs, u, block) == [1, 5, 0]
    u = torch.tensor([1.0 - 2.0 ** -53] * 3, dtype=torch.float64)  # never past the last kept token
    assert ops.inverse_cdf_pick(probs, u, block) == [4, 5, 3]


@pytest.mark.parametrize("bad, fragment", [
    (torch.zeros(2, 3, dtype=torch.float64), "x: need a CPU float32 [rows, vocab >= 1] tensor"),
    (torch.zeros(3), "x: need a CPU float32 [rows, vocab >= 1] tensor"),
    (torch.zeros(2, 0), "got torch.float32 (2, 0)"),
    (torch.zeros(4, 3).t(), "strides (1, 3)"),
])
def test_argmax_rejects_what_the_c_code_does_not_take(ops, bad, fragment):
    with pytest.raises(ValueError) as e:
        ops.argmax_rows(bad)
    assert fragment in str(e.value)


def test_pick_rejects_bad_uniforms_and_block(ops):
    p = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"u: need a contiguous CPU float64 \[2\] tensor, got torch.float32"):
        ops.inverse_cdf_pick(p, torch.zeros(2), 4)
    with pytest.raises(ValueError, match=r"u: need a contiguous CPU float64 \[2\] tensor, got torch.float64 \(3,\)"):
        ops.inverse_cdf_pick(p, torch.zeros(3, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match=r"u: need a contiguous"):
        ops.inverse_cdf_pick(p, torch.zeros(4, dtype=torch.float64)[::2], 4)
    with pytest.raises(ValueError, match="block must be >= 1 token, got 0"):
        ops.inverse_cdf_pick(p, torch.zeros(2, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="probs: need a CPU float32"):
        ops.inverse_cdf_pick(p.double(), torch.zeros(2, dtype=torch.float64), 4)


def test_the_switch_turns_the_ops_off(monkeypatch):
    monkeypatch.setenv("PAGEDKV_FUSED", "0")
    off = sample_ops.BuiltOnce("PAGEDKV_FUSED", lambda: 1 / 0)
    assert off.get() is None and off.error() == "disabled by PAGEDKV_FUSED=0"
    monkeypatch.setenv("PAGEDKV_FUSED", "1")
    broken = sample_ops.BuiltOnce("PAGEDKV_FUSED", lambda: 1 / 0)
    assert broken.get() is None and broken.error() == "ZeroDivisionError: division by zero"


def test_the_switch_is_read_at_every_call_and_never_cached(monkeypatch):
    """A process whose first ``get()`` ran with the switch at ``0`` (a test's monkeypatch, a
    user's one-off run) builds the helper once the switch is unset: the off state is not
    remembered (it once was, which left a pytest worker without the native step for every
    later test)."""
    builds = []
    once = sample_ops.BuiltOnce("PAGEDKV_FUSED", lambda: builds.append(1) or "ops")
    monkeypatch.setenv("PAGEDKV_FUSED", "0")
    assert once.get() is None and once.error() == "disabled by PAGEDKV_FUSED=0" and builds == []
    monkeypatch.delenv("PAGEDKV_FUSED")
    assert once.get() == "ops" and once.get() == "ops" and once.error() is None and builds == [1]
    monkeypatch.setenv("PAGEDKV_FUSED", "0")
    assert once.get() is None and builds == [1]
