"""`CCMForCausalLM`: any decoder-only causal LM with `<COMP>` embeddings and a conditional LoRA."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from transformers_ccm.attention import (
    WRAPPED_IMPLEMENTATIONS,
    ccm_attention_name,
    register_ccm_attention,
    wrapped_implementation,
)
from transformers_ccm.config import CCMConfig
from transformers_ccm.lora import LoRAGate, attention_modules, inject_lora, lora_layers
from transformers_ccm.masks import block_attention, comp_ranks

logger = logging.getLogger(__name__)

TESTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_neox",
    "olmo",
    "gpt2",
)


class CCMForCausalLM(nn.Module):
    """A causal LM that compresses contexts into the keys/values of `<COMP>` tokens.

    The base model's weights are frozen; only the LoRA layers and `comp_embeddings` (`(n_comp, hidden)`)
    train. Build one with `from_base`.
    """

    def __init__(self, base_model: PreTrainedModel, config: CCMConfig) -> None:
        _check_supported(base_model)
        super().__init__()
        self.config = config
        self.base_model = base_model
        base_model.requires_grad_(False)
        inject_lora(base_model, config)
        for layer in lora_layers(base_model):
            layer.lora_A.requires_grad_(True)
            layer.lora_B.requires_grad_(True)
        self.comp_embeddings = nn.Parameter(_initial_comp_embeddings(base_model, config.num_comp_tokens))
        self._gate = LoRAGate(base_model) if config.conditional_lora else None
        _use_ccm_attention(base_model)

    @classmethod
    def from_base(
        cls,
        model: str | os.PathLike[str] | PreTrainedModel,
        config: CCMConfig | None = None,
        **from_pretrained_kwargs: Any,
    ) -> CCMForCausalLM:
        """Wrap a loaded model, or load one by local path or Hub id (kwargs go to `from_pretrained`)."""
        config = config or CCMConfig()
        if isinstance(model, (str, os.PathLike)):
            model = AutoModelForCausalLM.from_pretrained(os.fspath(model), **from_pretrained_kwargs)
        elif from_pretrained_kwargs:
            raise TypeError(
                f"from_base got a loaded model and loading arguments {sorted(from_pretrained_kwargs)}; "
                "pass those arguments only with a path or Hub id."
            )
        base_name = config.base_model_name_or_path or getattr(model, "name_or_path", None) or None
        config = replace(config, base_model_name_or_path=base_name)
        return cls(model, config)

    @property
    def device(self) -> torch.device:
        return self.comp_embeddings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base_model.dtype

    def embed(self, input_ids: torch.Tensor, comp_mask: torch.Tensor) -> torch.Tensor:
        """`(batch, seq, hidden)` input embeddings; `<COMP>` positions take `comp_embeddings` (ids ignored)."""
        ordinary = self.base_model.get_input_embeddings()(input_ids.masked_fill(comp_mask, 0))
        comp = self.comp_embeddings[comp_ranks(comp_mask, self.config.num_comp_tokens)].to(ordinary.dtype)
        return torch.where(comp_mask[..., None], comp, ordinary)

    @contextlib.contextmanager
    def lora_at(self, comp_mask: torch.Tensor) -> Iterator[None]:
        """Within the context, the LoRA acts at the `<COMP>` positions of `comp_mask` `(batch, seq)` only
        (everywhere when `conditional_lora=False`)."""
        if self._gate is None:
            yield
        else:
            with self._gate.active(comp_mask):
                yield

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        comp_mask: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """The parallel training forward of a batch from `CCMDataCollator`, in one pass of the base model.

        Args:
            input_ids, segment_ids, position_ids: `(batch, seq)` long; see `transformers_ccm.masks`.
            comp_mask: `(batch, seq)` bool, True at `<COMP>` tokens.
            labels: `(batch, seq)` long, -100 except at output tokens; the loss is next-token NLL on those.
        """
        plan = block_attention(segment_ids, comp_mask, self.config)
        with self.lora_at(comp_mask):
            return self.base_model(
                inputs_embeds=self.embed(input_ids, comp_mask),
                attention_mask=plan.mask,
                position_ids=position_ids,
                labels=labels,
                use_cache=False,
                ccm_memory_mix=plan.memory_mix,
                **kwargs,
            )

    def num_parameters(self, only_trainable: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.num_parameters(only_trainable=True), self.num_parameters()
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")


def _check_supported(model: PreTrainedModel) -> None:
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"CCM wraps a transformers PreTrainedModel, got {name}; for a PEFT model pass its base model "
            "(merge_and_unload() first)."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model; CCM needs a decoder-only AutoModelForCausalLM.")
    if lora_layers(model):
        raise TypeError(f"{name} already holds LoRA layers; pass the base model without adapters.")
    if not model._supports_attention_backend:
        raise TypeError(
            f"{name} does not route its attention through transformers' AttentionInterface, which CCM needs to "
            f"insert its memory and block mask. Known to work: {', '.join(TESTED_MODEL_TYPES)}."
        )
    if not attention_modules(model):
        raise TypeError(f"{name}: found no attention layers (modules named *Attention with a layer_idx).")
    if model.config.model_type not in TESTED_MODEL_TYPES:
        logger.warning(
            "transformers-ccm has not been tested with model type %r; known to work: %s.",
            model.config.model_type,
            ", ".join(TESTED_MODEL_TYPES),
        )


def _use_ccm_attention(model: PreTrainedModel) -> None:
    current = model.config._attn_implementation
    if wrapped_implementation(current) is not None:
        return
    register_ccm_attention()
    if current in WRAPPED_IMPLEMENTATIONS:
        wrapped = current
    else:
        wrapped = "sdpa" if model._supports_sdpa else "eager"
        logger.warning("CCM needs arbitrary attention masks; switching %r to %r.", current, wrapped)
    model.set_attn_implementation(ccm_attention_name(wrapped))


def _initial_comp_embeddings(model: PreTrainedModel, num_comp_tokens: int) -> torch.Tensor:
    """`(n_comp, hidden)`: the mean of (embedded) vocabulary tokens, plus a little noise so the tokens differ."""
    embedding = model.get_input_embeddings()
    sample = torch.randint(0, embedding.num_embeddings, (min(4096, embedding.num_embeddings),))
    with torch.no_grad():
        embedded = embedding(sample.to(embedding.weight.device)).float()
    mean, std = embedded.mean(dim=0), embedded.std(dim=0)
    noise = torch.randn(num_comp_tokens, mean.shape[-1], device=mean.device) * 0.1 * std
    return (mean + noise).to(embedding.weight.dtype)
