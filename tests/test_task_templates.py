"""Built-in tasks write their chat wordings in the model's own chat template, as `ccm chat` talks to it."""

import argparse
import copy
import functools
import hashlib
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_chat import (
    GEMMA_TEMPLATE,
    LLAMA_2_TEMPLATE,
    LLAMA_3_TEMPLATE,
    MISTRAL_TEMPLATE,
    MISTRAL_V3_TEMPLATE,
    _with_template,
)
from tiny_models import sentencepiece_tokenizer
from transformers_ccm.cli import _evaluation_sets, _load_samples, main
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.tasks import MIXTURE, TASKS, WORDINGS, has_unseen_wordings, make_task_samples
from transformers_ccm.tasks.wordings import CHATML_FORMAT, chat_format

# Qwen2.5's template, reduced: ChatML with a default system prompt before the first message.
QWEN_2_5_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Markers with braces, which the wordings' str.format templates must keep as text.
BRACED_TEMPLATE = (
    "{% for m in messages %}{{ '{' + m['role'] + '}: ' + m['content'] + ' {end}\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '{assistant}: ' }}{% endif %}"
)
# The digests of the samples SmolLM2's tokenizer gets (those the shipped adapters and docs/results.md were made from;
# `grouping`'s since 2026-11-28, when items that belonged to two groups were drawn again).
PINNED = {
    "icl/train/seen": "f2f64bc62a43257e",
    "icl/test/seen": "7bae27bb6acaeb8e",
    "icl/test/unseen": "4ad5aa109fbe08cb",
    "icl/test/all": "9f3c9e8dc13fd779",
    "personalization/train/seen": "3fe5888154debef4",
    "personalization/test/seen": "59860c9f6c8c02b5",
    "personalization/test/unseen": "d676d120a2e79315",
    "personalization/test/all": "6625b661f3552717",
    "dialogue/train/seen": "b0b1830b9983ced5",
    "dialogue/test/seen": "2ca6ef2984059d3f",
    "dialogue/test/unseen": "17b4b2bf23407951",
    "dialogue/test/all": "56f05ed760995754",
    "chat/train/seen": "234ebefb002a9ffa",
    "chat/test/seen": "4556003ff7084ca6",
    "chat/test/unseen": "db187b14d9443552",
    "chat/test/all": "4c8283567207f9d1",
    "document/train/seen": "b259c7bf4ecfaf48",
    "document/test/seen": "ce69b10527d4fb5b",
    "document/test/all": "f0d1bdb1c501fbb5",
    "people/train/seen": "7e659d679366af4d",
    "people/test/seen": "cb395d988c920f2f",
    "people/test/unseen": "ef7d6be398892743",
    "people/test/all": "4686b027ffbcdb4f",
    "grouping/train/seen": "87fe21d2bd5a8171",
    "grouping/test/seen": "885c9bfebc5ef82d",
    "grouping/test/unseen": "a9e8fd5c02673c7d",
    "grouping/test/all": "6fae83020e81ab0e",
    "mixture/train/seen": "ae0c054b56adb96a",
    "mixture/test/seen": "f49f0b5d262f5855",
    "mixture/test/unseen": "5936526a17c97078",
    "mixture/test/all": "eb867c02c0b84fe7",
    "grouping:2,people:1/train/seen": "2fc64555c3d14ba8",
    "grouping:2,people:1/test/seen": "288b2532216a5be1",
    "grouping:2,people:1/test/unseen": "47d14915631aa507",
    "grouping:2,people:1/test/all": "e6a90ef003d666d4",
}
CHAT_FAMILIES = ("icl", "personalization", "dialogue", "chat", "people", "grouping")
ROLES = ("user", "assistant")
_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n(.*?)<\|im_end\|>\n", re.DOTALL)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("default")


# Templates written on a SentencePiece tokenizer with their markers (and `<s>`, `</s>`); the others on SmolLM2's.
_SENTENCEPIECE = {"mistral": MISTRAL_TEMPLATE, "mistral-v3": MISTRAL_V3_TEMPLATE, "llama-2": LLAMA_2_TEMPLATE}
TEMPLATES = ["llama-3", "gemma", *_SENTENCEPIECE]
MARKERS = {"llama-3": "<|start_header_id|>user<|end_header_id|>", "gemma": "<start_of_turn>"}


@functools.cache
def _sentencepiece(name: str):
    return sentencepiece_tokenizer(_SENTENCEPIECE[name])


def _templated(smollm2, name: str):
    """A real tokenizer with the chat template `name`."""
    if name in _SENTENCEPIECE:
        return _sentencepiece(name)
    return _with_template(smollm2, {"llama-3": LLAMA_3_TEMPLATE, "gemma": GEMMA_TEMPLATE}[name])


def _digests(tokenizer) -> dict[str, str]:
    """A digest of the samples of every task, split and wording set, over two seeds and three time-step settings."""
    digests = {}
    for task in [*TASKS, MIXTURE, "grouping:2,people:1"]:
        for split, wordings in (("train", "seen"), ("test", "seen"), ("test", "unseen"), ("test", "all")):
            if wordings == "unseen" and not has_unseen_wordings(task):
                continue
            digest = hashlib.sha256()
            for seed in (0, 7):
                for steps in (None, 1, 3):
                    for built in make_task_samples(task, split, 24, seed, steps, wordings, tokenizer):
                        sample = built.sample
                        record = [sample.contexts, sample.input, sample.output, sample.choices, built.wording]
                        digest.update(json.dumps([*record, built.items]).encode())
            digests[f"{task}/{split}/{wordings}"] = digest.hexdigest()[:16]
    return digests


def test_smollm2_and_chatml_templates_keep_every_sample_byte_for_byte(smollm2):
    """SmolLM2's tokenizer, no tokenizer, a tokenizer without a template, and Qwen2.5's template (ChatML with a default
    system prompt, which a turn never holds) give the samples the shipped adapters and results were made from."""
    assert chat_format(smollm2) == CHATML_FORMAT
    untemplated = copy.deepcopy(smollm2)
    untemplated.chat_template = None
    qwen = copy.deepcopy(smollm2)
    qwen.chat_template = QWEN_2_5_TEMPLATE
    for tokenizer in (smollm2, None, untemplated, qwen):
        assert _digests(tokenizer) == PINNED


def test_a_template_chat_cannot_use_keeps_chatml(smollm2):
    """A template that does not write a conversation as turns, or refuses user and assistant messages alone, gives
    ChatML (the model is never talked to in turns), not a refusal of every built-in task."""
    rewriting = copy.deepcopy(smollm2)  # an end of text after the whole conversation, wherever it ends
    rewriting.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}<|endoftext|>"
    )
    needs_system = copy.deepcopy(smollm2)
    needs_system.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('A system message is required') }}{% endif %}"
        + smollm2.chat_template
    )
    for tokenizer in (rewriting, needs_system):
        assert chat_format(tokenizer) == CHATML_FORMAT
        for task in CHAT_FAMILIES:
            assert make_task_samples(task, "test", 16, 2, tokenizer=tokenizer) == make_task_samples(task, "test", 16, 2)


def _is_chat(text: str) -> bool:
    return "<|im_start|>" in text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    template=st.sampled_from(TEMPLATES),
    task=st.sampled_from(CHAT_FAMILIES),
    wordings=st.sampled_from(["seen", "unseen", "all"]),
    seed=st.integers(0, 10**6),
    steps=st.integers(1, 5),
)
def test_chat_wordings_are_written_as_the_models_template_writes_the_conversation(
    smollm2, template, task, wordings, seed, steps
):
    """Each sample differs from SmolLM2's only in its chat turns: where SmolLM2's is ChatML, the other holds none of
    it, and an exchange (a user turn and its reply) is the conversation as the model's template writes it, after its
    own preamble (the BOS), up to the reply as `ccm chat` folds it: with the space Llama 2 and Mistral v0.3 write
    before a reply ("[/INST] Paris"), which the prompt leaves for the model to write."""
    tokenizer = _templated(smollm2, template)
    if wordings == "unseen" and not has_unseen_wordings(task):
        wordings = "all"
    chatml = make_task_samples(task, "test", 8, seed, steps, wordings)
    written = make_task_samples(task, "test", 8, seed, steps, wordings, tokenizer)
    for before, after in zip(chatml, written, strict=True):
        assert (before.wording, before.items, len(after.sample.contexts)) == (after.wording, after.items, steps)
        texts = [*before.sample.contexts, before.sample.input, before.sample.output, *(before.sample.choices or [])]
        if not any(map(_is_chat, texts)):
            assert after.sample == before.sample
            continue
        whole = "".join(after.sample.contexts) + after.sample.input
        assert MARKERS.get(template, "[INST]") in whole and "<|im_start|>" not in whole + after.sample.output
        if before.wording == "personalization/chat":  # posts are user turns with no reply: no conversation to check
            continue
        # The conversation read from SmolLM2's sample: every exchange, the question and the reply (some replies begin
        # in the input: "Put it in" + " T2.").
        chatml = "".join(before.sample.contexts) + before.sample.input + before.sample.output + "\n"
        turns = _TURN.findall(chatml)
        assert (
            "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n" for u, a in turns)
            == chatml
        )
        messages = [{"role": role, "content": text} for turn in turns for role, text in zip(ROLES, turn, strict=True)]
        assert len(messages) == 2 * (steps + 1)
        conversation = tokenizer.apply_chat_template(messages, tokenize=False)
        text = whole + after.sample.output
        start = conversation.find(text)
        preamble = conversation[:start]
        assert start >= 0 and conversation[start:].rstrip() == text.rstrip()
        assert not any(m["content"] in preamble for m in messages)
        # Where `ccm chat` starts the reply: the sample's input is that prompt (and any start of the reply after it).
        prompted = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert (preamble + whole).startswith(prompted)


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_chat_wording_of_every_family_is_written_in_the_template(smollm2, template):
    tokenizer = _templated(smollm2, template)
    for family in CHAT_FAMILIES:
        chatml = make_task_samples(family, "test", 96, seed=1, steps=2, wordings="all")
        written = make_task_samples(family, "test", 96, seed=1, steps=2, wordings="all", tokenizer=tokenizer)
        chat_wordings = {b.wording for b in chatml if _is_chat(b.sample.input)}
        # The wordings written in ChatML, or composing chat turns anew for every sample
        expected = {w.id for w in WORDINGS[family] if "<|im_start|>" in repr(w) or getattr(w, "form", None) == "chat"}
        assert chat_wordings == expected and expected
        for built in written:
            assert not any(map(_is_chat, [*built.sample.contexts, built.sample.input]))


def test_markers_with_braces_stay_text(smollm2):
    braced = copy.deepcopy(smollm2)
    braced.chat_template = BRACED_TEMPLATE
    for built in make_task_samples("grouping", "test", 40, seed=3, steps=2, wordings="all", tokenizer=braced):
        if built.wording == "grouping/chat":
            # the space before the answer goes with it, as in every wording (a BPE tokenizer writes " word")
            assert built.sample.input.startswith("{user}: ") and built.sample.input.endswith(" {end}\n{assistant}:")
            assert built.sample.output.startswith(" ") and built.sample.output.endswith(" {end}")
            assert all(context.endswith(" {end}\n") for context in built.sample.contexts)
            return
    raise AssertionError("no grouping/chat sample drawn")


@pytest.mark.parametrize("template", ["llama-3", "gemma"])
def test_ccm_train_and_eval_write_chat_wordings_in_the_models_template(smollm2, template):
    """What `ccm train` trains on and `ccm eval` scores: the samples of the model's tokenizer."""
    tokenizer = _templated(smollm2, template)
    trained, rows = _load_samples("dialogue", "train", 24, 0, lambda: tokenizer, 4)
    assert rows is None  # lines only for a JSONL file
    assert trained == [b.sample for b in make_task_samples("dialogue", "train", 24, 0, tokenizer=tokenizer)]
    assert any(_is_chat(b.sample.input) for b in make_task_samples("dialogue", "train", 24, 0))
    assert not any(_is_chat(sample.input) for sample in trained)
    args = argparse.Namespace(samples=6, seed=0, steps=[2])
    for wordings, steps, samples, _, lines in _evaluation_sets("chat", args, tokenizer):
        assert lines is None  # lines only for a JSONL file
        drawn = make_task_samples("chat", "test", 6, 0, steps, wordings, tokenizer)
        assert samples == [b.sample for b in drawn]
        assert not any(_is_chat(s.input) for s in samples)


def test_ccm_train_refuses_a_bad_task_or_file_before_the_tokenizer_loads(tmp_path, capsys):
    """Built-in tasks load the tokenizer to write their chat turns: an unknown task, or a bad JSONL file for the other
    split, is still refused first, naming itself, not the model that could not load."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"contexts": ["c"], "input": 5}\n')
    for arguments, message in (
        (["--task", "qa"], "Unknown task 'qa'"),
        (["--task", "txt"], "ccm train also takes text or text-varied"),
        (["--task", "icl:2,qa:1"], "Unknown task 'qa'"),
        (["--task", "icl", "--eval-task", str(bad)], "bad.jsonl:1: 'input' must be a string"),
        (["--task", str(bad), "--eval-task", "dialogue"], "bad.jsonl:1: 'input' must be a string"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), *arguments])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
