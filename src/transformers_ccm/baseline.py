"""The fine-tuned full-context baseline (the paper's upper bound): the same LoRA, acting at every position,
trained on the same samples and steps as a CCM adapter but reading the whole history as a plain prompt.

It is a `CCMForCausalLM` with `conditional_lora=False`, trained on `CCMDataCollator(..., layout="full_context")`
batches (`TrainingRecipe(layout="full_context")`, `ccm train --method full-context`). Its `ccm_config.json`
says what it is in `trained_on`, so it saves and loads like any adapter.
"""

from __future__ import annotations

from dataclasses import replace

from transformers_ccm.config import CCMConfig
from transformers_ccm.data import OnlineSample, Tokenizer, sample_entries, token_ids

FULL_CONTEXT_BASELINE = "fine-tuned full-context baseline"


def full_context_config(config: CCMConfig) -> CCMConfig:
    """`config` for the baseline: the same LoRA (rank, alpha, targets) at every position, marked in `trained_on`."""
    trained_on = FULL_CONTEXT_BASELINE + (f" on {config.trained_on}" if config.trained_on else "")
    return replace(config, conditional_lora=False, trained_on=trained_on)


def is_full_context_baseline(config: CCMConfig) -> bool:
    """Whether `config` is that of a fine-tuned full-context baseline (made by `full_context_config`)."""
    return not config.conditional_lora and (config.trained_on or "").startswith(FULL_CONTEXT_BASELINE)


def as_plain_prompt(sample: OnlineSample, tokenizer: Tokenizer | None = None) -> OnlineSample:
    """`sample` with no contexts and the history `c(1) ... c(t) I(t)` (token ids, each part tokenized on its own
    as the collator does) as its input: what the baseline reads. Scoring these with the online path, e.g.
    `score_samples(baseline, tokenizer, plain, "ccm", metric)`, scores the baseline (no memory is compressed)."""
    fix = "pass as_plain_prompt a tokenizer, or token ids"  # not the collator's: this call reads the strings
    history = [
        token
        for j, context in enumerate(sample_entries(sample.contexts, "the sample's contexts"))
        for token in token_ids(context, tokenizer, f"c({j + 1})", without_tokenizer=fix)
    ]
    return replace(
        sample, contexts=[], input=history + token_ids(sample.input, tokenizer, "the input", without_tokenizer=fix)
    )
