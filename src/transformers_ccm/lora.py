"""The conditional LoRA: PEFT's LoRA layers, gated per token so that only `<COMP>` positions see them.

The LoRA branch `B A dropout(m x) * scaling` is added with `m` the `<COMP>` mask of the running call, so it is
exactly zero at every other position (`A 0 = 0`, no bias). The mask is per call, never stored on the model.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import cast_adapter_dtype, check_target_module_exists
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from transformers_ccm.config import CCMConfig

ADAPTER_NAME = "default"
# The forward keyword argument that carries the `<COMP>` mask of a call, `(batch, seq)` bool.
COMP_MASK_KWARG = "ccm_comp_mask"


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
        if isinstance(child, (torch.nn.Linear, Conv1D, LoraLayer))  # LoraLayer: the model already has a LoRA
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
    # PEFT would also wrap an embedding or a convolution, whose LoRA the gate cannot restrict to <COMP> positions;
    # refused before anything is injected, so that the model given is left as it was.
    unsupported = sorted(
        name
        for name, module in model.named_modules()
        if check_target_module_exists(lora_config, name) and not isinstance(module, (torch.nn.Linear, Conv1D))
    )
    if unsupported:
        raise ValueError(
            f"CCMConfig.target_modules {config.target_modules} selects modules that are not linear layers "
            f"({unsupported[:3]}{' ...' if len(unsupported) > 3 else ''}); name linear projections only, such as "
            "'q_proj' or 'up_proj'."
        )
    try:
        inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # such as PEFT's "ParamWrapper does not work with lora_dropout != 0"
        _refuse_parameter_targets(model, lora_config, config, error)
        raise
    _refuse_parameter_targets(model, lora_config, config)
    # As PEFT's get_peft_model does: on a float16 or bfloat16 base the LoRA weights are float32 (the gate casts at each
    # use), or an optimizer step of 1e-4 on a bfloat16 weight of 0.3 (whose step is 2e-3) would be rounded away.
    cast_adapter_dtype(model, ADAPTER_NAME)
    # PEFT puts an adapter on a layer that already is a LoRA layer with `update_layer`: get_peft_model or
    # PeftModel.from_pretrained on the CCM model (or add_adapter, load_adapter on its base model) re-initialized the
    # trained adapter under its name (zero B), or added one the gate never runs.
    refusal = functools.partial(_refuse_another_adapter, model.peft_config, dict(model.peft_config))
    for layer in lora_layers(model):
        layer.update_layer = refusal


def _refuse_another_adapter(
    configs: dict[str, LoraConfig], own: dict[str, LoraConfig], adapter_name: str, *args: Any, **kwargs: Any
) -> None:
    """`LoraLayer.update_layer` of the layers of a CCM model: raise, before PEFT changes anything on the layer.
    `configs` is the model's `peft_config`, into which PEFT already put the new adapter's config (replacing the CCM
    adapter's under its name, which a save would then write): it gets back `own`, what it held."""
    configs.clear()
    configs.update(own)
    raise ValueError(
        f"PEFT was asked to put the adapter {adapter_name!r} on a LoRA layer of a CCMForCausalLM, whose conditional "
        "LoRA acts at <COMP> positions only: it would overwrite the trained CCM adapter, or add one that never runs. "
        "A CCM model takes no PEFT adapter (get_peft_model or PeftModel.from_pretrained on it or its base_model, "
        "base_model.add_adapter or base_model.load_adapter): load CCM adapters with CCMForCausalLM.from_pretrained or "
        "model.load_adapter, and merge a plain LoRA into the base model (merge_and_unload()) before wrapping it with "
        "CCMForCausalLM.from_base."
    )


def _refuse_parameter_targets(
    model: PreTrainedModel, lora_config: LoraConfig, config: CCMConfig, cause: Exception | None = None
) -> None:
    """Raise if PEFT turned target modules into target parameters, as it does for names of the fused experts of some
    mixture-of-experts models (Mixtral's w1/w2/w3): a LoRA on a parameter changes the weight for every token, where
    the gate cannot keep it to `<COMP>` positions (it failed on a shape, or made the LoRA act everywhere). Called
    after `inject_adapter_in_model`, which converts `lora_config` in place (PEFT may have raised part way)."""
    parameters = sorted(lora_config.target_parameters or ())
    if parameters:
        raise ValueError(
            f"CCMConfig.target_modules {config.target_modules} name the experts of {type(model).__name__}'s "
            f"mixture-of-experts layers, which PEFT adapts as the fused parameters {parameters}: a LoRA there acts "
            "at every token, not only at <COMP> positions. Name linear projections only, such as the attention's "
            "'q_proj' or 'v_proj'."
        ) from cause


def targeted(model: PreTrainedModel, target_modules: list[str] | None) -> set[str]:
    """The qualified names of the modules of `model` that `target_modules` (`None`: the default attention
    projections) selects; a LoRA layer counts as the layer it wraps, its inner modules not at all."""
    config = LoraConfig(target_modules=target_modules or default_target_modules(model))
    inner = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, LoraLayer))
    return {
        name
        for name, _ in model.named_modules()
        if check_target_module_exists(config, name) and not name.startswith(inner)
    }


def untargeted(model: PreTrainedModel, target_modules: list[str] | None) -> set[str]:
    """The qualified names of the LoRA layers of `model` that `target_modules` (`None`: the default attention
    projections) would not select."""
    layers = {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    return layers - targeted(model, target_modules)


def lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def without_lora(model: torch.nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict`, of `model` with LoRA layers, as the model without them has it (as after PEFT's `unload()`): each
    LoRA layer's own entries dropped, `<layer>.base_layer.<name>` renamed `<layer>.<name>`."""
    layers = {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    kept = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        # The LoRA layer the entry belongs to, if any (none is inside another).
        depth = next((i for i in range(1, len(parts)) if ".".join(parts[:i]) in layers), None)
        if depth is None:
            kept[key] = value
        elif parts[depth] == "base_layer":
            kept[".".join(parts[:depth] + parts[depth + 1 :])] = value
    return kept


@dataclass(frozen=True)
class _GateState:
    """Where the LoRA acts in the current call: at `mask` (`(batch, seq)` bool), nowhere when `suppressed`."""

    mask: torch.Tensor | None = None
    suppressed: bool = False
    outer: _GateState | None = None  # the state an attention layer restores once its forward ends


# Per thread and per asyncio task: one model serves concurrent calls, each with its own <COMP> mask.
_GATE: ContextVar[_GateState] = ContextVar("ccm_lora_gate", default=_GateState())  # noqa: B039 (frozen)


class LoRAGate:
    """Runs the LoRA only where the current call asks for it; nothing on the model changes per call.

    PEFT's own LoRA path stays switched off, so outside a `<COMP>` run the model is exactly its base model and
    pays nothing for the adapter. A forward hook on every LoRA layer adds `B A dropout(m x) * scaling`, with
    `m` the `<COMP>` mask of the running call. The mask reaches the hook in one of two per-call ways:

    - the forward keyword argument `ccm_comp_mask` (`(batch, seq)` bool), which transformers hands down to
      every attention layer; a pre-hook there makes it current while that layer runs, so gradient
      checkpointing, which re-runs a layer with the same arguments during backward, sees it again (this covers
      LoRA layers inside attention, the default targets);
    - `active(mask)`, a context manager local to the calling thread or task.

    With `conditional=False` (the unconditional ablation) the LoRA acts at every position.
    """

    def __init__(self, model: torch.nn.Module, conditional: bool) -> None:
        self.conditional = conditional
        layers = lora_layers(model)
        if not layers:
            raise TypeError(f"{type(model).__name__} has no LoRA layers to gate.")
        self.layers = tuple(layers)  # those the hooks run: PEFT may add others later (get_peft_model)
        for layer in layers:
            layer._disable_adapters = True  # set once: PEFT's path never runs the adapter, these hooks do
        self._handles = [layer.register_forward_hook(self._add_lora) for layer in layers]
        for attention in attention_modules(model).values():
            self._handles.append(attention.register_forward_pre_hook(self._enter_layer, with_kwargs=True))
            self._handles.append(attention.register_forward_hook(self._leave_layer, with_kwargs=True, always_call=True))

    def _add_lora(self, layer: LoraLayer, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        state = _GATE.get()
        if state.suppressed or (self.conditional and state.mask is None):
            return None
        x = args[0]
        lora_A, lora_B = layer.lora_A[ADAPTER_NAME], layer.lora_B[ADAPTER_NAME]
        x = x.to(lora_A.weight.dtype)
        if self.conditional:
            x = x * state.mask[..., None].to(x.dtype)
        delta = lora_B(lora_A(layer.lora_dropout[ADAPTER_NAME](x))) * layer.scaling[ADAPTER_NAME]
        return output + delta.to(output.dtype)

    @staticmethod
    def _enter_layer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get(COMP_MASK_KWARG)
        if mask is not None:
            state = _GATE.get()
            _GATE.set(_GateState(mask, state.suppressed, outer=state))

    @staticmethod
    def _leave_layer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if kwargs.get(COMP_MASK_KWARG) is not None:
            outer = _GATE.get().outer
            _GATE.set(outer if outer is not None else _GateState())

    @staticmethod
    def active(token_mask: torch.Tensor) -> AbstractContextManager[None]:
        """Apply the LoRA only where `token_mask` (`(batch, seq)` bool) is True, in this thread or task."""
        return _gate_state(mask=token_mask)

    @staticmethod
    def suppressed() -> AbstractContextManager[None]:
        """No LoRA at all in this thread or task, even inside `active` (the base model alone)."""
        return _gate_state(suppressed=True)

    @staticmethod
    def scope() -> AbstractContextManager[None]:
        """A call's scope: the LoRA acts only where the call itself asks (nowhere while `suppressed`), not at a mask
        the caller made current with `active`, which numbers the caller's own tokens (the call's tokens took the
        LoRA wherever it broadcast, or failed on its shape); whatever the call's layers' hooks left behind (an
        interrupt skips their clean-up) is undone when it ends."""
        return _call_state()

    @staticmethod
    def is_suppressed() -> bool:
        """Whether `suppressed` holds in this thread or task (or in the one that created this task)."""
        return _GATE.get().suppressed

    @staticmethod
    def checkpoint_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """`context_fn` for torch's non-reentrant checkpointing: the recomputation during backward runs under the
        state of the forward it repeats, so a LoRA outside attention (on the MLP), which takes the mask from that
        state rather than from a forward argument, acts there as it did."""
        return nullcontext(), _restored(_GATE.get())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextmanager
def _restored(state: _GateState) -> Iterator[None]:
    token = _GATE.set(state)
    try:
        yield
    finally:
        _GATE.reset(token)


@contextmanager
def _call_state() -> Iterator[None]:
    # Read where the context is entered, as in `_gate_state`.
    with _restored(_GateState(suppressed=_GATE.get().suppressed)):
        yield


@contextmanager
def _gate_state(mask: torch.Tensor | None = None, suppressed: bool = False) -> Iterator[None]:
    # The state is read where the context is entered, not where it was made: a context made first and entered inside
    # `adapter_disabled()` dropped the suppression, and one made in another thread brought that thread's state along.
    current = _GATE.get()
    with _restored(
        _GateState(mask if mask is not None else current.mask, suppressed or current.suppressed, current.outer)
    ):
        yield
