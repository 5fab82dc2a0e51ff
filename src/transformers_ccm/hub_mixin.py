"""Adapter I/O for `CCMForCausalLM`: save, share and load adapters as PEFT-format files (see `hub.py`).

The file formats and the Hub live in `hub.py`, which takes data only; this mixin gives the model the methods
users know from transformers and PEFT: `save_pretrained`, `push_to_hub`, `from_pretrained`, `load_adapter`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import PreTrainedModel

from transformers_ccm.config import CCMConfig, base_shape
from transformers_ccm.embedded import load_base_config, load_base_model, resolve_name
from transformers_ccm.hub import (
    COMP_EMBEDDINGS_KEY,
    check_base_shape,
    check_cap_holds_resize,
    check_flags,
    push_adapter,
    read_adapter,
    resolve_adapter,
    save_adapter,
)
from transformers_ccm.lora import ADAPTER_NAME, targeted, untargeted

if TYPE_CHECKING:
    from typing_extensions import Self

# The adapter step (a load or a save) running on each model, by id: one at a time per model, so that two loads in
# different threads do not leave a mix of both adapters, nor a save write an adapter half loaded.
_ADAPTER_STEPS: dict[int, str] = {}
_ADAPTER_STEPS_LOCK = threading.Lock()


class AdapterHubMixin:
    """Adapter files for a model with `config` (`CCMConfig`), `base_model` (with PEFT LoRA layers) and
    `comp_embeddings`; `cls(base_model, config)` builds one."""

    config: CCMConfig
    base_model: PreTrainedModel
    comp_embeddings: nn.Parameter
    _release_base: Callable[[], None]  # undoes `cls(base_model, config)` on the base model after a failed load
    _check_in_place: Callable[[], None]  # raises where weights are offloaded or on the meta device (hold no values)
    _check_lora_layers: Callable[[], None]  # raises where PEFT added LoRA layers or replaced the adapter's config

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights under PEFT's key names (without the adapter name)."""
        # CCM never resizes embeddings, so PEFT need not look up the base config (a network call) to check.
        return get_peft_model_state_dict(self.base_model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """Every adapter tensor as saved: the LoRA under PEFT's key names and the `<COMP>` embeddings."""
        return {**self.lora_state_dict(), COMP_EMBEDDINGS_KEY: self.comp_embeddings}

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], safe_serialization: bool = True, is_main_process: bool = True
    ) -> None:
        """Save the adapter (PEFT LoRA, `<COMP>` embeddings, `ccm_config.json`, model card); never the base. As in
        transformers and PEFT, a process other than the main one (`is_main_process=False`) writes nothing; the weights
        are safetensors only (`safe_serialization=False`, a pickle, is refused)."""
        check_flags(is_main_process=is_main_process)
        _check_safetensors_only(safe_serialization, "save_pretrained")
        if not is_main_process:
            return
        with self._adapter_step("save_pretrained()"):
            self._check_in_place()  # weights on the meta device hold no values to write
            self._check_lora_layers()  # else it wrote an adapter that does not load, over the one saved before
            save_adapter(save_directory, self.config, self.base_model.peft_config[ADAPTER_NAME], self.adapter_tensors())

    @contextmanager
    def _adapter_step(self, step: str) -> Iterator[None]:
        """Within the context, `step` (`load_adapter()`, `save_pretrained()`, ...) is the only adapter step on this
        model: one that another thread starts meanwhile is refused."""
        with _ADAPTER_STEPS_LOCK:
            running = _ADAPTER_STEPS.get(id(self))
            if running is not None:
                raise ValueError(
                    f"{step} was called while another thread runs {running} on this model's adapter, and the two would "
                    f"interleave (a mix of two adapters); call {step} after {running} returns."
                )
            _ADAPTER_STEPS[id(self)] = step
        try:
            yield
        finally:
            with _ADAPTER_STEPS_LOCK:
                del _ADAPTER_STEPS[id(self)]

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        commit_message: str | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        commit_description: str | None = None,
        tags: str | list[str] | None = None,
        safe_serialization: bool = True,
        max_shard_size: int | str | None = None,
    ) -> Any:
        """Upload the adapter files to the Hub repo `repo_id` (created if needed) in one commit, as transformers
        does: to the branch `revision` (created if needed), or as a pull request with `create_pr`. `tags` go onto
        the model card beside the adapter's own. As with a PEFT adapter, `max_shard_size` changes nothing (an
        adapter is one file); `safe_serialization=False` (a pickle) is refused."""
        _check_safetensors_only(safe_serialization, "push_to_hub")
        with self._adapter_step("push_to_hub()"):
            self._check_in_place()
            self._check_lora_layers()
            return push_adapter(
                repo_id,
                self.config,
                self.base_model.peft_config[ADAPTER_NAME],
                self.adapter_tensors(),
                private=private,
                commit_message=commit_message,
                token=token,
                revision=revision,
                create_pr=create_pr,
                commit_description=commit_description,
                tags=tags,
                max_shard_size=max_shard_size,
            )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str],
        base_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        torch_dtype: torch.dtype | str | None = None,
        device_map: str | dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        subfolder: str | None = None,
        local_files_only: bool = False,
        **base_kwargs: Any,
    ) -> Self:
        """Load an adapter from a local folder or a Hub repo, with its base model.

        The base model is the one named in `ccm_config.json` (at its recorded revision) unless `base_model`
        (a path, Hub id or loaded model) is given. Its architecture and sizes are checked against the adapter
        before any weight is loaded. `base_kwargs` go to the base model's `from_pretrained`. As in PEFT, `subfolder` is
        the adapter's folder inside `name_or_path`, and `local_files_only` reads the adapter (and the base model)
        from the Hub cache only. `torch_dtype` and `dtype` (transformers 5's name for it, in `base_kwargs`) are one
        argument: give one of them.
        """
        if torch_dtype is not None and "dtype" in base_kwargs:  # else a raw "multiple values for 'dtype'" below
            raise TypeError(
                f"from_pretrained got both torch_dtype={torch_dtype!r} and dtype={base_kwargs['dtype']!r}, two names "
                "for the base model's dtype; pass only dtype= (transformers 5's name; torch_dtype is its older alias)."
            )
        folder = resolve_adapter(
            name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            subfolder=subfolder,
            local_files_only=local_files_only,
        )
        config, tensors = read_adapter(folder)
        # Any module is taken as the loaded base: wrapping refuses one that is no transformers model with its fix (a
        # torch.compile'd or PEFT model failed in os.fspath, "expected str, bytes or os.PathLike object").
        if isinstance(base_model, nn.Module):
            if torch_dtype is not None or device_map is not None or base_kwargs:
                raise TypeError(
                    "torch_dtype, device_map and loading arguments apply only when the base is loaded here."
                )
            base = base_model
        else:
            base_name = resolve_name(base_model) if base_model is not None else config.base_model_name_or_path
            if base_name is None:
                raise ValueError(f"The adapter at {folder} names no base model; pass base_model=.")
            options = {
                "revision": config.base_model_revision if base_model is None else None,
                "token": token,
                "cache_dir": cache_dir,
                "local_files_only": local_files_only or None,
            }
            options = {key: value for key, value in options.items() if value is not None}
            try:
                base_config = load_base_config(base_name, **options, **base_kwargs)
            except OSError as error:
                if base_model is not None or base_kwargs:  # the caller's name or arguments: their own error says it
                    raise
                # The name comes from the adapter's file (a folder on the machine that trained it, say), not from
                # the caller, whose fix is to name the base model themselves.
                raise FileNotFoundError(
                    f"The adapter at {folder} was made for the base model {base_name!r}, which cannot be loaded here "
                    f"({error}). Pass base_model= (its folder, Hub id or loaded model)."
                ) from error
            check_base_shape(config, base_name, base_shape(base_config))
            loading = {"dtype": torch_dtype, "device_map": device_map}
            base = load_base_model(
                base_name, **options, **{k: v for k, v in loading.items() if v is not None}, **base_kwargs
            )
        model = cls(base, config)  # type: ignore[call-arg]
        try:
            model._load_adapter_weights(tensors, folder)
        except BaseException:
            model._release_base()  # the caller's base model, if it gave one, is theirs again as it was
            raise
        return model

    def load_adapter(
        self,
        name_or_path: str | os.PathLike[str],
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        resize_comp_tokens: bool = False,
        extend_targets: bool = False,
        subfolder: str | None = None,
        local_files_only: bool = False,
    ) -> None:
        """Replace this model's adapter by a saved one of the same structure (LoRA rank and targets, `<COMP>`
        length); its update rule comes along, the model keeps its `lora_dropout`. Nothing changes if anything
        does not match.

        With `resize_comp_tokens=True` an adapter with another number of `<COMP>` tokens loads too, to continue
        training with more (or fewer) memory slots per context: the model keeps its own count, its first tokens
        take the adapter's embeddings and any further ones copies of the adapter's last, so a grown adapter
        starts out close to the saved one and training tells the copies apart.

        With `extend_targets=True` an adapter with LoRA on some of this model's targets loads too (attention
        only, say, into a model that also adapts its MLP): the model keeps its own targets, and the LoRA layers
        the adapter lacks start at zero (`B = 0`), so the model computes what the saved adapter does until
        training moves them. `subfolder` and `local_files_only` are those of `from_pretrained`."""
        check_flags(resize_comp_tokens=resize_comp_tokens, extend_targets=extend_targets)
        folder = resolve_adapter(
            name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            subfolder=subfolder,
            local_files_only=local_files_only,
        )
        config, tensors = read_adapter(folder)
        # The checks read the model's config and the load writes it: another load in between would mix the two.
        with self._adapter_step("load_adapter()"):
            check_base_shape(
                config, self.config.base_model_name_or_path or "this model", base_shape(self.base_model.config)
            )
            saved_comp = tensors.get(COMP_EMBEDDINGS_KEY)
            # A missing or malformed embedding is left as it is, for the checks below to reject with their message.
            if resize_comp_tokens and saved_comp is not None and saved_comp.ndim == 2 and len(saved_comp):
                n = self.config.num_comp_tokens
                check_cap_holds_resize(
                    config,
                    n,
                    f"The adapter at {folder}",
                    f"this model's {n} <COMP> tokens",
                    "resize it to at most {cap} <COMP> tokens",
                )
                tensors = {**tensors, COMP_EMBEDDINGS_KEY: _resized(saved_comp, n)}
                config = replace(config, num_comp_tokens=n)
            if targeted(self.base_model, config.target_modules) == targeted(
                self.base_model, self.config.target_modules
            ):
                config = replace(config, target_modules=self.config.target_modules)  # the same layers, named otherwise
            structural = ("num_comp_tokens", "conditional_lora", "r", "lora_alpha", "target_modules")
            different = [name for name in structural if getattr(config, name) != getattr(self.config, name)]
            added_layers: set[str] = set()
            if extend_targets and "target_modules" in different:
                different.remove("target_modules")
                # Only layers its own targets leave out start at zero; one they cover must be in the file.
                added_layers = untargeted(self.base_model, config.target_modules)
                config = replace(config, target_modules=self.config.target_modules)
            if different:
                details = ", ".join(
                    f"{n}: adapter {getattr(config, n)!r} vs model {getattr(self.config, n)!r}" for n in different
                )
                raise ValueError(
                    f"The adapter at {folder} has another structure ({details}); load it with "
                    "CCMForCausalLM.from_pretrained instead."
                )
            self._load_adapter_weights(tensors, folder, added_layers)
            # The LoRA layers keep the dropout they were built with.
            self.config = replace(
                config, lora_dropout=self.config.lora_dropout, base_model_shape=self.config.base_model_shape
            )

    def _load_adapter_weights(
        self, tensors: dict[str, torch.Tensor], source: os.PathLike[str], added_layers: AbstractSet[str] = frozenset()
    ) -> None:
        """Check every name and shape first, then copy: a mismatch leaves the model untouched. The LoRA layers
        named in `added_layers` are not in `tensors`; they are set to zero."""
        self._check_in_place()  # a copy onto the meta device does nothing: the adapter would be lost
        expected = self.adapter_tensors()
        added = {f"{layer}.lora_{part}.weight" for layer in added_layers for part in "AB"}
        missing = sorted(expected.keys() - tensors.keys() - added)
        unexpected = sorted(tensors.keys() - (expected.keys() - added))
        wrong = sorted(k for k in expected.keys() & tensors.keys() if tensors[k].shape != expected[k].shape)
        # Finite in the file's dtype is not enough: a float64 (or float32 into float16) value past the model's
        # range would be copied in as inf.
        overflow = sorted(
            k
            for k in expected.keys() & tensors.keys()
            if k not in wrong and not bool(torch.isfinite(tensors[k].to(expected[k].dtype)).all())
        )
        if missing or unexpected or wrong or overflow:
            # The adapter's dtype, not the model's: on a float16 or bfloat16 base the adapter is float32.
            ranges = ", ".join(sorted({str(expected[k].dtype) for k in overflow}))
            labels = ("missing", "unexpected", "wrong shape", f"values beyond the range of {ranges}")
            problems = [
                f"{label}: {names[:4]}{' ...' if len(names) > 4 else ''}"
                for label, names in zip(labels, (missing, unexpected, wrong, overflow), strict=True)
                if names
            ]
            raise ValueError(f"The adapter weights in {source} do not fit this model ({'; '.join(problems)}).")
        with torch.no_grad():
            lora = {key: value for key, value in tensors.items() if key != COMP_EMBEDDINGS_KEY}
            lora |= {
                f"{layer}.lora_B.weight": torch.zeros_like(expected[f"{layer}.lora_B.weight"]) for layer in added_layers
            }
            # The copy goes module by module: one that fails half way puts the earlier modules back (the values of
            # `expected` share the parameters' storage), so that the model and the caches made with it stay valid.
            kept = {key: value.clone() for key, value in expected.items()}
            try:
                set_peft_model_state_dict(self.base_model, lora, adapter_name=ADAPTER_NAME)
                self.comp_embeddings.copy_(tensors[COMP_EMBEDDINGS_KEY])
            except BaseException:
                for key, value in expected.items():
                    value.copy_(kept[key])
                raise


def _check_safetensors_only(safe_serialization: object, call: str) -> None:
    """Raise unless `safe_serialization` is True: a CCM adapter is never pickled."""
    check_flags(safe_serialization=safe_serialization)
    if not safe_serialization:
        raise ValueError(
            "A CCM adapter is saved as safetensors only (nothing is pickled, so nothing runs when it is loaded); "
            f"call {call} without safe_serialization=False."
        )


def _resized(comp_embeddings: torch.Tensor, count: int) -> torch.Tensor:
    """`(count, hidden)`: the first `count` rows of `comp_embeddings` `(n, hidden)`, then copies of its last row."""
    extra = comp_embeddings[-1:].expand(max(0, count - len(comp_embeddings)), -1)
    return torch.cat([comp_embeddings[:count], extra])
