"""A mixture-of-experts GGUF's experts on the integer kernels (``weights="gguf"``), one
``GGUFLinear`` per expert matrix, packed from the file's stored blocks.

llama.cpp stores a layer's experts stacked: ``blk.{i}.ffn_gate_exps.weight`` and
``ffn_up_exps.weight`` ``[E, I, H]``, ``ffn_down_exps.weight`` ``[E, H, I]`` (numpy order; GGML's
``ne`` reversed), and the router ``ffn_gate_inp.weight`` ``[E, H]`` (F32 as llama.cpp's
quantiser keeps it); gpt-oss adds their biases ``ffn_{gate,up}_exps.bias`` ``[E, I]`` and
``ffn_down_exps.bias`` ``[E, H]``, each expert's rows packed beside its weights (gate then up). Expert ``e``'s rows are one contiguous run of each stacked tensor (rows
``e * I .. (e + 1) * I``), so its gate and up rows are read straight into one buffer (its
``gate_up_proj``: gate rows then up rows, ``pagedkv.model.moe.Expert``) and its down rows into
another, each packed by ``qmm.pack_gguf`` into the kernels' layout, whose size is the file's
bytes for those rows: the experts hold the stored codes and nothing else. At decode only the
routed experts' packed weights are multiplied (``pagedkv.model.moe.MoE``).

Lazily (``PAGEDKV_LAZY_EXPERTS=1``, or ``build_gguf_model(lazy_experts=True)``) each expert
matrix is a ``LazyExpertLinear``: its rows are read and packed at its first forward, so an
expert no token was routed to is never read from the file (the load reads everything else).

Raises ``ConfigError`` naming the tensor for a missing part, a stacked tensor whose expert
count or shape does not fit the config, or a type the kernels do not take.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFTensorInfo
from pagedkv.ops import qmm
from pagedkv.model.gguf_read import Reader, dequantize_rows
from pagedkv.model.gguf_shard import packed_cut
from pagedkv.model.gguf_read import qtype_name as _qtype
from pagedkv.model.gguf_read import tensor_rows as _rows

#: stacked expert tensors -> (our module, position in its rows)
EXPERT_PARTS = {"ffn_gate_exps": ("gate_up_proj", 0), "ffn_up_exps": ("gate_up_proj", 1),
                "ffn_down_exps": ("down_proj", 0)}
#: the router's GGUF part name (a float matrix: not one the kernels multiply)
ROUTER = "ffn_gate_inp"


def check_expert_counts(tensors: list[GGUFTensorInfo], num_experts: int) -> None:
    """Raise ``ConfigError`` naming the first stacked expert tensor (``*_exps.weight``) that is
    not ``[num_experts, rows, cols]``: checked before ``num_experts`` expert modules are made."""
    for t in tensors:
        if t.name.endswith("_exps.weight") and (len(t.shape) != 3 or t.shape[0] != num_experts):
            raise ConfigError(f"weights: {t.name} holds {t.shape[0] if t.shape else 0} experts "
                              f"(shape {tuple(t.shape)}), the config {num_experts}")


def expert_packed(reader: Reader, parts: list[GGUFTensorInfo], e: int, what: str, cut: Any = None,
                  biases: list[GGUFTensorInfo] | None = None) -> tuple[qmm.Packed, tuple[str, ...], int]:
    """``(packed weights, GGML type names, output rows)`` of expert ``e``'s rows of the stacked
    ``parts`` (each ``[E, rows, cols]``), stacked along the output rows in order; zero rows pad
    one type's buffer to a multiple of 8; parts of different types are packed each and
    concatenated (``qmm.concat_packed``). Reads only expert ``e``'s bytes of the file.
    ``cut``: a tensor-parallel rank's ``gguf_shard.Cut`` of the expert (its rows and columns only).
    ``biases``: per part its stacked bias ``[E, rows]`` (gpt-oss), expert ``e``'s row read as
    float32 into the packed weights' bias."""
    k = parts[0].shape[-1]
    sizes = []
    for p in parts:
        if len(p.shape) != 3 or p.shape[-1] != k:
            raise ConfigError(f"weights: {p.name}: expected stacked experts [E, rows, {k}], got {tuple(p.shape)}")
        sizes.append((p.shape[1], _rows(p)[1]))
    types = tuple(_qtype(p) for p in parts)
    n = sum(r for r, _ in sizes)
    vals = [None] * len(parts) if biases is None else [dequantize_rows(b, reader.rows(b, e, e + 1))[0] for b in biases]
    if cut is not None:
        pieces = [(p, rows, functools.partial(reader.into, p, skip=e * rows * rb)) for p, (rows, rb) in zip(parts, sizes)]
        return packed_cut(pieces, vals, k, cut, what)
    try:
        if len(set(types)) == 1:
            buf = np.empty((n + (-n % 8), sizes[0][1]), dtype=np.uint8)
            buf[n:] = 0  # zero blocks: d = 0, values 0
            r0 = 0
            for p, (rows, rb) in zip(parts, sizes):
                reader.into(p, buf[r0:r0 + rows], skip=e * rows * rb)
                r0 += rows
            bias = None if biases is None else torch.cat([*vals, torch.zeros(len(buf) - n)]).float().contiguous()
            packed = qmm.pack_gguf(types[0], buf, k, bias)
        else:
            packs = []
            for p, (rows, rb), b in zip(parts, sizes, vals):
                buf = np.empty((rows, rb), dtype=np.uint8)
                reader.into(p, buf, skip=e * rows * rb)
                packs.append(qmm.pack_gguf(_qtype(p), buf, k, None if b is None else b.float().contiguous()))
            packed = qmm.concat_packed(packs)
    except ValueError as err:
        raise ConfigError(f"weights: {what}: {err}") from None
    return packed, types, n


def expert_jobs(layer: nn.Module, parts: dict[str, GGUFTensorInfo], i: int, num_experts: int,
                cut_of: Callable[[str], Any] = lambda module: None) -> Iterator[tuple[nn.Module, str, tuple[Any, ...]]]:
    """``(expert module, attribute, (function, *args))`` for every expert matrix of layer ``i``
    (``layer.mlp``: a ``pagedkv.model.moe.MoE``) from its stacked GGUF ``parts`` (part name ->
    tensor; ``{part}.bias`` -> its stacked bias ``[E, rows]`` where the experts are biased, as
    gpt-oss's): call ``function(reader, *args)`` for ``GGUFLinear``'s arguments. Raises
    ``ConfigError`` for a missing part or bias, a bias the config does not give, a dense layer
    given experts, or an expert count or bias shape other than the config's. ``cut_of(module)``:
    a tensor-parallel rank's cut of each expert's ``module`` (``gguf_shard.module_cut``),
    ``None`` for the whole matrix."""
    if getattr(layer, "mlp", None) is None:
        raise ConfigError(f"weights: layer {i} has stacked experts but the config makes it dense")
    groups: dict[str, list[GGUFTensorInfo | None]] = {"gate_up_proj": [None, None], "down_proj": [None]}
    biases: dict[str, list[GGUFTensorInfo | None]] = {"gate_up_proj": [None, None], "down_proj": [None]}
    for name, info in parts.items():
        part, _, kind = name.partition(".")
        module, pos = EXPERT_PARTS[part]
        if info.shape[0] != num_experts:
            raise ConfigError(f"weights: {info.name} holds {info.shape[0]} experts, the config {num_experts}")
        (biases if kind == "bias" else groups)[module][pos] = info
    biased = layer.mlp.spec.bias
    for module, infos in groups.items():
        if any(x is None for x in infos):
            raise ConfigError(f"weights: layer {i} is missing stacked expert tensors of {module}")
        got = [b for b in biases[module] if b is not None]
        if got and not biased:
            raise ConfigError(f"weights: {got[0].name}: the config gives its experts no biases")
        if biased and len(got) != len(infos):
            raise ConfigError(f"weights: layer {i} is missing stacked expert biases of {module}")
        for w, b in zip(infos, got):
            if tuple(b.shape) != tuple(w.shape[:2]):
                raise ConfigError(f"weights: {b.name} has shape {tuple(b.shape)}, expected {tuple(w.shape[:2])}")
    cuts = {module: cut_of(module) for module in groups}
    for e in range(num_experts):
        for module, infos in groups.items():
            fn = functools.partial(expert_packed, cut=cuts[module], biases=biases[module] if biased else None)
            yield layer.mlp.experts[e], module, (fn, infos, e, f"layer {i} expert {e} {module}")


class LazyExpertLinear(nn.Module):
    """An expert matrix read and packed at its first forward: ``make()`` returns the linear
    module (a ``GGUFLinear`` on the expert's stored rows), which then becomes the child
    ``linear`` (``None`` until then) and serves every later call. ``forward(x [T, in]) -> [T,
    out]``. Safe to call from several threads (the first makes it once)."""

    def __init__(self, make: Callable[[], nn.Module], in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._make: Callable[[], nn.Module] | None = make
        self._lock = threading.Lock()
        self.linear: nn.Module | None = None

    def materialize(self) -> nn.Module:
        """The linear module, made now if it was not yet (reads the expert's rows)."""
        if self.linear is None:
            with self._lock:
                if self.linear is None:
                    self.linear = self._make()
                    self._make = None
        return self.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.materialize()(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, read={self.linear is not None}"
