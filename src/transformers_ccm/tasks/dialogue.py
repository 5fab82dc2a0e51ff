"""Conversation: multi-turn dialogues in which the user shares facts that a later turn recalls.

Each context is one earlier exchange (user and assistant), in ChatML or as a plain transcript; in natural
wordings the user mentions facts among small talk ("Long day today. I'm an architect by profession. What
about you?"). The input is the user's last message, asking about one fact; the output is the assistant's
reply, which needs the earlier turns. Scored by perplexity.

The `chat` family is the same conversation as a chat model holds it: every assistant reply runs on for several
sentences (`replies.ramble`), earlier turns may already have asked about other facts, and the last question
comes with an aside ("By the way, what is my name?").

Training dialogues mention a friend beside the user's name (and the like) in about half of the draws that mention
either (`facts.with_lookalike`), so that recall learns to tell two names apart; test dialogues draw kinds uniformly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.facts import CLOSERS, FACTS, OPENERS, SMALL_TALK, draw_facts, fill, with_lookalike
from transformers_ccm.tasks.replies import ramble
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import CHATML_FORMAT, Built, Phrasings, at_answer, in_chat_format


@dataclass(frozen=True)
class DialogueWording:
    """One exchange (`{user}`, then `{answer}` for the assistant); `natural`: facts come among small talk;
    `long_replies`: the assistant rambles on as a chat model does (the `chat` family); `varied`: speakers and
    layout composed anew for every dialogue (then `exchange` is unused)."""

    id: str
    exchange: str
    natural: bool = False
    held_out: bool = False
    long_replies: bool = False
    varied: bool = False

    def frame(self, rng: random.Random) -> str:
        """The exchange template of one dialogue."""
        return varied_exchange(rng) if self.varied else self.exchange


# Parts of varied transcripts. None belongs to a held-out wording of any family (no "A"/"B", "Me"/"Helper", square
# brackets or personalization's "Reply"), and no upper-case name ends in "A" or "B", so unseen wordings stay unseen.
_USER_NAMES = (
    "User", "Human", "Customer", "Client", "Guest", "Visitor", "Caller", "Student", "Patient", "Member", "Reader",
    "Person", "Traveller", "Learner", "You", "Shopper", "Player", "Writer", "Friend", "Parent",
)  # fmt: skip
_ASSISTANT_NAMES = (
    "Assistant", "AI", "Agent", "Support", "Host", "Advisor", "Chatbot", "Model", "Tutor", "Guide", "Companion",
    "Operator", "Concierge", "Bot", "Expert", "Coach", "Librarian", "Mentor", "Service", "Responder",
)  # fmt: skip
_SPEAKER_SEPARATORS = (": ", ": ", " - ", " > ", " | ", ":: ")


def varied_exchange(rng: random.Random) -> str:
    """An exchange template composed at random: speaker names (as written, lower or upper case) before each turn on
    its line, as headings above it, or in angle brackets; one of several endings."""
    case = rng.choice((str.strip, str.strip, str.lower, str.upper))  # as written, or all lower or upper case
    user, assistant = case(rng.choice(_USER_NAMES)), case(rng.choice(_ASSISTANT_NAMES))
    layout = rng.randrange(3)
    if layout == 0:
        separator = rng.choice(_SPEAKER_SEPARATORS)
        body = f"{user}{separator}{{user}}\n{assistant}{separator}{{answer}}"
    elif layout == 1:
        heading = rng.choice(("### ", "## ", "**"))
        close = ":**" if heading == "**" else ""
        body = f"{heading}{user}{close}\n{{user}}\n{heading}{assistant}{close}\n{{answer}}"
    else:
        body = f"<{user}> {{user}}\n<{assistant}> {{answer}}"
    return body + rng.choice(("\n", "\n", "\n\n", "\n---\n"))


CHATML = "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
WORDINGS = (
    DialogueWording("dialogue/chatml", CHATML),
    DialogueWording("dialogue/chatml-natural", CHATML, natural=True),
    DialogueWording("dialogue/user-assistant", "User: {user}\nAssistant: {answer}\n"),
    DialogueWording("dialogue/human-ai-natural", "Human: {user}\nAI: {answer}\n\n", natural=True),
    DialogueWording("dialogue/varied", "", varied=True),
    DialogueWording("dialogue/chatml-rephrased", CHATML, natural=True, held_out=True),
    DialogueWording("dialogue/a-b", "A: {user}\nB: {answer}\n", natural=True, held_out=True),
    DialogueWording("dialogue/bracketed", "[user] {user}\n[assistant] {answer}\n", held_out=True),
)
CHAT_WORDINGS = (
    DialogueWording("chat/chatml", CHATML, natural=True, long_replies=True),
    DialogueWording("chat/chatml-plain", CHATML, long_replies=True),
    DialogueWording("chat/user-assistant", "User: {user}\nAssistant: {answer}\n\n", natural=True, long_replies=True),
    DialogueWording("chat/you-bot", "You: {user}\nBot: {answer}\n", natural=True, long_replies=True),
    DialogueWording("chat/varied", "", natural=True, long_replies=True, varied=True),
    DialogueWording("chat/chatml-rephrased", CHATML, natural=True, held_out=True, long_replies=True),
    DialogueWording(
        "chat/me-helper", "Me: {user}\nHelper: {answer}\n\n", natural=True, held_out=True, long_replies=True
    ),
)
# Said before the last question of a chat, lower-casing the question: "By the way, what is my name?". None is
# the demo's ("Quick check:", "And"), so that `ccm demo` asks as no training sample does.
ASIDES = Phrasings(
    (
        "By the way,",
        "One more thing:",
        "Before I forget,",
        "Okay, so",
        "Hmm,",
        "Oh right,",
        "Also,",
        "So,",
        "Actually,",
        "Wait,",
        "Just wondering,",
        "Oh, and",
        "Question for you:",
        "Let me check something:",
        "Real quick,",
        "Anyway,",
        "Now,",
        "Also, I was wondering,",
        "Sorry, one question:",
        "Just to check,",
    ),
    ("Random question:", "Also, just curious,"),
)
KINDS = sorted(FACTS)


def dialogue_sample(
    rng: random.Random, split: Split, steps: int, wording: DialogueWording, chat: TurnFormat = CHATML_FORMAT
) -> Built:
    """A dialogue with `steps` earlier exchanges, some sharing facts, and a last turn recalling one of them; chat turns
    as `chat` writes them."""
    held_out = wording.held_out
    facts = draw_facts(rng, split, KINDS, max(1, (steps + 1) // 2))
    if split == "train":  # test dialogues keep uniform draws, so their samples and scores stay comparable
        facts = with_lookalike(rng, split, facts)
    # A chat may already have asked about other facts (as the demo does), in its last turns before the question.
    asked_before = rng.randint(0, min(2, len(facts) - 1, steps - len(facts))) if wording.long_replies else 0
    exchanges = []
    for kind, value in facts.items():
        user = fill(FACTS[kind].statements.pick(rng, held_out), value)
        if wording.natural:
            user = f"{OPENERS.pick(rng, held_out)} {user} {CLOSERS.pick(rng, held_out)}"
        exchanges.append((user, fill(FACTS[kind].acknowledgements.pick(rng, held_out), value)))
    while len(exchanges) + asked_before < steps:
        user, assistant = SMALL_TALK.pick(rng, held_out)
        topic = rng.choice(words("word", split))
        exchanges.append((fill(user, topic), fill(assistant, topic)))
    rng.shuffle(exchanges)
    asked = rng.choice(sorted(facts))
    recall = fill(FACTS[asked].recalls.pick(rng, held_out), facts[asked])
    question = FACTS[asked].questions.pick(rng, held_out)
    if wording.long_replies:
        avoid = tuple(facts.values())
        exchanges = [(user, f"{assistant} {ramble(rng, split, held_out, avoid)}") for user, assistant in exchanges]
        for kind in rng.sample([kind for kind in sorted(facts) if kind != asked], asked_before):
            answer = fill(FACTS[kind].recalls.pick(rng, held_out), facts[kind])
            exchanges.append((_with_aside(rng, FACTS[kind].questions.pick(rng, held_out), held_out), answer))
        question = _with_aside(rng, question, held_out)
    exchange = in_chat_format(wording.frame(rng), chat)
    prompt, output = at_answer(exchange, recall, user=question)
    contexts = [exchange.format(user=user, answer=assistant) for user, assistant in exchanges]
    return OnlineSample(contexts, prompt, output), tuple(facts.values())


def _with_aside(rng: random.Random, question: str, held_out: bool) -> str:
    return f"{ASIDES.pick(rng, held_out)} {question[0].lower()}{question[1:]}"
