"""Demo recall of adapter directories, as tests/test_demo.py's slow test asks it, on `count` held-out people:
python docs/results/scripts/demo_recall.py COUNT [--full-context] ADAPTER...

With `--full-context` each adapter reads the whole conversation as its prompt (`FullContextChat`): a compression
adapter is then its base model, `ccm:smollm2-full-context` the fine-tuned full-context baseline."""

import sys

sys.path.insert(0, "tests")
from test_demo import ASKED, held_out_people, recalled, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import FullContextChat
from transformers_ccm.cli import demo_script
from transformers_ccm.embedded import load_tokenizer

count = int(sys.argv[1])
full_context = sys.argv[2] == "--full-context"
tokenizer = load_tokenizer("default")
for adapter in sys.argv[3 if full_context else 2 :]:
    model = CCMForCausalLM.from_pretrained(adapter).eval()
    hits = {fact: 0 for fact in ASKED}
    for person in held_out_people(count):
        if full_context:
            chat = FullContextChat(model, tokenizer, max_new_tokens=24)
            replies = list(zip(ASKED, [chat.turn(message) for message in demo_script(**person)][-3:], strict=True))
        else:
            replies = recalled(model, tokenizer, person)
        for fact, reply in replies:
            ok = says(reply, person[fact])
            hits[fact] += ok
            print(f"{adapter} {'OK  ' if ok else 'MISS'} {fact}={person[fact]!r}: {reply!r}")
    print(f"{adapter}: recalled {sum(hits.values())} of {3 * count}: {hits}")
