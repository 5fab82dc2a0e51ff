"""The single parallel forward equals the step-by-step recursion, on every architecture and update rule."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ccm_reference import reference_logits
from tiny_models import ARCHITECTURES, VOCAB, tiny_ccm
from transformers_ccm import CCMDataCollator, OnlineSample

TOLERANCE = 1e-4
tokens = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5)
samples = st.builds(
    OnlineSample,
    contexts=st.lists(tokens, min_size=0, max_size=6),
    input=tokens,
    output=st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=4),
)


def assert_matches_recursion(model, batch_samples):
    batch = CCMDataCollator(model)(batch_samples)
    with torch.no_grad():
        logits = model(**batch).logits
    for row, sample in enumerate(batch_samples):
        io = [*sample.input, *sample.output]
        end = int((batch["segment_ids"][row] > 0).sum())
        expected = reference_logits(model, sample.contexts, io)
        difference = (logits[row, end - len(io) : end] - expected).abs().max().item()
        assert difference <= TOLERANCE, f"row {row}: max |parallel - recursion| = {difference:.2e}"


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_samples=st.lists(samples, min_size=1, max_size=3), n=st.sampled_from([1, 2]))
def test_parallel_forward_equals_recursion(architecture, update, batch_samples, n):
    assert_matches_recursion(tiny_ccm(architecture, update=update, num_comp_tokens=n, ema_alpha=0.3), batch_samples)


@settings(max_examples=10, deadline=None)
@given(batch_samples=st.lists(samples, min_size=1, max_size=3), cap=st.integers(2, 7))
def test_capped_concat_equals_recursion(batch_samples, cap):
    assert_matches_recursion(tiny_ccm("llama", num_comp_tokens=2, max_memory_tokens=cap), batch_samples)


@pytest.mark.parametrize("update", ["concat", "merge"])
@settings(max_examples=5, deadline=None)
@given(batch_samples=st.lists(samples, min_size=1, max_size=2))
def test_unconditional_lora_equals_recursion(update, batch_samples):
    assert_matches_recursion(tiny_ccm("qwen3", update=update, conditional_lora=False), batch_samples)


def test_memory_is_used():
    """The compared logits really depend on the contexts (the test above cannot pass vacuously)."""
    model = tiny_ccm("llama", update="merge")
    collate = CCMDataCollator(model)
    with torch.no_grad():
        a = model(**collate([OnlineSample([[5, 6, 7]], [9, 10])])).logits[0, -2:]
        b = model(**collate([OnlineSample([[50, 60, 70]], [9, 10])])).logits[0, -2:]
    assert (a - b).abs().max() > 1e-3


def test_loss_is_next_token_nll_on_outputs_only():
    model = tiny_ccm("llama")
    sample = OnlineSample([[5, 6, 7], [8]], [20, 21], [30, 31, 32])
    batch = CCMDataCollator(model)([sample])
    with torch.no_grad():
        out = model(**batch)
    log_probs = reference_logits(model, sample.contexts, [20, 21, 30, 31, 32]).log_softmax(-1)
    expected = -torch.stack([log_probs[1, 30], log_probs[2, 31], log_probs[3, 32]]).mean()
    torch.testing.assert_close(out.loss, expected, atol=TOLERANCE, rtol=0)
