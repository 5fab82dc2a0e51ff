"""Personalization (LaMP-like): a user's past posts form the profile; the question's right answer depends on
what the user revealed in them.
"""

from __future__ import annotations

import random

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.vocabulary import Split, words

# attribute: (pool, how a post reveals it, the question about it)
ATTRIBUTES = {
    "job": ("job", "Work was busy today, as usual for a {}.", "What does this user work as?"),
    "country": ("country", "Nothing beats coming home to {} after a long trip.", "Which country is this user from?"),
    "language": ("language", "I practised my {} again this evening.", "Which language is this user learning?"),
    "color": ("color", "I painted my bedroom {} this weekend.", "Which colour did this user paint their room?"),
    "state": ("state", "The weather in {} was lovely this morning.", "In which state does this user live?"),
    "friend": ("first_name", "Had a long coffee with my friend {} today.", "What is the name of this user's friend?"),
}
FILLER = (
    "Just finished a good book about {}.",
    "Thinking about {} all day long.",
    "Does anyone else care about {} as much as I do?",
    "Learned something new about {} today.",
)


def personalization_sample(rng: random.Random, split: Split, steps: int, choices: int = 3) -> OnlineSample:
    """A user with `steps` posts (some reveal attributes, the rest are filler) and a question about one."""
    attributes = rng.sample(sorted(ATTRIBUTES), min(len(ATTRIBUTES), max(1, (steps + 1) // 2)))
    profile = {name: rng.choice(words(ATTRIBUTES[name][0], split)) for name in attributes}
    posts = [ATTRIBUTES[name][1].format(value) for name, value in profile.items()]
    while len(posts) < steps:
        posts.append(rng.choice(FILLER).format(rng.choice(words("word", split))))
    posts = posts[:steps]
    rng.shuffle(posts)
    revealed = [name for name in attributes if any(ATTRIBUTES[name][1].format(profile[name]) == p for p in posts)]
    asked = rng.choice(revealed)
    pool, _, question = ATTRIBUTES[asked]
    options = [profile[asked], *rng.sample([w for w in words(pool, split) if w != profile[asked]], choices - 1)]
    rng.shuffle(options)
    return OnlineSample(
        contexts=[f"Post: {post}\n" for post in posts],
        input=f"Question: {question}\nAnswer:",
        output=f" {profile[asked]}",
        choices=[f" {option}" for option in options],
    )
