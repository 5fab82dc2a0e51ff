"""The registered attention function: the model's own sdpa or eager attention, plus merge/EMA memory.

`register_ccm_attention()` adds `ccm_sdpa` and `ccm_eager` to transformers' `AttentionInterface` (and the
matching mask functions to `AttentionMaskInterface`, so ordinary 2D masks keep working). A model switched
to one of them behaves exactly as before, unless its forward is given `ccm_memory_mix`: then each layer
appends the merged memory slots to its keys/values (after projection and rotary embedding) before
attending, which a mask alone cannot express. Given a flex `BlockMask` instead of a dense mask (the
block-sparse training forward), it runs `flex_attention`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.flex_attention import get_flex_attention_lse_kwargs
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
        if isinstance(attention_mask, BlockMask):
            return flex_attention_forward(query, key, value, attention_mask, **kwargs)
        if wrapped == "eager":
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min
                )
            return _model_eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ccm_attention.__name__ = f"ccm_{wrapped}_attention"
    return ccm_attention


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: BlockMask,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a block-sparse mask (blocks no query sees are skipped): compiled on accelerators, eager
    (forward only) on CPU. Returns `(batch, seq, heads, head_dim)` as the model's attention functions do.

    Args:
        query: `(batch, heads, seq, head_dim)`; key, value: `(batch, kv_heads, keys, head_dim)`.
        s_aux: `(heads,)` attention-sink logits (GPT-OSS), or None.
    """
    if dropout:
        raise ValueError(
            f"Block-sparse (flex) attention has no attention dropout, and this model uses {dropout}; train with "
            'model.set_training_attention("dense").'
        )

    def softcapped(score: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)

    on_cpu = query.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)):
        # torch's own refusal ("set the input requires_grad to False or use another device") named no fix a CCM user
        # has: the inputs require grad because the adapter trains.
        raise ValueError(
            "Block-sparse (flex) training attention has no backward on CPU, where torch runs flex_attention forward "
            "only, and this forward builds a graph for one. Train on CPU with model.set_training_attention('dense') "
            "(or 'auto', which takes dense there), or run the forward under torch.no_grad()."
        )
    run = flex_attention if on_cpu else _compiled_flex_attention()
    output = run(
        query,
        key,
        value,
        block_mask=block_mask,
        score_mod=softcapped if softcap else None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        **get_flex_attention_lse_kwargs(s_aux is not None),
    )
    if s_aux is not None:
        output, aux = output
        lse = getattr(aux, "lse", aux)  # `(batch, heads, seq)` float32; torch < 2.9 returns it in place of `aux`
        # A sink is one more logit per head in every query's softmax, with no value: the attention it takes scales
        # the output by sum / (sum + exp(sink)), as the model's eager attention computes it.
        output = output * torch.sigmoid(lse - s_aux.float()[None, :, None])[..., None].to(output.dtype)
    return output.transpose(1, 2).contiguous(), None


def register_ccm_attention() -> None:
    """Register `ccm_sdpa` and `ccm_eager` with transformers (idempotent)."""
    for wrapped, mask_function in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        name = ccm_attention_name(wrapped)
        AttentionInterface.register(name, _make_ccm_attention(wrapped))
        AttentionMaskInterface.register(name, mask_function)
