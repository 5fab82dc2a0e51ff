"""A plain, slow reference of streaming (sink + memory + window), written independently of the library.

Every held slot keeps its key un-rotated (rotated back from the position it was computed at, with the
model's own rotary functions); each step rotates all slots to positions 0..n-1 and runs the model with an
ordinary `DynamicCache`. Compression runs the `<COMP>` tokens over [sink | memory | oldest chunk]; with
`keep_window_full` the chunk stays in the window and its slots leave one by one as new tokens need room.
Sliding-window layers see the slots less than their window back, and the memory always.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from transformers_ccm import CCMForCausalLM
from transformers_ccm.modeling import CACHE_ARGUMENT
from transformers_ccm.streaming import StreamingConfig


def _rotary(model: CCMForCausalLM):
    base = model.base_model
    module = next(m for m in base.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    apply = sys.modules[type(base).__module__].apply_rotary_pos_emb
    return module, apply


def _rotate(model: CCMForCausalLM, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """keys `(batch, heads, len, dim)` of layer `layer` rotated by `positions` `(len,)` with the model's own RoPE code
    (Gemma 3's for the layer's type: its local and global layers rotate with different frequencies)."""
    module, apply = _rotary(model)
    layer_types = getattr(model.base_model.config, "layer_types", None)
    by_type = {"layer_type": layer_types[layer]} if layer_types and hasattr(module, "layer_types") else {}
    cos, sin = module(keys, positions[None].expand(keys.shape[0], -1), **by_type)
    rotated, _ = apply(keys, keys, cos, sin)
    return rotated


@dataclass
class Slot:
    keys: list[torch.Tensor]  # per layer, (batch, heads, 1, dim), un-rotated
    values: list[torch.Tensor]


@dataclass
class ReferenceStream:
    model: CCMForCausalLM
    config: StreamingConfig
    sink: list[Slot] = field(default_factory=list)
    memory: list[Slot] = field(default_factory=list)
    window: list[Slot] = field(default_factory=list)
    steps: int = 0
    compressed: int = 0  # oldest window slots already in memory (keep_window_full)

    def _cache(self, slots: list[Slot]) -> DynamicCache:
        if not slots:
            return DynamicCache()
        data = []
        positions = torch.arange(len(slots))
        for layer in range(self.model.base_model.config.num_hidden_layers):
            keys = torch.cat([slot.keys[layer] for slot in slots], dim=2)
            values = torch.cat([slot.values[layer] for slot in slots], dim=2)
            data.append((_rotate(self.model, keys, positions, layer), values))
        return DynamicCache(ddp_cache_data=data)

    def _sliding_mask(self, start: int, q: int, batch: int) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The mask of `q` queries at positions `start..` for a model with sliding-window layers (None without):
        those layers see the slots less than the window back, and the memory slots (after the sink) always."""
        config = self.model.base_model.config
        size = getattr(config, "sliding_window", None)
        if not size:
            return None
        keys, queries = torch.arange(start + q), torch.arange(start, start + q)
        causal = keys[None, :] <= queries[:, None]
        near = queries[:, None] - keys[None, :] < size
        near[:, len(self.sink) : len(self.sink) + len(self.memory)] = True
        causal, sliding = causal.expand(batch, 1, q, -1), (causal & near).expand(batch, 1, q, -1)
        if getattr(config, "layer_types", None):
            return {"full_attention": causal, "sliding_attention": sliding}
        return sliding

    def _run(self, held: list[Slot], embeds: torch.Tensor) -> tuple[torch.Tensor, list[Slot]]:
        """Run `embeds` `(batch, q, hidden)` after `held` (the sink and memory first); returns logits and the new
        slots (un-rotated)."""
        cache = self._cache(held)
        start, q = len(held), embeds.shape[1]
        positions = torch.arange(start, start + q)
        out = self.model.base_model(
            inputs_embeds=embeds,
            position_ids=positions[None].expand(embeds.shape[0], -1),
            attention_mask=self._sliding_mask(start, q, embeds.shape[0]),
            **{CACHE_ARGUMENT: cache},
        )
        slots = []
        for i in range(q):
            where = slice(start + i, start + i + 1)
            keys = [
                _rotate(self.model, layer.keys[:, :, where], -positions[i : i + 1], index)
                for index, layer in enumerate(cache.layers)
            ]
            slots.append(Slot(keys, [layer.values[:, :, where] for layer in cache.layers]))
        return out.logits, slots

    def _compress_oldest_chunk(self) -> None:
        """Compress the oldest chunk not yet compressed; it leaves the window, or (keep_window_full) stays."""
        config, ccm = self.config, self.model.config
        self.window = self.window[self.compressed :]
        chunk = self.window[: config.compress_chunk]
        if config.keep_window_full:
            self.compressed = config.compress_chunk
        else:
            self.window = self.window[config.compress_chunk :]
        batch, n = chunk[0].keys[0].shape[0], ccm.num_comp_tokens
        comp = self.model.comp_embeddings[None].expand(batch, n, -1)
        with self.model.lora_at(torch.ones(batch, n, dtype=torch.bool)):
            _, new = self._run(self.sink + self.memory + chunk, comp)
        self.steps += 1
        if ccm.update == "concat":
            self.memory = (self.memory + new)[-config.max_memory_tokens :]
        elif not self.memory:
            self.memory = new
        else:
            a = 1 / self.steps if ccm.update == "merge" else ccm.ema_alpha
            self.memory = [
                Slot(
                    [(1 - a) * old + a * fresh for old, fresh in zip(kept.keys, slot.keys, strict=True)],
                    [(1 - a) * old + a * fresh for old, fresh in zip(kept.values, slot.values, strict=True)],
                )
                for kept, slot in zip(self.memory, new, strict=True)
            ]

    def feed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed `(batch, q)` tokens (q fits the window); returns their logits `(batch, q, vocab)`."""
        config, q = self.config, input_ids.shape[1]
        to_sink = min(q, config.sink_tokens - len(self.sink))
        growth = q - to_sink
        # Compress while the tokens that must leave include some not yet in memory.
        while config.compress and len(self.window) + growth - config.window_tokens > self.compressed:
            self._compress_oldest_chunk()
        excess = len(self.window) + growth - config.window_tokens
        if excess > 0:
            self.window = self.window[excess:]
            self.compressed = max(0, self.compressed - excess)
        embeds = self.model.base_model.get_input_embeddings()(input_ids)
        logits, slots = self._run(self.sink + self.memory + self.window, embeds)
        self.sink += slots[:to_sink]
        self.window += slots[to_sink:]
        return logits
