"""`ccm demo`'s promise on the real model: it recalls names and jobs, never seen in training, that a user
mentioned among small talk."""

import random
import re

import pytest
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm import CCMForCausalLM
from transformers_ccm.chat import ChatSession
from transformers_ccm.cli import DEMO_FACTS, demo_script
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.tasks.dialogue import ASIDES
from transformers_ccm.tasks.people import NAME_QUESTIONS
from transformers_ccm.tasks.vocabulary import in_test_split, words

ASKED = ("name", "job", "friend")  # what the last three messages of the script ask, in order


def test_the_demo_uses_held_out_facts_and_asks_last():
    assert all(in_test_split(value) for value in DEMO_FACTS.values())
    script = demo_script(**DEMO_FACTS)
    told = "".join(script[:-3])
    assert all(value in told for value in DEMO_FACTS.values())
    assert not any(value in message for value in DEMO_FACTS.values() for message in script[-3:])


def test_the_demo_asks_as_no_training_sample_does():
    """The chat family asks with asides too; none of them (seen or held out) opens a demo question, and no question
    of the people family asks as the demo's friend question does."""
    asides = (*ASIDES.seen, *ASIDES.unseen)
    questions = demo_script(**DEMO_FACTS)[-3:]
    assert not [message for message in questions if message.startswith(asides)]
    about_a_friend = {q.format(r="friend", n="George") for q in (*NAME_QUESTIONS.seen, *NAME_QUESTIONS.unseen)}
    assert not about_a_friend & set(questions)


def held_out_people(count: int) -> list[dict[str, str]]:
    """The demo's user, then others made of test-split names and jobs."""
    rng = random.Random(0)
    people = [DEMO_FACTS]
    while len(people) < count:
        name, friend = rng.sample(words("first_name", "test"), 2)
        people.append({"name": name, "job": rng.choice(words("job", "test")), "friend": friend})
    return people


def recalled(
    model: CCMForCausalLM, tokenizer: PreTrainedTokenizerBase, person: dict[str, str]
) -> list[tuple[str, str]]:
    """The demo conversation for `person` in compressed memory: each asked fact with the reply to its question."""
    session = ChatSession(model, tokenizer, max_new_tokens=24)
    replies = [session.turn(message).reply for message in demo_script(**person)]
    return list(zip(ASKED, replies[-3:], strict=True))


def says(reply: str, value: str) -> bool:
    """Whether `reply` names `value` as whole words, in any case ("Jordanian" does not name "Jordan")."""
    return re.search(rf"\b{re.escape(value)}\b", reply, flags=re.IGNORECASE) is not None


def test_a_reply_names_a_fact_only_as_whole_words():
    assert says("You're Jordan.", "Jordan") and says("You work as a Glass Blower/Designer.", "glass blower/designer")
    assert not says("You told me Jordanian.", "Jordan") and not says("Your friend is Annabel.", "Anna")


@pytest.mark.slow
def test_concat_adapter_recalls_held_out_names_jobs_and_friends():
    model = CCMForCausalLM.from_pretrained("ccm:smollm2-concat").eval()
    tokenizer = load_tokenizer("default")
    missed = []
    for person in held_out_people(4):
        for fact, reply in recalled(model, tokenizer, person):
            if not says(reply, person[fact]):
                missed.append((fact, person[fact], reply))
    assert not missed, f"{len(missed)} of {3 * 4} facts not recalled: {missed}"
