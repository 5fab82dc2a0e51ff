"""People in the user's life: a conversation names several of them, one per turn, and a question asks about one.

The user tells of their sister, their boss, a friend ("My sister Ana just got back from Lisbon."), sometimes with
a job, sometimes their own name too, among small talk. The last question asks which name goes with a relation
("What's my sister's name?"), which relation with a name ("Who is Tom to me?"), a person's job, or the user's own
name; the choices are the same answer with the other people's names (or relations, or jobs) of the same
conversation. Every name in memory is a distractor, so recall has to keep who is who, not only which names were
said: the case where one memory slot per turn most often answers with the wrong person (`ccm demo`'s friend).
Scored by accuracy over the choices.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.dialogue import CHATML, DialogueWording
from transformers_ccm.tasks.facts import CLOSERS, FACTS, OPENERS, SMALL_TALK, fill
from transformers_ccm.tasks.replies import ramble
from transformers_ccm.tasks.vocabulary import Split, with_article, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built, Phrasings, at_answer, in_chat_format


@dataclass(frozen=True)
class Relation:
    """Who someone is to the user ("sister"), and the word list their names come from."""

    word: str
    pool: str = "first_name"


_FEMALE, _MALE = "female_name", "male_name"
RELATIONS = (
    Relation("friend"), Relation("best friend"), Relation("sister", _FEMALE), Relation("brother", _MALE),
    Relation("boss"), Relation("neighbour"), Relation("colleague"), Relation("cousin"), Relation("roommate"),
    Relation("partner"), Relation("mentor"), Relation("aunt", _FEMALE), Relation("uncle", _MALE),
    Relation("daughter", _FEMALE), Relation("son", _MALE), Relation("wife", _FEMALE), Relation("husband", _MALE),
    Relation("teacher"), Relation("coach"), Relation("doctor"), Relation("flatmate"), Relation("niece", _FEMALE),
    Relation("nephew", _MALE), Relation("classmate"), Relation("manager"), Relation("girlfriend", _FEMALE),
    Relation("boyfriend", _MALE), Relation("old school friend"),
)  # fmt: skip
# Relations only unseen wordings name: whether recall carries over to a relation training never asked about.
HELD_OUT_RELATIONS = (
    Relation("landlord", _MALE), Relation("grandmother", _FEMALE), Relation("personal trainer"),
    Relation("godfather", _MALE), Relation("team lead"), Relation("stepsister", _FEMALE),
)  # fmt: skip

# Fields: {r} the relation, {n} the name, {a} the job with its article.
STATEMENTS = Phrasings(
    (
        "My {r} {n} just got back from a trip abroad.",
        "I had lunch with my {r}, {n}, yesterday.",
        "{n}, my {r}, recommended a great book to me.",
        "My {r} is called {n}.",
        "My {r}'s name is {n}.",
        "{n} is my {r}, and we talk every week.",
        "I'm meeting my {r} {n} for coffee later.",
        "My {r} {n} keeps sending me funny videos.",
        "Yesterday my {r} {n} helped me fix my bike.",
        "I was on the phone with my {r}, {n}, for an hour.",
        "My {r} {n} is visiting this weekend.",
        "You'd like my {r}, {n}; everyone does.",
        "{n} (my {r}) says I should ask you.",
        "Last month my {r} {n} moved into a new flat.",
        "My {r}, {n}, is the funniest person I know.",
        "I'm cooking dinner for my {r} {n} tonight.",
        "{n}, who is my {r}, gave me some advice.",
        "I'm planning a surprise party for my {r} {n}.",
        "My {r} {n} lent me a camera for the holidays.",
        "Just got a text from my {r}, {n}.",
        "I've known my {r} {n} for years.",
        "My {r} {n} and I went to a concert on Friday.",
        "{n}, my {r}, is running a marathon soon.",
        "Spent the afternoon with my {r}, {n}.",
        "My {r}, whose name is {n}, lives nearby.",
        "Funny story: my {r} {n} locked the keys in the car again.",
        "I promised my {r} {n} I'd help with the garden.",
        "{n} is my {r}; you'll hear about them a lot.",
    ),
    (
        "I bumped into my {r} {n} at the market.",
        "{n}, my {r}, finally replied to my email.",
        "My {r} goes by {n}.",
        "Went for a walk with my {r} {n} at dawn.",
    ),
)
JOB_STATEMENTS = Phrasings(
    (
        "My {r} {n} works as {a}.",
        "{n}, my {r}, is {a}.",
        "My {r} {n} has just qualified as {a}.",
        "My {r} {n} is {a} at a big company.",
        "{n} (my {r}) has been {a} for ten years.",
        "My {r} is {n}, {a} by trade.",
        "My {r} {n} started a new job as {a}.",
    ),
    ("My {r} {n} earns a living as {a}.", "{n}, my {r}, trained as {a}."),
)
ACKNOWLEDGEMENTS = Phrasings(
    (
        "That sounds nice!",
        "{n} sounds great.",
        "How lovely.",
        "Good to hear.",
        "Say hello to {n} from me!",
        "It's nice to have people like {n} around.",
        "Sounds like a good {r}.",
        "Thanks for sharing that.",
        "That's great to hear.",
        "I hope you have fun with {n}.",
        "Oh nice, tell me more about {n} sometime.",
        "What a story!",
    ),
    ("Lovely, {n} sounds kind.", "What a nice {r} to have."),
)
# What the user asks, and how the assistant answers.
NAME_QUESTIONS = Phrasings(
    (
        "What's my {r}'s name?",
        "Who is my {r}?",
        "What is my {r} called?",
        "Remind me, who's my {r}?",
        "Do you remember my {r}'s name?",
        "What did I say my {r} is called?",
        "Who did I mention as my {r}?",
        "Can you tell me my {r}'s name?",
        "Which name did I give for my {r}?",
        "And my {r}, what's their name?",
    ),
    ("Whom did I call my {r}?", "My {r}, what was their name again?"),
)
NAME_RECALLS = Phrasings(
    (
        "Your {r} is {n}.",
        "Your {r}'s name is {n}.",
        "You said your {r} is {n}.",
        "That's {n}, your {r}.",
        "Your {r} is called {n}.",
    ),
    ("I believe your {r} is {n}.",),
)
RELATION_QUESTIONS = Phrasings(
    (
        "Who is {n} to me?",
        "How do I know {n}?",
        "What did I say {n} is to me?",
        "Remind me who {n} is.",
        "Who's {n} again?",
        "Where do I know {n} from?",
    ),
    ("In what way is {n} connected to me?",),
)
RELATION_RECALLS = Phrasings(
    ("{n} is your {r}.", "You said {n} is your {r}.", "{n}? That's your {r}.", "{n} is your {r}, as you told me."),
    ("You described {n} as your {r}.",),
)
JOB_QUESTIONS = Phrasings(
    (
        "What does my {r} do for a living?",
        "What's my {r}'s job?",
        "What does {n} do for work?",
        "What is {n}'s job?",
        "Remind me what my {r} does.",
        "What work does my {r} do?",
    ),
    ("What line of work is my {r} in?",),
)
JOB_RECALLS = Phrasings(
    ("Your {r} works as {a}.", "{n} is {a}.", "Your {r} is {a}.", "{n} works as {a}."),
    ("From what I recall, {n} is {a}.",),
)

WORDINGS = (
    DialogueWording("people/chatml", CHATML, natural=True),
    DialogueWording("people/chatml-chat", CHATML, natural=True, long_replies=True),
    DialogueWording("people/user-assistant", "User: {user}\nAssistant: {answer}\n"),
    DialogueWording("people/varied", "", natural=True, varied=True),
    DialogueWording("people/chatml-rephrased", CHATML, natural=True, held_out=True),
    DialogueWording("people/a-b", "A: {user}\nB: {answer}\n", natural=True, held_out=True),
)
CHOICES = 3


@dataclass(frozen=True)
class _Person:
    relation: str
    name: str
    job: str | None


def people_sample(
    rng: random.Random, split: Split, steps: int, wording: DialogueWording, chat: TurnFormat = CHATML_FORMAT
) -> Built:
    """A conversation of `steps` exchanges naming one to four people (and maybe the user), and a question about
    one of them whose choices are the answer and the same answer about the others; chat turns as `chat` writes
    them."""
    held_out = wording.held_out
    relations = rng.sample(_relations(held_out), min(steps, rng.randint(2, 4)))
    taken: set[str] = set()
    people = []
    for relation in relations:
        name = rng.choice([w for w in words(relation.pool, split) if w not in taken])
        taken.add(name)
        job = rng.choice(words("job", split)) if rng.random() < 0.4 else None
        people.append(_Person(relation.word, name, job))
    user_name = None
    if len(people) < steps and rng.random() < 0.5:
        user_name = rng.choice([w for w in words("first_name", split) if w not in taken])
    exchanges = [
        (
            _natural(rng, _say((JOB_STATEMENTS if p.job else STATEMENTS).pick(rng, held_out), p), wording),
            _say(ACKNOWLEDGEMENTS.pick(rng, held_out), p),
        )
        for p in people
    ]
    if user_name is not None:
        statement = fill(FACTS["name"].statements.pick(rng, held_out), user_name)
        exchanges.append(
            (_natural(rng, statement, wording), fill(FACTS["name"].acknowledgements.pick(rng, held_out), user_name))
        )
    while len(exchanges) < steps:
        user, assistant = SMALL_TALK.pick(rng, held_out)
        topic = rng.choice(words("word", split))
        exchanges.append((fill(user, topic), fill(assistant, topic)))
    rng.shuffle(exchanges)
    items = tuple(sorted(taken | {p.job for p in people if p.job} | ({user_name} if user_name else set())))
    if wording.long_replies:
        exchanges = [(user, f"{assistant} {ramble(rng, split, held_out, items)}") for user, assistant in exchanges]
    question, answers = _question(rng, split, people, user_name, held_out)
    exchange = in_chat_format(wording.frame(rng), chat)
    options = [at_answer(exchange, answer, user=question)[1] for answer in answers]
    prompt, output = at_answer(exchange, answers[0], user=question)
    rng.shuffle(options)
    contexts = [exchange.format(user=user, answer=assistant) for user, assistant in exchanges]
    return OnlineSample(contexts, prompt, output, choices=options), items


def _relations(held_out: bool) -> tuple[Relation, ...]:
    """The relations a wording may name: unseen wordings also name the held-out ones."""
    return RELATIONS + HELD_OUT_RELATIONS if held_out else RELATIONS


def _say(sentence: str, person: _Person) -> str:
    text = sentence.format(r=person.relation, n=person.name, a=with_article(person.job or ""))
    return text[0].upper() + text[1:]


def _natural(rng: random.Random, said: str, wording: DialogueWording) -> str:
    """`said` among small talk in natural wordings."""
    if not wording.natural:
        return said
    return f"{OPENERS.pick(rng, wording.held_out)} {said} {CLOSERS.pick(rng, wording.held_out)}"


def _question(
    rng: random.Random, split: Split, people: list[_Person], user_name: str | None, held_out: bool
) -> tuple[str, list[str]]:
    """A question about one person (or the user's name), and its answers: the right one first, then the same
    answer about others in the conversation, then about strangers, `CHOICES` in all."""
    kinds = ["name", "name", "relation"] + (["job"] if any(p.job for p in people) else [])
    kinds += ["own name"] if user_name is not None else []
    kind = rng.choice(kinds)
    if user_name is not None and kind == "own name":
        question = FACTS["name"].questions.pick(rng, held_out)
        recall = FACTS["name"].recalls.pick(rng, held_out)
        names = [user_name, *(p.name for p in people)]
        names += _strangers(rng, split, "first_name", names)
        return question, [fill(recall, name) for name in names[:CHOICES]]
    person = rng.choice([p for p in people if p.job] if kind == "job" else people)
    others = [p for p in people if p is not person]
    if kind == "name":
        question, recall = NAME_QUESTIONS.pick(rng, held_out), NAME_RECALLS.pick(rng, held_out)
        values = [person.name, *(p.name for p in others)]
        strangers = _strangers(rng, split, "first_name", values)
        # The user's own name first: the wrong answer a compressed memory gives most (`ccm demo`'s friend).
        values = list(dict.fromkeys([person.name, *([user_name] if user_name else []), *values[1:], *strangers]))
        variants = [_Person(person.relation, name, None) for name in values]
    elif kind == "relation":
        question, recall = RELATION_QUESTIONS.pick(rng, held_out), RELATION_RECALLS.pick(rng, held_out)
        values = [person.relation, *(p.relation for p in others)]
        values += rng.sample([r.word for r in _relations(held_out) if r.word not in values], CHOICES)
        variants = [_Person(relation, person.name, None) for relation in values]
    else:
        question, recall = JOB_QUESTIONS.pick(rng, held_out), JOB_RECALLS.pick(rng, held_out)
        values = list(dict.fromkeys(job for job in (person.job, *(p.job for p in others)) if job is not None))
        values += _strangers(rng, split, "job", values)
        variants = [_Person(person.relation, person.name, job) for job in values]
    return _say(question, person), [_say(recall, variant) for variant in variants[:CHOICES]]


def _strangers(rng: random.Random, split: Split, pool: str, taken: list[str]) -> list[str]:
    """`CHOICES` values of `pool` from `split` that `taken` does not hold."""
    return rng.sample([w for w in words(pool, split) if w not in taken], CHOICES)
