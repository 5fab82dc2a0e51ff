"""Demo recall of adapter directories, as tests/test_demo.py's slow test asks it, on `count` held-out people:
python docs/results/scripts/demo_recall.py COUNT [--full-context | --alone] ADAPTER...

With `--full-context` each adapter reads the whole conversation as its prompt (`FullContextChat`): a compression
adapter is then its base model, `ccm:smollm2-full-context` the fine-tuned full-context baseline. With `--alone` each
of the three questions is asked on its own copy of the memory the telling turns left, so that no earlier question
or reply is in it."""

import copy
import sys

sys.path.insert(0, "tests")
from test_demo import ASKED, held_out_people, recalled, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import ChatSession, FullContextChat
from transformers_ccm.cli import demo_script
from transformers_ccm.embedded import load_tokenizer


def asked_alone(model: CCMForCausalLM, person: dict[str, str]) -> list[tuple[str, str]]:
    """Each asked fact with the reply to its question, asked on a copy of the memory of the telling turns only."""
    script = demo_script(**person)
    session = ChatSession(model, tokenizer, max_new_tokens=24)
    for message in script[:-3]:
        session.turn(message)
    return [
        (fact, ChatSession(model, tokenizer, copy.deepcopy(session.cache), max_new_tokens=24).turn(question).reply)
        for fact, question in zip(ASKED, script[-3:], strict=True)
    ]


count = int(sys.argv[1])
mode = sys.argv[2] if sys.argv[2] in ("--full-context", "--alone") else None
tokenizer = load_tokenizer("default")
for adapter in sys.argv[3 if mode else 2 :]:
    model = CCMForCausalLM.from_pretrained(adapter).eval()
    hits = {fact: 0 for fact in ASKED}
    for person in held_out_people(count):
        if mode == "--full-context":
            chat = FullContextChat(model, tokenizer, max_new_tokens=24)
            replies = list(zip(ASKED, [chat.turn(message) for message in demo_script(**person)][-3:], strict=True))
        elif mode == "--alone":
            replies = asked_alone(model, person)
        else:
            replies = recalled(model, tokenizer, person)
        for fact, reply in replies:
            ok = says(reply, person[fact])
            hits[fact] += ok
            print(f"{adapter} {'OK  ' if ok else 'MISS'} {fact}={person[fact]!r}: {reply!r}")
    print(f"{adapter}: recalled {sum(hits.values())} of {3 * count}: {hits}")
