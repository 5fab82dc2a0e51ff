"""The adapters shipped in the package load by short name, on the embedded model, and hold a conversation."""

import pytest
import torch

from transformers_ccm import CCMConfig, CCMForCausalLM, StreamingConfig
from transformers_ccm.baseline import is_full_context_baseline
from transformers_ccm.chat import ChatSession
from transformers_ccm.embedded import EMBEDDED_MODEL_ID, load_tokenizer
from transformers_ccm.hub import read_adapter, resolve_adapter, shipped_adapters
from transformers_ccm.tasks.text import long_text

EXPECTED = {
    "ccm:smollm2-concat": ("concat", 1, "distilled from ccm:smollm2-full-context"),
    "ccm:smollm2-merge": ("merge", 4, "distilled from ccm:smollm2-full-context"),
    "ccm:smollm2-stream": ("concat", 2, "'text'"),
    "ccm:smollm2-full-context": ("concat", 2, "fine-tuned full-context baseline on"),  # <COMP> unused
}


def test_shipped_adapters_are_listed():
    assert shipped_adapters() == sorted(EXPECTED)


@pytest.mark.parametrize(("name", "expected"), EXPECTED.items())
def test_shipped_config_matches(name, expected):
    config, tensors = read_adapter(resolve_adapter(name))
    update, num_comp_tokens, trained_on = expected
    assert (config.update, config.num_comp_tokens) == (update, num_comp_tokens)
    assert config.base_model_name_or_path == EMBEDDED_MODEL_ID
    assert config.base_model_shape["model_type"] == "llama" and config.base_model_shape["num_hidden_layers"] == 30
    assert trained_on in config.trained_on
    assert tensors["ccm.comp_embeddings"].shape == (num_comp_tokens, 576)
    assert is_full_context_baseline(config) == (name == "ccm:smollm2-full-context") != config.conditional_lora


def test_unknown_short_name():
    with pytest.raises(FileNotFoundError, match="No shipped adapter 'ccm:gpt9'"):
        resolve_adapter("ccm:gpt9")


def test_default_model_is_recorded_by_its_hub_id_and_the_concat_adapter_holds_a_conversation_in_memory():
    """One load of the embedded model (seconds of GGUF reading) for both: `from_base("default")`, then the shipped
    adapter loaded into it (`from_pretrained("ccm:...")` is the stream adapter's test below)."""
    model = CCMForCausalLM.from_base("default", CCMConfig(num_comp_tokens=1))
    assert model.config.base_model_name_or_path == EMBEDDED_MODEL_ID == model.base_model.name_or_path
    model.load_adapter("ccm:smollm2-concat")
    model.eval()
    session = ChatSession(model, load_tokenizer("default"), max_new_tokens=12)
    first = session.turn("Hi! My name is Maria.")
    second = session.turn("Do you remember my name?")
    assert (first.memory_slots, second.memory_slots) == (1, 2)  # one slot per turn, not the turn's tokens
    assert second.full_context_tokens > 20 * second.memory_slots
    assert second.memory_bytes == 2 * model.base_model.config.num_hidden_layers * 2 * 3 * 64 * 4
    assert session.cache.turn_length == 0


def test_stream_adapter_streams_the_embedded_model_in_bounded_memory():
    model = CCMForCausalLM.from_pretrained("ccm:smollm2-stream").eval()
    streaming = StreamingConfig()
    text = long_text("test")[:1500]
    ids = load_tokenizer("default")(text, return_tensors="pt")["input_ids"]
    cache = model.new_cache(1, streaming=streaming)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids, past_key_values=cache).loss
    assert ids.shape[1] > 300 and cache.turn_tokens == ids.shape[1]
    assert cache.kv_length <= streaming.max_kv_length(model.config) == 160
    assert cache.memory_length == 8 and int(cache.steps[0]) >= 3
    assert loss.exp() < 30  # real language modelling through compressed memory, not noise
