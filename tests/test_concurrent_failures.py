"""One model serving many users from threads while some of their calls fail: every other user gets the results of a
run alone, the failed user's cache is as before the failed call, and nothing is left claimed or held."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fault_injection import assert_same, snapshot
from tiny_models import tiny_ccm
from transformers_ccm import CCMForCausalLM, CompressedMemoryCache

JOIN_TIMEOUT = 120  # seconds: a thread still running then is a hang, reported as a failure


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What `call()` gave: ("result", its value) or ("error", its type and message)."""
    try:
        return "result", call()
    except (ValueError, TypeError, RuntimeError) as error:
        return "error", (type(error), str(error))


def _join(thread: threading.Thread) -> None:
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive(), f"a thread still runs after {JOIN_TIMEOUT} s: something was left held"


@contextmanager
def _paused_when_claiming(call: Callable[[], Any]) -> Iterator[dict[str, Any]]:
    """Run `call()` in a thread that stops where it first claims a cache (`CompressedMemoryCache._claimed`) until the
    context's body has run; yields what the call gave, filled in once the context ends."""
    claim = CompressedMemoryCache._claimed.__wrapped__.__code__
    reached, resume = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def stop_at_claim(frame: Any, event: str, _: Any) -> None:
        if event == "call" and frame.f_code is claim and not reached.is_set():
            reached.set()
            resume.wait(JOIN_TIMEOUT)

    def run() -> None:
        sys.settrace(stop_at_claim)
        try:
            outcome["outcome"] = _outcome(call)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert reached.wait(JOIN_TIMEOUT), "the call never claimed the cache"
        yield outcome
    finally:
        resume.set()
        _join(thread)


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
    expected = _outcome(lambda: CALLS[call](model, serial))
    cache = _with_turn(model)
    with _paused_when_claiming(lambda: CALLS[call](model, cache)) as got:
        MEANWHILE[meanwhile](model, cache)
    assert_same(got["outcome"], expected, f"{call} after {meanwhile}")
    assert_same(snapshot(cache), snapshot(serial))
