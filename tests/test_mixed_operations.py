"""A hostile caller's session: what a call returns, or a failure in the middle of another call, changes no cache behind
the caller's back, and mixed operations on several caches of one model give what each gives alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from fault_injection import assert_same, snapshot
from test_online import StopAfter
from tiny_models import randomize_adapter, tiny_base, tiny_ccm, tiny_full_context_baseline
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, StreamingConfig
from transformers_ccm.wrapping import CACHE_ARGUMENT

SMALL_STREAM = StreamingConfig(window_tokens=10, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)


@pytest.mark.parametrize("return_dict_in_generate", [False, True])
def test_changing_the_returned_ids_in_place_leaves_the_cache_as_generate_left_it(return_dict_in_generate):
    """The cache kept the last generated token (the one compress() folds, not yet run) as a view of the ids generate()
    returned: a caller that padded its reply's end in place (`out[:, -1] = pad_id`) changed the token its memory was
    then made of, without a word. The cache holds a copy."""
    model = tiny_ccm("llama", update="concat")
    changed = model.new_cache(2)
    model.compress(changed, torch.tensor([[5, 6, 7], [8, 9, 10]]))
    untouched = changed.copy()
    prompt = torch.tensor([[20, 21], [22, 23]])
    outputs = [
        model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=3,
            do_sample=False,
            return_dict_in_generate=return_dict_in_generate,
        )
        for cache in (changed, untouched)
    ]
    assert not torch.equal(changed.pending_ids, torch.zeros_like(changed.pending_ids))  # the change is one
    returned = outputs[0].sequences if return_dict_in_generate else outputs[0]
    returned.zero_()
    assert_same(snapshot(changed), snapshot(untouched))
    for cache in (changed, untouched):
        model.compress(cache)
    assert_same(snapshot(changed), snapshot(untouched))


def test_a_deep_copy_of_a_cache_filled_with_gradients_on_holds_its_values():
    """A forward run with gradients on (outside torch.no_grad()) by an adapter whose LoRA acts at every position leaves
    keys/values in the cache that belong to the autograd graph, and copy.deepcopy(cache) failed inside torch ("Only
    Tensors created explicitly by the user (graph leaves) support the deepcopy protocol"), though a pickle of the same
    cache worked. The deep copy holds the same values, apart from the graph, and goes on as the cache does."""
    model = tiny_full_context_baseline(seed=3)
    cache = model.new_cache(1)
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    model(input_ids=torch.tensor([[20, 21, 22]]), past_key_values=cache)
    assert cache.layers[0].keys.grad_fn is not None  # what the copy is made of: tensors of the graph
    copied = copy.deepcopy(cache)
    assert all(layer.keys.grad_fn is None and layer.values.grad_fn is None for layer in copied.layers)
    assert cache.layers[0].keys.grad_fn is not None  # the cache itself keeps its call's graph
    assert_same(snapshot(copied), snapshot(cache))
    prompt = torch.tensor([[23, 24]])
    with torch.no_grad():
        outputs = [model(input_ids=prompt, past_key_values=each).logits for each in (cache, copied)]
    assert torch.equal(outputs[0], outputs[1])
    assert_same(snapshot(copied), snapshot(cache))


@pytest.mark.parametrize(
    ("streaming", "options"),
    [
        (None, {"num_beams": 2}),
        (None, {"num_beams": 2, "num_return_sequences": 2}),
        (None, {"num_return_sequences": 2, "do_sample": True}),
        (SMALL_STREAM, {"num_beams": 2}),
    ],
)
def test_the_cache_a_generate_output_names_is_the_callers(options, streaming):
    """With beams or several sequences, generate() runs on an expanded copy of the cache, and the output's cache was
    that copy: a row per beam (or sequence), each turn without its last token and with the padding of finished beams,
    which compress() folded into a wrong memory without a word. The output names the caller's cache, as a greedy
    call's does, and that cache holds what the call documents (the returned beam's turn, or nothing new)."""
    model = tiny_ccm("llama", update="concat")
    cache = model.new_cache(1, streaming=streaming)
    if streaming is None:
        model.compress(cache, torch.tensor([[5, 6, 7]]))
    output = model.generate(
        torch.tensor([[20, 21]]),
        past_key_values=cache,
        max_new_tokens=3,
        return_dict_in_generate=True,
        **{"do_sample": False, **options},
    )
    assert getattr(output, CACHE_ARGUMENT) is cache
    assert cache.batch_size == 1


@pytest.mark.parametrize("streaming", [None, SMALL_STREAM])
def test_a_cache_is_not_copied_or_saved_from_inside_a_forward_on_it(tmp_path, streaming):
    """A hook on one of the model's layers (logging, a checkpoint) that copied or saved the cache during a forward on
    it read it half updated: the first layer held the new tokens and the second not yet (or, from a hook of the base
    model, compress()'s <COMP> keys still in the turn). Later calls took the copy as it was (layers of different
    lengths; <COMP> keys folded again as tokens), and a stream's file replaced the earlier one with a memory that
    `load` refuses. Both are refused with the way to do it; a copy from a streamer, between the forwards of
    generate(), is whole and still taken."""
    model = tiny_ccm("llama", update="concat")
    cache = model.new_cache(1, streaming=streaming)
    model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache)
    if streaming is None:
        model.compress(cache)
    path = tmp_path / "memory.safetensors"
    cache.save(path)
    saved, untouched = path.read_bytes(), cache.copy()
    refusals: list[str] = []

    def copy_and_save(*_: object) -> None:
        for call in (cache.copy, lambda: copy.deepcopy(cache), lambda: cache.save(path)):
            with pytest.raises(ValueError, match="from inside a forward of its model") as refused:
                call()
            refusals.append(str(refused.value))

    handle = model.base_model.model.layers[1].register_forward_pre_hook(copy_and_save)
    try:
        model(input_ids=torch.tensor([[20, 21, 22]]), past_key_values=cache)
    finally:
        handle.remove()
    assert len(refusals) == 3 and "after the call returns" in refusals[0]
    assert path.read_bytes() == saved
    model(input_ids=torch.tensor([[20, 21, 22]]), past_key_values=untouched)
    assert_same(snapshot(cache), snapshot(untouched))
    if streaming is None:
        # A forward hook of the base model itself, after compress()'s <COMP> forward: its keys were in the turn as
        # tokens of it, and a fold of the copy compressed them again.
        handle = model.base_model.register_forward_hook(copy_and_save)
        try:
            model.compress(cache, torch.tensor([[8, 9]]))
        finally:
            handle.remove()
        assert len(refusals) == 6
        model.compress(untouched, torch.tensor([[8, 9]]))
        assert_same(snapshot(cache), snapshot(untouched))

    copies: list[CompressedMemoryCache] = []

    class Copying(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            copies.append(cache.copy())

        def end(self) -> None:
            """Nothing to close: the copies are taken in `put`."""

    model.generate(
        torch.tensor([[30, 31]]), past_key_values=cache, max_new_tokens=2, do_sample=False, streamer=Copying()
    )
    assert len(copies) == 3  # the prompt and each generated token
    assert len({tuple(layer.keys.shape) for layer in copies[-1].layers}) == 1


@pytest.mark.parametrize("streaming", [None, SMALL_STREAM])
def test_an_online_forward_under_activation_checkpointing_is_refused_before_it_changes_the_cache(streaming):
    """With activation checkpointing on (a model being trained), an online forward in training mode with gradients ran
    every decoder layer without the cache, as transformers does for checkpointed layers: on a fresh cache it returned
    logits that saw no memory and left rows that counted tokens no layer held (every later compress() then failed
    inside torch), and on a memory it failed inside torch on the attention mask's shape. It is refused before anything
    changes, with the ways out; without gradients the same call runs as it does without checkpointing."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="concat")))
    cache = model.new_cache(1, streaming=streaming)
    if streaming is None:
        model.compress(cache, torch.tensor([[5, 6, 7]]))
    expected = model(input_ids=torch.tensor([[8, 9]]), past_key_values=cache.copy()).logits
    model.activation_checkpointing_enable()
    model.train()
    before = snapshot(cache)
    with pytest.raises(ValueError, match="activation checkpointing") as refused:
        model(input_ids=torch.tensor([[8, 9]]), past_key_values=cache)
    assert "torch.no_grad()" in str(refused.value) and "activation_checkpointing_disable()" in str(refused.value)
    assert_same(snapshot(cache), before)
    model.eval()  # no dropout, so that the logits are those of the model before
    with torch.no_grad():
        assert torch.equal(model(input_ids=torch.tensor([[8, 9]]), past_key_values=cache).logits, expected)


def test_a_copy_of_a_stream_taken_during_its_generate_takes_every_token_of_a_later_forward():
    """A stream's generate() stops taking tokens of a row once its reply ended (`row_ends`): a copy taken meanwhile (by
    a streamer) kept that, and a later forward on the copy dropped every token of the row whose reply had ended."""
    model = tiny_ccm("llama")
    stream = model.new_cache(2, streaming=SMALL_STREAM)
    model(input_ids=torch.tensor([list(range(3, 7))] * 2), past_key_values=stream)
    copies = []

    class CopyAtEachToken(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            copies.append(stream.copy())

        def end(self) -> None:
            pass

    stopping = StoppingCriteriaList([StopAfter([1, None], 2)])  # the first row's reply ends first
    model.generate(
        torch.tensor([[20, 21]] * 2),
        past_key_values=stream,
        max_new_tokens=4,
        stopping_criteria=stopping,
        streamer=CopyAtEachToken(),
    )
    taken = copies[3]  # the prompt, then three tokens: the first row's reply has ended
    before = taken.history_tokens.tolist()
    model(input_ids=torch.tensor([[30, 31, 32]] * 2), past_key_values=taken)
    assert taken.history_tokens.tolist() == [count + 3 for count in before]
