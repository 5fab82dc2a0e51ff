import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ccm_reference import reference_logits
from test_online import online_logits, parallel_logits
from tiny_models import (
    VOCAB,
    randomize_adapter,
    tiny_ccm,
    tiny_dynamic_ntk_base,
    tiny_llama_for,
    tiny_longrope_base,
    wordpiece_tokenizer,
)
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.data import IGNORE_INDEX
from transformers_ccm.masks import sample_layout

CONFIG = CCMConfig(num_comp_tokens=2)


def test_batch_layout_and_labels():
    batch = CCMDataCollator(CONFIG, pad_token_id=9)([OnlineSample([[5, 6], [7]], [8], [30, 31])])
    assert batch["input_ids"].tolist() == [[5, 6, 9, 9, 7, 9, 9, 8, 30, 31]]
    assert batch["comp_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 0, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 3, 3, 3]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2, 3, 4, 3, 4, 5]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 8 + [30, 31]]


def test_samples_without_output_have_no_labels():
    batch = CCMDataCollator(CONFIG)([OnlineSample([[5]], [8]), OnlineSample([], [1, 2])])
    assert "labels" not in batch


def test_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match=r"samples\[0\].input is a string; give CCMDataCollator a tokenizer"):
        CCMDataCollator(CONFIG)([OnlineSample([[5]], "hello")])


def test_strings_are_tokenized():
    def tokenizer(text, add_special_tokens=True):
        assert not add_special_tokens
        return {"input_ids": [ord(ch) for ch in text]}

    batch = CCMDataCollator(CONFIG, tokenizer=tokenizer)([OnlineSample(["ab"], "c", "d")])
    assert batch["input_ids"].tolist() == [[97, 98, 0, 0, 99, 100]]


def test_a_tokenizer_of_one_string_tokenizes_samples_as_collating_does():
    """`tokenized` (which train() runs) called the tokenizer once with the list of every string, which a function of
    one string, as the collator itself calls it, failed on (or read as one text)."""

    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) - 90 for ch in text]}

    samples = [OnlineSample(["ab", [5]], "c", "d"), OnlineSample([], "ab")]
    collate = CCMDataCollator(CONFIG, tokenizer=tokenizer)
    tokenized = collate.tokenized(samples)
    assert [(s.contexts, s.input, s.output) for s in tokenized] == [([[7, 8], [5]], [9], [10]), ([], [7, 8], None)]
    for key, tensor in collate(samples).items():
        assert torch.equal(collate(tokenized)[key], tensor), key


@pytest.mark.parametrize("kind", [bytes, bytearray])
@pytest.mark.parametrize("field", ["contexts", "input", "output"])
def test_bytes_are_refused_not_read_as_their_byte_values(kind, field):
    """bytes are a sequence of ints (a `Sequence[int]`, as `Tokens` types ids, to a type checker too): text read in
    binary mode was collated as token ids, its byte values, without a word."""
    fields = {"contexts": [[5]], "input": [6], "output": [7]}
    text = kind(b"ABC")  # 65, 66, 67: ids inside the vocabulary
    fields[field] = [text] if field == "contexts" else text
    where = re.escape(f"samples[0].{field}{'[0]' if field == 'contexts' else ''} is {kind.__name__}, neither")
    for collate in (CCMDataCollator(CONFIG, tokenizer=wordpiece_tokenizer()), CCMDataCollator(CONFIG)):
        with pytest.raises(ValueError, match=rf"{where} a string nor token ids; decode text to a string"):
            collate([OnlineSample(**fields)])


@pytest.mark.parametrize(
    ("sample", "where"),
    [
        (OnlineSample([[5], []], [8]), r"samples\[0\].contexts\[1\] is empty"),
        (OnlineSample([[5]], []), r"samples\[0\].input is empty"),
    ],
)
def test_empty_context_or_input(sample, where):
    with pytest.raises(ValueError, match=where):
        CCMDataCollator(CONFIG)([sample])


@pytest.mark.parametrize("text", ["\u200b", "\x00\x01", "\ufeff"])
def test_text_the_tokenizer_reads_as_no_token_is_refused_as_such(text):
    """A BERT-style tokenizer drops control and zero-width characters: such a context was refused as 'empty', a text
    the user had given. The error quotes the text and says the tokenizer reads it as no token."""
    collate = CCMDataCollator(CONFIG, tokenizer=wordpiece_tokenizer())
    quoted = re.escape(repr(text))
    with pytest.raises(ValueError, match=rf"contexts\[1\] is the text {quoted}, which the tokenizer reads as no token"):
        collate([OnlineSample(["hello", text], "world")])
    with pytest.raises(ValueError, match=r"contexts\[1\] is empty"):
        collate([OnlineSample(["hello", ""], "world")])


@pytest.mark.parametrize("text", ["\u200b", " \ufeff "])
def test_train_quotes_text_the_tokenizer_reads_as_no_token(tmp_path, text):
    """Tokenized once before training, such a context was refused as 'empty', and such an output as 'no output'."""
    from transformers_ccm.training import TrainingRecipe, train

    tokenizer = wordpiece_tokenizer()
    model = CCMForCausalLM.from_base(tiny_llama_for(tokenizer), CCMConfig())
    quoted = re.escape(repr(text))
    for sample, message in (
        (OnlineSample(["hello", text], "world", "hello"), rf"\.contexts\[1\] is the text {quoted}, which"),
        (
            OnlineSample(["hello"], "world", text),
            rf" has no token to learn from: the tokenizer reads its output {quoted} ",
        ),
    ):
        with pytest.raises(ValueError, match=rf"^train_samples\[0\]{message}"):
            train(model, tokenizer, [sample], None, tmp_path / "run", TrainingRecipe(steps=1, batch_size=1))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("sample", "where", "problem"),
    [
        (OnlineSample([[5.7, 6]], [8], [9]), r"samples\[0\].contexts\[0\]", "must hold integer token ids"),
        (OnlineSample([[5]], torch.tensor([8.0]), [9]), r"samples\[0\].input", "must hold integer token ids"),
        (OnlineSample([[5]], [8], [True]), r"samples\[0\].output", "must hold integer token ids"),
        (OnlineSample([[5, -1]], [8], [9]), r"samples\[0\].contexts\[0\]", r"token id -1, outside"),
        (OnlineSample([[5]], [8], [VOCAB]), r"samples\[0\].output", rf"token id {VOCAB}, outside .*0\.\.{VOCAB - 1}"),
    ],
)
def test_ids_that_are_no_token_of_the_model_are_refused_naming_the_sample(sample, where, problem):
    """Floats used to be truncated (silently another token) and ids outside the vocabulary failed in the forward
    with torch's IndexError."""
    model = tiny_ccm("llama")
    with pytest.raises(ValueError, match=f"{where} .*{problem}"):
        CCMDataCollator(model)([sample])


@settings(max_examples=30, deadline=None)
@given(token=st.integers(2**63, 2**200) | st.integers(-(2**200), -1), field=st.sampled_from(["contexts", "input"]))
def test_ids_past_int64_are_refused_naming_the_sample_without_a_model(token, field):
    """A collator built from a config knows no vocabulary: an id past int64 failed in torch.tensor with "Overflow when
    unpacking long long", naming no sample."""
    sample = OnlineSample([[token]], [8], [9]) if field == "contexts" else OnlineSample([[5]], [token], [9])
    where = r"contexts\[0\]" if field == "contexts" else "input"
    with pytest.raises(ValueError, match=rf"samples\[0\]\.{where} holds the token id {token}, outside .*int64"):
        CCMDataCollator(CONFIG)([sample])


def _character_tokenizer(text, add_special_tokens=True):
    return {"input_ids": [ord(ch) for ch in text] if isinstance(text, str) else [[ord(ch) for ch in t] for t in text]}


@pytest.mark.parametrize(
    ("sample", "error", "message"),
    [
        # A context without its list: one context per character (tokenized) or per id.
        (OnlineSample("ab", [8], [9]), ValueError, r"samples\[0\].contexts is a single str; give a list"),
        (OnlineSample([5, 6], [8], [9]), ValueError, r"samples\[0\].contexts holds token ids, not a list of them"),
        (OnlineSample(torch.tensor([5, 6]), [8], [9]), ValueError, r"samples\[0\].contexts is a single Tensor"),
        # An unordered collection: its contexts in any order.
        (OnlineSample({"ab", "cd"}, [8], [9]), ValueError, r"samples\[0\].contexts must be a list.*got set"),
        # A lone id or nothing failed with "'int' object is not iterable", a set of ids came in any order.
        (OnlineSample([[5]], 8, [9]), ValueError, r"samples\[0\].input must be a string or a sequence of token ids"),
        (OnlineSample([[5]], None, [9]), ValueError, r"samples\[0\].input must be a string or a sequence"),
        (OnlineSample([[5]], [8], {9, 10}), ValueError, r"samples\[0\].output must be a string or a sequence"),
        # The rows of a batch of ids were run together as one.
        (OnlineSample([[5]], torch.tensor([[8], [9]]), [9]), ValueError, r"samples\[0\].input is a tensor of shape"),
        ({"contexts": [[5]], "input": [8], "output": [9]}, TypeError, r"samples\[0\] is a dict, not an OnlineSample"),
    ],
)
def test_samples_of_the_wrong_form_are_refused_naming_the_field(sample, error, message):
    collate = CCMDataCollator(tiny_ccm("llama"), tokenizer=_character_tokenizer)
    with pytest.raises(error, match=message):
        collate([sample])
    if isinstance(sample, dict) or "contexts" in message:  # what tokenizing reads: it leaves ids as they are
        with pytest.raises(error, match=message):
            collate.tokenized([sample])
    one_row = OnlineSample([[5, 6]], torch.tensor([[8, 9]]), [9])  # as a tokenizer's return_tensors="pt" gives it
    assert torch.equal(collate([one_row])["input_ids"], collate([OnlineSample([[5, 6]], [8, 9], [9])])["input_ids"])


def test_text_that_another_models_tokenizer_reads_past_the_vocabulary_is_refused():
    def tokenizer(text, add_special_tokens=True):
        return {"input_ids": [VOCAB + ord(ch) for ch in text]}

    with pytest.raises(ValueError, match=rf"samples\[0\].contexts\[0\] holds the token id {VOCAB + 97}, outside"):
        CCMDataCollator(tiny_ccm("llama"), tokenizer=tokenizer)([OnlineSample(["ab"], [5], [6])])


def test_empty_batch():
    with pytest.raises(ValueError, match="empty list"):
        CCMDataCollator(CONFIG)([])


@given(
    samples=st.lists(
        st.tuples(st.lists(st.integers(1, 5), max_size=5), st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=4
    ),
    n=st.integers(1, 3),
)
def test_padding_never_changes_a_row(samples, n):
    config = CCMConfig(num_comp_tokens=n)
    online = [OnlineSample([[7] * k for k in ctx], [8] * i, [9] * o) for ctx, i, o in samples]
    batch = CCMDataCollator(config)(online)
    for row, (ctx, i, o) in enumerate(samples):
        layout = sample_layout(ctx, i + o, n)
        length = len(layout.segment_ids)
        assert batch["segment_ids"][row, :length].tolist() == layout.segment_ids
        assert batch["position_ids"][row, :length].tolist() == layout.position_ids
        assert (batch["segment_ids"][row, length:] == 0).all()
        if "labels" in batch:
            assert (batch["labels"][row] != IGNORE_INDEX).sum() == o
    assert batch["input_ids"].dtype == torch.long


def test_dense_supervision_labels_every_later_context_but_its_first_token():
    collate = CCMDataCollator(CCMConfig(num_comp_tokens=1), supervision="dense")
    batch = collate([OnlineSample([[5, 6, 7], [8, 9, 10], [11]], [12], [13, 14])])
    ignore = IGNORE_INDEX
    #                      c(1) 5 6 7  COMP  c(2) 8   9   10  COMP c(3) 11 COMP  I 12  O 13 14
    assert batch["labels"][0].tolist() == [ignore] * 4 + [ignore, 9, 10, ignore] + [ignore, ignore] + [ignore, 13, 14]
    with pytest.raises(ValueError, match=r"supervision must be one of \('output', 'dense'\)"):
        CCMDataCollator(CCMConfig(), supervision="everything")


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_dense_loss_is_the_mean_nll_of_each_context_given_the_memory_before_it(update):
    model = tiny_ccm("llama", update=update)
    sample = OnlineSample([[5, 6, 7], [8, 9, 10, 11], [12, 13]], [14, 15], [16, 17])
    with torch.no_grad():
        loss = model(**CCMDataCollator(model, supervision="dense")([sample])).loss
        terms = []
        for step in range(1, len(sample.contexts)):
            context = sample.contexts[step]
            logits = reference_logits(model, sample.contexts[:step], context)
            terms.append(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(context[1:]), reduction="none"))
        io = [*sample.input, *sample.output]
        logits = reference_logits(model, sample.contexts, io)[len(sample.input) - 1 : -1]
        terms.append(torch.nn.functional.cross_entropy(logits, torch.tensor(sample.output), reduction="none"))
    assert torch.allclose(loss, torch.cat(terms).mean(), atol=1e-4)


@given(
    lengths=st.lists(st.tuples(st.lists(st.integers(1, 6), max_size=4), st.integers(1, 4)), min_size=1, max_size=3),
    multiple=st.integers(1, 40),
)
def test_pad_to_multiple_of_only_appends_padding(lengths, multiple):
    samples = [OnlineSample([[7] * k for k in ctx], [8] * i, [9]) for ctx, i in lengths]
    plain = CCMDataCollator(CONFIG)(samples)
    padded = CCMDataCollator(CONFIG, pad_to_multiple_of=multiple)(samples)
    length = plain["input_ids"].shape[1]
    assert padded["input_ids"].shape[1] % multiple == 0 and 0 <= padded["input_ids"].shape[1] - length < multiple
    for key, tensor in plain.items():
        assert torch.equal(padded[key][:, :length], tensor)
    assert (padded["labels"][:, length:] == IGNORE_INDEX).all() and not padded["comp_mask"][:, length:].any()
    assert (padded["segment_ids"][:, length:] == 0).all()


def test_padding_to_a_multiple_leaves_the_loss_as_it_was():
    model = tiny_ccm("llama")
    samples = [OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13]), OnlineSample([[14]], [15], [16])]
    with torch.no_grad():
        plain = model(**CCMDataCollator(model)(samples)).loss
        padded = model(**CCMDataCollator(model, pad_to_multiple_of=16)(samples)).loss
    assert torch.allclose(plain, padded, atol=1e-5)
    # Refused when the collator is made, naming the setting: a float failed at the first batch, inside the padding.
    for multiple in (0, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"CCMDataCollator.pad_to_multiple_of must be a positive integer"):
            CCMDataCollator(model, pad_to_multiple_of=multiple)


@given(
    lengths=st.lists(st.tuples(st.lists(st.integers(1, 6), max_size=4), st.integers(1, 4)), min_size=1, max_size=3),
    with_output=st.booleans(),
    layout=st.sampled_from(["ccm", "full_context"]),
)
def test_sequence_length_is_the_unpadded_row_length(lengths, with_output, layout):
    samples = [OnlineSample([[7] * k for k in ctx], [8] * i, [9] if with_output else None) for ctx, i in lengths]
    collate = CCMDataCollator(CONFIG, pad_token_id=0, layout=layout)
    for sample in samples:
        assert collate.sequence_length(sample) == collate([sample])["input_ids"].shape[1]


def test_tokenized_samples_collate_to_the_same_batch():
    from transformers_ccm.embedded import load_tokenizer
    from transformers_ccm.tasks import make_samples

    tokenizer = load_tokenizer("default")
    samples = [*make_samples("mixture", "train", 12, seed=4), OnlineSample(["a", "a b"], "a", None)]
    collate = CCMDataCollator(CONFIG, tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id, supervision="dense")
    tokenized = collate.tokenized(samples)
    assert all(not isinstance(text, str) for sample in tokenized for text in (*sample.contexts, sample.input))
    assert tokenized[-1].output is None
    for key, tensor in collate(samples).items():
        assert torch.equal(collate(tokenized)[key], tensor), key
    without_tokenizer = [OnlineSample([[5]], "hello")]
    assert CCMDataCollator(CONFIG).tokenized(without_tokenizer) == without_tokenizer


@pytest.mark.parametrize("layout", ["ccm", "full_context"])
def test_samples_past_learned_absolute_positions_are_refused_naming_the_sample(tmp_path, layout):
    """GPT-2 has 512 learned positions: a longer sample failed inside the embedding (IndexError: index out of range
    in self) at whichever training step drew it. Rotary models of fixed frequencies have no such limit in the parallel
    forward (the online path re-bases their positions)."""
    from transformers_ccm.training import TrainingRecipe, train

    gpt2 = tiny_ccm("gpt2", num_comp_tokens=2)
    fits, too_long = (OnlineSample([[5] * 300], [6] * 100, [7] * k) for k in (112, 113))  # last positions 511, 512
    collate = CCMDataCollator(gpt2, layout=layout)
    assert collate([fits])["position_ids"].max() == 511
    with pytest.raises(ValueError, match=r"samples\[1\] reaches position 512, past the model's 512 learned absolute"):
        collate([fits, too_long])
    CCMDataCollator(tiny_ccm("llama", num_comp_tokens=2), layout=layout)([too_long])
    if layout == "ccm":
        with pytest.raises(ValueError, match=r"samples\[1\] reaches position 512"):
            train(gpt2, None, [fits, too_long], None, tmp_path / "run", TrainingRecipe(steps=1, batch_size=2))
        assert not (tmp_path / "run").exists()


@settings(max_examples=30, deadline=None)
@given(
    total=st.integers(500, 512),
    split=st.integers(0, 1),
    input_length=st.integers(1, 4),
    output_length=st.none() | st.integers(0, 4),
    n=st.integers(1, 3),
)
@example(total=511, split=0, input_length=1, output_length=None, n=2)  # the block alone reaches position 512
@example(total=510, split=1, input_length=1, output_length=0, n=2)  # the last position the model has
def test_a_comp_block_past_learned_absolute_positions_is_refused(total, split, input_length, output_length, n):
    """The <COMP> block after the last context takes the positions after it, beyond a short input and output: a
    sample whose block alone passed GPT-2's 512 positions was collated, and failed inside the embedding."""
    contexts = [total] if split == 0 else [total // 2, total - total // 2]
    gpt2 = tiny_ccm("gpt2", num_comp_tokens=n)
    output = None if output_length is None else [7] * output_length
    sample = OnlineSample([[5] * length for length in contexts], [6] * input_length, output)
    last = max(sum(contexts) + input_length + (output_length or 0), sum(contexts) + n) - 1
    collate = CCMDataCollator(gpt2)
    if last > 511:
        with pytest.raises(ValueError, match=rf"samples\[0\] reaches position {last}, past the model's 512 learned"):
            collate([sample])
        return
    batch = collate([sample])
    assert int(batch["position_ids"].max()) == last
    with torch.no_grad():
        gpt2(**batch)


@pytest.mark.parametrize("base", [tiny_longrope_base, tiny_dynamic_ntk_base])
def test_samples_past_the_original_context_of_a_dynamic_rotary_are_refused(tmp_path, base):
    """LongRoPE and dynamic NTK rotate every position of a forward that passes their original context (64) with other
    frequencies; inference compresses each context in a forward of its own, within it. A longer sample was trained on,
    its logits 0.04 away from what inference computes; one that fits gives inference's logits."""
    from transformers_ccm.training import TrainingRecipe, train

    model = randomize_adapter(CCMForCausalLM.from_base(base(), CCMConfig(num_comp_tokens=2))).eval()
    fits, too_long = (OnlineSample([[5] * 30, [6] * 30], [7, 8], [9] * k) for k in (2, 3))  # last positions 63, 64
    online = online_logits(model, [fits], "right")[0]
    torch.testing.assert_close(parallel_logits(model, [fits])[0], online, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"samples\[1\] reaches position 64, past the model's original context of 64"):
        CCMDataCollator(model)([fits, too_long])
    CCMDataCollator(model, layout="full_context")([too_long])  # one plain prompt, as the baseline reads it
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"samples\[1\] reaches position 64"):
        train(model, None, [fits, too_long], None, tmp_path / "run", TrainingRecipe(steps=1, batch_size=2))
    assert not (tmp_path / "run").exists()
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())


def test_a_pad_token_id_the_model_cannot_embed_is_refused_and_none_pads_with_zero():
    """A tokenizer without a pad token gives pad_token_id=None: collating failed with a TypeError. An id outside the
    vocabulary failed inside the embedding (padding positions are embedded, then masked) with torch's IndexError."""
    model = tiny_ccm("llama", num_comp_tokens=2)
    samples = [OnlineSample([[5, 6]], [7], [8]), OnlineSample([[5]], [7], [8])]
    batch = CCMDataCollator(model, pad_token_id=None)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 0, 0, 7, 8], [5, 0, 0, 7, 8, 0]]
    model(**batch)
    for pad in (-1, VOCAB, 2.0, True):
        with pytest.raises(ValueError, match=rf"CCMDataCollator.pad_token_id must be an integer in 0..{VOCAB - 1}"):
            CCMDataCollator(model, pad_token_id=pad)
    with pytest.raises(ValueError, match=r"CCMDataCollator.pad_token_id must be an integer >= 0"):
        CCMDataCollator(CONFIG, pad_token_id=-1)


def _spoiled(batch, name, value):
    return {**batch, name: value(batch[name])}


HAND_MADE = {
    "an id past the vocabulary": (
        "input_ids",
        lambda ids: ids.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(VOCAB + 3)),
        ValueError,
        rf"input_ids holds the token id {VOCAB + 3}, outside the model's vocabulary",
    ),
    "float ids": ("input_ids", lambda ids: ids.float(), ValueError, "input_ids must hold integer token ids"),
    "ids as a list": ("input_ids", lambda ids: ids.tolist(), TypeError, "input_ids must be a torch.Tensor, got list"),
    "a shorter comp_mask": (
        "comp_mask",
        lambda mask: mask[:, :-1],
        ValueError,
        r"tensors of one shape, got input_ids \(1, 7\), comp_mask \(1, 6\).*build it with CCMDataCollator",
    ),
    "labels of another length": (
        "labels",
        lambda labels: labels[:, 1:],
        ValueError,
        r"tensors of one shape, got .*labels \(1, 6\)",
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_MADE))
def test_a_hand_made_training_batch_that_does_not_fit_is_refused_naming_the_problem(case):
    """A batch built by hand failed inside torch: an IndexError (on CUDA a device-side assert that stops the process),
    an AttributeError for a list, a RuntimeError on mismatched sizes."""
    model = tiny_ccm("llama")
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [8], [9])])
    name, spoil, error, message = HAND_MADE[case]
    with pytest.raises(error, match=message):
        model(**_spoiled(batch, name, spoil))


def test_ids_at_comp_positions_of_a_training_batch_are_not_read():
    """`embed()` puts the `<COMP>` embeddings there whatever the ids say, so any id there is fine."""
    model = tiny_ccm("llama")
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [8], [9])])
    marked = _spoiled(batch, "input_ids", lambda ids: ids.masked_fill(batch["comp_mask"], -1))
    with torch.no_grad():
        torch.testing.assert_close(model(**marked).logits, model(**batch).logits, rtol=0, atol=0)
