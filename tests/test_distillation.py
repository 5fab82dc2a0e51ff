"""Distillation from full context: the teacher sees the plain history; only the student's adapter learns."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import (
    ARCHITECTURES,
    InjectedFailure,
    fail_in_layer,
    randomize_adapter,
    tiny_base,
    tiny_ccm,
    tiny_full_context_baseline,
)
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.data import predicting_positions
from transformers_ccm.distillation import distillation_loss, kl_to_teacher, plain_history, plain_prompt_logits

SAMPLES = [
    OnlineSample([[5, 6, 7], [8, 9]], [10, 11], [12, 13]),
    OnlineSample([[14], [15, 16, 17], [18, 19]], [20], [21]),
]


def fresh(**config):
    return randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0, **config)))


def test_the_teacher_reads_the_plain_history_aligned_with_the_sequence():
    batch = CCMDataCollator(CCMConfig(num_comp_tokens=2))(SAMPLES)
    ids, index = plain_history(batch)
    for row, sample in enumerate(SAMPLES):
        plain = [token for context in sample.contexts for token in context] + [*sample.input, *sample.output]
        assert ids[row, : len(plain)].tolist() == plain
        ordinary = index[row] >= 0
        assert torch.equal(ids[row, index[row][ordinary]], batch["input_ids"][row][ordinary])
        assert torch.equal(batch["position_ids"][row][ordinary], index[row][ordinary])  # the same positions


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_teacher_projects_only_the_kept_positions(architecture):
    model = randomize_adapter(tiny_ccm(architecture))
    ids = torch.randint(5, 60, (2, 9))
    kept = torch.tensor([0, 3, 4, 8])
    assert torch.allclose(plain_prompt_logits(model, ids, kept), plain_prompt_logits(model, ids)[:, kept], atol=1e-5)


def test_no_memory_means_no_difference_to_distil():
    model = fresh()
    batch = CCMDataCollator(model)([OnlineSample([], [5, 6, 7], [8, 9])])
    with torch.no_grad():
        assert distillation_loss(model, batch, model(**batch).logits) < 1e-6


def test_distillation_trains_only_the_adapter_and_equals_on_labels_only_logits():
    model = fresh(update="merge")
    batch = CCMDataCollator(model, supervision="dense")(SAMPLES)
    out = model(**batch)
    loss = distillation_loss(model, batch, out.logits, temperature=2.0)
    assert loss > 1e-3
    kept = model(**batch, logits_at_labels=True)
    positions = (batch["labels"][:, 1:] != -100).any(dim=0).nonzero().squeeze(-1)
    assert torch.allclose(loss, distillation_loss(model, batch, kept.logits, 2.0, positions), atol=1e-6)
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None, name
        else:
            assert parameter.grad is None, name
    assert model.comp_embeddings.grad.abs().sum() > 0


def test_a_full_context_baseline_teaches_with_its_lora_on_and_learns_nothing():
    model = fresh()
    batch = CCMDataCollator(model)(SAMPLES)
    student = model(**batch).logits
    # A baseline whose LoRA is still zero reads the plain history as the base model does: self-distillation.
    untrained = distillation_loss(model, batch, student, teacher=tiny_full_context_baseline())
    assert torch.allclose(untrained, distillation_loss(model, batch, student), atol=1e-6)
    teacher = tiny_full_context_baseline(seed=7)
    loss = distillation_loss(model, batch, student, teacher=teacher)
    ids, index = plain_history(batch)
    with torch.no_grad():
        teacher_logits = teacher.base_model(input_ids=ids).logits  # its LoRA acts at every position
    supervised = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100) != -100
    rows = torch.arange(len(SAMPLES))[:, None].expand_as(supervised)
    expected = kl_to_teacher(student[supervised], teacher_logits[rows[supervised], index[supervised]], 1.0)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert (loss - untrained).abs() > 100 * 1e-6  # the LoRA changes the target far beyond float noise
    loss.backward()
    assert all(parameter.grad is None for parameter in teacher.parameters())
    assert model.comp_embeddings.grad.abs().sum() > 0


def test_the_teacher_reads_without_dropout_while_the_student_trains():
    # GPT-2's base model has dropout (0.1): the self-distillation teacher is its prediction, not a draw of its
    # dropout masks, and each module is left in the mode it had.
    model = CCMForCausalLM.from_base(tiny_base("gpt2"), CCMConfig(lora_dropout=0.0))
    batch = CCMDataCollator(model)(SAMPLES)
    ids, _ = plain_history(batch)
    with torch.no_grad():
        expected = tiny_base("gpt2")(input_ids=ids).logits
        student = model.eval()(**batch).logits
        in_eval = distillation_loss(model, batch, student)
        model.train()
        for _ in range(3):
            assert torch.allclose(plain_prompt_logits(model, ids), expected, atol=1e-5)
            assert torch.allclose(distillation_loss(model, batch, student), in_eval, atol=1e-6)
    assert all(module.training for module in model.modules())


def test_self_distillation_reads_the_base_model_with_an_unconditional_lora_too():
    # The unconditional ablation's LoRA acts at every position of the plain history too; teacher=None is the base
    # model all the same, as an untrained full-context baseline reads it.
    model = fresh(conditional_lora=False)
    batch = CCMDataCollator(model, supervision="dense")(SAMPLES)
    with torch.no_grad():
        student = model(**batch).logits
        base = distillation_loss(model, batch, student, teacher=tiny_full_context_baseline())
        assert torch.allclose(distillation_loss(model, batch, student), base, atol=1e-6)


TOKENS = st.lists(st.integers(3, 90), min_size=1, max_size=4)


@settings(max_examples=12, deadline=None)
@given(
    samples=st.lists(st.tuples(st.lists(TOKENS, max_size=4), TOKENS, TOKENS), min_size=1, max_size=3),
    supervision=st.sampled_from(["output", "dense"]),
    update=st.sampled_from(["concat", "merge"]),
    temperature=st.sampled_from([1.0, 2.0]),
)
def test_the_kl_is_the_base_model_on_the_whole_history_against_the_online_memory(
    samples, supervision, update, temperature
):
    """Summed over a batch, the KL is each sample's own sum of KL(base model reading the plain history || the
    memory of the online path), label by label: the teacher's positions are the student's, whatever the batch mates
    and padding."""
    model = tiny_ccm("llama", update=update, num_comp_tokens=2)
    online = [OnlineSample(contexts, input_ids, output) for contexts, input_ids, output in samples]
    batch = CCMDataCollator(model, supervision=supervision, pad_to_multiple_of=8)(online)
    expected = torch.zeros(())
    with torch.no_grad():
        for sample in online:
            history = [token for context in sample.contexts for token in context] + sample.input + sample.output
            teacher = tiny_base("llama")(input_ids=torch.tensor([history])).logits[0]
            cache, start, student, targets = model.new_cache(), 0, [], []
            for step, context in enumerate(sample.contexts):
                if supervision == "dense" and step:  # a context's tokens after its first, given the memory before it
                    student.append(model(input_ids=torch.tensor([context]), past_key_values=cache).logits[0, :-1])
                    targets.append(teacher[start : start + len(context) - 1])
                    model.compress(cache)
                else:
                    model.compress(cache, torch.tensor([context]))
                start += len(context)
            io = torch.tensor([sample.input + sample.output])
            student.append(model(input_ids=io, past_key_values=cache).logits[0, len(sample.input) - 1 : -1])
            targets.append(teacher[start + len(sample.input) - 1 : -1])
            student_log, teacher_log = (
                F.log_softmax(torch.cat(logits) / temperature, dim=-1) for logits in (student, targets)
            )
            expected += (teacher_log.exp() * (teacher_log - student_log)).sum() * temperature**2
        kl = distillation_loss(model, batch, model(**batch).logits, temperature, num_items_in_batch=1)
    assert torch.allclose(kl, expected, atol=1e-5, rtol=1e-4)


def test_logits_that_do_not_fit_the_batch_are_refused_naming_the_fix():
    model = tiny_ccm("llama")
    batch = CCMDataCollator(model)(SAMPLES)
    with torch.no_grad():
        full, kept = model(**batch).logits, model(**batch, logits_at_labels=True).logits
        one = model(**CCMDataCollator(model)(SAMPLES[:1])).logits
    positions = predicting_positions(batch["labels"])
    fix = r"logits_at_labels=True\) with positions=predicting_positions"
    for logits, at in ((full, positions), (kept, None), (one, None)):
        with pytest.raises(ValueError, match=rf"student_logits of shape \({logits.shape[0]}, .*{fix}"):
            distillation_loss(model, batch, logits, positions=at)
    unlabelled = {key: value for key, value in batch.items() if key != "labels"}
    with pytest.raises(ValueError, match="batch has no labels"):
        distillation_loss(model, unlabelled, full)
    assert torch.allclose(
        distillation_loss(model, batch, kept, positions=positions), distillation_loss(model, batch, full)
    )


def test_a_teacher_pass_that_fails_leaves_the_student_training_with_its_adapter_on():
    model = fresh().train()
    batch = CCMDataCollator(model)(SAMPLES)
    with torch.no_grad():
        before = model(**batch).logits
        handle = fail_in_layer(model, layer=1, after_calls=0)
        try:
            with pytest.raises(InjectedFailure):
                distillation_loss(model, batch, before)
        finally:
            handle.remove()
        assert all(module.training for module in model.modules())
        assert torch.equal(model(**batch).logits, before)  # the LoRA acts at <COMP> positions again
