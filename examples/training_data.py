"""Training data: built-in task families in many wordings, weighted into one mixture, and a short training run.

A weighted mixture gives cheap or important families more turns ("icl:3,dialogue:1": three ICL samples, then
one dialogue, and again). ICL's `icl/varied` wording composes a new frame for every sample, so an adapter
learns to read demonstrations, not one template. The run below uses a tiny random model with the embedded
model's tokenizer so that it finishes in seconds; `ccm train --model default --task "icl:3,dialogue:1"` is
the same on the real model.

    python examples/training_data.py
"""

from __future__ import annotations

import tempfile
from collections import Counter

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_ccm import CCMConfig, CCMForCausalLM
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.tasks import make_samples, make_task_samples
from transformers_ccm.training import TrainingRecipe, train

MIXTURE = "icl:3,personalization:1,dialogue:1"


def main() -> None:
    built = make_task_samples(MIXTURE, "train", 40, seed=0)
    print("families:", dict(Counter(sample.task for sample in built)))
    varied = [sample.sample for sample in built if sample.wording == "icl/varied"]
    for sample in varied[:2]:
        print("a varied ICL frame:", repr(sample.contexts[0]), "->", repr(sample.input), repr(sample.output))

    tokenizer = load_tokenizer("default")
    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    model = CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=1, trained_on=f"built-in task '{MIXTURE}'"))
    held_out = make_samples(MIXTURE, "test", 8, seed=0)  # test-split names, entities and labels
    recipe = TrainingRecipe(steps=6, batch_size=4, learning_rate=1e-2, eval_every=3, save_every=1000, log_every=1000)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(model, tokenizer, [sample.sample for sample in built], held_out, output_dir, recipe)
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    print(f"held-out loss at steps 3 and 6: {losses[0]:.3f}, {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
