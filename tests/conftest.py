"""Fixtures shared by test modules."""

import os
import shutil
import tempfile

import pytest
from hypothesis import settings

from tiny_models import tiny_llama_for
from transformers_ccm.embedded import CACHE_ENV, load_tokenizer

# No example is failed for its time: on a shared machine a first call (imports, a model's first forward) takes longer
# than hypothesis' default 200 ms deadline, a timed assertion that failed correct code at random.
settings.register_profile("untimed", deadline=None)
settings.load_profile("untimed")

_CONVERTED = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The embedded model is converted from its GGUF file once per session, into a folder of the session's (the
    commands the tests run inherit it), not into the user's cache; a folder set in the environment is used as is."""
    if CACHE_ENV not in os.environ:
        config.stash[_CONVERTED] = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="ccm-test-converted-")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CONVERTED, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[CACHE_ENV]


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, one per test module."""
    return load_tokenizer("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A folder holding a tiny random Llama with the embedded model's tokenizer, as `--model` takes it."""
    folder = tmp_path_factory.mktemp("tiny-smollm")
    tokenizer = load_tokenizer("default")
    tiny_llama_for(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
