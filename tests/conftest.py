"""Fixtures shared by test modules."""

import pytest

from tiny_models import tiny_llama_for
from transformers_ccm.embedded import load_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A folder holding a tiny random Llama with the embedded model's tokenizer, as `--model` takes it."""
    folder = tmp_path_factory.mktemp("tiny-smollm")
    tokenizer = load_tokenizer("default")
    tiny_llama_for(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
