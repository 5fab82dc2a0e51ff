"""Training data: built-in task families in many wordings, weighted into one mixture, and a short training run;
a fine-tuned full-context baseline as the distillation teacher of the memory, and the two adapters compared on
the same held-out samples; then long text trained as a stream, through the streaming cache `ccm stream-eval`
measures.

A weighted mixture gives cheap or important families more turns ("icl:3,dialogue:1": three ICL samples, then
one dialogue, and again). ICL's `icl/varied` wording composes a new frame for every sample, and
`personalization/varied` new post and question frames for every user, so an adapter learns to read
demonstrations and profiles, not one template. The run below uses a tiny random model with the embedded
model's tokenizer so that it finishes in seconds; `ccm train --model default --task "icl:3,dialogue:1"` is
the same on the real model, and so is `ccm train --task text-varied --supervision stream`.

    python examples/training_data.py
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_ccm import CCMConfig, CCMForCausalLM, StreamingConfig
from transformers_ccm.baseline import full_context_config
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.evaluation import difference_text, paired_difference, score_samples
from transformers_ccm.stream_training import tokens_before_compression
from transformers_ccm.tasks import make_samples, make_task_samples
from transformers_ccm.tasks.text import text_streams
from transformers_ccm.training import TrainingRecipe, train

MIXTURE = "icl:3,personalization:1,dialogue:1"


def main() -> None:
    built = make_task_samples(MIXTURE, "train", 40, seed=0)
    print("families:", dict(Counter(sample.task for sample in built)))
    # Drawn from the ICL family alone, so that adding wordings to other families leaves these samples as they are.
    varied = [b.sample for b in make_task_samples("icl", "train", 60, seed=0) if b.wording == "icl/varied"]
    for sample in varied[:2]:
        print("a varied ICL frame:", repr(sample.contexts[0]), "->", repr(sample.input), repr(sample.output))
    # Personalization's `personalization/varied` composes the post and question frames anew for every user.
    built_profiles = make_task_samples("personalization", "train", 60, seed=0, steps=2)
    profile = next(b.sample for b in built_profiles if b.wording == "personalization/varied")
    print("a varied profile:", repr(profile.contexts), "->", repr(profile.input), repr(profile.output))
    # `people` names several people in one conversation; every wrong choice is someone else it named.
    (people,) = make_samples("people", "train", 1, seed=0, steps=3)
    print("who is who:", repr(people.contexts), "->", repr(people.input), "choices:", people.choices)

    tokenizer = load_tokenizer("default")
    base = tiny_llama(len(tokenizer))
    model = CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=1, trained_on=f"built-in task '{MIXTURE}'"))
    samples = [sample.sample for sample in built]
    held_out = make_samples(MIXTURE, "test", 8, seed=0)  # test-split names, entities and labels
    recipe = TrainingRecipe(steps=12, batch_size=4, learning_rate=5e-2, eval_every=6, save_every=1000, log_every=1000)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(model, tokenizer, samples, held_out, output_dir, recipe)
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    print(f"held-out loss at steps 6 and 12: {losses[0]:.3f}, {losses[-1]:.3f}")

    # A teacher that has learnt the tasks with the whole history in view (the paper's upper bound, the same LoRA
    # at every position) asks the memory for its predictions: `ccm train --distill-teacher ccm:smollm2-full-context`.
    teacher = CCMForCausalLM.from_base(tiny_llama(len(tokenizer)), full_context_config(CCMConfig()))
    with tempfile.TemporaryDirectory() as output_dir:
        train(teacher, tokenizer, samples, None, output_dir, replace(recipe, layout="full_context"))
    student = CCMForCausalLM.from_base(tiny_llama(len(tokenizer)), CCMConfig(num_comp_tokens=1))
    distilled = replace(recipe, distill_weight=1.0)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(student, tokenizer, samples, held_out, output_dir, distilled, teacher=teacher)
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    print(f"held-out loss distilled from the baseline at steps 6 and 12: {losses[0]:.3f}, {losses[-1]:.3f}")

    # Two adapters scored on the same held-out samples: their difference has a paired interval, far narrower than
    # the two scores' own intervals (`ccm eval --adapters before after` reports it for `after`).
    probe = make_samples("dialogue", "test", 16, seed=1, steps=2)
    before, after = (score_samples(m, tokenizer, probe, "ccm", "perplexity") for m in (model, student))
    difference = paired_difference({**before.to_dict(), "method": "output-only"}, after.to_dict())
    print(
        f"held-out dialogue perplexity {before.value:.1f} [{before.low:.1f}, {before.high:.1f}] output-only, "
        f"{after.value:.1f} [{after.low:.1f}, {after.high:.1f}] distilled: {difference_text(difference, 'perplexity')}"
    )

    # Streams: each sample fills the sink and window, then is compressed three times on its way; the loss is on
    # every token after the first compression, with gradients through all three.
    streaming = StreamingConfig(window_tokens=48, sink_tokens=4, compress_chunk=16, max_memory_tokens=4)
    length = tokens_before_compression(streaming) + 3 * streaming.compress_chunk + 1
    streams, held_out_streams = (text_streams(tokenizer, split, 8, length) for split in ("train", "test"))
    model = CCMForCausalLM.from_base(tiny_llama(len(tokenizer)), CCMConfig(trained_on="built-in task 'text'"))
    recipe = TrainingRecipe(
        steps=4, batch_size=2, learning_rate=1e-2, eval_every=2, save_every=1000, log_every=1000, streaming=streaming
    )
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(model, tokenizer, streams, held_out_streams, output_dir, recipe)
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    print(f"held-out streamed loss at steps 2 and 4: {losses[0]:.3f}, {losses[-1]:.3f}")


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    """A tiny random Llama: the run finishes in seconds (the same code trains the real model)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


if __name__ == "__main__":
    main()
