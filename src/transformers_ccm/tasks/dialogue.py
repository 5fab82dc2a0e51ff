"""Conversation: multi-turn dialogues in ChatML in which the user shares facts that a later turn recalls.

Each context is one earlier turn (user and assistant); the input is the user's last message; the output is
the assistant's reply, which needs the earlier turns. Scored by perplexity.
"""

from __future__ import annotations

import random

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words

# fact: (pool, user shares it, assistant acknowledges, user asks, assistant recalls)
FACTS = {
    "name": (
        "first_name",
        "Hi! My name is {}.",
        "Nice to meet you, {}!",
        "Do you remember my name?",
        "Of course, your name is {}.",
    ),
    "job": (
        "job",
        "I work as a {}.",
        "Being a {} sounds interesting.",
        "What do I do for a living?",
        "You work as a {}.",
    ),
    "home": ("state", "I live in {}.", "{} is a lovely place to live.", "Where do I live again?", "You live in {}."),
    "friend": (
        "first_name",
        "My best friend is called {}.",
        "{} sounds like a great friend.",
        "What is my best friend called?",
        "Your best friend is called {}.",
    ),
    "language": (
        "language",
        "I am learning {} at the moment.",
        "Good luck with your {} lessons!",
        "Which language am I learning?",
        "You are learning {}.",
    ),
    "color": (
        "color",
        "My favourite colour is {}.",
        "{} is a beautiful colour.",
        "What is my favourite colour?",
        "Your favourite colour is {}.",
    ),
}
SMALL_TALK = (
    ("What do you think about {}?", "Many people find {} important."),
    ("I read an article about {} today.", "That sounds like an interesting read about {}."),
    ("Can you tell me something about {}?", "There is a lot to say about {}."),
)


def turn(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def dialogue_sample(rng: random.Random, split: Split, steps: int) -> OnlineSample:
    """A dialogue with `steps` earlier turns, some sharing facts, and a last turn recalling one of them."""
    facts = rng.sample(sorted(FACTS), min(len(FACTS), max(1, (steps + 1) // 2)))
    values = {fact: rng.choice(words(FACTS[fact][0], split)) for fact in facts}
    turns = [(fact, turn(FACTS[fact][1].format(values[fact]), FACTS[fact][2].format(values[fact]))) for fact in facts]
    while len(turns) < steps:
        user, assistant = rng.choice(SMALL_TALK)
        topic = rng.choice(words("word", split))
        turns.append((None, turn(user.format(topic), assistant.format(topic))))
    turns = turns[:steps]
    rng.shuffle(turns)
    asked = rng.choice([fact for fact, _ in turns if fact is not None])
    return OnlineSample(
        contexts=[text for _, text in turns],
        input=f"<|im_start|>user\n{FACTS[asked][3]}<|im_end|>\n<|im_start|>assistant\n",
        output=f"{FACTS[asked][4].format(values[asked])}<|im_end|>",
    )
