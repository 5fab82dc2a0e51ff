"""Probes in wordings no built-in task uses, with three choices per question and items from the test split (names,
jobs, places, pets training never saw). Writes docs/results/probe/<probe>-t<steps>.jsonl (other draws with --seed,
--count and --out-dir):

- messages: a user's text messages (facts in fresh phrasings among chatter), then a quiz question;
- emails: a user's emails with subject lines, in which the user's name and a friend's name both appear (the
  hard case of recall), then a form field to fill in;
- notes: a party planner's notes about three guests, in the third person, two of whom share the kind of fact asked
  about (two jobs, two home states or two pets), then a seating-chart field for one guest: the facts must be told
  apart by whom they belong to, not only by their kind;
- sorting (ICL, t = 16): a storeroom log puts hobbies, pets and jobs on three shelves named anew in every sample;
  the shelf of a new item can only be learned from the log.
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from transformers_ccm.tasks.vocabulary import with_article, words


@dataclass(frozen=True)
class Probe:
    statements: dict[str, tuple[str, list[str], str]]  # kind: (word list, phrasings, question)
    chatter: list[str]
    context: str  # one line: {line}, and {subject} where a probe has subjects
    question: str  # {q}
    always: tuple[str, ...] = ()  # kinds every sample holds
    subjects: tuple[str, ...] = ()  # subject lines to draw, for probes that have them


MESSAGES = Probe(
    statements={
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
    },
    chatter=[
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
    ],
    context="SMS> {line}\n",
    question="Quiz - {q}\nAnswer:",
)
EMAILS = Probe(
    statements={
        "name": (
            "first_name",
            [
                "Thanks again for everything.\nWarm regards,\n{v}",
                "Speak soon,\n{v}",
                "Please reply to me directly ({v}) rather than the list.",
                "In case the display name is wrong: this is {v} writing.",
            ],
            "the sender's first name",
        ),
        "friend": (
            "first_name",
            [
                "I've copied in {v}, a dear friend who wants to join us.",
                "{v}, who I've been friends with for years, will bring the tickets.",
                "My friend {v} sends their regards and says the photos are lovely.",
                "Could you add {v} to the booking? We're old friends from university.",
            ],
            "the friend the sender writes about",
        ),
        "job": (
            "job",
            [
                "Apologies for the slow reply; the week has been hectic in my role as {a}.",
                "As {a}, I can only take calls after six.",
                "Attached is my CV; I have worked as {a} since graduating.",
            ],
            "the sender's occupation",
        ),
        "pet": (
            "pet",
            [
                "Is the cottage pet-friendly? I'd be bringing my {v}.",
                "Sorry for the typos, my {v} walked across the keyboard.",
                "The pet sitter cancelled, so the {v} comes with me.",
            ],
            "the sender's pet",
        ),
    },
    chatter=[
        "Could we move Thursday's meeting to the afternoon?",
        "Please find the invoice attached.",
        "The parcel arrived today, thank you.",
        "Is the offer still open until Friday?",
        "I'll be out of office next week.",
        "Quick reminder about the deposit.",
        "Loved the photos from the weekend!",
        "Can you confirm the new address?",
        "The printer is broken again.",
        "Happy to help with the planning.",
    ],
    context="Subject: {subject}\n\n{line}\n\n---\n",
    question="Form field - {q}:",
    always=("name", "friend"),
    subjects=("Re: plans", "Quick question", "Booking", "Following up", "Hello", "Fwd: notes", "Weekend"),
)


def among_chatter(rng: random.Random, lines: list[str], chatter: list[str], steps: int) -> list[str]:
    """The fact lines and chatter lines up to `steps` lines, shuffled."""
    lines = lines + rng.sample(chatter, steps - len(lines))
    rng.shuffle(lines)
    return lines


def record(rng: random.Random, contexts: list[str], question: str, value: str, others: list[str]) -> dict:
    """One JSONL sample: the answer and two other options, in random order."""
    return {
        "contexts": contexts,
        "input": question,
        "output": f" {value}",
        "choices": [f" {option}" for option in rng.sample([value, *others], 3)],
    }


# Third-person facts about guests: kind: (word list, phrasings with {p} the guest, field asked).
GUEST_FACTS = {
    "job": (
        "job",
        [
            "{p} works as {a} now, so expect shop talk at table two.",
            "Seat {p} away from the speakers; {p} is {a} and starts early.",
            "{p} ({v}) can only stay until nine.",
            "Ask {p} about the new job as {a}.",
        ],
        "{p}'s occupation",
    ),
    "home": (
        "state",
        [
            "{p} is driving in from {v} on the morning of the party.",
            "{p} still lives in {v}; book the hotel near the station.",
            "Flights from {v} were delayed, so {p} may arrive late.",
        ],
        "the state {p} travels from",
    ),
    "pet": (
        "pet",
        [
            "{p} wants to bring the {v}; check with the venue.",
            "{p}'s {v} needs a quiet room upstairs.",
            "Remind {p} that the {v} has to stay on the terrace.",
        ],
        "the animal {p} brings",
    ),
}
PLANNER_CHATTER = [
    "Order twenty more chairs.",
    "The band arrives at seven.",
    "Check the parking situation.",
    "Cake pickup is Saturday at noon.",
    "Buy ice the day before.",
    "Confirm the caterer's menu.",
    "Print the name cards.",
    "Rain plan: move everything inside.",
]


def guest_records(seed: int, count: int = 48, steps: int = 8) -> list[dict]:
    """The notes probe: three guests, the asked kind held by two of them, the other guest's value as a choice."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        guests = rng.sample(words("first_name", "test"), 3)
        asked_kind = rng.choice(sorted(GUEST_FACTS))
        other_kind = rng.choice([kind for kind in sorted(GUEST_FACTS) if kind != asked_kind])
        kinds = [asked_kind, asked_kind, other_kind]
        facts: list[tuple[str, str, str]] = []  # (guest, kind, value)
        for guest, kind in zip(guests, kinds, strict=True):
            taken = [value for _, _, value in facts]
            facts.append((guest, kind, rng.choice([w for w in words(GUEST_FACTS[kind][0], "test") if w not in taken])))
        lines = [
            rng.choice(GUEST_FACTS[kind][1]).format(p=guest, v=value, a=with_article(value))
            for guest, kind, value in facts
        ]
        lines = among_chatter(rng, lines, PLANNER_CHATTER, steps)
        (guest, _, value), (_, _, twin) = facts[0], facts[1]
        unsaid = [w for w in words(GUEST_FACTS[asked_kind][0], "test") if w not in (value, twin)]
        contexts = [f"Planner note {i + 1}: {line}\n" for i, line in enumerate(lines)]
        question = f"Seating chart - {GUEST_FACTS[asked_kind][2].format(p=guest)}:"
        out.append(record(rng, contexts, question, value, [twin, rng.choice(unsaid)]))
    return out


def records(probe: Probe, seed: int, count: int = 48, steps: int = 8) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        rest = [kind for kind in sorted(probe.statements) if kind not in probe.always]
        kinds = [*probe.always, *rng.sample(rest, 3 - len(probe.always))]
        facts: dict[str, str] = {}
        for kind in kinds:
            facts[kind] = rng.choice([w for w in words(probe.statements[kind][0], "test") if w not in facts.values()])
        lines = [rng.choice(probe.statements[k][1]).format(v=v, a=with_article(v)) for k, v in facts.items()]
        lines = among_chatter(rng, lines, probe.chatter, steps)
        asked = rng.choice(kinds)
        value = facts[asked]
        word_list = probe.statements[asked][0]
        # A value of the same word list said in the sample (the friend beside the user's name) is a choice too.
        twins = [v for k, v in facts.items() if k != asked and probe.statements[k][0] == word_list]
        unsaid = [w for w in words(word_list, "test") if w not in facts.values()]
        others = twins + rng.sample(unsaid, 2 - len(twins))
        contexts = [
            probe.context.format(subject=rng.choice(probe.subjects) if probe.subjects else "", line=line)
            for line in lines
        ]
        out.append(record(rng, contexts, probe.question.format(q=probe.statements[asked][2]), value, others))
    return out


SHELVES = ("north", "south", "east", "west", "top", "bottom", "corner", "back")
SORTED_KINDS = ("hobby", "pet", "job")


def sorting_records(seed: int, count: int = 48, steps: int = 16) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        shelves = dict(zip(SORTED_KINDS, rng.sample(SHELVES, len(SORTED_KINDS)), strict=True))
        asked = rng.choice(SORTED_KINDS)
        kinds = [rng.choice(SORTED_KINDS) for _ in range(steps)]
        if asked not in kinds:
            kinds[rng.randrange(steps)] = asked
        new_item = rng.choice(words(asked, "test"))
        # Few pets are held out, so the log repeats items; the asked item is never in it.
        logged = {kind: [w for w in words(kind, "test") if w != new_item] for kind in SORTED_KINDS}
        line = "Box {} holds {} - stored on the {} shelf.\n"
        contexts = [line.format(i + 1, rng.choice(logged[kind]), shelves[kind]) for i, kind in enumerate(kinds)]
        question = f"Box {steps + 1} holds {new_item} - stored on the"
        others = [shelf for kind, shelf in shelves.items() if kind != asked]
        out.append(record(rng, contexts, question, shelves[asked], others))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--count", type=int, default=48, help="samples per probe")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/results/probe"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    draws = {
        "messages-t8": records(MESSAGES, seed=args.seed, count=args.count),
        "emails-t8": records(EMAILS, seed=args.seed, count=args.count),
        "notes-t8": guest_records(seed=args.seed, count=args.count),
        "sorting-t16": sorting_records(seed=args.seed, count=args.count),
    }
    for name, samples in draws.items():
        path = args.out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in samples))
        print(path, len(samples))
