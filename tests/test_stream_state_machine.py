"""Stateful property tests of what tests/test_cache_state_machine.py leaves out: streaming caches, and the batch
operations of non-streaming caches whose rows are at different turns.

As there, the machine keeps, beside each real cache, the list of calls that succeeded on it (the first entry says how
the cache was made). After every step each cache must equal, exactly, the cache made by replaying that list on a
fresh cache: a failed (an injected fault at a random layer and call, or an error inside `cache.transaction()` after
two calls) or refused call changes nothing, save/load and copy change nothing, and batch operations (row selection,
reordering, repetition; out-of-range rows are refused) and `reset()` replay exactly. A stream must also never hold
more positions than its budget, and no call may leave a cache claimed.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from fault_injection import assert_same, snapshot
from test_cache_state_machine import COPIES, MachineWithFiles
from tiny_models import VOCAB, InjectedFailure, fail_in_layer, randomize_adapter, tiny_base
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, StreamingConfig

NUM_CACHES = 3
NUM_LAYERS = 2
MAX_ROWS = 4

Op = tuple
# Few positions, so that histories pass them and get re-based: the most that a stream of `SMALL` needs (its budget
# and a <COMP> block), and for memory the most that one call takes, a compress of a pending token, 4 context tokens
# and the <COMP> block (a re-base makes room for any input that fits the positions).
STREAM_POSITIONS, MEMORY_POSITIONS = 16, 7


@functools.cache
def short_ccm(positions: int, update: str, max_memory_tokens: int | None = None) -> CCMForCausalLM:
    """`tiny_ccm("llama", ...)` with only `positions` positions (tests must not modify it)."""
    base = tiny_base("llama")
    base.config.max_position_embeddings = positions
    config = CCMConfig(update=update, max_memory_tokens=max_memory_tokens)
    return randomize_adapter(CCMForCausalLM.from_base(base, config))


token = st.integers(3, VOCAB - 1)  # no pad/bos/eos
layer_index = st.integers(0, NUM_LAYERS - 1)


def rows_of(length: int) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    """`MAX_ROWS` rows of `length` tokens; a call takes as many as its cache has rows."""
    return st.lists(st.lists(token, min_size=length, max_size=length).map(tuple), min_size=MAX_ROWS, max_size=MAX_ROWS)


def token_rows(min_size: int, max_size: int) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    return st.integers(min_size, max_size).flatmap(rows_of).map(tuple)


class _Machine(MachineWithFiles):
    """What both machines share: caches, their histories, replay, save/load, copies, batch operations, resets and
    transactions. A machine defines `new(op)`, the cache that the first entry of a history makes, `call(cache, op)`,
    which runs a model call, and `valid_call(index)`, model calls that cache `index` takes (never refused)."""

    model: CCMForCausalLM

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CompressedMemoryCache] = []
        self.ops: list[list[Op]] = []
        self.replayed: dict[tuple[Op, ...], CompressedMemoryCache] = {}

    def apply(self, cache: CompressedMemoryCache, op: Op) -> None:
        """Run `op` on `cache`: a batch operation or a reset here, a model call in `call`."""
        if op[0] == "select":
            cache.batch_select_indices(torch.tensor(op[1], dtype=torch.long))
        elif op[0] == "reorder":
            cache.reorder_cache(torch.tensor(op[1], dtype=torch.long))
        elif op[0] == "repeat":
            cache.batch_repeat_interleave(op[1])
        elif op[0] == "reset":
            cache.reset()
        else:
            self.call(cache, op)

    def _replay(self, ops: list[Op]) -> CompressedMemoryCache:
        """A fresh cache after `ops`: the longest history already replayed, deep-copied (tensors of its own), then
        the rest of `ops` applied to it."""
        key = tuple(ops)
        if key not in self.replayed:
            if len(key) == 1:
                self.replayed[key] = self.new(key[0])
            else:
                cache = copy.deepcopy(self._replay(list(key[:-1])))
                self.apply(cache, key[-1])
                self.replayed[key] = cache
        return self.replayed[key]

    def rows(self, index: int, ids: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        return ids[: self.caches[index].batch_size]

    def _succeeds(self, index: int, op: Op) -> None:
        self.apply(self.caches[index], op)
        self.ops[index].append(op)

    def _refused(self, index: int, call: Any, what: object) -> None:
        """`call()` must raise a ValueError and leave cache `index` as it was."""
        cache = self.caches[index]
        before = snapshot(cache)
        try:
            call()
        except ValueError:
            assert_same(snapshot(cache), before, f"cache {index} after a refused {what}")
            return
        raise AssertionError(f"{what} after {self.ops[index]} was not refused")

    def _fails(self, index: int, op: Op, layer: int, after_calls: int) -> None:
        """`op` with a fault injected in decoder layer `layer` after `after_calls` runs of it: it fails and changes
        nothing, or it ran before the fault (an ordinary success)."""
        cache = self.caches[index]
        before = snapshot(cache)
        handle = fail_in_layer(self.model, layer, after_calls)
        try:
            self.apply(cache, op)
        except InjectedFailure:
            assert_same(snapshot(cache), before, f"cache {index} after a failed {op}")
        else:
            self.ops[index].append(op)
        finally:
            handle.remove()

    @rule(index=st.integers(0, NUM_CACHES - 1))
    def save_and_load(self, index: int) -> None:
        cache, path = self.caches[index], self._path()
        if cache.has_unfolded_turn:
            self._refused(index, lambda: cache.save(path), "save")
            assert not path.exists()
            return
        cache.save(path)
        loaded = CompressedMemoryCache.load(path, self.model)
        loaded.save(again := self._path())
        assert again.read_bytes() == path.read_bytes(), "a loaded cache saves other bytes than the file it came from"
        self.caches[index] = loaded

    @rule(
        source=st.integers(0, NUM_CACHES - 1),
        destination=st.integers(0, NUM_CACHES - 1),
        how=st.sampled_from(sorted(COPIES)),
    )
    def copy(self, source: int, destination: int, how: str) -> None:
        self.caches[destination] = COPIES[how](self.caches[source])
        self.ops[destination] = list(self.ops[source])

    @rule(index=st.integers(0, NUM_CACHES - 1), kind=st.sampled_from(["select", "reorder"]), data=st.data())
    def select(self, index: int, kind: str, data: st.DataObject) -> None:
        rows = self.caches[index].batch_size
        indices = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=MAX_ROWS).map(tuple))
        self._succeeds(index, (kind, indices))

    @rule(index=st.integers(0, NUM_CACHES - 1), repeats=st.integers(1, 2))
    def repeat(self, index: int, repeats: int) -> None:
        if self.caches[index].batch_size * repeats <= MAX_ROWS:
            self._succeeds(index, ("repeat", repeats))

    @rule(index=st.integers(0, NUM_CACHES - 1), kind=st.sampled_from(["select", "reorder"]), past=st.integers(0, 2))
    def out_of_range(self, index: int, kind: str, past: int) -> None:
        cache = self.caches[index]
        before = snapshot(cache)
        with pytest.raises(ValueError, match="outside"):  # a row past the last one
            self.apply(cache, (kind, (0, cache.batch_size + past)))
        assert_same(snapshot(cache), before, f"cache {index} after an out-of-range {kind}")

    @rule(index=st.integers(0, NUM_CACHES - 1))
    def reset(self, index: int) -> None:
        self.caches[index].reset()
        self.ops[index].append(("reset",))

    @rule(index=st.integers(0, NUM_CACHES - 1), data=st.data(), fail=st.booleans())
    def transaction(self, index: int, data: st.DataObject, fail: bool) -> None:
        """Two calls in one `cache.transaction()`: both stay, or (an error after them) neither does."""
        cache = self.caches[index]
        before = snapshot(cache)
        first = data.draw(self.valid_call(index))
        done = []
        try:
            with cache.transaction():
                self.apply(cache, first)
                done.append(first)
                second = data.draw(self.valid_call(index))
                self.apply(cache, second)
                done.append(second)
                if fail:
                    raise InjectedFailure("after both calls")
        except InjectedFailure:
            assert_same(snapshot(cache), before, f"cache {index} after a failed transaction of {done}")
        else:
            self.ops[index].extend(done)

    @invariant()
    def each_cache_is_the_replay_of_its_operations(self) -> None:
        for index, (cache, ops) in enumerate(zip(self.caches, self.ops, strict=True)):
            assert_same(snapshot(cache), snapshot(self._replay(ops)), f"cache {index} after {ops}")


# ----- streams ---------------------------------------------------------------------------------------------------
# max_forward_tokens is 6 (the first two) or 8: forwards of up to 13 tokens run in pieces.
SMALL = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=3, max_memory_tokens=4)
STREAMS = (SMALL, replace(SMALL, keep_window_full=False), replace(SMALL, compress=False))
STREAM_ROWS = (1, 2, 1)


class StreamMachine(_Machine):
    """Streams of one and two rows with each schedule: forwards of any length, generate (greedy, beam search, and
    several returned sequences, which leave the stream as it was), save/load, copies, faults and refused calls."""

    update = "concat"

    def __init__(self) -> None:
        super().__init__()
        self.model = short_ccm(STREAM_POSITIONS, self.update)
        self.ops = [[("new", rows, config)] for rows, config in zip(STREAM_ROWS, STREAMS, strict=True)]
        self.caches = [self.new(ops[0]) for ops in self.ops]

    def new(self, op: Op) -> CompressedMemoryCache:
        return self.model.new_cache(op[1], streaming=op[2])

    def call(self, cache: CompressedMemoryCache, op: Op) -> Any:
        if op[0] == "forward":
            with torch.no_grad():
                return self.model(input_ids=torch.tensor(op[1]), past_key_values=cache)
        if op[0] == "generate":
            _, ids, count, beams, sequences = op
            return self.model.generate(
                torch.tensor(ids),
                past_key_values=cache,
                max_new_tokens=count,
                min_new_tokens=count,
                num_beams=beams,
                num_return_sequences=sequences,
                do_sample=False,
            )
        raise AssertionError(op)  # pragma: no cover

    def valid_call(self, index: int) -> st.SearchStrategy[Op]:
        return token_rows(1, 13).map(lambda ids: ("forward", self.rows(index, ids)))

    @rule(index=st.integers(0, NUM_CACHES - 1), ids=token_rows(1, 13))
    def forward(self, index: int, ids: tuple[tuple[int, ...], ...]) -> None:
        self._succeeds(index, ("forward", self.rows(index, ids)))

    @rule(
        index=st.integers(0, NUM_CACHES - 1),
        ids=token_rows(1, 9),
        count=st.integers(1, 4),
        beams=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    )
    def generate(self, index: int, ids: tuple[tuple[int, ...], ...], count: int, beams: tuple[int, int]) -> None:
        op = ("generate", self.rows(index, ids), count, *beams)
        if beams[1] > 1:  # several returned sequences: the stream is left as it was (docs/streaming.md)
            before = snapshot(self.caches[index])
            self.apply(self.caches[index], op)
            assert_same(snapshot(self.caches[index]), before, f"cache {index} after {op}")
            return
        if beams[0] > 1:  # beam search: the stream takes the returned sequence, as a forward of it does
            cache, fed = self.caches[index], copy.deepcopy(self.caches[index])
            sequence = self.call(cache, op)
            self.ops[index].append(op)
            with torch.no_grad():
                self.model(input_ids=sequence, past_key_values=fed)
            # A forward adds to the count of tokens fed (get_seq_length()); a generate() counts from its prompt.
            assert cache.get_seq_length() == cache.turn_tokens == sequence.shape[1], f"cache {index} after {op}"
            counts = {"turn_tokens": None, "lengths": None}
            assert_same({**snapshot(cache), **counts}, {**snapshot(fed), **counts}, f"cache {index} after {op}")
            return
        self._succeeds(index, op)

    @rule(
        index=st.integers(0, NUM_CACHES - 1),
        generating=st.booleans(),
        ids=token_rows(1, 13),
        layer=layer_index,
        after_calls=st.integers(0, 8),
    )
    def injected_failure(
        self, index: int, generating: bool, ids: tuple[tuple[int, ...], ...], layer: int, after_calls: int
    ) -> None:
        rows = self.rows(index, ids)
        self._fails(index, ("generate", rows, 3, 1, 1) if generating else ("forward", rows), layer, after_calls)

    @rule(
        index=st.integers(0, NUM_CACHES - 1),
        kind=st.sampled_from(
            ["compress", "padded", "attentions", "crop", "bad id", "bad id in generate", "other batch", "mask shape"]
        ),
        ids=token_rows(2, 13),
    )
    def refused_call(self, index: int, kind: str, ids: tuple[tuple[int, ...], ...]) -> None:
        model, cache = self.model, self.caches[index]
        tokens = torch.tensor(self.rows(index, ids))
        padded = torch.ones_like(tokens)
        padded[:, 0] = 0
        bad = tokens.clone()
        bad[:, -1] = VOCAB
        calls = {
            "compress": lambda: model.compress(cache, tokens),
            "padded": lambda: model(input_ids=tokens, attention_mask=padded, past_key_values=cache),
            "attentions": lambda: model(
                input_ids=torch.cat([tokens] * 7, dim=1), past_key_values=cache, output_attentions=True
            ),
            "crop": lambda: cache.crop(1),
            "bad id": lambda: model(input_ids=bad, past_key_values=cache),
            "bad id in generate": lambda: model.generate(bad, past_key_values=cache, max_new_tokens=2),
            "other batch": lambda: model(
                input_ids=torch.tensor(ids[: cache.batch_size % MAX_ROWS + 1]), past_key_values=cache
            ),
            "mask shape": lambda: model(input_ids=tokens, attention_mask=padded[:, :1], past_key_values=cache),
        }
        self._refused(index, calls[kind], kind)

    @invariant()
    def a_stream_stays_within_its_budget(self) -> None:
        for cache in self.caches:
            streaming = cache.streaming
            assert streaming is not None
            assert cache.kv_length <= streaming.max_kv_length(self.model.config)
            sink, _, window, compressed = cache.stream_lengths.unbind(1)
            assert bool((sink <= streaming.sink_tokens).all() and (window <= streaming.window_tokens).all())
            assert bool((compressed >= 0).all() and (compressed <= window).all())
            for layer in cache.layers:
                assert not layer.is_initialized or layer.keys.shape[2] == cache.kv_length


class MergeStreamMachine(StreamMachine):
    update = "merge"


class EmaStreamMachine(StreamMachine):
    update = "ema"


# ----- batch operations on memory --------------------------------------------------------------------------------
def masked_rows(length: int, left_padded: bool) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    """`MAX_ROWS` attention-mask rows of `length`: left padding with at least one token per row, or any pattern."""
    if left_padded:
        row = st.integers(0, length - 1).map(lambda pad: (0,) * pad + (1,) * (length - pad))
    else:
        row = st.lists(st.integers(0, 1), min_size=length, max_size=length).map(tuple)
    return st.lists(row, min_size=MAX_ROWS, max_size=MAX_ROWS).map(tuple)


def masked_input(max_size: int, left_padded: bool) -> st.SearchStrategy[tuple[Any, Any]]:
    return st.integers(1, max_size).flatmap(lambda n: st.tuples(rows_of(n).map(tuple), masked_rows(n, left_padded)))


class BatchMachine(_Machine):
    """Caches of several rows at different turns (rows padded or without a context): compress, generate (greedy
    and beam search), forwards, folds, and the batch operations of generate(): `batch_select_indices`,
    `reorder_cache`, `batch_repeat_interleave`; with faults and out-of-range indices."""

    update = "concat"
    max_memory_tokens: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.model = short_ccm(MEMORY_POSITIONS, self.update, self.max_memory_tokens)
        self.ops = [[("new", rows)] for rows in (2, 3, 3)]
        self.caches = [self.new(ops[0]) for ops in self.ops]

    def new(self, op: Op) -> CompressedMemoryCache:
        return self.model.new_cache(op[1])

    def call(self, cache: CompressedMemoryCache, op: Op) -> None:
        kind = op[0]
        if kind == "compress":
            self.model.compress(cache, torch.tensor(op[1]), attention_mask=torch.tensor(op[2]))
        elif kind == "fold":
            self.model.compress(cache)
        elif kind == "generate":
            _, ids, mask, count, beams, sequences = op
            self.model.generate(
                torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                past_key_values=cache,
                max_new_tokens=count,
                num_beams=beams,
                num_return_sequences=sequences,
                do_sample=False,
            )
        elif kind == "forward":
            with torch.no_grad():
                self.model(input_ids=torch.tensor(op[1]), attention_mask=torch.tensor(op[2]), past_key_values=cache)
        else:  # pragma: no cover
            raise AssertionError(op)

    def _run(self, index: int, op: Op) -> None:
        """Run `op`, which must succeed, or be refused (ValueError, nothing changed) where `refused` says."""
        cache = self.caches[index]
        if self.refused(cache, op):
            self._refused(index, lambda: self.apply(cache, op), op)
        else:
            self._succeeds(index, op)

    @staticmethod
    def refused(cache: CompressedMemoryCache, op: Op) -> bool:
        """Whether `op` must be refused on `cache`: generate with a turn not folded, a fold with no turn (a turn of
        padding alone is folded all the same), a forward of padding alone."""
        if op[0] == "generate":
            return cache.has_unfolded_turn
        if op[0] == "fold":
            return not cache.has_unfolded_turn
        if op[0] == "compress":
            return not (cache.has_unfolded_turn or any(map(any, op[2])))
        if op[0] == "forward":
            return not any(map(any, op[2]))
        return False

    def masked(self, index: int, given: tuple[Any, Any]) -> tuple[Any, Any]:
        return self.rows(index, given[0]), self.rows(index, given[1])

    def valid_call(self, index: int) -> st.SearchStrategy[Op]:
        """A compress or forward with a token in every row (never refused)."""
        kind = st.sampled_from(["compress", "forward"])
        return st.tuples(kind, masked_input(3, left_padded=True)).map(lambda c: (c[0], *self.masked(index, c[1])))

    @rule(index=st.integers(0, NUM_CACHES - 1), given=masked_input(4, left_padded=False))
    def compress(self, index: int, given: tuple[Any, Any]) -> None:
        self._run(index, ("compress", *self.masked(index, given)))

    @rule(
        index=st.integers(0, NUM_CACHES - 1),
        given=masked_input(3, left_padded=True),
        count=st.integers(1, 3),
        beams=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
        fold=st.booleans(),
    )
    def generate(self, index: int, given: tuple[Any, Any], count: int, beams: tuple[int, int], fold: bool) -> None:
        op = ("generate", *self.masked(index, given), count, *beams)
        if beams[1] > 1 and not self.refused(self.caches[index], op):  # the caller picks one: the cache is unchanged
            before = snapshot(self.caches[index])
            self.apply(self.caches[index], op)
            assert_same(snapshot(self.caches[index]), before, f"cache {index} after {op}")
            return
        self._run(index, op)
        if fold:
            self._run(index, ("fold",))

    @rule(index=st.integers(0, NUM_CACHES - 1), given=masked_input(3, left_padded=False))
    def forward(self, index: int, given: tuple[Any, Any]) -> None:
        self._run(index, ("forward", *self.masked(index, given)))

    @rule(index=st.integers(0, NUM_CACHES - 1))
    def fold(self, index: int) -> None:
        self._run(index, ("fold",))

    @rule(
        index=st.integers(0, NUM_CACHES - 1),
        kind=st.sampled_from(["compress", "generate", "forward", "fold"]),
        given=masked_input(3, left_padded=True),
        layer=layer_index,
        after_calls=st.integers(0, 3),
    )
    def injected_failure(self, index: int, kind: str, given: tuple[Any, Any], layer: int, after_calls: int) -> None:
        ids, mask = self.masked(index, given)
        op = {
            "compress": ("compress", ids, mask),
            "generate": ("generate", ids, mask, 2, 1, 1),
            "forward": ("forward", ids, mask),
            "fold": ("fold",),
        }[kind]
        if self.refused(self.caches[index], op):
            self._refused(index, lambda: self.apply(self.caches[index], op), op)
        else:
            self._fails(index, op, layer, after_calls)


class CappedBatchMachine(BatchMachine):
    max_memory_tokens = 3


class MergeBatchMachine(BatchMachine):
    update = "merge"


class EmaBatchMachine(BatchMachine):
    update = "ema"


SETTINGS = settings(max_examples=6, stateful_step_count=8, deadline=None, derandomize=True)
TestConcatStreamMachine = StreamMachine.TestCase
TestMergeStreamMachine = MergeStreamMachine.TestCase
TestEmaStreamMachine = EmaStreamMachine.TestCase
TestConcatBatchMachine = BatchMachine.TestCase
TestCappedConcatBatchMachine = CappedBatchMachine.TestCase
TestMergeBatchMachine = MergeBatchMachine.TestCase
TestEmaBatchMachine = EmaBatchMachine.TestCase
for _case in (
    TestConcatStreamMachine,
    TestMergeStreamMachine,
    TestEmaStreamMachine,
    TestConcatBatchMachine,
    TestCappedConcatBatchMachine,
    TestMergeBatchMachine,
    TestEmaBatchMachine,
):
    _case.settings = SETTINGS
del _case  # not a test of its own
