"""Surface forms ("wordings") of the built-in tasks, and which of them training never sees.

A wording is one way of writing a task: field names, separators, plain text or chat turns, and the phrasing
pool its statements and questions come from. Wordings with `held_out=True` ("unseen wordings") appear only in
the test split; they also draw their phrasings from pools that seen wordings never use, so an unseen sample
shares neither its frame nor its sentences with training.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.chat_template import TurnFormat
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


# The turns of SmolLM2's chat template (ChatML), in which chat wordings are written. A tokenizer with no chat template
# keeps them; the shipped adapters and docs/results.md were made from samples written so.
CHATML_FORMAT = TurnFormat("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\n")
_CHATML_MARKERS = re.compile(
    "|".join(map(re.escape, (CHATML_FORMAT.after_message, CHATML_FORMAT.before_message, CHATML_FORMAT.end_of_reply)))
)


def chat_format(tokenizer: PreTrainedTokenizerBase | None) -> TurnFormat:
    """The turns chat wordings are written in for a model with `tokenizer`: those of its chat template, as `ccm chat`
    writes them, so that training and chat agree; ChatML where there is no tokenizer, or no template `ccm chat` can
    use (none, one that does not write a conversation as a sequence of turns, one that refuses user and assistant
    messages alone): the model is never talked to in turns, and its built-in samples stay as they were."""
    if tokenizer is None:
        return CHATML_FORMAT
    try:
        return TurnFormat.of(tokenizer)
    except ValueError:
        return CHATML_FORMAT


def in_chat_format(frame: str, chat: TurnFormat) -> str:
    """`frame` (a wording's template, its chat turns written in ChatML) with those turns as `chat` writes them.

    A user turn and the reply after it become `before_message + user + after_message + before_reply + reply +
    end_of_reply`, as the template writes an exchange in the history (`at_answer` leaves `before_reply`'s spaces to
    the output, where the model writes them after the prompt `ChatSession` gives it). A user turn with no reply (a
    personalization post) ends as the template ends a user turn: with the end of a reply where the turn's end starts
    so (Llama 3, Gemma), otherwise with the whole `after_message` (Mistral's " [/INST]"). With `CHATML_FORMAT` the
    frame comes back as it was."""
    end_of_user_turn = chat.end_of_reply if chat.after_message.startswith(chat.end_of_reply) else chat.after_message

    def written(marker: re.Match[str]) -> str:
        if marker.group() == CHATML_FORMAT.before_message:
            text = chat.before_message
        elif marker.group() == CHATML_FORMAT.after_message:
            text = chat.after_message + chat.before_reply
        else:  # ends the reply, or a user turn where no reply opened after the last user turn
            before = frame[: marker.start()]
            replied = before.rfind(CHATML_FORMAT.after_message) > before.rfind(CHATML_FORMAT.before_message)
            text = chat.end_of_reply if replied else end_of_user_turn
        return text.replace("{", "{{").replace("}", "}}")  # the frame is filled with str.format afterwards

    return _CHATML_MARKERS.sub(written, frame)
