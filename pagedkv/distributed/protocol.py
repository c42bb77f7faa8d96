"""What the driver broadcasts each step, as two int64 tensors (torch.distributed broadcasts).

* the **header** ``[HEADER_LEN]``: ``cmd, T, S, B, C, L, max_query_len, max_seq_len, G`` with
  ``T`` tokens, ``S`` sequences, ``B`` block-table width, ``C`` CoW copies, ``L`` sampled rows,
  ``G`` KV layer groups (1 unless the model mixes full and sliding-window layers);
* the **payload** (``STEP`` only), the concatenation of
  ``input_ids[T]``, ``positions[T]``, ``slot_mapping[G*T]``, ``block_tables[G*S*B]`` (group by
  group), ``seq_lens[S]``, ``query_start_loc[S+1]``, ``logits_indices[L]``, ``copies[2C]``
  (src, dst pairs). Its length is ``payload_len(header)``. A worker hands each layer its
  group's metadata (``ModelRunner.layer_metadata``).

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
HEADER_LEN = 9


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
    _, t, s, b, c, n_logits, _, _, g = (int(x) for x in h.tolist())
    return (2 + g) * t + g * s * b + s + (s + 1) + n_logits + 2 * c


def pack_step(inp: ModelInput, copies: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` CPU int64 tensors for one step's ``inp`` and CoW ``copies``."""
    groups = inp.groups or [inp.metadata]
    md = groups[0]
    t, s = int(inp.input_ids.shape[0]), int(md.seq_lens.shape[0])
    b = max(int(x.block_tables.shape[1]) if x.block_tables.dim() == 2 else 0 for x in groups)
    h = torch.tensor(
        [CMD_STEP, t, s, b, len(copies), int(inp.logits_indices.shape[0]), md.max_query_len, md.max_seq_len,
         len(groups)],
        dtype=torch.int64,
    )
    cp = torch.tensor([x for pair in copies for x in pair], dtype=torch.int64)
    tables = [torch.nn.functional.pad(x.block_tables.reshape(s, -1), (0, b - x.block_tables.reshape(s, -1).shape[1]))
              for x in groups]
    parts = [inp.input_ids, inp.positions, *(x.slot_mapping for x in groups), *(x.reshape(-1) for x in tables),
             md.seq_lens, md.query_start_loc, inp.logits_indices, cp]
    payload = torch.cat([p.to(device="cpu", dtype=torch.int64) for p in parts])
    return h, payload


def unpack_step(
    h: torch.Tensor, payload: torch.Tensor, device: torch.device | str = "cpu"
) -> tuple[ModelInput, list[tuple[int, int]]]:
    """Inverse of ``pack_step``: a ``ModelInput`` on ``device`` (workers never sample) and the
    CoW copies. ``metadata`` is group 0's; ``groups`` holds every group's (hand each layer its
    own with ``ModelRunner.layer_metadata``)."""
    _, t, s, b, c, n_logits, max_q, max_s, g = (int(x) for x in h.tolist())
    sizes = [t, t] + [t] * g + [s * b] * g + [s, s + 1, n_logits, 2 * c]
    parts = torch.split(payload, sizes)
    ids, pos = parts[0], parts[1]
    seq_lens, qsl, logits_idx, cp = parts[2 + 2 * g:]
    seq_lens_list = seq_lens.tolist()
    qsl_list = qsl.tolist()
    groups = [AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=bt.reshape(s, b).to(torch.int32).to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        query_start_loc=qsl.to(torch.int32).to(device),
        max_query_len=max_q,
        max_seq_len=max_s,
        seq_lens_list=seq_lens_list,
        query_lens_list=[qsl_list[i + 1] - qsl_list[i] for i in range(s)],
    ) for slots, bt in zip(parts[2:2 + g], parts[2 + g:2 + 2 * g])]
    inp = ModelInput(
        input_ids=ids.to(device), positions=pos.to(device), metadata=groups[0],
        logits_indices=logits_idx.to(device), groups=groups,
    )
    pairs = cp.view(-1, 2).tolist()
    return inp, [(int(a), int(d)) for a, d in pairs]
