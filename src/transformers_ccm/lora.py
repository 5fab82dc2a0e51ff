"""The conditional LoRA: PEFT's LoRA layers, gated per token so that only `<COMP>` positions see them.

PEFT computes `W x + B A dropout(x) * scaling`; a forward pre-hook on every `lora_A` multiplies its input
by the `<COMP>` mask, so the LoRA branch is exactly zero at every other position (`A 0 = 0`, no bias).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from transformers_ccm.config import CCMConfig

ADAPTER_NAME = "default"


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The self-attention module of every layer, by qualified name (modules that carry a `layer_idx`)."""
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")
    }


def default_target_modules(model: torch.nn.Module) -> str:
    """A PEFT regex matching every linear projection of every attention layer (q, k, v, o or fused)."""
    attention = attention_modules(model)
    parents = {name.rsplit(".", 1)[-1] for name in attention}
    projections = {
        child_name
        for module in attention.values()
        for child_name, child in module.named_children()
        if isinstance(child, (torch.nn.Linear, Conv1D))
    }
    if not projections:
        raise TypeError(
            f"{type(model).__name__}: found no linear projections inside its attention layers "
            f"({sorted(parents) or 'no attention layer with a layer_idx'}); pass CCMConfig.target_modules."
        )
    alternatives = "|".join(sorted(re.escape(p) for p in projections))
    return rf"(.*\.)?({'|'.join(sorted(re.escape(p) for p in parents))})\.({alternatives})"


def inject_lora(model: PreTrainedModel, config: CCMConfig) -> None:
    """Add PEFT LoRA layers to `model` in place, following `config`."""
    lora_config = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules or default_target_modules(model),
        bias="none",
        # GPT-2 style Conv1D layers store their weight transposed.
        fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()),
    )
    inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER_NAME)


def lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


class LoRAGate:
    """Restricts the LoRA to the tokens of a mask while the `active` context is open.

    Outside the context the LoRA layers are switched off (PEFT's base-layer-only path), so the model is exactly
    its base model and pays nothing for the adapter; inside, a pre-hook on `lora_A` zeroes its input away from
    the mask.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._mask: torch.Tensor | None = None
        self._suppressed = False
        self._layers = lora_layers(model)
        self._handles = [
            layer.lora_A[ADAPTER_NAME].register_forward_pre_hook(self._gate_input) for layer in self._layers
        ]
        if not self._handles:
            raise TypeError(f"{type(model).__name__} has no LoRA layers to gate.")
        self._switch()

    def _switch(self) -> None:
        # PEFT's own flag, set without enable_adapters(): that would also clear requires_grad, and autograd drops
        # the gradients of a leaf that stops requiring them between a forward and its backward.
        off = self._mask is None or self._suppressed
        for layer in self._layers:
            layer._disable_adapters = off

    def _gate_input(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        (hidden,) = args
        if self._mask is None:  # only if something else switched the layers on
            return (torch.zeros_like(hidden),)
        return (hidden * self._mask[..., None].to(hidden.dtype),)

    def active(self, token_mask: torch.Tensor) -> AbstractContextManager[None]:
        """Apply the LoRA only where `token_mask` (`(batch, seq)` bool) is True."""
        return self._state(token_mask, self._suppressed)

    def suppressed(self) -> AbstractContextManager[None]:
        """No LoRA at all, even inside `active` (the base model alone)."""
        return self._state(self._mask, True)

    @contextmanager
    def _state(self, mask: torch.Tensor | None, suppressed: bool) -> Iterator[None]:
        previous = self._mask, self._suppressed
        self._mask, self._suppressed = mask, suppressed
        self._switch()
        try:
            yield
        finally:
            self._mask, self._suppressed = previous
            self._switch()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
