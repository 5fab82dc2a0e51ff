"""Quick tour: wrap a model, build a batch of online samples, train a few steps, watch the loss fall.

Runs on CPU in about ten seconds. The task needs the contexts: each context is a (key, label) pair and the
answer is the label of the last context, so only a model that reads its compressed memory can learn it.

    python examples/quick_tour.py
"""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.config import UpdateRule

QUERY, KEYS, LABELS = 5, range(10, 30), range(40, 56)


def recall_sample(rng: random.Random) -> OnlineSample:
    contexts = [[rng.choice(KEYS), rng.choice(LABELS)] for _ in range(rng.randint(1, 4))]
    return OnlineSample(contexts=contexts, input=[QUERY], output=[contexts[-1][1]])


def build_base() -> PreTrainedModel:
    """A tiny random Llama (the same weights on every call). Any decoder-only AutoModelForCausalLM works the
    same way (an instance, a local path or a Hub id); a tiny one keeps the tour fast."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
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


def build_model(update: UpdateRule = "concat") -> CCMForCausalLM:
    """The tiny base wrapped for CCM."""
    return CCMForCausalLM.from_base(build_base(), CCMConfig(num_comp_tokens=2, update=update, lora_dropout=0.0))


def train(model: CCMForCausalLM, steps: int = 200, log_every: int = 25) -> None:
    collate = CCMDataCollator(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rng = random.Random(1)
    for step in range(1, steps + 1):
        loss = model(**collate([recall_sample(rng) for _ in range(32)])).loss  # one parallel forward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if log_every and (step == 1 or step % log_every == 0):
            print(f"step {step:3d}  loss {loss.item():.3f}")
    model.eval()


def main() -> None:
    model = build_model()
    model.print_trainable_parameters()

    collate = CCMDataCollator(model)
    example = collate([recall_sample(random.Random(0))])
    print("one training sequence [c(1) <COMP> ... c(t) <COMP> I(t) O(t)]:")
    for key in ("input_ids", "comp_mask", "segment_ids", "position_ids", "labels"):
        print(f"  {key:>12}: {example[key][0].int().tolist()}")

    train(model)

    held_out = [recall_sample(random.Random(10_000 + i)) for i in range(128)]
    without = [OnlineSample([], s.input, s.output) for s in held_out]
    with torch.no_grad():
        with_memory, no_context = (model(**collate(batch)).loss.item() for batch in (held_out, without))
    print(f"held-out loss with compressed contexts {with_memory:.3f}, without contexts {no_context:.3f}")


if __name__ == "__main__":
    main()
