"""`CCMForCausalLM`: any decoder-only causal LM with `<COMP>` embeddings and a conditional LoRA."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import logging
import operator
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.generation import GenerationMode, StoppingCriteria, StoppingCriteriaList
from transformers.generation import stopping_criteria as transformers_criteria
from transformers.generation.streamers import BaseStreamer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from transformers_ccm.attention import (
    WRAPPED_IMPLEMENTATIONS,
    ccm_attention_name,
    register_ccm_attention,
    wrapped_implementation,
)
from transformers_ccm.cache import CacheSpec, CompressedMemoryCache
from transformers_ccm.config import BUILT_FIELDS, CCMConfig, base_shape
from transformers_ccm.data import IGNORE_INDEX, predicting_positions
from transformers_ccm.embedded import load_base_model
from transformers_ccm.hub import check_base_shape
from transformers_ccm.hub_mixin import AdapterHubMixin
from transformers_ccm.identity import adapter_digest, computing_settings, weights_fingerprint
from transformers_ccm.lora import (
    ADAPTER_NAME,
    COMP_MASK_KWARG,
    LoRAGate,
    attention_modules,
    inject_lora,
    lora_layers,
)
from transformers_ccm.masks import SlidingWindow, as_block_masks, comp_ranks, windowed_block_attention
from transformers_ccm.streaming import KeyRotation, StreamingConfig
from transformers_ccm.validation import is_index
from transformers_ccm.wrapping import (
    CACHE_ARGUMENT,
    check_comp_room,
    check_supported,
    check_weights_in_place,
    frequency_setting_rotaries,
    initial_comp_embeddings,
    key_shape,
    one_at_a_time,
    probe_base_model,
    save_base_weights,
    use_ccm_attention,
)

logger = logging.getLogger(__name__)

TrainingAttention = Literal["auto", "dense", "flex"]
TRAINING_ATTENTION: tuple[str, ...] = ("auto", "dense", "flex")

# The names a caller may pass the cache under: transformers 5.24 renamed `past_key_values` to `cache` (`CACHE_ARGUMENT`
# is the installed version's), keeping the old one as a deprecated alias.
CACHE_ARGUMENTS = ("cache", "past_key_values")


class _Registrations:
    """The latest parameter or submodule registered on a module of a listed model (counted by torch's global
    registration hooks), so that a model sees when its parameters may have been replaced. Registrations on other
    modules do not count: most decoders slice their layer list in every forward, which registers each layer in a new
    list, and counting those listed every model again at every call (milliseconds on 30 layers)."""

    _ids = itertools.count(1)
    latest = 0
    _watched: ClassVar[weakref.WeakSet[nn.Module]] = weakref.WeakSet()

    @classmethod
    def register(cls, module: nn.Module, *_: Any) -> None:
        if module in cls._watched:
            # A unique id each, not `latest += 1`: two racing increments could write back a value already read.
            cls.latest = next(cls._ids)

    @classmethod
    def watch(cls, model: nn.Module) -> None:
        """Count registrations on the modules of `model` from now on (a module attached later is registered on one
        of them, which counts)."""
        for module in model.modules():
            cls._watched.add(module)


register_module_parameter_registration_hook(_Registrations.register)
register_module_module_registration_hook(_Registrations.register)


class _ModelState(NamedTuple):
    """What a call's result depends on in the model, cheaply compared (`CCMForCausalLM._state`)."""

    adapter_versions: tuple[tuple[int, int], ...]  # version counter and storage of every adapter weight
    base_versions: tuple[tuple[int, int], ...]  # the same of every base weight
    attention: str  # the base model's attention implementation
    lora_scaling: tuple[float, ...]  # the scaling (lora_alpha / r) each LoRA layer multiplies its branch by
    conditional_lora: bool  # whether the gate keeps the LoRA to <COMP> positions
    peft_path_off: tuple[bool, ...]  # per LoRA layer, whether PEFT's own LoRA path is off (`_check_wrapping`)
    base_config: dict[str, Any]  # the base config's entries that change its numbers (`computing_settings`)
    training: tuple[bool, ...]  # every module's mode (dropout acts in training mode)
    mode_switch: int  # the latest `CCMForCausalLM.train()` or `eval()` that changed a mode: a switch and back counts
    memory_rule: tuple[str, float | None, int | None]  # update rule, EMA coefficient (ema only) and concat cap


_TRAINING = operator.attrgetter("training")  # a module's mode
# Numbers `CCMForCausalLM.train()` calls that change a module's mode (unique, as `_Registrations._ids`).
_MODE_SWITCHES = itertools.count(1)


def _tuple_on_request(forward: Callable[..., CausalLMOutputWithPast]) -> Callable[..., Any]:
    """transformers' `return_dict` for `CCMForCausalLM.forward`: its paths read fields of the base model's outputs, so
    they always run with `return_dict=True`; the caller gets a tuple when it passes `return_dict=False` (or leaves it
    unset and the base model's config says so), as from a transformers model."""

    @functools.wraps(forward)
    def wrapper(self: CCMForCausalLM, *args: Any, return_dict: bool | None = None, **kwargs: Any) -> Any:
        output = forward(self, *args, return_dict=True, **kwargs)
        wanted = self.base_model.config.return_dict if return_dict is None else return_dict
        return output if wanted else output.to_tuple()

    return wrapper


class CCMForCausalLM(AdapterHubMixin, nn.Module):
    """A causal LM that compresses contexts into the keys/values of `<COMP>` tokens.

    The base model's weights are frozen; only the LoRA layers and `comp_embeddings` (`(n_comp, hidden)`)
    train. Build one with `from_base`, or load a saved adapter with `from_pretrained` (`AdapterHubMixin`).
    """

    def __init__(self, base_model: PreTrainedModel, config: CCMConfig) -> None:
        _check_config(config)
        check_supported(base_model)
        check_base_shape(config, base_model.name_or_path, base_shape(base_model.config))
        check_comp_room(config, base_model)
        super().__init__()
        self.config = replace(config, base_model_shape=base_shape(base_model.config))
        self.base_model = base_model
        # What `_release_base` restores; the LoRA goes in first, so that a refused one leaves the model as it was.
        self._base_before = (
            {name: parameter.requires_grad for name, parameter in base_model.named_parameters()},
            base_model.config._attn_implementation,
        )
        # Digests of the adapter and base weights, each with the parameter versions it was computed at.
        self._digests: dict[str, tuple[tuple[tuple[int, int], ...], str]] = {}
        # The weights by kind, the LoRA layers, every module and whether a weight was on the meta device, with the count
        # of module registrations in the process when they were listed.
        self._listed: (
            tuple[int, dict[str, list[tuple[str, torch.Tensor]]], list[LoraLayer], list[nn.Module], bool] | None
        ) = None
        self._mode_switch = 0  # `_ModelState.mode_switch`
        # The base config's `computing_settings`, with the config and a deep copy of its entries they were read from.
        self._settings: tuple[PretrainedConfig, dict[str, Any], dict[str, Any]] | None = None
        self.training_attention: TrainingAttention = "auto"
        # The classes `_release_base` gives back to the rotary modules that `one_at_a_time` replaced.
        self._rotary_classes: list[tuple[nn.Module, type[nn.Module]]] = []
        try:
            self._wrap_base(config)
        except BaseException:
            # Failed half way (an out-of-memory error while the LoRA went in, an interrupt): the caller's model would
            # keep some LoRA layers, and every later from_base() of it would refuse a model that holds LoRA layers.
            self._release_base()
            raise

    def _wrap_base(self, config: CCMConfig) -> None:
        """Add the LoRA, the `<COMP>` embeddings, the gate and CCM's attention to `base_model` (`_release_base` undoes
        it, also part of it)."""
        base_model = self.base_model
        self._rotary_module = KeyRotation.module_name(base_model)
        # Checked on the model as it was given, before anything is added to it (None: its weights are not loaded yet).
        self._keys_movable: bool | None = probe_base_model(base_model, self._rotary_module)
        inject_lora(base_model, config)
        self._lora_config = base_model.peft_config[ADAPTER_NAME]  # `_check_lora_layers`
        base_model.requires_grad_(False)
        for layer in lora_layers(base_model):
            layer.lora_A.requires_grad_(True)
            layer.lora_B.requires_grad_(True)
        self.comp_embeddings = nn.Parameter(initial_comp_embeddings(base_model, config.num_comp_tokens))
        self._gate = LoRAGate(base_model, conditional=config.conditional_lora)
        use_ccm_attention(base_model)
        self._online_hook = base_model.register_forward_pre_hook(self._online_inputs, with_kwargs=True)
        self._online_end_hook = base_model.register_forward_hook(self._online_outputs, with_kwargs=True)
        # transformers saved the LoRA's entries and renamed weights, which a reload read as missing weights (random
        # attention, with a warning only); the base saves its own weights, as PEFT's `unload()` gives them back.
        base_model.save_pretrained = functools.partial(save_base_weights, base_model)
        for module in frequency_setting_rotaries(base_model):
            self._rotary_classes.append((module, type(module)))
            module.__class__ = one_at_a_time(type(module))
        # The LoRA's dropout modules (and this module) start in training mode; transformers loads a base model in eval
        # mode, where a dropout left on would make every compression of the loaded model random.
        self.train(base_model.training)

    def __getstate__(self) -> dict[str, Any]:
        """The model without its listing and digests of its weights (`_listing`, `_digest`): a copy (`copy.deepcopy`,
        a pickle) lists its own weights at its first call, which also watches its modules; one that kept the listing
        of the model it was copied from never saw its weights replaced, and accepted memories of the weights before."""
        return {**super().__getstate__(), "_listed": None, "_digests": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """`nn.Module.__setstate__`, with CCM's attention registered with transformers: wrapping registers it, and a
        model unpickled in a process that wrapped none (a spawned worker, `torch.load`) failed its first call."""
        register_ccm_attention()
        super().__setstate__(state)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CCMForCausalLM:
        """`nn.Module._apply` (`to()`, `half()`, `to_empty()`, ...). Where a parameter cannot take the converted
        tensor as its data (onto or off the meta device), torch puts a new one in place without its registration
        hooks: the weights are listed again at the next call, also after a conversion that failed half way."""
        try:
            return super()._apply(fn, recurse)
        finally:
            self._listed = None

    @property
    def config(self) -> CCMConfig:
        """The adapter's settings. The update rule, EMA coefficient and concat cap may change (memories made before are
        then refused); the fields the model was built with (`BUILT_FIELDS`: `<COMP>` count, LoRA shape and gate) may
        not."""
        config = self._config
        config._hold_built_fields()  # again: a copy of the model (copy.deepcopy, a pickle) copies it without the hold
        return config

    @config.setter
    def config(self, config: CCMConfig) -> None:
        _check_config(config)
        current = self.__dict__.get("_config")
        changed = [] if current is None else [n for n in BUILT_FIELDS if getattr(config, n) != getattr(current, n)]
        if changed:
            details = ", ".join(f"{n}: {getattr(current, n)!r} to {getattr(config, n)!r}" for n in changed)
            raise ValueError(
                f"The model's config cannot change the fields its LoRA layers and <COMP> embeddings were built with "
                f"({details}). Build a new model with CCMForCausalLM.from_base(base_model, config)."
            )
        if config.__dict__.get("_recorded", False):
            # A cache's record (`model.config = cache.config`) stays the cache's, unchanged; the model's may change.
            config = replace(config)
        config._hold_built_fields()
        self._config = config

    @classmethod
    def from_base(
        cls,
        model: str | os.PathLike[str] | PreTrainedModel,
        config: CCMConfig | None = None,
        **from_pretrained_kwargs: Any,
    ) -> CCMForCausalLM:
        """Wrap a loaded model, or load one by local path or Hub id (kwargs go to `from_pretrained`)."""
        config = CCMConfig() if config is None else config
        _check_config(config)  # before a base model is loaded
        if isinstance(model, (str, os.PathLike)):
            model = load_base_model(model, **from_pretrained_kwargs)
        elif from_pretrained_kwargs:
            raise TypeError(
                f"from_base got a loaded model and loading arguments {sorted(from_pretrained_kwargs)}; "
                "pass those arguments only with a path or Hub id."
            )
        base_name = config.base_model_name_or_path or getattr(model, "name_or_path", None) or None
        revision = (
            config.base_model_revision
            or from_pretrained_kwargs.get("revision")
            or getattr(getattr(model, "config", None), "_commit_hash", None)
        )
        config = replace(config, base_model_name_or_path=base_name, base_model_revision=revision)
        return cls(model, config)

    @property
    def generation_config(self) -> GenerationConfig:
        """The settings `generate()` starts from: the base model's, read and replaced here as on a transformers model
        (an attribute of this module would be ignored by `generate()`)."""
        return self.base_model.generation_config

    @generation_config.setter
    def generation_config(self, config: GenerationConfig) -> None:
        self.base_model.generation_config = config

    @property
    def device(self) -> torch.device:
        """Where the model runs (that of its `<COMP>` embeddings, which live beside the base model's weights)."""
        return self.comp_embeddings.device

    @property
    def dtype(self) -> torch.dtype:
        """The base model's dtype: that of its caches and memories (the adapter's weights may be float32)."""
        return self.base_model.dtype

    @property
    def vocabulary_size(self) -> int:
        """Rows of the input embedding: token ids must lie in `0..vocabulary_size - 1`."""
        return self.base_model.get_input_embeddings().num_embeddings

    @property
    def absolute_position_limit(self) -> int | None:
        """How many learned absolute positions the base model has (GPT-2's 1024), which no position may reach or
        pass; None for rotary models, whose positions are relative (the online path re-bases them)."""
        return None if self._rotary_module is not None else getattr(self._text_config, "max_position_embeddings", None)

    def embed(self, input_ids: torch.Tensor, comp_mask: torch.Tensor) -> torch.Tensor:
        """`(batch, seq, hidden)` input embeddings; `<COMP>` positions take `comp_embeddings` (ids ignored)."""
        ordinary = self.base_model.get_input_embeddings()(input_ids.masked_fill(comp_mask, 0))
        # An embedding lookup, not indexing: indexing's backward on a CPU sums the gradient in an order that varies
        # between runs, so two trainings from one seed gave two adapters.
        comp = nn.functional.embedding(comp_ranks(comp_mask, self.config.num_comp_tokens), self.comp_embeddings)
        return torch.where(comp_mask[..., None], comp.to(ordinary.dtype), ordinary)

    def train(self, mode: bool = True) -> CCMForCausalLM:
        """`nn.Module.train`, which counts as a change of the model for the calls running meanwhile in other threads
        (`_unchanged_since`) when it changes any module's mode, also when `eval()` switches it back before they end:
        they ran their first layers without dropout and their last ones with it."""
        modes = self._modes()
        super().train(mode)
        if self._modes() != modes:
            self._mode_switch = next(_MODE_SWITCHES)
        return self

    def set_training_attention(self, kind: TrainingAttention) -> None:
        """How the parallel training forward attends: `"flex"`, block-sparse `flex_attention` (blocks of the
        CCM mask that no query sees are skipped; compiled on accelerators, forward-only on CPU); `"dense"`, the
        model's own sdpa or eager attention with the full mask; `"auto"` (default): flex on CUDA for models
        whose code takes flex masks, unless they drop attention weights in training (attention dropout), else
        dense."""
        if kind not in TRAINING_ATTENTION:
            raise ValueError(f"Training attention must be one of {TRAINING_ATTENTION}, got {kind!r}.")
        if kind == "flex" and not self.base_model._supports_flex_attn:
            raise ValueError(
                f"{type(self.base_model).__name__} does not take flex attention masks; use 'dense' (or 'auto')."
            )
        self.training_attention = kind

    def _auto_flex(self, device: torch.device) -> bool:
        """Whether `"auto"` trains with flex attention on `device`: on CUDA, for a model whose code takes flex masks and
        that drops no attention weight in this forward (flex has no attention dropout: it stopped the first step)."""
        if not (device.type == "cuda" and self.base_model._supports_flex_attn):
            return False
        return not self.base_model.training or _attention_dropout(self.base_model) == 0

    def set_attn_implementation(self, implementation: str) -> None:
        """Run the base model's attention with `"sdpa"` or `"eager"`, inside CCM's attention (which adds the memory and
        the `<COMP>` masks). Switching the base model itself (`base_model.set_attn_implementation`) would drop it; calls
        then refuse to run."""
        if implementation not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(
                f"CCM runs its memory inside 'sdpa' or 'eager' attention, got {implementation!r}; pass one of those."
            )
        self.base_model.set_attn_implementation(ccm_attention_name(implementation))

    def _check_wrapping(self) -> None:
        """Raise if the base model was switched away from how CCM runs it after it was wrapped: its attention
        (another lacks CCM's memory and <COMP> masks), its weights (offloaded by accelerate), or PEFT's own LoRA path
        (which adds the LoRA at every token, besides the gate's)."""
        current = self.base_model.config._attn_implementation
        if wrapped_implementation(current) is None:
            raise ValueError(
                f"The base model's attention is {current!r}, which lacks CCM's memory and <COMP> masks (it was "
                "switched after the model was wrapped); switch with model.set_attn_implementation('sdpa' or 'eager')."
            )
        self._check_in_place()
        self._check_lora_layers()
        enabled = [layer for layer in self._listing()[1] if not layer.disable_adapters]
        if enabled:
            raise ValueError(
                f"{len(enabled)} LoRA layers run PEFT's own LoRA path (enable_adapters(True) was called on them), "
                "which adds the LoRA at every token besides CCM's conditional one; switch it off again with "
                "layer.enable_adapters(False): CCM runs the LoRA itself (use model.adapter_disabled() for the base "
                "model alone)."
            )

    def _check_in_place(self) -> None:
        """`check_weights_in_place` for this model's weights: those listed (`_listing`; a walk over its modules costs
        milliseconds per call), read anew where accelerate's hooks are on the model or a listed one is on the meta
        device. accelerate replaces weights without torch's registration hooks (its offload hooks, and
        `set_module_tensor_to_device`, which fills a model built under `init_empty_weights`): the weights are then
        listed again at the next call, so that a call does not hold the model to weights replaced since, and fail as
        if another thread changed them."""
        hooked = any(hasattr(module, "_hf_hook") for module in (self, self.base_model))
        weights: list[tuple[str, torch.Tensor]] = []
        if hooked or self._listing()[3]:
            self._listed = None
            weights = list(self.named_parameters())
        check_weights_in_place(self, self.base_model, weights)

    def _check_lora_layers(self) -> None:
        """Raise if PEFT changed the adapter after the model was wrapped (get_peft_model or add_adapter with targets
        beside CCM's LoRA layers, which `inject_lora` keeps PEFT from updating): LoRA layers the gate does not run,
        which act at every token, or another config under the adapter's name; a save would write an adapter that
        does not load."""
        configs = getattr(self.base_model, "peft_config", {})
        replaced = list(configs) != [ADAPTER_NAME] or configs[ADAPTER_NAME] is not self._lora_config
        listed, gated_layers = self._listing()[1], self._gate.layers
        if not replaced and len(listed) == len(gated_layers) and all(map(operator.is_, listed, gated_layers)):
            return
        gated = {id(layer) for layer in gated_layers}
        added = [
            name
            for name, module in self.base_model.named_modules()
            if isinstance(module, LoraLayer) and id(module) not in gated
        ]
        details = [f"LoRA layers added on {added[:3]}{' ...' if len(added) > 3 else ''}"] if added else []
        details += [f"base_model.peft_config replaced ({sorted(configs)})"] if replaced else []
        raise ValueError(
            f"PEFT changed this CCM model's adapter after it was wrapped: {'; '.join(details)}, by get_peft_model or "
            "add_adapter on the model or its base_model. A CCM model takes no PEFT adapter: the added LoRA would act "
            "at every token, and a saved adapter would not load. Build the model again (CCMForCausalLM.from_base or "
            "from_pretrained); merge a plain LoRA into the base model (merge_and_unload()) before wrapping it."
        )

    def _release_base(self) -> None:
        """Give `base_model` back as it was before this model was built around it (a load into a caller's model
        failed): hooks removed, each LoRA layer replaced by the layer it wraps, its attention implementation and
        `requires_grad` flags restored. This model is unusable afterwards. Also after `_wrap_base` failed half way: only
        what it did is undone."""
        requires_grad, attention = self._base_before
        hooks = ("_gate", "_online_hook", "_online_end_hook")
        for added in (self.__dict__.get(name) for name in hooks):
            if added is not None:
                added.remove()
        for module, rotary_class in self._rotary_classes:
            module.__class__ = rotary_class
        for name, module in list(self.base_model.named_modules()):
            if isinstance(module, LoraLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.base_model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(self.base_model, "peft_config"):
            del self.base_model.peft_config
        self.base_model.__dict__.pop("save_pretrained", None)
        self.base_model.set_attn_implementation(attention)
        for name, parameter in self.base_model.named_parameters():
            parameter.requires_grad_(requires_grad[name])

    def lora_at(self, comp_mask: torch.Tensor) -> AbstractContextManager[None]:
        """Within the context, in this thread or task, the LoRA acts at the `<COMP>` positions of `comp_mask`
        `(batch, seq)` only (everywhere when `conditional_lora=False`) in calls of `base_model`; a call on a cache
        decides that itself."""
        return self._gate.active(comp_mask)

    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: dict[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """Recompute each decoder layer's activations during backward (transformers' activation checkpointing,
        non-reentrant unless `activation_checkpointing_kwargs` says `use_reentrant=True`), with the LoRA acting in
        the recomputation exactly where it acted in the forward, whatever modules it targets.

        The arguments are transformers' (the `Trainer` passes them by name with `activation_checkpointing=True`):
        `every_n_layers` checkpoints only every n-th decoder layer, `offload` keeps the saved activations in host
        memory."""
        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        if kwargs["use_reentrant"]:
            inside = {id(m) for a in attention_modules(self.base_model).values() for m in a.modules()}
            outside = [layer for layer in lora_layers(self.base_model) if id(layer) not in inside]
            if outside:
                raise ValueError(
                    f"{len(outside)} LoRA layers sit outside attention (target_modules {self.config.target_modules}); "
                    "reentrant checkpointing would recompute them without the <COMP> mask. Pass "
                    "use_reentrant=False (the default)."
                )
        else:
            kwargs.setdefault("context_fn", LoRAGate.checkpoint_contexts)
        # transformers registers the embeddings' require-grads hook at every call, and keeps a handle on the last
        # one only: enabled twice, a hook stayed for good, which no disable removed.
        self.base_model.disable_input_require_grads()
        self.base_model.activation_checkpointing_enable(kwargs, every_n_layers=every_n_layers, offload=offload)

    def adapter_disabled(self) -> AbstractContextManager[None]:
        """Within the context, in this thread or task, the model is exactly its base model (no LoRA anywhere); a call
        on a cache in which the adapter would act (`compress`, say) is refused."""
        return self._gate.suppressed()

    def reading_plain_prompt(self) -> AbstractContextManager[None]:
        """Within the context, `base_model` reads a plain prompt (no `<COMP>` tokens) as this adapter would: a
        compression adapter is off (exactly the base model), a LoRA at every position (`conditional_lora=False`,
        e.g. the fine-tuned full-context baseline) stays on."""
        return self.adapter_disabled() if self.config.conditional_lora else nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`nn.Module`'s call; with a `CompressedMemoryCache`, one transaction on it together with the hooks registered
        on this module, which run around `forward`: a forward hook that failed (or an interrupt while one ran) left
        the cache holding the call's tokens, though the call raised."""
        cache = passed_cache(kwargs)
        if cache is None and len(args) > _CACHE_POSITION:
            cache = args[_CACHE_POSITION]
        if not isinstance(cache, CompressedMemoryCache):
            return super().__call__(*args, **kwargs)
        with cache.transaction():
            return super().__call__(*args, **kwargs)

    @_tuple_on_request
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        comp_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: CompressedMemoryCache | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_at_labels: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Either the parallel training forward of a `CCMDataCollator` batch, in one pass of the base model,
        or (with `past_key_values`, a `CompressedMemoryCache`) an online forward of new tokens of the turn.

        Args:
            input_ids, segment_ids, position_ids: `(batch, seq)` long; see `transformers_ccm.masks`.
            comp_mask: `(batch, seq)` bool, True at `<COMP>` tokens.
            labels: `(batch, seq)` long, -100 except at output tokens; the loss is next-token NLL on those.
            past_key_values: online only: the memory to attend to; the new tokens join its current turn (also
                accepted as `cache`, transformers' name since 5.24). With it, the training-only arguments
                (segment_ids, comp_mask, position_ids, logits_at_labels) are refused.
            attention_mask: online only: `(batch, new)` or `(batch, turn + new)`, 0 at padding.
            logits_at_labels: training only: run the LM head only at the positions that predict a label (the
                same loss, a fraction of the head's cost); `out.logits` then holds those positions only,
                `(batch, positions, vocab)`, the positions being where any row of the batch has a label next.
        """
        past_key_values = _given_cache(past_key_values, kwargs)
        if isinstance(past_key_values, CompressedMemoryCache):
            training = {"segment_ids": segment_ids, "comp_mask": comp_mask, "position_ids": position_ids}
            given = [name for name, value in training.items() if value is not None]
            given += ["logits_at_labels"] if logits_at_labels else []
            if given:  # the online path would ignore them: a training batch's ids would run as a turn
                raise ValueError(
                    f"{', '.join(given)} belong to the training forward (a CCMDataCollator batch, without a cache). "
                    "With a CompressedMemoryCache pass input_ids (or inputs_embeds) and attention_mask only: the cache "
                    "numbers the positions itself."
                )
            return self._online_forward(past_key_values, input_ids, attention_mask, labels, **kwargs)
        if past_key_values is not None:
            return self.base_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                labels=labels,
                **{CACHE_ARGUMENT: past_key_values},
                **kwargs,
            )
        self._check_wrapping()
        if segment_ids is None or comp_mask is None or position_ids is None or input_ids is None:
            raise ValueError(
                "The training forward needs input_ids, segment_ids, comp_mask and position_ids (a CCMDataCollator "
                "batch); for online inference pass past_key_values=model.new_cache(...)."
            )
        self._check_batch(input_ids, comp_mask, segment_ids=segment_ids, position_ids=position_ids, labels=labels)
        mask, memory_mix = windowed_block_attention(
            segment_ids, comp_mask, position_ids, self.config, SlidingWindow.of(self._text_config)
        )
        kind = self.training_attention
        if kind == "flex" or (kind == "auto" and self._auto_flex(segment_ids.device)):
            mask = as_block_masks(mask)
        # The mask travels with the call, so that gradient checkpointing's recomputation sees it too; the context
        # covers LoRA layers outside the decoder layers, if any were targeted.
        predicting = None
        if logits_at_labels and labels is not None:
            predicting = predicting_positions(labels)
            kwargs["logits_to_keep"] = predicting
        with self.lora_at(comp_mask):
            output = self.base_model(
                inputs_embeds=self.embed(input_ids, comp_mask),
                attention_mask=mask,
                position_ids=position_ids,
                labels=labels if predicting is None else None,
                use_cache=False,
                ccm_memory_mix=memory_mix,
                **{COMP_MASK_KWARG: comp_mask},
                **{key: value for key, value in kwargs.items() if predicting is None or key != "num_items_in_batch"},
            )
        if predicting is not None:
            output.loss = self.base_model.loss_function(
                logits=output.logits,
                labels=None,
                vocab_size=output.logits.shape[-1],
                shift_labels=labels[:, predicting + 1],
                num_items_in_batch=kwargs.get("num_items_in_batch"),
            )
        _zero_loss_without_labels(output, labels, kwargs.get("num_items_in_batch"))
        return output

    # ----- online inference --------------------------------------------------------------------------------
    def new_cache(self, batch_size: int = 1, streaming: StreamingConfig | None = None) -> CompressedMemoryCache:
        """An empty memory for `batch_size` users, or with `streaming` an empty bounded stream per row."""
        return CompressedMemoryCache(self.cache_spec(), batch_size, streaming=streaming)

    def cache_spec(self) -> CacheSpec:
        """What this model's caches need to know of it (shapes, positions, rotary frequencies, signature)."""
        text_config = self._text_config
        kv_heads, head_dim = key_shape(text_config)
        signature = self.memory_signature()  # refused while weights are offloaded or on the meta device
        if self._keys_movable is None:
            # Wrapped before its weights were loaded (init_empty_weights, then accelerate's load_checkpoint_and_dispatch
            # or set_module_tensor_to_device): probed now that they are, or streaming was refused for a Llama.
            self._keys_movable = probe_base_model(self.base_model, self._rotary_module)
        # Read now, not when the model was wrapped: a cast since then rounded the frequencies the model rotates with.
        rotation = rebase_rotation = None
        if self._keys_movable:
            rotation = KeyRotation.of_model(self.base_model, self._rotary_module)
            rebase_rotation = KeyRotation.of_model(self.base_model, self._rotary_module, at_max_positions=True)
        return CacheSpec(
            config=self.config._record(),  # the settings of the memory made now, whatever the model's become
            signature=signature,
            num_layers=text_config.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
            rotation=rotation,
            rebase_rotation=rebase_rotation,
            max_positions=getattr(text_config, "max_position_embeddings", None),
            sliding_window=SlidingWindow.of(text_config),
        )

    @property
    def _text_config(self) -> PretrainedConfig:
        return self.base_model.config.get_text_config(decoder=True)

    @torch.no_grad()
    def compress(
        self,
        cache: CompressedMemoryCache,
        context_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Compress a context into `cache`: `Mem(t) = update(Mem(t-1), h(t))`.

        The context `c(t)` is the cache's current turn (what `generate()` produced, never re-encoded) followed by
        `context_ids`. Only those of its tokens without keys/values yet run, then the `<COMP>` block; the turn is
        then replaced by the `<COMP>` keys/values according to the update rule. If anything fails, the cache is
        left as it was.

        Args:
            context_ids: `(batch, len)` or `(len,)` new context tokens (a tensor, or lists of ints), or None to
                fold the turn alone.
            attention_mask: `(batch, len)` of `context_ids` (given only with them), 0 at padding. A row with no
                token (and no turn) keeps its memory.
        """
        _check_is_cache(cache)
        with cache.running("compress()"):  # claimed before the checks: no other call changes it after them
            state = self._check_owner(cache)
            self._check_adapter_acts(cache, "compress()", compresses=True)
            cache.check_compressible()
            context, context_mask = self._context(cache, context_ids, attention_mask)
            pending_mask = cache.pending_mask.to(context_mask.device)
            rows = (
                cache.turn_mask.any(dim=1).to(context_mask.device) | pending_mask.any(dim=1) | context_mask.any(dim=1)
            )
            # A turn of padding alone (its rows' tokens left behind by batch_select_indices, say) is folded all the
            # same: it adds nothing to any row's memory, and generate() and save() refuse the cache until it is folded.
            if not rows.any() and not cache.has_unfolded_turn:
                raise ValueError(
                    "Nothing to compress: the context is empty and the cache holds no turn to fold. Pass context_ids "
                    "with at least one token."
                )
            n, batch, device = self.config.num_comp_tokens, cache.batch_size, self.device
            with self._unchanged_since(state, "compress()"):
                pending_ids, pending_mask = cache.take_pending()
                ids = torch.cat([pending_ids.to(device), context.to(device)], dim=1)
                mask = torch.cat([pending_mask.to(device), context_mask.to(device)], dim=1)
                ordinary = self.base_model.get_input_embeddings()(ids)
                comp = self.comp_embeddings[None].expand(batch, n, -1).to(ordinary.dtype)
                is_comp = torch.cat(
                    [torch.zeros_like(mask), torch.ones(batch, n, dtype=torch.bool, device=device)], dim=1
                )
                # Until fold() takes them, the <COMP> keys/values sit in the turn as if they were tokens of it.
                with self.lora_at(is_comp), cache.running_forward():
                    self.base_model(
                        inputs_embeds=torch.cat([ordinary, comp], dim=1),
                        attention_mask=torch.cat([mask, torch.ones(batch, n, dtype=torch.bool, device=device)], dim=1),
                        logits_to_keep=1,
                        **{CACHE_ARGUMENT: cache},
                    )
                    cache.fold(n, rows)

    def _context(
        self, cache: CompressedMemoryCache, context_ids: Any, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked context `(batch, len)` and its mask (empty when there is none)."""
        if context_ids is None and attention_mask is not None:
            # It marks nothing: every row's turn was folded, a row the mask left out (as padding) too.
            raise ValueError(
                "compress() got an attention_mask but no context_ids, whose padding it marks; drop attention_mask to "
                "fold the turn of every row, or pass the context_ids it belongs to."
            )
        if context_ids is None:
            empty = torch.zeros(cache.batch_size, 0, dtype=torch.long)
            return empty, empty.bool()
        try:
            if isinstance(context_ids, str):
                raise TypeError("text")
            context_ids = torch.as_tensor(context_ids)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"context_ids must be token ids (a tensor, or a list of ints or of equal-length lists of ints), got "
                f"{type(context_ids).__name__}: tokenize text with tokenizer(text, add_special_tokens=False), and pad "
                "rows of different lengths, marking the padding in attention_mask."
            ) from None
        _check_tensor(context_ids, "context_ids")
        context_ids = context_ids[None] if context_ids.ndim == 1 else context_ids
        if context_ids.ndim != 2:
            raise ValueError(f"context_ids must be 1-D or 2-D (batch, len), got shape {tuple(context_ids.shape)}.")
        cache.check_batch_size(context_ids.shape[0], "context_ids")
        if context_ids.shape[1] == 0:
            raise ValueError("context_ids is empty: pass at least one token, or None to fold the current turn.")
        self._check_ids(context_ids, "context_ids")
        if attention_mask is None:
            return context_ids, torch.ones_like(context_ids, dtype=torch.bool)
        return context_ids, _checked_mask(attention_mask, context_ids, "context_ids", "context token").bool()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: CompressedMemoryCache | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' `generate()` on `I(t)`, attending to the memory in `past_key_values` (or `cache`).

        The prompt is `input_ids` `(batch, len)` or, as in transformers, `inputs_embeds` `(batch, len, hidden)`
        (the output then holds the generated tokens only, unless the prompt's `input_ids` are given too).

        Every generation mode and argument of transformers works (greedy, sampling, beam search, streamers,
        stopping criteria); it always decodes with the cache, which holds the memory (`use_cache=False` is
        overridden). The turn stays in the cache for `compress(cache)` to fold; with several returned
        sequences per row the caller picks one and compresses it with `compress(cache, ids)`. If generation
        fails, the cache is left as it was, and a `streamer` given is ended (its consumer stops waiting).
        """
        streamer = kwargs.get("streamer")
        if streamer is not None:
            kwargs["streamer"] = streamer = _EndingStreamer(streamer)
        try:
            return self._generate(input_ids, attention_mask, past_key_values, **kwargs)
        except BaseException:
            # transformers ends a streamer only when generation succeeds: a consumer iterating a TextIteratorStreamer
            # (in another thread, without a timeout) waited for ever after a failure. It now sees the stream end.
            if streamer is not None and not streamer.ended:
                with contextlib.suppress(Exception):  # the call's own failure is the error to raise
                    streamer.end()
            raise

    def _generate(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        past_key_values: CompressedMemoryCache | None,
        **kwargs: Any,
    ) -> Any:
        """`generate()`, with a streamer (if any) that records whether it was ended."""
        given = _given_cache(past_key_values, kwargs)
        inputs = kwargs.pop("inputs", None)  # transformers' name for the prompt, its first positional argument
        if inputs is not None and input_ids is not None:
            raise TypeError("Give the prompt once, as input_ids= or as inputs= (the same argument), not both.")
        input_ids = input_ids if inputs is None else inputs
        embeds = kwargs.pop("inputs_embeds", None)
        if input_ids is None and embeds is None:
            raise ValueError("generate() needs a prompt: pass input_ids (batch, len) or inputs_embeds.")
        if kwargs.get("position_ids") is not None:  # the online forward would replace them without a word
            raise ValueError(
                "position_ids cannot be given with a CompressedMemoryCache: the cache numbers the positions itself "
                "(after the memory and the turn so far). Pass input_ids (or inputs_embeds) and attention_mask only."
            )
        name, prompt = ("input_ids", input_ids) if embeds is None else ("inputs_embeds", embeds)
        _check_tensor(prompt, name)
        cache = given if given is not None else self.new_cache(prompt.shape[0])
        if not isinstance(cache, CompressedMemoryCache):
            raise TypeError(f"past_key_values must be a CompressedMemoryCache (model.new_cache()), got {type(cache)}.")
        with cache.running("generate()"):  # claimed before the checks: no other call changes it after them
            state = self._check_owner(cache)
            self._check_adapter_acts(cache, "generate()")
            self._check_tokens(prompt, name, cache)
            if embeds is not None and input_ids is not None:  # transformers returns input_ids as the prompt's tokens
                self._check_tokens(input_ids, "input_ids", cache)
                if input_ids.shape[1] != embeds.shape[1]:
                    raise ValueError(
                        f"input_ids has {input_ids.shape[1]} tokens but inputs_embeds {embeds.shape[1]}; give the ids "
                        "of the embedded prompt, or inputs_embeds alone."
                    )
            if attention_mask is None:
                attention_mask = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
            else:
                attention_mask = _checked_mask(
                    attention_mask,
                    prompt[..., 0] if embeds is not None else prompt,
                    name,
                    "prompt token (the memory needs none)",
                )
                empty = (~attention_mask.bool().any(dim=1)).nonzero().flatten().tolist()
                # Such a row's first token was predicted at a padding position, and the reply went into its memory.
                if empty:
                    raise ValueError(
                        f"attention_mask marks every prompt token of row(s) {empty} as padding, so generate() would "
                        "reply to nothing and fold that reply into their memory; give every row at least one token "
                        "with mask 1 (or leave those users out of the batch)."
                    )
            # transformers' generate() reads the settings again: the caller's own (which may be shared by requests, and
            # changed by another thread) are read from a copy of this call's, and a change of the model's in between is
            # checked for after it.
            if kwargs.get("generation_config") is not None:
                kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
            seen = _settings_seen(self.generation_config)
            _check_token_counts(kwargs, kwargs.get("generation_config") or self.generation_config)
            settings = self._generation_settings(kwargs)
            if settings.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION:
                raise ValueError(
                    "Assisted generation (assistant_model, prompt_lookup_num_tokens, assistant_early_exit) crops the "
                    "draft tokens it rejects from the cache, and a CompressedMemoryCache cannot be cropped: its memory "
                    "is compressed. Generate without those options."
                )
            if not settings.use_cache:  # the memory is in the cache: decoding without it would feed every token again
                if kwargs.get("generation_config") is not None and "use_cache" not in kwargs:
                    kwargs["generation_config"].use_cache = True
                else:
                    kwargs["use_cache"] = True
            if settings.cache_implementation is not None:
                given = kwargs.get("generation_config")
                asked = kwargs.get("cache_implementation") or getattr(given, "cache_implementation", None)
                if asked is not None:
                    raise ValueError(
                        f"cache_implementation={asked!r} asks generate() to build a cache of its own, but a CCM model "
                        "decodes with its CompressedMemoryCache, which holds the memory; drop the option."
                    )
                # Saved on the base model for its own caches (transformers refuses it beside a given cache).
                kwargs["cache_implementation"] = None
            if settings.return_dict_in_generate:
                asked = [name for name in ("output_attentions", "output_hidden_states") if getattr(settings, name)]
                _check_one_piece(
                    cache,
                    prompt.shape[1],
                    asked,
                    "generate() would return those of the prompt's last piece alone",
                    " (feed the earlier tokens with model(...) first: the stream goes on from them)",
                )
            num_sequences = settings.num_return_sequences or 1
            expand = max(settings.num_beams or 1, num_sequences)
            longest = settings.max_new_tokens
            cache.check_reply_room(
                attention_mask.sum(-1), settings.max_length - prompt.shape[1] if longest is None else longest
            )
            # Rows finished before the others are padded, with ids a reply may hold too: each row's reply length is
            # taken from generate() itself, the step its stopping criteria first stopped it (or its returned beam's).
            # A stream takes no token of a row after that step. (Several sequences per row are not written to the
            # cache.)
            finished = None
            if num_sequences == 1:
                if expand == 1:
                    finished, kwargs["stopping_criteria"] = self._finished_rows(settings, kwargs, prompt.device)
                else:
                    kwargs["return_dict_in_generate"] = True  # for the returned beams' indices
            with self._gate.scope(), self._unchanged_since(state, "generate()"):
                run_cache = cache
                if expand > 1:  # generate() expands the inputs, not a given cache
                    run_cache = cache.copy()
                    run_cache.batch_repeat_interleave(expand)
                # On the cache generate() runs with: several returned sequences leave the user's cache as it was.
                run_cache.begin_generation()
                if cache.runs_last_generated_token and finished is not None:
                    cache.row_ends = functools.partial(finished.reply_ends, prompt.shape[1])
                prompts = {"input_ids": input_ids, "inputs_embeds": embeds}
                with run_cache.forwarding():  # as the base model's forwards require (the copy is free)
                    output = self.base_model.generate(
                        **{key: value for key, value in prompts.items() if value is not None},
                        attention_mask=attention_mask,
                        **{CACHE_ARGUMENT: run_cache},
                        **kwargs,
                    )
                if run_cache is not cache and not isinstance(output, torch.Tensor):
                    # The output named the expanded copy, a row per beam (or sequence), each turn without its last token
                    # and finished beams' padding counted as tokens, which compress() folded into a wrong memory. It
                    # names the caller's cache, as a greedy call's does.
                    output[CACHE_ARGUMENT] = cache
                if _settings_changed(self.generation_config, seen):
                    raise ValueError(
                        "model.generation_config was changed or replaced (in another thread) while generate() ran, so "
                        "the reply was decoded with other settings than the ones generate() checked and ends the turn "
                        "with (eos_token_id, pad_token_id, use_cache, ...); the cache is left as it was. Change "
                        "generation_config only while no generate() runs on the model, or give each call its own "
                        "settings (generate(..., generation_config=...) or keyword arguments such as eos_token_id=)."
                    )
                sequences = output if isinstance(output, torch.Tensor) else output.sequences
                if num_sequences > 1:
                    return output
                # transformers returns the prompt's ids, if it was given them, before the generated ones
                generated = sequences[:, 0 if input_ids is None else input_ids.shape[1] :]
                if cache.runs_last_generated_token:  # a stream holds every token, the last generated one included
                    if expand == 1:
                        self.base_model(input_ids=generated[:, -1:], logits_to_keep=1, **{CACHE_ARGUMENT: cache})
                    else:  # it takes the returned sequence now: its count starts with it, as a greedy call's
                        cache.begin_generation()
                        self._feed_replies(cache, name, prompt, generated, (output.beam_indices >= 0).sum(-1))
                    cache.row_ends = None
                    return output if expand == 1 or settings.return_dict_in_generate else sequences
                if finished is not None:
                    cache.end_generation(generated, finished.reply_lengths(generated))
                    return output
                # beam search: the turn of the returned beam goes into the user's cache. With neither a pad nor an
                # EOS id, transformers pads a beam that ended before the others with -1, which no embedding takes;
                # the padding is masked, so any id does.
                generated = generated.clamp(min=0)
                with cache.running_forward():  # the padding of a beam that ended counts as its turn until the end
                    self.base_model(
                        **self._followed_by(name, prompt, generated[:, :-1]),
                        attention_mask=torch.cat([attention_mask, torch.ones_like(generated[:, :-1])], dim=1),
                        logits_to_keep=1,
                        **{CACHE_ARGUMENT: cache},
                    )
                    # A beam's indices are -1 after its end
                    cache.end_generation(generated, (output.beam_indices >= 0).sum(-1))
                return output if settings.return_dict_in_generate else sequences

    def _finished_rows(
        self, settings: GenerationConfig, kwargs: dict[str, Any], device: torch.device
    ) -> tuple[_FinishedRows, StoppingCriteriaList]:
        """A criterion that runs the stopping criteria `generate()` runs with `settings` and the `stopping_criteria`
        in `kwargs`, recording when each row finished; and the list to give `generate()` in place of those given."""
        given = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        special = copy.deepcopy(settings)  # transformers sets its special token tensors in place
        # Those stop every row at once, which needs no record; and max_length is not yet the call's (max_new_tokens).
        special.max_length = special.max_time = None
        self.base_model._prepare_special_tokens(special, device=device)
        finished = _FinishedRows(self.base_model._get_stopping_criteria(special, given, kwargs.get("tokenizer")))
        # transformers adds its own criteria to those given, but takes a given one of its classes in place of its own
        own = [criterion for criterion in given if type(criterion).__module__ == transformers_criteria.__name__]
        return finished, StoppingCriteriaList([finished, *own])

    def _feed_replies(
        self,
        cache: CompressedMemoryCache,
        name: str,
        prompt: torch.Tensor,
        generated: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """Feed a stream `prompt` (`name`: `(batch, len)` input_ids or `(batch, len, hidden)` inputs_embeds) and
        each row's reply, the first `lengths` `(batch,)` of its `generated` ids `(batch, new)`, in the pieces a row
        alone is fed in; no row takes the padding after its reply (`row_ends`)."""
        ends = (lengths + prompt.shape[1]).cpu()  # read once: each piece's forward asks at several stages
        cache.row_ends = lambda: ends
        # With neither a pad nor an EOS id, transformers pads a beam that ended before the others with -1, which no
        # embedding takes; no row takes the padding, so any id does.
        self.base_model(
            **self._followed_by(name, prompt, generated.clamp(min=0)), logits_to_keep=1, **{CACHE_ARGUMENT: cache}
        )

    def _followed_by(self, name: str, prompt: torch.Tensor, generated: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward argument for `prompt` (`name`: `(batch, len)` input_ids or `(batch, len, hidden)`
        inputs_embeds) followed by the `generated` ids `(batch, new)`, embedded if the prompt was."""
        if name == "input_ids":
            return {name: torch.cat([prompt, generated], dim=1)}
        return {name: torch.cat([prompt, self.get_input_embeddings()(generated)], dim=1)}

    def _generation_settings(self, kwargs: dict[str, Any]) -> GenerationConfig:
        """The settings `generate()` will run with: the `generation_config` given (else the base model's), what it
        leaves unset taken from the base model's, then the keyword arguments, resolved by transformers itself."""
        given = {key: value for key, value in kwargs.items() if key != "generation_config"}
        return self.base_model._prepare_generation_config(kwargs.get("generation_config"), **given)[0]

    def _online_forward(
        self,
        cache: CompressedMemoryCache,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """New tokens of the turn (or of a stream, in pieces the window can take): logits `(batch, len, vocab)`."""
        with cache.running("model(...)"):  # claimed before the checks: no other call changes it after them
            state = self._check_owner(cache)
            self._check_adapter_acts(cache, "model(...)")
            self._check_cache_reaches_layers()
            name = "input_ids" if input_ids is not None else "inputs_embeds"
            tokens = input_ids if input_ids is not None else kwargs.pop("inputs_embeds", None)
            if tokens is None:
                raise ValueError("An online forward takes input_ids (or inputs_embeds).")
            self._check_tokens(tokens, name, cache)
            if labels is not None:
                self._check_labels(labels, tuple(tokens.shape[:2]))
            if attention_mask is not None:
                attention_mask = _as_mask(attention_mask, tokens.device, "input token")
                new = tokens.shape[1]
                # Padding alone would leave a turn that compress() finds nothing in to fold, and that blocks generate().
                if cache.streaming is None and attention_mask.ndim == 2 and not attention_mask[:, -new:].bool().any():
                    raise ValueError(
                        f"attention_mask marks every one of the {new} new tokens as padding (0), so the call would "
                        "add nothing but padding to the turn; pass at least one token with mask 1 (a row of padding "
                        "only is fine beside rows with tokens)."
                    )
            step = cache.max_forward_tokens
            asked = ["output_attentions"] if kwargs.get("output_attentions") else []
            _check_one_piece(cache, tokens.shape[1], asked, "no one attention map covers them")
            with self._gate.scope(), self._unchanged_since(state, "model(...)"):
                self._run_pending(cache)
                if step is None or tokens.shape[1] <= step:
                    output = self.base_model(
                        **{name: tokens, CACHE_ARGUMENT: cache}, attention_mask=attention_mask, labels=labels, **kwargs
                    )
                    _zero_loss_without_labels(output, labels, kwargs.get("num_items_in_batch"))
                    cache.end_stream_call()
                    return output
                cache.input_mask(attention_mask)
                keep = kwargs.pop("logits_to_keep", 0)  # of the whole input, not of each piece
                pieces = [
                    self.base_model(**{name: piece, CACHE_ARGUMENT: cache}, **kwargs)
                    for piece in tokens.split(step, dim=1)
                ]
                every = torch.cat([piece.logits for piece in pieces], dim=1)
                hidden_states = None
                if pieces[0].hidden_states is not None:  # per layer, the pieces' positions in order
                    hidden_states = tuple(
                        torch.cat(layer, dim=1)
                        for layer in zip(*(piece.hidden_states for piece in pieces), strict=True)
                    )
                output = CausalLMOutputWithPast(
                    logits=every[:, -keep:] if isinstance(keep, int) else every[:, keep],
                    hidden_states=hidden_states,
                    **{CACHE_ARGUMENT: cache},
                )
                # Inside the transaction: labels that do not fit the logits fail the call, which leaves the cache as it
                # was.
                if labels is not None:
                    output.loss = self.base_model.loss_function(
                        logits=output.logits,
                        labels=labels,
                        vocab_size=output.logits.shape[-1],
                        num_items_in_batch=kwargs.get("num_items_in_batch"),
                    )
                    _zero_loss_without_labels(output, labels, kwargs.get("num_items_in_batch"))
                cache.end_stream_call()
        return output

    def _run_pending(self, cache: CompressedMemoryCache) -> None:
        """Run the token `generate()` produced last (kept without keys/values for `compress` to fold), so that
        the new tokens of an online forward attend to it and follow it in the turn."""
        pending_ids, pending_mask = cache.take_pending()
        if pending_mask.any():
            self.base_model(
                input_ids=pending_ids.to(self.device),
                attention_mask=pending_mask.to(self.device),
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
            )

    def _online_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook of the base model: with a `CompressedMemoryCache`, the cache decides the mask and the
        logical positions. Runs at every decoding step, so it does only what the step needs."""
        cache = passed_cache(kwargs)
        if not isinstance(cache, CompressedMemoryCache):
            return None
        cache.check_held()
        cache.forward_began()  # until `_online_outputs`
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        mask = cache.input_mask(kwargs.get("attention_mask"))
        tokens = kwargs[name] = self._run_leading_pieces(cache, name, kwargs[name])
        self._make_room(cache, tokens.shape[1])
        new = tokens.shape[1]
        if mask is None:
            new_mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        elif mask.ndim == 2 and mask.shape[1] in (new, cache.turn_length + new):
            new_mask = mask[:, mask.shape[1] - new :].bool()
        else:
            raise ValueError(
                f"With a CompressedMemoryCache, attention_mask must be 2D and cover the {new} new tokens (or the "
                f"{cache.turn_length} tokens of the turn and the new ones), got shape {tuple(mask.shape)}."
            )
        sdpa = wrapped_implementation(self.base_model.config._attn_implementation) == "sdpa"
        position_ids, attention = cache.prepare_forward(new_mask, sdpa)
        kwargs.update(attention_mask=attention, position_ids=position_ids, use_cache=True)
        return args, kwargs

    def _online_outputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook of the base model: a forward on a `CompressedMemoryCache` has stored its tokens in every
        layer (`CompressedMemoryCache.check_whole`)."""
        cache = passed_cache(kwargs)
        if isinstance(cache, CompressedMemoryCache):
            cache.forward_ended()

    def _run_leading_pieces(self, cache: CompressedMemoryCache, name: str, tokens: torch.Tensor) -> torch.Tensor:
        """Run all but the last piece of an input too long for one forward (a long prompt given to generate() on
        a stream); returns the last piece. `tokens`: `(batch, len)` ids or `(batch, len, hidden)` embeddings."""
        step = cache.max_forward_tokens
        if step is None or tokens.shape[1] <= step:
            return tokens
        pieces = tokens.split(step, dim=1)
        for piece in pieces[:-1]:
            self.base_model(**{name: piece, CACHE_ARGUMENT: cache}, logits_to_keep=1)
        return pieces[-1]

    def _make_room(self, cache: CompressedMemoryCache, new: int) -> None:
        """Compress (or, for StreamingLLM, evict) the oldest window tokens of a stream until `new` more fit."""
        while (rows := cache.rows_to_compress(new)) is not None:
            cache.evict_compressed(rows)
            prefix, position_ids, mask = cache.compression_prefix(rows)
            batch, n = position_ids.shape
            comp = self.comp_embeddings[None].expand(batch, n, -1).to(self.dtype)
            with self.lora_at(torch.ones(batch, n, dtype=torch.bool, device=self.device)):
                self.base_model(
                    inputs_embeds=comp,
                    attention_mask=mask,
                    position_ids=position_ids,
                    use_cache=True,
                    **{CACHE_ARGUMENT: prefix},
                    logits_to_keep=1,
                )
            cache.fold_chunk(prefix, rows)
        cache.evict(new)

    # ----- identity -----------------------------------------------------------------------------------------
    def memory_signature(self) -> dict[str, Any]:
        """What a compressed memory depends on: the base model (name, shape, dtype, a fingerprint of every weight,
        and the config entries that change its numbers, such as its rotary base and scaling), the update rule and
        `<COMP>` length, a hash of every adapter tensor by name, the LoRA's scaling (`lora_alpha / r`, one value, or
        one per LoRA layer where they differ) and whether it is conditional.

        Digests are recomputed only after a weight changed (tracked by tensor version counters), so asking at
        every call is cheap.
        """
        self._check_in_place()
        signature = self._signature(self._state())
        # A copy: the model keeps the settings it read to compare at every call, which the caller may change.
        return {**signature, "base_config": copy.deepcopy(signature["base_config"])}

    def _signature(self, state: _ModelState) -> dict[str, Any]:
        """`memory_signature()` for the model in `state` (`_state()`), whose version scans key the digests: a call
        checks its cache with the scan it holds the model to, not with one more."""
        scaling = state.lora_scaling
        update, ema_alpha, cap = state.memory_rule
        return {
            "base_model": self.config.base_model_name_or_path,
            **base_shape(self.base_model.config),
            "dtype": str(self.dtype).removeprefix("torch."),
            "update": update,
            "num_comp_tokens": self.config.num_comp_tokens,
            "max_memory_tokens": cap,
            "ema_alpha": ema_alpha,
            "adapter_sha256": self._digest("adapter", adapter_digest, state.adapter_versions),
            "base_fingerprint": self._digest("base", weights_fingerprint, state.base_versions),
            "lora_scaling": scaling[0] if len(set(scaling)) == 1 else list(scaling),
            "conditional_lora": state.conditional_lora,
            "base_config": state.base_config,
        }

    def _listing(self) -> tuple[dict[str, list[tuple[str, torch.Tensor]]], list[LoraLayer], list[nn.Module], bool]:
        """The adapter's and the base model's parameters by name, sorted, the LoRA layers, every module and whether a
        parameter is on the meta device (read once per listing: hundreds of them take 0.1 ms). Walking the modules
        costs milliseconds and this is asked at every call, so they are listed again only after a module
        registered a parameter or a submodule (`load_state_dict(assign=True)`, a parameter or layer replaced): the
        digests of a stale list would miss the new tensors, and accept memories of the weights they replaced."""
        registrations = _Registrations.latest
        if self._listed is None or self._listed[0] != registrations:
            _Registrations.watch(self)
            registrations = _Registrations.latest  # read before the walk: a registration during it lists them again
            named = sorted(self.named_parameters())
            is_adapter = [name == "comp_embeddings" or ".lora_A." in name or ".lora_B." in name for name, _ in named]
            self._listed = (
                registrations,
                {
                    "adapter": [item for item, adapter in zip(named, is_adapter, strict=True) if adapter],
                    "base": [item for item, adapter in zip(named, is_adapter, strict=True) if not adapter],
                },
                lora_layers(self.base_model),
                list(self.modules()),
                any(parameter.is_meta for _, parameter in named),
            )
        return self._listed[1:]

    def _weights(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """The adapter's and the base model's parameters by name, sorted (`_listing`)."""
        return self._listing()[0]

    def _versions(self, kind: str) -> tuple[tuple[int, int], ...]:
        """The version counter and storage of every `kind` weight: they differ once one changed (in place: its
        version counter; replaced: its storage)."""
        weights = self._weights()[kind]
        try:
            return tuple((parameter._version, parameter.data_ptr()) for _, parameter in weights)
        except RuntimeError as error:  # torch's "Inference tensors do not track version counter"
            made = [name for name, parameter in weights if parameter.is_inference()]
            if not made:
                raise
            raise ValueError(
                f"The model's weights {made[:3]}{' ...' if len(made) > 3 else ''} were made under "
                "torch.inference_mode() (loaded there, say), which keeps no count of their changes, so a memory made "
                "before a change could not be told from one made after it. Load and wrap the model outside "
                "torch.inference_mode(); its calls may run inside it."
            ) from error

    def _digest(
        self, kind: str, compute: Callable[[list[tuple[str, torch.Tensor]]], str], versions: tuple[tuple[int, int], ...]
    ) -> str:
        """`compute` over the `kind` weights, again only if one of them changed since `versions` (`_versions(kind)`)
        keyed the digest."""
        cached = self._digests.get(kind)
        if cached is None or cached[0] != versions:
            cached = self._digests[kind] = versions, compute(self._weights()[kind])
        return cached[1]

    def _state(self) -> _ModelState:
        """What a call's result depends on in the model, cheaply compared. The LoRA scaling and the config are read
        where the model computes with them, so that a change made after loading (PEFT's `set_scale`, say) counts."""
        return _ModelState(
            adapter_versions=self._versions("adapter"),
            base_versions=self._versions("base"),
            attention=self.base_model.config._attn_implementation,
            lora_scaling=tuple(float(layer.scaling[ADAPTER_NAME]) for layer in self._listing()[1]),
            conditional_lora=self._gate.conditional,
            peft_path_off=tuple(layer.disable_adapters for layer in self._listing()[1]),
            base_config=self._base_config(),
            training=self._modes(),
            mode_switch=self._mode_switch,
            memory_rule=self._memory_rule(),
        )

    def _memory_rule(self) -> tuple[str, float | None, int | None]:
        """How a compression enters memory: the update rule, its EMA coefficient (ema only) and the concat cap."""
        config = self.config
        return config.update, config.ema_alpha if config.update == "ema" else None, config.max_memory_tokens

    def _modes(self) -> tuple[bool, ...]:
        """Every module's `training` flag (read twice per call, over every module: `map` walks them fastest)."""
        return tuple(map(_TRAINING, self._listing()[2]))

    def _base_config(self) -> dict[str, Any]:
        """`computing_settings` of the base config, read again only after the config (or an entry at any depth of
        it) changed or was replaced: `to_dict` costs more than the rest of `_state`, taken twice per call."""
        config = self._text_config
        settings = self._settings
        if settings is None or settings[0] is not config or settings[1] != config.__dict__:
            # The copy is taken before the settings are read: a change in between makes them differ from the copy
            # at the next call, which reads them again; taken after, they would be kept for the changed config.
            entries = copy.deepcopy(config.__dict__)
            settings = self._settings = config, entries, computing_settings(config)
        return settings[2]

    @contextmanager
    def _unchanged_since(self, state: _ModelState, call: str) -> Iterator[None]:
        """Raise when the context ends if the model is no longer in `state` (`_state()`): another thread loaded an
        adapter, stepped an optimizer, cast the model, switched its attention or its training mode while `call` ran,
        which then ran its first layers with one adapter (or without dropout) and its last with another, and would
        have stored that memory under the signature of either (or failed inside torch, on a cast). Entered inside the
        cache's transaction, which then leaves the cache as it was."""
        try:
            yield
        except Exception as error:
            if self._state() == state:
                raise
            raise _changed_during(call) from error  # the change is what failed it (a cast: torch's dtype mismatch)
        if self._state() != state:
            raise _changed_during(call)

    def _check_cache(self, cache: CompressedMemoryCache, call: str) -> _ModelState:
        """Raise unless `cache` is free for `call` (no other call runs on it, in another thread or in this one) and
        `_check_owner` passes; for a check made without claiming the cache (a call claims it first, with
        `cache.running`, and then checks the owner)."""
        _check_is_cache(cache)
        cache.check_free()
        cache.check_no_call(call)
        return self._check_owner(cache)

    def _check_owner(self, cache: CompressedMemoryCache) -> _ModelState:
        """Raise unless the model still runs as CCM wrapped it (`_check_wrapping`) and `cache` was made by this model,
        with these weights and settings, and lives on its device. Returns the model's state (`_state()`) taken before
        the checks, for the call to hold the model to (`_unchanged_since`): a change during the checks fails the call
        too."""
        state = self._state()
        self._check_wrapping()
        cache.check_signature(self._signature(state))
        cache.check_device(self.device)
        return state

    def _check_adapter_acts(self, cache: CompressedMemoryCache, call: str, compresses: bool = False) -> None:
        """Raise inside `adapter_disabled()` if the LoRA acts in `call` on `cache`: when it `compresses` (its `<COMP>`
        run), and in every call of an adapter without conditional LoRA or on a stream that compresses by itself. The
        cache would hold the base model's keys/values under the adapter's signature, and a task created inside the
        context (asyncio copies it) made such a memory long after the context was left where it was entered."""
        streaming = cache.streaming
        acts = compresses or not self.config.conditional_lora or (streaming is not None and streaming.compress)
        if acts and LoRAGate.is_suppressed():
            raise ValueError(
                f"{call} ran inside model.adapter_disabled() (entered in this thread or task, or in the task that "
                "created this one), where the adapter does not act: the cache would hold the base model's keys/values "
                "under the adapter's signature. Make the call outside that context."
            )

    def _check_cache_reaches_layers(self) -> None:
        """Raise if transformers would run decoder layers of an online forward without its cache: a checkpointed layer
        in training mode with gradients on drops it (so that the recomputation during backward does not store the keys
        twice). Its tokens then saw no memory, and the rows counted tokens that no layer held."""
        if not torch.is_grad_enabled():  # as in generate() and compress(): checkpointing needs a backward to replay
            return
        if any(
            isinstance(m, GradientCheckpointingLayer)
            and m.gradient_checkpointing
            and m.training
            and not getattr(m, "_can_checkpoint_with_cache", False)
            for m in self._listing()[2]
        ):
            raise ValueError(
                "model(...) with a CompressedMemoryCache ran with activation checkpointing on, in training mode and "
                "with gradients: transformers then runs the checkpointed decoder layers without the cache, whose "
                "tokens would neither see the memory nor be stored in it. Make the call under torch.no_grad() (or "
                "torch.inference_mode()), in eval mode (model.eval()), or after "
                "model.activation_checkpointing_disable()."
            )

    def _check_tokens(self, tokens: torch.Tensor, name: str, cache: CompressedMemoryCache) -> None:
        """Raise unless `tokens` (`name`: "input_ids" or "inputs_embeds") are `(batch, len)` token ids of this
        model's vocabulary or `(batch, len, hidden)` embeddings in its dtype, one row per cache row and at least
        one token: checked before anything runs, so that a bad input never reaches torch with the cache half
        changed."""
        _check_tensor(tokens, name)
        if name == "input_ids":
            self._check_ids(tokens, name)
            shape = "2-D (batch, len); add a batch dimension with input_ids[None]"
            fits = tokens.ndim == 2
        else:
            hidden = self.base_model.get_input_embeddings().weight.shape[-1]
            shape = f"3-D (batch, len, {hidden})"
            fits = tokens.ndim == 3 and tokens.shape[-1] == hidden
            if fits and tokens.dtype != self.dtype:
                raise ValueError(f"inputs_embeds has dtype {tokens.dtype} but the model runs in {self.dtype}; cast it.")
            if not bool(torch.isfinite(tokens).all()):  # its keys/values would join the turn, then the memory
                raise ValueError("inputs_embeds holds values that are not finite (NaN or inf); pass finite embeddings.")
        if not fits:
            raise ValueError(f"{name} must be {shape}, got shape {tuple(tokens.shape)}.")
        if tokens.shape[1] == 0:
            raise ValueError(f"{name} holds no token; pass at least one.")
        cache.check_batch_size(tokens.shape[0], name)

    def _check_batch(self, input_ids: Any, comp_mask: Any, **others: Any) -> None:
        """Raise unless a training batch holds tensors of one `(batch, seq)` shape and, outside `<COMP>` positions,
        ids of this model's vocabulary (`others`: segment_ids, position_ids and labels, None where not given). A
        hand-made batch failed inside torch: an `IndexError`, or on CUDA a device-side assert that stops the process."""
        tensors = {"input_ids": input_ids, "comp_mask": comp_mask, **others}
        for name, tensor in tensors.items():
            if tensor is not None:
                _check_tensor(tensor, name)
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items() if tensor is not None}
        if input_ids.ndim != 2 or len(set(shapes.values())) > 1:
            given = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
            raise ValueError(
                f"A training batch holds 2-D (batch, seq) tensors of one shape, got {given}; build it with "
                "CCMDataCollator."
            )
        if input_ids.numel() == 0:  # failed inside the attention's reshape
            raise ValueError(
                f"A training batch holds at least one row and one position, got input_ids of shape "
                f"{tuple(input_ids.shape)}; build it with CCMDataCollator from at least one sample."
            )
        if comp_mask.dtype != torch.bool:  # as indices or `~`, other dtypes failed inside torch or meant other rows
            raise ValueError(
                f"comp_mask must be a torch.bool tensor (True at <COMP> tokens), got dtype {comp_mask.dtype}; cast it "
                "with comp_mask.bool(), or build the batch with CCMDataCollator."
            )
        self._check_ids(input_ids.masked_fill(comp_mask, 0), "input_ids")  # embed() ignores <COMP> ids
        if others.get("labels") is not None:
            self._check_labels(others["labels"], tuple(input_ids.shape))

    def _check_labels(self, labels: Any, shape: tuple[int, ...]) -> None:
        """Raise unless `labels` are int64 `shape` `(batch, seq)`, each -100 or a token id of this model's vocabulary:
        the loss failed deep inside torch (an `IndexError`, on CUDA a device-side assert)."""
        _check_tensor(labels, "labels")
        if tuple(labels.shape) != shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)} but the input {shape}; give one label per token.")
        if labels.dtype != torch.int64:
            raise ValueError(
                f"labels must hold torch.int64 token ids (or -100), got dtype {labels.dtype}; cast them with "
                "labels.long()."
            )
        self._check_ids(labels.masked_fill(labels == IGNORE_INDEX, 0), "labels")  # -100: no label at that token

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        """Raise if `ids` are not int64 or int32 token ids of this model's vocabulary (checked before anything runs):
        torch's embedding takes no other dtype, and failed deep inside it."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"{what} must hold integer token ids of dtype torch.int64 (or torch.int32), got dtype {ids.dtype}; "
                f"cast them with {what}.long()."
            )
        vocabulary = self.vocabulary_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocabulary):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(
                f"{what} holds the token id {bad}, outside the model's vocabulary (0..{vocabulary - 1}); tokenize with "
                "this model's tokenizer."
            )

    # ----- what a transformers or PEFT user calls on a model ------------------------------------------------------
    main_input_name = "input_ids"

    @classmethod
    def can_generate(cls) -> bool:
        """True: `generate()` works (`transformers.pipeline("text-generation", ...)` asks before it runs)."""
        return True

    def get_input_embeddings(self) -> nn.Module:
        """The base model's token embedding (the `<COMP>` embeddings are `comp_embeddings`, outside the vocabulary)."""
        return self.base_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The base model's LM head."""
        return self.base_model.get_output_embeddings()

    def tie_weights(self) -> None:
        """Tie the base model's LM head to its input embedding where its config asks for it, as transformers does."""
        self.base_model.tie_weights()

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the adapter records the vocabulary of the base it was made for, and the new (frozen) rows would
        be saved nowhere. Resize the base model before wrapping it."""
        raise ValueError(
            "A CCMForCausalLM cannot resize its token embeddings: its adapter and memories belong to a base model of "
            f"{self.vocabulary_size} tokens, and the new rows would not be saved with the adapter. Resize the base "
            "model before wrapping it (base.resize_token_embeddings(n), then CCMForCausalLM.from_base(base, config)); "
            "the <COMP> tokens need no vocabulary entry (they are comp_embeddings)."
        )

    def activation_checkpointing_disable(self) -> None:
        """Keep every decoder layer's activations again (undoes `activation_checkpointing_enable`, the embeddings'
        require-grads hook included)."""
        self.base_model.activation_checkpointing_disable()
        # transformers removes the hook its enable registered only from a model it loaded a PEFT adapter into: left
        # on the embeddings, it made every later forward of the frozen base model build a graph for backward.
        self.base_model.disable_input_require_grads()

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether any decoder layer recomputes its activations during backward."""
        return self.base_model.is_activation_checkpointing

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """transformers' former name of `activation_checkpointing_enable` (PEFT's helpers still call it)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """transformers' former name of `activation_checkpointing_disable`."""
        self.activation_checkpointing_disable()

    def enable_input_require_grads(self) -> None:
        """Make the token embeddings' output require grad (PEFT's recipe for checkpointing a frozen base)."""
        self.base_model.enable_input_require_grads()

    def disable_input_require_grads(self) -> None:
        """Undo `enable_input_require_grads()`."""
        self.base_model.disable_input_require_grads()

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """`(trainable, all)` parameter counts, as PEFT's `PeftModel` gives them."""
        return self.num_parameters(only_trainable=True), self.num_parameters()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters of the base model, its LoRA and the `<COMP>` embeddings (as `PreTrainedModel` counts)."""
        counted = not exclude_embeddings and (self.comp_embeddings.requires_grad or not only_trainable)
        comp = self.comp_embeddings.numel() if counted else 0
        return (
            self.base_model.num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings) + comp
        )

    def disable_adapter(self) -> AbstractContextManager[None]:
        """PEFT's name of `adapter_disabled()` (`PeftModel.disable_adapter`): the base model alone in the context."""
        return self.adapter_disabled()

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as `merge_adapter` is: merged into the base weights, the LoRA would act at every token."""
        raise ValueError(
            "A CCM model's LoRA cannot be merged into the base model's weights (merge_and_unload(), merge_adapter()): "
            "it acts at <COMP> positions only, with the <COMP> embeddings and the memory of a CCM cache, and merged it "
            "would act at every token. Keep the model wrapped and save its adapter with save_pretrained(); for the "
            "base model alone use model.adapter_disabled() (PEFT's disable_adapter())."
        )

    merge_adapter = merge_and_unload

    def print_trainable_parameters(self) -> None:
        """Print the trainable and total parameter counts, as PEFT's `PeftModel` does."""
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")


class _FinishedRows(StoppingCriteria):
    """Runs `criteria` and records, per row, the reply length at which they first stopped it (transformers keeps a
    row stopped once they did)."""

    def __init__(self, criteria: StoppingCriteriaList) -> None:
        self.criteria = criteria
        self.steps = 0
        # transformers pads the rows that finished when a criterion it runs has an `eos_token_id` (an EOS criterion of
        # the caller's own class too): this one stands in for those it runs.
        eos = [criterion.eos_token_id for criterion in criteria if hasattr(criterion, "eos_token_id")]
        if eos:
            self.eos_token_id = eos[0]
        self.lengths: torch.Tensor | None = None  # (batch,), 0 for a row still running
        # `lengths` as last read to the host, with the step it was read at (`reply_ends`).
        self._read: tuple[int, torch.Tensor] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        """`(batch,)` bool, whether `criteria` stop each row of `input_ids` `(batch, len)` now."""
        done = self.criteria(input_ids, scores, **kwargs)
        self.steps += 1
        lengths = torch.zeros_like(done, dtype=torch.long) if self.lengths is None else self.lengths
        self.lengths = torch.where((lengths == 0) & done, self.steps, lengths)
        return done

    def reply_ends(self, prompt_length: int) -> torch.Tensor | None:
        """`(batch,)` long on the CPU: how many tokens of a `generate()` call each row takes, its prompt of
        `prompt_length` and its reply, those after it being padding (a row not stopped: all); None before the first
        stop. Read from the device once per decoding step: a stream asks at each of its forward's stages, and on a
        GPU every read waits for all the work queued before it."""
        if self.lengths is None:
            return None
        if self._read is None or self._read[0] != self.steps:
            self._read = self.steps, self.lengths.cpu()
        lengths = self._read[1]
        running = torch.full_like(lengths, torch.iinfo(torch.long).max // 2)
        return torch.where(lengths == 0, running, prompt_length + lengths)

    def reply_lengths(self, generated: torch.Tensor) -> torch.Tensor:
        """`(batch,)` each row's reply length in `generated` `(batch, new)`: all of it for a row never stopped, or
        stopped with the others by max_length or max_time."""
        new = generated.shape[1]
        if self.lengths is None:  # no token generated
            return torch.full(generated.shape[:1], new, device=generated.device)
        return torch.where(self.lengths == 0, new, self.lengths.clamp(max=new))


class _EndingStreamer(BaseStreamer):
    """Hands `generate()`'s tokens on to `streamer`, and records whether its stream was ended."""

    def __init__(self, streamer: BaseStreamer) -> None:
        self.streamer = streamer
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        self.ended = True  # first: a streamer whose end() fails is not ended twice
        self.streamer.end()


def _check_config(config: Any) -> None:
    """Raise unless `config` is a `CCMConfig` (a dict failed with an AttributeError, and an empty one was taken for
    the defaults)."""
    if not isinstance(config, CCMConfig):
        raise TypeError(
            f"config must be a CCMConfig, got {type(config).__name__}; build one with CCMConfig(...)"
            + (", e.g. CCMConfig(**settings) for a dict of settings." if isinstance(config, dict) else ".")
        )


def _as_mask(mask: Any, device: torch.device, entry: str) -> torch.Tensor:
    """`mask` as a tensor on `device` (a list is fine); `entry` says in errors what it masks."""
    try:
        if isinstance(mask, str):
            raise TypeError("text")
        return torch.as_tensor(mask, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"attention_mask must be 1 (a token) or 0 (padding) per {entry}, as a tensor or a list of equal-length "
            f"lists, got {type(mask).__name__}."
        ) from None


def _checked_mask(mask: Any, tokens: torch.Tensor, name: str, entry: str) -> torch.Tensor:
    """`mask` as a tensor on the device of `tokens` `(batch, len)`, of its shape: a list is fine, and one row may
    omit the batch dimension. `name` and `entry` say in errors what it masks."""
    mask = _as_mask(mask, tokens.device, entry)
    mask = mask[None] if mask.ndim == 1 else mask
    if mask.shape != tokens.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but {name} {tuple(tokens.shape)}; give one mask entry per "
            f"{entry}."
        )
    return mask


def _zero_loss_without_labels(
    output: CausalLMOutputWithPast, labels: torch.Tensor | None, num_items_in_batch: Any
) -> None:
    """Set `output.loss` to 0 when `labels` `(batch, seq)` leave no token to predict and the loss is a mean.

    transformers' mean over no token is NaN, which poisoned a summed or logged loss; the NLL of no token is 0, with
    zero gradients (still a graph, so backward runs). With `num_items_in_batch` the loss is a sum, 0 already."""
    if labels is not None and num_items_in_batch is None and not (labels[:, 1:] != IGNORE_INDEX).any():
        output.loss = output.logits.sum() * 0.0


def _settings_seen(config: GenerationConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """`config`'s settings as `to_dict` gives them (a deep copy), and the objects it holds, for `_settings_changed`."""
    return config.to_dict(), dict(config.__dict__)


def _settings_changed(config: GenerationConfig, seen: tuple[dict[str, Any], dict[str, Any]]) -> bool:
    """Whether `config` (the same object or one that replaced it) holds other settings than `seen`
    (`_settings_seen`): a setting differs unless it equals its copy, or it is the object seen and no container (a
    list, say) that could have changed in place. Tensors compare by their values; objects without `__eq__`, whose
    copies never equal them, by identity."""
    copies, objects = seen
    now = config.to_dict()
    if now.keys() != copies.keys():
        return True
    for name, value in now.items():
        held = config.__dict__.get(name)
        if not _equal(value, copies[name]) and (held is not objects.get(name) or isinstance(held, (list, dict, set))):
            return True
    return False


def _equal(first: Any, second: Any) -> bool:
    """`first == second`, tensors by their values; False where the two cannot be compared."""
    try:
        return bool(first == second)
    except (RuntimeError, ValueError):  # tensors (arrays) of several values have no truth value
        return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and torch.equal(first, second)


def _changed_during(call: str) -> ValueError:
    return ValueError(
        f"The model changed while {call} ran (load_adapter, an optimizer step, a cast, an attention or LoRA switch, "
        "train()/eval(), or its config's update rule, ema_alpha or max_memory_tokens set in another thread), so the "
        "call mixed two models; the cache is left as it was, and belongs to the model before the change. Change a "
        "serving model only while no call runs on it (or serve from another copy of the model)."
    )


def _check_one_piece(cache: CompressedMemoryCache, length: int, asked: list[str], why: str, how: str = "") -> None:
    """Raise if the outputs `asked` (output_attentions, ...) cover an input of `length` tokens that a stream runs in
    pieces (each attending to another window); `why` they cannot, `how` else to give the tokens."""
    step = cache.max_forward_tokens
    if asked and step is not None and length > step:
        raise ValueError(
            f"{' and '.join(asked)} with {length} tokens, which the stream runs in pieces of {step} that each attend "
            f"to a different window ({why}); pass at most {step} tokens per call{how}."
        )


def _check_token_counts(kwargs: dict[str, Any], config: GenerationConfig) -> None:
    """Raise unless the lengths `generate()` runs to (keyword arguments, else `config`'s) are whole numbers: a NaN
    `max_new_tokens` passed transformers' checks and no length ever reached it, so generation never stopped."""
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length"):
        value = kwargs[name] if name in kwargs else getattr(config, name, None)
        if value is not None and not is_index(value):
            raise ValueError(f"{name} must be a whole number of tokens, such as 32, got {value!r}.")


def _attention_dropout(model: torch.nn.Module) -> float:
    """The largest dropout probability that the attention layers of `model` apply to attention weights in training:
    transformers' attention modules hold it as `attention_dropout`, GPT-2's as an `attn_dropout` layer."""
    rates = [0.0]
    for module in attention_modules(model).values():
        for name in ("attention_dropout", "attn_dropout"):
            value = getattr(module, name, None)
            rate = value.p if isinstance(value, torch.nn.Dropout) else value
            if isinstance(rate, (int, float)) and not isinstance(rate, bool):
                rates.append(float(rate))
    return max(rates)


def _check_is_cache(cache: Any) -> None:
    """Raise unless `cache` is a `CompressedMemoryCache`."""
    if not isinstance(cache, CompressedMemoryCache):
        raise TypeError(f"The cache must be a CompressedMemoryCache (model.new_cache()), got {type(cache).__name__}.")


def _check_tensor(tokens: Any, name: str) -> None:
    """Raise unless `tokens` is a tensor: a list would fail deep inside with an `AttributeError`."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(tokens).__name__}; wrap token ids with torch.tensor([ids])."
        )
    if tokens.is_meta:  # its values, read by every check, do not exist
        raise ValueError(f"{name} is on the meta device, which holds no values; pass a tensor with its values.")


# Where `CCMForCausalLM.forward` takes its cache among the positional arguments (after `self`).
_CACHE_POSITION = list(inspect.signature(CCMForCausalLM.forward).parameters).index("past_key_values") - 1


def passed_cache(kwargs: dict[str, Any]) -> Any:
    """The cache in the keyword arguments of a forward, under either name (None if there is none)."""
    return next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)


def _given_cache(past_key_values: Any, kwargs: dict[str, Any]) -> Any:
    """The cache a caller gave under either name (`kwargs` loses `cache`); refuses two."""
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None:
        raise TypeError("Give the cache once, as cache= or as past_key_values= (the same argument), not both.")
    return cache if cache is not None else past_key_values
