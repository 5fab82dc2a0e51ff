"""Long assistant replies, as a chat model writes them: advice, lists and asides that run for several sentences.

A chat model folds its own reply into memory together with the user's message, so a turn that tells a fact
also carries sixty tokens of rambling, and sometimes other people's names and jobs. These replies teach the
adapter to keep what the user said through them. Fields: `{v}` is a topic word, `{name}` someone else's name,
`{job_a}` someone else's job with its article.
"""

from __future__ import annotations

import random

from transformers_ccm.tasks.vocabulary import Split, with_article, words
from transformers_ccm.tasks.wordings import Phrasings

SENTENCES = Phrasings(
    (
        "It's always worth taking things one step at a time.",
        "A lot of people feel the same way, so you're not alone.",
        "If you want, I can go into more detail.",
        "The most important thing is to be patient with yourself.",
        "Small changes often make the biggest difference.",
        "There's no single right answer, but a few ideas usually help.",
        "Let me know how it goes!",
        "I've heard {v} comes up a lot in conversations like this.",
        "Some people say {v} is the key, others disagree.",
        "Honestly, {v} is a fascinating subject.",
        "My friend {name} once spent a whole summer on {v}.",
        "I know {job_a} who swears by this.",
        "Reading a bit about {v} could be a good start.",
        "You could also ask someone who knows {v} well.",
        "Take a break, drink some water and get some fresh air.",
        "Many people find it helps to write things down.",
        "It might take a few days before you notice a change.",
        "I remember a story about {name}, who worked as {job_a} and loved {v}.",
        "A good night's sleep makes almost everything easier.",
        "You could try it for a week and see how you feel.",
        "{name} told me that {v} changed the way they think.",
        "Even {job_a} needs a day off now and then.",
        "There are plenty of books on {v} if you want to dig deeper.",
        "Don't be too hard on yourself.",
        "It helps to talk to friends about it.",
        "Some people swear by a morning routine.",
    ),
    (
        "Everyone's situation is different, of course.",
        "I'd suggest starting small and seeing what works for you.",
        "Someone named {name} wrote a lovely piece on {v}.",
        "Plenty of people who work as {job_a} would agree.",
        "It sounds like you have a lot going on right now.",
    ),
)
LIST_INTROS = Phrasings(
    (
        "Here are a few ideas:",
        "Some tips that might help:",
        "A few things to try:",
        "Here's what I'd suggest:",
        "A couple of suggestions:",
        "These might help:",
        "What works for many people:",
    ),
    ("You might consider the following:", "Options worth a look:"),
)
TIPS = Phrasings(
    (
        "Drink plenty of water.",
        "Go to bed at the same time every night.",
        "Take short walks during the day.",
        "Keep a notebook nearby.",
        "Avoid heavy meals late in the evening.",
        "Ask {name} for a second opinion.",
        "Read a little about {v}.",
        "Set a small goal for each day.",
        "Turn off your phone an hour before bed.",
        "Try something new every week.",
        "Stretch for five minutes after waking up.",
        "Write down three good things each evening.",
        "Call {name} and ask how they manage.",
        "Listen to a podcast about {v}.",
        "Cook a simple meal at home.",
        "Keep your desk tidy.",
    ),
    ("Spend ten quiet minutes outdoors.", "Talk it over with {name}.", "Look up {v} at the library."),
)


def ramble(rng: random.Random, split: Split, held_out: bool, avoid: tuple[str, ...]) -> str:
    """Two to five sentences, or a list of tips, about a random topic; its topic, names and jobs share no word
    with `avoid` (the user's own facts: "arts administrator" is no distractor for an administrator)."""
    taken = {word for item in avoid for word in item.lower().split()}

    def unrelated(pool: str) -> str:
        return rng.choice([item for item in words(pool, split) if not taken & set(item.lower().split())])

    fields = {"v": unrelated("word"), "name": unrelated("first_name"), "job_a": with_article(unrelated("job"))}

    if rng.random() < 0.35:
        bullet = rng.choice(("*", "-", "{}."))
        tips = TIPS.pick_distinct(rng, held_out, rng.randint(2, 4))
        lines = [f"{bullet.format(number)} {tip.format(**fields)}" for number, tip in enumerate(tips, 1)]
        return "\n".join([LIST_INTROS.pick(rng, held_out), *lines])
    return " ".join(text.format(**fields) for text in SENTENCES.pick_distinct(rng, held_out, rng.randint(2, 5)))
