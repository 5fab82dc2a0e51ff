"""`CompressedMemoryCache`: a `transformers.Cache` that keeps compressed memory instead of past tokens.

Every layer holds `[memory | turn]`: the memory slots (the `<COMP>` keys/values of earlier contexts, or
their running average) and the keys/values of the tokens of the current turn. `generate()` sees only the
turn (`get_seq_length()`), so it works unchanged; the model's online hook (see `modeling.py`) asks the
cache for the attention mask and the logical ("skip") positions of each forward. Folding a turn replaces
the turn by its compression `h(t)` according to the update rule.

Per-row state (`(batch, ...)` tensors) lets users at different time steps share a batch: `memory_mask`
marks the slots a row owns, `turn_mask` the real (non-padding) turn tokens, `next_position` the logical
position of the row's next token, `steps` the number of contexts compressed so far.

A streaming cache (`model.new_cache(streaming=StreamingConfig(...))`, see `streaming.py`) holds
`[sink | memory | window]` instead, the same lengths in every row, and compresses or evicts by itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from transformers_ccm.config import CCMConfig
from transformers_ccm.masks import update_coefficient
from transformers_ccm.streaming import KeyRotation, StreamingConfig

if TYPE_CHECKING:
    from transformers_ccm.modeling import CCMForCausalLM

MEMORY_FORMAT = "transformers-ccm-memory"
MEMORY_FORMAT_VERSION = "1"
_STREAM_STATE = ("sink_length", "window_length", "turn_tokens")
_ROW_STATE = ("memory_mask", "turn_mask", "next_position", "steps", "pending_ids", "pending_mask")


class CompressedMemoryLayer(DynamicLayer):
    """One layer's keys/values `(batch, kv_heads, memory + turn, head_dim)`; the first `memory_length`
    slots are memory."""

    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.memory_length = 0

    def get_seq_length(self) -> int:
        """Length of the current turn: the memory is a prefix that `generate()` must not count."""
        return super().get_seq_length() - self.memory_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.memory_length + self.get_seq_length() + query_length, 0

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory keys and values, `(batch, kv_heads, memory_length, head_dim)` each."""
        return self.keys[:, :, : self.memory_length], self.values[:, :, : self.memory_length]

    def set_memory(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the layer's content by a memory (the turn is dropped)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.memory_length = keys.shape[-2]


class CompressedMemoryCache(Cache):
    """Compressed context memory for a batch of users, usable as `past_key_values` of a `CCMForCausalLM`.

    Create one with `model.new_cache(batch_size)`; fill it with `model.compress(...)`; generate with
    `model.generate(..., past_key_values=cache)`. With `streaming` (and the model's `rotation`), it is a
    bounded stream instead: every forward adds to the window, compressing or evicting what overflows.
    """

    def __init__(
        self,
        config: CCMConfig,
        signature: dict[str, Any],
        num_layers: int,
        batch_size: int,
        streaming: StreamingConfig | None = None,
        rotation: KeyRotation | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        super().__init__(layers=[CompressedMemoryLayer() for _ in range(num_layers)])
        self.config = config
        self.signature = signature
        self.memory_mask = torch.zeros(batch_size, 0, dtype=torch.bool)
        self.turn_mask = torch.zeros(batch_size, 0, dtype=torch.bool)
        self.next_position = torch.zeros(batch_size, dtype=torch.long)
        self.steps = torch.zeros(batch_size, dtype=torch.long)
        # A token generate() produced last has no keys/values yet; folding the turn runs it.
        self.pending_ids = torch.zeros(batch_size, 0, dtype=torch.long)
        self.pending_mask = torch.zeros(batch_size, 0, dtype=torch.bool)
        if (streaming is None) != (rotation is None):
            raise ValueError("A streaming cache needs both a StreamingConfig and the model's KeyRotation.")
        self.streaming = streaming
        self.rotation = rotation
        self.sink_length = 0
        self.window_length = 0
        # Tokens fed since the stream or the current generate() began: what generate() must see as processed.
        self.turn_tokens = 0

    # ----- sizes -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    @property
    def memory_length(self) -> int:
        """Memory slots held per row (rows of a batch may own fewer; see `memory_mask`)."""
        return self.memory_mask.shape[1]

    @property
    def turn_length(self) -> int:
        """Tokens of the current turn held (input and generated tokens not yet folded)."""
        return self.turn_mask.shape[1]

    @property
    def has_unfolded_turn(self) -> bool:
        """Whether the cache holds turn tokens (or a pending generated token) that `compress` has not folded."""
        return bool(self.turn_length or self.pending_ids.shape[1])

    @property
    def kv_length(self) -> int:
        """Physical key/value length of every layer: memory plus turn (streaming: sink, memory and window)."""
        if self.streaming is not None:
            return self.sink_length + self.memory_length + self.window_length
        return self.memory_length + self.turn_length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.streaming is not None:
            return self.turn_tokens
        return super().get_seq_length(layer_idx)

    def memory_bytes(self) -> int:
        """Bytes of the per-user state between turns over all layers: the memory keys and values (streaming:
        everything held)."""
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in self.layers
            if layer.is_initialized
            for tensor in self._held(layer)
        )

    def _held(self, layer: CompressedMemoryLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's per-user state: its memory keys and values (streaming: everything it holds)."""
        return (layer.keys, layer.values) if self.streaming is not None else layer.memory()

    # ----- the online forward ------------------------------------------------------------------------------
    def prepare_forward(self, new_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register `new_mask.shape[1]` new tokens of the turn and describe how they attend.

        Args:
            new_mask: `(batch, new)` bool, False at padding.

        Returns:
            position_ids `(batch, new)` (logical positions) and the attention mask
            `(batch, 1, new, memory + turn + new)` bool.
        """
        self.check_batch_size(new_mask.shape[0], "the input")
        device = new_mask.device
        self._to(device)
        new = new_mask.shape[1]
        if self.streaming is not None:
            return self._prepare_stream_forward(new_mask)
        position_ids = (self.next_position[:, None] + new_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
        # A padding query attends to itself too, so that no softmax row is empty.
        own = (causal & new_mask[:, None, :]) | torch.eye(new, dtype=torch.bool, device=device)
        past = torch.cat([self.memory_mask, self.turn_mask], dim=1)[:, None, :].expand(-1, new, -1)
        mask = torch.cat([past, own], dim=-1)[:, None]
        self.turn_mask = torch.cat([self.turn_mask, new_mask], dim=1)
        self.next_position = self.next_position + new_mask.sum(-1)
        return position_ids, mask

    # ----- streaming ----------------------------------------------------------------------------------------
    def _prepare_stream_forward(self, new_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens after everything held, at the next positions; they attend to all of it."""
        streaming = self._streaming()
        self.check_unpadded(new_mask)
        new = new_mask.shape[1]
        growth = self._window_growth(new)
        if self.window_length + growth > streaming.window_tokens:
            raise ValueError(
                f"{new} new tokens do not fit the streaming window ({self.window_length} of "
                f"{streaming.window_tokens} held); run the base model through CCMForCausalLM, which makes room first."
            )
        held = self.kv_length
        position_ids = torch.arange(held, held + new, device=new_mask.device)[None].expand(self.batch_size, -1)
        mask = _attend_held_then_causal(self.batch_size, held, new, new_mask.device)
        self.sink_length += new - growth
        self.window_length += growth
        self.turn_tokens += new
        return position_ids, mask

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

    @property
    def max_forward_tokens(self) -> int:
        """The most new tokens one forward of a streaming cache takes (CCMForCausalLM splits longer inputs)."""
        return self._streaming().max_forward_tokens

    def _window_growth(self, new: int) -> int:
        """How many of `new` tokens go to the window (the others fill the sink)."""
        return new - min(new, self._streaming().sink_tokens - self.sink_length)

    def start_turn(self) -> None:
        """Count tokens from zero again (a new generate() call on a stream)."""
        self.turn_tokens = 0

    def needs_compression(self, new: int) -> bool:
        """Whether the oldest chunk of the window must be compressed before `new` tokens fit."""
        streaming = self._streaming()
        return (
            streaming.compress
            and self.window_length + self._window_growth(new) > streaming.window_tokens
            and self.window_length >= streaming.compress_chunk
        )

    def compression_prefix(self) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """What the `<COMP>` tokens of the next compression attend to: sink, memory and the oldest chunk.

        Returns:
            a `DynamicCache` holding those keys/values (a copy), the `<COMP>` positions `(batch, n_comp)`
            (right after the chunk) and their attention mask `(batch, 1, n_comp, prefix + n_comp)` bool.
        """
        length = self.sink_length + self.memory_length + self._streaming().compress_chunk
        prefix = DynamicCache(
            ddp_cache_data=[(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in self.layers]
        )
        n = self.config.num_comp_tokens
        device = self.layers[0].keys.device
        position_ids = torch.arange(length, length + n, device=device)[None].expand(self.batch_size, -1)
        return prefix, position_ids, _attend_held_then_causal(self.batch_size, length, n, device)

    def fold_chunk(self, prefix: DynamicCache) -> None:
        """Put the `<COMP>` keys/values just appended to `prefix` into memory, drop the oldest chunk of the
        window, evict concat memory beyond its cap, and move everything to positions `0..n-1`."""
        streaming, rotation = self._streaming(), self.rotation
        assert rotation is not None
        n, sink, memory, chunk = (
            self.config.num_comp_tokens,
            self.sink_length,
            self.memory_length,
            streaming.compress_chunk,
        )
        comp_start = sink + memory + chunk
        self.steps = self.steps + 1
        concat = self.config.update == "concat"
        evicted = max(0, memory + n - streaming.max_memory_tokens) if concat else 0
        weight = update_coefficient(int(self.steps[0]), self.config) if not concat and memory else 1.0
        for index, (layer, compressed) in enumerate(zip(self.layers, prefix.layers, strict=True)):
            comp_keys, comp_values = compressed.keys[:, :, -n:], compressed.values[:, :, -n:]
            keys, values = layer.keys, layer.values
            sink_keys, memory_keys, rest_keys = (
                keys[:, :, :sink],
                keys[:, :, sink : sink + memory],
                keys[:, :, comp_start:],
            )
            memory_values, rest_values = values[:, :, sink : sink + memory], values[:, :, comp_start:]
            if concat:
                key_pieces = [(sink_keys, 0), (memory_keys[:, :, evicted:], sink + evicted), (comp_keys, comp_start)]
                value_pieces = [memory_values[:, :, evicted:], comp_values]
            else:
                moved = rotation.shift(index, comp_keys, torch.full((n,), sink - comp_start))
                if memory:
                    moved = (1 - weight) * memory_keys + weight * moved
                    comp_values = (1 - weight) * memory_values + weight * comp_values
                key_pieces, value_pieces = [(sink_keys, 0), (moved, sink)], [comp_values]
            layer.keys = rotation.relocate(index, [*key_pieces, (rest_keys, comp_start)])
            layer.values = torch.cat([values[:, :, :sink], *value_pieces, rest_values], dim=2)
        slots = memory + n - evicted if concat else n
        self.memory_mask = torch.ones(self.batch_size, slots, dtype=torch.bool, device=self.memory_mask.device)
        self.window_length -= chunk

    def evict(self, new: int) -> None:
        """Drop the oldest window tokens so that `new` more fit (StreamingLLM), moving the rest back."""
        streaming, rotation = self._streaming(), self.rotation
        assert rotation is not None
        excess = self.window_length + self._window_growth(new) - streaming.window_tokens
        if excess <= 0:
            return
        kept = self.sink_length + self.memory_length
        for index, layer in enumerate(self.layers):
            layer.keys = rotation.relocate(
                index, [(layer.keys[:, :, :kept], 0), (layer.keys[:, :, kept + excess :], kept + excess)]
            )
            layer.values = torch.cat([layer.values[:, :, :kept], layer.values[:, :, kept + excess :]], dim=2)
        self.window_length -= excess

    def end_generation(self, generated: torch.Tensor, eos_token_ids: list[int]) -> None:
        """Record the tokens `generate()` produced: those after a row's first EOS are padding, and the last
        one is pending (no keys/values yet).

        Args:
            generated: `(batch, new_tokens)` the generated ids (prompt excluded).
        """
        if generated.shape[1] == 0:
            return
        is_eos = torch.isin(generated, torch.tensor(eos_token_ids, device=generated.device))
        # A token is real up to and including the row's first EOS.
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        real = ~after_eos
        fed = generated.shape[1] - 1
        turn = self.turn_mask.clone()
        turn[:, turn.shape[1] - fed :] &= real[:, :fed].to(turn.device)
        self.next_position -= (~real[:, :fed]).sum(-1).to(self.next_position.device)
        self.turn_mask = turn
        self.pending_ids = generated[:, fed:].to(self.next_position.device)
        self.pending_mask = real[:, fed:].to(self.next_position.device)

    def clear_pending(self) -> None:
        """Forget the pending token (once it is run)."""
        self.pending_ids = self.pending_ids[:, :0]
        self.pending_mask = self.pending_mask[:, :0]

    def fold(self, num_comp_tokens: int, rows: torch.Tensor) -> None:
        """Turn the last `num_comp_tokens` keys/values (the `<COMP>` block just run) into memory.

        Args:
            rows: `(batch,)` bool, the rows that had a context; the others keep their memory unchanged.
        """
        n = num_comp_tokens
        rows = rows.to(self.memory_mask.device)
        self.steps = self.steps + rows.long()
        config = self.config
        if config.update == "concat":
            keep = torch.cat([self.memory_mask, rows[:, None].expand(-1, n)], dim=1)
            if config.max_memory_tokens is not None:
                newest_first = keep.flip(-1).long().cumsum(-1).flip(-1)
                keep &= newest_first <= config.max_memory_tokens
            columns = keep.any(dim=0)
            for layer in self.layers:
                memory_keys, memory_values = layer.memory()
                kept = columns.to(layer.keys.device)
                keys = torch.cat([memory_keys, layer.keys[:, :, -n:]], dim=2)[:, :, kept]
                values = torch.cat([memory_values, layer.values[:, :, -n:]], dim=2)[:, :, kept]
                layer.set_memory(keys, values)
            self.memory_mask = keep[:, columns]
        else:
            coefficient = torch.tensor(
                [update_coefficient(max(int(step), 1), config) for step in self.steps], device=rows.device
            )
            weight = torch.where(rows, coefficient, torch.zeros((), device=rows.device))
            for layer in self.layers:
                new_keys, new_values = layer.keys[:, :, -n:], layer.values[:, :, -n:]
                if self.memory_length == 0:
                    layer.set_memory(new_keys, new_values)
                    continue
                a = weight.to(new_keys.device, new_keys.dtype)[:, None, None, None]
                memory_keys, memory_values = layer.memory()
                layer.set_memory((1 - a) * memory_keys + a * new_keys, (1 - a) * memory_values + a * new_values)
            owned = rows[:, None].expand(-1, n)
            self.memory_mask = owned.clone() if self.memory_length == 0 else self.memory_mask | owned
        self.turn_mask = self.turn_mask[:, :0]
        # <COMP> tokens take positions but do not advance the logical position (the "skip" scheme).
        self.next_position = self.next_position - n

    # ----- batch operations used by generate() ---------------------------------------------------------------
    def _map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in _ROW_STATE:
            setattr(self, name, function(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, beam_idx.to(layer.keys.device))
                layer.values = layer.values.index_select(0, beam_idx.to(layer.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
                layer.values = layer.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[indices.to(layer.keys.device)]
                layer.values = layer.values[indices.to(layer.values.device)]

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "A CompressedMemoryCache cannot be cropped (assisted or speculative decoding); generate without an "
            "assistant model."
        )

    def copy(self) -> CompressedMemoryCache:
        """A cache with the same content whose tensors can be changed independently."""
        clone = CompressedMemoryCache(
            self.config, self.signature, len(self.layers), self.batch_size, self.streaming, self.rotation
        )
        for name in _ROW_STATE:
            setattr(clone, name, getattr(self, name).clone())
        for name in _STREAM_STATE:
            setattr(clone, name, getattr(self, name))
        for source, target in zip(self.layers, clone.layers, strict=True):
            if source.is_initialized:
                target.lazy_initialization(source.keys, source.values)
                target.keys, target.values = source.keys.clone(), source.values.clone()
                target.memory_length = source.memory_length
        return clone

    # ----- checks ------------------------------------------------------------------------------------------
    def check_model(self, model: CCMForCausalLM) -> None:
        """Raise if this cache was made for another base model or adapter configuration."""
        # Hashing the adapter weights at every forward would cost more than a decoding step; the shapes suffice.
        expected = model.memory_signature(include_adapter=False)
        different = sorted(key for key in expected if expected[key] != self.signature.get(key))
        if different:
            details = ", ".join(
                f"{key}: cache {self.signature.get(key)!r} vs model {expected[key]!r}" for key in different
            )
            raise ValueError(
                f"This CompressedMemoryCache belongs to another model ({details}). Create the cache with this "
                "model's new_cache(), or use it with the model that made it."
            )

    def check_batch_size(self, batch_size: int, what: str) -> None:
        """Raise unless `what` (an input of `batch_size` rows) has one row per cache row."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"{what} has batch size {batch_size} but the cache holds {self.batch_size} rows (one per user); "
                f"pass one row per cache row, or create the cache with new_cache(batch_size={batch_size})."
            )

    def _to(self, device: torch.device) -> None:
        if self.next_position.device != device:
            self._map_rows(lambda t: t.to(device))

    # ----- persistence -------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the memory to a safetensors file whose header identifies the model and adapter."""
        if self.has_unfolded_turn:
            raise ValueError(
                "The cache holds an unfolded turn; call model.compress(cache) to fold it into memory before "
                "saving (only the compressed memory is stored)."
            )
        tensors = {name: getattr(self, name).contiguous().cpu() for name in ("memory_mask", "next_position", "steps")}
        for index, layer in enumerate(self.layers):
            if layer.is_initialized:
                keys, values = self._held(layer)
                tensors[f"layers.{index}.keys"] = keys.contiguous().cpu()
                tensors[f"layers.{index}.values"] = values.contiguous().cpu()
        metadata = {
            "format": MEMORY_FORMAT,
            "format_version": MEMORY_FORMAT_VERSION,
            "signature": json.dumps(self.signature, sort_keys=True),
        }
        if self.streaming is not None:
            state = {name: getattr(self, name) for name in _STREAM_STATE}
            metadata["streaming"] = json.dumps({"config": asdict(self.streaming), "state": state})
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: CCMForCausalLM) -> CompressedMemoryCache:
        """Read a memory written by `save`, checking that it was made by `model`'s base model and adapter."""
        path = os.fspath(path)
        try:
            with safe_open(path, framework="pt") as file:
                metadata = file.metadata() or {}
                tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is no dict)
        except FileNotFoundError:
            raise FileNotFoundError(f"No memory file at {path}.") from None
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a readable safetensors memory file ({error}).") from None
        if metadata.get("format") != MEMORY_FORMAT:
            raise ValueError(f"{path} is a safetensors file but not a transformers-ccm memory (no '{MEMORY_FORMAT}').")
        if metadata.get("format_version") != MEMORY_FORMAT_VERSION:
            raise ValueError(
                f"{path} has memory format version {metadata.get('format_version')!r}; this transformers-ccm reads "
                f"version {MEMORY_FORMAT_VERSION}. Upgrade transformers-ccm."
            )
        differences = _differences(json.loads(metadata["signature"]), model.memory_signature(), "file")
        if differences:
            raise ValueError(f"{path} was made by another model or adapter ({differences}); load it with that model.")
        streaming = json.loads(metadata.get("streaming", "null"))
        cache = model.new_cache(
            batch_size=tensors["next_position"].shape[0],
            streaming=StreamingConfig(**streaming["config"]) if streaming else None,
        )
        for name in ("memory_mask", "next_position", "steps"):
            setattr(cache, name, tensors[name].to(model.device))
        for name, value in (streaming["state"] if streaming else {}).items():
            setattr(cache, name, value)
        for index, layer in enumerate(cache.layers):
            if f"layers.{index}.keys" in tensors:
                keys = tensors[f"layers.{index}.keys"].to(model.device)
                values = tensors[f"layers.{index}.values"].to(model.device)
                if streaming:
                    layer.lazy_initialization(keys, values)
                    layer.keys, layer.values = keys, values
                else:
                    layer.set_memory(keys, values)
        return cache


def _attend_held_then_causal(batch_size: int, held: int, new: int, device: torch.device) -> torch.Tensor:
    """`(batch, 1, new, held + new)` bool: every new token sees all `held` positions and the new ones up to itself."""
    causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    mask = torch.cat([torch.ones(new, held, dtype=torch.bool, device=device), causal], dim=1)
    return mask[None, None].expand(batch_size, 1, new, held + new)


def _differences(found: dict[str, Any], expected: dict[str, Any], source: str) -> str:
    """The fields of `expected` that `found` does not match, as 'field: source X vs model Y, ...'."""
    return ", ".join(
        f"{key}: {source} {found.get(key)!r} vs model {value!r}"
        for key, value in sorted(expected.items())
        if found.get(key) != value
    )
