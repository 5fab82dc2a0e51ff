"""Personalization (LaMP-like): a user's past posts form the profile; the question's right answer depends on
what the user revealed in them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.facts import FACTS, SMALL_TALK, draw_facts, fill
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built, Phrasings, at_answer, field_name, in_chat_format


@dataclass(frozen=True)
class ProfileWording:
    """A post (`{post}`) and the question about the user (`{q}`, then `{answer}`). `varied`: both composed anew
    for every user (then `post` and `question` are unused)."""

    id: str
    post: str
    question: str
    held_out: bool = False
    varied: bool = False

    def frames(self, rng: random.Random) -> tuple[str, str]:
        """The post and question templates of one user."""
        return varied_profile(rng) if self.varied else (self.post, self.question)


# Parts of varied profiles. None belongs to a held-out wording (no "Status update", "Question about the author",
# "Reply", quotes, square brackets, "Q)" or "The answer is"), so unseen wordings stay unseen.
_SOURCES = (
    "Post", "Entry", "Shared", "Posted", "Thread", "Blog", "Caption", "Memo", "Feed", "Snippet", "Story", "Remark",
    "Record", "Thought", "Journal", "Log", "Diary", "Comment", "Bio", "Notebook", "Page", "Mention",
)  # fmt: skip
_HANDLES = ("me", "user", "author", "poster", "owner", "writer", "member", "profile")
_QUESTION_KEYS = (
    "Question", "Ask", "Query", "Prompt", "About this person", "About the writer", "About the poster", "Check",
    "Profile check", "Question about them", "Help me recall", "Fact check",
)  # fmt: skip
_ANSWER_KEYS = ("Answer", "Response", "Result", "Solution", "Output", "Filled in", "It is")
_SEPARATORS = (": ", " - ", " > ", " | ", " :: ", " = ")
_POST_ENDINGS = ("\n", "\n", "\n\n", "\n---\n", " //\n")


def varied_profile(rng: random.Random) -> tuple[str, str]:
    """A post template and a question template composed at random: a source label before the post, after it,
    as a heading or a handle; the question and its answer under keys, on one line or two, or as headings."""
    source, separator = field_name(rng, _SOURCES, 0.25), rng.choice(_SEPARATORS)
    layout = rng.randrange(5)
    if layout == 0:
        post = f"{source}{separator}{{post}}"
    elif layout == 1:
        post = f"({source}) {{post}}"
    elif layout == 2:
        post = f"{source}:\n{{post}}"
    elif layout == 3:
        post = f"@{rng.choice(_HANDLES)}{separator}{{post}}"
    else:
        post = f"{{post}} ({source.lower()})"
    question_key, answer_key = field_name(rng, _QUESTION_KEYS, 0.25), field_name(rng, _ANSWER_KEYS, 0.25)
    layout = rng.randrange(3)
    if layout == 0:
        question = f"{question_key}{separator}{{q}}\n{answer_key}{separator}{{answer}}"
    elif layout == 1:
        question = f"{question_key}{separator}{{q}} {answer_key}{separator}{{answer}}"
    else:
        heading = rng.choice(("### ", "## ", "**"))
        close = "**" if heading == "**" else ""
        question = f"{heading}{question_key}{close}\n{{q}}\n{heading}{answer_key}{close}\n{{answer}}"
    return post + rng.choice(_POST_ENDINGS), question


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
    ProfileWording("personalization/varied", "", "", varied=True),
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
    rng: random.Random,
    split: Split,
    steps: int,
    wording: ProfileWording,
    chat: TurnFormat = CHATML_FORMAT,
    choices: int = 3,
) -> Built:
    """A user with `steps` posts (some reveal facts, the rest are filler) and a question about one fact; chat turns as
    `chat` writes them."""
    post_frame, question_frame = (in_chat_format(frame, chat) for frame in wording.frames(rng))
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
    prompt, output = at_answer(question_frame, value, q=question)
    sample = OnlineSample(
        contexts=[post_frame.format(post=post) for post in posts],
        input=prompt,
        output=output,
        choices=[at_answer(question_frame, option, q="")[1] for option in options],
    )
    return sample, (*profile.values(), *options)
