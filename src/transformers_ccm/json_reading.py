"""JSON read from files that may be damaged or crafted: every problem is one `ValueError` naming the file."""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

from transformers_ccm.files import not_enough_memory, raise_if_short_of
from transformers_ccm.validation import first_repeated


def read_regular_file(path: str | os.PathLike[str], fix: str, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (or the one a link leads to). Anything else raises a `ValueError`
    ending in `fix` before a byte is read: a pipe blocked the read until a writer came, and /dev/zero never ended. With
    `max_bytes`, a larger file raises too, having read no more than `max_bytes + 1` bytes."""
    try:
        # Opened without blocking, so that a pipe is seen for what it is and closed; the kind is asked of the file
        # opened, not of its name, which could be replaced in between.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise_if_short_of(error, path)
        raise ValueError(f"{os.fspath(path)} cannot be read ({error.strerror or error}); {fix}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ValueError(f"{os.fspath(path)} is not a regular file (a folder, a pipe or a device); {fix}")
    with os.fdopen(descriptor, "rb") as file:
        try:
            content = file.read() if max_bytes is None else file.read(max_bytes + 1)
        except MemoryError as error:
            raise not_enough_memory("the file", path) from error
        except OSError as error:  # a file of /proc that refuses reads, a disk that fails
            raise_if_short_of(error, path)
            raise ValueError(f"{os.fspath(path)} cannot be read ({error.strerror or error}); {fix}") from None
    if max_bytes is not None and len(content) > max_bytes:
        raise ValueError(f"{os.fspath(path)} is larger than {max_bytes} bytes, more than any such file holds; {fix}")
    return content


def parse_json(text: str | bytes, where: str, fix: str) -> Any:
    """`text` decoded as JSON. Bytes that are not UTF-8, bad syntax, a key given twice in one object, nesting deeper
    than Python's recursion limit and an integer of more digits than Python reads raise
    `ValueError("<where> <problem>; <fix>")`."""
    try:
        return json.loads(text, object_pairs_hook=_object)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON ({error}); {fix}") from None
    except _RepeatedKey as error:
        raise ValueError(
            f"{where} gives the key {error.args[0]!r} twice in one object, and readers differ on which counts; {fix}"
        ) from None
    except RecursionError:  # nesting deeper than the recursion limit: no file of ours
        raise ValueError(f"{where} is nested too deeply to be read as JSON; {fix}") from None
    except ValueError as error:
        # Python's bound on the digits of an integer read from text: its message named neither the file nor a fix, and
        # told to raise the bound, for a number that no file of ours holds.
        if "integer string conversion" not in str(error):
            raise
        raise ValueError(
            f"{where} holds an integer of more than {sys.get_int_max_str_digits()} digits, which no such file does; "
            f"{fix}"
        ) from None


def parse_json_object(text: str | bytes, where: str, fix: str) -> dict[str, Any]:
    """`text` decoded as a JSON object, as `parse_json` does; another JSON value raises a `ValueError` too."""
    value = parse_json(text, where, fix)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(value).__name__}; {fix}")
    return value


class _RepeatedKey(ValueError):
    """A JSON object names a key twice (`args[0]`)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The object of `pairs`, refusing a key given twice: Python keeps the last value, other readers the first (a
    sample's second "output" was trained on without a word)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        raise _RepeatedKey(first_repeated(key for key, _ in pairs))
    return value
