"""General multi-segment text: consecutive passages of a document, each one context; the input is the start
of the next passage and the output its rest. Trained with dense supervision, every passage after the first
is predicted from the memory of those before it. Scored by perplexity.

Sources: the Python language reference that ships with Python (`text.long_text`, split by topic), and,
when Faker is installed, Faker's lorem prose over the split's word list.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import threading
from dataclasses import dataclass
from typing import Any, Literal

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.text import long_text
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built

MAX_WORDS = 48  # a passage: about 60 tokens, near the paper's ~50-token contexts
MIN_WORDS = 6
PROMPT_WORDS = 4  # the input: the first words of the next passage


@dataclass(frozen=True)
class DocumentWording:
    """Where the passages come from."""

    id: str
    source: Literal["reference", "lorem"]
    held_out: bool = False


WORDINGS = (
    DocumentWording("document/reference", "reference"),
    *((DocumentWording("document/lorem", "lorem"),) if importlib.util.find_spec("faker") else ()),
)


@functools.cache
def passages(split: Split) -> tuple[str, ...]:
    """The reference text of `split` cut into passages of `MIN_WORDS` to `MAX_WORDS` words, in order."""
    cut = []
    for paragraph in long_text(split).split("\n\n"):
        tokens = paragraph.split()
        for start in range(0, len(tokens), MAX_WORDS):
            piece = tokens[start : start + MAX_WORDS]
            if len(piece) >= MIN_WORDS:
                cut.append(" ".join(piece))
    return tuple(cut)


@functools.cache
def _faker() -> Any:
    from faker import Faker

    return Faker("en_US")


# One Faker serves every call, each seeding it and drawing from it: calls in several threads at once drew from one
# another's seeds, and gave other samples than the same calls one after another.
_FAKER_LOCK = threading.Lock()


def _lorem(rng: random.Random, split: Split, count: int) -> list[str]:
    fake = _faker()
    seed = rng.getrandbits(32)
    vocabulary = list(words("word", split))
    passages = []
    with _FAKER_LOCK:
        fake.seed_instance(seed)
        for _ in range(count):
            passage = fake.paragraph(nb_sentences=3, ext_word_list=vocabulary)
            while len(passage.split()) < 2 * PROMPT_WORDS:  # Faker's paragraphs can be a word or two long
                passage += " " + fake.paragraph(nb_sentences=3, ext_word_list=vocabulary)
            passages.append(passage)
    return passages


def document_sample(
    rng: random.Random, split: Split, steps: int, wording: DocumentWording, chat: TurnFormat = CHATML_FORMAT
) -> Built:
    """`steps` consecutive passages, then the start of the next one as the input and its rest as the output. Its
    wordings hold no chat turns: `chat` is taken as every family's generator takes it."""
    if wording.source == "reference":
        text = passages(split)
        start = rng.randrange(len(text) - steps)
        pieces = list(text[start : start + steps + 1])
    else:
        pieces = _lorem(rng, split, steps + 1)
    *contexts, last = pieces
    head = last.split()
    return OnlineSample(
        contexts=[f"{piece}\n\n" for piece in contexts],
        input=" ".join(head[:PROMPT_WORDS]),
        output=" " + " ".join(head[PROMPT_WORDS:]),
    ), ()
