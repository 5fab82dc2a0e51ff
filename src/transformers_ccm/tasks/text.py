"""Long general text for streaming, from what ships with every Python.

- "reference": the Python language reference (`pydoc_data.topics`, the text behind `help("if")`), real English
  prose with code, about 110k SmolLM2 tokens.
- "docstrings": the docstrings of the standard library's modules, classes and functions (about 340k tokens on
  Python 3.11): many authors and subjects, from e-mail headers to calendars to turtle graphics.

Texts are split by identity (a hash of the topic or module name, as the word lists are); a text that several
names share is held out if any of them is, so the held-out stream is text training never saw.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from pydoc_data.topics import topics

from transformers_ccm.data import OnlineSample, Tokenizer
from transformers_ccm.tasks.vocabulary import SPLITS, Split, in_test_split
from transformers_ccm.validation import check_sample_count, positive_int

# Each streaming task names the sources its text is cut from.
TEXT_TASKS: dict[str, tuple[str, ...]] = {"text": ("reference",), "text-varied": ("reference", "docstrings")}
# Test code and bundled third-party packages are not the standard library's own prose.
_SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_MIN_DOCSTRING = 200  # characters; shorter docstrings are mostly one-line summaries


def _reference(split: Split) -> list[str]:
    held_out = {topics[name].strip() for name in topics if in_test_split(name)}
    texts = dict.fromkeys(topics[name].strip() for name in sorted(topics))
    return [text for text in texts if (text in held_out) == (split == "test")]


def _documented(
    node: ast.Module | ast.ClassDef | ast.FunctionDef,
) -> Iterator[ast.Module | ast.ClassDef | ast.FunctionDef]:
    """`node` and the classes and functions defined directly in its body, recursively."""
    yield node
    for child in node.body:
        if isinstance(child, ast.ClassDef | ast.FunctionDef):
            yield from _documented(child)


@functools.cache
def _stdlib_docstrings() -> dict[str, str]:
    """Module name -> its docstrings of at least `_MIN_DOCSTRING` characters, in source order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        files += [Path(folder, name) for name in names if name.endswith(".py") and not name.startswith("test_")]
    modules = {}
    for path in sorted(files):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # the standard library keeps a few deliberately broken files
            continue
        docs = [doc for node in _documented(tree) if len(doc := ast.get_docstring(node) or "") >= _MIN_DOCSTRING]
        if docs:
            modules[".".join(parts)] = "\n\n".join(docs)
    return modules


def _docstrings(split: Split) -> list[str]:
    return [text for name, text in _stdlib_docstrings().items() if in_test_split(name) == (split == "test")]


_SOURCES = {"reference": _reference, "docstrings": _docstrings}


def long_text(split: Split, sources: Sequence[str] = ("reference",)) -> str:
    """The texts of `split` from each of `sources` ("reference", "docstrings"), one after another."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    unknown = [source for source in sources if source not in _SOURCES]
    if unknown or not sources:
        raise ValueError(f"Text sources must be some of {list(_SOURCES)}, got {list(sources)}.")
    return "\n\n".join(text for source in sources for text in _SOURCES[source](split))


def text_streams(
    tokenizer: Tokenizer,
    split: Split,
    count: int,
    length: int,
    seed: int = 0,
    sources: Sequence[str] = ("reference",),
) -> list[list[int]]:
    """`count` stretches of `length` consecutive tokens of `long_text(split, sources)`, at random offsets: samples
    for training on the stream itself (`transformers_ccm.stream_training`)."""
    _check_sizes(count, length=length)
    ids = tokenizer(long_text(split, sources), add_special_tokens=False)["input_ids"]
    if length > len(ids):
        raise ValueError(f"The {split} text has {len(ids)} tokens, fewer than a stream of {length}.")
    rng = random.Random(f"text-stream:{split}:{seed}")
    return [ids[start : start + length] for start in (rng.randrange(len(ids) - length + 1) for _ in range(count))]


def _check_sizes(count: int, **sizes: int) -> None:
    """Refuse a `count` that is no integer >= 0 and `sizes` that are no positive integers, before any text is read:
    a float failed inside `range()` with a bare TypeError, and a size of 0 or less cut empty or reversed stretches."""
    check_sample_count(count)
    for name, size in sizes.items():
        if not positive_int(size):
            raise ValueError(f"{name} must be a positive integer (tokens or chunks), got {size!r}.")


def stream_samples(
    tokenizer: Tokenizer,
    split: Split,
    count: int,
    seed: int = 0,
    chunk: int = 64,
    max_chunks: int = 4,
    max_window: int = 84,
    output: int = 64,
    sources: Sequence[str] = ("reference",),
) -> list[OnlineSample]:
    """Samples laid out as a stream sees them: `1..max_chunks` compressed chunks of `chunk` tokens, then up to
    `max_window` tokens kept as they are (the input), then `output` tokens to predict, cut from
    `long_text(split, sources)`."""
    _check_sizes(count, chunk=chunk, max_chunks=max_chunks, max_window=max_window, output=output)
    ids = tokenizer(long_text(split, sources), add_special_tokens=False)["input_ids"]
    rng = random.Random(f"text:{split}:{seed}")
    samples = []
    for _ in range(count):
        chunks, window = rng.randint(1, max_chunks), rng.randint(1, max_window)
        length = chunks * chunk + window + output
        if length > len(ids):
            raise ValueError(f"The {split} text has {len(ids)} tokens, fewer than a sample needs ({length}).")
        start = rng.randrange(len(ids) - length + 1)
        contexts = [ids[start + j * chunk : start + (j + 1) * chunk] for j in range(chunks)]
        middle = start + chunks * chunk
        samples.append(
            OnlineSample(contexts, ids[middle : middle + window], ids[middle + window : middle + window + output])
        )
    return samples
