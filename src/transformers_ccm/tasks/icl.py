"""Multi-task in-context learning (MetaICL-like): the label words of each task are arbitrary, so the mapping
from inputs to labels can only be learned from the demonstrations.

A task picks `classes` entity types (countries, jobs, languages, ...) and gives each a random word as its
label. Each context is one demonstration, written in one of `WORDINGS`; the input is a new entity written
the same way up to its label; the output is the label. The `icl/varied` wording composes a new frame for every
sample (field names, separators, layout), so training sees hundreds of frames rather than a few.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built, at_answer, field_name, in_chat_format

ENTITY_TYPES = ("first_name", "country", "language", "job", "state", "color")


@dataclass(frozen=True)
class IclWording:
    """A demonstration: `{x}` is the entity, `{answer}` its label. `varied`: a new frame per sample (then
    `demonstration` is unused)."""

    id: str
    demonstration: str
    held_out: bool = False
    varied: bool = False

    def frame(self, rng: random.Random) -> str:
        """The demonstration template of one sample."""
        return varied_frame(rng) if self.varied else self.demonstration


# Parts of varied frames. None of them belongs to a held-out wording (no "Q"/"A", "Review"/"Sentiment",
# quotes, brackets or "labelled"), so unseen wordings stay unseen.
_INPUT_KEYS = (
    "Input", "Text", "Example", "Entry", "Term", "Item", "Word", "Query", "Sample", "Prompt", "Data", "Case",
    "Instance", "Subject", "Phrase", "Name", "Value", "Token", "Key", "Object",
)  # fmt: skip
_LABEL_KEYS = (
    "Label", "Output", "Category", "Class", "Tag", "Type", "Group", "Kind", "Result", "Target", "Response",
    "Code", "Bucket", "Verdict", "Topic", "Set", "Mark", "Tier",
)  # fmt: skip
_KEY_SEPARATORS = (": ", " = ", " - ", " :: ", " > ")
_FIELD_JOINS = (" | ", ", ", "; ", " / ", "  ")
_ARROWS = (" -> ", " => ", " : ", " --> ", "\t", " >> ", " ~ ", " | ", ", ")
_SENTENCES = (
    "{x} goes with {answer}.", "{x} belongs to {answer}.", "{x} falls under {answer}.", "Put {x} in {answer}.",
    "{x} is in group {answer}.", "For {x}, say {answer}.",
)  # fmt: skip


def varied_frame(rng: random.Random) -> str:
    """A demonstration template composed at random: two keyed fields on two lines or one, an arrow between
    bare values, or a sentence; keys in title or lower case; one of several endings."""

    def key(pool: tuple[str, ...]) -> str:
        return field_name(rng, pool, 0.3)

    separator = rng.choice(_KEY_SEPARATORS)
    layout = rng.randrange(4)
    if layout == 0:
        body = f"{key(_INPUT_KEYS)}{separator}{{x}}\n{key(_LABEL_KEYS)}{separator}{{answer}}"
    elif layout == 1:
        body = f"{key(_INPUT_KEYS)}{separator}{{x}}{rng.choice(_FIELD_JOINS)}{key(_LABEL_KEYS)}{separator}{{answer}}"
    elif layout == 2:
        body = f"{{x}}{rng.choice(_ARROWS)}{{answer}}"
    else:
        body = rng.choice(_SENTENCES)
    return body + rng.choice(("\n", "\n", "\n\n", " || "))


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
    IclWording("icl/varied", "", varied=True),
    IclWording("icl/q-a", "Q: {x}\nA: {answer}\n", held_out=True),
    IclWording("icl/review-sentiment", "Review: {x}\nSentiment: {answer}\n\n", held_out=True),
    IclWording("icl/quoted", '"{x}" is labelled {answer}.\n', held_out=True),
    IclWording("icl/bracket-colon", "[{x}]: {answer}\n", held_out=True),
)


def icl_sample(
    rng: random.Random,
    split: Split,
    steps: int,
    wording: IclWording,
    chat: TurnFormat = CHATML_FORMAT,
    classes: int = 3,
) -> Built:
    """One sample with `steps` demonstrations, chat turns written as `chat` writes them. Task identity (types and
    label words) comes from `split`. Entities differ while the split has enough of their type; past that, they
    repeat."""
    demonstration = in_chat_format(wording.frame(rng), chat)
    types = rng.sample(ENTITY_TYPES, classes)
    labels = rng.sample(words("word", split), classes)
    used: list[str] = []

    def entity(kind: int) -> str:
        pool = words(types[kind], split)
        if set(pool) <= set(used):
            # Every item of the type is in the sample (12 states in the test split, against 17 draws at t=16 with
            # an unlucky seed, or more at --steps 30): one is used again, where the draws below would never end.
            return rng.choice(pool)
        while True:
            item = rng.choice(pool)
            if item not in used:
                used.append(item)
                return item

    contexts = []
    for _ in range(steps):
        kind = rng.randrange(classes)
        contexts.append(demonstration.format(x=entity(kind), answer=labels[kind]))
    kind = rng.randrange(classes)
    prompt, output = at_answer(demonstration, labels[kind], x=entity(kind))
    choices = [at_answer(demonstration, label, x="")[1] for label in labels]
    return OnlineSample(contexts, prompt, output, choices), (*used, *labels)
