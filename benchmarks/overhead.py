"""Compression overhead: the time of folding a generated turn into memory (only the `<COMP>` block and the last
generated token run) against re-encoding the turn as a new context; and the FLOPs by the paper's Table 16.

Table 16 (LLaMA-7B, contexts of 50 tokens) is reproduced exactly by: compressing costs the `<COMP>` tokens'
forward, `2 n P` FLOPs (`P`: parameters outside the embeddings and the LM head); every later token saves the
attention over the `l_c - n` keys no longer held, `4 L H d_h (l_c - n)` FLOPs (QK and AV, `L` layers, `H`
heads of size `d_h`); the threshold is their quotient, the inference tokens after which compression pays.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from benchmarks.timing import time_cases
from benchmarks.workload import PAPER_CONTEXT_TOKENS, Subject, Workload, llama_7b_config, meta_model

# The paper's Table 16: thresholds (inference tokens) for <COMP> lengths 1, 2, 4 and 8.
PAPER_THRESHOLDS = {1: 504, 2: 1029, 4: 2148, 8: 4706}


def decoder_parameters(model: PreTrainedModel) -> int:
    """Parameters outside the input embeddings and the LM head (a tied head counts once)."""
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def compression_flops(model: PreTrainedModel, num_comp_tokens: int, context_tokens: int) -> dict[str, Any]:
    """Table 16 for one `<COMP>` length: compression factor, FLOPs of one compression, attention FLOPs each
    later token saves, and the threshold (see the module docstring)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    overhead = 2 * num_comp_tokens * decoder_parameters(model)
    saved = 4 * config.num_hidden_layers * heads * head_dim * (context_tokens - num_comp_tokens)
    return {
        "num_comp_tokens": num_comp_tokens,
        "compression_factor": context_tokens / num_comp_tokens,
        "overhead_flops": overhead,
        "saved_flops_per_token": saved,
        "threshold_tokens": round(overhead / saved),
    }


@torch.no_grad()
def fold_cases(subject: Subject, workload: Workload, step: int) -> dict[str, dict[str, Any]]:
    """Per CCM model at time step `step` of a dialogue: callables that fold the turn `generate()` left in the
    cache, or re-encode that turn from the memory before it; and the tokens each runs."""
    vocab, prompt = subject.vocab_size, workload.prompt(subject.vocab_size)
    cases = {}
    for name, model in subject.ccm.items():
        before = model.new_cache(1)
        for done in range(1, step):
            model.compress(before, workload.step(vocab, "dialogue", done))
        after = before.copy()
        sequence = model.generate(prompt, past_key_values=after, **workload.generation(subject.base))
        n = model.config.num_comp_tokens
        cases[name] = {
            "fold": lambda model=model, after=after: model.compress(after.copy()),
            "re-encode": lambda model=model, before=before, sequence=sequence: model.compress(before.copy(), sequence),
            "fold_tokens": n + 1,
            "re-encode_tokens": sequence.shape[1] + n,
        }
    return cases


def run(subject: Subject, workload: Workload, step: int, rounds: int, min_run_time: float) -> dict[str, Any]:
    """Fold and re-encode times per CCM model, and the Table 16 FLOPs for this model and for LLaMA-7B."""
    rows = []
    for name, case in fold_cases(subject, workload, step).items():
        timings = time_cases({"fold": case["fold"], "re-encode": case["re-encode"]}, rounds, min_run_time)
        rows.append(
            {
                "method": name,
                "step": step,
                "fold_seconds": timings["fold"].median,
                "re_encode_seconds": timings["re-encode"].median,
                "re_encode_over_fold": timings["re-encode"].ratio_to(timings["fold"]),
                "fold_tokens": case["fold_tokens"],
                "re_encode_tokens": case["re-encode_tokens"],
            }
        )
    llama = meta_model(llama_7b_config(), torch.float16)
    return {
        "rows": rows,
        "context_tokens": workload.context_tokens,
        "flops": [
            {"method": name, **compression_flops(subject.base, model.config.num_comp_tokens, workload.context_tokens)}
            for name, model in subject.ccm.items()
        ],
        "llama_7b_flops": [compression_flops(llama, n, PAPER_CONTEXT_TOKENS) for n in PAPER_THRESHOLDS],
        "paper_thresholds": PAPER_THRESHOLDS,
    }
