"""The model runner: one forward pass over a flat batch, for one rank.

For a step's scheduled sequences it builds (all on the KV cache's device), through the one
builder :func:`pagedkv.kv.block_table.build_slots`:

* ``input_ids`` / ``positions`` ``[T]`` int64: each sequence's new tokens at positions
  ``num_computed ...``;
* ``block_tables`` int32 ``[num_seqs, max_blocks]`` (padded with 0);
* ``slot_mapping`` int64 ``[T]``: ``block_tables[seq, pos // block_size] * block_size +
  pos % block_size`` (seed §02);
* ``seq_lens`` / ``query_start_loc``;

applies the step's copy-on-write block copies, runs the model (which writes K/V through
``slot_mapping`` and reads through ``block_tables``), and returns the logits of the rows
that sample a token.

Hybrid models (``layer_windows`` with full and sliding-window layers, see
``pagedkv.kv.groups``): every layer group has its own block tables and slot mapping, so
``prepare`` takes per sequence one block table per group and builds one ``AttentionMetadata``
per group; the model gets one metadata per layer (its group's). The KV memory is
``max_layers`` per-layer caches of ``num_blocks`` blocks; the ``j``-th layer of every group
uses cache ``j`` (a block id belongs to one group at a time, so the groups never collide). It knows nothing of requests or the scheduler: every input is an
explicit argument, so the tensor-parallel workers run the same code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from pagedkv.attention import prefault
from pagedkv.attention.base import AttentionMetadata
from pagedkv.kv.block_table import build_slots
from pagedkv.kv.groups import LayerGroups
from pagedkv.utils import profile_scope
from pagedkv.worker.kv_transfer import BlockPayloadCodec, run_transfer


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata | list[AttentionMetadata]  # one, or one per layer (hybrid)
    logits_indices: torch.Tensor  # int64 [num_sampling + extra]: rows of T whose logits are returned
    num_sample_rows: int = -1  # the first num_sample_rows of logits_indices sample (-1: all)
    groups: list[AttentionMetadata] | None = None  # per layer group (None: just ``metadata``)


class ModelRunner:
    """Owns the model, the attention backend and one KV cache object per layer. ``dtype`` is
    the cache's: a torch dtype, or a quantised format name (``"int8"``, ``"fp8_e4m3"``,
    ``"fp8_e5m2"``) with ``quant_group_size`` elements per scale (None: ``head_dim``).
    ``layer_windows``: per layer ``None`` (full attention) or its sliding window in tokens
    (None: all full); it decides the layer groups (see the module doc). ``latent``: the
    model is MLA (``ModelConfig.is_mla``; the worker passes it): its caches are
    ``pagedkv.model.mla.allocate_latent_cache``'s, one ``head_dim``-wide latent per token in
    K, no V."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: str | torch.device = "cpu",
        quant_group_size: int | None = None,
        layer_windows: Sequence[int | None] | None = None,
        latent: bool = False,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.groups = LayerGroups.from_layer_windows(layer_windows, num_layers)
        quant = {} if quant_group_size is None else {"quant_group_size": quant_group_size}
        allocate = backend.allocate_kv_cache
        if latent:  # MLA: one latent per token, K only
            from pagedkv.model.mla import allocate_latent_cache

            allocate = functools.partial(allocate_latent_cache, backend)
        #: the allocated caches (``max_layers`` of them); ``kv_caches[i]`` is layer i's
        self.shared_caches = [
            allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device, **quant)
            for _ in range(self.groups.max_layers)
        ]
        self.kv_caches = [self.shared_caches[j] for j in self.groups.slot_of_layer]
        #: the background prefault of the CPU caches' pages (``pagedkv.attention.prefault``)
        self.prefault: prefault.KVPrefault | None = None
        if prefault.enabled() and self.device.type == "cpu":
            self.prefault = prefault.KVPrefault(prefault.cache_tensors(self.shared_caches, num_blocks), num_blocks).start()
        self._codec: BlockPayloadCodec | None = None
        #: the compiled step (``pagedkv.model.compiled.CompiledDecode``) when enabled: the runner
        #: owns it and calls it in place of the model's forward for the steps it accepts
        self.compiled: Any = None

    def compile_steps(self, max_rows: int, progress: bool = True) -> Any:
        """Compile the model's steps of 1 .. ``max_rows`` tokens (``torch.compile``, warmed now)
        and run them compiled from then on. Returns the ``CompiledDecode``; a compile failure is
        logged and leaves the steps eager (``failed`` says why)."""
        from pagedkv.model.compiled import compile_decode

        self.compiled = compile_decode(self.model, max_rows=max_rows, progress=progress)
        return self.compiled

    def prepare(
        self,
        token_ids: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        sample: Sequence[bool],
        prompt_rows: Sequence[int] = (),
    ) -> ModelInput:
        """Flat-batch tensors for one step. Sequence ``i`` computes the tokens
        ``token_ids[i]`` at positions ``num_computed[i] ...``; ``block_ids[i]`` is its block
        table (physical block ids, logical order); ``sample[i]``: whether its last new token's
        logits are returned by :meth:`execute`; ``prompt_rows[i]`` (optional, default 0): how
        many of sequence ``i``'s first new tokens also have their logits returned (prompt
        logprobs), after all the sampled rows, in sequence order. With several layer groups
        ``block_ids[i]`` is one block table per group. Raises ``InvalidRequestError`` when a
        position has no block."""
        qlens = [len(t) for t in token_ids]
        ng = self.groups.num_groups
        per_group = [build_slots([ids[g] for ids in block_ids] if ng > 1 else block_ids,
                                 num_computed, qlens, self.block_size) for g in range(ng)]
        b = per_group[0]
        group_md = [AttentionMetadata.from_slots(x, qlens, self.device) for x in per_group]
        ends = b.query_start_loc[1:].astype(np.int64) - 1
        dev = self.device
        flat = [t for ids in token_ids for t in ids]
        rows = ends[np.asarray(sample, dtype=bool)]
        num_sample = len(rows)
        if any(prompt_rows):
            starts = b.query_start_loc[:-1].astype(np.int64)
            rows = np.concatenate([rows] + [np.arange(s, s + k, dtype=np.int64) for s, k in zip(starts, prompt_rows)])
        return ModelInput(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(b.positions).to(dev),
            metadata=self.layer_metadata(group_md),
            logits_indices=torch.from_numpy(rows).to(dev),
            num_sample_rows=num_sample,
            groups=group_md,
        )

    def layer_metadata(self, per_group: list[AttentionMetadata]) -> AttentionMetadata | list[AttentionMetadata]:
        """The model's metadata argument: the one group's, or per layer its group's."""
        if len(per_group) == 1:
            return per_group[0]
        return [per_group[g] for g in self.groups.layer_group]

    def close(self) -> None:
        """Stop the caches' background prefault (idempotent); the caches stay usable."""
        if self.prefault is not None:
            self.prefault.stop()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply copy-on-write copies (src -> dst) in every layer, before the step's writes
        (each allocated cache once: a block id belongs to one layer group)."""
        if copies:
            for cache in self.shared_caches:
                self.backend.copy_blocks(cache, copies)

    def kv_payload_codec(self) -> BlockPayloadCodec:
        """How one block's K/V (every layer) travel to the KV tiers: bytes and format."""
        if self._codec is None:
            self._codec = BlockPayloadCodec(self.backend, self.kv_caches, self.device)
        return self._codec

    def transfer_kv(self, transfer: Any, stores: Any) -> None:
        """Run a step's ``KVTransfer`` with the tiers' ``TierStores`` before the step's CoW
        copies and forward (see ``worker.kv_transfer``); ``None`` is a no-op."""
        if transfer is not None:
            with profile_scope("pagedkv.kv_transfer"):
                run_transfer(self.kv_payload_codec(), transfer, stores, self._recompute_block)

    def _recompute_block(self, load: Any) -> None:
        """Rebuild the K/V of a block whose load failed from its tokens (int64 LE bytes)
        at its position, attending over its context blocks."""
        toks = np.frombuffer(load.entry.token_bytes, dtype="<i8").tolist()
        self.execute(self.prepare([toks], [load.position], [load.context_block_ids], [False]))

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Run the model; returns fp32 logits ``[num_sampling + prompt rows, vocab]`` (the
        rows of ``inp.logits_indices``)."""
        with profile_scope("pagedkv.forward"):
            hidden = None
            cd = self.compiled
            if cd is not None and cd.accepts(inp.input_ids.shape[0]):
                # None: the compiler failed (logged once, eager from then on)
                hidden = cd(inp.input_ids, inp.positions, self.kv_caches, inp.metadata, self.backend)
            if hidden is None:
                hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata, self.backend)
        if inp.logits_indices.numel() == 0:
            return torch.empty((0, 0))
        with profile_scope("pagedkv.logits"):
            return self.model.compute_logits(hidden[inp.logits_indices]).float()
