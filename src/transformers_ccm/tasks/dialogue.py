"""Conversation: multi-turn dialogues in which the user shares facts that a later turn recalls.

Each context is one earlier exchange (user and assistant), in ChatML or as a plain transcript; in natural
wordings the user mentions facts among small talk ("Long day today. I'm an architect by profession. What
about you?"). The input is the user's last message, asking about one fact; the output is the assistant's
reply, which needs the earlier turns. Scored by perplexity.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.facts import CLOSERS, FACTS, OPENERS, SMALL_TALK, draw_facts, fill
from transformers_ccm.tasks.vocabulary import Split, words
from transformers_ccm.tasks.wordings import Built, at_answer


@dataclass(frozen=True)
class DialogueWording:
    """One exchange (`{user}`, then `{answer}` for the assistant); `natural`: facts come among small talk."""

    id: str
    exchange: str
    natural: bool = False
    held_out: bool = False


CHATML = "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
WORDINGS = (
    DialogueWording("dialogue/chatml", CHATML),
    DialogueWording("dialogue/chatml-natural", CHATML, natural=True),
    DialogueWording("dialogue/user-assistant", "User: {user}\nAssistant: {answer}\n"),
    DialogueWording("dialogue/human-ai-natural", "Human: {user}\nAI: {answer}\n\n", natural=True),
    DialogueWording("dialogue/chatml-rephrased", CHATML, natural=True, held_out=True),
    DialogueWording("dialogue/a-b", "A: {user}\nB: {answer}\n", natural=True, held_out=True),
    DialogueWording("dialogue/bracketed", "[user] {user}\n[assistant] {answer}\n", held_out=True),
)
KINDS = sorted(FACTS)


def dialogue_sample(rng: random.Random, split: Split, steps: int, wording: DialogueWording) -> Built:
    """A dialogue with `steps` earlier exchanges, some sharing facts, and a last turn recalling one of them."""
    held_out = wording.held_out
    facts = draw_facts(rng, split, KINDS, max(1, (steps + 1) // 2))
    exchanges = []
    for kind, value in facts.items():
        user = fill(FACTS[kind].statements.pick(rng, held_out), value)
        if wording.natural:
            user = f"{OPENERS.pick(rng, held_out)} {user} {CLOSERS.pick(rng, held_out)}"
        exchanges.append((user, fill(FACTS[kind].acknowledgements.pick(rng, held_out), value)))
    while len(exchanges) < steps:
        user, assistant = SMALL_TALK.pick(rng, held_out)
        topic = rng.choice(words("word", split))
        exchanges.append((fill(user, topic), fill(assistant, topic)))
    rng.shuffle(exchanges)
    asked = rng.choice(sorted(facts))
    recall = fill(FACTS[asked].recalls.pick(rng, held_out), facts[asked])
    prompt, output = at_answer(wording.exchange, recall, user=FACTS[asked].questions.pick(rng, held_out))
    contexts = [wording.exchange.format(user=user, answer=assistant) for user, assistant in exchanges]
    return OnlineSample(contexts, prompt, output), tuple(facts.values())
