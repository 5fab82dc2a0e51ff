"""The registered attention function: the model's own sdpa or eager attention, plus merge/EMA memory.

`register_ccm_attention()` adds `ccm_sdpa` and `ccm_eager` to transformers' `AttentionInterface` (and the
matching mask functions to `AttentionMaskInterface`, so ordinary 2D masks keep working). A model switched
to one of them behaves exactly as before, unless its forward is given `ccm_memory_mix`: then each layer
appends the merged memory slots to its keys/values (after projection and rotary embedding) before
attending, which a mask alone cannot express.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

WRAPPED_IMPLEMENTATIONS = ("sdpa", "eager")
_PREFIX = "ccm_"


def ccm_attention_name(wrapped: str) -> str:
    """The registered name of the CCM attention that wraps `wrapped` ("sdpa" or "eager")."""
    return _PREFIX + wrapped


def wrapped_implementation(attn_implementation: str | None) -> str | None:
    """The implementation a CCM attention name wraps, or None if the name is not one of ours."""
    if attn_implementation and attn_implementation.startswith(_PREFIX):
        return attn_implementation.removeprefix(_PREFIX)
    return None


def _model_eager_attention(module: torch.nn.Module) -> Callable[..., Any]:
    """The `eager_attention_forward` of the module's own modeling file (softcapping, sinks... included)."""
    modeling = sys.modules[type(module).__module__]
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        raise TypeError(
            f"{type(module).__name__} has no eager_attention_forward in {modeling.__name__}; "
            "load the base model with attn_implementation='sdpa'."
        )
    return eager


def append_memory(
    key: torch.Tensor, value: torch.Tensor, memory_mix: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append merged memory slots to a layer's keys and values.

    Args:
        key, value: `(batch, kv_heads, seq, head_dim)`, after rotary embedding.
        memory_mix: `(batch, mem, seq)`.

    Returns:
        key and value of shape `(batch, kv_heads, seq + mem, head_dim)`.
    """
    mix = memory_mix.to(key.dtype)[:, None]
    return torch.cat([key, mix @ key], dim=2), torch.cat([value, mix @ value], dim=2)


def _make_ccm_attention(wrapped: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def ccm_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        ccm_memory_mix: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if ccm_memory_mix is not None:
            key, value = append_memory(key, value, ccm_memory_mix)
        if wrapped == "eager":
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min
                )
            return _model_eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ccm_attention.__name__ = f"ccm_{wrapped}_attention"
    return ccm_attention


def register_ccm_attention() -> None:
    """Register `ccm_sdpa` and `ccm_eager` with transformers (idempotent)."""
    for wrapped, mask_function in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        name = ccm_attention_name(wrapped)
        AttentionInterface.register(name, _make_ccm_attention(wrapped))
        AttentionMaskInterface.register(name, mask_function)
