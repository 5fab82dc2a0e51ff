"""The fine-tuned full-context baseline: the same LoRA at every position, trained on the plain history."""

import random
from types import SimpleNamespace

import pytest
import torch

from tiny_models import randomize_adapter, tiny_base
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.baseline import as_plain_prompt, full_context_config, is_full_context_baseline
from transformers_ccm.data import IGNORE_INDEX
from transformers_ccm.evaluation import score_samples
from transformers_ccm.training import TrainingRecipe, train

SAMPLES = [
    OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13]),
    OnlineSample([[14], [15, 16, 17], [18, 19]], [20], [21]),
]


def baseline(randomized: bool = True) -> CCMForCausalLM:
    model = CCMForCausalLM.from_base(
        tiny_base("llama"), full_context_config(CCMConfig(lora_dropout=0.0, trained_on="recall"))
    )
    return randomize_adapter(model) if randomized else model.eval()


def test_as_plain_prompt_of_text_without_a_tokenizer_names_its_own_fix():
    """The fix named was the collator's ("give CCMDataCollator a tokenizer"), which this call does not use."""
    for sample in (OnlineSample(["hello"], [5]), OnlineSample([[5]], "hello")):
        with pytest.raises(ValueError, match=r"is a string; pass as_plain_prompt a tokenizer, or token ids\."):
            as_plain_prompt(sample)


def test_the_layout_is_the_plain_history_with_the_ccm_labels():
    config = CCMConfig(num_comp_tokens=2)
    for supervision in ("output", "dense"):
        ccm = CCMDataCollator(config, supervision=supervision)(SAMPLES)
        plain = CCMDataCollator(config, supervision=supervision, layout="full_context", pad_token_id=3)(SAMPLES)
        assert not plain["comp_mask"].any()
        for row, sample in enumerate(SAMPLES):
            history = [token for context in sample.contexts for token in context] + [*sample.input, *sample.output]
            length = len(history)
            assert plain["input_ids"][row, :length].tolist() == history
            assert (plain["input_ids"][row, length:] == 3).all()
            assert plain["position_ids"][row, :length].tolist() == list(range(length))
            assert plain["segment_ids"][row, :length].tolist() == [1] * length
            assert (plain["segment_ids"][row, length:] == 0).all()
            ordinary = ~ccm["comp_mask"][row] & (ccm["segment_ids"][row] > 0)
            assert plain["labels"][row, :length].tolist() == ccm["labels"][row][ordinary].tolist()
    dense = CCMDataCollator(config, supervision="dense", layout="full_context")(SAMPLES[:1])
    #                                      c(1) 5 6 7  c(2) 8  9   I 10 11  O 12  13
    assert dense["labels"][0].tolist() == [IGNORE_INDEX] * 3 + [IGNORE_INDEX, 9] + [IGNORE_INDEX] * 2 + [12, 13]
    with pytest.raises(ValueError, match=r"layout must be one of \('ccm', 'full_context'\)"):
        CCMDataCollator(config, layout="plain")


def test_the_training_loss_is_the_lora_model_reading_the_plain_history():
    model = baseline()
    batch = CCMDataCollator(model, layout="full_context")(SAMPLES[:1])
    sample = SAMPLES[0]
    plain = torch.tensor(
        [[token for context in sample.contexts for token in context] + [*sample.input, *sample.output]]
    )
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model.base_model(input_ids=plain).logits[0, -len(sample.output) - 1 : -1]
        with model.adapter_disabled():
            base_logits = model.base_model(input_ids=plain).logits[0, -len(sample.output) - 1 : -1]
    target = torch.tensor(sample.output)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, target), atol=1e-5)
    assert not torch.allclose(loss, torch.nn.functional.cross_entropy(base_logits, target), atol=1e-3)


@pytest.mark.parametrize("randomized", [False, True])
def test_scoring_the_plain_prompt_online_scores_the_baseline(randomized):
    model = baseline(randomized)
    tokenizer = SimpleNamespace(pad_token_id=0)
    scored = score_samples(model, tokenizer, [as_plain_prompt(s) for s in SAMPLES], "ccm", "perplexity")
    assert scored.context_kv_tokens == 0
    # "full_context" lets an adapter with conditional_lora=False act: it scores the baseline itself.
    itself = score_samples(model, tokenizer, SAMPLES, "full_context", "perplexity")
    assert abs(scored.value - itself.value) < 1e-4, (scored.value, itself.value)
    with model.adapter_disabled():
        base = score_samples(model, tokenizer, SAMPLES, "full_context", "perplexity")
    # A zero LoRA-B is the base model itself; a trained (here random) LoRA changes the score.
    assert (abs(scored.value - base.value) < 1e-4) != randomized, (scored.value, base.value)


def test_train_the_baseline_saves_a_marked_adapter_and_lowers_the_loss(tmp_path):
    model = baseline(randomized=False)
    rng = random.Random(0)
    samples = [
        OnlineSample([[rng.randrange(10, 30), label]], [5], [label]) for label in rng.choices(range(40, 56), k=16)
    ]
    batch = CCMDataCollator(model, layout="full_context")(samples)
    with torch.no_grad():
        before = model(**batch).loss
    recipe = TrainingRecipe(steps=16, batch_size=16, learning_rate=3e-2, save_every=16, layout="full_context")
    train(model, None, samples, None, tmp_path / "out", recipe)
    with torch.no_grad():
        after = model.eval()(**batch).loss
    assert after < 0.9 * before, (before, after)
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "out", base_model=tiny_base("llama"))
    assert (
        is_full_context_baseline(loaded.config)
        and loaded.config.trained_on == "fine-tuned full-context baseline on recall"
    )
    assert not is_full_context_baseline(CCMConfig(conditional_lora=False))  # the unconditional CCM ablation


def test_train_refuses_a_conditional_lora_or_distillation_for_the_baseline(tmp_path):
    conditional = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    with pytest.raises(ValueError, match=r"full_context_config\(config\).*conditional_lora=True"):
        train(conditional, None, SAMPLES, None, tmp_path, TrainingRecipe(steps=1, layout="full_context"))
    with pytest.raises(ValueError, match=r"distill_weight=1\.0"):
        train(
            baseline(),
            None,
            SAMPLES,
            None,
            tmp_path,
            TrainingRecipe(steps=1, layout="full_context", distill_weight=1.0),
        )
