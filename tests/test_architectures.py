"""Which models CCM wraps, and the errors for those it cannot."""

import copy

import pytest
import torch
from accelerate import cpu_offload, disk_offload, dispatch_model, init_empty_weights
from accelerate.hooks import remove_hook_from_module
from accelerate.utils import set_module_tensor_to_device
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertLMHeadModel,
    BloomConfig,
    DeepseekV3Config,
    JambaConfig,
    Lfm2Config,
    Llama4TextConfig,
    NemotronConfig,
    RecurrentGemmaConfig,
    T5Config,
    T5ForConditionalGeneration,
)

from ccm_reference import reference_logits
from fault_injection import assert_same, snapshot
from test_online import assert_greedy_generate_equals_parallel, online_logits, parallel_logits
from tiny_models import (
    MORE_ARCHITECTURES,
    InjectedFailure,
    fail_in_layer,
    more_tiny_base,
    randomize_adapter,
    tiny_base,
    tiny_ccm,
)
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample, StreamingConfig
from transformers_ccm.lora import lora_layers


def test_model_without_attention_interface_is_refused():
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(TypeError, match=r"AttentionInterface, .* Known to work: llama, mistral, .*, gpt2\.$"):
        CCMForCausalLM.from_base(bloom, CCMConfig())


def test_a_tested_type_that_the_installed_transformers_has_not_ported_is_refused_with_an_upgrade():
    """transformers routes CodeGen's attention through the AttentionInterface from 5.24 (GPT-J's too): on 5.23
    the refusal listed codegen among the types known to work. The model's class says so as those versions' does."""
    base = more_tiny_base("codegen")
    base._supports_attention_backend = False
    fix = (
        r"transformers 5\.\d+\.\d+\S* does not route codegen's attention through it yet, a later version does: upgrade"
    )
    with pytest.raises(TypeError, match=rf"CodeGenForCausalLM does not route .* AttentionInterface, .*\. {fix}"):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert not lora_layers(base)


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_WITH_OTHER_LAYERS = {
    "conv": lambda: Lfm2Config(**_SMALL, layer_types=["conv", "full_attention"]),
    "recurrent": lambda: RecurrentGemmaConfig(**_SMALL, lru_width=32, block_types=["recurrent", "attention"]),
    "mamba": lambda: JambaConfig(**_SMALL, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False),
    "chunked attention": lambda: Llama4TextConfig(**_SMALL, head_dim=8, attention_chunk_size=4),
}


@pytest.mark.parametrize("kind", sorted(_WITH_OTHER_LAYERS))
def test_a_model_with_layers_that_are_not_attention_is_refused_and_left_as_it_was(kind):
    """LFM2 and RecurrentGemma were wrapped and failed at the first compression with an AttributeError (their
    recurrent layers hold no keys); Llama 4's chunked attention ran unmasked, and generate() disagreed with the
    parallel forward."""
    base = AutoModelForCausalLM.from_config(_WITH_OTHER_LAYERS[kind]())
    modules = {name: type(module) for name, module in base.named_modules()}
    implementation = base.config._attn_implementation
    with pytest.raises(TypeError, match=r"has layers of the types \[.*\] \(config.layer_types\).*every layer is full"):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert {name: type(module) for name, module in base.named_modules()} == modules
    assert base.config._attn_implementation == implementation


def test_a_model_whose_layers_drop_keyword_arguments_is_refused_and_left_as_it_was():
    """Nemotron's decoder layers call attention without the forward's keyword arguments: CCM's merge memory never
    reached attention and the training forward failed on a shape."""
    base = AutoModelForCausalLM.from_config(NemotronConfig(**_SMALL, num_key_value_heads=2)).train()
    modules = {name: (type(module), module.training) for name, module in base.named_modules()}
    hooks = {name: dict(module._forward_pre_hooks) for name, module in base.named_modules()}
    with pytest.raises(TypeError, match=r"NemotronForCausalLM's layers do not hand the forward's keyword arguments"):
        CCMForCausalLM.from_base(base, CCMConfig(update="merge"))
    assert {name: (type(module), module.training) for name, module in base.named_modules()} == modules
    assert {name: dict(module._forward_pre_hooks) for name, module in base.named_modules()} == hooks


def test_a_decoder_with_cross_attention_it_does_not_run_is_wrapped_and_exact():
    """A BERT decoder with cross-attention layers (which run only given an encoder's states) was refused as a model
    whose layers drop the forward's keyword arguments."""
    torch.manual_seed(0)
    config = BertConfig(**_SMALL, is_decoder=True, add_cross_attention=True)
    model = randomize_adapter(CCMForCausalLM.from_base(BertLMHeadModel(config).eval(), CCMConfig(update="merge")))
    samples = [OnlineSample([[5, 6, 7], [8, 9]], [20, 21], [22]), OnlineSample([[10, 11]], [30], [31, 32])]
    for sample, parallel, online in zip(
        samples, parallel_logits(model, samples), online_logits(model, samples), strict=True
    ):
        expected = reference_logits(model, sample.contexts, [*sample.input, *sample.output])
        assert (parallel - expected).abs().max() <= 1e-4 and (online - parallel).abs().max() <= 1e-4


def test_a_model_that_caches_a_latent_instead_of_keys_is_refused_and_left_as_it_was():
    """DeepSeek-V3's multi-head latent attention caches a compressed latent per token: it was wrapped, and every
    call failed on a shape."""
    config = DeepseekV3Config(
        **_SMALL, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8
    )
    base = AutoModelForCausalLM.from_config(config)
    modules = {name: type(module) for name, module in base.named_modules()}
    with pytest.raises(TypeError, match=r"shapes \[\(1, 1, 4, 16\)\] for 4 tokens, not the keys of its \d+ key/value"):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert {name: type(module) for name, module in base.named_modules()} == modules
    assert not hasattr(base, "peft_config")


def test_encoder_decoder_is_refused():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(TypeError, match="decoder-only"):
        CCMForCausalLM.from_base(t5, CCMConfig())


@pytest.mark.parametrize("head", ["none", "sequence classification"])
def test_a_model_without_a_language_modelling_head_is_refused_and_left_as_it_was(head):
    """A `LlamaModel` (or a classifier) was wrapped, compressed contexts, and failed inside generate()."""
    base = (
        tiny_base("llama").model
        if head == "none"
        else AutoModelForSequenceClassification.from_config(tiny_base("llama").config)
    )
    implementation = base.config._attn_implementation
    with pytest.raises(
        TypeError, match=rf"{type(base).__name__} has no language-modelling head .* AutoModelForCausalLM"
    ):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert not lora_layers(base) and base.config._attn_implementation == implementation


@pytest.mark.parametrize("config", [{}, {"num_comp_tokens": 4}, "concat"])
def test_a_config_that_is_no_ccm_config_is_refused_and_the_base_left_as_it_was(config):
    """A dict failed with an AttributeError (an empty one was silently taken for the defaults)."""
    base = tiny_base("llama")
    with pytest.raises(TypeError, match=rf"config must be a CCMConfig, got {type(config).__name__}; build one with"):
        CCMForCausalLM.from_base(base, config)
    with pytest.raises(TypeError, match="config must be a CCMConfig"):
        CCMForCausalLM(base, config)
    assert not lora_layers(base)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("num_comp_tokens", [512, 600])
def test_a_comp_block_that_fills_the_models_positions_is_refused_and_the_base_left_as_it_was(
    architecture, num_comp_tokens
):
    """Such a model could never compress a context: every compress() was refused asking for shorter pieces, and a
    rotary model trained on positions past its own."""
    base = tiny_base(architecture)
    with pytest.raises(
        ValueError,
        match=rf"num_comp_tokens={num_comp_tokens} leaves no room for a context in the 512 positions of the base "
        r"model; use fewer <COMP> tokens \(at most 511",
    ):
        CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=num_comp_tokens))
    assert not lora_layers(base)
    CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=511))


def test_peft_model_is_refused():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_base("llama"), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="PEFT"):
        CCMForCausalLM.from_base(peft_model, CCMConfig())


def test_a_compiled_or_peft_base_is_refused_with_its_fix_by_from_base_and_from_pretrained(tmp_path):
    """What torch.compile(base) returns is no PreTrainedModel: from_base blamed a PEFT model, and from_pretrained
    (as for a PEFT model) failed in os.fspath with "expected str, bytes or os.PathLike object"."""
    from peft import LoraConfig, get_peft_model

    tiny_ccm("llama").save_pretrained(tmp_path)
    base = tiny_base("llama")
    compiled = torch.compile(base)  # compiles at its first call only: this costs nothing
    fix = r"got torch.compile's OptimizedModule around a LlamaForCausalLM; pass the model itself \(compiled._orig_mod\)"
    with pytest.raises(TypeError, match=fix):
        CCMForCausalLM.from_base(compiled, CCMConfig())
    with pytest.raises(TypeError, match=fix):
        CCMForCausalLM.from_pretrained(tmp_path, base_model=compiled)
    peft_model = get_peft_model(tiny_base("llama"), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(TypeError, match=r"got PeftModel; for a PEFT model pass its base model"):
        CCMForCausalLM.from_pretrained(tmp_path, base_model=peft_model)
    assert not lora_layers(base) and not hasattr(base, "peft_config")


def test_loading_arguments_with_a_loaded_model_are_refused():
    with pytest.raises(TypeError, match="loading arguments"):
        CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(), torch_dtype=torch.float16)


def test_a_base_model_offloaded_by_accelerate_is_refused_and_left_as_it_was(tmp_path):
    """A disk-offloaded layer keeps its weights on the meta device: the LoRA added there held no weights, and the
    first call failed with "Cannot copy out of meta tensor"."""
    tiny_base("llama").save_pretrained(tmp_path / "base")
    placement = {name: "cpu" for name in ("model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb")}
    placement |= {"model.layers.1": "disk", "lm_head": "cpu"}
    base = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device_map=placement, offload_folder=tmp_path / "off"
    )
    modules = {name: type(module) for name, module in base.named_modules()}
    with pytest.raises(ValueError, match=r"offloads \(model.layers.1 in its device_map\).*device_map='cpu'"):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert {name: type(module) for name, module in base.named_modules()} == modules


def test_cpu_entries_beside_an_accelerator_count_as_offloaded_and_a_cpu_only_map_does_not(tmp_path):
    tiny_base("llama").save_pretrained(tmp_path)
    placement = {name: "cpu" for name in ("model.embed_tokens", "model.layers", "model.norm", "lm_head")}
    on_cpu = CCMForCausalLM.from_base(str(tmp_path), CCMConfig(), device_map=placement | {"model.rotary_emb": "cpu"})
    cache = on_cpu.new_cache(batch_size=1)
    on_cpu.compress(cache, torch.tensor([[5, 6, 7]]))
    assert on_cpu(input_ids=torch.tensor([[8, 9]]), past_key_values=cache).logits.isfinite().all()
    beside_a_gpu = tiny_base("llama")
    beside_a_gpu.hf_device_map = {"model": 0, "lm_head": "cpu"}  # what accelerate records for such a map
    with pytest.raises(ValueError, match=r"offloads \(lm_head in its device_map\)"):
        CCMForCausalLM.from_base(beside_a_gpu, CCMConfig())


OFFLOADS = {
    "cpu_offload of the base": lambda model, _: cpu_offload(model.base_model, torch.device("cpu")),
    "cpu_offload of the model": lambda model, _: cpu_offload(model, torch.device("cpu")),
    "disk_offload": lambda model, folder: disk_offload(model.base_model, folder, torch.device("cpu")),
    "dispatch_model": lambda model, folder: dispatch_model(
        model.base_model,
        {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu"}
        | {"model.rotary_emb": "cpu", "lm_head": "cpu"},
        offload_dir=folder,
    ),
}


@pytest.mark.parametrize("offload", OFFLOADS)
def test_a_model_offloaded_by_accelerate_after_wrapping_is_refused_and_its_cache_left_as_it_was(offload, tmp_path):
    """Offloading once CCM wrapped the model left its weights on the meta device: new_cache() failed with "Cannot copy
    out of meta tensor", and compress() blamed a change made by another thread (the hooks swap the weights in)."""
    model = copy.deepcopy(tiny_ccm("llama", update="merge"))
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
    before = snapshot(cache)
    OFFLOADS[offload](model, tmp_path / "offload")
    calls = {
        "new_cache": lambda: model.new_cache(),
        "compress": lambda: model.compress(cache, torch.tensor([[11, 12]])),
        "generate": lambda: model.generate(torch.tensor([[9, 10]]), past_key_values=cache, max_new_tokens=2),
        "forward": lambda: model(input_ids=torch.tensor([[9, 10]]), past_key_values=cache),
        "training forward": lambda: model(**CCMDataCollator(model)([OnlineSample([[5, 6]], [7], [8])])),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"(meta device|offloads).*device_map='cpu'.*remove_hook_from_module"):
            call()
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("offload", [name for name in OFFLOADS if name != "dispatch_model"])
def test_a_model_refused_while_offloaded_computes_as_before_once_the_hooks_are_removed(offload, tmp_path):
    """accelerate swaps the weights without torch's registration hooks: the first call after the hooks were removed
    held the model to the offloaded weights it had listed when it refused a call, and failed as if another thread
    had changed them."""
    model = copy.deepcopy(tiny_ccm("llama", update="merge"))
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
    expected = model(input_ids=torch.tensor([[9, 10]]), past_key_values=copy.deepcopy(cache)).logits
    OFFLOADS[offload](model, tmp_path / "offload")
    with pytest.raises(ValueError, match="meta device"):
        model.compress(cache, torch.tensor([[11, 12]]))
    remove_hook_from_module(model, recurse=True)
    torch.testing.assert_close(
        model(input_ids=torch.tensor([[9, 10]]), past_key_values=cache).logits, expected, rtol=0, atol=0
    )


@pytest.mark.parametrize("when", ["before wrapping", "after wrapping"])
def test_a_base_dispatched_by_accelerate_with_its_hooks_computes_as_the_model_undispatched(when):
    """accelerate's AlignDevicesHook (each module's forward replaced, its inputs moved to its device) beside CCM's own
    forward hooks: the parallel and online paths, generate() and a failed compression, as on the model undispatched."""
    expected = tiny_ccm("llama", update="merge")
    if when == "after wrapping":
        model = copy.deepcopy(expected)
    else:
        model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge"))
    placement = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    dispatch_model(model.base_model, placement | {"model.layers.0": "cpu", "model.layers.1": "cpu"}, force_hooks=True)
    model = randomize_adapter(model) if when == "before wrapping" else model
    assert hasattr(model.base_model.model.layers[1], "_hf_hook")
    samples = [OnlineSample([[5, 6, 7], [8, 9]], [20, 21], [22]), OnlineSample([[10, 11]], [30], [31, 32])]
    for got, want in [
        (parallel_logits(model, samples), parallel_logits(expected, samples)),
        (online_logits(model, samples), online_logits(expected, samples)),
    ]:
        for each, other in zip(got, want, strict=True):
            torch.testing.assert_close(each, other, rtol=0, atol=0)
    caches = [each.new_cache() for each in (model, expected)]
    replies = []
    for each, cache in zip((model, expected), caches, strict=True):
        each.compress(cache, torch.tensor([[5, 6, 7]]))
        replies.append(each.generate(torch.tensor([[9, 10]]), past_key_values=cache, max_new_tokens=3))
        each.compress(cache)
    assert torch.equal(replies[0], replies[1])
    before = snapshot(caches[0])
    handle = fail_in_layer(model, 1, after_calls=0)
    with pytest.raises(InjectedFailure):
        model.compress(caches[0], torch.tensor([[11, 12]]))
    handle.remove()
    assert_same(snapshot(caches[0]), before)


@pytest.mark.slow
def test_a_base_compiled_in_place_computes_as_the_uncompiled_one():
    """torch.compile in place (`base.compile()`, before wrapping) traces CCM's forward hooks, LoRA gate and merge
    memory into the compiled forward: the parallel and online paths and generate() give what the uncompiled model
    gives. About 20 s on 2 cores."""
    base = tiny_base("llama")
    base.compile()
    try:
        model = randomize_adapter(CCMForCausalLM.from_base(base, CCMConfig(update="merge")))
        expected = tiny_ccm("llama", update="merge")
        samples = [OnlineSample([[5, 6, 7], [8, 9]], [20, 21], [22]), OnlineSample([[10, 11]], [30], [31, 32])]
        for got, want in [
            (parallel_logits(model, samples), parallel_logits(expected, samples)),
            (online_logits(model, samples), online_logits(expected, samples)),
        ]:
            for each, other in zip(got, want, strict=True):
                torch.testing.assert_close(each, other, rtol=0, atol=1e-5)
        replies = []
        for each in (model, expected):
            cache = each.new_cache()
            each.compress(cache, torch.tensor([[5, 6, 7]]))
            replies.append(each.generate(torch.tensor([[9, 10]]), past_key_values=cache, max_new_tokens=4))
        assert torch.equal(replies[0], replies[1])
    finally:
        torch._dynamo.reset()


def test_an_adapter_loaded_onto_weights_never_loaded_is_refused_and_the_model_left_as_it_was(tmp_path):
    """A base model built under accelerate's init_empty_weights holds its weights on the meta device, where copying an
    adapter in does nothing: from_pretrained and load_adapter returned with a torch warning, and the first call (and
    save_pretrained) failed with "Cannot copy out of meta tensor"."""
    tiny_ccm("llama").save_pretrained(tmp_path)
    with init_empty_weights():
        base = AutoModelForCausalLM.from_config(tiny_base("llama").config)
    modules = {name: type(module) for name, module in base.named_modules()}
    fix = r"meta device.*init_empty_weights.*device_map='cpu'"
    with pytest.raises(ValueError, match=fix):
        CCMForCausalLM.from_pretrained(tmp_path, base_model=base)
    assert {name: type(module) for name, module in base.named_modules()} == modules
    model = CCMForCausalLM.from_base(base, CCMConfig())  # wrapped for its shapes alone (benchmarks count its bytes)
    saved = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    calls = {
        "load_adapter": lambda: model.load_adapter(tmp_path),
        "save_pretrained": lambda: model.save_pretrained(tmp_path),
        "push_to_hub": lambda: model.push_to_hub("someone/ccm-adapter"),
        "new_cache": lambda: model.new_cache(),
        "memory_signature": lambda: model.memory_signature(),
        "training forward": lambda: model(**CCMDataCollator(model)([OnlineSample([[5, 6]], [7], [8])])),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=fix):
            call()
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == saved
    # Its weights put in by accelerate (as load_checkpoint_and_dispatch does), which torch's registration hooks do not
    # see: the model then computes as the one they come from.
    loaded = tiny_ccm("llama")
    for name, tensor in [*loaded.state_dict().items(), *loaded.named_buffers()]:
        set_module_tensor_to_device(model, name, "cpu", value=tensor)
    model.eval()
    caches = [each.new_cache() for each in (model, loaded)]
    logits = []
    for each, cache in zip((model, loaded), caches, strict=True):
        each.compress(cache, torch.tensor([[5, 6, 7]]))
        logits.append(each(input_ids=torch.tensor([[8, 9]]), past_key_values=cache).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_a_model_wrapped_before_its_weights_were_loaded_streams_as_the_model_they_come_from():
    """Wrapped under init_empty_weights, CCM cannot run the base model to learn whether rotation moves its keys: a
    Llama given its weights afterwards (as load_checkpoint_and_dispatch does) refused streaming as a model with learned
    absolute positions, and could not re-base a memory at its last positions."""
    loaded = tiny_ccm("llama")
    with init_empty_weights():
        base = AutoModelForCausalLM.from_config(tiny_base("llama").config)
    model = CCMForCausalLM.from_base(base, CCMConfig())
    for name, tensor in [*loaded.state_dict().items(), *loaded.named_buffers()]:
        set_module_tensor_to_device(model, name, "cpu", value=tensor)
    model.eval()
    streaming = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4)
    ids = (torch.arange(14) * 7 % 90 + 3)[None]
    logits = []
    for each in (model, loaded):
        cache = each.new_cache(streaming=streaming)
        pieces = [each(input_ids=piece, past_key_values=cache).logits for piece in ids.split(7, dim=1)]
        assert cache.stream_lengths[0, 1] > 0  # chunks were compressed into memory slots
        logits.append(torch.cat(pieces, dim=1))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_a_model_moved_to_the_meta_device_is_refused_and_its_cache_left_as_it_was():
    """`to("meta")` puts new parameters in place without torch's registration hooks: the model kept its listing of the
    weights it had, new_cache() made a cache of the meta device, and calls failed inside torch."""
    model = copy.deepcopy(tiny_ccm("llama", update="merge"))
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    before = snapshot(cache)
    model.to("meta")
    calls = {
        "new_cache": lambda: model.new_cache(),
        "compress": lambda: model.compress(cache, torch.tensor([[11, 12]])),
        "generate": lambda: model.generate(torch.tensor([[9, 10]]), past_key_values=cache, max_new_tokens=2),
        "training forward": lambda: model(**CCMDataCollator(model)([OnlineSample([[5, 6]], [7], [8])])),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"meta device.*init_empty_weights"):
            call()
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("offload", [name for name in OFFLOADS if name != "dispatch_model"])
def test_an_adapter_loaded_into_or_saved_from_a_model_offloaded_after_wrapping_is_refused(offload, tmp_path):
    """The adapter's weights were copied onto the meta device, which does nothing: load_adapter returned, and once
    the hooks were removed the model ran the adapter it had before. save_pretrained failed inside torch."""
    tiny_ccm("llama", update="merge").save_pretrained(tmp_path / "adapter")
    model = randomize_adapter(copy.deepcopy(tiny_ccm("llama", update="merge")), seed=7)
    before = model.memory_signature()
    OFFLOADS[offload](model, tmp_path / "offload")
    with pytest.raises(ValueError, match=r"meta device.*remove_hook_from_module"):
        model.load_adapter(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"meta device.*remove_hook_from_module"):  # its weights are not there to save
        model.save_pretrained(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    remove_hook_from_module(model, recurse=True)
    assert model.memory_signature() == before
    model.load_adapter(tmp_path / "adapter")
    assert (
        model.memory_signature()["adapter_sha256"]
        == tiny_ccm("llama", update="merge").memory_signature()["adapter_sha256"]
    )


def test_from_base_loads_a_local_path(tmp_path):
    tiny_base("qwen2").save_pretrained(tmp_path)
    model = CCMForCausalLM.from_base(str(tmp_path), CCMConfig(num_comp_tokens=3))
    assert model.config.base_model_name_or_path == str(tmp_path)
    assert model.comp_embeddings.shape == (3, 32)
    assert model.base_model.config._attn_implementation == "ccm_sdpa"


def test_eager_models_keep_eager_attention():
    model = CCMForCausalLM.from_base(tiny_base("gemma2"), CCMConfig())
    assert model.base_model.config._attn_implementation == "ccm_eager"


def test_user_config_is_not_modified():
    config = CCMConfig()
    model = CCMForCausalLM.from_base(tiny_base("llama"), config)
    assert config.base_model_name_or_path is None
    assert model.config is not config


def _memory_logits(model):
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    with torch.no_grad():
        return model(input_ids=torch.tensor([[20, 21]]), past_key_values=cache).logits


def _decoded_logits(model, cache):
    context = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    if cache.streaming is None:
        model.compress(cache, context)
    else:
        with torch.no_grad():
            model(input_ids=context, past_key_values=cache)
    out = model.generate(
        torch.tensor([[20, 21]]),
        past_key_values=cache,
        max_new_tokens=6,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return torch.stack(out.logits)


@pytest.mark.parametrize("streaming", [None, StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4)])
@pytest.mark.parametrize(("before", "after"), [("sdpa", "eager"), ("eager", "sdpa")])
def test_a_cache_made_before_switching_the_attention_decodes_as_one_made_after(before, after, streaming):
    """A cache made under sdpa left the mask out of one-token steps after a switch to eager, whose mask code then
    hid part of the memory (the logits of a model that forgot)."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    model.set_attn_implementation(before)
    made_before = model.new_cache(streaming=streaming)
    model.set_attn_implementation(after)
    expected = _decoded_logits(model, model.new_cache(streaming=streaming))
    torch.testing.assert_close(_decoded_logits(model, made_before), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flex_attention"])
def test_switching_the_base_models_attention_after_wrapping_is_refused_with_the_fix(implementation):
    """Switched on the base model, the attention would lose CCM's masks and merged memory (eager added a boolean mask
    as numbers, flex crashed the process); each call refuses it before anything runs, naming the model's own switch,
    which keeps CCM's attention around the implementation asked for and gives the same logits."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge"))
    expected = _memory_logits(model)
    cache = model.new_cache()
    model.base_model.set_attn_implementation(implementation)
    with pytest.raises(ValueError, match=r"model\.set_attn_implementation"):
        model.compress(cache, torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match=r"model\.set_attn_implementation"):
        model.generate(torch.tensor([[20, 21]]), past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"model\.set_attn_implementation"):
        model(**CCMDataCollator(model)([OnlineSample([[5, 6]], [7], [8])]))
    assert cache.memory_length == 0 and not cache.has_unfolded_turn
    for switched in ("eager", "sdpa"):
        model.set_attn_implementation(switched)
        assert model.base_model.config._attn_implementation == f"ccm_{switched}"
        torch.testing.assert_close(_memory_logits(model), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="'sdpa' or 'eager'"):
        model.set_attn_implementation("flex_attention")
    assert model.base_model.config._attn_implementation == "ccm_sdpa"


def test_a_mixture_of_experts_adapter_saves_and_loads(tmp_path):
    """PEFT writes target_parameters=[] for the MoE models whose config it converts (Mixtral, Qwen3-MoE), and loading
    refused every such adapter as one whose files disagree with its ccm_config.json."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("mixtral"), CCMConfig()))
    model.save_pretrained(tmp_path)
    loaded = CCMForCausalLM.from_pretrained(tmp_path, base_model=tiny_base("mixtral"))
    assert torch.equal(_memory_logits(loaded), _memory_logits(model))


@pytest.mark.parametrize("lora_dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", [["w1", "w3"], ["q_proj", "w1", "w2", "w3"]])
def test_targets_on_fused_experts_are_refused_and_the_base_left_as_it_was(targets, lora_dropout):
    """PEFT puts a LoRA on Mixtral's fused expert weights for their old names: the gate cannot keep one on a weight to
    <COMP> positions, and the first call failed on a shape (or, with dropout, PEFT's error named the dropout)."""
    base = tiny_base("mixtral")
    modules = {name: type(module) for name, module in base.named_modules()}
    with pytest.raises(ValueError, match=r"experts of MixtralForCausalLM.*'gate_up_proj'\].*every token.*Name linear"):
        CCMForCausalLM.from_base(base, CCMConfig(target_modules=targets, lora_dropout=lora_dropout))
    assert {name: type(module) for name, module in base.named_modules()} == modules
    assert not hasattr(base, "peft_config")


@pytest.mark.parametrize("architecture", ["cohere", "smollm3", "gptj"])
def test_keys_that_cannot_be_re_rotated_refuse_streaming_and_re_basing(architecture):
    """Streaming and re-basing moved Cohere's keys (rotated in interleaved pairs) and SmolLM3's (a layer without
    positions) as if in Llama's layout, to wrong positions: the logits of another history, silently. GPT-J's rotary
    module (a table of sines and cosines) made every cache fail with an AttributeError."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig()))
    with pytest.raises(TypeError, match=r"keys cannot follow .*interleaved pairs.*layers without positions"):
        model.new_cache(streaming=StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4))
    cache, context = model.new_cache(), torch.tensor([list(range(3, 60))])
    for _ in range(8):  # 8 * (57 + 1) positions of the 512
        model.compress(cache, context)
    memory = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match=r"past the model's 512 positions, which cannot be moved .*Start a new cache"):
        model.compress(cache, context)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, memory, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_wrapped_under_autocast_streams(dtype):
    """Wrapped under autocast, an fp32 model computes its keys in half precision: the wrap-time check of its rotary
    layout held them to fp32's tolerance, found them unmovable, and every stream of this Llama was refused."""
    with torch.autocast("cpu", dtype=dtype):
        model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    model.new_cache(streaming=StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4))


@pytest.mark.parametrize("model_type", MORE_ARCHITECTURES)
@pytest.mark.parametrize("update", ["concat", "merge"])
def test_more_architectures_are_exact_and_their_adapters_load(model_type, update, tmp_path):
    """The parallel forward equals the step-by-step recursion and the online path, greedy generate() equals
    teacher-forced decoding, and a saved adapter loads to the same logits."""
    model = randomize_adapter(CCMForCausalLM.from_base(more_tiny_base(model_type), CCMConfig(update=update)))
    samples = [OnlineSample([[5, 6, 7, 8], [9, 10]], [20, 21, 22], [23, 24]), OnlineSample([[11, 12]], [30], [31])]
    parallel = parallel_logits(model, samples)
    for row, sample in enumerate(samples):
        expected = reference_logits(model, sample.contexts, [*sample.input, *sample.output])
        assert (parallel[row] - expected).abs().max() <= 1e-4
    for side in ("left", "right"):
        for online, from_parallel in zip(online_logits(model, samples, side), parallel, strict=True):
            assert (online - from_parallel).abs().max() <= 1e-4
    assert_greedy_generate_equals_parallel(model, [[5, 6, 7], [8, 9]], steps=5)
    model.save_pretrained(tmp_path)
    loaded = CCMForCausalLM.from_pretrained(tmp_path, base_model=more_tiny_base(model_type))
    assert torch.equal(parallel_logits(loaded, samples)[0], parallel[0])
