"""Built-in online tasks and the JSONL format."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformers_ccm import OnlineSample
from transformers_ccm.tasks import EVAL_STEPS, MIXTURE, TASKS, load_jsonl, make_samples, save_jsonl
from transformers_ccm.tasks.vocabulary import POOLS, in_test_split, words


@pytest.mark.parametrize("task", [*TASKS, MIXTURE])
def test_deterministic_by_seed(task):
    assert make_samples(task, "train", 12, seed=3) == make_samples(task, "train", 12, seed=3)
    assert make_samples(task, "train", 12, seed=3) != make_samples(task, "train", 12, seed=4)
    assert make_samples(task, "train", 12, seed=3) != make_samples(task, "test", 12, seed=3)


@pytest.mark.parametrize("pool", POOLS)
def test_pools_split_by_identity(pool):
    train, test = set(words(pool, "train")), set(words(pool, "test"))
    assert train and test and not train & test
    assert all(in_test_split(item) for item in test)


TEST_ITEMS = {w for pool in POOLS for w in words(pool, "test")}


def _values(task, sample):
    """The word-list items a sample is built from (entities, labels, profile values, recalled facts)."""
    if task == "icl":
        entities = re.findall(r"Input: (.*)\n", "".join(sample.contexts) + sample.input + "\n")
        return entities + [c.strip() for c in sample.choices]
    if task == "personalization":
        return [c.strip() for c in sample.choices]
    recalled = re.search(r"(?:name is|work as a|live in|called|learning|colour is) (.+)\.<\|im_end\|>$", sample.output)
    return [recalled.group(1)]


@pytest.mark.parametrize("task", list(TASKS))
def test_test_samples_use_only_test_items(task):
    """Test tasks, users and dialogues are built only from held-out items: never seen in training."""
    for sample in make_samples(task, "test", 40, seed=1):
        values = _values(task, sample)
        assert values and all(value in TEST_ITEMS for value in values), values


@pytest.mark.parametrize("task", list(TASKS))
@settings(max_examples=10, deadline=None)
@given(steps=st.integers(1, 16), seed=st.integers(0, 10_000))
def test_format(task, steps, seed):
    (sample,) = make_samples(task, "train", 1, seed=seed, steps=steps)
    assert len(sample.contexts) == steps
    assert all(isinstance(c, str) and c for c in sample.contexts)
    assert sample.input and sample.output
    if task == "dialogue":
        assert sample.choices is None
        assert all(c.startswith("<|im_start|>user\n") and c.endswith("<|im_end|>\n") for c in sample.contexts)
        assert sample.output.endswith("<|im_end|>")
    else:
        assert sample.output in sample.choices and len(set(sample.choices)) == len(sample.choices) >= 2


def test_answers_need_the_contexts():
    """The asked fact or the label mapping appears in the contexts."""
    for sample in make_samples("personalization", "test", 20, seed=2, steps=6):
        assert sample.output.strip() in "".join(sample.contexts)
    for sample in make_samples("dialogue", "test", 20, seed=2, steps=6):
        recalled = sample.output.removesuffix("<|im_end|>").rstrip(".").split()[-1]
        assert recalled in "".join(sample.contexts)


def test_eval_steps_match_the_paper():
    assert EVAL_STEPS["icl"] == (1, 2, 4, 8, 16) and EVAL_STEPS["dialogue"][-1] == 12


def test_jsonl_round_trip(tmp_path):
    samples = make_samples(MIXTURE, "test", 9, seed=5)
    save_jsonl(samples, tmp_path / "data.jsonl")
    assert load_jsonl(tmp_path / "data.jsonl") == samples
    first = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[0])
    assert set(first) >= {"contexts", "input", "output"}


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
    ],
)
def test_jsonl_errors(tmp_path, text, message):
    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_jsonl(tmp_path / "bad.jsonl")


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


def test_stream_samples_are_consecutive_text():
    from transformers_ccm.embedded import load_tokenizer
    from transformers_ccm.tasks.text import long_text, stream_samples

    tokenizer = load_tokenizer("default")
    samples = stream_samples(tokenizer, "test", 6, seed=1)
    assert samples == stream_samples(tokenizer, "test", 6, seed=1) != stream_samples(tokenizer, "test", 6, seed=2)
    ids = tokenizer(long_text("test"), add_special_tokens=False)["input_ids"]
    for sample in samples:
        assert 1 <= len(sample.contexts) <= 4 and all(len(chunk) == 64 for chunk in sample.contexts)
        assert 1 <= len(sample.input) <= 84 and len(sample.output) == 64
        joined = [*(t for chunk in sample.contexts for t in chunk), *sample.input, *sample.output]
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
