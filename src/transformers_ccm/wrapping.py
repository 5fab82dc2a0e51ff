"""Wrapping a base model: what CCM checks of a decoder before it adds anything to it (a causal LM whose every
layer is attention routed through transformers' AttentionInterface, weights held where they run, keyword arguments
reaching attention, keys that rotary re-rotation moves exactly), and what it changes on it (CCM's attention, rotary
modules whose frequencies are set per forward run one thread at a time, the `<COMP>` embeddings' first values, a
`save_pretrained` that writes the base weights alone). `CCMForCausalLM` calls these; they never call it."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
import transformers
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from transformers_ccm.attention import (
    WRAPPED_IMPLEMENTATIONS,
    ccm_attention_name,
    register_ccm_attention,
    wrapped_implementation,
)
from transformers_ccm.config import CCMConfig
from transformers_ccm.lora import attention_modules, lora_layers, without_lora
from transformers_ccm.modes import evaluating
from transformers_ccm.streaming import KeyRotation, longrope_original_context

logger = logging.getLogger(__name__)

# transformers 5.24 renamed the cache argument of `forward()`/`generate()` and the output field from
# `past_key_values` to `cache`, keeping the old name as a deprecated alias; the base model is called with the
# name of the installed version, and a caller may use either.
CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


TESTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "gpt_neox",
    "olmo",
    "olmo2",
    "olmo3",
    "cohere",
    "cohere2",
    "smollm3",
    "starcoder2",
    "granite",
    "granitemoe",
    "glm",
    "glm4",
    "helium",
    "exaone4",
    "persimmon",
    "gptj",
    "codegen",
    "gpt_oss",
    "opt",
    "gpt_bigcode",
    "gpt2",
)


# The layer types (`config.layer_types`) CCM runs: attention over every key or a sliding window of them.
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def check_comp_room(config: CCMConfig, model: PreTrainedModel) -> None:
    """Raise if the `<COMP>` block leaves no position for a context: every compression would be refused (asking for
    shorter pieces), and training would run past the model's positions."""
    positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if positions is not None and config.num_comp_tokens >= positions:
        raise ValueError(
            f"num_comp_tokens={config.num_comp_tokens} leaves no room for a context in the {positions} positions of "
            f"the base model; use fewer <COMP> tokens (at most {positions - 1}; the paper uses 1 to 8)."
        )


def check_supported(model: PreTrainedModel) -> None:
    name = type(model).__name__
    compiled = getattr(model, "_orig_mod", None)  # what torch.compile(model) returns holds the model it compiles
    if not isinstance(model, PreTrainedModel) and isinstance(compiled, PreTrainedModel):
        raise TypeError(
            f"CCM wraps a transformers PreTrainedModel, got torch.compile's {name} around a {type(compiled).__name__}; "
            "pass the model itself (compiled._orig_mod) and compile it in place with model.compile(), before or after "
            "wrapping, or compile the CCM model."
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"CCM wraps a transformers PreTrainedModel, got {name}; for a PEFT model pass its base model "
            "(merge_and_unload() first)."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model; CCM needs a decoder-only AutoModelForCausalLM.")
    if not model.can_generate():  # compress() ran, and generate() failed deep inside with an AttributeError
        raise TypeError(
            f"{name} has no language-modelling head (it cannot generate); CCM needs a decoder-only causal LM: load it "
            "with AutoModelForCausalLM."
        )
    if lora_layers(model):
        raise TypeError(f"{name} already holds LoRA layers; pass the base model without adapters.")
    text_config = model.config.get_text_config(decoder=True)
    other_layers = sorted({str(kind) for kind in getattr(text_config, "layer_types", None) or ()} - ATTENTION_LAYERS)
    if other_layers:
        raise TypeError(
            f"{name} has layers of the types {other_layers} (config.layer_types), beside attention: a recurrent or "
            "convolution state (Mamba, linear attention), or attention CCM does not mask (chunked), whose history "
            "cannot be held in <COMP> keys and values. CCM needs a model whose every layer is full or sliding-window "
            "attention."
        )
    if not model._supports_attention_backend:
        # transformers ports architectures to the AttentionInterface one release at a time (GPT-J and CodeGen in
        # 5.24): a tested type refused here is one that the installed version has not ported yet.
        fix = (
            f"transformers {transformers.__version__} does not route {model.config.model_type}'s attention through it "
            "yet, a later version does: upgrade transformers (pip install -U transformers)"
            if model.config.model_type in TESTED_MODEL_TYPES
            else f"Known to work: {', '.join(TESTED_MODEL_TYPES)}"
        )
        raise TypeError(
            f"{name} does not route its attention through transformers' AttentionInterface, which CCM needs to "
            f"insert its memory and block mask. {fix}."
        )
    if not attention_modules(model):
        raise TypeError(f"{name}: found no attention layers (modules named *Attention with a layer_idx).")
    # A model without accelerate's hooks may hold its weights on the meta device (benchmarks measure shapes alone).
    check_weights_in_place(model, model, model.named_parameters() if hasattr(model, "_hf_hook") else ())
    if model.config.model_type not in TESTED_MODEL_TYPES:
        logger.warning(
            "transformers-ccm has not been tested with model type %r; known to work: %s.",
            model.config.model_type,
            ", ".join(TESTED_MODEL_TYPES),
        )


def _offloaded_modules(model: PreTrainedModel) -> list[str]:
    """The device-map entries whose weights accelerate keeps away from where they run: those on the disk, and
    those on the CPU beside accelerators (on a CPU-only map they run where they are)."""
    placement = {name: str(device) for name, device in (getattr(model, "hf_device_map", None) or {}).items()}
    accelerators = set(placement.values()) - {"cpu", "disk"}
    return sorted(name for name, device in placement.items() if device == "disk" or (device == "cpu" and accelerators))


def check_weights_in_place(
    model: nn.Module, base_model: PreTrainedModel, parameters: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Raise if weights of `model` (`base_model`, or a `CCMForCausalLM` around it) are not held where they run:
    accelerate offloads them (a device map with offloaded entries; `cpu_offload`, `disk_offload`, also once CCM
    wrapped the model), loading them per forward, or they were never loaded (the meta device: `init_empty_weights`).
    A LoRA layer added there holds no weights, an adapter copied in is lost, their digests cannot be read, and a
    forward swaps them in and out. `parameters`: the named weights of `model` to look for on the meta device."""
    offloaded = _offloaded_modules(base_model)
    where = f"has modules that accelerate offloads ({', '.join(offloaded[:3])}{' ...' if len(offloaded) > 3 else ''}"
    where += " in its device_map)"
    if not offloaded:
        offloaded = [name for name, parameter in parameters if parameter.is_meta]
        where = f"has weights on the meta device ({', '.join(offloaded[:3])}{' ...' if len(offloaded) > 3 else ''})"
    if offloaded:
        raise ValueError(
            f"{type(model).__name__} {where}: they are loaded per forward, or were never loaded (a model built under "
            "init_empty_weights), which CCM does not support. Load the base model with its weights, every module on a "
            "GPU or all on the CPU (device_map='auto' with enough max_memory, or device_map='cpu'), and undo "
            "cpu_offload or disk_offload with accelerate.hooks.remove_hook_from_module(model, recurse=True)."
        )


def use_ccm_attention(model: PreTrainedModel) -> None:
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


def frequency_setting_rotaries(model: PreTrainedModel) -> list[nn.Module]:
    """The rotary embedding modules whose forward sets their frequencies in place, by the last position of the
    forward (transformers' dynamic NTK and LongRoPE)."""
    found = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
        dynamic = any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in kinds)
        if dynamic and type(module).__name__.endswith("RotaryEmbedding"):
            found.append(module)
    return found


def uniform_rotation_positions(model: PreTrainedModel) -> int | None:
    """The most positions one forward of `model` may reach and still rotate with the frequencies of its original
    context, those online inference computes every key with (a cache re-bases positions before they pass it): past
    them a dynamic NTK rotary rescales and LongRoPE takes its long factors, for every position of that forward. None
    where no rotary module of `model` sets its frequencies by the forward."""
    limits = []
    for rotary in frequency_setting_rotaries(model):
        kinds = rotary.rope_type if isinstance(rotary.rope_type, dict) else {None: rotary.rope_type}
        for layer_type, kind in kinds.items():
            if kind == "longrope":
                limits.append(longrope_original_context(rotary, layer_type))
            elif "dynamic" in kind:  # transformers rescales past the module's original maximum
                limits.append(rotary.original_max_seq_len)
    return min(limits, default=None)


# Held while a rotary module of `frequency_setting_rotaries` sets its frequencies and computes with them.
_ROTARY_FORWARDS = threading.Lock()


@functools.cache
def one_at_a_time(rotary_class: type[nn.Module]) -> type[nn.Module]:
    """`rotary_class` with a forward that runs in one thread at a time: it sets the module's frequencies (shared by
    every call on the model) and then computes with them, and another thread's forward setting others in between made
    one user's call rotate with the frequencies of another's history (LongRoPE: long factors for a short history)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _ROTARY_FORWARDS:
            return rotary_class.forward(self, *args, **kwargs)

    def __reduce_ex__(self: nn.Module, protocol: int) -> tuple[Any, ...]:
        # pickle (torch.save of the model) looks a class up by its name, which names `rotary_class`, not this one.
        return _new_one_at_a_time, (rotary_class,), self.__getstate__()

    namespace = {
        "forward": forward,
        "__reduce_ex__": __reduce_ex__,
        "__module__": rotary_class.__module__,
        "__qualname__": rotary_class.__qualname__,
    }
    return type(rotary_class.__name__, (rotary_class,), namespace)


def _new_one_at_a_time(rotary_class: type[nn.Module]) -> nn.Module:
    """An empty module of `one_at_a_time(rotary_class)`, for pickle to fill with a saved one's state."""
    locked = one_at_a_time(rotary_class)
    return locked.__new__(locked)


# A keyword argument of `probe_base_model`'s forward, which every attention layer must receive.
_PROBE_KWARG = "ccm_probe"


@torch.no_grad()
def probe_base_model(model: PreTrainedModel, rotary_module: str | None) -> bool | None:
    """Run `model` on a few tokens at positions `0..n-1` (and, for a rotary model, at `shift..shift+n-1`). Raise a
    TypeError if its layers do not hand the forward's keyword arguments on to attention: CCM's masks and memory travel
    that way (Nemotron's decoder layers drop them; merge and EMA failed on a shape). Returns whether `KeyRotation`
    moves its keys where its own forward puts them, in every layer: not for rotary layouts other than `rotate_half`
    (interleaved pairs, as in Cohere, GLM, Helium and GPT-J), nor for layers without positions (SmolLM3 or Cohere 2
    NoPE layers); streaming and re-basing would move those keys to wrong positions. None, probing nothing, for weights
    not loaded yet (the meta device: `init_empty_weights`), which accelerate may put in place later: probe it then."""
    embeddings = model.get_input_embeddings().weight
    if embeddings.is_meta:
        return None
    rotary = None if rotary_module is None else model.get_submodule(rotary_module)
    # A table of sines and cosines instead of frequencies (GPT-J, CodeGen) is in interleaved pairs.
    movable = rotary is not None and any(name.endswith("inv_freq") for name, _ in rotary.named_buffers())
    length, shift = 4, 13  # within any original context: dynamic and LongRoPE rotaries keep their short frequencies
    ids = (torch.arange(length, device=embeddings.device) * 7 + 3)[None] % embeddings.shape[0]
    attention = attention_modules(model)
    # Whether each attention layer that ran received the keyword argument (cross-attention without an encoder,
    # as in a BERT decoder, does not run).
    reached: dict[int, bool] = {}
    probing = threading.get_ident()

    def note(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if threading.get_ident() == probing:  # not another thread's forward of the same model, meanwhile
            reached[id(module)] = reached.get(id(module), True) and kwargs.get(_PROBE_KWARG) is True

    handles = [module.register_forward_pre_hook(note, with_kwargs=True) for module in attention.values()]
    try:
        keys = []
        # In the model's own precision: keys rounded through layers autocast to half precision failed the tolerance of
        # fp32 weights, and streaming was refused for a model that streams.
        with torch.autocast(ids.device.type, enabled=False), evaluating(model):  # dropout would make the runs differ
            for start in (0, shift) if movable else (0,):
                cache = DynamicCache()
                positions = torch.arange(start, start + length, device=ids.device)[None]
                arguments = {CACHE_ARGUMENT: cache, _PROBE_KWARG: True}
                model(input_ids=ids, position_ids=positions, use_cache=True, **arguments)
                keys.append([layer.keys.float() for layer in cache.layers])
    finally:
        for handle in handles:
            handle.remove()
    if not all(reached.values()):
        raise TypeError(
            f"{type(model).__name__}'s layers do not hand the forward's keyword arguments on to their attention, "
            "which CCM needs to give every attention layer its <COMP> masks and memory."
        )
    kv_heads, head_dim = key_shape(model.config.get_text_config(decoder=True))
    cached = {tuple(layer_keys.shape) for layer_keys in keys[0]}
    if cached != {(1, kv_heads, length, head_dim)}:
        raise TypeError(
            f"{type(model).__name__} caches tensors of shapes {sorted(cached)} for {length} tokens, not the keys of "
            f"its {kv_heads} key/value heads of size {head_dim} (a compressed latent, as multi-head latent attention): "
            "CCM merges and re-rotates cached keys and values per head, so it cannot hold this model's memory."
        )
    if not movable:
        return False
    rotation = KeyRotation.of_model(model, rotary_module)
    # Moving keys by the wrong rotation errs by about their size; rounding through the layers, by far less.
    tolerance = 1e-3 if embeddings.dtype == torch.float32 else 1e-1
    return len(keys[0]) == model.config.get_text_config(decoder=True).num_hidden_layers and all(
        (rotation.shift(index, at_start, torch.full((length,), shift)) - shifted).norm() <= tolerance * shifted.norm()
        for index, (at_start, shifted) in enumerate(zip(*keys, strict=True))
    )


def key_shape(text_config: PretrainedConfig) -> tuple[int, int]:
    """The number of key/value heads and the size of each that a model's config gives."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    return kv_heads, getattr(text_config, "head_dim", None) or text_config.hidden_size // heads


def initial_comp_embeddings(model: PreTrainedModel, num_comp_tokens: int) -> torch.Tensor:
    """`(n_comp, hidden)`: the mean of (embedded) vocabulary tokens, plus a little noise so the tokens differ; float32
    on a float16 or bfloat16 base, as the LoRA (`inject_lora`), and cast at each use."""
    embedding = model.get_input_embeddings()
    sample = torch.randint(0, embedding.num_embeddings, (min(4096, embedding.num_embeddings),))
    with torch.no_grad():
        embedded = embedding(sample.to(embedding.weight.device)).float()
    mean, std = embedded.mean(dim=0), embedded.std(dim=0)
    noise = torch.randn(num_comp_tokens, mean.shape[-1], device=mean.device) * 0.1 * std
    return (mean + noise).to(torch.promote_types(embedding.weight.dtype, torch.float32))


def save_base_weights(base_model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """`base_model.save_pretrained(...)` while wrapped: its base weights under their own names, the LoRA left out (it
    is the adapter's, which `CCMForCausalLM.save_pretrained` saves)."""
    call = inspect.signature(type(base_model).save_pretrained).bind(base_model, *args, **kwargs)
    if call.arguments.get("distributed_checkpoint"):
        # transformers writes that checkpoint from the modules themselves, LoRA included, whatever the state_dict
        # (and on a model not sharded it fails after writing config.json).
        raise ValueError(
            "save_pretrained(distributed_checkpoint=True) on a base model wrapped by a CCM model would save the LoRA "
            "layers with the base weights. Save the base without distributed_checkpoint (its weights are gathered "
            "on one process), and the adapter with the CCM model's save_pretrained()."
        )
    given = call.arguments.get("state_dict")
    call.arguments["state_dict"] = without_lora(base_model, base_model.state_dict() if given is None else given)
    return type(base_model).save_pretrained(*call.args, **call.kwargs)
