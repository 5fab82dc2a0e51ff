"""One model serving many users from threads while some of their calls fail: every other user gets the results of a
run alone, the failed user's cache is as before the failed call, and nothing is left claimed or held."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

from fault_injection import (
    FAILURES,
    JOIN_TIMEOUT,
    FailAt,
    assert_same,
    join,
    model_snapshot,
    outcome,
    paused_at,
    snapshot,
)
from tiny_models import InjectedFailure, SeededSampling, randomize_adapter, tiny_ccm, tiny_longrope_base
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, StreamingConfig
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.lora import _GATE, _GateState


def _paused_when_claiming(call: Callable[[], Any]) -> AbstractContextManager[dict[str, Any]]:
    """`paused_at` where `call()` first claims a cache (`CompressedMemoryCache._claimed`)."""
    return paused_at(CompressedMemoryCache._claimed.__wrapped__.__code__, call)


def _with_turn(model: CCMForCausalLM) -> CompressedMemoryCache:
    """Two users' memories, each with a generated turn not yet folded."""
    cache = model.new_cache(2)
    model.compress(cache, torch.tensor([[5, 6, 7], [8, 9, 10]]))
    model.generate(torch.tensor([[20, 21], [22, 23]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    return cache


CALLS: dict[str, Callable[[CCMForCausalLM, CompressedMemoryCache], Any]] = {
    # Row 0 gives only padding: it folds its turn if it has one, else keeps its memory.
    "compress": lambda model, cache: model.compress(
        cache, torch.tensor([[0], [11]]), attention_mask=torch.tensor([[0], [1]])
    ),
    "generate": lambda model, cache: model.generate(
        torch.tensor([[30, 31], [32, 33]]), past_key_values=cache, max_new_tokens=2, do_sample=False
    ),
    "forward": lambda model, cache: model(input_ids=torch.tensor([[30, 31], [32, 33]]), past_key_values=cache).logits,
}
MEANWHILE: dict[str, Callable[[CCMForCausalLM, CompressedMemoryCache], Any]] = {
    "fold the turn": lambda model, cache: model.compress(cache),
    "keep one row": lambda model, cache: cache.batch_select_indices(torch.tensor([0])),
    "reset": lambda model, cache: cache.reset(),
}


@settings(max_examples=12, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), meanwhile=st.sampled_from(sorted(MEANWHILE)))
def test_a_call_checks_the_cache_as_it_runs_on_it(call, meanwhile):
    """A call checked its inputs against the cache before claiming it, so another thread's call that changed the cache
    in between (and returned) left it running on what it had not checked: a compress folded an empty context into the
    memory of a row whose turn the other call had just folded (a memory no order of the two calls gives), and inputs
    of another batch size failed inside torch. A call now claims the cache before it checks it: it gives what it gives
    after the other call, one after the other."""
    model = tiny_ccm("llama", update="concat")
    serial = _with_turn(model)
    MEANWHILE[meanwhile](model, serial)
    expected = outcome(lambda: CALLS[call](model, serial))
    cache = _with_turn(model)
    with _paused_when_claiming(lambda: CALLS[call](model, cache)) as got:
        MEANWHILE[meanwhile](model, cache)
    assert_same(got["outcome"], expected, f"{call} after {meanwhile}")
    assert_same(snapshot(cache), snapshot(serial))


# ----- users served from threads while one user's call fails ----------------------------------------------------


@functools.cache
def _serving_model(architecture: str) -> CCMForCausalLM:
    """Llama; Gemma 3, whose layers alternate sliding-window and full attention; a Phi-3 with LongRoPE, whose rotary
    module sets the frequencies every call shares at each forward."""
    if architecture == "longrope":
        return randomize_adapter(CCMForCausalLM.from_base(tiny_longrope_base(), CCMConfig(update="merge")))
    return tiny_ccm(architecture, update="concat", max_memory_tokens=6)


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer("default")


STREAM = StreamingConfig(window_tokens=10, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)


class _FailingStopping(StoppingCriteria):
    """Interrupts generation at its second token."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **_: Any) -> torch.BoolTensor:
        self.calls += 1
        if self.calls == 2:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class _FailingProcessor(LogitsProcessor):
    """Runs out of memory at the first token."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        raise FAILURES["out of memory"]()


class _FailingStreamer(BaseStreamer):
    """A streamer whose `put` fails at the generated token (the prompt is the first `put`)."""

    def __init__(self) -> None:
        self.calls = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            raise FAILURES["injected"]()

    def end(self) -> None:
        pass


# A failure that a generate() call is given, as the argument that raises it.
CALLBACK_FAILURES: dict[str, Callable[[], dict[str, Any]]] = {
    "stopping criterion": lambda: {"stopping_criteria": StoppingCriteriaList([_FailingStopping()])},
    "logits processor": lambda: {"logits_processor": LogitsProcessorList([_FailingProcessor()])},
    "streamer": lambda: {"streamer": _FailingStreamer()},
}
GENERATING = ("generate greedy", "generate sampling", "generate beams", "generate streamed", "stream generate")
OPERATIONS = (*GENERATING, "compress", "forward", "stream forward", "save and load")


def _read_one_then_stop(streamer: TextIteratorStreamer) -> None:
    """A client that reads one piece of the reply and goes away (or none, when the reply failed)."""
    next(iter(streamer), None)


@dataclass
class _Served:
    """One user's memory and stream on `model`, and the tokens its operations draw from `seed`."""

    model: CCMForCausalLM
    seed: int
    folder: str
    cache: CompressedMemoryCache = field(init=False)
    stream: CompressedMemoryCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache, self.stream = self.model.new_cache(), self.model.new_cache(streaming=STREAM)
        self.generator, self.step = torch.Generator().manual_seed(self.seed), 0

    def ids(self, length: int) -> torch.Tensor:
        return torch.randint(3, 90, (1, length), generator=self.generator)

    def prepare(self, operation: str) -> None:
        """Fold the last reply before an operation that needs the memory without one (not part of the operation)."""
        if operation in (*GENERATING[:-1], "save and load") and self.cache.has_unfolded_turn:
            self.model.compress(self.cache)

    def run(self, operation: str, failing: AbstractContextManager[Any] | None = None, **arguments: Any) -> Any:
        """Run `operation`, its library call inside `failing` (a `FailAt`) and given `arguments` (those of a callback
        failure, for generate()); returns what it gave."""
        self.step += 1
        model, cache, stream = self.model, self.cache, self.stream
        prompt = self.ids(3 if operation in ("compress", "stream generate", "stream forward") else 2)
        options: dict[str, Any] = {"max_new_tokens": 3, "do_sample": False, **arguments}
        if operation == "generate sampling":
            sampler = SeededSampling(torch.Generator().manual_seed(self.seed * 100 + self.step))
            processors = [sampler, *options.pop("logits_processor", [])]
            options.update(do_sample=True, logits_processor=LogitsProcessorList(processors))
        elif operation == "generate beams":
            options.update(num_beams=2)
        elif operation == "generate streamed":
            options.update(streamer=TextIteratorStreamer(_tokenizer(), timeout=JOIN_TIMEOUT))
            reader = threading.Thread(target=_read_one_then_stop, args=(options["streamer"],))
            reader.start()
        calls: dict[str, Callable[[], Any]] = {
            "compress": lambda: model.compress(cache, prompt),
            "forward": lambda: model(input_ids=prompt, past_key_values=cache).logits,
            "stream forward": lambda: model(input_ids=prompt, past_key_values=stream).logits,
            "stream generate": lambda: model.generate(prompt, past_key_values=stream, **options),
            **{name: lambda: model.generate(prompt, past_key_values=cache, **options) for name in GENERATING[:-1]},
        }
        if operation == "save and load":
            path = f"{self.folder}/user{self.seed}.safetensors"
            cache.save(path)
            self.cache = CompressedMemoryCache.load(path, model)
            with open(path, "rb") as file:
                return file.read()
        try:
            with failing or nullcontext(), torch.no_grad():
                return calls[operation]()
        finally:
            if operation == "generate streamed":
                join(reader)

    def held(self) -> Any:
        return snapshot(self.cache), snapshot(self.stream)


FAILABLE = tuple(operation for operation in OPERATIONS if operation != "save and load")  # safetensors rewraps failures
# The generate() calls a callback failure can be given to (transformers refuses a streamer beside beams; a streamed
# call has a streamer of its own).
CALLBACK_FAILABLE = {
    "stopping criterion": GENERATING,
    "logits processor": GENERATING,
    "streamer": ("generate greedy", "generate sampling", "stream generate"),
}


@dataclass(frozen=True)
class _Failure:
    """The call that fails: the `step`-th operation of user `user`, failing with `kind` (a key of `FAILURES`, at its
    operation drawn by `where`, or of `CALLBACK_FAILURES`)."""

    user: int
    step: int
    kind: str
    where: float

    def expected(self) -> type[BaseException]:
        if self.kind in FAILURES:
            return type(FAILURES[self.kind]())
        return {"stopping criterion": KeyboardInterrupt, "logits processor": RuntimeError, "streamer": InjectedFailure}[
            self.kind
        ]


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[list[list[str]], _Failure]:
    """Three users' programs, one of which has a call that fails."""
    programs = draw(st.lists(st.lists(st.sampled_from(OPERATIONS), max_size=2), min_size=3, max_size=3))
    user = draw(st.integers(0, 2))
    step = draw(st.integers(0, len(programs[user])))
    operation = draw(st.sampled_from(FAILABLE))
    programs[user].insert(step, operation)
    kinds = [*FAILURES, *(kind for kind, operations in CALLBACK_FAILABLE.items() if operation in operations)]
    return programs, _Failure(user, step, draw(st.sampled_from(kinds)), draw(st.floats(0, 1, exclude_max=True)))


def _alone(model: CCMForCausalLM, folder: str, programs: list[list[str]], failure: _Failure) -> tuple[list[Any], int]:
    """Each user's results, run alone and one after another, and how many tensor operations the failing call has."""
    results, operations = [], 0
    for user, program in enumerate(programs):
        served, got = _Served(model, user, folder), []
        for step, operation in enumerate(program):
            served.prepare(operation)
            counter = FailAt() if (user, step) == (failure.user, failure.step) else None
            got.append(served.run(operation, counter))
            operations = operations if counter is None else counter.count
        results.append([*got, served.held()])
    return results, operations


def _serve_together(
    model: CCMForCausalLM, folder: str, programs: list[list[str]], failure: _Failure, operations: int, runner: str
) -> list[Any]:
    """Each user's results, its program run in a thread (or an asyncio task's thread) of its own, every step started
    at once; the failing call checked where it fails, then made again."""
    barrier = threading.Barrier(len(programs))
    results: list[list[Any]] = [[] for _ in programs]
    errors: list[BaseException] = []

    def fail(served: _Served, operation: str) -> None:
        served.prepare(operation)
        before, drawn, step = served.held(), served.generator.get_state(), served.step
        if failure.kind in FAILURES:
            failing, arguments = FailAt(1 + int(failure.where * operations), FAILURES[failure.kind]), {}
        else:
            failing, arguments = None, CALLBACK_FAILURES[failure.kind]()
        with pytest.raises(failure.expected()):
            served.run(operation, failing, **arguments)
        assert_same(served.held(), before, f"the cache after {operation} failed ({failure.kind})")
        assert _GATE.get() == _GateState(), "the failed call left its LoRA gate state in the thread"
        served.generator.set_state(drawn)
        served.step = step

    def serve(user: int) -> None:
        try:
            served = _Served(model, user, folder)
            for step in range(max(map(len, programs))):
                barrier.wait(JOIN_TIMEOUT)
                if step < len(programs[user]):
                    operation = programs[user][step]
                    if (user, step) == (failure.user, failure.step):
                        fail(served, operation)
                    served.prepare(operation)
                    results[user].append(served.run(operation))
            results[user].append(served.held())
        except BaseException as error:  # reported by the test, with the schedule
            errors.append(error)
            barrier.abort()

    def in_tasks() -> None:
        async def tasks() -> None:
            await asyncio.gather(*(asyncio.to_thread(serve, user) for user in range(len(programs))))

        asyncio.run(tasks())

    def in_threads() -> None:
        threads = [threading.Thread(target=serve, args=(user,)) for user in range(len(programs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            join(thread)

    # A daemon thread: a call left hanging fails the test (at the join) instead of hanging it.
    main = threading.Thread(target=in_tasks if runner == "asyncio tasks" else in_threads, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads finely
    try:
        main.start()
        join(main)
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return results


@settings(max_examples=6, deadline=None)
@given(
    architecture=st.sampled_from(["llama", "gemma3", "longrope"]),
    schedule=_schedules(),
    runner=st.sampled_from(["threads", "asyncio tasks"]),
)
@example(  # a streamed reply fails before its first piece: its client sees the stream end instead of waiting
    architecture="longrope",
    schedule=(
        [["generate streamed"], ["generate beams", "stream generate"], ["compress", "generate sampling"]],
        _Failure(user=0, step=0, kind="interrupt", where=0.0),
    ),
    runner="asyncio tasks",
)
@example(
    architecture="gemma3",
    schedule=(
        [["stream forward", "compress"], ["stream generate", "save and load"], ["generate streamed", "forward"]],
        _Failure(user=1, step=0, kind="streamer", where=0.0),
    ),
    runner="threads",
)
def test_users_served_beside_a_failing_call_get_what_they_get_alone(tmp_path_factory, architecture, schedule, runner):
    """Three users served at once from threads (or asyncio tasks through `asyncio.to_thread`), compressing, generating
    (greedy, sampled with a generator of their own, with beams, to a client that reads one piece and goes away, on a
    stream), scoring, saving and loading, while one call of one user fails: an error deep inside torch (a bug, an
    interrupt, an out-of-memory error), a stopping criterion, logits processor or streamer that raises. The failed
    call leaves its user's memory and stream as they were, and made again gives what it gives alone; every user's
    results and memory are those of running alone, and the model is as it was."""
    programs, failure = schedule
    model, folder = _serving_model(architecture), str(tmp_path_factory.mktemp("memories"))
    before = model_snapshot(model)
    alone, operations = _alone(model, folder, programs, failure)
    together = _serve_together(model, folder, programs, failure, operations, runner)
    for user, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert_same(got, want, f"user {user} ({programs[user]}) beside {failure}")
    assert_same(model_snapshot(model), before, "the model")
