"""Layer groups of a hybrid KV cache (full + sliding-window attention layers).

A *layer group* is the set of layers with the same attention kind: full attention
(``window=None``) or a sliding window of ``W`` tokens. Each group has its own block table
per request; all groups draw block ids from **one** block pool. The device memory is laid out
so that one block id is one page in each of ``max_layers`` per-layer tensors, and the
``j``-th layer of *every* group uses tensor ``j`` (``slot_of_layer``): a block owned by the
full group holds full-attention K/V in those tensors, a block owned by a window group holds
window K/V there. One pool (not one per group) because how many blocks each group needs
changes with the mix of request lengths (a short request needs as many window blocks as
full ones, a long one a fraction): a static split of the budget would strand memory in
whichever group the traffic does not need. With equal group sizes (Gemma-2: 21 + 21 layers)
this wastes nothing. Unequal kinds are split into equal-size groups: the group size is the
layer count of the smallest kind (but at least ``ceil(L / MAX_GROUPS)``, so a model never has
more than about ``MAX_GROUPS`` block tables per request), and each kind's layers are cut into
consecutive groups of that size. Gemma-3-12B (8 full + 40 window-1024 layers) becomes one full
group and five window groups of 8 layers: a page spans 8 layers, not 40, so a full-attention
block no longer carries 32 unused layers' pages (at 32k tokens: 0.19x the all-full bytes per
request instead of 0.86x). Groups of one kind hold identical block-table shapes but their own
block ids and prefix-hash chains. A last, shorter group of a kind leaves ``max_layers -
n_layers`` of its pages unused (see ``page_waste``).

Window rule. A step that computes positions from ``p`` (the request's computed tokens) has
its earliest query at ``p``, which sees keys ``p - W + 1 .. p``. Logical blocks wholly
before ``p - W + 1`` are never read again by that request: ``first_live_block(p)`` =
``max(0, p - W + 1) // block_size``. The manager replaces them with the *null block*
(block id 0, never handed out, its storage zero) and frees the real block behind the
step fence, so a request holds at most about ``(W + chunk) / block_size + 1`` blocks of a
window group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedkv.errors import ConfigError
from pagedkv.kv.block_table import blocks_needed
from pagedkv.utils import cdiv

#: Block id reserved as the placeholder of freed window blocks (hybrid managers only).
NULL_BLOCK_ID = 0
#: Split unequal attention kinds into groups of at least ``ceil(num_layers / MAX_GROUPS)``
#: layers: bounds the block tables (and their bookkeeping) per request.
MAX_GROUPS = 8


def first_live_block(window: int | None, num_computed: int, block_size: int) -> int:
    """THE window rule: the first logical block a step computing from position ``num_computed``
    reads with a sliding window of ``window`` tokens, ``max(0, num_computed - window + 1) //
    block_size`` (0 for full attention, ``window=None``)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


@dataclass(frozen=True)
class LayerGroups:
    """``windows[g]``: group ``g``'s window in tokens (``None`` = full attention);
    ``layer_group[i]``: the group of layer ``i``. Groups are ordered: full first, then
    windows ascending; one kind may span several consecutive groups of equal size (see the
    module docstring). Build with :meth:`from_layer_windows`."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]

    @classmethod
    def from_layer_windows(cls, layer_windows: Sequence[int | None] | None, num_layers: int = 1) -> "LayerGroups":
        """Groups from one entry per layer (``None`` = full attention, an int = sliding
        window in tokens); ``None`` means ``num_layers`` full layers. Raises ``ConfigError``
        on an empty list or a window that is not a positive integer."""
        if layer_windows is None:
            layer_windows = [None] * num_layers
        layer_windows = list(layer_windows)
        if not layer_windows:
            raise ConfigError("layer_windows: give one entry per layer")
        for w in layer_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ConfigError(f"layer_windows: a window must be a positive integer or None, got {w!r}")
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        members = {w: [i for i, x in enumerate(layer_windows) if x == w] for w in kinds}
        size = max(min(len(m) for m in members.values()), cdiv(len(layer_windows), MAX_GROUPS))
        windows: list[int | None] = []
        layer_group = [0] * len(layer_windows)
        for w in kinds:  # each kind cut into consecutive groups of ``size`` layers
            for start in range(0, len(members[w]), size):
                for i in members[w][start:start + size]:
                    layer_group[i] = len(windows)
                windows.append(w)
        return cls(tuple(windows), tuple(layer_group))

    @property
    def num_groups(self) -> int:
        """Layer groups (1 without sliding windows)."""
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """True when some group has a sliding window (the manager then reserves block 0)."""
        return any(w is not None for w in self.windows)

    def kind(self, g: int) -> str:
        """Group ``g``'s kind: ``"full"`` or ``"sliding_window"`` (the key of the class that
        manages its block tables in ``pagedkv.kv.manager.GROUP_TYPES``)."""
        return "full" if self.windows[g] is None else "sliding_window"

    def layers_of(self, g: int) -> list[int]:
        return [i for i, x in enumerate(self.layer_group) if x == g]

    @property
    def max_layers(self) -> int:
        """Layers of the largest group: per-layer tensors one block id spans."""
        return max(len(self.layers_of(g)) for g in range(self.num_groups))

    @property
    def slot_of_layer(self) -> list[int]:
        """Per layer, the shared per-layer tensor it uses (its index inside its group)."""
        seen = [0] * self.num_groups
        out = []
        for g in self.layer_group:
            out.append(seen[g])
            seen[g] += 1
        return out

    @property
    def page_waste(self) -> float:
        """Fraction of the KV memory a block of an average group leaves unused (0 when every
        group has the same number of layers)."""
        sizes = [len(self.layers_of(g)) for g in range(self.num_groups)]
        return 1.0 - sum(sizes) / (len(sizes) * max(sizes))

    def first_live_block(self, g: int, num_computed: int, block_size: int) -> int:
        """First logical block group ``g`` still needs when the next step computes from
        position ``num_computed`` (0 for a full group; :func:`first_live_block`)."""
        return first_live_block(self.windows[g], num_computed, block_size)

    def blocks_held(self, g: int, num_tokens: int, block_size: int) -> int:
        """Blocks of group ``g`` a request holds after its last step, which computed
        position ``num_tokens - 1`` alone (a decode step)."""
        return blocks_needed(max(0, num_tokens), block_size, self.windows[g])

    def describe(self) -> list[dict]:
        """JSON-able: per group its window and layer indices."""
        return [{"group": g, "window": w, "layers": self.layers_of(g)} for g, w in enumerate(self.windows)]


def longest_valid_hit(present: list[list[bool]], groups: LayerGroups, block_size: int, limit: int) -> int:
    """The longest prefix hit, in blocks ``k <= limit``, valid in every group: a full group
    needs its blocks ``0 .. k-1`` cached, a window group only ``first_live_block(k * bs) ..
    k-1`` (the blocks covering the last ``W`` tokens before the hit point).
    ``present[g][i]``: whether group ``g``'s block ``i`` is cached (lists of ``>= limit``)."""
    runs = []  # runs[g][k]: cached blocks of group g in a row ending at block k - 1
    for g in range(groups.num_groups):
        run = [0] * (limit + 1)
        for i in range(limit):
            run[i + 1] = run[i] + 1 if present[g][i] else 0
        if groups.windows[g] is None:  # a full group: nothing past its first miss
            limit = min(limit, next((i for i in range(limit) if not present[g][i]), limit))
        runs.append(run)
    for k in range(limit, 0, -1):
        if all(runs[g][k] >= k - groups.first_live_block(g, k * block_size, block_size)
               for g in range(groups.num_groups)):
            return k
    return 0
