"""Serving: one model, many caches, several threads; failed calls; gradient checkpointing; numerics and bounds."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import pickle
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from fault_injection import assert_same, paused_at, snapshot
from test_online import Collect
from tiny_models import (
    VOCAB,
    InjectedFailure,
    fail_in_layer,
    randomize_adapter,
    tiny_base,
    tiny_ccm,
    tiny_longrope_base,
)
from transformers_ccm import (
    CCMConfig,
    CCMDataCollator,
    CCMForCausalLM,
    CompressedMemoryCache,
    OnlineSample,
    StreamingConfig,
    modeling,
)
from transformers_ccm.identity import _CHUNK, weights_fingerprint
from transformers_ccm.lora import lora_layers

CONTEXTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _user_session(model: CCMForCausalLM, seed: int) -> list[torch.Tensor]:
    """One user's calls: compress contexts, generate, fold the turn, score with the memory."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache()
    outputs = []
    for context in CONTEXTS:
        model.compress(cache, torch.tensor([context]) + seed % 7)
    prompt = torch.randint(3, VOCAB, (1, 4), generator=generator)
    outputs.append(model.generate(prompt, past_key_values=cache, max_new_tokens=5, do_sample=False))
    model.compress(cache)
    with torch.no_grad():
        outputs.append(model(input_ids=prompt, past_key_values=cache).logits)
    outputs.extend(layer.keys for layer in cache.layers)
    return outputs


def _training_score(model: CCMForCausalLM, seed: int) -> list[torch.Tensor]:
    """A parallel-forward loss and logits (the gate is on at <COMP> positions only)."""
    shift = seed % 11
    batch = CCMDataCollator(model)([OnlineSample([[5 + shift, 6, 7], [8, 9]], [10, 11], [12 + shift, 13])])
    with torch.no_grad():
        out = model(**batch)
    return [out.loss, out.logits]


def _base_score(model: CCMForCausalLM, seed: int) -> list[torch.Tensor]:
    """The base model alone, through adapter_disabled."""
    with torch.no_grad(), model.adapter_disabled():
        return [model.base_model(input_ids=torch.tensor([[5, 6, 7, 8 + seed % 5]])).logits]


JOBS = (_user_session, _training_score, _base_score)


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_threads_mixing_compress_generate_and_scoring_give_sequential_results(update):
    model = tiny_ccm("llama", update=update)
    work = [(JOBS[index % len(JOBS)], index) for index in range(36)]
    expected = [job(model, seed) for job, seed in work]
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda item: item[0](model, item[1]), work))
        for (job, seed), got, want in zip(work, results, expected, strict=True):
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), f"{job.__name__} (seed {seed}) differs when run among other threads"


def test_lora_runs_only_in_comp_runs_and_never_while_disabled():
    model = tiny_ccm("llama")
    calls = []
    handles = [
        layer.lora_A["default"].register_forward_hook(lambda *_: calls.append(1))
        for layer in lora_layers(model.base_model)
    ]
    try:
        cache = model.new_cache()
        model.compress(cache, torch.tensor([[5, 6, 7]]))
        assert len(calls) == len(handles)  # once per LoRA layer: the <COMP> run
        calls.clear()
        model.generate(torch.tensor([[8, 9]]), past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert not calls  # decoding ordinary tokens never runs the adapter
        with model.adapter_disabled(), model.lora_at(torch.ones(1, 2, dtype=torch.bool)), torch.no_grad():
            model.base_model(input_ids=torch.tensor([[5, 6]]))
        assert not calls
        with model.lora_at(torch.ones(1, 2, dtype=torch.bool)), torch.no_grad():
            model.base_model(input_ids=torch.tensor([[5, 6]]))
        assert len(calls) == len(handles)
    finally:
        for handle in handles:
            handle.remove()


def test_gate_state_does_not_leak_into_other_threads():
    model = tiny_ccm("llama")
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = model.base_model(input_ids=ids).logits
    inside, seen = threading.Event(), []

    def other_thread() -> None:
        inside.wait()
        with torch.no_grad():
            seen.append(model.base_model(input_ids=ids).logits)

    thread = threading.Thread(target=other_thread)
    thread.start()
    with model.lora_at(torch.ones(1, 3, dtype=torch.bool)), torch.no_grad():
        gated = model.base_model(input_ids=ids).logits
        inside.set()
        thread.join()
    assert (gated - plain).abs().max() > 1e-3
    assert torch.equal(seen[0], plain)


@settings(max_examples=15, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["disabled", "gate"]), min_size=1, max_size=4),
    made_in=st.sampled_from(["this thread", "another thread", "another thread, adapter disabled"]),
)
def test_a_gate_context_takes_the_state_where_it_is_entered(kinds, made_in):
    """A context made first and entered later took the state current where it was made: `lora_at` made before
    `adapter_disabled()` was entered ran the LoRA inside it, and one made in another thread (there under
    `adapter_disabled()`) brought that thread's state into this one's call."""
    model = tiny_ccm("llama")
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        plain = model.base_model(input_ids=ids).logits
        with model.lora_at(mask):
            gated = model.base_model(input_ids=ids).logits

    def make() -> list[contextlib.AbstractContextManager[None]]:
        return [model.adapter_disabled() if kind == "disabled" else model.lora_at(mask) for kind in kinds]

    if made_in == "this thread":
        contexts = make()
    else:
        made = []

        def maker() -> None:
            with model.adapter_disabled() if made_in.endswith("disabled") else contextlib.nullcontext():
                made.extend(make())

        thread = threading.Thread(target=maker)
        thread.start()
        thread.join()
        contexts = made
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        logits = model.base_model(input_ids=ids).logits
    assert torch.equal(logits, gated if "gate" in kinds and "disabled" not in kinds else plain)


def test_a_cache_in_use_by_another_thread_is_refused_and_keeps_that_threads_work(tmp_path):
    """Threads that wrongly share one cache: a call arriving while another thread runs one on it gets a clear
    error and changes nothing, and the running call's result is kept (not overwritten by a failure's restore)."""
    model = tiny_ccm("llama")
    shared, alone = model.new_cache(), model.new_cache()
    running, release = threading.Event(), threading.Event()

    def slow_stopper(*_: object, **__: object) -> bool:
        running.set()
        release.wait(timeout=30)
        return False

    def generate(cache: CompressedMemoryCache, stopping: list) -> None:
        model.generate(
            torch.tensor([[20, 21]]),
            past_key_values=cache,
            max_new_tokens=3,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList(stopping),
        )
        model.compress(cache)

    thread = threading.Thread(target=generate, args=(shared, [slow_stopper]))
    thread.start()
    assert running.wait(timeout=30)
    calls = (
        lambda: model.compress(shared, torch.tensor([[5, 6]])),
        lambda: model.generate(torch.tensor([[7]]), past_key_values=shared, max_new_tokens=2),
        lambda: model(input_ids=torch.tensor([[7]]), past_key_values=shared),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"in use by a call in another thread.*its own cache, or hold a lock"):
            call()
    release.set()
    thread.join()
    generate(alone, [])
    assert _saved_bytes(shared, tmp_path / "shared.safetensors") == _saved_bytes(alone, tmp_path / "alone.safetensors")
    generate(shared, [])  # free again once the other thread's call ended


@pytest.mark.parametrize("streaming", [False, True])
def test_saving_a_cache_while_another_thread_runs_a_call_on_it_is_refused(tmp_path, streaming):
    """A save in the middle of another thread's call would read layers half updated (for a stream: a file that
    does not load back); it is refused with the fix, the file already there is kept, and it works once free."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama")
    config = StreamingConfig(window_tokens=12, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
    cache = model.new_cache(streaming=config if streaming else None)

    def feed(ids: torch.Tensor) -> None:
        if streaming:
            model(input_ids=ids, past_key_values=cache)
        else:
            model.compress(cache, ids)

    feed(torch.tensor([[3, 4, 5, 6, 7, 8]]))
    path = tmp_path / "memory.safetensors"
    before = _saved_bytes(cache, path)
    inside, release = threading.Event(), threading.Event()

    def pause(*_: object) -> None:
        inside.set()
        release.wait(timeout=30)

    handle = model.base_model.model.layers[1].register_forward_pre_hook(pause)
    thread = threading.Thread(target=feed, args=(torch.tensor([[10, 11, 12]]),))
    try:
        thread.start()
        assert inside.wait(timeout=30)
        with pytest.raises(ValueError, match="in use by a call in another thread"):
            cache.save(path)
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert path.read_bytes() == before
    cache.save(path)
    loaded = CompressedMemoryCache.load(path, model)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, cache.layers, strict=True))


@pytest.mark.parametrize("duplicate", ["copy", "deepcopy", "pickle"])
def test_a_copy_made_during_a_call_is_free_for_every_thread(duplicate):
    """A deep copy (or a pickle) of a cache made inside a transaction, or from a streamer or stopping criterion of a
    running generate(), took the claim along: every other thread was then told, forever, that the copy was in use."""
    model = tiny_ccm("llama")
    cache = _filled(model)
    make = {"copy": lambda c: c.copy(), "deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}
    with cache.transaction():
        twin = make[duplicate](cache)
    errors = []

    def elsewhere() -> None:
        try:
            model.compress(twin, torch.tensor([[11, 12], [13, 14]]))
        except ValueError as error:
            errors.append(error)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert not errors
    model.compress(cache, torch.tensor([[11, 12], [13, 14]]))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(twin.layers, cache.layers, strict=True))


@pytest.mark.parametrize("operation", ["copy", "copy.copy", "deepcopy", "pickle", "reorder", "reset"])
def test_copying_reordering_or_resetting_a_cache_while_another_thread_runs_a_call_on_it_is_refused(operation):
    """A copy (or a pickle) read the layers half updated by the other thread's call (as a save would): a compress's
    context in the turn, with the keys of its first layers only; a reorder or a reset changed them under it. All are
    refused with the fix, as a call is, and change nothing."""
    model = tiny_ccm("llama")
    cache = _filled(model)
    inside, release = threading.Event(), threading.Event()

    def pause(*_: object) -> None:
        inside.set()
        release.wait(timeout=30)

    operations = {
        "copy": lambda: cache.copy(),
        "copy.copy": lambda: copy.copy(cache),
        "deepcopy": lambda: copy.deepcopy(cache),
        "pickle": lambda: pickle.dumps(cache),
        "reorder": lambda: cache.reorder_cache(torch.tensor([1, 0])),
        "reset": lambda: cache.reset(),
    }
    alone = _filled(model)
    model.compress(alone, torch.tensor([[10, 11], [12, 13]]))
    handle = model.base_model.model.layers[1].register_forward_pre_hook(pause)
    thread = threading.Thread(target=model.compress, args=(cache, torch.tensor([[10, 11], [12, 13]])))
    try:
        thread.start()
        assert inside.wait(timeout=30)
        with pytest.raises(ValueError, match="in use by a call in another thread"):
            operations[operation]()
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, alone.layers, strict=True))
    operations[operation]()  # free again


NESTED_CALLS = {
    "compress": lambda model, cache: model.compress(cache),
    "compress context": lambda model, cache: model.compress(cache, torch.tensor([[3, 4]])),
    "forward": lambda model, cache: model(input_ids=torch.tensor([[3]]), past_key_values=cache),
    "generate": lambda model, cache: model.generate(torch.tensor([[3]]), past_key_values=cache, max_new_tokens=1),
    "reset": lambda model, cache: cache.reset(),
    # They changed which user each row is under the running call (or its batch size: a failure deep inside).
    "reorder": lambda model, cache: cache.reorder_cache(torch.tensor([0])),
    "select rows": lambda model, cache: cache.batch_select_indices(torch.tensor([0])),
    "repeat rows": lambda model, cache: cache.batch_repeat_interleave(2),
}


class _CallingStreamer(BaseStreamer):
    """A streamer that runs `call` on the cache of its own generate() at its `at`-th put (or at its end)."""

    def __init__(self, call: Callable[[], object], at: int | None) -> None:
        self.call, self.at, self.puts = call, at, 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == self.at:
            self.call()

    def end(self) -> None:
        if self.at is None:
            self.call()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    call=st.sampled_from(sorted(NESTED_CALLS)),
    hook=st.sampled_from(["streamer", "stopping criterion"]),
    at=st.one_of(st.none(), st.integers(1, 3)),
    streaming=st.booleans(),
)
def test_a_call_on_the_cache_of_a_running_generate_is_refused_and_changes_nothing(tmp_path, call, hook, at, streaming):
    """A streamer or stopping criterion that called the model on the cache of its own generate() (folding the turn at
    the streamer's end, say) changed the turn under it: a failure deep inside torch, or the reply's tokens left out of
    order in the turn. It is refused with the fix; the cache is left as it was and works on."""
    from transformers_ccm.streaming import StreamingConfig

    if streaming and call.startswith("compress"):
        call = "forward"  # a stream compresses by itself
    model = tiny_ccm("llama")
    stream = StreamingConfig(window_tokens=12, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
    cache, alone = (model.new_cache(streaming=stream if streaming else None) for _ in range(2))
    for each in (cache, alone):
        if streaming:
            model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), past_key_values=each)
        else:
            model.compress(each, torch.tensor([[5, 6, 7, 8]]))
    before = _saved_bytes(cache, tmp_path / "before.safetensors")

    def nested() -> None:
        NESTED_CALLS[call](model, cache)

    def stopper(*_: object, **__: object) -> torch.Tensor:
        if at is None or stopper.calls == at - 1:
            nested()
        stopper.calls += 1
        return torch.zeros(1, dtype=torch.bool)

    stopper.calls = 0
    extra = (
        {"streamer": _CallingStreamer(nested, at)}
        if hook == "streamer"
        else {"stopping_criteria": StoppingCriteriaList([stopper])}
    )
    with pytest.raises(ValueError, match=r"its own running generate\(\) is using .*after generate\(\) returns"):
        model.generate(torch.tensor([[20, 21]]), past_key_values=cache, max_new_tokens=3, do_sample=False, **extra)
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before
    replies = [
        model.generate(torch.tensor([[20, 21]]), past_key_values=each, max_new_tokens=3, do_sample=False)
        for each in (cache, alone)
    ]
    assert torch.equal(*replies)


@pytest.mark.parametrize("update", ["concat", "merge"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_reset_cache_is_a_new_one_and_its_copies_keep_their_memory(tmp_path, update, streaming):
    """transformers' `Cache.reset` dropped the keys/values but left the rows their memory slots and positions:
    every later call failed inside torch. A reset cache now works exactly as a new one; a copy keeps its memory."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama", update=update)
    stream = StreamingConfig(window_tokens=12, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
    config = stream if streaming else None
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]])

    def use(cache: CompressedMemoryCache) -> torch.Tensor:
        logits = model(input_ids=ids, past_key_values=cache).logits
        for _ in range(2):
            if not streaming:
                model.compress(cache)
            model.generate(ids[:, :3], past_key_values=cache, max_new_tokens=3, do_sample=False)
        if not streaming:
            model.compress(cache)
        return logits

    cache = model.new_cache(2, streaming=config)
    use(cache)
    twin = cache.copy()
    kept = _saved_bytes(twin, tmp_path / "twin.safetensors")
    cache.reset()
    fresh = model.new_cache(2, streaming=config)
    assert torch.equal(use(cache), use(fresh))
    assert _saved_bytes(cache, tmp_path / "reset.safetensors") == _saved_bytes(fresh, tmp_path / "fresh.safetensors")
    assert _saved_bytes(twin, tmp_path / "twin.safetensors") == kept


# ----- failures --------------------------------------------------------------------------------------------------
def _filled(model: CCMForCausalLM, batch: int = 2) -> CompressedMemoryCache:
    cache = model.new_cache(batch)
    model.compress(cache, torch.tensor([[5, 6, 7]] * batch))
    model.compress(cache, torch.tensor([[8, 9, 10]] * batch))
    return cache


def _user_cache(model: CCMForCausalLM, streaming: bool) -> CompressedMemoryCache:
    """Two users with memory: compressed contexts (`_filled`), or a stream past its first compression."""
    if not streaming:
        return _filled(model)
    cache = model.new_cache(2, StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4))
    model(input_ids=torch.tensor([list(range(3, 15))] * 2), past_key_values=cache)
    return cache


def _saved_bytes(cache: CompressedMemoryCache, path) -> bytes:
    cache.save(path)
    return path.read_bytes()


CALLS = {
    "compress": lambda model, cache: model.compress(cache, torch.tensor([[11, 12], [13, 14]])),
    "generate": lambda model, cache: model.generate(
        torch.tensor([[20, 21], [22, 23]]), past_key_values=cache, max_new_tokens=4, do_sample=False
    ),
    "forward": lambda model, cache: model(input_ids=torch.tensor([[20, 21], [22, 23]]), past_key_values=cache),
    "beam search": lambda model, cache: model.generate(
        torch.tensor([[20, 21], [22, 23]]), past_key_values=cache, max_new_tokens=3, num_beams=2, do_sample=False
    ),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    call=st.sampled_from(sorted(CALLS)),
    update=st.sampled_from(["concat", "merge"]),
    layer=st.integers(0, 1),
    after_calls=st.integers(0, 3),
)
def test_injected_failure_leaves_saved_cache_bytes_unchanged(tmp_path, call, update, layer, after_calls):
    model = tiny_ccm("llama", update=update)
    cache = _filled(model)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    handle = fail_in_layer(model, layer, after_calls)
    try:
        try:
            CALLS[call](model, cache)
            failed = False
        except InjectedFailure:
            failed = True
    finally:
        handle.remove()
    if failed:
        assert _saved_bytes(cache, tmp_path / "after.safetensors") == before
        CALLS[call](model, cache)  # and the cache still works


def non_finite_keys(model: CCMForCausalLM, tokens: int | None = None) -> torch.utils.hooks.RemovableHandle:
    """Make the first layer's key projection give NaN (as a float16 overflow would), in every forward or only in
    those of `tokens` tokens (a stream's `<COMP>` run)."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        return output * torch.nan if tokens is None or output.shape[1] == tokens else None

    return model.base_model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_a_compression_that_gives_non_finite_keys_is_refused_and_leaves_the_cache_as_it_was(tmp_path, update):
    """A NaN in the `<COMP>` keys/values was stored in memory, where every later turn attended to it (and a saved
    memory carried it): the compression is refused, and the turn can be folded once the model is sound again."""
    model = tiny_ccm("llama", update=update)
    cache, reference = _filled(model), _filled(model)
    for each in (cache, reference):
        model.generate(torch.tensor([[20, 21], [22, 23]]), past_key_values=each, max_new_tokens=3, do_sample=False)
    before = copy.deepcopy(cache)
    handle = non_finite_keys(model)
    try:
        with pytest.raises(ValueError, match=r"compression gave keys/values that are not finite"):
            model.compress(cache, torch.tensor([[11, 12], [13, 14]]))
    finally:
        handle.remove()
    assert cache.has_unfolded_turn
    for each in (cache, before, reference):
        model.compress(each, torch.tensor([[11, 12], [13, 14]]))
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == _saved_bytes(before, tmp_path / "before.safetensors")
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == _saved_bytes(reference, tmp_path / "ref.safetensors")


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_a_stream_compression_that_gives_non_finite_keys_is_refused_and_leaves_the_stream_as_it_was(tmp_path, update):
    model = tiny_ccm("llama", update=update)
    config = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
    cache = model.new_cache(2, streaming=config)
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 9)), past_key_values=cache)  # sink and a full window
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    handle = non_finite_keys(model, tokens=model.config.num_comp_tokens)
    try:
        with pytest.raises(ValueError, match=r"compression gave keys/values that are not finite"), torch.no_grad():
            model(input_ids=torch.randint(3, VOCAB, (2, 3)), past_key_values=cache)
    finally:
        handle.remove()
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before


PLAIN_MODEL_CALLS = {
    "forward": lambda base, cache: base(input_ids=torch.tensor([[20, 21], [22, 23]]), past_key_values=cache),
    "generate": lambda base, cache: base.generate(
        torch.tensor([[20, 21], [22, 23]]), past_key_values=cache, max_new_tokens=3, do_sample=False
    ),
}


# A stream's plain generate() fails inside the base model before it reaches the cache: the stream's tokens so far count
# as processed, so a short prompt leaves nothing to run.
@pytest.mark.parametrize(("call", "streaming"), [("forward", False), ("forward", True), ("generate", False)])
def test_a_cache_given_to_a_plain_model_is_refused_and_left_as_it_was(tmp_path, call, streaming):
    """The plain base model appended its keys/values to a CompressedMemoryCache without a word: the per-row state did
    not know of them, so the next compress found nothing to fold and later calls attended to keys of no turn."""

    model = tiny_ccm("llama")
    cache = _user_cache(model, streaming)
    untouched = cache.copy()
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    with pytest.raises(ValueError, match="passed to another model"):
        PLAIN_MODEL_CALLS[call](tiny_base("llama"), cache)
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before
    assert torch.equal(CALLS["generate"](model, cache), CALLS["generate"](model, untouched))


@settings(max_examples=16, deadline=None)
@given(
    call=st.sampled_from(sorted(PLAIN_MODEL_CALLS)),
    streaming=st.booleans(),
    fails_in_layer=st.booleans(),
    in_transaction=st.booleans(),
    whose=st.sampled_from(["its own", "another model's"]),
)
def test_a_cache_given_to_the_wrapped_base_model_itself_is_refused_and_left_as_it_was(
    call, streaming, fails_in_layer, in_transaction, whose
):
    """`model.base_model(..., past_key_values=cache)` ran the cache through CCM's pre-hook outside any transaction or
    claim: it worked while nothing failed, but an interrupt in a layer left the cache half updated (some layers
    holding the new tokens), and another thread's call could interleave with it. Inside `cache.transaction()` it ran
    too, without the CCM calls' checks: the base model of another model wrote its keys into the turn, which the
    cache's own model then folded into its memory."""
    owner = tiny_ccm("llama")
    model = owner if whose == "its own" else tiny_ccm("llama", update="merge")
    cache = _user_cache(owner, streaming)
    untouched, before = cache.copy(), snapshot(cache)
    handle = fail_in_layer(model, layer=1, after_calls=0) if fails_in_layer else None
    try:
        with (
            pytest.raises(ValueError, match=r"given to the wrapped base model .* Give it to the CCMForCausalLM"),
            cache.transaction() if in_transaction else contextlib.nullcontext(),
        ):
            PLAIN_MODEL_CALLS[call](model.base_model, cache)
    finally:
        if handle is not None:
            handle.remove()
    assert_same(snapshot(cache), before, "the cache after the refused call")
    assert torch.equal(CALLS["generate"](owner, cache), CALLS["generate"](owner, untouched))


def test_a_cache_given_to_the_base_model_in_another_thread_while_a_call_runs_on_it_is_refused():
    """The check that a model call holds the cache asked that one runs, not that it is the calling thread's: the base
    model given the cache in another thread while compress() ran on it wrote its tokens into that call's turn."""
    model = tiny_ccm("llama")
    cache, alone = _filled(model), _filled(model)
    CALLS["compress"](model, alone)

    def held() -> list[object]:  # what the cache holds now (claimed, so no snapshot): it replaces, never changes them
        return [cache.rows, *(value for layer in cache.layers for value in layer.__dict__.values())]

    with paused_at(CompressedMemoryCache.fold.__code__, lambda: CALLS["compress"](model, cache)) as compressing:
        before = held()
        with pytest.raises(ValueError, match=r"given to the wrapped base model .* Give it to the CCMForCausalLM"):
            PLAIN_MODEL_CALLS["forward"](model.base_model, cache)
        assert all(now is then for now, then in zip(held(), before, strict=True))
    assert compressing["outcome"] == ("result", None)
    assert_same(snapshot(cache), snapshot(alone), "the cache after the call")


def _step_the_adapter(model: CCMForCausalLM, _) -> None:
    with torch.no_grad():  # what an optimizer step does
        for layer in lora_layers(model.base_model):
            layer.lora_B["default"].weight.add_(0.1)


def _switch_peft_path_on(model: CCMForCausalLM) -> None:
    for layer in lora_layers(model.base_model):
        layer.enable_adapters(True)


MODEL_CHANGES = {
    "load_adapter": lambda model, path: model.load_adapter(path),
    "optimizer step": _step_the_adapter,
    "attention switch": lambda model, _: model.base_model.set_attn_implementation("sdpa"),
    "cast": lambda model, _: model.half(),
    "LoRA scaling": lambda model, _: _set_scale(model),
    "base config": lambda model, _: setattr(model.base_model.config, "rms_norm_eps", 1e-2),
    # It ran the later layers with the LoRA at every token besides the gate's, and stored that memory, which the
    # model accepted again once the path was switched off.
    "PEFT's LoRA path switched on": lambda model, _: _switch_peft_path_on(model),
}


@pytest.mark.parametrize("change", sorted(MODEL_CHANGES))
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_during_which_another_thread_changes_the_model_fails_and_changes_nothing(tmp_path, call, change):
    """load_adapter (or another change of the model) in another thread while a call ran: the call ran its first
    layer with one adapter and its last with the other, and stored that memory under the old adapter's signature,
    which accepted it once the old adapter was loaded again; a cast failed it inside torch on mismatched dtypes."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()), seed=7).save_pretrained(
        tmp_path / "other"
    )
    cache = _filled(model)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    changed = []

    def change_in_another_thread(*_: object) -> None:
        if not changed:
            changed.append(threading.Thread(target=MODEL_CHANGES[change], args=(model, tmp_path / "other")))
            changed[0].start()
            changed[0].join()

    handle = model.base_model.model.layers[1].register_forward_pre_hook(change_in_another_thread)
    try:
        with pytest.raises(ValueError, match=r"The model changed while .+ ran .*the cache is left as it was"):
            CALLS[call](model, cache)
    finally:
        handle.remove()
    assert changed and _saved_bytes(cache, tmp_path / "after.safetensors") == before


def _two_users(streaming: bool) -> CompressedMemoryCache:
    """A cache of two users with memory: compressed turns, or a stream past its first compression."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    if not streaming:
        return _filled(model)
    cache = model.new_cache(2, streaming=StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=3))
    model(input_ids=torch.randint(3, VOCAB, (2, 12)), past_key_values=cache)
    return cache


def _generate_and_fold(model: CCMForCausalLM, cache: CompressedMemoryCache) -> None:
    """A reply folded into memory, after the turn an online forward left (generate() refuses to start on one)."""
    _fold_turn(model, cache)
    CALLS["generate"](model, cache)
    _fold_turn(model, cache)


def _fold_turn(model: CCMForCausalLM, cache: CompressedMemoryCache) -> None:
    if cache.has_unfolded_turn:  # a stream holds every token itself
        model.compress(cache)


SHALLOW_COPY_CALLS: dict[str, Callable[[CCMForCausalLM, CompressedMemoryCache], object]] = {
    "compress": CALLS["compress"],
    "generate and fold": _generate_and_fold,
    "forward": CALLS["forward"],
    "reset": lambda _, cache: cache.reset(),
    "reorder": lambda _, cache: cache.reorder_cache(torch.tensor([1, 0])),
}


@settings(max_examples=10, deadline=None)
@given(calls=st.lists(st.sampled_from(sorted(SHALLOW_COPY_CALLS)), min_size=1, max_size=3), streaming=st.booleans())
def test_a_shallow_copy_of_a_cache_changes_independently(calls, streaming):
    """copy.copy(cache) shared the cache's layers: a call on the copy changed the original's memory under it (and ran
    beside a call on the original in another thread, unrefused, on the same layers)."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    cache = _two_users(streaming)
    before = snapshot(cache)
    twin = copy.copy(cache)
    for call in calls:
        if not (streaming and call == "compress"):  # a stream compresses by itself
            SHALLOW_COPY_CALLS[call](model, twin)
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "operation",
    [
        lambda cache: cache.batch_select_indices(torch.tensor([], dtype=torch.long)),
        lambda cache: cache.reorder_cache(torch.tensor([], dtype=torch.long)),
        lambda cache: cache.batch_repeat_interleave(0),
    ],
    ids=["select none", "reorder to none", "repeat 0 times"],
)
def test_a_batch_operation_that_keeps_no_row_is_refused(tmp_path, operation, streaming):
    """It left a cache of no row: its saved file was refused by load ('Save the memory again'), and every call
    on it failed inside torch."""
    cache = _two_users(streaming)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    with pytest.raises(ValueError, match="would leave the cache no row"):
        operation(cache)
    assert cache.batch_size == 2 and _saved_bytes(cache, tmp_path / "after.safetensors") == before


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("select", ["batch_select_indices", "reorder_cache"])
@pytest.mark.parametrize("index", [torch.tensor(1), torch.tensor([[1, 0]])], ids=["0-d", "2-D"])
def test_a_batch_operation_given_indices_that_are_no_list_of_rows_is_refused(tmp_path, select, index, streaming):
    """batch_select_indices failed with a bare IndexError from inside the cache ('tuple index out of range') given a 0-d
    index, and given a 2-D one left rows of two dimensions, on which every later call failed inside torch."""
    cache = _two_users(streaming)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    with pytest.raises(ValueError, match=r"takes a 1-D tensor of row indices, such as torch\.tensor\(\[2, 0\]\)"):
        getattr(cache, select)(index)
    with pytest.raises(TypeError, match=r"takes a 1-D tensor of row indices"):
        getattr(cache, select)(index.tolist())
    assert cache.batch_size == 2 and _saved_bytes(cache, tmp_path / "after.safetensors") == before


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("select", "dtype"),
    [
        ("batch_select_indices", torch.uint8),
        ("batch_select_indices", torch.float32),
        ("reorder_cache", torch.uint8),
        ("reorder_cache", torch.float32),
        ("reorder_cache", torch.bool),
    ],
)
def test_a_batch_operation_given_indices_of_another_dtype_is_refused(tmp_path, select, dtype, streaming):
    """uint8 indices selected the rows of a mask (torch.tensor([0, 1], dtype=torch.uint8) kept row 1 alone), and
    indices of other dtypes failed inside torch; a bool mask is for batch_select_indices only."""
    cache = _two_users(streaming)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    with pytest.raises(TypeError, match=rf"takes row indices of dtype torch.int64 or torch.int32.* got dtype {dtype}"):
        getattr(cache, select)(torch.tensor([0, 1]).to(dtype))
    assert cache.batch_size == 2 and _saved_bytes(cache, tmp_path / "after.safetensors") == before
    getattr(cache, select)(torch.tensor([1, 0], dtype=torch.int32))
    cache.batch_select_indices(torch.tensor([True, False]))
    assert cache.batch_size == 1


@pytest.mark.parametrize("streaming", [False, True])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    select=st.sampled_from(["batch_select_indices", "reorder_cache"]),
    indices=st.lists(st.integers(-4, 4), min_size=1, max_size=4),
)
def test_a_batch_operation_given_rows_the_cache_lacks_is_refused_naming_them(streaming, select, indices):
    """Row indices past the cache's rows (reorder_cache: or negative) failed inside torch with a bare IndexError, and
    on a GPU with a device-side assert that ends the process; indices of rows it holds select those rows."""
    cache = _two_users(streaming).copy()
    before = snapshot(cache)
    lowest = -2 if select == "batch_select_indices" else 0
    outside = [index for index in indices if not lowest <= index < 2]
    if outside:
        with pytest.raises(ValueError, match=re.escape(f"row indices {outside} outside {lowest} to 1, the cache hold")):
            getattr(cache, select)(torch.tensor(indices))
        assert_same(snapshot(cache), before)
        return
    getattr(cache, select)(torch.tensor(indices))
    rows = [index % 2 for index in indices]
    assert cache.next_position.tolist() == [before["rows"]["next_position"][row].item() for row in rows]
    for layer, held in zip(cache.layers, before["layers"], strict=True):
        assert torch.equal(layer.keys, held["keys"][rows])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_row_mask_of_another_length_than_the_batch_is_refused(streaming):
    """A bool mask of fewer or more rows than the cache failed inside torch with a bare IndexError."""
    cache = _two_users(streaming)
    before = snapshot(cache)
    for mask in ([True], [True, False, True]):
        with pytest.raises(ValueError, match=rf"a mask of {len(mask)} rows, but the cache holds 2; give one True"):
            cache.batch_select_indices(torch.tensor(mask))
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("repeats", "error", "message"),
    [
        (-1, ValueError, "copies per row of 1 or more, such as 2; got -1"),
        (2.0, TypeError, "a whole number of copies per row, such as 2; got 2.0"),
        (True, TypeError, "a whole number of copies per row, such as 2; got True"),
        ("2", TypeError, "a whole number of copies per row, such as 2; got '2'"),
    ],
)
def test_batch_repeat_interleave_refuses_a_count_that_is_no_whole_number_of_copies(streaming, repeats, error, message):
    """A negative count failed inside torch with a RuntimeError, and a float, a bool or a string with torch's list of
    its overloads; a NumPy or 0-d tensor integer repeats the rows as an int does."""
    cache = _two_users(streaming)
    before = snapshot(cache)
    with pytest.raises(error, match=re.escape(message)):
        cache.batch_repeat_interleave(repeats)
    assert_same(snapshot(cache), before)
    for count in (np.int64(2), torch.tensor(2)):
        copied = cache.copy()
        copied.batch_repeat_interleave(count)
        assert copied.next_position.tolist() == cache.next_position.repeat_interleave(2).tolist()


def test_compress_after_a_failed_compress_folds_the_same_memory(tmp_path):
    model = tiny_ccm("llama", update="merge")
    failed, clean = _filled(model), _filled(model)
    model.generate(torch.tensor([[20, 21], [22, 23]]), past_key_values=failed, max_new_tokens=3, do_sample=False)
    model.generate(torch.tensor([[20, 21], [22, 23]]), past_key_values=clean, max_new_tokens=3, do_sample=False)
    handle = fail_in_layer(model, 1, 0)
    with pytest.raises(InjectedFailure):
        model.compress(failed, torch.tensor([[30, 31], [32, 33]]))
    handle.remove()
    model.compress(failed, torch.tensor([[30, 31], [32, 33]]))
    model.compress(clean, torch.tensor([[30, 31], [32, 33]]))
    assert _saved_bytes(failed, tmp_path / "a.safetensors") == _saved_bytes(clean, tmp_path / "b.safetensors")


@pytest.mark.parametrize("bad", [VOCAB, -1, 10_000])
def test_out_of_vocabulary_ids_are_refused_before_anything_runs(tmp_path, bad):
    model = tiny_ccm("llama")
    cache = _filled(model)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    for call in (
        lambda: model.compress(cache, torch.tensor([[5, bad], [6, 7]])),
        lambda: model.generate(torch.tensor([[5, 6], [bad, 7]]), past_key_values=cache, max_new_tokens=2),
        lambda: model(input_ids=torch.tensor([[5, 6], [7, bad]]), past_key_values=cache),
    ):
        with pytest.raises(ValueError, match=rf"token id {bad}, outside the model's vocabulary \(0\.\.{VOCAB - 1}\)"):
            call()
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before


BAD_INPUTS = {
    "1-D input_ids to generate": (
        lambda model, cache: model.generate(torch.tensor([20, 21]), past_key_values=cache, max_new_tokens=2),
        r"input_ids must be 2-D \(batch, len\); add a batch dimension",
    ),
    "1-D input_ids to forward": (
        lambda model, cache: model(input_ids=torch.tensor([20, 21]), past_key_values=cache),
        r"input_ids must be 2-D",
    ),
    "an empty prompt": (
        lambda model, cache: model.generate(torch.zeros(2, 0, dtype=torch.long), past_key_values=cache),
        "input_ids holds no token",
    ),
    "a prompt mask of another shape": (
        lambda model, cache: model.generate(
            torch.tensor([[20, 21], [22, 23]]), attention_mask=torch.ones(2, 5), past_key_values=cache
        ),
        r"attention_mask has shape \(2, 5\) but input_ids \(2, 2\)",
    ),
    "text as context_ids": (
        lambda model, cache: model.compress(cache, "my name is Ada"),
        r"context_ids must be token ids .* got str: tokenize text",
    ),
    "context rows of different lengths": (
        lambda model, cache: model.compress(cache, [[20, 21, 22], [23]]),
        r"context_ids must be token ids .* pad rows of different lengths",
    ),
    "a forward whose mask marks every new token as padding": (
        lambda model, cache: model(
            input_ids=torch.tensor([[20, 21], [22, 23]]), attention_mask=torch.zeros(2, 2), past_key_values=cache
        ),
        r"attention_mask marks every one of the 2 new tokens as padding.*pass at least one token with mask 1",
    ),
    "text as the mask of a forward": (
        lambda model, cache: model(
            input_ids=torch.tensor([[20, 21], [22, 23]]), attention_mask="11", past_key_values=cache
        ),
        r"attention_mask must be 1 \(a token\) or 0 \(padding\) per input token, .* got str",
    ),
    "embeddings of another width": (
        lambda model, cache: model(inputs_embeds=torch.randn(2, 3, 16), past_key_values=cache),
        r"inputs_embeds must be 3-D \(batch, len, 32\), got shape \(2, 3, 16\)",
    ),
    "embeddings of another dtype": (
        lambda model, cache: model(inputs_embeds=torch.randn(2, 3, 32, dtype=torch.float64), past_key_values=cache),
        "inputs_embeds has dtype torch.float64 but the model runs in torch.float32",
    ),
    "embeddings holding a NaN": (
        lambda model, cache: model(
            inputs_embeds=torch.randn(2, 3, 32).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(torch.nan)),
            past_key_values=cache,
        ),
        r"inputs_embeds holds values that are not finite \(NaN or inf\)",
    ),
    "position_ids given to generate": (
        lambda model, cache: model.generate(
            torch.tensor([[20, 21], [22, 23]]), position_ids=torch.tensor([[7, 8], [7, 8]]), past_key_values=cache
        ),
        "position_ids cannot be given with a CompressedMemoryCache: the cache numbers the positions itself",
    ),
    "a prompt row of padding only": (
        lambda model, cache: model.generate(
            torch.tensor([[20, 21], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]), past_key_values=cache
        ),
        r"every prompt token of row\(s\) \[1\] as padding, so generate\(\) would reply to nothing",
    ),
    "a prompt of padding only": (
        lambda model, cache: model.generate(
            torch.tensor([[0], [0]]), attention_mask=torch.tensor([[0], [0]]), past_key_values=cache, num_beams=2
        ),
        r"every prompt token of row\(s\) \[0, 1\] as padding.*give every row at least one token with mask 1",
    ),
    "generate without a prompt": (
        lambda model, cache: model.generate(past_key_values=cache, max_new_tokens=2),
        r"generate\(\) needs a prompt: pass input_ids \(batch, len\) or inputs_embeds",
    ),
    "a prompt of embeddings holding an inf": (
        lambda model, cache: model.generate(
            inputs_embeds=torch.full((2, 2, 32), torch.inf), past_key_values=cache, max_new_tokens=2
        ),
        r"inputs_embeds holds values that are not finite \(NaN or inf\)",
    ),
}


BAD_TYPES = {
    "a list as input_ids to generate": (
        lambda model, cache: model.generate([[20, 21], [22, 23]], past_key_values=cache, max_new_tokens=2),
        r"input_ids must be a torch.Tensor, got list; wrap token ids with torch.tensor",
    ),
    "a list as input_ids to forward": (
        lambda model, cache: model(input_ids=[[20, 21], [22, 23]], past_key_values=cache),
        r"input_ids must be a torch.Tensor, got list",
    ),
    "the prompt as input_ids and as inputs": (
        lambda model, cache: model.generate(
            torch.tensor([[20, 21], [22, 23]]), inputs=torch.tensor([[20, 21], [22, 23]]), past_key_values=cache
        ),
        "Give the prompt once, as input_ids= or as inputs=",
    ),
    "no cache to compress": (
        lambda model, cache: model.compress(None, torch.tensor([[5, 6], [7, 8]])),
        r"must be a CompressedMemoryCache \(model.new_cache\(\)\), got NoneType",
    ),
    "a streaming config as a dict": (
        lambda model, cache: model.new_cache(2, streaming={"window_tokens": 12}),
        "streaming must be a StreamingConfig",
    ),
}


@pytest.mark.parametrize(
    ("case", "error"),
    [*((case, ValueError) for case in sorted(BAD_INPUTS)), *((case, TypeError) for case in sorted(BAD_TYPES))],
)
def test_bad_inputs_are_refused_before_anything_runs(tmp_path, case, error):
    """Wrong shapes and dtypes get a ValueError, wrong types a TypeError (they failed with an AttributeError such as
    'list' object has no attribute 'is_floating_point'); each says what to pass and leaves the cache as it was."""
    model = tiny_ccm("llama")
    cache = _filled(model)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    call, message = {**BAD_INPUTS, **BAD_TYPES}[case]
    with pytest.raises(error, match=message):
        call(model, cache)
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before


def test_generate_takes_a_prompt_mask_given_as_a_list():
    model = tiny_ccm("llama")
    prompt, mask = torch.tensor([[0, 20, 21], [22, 23, 24]]), [[0, 1, 1], [1, 1, 1]]
    outputs = [
        model.generate(prompt, attention_mask=given, past_key_values=_filled(model), max_new_tokens=3, do_sample=False)
        for given in (mask, torch.tensor(mask))
    ]
    assert torch.equal(*outputs)


def test_a_forward_takes_a_mask_given_as_a_list():
    """It failed with AttributeError: 'list' object has no attribute 'ndim'."""
    model = tiny_ccm("llama")
    prompt, mask = torch.tensor([[0, 20, 21], [22, 23, 24]]), [[0, 1, 1], [1, 1, 1]]
    with torch.no_grad():
        logits = [
            model(input_ids=prompt, attention_mask=given, past_key_values=_filled(model)).logits
            for given in (mask, torch.tensor(mask))
        ]
    assert torch.equal(*logits)


def test_a_forward_of_padding_only_leaves_no_turn_that_nothing_can_fold(tmp_path):
    """A forward whose new tokens were all padding left a turn of padding: generate() and save() then asked for
    compress(), which found nothing to fold, and the cache was stuck. It is refused, with a mask of the new tokens or
    of the turn and the new tokens; a batch in which only some rows are padding still runs, and its turn folds."""
    model = tiny_ccm("llama")
    cache = _filled(model)
    with pytest.raises(ValueError, match="marks every one of the 2 new tokens as padding"):
        model(input_ids=torch.tensor([[20, 21], [22, 23]]), attention_mask=[[0, 0], [0, 0]], past_key_values=cache)
    assert not cache.has_unfolded_turn
    model(input_ids=torch.tensor([[20], [21]]), past_key_values=cache)
    with pytest.raises(ValueError, match="marks every one of the 1 new tokens as padding"):
        model(input_ids=torch.tensor([[22], [23]]), attention_mask=[[1, 0], [1, 0]], past_key_values=cache)
    assert cache.turn_length == 1
    model(input_ids=torch.tensor([[22, 23], [24, 25]]), attention_mask=[[1, 0, 0], [1, 1, 1]], past_key_values=cache)
    model.compress(cache)
    assert cache.steps.tolist() == [3, 3] and not cache.has_unfolded_turn


def test_labels_that_do_not_fit_a_streamed_input_leave_the_stream_as_it_was(tmp_path):
    """The loss of an input run in pieces is part of the call: labels it cannot take fail it whole."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama")
    cache = model.new_cache(
        streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    )
    model(input_ids=torch.tensor([list(range(3, 15))]), past_key_values=cache)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    with pytest.raises(ValueError, match=r"labels has shape \(1, 3\) but the input \(1, 27\); give one label"):
        model(
            input_ids=torch.tensor([list(range(3, 30))]),
            labels=torch.ones(1, 3, dtype=torch.long),
            past_key_values=cache,
        )
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before


def test_an_interrupt_leaves_the_cache_as_it_was(tmp_path):
    model = tiny_ccm("llama")
    cache = _filled(model)
    before = _saved_bytes(cache, tmp_path / "before.safetensors")
    block = model.base_model.model.layers[1]

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    handle = block.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model.compress(cache, torch.tensor([[11, 12], [13, 14]]))
    handle.remove()
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == before


_INTERRUPTS = {
    "injected": lambda: InjectedFailure("the user's hook failed"),
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": SystemExit,
    "CancelledError": asyncio.CancelledError,
}


def _online_call(model: CCMForCausalLM, cache: CompressedMemoryCache, passed: str) -> torch.Tensor:
    ids = torch.tensor([[20, 21, 22], [23, 24, 25]])
    with torch.no_grad():
        if passed == "positionally":
            return model(ids, None, None, None, None, cache).logits
        return model(input_ids=ids, **{passed: cache}).logits


@settings(max_examples=16, deadline=None)
@given(
    failure=st.sampled_from(sorted(_INTERRUPTS)),
    streaming=st.booleans(),
    passed=st.sampled_from(["past_key_values", "cache", "positionally"]),
    with_kwargs=st.booleans(),
)
def test_a_forward_hook_of_the_model_that_fails_leaves_the_cache_as_it_was(failure, streaming, passed, with_kwargs):
    """The hooks registered on the model run around its forward, outside the call's transaction on the cache: a
    forward hook that raised (or an interrupt while one ran) left the cache holding the call's tokens, though the call
    failed."""
    model = tiny_ccm("llama")
    cache = _user_cache(model, streaming)
    untouched, before = cache.copy(), snapshot(cache)

    def fail(*_: object) -> None:
        raise _INTERRUPTS[failure]()

    handle = model.register_forward_hook(fail, with_kwargs=with_kwargs)
    try:
        with pytest.raises(type(_INTERRUPTS[failure]())):
            _online_call(model, cache, passed)
    finally:
        handle.remove()
    assert_same(snapshot(cache), before, "the cache after the failed call")
    assert torch.equal(_online_call(model, cache, passed), _online_call(model, untouched, passed))
    assert_same(snapshot(cache), snapshot(untouched), "the cache after the call made again")


# ----- gradient checkpointing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradients_with_and_without_checkpointing_agree(architecture, use_reentrant):
    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig(lora_dropout=0.0)))
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13])] * 2)
        model(**batch).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert checkpointed[name] is not None, f"{name} gets no gradient under checkpointing"
        assert torch.allclose(grad, checkpointed[name], atol=1e-5), name
    assert any(grad.abs().sum() > 0 for name, grad in plain.items() if "lora_B" in name)


# ----- identity --------------------------------------------------------------------------------------------------
def test_freezing_the_adapter_does_not_change_its_identity(tmp_path):
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    cache = _filled(model)
    cache.save(tmp_path / "user.safetensors")
    model.requires_grad_(False)
    CompressedMemoryCache.load(tmp_path / "user.safetensors", model)
    other = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()), seed=5)
    other.requires_grad_(False)
    with pytest.raises(ValueError, match="adapter_sha256"):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", other)


def test_memory_from_another_base_of_the_same_shape_is_refused(tmp_path):
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama", seed=0), CCMConfig()))
    other_base = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama", seed=1), CCMConfig()))
    cache = _filled(model)
    cache.save(tmp_path / "user.safetensors")
    with pytest.raises(ValueError, match="base_fingerprint"):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", other_base)
    with pytest.raises(ValueError, match=r"belongs to another model or adapter .*base_fingerprint"):
        other_base.compress(cache, torch.tensor([[5, 6], [7, 8]]))


def test_a_live_cache_is_refused_once_the_adapter_changed():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    cache = _filled(model)
    with torch.no_grad():
        model.comp_embeddings.add_(0.1)
    with pytest.raises(ValueError, match="adapter_sha256"):
        model.generate(torch.tensor([[5], [6]]), past_key_values=cache, max_new_tokens=2)


def _same_weights(ccm: dict[str, object], base: dict[str, object]) -> CCMForCausalLM:
    """A tiny Llama CCM model with the weights of `tiny_base("llama")` and `randomize_adapter` (seed 1), built with
    the adapter settings `ccm` and the base config entries `base` changed."""
    reference = tiny_base("llama")
    config = copy.deepcopy(reference.config)
    for name, value in base.items():
        setattr(config, name, value)
    twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    twin.load_state_dict(reference.state_dict())
    return randomize_adapter(CCMForCausalLM.from_base(twin, CCMConfig(**ccm)))


def _memory(model: CCMForCausalLM) -> CompressedMemoryCache:
    cache = model.new_cache(1)
    model.compress(cache, torch.tensor([list(range(3, 40))]))
    return cache


def _memory_difference(one: CompressedMemoryCache, other: CompressedMemoryCache) -> float:
    return max(
        float((mine - theirs).abs().max())
        for a, b in zip(one.layers, other.layers, strict=True)
        for mine, theirs in ((a.keys, b.keys), (a.values, b.values))
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ccm=st.fixed_dictionaries(
        {},
        optional={
            "lora_alpha": st.sampled_from([4.0, 16.0, 64.0]),
            "conditional_lora": st.booleans(),
            "lora_dropout": st.sampled_from([0.0, 0.3]),
        },
    ),
    base=st.fixed_dictionaries(
        {},
        optional={
            "rope_parameters": st.sampled_from(
                [
                    {"rope_type": "default", "rope_theta": 500000.0},
                    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                ]
            ),
            "rms_norm_eps": st.sampled_from([1e-6, 1e-2]),
            "hidden_act": st.sampled_from(["silu", "gelu"]),
            "pad_token_id": st.sampled_from([0, 5]),
            "unk_token_id": st.sampled_from([0, 7]),
        },
    ),
)
def test_a_memory_is_accepted_only_by_a_model_that_computes_the_same_memory(tmp_path, ccm, base):
    """Same weights, other settings: the signature left out the LoRA scaling (lora_alpha), the conditional gate and
    the base config (rotary base and scaling, norm epsilon, activation), so a memory compressed under one was
    accepted by a model that computes another, which then answered from keys/values it never made."""
    made_by, user = _same_weights({}, {}), _same_weights(ccm, base)
    assert user.memory_signature()["adapter_sha256"] == made_by.memory_signature()["adapter_sha256"]
    assert user.memory_signature()["base_fingerprint"] == made_by.memory_signature()["base_fingerprint"]
    memory = _memory(made_by)
    memory.save(tmp_path / "user.safetensors")
    if _memory_difference(memory, _memory(user)) > 1e-5:
        with pytest.raises(ValueError, match="belongs to another model or adapter"):
            user.compress(memory, torch.tensor([[5, 6]]))
        with pytest.raises(ValueError, match="was made by another model or adapter"):
            CompressedMemoryCache.load(tmp_path / "user.safetensors", user)
    if set(ccm) <= {"lora_dropout"} and set(base) <= {"pad_token_id", "unk_token_id"}:  # no change of numbers at eval
        loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", user)
        user.compress(memory, torch.tensor([[5, 6]]))
        assert _memory_difference(loaded, _memory(made_by)) == 0


@pytest.mark.parametrize(
    "entry",
    [
        {"pad_token_id": 5},
        {"unk_token_id": 7},
        {"initializer_range": 0.5},
        {"use_cache": False},
        {"attention_dropout": 0.3},
        {"output_hidden_states": True},
        {"transformers_version": "4.0.0"},
    ],
)
def test_a_base_config_that_differs_only_in_bookkeeping_accepts_the_memory(tmp_path, entry):
    """Token ids, initialisation, switches and dropout (off in eval) change no key or value: a base config that differs
    only there computes the same memory and accepts it."""
    made_by, user = _same_weights({}, {}), _same_weights({}, entry)
    _memory(made_by).save(tmp_path / "user.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", user)
    assert _memory_difference(loaded, _memory(user)) == 0


def test_a_refused_base_config_names_the_entry_that_differs(tmp_path):
    _memory(_same_weights({}, {})).save(tmp_path / "user.safetensors")
    other = _same_weights({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    with pytest.raises(
        ValueError, match=r"base_config\.rope_parameters\.rope_theta: file 10000\.0 vs model 500000\.0\)"
    ):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", other)


def _set_scale(model: CCMForCausalLM) -> None:
    for layer in lora_layers(model.base_model):
        layer.set_scale("default", 2.0)  # PEFT's own call: scaling = 2 * lora_alpha / r


def _scale_one_layer(model: CCMForCausalLM) -> None:
    lora_layers(model.base_model)[1].scaling["default"] *= 3


def _narrow_the_window(model: CCMForCausalLM) -> None:
    model.base_model.config.sliding_window = 4  # read by the mask code at every call


def _tiny_llama() -> CCMForCausalLM:
    return _same_weights({}, {})


def _tiny_mistral() -> CCMForCausalLM:
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("mistral"), CCMConfig()))


LIVE_CHANGES = {
    "set_scale": (_tiny_llama, _set_scale, "lora_scaling: cache 2.0 vs model 4.0"),
    "scaling of one layer": (_tiny_llama, _scale_one_layer, "lora_scaling: cache 2.0 vs model [2.0, 6.0, 2.0"),
    "sliding window": (_tiny_mistral, _narrow_the_window, "base_config.sliding_window: cache None vs model 4"),
}


@pytest.mark.parametrize("change", sorted(LIVE_CHANGES))
def test_a_cache_is_refused_once_the_model_computes_its_memory_otherwise(tmp_path, change):
    """A change made to a loaded model that changes the keys/values it computes (the LoRA scaling, the sliding window
    its mask code reads) left its caches and memory files accepted."""
    make, change_it, message = LIVE_CHANGES[change]
    model = make()
    cache = _memory(model)
    cache.save(tmp_path / "user.safetensors")
    change_it(model)
    assert _memory_difference(cache, _memory(model)) > 1e-3
    with pytest.raises(ValueError, match=re.escape(message)):
        model.compress(cache, torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match=re.escape(message.replace("cache", "file"))):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", model)


def _set_an_entry(model: CCMForCausalLM) -> Callable[[], None]:
    config = model.base_model.config
    earlier, config.rms_norm_eps = config.rms_norm_eps, 1e-2
    return lambda: setattr(config, "rms_norm_eps", earlier)


def _change_a_nested_entry_in_place(model: CCMForCausalLM) -> Callable[[], None]:
    parameters = model.base_model.config.rope_parameters
    earlier, parameters["rope_theta"] = parameters["rope_theta"], 500000.0
    return lambda: parameters.update(rope_theta=earlier)


def _add_an_entry(model: CCMForCausalLM) -> Callable[[], None]:
    config = model.base_model.config
    config.attention_multiplier = 2.0
    return lambda: delattr(config, "attention_multiplier")


def _replace_the_config(model: CCMForCausalLM) -> Callable[[], None]:
    earlier = model.base_model.config
    model.base_model.config = copy.deepcopy(earlier)
    model.base_model.config.rope_parameters["rope_theta"] = 500000.0
    return lambda: setattr(model.base_model, "config", earlier)


CONFIG_CHANGES = {
    "an entry set": (_set_an_entry, "base_config.rms_norm_eps"),
    "a nested entry changed in place": (_change_a_nested_entry_in_place, "base_config.rope_parameters.rope_theta"),
    "an entry added": (_add_an_entry, "base_config.attention_multiplier"),
    "the config replaced": (_replace_the_config, "base_config.rope_parameters.rope_theta"),
}


@settings(max_examples=16, deadline=None)
@given(change=st.sampled_from(sorted(CONFIG_CHANGES)), in_thread=st.booleans(), undone=st.booleans())
def test_a_base_config_changed_between_calls_refuses_the_caches_made_before(change, in_thread, undone):
    """The model reads its base config's settings again only once the config changed; a change of any kind, made
    in any thread, still refuses the caches made before it, and one undone again leaves them accepted."""
    model = _same_weights({}, {})
    cache, expected = _filled(model), _filled(model)
    CALLS["compress"](model, expected)
    make, named = CONFIG_CHANGES[change]
    undo = []
    if in_thread:
        thread = threading.Thread(target=lambda: undo.append(make(model)))
        thread.start()
        thread.join()
    else:
        undo.append(make(model))
    if undone:
        undo[0]()
        CALLS["compress"](model, cache)
        assert _memory_difference(cache, expected) == 0
    else:
        with pytest.raises(ValueError, match=re.escape(named)):
            CALLS["compress"](model, cache)


def test_calls_on_an_unchanged_model_read_its_base_config_once(monkeypatch):
    """Each call read the base config's settings twice (`to_dict`, before and after it ran), more than the rest of
    its checks of the model cost."""
    model = _same_weights({}, {})
    cache = _filled(model)
    reads = []
    read = modeling.computing_settings
    monkeypatch.setattr(modeling, "computing_settings", lambda config: reads.append(config) or read(config))
    model.memory_signature()["base_config"]["rms_norm_eps"] = 1.0  # the caller's copy: the model keeps its own
    for call in ("compress", "generate", "forward", "beam search"):
        CALLS[call](model, cache.copy())
    assert reads == []
    model.base_model.config.rms_norm_eps = 1e-2
    with pytest.raises(ValueError, match=re.escape("base_config.rms_norm_eps: cache 1e-06 vs model 0.01")):
        CALLS["compress"](model, cache)
    assert reads == [model.base_model.config]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.sets(st.integers(0, 7), min_size=1), call=st.sampled_from(sorted(CALLS)))
def test_peft_s_own_lora_path_switched_on_is_refused_until_switched_off(tmp_path, layers, call):
    """`enable_adapters(True)` on a LoRA layer (PEFT's own switch) added the LoRA at every token besides the gate's:
    calls ran on, with other keys/values under the same signature, and the caches made before were accepted."""
    model = _same_weights({}, {})
    cache = _memory(model).copy()
    cache.batch_repeat_interleave(2)
    saved = _saved_bytes(cache, tmp_path / "before.safetensors")
    expected = _memory(model)
    enabled = [lora_layers(model.base_model)[index] for index in sorted(layers)]
    for layer in enabled:
        layer.enable_adapters(True)
    with pytest.raises(ValueError, match=rf"{len(enabled)} LoRA layers run PEFT's own LoRA path .*enable_adapters"):
        CALLS[call](model, cache)
    with pytest.raises(ValueError, match="enable_adapters"):
        model(**CCMDataCollator(model)([OnlineSample([[5, 6]], [7], [8])]))
    assert _saved_bytes(cache, tmp_path / "after.safetensors") == saved
    for layer in enabled:
        layer.enable_adapters(False)
    assert _memory_difference(_memory(model), expected) == 0
    CALLS[call](model, cache)


def _assign_state_dict(model: CCMForCausalLM, shift: float) -> None:
    model.load_state_dict({name: tensor + shift for name, tensor in model.state_dict().items()}, assign=True)


def _new_lora_parameter(model: CCMForCausalLM, shift: float) -> None:
    linear = lora_layers(model.base_model)[-1].lora_B["default"]
    linear.weight = torch.nn.Parameter(linear.weight.detach() + shift)


def _new_base_parameter(model: CCMForCausalLM, shift: float) -> None:
    linear = model.base_model.model.layers[1].mlp.up_proj
    linear.weight = torch.nn.Parameter(linear.weight.detach() + shift, requires_grad=False)


def _new_base_layer(model: CCMForCausalLM, shift: float) -> None:
    mlp = model.base_model.model.layers[0].mlp
    replacement = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    with torch.no_grad():
        replacement.weight.copy_(mlp.down_proj.weight + shift)
    mlp.down_proj = replacement.requires_grad_(False)


COPIES: dict[str, Callable[[CCMForCausalLM], CCMForCausalLM]] = {
    "the model": lambda model: model,
    "a deep copy": copy.deepcopy,
    "a pickled copy": lambda model: pickle.loads(pickle.dumps(model)),
}


@pytest.mark.parametrize("copied", COPIES)
@pytest.mark.parametrize(
    ("replace", "field"),
    [
        (_assign_state_dict, "adapter_sha256"),
        (_new_lora_parameter, "adapter_sha256"),
        (_new_base_parameter, "base_fingerprint"),
        (_new_base_layer, "base_fingerprint"),
    ],
)
def test_weights_put_in_as_new_tensors_change_the_signature(tmp_path, replace, field, copied):
    """The weights were listed once: after load_state_dict(assign=True) or a replaced parameter or layer, the
    signature still hashed the tensors they replaced, so memories of the old weights were accepted. A copy of a model
    (copy.deepcopy, a pickle) kept the listing of the model it was copied from, and never saw its own weights
    replaced."""
    original = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    _filled(original)  # the original has listed its weights
    model = COPIES[copied](original)
    cache = _filled(model)
    cache.save(tmp_path / "user.safetensors")
    replace(model, 0.0)  # the same values in new tensors: the memory is still the model's
    model.compress(cache.copy(), torch.tensor([[5], [6]]))
    replace(model, 0.25)
    with pytest.raises(ValueError, match=field):
        model.compress(cache, torch.tensor([[5], [6]]))
    with pytest.raises(ValueError, match=field):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", model)


def test_a_parameter_of_a_layer_put_in_after_the_listing_changes_the_signature():
    """A layer attached after the weights were listed is watched from the next listing on: replacing its weight
    then is seen too."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    _new_base_layer(model, 0.0)
    before = model.memory_signature()["base_fingerprint"]
    _new_base_layer_weight(model, 0.25)
    assert model.memory_signature()["base_fingerprint"] != before


def _new_base_layer_weight(model: CCMForCausalLM, shift: float) -> None:
    down = model.base_model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() + shift, requires_grad=False)


def test_registrations_outside_the_model_do_not_list_its_weights_again():
    """Decoders slice their layer list in every forward, which registers each layer in a new list: counted, they
    made every call walk all the model's parameters again (milliseconds on 30 layers)."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    cache = _filled(model)
    model.compress(cache, torch.tensor([[5], [6]]))
    listed = model._listed
    model(torch.tensor([[7], [8]]), past_key_values=cache)
    model.base_model.model.layers[:1]
    torch.nn.Linear(2, 2).weight = torch.nn.Parameter(torch.zeros(2, 2))
    model.compress(cache, torch.tensor([[5], [6]]))
    assert model._listed is listed


def test_a_single_changed_base_weight_changes_the_fingerprint():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    before = model.memory_signature()["base_fingerprint"]
    with torch.no_grad():
        model.base_model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-3
    assert model.memory_signature()["base_fingerprint"] != before


@settings(max_examples=10, deadline=None)
@given(rows=st.lists(st.integers(0, 31), min_size=2, max_size=2, unique=True))
def test_base_weights_moved_to_other_rows_change_the_fingerprint(tmp_path_factory, rows):
    """The fingerprint sums each weight's raw bits plain and weighted by the row of 64 they sit in: rows of a weight
    swapped (heads or channels permuted) keep the plain sum, and a memory of the other model loaded."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    path = tmp_path_factory.mktemp("swap") / "user.safetensors"
    _filled(model).save(path)
    down = model.base_model.model.layers[0].mlp.down_proj.weight  # (32, 64): one row of 64 per output channel
    assert down.shape[1] == 64
    with torch.no_grad():
        down[rows] = down[rows[::-1]].clone()
    with pytest.raises(ValueError, match=r"another model or adapter \(base_fingerprint: [^,]*\); load it"):
        CompressedMemoryCache.load(path, model)


def test_rows_moved_between_chunks_of_a_large_weight_change_the_fingerprint():
    """A weight of more than one chunk is summed chunk by chunk: its rows are weighted by their place in the whole
    weight, so that rows at the same place in two chunks are told apart."""
    rows = 2 * _CHUNK // 64
    weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0))
    moved = weight.clone()
    moved[[5, 5 + rows // 2]] = weight[[5 + rows // 2, 5]]
    assert weights_fingerprint([("w", moved)]) != weights_fingerprint([("w", weight)])


# ----- numerics and bounds ---------------------------------------------------------------------------------------
def test_bf16_merge_memory_stays_close_to_fp32_after_1000_turns():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge")))
    half = copy.deepcopy(model).to(torch.bfloat16)
    caches = {model: model.new_cache(), half: half.new_cache()}
    generator = torch.Generator().manual_seed(0)
    for _ in range(1000):
        context = torch.randint(3, VOCAB, (1, 3), generator=generator)
        for each, cache in caches.items():
            each.compress(cache, context)
    for full, low in zip(caches[model].layers, caches[half].layers, strict=True):
        reference = full.keys.float()
        error = (low.keys.float() - reference).norm() / reference.norm()
        assert error < 0.03, f"bf16 merge memory is {error:.1%} away from fp32"


@pytest.mark.parametrize(
    ("architecture", "update", "streaming"),
    [("llama", "concat", False), ("llama", "merge", False), ("gpt2", "concat", False), ("llama", "merge", True)],
)
def test_a_memory_made_under_autocast_is_held_in_the_models_dtype_and_loads_back(
    tmp_path, architecture, update, streaming
):
    """Under bf16 autocast the projections gave bf16 keys/values, which a new cache held as they came: the memory
    saved was a file that `load` refused ('expected torch.float32')."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm(architecture, update=update)
    stream = StreamingConfig(window_tokens=12, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
    cache = model.new_cache(2, streaming=stream if streaming else None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if streaming:
            model(input_ids=ids, past_key_values=cache)
        else:
            model.compress(cache, ids)
    assert {layer.keys.dtype for layer in cache.layers} | {layer.values.dtype for layer in cache.layers} == {
        model.dtype
    }
    cache.save(tmp_path / "user.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", model)
    assert all(torch.equal(a.values, b.values) for a, b in zip(loaded.layers, cache.layers, strict=True))


@settings(max_examples=10, deadline=None)
@given(cap=st.integers(2, 6), steps=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=8))
def test_the_concat_cap_bounds_every_row(cap, steps):
    model = tiny_ccm("llama", max_memory_tokens=cap)
    cache = model.new_cache(4)
    for rows in steps:
        if not any(rows):
            continue
        model.compress(cache, torch.tensor([[5, 6]] * 4), attention_mask=torch.tensor([[r, r] for r in rows]))
        assert cache.memory_length <= cap
        assert all(layer.keys.shape[2] <= cap for layer in cache.layers)


def test_four_users_with_cap_four_hold_four_slots_each():
    model = tiny_ccm("llama", max_memory_tokens=4)
    cache = model.new_cache(4)
    for user in range(4):  # each user in turn, so that no two users' slots line up
        for _ in range(3):
            mask = torch.zeros(4, 2, dtype=torch.long)
            mask[user] = 1
            model.compress(cache, torch.tensor([[5, 6]] * 4), attention_mask=mask)
    assert cache.memory_length == 4
    assert cache.memory_mask.sum(dim=1).tolist() == [4, 4, 4, 4]


def test_compaction_keeps_each_rows_memory_exact():
    model = tiny_ccm("llama", max_memory_tokens=4)
    together = model.new_cache(2)
    alone = [model.new_cache(1), model.new_cache(1)]
    schedule = [[1, 0], [1, 1], [0, 1], [0, 1], [1, 0], [0, 1]]
    for step, rows in enumerate(schedule):
        context = torch.tensor([[5 + step, 6], [7, 8 + step]])
        model.compress(together, context, attention_mask=torch.tensor([[r, r] for r in rows]))
        for row, present in enumerate(rows):
            if present:
                model.compress(alone[row], context[row : row + 1])
    prompt = torch.tensor([[20, 21], [22, 23]])
    with torch.no_grad():
        batched = model(input_ids=prompt, past_key_values=together).logits
        for row in range(2):
            single = model(input_ids=prompt[row : row + 1], past_key_values=alone[row]).logits
            assert torch.allclose(batched[row], single[0], atol=1e-5)


def test_gpt2_history_past_its_positions_is_refused_with_the_fix():
    model = tiny_ccm("gpt2")
    cache = model.new_cache()
    with pytest.raises(ValueError, match=r"which cannot be moved \(learned absolute positions.*\)\. Start a new cache"):
        for _ in range(200):
            model.compress(cache, torch.tensor([list(range(3, 60))]))
    model.compress(cache, torch.tensor([[5, 6]]))  # the failed call left a usable cache


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.integers(440, 508), extra=st.integers(0, 3))
def test_a_gpt2_input_past_its_positions_is_refused_naming_the_position_it_would_reach(history: int, extra: int):
    """The refusal named the position after the input's last (542 for one whose last token would sit at 541), one
    past the figure `generate()`'s own check gives for the same input."""
    model = tiny_ccm("gpt2")
    cache = model.new_cache()
    model.compress(cache, (torch.arange(history) % 90 + 3)[None])  # the <COMP> tokens take no position after it
    fits = 512 - history  # the tokens that still fit: the last takes position 511
    with torch.no_grad():
        model(input_ids=torch.full((1, fits), 7), past_key_values=cache.copy())
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"would reach position {512 + extra} after this memory's history, past "):
        model(input_ids=torch.full((1, fits + 1 + extra), 7), past_key_values=cache)
    assert_same(before, snapshot(cache))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    memory=st.lists(st.integers(460, 505), min_size=1, max_size=2),
    prompt=st.integers(1, 6),
    new=st.integers(1, 30),
)
# The bound itself: the fold's last <COMP> token at position 511 (the last), or at 512.
@example(memory=[500], prompt=6, new=4)
@example(memory=[500], prompt=6, new=5)
def test_a_gpt2_reply_that_would_pass_its_positions_is_refused_before_generating(
    memory: list[int], prompt: int, new: int
) -> None:
    """On learned absolute positions, a reply that ran past them failed part way through generate(), after streaming
    tokens, saying to start a new cache; one that ended within them could not be folded (the <COMP> tokens passed
    them), and the cache was stuck: generate() asked for that fold. Prompt, reply and fold are now checked first."""
    model = tiny_ccm("gpt2")
    cache, longest = model.new_cache(len(memory)), max(memory)
    context = (torch.arange(longest) % 90 + 3).repeat(len(memory), 1)
    model.compress(cache, context, attention_mask=torch.tensor([[0] * (longest - m) + [1] * m for m in memory]))
    before, streamer = snapshot(cache), Collect()
    reached = max(memory) + prompt + new + model.config.num_comp_tokens - 1
    ids = torch.full((len(memory), prompt), 7)
    generate = functools.partial(
        model.generate, ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, streamer=streamer
    )
    if reached < 512:
        assert generate().shape[1] == prompt + new
        model.compress(cache)
        assert cache.next_position.tolist() == [m + prompt + new for m in memory]
        return
    most = 512 - (reached - new + 1)
    fix = f"give max_new_tokens={most} or less" if most > 0 else "shorten the prompt, or start a new cache"
    with pytest.raises(ValueError, match=rf"would reach position {reached}, past the model's 512 positions.*; {fix}"):
        generate()
    assert_same(snapshot(cache), before)
    assert streamer.tokens == ["end"]  # nothing ran


def short_and_long_twins() -> tuple[CCMForCausalLM, CCMForCausalLM]:
    """Two tiny Llama CCM models with the same weights, of 64 and 512 positions."""
    short = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    long_base = tiny_base("llama")
    long_base.config.max_position_embeddings = 512
    long = randomize_adapter(CCMForCausalLM.from_base(long_base, CCMConfig()))
    long.load_state_dict(short.state_dict())
    short.base_model.config.max_position_embeddings = 64
    return short, long


def test_rotary_positions_are_rebased_exactly():
    """A model with 64 positions and its twin with 512 agree on a history of several hundred tokens."""
    short, long = short_and_long_twins()
    caches = short.new_cache(), long.new_cache()
    for step in range(12):
        context = torch.tensor([list(range(3 + step, 23 + step))])
        for model, cache in zip((short, long), caches, strict=True):
            model.compress(cache, context)
    assert int(caches[0].next_position[0]) <= 64 < int(caches[1].next_position[0])
    prompt = torch.tensor([[20, 21, 22]])
    outputs = [
        model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=5,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for model, cache in zip((short, long), caches, strict=True)
    ]
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    for a, b in zip(outputs[0].logits, outputs[1].logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("call", ["compress", "generate", "forward"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(over=st.integers(1, 200), history=st.integers(0, 500))
def test_an_input_past_the_model_s_positions_is_refused_naming_the_fix_for_its_call(call, over, history):
    """Any history re-bases, but one input past the model's 512 positions cannot run: a prompt or a context was told to
    "pass shorter pieces", which generate() and compress() have no way to take (and a context was counted with its
    <COMP> tokens, more tokens than were passed). The refusal names each call's way, which then runs."""
    model = tiny_ccm("llama")
    n = model.config.num_comp_tokens
    cache = model.new_cache()
    if history:
        model.compress(cache, (torch.arange(history) % 90 + 3)[None])
    before = snapshot(cache)
    ids = torch.full((1, 512 + over - (n if call == "compress" else 0)), 7)
    if call == "compress":
        message = rf"A context of {ids.shape[1]} tokens and its {n} <COMP> tokens pass the model's 512 positions; "
        message += rf"compress it as several contexts of at most {512 - n} tokens each\."
        with pytest.raises(ValueError, match=message):
            model.compress(cache, ids)
        assert_same(before, snapshot(cache))
        for piece in ids.split(512 - n, dim=1):
            model.compress(cache, piece)
    elif call == "generate":
        message = rf"A prompt of {ids.shape[1]} tokens passes the model's 512 positions; shorten it, or compress its "
        message += r"beginning first \(model\.compress\(cache, beginning_ids\)\) and generate from the rest\."
        with pytest.raises(ValueError, match=message):
            model.generate(ids, past_key_values=cache, max_new_tokens=2)
        assert_same(before, snapshot(cache))
        for piece in ids[:, :-8].split(512 - n, dim=1):
            model.compress(cache, piece)
        model.generate(ids[:, -8:], past_key_values=cache, max_new_tokens=2)
    else:
        message = rf"An input of {ids.shape[1]} tokens passes the model's 512 positions; pass it in pieces of at most "
        message += r"512 tokens \(each model\(\.\.\.\) call continues the turn\)\."
        with torch.no_grad():
            with pytest.raises(ValueError, match=message):
                model(input_ids=ids, past_key_values=cache)
            assert_same(before, snapshot(cache))
            for piece in ids.split(512, dim=1):
                model(input_ids=piece, past_key_values=cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("update", ["merge", "ema"])
def test_a_rebased_half_precision_average_stays_the_memory_it_is_cast_to(update, dtype):
    """Re-basing rotated the memory attended to (the cast of its float32 average) and the average each by itself: the
    memory, rounded twice, was no longer the average's cast, and the turn that passed the model's positions attended
    to keys other than those a fold or a saved file holds."""
    model = copy.deepcopy(tiny_ccm("llama", update=update)).to(dtype)
    cache = model.new_cache(2)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([[100], [20]])  # only the first row reaches the model's 512 positions
    mask = torch.arange(100)[None] < lengths
    for _ in range(5):
        model.compress(cache, torch.randint(3, VOCAB, (2, 100), generator=generator), attention_mask=mask)
    model(input_ids=torch.randint(3, VOCAB, (2, 30), generator=generator), past_key_values=cache)
    assert int(cache.rows.rebased[0]) > 0 and int(cache.rows.rebased[1]) == 0
    for layer in cache.layers:
        assert torch.equal(layer.memory()[0], layer.accumulated[0].to(dtype))


def test_longrope_positions_are_rebased_with_the_long_factors_the_model_rotates_with_there():
    """Past its original context (64) a LongRoPE model rotates every position with its long factors: re-basing moved
    such keys with the short ones, and a model of 256 positions then disagreed with its twin of 4096."""
    short = randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig()))
    long_base = tiny_longrope_base()
    long_base.config.max_position_embeddings = 4096
    long = CCMForCausalLM.from_base(long_base, CCMConfig()).eval()
    long.load_state_dict(short.state_dict())
    short.base_model.config.max_position_embeddings = 256
    caches = short.new_cache(), long.new_cache()
    generator = torch.Generator().manual_seed(0)
    for length in (70, *[25] * 12):  # past the original context from the first forward on
        context = torch.randint(3, VOCAB, (1, length), generator=generator)
        for model, cache in zip((short, long), caches, strict=True):
            model.compress(cache, context)
    assert int(caches[0].rows.rebased[0]) > 0 and int(caches[1].rows.rebased[0]) == 0
    prompt = torch.tensor([[20, 21, 22]])
    logits = [
        model(input_ids=prompt, past_key_values=cache).logits
        for model, cache in zip((short, long), caches, strict=True)
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.integers(1, 60), length=st.integers(1, 66), compress=st.booleans())
@example(history=30, length=50, compress=False)
@example(history=30, length=40, compress=True)
@example(history=5, length=64, compress=False)
@example(history=5, length=63, compress=True)
def test_an_input_that_fits_the_positions_is_rebased_after_any_history(history, length, compress):
    """An input (a compression's: with its 2 <COMP> tokens) of up to all 64 positions of a model runs after a history
    as on its twin of 512 positions; it was refused past half of them. A longer one is refused, naming the fix."""
    short, long = short_and_long_twins()
    caches = short.new_cache(), long.new_cache()
    for model, cache in zip((short, long), caches, strict=True):
        model.compress(cache, torch.arange(history)[None] % (VOCAB - 3) + 3)
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    counts = length + 2 if compress else length
    if counts > 64:
        before = snapshot(caches[0])
        passes = rf"A context of {length} tokens and its 2 <COMP> tokens pass" if compress else f"An input of {length} "
        with pytest.raises(ValueError, match=rf"{passes}.* the model's 64 positions; (compress|pass) "):
            short.compress(caches[0], ids) if compress else short(input_ids=ids, past_key_values=caches[0])
        assert_same(snapshot(caches[0]), before)
        return
    for model, cache in zip((short, long), caches, strict=True):
        if compress:
            model.compress(cache, ids)
        else:
            model(input_ids=ids, past_key_values=cache)
    after = [
        model(input_ids=torch.tensor([[20, 21]]), past_key_values=cache).logits
        for model, cache in zip((short, long), caches, strict=True)
    ]
    torch.testing.assert_close(after[0], after[1], atol=1e-4, rtol=0)
