"""Many users served from several threads (and asyncio tasks) by one model: each thread's results equal the same
operations run alone, one after another, bit for bit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import io
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from tiny_models import (
    InjectedFailure,
    SeededSampling,
    randomize_adapter,
    tiny_base,
    tiny_ccm,
    tiny_full_context_baseline,
    tiny_llama_for,
    tiny_longrope_base,
)
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache
from transformers_ccm.chat import ChatSession
from transformers_ccm.streaming import StreamingConfig
from transformers_ccm.wrapping import frequency_setting_rotaries, one_at_a_time

Result = list[object]


def tiny_llama_model(tokenizer, update: str = "merge") -> CCMForCausalLM:
    """A tiny CCM Llama with a random adapter and `tokenizer`'s vocabulary."""
    config = CCMConfig(update=update, max_memory_tokens=6 if update == "concat" else None)
    return randomize_adapter(CCMForCausalLM.from_base(tiny_llama_for(tokenizer), config))


@pytest.fixture(scope="module", params=["concat", "merge"])
def model(request, tokenizer) -> CCMForCausalLM:
    return tiny_llama_model(tokenizer, request.param)


def _interrupt(*_: object, **__: object) -> torch.Tensor:
    raise KeyboardInterrupt


@dataclass
class _User:
    """One thread's users: a cache of `rows` rows, and the tokens its operations draw from `seed`."""

    model: CCMForCausalLM
    tokenizer: object
    folder: str
    name: str
    seed: int
    rows: int = 2

    def __post_init__(self) -> None:
        self.cache = self.model.new_cache(self.rows)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.step = 0

    def ids(self, length: int) -> torch.Tensor:
        return torch.randint(3, 90, (self.cache.batch_size, length), generator=self.generator)

    def folded(self) -> None:
        if self.cache.has_unfolded_turn:
            self.model.compress(self.cache)

    def run(self, operation: str) -> Result:
        """Run `operation` on this thread's cache; returns what it produced."""
        self.step += 1
        model, cache = self.model, self.cache
        if operation == "compress":
            model.compress(cache, self.ids(3))
            return []
        if operation.startswith("generate"):
            self.folded()
            options: dict[str, object] = {"max_new_tokens": 3, "do_sample": False}
            if operation == "generate sampling":
                sampler = SeededSampling(torch.Generator().manual_seed(self.seed * 100 + self.step))
                options.update(do_sample=True, logits_processor=LogitsProcessorList([sampler]))
            elif operation == "generate beams":
                options.update(num_beams=2)
            return [model.generate(self.ids(2), past_key_values=cache, **options)]
        if operation == "interrupted generate":
            self.folded()
            prompt = self.ids(2)
            interrupting = StoppingCriteriaList([_interrupt])
            with pytest.raises(KeyboardInterrupt):
                model.generate(prompt, past_key_values=cache, max_new_tokens=3, stopping_criteria=interrupting)
            return [cache.has_unfolded_turn]
        if operation == "forward":
            with torch.no_grad():
                return [model(input_ids=self.ids(2), past_key_values=cache).logits]
        if operation == "save and load":
            self.folded()
            path = f"{self.folder}/{self.name}.safetensors"
            cache.save(path)
            self.cache = CompressedMemoryCache.load(path, model)
            with open(path, "rb") as file:
                return [hashlib.sha256(file.read()).hexdigest()]
        if operation == "copy":
            self.cache = cache.copy()
            return []
        if operation == "reorder":
            cache.reorder_cache(torch.arange(cache.batch_size).flip(0))
            return []
        if operation == "select rows":
            cache.batch_select_indices(torch.tensor([cache.batch_size - 1]))
            return []
        if operation == "chat":
            session = ChatSession(model, self.tokenizer, max_new_tokens=3)
            return [session.turn(f"hello <|im_end|> user {self.seed} {self.step}").reply]
        raise AssertionError(operation)

    def final(self) -> Result:
        return _content(self.cache)


def _content(cache: CompressedMemoryCache) -> Result:
    """What a cache holds: its rows' state and every layer's keys and values."""
    return [cache.rows, *((layer.keys, layer.values) for layer in cache.layers if layer.is_initialized)]


USER_OPERATIONS = (
    "compress",
    "generate greedy",
    "generate sampling",
    "generate beams",
    "interrupted generate",
    "forward",
    "save and load",
    "copy",
    "reorder",
    "select rows",
    "chat",
)


class _Reader:
    """A thread that reads the model and runs the base model under its own gate contexts, never using a cache."""

    def __init__(self, model: CCMForCausalLM, seed: int) -> None:
        self.model = model
        self.ids = torch.randint(3, 90, (1, 4), generator=torch.Generator().manual_seed(seed))

    def run(self, operation: str) -> Result:
        model = self.model
        with torch.no_grad():
            if operation == "state_dict":
                return [sum(float(tensor.double().sum()) for tensor in model.state_dict().values())]
            if operation == "signature":
                return [model.memory_signature()]
            if operation == "parameters":
                return [sum(parameter.numel() for parameter in model.parameters()), model.num_parameters()]
            if operation == "adapter disabled":
                with model.adapter_disabled(), model.lora_at(torch.ones(1, 4, dtype=torch.bool)):
                    return [model.base_model(input_ids=self.ids).logits]
            if operation == "lora at":
                with model.lora_at(torch.tensor([[False, True, True, False]])):
                    return [model.base_model(input_ids=self.ids).logits]
        raise AssertionError(operation)

    def final(self) -> Result:
        return []


READER_OPERATIONS = ("state_dict", "signature", "parameters", "adapter disabled", "lora at")


@contextlib.contextmanager
def _frequent_thread_switches() -> Iterator[None]:
    """Switch threads every microsecond (instead of every 5 ms), so that the threads' calls interleave finely."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _run_interleaved(target: Callable[[int], None], count: int) -> None:
    """Run `target(0)` .. `target(count - 1)` in threads of their own at once, switching between them often."""
    threads = [threading.Thread(target=target, args=(index,)) for index in range(count)]
    with _frequent_thread_switches():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _run_alone(worker: _User | _Reader, program: list[str]) -> list[Result]:
    return [worker.run(operation) for operation in program] + [worker.final()]


def _run_together(workers: list[_User | _Reader], programs: list[list[str]]) -> list[list[Result]]:
    """Run each worker's program in a thread of its own; every step starts in every thread at once."""
    steps = max(len(program) for program in programs)
    barrier = threading.Barrier(len(workers))
    results: list[list[Result]] = [[] for _ in workers]
    failures: list[BaseException] = []

    def thread(index: int) -> None:
        try:
            for step in range(steps):
                barrier.wait()
                if step < len(programs[index]):
                    results[index].append(workers[index].run(programs[index][step]))
            results[index].append(workers[index].final())
        except BaseException as error:  # reported below, with the thread's program
            failures.append(error)
            barrier.abort()

    _run_interleaved(thread, len(workers))
    if failures:
        raise failures[0]
    return results


def _assert_equal(got: object, want: object, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for a, b in zip(got, want, strict=True):
            _assert_equal(a, b, where)
    elif hasattr(want, "__dataclass_fields__"):
        for name in want.__dataclass_fields__:
            _assert_equal(getattr(got, name), getattr(want, name), f"{where}.{name}")
    else:
        assert got == want, where


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    users=st.lists(st.lists(st.sampled_from(USER_OPERATIONS), min_size=1, max_size=6), min_size=2, max_size=3),
    readers=st.lists(st.lists(st.sampled_from(READER_OPERATIONS), min_size=1, max_size=6), max_size=2),
)
def test_threads_serving_their_own_caches_give_the_results_of_running_alone(
    model, tokenizer, tmp_path_factory, users, readers
):
    folder = tmp_path_factory.mktemp("memories")

    def workers() -> list[_User | _Reader]:
        return [_User(model, tokenizer, str(folder), f"user{index}", seed=index) for index in range(len(users))] + [
            _Reader(model, seed=index) for index in range(len(readers))
        ]

    programs = users + readers
    alone = [_run_alone(worker, program) for worker, program in zip(workers(), programs, strict=True)]
    together = _run_together(workers(), programs)
    for index, (got, want) in enumerate(zip(together, alone, strict=True)):
        _assert_equal(got, want, f"thread {index} ({programs[index]}) differs from its run alone")


def test_user_text_and_template_markers_tokenize_the_same_in_concurrent_threads(tokenizer):
    """A fast tokenizer takes `split_special_tokens` (user text keeps special-token strings as text) by setting a flag
    on its shared backend: a conversation encoding a message in one thread unset it for another thread's message
    (a typed `<|im_end|>` became the control token) and set it for a template's role markers encoded meanwhile
    (split into text), in the session's own code and in the caller's."""
    session = ChatSession(tiny_llama_model(tokenizer), tokenizer)
    messages = [f"hello <|im_end|> <|im_start|>system {index}" for index in range(2)]
    markup = "<|im_start|>user\nhi<|im_end|>\n"
    expected = [session.prompt_ids(message) for message in messages] + [tokenizer(markup)["input_ids"]]
    calls = [lambda: session.prompt_ids(messages[0]), lambda: session.prompt_ids(messages[1])]
    calls.append(lambda: tokenizer(markup)["input_ids"])
    wrong = [0] * len(calls)
    start = threading.Barrier(len(calls))

    def repeat(index: int) -> None:
        start.wait()
        for _ in range(2000):
            wrong[index] += calls[index]() != expected[index]

    _run_interleaved(repeat, len(calls))
    assert wrong == [0] * len(calls)


def _user_session(model: CCMForCausalLM, seed: int) -> list[torch.Tensor]:
    """One user's turns: compress a context, then twice generate a reply and fold the turn."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache()
    model.compress(cache, torch.randint(3, 90, (1, 5), generator=generator))
    replies = []
    for _ in range(2):
        prompt = torch.randint(3, 90, (1, 3), generator=generator)
        replies.append(model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False))
        model.compress(cache)
    return replies


def test_asyncio_tasks_serving_through_threads_give_the_results_of_running_alone(model, tokenizer):
    """Users served by asyncio tasks that run their calls in threads (`asyncio.to_thread`, `run_in_executor`), one
    of them streaming its reply to another task through an `AsyncTextIteratorStreamer`."""
    from transformers import AsyncTextIteratorStreamer

    prompt = torch.tensor([[20, 21, 22]])
    alone = [_user_session(model, seed) for seed in range(4)]
    options = {"max_new_tokens": 4, "do_sample": False}
    streamed_alone = model.generate(prompt, past_key_values=model.new_cache(), **options)

    async def serve() -> tuple[list[list[torch.Tensor]], torch.Tensor, str]:
        loop = asyncio.get_running_loop()
        sessions = [
            asyncio.to_thread(_user_session, model, seed)
            if seed % 2
            else loop.run_in_executor(None, _user_session, model, seed)
            for seed in range(4)
        ]
        streamer = AsyncTextIteratorStreamer(tokenizer, skip_prompt=True)

        async def read() -> str:
            return "".join([text async for text in streamer])

        reader = asyncio.create_task(read())
        streaming = asyncio.to_thread(
            model.generate, prompt, past_key_values=model.new_cache(), streamer=streamer, **options
        )
        *replies, streamed = await asyncio.gather(*sessions, streaming)
        return replies, streamed, await reader

    with _frequent_thread_switches():
        replies, streamed, text = asyncio.run(serve())
    _assert_equal(replies, alone, "a user served by a task differs from its run alone")
    assert torch.equal(streamed, streamed_alone)
    assert text == tokenizer.decode(streamed[0, prompt.shape[1] :], skip_special_tokens=True)


GATE_CONTEXTS = {
    "adapter disabled": lambda model: model.adapter_disabled(),
    "lora at one token": lambda model: model.lora_at(torch.ones(1, 1, dtype=torch.bool)),
    "lora at two tokens": lambda model: model.lora_at(torch.tensor([[True, False]])),
}
CACHE_CALLS = {
    "compress": lambda model, cache: model.compress(cache, torch.tensor([[30, 31, 32]])),
    "generate": lambda model, cache: model.generate(
        torch.tensor([[40, 41]]), past_key_values=cache, max_new_tokens=3, do_sample=False
    ),
    "forward": lambda model, cache: model(input_ids=torch.tensor([[40, 41]]), past_key_values=cache).logits,
}


@functools.cache
def _gate_model(conditional: bool) -> CCMForCausalLM:
    return tiny_ccm("llama") if conditional else tiny_full_context_baseline(seed=1)


@settings(max_examples=30, deadline=None)
@given(
    context=st.sampled_from(sorted(GATE_CONTEXTS)),
    call=st.sampled_from(sorted(CACHE_CALLS)),
    entered_in=st.sampled_from(["this thread", "the task that created the calling task"]),
    conditional=st.booleans(),
)
def test_a_call_does_not_take_the_gate_context_of_its_caller(context, call, entered_in, conditional):
    """A call on a cache ran under the caller's gate contexts: inside `lora_at(mask)` generate() and model(...) put the
    LoRA on their ordinary tokens (wherever the caller's mask broadcast, else failing on its shape), and inside
    `adapter_disabled()` compress() made a memory of the base model under the adapter's signature; asyncio copies the
    contexts into the tasks created inside them. A call now acts as outside them, or is refused where the adapter
    would not act (the cache left as it was)."""
    model = _gate_model(conditional)

    def prepared() -> CompressedMemoryCache:
        cache = model.new_cache()
        model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
        return cache

    alone = prepared()
    expected = CACHE_CALLS[call](model, alone)
    cache = prepared()
    before = _content(cache)

    async def caller() -> object:
        async def call_in_task() -> object:
            return CACHE_CALLS[call](model, cache)

        with GATE_CONTEXTS[context](model):
            task = asyncio.create_task(call_in_task())
        return await task

    refused = context == "adapter disabled" and (call == "compress" or not conditional)
    refusal = pytest.raises(ValueError, match=r"inside model.adapter_disabled\(\).*outside")
    with refusal if refused else contextlib.nullcontext():
        if entered_in == "this thread":
            with GATE_CONTEXTS[context](model):
                got = CACHE_CALLS[call](model, cache)
        else:
            got = asyncio.run(caller())
    if refused:
        _assert_equal(_content(cache), before, "the refused call changed the cache")
        return
    _assert_equal(got, expected, f"{call} inside {context} differs")
    _assert_equal(_content(cache), _content(alone), "cache")


def test_a_model_is_wrapped_while_another_thread_runs_it():
    """Wrapping runs the model on a few tokens and notes which attention layers received its keyword argument: a
    forward of the same model in another thread meanwhile was noted too, without it, and the wrap was refused as if
    the model's layers dropped keyword arguments."""
    base, tokens = tiny_base("llama"), torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = base(tokens).logits
    logits, started = [], threading.Event()

    def run_alone() -> None:
        with torch.no_grad():
            logits.append(base(tokens).logits)

    def beside_the_wrap(*_: object) -> None:  # the other thread's whole forward, inside the wrap's first one
        if not started.is_set():
            started.set()
            other = threading.Thread(target=run_alone)
            other.start()
            other.join()

    handle = base.model.layers[0].register_forward_pre_hook(beside_the_wrap)
    try:
        CCMForCausalLM.from_base(base, CCMConfig())
    finally:
        handle.remove()
    assert len(logits) == 1 and torch.equal(logits[0], expected)


def test_a_stream_moves_its_keys_alike_whatever_other_users_ran_between_its_calls():
    """LongRoPE sets the rotary frequencies in place at each forward, by its last position; a cache's rotation read
    them there, so a stream moved its keys by the frequencies of the last forward of any user: another user's history
    past the original context changed the stream's logits."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig()))
    streaming = StreamingConfig(window_tokens=12, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)

    def stream(beside_long_history: bool) -> list[torch.Tensor]:
        cache, other = model.new_cache(streaming=streaming), model.new_cache()
        model.compress(other, torch.randint(3, 90, (1, 70)))
        generator = torch.Generator().manual_seed(0)
        logits = []
        with torch.no_grad():
            for _ in range(6):
                if beside_long_history:
                    model(input_ids=torch.tensor([[5, 6]]), past_key_values=other)
                logits.append(model(input_ids=torch.randint(3, 90, (1, 5), generator=generator), past_key_values=cache))
        return [output.logits for output in logits]

    _assert_equal(stream(beside_long_history=True), stream(beside_long_history=False), "the stream's logits")


def test_a_short_history_rotates_alike_beside_a_thread_serving_one_past_the_original_context():
    """LongRoPE sets the rotary frequencies shared by every call of the model at each forward, then computes with them:
    a thread serving a history past the original context set its long factors between another thread's setting and
    use of the short ones, and that user's logits changed."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig()))

    def short_history() -> list[torch.Tensor]:
        cache, generator = model.new_cache(), torch.Generator().manual_seed(1)
        logits = []
        with torch.no_grad():
            for _ in range(8):  # 8 x 7 tokens: within the original 64 positions
                model.compress(cache, torch.randint(3, 90, (1, 4), generator=generator))
                logits.append(model(input_ids=torch.randint(3, 90, (1, 3), generator=generator), past_key_values=cache))
        return [output.logits for output in logits]

    alone = short_history()
    done = threading.Event()

    def long_history() -> None:
        cache = model.new_cache()
        model.compress(cache, torch.randint(3, 90, (1, 70)))
        while not done.is_set():
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6]]), past_key_values=cache)
            model.compress(cache)

    with _frequent_thread_switches():
        for _ in range(40):
            done.clear()
            beside = threading.Thread(target=long_history)
            beside.start()
            try:
                _assert_equal(short_history(), alone, "the short history's logits")
            finally:
                done.set()
                beside.join()


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_task_using_the_cache_inside_another_tasks_transaction_is_refused(first_fails):
    """A cache was held by a thread, and asyncio tasks share one: a task's calls on a cache while another task was
    suspended inside its `transaction` passed as nested in it. A failure of the first task then restored the cache
    over the second's calls, which had returned without an error, and left the cache claimed for ever (every other
    thread refused). The second task is now refused, and the cache is free once the first ends."""
    model = tiny_ccm("llama")
    cache, alone = model.new_cache(), model.new_cache()
    if not first_fails:
        model.compress(alone, torch.tensor([[5, 6, 7]]))
    inside = asyncio.Event()

    async def first() -> None:
        with cache.transaction():
            model.compress(cache, torch.tensor([[5, 6, 7]]))
            inside.set()
            await asyncio.sleep(0)  # the second task runs while this one is inside its transaction
            if first_fails:
                raise InjectedFailure("the first task failed")

    async def second() -> None:
        await inside.wait()
        model.compress(cache, torch.tensor([[8, 9]]))

    async def both() -> list[object]:
        return await asyncio.gather(first(), second(), return_exceptions=True)

    failed, refused = asyncio.run(both())
    assert isinstance(failed, InjectedFailure) if first_fails else failed is None
    assert isinstance(refused, ValueError) and "in use by a call in another thread (or asyncio task)" in str(refused)
    _assert_equal(_content(cache), _content(alone), "the cache after both tasks")
    beside = threading.Thread(target=model.compress, args=(cache, torch.tensor([[8, 9]])))
    beside.start()
    beside.join()
    assert int(cache.steps[0]) == (1 if first_fails else 2)  # the other thread's call ran


@settings(max_examples=12, deadline=None)
@given(
    starts_inside=st.booleans(),
    spawn=st.sampled_from(["create_task", "gather"]),
    parent_ends=st.sampled_from(["returns", "fails", "is cancelled"]),
)
def test_a_task_created_inside_a_transaction_takes_the_cache_only_once_the_transaction_ended(
    starts_inside, spawn, parent_ends
):
    """A task created inside a `transaction` copies its context, and its claims passed as nested in that transaction:
    the transaction ending first left the cache claimed for ever (every later call refused as busy), and one that
    failed restored the cache under the task's calls, which had returned without an error. A task that uses the
    cache while the transaction holds it is now refused; once the transaction has ended, it takes the cache."""
    model = tiny_ccm("llama")
    cache, expected = model.new_cache(), model.new_cache()
    mine, its = torch.tensor([[5, 6, 7]]), [torch.tensor([[8, 9]]), torch.tensor([[10]])]
    ended = asyncio.Event()

    async def child() -> None:
        if not starts_inside:
            await ended.wait()
        with cache.transaction():
            model.compress(cache, its[0])
            await asyncio.sleep(0)  # the parent's transaction ends meanwhile, if it has not yet
            model.compress(cache, its[1])

    spawned: list[asyncio.Future[object]] = []

    async def parent() -> None:
        try:
            with cache.transaction():
                model.compress(cache, mine)
                spawned.append(asyncio.create_task(child()) if spawn == "create_task" else asyncio.gather(child()))
                await asyncio.sleep(0)  # the child runs while the transaction holds the cache
                if parent_ends == "fails":
                    raise InjectedFailure("the parent task failed")
                if parent_ends == "is cancelled":
                    asyncio.current_task().cancel()
                    await asyncio.sleep(0)
        finally:
            ended.set()

    async def serve() -> tuple[object, object]:
        parent_result = (await asyncio.gather(parent(), return_exceptions=True))[0]
        child_result = (await asyncio.gather(spawned[0], return_exceptions=True))[0]
        return parent_result, child_result[0] if isinstance(child_result, list) else child_result

    parent_result, child_result = asyncio.run(serve())
    if parent_ends == "returns":
        model.compress(expected, mine)
    else:
        want = InjectedFailure if parent_ends == "fails" else asyncio.CancelledError
        assert isinstance(parent_result, want), parent_result
    if starts_inside:
        assert isinstance(child_result, ValueError) and "created inside the other's" in str(child_result)
    else:
        assert child_result is None, child_result
        for context in its:
            model.compress(expected, context)
    _assert_equal(_content(cache), _content(expected), "the cache after both tasks")
    beside = threading.Thread(target=model.compress, args=(cache, torch.tensor([[3, 4]])))
    beside.start()
    beside.join()
    model.compress(expected, torch.tensor([[3, 4]]))
    _assert_equal(_content(cache), _content(expected), "the cache after another thread's call")


def test_a_call_sent_to_a_thread_from_inside_a_transaction_is_refused_with_the_way_to_run_it():
    """`asyncio.to_thread` copies the task's context, and so the claim of a task's `transaction()`, into the thread: a
    call sent there from inside the transaction was refused as "in use by another thread", with the advice to give
    each thread its own cache. It is refused (the transaction could restore the cache under it, were the task
    cancelled) with the way to run the transaction; run so, it gives what it gives alone."""
    model = tiny_ccm("llama")
    context, alone = torch.tensor([[5, 6, 7]]), model.new_cache()
    model.compress(alone, context)
    cache = model.new_cache()

    async def sent_from_transaction() -> None:
        with cache.transaction():
            await asyncio.to_thread(model.compress, cache, context)

    def turn() -> None:
        with cache.transaction():
            model.compress(cache, context)

    with pytest.raises(ValueError, match=r"asyncio.to_thread\(turn\), with the `with cache.transaction\(\):`"):
        asyncio.run(sent_from_transaction())
    _assert_equal(_content(cache), _content(model.new_cache()), "the cache after the refused call")
    asyncio.run(asyncio.to_thread(turn))
    _assert_equal(_content(cache), _content(alone), "the cache after the turn run in one thread")


class _LockstepStreamer(BaseStreamer):
    """Waits at `barrier` at every token: each thread's generate() goes on only when the other's reached its token."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def put(self, value: torch.Tensor) -> None:
        self.barrier.wait(timeout=120)  # a deadlock fails the test instead of hanging it

    def end(self) -> None:
        self.barrier.wait(timeout=120)


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_streamers_of_two_threads_waiting_for_each_other_do_not_deadlock(rope):
    """No lock is held while generate() calls a streamer (nor a rotary module's, which LongRoPE models take at each
    forward): two threads whose streamers wait for each other's tokens both finish, with the replies they give alone."""
    model = tiny_ccm("llama") if rope == "default" else CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig())
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9, 10]])]
    options = {"max_new_tokens": 4, "do_sample": False, "min_new_tokens": 4}
    alone = [model.generate(prompt, past_key_values=model.new_cache(), **options) for prompt in prompts]
    barrier = threading.Barrier(2)
    with ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(
                lambda prompt: model.generate(
                    prompt, past_key_values=model.new_cache(), streamer=_LockstepStreamer(barrier), **options
                ),
                prompts,
            )
        )
    _assert_equal(replies, alone, "the replies")


def test_a_longrope_model_pickles_and_loads_back_with_its_rotary_still_run_one_at_a_time():
    """The rotary module of a LongRoPE model runs as a class made at wrapping time, which pickle (torch.save of the
    model) looked up by the name of the class it replaced and refused as 'not the same object'."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig()))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    rotaries = [type(module) for module in frequency_setting_rotaries(loaded.base_model)]
    assert rotaries and all(rotary is one_at_a_time(rotary.__mro__[1]) for rotary in rotaries)
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(0))
    logits = []
    for each in (model, loaded):
        cache = each.new_cache()
        each.compress(cache, ids)
        with torch.no_grad():
            logits.append(each(input_ids=torch.tensor([[5, 6]]), past_key_values=cache).logits)
    _assert_equal(logits[0], logits[1], "the loaded model's logits")
