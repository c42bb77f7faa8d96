"""Mixture-of-experts feed-forward: a router picks ``k`` of ``E`` experts per token, each a
gated MLP, and the token's output is the routing-weighted sum of its experts' outputs (plus
shared experts that every token runs). Used as the MLP of the MoE layers of
``pagedkv.model.llama.DecoderLayer`` (``ModelConfig.num_experts > 0``).

Routing (``route``; ``logits = x @ router.T`` in fp32, ``[T, E]``):

* ``"softmax"``: ``p = softmax(logits)``; top-k of ``p`` (Mixtral, Qwen3-MoE, DeepSeek-V2's
  ``greedy``); with ``n_group > 1`` only the ``topk_group`` groups of experts with the highest
  group maximum are eligible (DeepSeek-V2's ``group_limited_greedy``). The weights are the
  chosen ``p``, divided by their sum when ``norm_topk_prob`` (Mixtral always, Qwen3-MoE by
  config), times ``routed_scaling_factor``.
* ``"sigmoid"`` (DeepSeek-V3's ``noaux_tc``): ``s = sigmoid(logits)``; the choice is made on
  ``s + e_score_correction_bias``: groups ranked by the sum of their top-2 choice scores, the
  ``topk_group`` best eligible, top-k among them; the weights are the chosen ``s`` (without
  the bias), divided by ``sum + 1e-20`` when ``norm_topk_prob``, times
  ``routed_scaling_factor``.
* ``"topk_softmax"`` (gpt-oss): top-k of the raw ``logits`` (router with a bias), the weights
  the softmax over the ``k`` chosen logits only.

gpt-oss experts (``MoESpec.bias`` / ``swiglu_limit``): every linear layer of the router and the
experts has a bias, and the activation is the clamped SwiGLU ``g = min(gate, limit)``,
``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)`` (transformers'
``GptOssExperts._apply_gate``; transformers stores gate and up interleaved, the loader
de-interleaves them into gate rows then up rows, ``pagedkv.model.gptoss``).

Source: the routers of transformers 5.24 (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``,
``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``); DeepSeek-V2 (arXiv:2405.04434, sec. 2.2:
shared experts added to the routed output, group- (device-) limited routing) and DeepSeek-V3
(arXiv:2412.19437, sec. 2.1.2: sigmoid affinities, a bias that steers only the choice, weights
normalised over the chosen experts). Which layers are MoE: ``moe_layer_indices``.

Experts run grouped (``MoE.forward``): the ``T * k`` (token, expert) pairs are sorted by
expert id and each expert that got tokens runs one matmul pair over its rows, scaled by their
routing weights and scatter-added (``index_add_``) into the output, in increasing expert
order as transformers' loop. An expert without tokens is never called, so at decode (one
row) only the ``k`` routed experts' weights are read. Each expert is its own module with the
dense MLP's two linear layers (``gate_up_proj`` ``[2 I, H]`` = gate rows then up rows,
``down_proj`` ``[H, I]``): a quantised format replaces them as it replaces any linear layer
(``pagedkv.model.quantize.install_linears``), and a GGUF's stacked ``ffn_*_exps`` tensors slice
into per-expert matrices without reordering.

Weights (state-dict names under ``layers.{i}.mlp.``): ``router.weight`` ``[E, H]``;
``e_score_correction_bias`` ``[E]`` fp32 (``"sigmoid"`` only); ``experts.{e}.gate_up_proj.weight``
``[2 I, H]``; ``experts.{e}.down_proj.weight`` ``[H, I]``; with shared experts
``shared.gate_up_proj.weight`` ``[2 S, H]`` / ``shared.down_proj.weight`` ``[H, S]``, ``S`` =
``num_shared_experts * I`` (DeepSeek's shared experts are one MLP of that width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.utils import linear_layer

#: routing kinds of ``route``
ROUTINGS = ("softmax", "sigmoid", "topk_softmax")
#: activations of the experts' gated MLPs
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer's shape and routing (from ``ModelConfig``, see ``MoESpec.from_config``).

    ``num_experts`` E; ``top_k`` experts per token; ``intermediate_size`` I of each expert;
    ``num_shared_experts`` (0: none); ``routing`` in ``ROUTINGS``; ``norm_topk_prob``;
    ``n_group`` / ``topk_group`` (group-limited choice; ``n_group`` 1: none);
    ``routed_scaling_factor``; ``hidden_act`` of the experts; ``bias`` (router and experts
    biased, gpt-oss); ``swiglu_limit`` (``None``: plain gated MLP; a number: gpt-oss's clamped
    SwiGLU with gain ``swiglu_alpha``, module doc). Raises ``ConfigError`` naming the
    field when the values do not fit (``top_k > E``, groups that do not divide ``E``, ...)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    routing: str = "softmax"
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    hidden_act: str = "silu"
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}: must be a positive integer for a mixture-of-experts layer, got {v!r}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(self.num_shared_experts, int) \
                or self.num_shared_experts < 0:
            raise ConfigError(f"num_shared_experts: must be a non-negative integer, got {self.num_shared_experts!r}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"moe_routing: unsupported {self.routing!r} (supported: {', '.join(ROUTINGS)})")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act: unsupported {self.hidden_act!r} for experts")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok: {self.top_k} > num_experts {self.num_experts}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"n_group/topk_group: {self.n_group} groups of {self.num_experts} experts, "
                              f"{self.topk_group} chosen: groups must divide the experts and topk_group <= n_group")
        group = self.num_experts // self.n_group
        if self.topk_group * group < self.top_k or (self.routing == "sigmoid" and self.n_group > 1 and group < 2):
            raise ConfigError(f"topk_group: {self.topk_group} groups of {group} experts cannot hold "
                              f"num_experts_per_tok {self.top_k} (sigmoid group scores need 2 per group)")
        if not (self.routed_scaling_factor > 0):
            raise ConfigError(f"routed_scaling_factor: must be positive, got {self.routed_scaling_factor!r}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ConfigError(f"{name}: must be a positive number, got {v!r}")

    @classmethod
    def from_config(cls, config) -> "MoESpec":
        """The spec of ``config``'s (a ``ModelConfig``) MoE layers."""
        return cls(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   config.num_shared_experts, config.moe_routing, config.norm_topk_prob, config.moe_n_group,
                   config.moe_topk_group, config.routed_scaling_factor, config.hidden_act, config.moe_bias,
                   config.swiglu_limit, config.swiglu_alpha)


def moe_layer_indices(num_layers: int, *, first_k_dense_replace: int = 0, decoder_sparse_step: int = 1,
                      mlp_only_layers: tuple[int, ...] | list[int] = ()) -> list[int]:
    """The layers (ascending) whose MLP is a mixture of experts: layer ``i`` is when ``i >=
    first_k_dense_replace`` (DeepSeek-V2/V3's leading dense layers), ``(i + 1) %
    decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers`` (Qwen3-MoE). Raises
    ``ConfigError`` naming the field for a negative ``first_k_dense_replace`` or a step below 1."""
    for name, v, low in (("first_k_dense_replace", first_k_dense_replace, 0),
                         ("decoder_sparse_step", decoder_sparse_step, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{name}: must be an integer >= {low}, got {v!r}")
    if not isinstance(mlp_only_layers, (list, tuple)):
        raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {mlp_only_layers!r}")
    return [i for i in range(num_layers)
            if i >= first_k_dense_replace and (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers]


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], expert ids int64 [T, k])`` from router ``logits`` ``[T, E]``
    (any float dtype, routed in fp32) by ``spec.routing`` (module doc). ``bias`` ``[E]``:
    DeepSeek-V3's ``e_score_correction_bias`` (``"sigmoid"``; ``None`` = zeros). The ``k``
    chosen experts come in no particular order (``torch.topk(sorted=False)``, as transformers);
    exact ties are broken as ``torch.topk`` breaks them."""
    logits = logits.float()
    t, e = logits.shape
    size = e // spec.n_group
    if spec.routing == "topk_softmax":  # gpt-oss: softmax over the k chosen logits
        values, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = values.softmax(dim=-1)
    elif spec.routing == "softmax":
        scores = logits.softmax(dim=-1)
        choice = scores
        if spec.n_group > 1:
            group_scores = scores.view(t, spec.n_group, size).max(dim=-1).values
            choice = scores.masked_fill(~_group_mask(group_scores, spec.topk_group, size), 0.0)
        weights, ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias.float()
        if spec.n_group > 1:
            group_scores = choice.view(t, spec.n_group, size).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(group_scores, spec.topk_group, size), float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, size: int) -> torch.Tensor:
    """bool ``[T, E]``: the experts of each token's ``topk_group`` best groups."""
    idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
    return mask.repeat_interleave(size, dim=1)


class Expert(nn.Module):
    """One gated MLP: ``down_proj(act(x @ gate.T) * (x @ up.T))`` with ``gate_up_proj`` ``[2 I,
    H]`` (gate rows then up rows) and ``down_proj`` ``[H, I]``; ``x`` ``[n, H]`` -> ``[n, H]``.
    ``bias``: both layers biased; ``limit``: gpt-oss's clamped SwiGLU (module doc) with gain
    ``alpha`` in place of ``act``."""

    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype, device: torch.device | str,
                 bias: bool = False, limit: float | None = None, alpha: float = 1.702) -> None:
        super().__init__()
        self.intermediate_size, self.gelu = inter, act == "gelu_pytorch_tanh"
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj = linear_layer(hidden, 2 * inter, bias, dtype, device)
        self.down_proj = linear_layer(inter, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size:]
        if self.limit is not None:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class MoE(nn.Module):
    """The MoE feed-forward of one layer (module doc): ``forward(x [T, H]) -> [T, H]`` in
    ``x``'s dtype. Build with the layer's ``MoESpec``; parameters are allocated uninitialised
    (the loader assigns them)."""

    def __init__(self, spec: MoESpec, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.spec = spec
        self.router = linear_layer(hidden, spec.num_experts, spec.bias, dtype, device)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32, device=device))
                                        if spec.routing == "sigmoid" else None)
        self.experts = nn.ModuleList(Expert(hidden, spec.intermediate_size, spec.hidden_act, dtype, device, spec.bias,
                                            spec.swiglu_limit, spec.swiglu_alpha) for _ in range(spec.num_experts))
        self.shared = (Expert(hidden, spec.num_shared_experts * spec.intermediate_size, spec.hidden_act, dtype, device)
                       if spec.num_shared_experts else None)

    @property
    def native_ok(self) -> bool:
        """Whether the fused and native CPU paths (``pagedkv/csrc/decoder.c``) take this layer:
        any routing without expert groups (Qwen3-MoE, Mixtral, DeepSeek-V2-Lite's greedy routing,
        DeepSeek-V3-architecture models of one expert group such as Moonlight, shared experts
        included; gpt-oss's biased router and experts with the clamped SwiGLU); group-limited
        routing (DeepSeek-V2/V3's full models) stays on these torch ops."""
        return self.spec.n_group == 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights fp32 [T, k], ids int64 [T, k])`` of tokens ``x`` ``[T, H]`` (``route``)."""
        b = self.router.bias
        logits = F.linear(x.float(), self.router.weight.float(), None if b is None else b.float())
        return route(logits, self.spec, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts' weighted sum (plus the shared experts) for ``x`` ``[T, H]``; only
        the experts some token was routed to run (module doc)."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode: the k routed experts, in increasing id (transformers' order)
            order = sorted(range(ids.shape[1]), key=lambda j: int(ids[0, j]))
            for j in order:
                h = self.experts[int(ids[0, j])](x)
                out.add_(h * weights[0, j].to(h.dtype))
        else:
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
            counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
            rows = order // ids.shape[1]
            w = weights.reshape(-1)[order]
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                tok = rows[start:start + n]
                h = self.experts[e](x.index_select(0, tok))
                out.index_add_(0, tok, h * w[start:start + n, None].to(h.dtype))
                start += n
        if self.shared is not None:
            out.add_(self.shared(x))
        return out
