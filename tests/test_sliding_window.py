"""Sliding-window layers (Gemma 2/3 local layers, Mistral) keep their window in the parallel forward and online:
the tokens of a query's own segment farther than the window are hidden, memory never is."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig

from test_online import TOLERANCE, online_logits, parallel_logits
from tiny_models import _COMMON, VOCAB, randomize_adapter
from transformers_ccm import CCMConfig, CCMForCausalLM, OnlineSample
from transformers_ccm.masks import SlidingWindow

WINDOW = 4
CONFIGS = {
    "gemma3": lambda window: Gemma3TextConfig(
        **_COMMON, head_dim=8, sliding_window=window, layer_types=["sliding_attention", "full_attention"]
    ),
    "gemma2": lambda window: Gemma2Config(**_COMMON, head_dim=8, sliding_window=window, attn_implementation="eager"),
    "mistral": lambda window: MistralConfig(**_COMMON, sliding_window=window),
}


def windowed_model(architecture: str, window: int, update: str = "concat") -> CCMForCausalLM:
    torch.manual_seed(0)
    config = CONFIGS[architecture](window)
    implementation = "eager" if architecture == "gemma2" else "sdpa"
    base = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    return randomize_adapter(CCMForCausalLM.from_base(base, CCMConfig(update=update)))


long_tokens = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=9)


@pytest.mark.parametrize("update", ["concat", "merge"])
@pytest.mark.parametrize("architecture", sorted(CONFIGS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=st.lists(
        st.builds(
            OnlineSample, contexts=st.lists(long_tokens, min_size=1, max_size=3), input=long_tokens, output=long_tokens
        ),
        min_size=1,
        max_size=2,
    ),
    side=st.sampled_from(["left", "right"]),
)
def test_online_equals_parallel_with_a_window_shorter_than_the_segments(architecture, update, samples, side):
    model = windowed_model(architecture, WINDOW, update)
    for online, parallel in zip(online_logits(model, samples, side), parallel_logits(model, samples), strict=True):
        assert torch.allclose(online, parallel, atol=TOLERANCE), (online - parallel).abs().max()


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_the_window_hides_far_tokens_of_the_segment(architecture):
    # The context and its <COMP> block fit in the window, so memory is the same; the turn is longer.
    sample = [OnlineSample([[5, 6]], list(range(20, 30)), [31, 32])]
    narrow, wide = (parallel_logits(windowed_model(architecture, window), sample)[0] for window in (WINDOW, 4096))
    assert torch.allclose(narrow[:WINDOW], wide[:WINDOW], atol=1e-5)  # all within the window: nothing hidden
    assert (narrow[WINDOW:] - wide[WINDOW:]).abs().max() > 1e-3  # farther tokens are hidden


def test_window_kinds():
    assert SlidingWindow.of(CONFIGS["gemma3"](4)) == SlidingWindow(4, per_layer_type=True)
    assert SlidingWindow.of(CONFIGS["mistral"](4)) == SlidingWindow(4, per_layer_type=False)
    assert SlidingWindow.of(MistralConfig(**_COMMON, sliding_window=None)) is None
