"""Files that are not what their names say: a named pipe that a writer feeds."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


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
