"""Checks of settings given as plain values (configs, recipes, counts): types first, so that True is not 1."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_index(value: object) -> bool:
    """An integer as `operator.index` takes it (an int, a NumPy integer, a one-value integer tensor, as transformers
    takes a count), not a bool (of Python, NumPy or torch): True is not 1."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def positive_int(value: object) -> bool:
    return is_int(value) and value > 0  # type: ignore[operator]


def check_sample_count(count: object) -> None:
    """Raise a ValueError unless `count`, the number of samples a task maker is asked for, is an integer >= 0 (a float
    failed inside `range()` with a bare TypeError)."""
    if not (is_int(count) and count >= 0):  # type: ignore[operator]
        raise ValueError(f"count must be an integer >= 0 (samples to make), got {count!r}.")


_Item = TypeVar("_Item", bound=Hashable)


def first_repeated(values: Iterable[_Item]) -> _Item | None:
    """The first of `values` that an earlier one equals, None where all differ. In one pass: a search of each value
    among those before it took minutes on a crafted file of a megabyte (200,000 JSON keys or sample choices)."""
    seen: set[_Item] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(value: object) -> bool:
    """A number that converts to a finite float: an integer past float's range (a crafted JSON file's 10**400)
    counts as not finite, where `math.isfinite` would raise an OverflowError."""
    if not number(value):
        return False
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:
        return False


def check_setting(owner: str, value: object, name: str, allowed: str, ok: Callable[[object], bool]) -> None:
    """Raise `ValueError("<owner>.<name> must be <allowed>, got <value>")` unless `ok(value)`."""
    if not ok(value):
        raise ValueError(f"{owner}.{name} must be {allowed}, got {value!r}.")
