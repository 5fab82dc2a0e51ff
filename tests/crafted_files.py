"""Files that are not what their names say: a named pipe that a writer feeds, a safetensors file declaring a huge
tensor."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch


@contextmanager
def pipe_feeding(path: Path, text: str) -> Iterator[None]:
    """Within the context, `path` is a named pipe whose writer gives `text` to the first reader: code that reads it
    as a file gets `text` (and would block for good without a writer)."""
    os.mkfifo(path)

    def write() -> None:
        with suppress(BrokenPipeError), open(path, "w") as file:  # a reader that closes first takes nothing
            file.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield
    finally:
        # A writer that no reader came for waits in open(); a reader that does not block lets it finish.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(descriptor)


def with_huge_tensor(source: Path, target: Path, name: str, shape: tuple[int, ...]) -> None:
    """Write `target`: the safetensors file `source` with tensor `name` declared `shape` (float32, zeros; last in the
    data, which the file holds as a hole, so it takes no disk)."""
    raw = source.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    parts, offset = {}, 0
    for key, entry in sorted(header.items()):
        if key == "__metadata__" or key == name:
            continue
        start, end = entry["data_offsets"]
        parts[key] = dict(entry, data_offsets=[offset, offset + end - start])
        offset += end - start
    size = 4 * int(torch.Size(shape).numel())
    parts[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
    text = json.dumps({"__metadata__": header.get("__metadata__", {}), **parts}).encode()
    text += b" " * (-len(text) % 8)
    with open(target, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for key, entry in sorted(header.items()):
            if key not in ("__metadata__", name):
                file.write(data[entry["data_offsets"][0] : entry["data_offsets"][1]])
        file.truncate(file.tell() + size)
