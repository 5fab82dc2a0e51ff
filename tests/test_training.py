"""A few hundred optimisation steps on a tiny model learn to answer from compressed contexts."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample

QUERY, KEYS, LABELS = 5, range(10, 30), range(40, 56)


def recall_sample(rng: random.Random) -> OnlineSample:
    """Contexts are (key, label) pairs; the answer is the label of the last context, unknowable without it."""
    contexts = [[rng.choice(KEYS), rng.choice(LABELS)] for _ in range(rng.randint(1, 3))]
    return OnlineSample(contexts, [QUERY], [contexts[-1][1]])


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_training_learns_to_use_memory(update):
    torch.manual_seed(0)
    # initializer_range 0.2 gives the frozen random base logits wide enough to express a confident answer.
    base = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.2,
            tie_word_embeddings=True,
        )
    )
    model = CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=2, update=update, lora_dropout=0.0))
    collate = CCMDataCollator(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rng = random.Random(0)
    for _ in range(200):
        model(**collate([recall_sample(rng) for _ in range(32)])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model.eval()
    held_out = [recall_sample(random.Random(10_000 + i)) for i in range(64)]
    no_context = [OnlineSample([], s.input, s.output) for s in held_out]
    wrong_context = [OnlineSample(held_out[i - 1].contexts, s.input, s.output) for i, s in enumerate(held_out)]
    with torch.no_grad():
        loss, loss_without, loss_wrong = (
            model(**collate(batch)).loss.item() for batch in (held_out, no_context, wrong_context)
        )
    assert loss < 0.3 * loss_without, (loss, loss_without)
    assert loss < 0.3 * loss_wrong, (loss, loss_wrong)
