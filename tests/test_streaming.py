"""Streaming caches: exact re-rotation, StreamingLLM and CCM streams against a plain reference, bounded
memory over long generations, batching, persistence and bad configurations."""

import copy
import sys
from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StoppingCriteriaList

from fault_injection import assert_same, snapshot
from streaming_reference import ReferenceStream
from test_online import StopAfter
from test_sliding_window import windowed_model
from tiny_models import (
    VOCAB,
    InjectedFailure,
    randomize_adapter,
    tiny_base,
    tiny_ccm,
    tiny_longrope_base,
    tiny_wide_head_base,
)
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, StreamingConfig
from transformers_ccm.modeling import CACHE_ARGUMENT
from transformers_ccm.streaming import KeyRotation

ROTARY = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt-neox", "olmo")
SMALL = StreamingConfig(window_tokens=10, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)


def keys_at(model, ids, start):
    """Every layer's cached keys for `ids` run at positions start, start + 1, ..."""
    cache = DynamicCache()
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad(), model.adapter_disabled():
        model.base_model(input_ids=ids, position_ids=positions, **{CACHE_ARGUMENT: cache})
    return [layer.keys for layer in cache.layers]


@pytest.mark.parametrize("architecture", ROTARY)
def test_rerotation_equals_keys_computed_at_the_new_positions(architecture):
    model = tiny_ccm(architecture)
    rotation = model.cache_spec().rotation
    ids = torch.randint(3, VOCAB, (2, 9))
    for old, new in ((40, 3), (0, 25), (7, 8)):
        moved = keys_at(model, ids, old)
        expected = keys_at(model, ids, new)
        for index, (keys, target) in enumerate(zip(moved, expected, strict=True)):
            shifted = rotation.shift(index, keys, torch.full((ids.shape[1],), new - old))
            torch.testing.assert_close(shifted, target, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_model_cast_after_wrapping_streams_as_one_wrapped_after_casting(architecture, dtype):
    """The rotary frequencies were read when the model was wrapped: a cast after it rounded those the model rotates
    keys with, and the stream's re-rotation, still using the unrounded ones, moved keys to other positions."""
    cast_after = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig())).to(dtype)
    # Its adapter, float32 on a half-precision base, cast too: the two models then differ in when the base was cast.
    cast_before = CCMForCausalLM.from_base(tiny_base(architecture).to(dtype), CCMConfig()).to(dtype).eval()
    cast_before.load_state_dict(cast_after.state_dict())
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (cast_after, cast_before):
        cache = model.new_cache(streaming=SMALL)
        with torch.no_grad():
            logits.append(torch.cat([model(input_ids=p, past_key_values=cache).logits for p in ids.split(6, dim=1)], 1))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_window_key_moved_token_by_token_is_rounded_once(dtype):
    """A window key moves back one position per token that enters a full window; rotated and rounded to bfloat16 at
    each move, a key 99 moves old was up to 29% off the key rotated once (slow rotary frequencies move a value by
    less than a rounding step, so those dimensions stopped turning), where one rounding is 0.4% at most."""
    model = CCMForCausalLM.from_base(tiny_wide_head_base(), CCMConfig()).to(dtype)
    cache = model.new_cache(streaming=StreamingConfig(window_tokens=148, sink_tokens=4, compress=False))
    ids = torch.randint(3, VOCAB, (300, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for index, token in enumerate(ids):
            model(input_ids=token[None], past_key_values=cache)
            if index == 200:  # the window is full: the key enters at its last slot
                entered, slot = cache.layers[0].keys[:, :, -1:].clone(), cache.kv_length - 1
    moves = len(ids) - 1 - 200
    rotation = KeyRotation.of_model(model.base_model, model._rotary_module)
    exact = rotation.shift(0, entered.float(), torch.tensor([-moves]))
    held = cache.layers[0].keys[:, :, slot - moves : slot - moves + 1].float()
    torch.testing.assert_close(held, exact, rtol=2**-8, atol=1e-5)  # half a rounding step of either dtype


def stream_logits(model, config, ids, piece):
    """Feed `ids` `(batch, len)` in pieces of `piece` tokens through a streaming cache and the reference."""
    cache = model.new_cache(ids.shape[0], streaming=config)
    reference = ReferenceStream(model, cache.streaming)  # the sizes the stream took (its adapter's cap where None)
    ours, theirs = [], []
    with torch.no_grad():
        for chunk in ids.split(piece, dim=1):
            ours.append(model(input_ids=chunk, past_key_values=cache).logits)
            theirs.append(reference.feed(chunk))
            assert cache.kv_length == len(reference.sink) + len(reference.memory) + len(reference.window)
            assert cache.layers[0].keys.shape[2] == cache.kv_length <= config.max_kv_length(model.config)
    return torch.cat(ours, dim=1), torch.cat(theirs, dim=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    architecture=st.sampled_from(("llama", "qwen3", "gpt-neox")),
    sink=st.integers(0, 3),
    window=st.integers(3, 9),
    piece=st.integers(1, 3),
    length=st.integers(1, 40),
)
def test_streaming_llm_equals_the_reference(architecture, sink, window, piece, length):
    model = tiny_ccm(architecture)
    config = StreamingConfig(window_tokens=window, sink_tokens=sink, compress=False)
    ids = torch.randint(3, VOCAB, (2, length))
    ours, theirs = stream_logits(model, config, ids, min(piece, window))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    architecture=st.sampled_from(("llama", "qwen3", "gpt-neox")),
    update=st.sampled_from(("concat", "merge", "ema")),
    num_comp_tokens=st.integers(1, 2),
    sink=st.integers(0, 2),
    chunk=st.integers(1, 4),
    extra_window=st.integers(0, 4),
    piece=st.integers(1, 3),
    length=st.integers(1, 48),
    keep_window_full=st.booleans(),
)
def test_ccm_stream_equals_compress_then_evict_reference(
    architecture, update, num_comp_tokens, sink, chunk, extra_window, piece, length, keep_window_full
):
    model = tiny_ccm(architecture, num_comp_tokens=num_comp_tokens, update=update)
    config = StreamingConfig(
        window_tokens=chunk + extra_window,
        sink_tokens=sink,
        compress_chunk=chunk,
        max_memory_tokens=2 * num_comp_tokens,
        keep_window_full=keep_window_full,
    )
    ids = torch.randint(3, VOCAB, (2, length))
    ours, theirs = stream_logits(model, config, ids, min(piece, config.max_forward_tokens))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_comp_tokens=st.integers(1, 2),
    slots=st.integers(0, 3),
    below=st.integers(0, 3),
    piece=st.integers(1, 3),
    length=st.integers(1, 40),
)
def test_a_stream_keeps_its_adapter_cap_unless_given_a_smaller_one(num_comp_tokens, slots, below, piece, length):
    """A stream took StreamingConfig's cap (8) whatever its adapter's: it held more memory slots than the adapter was
    made to read."""
    cap = num_comp_tokens + slots
    model = tiny_ccm("llama", num_comp_tokens=num_comp_tokens, max_memory_tokens=cap)
    default = StreamingConfig(window_tokens=6, sink_tokens=1, compress_chunk=3)
    smaller = replace(default, max_memory_tokens=max(cap - below, num_comp_tokens))
    for config, held in ((default, cap), (smaller, smaller.max_memory_tokens)):
        assert config.max_kv_length(model.config) == 1 + held + 6
        assert model.new_cache(1, streaming=config).streaming == replace(default, max_memory_tokens=held)
        ids = torch.randint(3, VOCAB, (2, length))
        ours, theirs = stream_logits(model, config, ids, piece)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cap", [5, 8])
def test_a_stream_cap_above_its_adapter_cap_is_refused(cap):
    model = tiny_ccm("llama", num_comp_tokens=2, max_memory_tokens=4)
    with pytest.raises(
        ValueError,
        match=rf"StreamingConfig.max_memory_tokens \({cap}\) exceeds the adapter's CCMConfig.max_memory_tokens "
        r"\(4\).* at most 4, or to None",
    ):
        model.new_cache(1, streaming=replace(SMALL, max_memory_tokens=cap))
    # Without compression the stream holds no memory: any cap goes.
    model.new_cache(1, streaming=replace(SMALL, max_memory_tokens=cap, compress=False))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    architecture=st.sampled_from(("mistral", "gemma2", "gemma3")),
    update=st.sampled_from(("concat", "merge")),
    size=st.integers(1, 5),
    sink=st.integers(0, 2),
    extra_window=st.integers(0, 6),
    piece=st.integers(1, 3),
    compress=st.booleans(),
    keep_window_full=st.booleans(),
)
def test_a_stream_keeps_the_sliding_window_of_the_model(
    architecture, update, size, sink, extra_window, piece, compress, keep_window_full
):
    """Sliding-window layers of a stream (StreamingLLM as the base model runs it, or CCM) see the sink and window tokens
    less than their window back, and the memory always; they saw the whole stream."""
    model = windowed_model(architecture, size, update)
    config = StreamingConfig(
        window_tokens=3 + extra_window,
        sink_tokens=sink,
        compress_chunk=3,
        max_memory_tokens=2,
        compress=compress,
        keep_window_full=keep_window_full,
    )
    ids = torch.randint(3, VOCAB, (2, 30))
    ours, theirs = stream_logits(model, config, ids, min(piece, config.max_forward_tokens))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compress", [True, False])
def test_a_longrope_stream_stays_within_the_original_context(compress):
    """A forward past its original context (64 positions) rotates every position with LongRoPE's long factors: a stream
    holding more moved keys computed with those by the short factors, to other positions than it gave them. Within it,
    the keys of the first layer (which depend on the token and its position alone) are those computed at the positions
    the stream moved them to."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig(num_comp_tokens=2)))
    # 2 sink + 4 memory + window + 2 <COMP> positions with compression; 2 sink + window without.
    window = 56 if compress else 62
    within = replace(SMALL, window_tokens=window, compress_chunk=8, compress=compress)
    with pytest.raises(ValueError, match="passes the model's original context of 64 positions"):
        model.new_cache(streaming=replace(within, window_tokens=window + 1))
    ids = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(streaming=within)
    with torch.no_grad():
        for piece in ids.split(7, dim=1):
            model(input_ids=piece, past_key_values=cache)
    sink, kept = cache.sink_length, cache.sink_length + cache.memory_length
    expected = [keys_at(model, ids[:, :sink], 0)[0], keys_at(model, ids[:, -cache.window_length :], kept)[0]]
    keys = cache.layers[0].keys
    torch.testing.assert_close(torch.cat([keys[:, :, :sink], keys[:, :, kept:]], dim=2), torch.cat(expected, dim=2))


def test_long_inputs_are_split_and_compressed_by_themselves():
    model = tiny_ccm("llama", num_comp_tokens=2)
    ids = torch.randint(3, VOCAB, (1, 57))
    ours, theirs = stream_logits(model, SMALL, ids, SMALL.max_forward_tokens)
    whole = model(input_ids=ids, past_key_values=model.new_cache(1, streaming=SMALL)).logits
    torch.testing.assert_close(whole, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("keep", [1, 5, 57])
def test_logits_to_keep_counts_from_the_end_of_a_split_input(keep):
    model = tiny_ccm("llama", num_comp_tokens=2)
    ids = torch.randint(3, VOCAB, (1, 57))
    whole = model(input_ids=ids, past_key_values=model.new_cache(1, streaming=SMALL)).logits
    kept = model(input_ids=ids, past_key_values=model.new_cache(1, streaming=SMALL), logits_to_keep=keep).logits
    torch.testing.assert_close(kept, whole[:, -keep:], atol=1e-5, rtol=0)


def test_a_split_input_returns_the_hidden_states_of_its_pieces_and_refuses_attentions():
    """An input longer than a stream's forward runs in pieces: `output_hidden_states=True` gave None, and
    `output_attentions=True` was dropped without a word (each piece attends to another window: refused)."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    ids = torch.randint(3, VOCAB, (1, 29))
    cache = model.new_cache(1, streaming=SMALL)
    with torch.no_grad():
        pieces = [
            model(input_ids=piece, past_key_values=cache, output_hidden_states=True)
            for piece in ids.split(SMALL.max_forward_tokens, dim=1)
        ]
        whole = model(input_ids=ids, past_key_values=model.new_cache(1, streaming=SMALL), output_hidden_states=True)
    assert len(whole.hidden_states) == len(pieces[0].hidden_states) == model.base_model.config.num_hidden_layers + 1
    for index, layer in enumerate(whole.hidden_states):
        torch.testing.assert_close(layer, torch.cat([piece.hidden_states[index] for piece in pieces], dim=1))
    before = cache.copy()
    with pytest.raises(ValueError, match=f"pass at most {SMALL.max_forward_tokens} tokens per call"):
        model(input_ids=ids, past_key_values=cache, output_attentions=True)
    assert cache.turn_tokens == before.turn_tokens and torch.equal(cache.layers[0].keys, before.layers[0].keys)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(1, 3 * SMALL.max_forward_tokens), output=st.sampled_from(["attentions", "hidden_states"]))
def test_generate_refuses_the_attentions_and_hidden_states_of_a_prompt_it_runs_in_pieces(length, output):
    """generate() ran a prompt longer than a stream's forward in pieces and returned the attentions or hidden states
    of its last piece alone, as if they were the prompt's; such a prompt is refused, a shorter one gets all of its
    tokens', and the stream goes on from earlier tokens fed with model(...) as from a whole prompt."""
    model = tiny_ccm("llama-eager", num_comp_tokens=2)
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    cache = model.new_cache(1, streaming=SMALL)
    model(input_ids=torch.randint(3, VOCAB, (1, 7)), past_key_values=cache)
    before = snapshot(cache)
    asked = {"return_dict_in_generate": True, f"output_{output}": True, "max_new_tokens": 2, "do_sample": False}
    step = SMALL.max_forward_tokens
    if length > step:
        with pytest.raises(ValueError, match=rf"output_{output} with {length} tokens.* pass at most {step} tokens"):
            model.generate(ids, past_key_values=cache, **asked)
        assert_same(snapshot(cache), before)
    whole = model.generate(ids, past_key_values=cache.copy(), max_new_tokens=2, do_sample=False)
    # generate() runs pieces of `step` tokens, then the rest: fed so, the stream holds the same (its outputs depend on
    # how the tokens are split, each piece attending to the window as it was before it).
    split = step * ((length - 1) // step)
    earlier, last = ids[:, :split], ids[:, split:]
    if earlier.shape[1]:
        model(input_ids=earlier, past_key_values=cache)
    out = model.generate(last, past_key_values=cache, **asked)
    assert torch.equal(out.sequences[:, -2:], whole[:, -2:])
    first_step = getattr(out, output)[0][-1]  # the last layer's, at the prompt's forward
    assert first_step.shape[-2] == last.shape[1]


def test_streaming_forward_loss_is_the_mean_next_token_loss():
    model = tiny_ccm("llama")
    ids = torch.randint(3, VOCAB, (1, 30))
    out = model(input_ids=ids, labels=ids, past_key_values=model.new_cache(1, streaming=SMALL))
    expected = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(out.loss, expected)


def test_generate_after_a_long_prompt_continues_the_stream():
    """generate() (prompt split into pieces, then one token at a time) equals greedy decoding by forward calls."""
    model = tiny_ccm("qwen3", num_comp_tokens=1, update="merge")
    prompt = torch.randint(3, VOCAB, (2, 33))
    cache = model.new_cache(2, streaming=SMALL)
    generated = model.generate(prompt, past_key_values=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    manual = model.new_cache(2, streaming=SMALL)
    logits = model(input_ids=prompt, past_key_values=manual).logits[:, -1]
    tokens = []
    for _ in range(20):
        logits[:, model.base_model.generation_config.eos_token_id] = float("-inf")  # as min_new_tokens does
        tokens.append(logits.argmax(-1, keepdim=True))
        logits = model(input_ids=tokens[-1], past_key_values=manual).logits[:, -1]
    torch.testing.assert_close(generated[:, prompt.shape[1] :], torch.cat(tokens, dim=1))
    # The last generated token is in the stream too, so both caches hold the same.
    assert cache.kv_length == manual.kv_length
    for ours, theirs in zip(cache.layers, manual.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("new_tokens", [3_000, pytest.param(10_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("update", ["concat", "merge"])
def test_thousands_of_generated_tokens_stay_within_160_positions(update, new_tokens):
    """Far past the window and the tiny model's 512 positions: 3,000 tokens (44 compressions) by default, 10,000 with
    the slow tests."""
    model = tiny_ccm("llama", num_comp_tokens=2, update=update)
    config = StreamingConfig()  # the paper's sizes: 4 sink + 8 memory + 148 window = 160
    budget = config.max_kv_length(model.config)
    assert budget == (160 if update == "concat" else 154)
    cache = model.new_cache(2, streaming=config)
    held, sizes = [], []

    def record(module, args, kwargs, output):
        held.append(cache.layers[0].keys.shape[2])
        sizes.append(cache.memory_bytes())

    hook = model.base_model.register_forward_hook(record, with_kwargs=True)
    try:
        model.generate(
            torch.randint(3, VOCAB, (2, 5)),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    finally:
        hook.remove()
    assert cache.turn_tokens == new_tokens + 5
    assert max(held) <= budget
    assert max(held) >= budget - config.compress_chunk  # it really streams at the budget
    assert min(held[1000:]) == budget  # keep_window_full (the default): the budget stays full
    per_position = sizes[-1] // cache.kv_length
    assert max(sizes) <= budget * per_position  # nothing grows beyond the budget's tensors
    assert int(cache.steps[0]) >= (new_tokens + 5 - budget) // config.compress_chunk


def test_batched_streams_are_independent():
    model = tiny_ccm("llama", num_comp_tokens=2)
    prompts = torch.randint(3, VOCAB, (3, 12))
    together = model.generate(
        prompts,
        past_key_values=model.new_cache(3, streaming=SMALL),
        max_new_tokens=40,
        min_new_tokens=40,
        do_sample=False,
    )
    for row in range(3):
        alone = model.generate(
            prompts[row : row + 1],
            past_key_values=model.new_cache(1, streaming=SMALL),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
        )
        torch.testing.assert_close(together[row : row + 1], alone)


def test_beam_search_on_a_stream():
    model = tiny_ccm("llama", num_comp_tokens=2)
    prompt = torch.randint(3, VOCAB, (1, 15))
    cache = model.new_cache(1, streaming=SMALL)
    output = model.generate(prompt, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, num_beams=3)
    assert output.shape == (1, 21)
    assert cache.turn_tokens == 21
    assert cache.kv_length <= SMALL.max_kv_length(model.config)


@pytest.mark.parametrize("beams", [1, 2])
def test_a_stream_counts_the_tokens_of_the_current_generate_whatever_the_mode(beams):
    """With beam search the stream's count of tokens fed (get_seq_length(), saved with it) went on from before the
    call, while a greedy call counts from its prompt: the same stream and reply gave different counts and files."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    cache = model.new_cache(1, streaming=SMALL)
    model(input_ids=torch.randint(3, VOCAB, (1, 12)), past_key_values=cache)
    output = model.generate(
        torch.randint(3, VOCAB, (1, 3)), past_key_values=cache, max_new_tokens=4, min_new_tokens=4, num_beams=beams
    )
    assert cache.get_seq_length() == cache.turn_tokens == output.shape[1] == 7


@pytest.mark.parametrize("keep_window_full", [True, False])
def test_a_saved_stream_continues_exactly(tmp_path, keep_window_full):
    model = tiny_ccm("llama", num_comp_tokens=2, update="merge")
    config = replace(SMALL, keep_window_full=keep_window_full)
    ids = torch.randint(3, VOCAB, (2, 40))
    cache = model.new_cache(2, streaming=config)
    model(input_ids=ids[:, :27], past_key_values=cache)
    # Saved between compressions: with keep_window_full the window still holds compressed tokens.
    assert cache.compressed_in_window == (1 if keep_window_full else 0)
    cache.save(tmp_path / "stream.safetensors")
    loaded = type(cache).load(tmp_path / "stream.safetensors", model)
    assert loaded.streaming == config and loaded.compressed_in_window == cache.compressed_in_window
    torch.testing.assert_close(
        model(input_ids=ids[:, 27:], past_key_values=loaded).logits,
        model(input_ids=ids[:, 27:], past_key_values=cache).logits,
    )


def test_same_size_baseline_holds_as_many_positions():
    model = tiny_ccm("llama", num_comp_tokens=2)
    baseline = StreamingConfig().same_size_baseline(model.config)
    assert not baseline.compress
    assert baseline.max_kv_length(model.config) == StreamingConfig().max_kv_length(model.config) == 160
    assert baseline.window_tokens == 156


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (StreamingConfig(window_tokens=8, compress_chunk=16), "smaller than compress_chunk"),
        (StreamingConfig(compress_chunk=0), "compress_chunk must be a positive integer"),
        (StreamingConfig(window_tokens=600, compress_chunk=16), "maximum of 512 positions"),
        (StreamingConfig(window_tokens=511, sink_tokens=2, compress=False), "maximum of 512 positions"),
        # Each names the largest of the sizes that add up: a large cap was refused asking for a smaller window.
        (
            StreamingConfig(max_memory_tokens=600),
            r"= 4 \+ 600 \+ 148 \+ 2 = 754 exceeds .* lower max_memory_tokens \(600\)",
        ),
        (StreamingConfig(sink_tokens=400), r"lower sink_tokens \(400\)"),
        (StreamingConfig(window_tokens=600, compress_chunk=16), r"lower window_tokens \(600\)"),
        (StreamingConfig(max_memory_tokens=1), "max_memory_tokens"),
        (StreamingConfig(sink_tokens=-1), "sink_tokens"),
    ],
)
def test_bad_streaming_configurations_name_the_setting(config, message):
    with pytest.raises(ValueError, match=message):
        tiny_ccm("llama", num_comp_tokens=2).new_cache(1, streaming=config)


def test_streaming_misuse_is_explained():
    model = tiny_ccm("llama", num_comp_tokens=2)
    cache = model.new_cache(2, streaming=SMALL)
    with pytest.raises(ValueError, match="unpadded"):
        model(
            input_ids=torch.ones(2, 4, dtype=torch.long),
            attention_mask=torch.tensor([[1] * 4, [0, 1, 1, 1]]),
            past_key_values=cache,
        )
    with pytest.raises(ValueError, match="compresses by itself"):
        model.compress(cache, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="rotary"):
        tiny_ccm("gpt2").new_cache(1, streaming=SMALL)


def test_several_returned_sequences_leave_the_stream_as_it_was(tmp_path):
    """The stream's keys were kept, but its count of tokens fed was reset: its saved file changed."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    cache = model.new_cache(1, streaming=SMALL)
    model(input_ids=torch.randint(3, VOCAB, (1, 12)), past_key_values=cache)
    before = [layer.keys.clone() for layer in cache.layers]
    cache.save(tmp_path / "before.safetensors")
    output = model.generate(
        torch.randint(3, VOCAB, (1, 3)), past_key_values=cache, max_new_tokens=4, num_beams=2, num_return_sequences=2
    )
    assert output.shape[0] == 2
    for keys, layer in zip(before, cache.layers, strict=True):
        assert torch.equal(keys, layer.keys)
    cache.save(tmp_path / "after.safetensors")
    assert (tmp_path / "after.safetensors").read_bytes() == (tmp_path / "before.safetensors").read_bytes()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["forward", "generate", "embeds", "beams"]), st.integers(1, 9)),
        min_size=1,
        max_size=4,
    ),
    rows=st.lists(st.integers(0, 1), min_size=1, max_size=3),
)
def test_a_stream_counts_every_token_fed_in_its_history_tokens(tmp_path_factory, calls, rows):
    """`history_tokens` read 0 on a stream whatever it was fed: it counted only compressed memory's positions. It now
    counts every token a stream took in (prompts, embedded ones, replies, compressed or evicted), and keeps the count
    through copies, batch operations and save/load."""
    model = tiny_ccm("llama")
    cache = model.new_cache(2, streaming=StreamingConfig(8, 2, 4, 4))
    fed = 0
    for kind, length in calls:
        ids = torch.randint(3, VOCAB, (2, length))
        if kind == "forward":
            with torch.no_grad():
                model(input_ids=ids, cache=cache)
            fed += length
            continue
        prompt = {"inputs_embeds": model.get_input_embeddings()(ids)} if kind == "embeds" else {"input_ids": ids}
        out = model.generate(
            **prompt, cache=cache, max_new_tokens=3, min_new_tokens=3, num_beams=2 if kind == "beams" else 1
        )
        fed += length + 3
        assert out.shape[1] == (3 if kind == "embeds" else length + 3)
    assert cache.history_tokens.tolist() == [fed, fed]
    copied = cache.copy()
    copied.batch_repeat_interleave(2)
    copied.batch_select_indices(torch.tensor(rows))
    assert copied.history_tokens.tolist() == [fed] * len(rows)
    path = tmp_path_factory.mktemp("stream") / "stream.safetensors"
    cache.save(path)
    assert type(cache).load(path, model).history_tokens.tolist() == [fed, fed]


def _graph_nodes(tensors):
    """The autograd nodes that `tensors` keep alive (each node holds the activations its backward needs)."""
    seen, stack = set(), [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions)
    return len(seen)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    update=st.sampled_from(["concat", "merge", "ema"]),
    lengths=st.lists(st.integers(1, 12), min_size=2, max_size=8).filter(lambda lengths: sum(lengths) > 16),
    labelled=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_stream_fed_with_gradients_on_holds_no_graph_of_earlier_calls(update, lengths, labelled, seed):
    model = tiny_ccm("llama", update=update)
    cache = model.new_cache(streaming=SMALL)
    generator = torch.Generator().manual_seed(seed)
    for length in lengths:  # a forward outside torch.no_grad(), as a server feeding a stream might run it
        ids = torch.randint(3, VOCAB, (1, length), generator=generator)
        model(input_ids=ids, labels=ids if labelled else None, past_key_values=cache)
        assert _graph_nodes(tensor for layer in cache.layers for tensor in layer.held().values()) == 0
    assert int(cache.steps[0]) >= 1  # the LoRA ran: it compressed, in grad mode
    copy.deepcopy(cache)  # a tensor with a graph refuses deepcopy


def test_a_streamed_loss_still_reaches_the_adapter_within_its_call():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    cache = model.new_cache(streaming=SMALL)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, past_key_values=cache).loss.backward()  # one call, run in pieces
    assert model.comp_embeddings.grad is not None and model.comp_embeddings.grad.abs().sum() > 0


def _stream_after_generate(model, config, history, prompts, counts, new, beams, fail_at=None, cache=None):
    """A stream (`cache`, else a new one) of `history` `(batch, h)` tokens (none if h is 0), then generate() with
    `beams` beams from `prompts` whose row r stops after `counts[r]` tokens (None: at `new`), failing at reply length
    `fail_at`: (cache, the generated tokens `(batch, <= new)`, or the snapshot of the cache before the call if it
    failed)."""
    cache = cache if cache is not None else model.new_cache(prompts.shape[0], streaming=config)
    if history.shape[1]:
        model(input_ids=history, past_key_values=cache)
    before = snapshot(cache)
    stopping = StoppingCriteriaList([StopAfter(counts, prompts.shape[1], fail_at)])
    try:
        sequences = model.generate(
            prompts,
            past_key_values=cache,
            max_new_tokens=new,
            do_sample=False,
            num_beams=beams,
            stopping_criteria=stopping,
        )
    except InjectedFailure:
        return cache, before
    return cache, sequences[:, prompts.shape[1] :]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_row_that_finishes_early_streams_as_it_does_alone(tmp_path_factory, data):
    """transformers pads a row that finished before the others (EOS, a stopping criterion; with beam search, a row
    whose returned beam ended first); a stream kept that padding in the row's window, compressed it into the row's
    memory and counted it in its positions. Each row now holds what it holds generating alone: the same keys and
    values, positions and history, and the same logits later on, saved and loaded too, and after a selection of rows;
    a call that fails leaves the stream as it was."""
    update = data.draw(st.sampled_from(("concat", "merge", "ema")), label="update")
    model = tiny_ccm("llama", num_comp_tokens=2, update=update)
    chunk = data.draw(st.integers(1, 4), label="chunk")
    config = StreamingConfig(
        window_tokens=chunk + data.draw(st.integers(0, 4), label="extra window"),
        sink_tokens=data.draw(st.integers(0, 2), label="sink"),
        compress_chunk=chunk,
        max_memory_tokens=4,
        keep_window_full=data.draw(st.booleans(), label="keep_window_full"),
        compress=data.draw(st.booleans(), label="compress"),
    )
    batch = data.draw(st.integers(2, 3), label="batch")
    new = data.draw(st.integers(2, 8), label="max_new_tokens")
    counts = data.draw(st.lists(st.none() | st.integers(1, new), min_size=batch, max_size=batch), label="counts")
    fail_at = data.draw(st.none() | st.integers(1, new), label="fail_at")
    beams = data.draw(st.sampled_from([1, 2]), label="beams")
    history = torch.randint(3, VOCAB, (batch, data.draw(st.integers(0, 12), label="history")))
    prompts = torch.randint(3, VOCAB, (batch, data.draw(st.integers(1, 5), label="prompt")))
    later = torch.randint(3, VOCAB, (batch, data.draw(st.integers(1, 6), label="later")))
    cache, replies = _stream_after_generate(model, config, history, prompts, counts, new, beams, fail_at)
    if isinstance(replies, dict):
        assert_same(snapshot(cache), replies)
        return
    lengths, held = cache.kv_lengths.tolist(), [(layer.keys, layer.values) for layer in cache.layers]
    path = tmp_path_factory.mktemp("stream") / "stream.safetensors"
    cache.save(path)
    loaded = CompressedMemoryCache.load(path, model)
    logits = model(input_ids=later, past_key_values=cache).logits
    torch.testing.assert_close(model(input_ids=later, past_key_values=loaded).logits, logits, atol=0, rtol=0)
    alone_caches = []
    for row in range(batch):
        alone, reply = _stream_after_generate(
            model, config, history[row : row + 1], prompts[row : row + 1], [counts[row]], new, beams
        )
        assert replies[row, : reply.shape[1]].tolist() == reply[0].tolist()
        assert int(alone.history_tokens[0]) + later.shape[1] == int(cache.history_tokens[row]), f"row {row}"
        assert lengths[row] == alone.kv_length
        for (keys, values), single in zip(held, alone.layers, strict=True):
            own = slice(0, alone.kv_length)
            torch.testing.assert_close(keys[row : row + 1, :, own], single.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(values[row : row + 1, :, own], single.values, atol=1e-5, rtol=0)
        alone_logits = model(input_ids=later[row : row + 1], past_key_values=alone).logits
        torch.testing.assert_close(logits[row : row + 1], alone_logits, atol=1e-4, rtol=0)
        alone_caches.append(alone)
    # A second reply, its rows ending at other steps, from streams of different lengths.
    again = data.draw(st.lists(st.none() | st.integers(1, new), min_size=batch, max_size=batch), label="again")
    nothing = torch.zeros(batch, 0, dtype=torch.long)
    _, replies = _stream_after_generate(model, config, nothing, later, again, new, beams, cache=loaded)
    for row, alone in enumerate(alone_caches):
        prompt = later[row : row + 1]
        _, reply = _stream_after_generate(model, config, nothing[:1], prompt, [again[row]], new, beams, cache=alone)
        assert replies[row, : reply.shape[1]].tolist() == reply[0].tolist()
        assert int(loaded.kv_lengths[row]) == alone.kv_length
        assert int(loaded.history_tokens[row]) == int(alone.history_tokens[0])
    # Rows selected in another order (the longest may leave) keep their streams, saved and loaded too.
    order = data.draw(st.permutations(range(batch)), label="order")[: data.draw(st.integers(1, batch), label="kept")]
    selected = CompressedMemoryCache.load(path, model)
    selected.batch_select_indices(torch.tensor(order))
    selected.save(path)
    selected = CompressedMemoryCache.load(path, model)
    assert selected.kv_length == max(lengths[row] for row in order)
    got = model(input_ids=later[order], past_key_values=selected).logits
    torch.testing.assert_close(got, logits[order], atol=1e-5, rtol=0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    update=st.sampled_from(("concat", "merge")),
    counts=st.lists(st.none() | st.integers(1, 6), min_size=2, max_size=3),
    beams=st.sampled_from([1, 2]),
    history=st.integers(0, 12),
)
def test_a_batched_stream_reads_its_rows_reply_ends_to_the_host_once_per_step(update, counts, beams, history):
    """A stream asks for its rows' reply ends at each stage of a decoding step's forward (room to make, evictions, the
    new tokens' places), and each asked read them to the host again: on a GPU, a wait for all the work queued, several
    times per generated token. Counted on the CPU, where the reads (`Tensor.cpu`) happen all the same."""
    model = tiny_ccm("llama", num_comp_tokens=2, update=update)
    reads = 0
    read = torch.Tensor.cpu

    def counted(tensor, *args, **kwargs):
        nonlocal reads
        reads += sys._getframe(1).f_globals["__name__"].startswith("transformers_ccm")
        return read(tensor, *args, **kwargs)

    forwards = []
    history_ids = torch.randint(3, VOCAB, (len(counts), history))
    prompts = torch.randint(3, VOCAB, (len(counts), 3))
    model.memory_signature()  # the adapter's digests, read once for the model and kept
    hook = model.base_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with patch.object(torch.Tensor, "cpu", counted):
        _stream_after_generate(model, SMALL, history_ids, prompts, counts, 6, beams)
    hook.remove()
    # Greedy: at most one read per decoding step; beam search feeds the returned replies in one call, one read.
    assert reads <= (len(forwards) if beams == 1 else 1)
