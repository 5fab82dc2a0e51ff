"""Fault injection at the level of single tensor operations, and exact snapshots of caches and models.

`FailAt(k, error)` raises `error` at the k-th tensor operation (aten op, as torch dispatches it) run while it is
active; `count_operations(call)` says how many there are, so a test can sweep k over every operation of a call.
`paused_at(code, call)` runs a call in a thread stopped where it enters a function, for the test to act meanwhile.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from types import CodeType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_models import InjectedFailure
from transformers_ccm import CCMForCausalLM, CompressedMemoryCache
from transformers_ccm.cache import StreamingLayer
from transformers_ccm.lora import _GATE, lora_layers

# What a failure deep inside torch looks like: a bug (any exception), an interrupt (Ctrl-C: not an Exception, so
# `except Exception` clean-ups miss it), and an out-of-memory error (a RuntimeError, as torch raises it).
FAILURES: dict[str, Callable[[], BaseException]] = {
    "injected": lambda: InjectedFailure("injected failure"),
    "interrupt": KeyboardInterrupt,
    "out of memory": lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
}


JOIN_TIMEOUT = 120  # seconds: a thread still running then is a hang, reported as a failure


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What `call()` gave: ("result", its value) or ("error", its type and message)."""
    try:
        return "result", call()
    except (ValueError, TypeError, RuntimeError) as error:
        return "error", (type(error), str(error))


def join(thread: threading.Thread) -> None:
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive(), f"a thread still runs after {JOIN_TIMEOUT} s: something was left held"


@contextmanager
def paused_at(code: CodeType, call: Callable[[], Any], entry: int = 1) -> Iterator[dict[str, Any]]:
    """Run `call()` in a thread that stops where it enters the function of `code` for the `entry`-th time until the
    context's body has run; yields what the call gave (`outcome`) under "outcome", filled in once the context ends."""
    reached, resume = threading.Event(), threading.Event()
    got: dict[str, Any] = {}
    entries = 0

    def stop_there(frame: Any, event: str, _: Any) -> None:
        nonlocal entries
        if event == "call" and frame.f_code is code and not reached.is_set():
            entries += 1
            if entries == entry:
                reached.set()
                resume.wait(JOIN_TIMEOUT)

    def run() -> None:
        sys.settrace(stop_there)
        try:
            got["outcome"] = outcome(call)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert reached.wait(JOIN_TIMEOUT), f"the call never entered {code.co_qualname}"
        yield got
    finally:
        resume.set()
        join(thread)


class FailAt(TorchDispatchMode):
    """Raise `failure()` at the `k`-th tensor operation (1-based) run inside the context; count them all."""

    def __init__(self, k: int | None = None, failure: Callable[[], BaseException] = FAILURES["injected"]) -> None:
        super().__init__()
        self.k, self.failure, self.count = k, failure, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.count += 1
        if self.count == self.k:
            raise self.failure()
        return func(*args, **(kwargs or {}))


def count_operations(call: Callable[[], Any]) -> int:
    """How many tensor operations `call()` runs."""
    with FailAt() as counter:
        call()
    return counter.count


class ValuesRead(TorchDispatchMode):
    """Count the values read from tensors into Python inside the context (`bool(t)`, `int(t)`, `t.item()`): on a GPU,
    each waits for every operation queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def model_snapshot(model: CCMForCausalLM) -> dict[str, Any]:
    """Everything of `model` that a call must leave as it was: weights and buffers, gradients and `requires_grad`,
    training mode, hooks, attention implementation, the LoRA gate of this thread, PEFT's adapter switches and the
    generation settings."""
    modules = dict(model.named_modules())
    hook_kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "gradients": {
            name: None if parameter.grad is None else parameter.grad.clone()
            for name, parameter in model.named_parameters()
        },
        "requires_grad": {name: parameter.requires_grad for name, parameter in model.named_parameters()},
        "training": {name: module.training for name, module in modules.items()},
        "hooks": {name: [tuple(getattr(module, kind)) for kind in hook_kinds] for name, module in modules.items()},
        "attention": model.base_model.config._attn_implementation,
        "gate": _GATE.get(),
        "adapter_switches": [(layer._disable_adapters, layer.active_adapter) for layer in lora_layers(model)],
        "generation_config": model.generation_config.to_json_string(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_frozen(item) for item in value)
    return value


def _memory(cache: CompressedMemoryCache, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's memory slots (a stream's sit after each row's sink; zeros past a row's own)."""
    if isinstance(layer, StreamingLayer):
        sink, memory = cache.stream_lengths[:, 0, None], cache.stream_lengths[:, 1, None]
        slots = torch.arange(cache.memory_length)[None]
        valid = slots < memory
        keys, values = layer.slots(torch.where(valid, sink + slots, 0), valid)
        return keys.to(layer.keys.dtype), values
    return layer.memory()


def snapshot(cache: CompressedMemoryCache) -> dict[str, Any]:
    """Everything a cache holds: row bookkeeping, each layer's keys/values/lengths, the float32 average where it is
    not the memory itself (a loaded cache keeps none when they are equal), counters. The claim must be free."""
    assert cache._user is None and cache._call is None, "a call left the cache claimed"
    layers = []
    for layer in cache.layers:
        state = {name: _frozen(value) for name, value in layer.__dict__.items() if name != "accumulated"}
        accumulated = getattr(layer, "accumulated", None)
        if accumulated is not None:
            keys, values = _memory(cache, layer)
            if accumulated[0].dtype == keys.dtype:
                assert torch.equal(accumulated[0], keys) and torch.equal(accumulated[1], values)
            else:
                state["accumulated"] = _frozen(accumulated)
        layers.append(state)
    return {
        "rows": {field.name: _frozen(getattr(cache.rows, field.name)) for field in fields(cache.rows)},
        "layers": layers,
        "turn_tokens": cache.turn_tokens,
        "compressed_in_window": cache.compressed_in_window,
        "stream_lengths": cache.stream_lengths.clone(),
        "row_ends": cache.row_ends,
        "streaming": cache.streaming,
        "lengths": (cache.memory_length, cache.turn_length, cache.get_seq_length(), cache.has_unfolded_turn),
        "steps": cache.steps.tolist(),
    }


def assert_same(got: Any, want: Any, where: str = "cache") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.shape == want.shape and got.dtype == want.dtype, f"{where}: {got.shape} {got.dtype} != {want.shape}"
        assert torch.equal(got, want), f"{where}: values differ (max {(got.float() - want.float()).abs().max()})"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, tuple | list):
        assert isinstance(got, tuple | list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
