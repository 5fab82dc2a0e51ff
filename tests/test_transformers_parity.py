"""What a transformers or PEFT user calls on a model works on a `CCMForCausalLM`, or is refused with a clear error."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import TextIteratorStreamer, pipeline

from tiny_models import InjectedFailure, fail_in_layer, randomize_adapter, tiny_base, tiny_ccm, tiny_llama_for
from transformers_ccm import CCMConfig, CCMForCausalLM


def test_a_text_generation_pipeline_generates_as_the_model_does(tokenizer):
    """`pipeline` asks `can_generate()` before anything runs; it then decodes without memory (a fresh cache)."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_llama_for(tokenizer), CCMConfig()))
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("Hello there", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    prompt = tokenizer("Hello there", return_tensors="pt")
    expected = model.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_members_of_a_pretrained_model_reach_the_base_model():
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    assert model.main_input_name == "input_ids" and model.can_generate()
    assert model.get_input_embeddings() is model.base_model.model.embed_tokens
    assert model.get_output_embeddings() is model.base_model.lm_head
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model.get_nb_trainable_parameters() == (trainable, sum(p.numel() for p in model.parameters()))
    model.enable_input_require_grads()
    assert model.get_input_embeddings()(torch.tensor([[5, 6]])).requires_grad
    model.disable_input_require_grads()
    assert not model.get_input_embeddings()(torch.tensor([[5, 6]])).requires_grad
    signature = model.memory_signature()
    model.tie_weights()
    assert model.memory_signature() == signature


def test_generate_takes_the_prompt_under_transformers_name_inputs():
    """`generate(inputs=ids)` (transformers' name, and its first positional argument) is `generate(ids)`."""
    model = tiny_ccm("llama")
    runs = []
    for prompt in ({"input_ids": torch.tensor([[8, 9]])}, {"inputs": torch.tensor([[8, 9]])}):
        cache = model.new_cache()
        model.compress(cache, torch.tensor([[5, 6, 7]]))
        runs.append(model.generate(**prompt, past_key_values=cache, max_new_tokens=4, do_sample=False))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("enables", [1, 2])
@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])
def test_activation_checkpointing_turns_off_again(name, enables):
    """Hooks included: transformers' enable registers a require-grads hook on the embeddings, which its disable left
    there (and a second enable one more, for good), so that every forward of the frozen base built a graph."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()).eval()
    embeddings = model.get_input_embeddings()
    ids = torch.tensor([[5, 6, 7]])
    with model.adapter_disabled():
        assert not model.base_model(input_ids=ids).logits.requires_grad
    for _ in range(enables):
        getattr(model, f"{name}_enable")()
    assert model.is_activation_checkpointing and len(embeddings._forward_hooks) == 1
    getattr(model, f"{name}_disable")()
    assert not model.is_activation_checkpointing
    assert not any(layer.gradient_checkpointing for layer in model.base_model.model.layers)
    assert not embeddings._forward_hooks
    with model.adapter_disabled():
        assert not model.base_model(input_ids=ids).logits.requires_grad


def test_resizing_the_token_embeddings_is_refused_and_leaves_the_model_and_its_memories_as_they_were():
    """The adapter records its base's vocabulary, and new rows would be saved nowhere: resize before wrapping."""
    model = tiny_ccm("llama")
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    signature = model.memory_signature()
    with pytest.raises(ValueError, match=r"Resize the base model before wrapping it"):
        model.resize_token_embeddings(120)
    assert model.vocabulary_size == 97 and model.memory_signature() == signature
    model.generate(torch.tensor([[8, 9]]), past_key_values=cache, max_new_tokens=2)


@pytest.mark.parametrize(
    ("failure", "error"), [("a layer", InjectedFailure), ("an id outside the vocabulary", ValueError)]
)
def test_a_generate_that_fails_in_a_worker_thread_ends_its_streamer(tokenizer, failure, error):
    """transformers ends a streamer only when generation succeeds, so a consumer iterating a TextIteratorStreamer
    waited for ever when generate() failed in the thread that ran it (the timeout here only keeps a regression from
    hanging the suite)."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_llama_for(tokenizer), CCMConfig()))
    cache = model.new_cache()
    model.compress(cache, torch.tensor([tokenizer("My name is Ada.")["input_ids"]]))
    before = [layer.keys for layer in cache.layers]
    prompt = torch.tensor([tokenizer("What is my name?")["input_ids"]])
    if failure != "a layer":
        prompt[0, -1] = model.vocabulary_size
    streamer = TextIteratorStreamer(tokenizer, timeout=300)
    raised = []

    def run() -> None:
        try:
            model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False, streamer=streamer)
        except Exception as exception:
            raised.append(exception)

    handle = fail_in_layer(model, 1, after_calls=3) if failure == "a layer" else None
    try:
        worker = threading.Thread(target=run)
        worker.start()
        "".join(streamer)  # ends, instead of waiting for text that never comes
        worker.join()
    finally:
        if handle is not None:
            handle.remove()
    assert len(raised) == 1 and isinstance(raised[0], error)
    assert not cache.has_unfolded_turn
    assert all(keys is layer.keys for keys, layer in zip(before, cache.layers, strict=True))


def _model_state(model: CCMForCausalLM) -> tuple:
    """What a refused call must leave as it was: weights, modules, trainability, PEFT configs and a memory."""
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
    return (
        {key: value.clone() for key, value in model.state_dict().items()},
        [type(module) for module in model.modules()],
        {name: parameter.requires_grad for name, parameter in model.named_parameters()},
        dict(model.base_model.peft_config),
        [layer.keys.clone() for layer in cache.layers],
    )


def _assert_same_state(before: tuple, after: tuple) -> None:
    weights, modules, trainable, configs, memory = before
    assert after[0].keys() == weights.keys() and all(torch.equal(after[0][k], v) for k, v in weights.items())
    assert after[1] == modules and after[2] == trainable
    assert after[3].keys() == configs.keys() and all(after[3][k] is v for k, v in configs.items())
    assert all(torch.equal(a, b) for a, b in zip(after[4], memory, strict=True))


_PEFT_ON_A_CCM_MODEL = {
    "get_peft_model(model)": lambda model, config, folder: get_peft_model(model, config),
    "get_peft_model(model.base_model)": lambda model, config, folder: get_peft_model(model.base_model, config),
    "PeftModel.from_pretrained(model)": lambda model, config, folder: PeftModel.from_pretrained(model, folder),
    "model.base_model.load_adapter": lambda model, config, folder: model.base_model.load_adapter(
        folder, adapter_name="other"
    ),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    architecture=st.sampled_from(["llama", "gpt2"]),
    call=st.sampled_from(sorted(_PEFT_ON_A_CCM_MODEL)),
    projections=st.data(),
    with_mlp=st.booleans(),
)
def test_a_peft_adapter_put_on_a_ccm_model_is_refused_and_leaves_it_as_it_was(
    tmp_path_factory, architecture, call, projections, with_mlp
):
    """PEFT re-initialized the trained CCM adapter in every LoRA layer it targeted (B = 0, under the name "default"),
    or added one there that the gate never runs, and replaced the config a save writes, with a warning at most."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig()))
    attention = sorted({name.rsplit(".", 1)[-1] for name, _ in model.base_model.named_modules() if "attn" in name})
    attention = [name for name in attention if name in ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn")]
    targets = projections.draw(st.lists(st.sampled_from(attention), min_size=1, unique=True))
    targets += ["up_proj" if architecture == "llama" else "c_fc"] if with_mlp else []
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    get_peft_model(tiny_base(architecture), LoraConfig(target_modules=targets)).save_pretrained(folder)
    before = _model_state(model)
    with pytest.raises(ValueError, match=r"A CCM model takes no PEFT adapter .*merge_and_unload\(\)"):
        _PEFT_ON_A_CCM_MODEL[call](model, LoraConfig(target_modules=targets), folder)
    _assert_same_state(before, _model_state(model))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(architecture=st.sampled_from(["llama", "gpt2"]), on_base=st.booleans(), mlp=st.data())
def test_a_peft_lora_added_beside_the_ccm_one_is_refused_at_every_call_and_save(
    tmp_path_factory, architecture, on_base, mlp
):
    """get_peft_model with targets outside CCM's LoRA layers (the MLP) puts LoRA layers there that act at every token
    (calls were refused as if `enable_adapters(True)` had been called, naming the wrong fix), and on the base model
    replaces the adapter's config: save_pretrained wrote, over the adapter saved before, one that does not load."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig()))
    choices = ["gate_proj", "up_proj", "down_proj"] if architecture == "llama" else ["c_fc"]
    targets = mlp.draw(st.lists(st.sampled_from(choices), min_size=1, unique=True))
    folder = tmp_path_factory.mktemp("adapter") / "saved"
    model.save_pretrained(folder)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    get_peft_model(model.base_model if on_base else model, LoraConfig(target_modules=targets))
    refusal = r"PEFT changed this CCM model's adapter after it was wrapped: LoRA layers added on .*Build the model"
    for call in (
        lambda: model.compress(model.new_cache(), torch.tensor([[5, 6, 7]])),
        lambda: model.generate(torch.tensor([[8, 9]]), past_key_values=cache, max_new_tokens=2),
        lambda: model.save_pretrained(folder),
    ):
        with pytest.raises(ValueError, match=refusal):
            call()
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == files


def test_peft_s_disable_adapter_is_adapter_disabled_and_its_merges_are_refused():
    """`with model.disable_adapter():` (PEFT's idiom, TRL's reference model) and `merge_and_unload()` failed on an
    AttributeError; merged, a conditional LoRA would act at every token."""
    model = tiny_ccm("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    with model.disable_adapter():
        plain = model.base_model(input_ids=ids).logits
        with pytest.raises(ValueError, match=r"ran inside model\.adapter_disabled\(\)"):
            model.compress(model.new_cache(), ids)
    with model.lora_at(torch.ones_like(ids, dtype=torch.bool)):
        assert not torch.allclose(model.base_model(input_ids=ids).logits, plain)
        with model.disable_adapter():
            assert torch.equal(model.base_model(input_ids=ids).logits, plain)
    assert torch.equal(tiny_base("llama")(input_ids=ids).logits, plain)
    before = _model_state(model)
    for merge in (model.merge_and_unload, model.merge_adapter):
        with pytest.raises(ValueError, match=r"cannot be merged .* model\.adapter_disabled\(\)"):
            merge()
    _assert_same_state(before, _model_state(model))
