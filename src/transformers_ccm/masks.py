"""The layout of a parallel training sequence `[c(1) <COMP> ... c(t) <COMP> I(t) O(t)]`.

A sequence is described per token by three vectors: `segment_ids` (1..t for `c(j)` and its `<COMP>`
block, t+1 for `I(t) O(t)`, 0 for padding), `comp_mask` (True at `<COMP>` tokens) and `position_ids`
(the "skip" scheme). From these, `block_attention` derives the mask of the paper's Fig. 3b and, for merge
and EMA, how each layer forms `Mem(1..t)` from the `<COMP>` keys/values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from transformers_ccm.config import CCMConfig


@dataclass(frozen=True)
class SequenceLayout:
    """Per-token description of one sample; all three lists have the sequence's length."""

    segment_ids: list[int]
    comp_mask: list[bool]
    position_ids: list[int]


@dataclass(frozen=True)
class BlockAttention:
    """What every attention layer needs to run the parallel forward.

    Attributes:
        mask: `(batch, 1, seq, seq + mem)` bool, True where a query may attend. The last `mem` columns are
            the memory slots `Mem(1..T)` that merge/EMA forms inside each layer (`mem = 0` for concat).
        memory_mix: `(batch, mem, seq)` weights with `Mem slot m = sum_l memory_mix[m, l] * kv[l]`, or None
            for concat, whose memory is the `<COMP>` keys/values themselves.
    """

    mask: torch.Tensor
    memory_mix: torch.Tensor | None


@dataclass(frozen=True)
class SlidingWindow:
    """Attention layers that see only the last `size` positions (Mistral, Gemma 2/3 local layers, ...).

    CCM keeps the window for the tokens of a query's own segment (its context, or its turn) and leaves memory
    visible whatever its distance: memory is the compressed past, held in a few slots. `per_layer_type`: the
    model mixes full and sliding layers and takes a mask per layer type; otherwise every layer slides.
    """

    size: int
    per_layer_type: bool

    @classmethod
    def of(cls, config: Any) -> SlidingWindow | None:
        """The sliding window of a model config, or None if every layer attends to everything."""
        size = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            sliding = any("sliding" in str(layer_type) for layer_type in layer_types)
            return cls(size, per_layer_type=True) if sliding and size else None
        return cls(size, per_layer_type=False) if size else None

    def apply(self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> Any:
        """The attention mask the model takes: `mask` `(batch, 1, q, k)` bool, restricted for sliding layers to
        keys whose position (`(batch, k)`, or `(batch, q, k)` per query) is less than `size` before the query's
        `(batch, q)`; memory keys carry `ALWAYS_VISIBLE`. A dict by layer type when the model mixes layers."""
        keys = key_positions if key_positions.ndim == 3 else key_positions[:, None, :]
        sliding = mask & (query_positions[:, :, None] - keys < self.size)[:, None]
        return {"full_attention": mask, "sliding_attention": sliding} if self.per_layer_type else sliding


# A position after every real one: memory keys get it, so that no sliding window ever hides them.
ALWAYS_VISIBLE = 2**40


def sample_layout(context_lengths: Sequence[int], io_length: int, num_comp_tokens: int) -> SequenceLayout:
    """Segments, `<COMP>` flags and "skip" positions of `[c(1) <COMP> ... c(t) <COMP> I O]`.

    Ordinary tokens are numbered as if no `<COMP>` were there; the k-th `<COMP>` (k = 1..n) after `c(j)`
    takes the last position of `c(j)` plus k.
    """
    segment_ids: list[int] = []
    comp_mask: list[bool] = []
    position_ids: list[int] = []
    offset = 0
    for step, length in enumerate(context_lengths, start=1):
        segment_ids += [step] * (length + num_comp_tokens)
        comp_mask += [False] * length + [True] * num_comp_tokens
        position_ids += list(range(offset, offset + length))
        offset += length
        position_ids += list(range(offset, offset + num_comp_tokens))
    segment_ids += [len(context_lengths) + 1] * io_length
    comp_mask += [False] * io_length
    position_ids += list(range(offset, offset + io_length))
    return SequenceLayout(segment_ids, comp_mask, position_ids)


def comp_ranks(comp_mask: torch.Tensor, num_comp_tokens: int) -> torch.Tensor:
    """`(batch, seq)` index 0..n-1 of each `<COMP>` token inside its block (0 at other tokens)."""
    ranks = (comp_mask.long().cumsum(dim=-1) - 1).remainder(num_comp_tokens)
    return ranks.masked_fill(~comp_mask, 0)


def update_coefficient(step: int, config: CCMConfig) -> float:
    """`a_t` of `Mem(t) = (1 - a_t) Mem(t-1) + a_t h(t)` for the 1-based `step` t (merge or EMA)."""
    if step == 1:
        return 1.0
    return 1.0 / step if config.update == "merge" else config.ema_alpha


def memory_weights(steps: int, config: CCMConfig) -> torch.Tensor:
    """`(steps, steps)` lower-triangular `W` with `Mem(j) = sum_i W[j-1, i-1] h(i)`, unrolled from `a_t`."""
    coefficients = [update_coefficient(step, config) for step in range(1, steps + 1)]
    weights = torch.zeros(steps, steps, dtype=torch.float64)
    for j in range(steps):
        decay = 1.0
        for i in range(j, -1, -1):
            weights[j, i] = coefficients[i] * decay
            decay *= 1.0 - coefficients[i]
    return weights


def windowed_block_attention(
    segment_ids: torch.Tensor,
    comp_mask: torch.Tensor,
    position_ids: torch.Tensor,
    config: CCMConfig,
    window: SlidingWindow | None,
) -> tuple[Any, torch.Tensor | None]:
    """`block_attention`, with sliding layers restricted to `window` inside each segment: the attention mask
    the model takes (a tensor, or a dict by layer type) and the merge/EMA `memory_mix`."""
    plan = block_attention(segment_ids, comp_mask, config)
    if window is None:
        return plan.mask, plan.memory_mix
    # Keys of other segments are memory (concat); merge/EMA memory columns follow the sequence.
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    key_positions = position_ids[:, None, :].expand_as(same).masked_fill(~same, ALWAYS_VISIBLE)
    extra = plan.mask.shape[-1] - segment_ids.shape[1]
    memory = torch.full((*same.shape[:2], extra), ALWAYS_VISIBLE, device=position_ids.device, dtype=torch.long)
    return window.apply(plan.mask, position_ids, torch.cat([key_positions, memory], dim=-1)), plan.memory_mix


def block_attention(segment_ids: torch.Tensor, comp_mask: torch.Tensor, config: CCMConfig) -> BlockAttention:
    """The block mask (and merge/EMA memory weights) of a batch of parallel training sequences.

    Args:
        segment_ids: `(batch, seq)` long, as described in the module docstring.
        comp_mask: `(batch, seq)` bool.
    """
    length = segment_ids.shape[1]
    device = segment_ids.device
    n = config.num_comp_tokens
    index = torch.arange(length, device=device)
    valid = segment_ids > 0
    seg_q = segment_ids[:, :, None]
    seg_k = segment_ids[:, None, :]

    own = (seg_q == seg_k) & (index[:, None] >= index[None, :]) & valid[:, None, :]
    # A padding query attends to itself only, so that no softmax row is empty.
    own |= torch.eye(length, dtype=torch.bool, device=device) & ~valid[:, :, None]
    ranks = comp_ranks(comp_mask, n)

    if config.update == "concat":
        visible = comp_mask[:, None, :] & (seg_k < seg_q)
        if config.max_memory_tokens is not None:
            slot = (segment_ids - 1) * n + ranks
            memory_size = (seg_q - 1) * n
            visible &= slot[:, None, :] >= memory_size - config.max_memory_tokens
        return BlockAttention(mask=(own | visible)[:, None], memory_mix=None)

    steps = int(comp_mask.sum(dim=-1).max().item()) // n
    if steps == 0:
        return BlockAttention(mask=own[:, None], memory_mix=None)
    slots = torch.arange(steps * n, device=device)
    slot_step = slots // n + 1
    slot_rank = slots % n
    weights = memory_weights(steps, config).to(device=device, dtype=torch.float32)
    token_step = segment_ids.clamp(1, steps) - 1
    # mix[b, m, l] = W[step(m), step(l)] for the <COMP> token l of the same rank whose step is <= step(m).
    mix = weights[slot_step - 1][:, token_step].permute(1, 0, 2)
    selected = (
        comp_mask[:, None, :]
        & (ranks[:, None, :] == slot_rank[None, :, None])
        & (segment_ids[:, None, :] <= slot_step[None, :, None])
    )
    mix = torch.where(selected, mix, torch.zeros((), device=device))
    memory_visible = (seg_q - 1) == slot_step[None, None, :]
    return BlockAttention(mask=torch.cat([own, memory_visible], dim=-1)[:, None], memory_mix=mix)


def as_block_masks(mask: Any) -> Any:
    """The same attention pattern as flex `BlockMask`s, whose empty blocks the kernel skips: `mask` is a
    `(batch, 1, q, k)` bool tensor, or a dict of them by layer type."""
    if isinstance(mask, dict):
        return {kind: as_block_masks(each) for kind, each in mask.items()}
    dense = mask[:, 0]

    def allowed(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return dense[batch, query, key]

    block_mask: BlockMask = create_block_mask(
        allowed, dense.shape[0], None, dense.shape[1], dense.shape[2], device=dense.device
    )
    return block_mask
