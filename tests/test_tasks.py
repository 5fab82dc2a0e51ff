"""Built-in online tasks and the JSONL format."""

import json
import os
import random
import re
import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crafted_files import pipe_feeding
from transformers_ccm import OnlineSample
from transformers_ccm.tasks import (
    EVAL_STEPS,
    MAX_STEPS,
    METRIC,
    MIXTURE,
    MIXTURE_FAMILIES,
    TASKS,
    WORDINGS,
    icl,
    load_jsonl,
    make_samples,
    make_task_samples,
    people,
    save_jsonl,
    wording_ids,
)
from transformers_ccm.tasks.dialogue import ASIDES, varied_exchange
from transformers_ccm.tasks.document import passages
from transformers_ccm.tasks.facts import CLOSERS, FACTS, OPENERS, SMALL_TALK, draw_facts, with_lookalike
from transformers_ccm.tasks.grouping import ITEM_KINDS, composed_line, composed_turns, grouping_sample
from transformers_ccm.tasks.icl import varied_frame
from transformers_ccm.tasks.personalization import FILLER, varied_profile
from transformers_ccm.tasks.replies import LIST_INTROS, SENTENCES, TIPS, ramble
from transformers_ccm.tasks.vocabulary import POOLS, in_test_split, words
from transformers_ccm.tasks.wordings import Phrasings, at_answer
from transformers_ccm.validation import first_repeated


@pytest.mark.parametrize("task", [*TASKS, MIXTURE])
def test_deterministic_by_seed(task):
    assert make_samples(task, "train", 12, seed=3) == make_samples(task, "train", 12, seed=3)
    assert make_samples(task, "train", 12, seed=3) != make_samples(task, "train", 12, seed=4)
    assert make_samples(task, "train", 12, seed=3) != make_samples(task, "test", 12, seed=3)


def test_samples_drawn_in_several_threads_at_once_are_those_drawn_alone():
    """The document family's Faker prose comes from one Faker that each call seeds and draws from: calls in several
    threads at once drew from one another's seeds, so a seed no longer gave its samples."""
    draws = [(task, seed) for task in (*TASKS, MIXTURE) for seed in range(2)] + [("document", seed) for seed in (2, 3)]
    alone = [make_samples(task, "train", 60, seed=seed) for task, seed in draws]
    together: dict[int, list[OnlineSample]] = {}
    start = threading.Barrier(len(draws))

    def draw(index: int) -> None:
        start.wait()
        together[index] = make_samples(*draws[index][:1], "train", 60, seed=draws[index][1])

    threads = [threading.Thread(target=draw, args=(index,)) for index in range(len(draws))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [index for index in range(len(draws)) if together[index] != alone[index]] == []


@pytest.mark.parametrize("pool", POOLS)
def test_pools_split_by_identity(pool):
    train, test = set(words(pool, "train")), set(words(pool, "test"))
    assert train and test and not train & test
    assert all(in_test_split(item) for item in test)


TEST_ITEMS = {w for pool in POOLS for w in words(pool, "test")}
FAMILIES_WITH_ITEMS = ["icl", "personalization", "dialogue", "chat", "people", "grouping"]


def _text(sample):
    return "".join(sample.contexts) + sample.input + (sample.output or "") + "".join(sample.choices or ())


@pytest.mark.parametrize("task", FAMILIES_WITH_ITEMS)
def test_test_samples_use_only_test_items(task):
    """Test tasks, users and dialogues are built only from held-out items: never seen in training."""
    for built in make_task_samples(task, "test", 60, seed=1):
        assert built.items and all(item in TEST_ITEMS for item in built.items), built.items
        assert all(item.lower() in _text(built.sample).lower() for item in built.items)


def test_documents_come_from_the_split():
    for built in make_task_samples("document", "test", 40, seed=1):
        sample = built.sample
        if built.wording == "document/reference":
            assert all(context.strip() in passages("test") for context in sample.contexts)
            assert f"{sample.input}{sample.output}" in passages("test")
        else:
            text = re.findall(r"[a-z]+", _text(sample).lower())
            assert text and set(text) <= set(words("word", "test"))


@pytest.mark.parametrize("task", list(TASKS))
@settings(max_examples=10, deadline=None)
@given(steps=st.integers(1, 16), seed=st.integers(0, 10_000))
@example(steps=4, seed=49)  # a Faker passage of three words once left the document output empty
def test_format(task, steps, seed):
    steps = min(steps, MAX_STEPS[task])
    (built,) = make_task_samples(task, "train", 1, seed=seed, steps=steps)
    sample = built.sample
    assert built.task == task and built.wording.startswith(f"{task}/") and not built.held_out
    assert len(sample.contexts) == steps
    assert all(isinstance(c, str) and c for c in sample.contexts)
    assert sample.input and sample.output.strip()
    if METRIC[task] == "perplexity":
        assert sample.choices is None
    else:
        assert sample.output in sample.choices and len(set(sample.choices)) == len(sample.choices) >= 2
    if "<|im_start|>" in sample.input:
        assert sample.output.endswith("<|im_end|>") and all(c.endswith("<|im_end|>\n") for c in sample.contexts)


def test_answers_need_the_contexts():
    """The asked fact appears in the contexts (in whatever phrasing), not only in the question."""
    for task in ("personalization", "dialogue", "chat"):
        for built in make_task_samples(task, "test", 40, seed=2, steps=6):
            sample = built.sample
            answers = [item for item in built.items if item.lower() in sample.output.lower()]
            assert answers and all(answer.lower() in "".join(sample.contexts).lower() for answer in answers)
            assert not any(answer.lower() in sample.input.lower() for answer in answers)


@pytest.mark.parametrize("task", FAMILIES_WITH_ITEMS)
def test_wordings_are_many_and_some_held_out(task):
    seen, unseen = wording_ids(task, "seen"), wording_ids(task, "unseen")
    assert len(seen) >= 4 and len(unseen) >= 2 and not set(seen) & set(unseen)
    train = make_task_samples(task, "train", 200, seed=0)
    assert {b.wording for b in train} == set(seen) and not any(b.held_out for b in train)
    held_out = make_task_samples(task, "test", 60, seed=0, wordings="unseen")
    assert {b.wording for b in held_out} == set(unseen) and all(b.held_out for b in held_out)
    assert {b.wording for b in make_task_samples(task, "test", 200, seed=0)} == {*seen, *unseen}


@pytest.mark.parametrize(
    ("count", "steps", "message"),
    [
        (2.0, None, "count must be an integer >= 0 (samples to make), got 2.0."),  # TypeError inside range()
        (True, None, "count must be an integer >= 0 (samples to make), got True."),  # one sample
        (-1, None, "count must be an integer >= 0 (samples to make), got -1."),  # none
        (2, 0, "steps must be a positive integer (contexts per sample) or None, got 0."),  # no context (dialogue: one)
        (2, -1, "steps must be a positive integer (contexts per sample) or None, got -1."),
        (2, 2.5, "steps must be a positive integer (contexts per sample) or None, got 2.5."),  # TypeError
        (2, True, "steps must be a positive integer (contexts per sample) or None, got True."),  # one context
    ],
)
@pytest.mark.parametrize("task", ["icl", "dialogue"])
def test_a_count_or_time_step_of_the_wrong_kind_is_refused_naming_it(task, count, steps, message):
    """`ccm eval` checks its --samples and --steps; make_samples from Python took whatever came."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_samples(task, "test", count, steps=steps)


def test_training_never_takes_held_out_wordings():
    for wordings in ("unseen", "all"):
        with pytest.raises(ValueError, match="would train on held-out wordings"):
            make_samples("icl", "train", 1, wordings=wordings)
    with pytest.raises(ValueError, match="wordings must be one of"):
        make_samples("icl", "test", 1, wordings="new")
    with pytest.raises(ValueError, match="'document' family has no unseen wordings"):
        make_samples("document", "test", 1, wordings="unseen")


def _literal_parts(template):
    """The fixed text of a template, between its fields, stripped; parts under 2 characters are dropped."""
    return {part.strip() for part in re.split(r"\{[a-z]*\}", template) if len(part.strip()) >= 2}


def _templates(wording):
    if getattr(wording, "varied", False):
        return []  # a new frame per sample: see test_varied_frames_are_many_and_read_as_they_are_written
    return [
        getattr(wording, field)
        for field in ("demonstration", "post", "question", "exchange")
        if hasattr(wording, field)
    ]


_PHRASINGS = [p for fact in FACTS.values() for p in vars(fact).values() if isinstance(p, Phrasings)]
_PHRASINGS += [OPENERS, CLOSERS, FILLER, ASIDES, SENTENCES, LIST_INTROS, TIPS]
_PHRASINGS += [people.STATEMENTS, people.JOB_STATEMENTS, people.ACKNOWLEDGEMENTS]
_PHRASINGS += [people.NAME_QUESTIONS, people.NAME_RECALLS, people.RELATION_QUESTIONS, people.RELATION_RECALLS]
_PHRASINGS += [people.JOB_QUESTIONS, people.JOB_RECALLS]
_WORDINGS = [w for family in FAMILIES_WITH_ITEMS for w in WORDINGS[family]]
_SEEN_FRAMES = {template for w in _WORDINGS if not w.held_out for template in _templates(w)}


def _held_out_parts():
    """Field names and separators of unseen frames, and every part of 8 characters or more of unseen sentences."""
    parts = {
        part
        for w in _WORDINGS
        if w.held_out
        for template in _templates(w)
        if template not in _SEEN_FRAMES  # a rephrased chat keeps the ChatML frame; its sentences are new
        for part in _literal_parts(template)
    }
    unseen = [sentence for phrasing in _PHRASINGS for sentence in phrasing.unseen]
    unseen += [sentence for pair in SMALL_TALK.unseen for sentence in pair]
    return parts | {part for sentence in unseen for part in _literal_parts(sentence) if len(part) >= 8}


def test_held_out_wordings_share_no_frame_or_phrase_with_training():
    """No field name, separator phrase or sentence of an unseen wording occurs in any training sample."""
    held_out_parts = _held_out_parts()
    training = "\n".join(
        _text(built.sample)
        for task in (MIXTURE, "people", "grouping")
        for built in make_task_samples(task, "train", 600, seed=0)
        if built.task != "document"
    )
    assert held_out_parts and not [part for part in held_out_parts if part in training]


def test_no_seen_phrasing_or_frame_holds_a_held_out_phrase():
    """The same, over every seen phrasing and frame rather than a sample of training text: a rare phrasing
    that a sample of 600 misses still may not repeat an unseen one."""
    seen = [sentence for phrasing in _PHRASINGS for sentence in phrasing.seen]
    seen += [sentence for pair in SMALL_TALK.seen for sentence in pair]
    held_out_parts = _held_out_parts()
    assert not [(part, text) for part in held_out_parts for text in [*seen, *_SEEN_FRAMES] if part in text]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), entity=st.sampled_from(["Peru", "soil scientist"]))
def test_varied_frames_are_many_and_read_as_they_are_written(seed, entity):
    """Every varied frame holds the entity, then the label; cut at the label, prompt + output is the
    demonstration as written; and it shares no field name or phrase with a held-out wording."""

    frame = varied_frame(random.Random(seed))
    assert frame.count("{x}") == frame.count("{answer}") == 1 and frame.index("{x}") < frame.index("{answer}")
    prompt, output = at_answer(frame, "north", x=entity)
    assert prompt + output == frame.format(x=entity, answer="north").rstrip()
    assert not prompt.endswith(" ") and output.strip().startswith("north")
    held_out = {part for w in WORDINGS["icl"] if w.held_out for part in _literal_parts(w.demonstration)}
    assert not [part for part in held_out if part in frame]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), question=st.sampled_from(["What is my name?", "Hmm, who am I?"]))
def test_varied_exchanges_are_many_and_read_as_they_are_written(seed, question):
    """Every varied exchange holds the user's turn, then the reply; cut at the reply, prompt + output is the
    exchange as written; and it shares no speaker or bracket with a held-out wording."""
    exchange = varied_exchange(random.Random(seed))
    assert exchange.count("{user}") == exchange.count("{answer}") == 1
    assert exchange.index("{user}") < exchange.index("{answer}")
    prompt, output = at_answer(exchange, "You're Ada.", user=question)
    assert prompt + output == exchange.format(user=question, answer="You're Ada.").rstrip()
    assert not prompt.endswith(" ") and output.strip().startswith("You're Ada.")
    held_out = {
        part
        for family in ("dialogue", "chat")
        for w in WORDINGS[family]
        if w.held_out
        for part in _literal_parts(w.exchange)
    }
    assert not [part for part in held_out if part in exchange]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), question=st.sampled_from(["Who is this user's friend?", "Where from?"]))
def test_varied_profiles_are_many_and_read_as_they_are_written(seed, question):
    """Every varied profile has one post field, and a question before its answer; cut at the answer, prompt +
    output is the question as written; and neither shares a field name or phrase with a held-out wording."""
    post, frame = varied_profile(random.Random(seed))
    assert post.count("{post}") == 1 and post.format(post="I keep a goat.").count("I keep a goat.") == 1
    assert frame.count("{q}") == frame.count("{answer}") == 1 and frame.index("{q}") < frame.index("{answer}")
    prompt, output = at_answer(frame, "Mirela", q=question)
    assert prompt + output == frame.format(q=question, answer="Mirela").rstrip()
    assert not prompt.endswith(" ") and output.strip().startswith("Mirela")
    held_out = {
        part
        for w in WORDINGS["personalization"]
        if w.held_out
        for template in (w.post, w.question)
        for part in _literal_parts(template)
    }
    assert not [part for part in held_out if part in post + frame]


# Phrases of the probes in docs/results/probe, which measure wordings no built-in task uses.
PROBE_PHRASES = ("shelf", "stored", "holds", "Box")


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(["numbered", "bare", "prose", "chat"]),
    item=st.sampled_from(["Peru", "tabby cat"]),
)
def test_grouping_forms_are_many_and_read_as_they_are_written(seed, form, item):
    """Every composed grouping form holds the item, then its group; cut at the group, prompt + output is the
    context as written; and it shares no phrase with a held-out wording or a probe."""
    rng = random.Random(seed)
    frame = composed_turns(rng) if form == "chat" else composed_line(rng, form)
    assert frame.count("{x}") == frame.count("{answer}") == 1 and frame.index("{x}") < frame.index("{answer}")
    assert ("{i}" in frame) == (form == "numbered")
    prompt, output = at_answer(frame, "K7", x=item, i="3")
    assert prompt + output == frame.format(x=item, answer="K7", i="3").rstrip()
    assert not prompt.endswith(" ") and output.strip().startswith("K7")
    held_out = {part for w in WORDINGS["grouping"] if w.held_out for part in _literal_parts(w.demonstration)}
    assert not [part for part in (*held_out, *PROBE_PHRASES) if part in frame]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 16), split=st.sampled_from(["train", "test"]))
@example(seed=2674429378, steps=14, split="test")  # the state Virginia asked, in groups Virginia, Alex and Ana
@example(seed=3595498960, steps=15, split="test")  # the hobby painting in a context, in groups painting, radio, ...
def test_grouping_asks_a_new_item_whose_group_the_contexts_name(seed, steps, split):
    """The asked item is in the question and in no context, and no item is named like a group; the output is one of
    2-4 group names, each a choice, and the contexts name only these groups; numbered contexts count 1..steps and
    the question goes on."""
    (built,) = make_task_samples("grouping", split, 1, seed=seed, steps=steps)
    sample, (asked, *others) = built.sample, built.items
    assert asked in sample.input and asked not in others
    assert len(set(others)) == len(others)  # the contexts' items, then the group names that are word-list items
    assert 2 <= len(sample.choices) <= 4 and sample.output in sample.choices
    names = [re.sub(r"(<\|im_end\|>|[.;,|/ ]|of course|I'd say)+$", "", choice).strip() for choice in sample.choices]
    assert all(any(name in context for name in names) for context in sample.contexts)
    if built.wording == "grouping/numbered":
        assert [str(n) in context for n, context in enumerate(sample.contexts, start=1)] == [True] * steps
        assert str(steps + 1) in sample.input


def test_no_grouping_item_belongs_to_two_of_the_samples_kinds():
    """Jordan, a woman's name, a man's and a country in the test split, was drawn in a sample of women and men: two
    groups for one item, or an asked item whose group nothing decides. Such a draw now takes another item."""
    (built,) = make_task_samples("grouping", "test", 1, seed=1622716021, steps=6)
    assert "Jordan" not in built.items
    assert {"Fernando", "Randy"} <= set(built.items) and {"Isabel", "Mckenzie"} <= set(built.items)


class _BoundedRandom(random.Random):
    """A generator that fails a test past a million draws of `choice`, where a task would otherwise draw for good."""

    draws = 0

    def choice(self, seq):
        self.draws += 1
        assert self.draws <= 1_000_000, "the sample was still being drawn after a million draws"
        return super().choice(seq)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 60), split=st.sampled_from(["train", "test"]))
@example(seed=494, steps=16, split="test")  # the 12 states of the test split, 13 times in one sample
def test_icl_samples_of_any_length_are_drawn(seed, steps, split):
    """An entity type used up within a sample made icl draw for good: `ccm eval --tasks icl --seed 11` (at t=16, the
    paper's step) never ended, nor did --steps 30. Entities differ until their type is used up."""
    wording = random.Random(seed).choice(icl.WORDINGS)
    sample, items = icl.icl_sample(_BoundedRandom(seed), split, steps, wording)
    assert len(sample.contexts) == steps and sample.output in sample.choices
    entities = set(items[:-3])  # then the three labels
    used_up = [kind for kind in icl.ENTITY_TYPES if set(words(kind, split)) <= entities]
    assert len(entities) == steps + 1 or used_up


def test_grouping_draws_every_kind():
    rng = random.Random(0)
    kinds = set()
    for _ in range(300):
        sample, items = grouping_sample(rng, "test", 16, next(w for w in WORDINGS["grouping"] if w.form == "bare"))
        kinds |= {kind for kind in ITEM_KINDS if set(items) & set(words(kind, "test"))}
        assert len(sample.contexts) == 16
    assert kinds == set(ITEM_KINDS)


def test_varied_profiles_give_many_frames_in_training():
    wordings = [built.wording for built in make_task_samples("personalization", "train", 400, seed=0, steps=1)]
    assert wordings.count("personalization/varied") >= 400 // (2 * len(wording_ids("personalization", "seen")))
    assert len({varied_profile(random.Random(seed)) for seed in range(300)}) >= 200


@pytest.mark.parametrize("family", ["dialogue", "chat"])
def test_varied_dialogues_give_many_speakers_in_training(family):
    first_lines = {
        built.sample.contexts[0].split("\n")[0].split(" ")[0]
        for built in make_task_samples(family, "train", 300, seed=0, steps=1)
        if built.wording == f"{family}/varied"
    }
    assert len(first_lines) >= 15


def test_varied_wording_gives_many_frames_in_training():
    frames = {
        built.sample.contexts[0].replace(built.items[0], "{x}")
        for built in make_task_samples("icl", "train", 400, seed=0, steps=1)
        if built.wording == "icl/varied"
    }
    assert len(frames) >= 25


def test_weighted_mixture_takes_families_in_turn_by_weight():
    tasks = [built.task for built in make_task_samples("icl:3,dialogue:1", "train", 8, seed=0)]
    assert tasks == ["icl", "icl", "icl", "dialogue"] * 2
    assert make_samples("mixture", "train", 8, seed=2) != make_samples("icl:1,dialogue:1", "train", 8, seed=2)
    unseen = make_task_samples("icl:2,document:1", "test", 6, wordings="unseen")
    assert {b.task for b in unseen} == {"icl"} and all(b.held_out for b in unseen)
    assert set(wording_ids("icl:2,dialogue:1")) == set(wording_ids("icl")) | set(wording_ids("dialogue"))


@pytest.mark.parametrize("task", ["icl:0", "icl:two", "icl:1,icl:2", "icl:1,poems:1", "icl:1,,dialogue:1"])
def test_a_malformed_mixture_is_refused_with_the_fix(task):
    with pytest.raises(ValueError, match=r"weight|Unknown task"):
        make_samples(task, "train", 1)


def test_make_samples_keeps_its_signature():
    samples = make_samples("dialogue", "test", 5, 3, 4)
    assert samples == [b.sample for b in make_task_samples("dialogue", "test", 5, seed=3, steps=4)]
    assert all(isinstance(s, OnlineSample) and len(s.contexts) == 4 for s in samples)


def test_mixture_covers_its_families():
    assert {b.task for b in make_task_samples(MIXTURE, "train", 8)} == set(MIXTURE_FAMILIES)
    assert {b.task for b in make_task_samples(MIXTURE, "test", 8, wordings="unseen")} == set(MIXTURE_FAMILIES) - {
        "document"
    }


@pytest.mark.parametrize("task", FAMILIES_WITH_ITEMS)
def test_prompt_and_output_read_as_the_wording_writes_them(task):
    """The input stops right where the answer starts: input + output is the wording's own text."""
    for built in make_task_samples(task, "test", 30, seed=4, steps=2):
        sample = built.sample
        wording = next(w for w in WORDINGS[task] if w.id == built.wording)
        if getattr(wording, "varied", False):
            continue  # a frame per sample, checked by test_varied_frames_are_many_and_read_as_they_are_written
        template = _templates(wording)[-1]  # the one that holds the answer
        suffix = template.split("{answer}")[1].rstrip()
        assert sample.output.endswith(suffix) and not sample.input.endswith(" ")


def test_eval_steps_match_the_paper():
    assert EVAL_STEPS["icl"] == (1, 2, 4, 8, 16) and EVAL_STEPS["dialogue"][-1] == 12


def test_jsonl_round_trip(tmp_path):
    samples = make_samples(MIXTURE, "test", 9, seed=5)
    save_jsonl(samples, tmp_path / "data.jsonl")
    assert load_jsonl(tmp_path / "data.jsonl") == samples
    first = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[0])
    assert set(first) >= {"contexts", "input", "output"}


def test_samples_of_tensor_or_numpy_ids_are_saved_as_their_ids(tmp_path):
    """An OnlineSample may hold ids as a tensor of shape (n,) or (1, n), or NumPy ids: save_jsonl failed on them with
    json's "Object of type Tensor is not JSON serializable"."""
    import numpy as np
    import torch

    samples = [
        OnlineSample([torch.tensor([1, 2]), np.array([3])], torch.tensor([[4, 5]]), [np.int64(6)], choices=[[6], "x"]),
        OnlineSample(["text"], "more", torch.tensor([], dtype=torch.long)),
    ]
    save_jsonl(samples, tmp_path / "ids.jsonl")
    assert load_jsonl(tmp_path / "ids.jsonl") == [
        OnlineSample([[1, 2], [3]], [4, 5], [6], choices=[[6], "x"]),
        OnlineSample(["text"], "more", []),
    ]
    # A sample that is not one is refused naming it, and the file written before stays.
    with pytest.raises(ValueError, match=r"^samples\[1\].contexts is a single str; give a list"):
        save_jsonl([samples[0], OnlineSample("text", [1])], tmp_path / "ids.jsonl")
    assert len(load_jsonl(tmp_path / "ids.jsonl")) == 2


def test_jsonl_with_token_ids(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"contexts": [[1, 2], [3]], "input": [4], "output": [5]}\n\n')
    assert load_jsonl(tmp_path / "ids.jsonl") == [OnlineSample([[1, 2], [3]], [4], [5])]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json\n", "line 1|:1 is not valid JSON"),
        ('{"input": "x"}\n', "needs an object with 'contexts'"),
        ('{"contexts": "x", "input": "y"}\n', "'contexts' must be a list"),
        ('{"contexts": [], "input": "y", "label": 1}\n', "unknown fields"),
        ("\n", "holds no samples"),
        ("[" * 100_000 + "]" * 100_000, r":1 is nested too deeply to be read as JSON; write one JSON object per line"),
        (b'{"contexts": ["\xff"], "input": "q"}', r"is not UTF-8 text .*; save it as UTF-8"),
        ('{"contexts": [], "input": "q", "output": "x", "choices": ["x", "y", "x"]}', "the choice 'x' is listed twice"),
        # Python kept the last "output", other readers the first: the sample trained on one of two answers.
        ('{"contexts": ["c"], "input": "q", "output": "x", "output": "y"}', r":1 gives the key 'output' twice"),
        # Python's own error named neither the file nor a fix, and told to raise its bound on digits.
        (
            '{"contexts": [[' + "1" * 5000 + ']], "input": "q"}',
            r":1 holds an integer of more than \d+ digits, which no such file does; write one JSON object per line",
        ),
    ],
)
def test_jsonl_errors(tmp_path, text, message):
    (tmp_path / "bad.jsonl").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message):
        load_jsonl(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("repeated", [["c0"], [[0]]])
def test_a_sample_of_many_choices_is_read_in_one_pass(tmp_path, repeated):
    """Each choice was searched for among those before it: a line of 50,000 choices (400 KB) took 15 s to read, one
    of 200,000 minutes, for a choice listed twice (the last, here) or none. Found in one pass now
    (`validation.first_repeated`)."""
    choices = [f"c{index}" if isinstance(repeated[0], str) else [index] for index in range(50_000)]
    path = tmp_path / "choices.jsonl"
    path.write_text(json.dumps({"contexts": ["x"], "input": "q", "choices": choices}) + "\n")
    assert len(load_jsonl(path)) == 1
    path.write_text(json.dumps({"contexts": ["x"], "input": "q", "choices": choices + repeated}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f":1: the choice {repeated[0]!r} is listed twice")):
        load_jsonl(path)


class _Counted:
    """A value that counts how often it is compared with another."""

    compared = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        _Counted.compared += 1
        return isinstance(other, _Counted) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


@pytest.mark.parametrize("repeated", [None, 0, 4_999])
def test_first_repeated_compares_each_value_about_once(repeated):
    """JSON keys and sample choices are checked with it: a search of each among those before it took minutes on a
    crafted megabyte."""
    values = [_Counted(index) for index in range(5_000)] + ([] if repeated is None else [_Counted(repeated)])
    _Counted.compared = 0
    found = first_repeated(values)
    assert (found is None) if repeated is None else (found is values[-1])
    assert _Counted.compared <= 2  # equal hashes only; a search of those before each: 12.5 million


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    contexts=st.lists(st.text(min_size=1), max_size=3),
    question=st.text(min_size=1),
    answer=st.text(),
)
@example(contexts=["a\u2028b", "c\x85d"], question="q\u2029", answer="x\r\ny")
def test_jsonl_round_trip_of_any_text(tmp_path, contexts, question, answer):
    """save_jsonl writes U+2028, U+2029 and U+0085 as they are (JSON allows them in strings), and load_jsonl split
    lines at them too: the file it had just written was "not valid JSON"."""
    samples = [OnlineSample(contexts, question, answer), OnlineSample(["c"], "q", "a")]
    save_jsonl(samples, tmp_path / "text.jsonl")
    assert load_jsonl(tmp_path / "text.jsonl") == samples


def test_a_jsonl_path_that_is_not_a_readable_file_is_named(tmp_path):
    """A folder failed with a bare IsADirectoryError (a traceback from the ccm command)."""
    path = tmp_path / "samples.jsonl"
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} cannot be read \(No such file.*\); give a JSONL"):
        load_jsonl(path)
    path.mkdir()
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a regular file .*; give a JSONL file"):
        load_jsonl(path)


def test_a_jsonl_path_that_is_a_pipe_or_a_device_is_refused_unread(tmp_path):
    """A named pipe was read as a file: the command waited for good for a writer (here one comes, and its samples
    were taken); a link to /dev/zero read zeros until the memory was full."""
    line = '{"contexts": ["a"], "input": "q", "output": "x"}\n'
    pipe = tmp_path / "pipe.jsonl"
    with pipe_feeding(pipe, line), pytest.raises(ValueError, match=rf"{re.escape(str(pipe))} is not a regular file"):
        load_jsonl(pipe)
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"zero\.jsonl is not a regular file \(a folder, a pipe or a device\)"):
        load_jsonl(tmp_path / "zero.jsonl")


def test_jsonl_with_a_byte_order_mark(tmp_path):
    (tmp_path / "bom.jsonl").write_text('\ufeff{"contexts": ["a"], "input": "q", "output": "x"}\n', encoding="utf-8")
    assert load_jsonl(tmp_path / "bom.jsonl") == [OnlineSample(["a"], "q", "x")]


def test_unknown_task():
    with pytest.raises(ValueError, match="Unknown task 'qa'"):
        make_samples("qa", "train", 1)


def test_long_text_splits_topics_by_identity():
    from pydoc_data.topics import topics

    from transformers_ccm.tasks.text import long_text

    train, test = long_text("train"), long_text("test")
    assert len(test) > 50_000 and len(train) > 3 * len(test)
    for name, text in topics.items():
        assert (text.strip() in test) != (text.strip() in train)
        if in_test_split(name):
            assert text.strip() in test


def test_docstring_text_splits_modules_by_identity():
    from transformers_ccm.tasks.text import _stdlib_docstrings, long_text

    modules = _stdlib_docstrings()
    assert {"email.message", "calendar", "json"} <= set(modules)
    assert not any(part in {"test", "tests", "site-packages"} for name in modules for part in name.split("."))
    train, test = long_text("train", ["docstrings"]), long_text("test", ["docstrings"])
    assert len(test) > 50_000 and len(train) > 2 * len(test)
    for name, text in modules.items():
        assert text in (test if in_test_split(name) else train)
    both = long_text("test", ["reference", "docstrings"])
    assert both == long_text("test") + "\n\n" + test


@pytest.mark.parametrize("sources", [[], ["reference", "novels"]])
def test_long_text_refuses_unknown_sources(sources):
    from transformers_ccm.tasks.text import long_text

    with pytest.raises(ValueError, match=r"Text sources must be some of \['reference', 'docstrings'\]"):
        long_text("train", sources)


@pytest.fixture(scope="module")
def held_out_text_ids():
    from transformers_ccm.embedded import load_tokenizer
    from transformers_ccm.tasks.text import long_text

    tokenizer = load_tokenizer("default")
    return tokenizer, tokenizer(long_text("test"), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("make", "sizes", "message"),
    [
        ("text_streams", {"count": 2.0, "length": 8}, "count must be an integer >= 0 (samples to make), got 2.0."),
        ("text_streams", {"count": 2, "length": 0}, "length must be a positive integer (tokens or chunks), got 0."),
        ("stream_samples", {"count": -1}, "count must be an integer >= 0 (samples to make), got -1."),
        ("stream_samples", {"count": 2, "chunk": 1.5}, "chunk must be a positive integer (tokens or chunks), got 1.5."),
        ("stream_samples", {"count": 2, "output": -3}, "output must be a positive integer (tokens or chunks), got -3."),
        (
            "stream_samples",
            {"count": 2, "max_chunks": True},
            "max_chunks must be a positive integer (tokens or chunks), got True.",
        ),
    ],
)
def test_text_stream_sizes_of_the_wrong_kind_are_refused_naming_them(tokenizer, make, sizes, message):
    """A float failed inside range() with a bare TypeError; a size of 0 or less cut empty or reversed stretches."""
    from transformers_ccm.tasks import text

    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        getattr(text, make)(tokenizer, "test", **sizes)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunk=st.integers(1, 96),
    max_chunks=st.integers(1, 6),
    max_window=st.integers(1, 120),
    output=st.integers(1, 80),
    seed=st.integers(0, 1000),
)
def test_stream_samples_are_consecutive_text(held_out_text_ids, chunk, max_chunks, max_window, output, seed):
    from transformers_ccm.tasks.text import stream_samples

    tokenizer, ids = held_out_text_ids
    sizes = {"chunk": chunk, "max_chunks": max_chunks, "max_window": max_window, "output": output}
    samples = stream_samples(tokenizer, "test", 4, seed=seed, **sizes)
    assert samples == stream_samples(tokenizer, "test", 4, seed=seed, **sizes)
    assert samples != stream_samples(tokenizer, "test", 4, seed=seed + 1, **sizes)
    for sample in samples:
        assert 1 <= len(sample.contexts) <= max_chunks and all(len(part) == chunk for part in sample.contexts)
        assert 1 <= len(sample.input) <= max_window and len(sample.output) == output
        joined = [*(t for part in sample.contexts for t in part), *sample.input, *sample.output]
        start = ids.index(joined[0])
        while ids[start : start + len(joined)] != joined:
            start = ids.index(joined[0], start + 1)


BAD_FIELDS = {
    '{"contexts": [["a", "b"]], "input": "q"}': "contexts[0] must be a string or a list of token ids",
    '{"contexts": [""], "input": "q"}': "contexts[0] must be a string or a list of token ids",
    '{"contexts": ["c"], "input": [1, -2]}': "'input' must be a string or a list of token ids",
    '{"contexts": ["c"], "input": "q", "output": 3}': "'output' must be a string or a list of token ids",
    '{"contexts": ["c"], "input": "q", "output": [1.5]}': "'output' must be a string or a list of token ids",
    '{"contexts": ["c"], "input": "q", "choices": "yes"}': "'choices' must be a non-empty list",
    '{"contexts": ["c"], "input": "q", "output": "no", "choices": ["yes", "maybe"]}': "is not among the choices",
}


@settings(max_examples=len(BAD_FIELDS), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sampled_from(sorted(BAD_FIELDS)), good_before=st.integers(0, 3))
def test_jsonl_field_errors_name_the_line(tmp_path, bad, good_before):
    good = '{"contexts": ["c"], "input": "q", "output": "a"}\n'
    (tmp_path / "bad.jsonl").write_text(good * good_before + bad + "\n" + good)
    with pytest.raises(ValueError, match=rf"bad\.jsonl:{good_before + 1}: .*{re.escape(BAD_FIELDS[bad])}"):
        load_jsonl(tmp_path / "bad.jsonl")


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), held_out=st.booleans(), split=st.sampled_from(["train", "test"]))
@example(seed=84, held_out=False, split="test")  # a user named Don, told "Don't be too hard on yourself."
def test_long_replies_never_name_the_users_own_facts(seed, held_out, split):
    """Other people in a rambling reply are distractors, never the user's name, friend or job, nor a job that
    shares a word with it. A contraction is no name: `\\b` ends a word at its apostrophe, so the check took "Don't"
    for the name Don and failed at random (a few draws in ten thousand), though a possessive ("Don's") still names
    him."""
    rng = random.Random(seed)
    avoid = (*rng.sample(words("first_name", split), 2), rng.choice(words("job", split)))
    text = ramble(rng, split, held_out, avoid)
    assert len(text.split()) >= 8
    assert not [item for item in avoid if re.search(rf"\b{re.escape(item)}\b(?!'t\b)", text)]


def test_chat_replies_run_long_and_earlier_turns_may_ask():
    """Chat samples are dialogues as a chat model holds them: replies several times longer than the dialogue
    family's, and some earlier turns already asking about another fact."""

    def words_per_reply(task):
        samples = make_task_samples(task, "train", 60, seed=0, steps=6)
        turn = "<|im_start|>assistant\n"
        replies = [c.split(turn)[1].split("<|im_end|>")[0] for b in samples for c in b.sample.contexts if turn in c]
        return sum(len(reply.split()) for reply in replies) / len(replies)

    assert words_per_reply("chat") > 4 * words_per_reply("dialogue")
    asides = [aside for aside in ASIDES.seen if len(aside) > 4]
    samples = make_task_samples("chat", "train", 60, seed=0, steps=8)
    asked_before = [
        context
        for built in samples
        for context in built.sample.contexts
        if any(aside in context for aside in asides) and any(item in context for item in built.items)
    ]
    assert asked_before and all(any(aside in b.sample.input for aside in ASIDES.seen) for b in samples)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 6), split=st.sampled_from(["train", "test"]))
def test_lookalike_facts_keep_their_number_and_distinct_values(seed, count, split):
    rng = random.Random(seed)
    facts = draw_facts(rng, split, sorted(FACTS), count)
    swapped = with_lookalike(rng, split, facts)
    assert len(swapped) == len(facts) and len(set(swapped.values())) == len(swapped)
    assert all(value in words(FACTS[kind].pool, split) for kind, value in swapped.items())


@pytest.mark.parametrize("family", ["dialogue", "chat"])
def test_training_dialogues_often_name_a_friend_beside_the_user(family):
    """Two first names in one dialogue (the user's and a friend's) are the hard case of recall: training poses it
    far more often than uniform draws do, and test dialogues keep uniform draws."""

    def share_with_two_names(split):
        names = set(words("first_name", split))
        samples = make_task_samples(family, split, 300, seed=1, steps=8, wordings="seen")
        return sum(len(names.intersection(built.items)) >= 2 for built in samples) / len(samples)

    assert share_with_two_names("train") > 0.35 > 0.25 > share_with_two_names("test")


def test_people_choices_name_others_of_the_same_conversation():
    """With two or more people in memory, a wrong choice is someone (or something) the conversation also holds:
    recall must keep who is who, not only which names were said."""
    hard = 0
    for built in make_task_samples("people", "test", 120, seed=5, steps=6):
        sample, told = built.sample, "".join(built.sample.contexts)
        assert len(sample.choices) == people.CHOICES and sample.output in sample.choices
        wrong = [choice for choice in sample.choices if choice != sample.output]
        hard += any(item in choice and item in told for choice in wrong for item in built.items)
    assert hard >= 100  # the rest ask a relation (its distractors are relations) or about a lone person


def test_people_relations_keep_their_names_and_held_out_relations_stay_unseen():
    held_out = [relation.word for relation in people.HELD_OUT_RELATIONS]
    for built in make_task_samples("people", "train", 300, seed=6):
        assert not [word for word in held_out if f"my {word}" in _text(built.sample)]
    female = set(words("female_name", "test"))
    for built in make_task_samples("people", "test", 100, seed=6, steps=4):
        for match in re.finditer(r"my (sister|daughter|wife|niece|aunt) ([A-Z][a-z]+)", "".join(built.sample.contexts)):
            assert match.group(2) in female
    unseen = "".join(_text(b.sample) for b in make_task_samples("people", "test", 200, seed=6, wordings="unseen"))
    assert any(f"my {word}" in unseen for word in held_out)


def test_people_long_replies_name_each_person_only_in_their_own_turn():
    """A rambling reply names others as distractors, never someone the conversation holds (the user included):
    each name is told in one turn only. (Seed 2 drew the user's name into a reply before that was excluded.)"""
    names = set(words("first_name", "train"))
    samples = make_task_samples("people", "train", 400, seed=2, steps=8, wordings="seen")
    long_replies = [built for built in samples if "<|im_start|>" in built.sample.contexts[0]]
    assert len(long_replies) > 50
    for built in long_replies:
        for name in names.intersection(built.items):
            turns = [c for c in built.sample.contexts if re.search(rf"\b{name}\b", c)]
            assert len(turns) == 1, (name, turns)


def test_save_jsonl_over_a_file_keeps_it_when_the_samples_fail_part_way(tmp_path):
    """The file was opened for writing first: samples that failed part way (a generator that raises) left it cut
    short, the earlier samples lost."""
    path = tmp_path / "data.jsonl"
    samples = make_samples("icl", "test", 3, steps=1)
    save_jsonl(samples, path)
    before = path.read_bytes()

    def failing():
        yield samples[0]
        raise RuntimeError("the source of samples failed")

    with pytest.raises(RuntimeError, match="the source of samples failed"):
        save_jsonl(failing(), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]
    assert load_jsonl(path) == samples


def test_save_jsonl_writes_to_a_pipe_or_device_as_a_stream(tmp_path, capfd):
    """Replaced by a rename, /dev/stdout redirected to a file (here: pytest's capture) lost what was written."""
    samples = make_samples("icl", "test", 2, steps=1)
    save_jsonl(samples, "/dev/stdout")
    assert [json.loads(line)["output"] for line in capfd.readouterr().out.splitlines()] == [s.output for s in samples]
    os.mkfifo(tmp_path / "pipe")
    received = []
    reader = threading.Thread(target=lambda: received.append((tmp_path / "pipe").read_text()), daemon=True)
    reader.start()
    save_jsonl(samples, tmp_path / "pipe")
    reader.join()
    assert [json.loads(line)["output"] for line in received[0].splitlines()] == [s.output for s in samples]
    assert (tmp_path / "pipe").is_fifo()
