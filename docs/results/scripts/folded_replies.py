"""Does the assistant's own reply, folded into memory with its turn, decide what the demo recalls? The demo's
first five turns are folded with the reply the model generates ("generated", as `ccm demo`), with one fixed
neutral reply ("neutral"), or with a right reply that repeats the turn's fact ("echo"); then the three questions
are asked as usual. Usage: python docs/results/scripts/folded_replies.py ADAPTER COUNT."""

import sys

import torch

sys.path.insert(0, "tests")
from test_demo import ASKED, held_out_people, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import ChatSession
from transformers_ccm.cli import demo_script
from transformers_ccm.embedded import load_tokenizer

ECHOES = (
    "Nice to meet you, {name}!",
    "Rest and daylight help.",
    "Good luck at work.",
    "Try a classic novel.",
    "How nice that {friend} recommended it.",
)
FOLDED_REPLIES = {"neutral": ["Thanks for telling me."] * len(ECHOES), "echo": list(ECHOES)}

tokenizer = load_tokenizer("default")
model = CCMForCausalLM.from_pretrained(sys.argv[1]).eval()
hits = {mode: dict.fromkeys(ASKED, 0) for mode in ("generated", *FOLDED_REPLIES)}
for person in held_out_people(int(sys.argv[2])):
    script = demo_script(**person)
    for mode in hits:
        session = ChatSession(model, tokenizer, max_new_tokens=24)
        for index, message in enumerate(script[:-3]):
            if mode == "generated":
                session.turn(message)
                continue
            reply = FOLDED_REPLIES[mode][index].format(**person) + session.format.end_of_reply
            turn = session.prompt_ids(message) + tokenizer(reply, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                model.compress(session.cache, torch.tensor([turn]))
        for fact, question in zip(ASKED, script[-3:], strict=True):
            reply = session.turn(question).reply
            hits[mode][fact] += says(reply, person[fact])
            print(f"{mode:9s} {fact}={person[fact]!r}: {reply!r}", flush=True)
for mode, counts in hits.items():
    print(f"{mode}: {counts}")
