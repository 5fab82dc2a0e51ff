"""Per-token decoding cost: one decoding step of a `CompressedMemoryCache` against a plain `DynamicCache`
holding the same number of key/value positions, on the same model (its adapter is never active while
decoding ordinary tokens). What remains is the CCM step's own Python and mask work.

    python -m benchmarks.decode_step --model default --kv-lengths 128 512 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.timing import time_cases
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache
from transformers_ccm.embedded import DEFAULT_MODEL, load_base_model
from transformers_ccm.modeling import CACHE_ARGUMENT


def filled_caches(model: CCMForCausalLM, kv_length: int, seed: int = 0) -> tuple[DynamicCache, CompressedMemoryCache]:
    """A `DynamicCache` after `kv_length` tokens, and a CCM cache whose memory holds those same keys/values."""
    generator = torch.Generator().manual_seed(seed)
    vocabulary = model.base_model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocabulary, (1, kv_length), generator=generator).to(model.device)
    dynamic = DynamicCache(config=model.base_model.config)
    with torch.no_grad():
        model.base_model(input_ids=ids, use_cache=True, **{CACHE_ARGUMENT: dynamic})
    memory = model.new_cache()
    for layer, source in zip(memory.layers, dynamic.layers, strict=True):
        layer.set_memory(source.keys, source.values)
    memory.rows = replace(
        memory.rows,
        memory_mask=torch.ones(1, kv_length, dtype=torch.bool),
        next_position=torch.tensor([kv_length]),
    )
    return dynamic, memory


def step_cases(model: CCMForCausalLM, kv_length: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One decoding step from the same state each call (caches are copied, which shares their tensors)."""
    dynamic, memory = filled_caches(model, kv_length)
    token = torch.tensor([[7]], device=model.device)

    def dynamic_step() -> torch.Tensor:
        return model.base_model(input_ids=token, **{CACHE_ARGUMENT: _copy(dynamic)}).logits

    def ccm_step() -> torch.Tensor:
        twin = memory.copy()
        # Held as generate() holds it around its steps: the base model refuses a cache no model call holds.
        with twin.forwarding():
            return model.base_model(input_ids=token, **{CACHE_ARGUMENT: twin}).logits

    return {"dynamic_cache": dynamic_step, "ccm": ccm_step}


def _copy(cache: DynamicCache) -> DynamicCache:
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin


@torch.no_grad()
def run(model: CCMForCausalLM, kv_lengths: Sequence[int], rounds: int, min_run_time: float) -> dict[str, Any]:
    """Seconds per decoding step of each cache, and the CCM / DynamicCache ratio, per KV length."""
    results = []
    for kv_length in kv_lengths:
        timings = time_cases(step_cases(model, kv_length), rounds, min_run_time)
        results.append(
            {
                "kv_length": kv_length,
                "dynamic_cache_s": timings["dynamic_cache"].median,
                "ccm_s": timings["ccm"].median,
                "ratio": timings["ccm"].ratio_to(timings["dynamic_cache"]),
            }
        )
    return {"device": str(model.device), "steps": results}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model name or path, or a config.json (random)")
    parser.add_argument("--kv-lengths", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.model.endswith(".json"):
        from transformers import AutoConfig, AutoModelForCausalLM

        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    else:
        base = load_base_model(args.model)
    model = CCMForCausalLM.from_base(base.to(args.device).eval(), CCMConfig()).eval()
    report = run(model, args.kv_lengths, args.rounds, args.min_run_time)
    report["machine"] = platform.processor() or platform.machine()
    report["torch_threads"] = torch.get_num_threads()
    for row in report["steps"]:
        print(
            f"KV {row['kv_length']:6d}  DynamicCache {row['dynamic_cache_s'] * 1e3:7.2f} ms  "
            f"CCM {row['ccm_s'] * 1e3:7.2f} ms  ratio {row['ratio']:.3f}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
