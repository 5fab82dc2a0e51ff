"""The block-sparse training forward (flex_attention over a BlockMask) equals the dense one."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from test_online import samples_strategy
from test_sliding_window import windowed_model
from tiny_models import tiny_ccm
from transformers_ccm import CCMDataCollator

TOLERANCE = 1e-4


def logits(model, samples, kind):
    model.set_training_attention(kind)
    try:
        with torch.no_grad():  # flex_attention has no backward on CPU
            return model(**CCMDataCollator(model)(samples)).logits
    finally:
        model.set_training_attention("auto")


@pytest.mark.parametrize(
    ("architecture", "config"),
    [
        ("llama", {}),
        ("llama", {"update": "merge"}),
        ("llama", {"update": "ema"}),
        ("llama", {"max_memory_tokens": 3}),
        ("gemma2", {}),  # softcapping, eager
        ("qwen3", {}),
        ("gpt-neox", {"update": "merge"}),
        ("gpt-oss", {"update": "merge"}),  # attention sinks, which flex attention left out
    ],
)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy)
def test_flex_equals_dense(architecture, config, samples):
    model = tiny_ccm(architecture, **config)
    assert torch.allclose(logits(model, samples, "flex"), logits(model, samples, "dense"), atol=TOLERANCE)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy)
def test_flex_equals_dense_with_sliding_layers(samples):
    model = windowed_model("gemma3", 4, "merge")
    assert torch.allclose(logits(model, samples, "flex"), logits(model, samples, "dense"), atol=TOLERANCE)


def test_auto_is_dense_on_cpu_and_kinds_are_checked():
    model = tiny_ccm("llama")
    assert model.training_attention == "auto"
    with pytest.raises(ValueError, match=r"one of \('auto', 'dense', 'flex'\)"):
        model.set_training_attention("sparse")
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not take flex attention masks"):
        tiny_ccm("gpt2").set_training_attention("flex")
