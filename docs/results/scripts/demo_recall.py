"""Demo recall of adapter directories, as tests/test_demo.py's slow test asks it, on `count` held-out people."""

import sys

sys.path.insert(0, "tests")
from test_demo import ASKED, held_out_people, recalled, says
from transformers_ccm import CCMForCausalLM
from transformers_ccm.embedded import load_tokenizer

count = int(sys.argv[1])
tokenizer = load_tokenizer("default")
for adapter in sys.argv[2:]:
    model = CCMForCausalLM.from_pretrained(adapter).eval()
    hits = {fact: 0 for fact in ASKED}
    for person in held_out_people(count):
        for fact, reply in recalled(model, tokenizer, person):
            ok = says(reply, person[fact])
            hits[fact] += ok
            print(f"{adapter} {'OK  ' if ok else 'MISS'} {fact}={person[fact]!r}: {reply!r}")
    print(f"{adapter}: recalled {sum(hits.values())} of {3 * count}: {hits}")
