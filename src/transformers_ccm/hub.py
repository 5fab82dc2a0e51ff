"""Adapters as files: a PEFT-format LoRA plus `<COMP>` embeddings, `ccm_config.json` and a model card.

Layout of a saved adapter (never the base weights, never pickle):

    adapter_config.json         PEFT LoraConfig
    adapter_model.safetensors   LoRA weights (PEFT key names) and `ccm.comp_embeddings`
    ccm_config.json             CCMConfig: update rule, <COMP> length, base model id, revision and shape
    README.md                   model card
    ccm_manifest.json           SHA-256 of the first three files: a folder holding files of two saves (a save killed
                                part way) is refused, not loaded as a mix (the model card is left out: users edit it)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, constants, snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from safetensors import SafetensorError, deserialize
from safetensors.torch import load, save_file
from transformers.utils.hub import convert_file_size_to_int

from transformers_ccm.config import CONFIG_MAX_BYTES, CONFIG_NAME, CCMConfig
from transformers_ccm.embedded import check_local_or_hub
from transformers_ccm.files import (
    checked_path,
    folder_lock,
    made_folder,
    not_enough_memory,
    raise_if_short_of,
    remove_folder,
    replace_files,
)
from transformers_ccm.json_reading import parse_json_object, read_regular_file
from transformers_ccm.safetensors_header import safetensors_header, write_errors_as_os_errors
from transformers_ccm.validation import is_int

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
MODEL_CARD_NAME = "README.md"
MANIFEST_NAME = "ccm_manifest.json"
MANIFEST_VERSION = 1
# A manifest of ours is some 300 bytes: a larger file is none, and is refused before it is read whole.
MANIFEST_MAX_BYTES = 1 << 16
# The files whose digests the manifest records, in the order they are written (and swapped in backwards).
VERIFIED_FILES = (CONFIG_NAME, ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
ADAPTER_FILES = (*VERIFIED_FILES, MODEL_CARD_NAME, MANIFEST_NAME)
PEFT_PREFIX = "base_model.model."
# adapter_config.json's task_type: PEFT refuses a task type it does not know, naming it, so that PEFT
# (`PeftModel.from_pretrained`, `AutoPeftModelForCausalLM`) and transformers (`AutoModelForCausalLM.from_pretrained`
# of the folder, `load_adapter`) do not load a LoRA that would act at every token, without the <COMP> embeddings.
PEFT_TASK_TYPE = (
    "CCM_ADAPTER: a Compressed Context Memory adapter, whose LoRA and <COMP> embeddings run only inside "
    "transformers-ccm; load it with transformers_ccm.CCMForCausalLM.from_pretrained"
)
COMP_EMBEDDINGS_KEY = "ccm.comp_embeddings"
SHIPPED_PREFIX = "ccm:"
SHIPPED_FOLDER = Path(__file__).parent / "adapters"

_CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

A [Compressed Context Memory](https://arxiv.org/abs/2312.03414) adapter for
{{ base_model }}: a conditional LoRA (rank {{ r }}) and
{{ num_comp_tokens }} learned `<COMP>` embedding(s) that compress each new context into {{ num_comp_tokens }}
key/value slot(s) per layer, updated by **{{ update }}**{{ update_detail }}.

- Trained on: {{ trained_on }}
- Base model revision: {{ revision }}
- Made with transformers-ccm {{ version }}

## Use

```python
from transformers_ccm import CCMForCausalLM

model = CCMForCausalLM.from_pretrained({{ load_arguments }})   # {{ load_comment }}
cache = model.new_cache()
model.compress(cache, context_ids)
out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
model.compress(cache)   # fold the turn into memory
```
"""


def save_adapter(
    save_directory: str | os.PathLike[str],
    config: CCMConfig,
    lora_config: LoraConfig,
    tensors: dict[str, torch.Tensor],
    repo_id: str | None = None,
    tags: tuple[str, ...] = (),
) -> None:
    """Write an adapter's files into `save_directory`: `config`, PEFT's `lora_config` (a copy records the base
    model; the given one is left as it is) and `tensors` (PEFT key names without prefix, and
    `COMP_EMBEDDINGS_KEY`). The model card tells to load it by `repo_id` (default: `ccm:<name>` inside the
    package's adapters folder, else the folder's path), and lists `tags` after the adapter's own."""
    folder = Path(checked_path(save_directory, "save_directory", "my-adapter"))
    lora_config = copy.deepcopy(lora_config)
    lora_config.base_model_name_or_path = config.base_model_name_or_path
    lora_config.revision = config.base_model_revision
    lora_config.task_type = PEFT_TASK_TYPE
    # PEFT holds a list of target modules as a set and writes it in the set's order, which changes with each process's
    # string hashing: one adapter saved twice gave two adapter_config.json files (and manifests). Sorted, it gives one.
    for name in _PEFT_TARGETING:
        if isinstance(getattr(lora_config, name, None), set):
            setattr(lora_config, name, sorted(getattr(lora_config, name)))
    prefixed = {
        (key if key == COMP_EMBEDDINGS_KEY else PEFT_PREFIX + key): value for key, value in _snapshot(tensors).items()
    }
    if repo_id is None:
        shipped = folder.resolve().parent == SHIPPED_FOLDER.resolve()
        repo_id = SHIPPED_PREFIX + folder.name if shipped else str(folder)
    card = _model_card(config, repo_id, tags)
    # Written aside, then swapped in together (see files.py): a failed save keeps the adapter saved there before,
    # and the folder's other files (training checkpoints, the user's) stay. The manifest goes in first: a process
    # killed during the swap leaves files that disagree with it, which `read_adapter` refuses.
    with made_folder(folder, "save the adapter into a folder."):
        replace_files(
            {
                folder / CONFIG_NAME: config._write_json,
                folder / ADAPTER_CONFIG_NAME: lambda path: lora_config.save_pretrained(os.path.dirname(path)),
                folder / ADAPTER_WEIGHTS_NAME: lambda path: _save_weights(prefixed, path),
                folder / MODEL_CARD_NAME: card.save,
                folder / MANIFEST_NAME: _write_manifest,
            }
        )


def _save_weights(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write an adapter's weights file (a full disk raises an OSError)."""
    with write_errors_as_os_errors():
        save_file(tensors, path, metadata={"format": "pt"})


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of `tensors`, all of one state: the weights as they were when the save read them, not
    the live parameters, which an optimizer step or a load in another thread would change while they are written."""
    # An in-place write (an optimizer step) bumps a tensor's version, a `.data` swap moves its storage: either
    # during the pass would leave copies of two states.
    before = {key: (value._version, value.data_ptr()) for key, value in tensors.items()}
    copies = {key: _cpu_copy(value) for key, value in tensors.items()}
    changed = sorted(key for key, value in tensors.items() if (value._version, value.data_ptr()) != before[key])
    if changed:
        raise ValueError(
            f"The adapter weights changed while they were being saved ({', '.join(changed[:4])}"
            f"{' ...' if len(changed) > 4 else ''}): another thread trained the model or loaded weights into it "
            "meanwhile, and the file would hold weights of two states. Save while no other thread trains or loads "
            "into the model, or retry the save; nothing was written."
        )
    return copies


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` on the CPU, sharing no memory with it."""
    return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _write_manifest(path: str) -> None:
    """Write the manifest of the `VERIFIED_FILES` beside `path`."""
    folder = Path(path).parent
    digests = {name: _digest((folder / name).read_bytes()) for name in VERIFIED_FILES}
    Path(path).write_text(json.dumps({"format_version": MANIFEST_VERSION, "sha256": digests}, indent=2) + "\n")


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _is_digest(value: object) -> bool:
    """Whether `value` is written as `_digest` writes one."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _model_card(config: CCMConfig, repo_id: str, tags: tuple[str, ...] = ()) -> ModelCard:
    from transformers_ccm import __version__

    base = config.base_model_name_or_path
    on_hub = base is not None and not os.path.exists(base) and _is_repo_id(base)
    # A base the adapter does not name, or a folder of the machine that saved it, has no Hub page to link to, and
    # from_pretrained cannot find it elsewhere by itself: the card says to pass it (it linked huggingface.co/unknown).
    # The snippet's arguments are Python literals (repr): a path with a quote, a backslash or a newline broke it.
    if on_hub:
        described, arguments, comment = (
            f"[{base}](https://huggingface.co/{base})",
            repr(repo_id),
            "loads the base model too",
        )
    elif base is None:
        described, arguments = "a base model it does not record", f"{repo_id!r}, base_model='path-or-hub-id'"
        comment = "give the base model's folder or Hub id"
    else:
        described = f"`{base}` (a folder on the machine that saved the adapter)"
        arguments = f"{repo_id!r}, base_model={base!r}"
        comment = "the base model's folder or Hub id here"
    card_data = ModelCardData(
        base_model=base if on_hub else None,
        library_name="transformers-ccm",
        tags=list(dict.fromkeys(("ccm", "context-compression", "peft", "lora", f"ccm-{config.update}", *tags))),
        pipeline_tag="text-generation",
    )
    return ModelCard.from_template(
        card_data,
        template_str=_CARD_TEMPLATE,
        title=f"{Path(repo_id).name.removeprefix(SHIPPED_PREFIX)}: CCM-{config.update} adapter",
        base_model=described,
        load_arguments=arguments,
        load_comment=comment,
        r=config.r,
        num_comp_tokens=config.num_comp_tokens,
        update=config.update,
        update_detail=_update_detail(config),
        trained_on=config.trained_on or "not recorded",
        revision=config.base_model_revision or "not recorded",
        version=__version__,
    )


def _update_detail(config: CCMConfig) -> str:
    """The update rule's own setting, as the model card states it after the rule's name."""
    if config.update == "ema":
        return f" (each new context weighted by ema_alpha = {config.ema_alpha})"
    if config.update == "concat" and config.max_memory_tokens is not None:
        return f" (at most max_memory_tokens = {config.max_memory_tokens} slots per layer, the oldest dropped first)"
    return ""


def shipped_adapters() -> list[str]:
    """Short names of the adapters shipped inside the package (`ccm:<name>`; no Hub id has a colon)."""
    return sorted(SHIPPED_PREFIX + p.name for p in SHIPPED_FOLDER.iterdir() if (p / CONFIG_NAME).is_file())


def resolve_adapter(
    name_or_path: str | os.PathLike[str],
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    subfolder: str | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local folder holding the adapter: a shipped adapter (`ccm:<name>`), `name_or_path` itself, or its Hub
    snapshot (downloaded or cached; with `local_files_only`, cached only), or their `subfolder` (as PEFT reads it)."""
    name = os.fspath(name_or_path)
    inside = _subfolder_parts(subfolder)
    check_flags(local_files_only=local_files_only)
    if name.startswith(SHIPPED_PREFIX):
        # A shipped name is one of the package's adapter folders, never a path that could lead elsewhere.
        if name not in shipped_adapters():
            raise FileNotFoundError(f"No shipped adapter {name!r}; shipped: {shipped_adapters()}.")
        folder = SHIPPED_FOLDER / name.removeprefix(SHIPPED_PREFIX)
    elif os.path.isdir(name):  # not `Path(name).is_dir()`: Path("") is the working folder
        folder = Path(name)
    else:
        check_local_or_hub(name, "give an adapter's folder, its Hub id or ccm:<name>.")
        try:
            folder = Path(
                snapshot_download(
                    name,
                    revision=revision,
                    token=token,
                    cache_dir=cache_dir,
                    # huggingface-hub 1.x, offline (HF_HUB_OFFLINE=1), asks the Hub for the files of a commit hash
                    # and raises OfflineModeIsEnabled, where its snapshot is cached; 2.x looks in the cache first.
                    local_files_only=local_files_only
                    or (constants.HF_HUB_OFFLINE and re.fullmatch(r"[0-9a-f]{40}", revision or "") is not None),
                    allow_patterns=["/".join((*inside, file)) for file in ADAPTER_FILES],
                )
            )
        except HFValidationError:
            raise FileNotFoundError(f"{name_or_path} is neither a local folder nor a valid Hub repo id.") from None
    if not inside:
        return folder
    if not folder.joinpath(*inside).is_dir():
        raise FileNotFoundError(
            f"{name_or_path} has no folder {subfolder!r}; pass the subfolder that holds the adapter."
        )
    return folder.joinpath(*inside)


def check_flags(**flags: object) -> None:
    """Raise a ValueError naming the first of the arguments `flags` that is not True or False: a string such as "no"
    or "false" is truthy, and did what it said not to."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}.")


def _subfolder_parts(subfolder: object) -> tuple[str, ...]:
    """The names of the folders on the path `subfolder` (None or "": none). Raise a ValueError unless it stays inside
    the repo or folder it is taken from."""
    if subfolder is None:
        return ()
    if not isinstance(subfolder, str):
        raise TypeError(f"subfolder must be a string such as 'adapters/concat', not a {type(subfolder).__name__}.")
    parts = tuple(part for part in subfolder.replace("\\", "/").split("/") if part not in ("", "."))
    if subfolder.startswith(("/", "\\")) or os.path.isabs(subfolder) or ".." in parts:
        raise ValueError(
            f"subfolder={subfolder!r} leads out of the adapter's repo or folder; give a path inside it, such as "
            "'adapters/concat'."
        )
    return parts


def read_adapter(folder: Path) -> tuple[CCMConfig, dict[str, torch.Tensor]]:
    """Read and check the adapter files in `folder`. Returns its config and weights (PEFT keys without prefix,
    plus `COMP_EMBEDDINGS_KEY`)."""
    # Read under the folder's shared lock: a save in another thread or process swaps the files under its exclusive
    # lock, so they are all of one save. Where there is no lock, the order still refuses a mix: the manifest first,
    # the weights last (a save in between changes their digest), and the JSON and the weights parsed from the bytes
    # digested.
    with folder_lock(folder, exclusive=False):
        _check_links(folder)
        manifest = _read_manifest(folder / MANIFEST_NAME)
        names = (CONFIG_NAME, ADAPTER_CONFIG_NAME)
        files = {
            name: read_regular_file(folder / name, "save or download the adapter again.", CONFIG_MAX_BYTES)
            for name in names
            if (folder / name).is_file()
        }
        if manifest is not None:
            files[MANIFEST_NAME] = manifest
        if CONFIG_NAME not in files:
            raise FileNotFoundError(f"{folder} holds no CCM adapter: {_what_is_there(folder)}")
        for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"{folder} has {CONFIG_NAME} but no {name}; the adapter is incomplete (a save or a download "
                    "cut short): save it again, or download it again (online, without HF_HUB_OFFLINE)."
                )
        files[ADAPTER_WEIGHTS_NAME] = _read_weights(folder / ADAPTER_WEIGHTS_NAME)
    tensors = _read_tensors(folder / ADAPTER_WEIGHTS_NAME, files[ADAPTER_WEIGHTS_NAME])
    _check_manifest(folder, files)
    config = CCMConfig.from_json_bytes(files[CONFIG_NAME], str(folder / CONFIG_NAME))
    peft_config = parse_json_object(
        files[ADAPTER_CONFIG_NAME], str(folder / ADAPTER_CONFIG_NAME), "save or download it again."
    )
    _check_values(folder / ADAPTER_WEIGHTS_NAME, tensors)
    _check_files_agree(folder, config, peft_config, tensors)
    return config, {key.removeprefix(PEFT_PREFIX): value for key, value in tensors.items()}


def _read_weights(path: Path) -> bytes:
    """The bytes of the adapter weights file at `path`, read once its header names a CCM adapter's tensors: a file of
    other weights (a base model's, gigabytes) was read whole before it was refused."""
    try:
        opened = path.open("rb")
    except OSError as error:
        raise_if_short_of(error, path)
        raise
    with opened as file:
        _, declared, _, _ = safetensors_header(
            file, f"{path.parent} has a corrupt adapter file ({path.name})", "save or download the adapter again."
        )
        if COMP_EMBEDDINGS_KEY not in declared:
            raise ValueError(
                f"{path} has no {COMP_EMBEDDINGS_KEY}: not a CCM adapter file (its tensors include "
                f"{sorted(declared)[:3]}). Give the folder that a CCM model's save_pretrained() wrote."
            )
        file.seek(0)
        try:
            return file.read()
        except MemoryError as error:
            raise not_enough_memory("the adapter weights file", path) from error


def _read_tensors(path: Path, content: bytes) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `content` read from `path`, each in memory of its own."""
    try:
        return load(content)
    except SafetensorError as error:
        raise ValueError(f"{path.parent} has a corrupt adapter file ({error}); save or download it again.") from None
    except KeyError as error:  # a dtype that safetensors reads into torch from a file only (packed 4-bit floats)
        names = sorted(name for name, view in deserialize(content) if view["dtype"] == error.args[0])
        raise ValueError(
            f"{path} holds tensors that are not floating point, one value per element ({error.args[0]}): {names}; "
            "save or download the adapter again."
        ) from None


def _check_links(folder: Path) -> None:
    """Raise unless each file of the adapter in `folder` that is a link leads inside the folder, or, for a Hub cache
    snapshot (`.../snapshots/<revision>`) or a folder in one, inside its cached repository, whose `blobs` the
    snapshot links to. A crafted folder's links made a load read any file on the machine (a JSON one named its keys
    in the error)."""
    real = folder.resolve()
    # A subfolder of a snapshot (`subfolder=`) links into the same blobs.
    snapshot = next((path for path in (real, *real.parents) if path.parent.name == "snapshots"), None)
    root = real if snapshot is None else snapshot.parent.parent
    for name in (*VERIFIED_FILES, MANIFEST_NAME):
        path = folder / name
        # A link to no regular file (a device, a broken link) is never read: the checks of each file name it.
        if path.is_symlink() and path.is_file() and not path.resolve().is_relative_to(root):
            raise ValueError(
                f"{path} is a link to {path.resolve()}, outside the adapter's folder, and an adapter is read from its "
                "own files only; copy the file into the folder in place of the link."
            )


def _read_manifest(path: Path) -> bytes | None:
    """The bytes of the manifest at `path`, or None where there is none. Anything else there (a folder, a pipe, a
    device, a broken link, a file too large to be one) raises: skipped, it would let the files load unchecked."""
    if not os.path.lexists(path):
        return None
    if not path.is_file():  # checked before opening: a pipe or /dev/zero would block or never end
        raise ValueError(
            f"{path} is not a regular file (a folder, a pipe, a device or a broken link), so the adapter's files "
            f"cannot be checked against it; save the adapter again, or delete {path}."
        )
    return read_regular_file(path, f"save the adapter again, or delete {path}.", MANIFEST_MAX_BYTES)


def _check_manifest(folder: Path, files: dict[str, bytes]) -> None:
    """Raise unless the `files` read from `folder` are those its manifest records (none: an adapter saved before
    manifests, or put together by hand, is checked by its content alone)."""
    if MANIFEST_NAME not in files:
        return
    path = folder / MANIFEST_NAME
    manifest = parse_json_object(files[MANIFEST_NAME], str(path), "save the adapter again.")
    version = manifest.get("format_version")
    if not is_int(version) or version != MANIFEST_VERSION:  # not `true` nor 1.0, which equal 1
        raise ValueError(
            f"{path} has format_version {version!r}, but this transformers-ccm reads version "
            f"{MANIFEST_VERSION}; upgrade transformers-ccm, or save the adapter again."
        )
    recorded = manifest.get("sha256")
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} records no sha256 digests; save the adapter again.")
    malformed = [name for name in VERIFIED_FILES if not _is_digest(recorded.get(name))]
    if malformed:
        raise ValueError(
            f"{path} records no SHA-256 digest (64 lowercase hexadecimal digits) of {malformed}; save the adapter "
            "again."
        )
    differing = [name for name in VERIFIED_FILES if recorded.get(name) != _digest(files[name])]
    if differing:
        raise ValueError(
            f"The adapter at {folder} mixes files of different saves: {differing} are not the ones {MANIFEST_NAME} "
            "records (a save cut off part way, or files changed after saving). Save the adapter again; if you "
            f"changed them on purpose, delete {MANIFEST_NAME}."
        )


def _check_values(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Raise unless every tensor holds finite floating-point values: weights are copied into the model as they
    are, so an integer tensor would be cast silently and a NaN would turn every `<COMP>` run into NaN."""
    not_float, not_finite = [], []
    for key, value in sorted(tensors.items()):
        if not value.is_floating_point():
            not_float.append(key)
            continue
        try:
            # `isfinite` has no kernel for most 8-bit floats; float32 holds each of their values exactly.
            finite = bool(torch.isfinite(value.float() if value.element_size() == 1 else value).all())
        except NotImplementedError:  # packed fp4 (two values per element), where safetensors reads it into torch
            not_float.append(key)
            continue
        if not finite:
            not_finite.append(key)
    problems = [
        f"{label} {names[:2]}{' ...' if len(names) > 2 else ''}"
        for label, names in (
            ("tensors that are not floating point, one value per element", not_float),
            ("tensors with values that are not finite", not_finite),
        )
        if names
    ]
    if problems:
        raise ValueError(f"{path} holds {'; '.join(problems)}; save or download the adapter again.")


# What PEFT reads from adapter_config.json to build and compute the LoRA, with the value a CCM adapter holds (r
# and lora_alpha come from ccm_config.json): a file that says otherwise (a LoRA variant, trained biases, layers
# added or replicated) would load differently with PEFT. Unset ones are None in PEFT's files, or left out.
_PEFT_FIXED = {
    "peft_type": "LORA",
    "use_dora": False,
    "use_rslora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
    "lora_bias": False,
    "use_qalora": False,
    **dict.fromkeys(
        (
            "modules_to_save",
            "trainable_token_indices",
            "layer_replication",
            "target_parameters",
            "alora_invocation_tokens",
            "arrow_config",
            "kasa_config",
            "monteclora_config",
            "use_bdlora",
            "velora_config",
        )
    ),
}
# The fields with which adapter_config.json selects the modules PEFT puts its LoRA on.
_PEFT_TARGETING = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
# The regular expressions those fields may hold, since PEFT runs them: module names (with `|` and `.`, no repetition)
# and the target_modules CCM writes (`lora.default_target_modules`). Any other is refused unrun: Python's `re` cannot
# be stopped, and a crafted pattern ("(.*.*)*Z") kept a load matching for hours.
_NAMES = r"[\w.]+(?:\|[\w.]+)*"
_RUNNABLE_PATTERNS = {
    "target_modules": re.compile(rf"\(\.\*\\\.\)\?\(\w+(?:\|\w+)*\)\\\.\(\w+(?:\|\w+)*\)|{_NAMES}"),
    "exclude_modules": re.compile(_NAMES),
    "layers_pattern": re.compile(r"\w+"),
}


def _check_files_agree(
    folder: Path, config: CCMConfig, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """Raise, naming the files and values, unless adapter_config.json and the weights' sizes say what
    ccm_config.json says. Runs before any model is built, so a crafted config cannot make it allocate."""
    wanted = {**_PEFT_FIXED, "r": config.r, "lora_alpha": config.lora_alpha}
    problems = [
        f"{ADAPTER_CONFIG_NAME} has {key}={peft_config.get(key, '(missing)')!r} where {value!r} is expected"
        for key, value in wanted.items()
        if _unset_as_none(peft_config.get(key, _PEFT_FIXED.get(key)), value) != value
    ]
    # PEFT loads only its own key names (and read_adapter drops the prefix: with and without it, one would win).
    unprefixed = sorted(key for key in tensors if key != COMP_EMBEDDINGS_KEY and not key.startswith(PEFT_PREFIX))
    if unprefixed:
        problems.append(
            f"{ADAPTER_WEIGHTS_NAME} has tensors without PEFT's key prefix '{PEFT_PREFIX}': {unprefixed[:2]}"
        )
    comp = tensors[COMP_EMBEDDINGS_KEY]
    hidden = (config.base_model_shape or {}).get("hidden_size", comp.shape[-1] if comp.ndim else None)
    if tuple(comp.shape) != (config.num_comp_tokens, hidden):
        problems.append(
            f"{COMP_EMBEDDINGS_KEY} has shape {tuple(comp.shape)} where num_comp_tokens={config.num_comp_tokens} "
            f"and hidden_size={hidden} give ({config.num_comp_tokens}, {hidden})"
        )
    lora = {key: value for key, value in tensors.items() if "lora_A" in key or "lora_B" in key}
    if not lora:  # else nothing tells the rank of ccm_config.json, and the model is built with it before any check
        problems.append(f"{ADAPTER_WEIGHTS_NAME} holds no LoRA weights (lora_A, lora_B), only {sorted(tensors)[:3]}")
    modules = {key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for key in lora}
    problems += _unselected(peft_config, modules, ADAPTER_CONFIG_NAME)
    if config.target_modules is not None:  # None: the model's attention projections, known once it is built
        # The model is built with these targets: ones that miss the weights failed in PEFT, naming no file.
        problems += _unselected({"target_modules": config.target_modules}, modules, CONFIG_NAME)
    rank_axis = {key: 0 if "lora_A" in key else 1 for key in lora}  # lora_A (r, in), lora_B (out, r)
    wrong_rank = {
        key: tuple(value.shape)
        for key, value in lora.items()
        if value.ndim != 2 or value.shape[rank_axis[key]] != config.r
    }
    if wrong_rank:
        problems.append(f"LoRA weights not of rank r={config.r}: {dict(list(wrong_rank.items())[:2])}")
    if problems:
        raise ValueError(
            f"The files of the adapter at {folder} disagree with its {CONFIG_NAME}: {'; '.join(problems)}. "
            "They do not belong together; save or download the adapter again."
        )


def _unset_as_none(found: Any, expected: Any) -> Any:
    """`found` read as PEFT reads it where `expected` is None (unset): an empty list selects nothing, as None does;
    PEFT writes `target_parameters=[]` for the MoE models whose config it converts (Mixtral, Qwen3-MoE)."""
    return None if expected is None and found == [] else found


def _unselected(peft_config: dict[str, Any], modules: set[str], source: str) -> list[str]:
    """What keeps the targeting fields of `peft_config` (read from the file `source`) from selecting each of `modules`
    (those the weights hold a LoRA for), as PEFT selects them: PEFT would leave out the LoRA of a module it does not
    select."""
    selection = {key: peft_config.get(key) for key in _PEFT_TARGETING}
    if selection["target_modules"] is None:
        return [f"{source} has no target_modules (PEFT would pick its own for the model type)"]
    unrunnable = [key for key, pattern in _RUNNABLE_PATTERNS.items() if not _runnable(selection[key], key, pattern)]
    if unrunnable:
        return [
            f"{source} has {key}={selection[key]!r:.80}, a regular expression CCM never writes, which is not run (a "
            "crafted one can match for hours); give module names as a list"
            for key in unrunnable
        ]
    try:
        selects = LoraConfig(**selection)
        left_out = sorted(name for name in modules if not check_target_module_exists(selects, name))
    except (TypeError, ValueError, re.error) as error:
        return [f"{source} selects modules in a way PEFT refuses ({error})"]
    if not left_out:
        return []
    chosen = ", ".join(f"{key}={value!r}" for key, value in selection.items() if value is not None)
    return [f"{source} ({chosen}) leaves out modules with LoRA weights {left_out[:2]}"]


def _runnable(value: Any, key: str, pattern: re.Pattern[str]) -> bool:
    """Whether PEFT may run what the targeting field `key` holds as `value`: a string is run as a regular expression
    (for layers_pattern, each string of a list too), so it must have `pattern`'s form; module names in a list are
    matched as suffixes, never run."""
    if isinstance(value, str):
        return pattern.fullmatch(value) is not None
    run = value if key == "layers_pattern" and isinstance(value, list) else []
    return all(pattern.fullmatch(text) for text in run if isinstance(text, str))


def _what_is_there(folder: Path) -> str:
    if (folder / CONFIG_NAME).exists():
        return f"its {CONFIG_NAME} is not a file; save or download the adapter again."
    if (folder / ADAPTER_CONFIG_NAME).is_file():
        try:
            content = read_regular_file(folder / ADAPTER_CONFIG_NAME, "", CONFIG_MAX_BYTES)
            peft = parse_json_object(content, ADAPTER_CONFIG_NAME, "")
        except ValueError:  # described as well as it can be: the message is about the missing ccm_config.json
            peft = {}
        kind = " ".join(str(part) for part in ("PEFT", peft.get("peft_type")) if part)
        return (
            f"it is a plain {kind} adapter for {peft.get('base_model_name_or_path')!r} without {CONFIG_NAME}; load it "
            "with peft.PeftModel.from_pretrained."
        )
    if (folder / "config.json").is_file():
        return "it is a full transformers model (config.json); wrap it with CCMForCausalLM.from_base."
    files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    return f"no {CONFIG_NAME} among {files}."


def check_cap_holds_resize(config: CCMConfig, count: int, adapter: str, asked: str, fix: str) -> None:
    """Raise unless the concat cap of a saved adapter's `config` (the adapter named `adapter`) holds one context of
    `count` `<COMP>` tokens (`asked` names that count to the user), as resizing the adapter to them needs: CCMConfig's
    own refusal named neither the adapter nor the resize. `fix` says how to resize it, with `{cap}` for the cap."""
    cap = config.max_memory_tokens
    if cap is not None and cap < count:
        raise ValueError(
            f"{adapter} caps concat memory at {cap} slots, fewer than one context of {asked}; {fix.format(cap=cap)}."
        )


def check_base_shape(config: CCMConfig, base_name: str, base_shape: dict[str, Any]) -> None:
    """Raise, naming both models, if `base_shape` is not the shape the adapter was made for."""
    expected = config.base_model_shape or {}
    differences = {key: (value, base_shape.get(key)) for key, value in expected.items() if base_shape.get(key) != value}
    if differences:
        details = ", ".join(
            f"{key}: adapter {want!r} vs base {got!r}" for key, (want, got) in sorted(differences.items())
        )
        # A model wrapped from a config, or an adapter saved from one, has no name: "None" and '' named nothing.
        made_for = config.base_model_name_or_path
        made_for = repr(made_for) if made_for else "a base model whose name it does not record"
        given = repr(base_name) if base_name else "(a model without a name_or_path)"
        raise ValueError(
            f"This adapter was made for {made_for}, which does not match the base model {given} ({details}). Pass "
            "the matching base model."
        )


def push_adapter(
    repo_id: str,
    config: CCMConfig,
    lora_config: LoraConfig,
    tensors: dict[str, torch.Tensor],
    private: bool | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_description: str | None = None,
    tags: str | list[str] | None = None,
    max_shard_size: int | str | None = None,
) -> Any:
    """Create `repo_id` if needed and upload an adapter's files (see `save_adapter`) in one commit, to the branch
    `revision` (created from the default branch if needed; None: the default branch) or, with `create_pr`, as a
    pull request against it. Returns the commit info. A name without a namespace goes where the Hub creates it (the
    token's user). `tags` (one or a list) go onto the model card; `max_shard_size` is checked as transformers reads it,
    and changes nothing: an adapter is one file, as PEFT writes it."""
    # Every argument is checked before the first request: a refusal after it left a repo or branch made for nothing.
    _check_repo_id(repo_id)
    check_flags(create_pr=create_pr)
    if private is not None:
        check_flags(private=private)
    if commit_description is not None and not isinstance(commit_description, str):
        raise TypeError(f"commit_description must be a string, got a {type(commit_description).__name__}.")
    card_tags = _tags(tags)
    _check_shard_size(max_shard_size)
    # Not a TemporaryDirectory: its removal lists the folder, which at the process's limit of open files failed, left
    # the folder and the adapter's files in the system's temporary folder, and raised in place of the save's error.
    folder = tempfile.mkdtemp(prefix="ccm-push-")
    try:
        # Staged before the first request too: a disk that could not take the files left a repo made for nothing.
        save_adapter(folder, config, lora_config, tensors, repo_id=repo_id, tags=card_tags)
        api = HfApi(token=token)
        created = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if created != repo_id:  # a name without a namespace, which the Hub put under the token's user: the card says so
            save_adapter(folder, config, lora_config, tensors, repo_id=created, tags=card_tags)
        if revision is not None and not revision.startswith("refs/pr/"):  # a pull request's ref is no branch to create
            api.create_branch(created, branch=revision, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=created,
            folder_path=folder,
            commit_message=commit_message or f"Upload CCM-{config.update} adapter",
            commit_description=commit_description,
            repo_type="model",
            revision=revision,
            create_pr=create_pr,
        )
    finally:
        remove_folder(folder, ADAPTER_FILES)


def _tags(tags: object) -> tuple[str, ...]:
    """`tags` as a tuple: one tag (a string, as transformers takes it), or a list or tuple of them."""
    listed = (tags,) if isinstance(tags, str) else () if tags is None else tags
    if not isinstance(listed, (list, tuple)) or not all(isinstance(tag, str) and tag.strip() for tag in listed):
        raise TypeError(
            f"tags must be a string or a list of strings that are not empty, such as ['chat'], got {tags!r}."
        )
    return tuple(listed)


def _check_shard_size(max_shard_size: object) -> None:
    """Raise unless `max_shard_size` is None or a size transformers reads (a positive int of bytes, or "5GB")."""
    if max_shard_size is None:
        return
    try:
        valid = not isinstance(max_shard_size, bool) and convert_file_size_to_int(max_shard_size) > 0  # type: ignore[arg-type]
    except (ValueError, AttributeError):  # AttributeError: neither an int nor a string
        valid = False
    if not valid:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {max_shard_size!r}."
        )


def _is_repo_id(name: object) -> bool:
    """Whether the Hub could hold a repo named `name`."""
    try:
        _check_repo_id(name)
    except ValueError:
        return False
    return True


def _check_repo_id(repo_id: object) -> None:
    """Raise a ValueError unless the Hub can hold a repo named `repo_id` (checked before any request)."""
    problem = None if isinstance(repo_id, str) else f"a {type(repo_id).__name__}, not a string"
    if problem is None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as error:
            problem = str(error)
    if problem is not None:
        raise ValueError(
            f"{repo_id!r} is not a valid Hub repo id ({problem}); give one such as 'your-name/my-ccm-adapter'."
        )
