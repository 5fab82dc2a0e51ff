"""Is the friend's name in the memory of its turn? The demo's friend message alone (or after the name turn),
then the friend question, on held-out people."""

import sys

sys.path.insert(0, "tests")
from test_demo import held_out_people, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import ChatSession
from transformers_ccm.cli import demo_script
from transformers_ccm.embedded import load_tokenizer

tokenizer = load_tokenizer("default")
model = CCMForCausalLM.from_pretrained(sys.argv[1]).eval()
PLANS = {"friend turn only": [4], "name turn + friend turn": [0, 4], "all five": [0, 1, 2, 3, 4]}
for person in held_out_people(int(sys.argv[2])):
    script = demo_script(**person)
    for plan, turns in PLANS.items():
        session = ChatSession(model, tokenizer, max_new_tokens=20)
        for index in turns:
            session.turn(script[index])
        reply = session.turn("What was my friend's name?").reply
        hit = says(reply, person["friend"])
        print(f"{person['name']} {person['friend']} | {plan} | {hit} | {reply}", flush=True)
