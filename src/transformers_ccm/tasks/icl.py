"""Multi-task in-context learning (MetaICL-like): the label words of each task are arbitrary, so the mapping
from inputs to labels can only be learned from the demonstrations.

A task picks `classes` entity types (countries, jobs, languages, ...) and gives each a random word as its
label. Each context is one demonstration; the input is a new entity; the output is its label.
"""

from __future__ import annotations

import random

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words

ENTITY_TYPES = ("first_name", "country", "language", "job", "state", "color")


def icl_sample(rng: random.Random, split: Split, steps: int, classes: int = 3) -> OnlineSample:
    """One sample with `steps` demonstrations. Task identity (types and label words) comes from `split`."""
    types = rng.sample(ENTITY_TYPES, classes)
    labels = rng.sample(words("word", split), classes)
    seen: set[str] = set()

    def entity(kind: int) -> str:
        while True:
            item = rng.choice(words(types[kind], split))
            if item not in seen:
                seen.add(item)
                return item

    contexts = []
    for _ in range(steps):
        kind = rng.randrange(classes)
        contexts.append(f"Input: {entity(kind)}\nLabel: {labels[kind]}\n")
    kind = rng.randrange(classes)
    return OnlineSample(
        contexts=contexts,
        input=f"Input: {entity(kind)}\nLabel:",
        output=f" {labels[kind]}",
        choices=[f" {label}" for label in labels],
    )
