"""The model runner: turns a ``SchedulerOutput`` into one forward pass over a flat batch.

For the scheduled requests it builds (all on the KV cache's device):

* ``input_ids`` / ``positions`` ``[T]`` int64: each request's new tokens
  ``all_token_ids[num_computed : num_computed + n]`` at positions ``num_computed ...``;
* ``block_tables`` int32 ``[num_seqs, max_blocks]`` from the KV manager (padded with 0);
* ``slot_mapping`` int64 ``[T]``: ``block_tables[seq, pos // block_size] * block_size +
  pos % block_size`` (seed §02), computed for the whole batch in one gather;
* ``seq_lens`` / ``query_start_loc``;

applies the step's copy-on-write block copies, runs the model (which writes K/V through
``slot_mapping`` and reads through ``block_tables``), and returns the logits of each request
whose known tokens are now all computed (the rows that sample a token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pagedkv.attention.base import AttentionMetadata
from pagedkv.engine.request import Request


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling]
    sampling_requests: list[Request]


class ModelRunner:
    """Owns the model, the attention backend and one KV cache object per layer."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = [
            backend.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)
            for _ in range(num_layers)
        ]

    def prepare(self, scheduled: Sequence[tuple[Request, int]], block_ids: Sequence[list[int]]) -> ModelInput:
        """Flat-batch tensors for ``scheduled`` (request, num_new_tokens) pairs;
        ``block_ids[i]`` is request i's block table (physical block ids, logical order)."""
        bs = self.block_size
        num_seqs = len(scheduled)
        input_ids: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling: list[Request] = []
        offset = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            input_ids += req.all_token_ids[start : start + n]
            starts.append(start)
            qlens.append(n)
            seq_lens.append(start + n)
            offset += n
            if start + n == req.num_tokens:
                logits_rows.append(offset - 1)
                sampling.append(req)
        max_blocks = max(len(b) for b in block_ids)
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.int64)
        for i, b in enumerate(block_ids):
            table[i, : len(b)] = torch.tensor(b, dtype=torch.int64)
        qlens_t = torch.tensor(qlens, dtype=torch.int64)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(qlens_t, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), qlens_t)
        positions = torch.arange(offset, dtype=torch.int64) - qsl[:-1][seq_idx] + torch.tensor(starts, dtype=torch.int64)[seq_idx]
        slot_mapping = table[seq_idx, positions // bs] * bs + positions % bs
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=table.to(torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=qsl.to(torch.int32).to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens,
            query_lens_list=qlens,
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            metadata=md,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sampling_requests=sampling,
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply copy-on-write copies (src -> dst) in every layer, before the step's writes."""
        if copies:
            for cache in self.kv_caches:
                self.backend.copy_blocks(cache, copies)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Run the model; returns fp32 logits ``[num_sampling, vocab]``."""
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata, self.backend)
        if inp.logits_indices.numel() == 0:
            return torch.empty((0, 0))
        return self.model.compute_logits(hidden[inp.logits_indices]).float()
