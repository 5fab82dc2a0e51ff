"""Personalization (LaMP-like): a user's past posts form the profile; the question's right answer depends on
what the user revealed in them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.facts import FACTS, SMALL_TALK, draw_facts, fill
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import Built, Phrasings, at_answer


@dataclass(frozen=True)
class ProfileWording:
    """A post (`{post}`) and the question about the user (`{q}`, then `{answer}`)."""

    id: str
    post: str
    question: str
    held_out: bool = False


WORDINGS = (
    ProfileWording("personalization/post", "Post: {post}\n", "Question: {q}\nAnswer: {answer}"),
    ProfileWording("personalization/tweet", "Tweet: {post}\n", "Query: {q}\nResponse: {answer}"),
    ProfileWording("personalization/bullet", "- {post}\n", "{q} {answer}"),
    ProfileWording(
        "personalization/journal", "Journal entry: {post}\n\n", "Based on the journal entries: {q}\nAnswer: {answer}"
    ),
    ProfileWording(
        "personalization/chat",
        "<|im_start|>user\n{post}<|im_end|>\n",
        "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n",
    ),
    ProfileWording("personalization/diary", "Diary: {post}\n", "Question for the diarist: {q}\nAnswer: {answer}"),
    ProfileWording("personalization/markdown", "### Post\n{post}\n\n", "### Question\n{q}\n### Answer\n{answer}"),
    ProfileWording(
        "personalization/comment", "Comment by the user: {post}\n", "About this user. {q}\nAnswer: {answer}"
    ),
    ProfileWording("personalization/message", "Message: {post}\n", "User question: {q}\nAssistant: {answer}"),
    ProfileWording(
        "personalization/email", "Email from the user:\n{post}\n\n", "Question about the sender: {q}\nAnswer: {answer}"
    ),
    ProfileWording("personalization/note", "Note: {post}\n", "From these notes. {q}\nAnswer: {answer}"),
    ProfileWording("personalization/plain", "{post}\n", "{q}\n{answer}"),
    ProfileWording(
        "personalization/log", "Log entry: {post}\n", "Question about whoever kept this log: {q}\nAnswer: {answer}"
    ),
    ProfileWording(
        "personalization/review", "Review by the user: {post}\n", "Regarding the reviewer. {q}\nAnswer: {answer}"
    ),
    ProfileWording("personalization/profile", "Profile line: {post}\n", "Profile question: {q}\nAnswer: {answer}"),
    ProfileWording(
        "personalization/status",
        "Status update: {post}\n",
        "Question about the author: {q}\nReply: {answer}",
        held_out=True,
    ),
    ProfileWording("personalization/quote", '"{post}"\n', "{q}\nThe answer is {answer}.", held_out=True),
    ProfileWording("personalization/forum", "[forum] {post}\n", "Q) {q}\nA) {answer}", held_out=True),
)
KINDS = ["job", "country", "language", "color", "home", "friend", "hobby", "pet"]
FILLER = Phrasings(
    (
        "Just finished a good book about {v}.",
        "Thinking about {v} all day long.",
        "Does anyone else care about {v} as much as I do?",
        "Learned something new about {v} today.",
        "Had a lovely walk and thought about {v}.",
        "Not sure what to make of {v} these days.",
        "Coffee first, then {v}.",
        "Who else is tired of hearing about {v}?",
        "Spent the evening reading up on {v}.",
        "Someone asked me about {v} at lunch.",
        "Trying to understand {v} better.",
        "Found a great video on {v}.",
        "Hot take: {v} is overrated.",
        "Writing a short essay on {v}.",
        "Long queue at the shop, so I read about {v}.",
        "Is {v} worth learning about?",
        "Note to self: look into {v}.",
        *(user for user, _ in SMALL_TALK.seen),
    ),
    ("Can't believe how much I've read about {v} this month.", *(user for user, _ in SMALL_TALK.unseen)),
)


def personalization_sample(
    rng: random.Random, split: Split, steps: int, wording: ProfileWording, choices: int = 3
) -> Built:
    """A user with `steps` posts (some reveal facts, the rest are filler) and a question about one fact."""
    profile = draw_facts(rng, split, KINDS, max(1, (steps + 1) // 2))
    posts = [fill(FACTS[kind].statements.pick(rng, wording.held_out), value) for kind, value in profile.items()]
    while len(posts) < steps:
        posts.append(fill(FILLER.pick(rng, wording.held_out), rng.choice(words("word", split))))
    rng.shuffle(posts)
    asked = rng.choice(sorted(profile))
    value = profile[asked]
    pool = [w for w in words(FACTS[asked].pool, split) if w != value]
    options = [value, *rng.sample(pool, choices - 1)]
    rng.shuffle(options)
    question = FACTS[asked].about.pick(rng, wording.held_out)
    prompt, output = at_answer(wording.question, value, q=question)
    sample = OnlineSample(
        contexts=[wording.post.format(post=post) for post in posts],
        input=prompt,
        output=output,
        choices=[at_answer(wording.question, option, q="")[1] for option in options],
    )
    return sample, (*profile.values(), *options)
