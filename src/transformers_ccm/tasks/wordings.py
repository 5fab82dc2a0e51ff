"""Surface forms ("wordings") of the built-in tasks, and which of them training never sees.

A wording is one way of writing a task: field names, separators, plain text or chat turns, and the phrasing
pool its statements and questions come from. Wordings with `held_out=True` ("unseen wordings") appear only in
the test split; they also draw their phrasings from pools that seen wordings never use, so an unseen sample
shares neither its frame nor its sentences with training.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split

WordingSet = Literal["seen", "unseen", "all"]
WORDING_SETS: tuple[str, ...] = ("seen", "unseen", "all")


class Wording(Protocol):
    """What every family's wording has: a stable id (`"<family>/<name>"`) and whether training may see it."""

    @property
    def id(self) -> str: ...

    @property
    def held_out(self) -> bool: ...


W = TypeVar("W", bound=Wording)


# A generated sample and the word-list items it is made of (entities, labels, facts; empty for general text).
Built = tuple[OnlineSample, tuple[str, ...]]


@dataclass(frozen=True)
class TaskSample:
    """A built-in sample with where it came from: its family, its wording and the items it is made of."""

    sample: OnlineSample
    task: str
    wording: str
    held_out: bool  # whether the wording is one training never sees
    items: tuple[str, ...]


def check_wording_set(split: Split, wordings: WordingSet | None) -> WordingSet:
    """The wording set to draw from: by default all of them in the test split and the seen ones in training.

    Raises if training would see a held-out wording."""
    if wordings is None:
        return "all" if split == "test" else "seen"
    if wordings not in WORDING_SETS:
        raise ValueError(f"wordings must be one of {WORDING_SETS}, got {wordings!r}.")
    if split == "train" and wordings != "seen":
        raise ValueError(
            f"wordings={wordings!r} with split='train' would train on held-out wordings; use wordings='seen' "
            "for training (unseen wordings exist to measure generalization in the test split)."
        )
    return wordings


def select(family: str, wordings: Sequence[W], which: WordingSet) -> tuple[W, ...]:
    """The wordings of `family` in the set `which`; raises if there are none."""
    chosen = tuple(w for w in wordings if which == "all" or w.held_out == (which == "unseen"))
    if not chosen:
        raise ValueError(f"The {family!r} family has no {which} wordings; ask for 'seen' or 'all'.")
    return chosen


@dataclass(frozen=True)
class Phrasings:
    """Paraphrases of one sentence (`{}`-style fields), split into those seen wordings use and those kept for
    unseen wordings."""

    seen: tuple[str, ...]
    unseen: tuple[str, ...]

    def pick(self, rng: random.Random, held_out: bool) -> str:
        return rng.choice(self.unseen if held_out else self.seen)

    def pick_distinct(self, rng: random.Random, held_out: bool, count: int) -> list[str]:
        """Up to `count` different paraphrases (fewer if the pool is smaller)."""
        pool = self.unseen if held_out else self.seen
        return rng.sample(pool, min(count, len(pool)))


def field_name(rng: random.Random, pool: Sequence[str], lower_chance: float) -> str:
    """A name from `pool` for a composed frame, in lower case with probability `lower_chance`."""
    name = rng.choice(pool)
    return name.lower() if rng.random() < lower_chance else name


def at_answer(template: str, answer: str, **fields: str) -> tuple[str, str]:
    """`template` (fields, and `{answer}` where the answer goes) cut into the prompt and what follows it.

    The space before the answer moves into the output (a BPE tokenizer writes " word" as one token), and the
    output ends where the line or the turn does: `"Q: {q}\\nA: {answer}\\n"` gives `("Q: ...\\nA:", " yes")`;
    a ChatML turn keeps its `<|im_end|>`.
    """
    before, after = template.split("{answer}")
    prompt = before.rstrip(" ")
    return prompt.format(**fields), before[len(prompt) :] + answer + after.rstrip().format(**fields)
