"""`CCMConfig`: everything that defines a compression adapter, stored as `ccm_config.json`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from transformers_ccm.files import made_folder, replace_file
from transformers_ccm.json_reading import parse_json_object, read_regular_file
from transformers_ccm.validation import check_setting, finite_number, number, positive_int

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONFIG_NAME = "ccm_config.json"
# ccm_config.json and adapter_config.json hold some 1000 bytes: a file far larger is none, and is refused before it is
# read whole (a crafted one of gigabytes was read, then parsed, into memory).
CONFIG_MAX_BYTES = 1 << 20
FORMAT_VERSION = 1

UpdateRule = Literal["concat", "merge", "ema"]
UPDATE_RULES: tuple[str, ...] = ("concat", "merge", "ema")
# What a model's LoRA layers and <COMP> embeddings are built with: its config keeps them (`_hold_built_fields`). Set
# on its config, a count of <COMP> tokens failed every call inside torch, and conditional_lora=False was saved with a
# LoRA trained as conditional, which the adapter then ran at every token once loaded.
BUILT_FIELDS = (
    "num_comp_tokens",
    "conditional_lora",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "base_model_shape",
)
# The concat cap is compared with int64 slot counts: past int64 the comparison wrapped (every slot was dropped at
# the next fold) or overflowed.
_LARGEST_CAP = 2**63 - 1


def _refuse_in_place(self: object, *args: object, **kwargs: object) -> NoReturn:
    raise TypeError(
        "A CCMConfig's target_modules and base_model_shape cannot change in place; set the field instead (e.g. "
        "config.target_modules = [...]), which is checked as the constructor checks it."
    )


class _FrozenList(list):
    """A list that refuses changes in place (`CCMConfig.target_modules`): equal to the list it holds, written to JSON
    and given to PEFT as one. `+=` makes a new list, which setting the field then checks."""

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse_in_place
    __setitem__ = __delitem__ = __imul__ = _refuse_in_place

    def __iadd__(self, other: Any) -> list[Any]:
        return [*self, *other]

    def __reduce__(self) -> tuple[type, tuple[list[Any]]]:
        # Pickled and copied (`copy.deepcopy`) by its items, never appended one by one.
        return type(self), (list(self),)


class _FrozenDict(dict):
    """A dict that refuses changes in place (`CCMConfig.base_model_shape`): equal to the dict it holds, and written to
    JSON as one. `|=` makes a new dict, which setting the field then checks."""

    clear = pop = popitem = setdefault = update = _refuse_in_place
    __setitem__ = __delitem__ = _refuse_in_place

    def __ior__(self, other: Any) -> dict[Any, Any]:
        return {**self, **other}

    def __reduce__(self) -> tuple[type, tuple[dict[Any, Any]]]:
        return type(self), (dict(self),)


def _frozen(value: Any) -> Any:
    """`value` with every list and dict in it, at any depth, one that refuses changes in place."""
    if isinstance(value, dict):
        return _FrozenDict({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return _FrozenList(_frozen(item) for item in value)
    return value


def _thawed(value: Any) -> Any:
    """`value` (`_frozen`'s) with plain lists and dicts again."""
    if isinstance(value, dict):
        return {key: _thawed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_thawed(item) for item in value]
    return value


@dataclass
class CCMConfig:
    """Settings of a Compressed Context Memory adapter, checked when made and whenever a field is set.

    Args:
        num_comp_tokens: length of the `<COMP>` block appended to every context (paper: 1 to 8).
        update: how a new compression `h(t)` enters memory. `"concat"` appends it (memory grows by
            `num_comp_tokens` per step), `"merge"` keeps the running mean, `"ema"` an exponential
            moving average with `ema_alpha` (`a_1 = 1`).
        ema_alpha: the EMA coefficient `a_t` for `t >= 2`, in (0, 1].
        max_memory_tokens: cap on concat memory; the oldest slots are evicted first. `None` is unbounded.
        conditional_lora: apply the LoRA only at `<COMP>` positions (the paper's method). `False` gives the
            unconditional ablation.
        r, lora_alpha, lora_dropout: LoRA rank, scaling numerator and dropout (paper: 8, 16, 0.05).
        target_modules: names of the modules that get a LoRA. `None` picks every linear projection of each
            attention layer (q, k, v, o, or the fused variants a model uses).
        base_model_name_or_path, base_model_revision: the base model the adapter was made for.
        base_model_shape: that model's architecture and sizes (filled in when a model is wrapped), checked
            against a base model before any weight is loaded.
        trained_on: what the adapter was trained on, when known (shown in the model card).
    """

    num_comp_tokens: int = 2
    update: UpdateRule = "concat"
    ema_alpha: float = 0.5
    max_memory_tokens: int | None = None
    conditional_lora: bool = True
    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    target_modules: list[str] | None = None
    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    base_model_shape: dict[str, Any] | None = None
    trained_on: str | None = None

    def __post_init__(self) -> None:
        _check(self.num_comp_tokens, "num_comp_tokens", "a positive integer", positive_int)
        _check(self.update, "update", " | ".join(repr(u) for u in UPDATE_RULES), lambda v: v in UPDATE_RULES)
        _check(self.ema_alpha, "ema_alpha", "a number in (0, 1]", lambda v: number(v) and 0 < v <= 1)
        if self.max_memory_tokens is not None:
            if self.update != "concat":
                raise ValueError(
                    f"CCMConfig.max_memory_tokens applies to update='concat' only (got update={self.update!r}); "
                    "merge and ema memory already holds num_comp_tokens slots. Set max_memory_tokens=None."
                )
            _check(
                self.max_memory_tokens,
                "max_memory_tokens",
                f"None or an integer >= num_comp_tokens ({self.num_comp_tokens}) and < 2**63 (None for no cap)",
                lambda v: positive_int(v) and self.num_comp_tokens <= v <= _LARGEST_CAP,
            )
        _check(self.conditional_lora, "conditional_lora", "True or False", lambda v: isinstance(v, bool))
        _check(self.r, "r", "a positive integer", positive_int)
        _check(self.lora_alpha, "lora_alpha", "a positive finite number", lambda v: finite_number(v) and v > 0)
        _check(self.lora_dropout, "lora_dropout", "a number in [0, 1)", lambda v: number(v) and 0 <= v < 1)
        if self.target_modules is not None:
            _check(
                self.target_modules,
                "target_modules",
                "None or a non-empty list of module names",
                lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(n, str) for n in v),
            )
        for name in ("base_model_name_or_path", "base_model_revision", "trained_on"):
            _check(getattr(self, name), name, "None or a string", lambda v: v is None or isinstance(v, str))
        _check(
            self.base_model_shape,
            "base_model_shape",
            "None or an object of sizes",
            lambda v: v is None or (isinstance(v, dict) and all(isinstance(key, str) for key in v)),
        )
        # Held as lists and dicts that refuse changes in place: `config.target_modules.append(...)` skipped every check
        # above, and a model's hold on the fields it was built with (`_hold_built_fields`).
        self.target_modules = _frozen(self.target_modules)
        self.base_model_shape = _frozen(self.base_model_shape)
        # From now on a field set alone is checked too (`__setattr__`).
        self.__dict__["_checked"] = True

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a field as the constructor takes it, checked with the rest of the config (a `ValueError` leaves the
        config as it was): set unchecked, `model.config.ema_alpha = 2.0` made every EMA memory grow without bound, and
        `update = "mean"` folded as EMA under a signature that named another rule."""
        if name in _FIELD_NAMES and self.__dict__.get("_recorded", False):
            raise ValueError(
                f"CCMConfig.{name} of a cache's config (cache.config) cannot change: it records the settings the "
                "cache's memory was made with. Change the model's config (model.config), whose memories made before "
                "are then refused, and make a new cache with model.new_cache()."
            )
        if name in _FIELD_NAMES and self.__dict__.get("_checked", False):
            value = getattr(replace(self, **{name: value}), name)  # as normalised (`_frozen`)
            if name in self.__dict__.get("_built", ()) and value != getattr(self, name):
                raise ValueError(
                    f"CCMConfig.{name} of a model's config cannot change ({getattr(self, name)!r} to {value!r}): the "
                    f"model's LoRA layers and <COMP> embeddings were built with it. Build a new model with "
                    f"CCMForCausalLM.from_base(base_model, dataclasses.replace(model.config, {name}=...))."
                )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        """Refuse deleting a field: its class default showed through, past every check of `__setattr__` (`del
        model.config.num_comp_tokens` read 2 for a model built with 4, whose next call failed inside torch, and `del
        cache.config.ema_alpha` changed how that cache folded)."""
        if name in _FIELD_NAMES:
            raise AttributeError(
                f"CCMConfig.{name} cannot be deleted; set it instead (config.{name} = ...), which is checked as the "
                "constructor checks it."
            )
        super().__delattr__(name)

    def _hold_built_fields(self) -> None:
        """Refuse, from now on, a change of the fields a model was built with (`BUILT_FIELDS`): this is its config."""
        self.__dict__["_built"] = BUILT_FIELDS

    def _record(self) -> CCMConfig:
        """A copy that refuses every change: a cache's record of the settings its memory is made with
        (`CacheSpec.config`). A cache held the model's own config, which reported the model's later settings as its
        memory's; and once the model took another config (`load_adapter`), `cache.config.ema_alpha = 0.2` changed
        how that cache folded while its signature still named the rule it was made with. `dataclasses.replace` of
        it is a config of its own again."""
        record = replace(self)
        record.__dict__["_recorded"] = True
        return record

    def __getstate__(self) -> dict[str, Any]:
        """The config without a model's hold (`_hold_built_fields`): a copy (`copy.deepcopy`, a pickle) is a config of
        its own, which a model holds again once it is its config."""
        return {name: value for name, value in self.__dict__.items() if name != "_built"}

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready content of `ccm_config.json`, with the format version."""
        from transformers_ccm import __version__

        content = {field.name: _thawed(getattr(self, field.name)) for field in fields(self)}
        return {"format_version": FORMAT_VERSION, "ccm_version": __version__, **content}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = CONFIG_NAME) -> CCMConfig:
        """The config that `data` (the content of `ccm_config.json`) holds; errors name the file as `source`."""
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if not positive_int(version):
            raise ValueError(f"{source} has format_version {version!r}; it must be a whole number such as 1.")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{source} has format_version {version!r}, but this transformers-ccm reads version "
                f"{FORMAT_VERSION}. Upgrade transformers-ccm to load this adapter."
            )
        data.pop("ccm_version", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source} has unknown fields {unknown}; known fields: {sorted(known)}.")
        try:
            return cls(**data)
        except ValueError as error:
            raise ValueError(
                f"{source} holds a value CCMConfig refuses: {error} Save or download the adapter again."
            ) from None

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> str:
        """Write `ccm_config.json` into `save_directory` and return its path."""
        path = os.path.join(save_directory, CONFIG_NAME)
        with made_folder(save_directory, "save the config into a folder."):
            replace_file(path, self._write_json)
        return path

    def _write_json(self, path: str) -> None:
        """Write the content of `ccm_config.json` to the file `path` (as it is: `save_pretrained` replaces the file
        whole)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_pretrained(cls, directory_or_file: str | os.PathLike[str]) -> CCMConfig:
        """Read `ccm_config.json` from a folder (or the file itself)."""
        path = os.fspath(directory_or_file)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        if not os.path.lexists(path):
            raise FileNotFoundError(f"No {CONFIG_NAME} at {path}: this folder holds no CCM adapter.")
        # Not opened as a stream: a pipe there (a checkpoint's, for `ccm train --resume`) blocked the read for good.
        text = read_regular_file(path, "give the ccm_config.json of an adapter, or save it again.", CONFIG_MAX_BYTES)
        return cls.from_json_bytes(text, path)

    @classmethod
    def from_json_bytes(cls, text: bytes, path: str) -> CCMConfig:
        """The config that `text` (the content of the `ccm_config.json` at `path`, which errors name) holds."""
        return cls.from_dict(parse_json_object(text, path, "the file is corrupt, save it again."), source=path)


_check = partial(check_setting, "CCMConfig")
_FIELD_NAMES = frozenset(field.name for field in fields(CCMConfig))


def base_shape(config: PretrainedConfig) -> dict[str, Any]:
    """The architecture and sizes an adapter or a memory depends on."""
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "vocab_size": config.vocab_size,
    }
