"""The block-sparse training forward (flex_attention over a BlockMask) equals the dense one."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from test_online import samples_strategy
from test_sliding_window import windowed_model
from tiny_models import tiny_base, tiny_ccm
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.lora import attention_modules

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


def test_auto_takes_flex_on_cuda_only_where_no_attention_weight_is_dropped():
    """Flex has no attention dropout: "auto" took it on CUDA for a model that drops attention weights in training, and
    the first step stopped asking for "dense". It takes dense there now, and flex when evaluating or with no dropout."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    model = tiny_ccm("llama").train()
    assert model._auto_flex(cuda) and not model._auto_flex(cpu)
    for attention in attention_modules(model.base_model).values():  # as from a config with attention_dropout=0.1
        attention.attention_dropout = 0.1
    assert not model._auto_flex(cuda) and model.eval()._auto_flex(cuda)
    assert not tiny_ccm("gpt2").eval()._auto_flex(cuda)  # its code takes no flex masks


def test_flex_training_on_cpu_is_refused_naming_dense_attention():
    """A training forward (gradients on) with flex attention on CPU, where torch runs it forward only, failed inside
    torch with "set the input requires_grad to False or use another device", no fix a CCM user has; it names
    set_training_attention('dense') now, and the forward without gradients still runs."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge"))
    model.set_training_attention("flex")
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [8], [9, 10])])
    with pytest.raises(ValueError, match=r"no backward on CPU.*set_training_attention\('dense'\)"):
        model(**batch)
    assert all(parameter.grad is None for parameter in model.parameters())
    with torch.no_grad():
        flex = model(**batch).loss
    model.set_training_attention("dense")
    dense = model(**batch).loss
    dense.backward()
    assert torch.allclose(flex, dense, atol=TOLERANCE)
    assert model.comp_embeddings.grad.abs().sum() > 0
