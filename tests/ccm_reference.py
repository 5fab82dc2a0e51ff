"""A plain step-by-step CCM reference: one forward per step, memory carried explicitly.

It uses only the base model, PEFT's switch to turn the LoRA off for ordinary tokens, and a DynamicCache
prefilled with the memory: none of the package's masks, positions or memory code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from transformers_ccm import CCMForCausalLM
from transformers_ccm.modeling import CACHE_ARGUMENT

KV = tuple[torch.Tensor, torch.Tensor]


def lora_off(model: CCMForCausalLM) -> contextlib.AbstractContextManager[None]:
    return model.adapter_disabled()


def _cache_of(model: CCMForCausalLM, memory: list[KV] | None) -> DynamicCache:
    cache = DynamicCache(config=model.base_model.config)
    for layer_idx, (keys, values) in enumerate(memory or []):
        cache.update(keys, values, layer_idx)
    return cache


def _run(
    model: CCMForCausalLM,
    cache: DynamicCache,
    start: int,
    ids: Sequence[int] | None = None,
    embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    length = len(ids) if ids is not None else embeds.shape[1]
    positions = torch.arange(start, start + length)[None]
    tokens = torch.tensor([list(ids)]) if ids is not None else None
    return model.base_model(
        input_ids=tokens, inputs_embeds=embeds, position_ids=positions, use_cache=True, **{CACHE_ARGUMENT: cache}
    ).logits[0]


def reference_memory(model: CCMForCausalLM, contexts: Sequence[Sequence[int]]) -> tuple[list[KV] | None, int]:
    """Compress each context in turn. Returns the per-layer memory and the next logical position."""
    config = model.config
    n = config.num_comp_tokens
    memory: list[KV] | None = None
    position = 0
    for step, context in enumerate(contexts, start=1):
        cache = _cache_of(model, memory)
        with lora_off(model):
            _run(model, cache, position, ids=context)
        if not config.conditional_lora:
            cache = _cache_of(model, memory)  # the unconditional LoRA changes the context's keys too
            _run(model, cache, position, ids=context)
        with model.lora_at(torch.ones(1, n, dtype=torch.bool)):  # all <COMP>: the plain PEFT LoRA
            _run(model, cache, position + len(context), embeds=model.comp_embeddings[None])
        new = [(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in cache.layers]
        memory = _update(memory, new, step, model)
        position += len(context)
    return memory, position


def _update(memory: list[KV] | None, new: list[KV], step: int, model: CCMForCausalLM) -> list[KV]:
    config = model.config
    if memory is None:
        return new
    if config.update == "concat":
        merged = [
            (torch.cat([mk, nk], 2), torch.cat([mv, nv], 2)) for (mk, mv), (nk, nv) in zip(memory, new, strict=True)
        ]
        cap = config.max_memory_tokens
        return merged if cap is None else [(k[:, :, -cap:], v[:, :, -cap:]) for k, v in merged]
    a = 1.0 / step if config.update == "merge" else config.ema_alpha
    return [((1 - a) * mk + a * nk, (1 - a) * mv + a * nv) for (mk, mv), (nk, nv) in zip(memory, new, strict=True)]


@torch.no_grad()
def reference_logits(model: CCMForCausalLM, contexts: Sequence[Sequence[int]], io: Sequence[int]) -> torch.Tensor:
    """`(len(io), vocab)` logits of `I(t) O(t)` given the contexts, computed step by step."""
    memory, position = reference_memory(model, contexts)
    cache = _cache_of(model, memory)
    if model.config.conditional_lora:
        with lora_off(model):
            return _run(model, cache, position, ids=io)
    return _run(model, cache, position, ids=io)
