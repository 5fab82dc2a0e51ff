"""Layouts, positions and block masks against matrices written out by hand."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transformers_ccm import CCMConfig
from transformers_ccm.masks import block_attention, memory_weights, sample_layout


def _batch(*layouts):
    length = max(len(layout.segment_ids) for layout in layouts)
    segment = [layout.segment_ids + [0] * (length - len(layout.segment_ids)) for layout in layouts]
    comp = [layout.comp_mask + [False] * (length - len(layout.comp_mask)) for layout in layouts]
    return torch.tensor(segment), torch.tensor(comp)


def _mask(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_skip_positions_t3_two_comp_tokens():
    layout = sample_layout([1, 2, 1], io_length=1, num_comp_tokens=2)
    #                      c  C  C  c  c  C  C  c  C  C  i
    assert layout.position_ids == [0, 1, 2, 1, 2, 3, 4, 3, 4, 5, 4]
    assert layout.segment_ids == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4]
    assert layout.comp_mask == [0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0]


def test_layout_without_context_is_plain_sequence():
    layout = sample_layout([], io_length=3, num_comp_tokens=2)
    assert layout.position_ids == [0, 1, 2]
    assert layout.segment_ids == [1, 1, 1]
    assert layout.comp_mask == [False] * 3


# c1 c1 C1 c2 C2 i o  (n_comp = 1, t = 2)
T2 = sample_layout([2, 1], io_length=2, num_comp_tokens=1)


def test_positions_t2_one_comp_token():
    assert T2.position_ids == [0, 1, 2, 2, 3, 3, 4]


def test_concat_mask_t2():
    segment, comp = _batch(T2)
    plan = block_attention(segment, comp, CCMConfig(num_comp_tokens=1))
    expected = _mask(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 1, 0, 1, 1, 0],
            [0, 0, 1, 0, 1, 1, 1],
        ]
    )
    assert plan.memory_mix is None
    assert torch.equal(plan.mask, expected[None, None])


def test_concat_mask_with_cap_evicts_oldest():
    segment, comp = _batch(T2)
    plan = block_attention(segment, comp, CCMConfig(num_comp_tokens=1, max_memory_tokens=1))
    expected = _mask(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(plan.mask, expected[None, None])


def test_concat_mask_t3_cap_two():
    # c C c C c C i
    segment, comp = _batch(sample_layout([1, 1, 1], io_length=1, num_comp_tokens=1))
    uncapped = block_attention(segment, comp, CCMConfig(num_comp_tokens=1)).mask[0, 0]
    capped = block_attention(segment, comp, CCMConfig(num_comp_tokens=1, max_memory_tokens=2)).mask[0, 0]
    common = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0, 0],
        [0, 1, 0, 1, 1, 0, 0],
        [0, 1, 0, 1, 1, 1, 0],
    ]
    assert torch.equal(uncapped, _mask([*common, [0, 1, 0, 1, 0, 1, 1]]))
    assert torch.equal(capped, _mask([*common, [0, 0, 0, 1, 0, 1, 1]]))


@pytest.mark.parametrize(("update", "second"), [("merge", [0.5, 0.5]), ("ema", [0.75, 0.25])])
def test_merge_and_ema_mask_and_memory_t2(update, second):
    segment, comp = _batch(T2)
    plan = block_attention(segment, comp, CCMConfig(num_comp_tokens=1, update=update, ema_alpha=0.25))
    #                 sequence              | Mem(1) Mem(2)
    expected = _mask(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1, 0, 0, 1],
            [0, 0, 0, 0, 0, 1, 1, 0, 1],
        ]
    )
    assert torch.equal(plan.mask, expected[None, None])
    mix = torch.tensor([[0, 0, 1, 0, 0, 0, 0], [0, 0, second[0], 0, second[1], 0, 0]])
    torch.testing.assert_close(plan.memory_mix, mix[None].float())


# Two samples of t = 1 with n_comp = 2: [c C C i] + 2 pads, and [c c C C i o].
PADDED = (sample_layout([1], io_length=1, num_comp_tokens=2), sample_layout([2], io_length=2, num_comp_tokens=2))


def test_padded_positions():
    assert PADDED[0].position_ids == [0, 1, 2, 1]
    assert PADDED[1].position_ids == [0, 1, 2, 3, 2, 3]


def test_concat_mask_with_padding():
    segment, comp = _batch(*PADDED)
    mask = block_attention(segment, comp, CCMConfig(num_comp_tokens=2)).mask
    first = _mask(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],  # padding attends to itself only
            [0, 0, 0, 0, 0, 1],
        ]
    )
    second = _mask(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(mask[:, 0], torch.stack([first, second]))


def test_merge_mask_with_padding():
    segment, comp = _batch(*PADDED)
    plan = block_attention(segment, comp, CCMConfig(num_comp_tokens=2, update="merge"))
    first = _mask(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 1, 1],
            [0, 0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0],
        ]
    )
    second = _mask(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 1, 1],
            [0, 0, 0, 0, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(plan.mask[:, 0], torch.stack([first, second]))
    mix = torch.zeros(2, 2, 6)
    mix[0, 0, 1] = mix[0, 1, 2] = 1  # slot k of Mem(1) is the k-th <COMP> of the row
    mix[1, 0, 2] = mix[1, 1, 3] = 1
    torch.testing.assert_close(plan.memory_mix, mix)


def test_memory_weights_t3():
    merge = memory_weights(3, CCMConfig(update="merge"))
    ema = memory_weights(3, CCMConfig(update="ema", ema_alpha=0.5))
    torch.testing.assert_close(merge, torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]]).double())
    torch.testing.assert_close(ema, torch.tensor([[1, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]]).double())


@given(
    lengths=st.lists(st.integers(1, 6), max_size=6),
    io_length=st.integers(1, 6),
    n=st.integers(1, 4),
)
def test_layout_properties(lengths, io_length, n):
    layout = sample_layout(lengths, io_length, n)
    total = sum(lengths) + n * len(lengths) + io_length
    assert len(layout.segment_ids) == len(layout.comp_mask) == len(layout.position_ids) == total
    ordinary = [p for p, c in zip(layout.position_ids, layout.comp_mask, strict=True) if not c]
    assert ordinary == list(range(sum(lengths) + io_length))  # as if no <COMP> were there
    assert sum(layout.comp_mask) == n * len(lengths)


@given(
    lengths=st.lists(st.lists(st.integers(1, 4), max_size=4), min_size=1, max_size=3),
    n=st.integers(1, 3),
    update=st.sampled_from(["concat", "merge", "ema"]),
)
def test_every_row_attends_somewhere_and_memory_sums_to_one(lengths, n, update):
    segment, comp = _batch(*(sample_layout(sample, 2, n) for sample in lengths))
    plan = block_attention(segment, comp, CCMConfig(num_comp_tokens=n, update=update))
    assert plan.mask.any(dim=-1).all()
    if plan.memory_mix is not None:
        steps = (comp.sum(-1) // n)[:, None]
        slot_step = torch.arange(plan.memory_mix.shape[1]) // n + 1
        live = slot_step[None] <= steps  # memory slots a row can reach
        totals = plan.memory_mix.sum(-1)
        torch.testing.assert_close(totals[live], torch.ones_like(totals[live]))
