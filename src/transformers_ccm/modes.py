"""The training and evaluation modes of a module tree, switched within a context and given back after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Within the context, anything may switch the training mode of `model`'s modules; each gets its own mode back
    when it ends, also on an error."""
    modes = {module: module.training for module in model.modules()}
    try:
        yield
    finally:
        for module, training in modes.items():  # parents first: each one's train() switches its children too
            module.train(training)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Within the context, every module of `model` is in evaluation mode (no dropout); each gets its own mode back
    when it ends. A model already in evaluation mode is left untouched."""
    if not any(module.training for module in model.modules()):
        yield
        return
    with modes_kept(model):
        model.eval()
        yield
