"""The conformance kit's scenarios (:class:`Case`): what ``pagedkv.testing.conformance`` runs
every backend through. Shapes, lengths and per-layer options only; the kit builds the cache,
the metadata and the oracle from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Case:
    """One conformance scenario. ``seq_lens[i]`` is sequence i's context length after the step
    (tokens), ``query_lens[i]`` its new tokens this step (1 = decode). ``shared_prefix_blocks``
    leading full blocks are the *same physical blocks* in every sequence (prefix caching)."""

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    shared_prefix_blocks: int = 0
    table_padding: int = 2  # extra block-table entries per row, pointing at NaN blocks
    spare_blocks: int = 3  # unused (NaN) physical blocks
    tags: tuple[str, ...] = ()
    kv_cache_dtype: str | None = None  # None: the query dtype; else int8 | fp8_e4m3 | fp8_e5m2
    quant_group_size: int | None = None  # elements per scale (None: head_dim)
    sliding_window: int | None = None  # tokens; forward(..., sliding_window=)
    logits_soft_cap: float | None = None  # forward(..., logits_soft_cap=)

    def window_start(self, i: int) -> int:
        """First position sequence ``i``'s earliest new token sees (0 without a window):
        positions before it are never written (NaN) and whole blocks before it are the null
        block in the table, as after the KV manager freed them."""
        w = self.sliding_window
        return max(0, self.seq_lens[i] - self.query_lens[i] - w + 1) if w else 0

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads


def conformance_cases(small: bool = False) -> list[Case]:
    """The scenarios the issue asks for. ``small=True`` keeps only shapes cheap enough for an
    interpreter (Triton ``TRITON_INTERPRET=1``): same coverage, shorter contexts."""
    long_ctx = 600 if small else 1100  # spans many blocks; >= 1024 triggers split-K paths
    cases = [
        # seed §03's worked example: A=17, B=33, C=8 tokens, block_size 16, decode
        Case("seed03_decode", (17, 33, 8), (1, 1, 1), 16, 6, 2, 32, tags=("decode", "partial_block")),
        Case("block_size_1", (5, 9, 1), (1, 4, 1), 1, 4, 2, 16, tags=("bs1", "mixed")),
        Case("block_size_2_prefill", (7, 12), (7, 5), 2, 4, 1, 16, tags=("prefill", "mqa")),
        Case("block_size_128", (130, 7), (1, 7), 128, 4, 2, 16, tags=("bs128", "mixed")),
        Case("mha_ratio1", (23, 40), (1, 3), 8, 4, 4, 32, tags=("gqa1",)),
        Case("smollm_shape_gqa3", (45, 64, 3), (1, 16, 3), 16, 9, 3, 64, tags=("gqa3", "mixed")),
        Case("gqa8", (31, 19), (1, 19), 4, 16, 2, 32, tags=("gqa8", "mixed")),
        Case("mqa", (50, 12), (2, 1), 8, 8, 1, 32, tags=("mqa",)),
        Case("head_dim_128", (20, 9), (1, 9), 8, 4, 2, 128, tags=("d128",)),
        Case("long_context_decode", (long_ctx,), (1,), 16, 4, 2, 32, tags=("long", "decode", "split")),
        Case("long_context_batch", (long_ctx // 2, 77, long_ctx // 3), (1, 1, 1), 16, 6, 2, 32,
             tags=("long", "decode")),
        Case("prefill_from_scratch", (37,), (37,), 8, 6, 2, 32, tags=("prefill", "partial_block")),
        Case("chunked_prefill_cached_context", (50, 41), (13, 40), 16, 6, 3, 32, tags=("prefill", "chunked")),
        Case("mixed_prefill_decode", (40, 25, 70, 1), (1, 25, 9, 1), 16, 6, 2, 32, tags=("mixed",)),
        # 3 sequences share their first 2 blocks; the second has its whole prompt cached except
        # its last token (seq_len = 2*bs + 1, q_len 1); the third is a chunk after the prefix
        Case("shared_prefix", (37, 33, 45), (1, 1, 13), 16, 6, 2, 32, shared_prefix_blocks=2,
             tags=("prefix", "cached_all_but_last")),
        Case("shared_prefix_bs1", (9, 7), (2, 1), 1, 4, 2, 16, shared_prefix_blocks=6, tags=("prefix", "bs1")),
    ]
    return cases + window_cases(small) + quantized_cases(small)


def window_cases(small: bool = False) -> list[Case]:
    """Sliding windows (smaller than, equal to, and spanning several blocks; a long split-K
    context) and logit soft-capping (alone and with a window), each mixing decode rows,
    prefills and chunks over cached context. Blocks wholly before a sequence's window are the
    null block (NaN) in its table: a backend that reads them fails."""
    long_ctx = 600 if small else 1100
    return [
        Case("window_lt_block", (37, 20, 9), (1, 20, 4), 8, 6, 2, 32, sliding_window=3, tags=("window", "mixed")),
        Case("window_eq_block", (40, 33, 17), (1, 12, 2), 8, 4, 2, 32, sliding_window=8, tags=("window", "chunked")),
        Case("window_spans_blocks", (61, 45, 10), (1, 17, 3), 4, 8, 2, 32, sliding_window=20,
             tags=("window", "chunked")),
        Case("window_bs1", (30, 12), (1, 5), 1, 4, 1, 16, sliding_window=7, tags=("window", "bs1", "mqa")),
        Case("window_long_decode", (long_ctx, long_ctx // 2), (1, 1), 16, 4, 2, 32, sliding_window=long_ctx // 2 + 5,
             tags=("window", "long", "split")),
        Case("softcap_mixed", (50, 41, 9), (13, 40, 1), 16, 6, 3, 32, logits_soft_cap=2.0, tags=("softcap", "mixed")),
        Case("window_softcap", (30, 25, 18), (1, 25, 6), 4, 6, 2, 32, sliding_window=10, logits_soft_cap=2.0,
             tags=("window", "softcap", "mixed")),
    ]



def quantized_cases(small: bool = False) -> list[Case]:
    """The quantised-cache scenarios, in every KV format this torch has (int8, fp8_e4m3,
    fp8_e5m2): decode, mixed prefill/decode, a long split-K context, a shared prefix, and group
    sizes below the head dim (32 of 128; 4 of 32, which the CPU kernel leaves to torch)."""
    from pagedkv.attention.quant import FORMATS

    long_ctx = 600 if small else 1100
    shapes = [
        Case("q_seed03_decode", (17, 33, 8), (1, 1, 1), 16, 6, 2, 32, tags=("decode",)),
        Case("q_mixed_prefill_decode", (40, 25, 70), (1, 25, 9), 16, 9, 3, 64, tags=("mixed", "gqa3")),
        Case("q_long_context_decode", (long_ctx,), (1,), 16, 4, 2, 32, tags=("long", "split")),
        Case("q_shared_prefix", (37, 33, 45), (1, 1, 13), 16, 6, 2, 32, shared_prefix_blocks=2, tags=("prefix",)),
        Case("q_group32_d128", (20, 9), (1, 9), 8, 4, 2, 128, quant_group_size=32, tags=("d128", "group")),
        Case("q_group4_bs1", (9, 5), (1, 5), 1, 4, 1, 32, quant_group_size=4, tags=("bs1", "group", "mqa")),
        Case("q_window_softcap", (40, 25, 18), (1, 25, 3), 4, 6, 2, 32, sliding_window=10, logits_soft_cap=2.0,
             tags=("window", "softcap")),
    ]
    return [replace(c, name=f"{c.name}_{fmt}", kv_cache_dtype=fmt, tags=c.tags + ("quantized",))
            for fmt in FORMATS for c in shapes]
