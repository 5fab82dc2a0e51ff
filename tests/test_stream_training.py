"""Training on streams: the loss is the streamed perplexity `ccm stream-eval` measures, gradients reach the
adapter through every compression, and a tiny model learns to carry a token past the window in memory."""

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tiny_models import VOCAB, confident_tiny_llama, randomize_adapter, tiny_base, tiny_ccm, tiny_full_context_baseline
from transformers_ccm import CCMConfig, CCMForCausalLM, StreamingConfig
from transformers_ccm.baseline import full_context_config
from transformers_ccm.data import IGNORE_INDEX
from transformers_ccm.stream_evaluation import stream_nll
from transformers_ccm.stream_training import StreamCollator, stream_loss, tokens_before_compression
from transformers_ccm.training import TrainingRecipe, train

SMALL = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)


def test_the_collator_labels_only_tokens_predicted_after_the_first_compression():
    streams = [list(range(3, 3 + 19)), list(range(20, 20 + 19))]
    batch = StreamCollator(SMALL)(streams)
    assert batch["input_ids"].tolist() == streams
    warm = tokens_before_compression(SMALL)
    assert warm == 10
    assert (batch["labels"][:, : warm + 1] == IGNORE_INDEX).all()
    assert torch.equal(batch["labels"][:, warm + 1 :], batch["input_ids"][:, warm + 1 :])


@pytest.mark.parametrize(
    ("streams", "message"),
    [
        ([[5] * 19, [5] * 18], "one length, got lengths [18, 19]"),
        ([[5] * 11], "never compress: the sink and window take 10; give samples of at least 12 tokens"),
        # torch.tensor(..., dtype=torch.long) truncated these to other tokens without a word.
        ([[5] * 19, [5.7] * 19], "streams[1] must hold integer token ids"),
        ([[5] * 19, [True] * 19], "streams[1] must hold integer token ids"),
        ([[5] * 18 + [-1]], "streams[0] holds the token id -1, outside the model's vocabulary"),
        ([[5] * 18 + [VOCAB]], f"streams[0] holds the token id {VOCAB}, outside the model's vocabulary"),
        # The collator has no tokenizer: the fix named was to give CCMDataCollator one.
        (["a b c " * 19], "streams[0] is a string; a stream is token ids: tokenize its text first"),
        # Read as the byte values 5..23, token ids, without a word.
        ([bytes(range(5, 24))], "streams[0] is bytes, neither a string nor token ids"),
    ],
)
def test_the_collator_refuses_streams_it_cannot_train_on(streams, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        StreamCollator(SMALL, vocabulary=VOCAB)(streams)


def test_train_refuses_a_stream_it_cannot_train_on_before_the_first_step(tmp_path):
    """A stream of another length (or with other ids) failed at whichever step drew it, which here is none: one step
    of one stream trained on the first and never read the others."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    recipe = TrainingRecipe(steps=1, batch_size=1, streaming=SMALL, group_by_length=False)
    for streams, message in (
        ([[5] * 19] * 3 + [[5] * 18], r"one length, got lengths \[18, 19\]"),
        ([[5] * 19] * 3 + [[5] * 18 + [VOCAB]], rf"train_samples\[3\] holds the token id {VOCAB}"),
    ):
        with pytest.raises(ValueError, match=message):
            train(model, None, streams, None, tmp_path / "out", recipe)
        with pytest.raises(ValueError, match=message.replace("train_samples", "eval_samples")):
            train(model, None, [[5] * 19], streams, tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("architecture", "streaming", "error", "message"),
    [
        # StreamingLLM runs no <COMP> token: the backward failed inside torch ("does not require grad").
        ("llama", replace(SMALL, compress=False), ValueError, r"needs StreamingConfig\(compress=True\)"),
        # Sizes the model's 512 positions cannot hold, and a model without rotary embeddings, failed at the first step.
        ("llama", replace(SMALL, window_tokens=600), ValueError, "exceeds the model's maximum of 512 positions"),
        ("gpt2", SMALL, TypeError, "keys cannot follow"),
        ("llama", {"window_tokens": 8}, TypeError, "TrainingRecipe.streaming must be a StreamingConfig"),
    ],
)
def test_train_refuses_streaming_settings_it_cannot_train_with_before_the_first_step(
    tmp_path, architecture, streaming, error, message
):
    model = CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig())
    recipe = TrainingRecipe(steps=1, batch_size=1, streaming=streaming, group_by_length=False)
    with pytest.raises(error, match=message):
        train(model, None, [[5] * 700] * 2, None, tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    architecture=st.sampled_from(["llama", "qwen2", "gemma2", "gemma3", "gpt-neox"]),
    update=st.sampled_from(["concat", "merge"]),
    chunk=st.integers(2, 5),
    piece=st.integers(1, 6),
    sink=st.integers(0, 3),
    extra_window=st.integers(0, 8),
    tail=st.integers(1, 16),
    keep_window_full=st.booleans(),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
# The defaults' shape: the sink and window fill ends inside a piece (152 tokens, 9.5 pieces of 16), and so does the
# final token. Training began its pieces after the fill and ended them before that token: every compression came at
# other tokens than stream-eval's, and the loss was not the perplexity it reports.
@example("llama", "concat", 4, 4, 2, 4, 9, True, 1, 0)
def test_the_loss_is_the_streamed_perplexity_of_stream_eval(
    architecture, update, chunk, piece, sink, extra_window, tail, keep_window_full, batch, seed
):
    streaming = StreamingConfig(
        window_tokens=chunk + extra_window,
        sink_tokens=sink,
        compress_chunk=chunk,
        max_memory_tokens=4,
        keep_window_full=keep_window_full,
    )
    model = tiny_ccm(architecture, update=update)
    warm = tokens_before_compression(streaming)
    ids = torch.randint(3, VOCAB, (batch, warm + 1 + tail), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        loss = stream_loss(model, StreamCollator(streaming)(ids.tolist()), streaming, piece=piece)
    expected = [stream_nll(model, row, streaming, piece=piece).token_nll[warm:] for row in ids]
    assert loss.item() == pytest.approx(sum(map(sum, expected)) / sum(map(len, expected)), rel=1e-4)


@pytest.mark.parametrize("piece", [0, -2, 2.0, True, None])
def test_stream_loss_refuses_a_piece_that_is_not_a_positive_integer(piece):
    """0 failed on a modulo by zero, -2 on an empty torch.cat, 2.0 and None on bare TypeErrors; True streamed as 1."""
    batch = StreamCollator(SMALL)(torch.randint(3, VOCAB, (1, 19)).tolist())
    with pytest.raises(
        ValueError,
        match=rf"piece \(TrainingRecipe.stream_piece, ccm train --stream-piece\) must be a "
        rf"positive integer, got {piece!r}",
    ):
        stream_loss(tiny_ccm("llama"), batch, SMALL, piece=piece)


def test_gradients_reach_the_adapter_through_the_memory():
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))).train()
    ids = torch.randint(3, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    batch = StreamCollator(SMALL)(ids.tolist())
    # Only the last piece is labelled: the adapter reaches it through the memory alone (it never runs on tokens).
    batch["labels"][:, :-4] = IGNORE_INDEX
    stream_loss(model, batch, SMALL, piece=4).backward()
    assert model.comp_embeddings.grad is not None and model.comp_embeddings.grad.abs().sum() > 0
    # Every layer's <COMP> keys and values are read; the last layer's <COMP> queries feed nothing.
    read = [
        p.grad for name, p in model.named_parameters() if "lora_B" in name and ("k_proj" in name or "v_proj" in name)
    ]
    assert len(read) == 4 and all(grad is not None and grad.abs().sum() > 0 for grad in read)


def test_distillation_adds_the_kl_to_the_teacher_over_the_whole_stretch():
    model = tiny_ccm("llama")
    batch = StreamCollator(SMALL)(torch.randint(3, VOCAB, (2, 19)).tolist())
    with torch.no_grad():
        plain, distilled = stream_loss(model, batch, SMALL), stream_loss(model, batch, SMALL, distill_weight=1.0)
    assert distilled > plain
    # A full-context baseline teaches with its LoRA on; while that LoRA is zero it reads as the base model does.
    teacher = tiny_full_context_baseline()
    with torch.no_grad():
        assert torch.allclose(stream_loss(model, batch, SMALL, distill_weight=1.0, teacher=teacher), distilled)
        randomize_adapter(teacher, seed=5)
        assert not torch.allclose(stream_loss(model, batch, SMALL, distill_weight=1.0, teacher=teacher), distilled)


QUERY, KEYS, FILLER = 5, range(10, 30), list(range(60, 67))


def key_stream(rng: random.Random) -> list[int]:
    """Sink, a key and filler that fill the window, then QUERY, which pushes the key's chunk into memory, and the
    key again: the one labelled token, known only from memory."""
    key = rng.choice(KEYS)
    return [1, 1, key, *FILLER, QUERY, key]


def test_training_on_streams_learns_to_carry_a_token_past_the_window(tmp_path):
    base = confident_tiny_llama()
    model = CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=2, lora_dropout=0.0))
    held_out = StreamCollator(SMALL)([key_stream(random.Random(10_000 + i)) for i in range(64)])

    def key_loss() -> float:
        with torch.no_grad():
            return stream_loss(model.eval(), held_out, SMALL).item()

    before = key_loss()
    rng = random.Random(0)
    recipe = TrainingRecipe(
        steps=200, batch_size=32, learning_rate=1e-2, save_every=200, streaming=SMALL, stream_piece=1
    )
    train(model, None, [key_stream(rng) for _ in range(200 * 32)], None, tmp_path / "out", recipe)
    after = key_loss()
    assert after < 0.3 * before, (before, after)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("full_context", "checkpointing", "message"),
    [(True, False, "needs a compression adapter"), (False, True, "Gradient checkpointing does not apply")],
)
def test_train_refuses_streams_it_cannot_train(tmp_path, full_context, checkpointing, message):
    config = full_context_config(CCMConfig()) if full_context else CCMConfig()
    model = CCMForCausalLM.from_base(tiny_base("llama"), config)
    recipe = TrainingRecipe(
        steps=1,
        batch_size=1,
        streaming=SMALL,
        layout="full_context" if full_context else "ccm",
        gradient_checkpointing=checkpointing,
    )
    with pytest.raises(ValueError, match=message):
        train(model, None, [[5] * 19], None, tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()


def test_train_refuses_streams_under_a_distributed_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    with pytest.raises(ValueError, match="Training on streams runs in one process"):
        train(model, None, [[5] * 19], None, tmp_path / "out", TrainingRecipe(steps=1, batch_size=1, streaming=SMALL))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("piece", [0, -3, 2.0])
def test_stream_nll_refuses_a_piece_that_is_not_a_positive_integer(piece):
    """piece=0 failed inside range() and a negative piece scored nothing, whose perplexity divided by zero."""
    with pytest.raises(ValueError, match=r"piece \(ccm stream-eval --piece\) must be a positive integer"):
        stream_nll(tiny_ccm("llama"), torch.arange(3, 40), SMALL, piece=piece)


def test_stream_evaluation_refuses_what_it_would_misread():
    """A negative start of a perplexity counted from the end of the stream, True stood for 1, and streaming=None made a
    cache of compressed memory, then failed on an attribute of None."""
    result = stream_nll(tiny_ccm("llama"), torch.arange(3, 40), SMALL, piece=5)
    for start in (-3, True, 1.5):
        with pytest.raises(ValueError, match=f"start must be a position of the stream, an integer >= 0, got {start!r}"):
            result.perplexity(start)
    assert result.perplexity(0) == result.perplexity()
    with pytest.raises(TypeError, match="streaming must be a StreamingConfig, got NoneType"):
        stream_nll(tiny_ccm("llama"), torch.arange(3, 40), None)


@pytest.mark.parametrize("ablation", [False, True])
def test_streamingllm_of_an_adapter_acting_everywhere_is_refused_naming_the_adapter(ablation):
    """StreamingLLM is scored with the adapter off, which a LoRA at every position (the unconditional ablation, or a
    full-context adapter) cannot be on a stream it fills: it failed on a model call, blaming an adapter_disabled()
    context the caller never entered. It is refused up front; CCM's own stream of such an adapter still scores."""
    model = (
        randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(conditional_lora=False)))
        if ablation
        else tiny_full_context_baseline(seed=1)
    )
    ids = torch.arange(3, 40)
    with pytest.raises(ValueError, match=r"acts at every position \(conditional_lora=False\).*compression adapter"):
        stream_nll(model, ids, SMALL.same_size_baseline(model.config), piece=5)
    assert len(stream_nll(model, ids, SMALL, piece=5).token_nll) == 36
    baseline = stream_nll(tiny_ccm("llama"), ids, SMALL.same_size_baseline(model.config), piece=5)
    assert len(baseline.token_nll) == 36


@given(length=st.integers(min_value=2, max_value=30), piece=st.integers(min_value=1, max_value=12))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_stream_no_longer_than_its_budget_has_no_perplexity_after_it(length, piece):
    """A stream that ends before the KV budget fills (14 positions here) raised ZeroDivisionError in its report."""
    result = stream_nll(tiny_ccm("llama"), torch.arange(3, 3 + length), SMALL, piece=piece)
    report = result.to_dict(bucket=8)
    budget = SMALL.max_kv_length(tiny_ccm("llama").config)
    assert len(result.token_nll) == length - 1 and report["perplexity"] > 0
    assert (report["perplexity_after_budget"] is None) == (length - 1 <= budget)
    if report["perplexity_after_budget"] is None:
        with pytest.raises(ValueError, match=f"none from position {budget} on"):
            result.perplexity(budget)


def test_a_resumed_stream_run_is_refused_streams_of_another_length(tmp_path):
    """A run resumed with longer streams (ccm train --stream-chunks) went on through more compressions per sample, on
    other stretches of the text, without a word; now it is refused before anything changes, and the same length goes
    on."""
    recipe = TrainingRecipe(steps=2, batch_size=1, save_every=1, log_every=1, streaming=SMALL, stream_piece=4)
    streams = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(0)).tolist()
    run = tmp_path / "run"
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    train(model, None, [row[:19] for row in streams], None, run, recipe, stop_at_step=1)
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    before = {key: value.clone() for key, value in model.state_dict().items()}
    message = r"the streams' length \(ccm train --stream-chunks\): checkpoint 19 vs this run 23\); resume with"
    with pytest.raises(ValueError, match=message):
        train(model, None, streams, None, run, recipe, resume=True)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert train(model, None, [row[:19] for row in streams], None, run, recipe, resume=True).state.global_step == 2
