"""KV memory against the time step: full context (a `DynamicCache` of every context token), CCM-concat and
CCM-merge (the compressed memory), measured from the cache tensors after each step; the growth per step
fitted, as the paper's Table 3 predicts it; and the same table for LLaMA-7B from its config alone."""

from __future__ import annotations

import statistics
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.workload import (
    FULL_CONTEXT,
    PAPER_CONTEXT_TOKENS,
    Subject,
    Workload,
    cache_bytes,
    llama_7b_config,
    meta_model,
)
from transformers_ccm import CCMConfig, CCMForCausalLM
from transformers_ccm.evaluation import kv_bytes_per_token
from transformers_ccm.modeling import CACHE_ARGUMENT

# The paper's Table 1: MetaICL at t = 16 with LLaMA-7B in fp16; context KV lengths 800 / 128 / 8.
PAPER_STEP = 16
PAPER_COMP_TOKENS = 8
PAPER_KV_LENGTH = {FULL_CONTEXT: 800, "ccm-concat": 128, "ccm-merge": 8}


@torch.no_grad()
def measure(subject: Subject, workload: Workload, steps: int) -> dict[str, list[int]]:
    """Bytes each method holds after time steps 1..steps, each bringing a context of `context_tokens`."""
    vocab = subject.vocab_size
    held: dict[str, list[int]] = {FULL_CONTEXT: []}
    cache = DynamicCache(config=subject.base.config)
    for step in range(1, steps + 1):
        subject.base(input_ids=workload.step(vocab, "context", step), logits_to_keep=1, **{CACHE_ARGUMENT: cache})
        held[FULL_CONTEXT].append(cache_bytes(cache))
    for name, model in subject.ccm.items():
        memory, held[name] = model.new_cache(1), []
        for step in range(1, steps + 1):
            model.compress(memory, workload.step(vocab, "context", step))
            held[name].append(cache_bytes(memory))
    return held


def expected_growth(workload: Workload, num_comp_tokens: dict[str, int]) -> dict[str, int]:
    """Slots added per step (Table 3): a context's tokens, `n_comp` (concat), none (merge)."""
    growth = {FULL_CONTEXT: workload.context_tokens}
    for name, n in num_comp_tokens.items():
        growth[name] = n if name == "ccm-concat" else 0
    return growth


def llama_7b_table(steps: list[int]) -> dict[str, Any]:
    """The paper's Table 1 set-up (fp16, contexts of 50 tokens, `<COMP>` length 8) on LLaMA-7B built on the meta
    device: bytes per slot from the CCM-wrapped model's shapes, slots from the update rules."""
    model = CCMForCausalLM.from_base(
        meta_model(llama_7b_config(), torch.float16), CCMConfig(num_comp_tokens=PAPER_COMP_TOKENS)
    )
    per_slot = kv_bytes_per_token(model)
    slots = {
        FULL_CONTEXT: lambda t: t * PAPER_CONTEXT_TOKENS,
        "ccm-concat": lambda t: t * PAPER_COMP_TOKENS,
        "ccm-merge": lambda t: PAPER_COMP_TOKENS,
    }
    return {
        "bytes_per_slot": per_slot,
        "steps": steps,
        "kv_length": {name: [count(t) for t in steps] for name, count in slots.items()},
        "bytes": {name: [count(t) * per_slot for t in steps] for name, count in slots.items()},
        "paper_kv_length_at_16": PAPER_KV_LENGTH,
        "kv_length_at_16": {name: count(PAPER_STEP) for name, count in slots.items()},
    }


def run(subject: Subject, workload: Workload, steps: int) -> dict[str, Any]:
    """Measured bytes per step and method, fitted growth (bytes and slots per step), ratios to full context."""
    held = measure(subject, workload, steps)
    per_slot = subject.bytes_per_token
    axis = list(range(1, steps + 1))
    slopes = {name: statistics.linear_regression(axis, values).slope for name, values in held.items()}
    at = min(PAPER_STEP, steps)
    return {
        "steps": axis,
        "bytes": held,
        "bytes_per_slot": per_slot,
        "slope_bytes": slopes,
        "slope_slots": {name: slope / per_slot for name, slope in slopes.items()},
        "expected_slots_per_step": expected_growth(
            workload, {name: model.config.num_comp_tokens for name, model in subject.ccm.items()}
        ),
        "ratio_step": at,
        "ratio_to_full": {name: values[at - 1] / held[FULL_CONTEXT][at - 1] for name, values in held.items()},
        "llama_7b": llama_7b_table(list(range(1, 65))),
    }
