"""Packages only the applications need (the `apps` extra): plots, word lists, the embedded GGUF model.

The core (models, caches, adapters) never imports them; tasks, evaluation plots and the default model do,
through these helpers, which say how to install what is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

APPS_EXTRA = "pip install 'transformers-ccm[apps]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import `module`, or raise an ImportError that names the extra to install for `purpose`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{purpose} needs the package '{module.split('.')[0]}': {APPS_EXTRA}") from None


def figure(**settings: Any) -> Any:
    """A matplotlib `Figure` of `settings` (`figsize`, ...), drawn and saved without pyplot: pyplot's `use("Agg")`
    switched the backend of the whole process, and a notebook's or an interactive window's `plt.show()` then showed
    nothing."""
    return require("matplotlib.figure", "Plotting").Figure(**settings)
