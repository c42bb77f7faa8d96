"""What the driver broadcasts each step, as two int64 tensors (torch.distributed broadcasts).

* the **header** ``[HEADER_LEN]``: ``cmd, T, S, B, C, L, max_query_len, max_seq_len`` with
  ``T`` tokens, ``S`` sequences, ``B`` block-table width, ``C`` CoW copies, ``L`` sampled rows;
* the **payload** (``STEP`` only), the concatenation of
  ``input_ids[T]``, ``positions[T]``, ``slot_mapping[T]``, ``block_tables[S*B]``,
  ``seq_lens[S]``, ``query_start_loc[S+1]``, ``logits_indices[L]``, ``copies[2C]`` (src, dst
  pairs). Its length is ``payload_len(header)``.

The header travels first on its own so that a worker, idle between steps, learns the command
and the payload size; see ``pagedkv.distributed.executor`` for which process group carries what.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.worker.runner import ModelInput

CMD_STEP, CMD_INFO, CMD_SHUTDOWN = 1, 2, 3
HEADER_LEN = 8


DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0


def default_timeouts() -> tuple[float, float]:
    """``(timeout_s, startup_timeout_s)`` from ``PAGEDKV_TP_TIMEOUT`` (a step's collectives)
    and ``PAGEDKV_TP_STARTUP_TIMEOUT`` (loading and joining), in seconds."""

    def get(name: str, default: float) -> float:
        raw = os.environ.get(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
        if not value > 0:
            raise ConfigError(f"{name} must be positive, got {raw!r}")
        return value

    return get("PAGEDKV_TP_TIMEOUT", DEFAULT_TIMEOUT_S), get("PAGEDKV_TP_STARTUP_TIMEOUT", DEFAULT_STARTUP_TIMEOUT_S)


def header(cmd: int) -> torch.Tensor:
    """A header for a command without payload (``CMD_INFO``, ``CMD_SHUTDOWN``)."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = cmd
    return h


def payload_len(h: torch.Tensor) -> int:
    """Elements of the payload announced by header ``h``."""
    _, t, s, b, c, n_logits, _, _ = (int(x) for x in h.tolist())
    return 3 * t + s * b + s + (s + 1) + n_logits + 2 * c


def pack_step(inp: ModelInput, copies: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` CPU int64 tensors for one step's ``inp`` and CoW ``copies``."""
    md = inp.metadata
    t, s = int(inp.input_ids.shape[0]), int(md.seq_lens.shape[0])
    bt = md.block_tables
    b = int(bt.shape[1]) if bt.dim() == 2 else 0
    h = torch.tensor(
        [CMD_STEP, t, s, b, len(copies), int(inp.logits_indices.shape[0]), md.max_query_len, md.max_seq_len],
        dtype=torch.int64,
    )
    cp = torch.tensor([x for pair in copies for x in pair], dtype=torch.int64)
    parts = [inp.input_ids, inp.positions, md.slot_mapping, bt.reshape(-1), md.seq_lens,
             md.query_start_loc, inp.logits_indices, cp]
    payload = torch.cat([p.to(device="cpu", dtype=torch.int64) for p in parts])
    return h, payload


def unpack_step(
    h: torch.Tensor, payload: torch.Tensor, device: torch.device | str = "cpu"
) -> tuple[ModelInput, list[tuple[int, int]]]:
    """Inverse of ``pack_step``: a ``ModelInput`` on ``device`` (workers never sample) and the CoW copies."""
    _, t, s, b, c, n_logits, max_q, max_s = (int(x) for x in h.tolist())
    sizes = [t, t, t, s * b, s, s + 1, n_logits, 2 * c]
    ids, pos, slots, bt, seq_lens, qsl, logits_idx, cp = torch.split(payload, sizes)
    seq_lens_list = seq_lens.tolist()
    qsl_list = qsl.tolist()
    md = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=bt.reshape(s, b).to(torch.int32).to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        query_start_loc=qsl.to(torch.int32).to(device),
        max_query_len=max_q,
        max_seq_len=max_s,
        seq_lens_list=seq_lens_list,
        query_lens_list=[qsl_list[i + 1] - qsl_list[i] for i in range(s)],
    )
    inp = ModelInput(
        input_ids=ids.to(device), positions=pos.to(device), metadata=md,
        logits_indices=logits_idx.to(device),
    )
    pairs = cp.view(-1, 2).tolist()
    return inp, [(int(a), int(d)) for a, d in pairs]
