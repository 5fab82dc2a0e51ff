"""The layout of a parallel training sequence `[c(1) <COMP> ... c(t) <COMP> I(t) O(t)]`.

A sequence is described per token by three vectors: `segment_ids` (1..t for `c(j)` and its `<COMP>`
block, t+1 for `I(t) O(t)`, 0 for padding), `comp_mask` (True at `<COMP>` tokens) and `position_ids`
(the "skip" scheme). From these, `block_attention` derives the mask of the paper's Fig. 3b and, for merge
and EMA, how each layer forms `Mem(1..t)` from the `<COMP>` keys/values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
