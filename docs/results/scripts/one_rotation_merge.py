"""`ccm` with merge/EMA memory averaged at one rotation, a diagnostic (not a feature):
python docs/results/scripts/one_rotation_merge.py eval ARGS...

Merge averages each step's `<COMP>` keys as rotated at their own positions (DESIGN.md, as the official code does).
Here, before each fold, the running average is moved (`KeyRotation.shift`) to the new `<COMP>` block's positions,
so that every key enters the average at one rotation: the average of un-rotated keys, rotated once. Everything
else is `ccm` as installed."""

import sys

import torch

from transformers_ccm.cache import CompressedMemoryCache
from transformers_ccm.cli import main

fold_as_installed = CompressedMemoryCache.fold


def fold(cache: CompressedMemoryCache, num_comp_tokens: int, rows: torch.Tensor) -> None:
    if cache.config.update != "concat":
        # (batch,) the first position of the <COMP> block being folded (the "skip" positions: see DESIGN.md)
        comp_start = cache.rows.next_position - num_comp_tokens
        previous = getattr(cache, "_comp_start", None)
        if previous is not None and cache.memory_length:
            delta = torch.where(rows.to(comp_start.device), comp_start - previous, 0)
            for index, layer in enumerate(cache.layers):
                keys, values = layer.accumulated
                moved = cache.spec.rotation.shift(index, keys, delta[:, None].expand(-1, keys.shape[2]))
                layer.set_average(moved, values, dtype=layer.memory()[0].dtype)
            comp_start = torch.where(rows.to(comp_start.device), comp_start, previous)
        cache._comp_start = comp_start
    fold_as_installed(cache, num_comp_tokens, rows)


CompressedMemoryCache.fold = fold
main(sys.argv[1:])
