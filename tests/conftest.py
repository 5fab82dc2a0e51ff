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

_CONVERTED = pytest.StashKey[tuple[str | None, str]]()


def pytest_configure(config: pytest.Config) -> None:
    """The embedded model is converted from its GGUF file once per session, into a folder of the session's (the
    commands the tests run inherit it), whatever the environment says: not into the user's cache, and never skipped
    (an empty setting would make every load read the GGUF file, and the tests of the copy fail)."""
    config.stash[_CONVERTED] = (os.environ.get(CACHE_ENV), tempfile.mkdtemp(prefix="ccm-test-converted-"))
    os.environ[CACHE_ENV] = config.stash[_CONVERTED][1]


def pytest_unconfigure(config: pytest.Config) -> None:
    earlier, folder = config.stash[_CONVERTED]
    shutil.rmtree(folder, ignore_errors=True)
    if earlier is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = earlier


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
