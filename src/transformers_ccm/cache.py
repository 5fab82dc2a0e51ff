"""`CompressedMemoryCache`: a `transformers.Cache` that keeps compressed memory instead of past tokens.

The cache is a list of layer objects that own their policy, as in transformers' `cache_utils`:

- `MemoryLayer` holds `[memory | turn]`: the memory slots (the `<COMP>` keys/values of earlier contexts, or
  their running average) and the keys/values of the tokens of the current turn. Folding a turn replaces the
  turn by its compression `h(t)` according to the update rule.
- `StreamingLayer` holds `[sink | memory | window]` and compresses (or evicts) the oldest window tokens when
  new ones would not fit, moving rotary keys to their new positions.

Per-row bookkeeping lives in one frozen `RowState` (users at different time steps share a batch): which
memory slots a row owns, the real (non-padding) turn tokens, the logical "skip" position of the row's next
token, the number of contexts compressed, and the token `generate()` produced last without running it.

The cache never calls the model. It changes only through whole replacements of tensors, so a `transaction`
can restore it exactly when a call fails.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from transformers_ccm.config import CCMConfig
from transformers_ccm.files import checked_path, nearest_existing
from transformers_ccm.masks import ALWAYS_VISIBLE, SlidingWindow, update_coefficient
from transformers_ccm.memory_file import (
    MOST_FOLDS,
    MOST_HISTORY_TOKENS,
    read_memory_file,
    signature_differences,
    write_memory_file,
)
from transformers_ccm.streaming import KeyRotation, StreamingConfig
from transformers_ccm.validation import is_index, positive_int

if TYPE_CHECKING:
    from transformers_ccm.modeling import CCMForCausalLM

logger = logging.getLogger(__name__)

# Taken to claim a cache for a call (see `CompressedMemoryCache.transaction`): a check and a claim, never a model run.
_CLAIMS = threading.Lock()


@dataclass(frozen=True, eq=False)
class _Claimant:
    """Who holds the caches that a thread or asyncio task claimed (`CompressedMemoryCache.transaction`): made by its
    outermost claim, in `thread` and `task` (None outside asyncio), so that the calls nested in it share its claims.
    `copied_from`: the claimant of the thread or task whose context this one's copies (`_CLAIMANT`), if any."""

    thread: int
    task: object | None
    copied_from: _Claimant | None


# The claimant of the current context (None: it holds no cache). A context copied into a thread (asyncio.to_thread)
# or a task created inside a transaction brings it along, but that thread or task is not the one that holds the
# caches (`_own_claimant`).
_CLAIMANT: ContextVar[_Claimant | None] = ContextVar("ccm_cache_claimant", default=None)


def _current_task() -> object | None:
    """The asyncio task running in this thread, or None."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return None


def _own_claimant() -> _Claimant | None:
    """The claimant of the calling thread or task, or None where it holds no cache: one in `_CLAIMANT` that another
    thread or task made is not its own."""
    claimant = _CLAIMANT.get()
    if claimant is not None and claimant.thread == threading.get_ident() and claimant.task is _current_task():
        return claimant
    return None


def _shares_context(holder: _Claimant) -> bool:
    """Whether the calling thread's or task's context and that of `holder` were copied one from the other (at any
    remove), so that both see one claimant in `_CLAIMANT`."""

    def lineage(claimant: _Claimant | None) -> Iterator[_Claimant]:
        while claimant is not None:
            yield claimant
            claimant = claimant.copied_from

    current = _CLAIMANT.get()
    return any(claimant is holder for claimant in lineage(current)) or any(
        claimant is current for claimant in lineage(holder)
    )


# Why a model's cached keys cannot move to other positions (`CacheSpec.rotation` is None).
_FIXED_POSITIONS = (
    "learned absolute positions added to the hidden states, or rotary embeddings that CCM cannot re-rotate: only "
    "the rotate_half layout of Llama is, not interleaved pairs (Cohere, GLM) nor layers without positions (Llama 4)"
)


# ----- what a model tells its caches -------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """Everything a cache needs to know of the model that fills it: data only, never the model itself.

    Attributes:
        config: the adapter's settings (update rule, `<COMP>` length, concat cap) as the memory is made with them: a
            record that refuses changes (`CCMConfig._record`).
        signature: what a memory depends on: base model, its weights and config, adapter weights and LoRA
            settings, update rule (see `CCMForCausalLM.memory_signature`). A model or file with another signature
            is refused.
        num_layers, kv_heads, head_dim: the shape of each layer's keys/values `(batch, kv_heads, len, head_dim)`.
        dtype, device: those of the keys/values.
        rotation: the model's rotary frequencies (None without rotary embeddings, or with ones `KeyRotation` does
            not reproduce); streaming needs it.
        rebase_rotation: its frequencies at `max_positions` (`KeyRotation.of_model(at_max_positions=True)`; None
            where `rotation` is), with which compressed memory re-bases positions that would pass them.
        max_positions: the model's maximum number of positions, if it has one.
        sliding_window: the model's sliding-window layers, which see only the recent tokens of the turn.
    """

    config: CCMConfig
    signature: dict[str, Any]
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    rotation: KeyRotation | None = None
    rebase_rotation: KeyRotation | None = None
    max_positions: int | None = None
    sliding_window: SlidingWindow | None = None


# ----- per-row state ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowState:
    """Per-row bookkeeping of a batch of users; replaced as a whole, never changed in place.

    Attributes:
        memory_mask: `(batch, memory)` bool, the memory slots each row owns.
        turn_mask: `(batch, turn)` bool, the real (non-padding) tokens of the current turn.
        next_position: `(batch,)` long, the logical ("skip") position of each row's next token (a stream: the count
            of tokens it was fed; its positions are those of what it holds).
        steps: `(batch,)` long, contexts (streaming: chunks) compressed so far.
        rebased: `(batch,)` long, how far re-basing has moved each row's positions back in all: `next_position +
            rebased` counts the ordinary tokens the row has taken in.
        pending_ids, pending_mask: `(batch, 0 or 1)`, the token `generate()` produced last, which has no
            keys/values yet (folding the turn runs it), and whether it is real.
    """

    memory_mask: torch.Tensor
    turn_mask: torch.Tensor
    next_position: torch.Tensor
    steps: torch.Tensor
    rebased: torch.Tensor
    pending_ids: torch.Tensor
    pending_mask: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int) -> RowState:
        return cls(
            memory_mask=torch.zeros(batch_size, 0, dtype=torch.bool),
            turn_mask=torch.zeros(batch_size, 0, dtype=torch.bool),
            next_position=torch.zeros(batch_size, dtype=torch.long),
            steps=torch.zeros(batch_size, dtype=torch.long),
            rebased=torch.zeros(batch_size, dtype=torch.long),
            pending_ids=torch.zeros(batch_size, 0, dtype=torch.long),
            pending_mask=torch.zeros(batch_size, 0, dtype=torch.bool),
        )

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> RowState:
        """The same state with `function` applied to every tensor (batch selection, devices)."""
        return RowState(**{field.name: function(getattr(self, field.name)) for field in fields(self)})


# ----- layers ----------------------------------------------------------------------------------------------------
class _RowsLayer(DynamicLayer):
    """A layer whose every tensor holds one row per user: its keys/values and, for merge and EMA memory, the
    float32 average (`accumulated`) of the memory."""

    is_croppable = False
    accumulated: tuple[torch.Tensor, torch.Tensor] | None

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor held, `(batch, ...)`, by `function` of it (rows selected or repeated, or detached)."""
        if self.is_initialized:
            self.keys, self.values = function(self.keys), function(self.values)
            if self.accumulated is not None:
                self.accumulated = function(self.accumulated[0]), function(self.accumulated[1])


class MemoryLayer(_RowsLayer):
    """One layer's `[memory | turn]` keys/values, `(batch, kv_heads, memory + turn, head_dim)`.

    Merge and EMA memory is accumulated in float32 (`accumulated`), whatever the model's dtype, so that a
    running mean over many turns keeps moving; the memory attended to is its cast to the model's dtype.
    """

    def __init__(self) -> None:
        super().__init__()
        self.memory_length = 0
        self.accumulated: tuple[torch.Tensor, torch.Tensor] | None = None
        self.announced = 0  # new tokens that `prepare_forward` registered and this layer has not yet stored

    def get_seq_length(self) -> int:
        """Length of the current turn: the memory is a prefix that `generate()` must not count."""
        return super().get_seq_length() - self.memory_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.memory_length + self.get_seq_length() + query_length, 0

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory keys and values, `(batch, kv_heads, memory_length, head_dim)` each."""
        return self.keys[:, :, : self.memory_length], self.values[:, :, : self.memory_length]

    def comp_block(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the last `n` positions: the `<COMP>` block just run."""
        return self.keys[:, :, -n:], self.values[:, :, -n:]

    def set_memory(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the layer's content by a memory (the turn is dropped)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.memory_length = keys.shape[-2]

    def fold_concat(self, n: int, slots: torch.Tensor) -> None:
        """New memory: the slots `slots` `(batch, width)` (indices into `[memory | <COMP> block]`) of each row."""
        memory_keys, memory_values = self.memory()
        comp_keys, comp_values = self.comp_block(n)
        keys, values = torch.cat([memory_keys, comp_keys], dim=2), torch.cat([memory_values, comp_values], dim=2)
        index = slots.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        self.set_memory(keys.gather(2, index), values.gather(2, index))

    def fold_average(self, n: int, weight: torch.Tensor) -> None:
        """`Mem = (1 - a) Mem + a h` per row in float32, with `a = weight` `(batch,)` (1 replaces the memory)."""
        comp_keys, comp_values = self.comp_block(n)
        new = comp_keys.float(), comp_values.float()
        old = _float_average(self.accumulated, self.memory() if self.memory_length else None)
        if old is None:
            accumulated = new
        else:
            a = weight.to(comp_keys.device, torch.float32)[:, None, None, None]
            accumulated = tuple((1 - a) * past + a * fresh for past, fresh in zip(old, new, strict=True))
        self.set_average(*accumulated, dtype=comp_keys.dtype)

    def set_average(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Hold the float32 average `keys`, `values` as memory, cast to `dtype` for attention."""
        self.accumulated = keys, values
        self.set_memory(keys.to(dtype), values.to(dtype))

    def rebase(self, rotation: KeyRotation, layer_idx: int, delta: torch.Tensor) -> None:
        """Move every held key by `delta` `(batch,)` positions (relative positions stay exact)."""
        shift = delta[:, None].expand(-1, self.keys.shape[2])
        keys = rotation.shift(layer_idx, self.keys, shift)
        if self.accumulated is not None:
            average, values = self.accumulated
            average = rotation.shift(layer_idx, average, shift[:, : average.shape[2]])
            self.accumulated = average, values
            # The memory stays the cast of its float32 average: its rotated cast was rounded twice (in bf16, keys
            # one step of bf16 away from those a later fold, or a saved file, holds).
            keys = torch.cat([average.to(keys.dtype), keys[:, :, average.shape[2] :]], dim=2)
        self.keys = keys

    def held(self) -> dict[str, torch.Tensor]:
        """The per-user state between turns, by name: the memory, and the float32 average when it is not the
        memory itself."""
        keys, values = self.memory()
        state = {"keys": keys, "values": values}
        if self.accumulated is not None and self.accumulated[0].dtype != keys.dtype:
            state["accumulated_keys"], state["accumulated_values"] = self.accumulated
        return state

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `held` (tensors already checked)."""
        keys, values = state["keys"], state["values"]
        if "accumulated_keys" in state:
            self.set_average(state["accumulated_keys"], state["accumulated_values"], dtype=keys.dtype)
        else:
            self.set_memory(keys, values)


class StreamingLayer(_RowsLayer):
    """One layer of a bounded stream: each row's `[sink | memory | window]` keys/values at positions `0..n-1`, the
    row's `n` its own (`CompressedMemoryCache.stream_lengths`); a row shorter than the longest is followed by zeros.

    New tokens follow each row's own slots (`update`, where `placement` says); compression and eviction lay every
    row out anew (`rearrange`), re-rotating moved keys to their new positions.

    In float16 or bfloat16 the keys are also held in float32 (`float_keys`), which every move rotates: a window
    key moves once per token that enters a full window, and rotated and rounded each time it drifted (bfloat16: 7%
    of its norm after 148 moves, against 0.2% for one rounding); the keys attended to are its cast.
    """

    def __init__(self) -> None:
        super().__init__()
        self.accumulated: tuple[torch.Tensor, torch.Tensor] | None = None
        self.float_keys: torch.Tensor | None = None  # the keys in float32, where they are not float32 themselves
        self.announced = 0  # as `MemoryLayer.announced`
        # Where the next tokens go (`CompressedMemoryCache.prepare_forward`): None after every slot, else each row's
        # `(index, valid)` (`_gathered`) into the held slots followed by the new ones.
        self.placement: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        placement, self.placement = self.placement, None
        keys, values = self._exact_keys(), self.values
        if keys.dtype != key_states.dtype:
            key_states = key_states.float()
        keys, values = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        if placement is not None:
            keys, values = _gathered(keys, values, *placement)
        self._set_keys(keys)
        self.values = values
        return self.keys, self.values

    def prefix(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :length], self.values[:, :, :length]

    def slots(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact keys and the values of the slots `index` `(batch, n)` of each row (zeros where `valid` is
        False)."""
        return _gathered(self._exact_keys(), self.values, index, valid)

    def rearrange(
        self,
        rotation: KeyRotation,
        layer_idx: int,
        index: torch.Tensor,
        delta: torch.Tensor | None,
        valid: torch.Tensor | None,
        extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Lay each row out anew: slot `j` of row `b` takes the slot `index[b, j]` of `[held | extra]` (`extra`: keys
        in float32 and values, `(batch, kv_heads, n, head_dim)` each), its key moved by `delta[b, j]` positions (None:
        no key moves); slots not `valid` are zeros (None: all are). `index`, `delta`, `valid`: `(batch, new_length)`
        (`_layout`)."""
        keys, values = self._exact_keys(), self.values
        if extra is not None:
            keys = torch.cat([keys, extra[0].to(keys.dtype)], dim=2)
            values = torch.cat([values, extra[1].to(values.dtype)], dim=2)
        keys, values = _gathered(keys, values, index, valid)
        if delta is not None:
            keys = rotation.shift(layer_idx, keys, delta)
        self._set_keys(keys)
        self.values = values

    def _exact_keys(self) -> torch.Tensor:
        """The keys `(batch, kv_heads, kv_length, head_dim)` in the precision they are moved in: float32."""
        return self.keys if self.float_keys is None else self.float_keys

    def _set_keys(self, keys: torch.Tensor) -> None:
        """Hold moved `_exact_keys` `keys`: as the keys attended to, cast to their dtype, and in float32 beside them."""
        dtype = self.values.dtype
        self.float_keys = None if dtype == torch.float32 else keys.float()
        self.keys = keys.to(dtype)

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().map_rows(function)
        if self.float_keys is not None:
            self.float_keys = function(self.float_keys)

    def trim(self, width: int, memory_slots: int) -> None:
        """Keep the first `width` slots of every row, and the merge/EMA average only where a row owns
        `memory_slots`."""
        if self.is_initialized and self.keys.ndim == 4:
            self.keys, self.values = self.keys[:, :, :width], self.values[:, :, :width]
            if self.float_keys is not None:
                self.float_keys = self.float_keys[:, :, :width]
        if not memory_slots:
            self.accumulated = None

    def held(self) -> dict[str, torch.Tensor]:
        state = {"keys": self.keys, "values": self.values}
        if self.accumulated is not None and self.accumulated[0].dtype != self.keys.dtype:
            state["accumulated_keys"], state["accumulated_values"] = self.accumulated
        if self.float_keys is not None:
            state["float_keys"] = self.float_keys
        return state

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        self.lazy_initialization(state["keys"], state["values"])
        self.keys, self.values = state["keys"], state["values"]
        if "accumulated_keys" in state:
            self.accumulated = state["accumulated_keys"], state["accumulated_values"]
        # A file without them (written before they were kept) starts them from the keys it holds.
        self.float_keys = (
            state.get("float_keys", state["keys"].float()) if state["keys"].dtype != torch.float32 else None
        )


def _gathered(
    keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots `index` `(batch, n)` of each row of `keys` and `values` `(batch, kv_heads, length, head_dim)`, zeros
    where `valid` `(batch, n)` is False."""
    where = index.to(keys.device)[:, None, :, None]
    gathered = [tensor.gather(2, where.expand(-1, tensor.shape[1], -1, tensor.shape[-1])) for tensor in (keys, values)]
    if valid is not None:
        keep = valid.to(keys.device)[:, None, :, None]
        gathered = [tensor.masked_fill(~keep, 0) for tensor in gathered]
    return gathered[0], gathered[1]


def _layout(
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Where each row's slots come from when `pieces` are laid out one after the other from slot 0: piece `(start,
    count, position)` (`(batch,)` long each, on the CPU) is `count` slots from slot `start` of the source, the first
    of which sits at `position`. Returns, on `device`, `(batch, width)` the source index, the positions each key
    moves by (None where none moves) and whether the slot is a row's own (None where every row is as long as the
    longest, `width`)."""
    ends = torch.stack([count for _, count, _ in pieces], dim=1).cumsum(dim=1)
    slots = torch.arange(max(ends[:, -1].tolist()))[None]
    index = torch.zeros(ends.shape[0], slots.shape[1], dtype=torch.long)
    delta = torch.zeros_like(index)
    begin = torch.zeros(ends.shape[0], 1, dtype=torch.long)
    for (start, _, position), end in zip(pieces, ends.unbind(1), strict=True):
        inside = (slots >= begin) & (slots < end[:, None])
        offset = slots - begin
        index = torch.where(inside, start[:, None] + offset, index)
        delta = torch.where(inside, slots - position[:, None] - offset, delta)
        begin = end[:, None]
    # Read on the CPU: no device synchronisation.
    moved = delta.to(device) if any(delta.flatten().tolist()) else None
    valid = None if len(set(ends[:, -1].tolist())) == 1 else (slots < begin).to(device)
    return index.to(device), moved, valid


# ----- the cache -------------------------------------------------------------------------------------------------
class CompressedMemoryCache(Cache):
    """Compressed context memory for a batch of users, usable as `past_key_values` of a `CCMForCausalLM`.

    Create one with `model.new_cache(batch_size)`; fill it with `model.compress(...)`; generate with
    `model.generate(..., past_key_values=cache)`. With `streaming` (and the model's `rotation`), it is a
    bounded stream instead: every forward adds to the window, compressing or evicting what overflows.

    Args:
        spec: what the model tells its caches (`CCMForCausalLM.cache_spec()`).
        batch_size: rows (users).
        streaming: sizes of a bounded stream, or None for compressed memory.
    """

    def __init__(self, spec: CacheSpec, batch_size: int, streaming: StreamingConfig | None = None) -> None:
        if not positive_int(batch_size):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if streaming is not None and not isinstance(streaming, StreamingConfig):
            raise TypeError(f"streaming must be a StreamingConfig (or None), got {type(streaming).__name__}.")
        if streaming is not None:
            if spec.rotation is None:
                raise TypeError(
                    f"Streaming reassigns positions inside the cache, which this model's keys cannot follow "
                    f"({_FIXED_POSITIONS}). Use a model with rotary embeddings in that layout (Llama, Mistral, Qwen, "
                    "Gemma, ...) or a non-streaming cache."
                )
            streaming.validate(spec.config, spec.max_positions, spec.rotation.max_positions)
        layers = (
            [MemoryLayer() for _ in range(spec.num_layers)]
            if streaming is None
            else [StreamingLayer() for _ in range(spec.num_layers)]
        )
        super().__init__(layers=layers)
        self.spec = spec
        # Its memory cap resolved (`StreamingConfig.for_adapter`): what fold_chunk evicts to and a saved file records.
        self.streaming = None if streaming is None else streaming.for_adapter(spec.config)
        self.rows = RowState.empty(batch_size)
        # The most tokens a row has taken in (`history_tokens`) or more, with the counters it holds for (see
        # `_known_history`).
        self._history: tuple[torch.Tensor, torch.Tensor, tuple[int, int], int] | None
        self._know_history(0)
        # Tokens fed since the stream or the current generate() began: what generate() must see as processed.
        self.turn_tokens = 0
        # Per row of a stream, `(batch, 4)` long on the CPU: its sink, memory and window tokens held, and its oldest
        # window tokens already compressed into memory (StreamingConfig.keep_window_full), evicted first. Rows differ
        # once a generate() reply of one ended before another's. Read with `tolist()`, which waits for no device.
        self.stream_lengths = torch.zeros(batch_size, 4 if streaming is not None else 0, dtype=torch.long)
        # During generate() on a stream: `(batch,)` long on the CPU, how many of the call's tokens (`turn_tokens`) each
        # row takes, its prompt and its reply; the rest is the padding of a reply that ended before the others' (None:
        # all). Asked at each stage of a forward, so it reads the device at most once per decoding step.
        self.row_ends: Callable[[], torch.Tensor | None] | None = None
        # The claimant running calls on this cache and how deeply they nest (None: free); see `transaction`.
        self._user: tuple[_Claimant, int] | None = None
        # The model call running on this cache (None: none); see `running`.
        self._call: str | None = None
        # Whether the base model's forwards may run on the cache (see `forwarding`).
        self._forwarding = False
        # Whether a stream keeps the autograd graph of its forwards from one call to the next (`end_stream_call`).
        self._keeps_graph = False
        # Forwards of the base model running on the cache now (nested: a stream's leading pieces); see `check_whole`.
        self._forwards_running = 0

    @property
    def config(self) -> CCMConfig:
        """The adapter configuration of the model that made this cache, as it was then (it refuses changes)."""
        return self.spec.config

    @property
    def signature(self) -> dict[str, Any]:
        """The memory signature of the model that made this cache (`CCMForCausalLM.memory_signature()`)."""
        return self.spec.signature

    @property
    def rotation(self) -> KeyRotation | None:
        """What moves this model's keys to other positions, or None where they cannot be moved exactly."""
        return self.spec.rotation

    @property
    def max_positions(self) -> int | None:
        """The model's `max_position_embeddings` (None: no limit)."""
        return self.spec.max_positions

    # ----- per-row views -----------------------------------------------------------------------------------------
    @property
    def memory_mask(self) -> torch.Tensor:
        """`(batch, memory_length)` bool: the memory slots each row owns."""
        return self.rows.memory_mask

    @property
    def turn_mask(self) -> torch.Tensor:
        """`(batch, turn_length)` bool: the real (non-padding) tokens of the current turn."""
        return self.rows.turn_mask

    @property
    def next_position(self) -> torch.Tensor:
        """`(batch,)` long: the logical ("skip") position of each row's next token."""
        return self.rows.next_position

    @property
    def steps(self) -> torch.Tensor:
        """`(batch,)` long: contexts (streaming: chunks) each row has compressed."""
        return self.rows.steps

    @property
    def history_tokens(self) -> torch.Tensor:
        """`(batch,)` long: the ordinary tokens (contexts, inputs, replies; no `<COMP>` slot) each row has taken in
        (a stream: every token fed, compressed, evicted or still held), what a full-context model would hold for the
        same history. Re-basing positions does not change it, and it survives `save` and `load`."""
        return self.rows.next_position + self.rows.rebased

    @property
    def pending_ids(self) -> torch.Tensor:
        """`(batch, 0 or 1)` long: the token `generate()` produced last, which has no keys/values yet."""
        return self.rows.pending_ids

    @property
    def pending_mask(self) -> torch.Tensor:
        """`(batch, 0 or 1)` bool: whether each row's pending token is real (not padding)."""
        return self.rows.pending_mask

    # ----- sizes -------------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Rows (users) of the cache."""
        return self.rows.next_position.shape[0]

    @property
    def memory_length(self) -> int:
        """Memory slots held per row (rows of a batch may own fewer; see `memory_mask`)."""
        return self.rows.memory_mask.shape[1]

    @property
    def turn_length(self) -> int:
        """Tokens of the current turn held (input and generated tokens not yet folded)."""
        return self.rows.turn_mask.shape[1]

    @property
    def has_unfolded_turn(self) -> bool:
        """Whether the cache holds turn tokens (or a pending generated token) that `compress` has not folded."""
        return bool(self.turn_length or self.rows.pending_ids.shape[1])

    @property
    def sink_length(self) -> int:
        """Sink tokens held (the most of any row; 0 unless streaming)."""
        return self._most_of_a_row(0)

    @property
    def window_length(self) -> int:
        """Window tokens held (the most of any row; 0 unless streaming)."""
        return self._most_of_a_row(2)

    @property
    def compressed_in_window(self) -> int:
        """Oldest window tokens already compressed into memory (`StreamingConfig.keep_window_full`; the most of any
        row; 0 unless streaming)."""
        return self._most_of_a_row(3)

    def _most_of_a_row(self, column: int) -> int:
        return max(self.stream_lengths[:, column].tolist()) if self.streaming is not None else 0

    @property
    def kv_length(self) -> int:
        """Physical key/value length of every layer: memory plus turn (streaming: sink, memory and window of the
        row that holds the most)."""
        if self.streaming is not None:
            return max(self.kv_lengths.tolist())
        return self.memory_length + self.turn_length

    @property
    def kv_lengths(self) -> torch.Tensor:
        """`(batch,)` long: the key/value slots each row holds in every layer: the memory slots it owns and its real
        turn tokens (streaming: its sink, memory and window, its first slots, at positions `0..n-1`)."""
        if self.streaming is not None:
            return self.stream_lengths[:, :3].sum(dim=1)
        return (self.rows.memory_mask.sum(dim=1) + self.rows.turn_mask.sum(dim=1)).cpu()

    @property
    def max_forward_tokens(self) -> int | None:
        """The most new tokens one forward takes (longer inputs run in pieces); None for no limit."""
        return self.streaming.max_forward_tokens if self.streaming is not None else None

    @property
    def runs_last_generated_token(self) -> bool:
        """Whether `generate()` must run its last token at once (a stream holds every token), rather than leave
        it pending for `compress` to fold."""
        return self.streaming is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """What `generate()` counts as processed: the current turn (streaming: the tokens of the current call); the
        memory is a prefix it must not count."""
        if self.streaming is not None:
            return self.turn_tokens
        return super().get_seq_length(layer_idx)

    def memory_bytes(self) -> int:
        """Bytes of the per-user state between turns over all layers: the memory keys and values (streaming:
        everything held, with the float32 keys of a half-precision stream), and the float32 merge/EMA average where
        it is not the memory itself."""
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in self.layers
            if layer.is_initialized
            for tensor in layer.held().values()
        )

    # ----- transactions ------------------------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Within the context, any exception (an interrupt included) restores the cache exactly as it was.

        Cheap: the cache replaces tensors instead of changing them, so keeping references suffices. The calling
        thread or asyncio task holds the cache until the context ends (transactions nest within it, across its
        `await`s); another thread or task that tries to use it meanwhile gets a `ValueError` instead of interleaving
        its changes (or a failure's restore) with these.
        """
        with self._claimed():
            states = [self.__dict__, *(layer.__dict__ for layer in self.layers)]
            saved = [dict(state) for state in states]
            try:
                yield
            except BaseException:
                for state, backup in zip(states, saved, strict=True):
                    # Not cleared first: another thread's `check_free` must see the claim throughout.
                    for name in state.keys() - backup.keys():
                        del state[name]
                    state.update(backup)
                raise

    @contextmanager
    def running(self, call: str) -> Iterator[None]:
        """A model call named `call` (`compress()`, `generate()`, an online forward) on the cache, as one transaction.

        Another call on the cache from inside it, in the same thread, is refused with a `ValueError` before it changes
        anything: a streamer or stopping criterion of `generate()` that folded or extended the turn under the running
        call failed deep inside torch, or left the reply's tokens out of order in the turn.
        """
        with self.forwarding():
            self.check_no_call(call)
            self._call = call
            try:
                yield
            finally:
                self._call = None

    @contextmanager
    def forwarding(self) -> Iterator[None]:
        """A transaction in which the base model's forwards may run on the cache (`check_held`): a model call's
        (`running`), or `generate()`'s on the expanded copy that beam search runs on, where `running` would refuse
        the `reorder_cache` of transformers' beam search."""
        with self.transaction():
            before, self._forwarding = self._forwarding, True
            try:
                yield
            finally:
                self._forwarding = before

    @contextmanager
    def _claimed(self) -> Iterator[None]:
        """Hold the cache for the calling thread or asyncio task within the context (nested claims by it are fine).

        Not held by the thread alone: asyncio tasks share their thread, and a task's claim taken while another task
        was suspended inside its `transaction` (at an `await`) passed as nested in it. A failure of the first task
        then restored the cache over the second's calls, which had returned without an error, and left the cache
        claimed for ever. Nor by the context alone: a task created inside a transaction copies its context, and its
        claims passed as nested in a transaction that could end (or restore the cache) under them; one that ended
        after it left the cache claimed for ever."""
        claimant = _own_claimant()
        made = None
        if claimant is None:
            claimant = _Claimant(threading.get_ident(), _current_task(), _CLAIMANT.get())
            made = _CLAIMANT.set(claimant)
        try:
            with _CLAIMS:
                self.check_free()
                depth = self._user[1] if self._user is not None else 0
                self._user = claimant, depth + 1
            try:
                yield
            finally:
                with _CLAIMS:
                    self._user = (claimant, depth) if depth else None
        finally:
            if made is not None:
                _CLAIMANT.reset(made)

    def _claimed_here(self) -> bool:
        """Whether the calling thread or task holds the cache (`_claimed`)."""
        user = self._user
        return user is not None and user[0] is _own_claimant()

    def check_no_call(self, call: str) -> None:
        """Raise if a model call runs on this cache in the calling thread or task, which `call` would be made from
        inside."""
        running = self._call
        if running is not None and self._claimed_here():
            raise ValueError(
                f"{call} was called on a CompressedMemoryCache that its own running {running} is using (from a "
                f"streamer or stopping criterion, say); make the call after {running} returns."
            )

    def check_held(self) -> None:
        """Raise unless a model call of the calling thread or task holds the cache (`forwarding`): the base model's
        forward (its pre-hook that runs the cache) given it directly, not through the `CCMForCausalLM` calls, ran
        outside any transaction (a failure, an interrupt, left some layers holding the new tokens, and another thread's
        call could interleave with it), or inside a bare `transaction()` without the calls' checks (another model's
        base model wrote its keys into the turn, which the cache's model then folded into its memory)."""
        if not self._forwarding or not self._claimed_here():
            raise ValueError(
                "A CompressedMemoryCache was given to the wrapped base model (model.base_model) itself, which runs it "
                "without the checks and the transaction of the CCM model's calls (a failure would leave it half "
                "updated). Give it to the CCMForCausalLM instead: model(...), model.generate() or model.compress()."
            )

    @contextmanager
    def running_forward(self) -> Iterator[None]:
        """Within the context the cache is half updated, as inside a forward on it (`check_whole` refuses copies and
        saves): from a forward whose keys join the turn until the call settles them (`fold`, `end_generation`), where
        the base model's own forward hooks run."""
        self.forward_began()
        try:
            yield
        finally:
            self.forward_ended()

    def forward_began(self) -> None:
        """A forward of the base model began on the cache (its pre-hook): copies and saves are refused until
        `forward_ended` (a failure in between restores the count with the cache's transaction)."""
        self._forwards_running += 1

    def forward_ended(self) -> None:
        """A forward of the base model stored its tokens in every layer of the cache (its forward hook)."""
        self._forwards_running -= 1

    def check_whole(self, call: str) -> None:
        """Raise if a forward of the model runs on the cache (`forward_began`): `call`, from a hook on one of the
        model's layers, read the cache half updated, with the forward's tokens in some layers and not yet in others.
        Another thread's call is refused by the claim."""
        if self._forwards_running:
            raise ValueError(
                f"{call} was called from inside a forward of its model on this CompressedMemoryCache (a hook on one of "
                "the model's layers, say), where some layers hold the forward's tokens and others do not yet: a copy "
                "or file of it would be corrupt. Make the call after the call returns, or from a streamer or stopping "
                "criterion of generate(), which run between its forwards."
            )

    def check_free(self) -> None:
        """Raise if another thread or asyncio task is running a call on this cache (a cache is one user's state)."""
        user = self._user
        if user is None or self._claimed_here():
            return
        holder = user[0]
        if _shares_context(holder) and holder.thread == threading.get_ident():
            # Tasks of one thread, one created inside the other's transaction (asyncio.create_task, gather): that
            # transaction could end, or restore the cache, under the other's calls.
            raise ValueError(
                "This CompressedMemoryCache is held by the cache.transaction() of another asyncio task, one of the two "
                "created inside the other's `with cache.transaction():` block (asyncio.create_task or gather there), "
                "whose end or failure would leave the cache claimed or restore it under the other's calls. Make a "
                "transaction's calls in the task that holds it (await the coroutine itself, not a task of it), or "
                "after its `with` block."
            )
        if _shares_context(holder):
            # The claimant travels with a copied context (asyncio.to_thread copies the task's): a call sent to a thread
            # from inside a transaction, which would restore the cache under it if the holder failed (or its task were
            # cancelled) meanwhile; or the other way round.
            raise ValueError(
                "This CompressedMemoryCache is in use by another thread that shares this one's claims: one runs with "
                "the context of the other's cache.transaction(), as asyncio.to_thread copies a task's context. A "
                "transaction's calls run in the thread that holds it: run the whole transaction in one thread, await "
                "asyncio.to_thread(turn), with the `with cache.transaction():` block inside turn."
            )
        raise ValueError(
            "This CompressedMemoryCache is in use by a call in another thread (or asyncio task). A cache holds one "
            "user's memory: give each thread (or user) its own cache, or hold a lock per cache around its calls."
        )

    # ----- the online forward ------------------------------------------------------------------------------------
    def prepare_forward(self, new_mask: torch.Tensor, sdpa: bool) -> tuple[torch.Tensor, Any]:
        """Register `new_mask.shape[1]` new tokens of the turn and describe how they attend.

        Args:
            new_mask: `(batch, new)` bool, False at padding.
            sdpa: whether the model attends with sdpa now, whose mask code makes the mask of one token that sees
                every held position itself (and then picks its fastest kernel); eager attention needs it given.
                Told at every forward: the model's attention may have been switched since the cache was made.

        Returns:
            position_ids `(batch, new)` (logical positions) and the attention mask
            `(batch, 1, new, held + new)` bool (a dict by layer type for models that mix sliding and full
            layers), or None for one token that sees everything held (when the model's own mask code handles
            that case: `sdpa`, and no sliding layers).
        """
        self.check_batch_size(new_mask.shape[0], "the input")
        self._to(new_mask.device)
        if self.streaming is not None:
            prepared = self._prepare_stream_forward(new_mask, sdpa)
        else:
            prepared = self._prepare_turn_forward(new_mask, sdpa)
        for layer in self.layers:
            layer.announced = new_mask.shape[1]
        return prepared

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys/values of the tokens `prepare_forward` registered, in the model's dtype; refuse any others:
        a model that did not register them (the plain base model, or any model other than the `CCMForCausalLM` that
        made this cache) would add keys/values that the per-row state does not know of, corrupting the memory. Under
        `torch.autocast` the projections give keys/values in the autocast dtype, and a memory saved in it was a file
        that `load` refuses."""
        layer = self.layers[layer_idx]
        new = key_states.shape[-2]
        if new != layer.announced:
            raise ValueError(
                f"This CompressedMemoryCache was given keys/values of {new} tokens that its CCMForCausalLM did not "
                "register: it was passed to another model (the plain base model, say). Run it through the "
                "CCMForCausalLM that made it (model(...), model.generate(...), model.compress(...)); a plain model "
                "takes a DynamicCache."
            )
        layer.announced = 0
        dtype = self.spec.dtype
        return super().update(key_states.to(dtype), value_states.to(dtype), layer_idx, *args, **kwargs)

    def _prepare_turn_forward(self, new_mask: torch.Tensor, sdpa: bool) -> tuple[torch.Tensor, Any]:
        """`prepare_forward` for compressed memory: the new tokens join the turn at each row's next positions."""
        counts = new_mask.sum(-1)
        most = self._check_history(counts, new_mask.shape[1])
        if self.max_positions is not None and most > self.max_positions:  # a row's next position is at most `most`
            self._fit_positions(counts)
        rows = self.rows
        position_ids = (rows.next_position[:, None] + new_mask.long().cumsum(-1) - 1).clamp(min=0)
        past = torch.cat([rows.memory_mask, rows.turn_mask], dim=1)
        sees_everything = self._mask_free(sdpa, new_mask.shape[1]) and bool(new_mask.all() & past.all())
        mask = None if sees_everything else _attend_past_then_causal(past, new_mask)
        if self.spec.sliding_window is not None:
            # The turn's tokens take consecutive positions up to the next one; memory is never out of the window.
            turn_positions = (rows.next_position - rows.turn_mask.sum(-1))[:, None] + rows.turn_mask.cumsum(-1) - 1
            memory = torch.full_like(rows.memory_mask, ALWAYS_VISIBLE, dtype=torch.long)
            key_positions = torch.cat([memory, turn_positions, position_ids], dim=1)
            mask = self.spec.sliding_window.apply(mask, position_ids, key_positions)
        self.rows = replace(
            rows, turn_mask=torch.cat([rows.turn_mask, new_mask], dim=1), next_position=rows.next_position + counts
        )
        self._know_history(most)
        return position_ids, mask

    def _check_history(self, counts: torch.Tensor, new: int) -> int:
        """Raise unless every row can take its `counts` `(batch,)` more tokens of a forward of `new` within the most a
        memory counts (a saved memory past it does not load); returns the bound `history_tokens` will then keep
        (`_know_history`)."""
        known = self._known_history()
        most = (int(self.history_tokens.max()) if known is None else known) + new
        # The counters are read from the device only near the bound (or, just above, once they were set elsewhere);
        # subtracted, not added: the sum could overflow.
        if most > MOST_HISTORY_TOKENS and bool((self.history_tokens > MOST_HISTORY_TOKENS - counts).any()):
            raise ValueError(
                f"This memory's rows have taken in {self.history_tokens.tolist()} tokens; {counts.tolist()} more would "
                f"pass the most a memory counts ({MOST_HISTORY_TOKENS}). Start a new cache for these users."
            )
        return most

    def _known_history(self) -> int | None:
        """The most tokens a row has taken in (or more), kept as the forwards add tokens (at most their width), so
        that a forward checks the bound without reading the counters from the device; None once the counters were
        set otherwise (loaded, rows selected or moved, changed in place), which must then be read."""
        rows, known = self.rows, self._history
        positions, rebased = rows.next_position, rows.rebased
        if known is None or known[0] is not positions or known[1] is not rebased:
            return None
        return known[3] if known[2] == (positions._version, rebased._version) else None

    def _know_history(self, most: int | None) -> None:
        """Record that no row of the current counters has taken in more than `most` tokens (None: unknown)."""
        positions, rebased = self.rows.next_position, self.rows.rebased
        # Tensors made under torch.inference_mode() keep no version counter, so a change in place to them goes unseen:
        # their bound is left unknown.
        if most is None or positions.is_inference() or rebased.is_inference():
            self._history = None
            return
        self._history = positions, rebased, (positions._version, rebased._version), most

    def _mask_free(self, sdpa: bool, new: int) -> bool:
        """Whether a forward of `new` tokens that see every held position may go without an attention mask."""
        return sdpa and self.spec.sliding_window is None and new == 1

    def check_reply_room(self, prompt_counts: torch.Tensor, max_new_tokens: int) -> None:
        """Raise unless each row's prompt of `prompt_counts` `(batch,)` tokens, a reply of up to `max_new_tokens` and
        its compression fit the model's positions, where they cannot be re-based: generate() failed part way through,
        or the reply ended where it could not be folded, and the cache was stuck (generate() asks for that fold)."""
        if self.max_positions is None or self.spec.rebase_rotation is not None or self.streaming is not None:
            return
        # generate() runs the prompt and every generated token but the last; compress runs that one and the <COMP>s.
        positions = self.rows.next_position
        before_reply = int((positions + prompt_counts.to(positions.device)).max()) + self.config.num_comp_tokens
        end = before_reply + max_new_tokens
        if end <= self.max_positions:
            return
        most = self.max_positions - before_reply
        fix = (
            f"give max_new_tokens={most} or less"
            if most > 0
            else "shorten the prompt, or start a new cache for this user"
        )
        raise ValueError(
            f"A prompt of {prompt_counts.tolist()} token(s) after this memory (next positions "
            f"{positions.tolist()}), a reply of up to {max_new_tokens} tokens and its compression "
            f"({self.config.num_comp_tokens} <COMP> tokens) would reach position {end - 1}, past the model's "
            f"{self.max_positions} positions, which cannot be moved ({_FIXED_POSITIONS}); {fix}."
        )

    def _fit_positions(self, counts: torch.Tensor) -> None:
        """Re-base rows whose next positions would pass the model's maximum (rotary models: exact, since
        attention depends on relative positions only); refuse where positions cannot move."""
        end = self.rows.next_position + counts
        if not bool((end > self.max_positions).any()):
            return
        if int(counts.max()) > self.max_positions:
            raise ValueError(self._too_long(int(counts.max())))
        rotation = self.spec.rebase_rotation
        if rotation is None:
            raise ValueError(
                f"This input would reach position {int(end.max()) - 1} after this memory's history, past the model's "
                f"{self.max_positions} positions, which cannot be moved ({_FIXED_POSITIONS}). Start a new cache for "
                "this user, or use a model with rotary position embeddings in that layout (positions are then re-based "
                "automatically)."
            )
        # Back to half the positions, so that re-basing is rare; further where the input needs more room: an input
        # of more than half the positions that fits them was refused after any history.
        start = (self.max_positions - counts).clamp(max=self.max_positions // 2)
        delta = torch.where(end > self.max_positions, self.rows.next_position - start, 0)
        for index, layer in enumerate(self.layers):
            if layer.is_initialized:
                layer.rebase(rotation, index, -delta)
        self.rows = replace(self.rows, next_position=self.rows.next_position - delta, rebased=self.rows.rebased + delta)
        logger.info("Re-based the positions of %d row(s) by up to %d.", int((delta > 0).sum()), int(delta.max()))

    def _too_long(self, count: int) -> str:
        """Why an input of `count` new tokens cannot run after any history, and how the running call (`running`) can
        take it instead: each piece of a turn runs after the history, re-based, but a prompt or a context is one."""
        most, n = self.max_positions, self.config.num_comp_tokens
        if self._call == "compress()":
            return (
                f"A context of {count - n} tokens and its {n} <COMP> tokens pass the model's {most} positions; "
                f"compress it as several contexts of at most {most - n} tokens each."
            )
        if self._call == "generate()":
            return (
                f"A prompt of {count} tokens passes the model's {most} positions; shorten it, or compress its "
                "beginning first (model.compress(cache, beginning_ids)) and generate from the rest."
            )
        return (
            f"An input of {count} tokens passes the model's {most} positions; pass it in pieces of at most {most} "
            "tokens (each model(...) call continues the turn)."
        )

    def begin_generation(self) -> None:
        """Start a `generate()` call: a stream counts its tokens from zero again; memory must be folded first."""
        if self.streaming is not None:
            self.turn_tokens = 0
        elif self.has_unfolded_turn:
            raise ValueError(
                "The cache holds a turn that was not folded; call model.compress(cache) before the next generate()."
            )

    def end_generation(self, generated: torch.Tensor, lengths: torch.Tensor) -> None:
        """Record the tokens `generate()` produced: each row's first `lengths` ones are its reply, those after it the
        padding of a row that finished before the others; the last token is pending (no keys/values yet).

        Args:
            generated: `(batch, new_tokens)` the generated ids (prompt excluded).
            lengths: `(batch,)` each row's reply length, at most `new_tokens`.
        """
        if generated.shape[1] == 0:
            return
        rows = self.rows
        device = rows.next_position.device
        real = torch.arange(generated.shape[1], device=device) < lengths.to(device)[:, None]
        fed = generated.shape[1] - 1
        split = rows.turn_mask.shape[1] - fed
        kept, last = rows.turn_mask[:, :split], rows.turn_mask[:, split:]
        known = self._known_history()  # still a bound: padding leaves the history
        self.rows = replace(
            rows,
            turn_mask=torch.cat([kept, last & real[:, :fed]], dim=1),
            next_position=rows.next_position - (~real[:, :fed]).sum(-1),
            # A copy: a view would share the ids generate() returns, and a caller's change to them in place (padding
            # its end token, say) changed the token that compress() folds.
            pending_ids=generated[:, fed:].to(device, copy=True),
            pending_mask=real[:, fed:],
        )
        self._know_history(known)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending token `(batch, 0 or 1)` and its mask, now handed to the caller to run."""
        rows = self.rows
        self.rows = replace(rows, pending_ids=rows.pending_ids[:, :0], pending_mask=rows.pending_mask[:, :0])
        return rows.pending_ids, rows.pending_mask

    def check_compressible(self) -> None:
        """Raise for a streaming cache, which compresses by itself."""
        if self.streaming is not None:
            raise ValueError(
                "A streaming cache compresses by itself when its window overflows; feed the text with model(...) "
                "or model.generate(...) instead of compress()."
            )

    def fold(self, num_comp_tokens: int, rows: torch.Tensor) -> None:
        """Turn the last `num_comp_tokens` keys/values (the `<COMP>` block just run) into memory.

        Args:
            rows: `(batch,)` bool, the rows that had a context; the others keep their memory unchanged.
        """
        n, config, state = num_comp_tokens, self.config, self.rows
        rows = rows.to(state.memory_mask.device)
        steps = _folded(state.steps, rows)
        if config.update == "concat":
            keep = torch.cat([state.memory_mask, rows[:, None].expand(-1, n)], dim=1)
            if config.max_memory_tokens is not None:
                newest_first = keep.flip(-1).long().cumsum(-1).flip(-1)
                keep = keep & (newest_first <= config.max_memory_tokens)
            # Each row keeps its own slots, oldest first; the width is the most any row keeps, so a cap bounds
            # every row (slot order does not matter to attention: keys carry their positions).
            width = int(keep.sum(dim=1).max())
            slots = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)[:, :width]
            for layer in self.layers:
                layer.fold_concat(n, slots)
            memory_mask = keep.gather(1, slots)
        else:
            coefficient = torch.tensor(
                [update_coefficient(max(int(step), 1), config) for step in steps.tolist()], device=rows.device
            )
            weight = torch.where(rows, coefficient, torch.zeros((), device=rows.device))
            for layer in self.layers:
                layer.fold_average(n, weight)
            owned = rows[:, None].expand(-1, n)
            memory_mask = owned.clone() if self.memory_length == 0 else state.memory_mask | owned
        _check_finite_memory([tensor for layer in self.layers for tensor in layer.memory()])
        known = self._known_history()  # still a bound: the <COMP> tokens leave the history
        # <COMP> tokens take positions but do not advance the logical position (the "skip" scheme).
        self.rows = replace(
            state,
            memory_mask=memory_mask,
            turn_mask=state.turn_mask[:, :0],
            next_position=state.next_position - n,
            steps=steps,
        )
        self._know_history(known)

    # ----- streaming ---------------------------------------------------------------------------------------------
    def _prepare_stream_forward(self, new_mask: torch.Tensor, sdpa: bool) -> tuple[torch.Tensor, Any]:
        """Append the new tokens after each row's own slots, at its next positions; they attend to all of it
        (sliding layers: see `_stream_mask`). A row whose `generate()` reply ended takes none of those after it
        (`_stream_counts`)."""
        streaming = self._streaming()
        self.check_unpadded(new_mask)
        new = new_mask.shape[1]
        counts, to_sink, excess = self._stream_growth(new)
        sink, memory, window, compressed = self.stream_lengths.unbind(1)
        if any((excess > 0).tolist()):
            raise ValueError(
                f"{new} new tokens do not fit the streaming window ({window.tolist()} of {streaming.window_tokens} "
                "held); run the base model through CCMForCausalLM, which makes room first."
            )
        device = new_mask.device
        most = self._check_history(counts.to(device), new)
        held = sink + memory + window
        queries = torch.arange(new)
        position_ids = (held[:, None] + queries).to(device)
        self.turn_tokens += new
        # A stream's positions are those of what it holds; `next_position` only counts its tokens (`history_tokens`).
        self.rows = replace(self.rows, next_position=self.rows.next_position + counts.to(device))
        self._know_history(most)
        self.stream_lengths = torch.stack([sink + to_sink, memory, window + counts - to_sink, compressed], dim=1)
        uniform = len(set(held.tolist())) == 1 and set(counts.tolist()) == {new}
        placement = None
        if not uniform:  # each row's new tokens right after its own slots
            after = torch.full_like(held, self._held_width())  # the new tokens follow the longest row's slots
            index, _, valid = _layout([(torch.zeros_like(held), held, held), (after, counts, held)], device)
            placement = index, valid
        for layer in self.layers:
            layer.placement = placement
        if uniform and self._mask_free(sdpa, new):
            return position_ids, None
        slots = torch.arange(max((held + counts).tolist()))
        # A row's query sees its own slots and new tokens up to itself; one past the tokens it takes (padding), those.
        seen = held[:, None] + torch.minimum(queries + 1, counts[:, None])
        mask = (slots[None, None, :] < seen[:, :, None])[:, None].to(device)
        return position_ids, self._stream_mask(mask, position_ids, self._key_positions(slots))

    def _held_width(self) -> int:
        """The length of every layer's keys/values: the most slots a row holds, or more once that row left the
        batch."""
        layer = self.layers[0]
        return layer.keys.shape[2] if layer.is_initialized and layer.keys.ndim == 4 else 0

    def _stream_growth(self, new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(batch,)` long each, on the CPU, for the `new` tokens of a forward: how many each row takes
        (`_stream_counts`), how many of those fill its sink, and how far its window would then pass `window_tokens`
        (negative: room left)."""
        streaming = self._streaming()
        counts = self._stream_counts(new)
        sink, _, window, _ = self.stream_lengths.unbind(1)
        to_sink = torch.minimum(counts, streaming.sink_tokens - sink)
        return counts, to_sink, window + counts - to_sink - streaming.window_tokens

    def _stream_counts(self, new: int) -> torch.Tensor:
        """`(batch,)` long on the CPU: how many of the `new` tokens of a forward each row takes, its first ones: all,
        but none past the end of a `generate()` reply (`row_ends`: those are transformers' padding)."""
        ends = self.row_ends() if self.row_ends is not None else None
        if ends is None:
            return torch.full((self.batch_size,), new, dtype=torch.long)
        return (ends - self.turn_tokens).clamp(min=0, max=new)

    def _key_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """`(batch, len(slots))` long: the positions of the held `slots` (`(n,)` long) of each row, its memory slots
        at `ALWAYS_VISIBLE`: a sliding window never hides them."""
        sink, memory = self.stream_lengths[:, 0, None], self.stream_lengths[:, 1, None]
        in_memory = (slots >= sink) & (slots < sink + memory)
        return torch.where(in_memory, ALWAYS_VISIBLE, slots[None])

    def _stream_mask(self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> Any:
        """The attention mask of a stream's queries (`mask` `(batch, 1, q, k)` bool): for a model with sliding-window
        layers (a dict by layer type where it mixes them), those see the sink and window tokens less than their window
        back, and the memory always, as in a turn (`_prepare_turn_forward`): given the whole stream, they attended far
        past the window the model was trained with."""
        window = self.spec.sliding_window
        if window is None:
            return mask
        device = mask.device
        return window.apply(mask, query_positions.to(device), key_positions.to(device))

    def input_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The attention mask that new tokens of a forward keep: a stream takes unpadded input only (checked),
        so it needs none."""
        if self.streaming is None or attention_mask is None:
            return attention_mask
        self.check_unpadded(attention_mask)
        return None

    def check_unpadded(self, mask: torch.Tensor) -> None:
        """Raise if an attention mask of a streaming input has padding."""
        if not mask.bool().all():
            raise ValueError(
                "A streaming cache takes unpadded input: every row is a stream of the same length. Feed rows of "
                "different lengths as separate streams."
            )

    def _streaming(self) -> StreamingConfig:
        if self.streaming is None:
            raise ValueError("This is not a streaming cache; create one with model.new_cache(streaming=...).")
        return self.streaming

    def end_stream_call(self) -> None:
        """Detach what a stream holds from the autograd graph of the call that ended (a forward outside
        `torch.no_grad()`): each call moves and merges the keys the last one left, so the stream kept the graph, and
        the activations it saves, of every call before, growing with each one however bounded the stream. Training
        through a stream (`stream_training.stream_loss`) sets `_keeps_graph` to reach earlier calls' compressions."""
        if self.streaming is not None and not self._keeps_graph:
            for layer in self.layers:
                layer.map_rows(torch.Tensor.detach)

    def rows_to_compress(self, new: int) -> torch.Tensor | None:
        """`(batch,)` bool on the CPU: the rows whose oldest window chunk must be compressed before the `new` tokens
        of a forward fit; None where none must (and never for a non-streaming cache)."""
        if self.streaming is None or not self.streaming.compress:
            return None
        _, _, excess = self._stream_growth(new)
        _, _, window, compressed = self.stream_lengths.unbind(1)
        rows = (excess > compressed) & (window - compressed >= self.streaming.compress_chunk)
        return rows if any(rows.tolist()) else None

    def evict_compressed(self, rows: torch.Tensor) -> None:
        """Drop the window tokens of `rows` `(batch,)` bool already compressed (`StreamingConfig.keep_window_full`),
        so that their next chunk follows the memory; called before a compression, which happens only once they must
        all leave."""
        counts = torch.where(rows, self.stream_lengths[:, 3], 0)
        if any(counts.tolist()):
            self._drop_oldest(counts)

    def compression_prefix(self, rows: torch.Tensor) -> tuple[DynamicCache, torch.Tensor, Any]:
        """What the `<COMP>` tokens of the next compression of `rows` `(batch,)` bool attend to: each row's sink,
        memory and oldest chunk (the other rows, whose `<COMP>` tokens are run and dropped, some of their slots).

        Returns:
            a `DynamicCache` holding those keys/values (views of this cache's tensors), the `<COMP>` positions
            `(batch, n_comp)` (right after each row's chunk) and their attention mask `(batch, 1, n_comp, prefix +
            n_comp)` (`_stream_mask`).
        """
        ends = self._chunk_ends(rows)
        length = max(ends.tolist())
        prefix = DynamicCache(ddp_cache_data=[layer.prefix(length) for layer in self.layers])
        n = self.config.num_comp_tokens
        device = self.layers[0].keys.device
        comp = torch.arange(n)
        position_ids = ends[:, None] + comp
        slots = torch.arange(length)
        held = (slots[None, :] < ends[:, None])[:, None].expand(-1, n, -1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(self.batch_size, -1, -1)
        mask = torch.cat([held, causal], dim=-1)[:, None]
        key_positions = torch.cat([self._key_positions(slots), position_ids], dim=1)
        return prefix, position_ids.to(device), self._stream_mask(mask.to(device), position_ids, key_positions)

    def _chunk_ends(self, rows: torch.Tensor) -> torch.Tensor:
        """`(batch,)` long: the end of each row's sink, memory and oldest chunk, where its `<COMP>` tokens go (a row
        not in `rows` `(batch,)` bool: at most its slots)."""
        sink, memory, window, _ = self.stream_lengths.unbind(1)
        ends = sink + memory + self._streaming().compress_chunk
        return torch.where(rows, ends, torch.minimum(ends, sink + memory + window))

    def fold_chunk(self, prefix: DynamicCache, rows: torch.Tensor) -> None:
        """Put the `<COMP>` keys/values just appended to `prefix` into the memory of `rows` `(batch,)` bool: appended
        after evicting the oldest slots beyond the cap (concat), or averaged into it in float32 (merge/EMA); drop
        their oldest window chunk (or keep it, `keep_window_full`, to be evicted as new tokens need room), and move
        everything to positions `0..n-1`."""
        streaming, rotation, n = self._streaming(), self.rotation, self.config.num_comp_tokens
        assert rotation is not None
        sink, memory, window, compressed = self.stream_lengths.unbind(1)
        held, source, chunk_end = sink + memory + window, self._held_width(), self._chunk_ends(rows)
        steps = _folded(self.rows.steps, rows)
        kept = sink + memory
        keep = streaming.keep_window_full
        rest = torch.where(rows & (not keep), chunk_end, kept)  # where each row's window goes on from
        zero = torch.zeros_like(sink)
        if self.config.update == "concat":
            evicted = torch.where(rows, (memory + n - streaming.max_memory_tokens).clamp(min=0), 0)
            added = torch.where(rows, n, 0)
            slots = memory - evicted + added
            pieces = [(zero, sink, zero), (sink + evicted, memory - evicted, sink + evicted)]
            pieces += [(torch.full_like(sink, source), added, chunk_end)]
            averages: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        else:
            coefficients = [
                update_coefficient(int(step), self.config) if slots else 1.0
                for step, slots in zip(steps.tolist(), memory.tolist(), strict=True)
            ]
            weight = torch.tensor(coefficients, dtype=torch.float32)
            slots = torch.where(rows | (memory > 0), n, 0)
            pieces = [(zero, sink, zero), (torch.full_like(sink, source), slots, sink)]
            averages = [
                self._fold_average(layer, index, compressed_layer, rows, weight, chunk_end)
                for index, (layer, compressed_layer) in enumerate(zip(self.layers, prefix.layers, strict=True))
            ]
        pieces.append((rest, held - rest, rest))
        index, delta, valid = _layout(pieces, self.layers[0].keys.device)
        for layer_idx, (layer, compressed_layer, average) in enumerate(
            zip(self.layers, prefix.layers, averages, strict=True)
        ):
            extra = average or (compressed_layer.keys[:, :, -n:].float(), compressed_layer.values[:, :, -n:])
            layer.rearrange(rotation, layer_idx, index, delta, valid, extra)
            if average is not None:  # zeros for a row without memory
                layer.accumulated = average
        window = torch.where(rows & (not keep), window - streaming.compress_chunk, window)
        compressed = torch.where(rows, streaming.compress_chunk if keep else 0, compressed)
        self.stream_lengths = torch.stack([sink, slots, window, compressed], dim=1)
        device = self.rows.steps.device
        memory_mask = torch.arange(max(slots.tolist()))[None] < slots[:, None]
        self.rows = replace(self.rows, steps=steps, memory_mask=memory_mask.to(device))
        _check_finite_memory(self._memory_tensors())

    def _fold_average(
        self,
        layer: StreamingLayer,
        layer_idx: int,
        compressed: DynamicLayer,
        rows: torch.Tensor,
        weight: torch.Tensor,
        chunk_end: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 merge/EMA memory `(batch, kv_heads, n, head_dim)` keys and values of one layer after `rows`
        fold the `<COMP>` keys/values at the end of `compressed` with `weight` `(batch,)` (1 where a row had none);
        zeros for a row that has none yet. The `<COMP>` keys are moved from after each row's chunk to its memory."""
        n, rotation = self.config.num_comp_tokens, self.rotation
        assert rotation is not None
        sink, memory = self.stream_lengths[:, 0], self.stream_lengths[:, 1]
        delta = (sink - chunk_end)[:, None].expand(-1, n)
        new = rotation.shift(layer_idx, compressed.keys[:, :, -n:].float(), delta), compressed.values[:, :, -n:].float()
        owned = (memory > 0).to(new[1].device)[:, None, None, None]
        has = (memory > 0)[:, None].expand(-1, n)
        memory_slots = layer.slots(torch.where(has, sink[:, None] + torch.arange(n), 0), has)
        old = _float_average(layer.accumulated, memory_slots)
        assert old is not None
        a = weight.to(new[1].device)[:, None, None, None]
        folding = rows.to(new[1].device)[:, None, None, None]
        return tuple(
            torch.where(folding, torch.where(owned, (1 - a) * past + a * fresh, fresh), past)
            for past, fresh in zip(old, new, strict=True)
        )

    def _memory_tensors(self) -> list[torch.Tensor]:
        """Every layer's memory keys and values, `(batch, kv_heads, memory_length, head_dim)` each, zeros past a
        row's own slots."""
        sink, memory = self.stream_lengths[:, 0, None], self.stream_lengths[:, 1, None]
        slots = torch.arange(self.memory_length)[None]
        index, valid = torch.where(slots < memory, sink + slots, 0), slots < memory
        return [tensor for layer in self.layers for tensor in layer.slots(index, valid)]

    def evict(self, new: int) -> None:
        """Drop each row's oldest window tokens so that its share of `new` more fits (StreamingLLM), moving the rest
        back."""
        if self.streaming is None:
            return
        excess = self._stream_growth(new)[2].clamp(min=0)
        if any(excess.tolist()):
            self._drop_oldest(excess)

    def _drop_oldest(self, counts: torch.Tensor) -> None:
        """Drop the `counts` `(batch,)` oldest window tokens of each row in every layer, compressed ones first."""
        rotation = self.rotation
        assert rotation is not None
        sink, memory, window, compressed = self.stream_lengths.unbind(1)
        kept = sink + memory
        zero = torch.zeros_like(kept)
        index, delta, valid = _layout(
            [(zero, kept, zero), (kept + counts, window - counts, kept + counts)], self.layers[0].keys.device
        )
        for layer_idx, layer in enumerate(self.layers):
            layer.rearrange(rotation, layer_idx, index, delta, valid)
        self.stream_lengths = torch.stack([sink, memory, window - counts, (compressed - counts).clamp(min=0)], dim=1)

    # ----- batch operations used by generate() -------------------------------------------------------------------
    def _map_batch(
        self,
        function: Callable[[torch.Tensor], torch.Tensor],
        call: str,
        indices: torch.Tensor | None = None,
        negative: bool = False,
    ) -> None:
        """Apply `function` to every per-row tensor; `indices`, the rows it selects (from the end too where
        `negative`), are checked first."""
        with self.transaction():  # whole or not at all, and never under another thread's call
            # Nor under a call of this thread (a streamer's): its rows would change users under the running call.
            self.check_no_call(call)
            if indices is not None:  # checked once claimed: the batch size cannot change before the selection
                _check_rows_in_range(indices, self.batch_size, call, negative)
            rows = self.rows.map(function)
            if rows.next_position.shape[0] == 0:
                # A cache of no row saves a file that `load` refuses, and every call on it fails inside torch.
                raise ValueError(
                    f"{call} would leave the cache no row; a cache holds at least one user. Keep at least one row, or "
                    "make a new cache with model.new_cache() when there is none left."
                )
            self.rows = rows
            self.stream_lengths = function(self.stream_lengths)
            for layer in self.layers:
                layer.map_rows(function)
            if self.streaming is not None:
                self._trim_stream()

    def _trim_stream(self) -> None:
        """Keep no slot past those of the longest row of a stream, and no memory slot past the most a row owns (rows
        were selected): as if those rows had been streamed alone."""
        width, slots = self.kv_length, max(self.stream_lengths[:, 1].tolist())
        self.rows = replace(self.rows, memory_mask=self.rows.memory_mask[:, :slots])
        for layer in self.layers:
            layer.trim(width, slots)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep row `beam_idx[i]` as row i (`(batch,)` long), as beam search does."""
        _check_row_indices(beam_idx, "cache.reorder_cache()")
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), "cache.reorder_cache()", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (`batch * repeats` rows), as generate() expands its inputs."""
        call = "cache.batch_repeat_interleave()"
        if not is_index(repeats):
            raise TypeError(f"{call} takes a whole number of copies per row, such as 2; got {repeats!r}.")
        count = operator.index(repeats)
        if count < 0:
            raise ValueError(f"{call} takes a number of copies per row of 1 or more, such as 2; got {count}.")
        self._map_batch(lambda t: t.repeat_interleave(count, dim=0), call)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` selects (long indices, or a `(batch,)` bool mask), in that order."""
        _check_row_indices(indices, "cache.batch_select_indices()", masks=True)
        self._map_batch(lambda t: t[indices.to(t.device)], "cache.batch_select_indices()", indices, negative=True)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: compressed memory cannot be cut back (assisted decoding crops rejected draft tokens)."""
        raise ValueError(
            "A CompressedMemoryCache cannot be cropped (assisted or speculative decoding); generate without an "
            "assistant model."
        )

    def reset(self) -> None:
        """Empty every row's memory (a stream: its sink, memory and window too), as `new_cache` makes a cache.

        transformers' `Cache.reset` drops only the layers' keys/values: the rows kept their memory slots and positions,
        and every later call failed deep inside torch. Refused while a call runs on the cache (in another thread, or
        the call of a streamer or stopping criterion that resets the cache)."""
        with self.running("cache.reset()"):
            fresh = CompressedMemoryCache(self.spec, self.batch_size, self.streaming)
            # One step: the new layers (copies keep the old ones, which are never zeroed), rows and stream counters.
            self.__dict__.update({**fresh.__dict__, "_user": self._user})

    def copy(self) -> CompressedMemoryCache:
        """A cache with the same content that changes independently (tensors are replaced, never changed, so
        they are shared until then). Refused while another thread runs a call on this cache, as `save` is."""
        clone = CompressedMemoryCache.__new__(CompressedMemoryCache)
        clone.__dict__.update(self.__getstate__())
        return clone

    def __copy__(self) -> CompressedMemoryCache:
        """`copy()`, for `copy.copy`: the default shallow copy shared the layers, so that a call on either changed the
        other, and escaped the claim of a call running on the cache in another thread."""
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> CompressedMemoryCache:
        """A copy with tensors of its own (`copy.deepcopy`), refused while another thread runs a call on this cache.

        Its keys/values are the values alone, as a pickle holds them: those of a forward run with gradients on (an
        adapter whose LoRA acts at every position) belong to that call's autograd graph, which torch does not
        deep-copy (it raised for every tensor not a leaf of the graph)."""
        clone = CompressedMemoryCache.__new__(CompressedMemoryCache)
        memo[id(self)] = clone
        state = self.__getstate__()
        for layer in state["layers"]:  # the state's own layers: detaching them leaves this cache's as they are
            layer.map_rows(torch.Tensor.detach)
        clone.__dict__.update(copy.deepcopy(state, memo))
        return clone

    def __getstate__(self) -> dict[str, Any]:
        """The content of one moment, without the claim: a copy (or a pickle) is a new cache, free whoever holds this
        one. Layers of their own, which this cache's calls do not change (its tensors are shared: they are replaced,
        never changed); refused while another thread runs a call on this cache, as `save` is: a pickle read the
        layers half updated."""
        with self._claimed():
            self.check_whole("Copying the cache (cache.copy(), copy.deepcopy, a pickle)")
            layers = []
            for layer in self.layers:
                twin = type(layer).__new__(type(layer))
                twin.__dict__.update(layer.__dict__)
                layers.append(twin)
            # Nor the reply ends of a generate() running on this cache, which would keep stopping rows of the copy.
            state = {**self.__dict__, "_user": None, "_call": None, "_forwarding": False, "row_ends": None}
            return {**state, "layers": layers}

    # ----- checks ------------------------------------------------------------------------------------------------
    def check_signature(self, signature: dict[str, Any]) -> None:
        """Raise unless `signature` (the model's) is the one this cache was made with."""
        differences = signature_differences(self.signature, signature, "cache")
        if differences:
            raise ValueError(
                f"This CompressedMemoryCache belongs to another model or adapter ({differences}). Create the cache "
                "with this model's new_cache(), or use it with the model (and adapter weights) that made it."
            )

    def check_batch_size(self, batch_size: int, what: str) -> None:
        """Raise unless `what` (an input of `batch_size` rows) has one row per cache row."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"{what} has batch size {batch_size} but the cache holds {self.batch_size} rows (one per user); "
                f"pass one row per cache row, or create the cache with new_cache(batch_size={batch_size})."
            )

    def check_device(self, device: torch.device) -> None:
        """Raise if the cache's keys/values live on another device than the model."""
        layer = self.layers[0]
        if layer.is_initialized and layer.keys.device != device:
            raise ValueError(
                f"The cache's keys/values are on {layer.keys.device} but the model is on {device}; keep a cache "
                "with the model that fills it (save it and load it for the other device)."
            )

    def _to(self, device: torch.device) -> None:
        if self.rows.next_position.device != device:
            self.rows = self.rows.map(lambda t: t.to(device))

    # ----- persistence -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the memory to a safetensors file whose header identifies the model and adapter. The file is
        replaced whole (a failed save keeps the earlier one); a symbolic link keeps leading to it.

        Refused while another thread runs a call on the cache: its layers would be read half updated."""
        with self._claimed():
            self.check_whole("cache.save()")
            self._save(path)

    def _save(self, path: str | os.PathLike[str]) -> None:
        target = os.path.abspath(checked_path(path, "path", "memory.safetensors"))
        if os.path.isdir(target):
            raise IsADirectoryError(f"{path} is a folder; save the memory to a file such as {path}/memory.safetensors.")
        existing = nearest_existing(os.path.dirname(target))
        if not os.path.isdir(existing):  # "create it" cannot be done: no folder can be made inside a file
            raise NotADirectoryError(f"{path} is inside {existing}, a file, not a folder; save the memory in a folder.")
        if not os.path.isdir(os.path.dirname(target)):
            raise FileNotFoundError(f"The folder of {path} does not exist; create it before saving the memory there.")
        if self.has_unfolded_turn:
            raise ValueError(
                "The cache holds an unfolded turn; call model.compress(cache) to fold it into memory before "
                "saving (only the compressed memory is stored)."
            )
        rows = self.rows
        tensors = {
            "memory_mask": rows.memory_mask,
            "next_position": rows.next_position,
            "steps": rows.steps,
        }
        if bool(rows.rebased.any()):  # only then: a file of a memory never re-based stays readable by earlier releases
            tensors["rebased"] = rows.rebased
        for index, layer in enumerate(self.layers):
            if layer.is_initialized:
                tensors.update({f"layers.{index}.{name}": tensor for name, tensor in layer.held().items()})
        header: dict[str, Any] = {"signature": self.signature}
        if self.streaming is not None:
            state = {
                "sink_length": self.sink_length,
                "memory_length": self.memory_length,
                "window_length": self.window_length,
                "turn_tokens": self.turn_tokens,
                "compressed_in_window": self.compressed_in_window,
            }
            lengths = self.stream_lengths
            # Only where rows differ (one's generate() reply ended first): other files stay readable by earlier
            # releases. Rows then hold the longest row's length, zeros past their own slots.
            if not bool((lengths == lengths[0]).all()):
                tensors["stream_lengths"] = lengths
                state["kv_length"] = self._held_width()
            header["streaming"] = {"config": asdict(self.streaming), "state": state}
        write_memory_file(path, tensors, header)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: CCMForCausalLM | CacheSpec) -> CompressedMemoryCache:
        """Read a memory written by `save` for `model` (a `CCMForCausalLM`, or its `cache_spec()`).

        Everything is checked before a cache is built: the file's format, that it was made by this base model
        (weights included) and adapter, and every tensor's name, dtype and shape. Any problem raises a
        `ValueError` that names it.
        """
        if not isinstance(model, CacheSpec) and not callable(getattr(model, "cache_spec", None)):
            raise TypeError(
                "CompressedMemoryCache.load() reads a memory for the model it was saved with: pass that CCMForCausalLM "
                f"(or its cache_spec()) as model, got {type(model).__name__}."
            )
        spec = model if isinstance(model, CacheSpec) else model.cache_spec()
        content = read_memory_file(path, spec)
        cache = cls(spec, content.batch_size, streaming=content.streaming)
        device = spec.device
        # Every row tensor on the model's device, those of the empty turn too: a call moves the rows only when their
        # positions are elsewhere (`_to`).
        held = {name: content.tensors[name] for name in ("memory_mask", "next_position", "steps")}
        held["rebased"] = content.tensors.get("rebased", torch.zeros_like(content.tensors["steps"]))
        cache.rows = replace(cache.rows, **held).map(lambda tensor: tensor.to(device))
        for index, layer in enumerate(cache.layers):
            state = content.layer_state(index)
            if not state:
                continue
            state = {name: tensor.to(device) for name, tensor in state.items()}
            layer.restore(state)
        cache.turn_tokens = content.stream_state.get("turn_tokens", 0)
        if content.streaming is not None:
            cache.stream_lengths = content.row_lengths()
        return cache


def _folded(steps: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The count of folds `(batch,)` after `rows` `(batch,)` bool fold one more, kept within `MOST_FOLDS`."""
    return (steps + rows.to(steps.device)).clamp(max=MOST_FOLDS)


def _check_finite_memory(tensors: list[torch.Tensor]) -> None:
    """Raise if a compression just gave memory keys/values (`tensors`) that are not finite: attention to a NaN slot
    gives NaN logits at every later turn, and a saved memory would carry it. Raised inside the call's transaction,
    which then leaves the cache as it was."""
    # One device synchronisation for all layers, not one per tensor.
    if not bool(torch.stack([torch.isfinite(tensor).all() for tensor in tensors]).all()):
        raise ValueError(
            "The compression gave keys/values that are not finite (NaN or inf), which would poison every later turn "
            "of this memory; the cache is left as it was. The model's weights or this turn's inputs hold non-finite "
            "values, or its float16 activations overflowed (run it in bfloat16 or float32)."
        )


def _check_row_indices(indices: Any, call: str, masks: bool = False) -> None:
    """Raise unless `indices` is a 1-D tensor of row indices (int64 or int32), or with `masks` a bool mask of rows: a
    0-d one dropped the batch dimension of the rows (`batch_select_indices`), a 2-D one added one, and every later call
    failed inside torch; torch takes uint8 indices for a mask of rows, and those of other dtypes failed inside it."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{call} takes a 1-D tensor of row indices, such as torch.tensor([2, 0]); got {type(indices)}.")
    if indices.ndim != 1:
        raise ValueError(
            f"{call} takes a 1-D tensor of row indices, such as torch.tensor([2, 0]); got shape {tuple(indices.shape)}."
        )
    if indices.dtype not in (torch.int64, torch.int32, *((torch.bool,) if masks else ())):
        mask = " (or a torch.bool mask of rows)" if masks else ""
        raise TypeError(
            f"{call} takes row indices of dtype torch.int64 or torch.int32{mask}, such as torch.tensor([2, 0]); got "
            f"dtype {indices.dtype}."
        )
    if indices.is_meta:  # holds no rows to check or select (torch failed with a NotImplementedError)
        raise ValueError(f"{call} was given row indices on the meta device, which hold no values; pass real ones.")


def _check_rows_in_range(indices: torch.Tensor, batch_size: int, call: str, negative: bool) -> None:
    """Raise unless the checked `indices` (`_check_row_indices`) name rows of a cache of `batch_size` rows, counted
    from the end too where `negative` (as indexing counts them): torch failed with a bare IndexError on the CPU, and on
    a GPU with a device-side assert that ends the process."""
    if indices.dtype == torch.bool:
        if indices.shape[0] != batch_size:
            raise ValueError(
                f"{call} was given a mask of {indices.shape[0]} rows, but the cache holds {batch_size}; give one "
                "True or False per row."
            )
        return
    lowest = -batch_size if negative else 0
    outside = indices[(indices < lowest) | (indices >= batch_size)]
    if outside.numel():
        raise ValueError(
            f"{call} was given row indices {outside.tolist()} outside {lowest} to {batch_size - 1}, the cache holding "
            f"{batch_size} rows; give indices of rows it holds."
        )


def _float_average(
    accumulated: tuple[torch.Tensor, torch.Tensor] | None, memory: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The float32 merge/EMA average to update: the one kept, else the memory held (loaded from a file, or
    already float32), else None (no memory yet)."""
    if accumulated is not None:
        return accumulated
    return None if memory is None else (memory[0].float(), memory[1].float())


# ----- masks -----------------------------------------------------------------------------------------------------
def _attend_past_then_causal(past: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
    """`(batch, 1, new, past + new)` bool: each new token sees the `past` `(batch, past)` slots marked True and
    the real new tokens up to itself; a padding query sees itself, so that no softmax row is empty."""
    new = new_mask.shape[1]
    device = new_mask.device
    own = torch.ones(new, new, dtype=torch.bool, device=device).tril() & new_mask[:, None, :]
    own = own | torch.eye(new, dtype=torch.bool, device=device)
    return torch.cat([past[:, None, :].expand(-1, new, -1), own], dim=-1)[:, None]
