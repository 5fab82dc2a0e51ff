"""The conditional LoRA: zero effect away from <COMP>, and only the adapter trains."""

import re

import pytest
import torch
from transformers import TrainingArguments

from tiny_models import ARCHITECTURES, randomize_adapter, tiny_base
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.lora import lora_layers
from transformers_ccm.training import CCMTrainer

IDS = torch.tensor([[5, 17, 33, 8, 61, 4]])


def _hidden_states(model, **inputs):
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lora_changes_nothing_without_comp(architecture):
    base = tiny_base(architecture)
    expected = _hidden_states(base, input_ids=IDS)
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig()))
    batch = CCMDataCollator(model)([OnlineSample([], IDS[0])])
    got = _hidden_states(model, **batch)
    for layer, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"hidden states of layer {layer} differ"


def test_unconditional_lora_changes_ordinary_tokens():
    base_logits = tiny_base("llama")(input_ids=IDS).logits
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(conditional_lora=False)))
    with torch.no_grad():
        logits = model(**CCMDataCollator(model)([OnlineSample([], IDS[0])])).logits
    assert (logits - base_logits).abs().max() > 1e-3


def test_conditional_lora_changes_comp_positions():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    batch = CCMDataCollator(model)([OnlineSample([[5, 6]], [7])])
    with torch.no_grad():
        gated = model(**batch).logits
        with model.adapter_disabled():
            plain = model(**batch).logits
        assert all(layer.disable_adapters for layer in lora_layers(model.base_model))  # off outside a <COMP> run
    assert (gated[0, -1] - plain[0, -1]).abs().max() > 1e-3  # through the memory


@pytest.mark.parametrize("architecture", ["llama", "phi3", "gpt-neox"])
def test_gradients_reach_only_lora_and_comp(architecture):
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig()))
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13])])
    model(**batch).loss.backward()
    last_layer = f".{model.base_model.config.num_hidden_layers - 1}."
    for name, parameter in model.named_parameters():
        is_adapter = "lora_A" in name or "lora_B" in name or name == "comp_embeddings"
        assert parameter.requires_grad == is_adapter, name
        if not is_adapter:
            assert parameter.grad is None, name
            continue
        assert parameter.grad is not None, f"{name} is not in the graph"
        # The last layer's <COMP> outputs feed nothing, so only its key/value projections get a gradient there.
        if last_layer not in name:
            assert parameter.grad.abs().sum() > 0, f"no gradient reaches {name}"
    value_lora = [p for n, p in model.named_parameters() if last_layer in n and "lora_B" in n]
    assert any(p.grad.abs().sum() > 0 for p in value_lora), "the last layer's keys/values get no gradient"


@pytest.mark.parametrize(
    ("architecture", "projections"),
    [
        ("llama", {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ("phi3", {"qkv_proj", "o_proj"}),
        ("gpt-neox", {"query_key_value", "dense"}),
        ("gpt2", {"c_attn", "c_proj"}),
    ],
)
def test_default_targets_are_the_attention_projections(architecture, projections):
    model = CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig())
    wrapped = {name for name, module in model.base_model.named_modules() if module in lora_layers(model.base_model)}
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == projections
    assert all(".mlp." not in name for name in wrapped)
    assert len(wrapped) == len(projections) * model.base_model.config.num_hidden_layers


_BESIDE_ATTENTION = {
    "llama": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "gpt-neox": ["query_key_value", "dense_h_to_4h"],
}


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
@pytest.mark.parametrize("architecture", ["llama", "gpt-neox"])
def test_lora_beside_attention_acts_the_same_in_checkpointed_layers(architecture, enable):
    """A LoRA on the MLP gets the `<COMP>` mask from the call's state, not from a forward argument: recomputed
    during backward under activation checkpointing, it must act exactly as in the forward, whichever of
    transformers' names (PEFT's helpers call the former one) turned it on."""
    config = CCMConfig(target_modules=_BESIDE_ATTENTION[architecture], lora_dropout=0.0)
    batch = None
    runs = []
    for checkpointing in (False, True):
        model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), config)).train()
        if checkpointing:
            getattr(model, enable)()
            assert model.is_activation_checkpointing
        batch = batch or CCMDataCollator(model)([OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13])] * 2)
        loss = model(**batch).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (plain_loss, plain), (checkpointed_loss, checkpointed) = runs
    torch.testing.assert_close(checkpointed_loss, plain_loss)
    assert any("mlp" in name and grad.abs().sum() > 0 for name, grad in plain.items()), "no MLP LoRA trained"
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-5, rtol=1e-4, msg=f"{name} differs")


def test_reentrant_checkpointing_is_refused_for_lora_beside_attention():
    config = CCMConfig(target_modules=_BESIDE_ATTENTION["llama"])
    model = CCMForCausalLM.from_base(tiny_base("llama"), config)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        model.activation_checkpointing_enable({"use_reentrant": True})
    assert not model.base_model.is_activation_checkpointing
    CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()).activation_checkpointing_enable({"use_reentrant": True})


def test_the_trainer_turns_on_activation_checkpointing_with_its_own_arguments(tmp_path):
    """transformers' Trainer with `activation_checkpointing=True` calls `activation_checkpointing_enable` with
    transformers' argument names (`activation_checkpointing_kwargs`, `every_n_layers`, `offload`), which failed with
    a TypeError before the first step."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"every_n_layers": 2},
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    samples = [OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13])] * 2
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    CCMTrainer(model=model, args=arguments, train_dataset=samples, data_collator=CCMDataCollator(model)).train()
    assert [layer.gradient_checkpointing for layer in model.base_model.model.layers] == [True, False]
    trained = dict(model.named_parameters())
    assert any(not torch.equal(trained[name], weight) for name, weight in before.items())  # the step ran


@pytest.mark.parametrize(
    ("targets", "named"), [(["embed_tokens"], "model.embed_tokens"), (["mlp"], "model.layers.0.mlp")]
)
def test_targets_that_are_not_linear_layers_are_refused_and_leave_the_base_as_it_was(targets, named):
    """The gate restricts a LoRA on linear layers only; the base model given is not left half-wrapped."""
    base = tiny_base("llama")
    with pytest.raises(ValueError, match=rf"selects modules that are not linear layers \(\['{re.escape(named)}'"):
        CCMForCausalLM.from_base(base, CCMConfig(target_modules=targets))
    assert not lora_layers(base)
    CCMForCausalLM.from_base(base, CCMConfig())  # still a plain base model


def test_trainable_parameters_leave_out_frozen_comp_embeddings(capsys):
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    model.comp_embeddings.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model.num_parameters(only_trainable=True) == trainable
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    model.print_trainable_parameters()
    assert f"trainable params: {trainable:,} ||" in capsys.readouterr().out
