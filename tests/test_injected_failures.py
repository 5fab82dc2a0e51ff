"""A failure at any tensor operation of a public call (a bug, an interrupt, an out-of-memory error) leaves every cache
and the model as they were, claims nothing, and the same call then succeeds with the result it has had the failure
never happened.

Each test draws the operation that fails among all the call's operations (`count_operations`). Locally every
operation of every call here was swept, with each kind of failure.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from fault_injection import FAILURES, FailAt, assert_same, count_operations, model_snapshot, snapshot
from tiny_models import randomize_adapter, tiny_base, tiny_ccm, tiny_llama_for
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, OnlineSample, StreamingConfig
from transformers_ccm.cache import CacheSpec
from transformers_ccm.chat import ChatSession
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.hub import read_adapter
from transformers_ccm.training import TrainingRecipe, train

Caches = dict[str, CompressedMemoryCache]


@dataclass(frozen=True)
class Scenario:
    """A public call on a model and caches in a given state.

    Attributes:
        model: the model the call runs on (the call must leave it as it was, so a cached one is fine).
        caches: fresh caches (and whatever else the call changes) in the state the call starts from.
        call: the call; returns what the caller gets, as tensors, numbers, strings and tuples of them.
        foreign: how many of the call's first operations run inside a library that does not pass every failure on
            (none are drawn): safetensors raises a ValueError of its own for one at the first operation of a tensor.
        wraps: whether the failure may reach the caller inside a RuntimeError that quotes it (torch's
            `load_state_dict` wraps any exception of a copy so).
    """

    model: Callable[[], CCMForCausalLM]
    caches: Callable[[CCMForCausalLM], Caches]
    call: Callable[[CCMForCausalLM, Caches], Any]
    foreign: Callable[[], int] = lambda: 0
    wraps: bool = False


def _ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows))


@functools.cache
def _compressed(update: str, batch_size: int = 2) -> CompressedMemoryCache:
    """A memory of `batch_size` users, one of them with a padded context."""
    model = tiny_ccm("llama", update=update)
    cache = model.new_cache(batch_size)
    contexts = [[5, 6, 7], [8, 9, 0], [3, 4, 5]][:batch_size]
    masks = [[1, 1, 1], [1, 1, 0], [1, 1, 1]][:batch_size]
    model.compress(cache, torch.tensor(contexts), attention_mask=torch.tensor(masks))
    return cache


@functools.cache
def _with_turn(update: str, batch_size: int = 2) -> CompressedMemoryCache:
    """`_compressed` with a generated turn not yet folded."""
    cache = _compressed(update, batch_size).copy()
    prompts = torch.tensor([[20, 21], [22, 23], [24, 25]][:batch_size])
    tiny_ccm("llama", update=update).generate(prompts, past_key_values=cache, max_new_tokens=3, do_sample=False)
    return cache


SMALL_STREAM = StreamingConfig(window_tokens=10, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)


@functools.cache
def _full_stream() -> CompressedMemoryCache:
    """A stream whose window is one token short of full: the next tokens make it compress its oldest chunk."""
    model = tiny_ccm("llama")
    cache = model.new_cache(2, streaming=SMALL_STREAM)
    with torch.no_grad():
        model(input_ids=torch.tensor([list(range(10, 21))] * 2), past_key_values=cache)
    return cache


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.seen.append(value.tolist())

    def end(self) -> None:
        self.seen.append([])


def _generate(**kwargs: Any) -> Callable[[CCMForCausalLM, Caches], Any]:
    def call(model: CCMForCausalLM, caches: Caches) -> Any:
        batch = caches["user"].batch_size
        prompts = torch.tensor([[20, 21], [22, 23], [24, 25]][:batch])
        return model.generate(prompts, past_key_values=caches["user"], max_new_tokens=3, **kwargs)

    return call


def _streamed(model: CCMForCausalLM, caches: Caches) -> Any:
    streamer = _Collect()
    output = model.generate(_ids([20, 21]), past_key_values=caches["user"], max_new_tokens=3, streamer=streamer)
    return output, str(streamer.seen)


def _forward(labels: bool) -> Callable[[CCMForCausalLM, Caches], Any]:
    def call(model: CCMForCausalLM, caches: Caches) -> Any:
        ids = _ids([20, 21, 22], [23, 24, 25])
        with torch.no_grad():
            output = model(input_ids=ids, past_key_values=caches["user"], labels=ids if labels else None)
        return output.logits, output.loss

    return call


def _copies(cache: Callable[[], CompressedMemoryCache]) -> Callable[[CCMForCausalLM], Caches]:
    return lambda model: {"user": cache().copy()}


def _save(model: CCMForCausalLM, caches: Caches) -> bytes:
    path = os.path.join(caches["folder"], "user.safetensors")  # type: ignore[arg-type]
    caches["user"].save(path)
    with open(path, "rb") as file:
        return file.read()


def _saving(model: CCMForCausalLM) -> Caches:
    """A memory and a folder holding an earlier memory file where the call saves it: a failed save keeps that file."""
    folder = tempfile.mkdtemp()
    _compressed("concat", 3).save(os.path.join(folder, "user.safetensors"))
    return {"user": _compressed("concat").copy(), "folder": folder}  # type: ignore[dict-item]


@functools.cache
def _memory_file() -> str:
    path = os.path.join(tempfile.mkdtemp(), "user.safetensors")
    _compressed("merge").save(path)
    return path


@functools.cache
def _spec() -> CacheSpec:
    return tiny_ccm("llama", update="merge").cache_spec()


def _read_memory_file() -> list[torch.Tensor]:
    """What `CompressedMemoryCache.load` reads first: every tensor of `_memory_file()`."""
    with safe_open(_memory_file(), framework="pt") as file:
        return [file.get_tensor(key) for key in file.keys()]  # noqa: SIM118 (safe_open is no dict)


def _load(model: CCMForCausalLM, caches: Caches) -> tuple[Any, ...]:
    # Given the model's spec, which the call would otherwise compute first: reading the file is its first operations.
    loaded = CompressedMemoryCache.load(_memory_file(), _spec())
    return tuple(snapshot(loaded)["layers"][1].values())


@functools.cache
def _chat_model() -> tuple[CCMForCausalLM, PreTrainedTokenizerBase, ChatSession]:
    """A model with the embedded tokenizer's vocabulary, and a session one turn in."""
    tokenizer = load_tokenizer("default")
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_llama_for(tokenizer), CCMConfig(update="merge")))
    session = ChatSession(model, tokenizer, max_new_tokens=3)
    session.turn("Hi! I'm Maria.")
    return model, tokenizer, session


def _session(model: CCMForCausalLM) -> Caches:
    """A copy of `_chat_model()`'s session, its cache among the caches."""
    _, tokenizer, first = _chat_model()
    session = ChatSession(model, tokenizer, cache=first.cache.copy(), max_new_tokens=3)
    assert session.history_tokens == first.history_tokens  # the count travels with the memory
    return {"user": session.cache, "session": session}  # type: ignore[dict-item]


def _turn(model: CCMForCausalLM, caches: Caches) -> tuple[Any, ...]:
    session: ChatSession = caches["session"]  # type: ignore[assignment]
    report = session.turn("What is my name?")
    return report.reply, report.memory_slots, report.full_context_tokens, report.full_context_bytes


@functools.cache
def _adapter_folder() -> str:
    folder = tempfile.mkdtemp()
    randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge")), seed=5).save_pretrained(
        folder
    )
    return folder


@functools.cache
def _adapter_model() -> CCMForCausalLM:
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))


def _loading_adapter(model: CCMForCausalLM) -> Caches:
    """A memory made with the model's adapter (which a load must leave valid when it fails), the adapter back in."""
    initial = tiny_ccm("llama")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(initial.state_dict()[name])
    model.config = initial.config
    cache = model.new_cache()
    model.compress(cache, _ids([5, 6, 7]))
    return {"user": cache}


def _load_adapter(model: CCMForCausalLM, caches: Caches) -> tuple[Any, ...]:
    model.load_adapter(_adapter_folder())
    return model.config.update, model.comp_embeddings


SCENARIOS: dict[str, Scenario] = {
    "compress a context": Scenario(
        lambda: tiny_ccm("llama", update="merge"),
        _copies(lambda: _compressed("merge")),
        lambda model, caches: model.compress(
            caches["user"], _ids([11, 12], [13, 14]), attention_mask=_ids([1, 1], [0, 1])
        ),
    ),
    "fold a generated turn": Scenario(
        lambda: tiny_ccm("llama", update="concat"),
        _copies(lambda: _with_turn("concat")),
        lambda model, caches: model.compress(caches["user"]),
    ),
    "generate greedily": Scenario(
        lambda: tiny_ccm("llama", update="merge"), _copies(lambda: _compressed("merge")), _generate(do_sample=False)
    ),
    "generate with beams": Scenario(
        lambda: tiny_ccm("llama", update="concat"),
        _copies(lambda: _compressed("concat")),
        _generate(num_beams=2, do_sample=False),
    ),
    "generate several sequences": Scenario(
        lambda: tiny_ccm("llama", update="concat"),
        _copies(lambda: _compressed("concat")),
        _generate(num_return_sequences=2, do_sample=True),
    ),
    "generate with a streamer": Scenario(
        lambda: tiny_ccm("llama", update="concat"), _copies(lambda: _compressed("concat", 1)), _streamed
    ),
    "online forward": Scenario(
        lambda: tiny_ccm("llama", update="concat"), _copies(lambda: _with_turn("concat")), _forward(labels=False)
    ),
    "online forward with labels": Scenario(
        lambda: tiny_ccm("llama", update="merge"), _copies(lambda: _compressed("merge")), _forward(labels=True)
    ),
    "stream forward across a compression": Scenario(
        lambda: tiny_ccm("llama"), _copies(_full_stream), _forward(labels=False)
    ),
    "stream generate across a compression": Scenario(
        lambda: tiny_ccm("llama"), _copies(_full_stream), _generate(do_sample=False)
    ),
    "batch_select_indices": Scenario(
        lambda: tiny_ccm("llama", update="concat"),
        _copies(lambda: _with_turn("concat", 3)),
        lambda model, caches: caches["user"].batch_select_indices(torch.tensor([2, 0])),
    ),
    "batch_repeat_interleave": Scenario(
        lambda: tiny_ccm("llama"),
        _copies(_full_stream),
        lambda model, caches: caches["user"].batch_repeat_interleave(2),
    ),
    "reorder_cache": Scenario(
        lambda: tiny_ccm("llama", update="merge"),
        _copies(lambda: _compressed("merge", 3)),
        lambda model, caches: caches["user"].reorder_cache(torch.tensor([1, 1, 0])),
    ),
    "copy": Scenario(
        lambda: tiny_ccm("llama", update="concat"),
        _copies(lambda: _with_turn("concat")),
        lambda model, caches: tuple(snapshot(caches["user"].copy())["layers"][0].values()),
    ),
    "ChatSession.turn": Scenario(lambda: _chat_model()[0], _session, _turn),
    "load_adapter": Scenario(
        _adapter_model,
        _loading_adapter,
        _load_adapter,
        foreign=lambda: count_operations(lambda: read_adapter(Path(_adapter_folder()))),
        wraps=True,
    ),
    "save": Scenario(lambda: tiny_ccm("llama", update="concat"), _saving, _save),
    "load": Scenario(
        lambda: tiny_ccm("llama", update="merge"),
        lambda model: {},
        _load,
        foreign=lambda: count_operations(_read_memory_file),
    ),
}


def _frozen_result(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return tuple(_frozen_result(item) for item in value)
    return value


def _states(model: CCMForCausalLM, caches: Caches) -> dict[str, Any]:
    """Everything the call may change: each cache (which must be free) and the model."""
    return {
        "caches": {name: snapshot(cache) for name, cache in caches.items() if isinstance(cache, CompressedMemoryCache)},
        "model": model_snapshot(model),
    }


@functools.cache
def _reference(name: str) -> tuple[int, Any, dict[str, Any]]:
    """The number of tensor operations of scenario `name`'s call, its result and the states it leaves."""
    scenario = SCENARIOS[name]
    model = scenario.model()
    scenario.call(model, scenario.caches(model))  # builds what the call's helpers cache (files, specs)
    caches = scenario.caches(model)
    torch.manual_seed(0)
    operations = count_operations(lambda: scenario.call(model, caches))
    caches = scenario.caches(model)
    torch.manual_seed(0)
    result = _frozen_result(scenario.call(model, caches))
    return operations, result, _states(model, caches)


def check_failure_at(scenario: Scenario, reference: tuple[int, Any, dict[str, Any]], k: int, failure: str) -> None:
    """Fail the call at its `k`-th tensor operation with `failure` (a key of `FAILURES`): the failure reaches the
    caller as it was raised, every cache and the model are as before, and the call then gives the reference result."""
    _, result, after = reference
    model = scenario.model()
    caches = scenario.caches(model)
    before = _states(model, caches)
    torch.manual_seed(0)
    expected = FAILURES[failure]()
    with (
        pytest.raises((type(expected), RuntimeError) if scenario.wraps else type(expected)) as raised,
        FailAt(k, FAILURES[failure]),
    ):
        scenario.call(model, caches)
    wrapped = scenario.wraps and str(expected) in str(raised.value)
    assert type(raised.value) is type(expected) or wrapped, f"the failure reached the caller as {raised.value!r}"
    assert_same(_states(model, caches), before, f"after a failure at operation {k}")
    torch.manual_seed(0)
    assert_same(_frozen_result(scenario.call(model, caches)), result, "the result after the failure")
    assert_same(_states(model, caches), after, "the state after the call")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), failure=st.sampled_from(sorted(FAILURES)))
@example(where=1 - 1e-9, failure="interrupt")  # the last operation: after it, what changed must stay changed
def test_a_failure_at_any_operation_changes_nothing(name, where, failure):
    reference, skipped = _reference(name), SCENARIOS[name].foreign()
    check_failure_at(SCENARIOS[name], reference, skipped + 1 + int(where * (reference[0] - skipped)), failure)


@pytest.mark.parametrize("failure", ["out of memory", "injected"])
def test_a_failure_while_reading_a_memory_file_is_no_bad_file(failure):
    """An out-of-memory error (any RuntimeError) while the file's tensors were read was reported as a ValueError, "not a
    readable safetensors memory file": the user was told to throw a good memory away. Only the operations where
    safetensors itself passes the failure on count: at a tensor's first it raises a ValueError of its own."""
    spec = _spec()
    passed_on = 0
    for k in range(1, count_operations(_read_memory_file) + 1):
        try:
            with FailAt(k, FAILURES[failure]):
                _read_memory_file()
        except ValueError:
            continue
        except RuntimeError:
            passed_on += 1
        with pytest.raises(RuntimeError) as raised, FailAt(k, FAILURES[failure]):
            CompressedMemoryCache.load(_memory_file(), spec)
        assert type(raised.value) is type(FAILURES[failure]()), f"operation {k} failed the load with {raised.value!r}"
    assert passed_on


TRAINING = TrainingRecipe(steps=2, batch_size=2, save_every=2, learning_rate=1e-2)


def _training_samples() -> list[OnlineSample]:
    rows = [([[5, 60]], 70), ([[7, 61], [8, 62]], 62), ([[9, 63]], 63), ([[10, 64], [11, 65], [12, 66]], 66)]
    return [OnlineSample(contexts, [91], [answer]) for contexts, answer in rows]


def _untrained() -> CCMForCausalLM:
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))


def _train(model: CCMForCausalLM) -> None:
    """A run of `TRAINING`, into a folder of its own that is removed afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        train(model, None, _training_samples(), None, folder, TRAINING)


@functools.cache
def _trained() -> tuple[int, dict[str, torch.Tensor]]:
    """The tensor operations of a run of `TRAINING` on `_untrained()`, and the weights it trains."""
    _train(_untrained())  # what the Trainer sets up once in a process
    model = _untrained()
    operations = count_operations(lambda: _train(model))
    return operations, model_snapshot(model)["weights"]


@settings(max_examples=1, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), failure=st.sampled_from(sorted(FAILURES)))
@example(where=1 - 1e-9, failure="out of memory")  # after the second step: its weights were kept
def test_a_failed_training_run_gives_the_adapter_back(where, failure):
    """A run that failed (an out-of-memory error, an interrupt) left the model with the gradients of a backward cut
    short, or with the weights of the steps it made (none of which was the model given, or on disk as the result); it
    gives the adapter back as it came, and a run then trains what it trains on a fresh model."""
    operations, trained = _trained()
    model = _untrained()
    before = model_snapshot(model)
    with pytest.raises(type(FAILURES[failure]())), FailAt(1 + int(where * operations), FAILURES[failure]):
        _train(model)
    assert_same(model_snapshot(model), before, "the model after a failed run")
    _train(model)
    assert_same(model_snapshot(model)["weights"], trained, "the weights trained after a failed run")


def _base_state(model: PreTrainedModel) -> dict[str, Any]:
    """What `from_base` changes on the model it wraps: modules, parameters and their flags, hooks, attention."""
    return {
        "modules": [(name, type(module).__name__) for name, module in model.named_modules()],
        "weights": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "requires_grad": {name: parameter.requires_grad for name, parameter in model.named_parameters()},
        "hooks": [len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules()],
        "attention": model.config._attn_implementation,
        "peft": hasattr(model, "peft_config"),
    }


@functools.cache
def _wrapping_operations() -> int:
    base = tiny_base("llama")
    return count_operations(lambda: CCMForCausalLM.from_base(base, CCMConfig()))


@settings(max_examples=4, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), failure=st.sampled_from(sorted(FAILURES)))
@example(where=0.5, failure="out of memory")  # while the LoRA goes in
def test_a_failure_while_wrapping_a_model_gives_it_back_as_it_was(where, failure):
    """A failure inside from_base (while PEFT injected the LoRA, or the <COMP> embeddings were drawn) left the caller's
    model with some LoRA layers and its parameters frozen, and every later from_base() of it refused it as a model that
    already holds LoRA layers."""
    base = tiny_base("llama")
    before = _base_state(base)
    with pytest.raises(type(FAILURES[failure]())), FailAt(1 + int(where * _wrapping_operations()), FAILURES[failure]):
        CCMForCausalLM.from_base(base, CCMConfig())
    assert_same(_base_state(base), before, "the base model after a failed from_base")
    untouched = tiny_base("llama")
    torch.manual_seed(0)
    model = CCMForCausalLM.from_base(base, CCMConfig())
    torch.manual_seed(0)
    fresh = CCMForCausalLM.from_base(untouched, CCMConfig())
    assert_same(model_snapshot(model)["weights"], model_snapshot(fresh)["weights"], "the model wrapped after a failure")
