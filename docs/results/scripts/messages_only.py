"""Does folding only what the user said, not the assistant's replies, make the demo's facts recalled? Each turn of a
conversation is folded whole, as `ccm demo` does ("turn"), or as the user's message alone ("message": the reply is
generated from the same memory, then left out of it). Three wordings: the demo's, and two others worded unlike it.
Usage: python docs/results/scripts/messages_only.py ADAPTER COUNT."""

import copy
import sys

import torch

sys.path.insert(0, "tests")
from test_demo import ASKED, held_out_people, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import ChatSession
from transformers_ccm.cli import demo_script
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.tasks.vocabulary import with_article


def hiking(name: str, job: str, friend: str) -> list[str]:
    return [
        f"Good morning. This is {name} speaking, nice to meet you.",
        "Is it going to rain this weekend, do you think?",
        f"My buddy {friend} wants to go hiking on Saturday.",
        "Which snacks travel well on a hike?",
        f"I can't stay out late though. Being {with_article(job)} means early Mondays.",
        "Any advice for sleeping better?",
        "Remind me, who wants to go hiking with me?",
        "What do I do for a living?",
        "What did I say my name was?",
    ]


def texting(name: str, job: str, friend: str) -> list[str]:
    return [
        f"hi!! {name} here lol",
        "what's a fun hobby to pick up in winter?",
        f"ok cool. i work as {with_article(job)} btw, pretty stressful job",
        "how do i make pasta sauce from scratch?",
        f"nice. {friend} (my roommate) is a great cook too",
        "tell me a joke",
        "what's my job again?",
        "and my roommate's name?",
        "and mine?",
    ]


# Each wording with the facts its last three messages ask, in order.
WORDINGS = {
    "demo": (demo_script, ASKED),
    "hiking": (hiking, ("friend", "job", "name")),
    "texting": (texting, ("job", "friend", "name")),
}


def replies(model: CCMForCausalLM, script: list[str], messages_only: bool) -> list[str]:
    session = ChatSession(model, tokenizer, max_new_tokens=24)
    said = []
    for message in script:
        if not messages_only:
            said.append(session.turn(message).reply)
            continue
        said.append(ChatSession(model, tokenizer, copy.deepcopy(session.cache), max_new_tokens=24).turn(message).reply)
        turn = (
            session.prompt_ids(message) + tokenizer(session.format.end_of_reply, add_special_tokens=False)["input_ids"]
        )
        with torch.no_grad():
            model.compress(session.cache, torch.tensor([turn]))
    return said


tokenizer = load_tokenizer("default")
model = CCMForCausalLM.from_pretrained(sys.argv[1]).eval()
count = int(sys.argv[2])
for wording, (script_of, asked) in WORDINGS.items():
    # The demo's own user first for its wording; the other wordings take the held-out users after it.
    people = held_out_people(count) if wording == "demo" else held_out_people(count + 1)[1:]
    for mode in ("turn", "message"):
        hits = dict.fromkeys(asked, 0)
        for person in people:
            said = replies(model, script_of(**person), messages_only=mode == "message")
            for fact, reply in zip(asked, said[-3:], strict=True):
                hits[fact] += says(reply, person[fact])
                print(f"{wording} {mode:7s} {fact}={person[fact]!r}: {reply!r}", flush=True)
        print(f"{wording} {mode}: recalled {sum(hits.values())} of {3 * count}: {hits}", flush=True)
