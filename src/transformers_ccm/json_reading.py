"""JSON read from files that may be damaged or crafted: every problem is one `ValueError` naming the file."""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str | bytes, where: str, fix: str) -> Any:
    """`text` decoded as JSON. Bytes that are not UTF-8, bad syntax and nesting deeper than Python's recursion
    limit raise `ValueError("<where> <problem>; <fix>")`."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON ({error}); {fix}") from None
    except RecursionError:  # nesting deeper than the recursion limit: no file of ours
        raise ValueError(f"{where} is nested too deeply to be read as JSON; {fix}") from None


def parse_json_object(text: str | bytes, where: str, fix: str) -> dict[str, Any]:
    """`text` decoded as a JSON object, as `parse_json` does; another JSON value raises a `ValueError` too."""
    value = parse_json(text, where, fix)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(value).__name__}; {fix}")
    return value
