"""A probe in a wording no built-in task uses: a user's text messages (facts in fresh phrasings among chatter),
then a quiz question with three choices. Items come from the test split (names, jobs, places, pets training never
saw). Writes docs/results/probe/messages-t8.jsonl."""

import json
import random
from pathlib import Path

from transformers_ccm.tasks.vocabulary import with_article, words

STATEMENTS = {
    "name": (
        "first_name",
        [
            "ok so it's {v} texting, new number",
            "sign me up too - {v}",
            "{v} speaking, lol",
            "tell them {v} says thanks",
            "this is {v}, saved your contact?",
        ],
        "what is the texter's name?",
    ),
    "job": (
        "job",
        [
            "ugh double shift again, {a}'s life",
            "training the new hires, the joys of being {a}",
            "my manager wants every {v} in early tomorrow",
            "guess who got certified as {a} today",
            "nobody warns you how tiring it is to be {a}",
        ],
        "what does the texter do for work?",
    ),
    "home": (
        "state",
        [
            "snowing like crazy over here in {v}",
            "flights out of {v} are so pricey",
            "home sweet home, {v} never changes",
            "the rent in {v} went up again",
        ],
        "which state does the texter live in?",
    ),
    "pet": (
        "pet",
        [
            "the {v} knocked my coffee over",
            "vet appointment for my {v} at 3",
            "bought a new bed for the {v}, it ignores it",
            "my {v} snores louder than me",
        ],
        "what animal does the texter keep?",
    ),
}
CHATTER = [
    "running late, sorry",
    "did you see the game?",
    "grabbing lunch, want anything?",
    "haha that's so true",
    "can't find my keys again",
    "phone's about to die",
    "what time tomorrow?",
    "this weather though",
    "just finished that show, wow",
    "remind me to call mom",
]

rng = random.Random(2026)
records = []
for _ in range(48):
    kinds = rng.sample(sorted(STATEMENTS), 3)
    facts = {kind: rng.choice(words(STATEMENTS[kind][0], "test")) for kind in kinds}
    lines = [rng.choice(STATEMENTS[k][1]).format(v=v, a=with_article(v)) for k, v in facts.items()]
    lines += rng.sample(CHATTER, 8 - len(lines))
    rng.shuffle(lines)
    asked = rng.choice(kinds)
    value = facts[asked]
    others = rng.sample([w for w in words(STATEMENTS[asked][0], "test") if w != value], 2)
    choices = [f" {option}" for option in rng.sample([value, *others], 3)]
    records.append(
        {
            "contexts": [f"SMS> {line}\n" for line in lines],
            "input": f"Quiz - {STATEMENTS[asked][2]}\nAnswer:",
            "output": f" {value}",
            "choices": choices,
        }
    )
path = Path("docs/results/probe/messages-t8.jsonl")
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text("".join(json.dumps(r) + "\n" for r in records))
print(path, len(records))
print(records[0])
