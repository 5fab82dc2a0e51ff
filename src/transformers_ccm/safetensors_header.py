"""Reading a safetensors file's header alone: its tensors' names, dtypes, shapes and byte ranges are checked before
any of its data is read. And the failures of writing one, as the OSError they are."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import _TYPES as SAFETENSORS_DTYPES  # its names of torch's dtypes

from transformers_ccm.json_reading import parse_json_object

# safetensors' own bound on a header's length: a longer one is no file it wrote, and reading it would take that memory.
_MOST_HEADER_BYTES = 100_000_000


@contextmanager
def write_errors_as_os_errors() -> Iterator[None]:
    """Within the context, a safetensors write that the file system refuses (a full disk, a file size limit) raises
    the OSError of its errno: safetensors raised its own SafetensorError, which no caller took for a failed write (a
    full disk ended `ccm chat` with a traceback instead of keeping the memory for the next turn)."""
    try:
        yield
    except SafetensorError as error:
        found = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(error))
        if found is None:  # not the file system's refusal (a tensor it cannot write, say)
            raise
        raise OSError(int(found[2]), found[1]) from error


class DeclaredTensor(NamedTuple):
    """A tensor as a safetensors header declares it, known without reading its data."""

    dtype: torch.dtype | str
    shape: torch.Size

    @property
    def ndim(self) -> int:
        return len(self.shape)


def safetensors_header(
    file: BinaryIO, unreadable: str, fix: str
) -> tuple[dict[str, str], dict[str, DeclaredTensor], dict[str, tuple[int, int]], bytes]:
    """The metadata, the declared tensors and the byte range of each tensor's data (from the data's start) of the
    safetensors file open as `file`, read from its header only, and the bytes they were read from (the length and the
    header), with which a later read of the file must begin to be the file checked. The ranges are checked to cover
    the file's data exactly, in order, as safetensors checks them only once the whole file is read. A problem raises a
    ValueError that begins with `unreadable` (what the file is not); `fix` ends one of a header that is no JSON."""
    file_bytes = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    size = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or size > _MOST_HEADER_BYTES:
        raise ValueError(f"{unreadable} (it begins with no safetensors header length: {size} bytes).")
    if 8 + size > file_bytes:
        raise ValueError(f"{unreadable} (its header of {size} bytes passes the end of the file, {file_bytes} bytes).")
    text = file.read(size)
    header = parse_json_object(text, f"{unreadable}: its header", fix)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ValueError(f"{unreadable} (its metadata is not a map of strings).")
    try:
        # A dtype torch cannot hold stays its name: no expected dtype equals it.
        declared = {
            name: DeclaredTensor(SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]), torch.Size(entry["shape"]))
            for name, entry in header.items()
        }
        spans = {name: _byte_range(entry["data_offsets"]) for name, entry in header.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{unreadable} (a tensor's entry in its header is wrong: {error!r}).") from None
    end = 0
    for name, (start, stop) in sorted(spans.items(), key=lambda item: item[1]):
        if start != end:
            raise ValueError(
                f"{unreadable} (the data of '{name}' begins at byte {start}, not where the last ended, {end})."
            )
        end = stop
    if 8 + size + end != file_bytes:
        raise ValueError(
            f"{unreadable} (its header declares {end} bytes of data, the file holds {file_bytes - 8 - size})."
        )
    return metadata, declared, spans, prefix + text


def _byte_range(offsets: Any) -> tuple[int, int]:
    """The `[start, end)` byte range of a header's `data_offsets`, two whole numbers in order."""
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(offset, int) and not isinstance(offset, bool) for offset in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"data_offsets {offsets!r} are not two whole numbers, start <= end")
    return offsets[0], offsets[1]
