"""A stateful property test of CompressedMemoryCache: random sequences of compress, generate, online forward,
save/load, copies (and pickles), failed calls (an injected fault at a random layer and call) and invalid calls
(refused with ValueError) on a few caches of one model.

Beside the real caches the machine keeps a model of each: the list of operations that succeeded on it. After every
step each cache must equal, exactly, the cache made by replaying that list on a fresh cache: a failed or refused
call changes nothing, save/load and copy change nothing, and a copy changes independently of its source.
"""

from __future__ import annotations

import copy
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fault_injection import assert_same, snapshot
from tiny_models import VOCAB, InjectedFailure, fail_in_layer, tiny_ccm
from transformers_ccm import CCMForCausalLM, CompressedMemoryCache

NUM_CACHES = 3
NUM_LAYERS = 2

Op = tuple  # ("compress", ids or None) | ("generate", prompt, max_new_tokens) | ("forward", ids)

cache_index = st.integers(0, NUM_CACHES - 1)
token = st.integers(3, VOCAB - 1)  # no pad/bos/eos
context = st.lists(token, min_size=1, max_size=4).map(tuple)
prompt = st.lists(token, min_size=1, max_size=3).map(tuple)
new_tokens = st.integers(1, 3)
bad_id = st.sampled_from([VOCAB, VOCAB + 1, 10_000, -1])
# The ways a cache is copied: each gives a cache equal to its source, which changes independently of it.
COPIES: dict[str, Callable[[CompressedMemoryCache], CompressedMemoryCache]] = {
    "copy()": CompressedMemoryCache.copy,
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "pickle": lambda cache: pickle.loads(pickle.dumps(cache)),
}


# ----- the operations and their replay ---------------------------------------------------------------------------
def apply(model: CCMForCausalLM, cache: CompressedMemoryCache, op: Op) -> None:
    kind = op[0]
    if kind == "compress":
        model.compress(cache, None if op[1] is None else torch.tensor([op[1]]))
    elif kind == "generate":
        model.generate(torch.tensor([op[1]]), past_key_values=cache, max_new_tokens=op[2], do_sample=False)
    elif kind == "forward":
        with torch.no_grad():
            model(input_ids=torch.tensor([op[1]]), past_key_values=cache)
    else:  # pragma: no cover
        raise AssertionError(kind)


def turn_open(ops: list[Op]) -> bool:
    """Whether a cache with this history holds an unfolded turn (compress folds it; generate and forward leave one)."""
    return bool(ops) and ops[-1][0] != "compress"


def refusal(ops: list[Op], op: Op) -> bool:
    """Whether `op` must be refused (ValueError, nothing changed) on a cache with this history."""
    if op[0] == "generate":
        return turn_open(ops)  # the turn must be folded before the next generate()
    if op == ("compress", None):
        return not turn_open(ops)  # nothing to compress
    return False


# ----- the machine -----------------------------------------------------------------------------------------------
class MachineWithFiles(RuleBasedStateMachine):
    """A state machine that saves memories: each file in a folder of its own, removed when the run ends."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp())
        self.files = 0

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _path(self) -> Path:
        self.files += 1
        return self.folder / f"memory{self.files}.safetensors"


class CacheMachine(MachineWithFiles):
    update = "concat"

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_ccm("llama", update=self.update)
        self.caches = [self.model.new_cache() for _ in range(NUM_CACHES)]
        self.ops: list[list[Op]] = [[] for _ in range(NUM_CACHES)]
        self.replayed: dict[tuple[Op, ...], dict[str, Any]] = {}

    def _expected(self, ops: list[Op]) -> dict[str, Any]:
        """The state of a fresh cache after replaying `ops` (each replay from scratch, memoized by history)."""
        key = tuple(ops)
        if key not in self.replayed:
            cache = self.model.new_cache()
            for op in ops:
                apply(self.model, cache, op)
            self.replayed[key] = snapshot(cache)
        return self.replayed[key]

    def _run(self, index: int, *ops: Op) -> None:
        """Run `ops` in turn on cache `index`; each must succeed or be refused (ValueError) as the model says."""
        for op in ops:
            cache, before = self.caches[index], snapshot(self.caches[index])
            if refusal(self.ops[index], op):
                try:
                    apply(self.model, cache, op)
                except ValueError:
                    assert_same(snapshot(cache), before, f"cache {index} after a refused {op}")
                    return
                raise AssertionError(f"{op} after {self.ops[index]} was not refused")
            apply(self.model, cache, op)
            self.ops[index].append(op)

    # ----- rules: calls that succeed ------------------------------------------------------------------------------
    @rule(index=cache_index, ids=context)
    def compress(self, index: int, ids: tuple[int, ...]) -> None:
        self._run(index, ("compress", ids))

    @rule(index=cache_index, ids=prompt, count=new_tokens, fold=st.booleans())
    def generate(self, index: int, ids: tuple[int, ...], count: int, fold: bool) -> None:
        self._run(index, ("generate", ids, count), *([("compress", None)] if fold else []))

    @rule(index=cache_index, ids=prompt, fold=st.booleans())
    def forward(self, index: int, ids: tuple[int, ...], fold: bool) -> None:
        self._run(index, ("forward", ids), *([("compress", None)] if fold else []))

    @rule(index=cache_index)
    def fold(self, index: int) -> None:
        self._run(index, ("compress", None))

    @rule(index=cache_index)
    def save_and_load(self, index: int) -> None:
        cache, path = self.caches[index], self._path()
        if turn_open(self.ops[index]):
            before = snapshot(cache)
            try:
                cache.save(path)
            except ValueError:
                assert_same(snapshot(cache), before, f"cache {index} after a refused save")
                assert not path.exists()
                return
            raise AssertionError(f"save with an unfolded turn after {self.ops[index]} was not refused")
        cache.save(path)
        loaded = CompressedMemoryCache.load(path, self.model)
        again = self._path()
        loaded.save(again)
        assert again.read_bytes() == path.read_bytes(), "a loaded cache saves other bytes than the file it came from"
        self.caches[index] = loaded

    @rule(source=cache_index, destination=cache_index, how=st.sampled_from(sorted(COPIES)))
    def copy(self, source: int, destination: int, how: str) -> None:
        self.caches[destination] = COPIES[how](self.caches[source])
        self.ops[destination] = list(self.ops[source])

    # ----- rules: failed and refused calls ------------------------------------------------------------------------
    @rule(
        index=cache_index,
        kind=st.sampled_from(["compress", "generate", "forward", "fold"]),
        ids=prompt,
        count=new_tokens,
        layer=st.integers(0, NUM_LAYERS - 1),
        after_calls=st.integers(0, 3),
    )
    def injected_failure(
        self, index: int, kind: str, ids: tuple[int, ...], count: int, layer: int, after_calls: int
    ) -> None:
        op = {
            "compress": ("compress", ids),
            "generate": ("generate", ids, count),
            "forward": ("forward", ids),
            "fold": ("compress", None),
        }[kind]
        cache, ops = self.caches[index], self.ops[index]
        before, saved = snapshot(cache), None
        if not turn_open(ops):
            saved = self._path()
            cache.save(saved)
        handle = fail_in_layer(self.model, layer, after_calls)
        try:
            apply(self.model, cache, op)
        except InjectedFailure:
            outcome = "failed"
        except ValueError:
            outcome = "refused"
        else:
            outcome = "ran"
        finally:
            handle.remove()
        if outcome == "ran":  # the fault came after the call's last layer run: an ordinary success
            assert not refusal(ops, op), f"{op} after {ops} was not refused"
            ops.append(op)
            return
        assert outcome == ("refused" if refusal(ops, op) else "failed"), f"{op} after {ops}: {outcome}"
        assert_same(snapshot(cache), before, f"cache {index} after a {outcome} {op}")
        if saved is not None:
            cache.save(again := self._path())
            assert again.read_bytes() == saved.read_bytes(), f"a {outcome} {op} changed the saved memory"

    @rule(index=cache_index, kind=st.sampled_from(["compress", "generate", "forward"]), ids=prompt, bad=bad_id)
    def out_of_vocabulary(self, index: int, kind: str, ids: tuple[int, ...], bad: int) -> None:
        ids = (*ids[:-1], bad, *ids[-1:])
        op = ("generate", ids, 2) if kind == "generate" else (kind, ids)
        cache, before = self.caches[index], snapshot(self.caches[index])
        try:
            apply(self.model, cache, op)
        except ValueError as error:  # refused for the id itself, not for another reason that happened to apply
            assert f"holds the token id {bad}, outside the model's vocabulary" in str(error), (op, error)
        else:
            raise AssertionError(f"{op} was not refused")
        assert_same(snapshot(cache), before, f"cache {index} after a refused {op}")

    @rule(index=cache_index, kind=st.sampled_from(["empty context", "two rows", "1-D prompt", "crop"]))
    def invalid_call(self, index: int, kind: str) -> None:
        model, cache = self.model, self.caches[index]
        before = snapshot(cache)
        calls = {
            "empty context": lambda: model.compress(cache, torch.zeros(1, 0, dtype=torch.long)),
            "two rows": lambda: model.compress(cache, torch.tensor([[5, 6], [7, 8]])),
            "1-D prompt": lambda: model.generate(torch.tensor([5, 6]), past_key_values=cache, max_new_tokens=2),
            "crop": lambda: cache.crop(1),
        }
        # What each refusal says: another ValueError (an unfolded turn, say) would leave its own check untested.
        messages = {
            "empty context": "context_ids is empty",
            "two rows": "has batch size 2 but the cache holds 1 rows",
            "1-D prompt": "must be 2-D (batch, len)",
            "crop": "cannot be cropped",
        }
        try:
            calls[kind]()
        except ValueError as error:
            assert messages[kind] in str(error), (kind, error)
        else:
            raise AssertionError(f"{kind} was not refused")
        assert_same(snapshot(cache), before, f"cache {index} after a refused {kind}")

    # ----- the invariant ------------------------------------------------------------------------------------------
    @invariant()
    def each_cache_is_the_replay_of_its_operations(self) -> None:
        for index, (cache, ops) in enumerate(zip(self.caches, self.ops, strict=True)):
            assert_same(snapshot(cache), self._expected(ops), f"cache {index} after {ops}")


class MergeCacheMachine(CacheMachine):
    update = "merge"


SETTINGS = settings(max_examples=15, stateful_step_count=8, deadline=None)
TestConcatCacheMachine = CacheMachine.TestCase
TestConcatCacheMachine.settings = SETTINGS
TestMergeCacheMachine = MergeCacheMachine.TestCase
TestMergeCacheMachine.settings = SETTINGS
