"""Streaming: an endless input in bounded KV memory (attention sinks + sliding window + compression).

A streaming `CompressedMemoryCache` holds `[sink | memory | window]` in every layer: the first
`sink_tokens` tokens of the stream, the compressed memory, and the most recent tokens. When new tokens
would overflow the window, its oldest `compress_chunk` tokens are compressed by the `<COMP>` tokens
(which attend to sink, memory and that chunk) into memory and dropped; with `compress=False` they are
just dropped, which is StreamingLLM. Positions are reassigned `0..n-1` inside the cache at every step,
so cached keys of rotary models are re-rotated to their new positions (`KeyRotation`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from transformers_ccm.config import CCMConfig
from transformers_ccm.validation import is_int

# The cap on a stream's concat memory when neither the stream nor its adapter sets one (the paper's 8 slots).
_DEFAULT_MEMORY_TOKENS = 8


class CapAboveAdapterError(ValueError):
    """A stream's concat memory cap `cap` above its adapter's own `adapter_cap`: its memory would hold more slots than
    the adapter was made to read."""

    def __init__(self, cap: int, adapter_cap: int) -> None:
        self.cap, self.adapter_cap = cap, adapter_cap
        super().__init__(
            f"StreamingConfig.max_memory_tokens ({cap}) exceeds the adapter's CCMConfig.max_memory_tokens "
            f"({adapter_cap}): the stream's memory would hold more slots than the adapter was made to read. Set "
            f"StreamingConfig.max_memory_tokens to at most {adapter_cap}, or to None for the adapter's own cap."
        )

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return type(self), (self.cap, self.adapter_cap)


@dataclass(frozen=True)
class StreamingConfig:
    """Sizes of a streaming cache. The KV held never exceeds `max_kv_length(ccm_config)`.

    Args:
        window_tokens: most recent tokens kept as they are (paper: 148 with 4 sink and 8 memory slots).
        sink_tokens: first tokens of the stream kept forever (attention sinks; paper and StreamingLLM: 4).
        compress_chunk: tokens compressed at once, into the adapter's `num_comp_tokens` slots (paper: 64 into
            2); the shipped stream adapter is trained for 32. With `keep_window_full=False` a compression
            empties the window by this many tokens (the paper's 64 leave 84 of 148).
        max_memory_tokens: cap on concat memory, whose oldest slots are evicted first (paper: 8). None: the
            adapter's own cap (`CCMConfig.max_memory_tokens`), or 8 where it has none; a cap above the adapter's is
            refused (its memory would hold more slots than the adapter was made to read). Merge and EMA memory
            always holds `num_comp_tokens` slots.
        compress: False drops the overflowing tokens instead (the StreamingLLM baseline; no `<COMP>` runs).
        keep_window_full: compress the oldest chunk when its first token must leave the window, but evict its
            tokens only as new ones need room, so the window stays at `window_tokens` (the budget stays full) and
            a chunk stays visible next to its memory slots until it slides out. False: the chunk leaves the
            window when compressed (the paper), which empties the window by `compress_chunk` tokens each time.
    """

    window_tokens: int = 148
    sink_tokens: int = 4
    compress_chunk: int = 32
    max_memory_tokens: int | None = None
    compress: bool = True
    keep_window_full: bool = True

    def for_adapter(self, ccm_config: CCMConfig) -> StreamingConfig:
        """These sizes with the concat memory cap a stream of an adapter of `ccm_config` takes: `max_memory_tokens`,
        or where it is None the adapter's own cap (8 where it has none). A stream holds these (`cache.streaming`)."""
        if self.max_memory_tokens is not None:
            return self
        cap = ccm_config.max_memory_tokens
        return replace(self, max_memory_tokens=_DEFAULT_MEMORY_TOKENS if cap is None else cap)

    def memory_slots(self, ccm_config: CCMConfig) -> int:
        """Memory slots held once the memory is full."""
        if not self.compress:
            return 0
        if ccm_config.update != "concat":
            return ccm_config.num_comp_tokens
        cap = self.for_adapter(ccm_config).max_memory_tokens
        assert cap is not None
        return cap

    def max_kv_length(self, ccm_config: CCMConfig) -> int:
        """The most positions a layer ever holds: sink + memory + window."""
        return self.sink_tokens + self.memory_slots(ccm_config) + self.window_tokens

    @property
    def max_forward_tokens(self) -> int:
        """The most new tokens one forward may take; longer inputs are run in pieces of this size."""
        return self.window_tokens - self.compress_chunk + 1 if self.compress else self.window_tokens

    def same_size_baseline(self, ccm_config: CCMConfig) -> StreamingConfig:
        """The StreamingLLM configuration (no compression) holding exactly as many positions as this one."""
        return replace(self, compress=False, window_tokens=self.window_tokens + self.memory_slots(ccm_config))

    def validate(self, ccm_config: CCMConfig, max_positions: int | None, rotary_positions: int | None = None) -> None:
        """Raise a ValueError naming the setting to change if these sizes cannot work, for a model of `max_positions`
        whose rotary embedding keeps its frequencies up to `rotary_positions` (`KeyRotation.max_positions`)."""
        # Types too: these sizes may come from a memory file's header, and a float or a bool would only fail (or
        # mean something else) later, inside a forward.
        for name in ("window_tokens", "compress_chunk", "max_memory_tokens"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1) and not (name == "max_memory_tokens" and value is None):
                none = " (or None for the adapter's own cap)" if name == "max_memory_tokens" else ""
                raise ValueError(f"StreamingConfig.{name} must be a positive integer, got {value!r}{none}.")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"StreamingConfig.sink_tokens must be an integer >= 0, got {self.sink_tokens!r}.")
        for name in ("compress", "keep_window_full"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StreamingConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        n = ccm_config.num_comp_tokens
        if self.compress and self.window_tokens < self.compress_chunk:
            raise ValueError(
                f"StreamingConfig.window_tokens ({self.window_tokens}) is smaller than compress_chunk "
                f"({self.compress_chunk}): the window must hold a whole chunk before it is compressed. Raise "
                "window_tokens or lower compress_chunk."
            )
        slots = self.memory_slots(ccm_config)
        if self.compress and ccm_config.update == "concat" and slots < n:
            raise ValueError(
                f"StreamingConfig.max_memory_tokens ({slots}) cannot hold one compressed chunk ({n} <COMP> slots); set "
                f"it to at least {n}."
            )
        adapter_cap = ccm_config.max_memory_tokens
        if self.compress and adapter_cap is not None and slots > adapter_cap:  # concat: the only rule with a cap
            raise CapAboveAdapterError(slots, adapter_cap)
        # The <COMP> tokens of a compression sit right after their chunk, up to n - 1 positions past the cap.
        highest = self.max_kv_length(ccm_config) + (n if self.compress else 0)
        # The setting to lower is the largest of those that add up: a large cap was refused asking for a smaller window.
        sizes = {"sink_tokens": self.sink_tokens, "window_tokens": self.window_tokens}
        if self.compress and ccm_config.update == "concat":
            sizes["max_memory_tokens"] = slots
        largest = max(sizes, key=sizes.__getitem__)
        terms = (self.sink_tokens, slots, self.window_tokens, *((n,) if self.compress else ()))
        total = (
            f"sink_tokens + memory + window_tokens{' + num_comp_tokens' if self.compress else ''} = "
            f"{' + '.join(map(str, terms))} = {highest}"
        )
        if max_positions is not None and highest > max_positions:
            raise ValueError(
                f"{total} exceeds the model's maximum of {max_positions} positions; lower {largest} ({sizes[largest]})."
            )
        if rotary_positions is not None and highest > rotary_positions:
            raise ValueError(
                f"{total} passes the model's original context of {rotary_positions} positions, past which its LongRoPE "
                "rotates every position with other frequencies: the keys a stream moves would land at wrong positions. "
                f"Lower {largest} ({sizes[largest]}) to stay within {rotary_positions} positions."
            )


def longrope_original_context(rotary: torch.nn.Module, layer_type: str | None) -> int | None:
    """The original context of a LongRoPE `rotary` module (of layers of `layer_type`, None where it has one kind): a
    forward whose positions pass it rotates every position with the long factors. None for other rotaries."""
    kinds = getattr(rotary, "rope_type", None)
    kind = kinds.get(layer_type) if isinstance(kinds, dict) else kinds
    if kind != "longrope":
        return None
    parameters = rotary.config.rope_parameters if layer_type is None else rotary.config.rope_parameters[layer_type]
    return parameters["original_max_position_embeddings"]


def _original_context(rotary: torch.nn.Module, layer_type: str | None) -> int | None:
    """`longrope_original_context`, or None for a maximum within the original context (the long factors never apply
    online, where positions are re-based at the maximum)."""
    original = longrope_original_context(rotary, layer_type)
    return original if original is not None and rotary.config.max_position_embeddings > original else None


def _long_frequencies(rotary: torch.nn.Module, layer_type: str | None, current: torch.Tensor) -> torch.Tensor | None:
    """The long-factor frequencies of a LongRoPE `rotary` module (`_original_context`), with which a forward that
    reaches the model's maximum position rotates, in the dtype of the module's frequencies `current` (transformers
    copies them into those); None where `_original_context` is."""
    original = _original_context(rotary, layer_type)
    if original is None:
        return None
    config = rotary.config
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, current.device, seq_len=original + 1, layer_type=layer_type)
    return long.to(current.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class KeyRotation:
    """Moves rotary-embedded keys to other positions: `R(p + d) k = R(d) R(p) k`, exactly.

    Holds each layer's rotary frequencies `(rotary_dim / 2,)`; dimensions past `rotary_dim` (partial rotary)
    carry no position and stay as they are. Scaled RoPE variants (YaRN, LongRoPE) scale the keys once when
    they are computed; a rotation keeps that scale.
    """

    def __init__(self, inverse_frequencies: list[torch.Tensor], max_positions: int | None = None) -> None:
        # Copies: the model's buffer may change in place (`of_model`), and a rotation must not change with it.
        self.inverse_frequencies = [frequencies.detach().float().clone() for frequencies in inverse_frequencies]
        # The most positions a forward may reach for the model to rotate with these frequencies (None: any).
        self.max_positions = max_positions

    @staticmethod
    def module_name(model: PreTrainedModel) -> str | None:
        """The qualified name of the model's rotary embedding module (None if it has none: its positions are then
        added to the hidden states and cannot be moved)."""
        return next((name for name, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")), None)

    @classmethod
    def of_model(cls, model: PreTrainedModel, module_name: str, at_max_positions: bool = False) -> KeyRotation:
        """Read the frequencies every layer uses at the positions of the model's original context from its rotary
        embedding module `module_name` (`KeyRotation.module_name(model)`), as they are now (in the model's dtype).
        With `at_max_positions`, those of a forward that reaches the model's `max_position_embeddings`, where re-basing
        moves keys: LongRoPE rotates every position of such a forward with its long factors when that passes its
        original context, and keys computed there, moved by the short ones, landed at other positions.

        Dynamic variants (dynamic NTK, LongRoPE) set their `inv_freq` at every forward, in place, by the last
        position of that forward: read there, a cache's rotation changed with the forward of any other user's cache,
        and moved a stream's keys by the frequencies of a history far longer than its own. Their
        `original_inv_freq`, those of positions within the original context, never changes: without
        `at_max_positions`, the rotation holds for forwards within that context only (`max_positions`)."""
        rotary = model.get_submodule(module_name)
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
        frequencies, contexts = [], []
        for layer_type in layer_types[: config.num_hidden_layers]:
            by_type = layer_type if layer_type and hasattr(rotary, f"{layer_type}_inv_freq") else None
            prefix = f"{by_type}_" if by_type else ""
            current = getattr(rotary, f"{prefix}inv_freq")
            long = _long_frequencies(rotary, by_type, current) if at_max_positions else None
            frequencies.append(long if long is not None else getattr(rotary, f"{prefix}original_inv_freq", current))
            contexts.append(_original_context(rotary, by_type))
        known = [context for context in contexts if context is not None]
        return cls(frequencies, None if at_max_positions or not known else min(known))

    def shift(self, layer_idx: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate keys `(batch, kv_heads, len, head_dim)` by `delta` positions each: `(len,)`, the same for every
        row, or `(batch, len)`."""
        frequencies = self.inverse_frequencies[layer_idx].to(keys.device)
        rotary_dim = 2 * frequencies.shape[0]
        angles = delta.to(keys.device, torch.float)[..., None] * frequencies
        angles = torch.cat([angles, angles], dim=-1)
        if delta.ndim == 2:
            angles = angles[:, None]
        rotated, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
        rotated = rotated * angles.cos() + _rotate_half(rotated) * angles.sin()
        return torch.cat([rotated.to(keys.dtype), rest], dim=-1)
