"""Multi-task in-context learning (MetaICL-like): the label words of each task are arbitrary, so the mapping
from inputs to labels can only be learned from the demonstrations.

A task picks `classes` entity types (countries, jobs, languages, ...) and gives each a random word as its
label. Each context is one demonstration, written in one of `WORDINGS`; the input is a new entity written
the same way up to its label; the output is the label.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import Built, at_answer

ENTITY_TYPES = ("first_name", "country", "language", "job", "state", "color")


@dataclass(frozen=True)
class IclWording:
    """A demonstration: `{x}` is the entity, `{answer}` its label."""

    id: str
    demonstration: str
    held_out: bool = False


_CHAT = "<|im_start|>user\n{x}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
WORDINGS = (
    IclWording("icl/input-label", "Input: {x}\nLabel: {answer}\n"),
    IclWording("icl/input-output", "Input: {x}\nOutput: {answer}\n"),
    IclWording("icl/text-arrow", "{x} -> {answer}\n"),
    IclWording("icl/word-category", "Word: {x}\nCategory: {answer}\n\n"),
    IclWording("icl/equals", "{x} = {answer}\n"),
    IclWording("icl/classify", "Classify: {x}\nClass: {answer}\n"),
    IclWording("icl/item-tag-inline", "Item: {x} | Tag: {answer}; "),
    IclWording("icl/sentence", "The answer for {x} is {answer}.\n"),
    IclWording("icl/chat", _CHAT),
    IclWording("icl/q-a", "Q: {x}\nA: {answer}\n", held_out=True),
    IclWording("icl/review-sentiment", "Review: {x}\nSentiment: {answer}\n\n", held_out=True),
    IclWording("icl/quoted", '"{x}" is labelled {answer}.\n', held_out=True),
    IclWording("icl/bracket-colon", "[{x}]: {answer}\n", held_out=True),
)


def icl_sample(rng: random.Random, split: Split, steps: int, wording: IclWording, classes: int = 3) -> Built:
    """One sample with `steps` demonstrations. Task identity (types and label words) comes from `split`."""
    types = rng.sample(ENTITY_TYPES, classes)
    labels = rng.sample(words("word", split), classes)
    used: list[str] = []

    def entity(kind: int) -> str:
        while True:
            item = rng.choice(words(types[kind], split))
            if item not in used:
                used.append(item)
                return item

    contexts = []
    for _ in range(steps):
        kind = rng.randrange(classes)
        contexts.append(wording.demonstration.format(x=entity(kind), answer=labels[kind]))
    kind = rng.randrange(classes)
    prompt, output = at_answer(wording.demonstration, labels[kind], x=entity(kind))
    choices = [at_answer(wording.demonstration, label, x="")[1] for label in labels]
    return OnlineSample(contexts, prompt, output, choices), (*used, *labels)
