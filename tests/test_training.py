"""A few hundred optimisation steps on a tiny model learn to answer from compressed contexts."""

import copy
import errno
import itertools
import json
import random
import re
import shutil
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import TrainingArguments

from crafted_files import pipe_feeding
from fault_injection import FAILURES, FailAt, count_operations
from test_files import file_size_limit, open_files_limit
from tiny_models import (
    VOCAB,
    InjectedFailure,
    confident_tiny_llama,
    fail_in_layer,
    more_tiny_base,
    randomize_adapter,
    tiny_base,
    tiny_full_context_baseline,
    tiny_llama_for,
)
from transformers_ccm import (
    CCMConfig,
    CCMDataCollator,
    CCMForCausalLM,
    CompressedMemoryCache,
    OnlineSample,
    StreamingConfig,
)
from transformers_ccm.baseline import full_context_config
from transformers_ccm.data import predicting_positions
from transformers_ccm.distillation import distillation_loss
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.stream_training import StreamCollator
from transformers_ccm.training import CCMTrainer, SimilarLengthSampler, TrainingRecipe, check_resume, train

QUERY, KEYS, LABELS = 5, range(10, 30), range(40, 56)


def recall_sample(rng: random.Random) -> OnlineSample:
    """Contexts are (key, label) pairs; the answer is the label of the last context, unknowable without it."""
    contexts = [[rng.choice(KEYS), rng.choice(LABELS)] for _ in range(rng.randint(1, 3))]
    return OnlineSample(contexts, [QUERY], [contexts[-1][1]])


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_training_learns_to_use_memory(update):
    base = confident_tiny_llama()
    model = CCMForCausalLM.from_base(base, CCMConfig(num_comp_tokens=2, update=update, lora_dropout=0.0))
    collate = CCMDataCollator(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rng = random.Random(0)
    for _ in range(200):
        model(**collate([recall_sample(rng) for _ in range(32)])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model.eval()
    held_out = [recall_sample(random.Random(10_000 + i)) for i in range(64)]
    no_context = [OnlineSample([], s.input, s.output) for s in held_out]
    wrong_context = [OnlineSample(held_out[i - 1].contexts, s.input, s.output) for i, s in enumerate(held_out)]
    with torch.no_grad():
        loss, loss_without, loss_wrong = (
            model(**collate(batch)).loss.item() for batch in (held_out, no_context, wrong_context)
        )
    assert loss < 0.3 * loss_without, (loss, loss_without)
    assert loss < 0.3 * loss_wrong, (loss, loss_wrong)


@pytest.mark.parametrize("architecture", ["llama", "gemma2", "gpt2", "phi3"])
def test_logits_at_labels_give_the_same_loss_and_gradients(architecture):
    def loss_and_gradients(at_labels: bool, items: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = randomize_adapter(CCMForCausalLM.from_base(tiny_base(architecture), CCMConfig(lora_dropout=0.0)))
        rng = random.Random(3)
        batch = CCMDataCollator(model)([recall_sample(rng) for _ in range(5)] + [OnlineSample([[7, 8]], [9], [])])
        extra = {} if items is None else {"num_items_in_batch": items}
        out = model(**batch, logits_at_labels=at_labels, **extra)
        out.loss.backward()
        if at_labels:
            assert out.logits.shape[1] < batch["input_ids"].shape[1]
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    for items in (None, 7):
        (full, full_grads), (kept, kept_grads) = loss_and_gradients(False, items), loss_and_gradients(True, items)
        assert torch.allclose(full, kept, atol=1e-6)
        for name, grad in full_grads.items():
            assert torch.allclose(grad, kept_grads[name], atol=1e-5), name


def test_train_with_dense_supervision_and_distillation(tmp_path):
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    before = model.comp_embeddings.detach().clone()
    rng = random.Random(0)
    recipe = TrainingRecipe(steps=3, batch_size=4, save_every=3, supervision="dense", distill_weight=1.0)
    trainer = train(model, None, [recall_sample(rng) for _ in range(12)], None, tmp_path / "out", recipe)
    assert trainer.distill_weight == 1.0 and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert not torch.equal(before, model.comp_embeddings)


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_two_runs_from_one_seed_train_the_same_adapter_bit_for_bit(tmp_path, update):
    """Batches large enough for torch to spread a step over threads: the `<COMP>` embeddings' gradient, summed over
    every `<COMP>` position of the batch, comes out the same on every run, so one seed gives one adapter."""
    samples = [recall_sample(random.Random(seed)) for seed in range(256)]
    recipe = TrainingRecipe(steps=2, batch_size=256, save_every=2, learning_rate=1e-2)
    adapters = []
    for run in ("first", "second"):
        model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update=update))
        train(model, None, samples, None, tmp_path / run, recipe)
        adapters.append(model.adapter_tensors())
    first, second = adapters
    assert [name for name, tensor in first.items() if not torch.equal(tensor, second[name])] == []


def test_two_runs_from_one_seed_train_a_mixture_of_experts_the_same_adapter_bit_for_bit(tmp_path):
    """Each token goes to 4 experts (as in Qwen2-MoE): transformers gathers the tokens by expert with repeated
    indices, whose gradient torch summed in a thread-dependent order once a batch held ~1,000 tokens; the run now
    uses torch's deterministic algorithms, and gives the caller's setting back."""
    samples = [recall_sample(random.Random(seed)) for seed in range(128)]
    recipe = TrainingRecipe(steps=2, batch_size=128, save_every=2, learning_rate=1e-2)
    adapters = []
    for run in ("first", "second"):
        model = CCMForCausalLM.from_base(more_tiny_base("qwen2_moe", num_experts_per_tok=4), CCMConfig())
        train(model, None, samples, None, tmp_path / run, recipe)
        adapters.append(model.adapter_tensors())
        assert not torch.are_deterministic_algorithms_enabled()
    first, second = adapters
    assert [name for name, tensor in first.items() if not torch.equal(tensor, second[name])] == []


def test_an_operation_without_a_deterministic_algorithm_still_runs_while_a_run_lasts(tmp_path):
    """The run's deterministic mode is the process's: strict, it made `Tensor.put_` (no deterministic algorithm on a
    CPU) fail in any code running meanwhile, here a hook after each optimizer step. It warns instead, and the mode is
    off again afterwards."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1)
    written = torch.zeros(3)
    handle = register_optimizer_step_post_hook(lambda *_: written.put_(torch.tensor([1]), torch.tensor([2.0])))
    try:
        with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
            train(model, None, [recall_sample(random.Random(0))] * 2, None, tmp_path, recipe)
    finally:
        handle.remove()
    assert written.tolist() == [0.0, 2.0, 0.0] and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("fails", [False, True])
def test_train_gives_back_the_callers_deterministic_algorithms_setting(tmp_path, fails):
    """The run turns torch's deterministic algorithms on for itself; a caller who had them on in warn-only mode has
    them so again, whether the run ends or fails."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1)
    if fails:
        fail_in_layer(model, 0, 0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        try:
            train(model, None, [recall_sample(random.Random(0))] * 2, None, tmp_path, recipe)
        except InjectedFailure:
            assert fails
        else:
            assert not fails
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("fails", [False, True])
def test_train_distils_from_a_frozen_full_context_teacher_and_gives_it_back_as_it_was(tmp_path, fails):
    """The teacher runs in evaluation mode and changes no weight; it came back frozen for good and in evaluation mode,
    and training it next (the fine-tuned baseline trained on) failed on a bare RuntimeError."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    teacher = tiny_full_context_baseline(seed=3).train()
    teacher.base_model.model.layers[0].eval()  # a module in another mode than the model's
    modes = [module.training for module in teacher.modules()]
    flags = {name: parameter.requires_grad for name, parameter in teacher.named_parameters()}
    assert any(flags.values())
    teacher_before = {name: value.clone() for name, value in teacher.state_dict().items()}
    teacher_modes: list[bool] = []
    teacher.base_model.register_forward_pre_hook(lambda module, _: teacher_modes.append(module.training))
    before = model.comp_embeddings.detach().clone()
    rng = random.Random(0)
    recipe = TrainingRecipe(steps=2, batch_size=4, save_every=2, distill_weight=1.0)
    samples = [recall_sample(rng) for _ in range(8)]
    handle = fail_in_layer(model, 1, after_calls=1) if fails else None
    try:
        if fails:
            with pytest.raises(InjectedFailure):
                train(model, None, samples, None, tmp_path / "out", recipe, teacher=teacher)
        else:
            trainer = train(model, None, samples, None, tmp_path / "out", recipe, teacher=teacher)
            assert trainer.distill_teacher is teacher and not torch.equal(before, model.comp_embeddings)
    finally:
        if handle is not None:
            handle.remove()
    assert teacher_modes and not any(teacher_modes)  # no dropout in the targets
    assert all(torch.equal(value, teacher_before[name]) for name, value in teacher.state_dict().items())
    assert [module.training for module in teacher.modules()] == modes
    assert {name: parameter.requires_grad for name, parameter in teacher.named_parameters()} == flags
    baseline = TrainingRecipe(steps=2, batch_size=4, save_every=2, layout="full_context")
    train(teacher, None, samples, None, tmp_path / "teacher", baseline)
    assert not all(torch.equal(value, teacher_before[name]) for name, value in teacher.state_dict().items())


def _memory_keys(model):
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7, 8]]))
    return [layer.keys for layer in cache.layers]


def _train(model: CCMForCausalLM, samples: list, output_dir: Path, recipe: TrainingRecipe, fails: bool) -> None:
    """`train()` on `samples`, or with its first step failing in a layer (`InjectedFailure`) where `fails`."""
    if not fails:
        train(model, None, samples, None, output_dir, recipe)
        return
    handle = fail_in_layer(model, 1, after_calls=0)
    try:
        with pytest.raises(InjectedFailure):
            train(model, None, samples, None, output_dir, recipe)
    finally:
        handle.remove()


@pytest.mark.parametrize("fails", [False, True])
def test_train_gives_the_model_back_in_the_mode_it_had(tmp_path, fails):
    """The Trainer switches the model to training mode and left it there, after a run or a failed step: the LoRA's
    dropout (and a base model's own, GPT-2's say) then made every later compress and generate random."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.5)))
    before = _memory_keys(model)
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1, learning_rate=0.0)
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    _train(model, samples, tmp_path / "out", recipe, fails)
    assert not model.training and not any(module.training for module in model.modules())
    for _ in range(2):  # no dropout: the same memory as before training (a learning rate of 0 keeps the weights)
        assert all(torch.equal(a, b) for a, b in zip(_memory_keys(model), before, strict=True))
    model.train()
    train(model, None, samples, None, tmp_path / "again", recipe)
    assert model.training


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(training=st.booleans(), switched=st.sets(st.integers(0, 200), max_size=6), fails=st.booleans())
def test_train_gives_every_module_back_its_own_mode(tmp_path_factory, training, switched, fails):
    """The model came back with every module in the model's mode: a module the caller kept in another mode (a
    frozen part in evaluation mode within a model in training mode, say) was switched for good."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.5)))
    model.train(training)
    modules = list(model.modules())
    for index in switched:
        modules[index % len(modules)].train(not training)
    before = [module.training for module in modules]
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1)
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    _train(model, samples, tmp_path_factory.mktemp("run") / "out", recipe, fails)
    assert [module.training for module in modules] == before


def _hooks(model: torch.nn.Module) -> dict[str, int]:
    """How many hooks of each kind `model`'s modules hold."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return {kind: sum(len(getattr(module, kind)) for module in model.modules()) for kind in kinds}


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("every_n_layers", [None, 2])
def test_gradient_checkpointing_is_for_the_run_only(tmp_path, fails, every_n_layers):
    """`TrainingRecipe(gradient_checkpointing=True)` left the model recomputing its activations, with a require-grads
    hook on its embeddings, after the run, also a failed one; a model checkpointing already had it turned on again
    with other settings."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    if every_n_layers is not None:
        model.activation_checkpointing_enable(every_n_layers=every_n_layers)
    layers = [layer.gradient_checkpointing for layer in model.base_model.model.layers]
    hooks = _hooks(model)
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1, gradient_checkpointing=True)
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    _train(model, samples, tmp_path / "out", recipe, fails)
    assert [layer.gradient_checkpointing for layer in model.base_model.model.layers] == layers
    assert model.is_activation_checkpointing == (every_n_layers is not None) and _hooks(model) == hooks


def _generator_states() -> tuple:
    return random.getstate(), repr(np.random.get_state()), torch.get_rng_state()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), fails=st.booleans())
def test_train_gives_the_caller_its_random_generators_back(tmp_path_factory, seed, fails):
    """The Trainer seeds Python's, numpy's and torch's generators with the run's seed: what a caller drew after
    `train()` (sampled replies, say) was the same whatever seed it had set."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.5)))
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1)
    samples = [recall_sample(random.Random(index)) for index in range(4)]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    before = _generator_states()
    _train(model, samples, tmp_path_factory.mktemp("run") / "out", recipe, fails)
    python, numpy, cpu = _generator_states()
    assert python == before[0] and numpy == before[1] and torch.equal(cpu, before[2])


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("own", [None, True])
def test_train_leaves_the_model_config_as_it_was(tmp_path, own, fails):
    """The Trainer sets `model.config.use_cache = False` for good: a CCMConfig held an attribute of the run's after
    it, which a caller reading `getattr(model.config, "use_cache", True)` took for its own."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    if own is not None:
        model.config.use_cache = own
    config = model.config
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    _train(model, samples, tmp_path / "out", TrainingRecipe(steps=1, batch_size=2, save_every=1), fails)
    assert model.config is config and getattr(model.config, "use_cache", "unset") == ("unset" if own is None else own)


@pytest.mark.parametrize(
    ("context", "name"), [(torch.no_grad, "torch.no_grad()"), (torch.inference_mode, "torch.inference_mode()")]
)
def test_train_with_gradients_disabled_is_refused_before_any_work(tmp_path, context, name):
    """Inside `torch.no_grad()` (an evaluation loop's, say) the first step's backward failed on a bare RuntimeError,
    with the output folder made."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    with context(), pytest.raises(ValueError, match=rf"inside {re.escape(name)}, where no gradient.*call it outside"):
        train(model, None, samples, None, tmp_path / "out", TrainingRecipe(steps=1, batch_size=2, save_every=1))
    assert not (tmp_path / "out").exists()
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    train(model, None, samples, None, tmp_path / "out", TrainingRecipe(steps=2, batch_size=2, save_every=2))
    assert not torch.equal(model.comp_embeddings, before["comp_embeddings"])


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("steps", 0),  # the Trainer read it as "train 3 epochs instead"
        ("steps", -1),
        ("steps", 2.5),
        ("batch_size", 0),
        ("gradient_accumulation", 0),  # ZeroDivisionError inside the Trainer
        ("eval_every", 0),
        ("save_every", 0),
        ("learning_rate", -1e-3),
        ("learning_rate", float("nan")),
        ("warmup_ratio", -0.5),
        ("distill_weight", -1.0),
        ("distill_temperature", 0.0),
        ("stream_piece", 0),
        ("pad_to_multiple_of", 0),
        ("seed", -1),  # numpy's "Seed must be between 0 and 2**32 - 1", once the model was set up for training
        ("seed", 2**32),
        # Read as truth values: "false" turned checkpointing on, None turned grouping off.
        ("gradient_checkpointing", "false"),
        ("gradient_checkpointing", 1),
        ("group_by_length", None),
        ("group_by_length", "no"),
    ],
)
def test_a_recipe_with_a_bad_value_is_refused_before_training(setting, value):
    """steps=0 or -1 trained (and wrote an adapter) for whole epochs; gradient_accumulation=0 divided by zero."""
    with pytest.raises(ValueError, match=rf"TrainingRecipe\.{setting} must be"):
        TrainingRecipe(**{"steps": 1, "batch_size": 2, setting: value})


@pytest.mark.parametrize("resume", ["False", None])
def test_train_refuses_a_resume_flag_other_than_true_or_false_before_any_work(tmp_path, resume):
    """resume="no" is truthy: the run went on from the checkpoint there, as resume=True does."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=rf"^resume must be True or False, got {re.escape(repr(resume))}\.$"):
        train(model, None, [OnlineSample([[5]], [6], [7])], None, tmp_path / "out", resume=resume)
    assert list((tmp_path / "out").iterdir()) == []


@given(steps=st.integers(max_value=0), batch_size=st.integers(min_value=1, max_value=64))
def test_a_recipe_takes_only_positive_steps(steps, batch_size):
    with pytest.raises(ValueError, match=r"TrainingRecipe\.steps must be a positive integer"):
        TrainingRecipe(steps=steps, batch_size=batch_size)
    assert TrainingRecipe(steps=1 - steps, batch_size=batch_size).steps == 1 - steps


@pytest.mark.parametrize(
    ("teacher_base", "distill_weight", "message"),
    [
        ("llama", 0.0, "distill_weight is 0"),
        ("mistral", 1.0, "give an adapter of the same base"),
        # The same architecture and shapes, other weights: its logits are another model's.
        ("llama-other-weights", 1.0, "runs on other base weights"),
        (None, 1.0, "teacher is the model being trained"),
        # Reading the plain history with its adapter off, it was its base model: teacher=None, without a word.
        ("compression", 1.0, r"is a compression adapter \(conditional_lora=True\).*leave teacher=None"),
    ],
)
def test_train_refuses_a_teacher_it_cannot_use(tmp_path, teacher_base, distill_weight, message):
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    if teacher_base is None:
        teacher = model
    elif teacher_base == "compression":
        teacher = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    elif teacher_base == "llama-other-weights":
        teacher = CCMForCausalLM.from_base(tiny_base("llama", seed=1), full_context_config(CCMConfig()))
    else:
        teacher = tiny_full_context_baseline(teacher_base)
    recipe = TrainingRecipe(steps=1, batch_size=2, distill_weight=distill_weight)
    with pytest.raises(ValueError, match=message):
        train(model, None, [recall_sample(random.Random(0))] * 2, None, tmp_path / "out", recipe, teacher=teacher)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("group_by_length", [True, False])
@pytest.mark.parametrize("where", ["train", "eval"])
def test_train_refuses_an_id_outside_the_vocabulary_before_the_first_step(tmp_path, group_by_length, where):
    """A JSONL file of ids for another tokenizer failed with torch's IndexError at the batch that held it (or at the
    first evaluation); every sample is now read before training starts."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    before = model.comp_embeddings.detach().clone()
    samples = [recall_sample(random.Random(seed)) for seed in range(8)]
    bad = [*samples[:7], OnlineSample([[5, 6]], [7], [VOCAB + 3])]
    train_samples, eval_samples = (bad, None) if where == "train" else (samples, bad)
    recipe = TrainingRecipe(steps=2, batch_size=2, eval_every=1, save_every=1, group_by_length=group_by_length)
    with pytest.raises(ValueError, match=rf"^{where}_samples\[7\].output holds the token id {VOCAB + 3}, outside"):
        train(model, None, train_samples, eval_samples, tmp_path / "out", recipe)
    assert torch.equal(before, model.comp_embeddings)
    assert not list(tmp_path.glob("out/checkpoint-*"))


def test_train_draws_length_grouped_batches_the_same_on_every_run(tmp_path):
    short = [OnlineSample([[11, 41]], [QUERY], [41]) for _ in range(8)]
    long = [OnlineSample([[12, 42, 13, 43] * 4] * 3, [QUERY], [43]) for _ in range(8)]
    recipe = TrainingRecipe(steps=4, batch_size=4, save_every=4)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    trainer = train(model, None, short + long, None, tmp_path / "grouped", recipe)
    width = {CCMDataCollator(model).sequence_length(sample[0]) for sample in (short, long)}
    widths = [[batch["input_ids"].shape[1] for batch in trainer.get_train_dataloader()] for _ in range(2)]
    assert widths[0] == widths[1] and sorted(widths[0]) == sorted([*width, *width])  # never short beside long

    shuffled = replace(recipe, group_by_length=False)
    trainer = train(model, None, short + long, None, tmp_path / "shuffled", shuffled)
    mixed = [batch["input_ids"].shape[1] for batch in trainer.get_train_dataloader()]
    assert trainer.sample_lengths is None and sorted(mixed) != sorted(widths[0])


def test_length_grouping_benchmark_trains_both_ways_on_the_same_samples(tiny_model):
    from benchmarks import length_grouping

    assert length_grouping.padded_positions([1] * 4 + [10] * 4, 4, grouped=True, multiple=None) == 44
    assert length_grouping.padded_positions([1] * 4 + [10] * 4, 4, grouped=True, multiple=8) == 4 * 8 + 4 * 16
    report = length_grouping.run(tiny_model, "mixture", 2, 2, "fp32", 1.0, seed=0, eval_samples=2)
    shuffled, grouped = report["shuffled"], report["grouped"]
    assert 1.0 <= grouped["positions_per_token"] < shuffled["positions_per_token"]
    for row in (shuffled, grouped):
        assert len(row["loss"]) == 2 and row["eval_loss"] > 0 and row["seconds_per_sample"] > 0


@given(
    lengths=st.lists(st.integers(1, 300), max_size=120),
    batch_size=st.integers(1, 9),
    group=st.integers(1, 6),
    seed=st.integers(0, 3),
)
def test_similar_length_batches_hold_every_sample_once_longest_first(lengths, batch_size, group, seed):
    sampler = SimilarLengthSampler(lengths, batch_size, seed, group)
    batches = sampler.batches()
    assert sorted(index for batch in batches for index in batch) == list(range(len(lengths)))
    assert all(len(batch) == batch_size for batch in batches[:-1])  # the one short batch comes last
    assert all(len(batch) <= batch_size for batch in batches)
    if lengths:
        assert max(lengths) in [lengths[index] for index in batches[0]]
    assert batches == SimilarLengthSampler(lengths, batch_size, seed, group).batches()  # the same draws for a seed
    # One group holding every sample: the batches are cut from one ordering by length, so their ranges never overlap.
    whole = SimilarLengthSampler(lengths, batch_size, seed, group=len(lengths) + 1).batches()
    ranges = sorted((min(lengths[i] for i in batch), max(lengths[i] for i in batch)) for batch in whole)
    assert all(high <= low for (_, high), (low, _) in itertools.pairwise(ranges))


def test_each_epoch_draws_its_own_batches_and_a_resumed_run_draws_them_again():
    """The Trainer sets the epoch before each pass: every pass holds every sample once in batches drawn anew (the
    same order every epoch trains on the same batches in the same order), and a fresh sampler set to an epoch, as in a
    run resumed there, draws what the first run drew in it."""
    lengths = [(7 * index) % 97 + 1 for index in range(200)]
    sampler = SimilarLengthSampler(lengths, 4, seed=3, group=5)
    passes = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        passes.append(sampler.batches())
        assert sorted(index for batch in passes[-1] for index in batch) == list(range(len(lengths)))
        resumed = SimilarLengthSampler(lengths, 4, seed=3, group=5)
        resumed.set_epoch(epoch)
        assert resumed.batches() == passes[-1]
    assert passes[0] != passes[1] != passes[2] != passes[0]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=150),
    per_device=st.integers(1, 5),
    accumulation=st.integers(1, 3),
    processes=st.integers(1, 4),
    group=st.integers(1, 4),
)
def test_each_process_gets_as_many_batches_each_a_piece_of_one_similar_length_batch(
    lengths, per_device, accumulation, processes, group
):
    """As the Trainer runs it under DDP: a DataLoader cuts the stream into per-device batches and accelerate deals
    them out (`BatchSamplerShard`, even batches). The short batch, shuffled into the middle, shifted every cut after
    it: those batches straddled two batches of unlike lengths (on 1003 samples, the spread of lengths within a batch
    rose about tenfold)."""
    from accelerate.data_loader import BatchSamplerShard

    sampler = SimilarLengthSampler(lengths, per_device * accumulation, seed=0, group=group)
    owner = {index: number for number, batch in enumerate(sampler.batches()) for index in batch}
    cuts = torch.utils.data.BatchSampler(sampler, per_device, drop_last=False)
    shards = [list(BatchSamplerShard(cuts, processes, rank, even_batches=True)) for rank in range(processes)]
    assert len({len(shard) for shard in shards}) == 1  # no process waits for a step the others never take
    dealt = [batch for round_ in zip(*shards, strict=True) for batch in round_]
    # Every sample once in the first batches; accelerate then fills the last one and round from the stream's start.
    unique = -(-len(lengths) // per_device)
    once = [index for batch in dealt[: unique - 1] for index in batch]
    assert len(set(once)) == len(once) and {index for batch in dealt[:unique] for index in batch} == set(owner)
    assert all(len({owner[index] for index in batch}) == 1 for batch in dealt[: unique - 1])


def test_ccm_train_groups_by_length_unless_told_not_to():
    from transformers_ccm.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["train", "--output-dir", "x"]).group_by_length
    assert not parse(["train", "--output-dir", "x", "--no-group-by-length"]).group_by_length


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run of 2 steps with a checkpoint after each."""
    folder = tmp_path_factory.mktemp("run")
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    train(model, None, samples, None, folder, TrainingRecipe(steps=2, batch_size=2, save_every=1))
    return folder, samples


def _truncate(path, keep):
    path.write_bytes(path.read_bytes()[: int(keep * path.stat().st_size)])


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("config", "difference"),
    [
        (CCMConfig(lora_dropout=0.0, update="merge"), "update: checkpoint 'concat' vs model 'merge'"),
        (CCMConfig(lora_dropout=0.0, r=4), "r: checkpoint 8 vs model 4"),
        (CCMConfig(lora_dropout=0.0, num_comp_tokens=3), "num_comp_tokens: checkpoint 2 vs model 3"),
        # A cap changes which memory every context sees: the run went on training another memory without a word.
        (CCMConfig(lora_dropout=0.0, max_memory_tokens=3), "max_memory_tokens: checkpoint None vs model 3"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_adapter(tmp_path_factory, two_checkpoints, config, difference):
    """Another update rule was taken from the checkpoint without a word (a run asked for merge went on, and was saved,
    as concat); another structure was refused with a fix for another situation (load it with from_pretrained)."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("other") / "run"
    shutil.copytree(folder, run)
    model = CCMForCausalLM.from_base(tiny_base("llama"), config)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    recipe = TrainingRecipe(steps=3, batch_size=2, save_every=1)
    with pytest.raises(ValueError, match=rf"checkpoint-2 holds another adapter \({re.escape(difference)}\); build the"):
        train(model, None, samples, None, run, recipe, resume=True)
    assert model.config.update == config.update
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert sorted(path.name for path in run.iterdir()) == sorted(path.name for path in folder.iterdir())


def test_resume_refuses_an_ema_checkpoint_of_another_alpha_naming_the_flag(tmp_path):
    """An EMA run resumed with another ema_alpha is refused (each memory would mix its compressions otherwise than the
    checkpoint was trained to read), and the fix names --ema-alpha among the flags to give as the run did: it named
    --update, --num-comp-tokens, --lora-r, --target-modules and --method, none of which differed."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0, update="ema", ema_alpha=0.5))
    samples = [recall_sample(random.Random(seed)) for seed in range(2)]
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1)
    train(model, None, samples, None, tmp_path / "run", recipe)
    check_resume(tmp_path / "run", replace(model.config, base_model_shape=None), recipe)  # the same alpha resumes
    with pytest.raises(
        ValueError,
        match=r"checkpoint-1 holds another adapter \(ema_alpha: checkpoint 0\.5 vs model 0\.25\); build the model as "
        r"the run that wrote it did \(ccm train: the same --update, --ema-alpha, --num-comp-tokens, --lora-r, "
        r"--target-modules and --method\)",
    ):
        check_resume(tmp_path / "run", CCMConfig(lora_dropout=0.0, update="ema", ema_alpha=0.25), recipe)


def test_resume_refuses_a_checkpoint_trained_on_other_samples(tmp_path_factory, two_checkpoints):
    """It went on from the checkpoint's step and data order on the new samples, and the adapter's card named them."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("other") / "run"
    shutil.copytree(folder, run)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0, trained_on="my chats"))
    with pytest.raises(
        ValueError,
        match=r"checkpoint-2 was trained on samples it does not name, and this run trains "
        r'on "my chats"; resume with the samples of the run that wrote it',
    ):
        train(model, None, samples, None, run, TrainingRecipe(steps=3, batch_size=2, save_every=1), resume=True)
    assert sorted(path.name for path in run.iterdir()) == sorted(path.name for path in folder.iterdir())


@pytest.mark.parametrize(
    "damage",
    [
        ("optimizer.pt", lambda path: _truncate(path, 0.5), "optimizer.pt is damaged"),
        ("optimizer.pt", _flip_middle_byte, "optimizer.pt is damaged"),
        ("scheduler.pt", lambda path: path.write_bytes(b""), "scheduler.pt is damaged"),
        ("trainer_state.json", lambda path: _truncate(path, 0.5), "trainer_state.json is not valid JSON"),
        # Missing: the Trainer silently started the optimizer or scheduler anew (a fresh Adam state, a second warm-up).
        ("optimizer.pt", lambda path: path.unlink(), "is incomplete: it has no optimizer.pt"),
        ("scheduler.pt", lambda path: path.unlink(), "is incomplete: it has no scheduler.pt"),
        # The adapter's own reader raised a FileNotFoundError, or named a fix (save it again) for no checkpoint.
        ("adapter_model.safetensors", lambda path: path.unlink(), "is incomplete: it has no adapter_model.safetensors"),
        ("ccm_config.json", lambda path: path.unlink(), "is incomplete: it has no ccm_config.json"),
        ("adapter_model.safetensors", lambda path: _truncate(path, 0.5), "holds a damaged adapter .*corrupt"),
        ("adapter_config.json", _flip_middle_byte, "holds a damaged adapter .*mixes files of different saves"),
    ],
    ids=[
        "cut-optimizer",
        "flipped-optimizer",
        "empty-scheduler",
        "cut-state",
        "no-optimizer",
        "no-sched",
        "no-adapter",
        "no-config",
        "cut-adapter",
        "flipped-adapter-config",
    ],
)
def test_resume_refuses_a_damaged_checkpoint_before_loading_it(tmp_path_factory, two_checkpoints, damage):
    """A checkpoint cut short (a run killed while writing it) failed with a bare OSError or JSONDecodeError once the
    Trainer had loaded its adapter into the model; the error now names the file and the fix, and changes nothing."""
    name, spoil, message = damage
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(folder, run)
    spoil(run / "checkpoint-2" / name)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    recipe = TrainingRecipe(steps=3, batch_size=2, save_every=1)
    with pytest.raises(ValueError, match=f"{message}.*delete .*checkpoint-2 to resume from the checkpoint before it"):
        train(model, None, samples, None, run, recipe, resume=True)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    shutil.rmtree(run / "checkpoint-2")  # the fix the message names: resume from the checkpoint before it
    assert train(model, None, samples, None, run, recipe, resume=True).state.global_step == 3


def test_resume_at_the_limit_of_open_files_is_refused_without_telling_to_delete_the_checkpoint(two_checkpoints):
    """A whole checkpoint that the process could not open for want of a descriptor "holds a damaged adapter", and the
    fix was to delete it: the run's last good checkpoint lost."""
    folder, _ = two_checkpoints
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=1)
    refusals = []
    for free in range(3):
        try:
            with open_files_limit(free):
                check_resume(folder, CCMConfig(lora_dropout=0.0), recipe)
        except OSError as error:
            assert error.errno == errno.EMFILE and "delete" not in str(error)
            refusals.append(str(error))
    assert (
        f"[Errno 24] Cannot read {folder / 'checkpoint-2' / 'ccm_manifest.json'} (Too many open files); this process "
        "has too many files open: close some, or raise its limit (ulimit -n), then read it again: the file was not "
        "judged." in refusals
    )
    check_resume(folder, CCMConfig(lora_dropout=0.0), recipe)


def test_a_checkpoint_cut_short_by_a_full_disk_is_removed_and_the_fix_names_the_checkpoint_to_resume_from(
    tmp_path, monkeypatch
):
    """A checkpoint whose optimizer state the disk could not take stayed, cut short, taking room on a full disk; and
    with no whole checkpoint before it, --resume and a fresh start both refused the folder until it was deleted."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    model.save_pretrained(tmp_path / "sizes")
    room = (tmp_path / "sizes" / "adapter_model.safetensors").stat().st_size + 1000  # not the optimizer's state
    save_checkpoint, calls = CCMTrainer._save_checkpoint, itertools.count()

    def onto_a_full_disk(self: CCMTrainer, *args: object) -> None:  # the real writers, the second time on a full disk
        with file_size_limit(room) if next(calls) == 1 else nullcontext():
            save_checkpoint(self, *args)

    monkeypatch.setattr(CCMTrainer, "_save_checkpoint", onto_a_full_disk)
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=1)
    run = tmp_path / "run"
    with pytest.raises(OSError) as refused:
        train(model, None, samples, None, run, recipe)
    assert re.fullmatch(
        rf"could not write the checkpoint {re.escape(str(run / 'checkpoint-2'))} \(.*\): is the disk full\? Make room, "
        rf"then resume \(ccm train --resume, resume=True\) from {re.escape(str(run / 'checkpoint-1'))}\.",
        str(refused.value),
    ), refused.value
    assert [path.name for path in run.iterdir()] == ["checkpoint-1"]
    check_resume(run, CCMConfig(lora_dropout=0.0), recipe)


def test_a_checkpoint_not_written_for_want_of_file_descriptors_says_so_not_that_the_disk_is_full(tmp_path, monkeypatch):
    save_checkpoint = CCMTrainer._save_checkpoint

    def without_descriptors(self: CCMTrainer, *args: object) -> None:  # the real writers, at the limit of open files
        with open_files_limit(0):
            save_checkpoint(self, *args)

    monkeypatch.setattr(CCMTrainer, "_save_checkpoint", without_descriptors)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    samples = [recall_sample(random.Random(seed)) for seed in range(2)]
    with pytest.raises(OSError) as refused:
        train(model, None, samples, None, tmp_path / "run", TrainingRecipe(steps=1, batch_size=2, save_every=1))
    assert re.fullmatch(
        rf"could not write the checkpoint {re.escape(str(tmp_path / 'run' / 'checkpoint-1'))} \(\[Errno 24\] .*\): "
        r"this process has too many files open: close some, or raise its limit \(ulimit -n\), then resume \(ccm train "
        r"--resume, resume=True\) from the last checkpoint saved whole\.",
        str(refused.value),
    ), refused.value
    assert list((tmp_path / "run").iterdir()) == []  # no checkpoint-1 cut short


class _Crafted:
    """Pickled, it calls `open(path, "w")` when unpickled: a file that runs code on load."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("optimizer.pt", r"optimizer\.pt holds an object other than tensors and plain data \([\w.]*open\)"),
        ("scheduler.pt", r"scheduler\.pt holds an object other than tensors and plain data \([\w.]*open\)"),
        ("rng_state.pth", r"rng_state\.pth holds an object other than tensors and plain data \([\w.]*open\)"),
        ("scaler.pt", r"scaler\.pt is the loss scaler of an fp16 run, which no ccm training run writes"),
    ],
)
def test_resume_refuses_a_crafted_pickle_without_running_it(tmp_path_factory, two_checkpoints, name, message):
    """The Trainer refused a crafted pickle's code (weights_only=True) only once the checkpoint's adapter was loaded,
    with a bare UnpicklingError that advised loading the file unrestricted; a scaler file (fp16 runs) failed on a
    bare AttributeError. Now the file is named before anything loads, and its code never runs."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("crafted") / "run"
    shutil.copytree(folder, run)
    ran = run / "code-ran"
    torch.save({"state": _Crafted(ran), "param_groups": []}, run / "checkpoint-2" / name)
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"{message}.*delete .*checkpoint-2 to resume from the checkpoint before it"):
        train(model, None, samples, None, run, TrainingRecipe(steps=2, batch_size=2, save_every=1), resume=True)
    assert not ran.exists()
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("global_step", -3, r"global_step=-3, not its folder's step \(the integer 2\)"),  # wrote checkpoint--1
        (
            "global_step",
            10**30,
            r"global_step=10+, not its folder's step \(the integer 2\)",
        ),  # ended at once, saving the adapter
        ("global_step", "2", r"global_step='2', not its folder's step \(the integer 2\)"),  # TypeError
        ("global_step", True, r"global_step=True, not its folder's step \(the integer 2\)"),  # ran as step 1
        ("global_step", None, r"global_step=None, not its folder's step \(the integer 2\)"),  # TypeError
        ("zzz", 1, r"fields no Trainer writes \(zzz\)"),  # TypeError
        ("log_history", {}, r"log_history=\{\}, not a list of objects"),  # AttributeError at the first log
        ("train_batch_size", "2", r"train_batch_size='2', not a positive integer or null"),  # TypeError
        ("stateful_callbacks", {}, r"stateful_callbacks=\{\}, not an object with a TrainerControl object"),  # KeyError
    ],
)
def test_resume_refuses_a_crafted_trainer_state(tmp_path_factory, two_checkpoints, field, value, message):
    """A trainer_state.json of other types failed in the Trainer on a bare TypeError, AttributeError or KeyError (at
    the first save, steps later), or ran on from a step its folder does not hold."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("crafted") / "run"
    shutil.copytree(folder, run)
    path = run / "checkpoint-2" / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    recipe = TrainingRecipe(steps=3, batch_size=2, save_every=1, log_every=1)
    with pytest.raises(ValueError, match=f"trainer_state.json holds {message}; delete .*checkpoint-2 to resume from"):
        train(model, None, samples, None, run, recipe, resume=True)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


# A value other than two_checkpoints' run used, for each setting a resumed run must share with it.
_OTHER_SETTINGS = {
    "batch_size": 1,
    "gradient_accumulation": 2,
    "learning_rate": 0.5,
    "warmup_ratio": 0.5,
    "weight_decay": 0.1,
    "seed": 3,
    "group_by_length": False,
    "supervision": "dense",
    "distill_weight": 1.0,
    "distill_temperature": 2.0,
    "stream_piece": 4,
}
# Settings that change neither the samples, their order nor the optimizer, and may change on resume.
_FREE_SETTINGS = {"precision": "fp32", "gradient_checkpointing": True, "eval_every": 1, "log_every": 1, "steps": 5}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changed=st.sets(st.sampled_from(sorted(_OTHER_SETTINGS))),
    free=st.sets(st.sampled_from(sorted(_FREE_SETTINGS))),
)
def test_resume_refuses_exactly_the_changed_settings_of_the_run(two_checkpoints, changed, free):
    """The Trainer took the learning rate and weight decay from the saved optimizer and ignored the new ones without a
    word; another batch size, accumulation, seed or grouping skipped other samples than the run had trained on."""
    folder, _ = two_checkpoints
    recipe = replace(
        TrainingRecipe(steps=2, batch_size=2, save_every=1),
        **{name: _OTHER_SETTINGS[name] for name in changed},
        **{name: _FREE_SETTINGS[name] for name in free},
    )
    config = CCMConfig(lora_dropout=0.0)
    if not changed:
        check_resume(folder, config, recipe)
        return
    with pytest.raises(ValueError, match=r"checkpoint-2 was trained with other settings \(") as refused:
        check_resume(folder, config, recipe)
    named = set(re.findall(r"TrainingRecipe\.(\w+): checkpoint", str(refused.value)))
    assert named == changed
    assert "ccm train --init-adapter" in str(refused.value)


def test_a_refused_resume_changes_nothing_and_an_allowed_one_goes_on(tmp_path_factory, two_checkpoints):
    """A resumed run with another learning rate trained on with the checkpoint's (the optimizer's); now it is refused
    before the adapter loads, and one with only another precision, evaluation interval or length goes on."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("changed") / "run"
    shutil.copytree(folder, run)
    shutil.rmtree(run / "checkpoint-2")
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=1)
    message = r"TrainingRecipe.learning_rate: checkpoint 0.001 vs this run 0.5\); resume with the settings"
    with pytest.raises(ValueError, match=message):
        train(model, None, samples, None, run, replace(recipe, learning_rate=0.5), resume=True)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    resumed = train(model, None, samples, None, run, replace(recipe, precision="fp32", eval_every=1), resume=True)
    assert resumed.state.global_step == 2


def test_a_resumed_run_that_fails_gives_the_model_back_with_its_own_config(tmp_path_factory, two_checkpoints):
    """The Trainer loads the checkpoint's adapter, its config included, before the first step: a resumed run that
    failed gave the adapter's weights back, and kept the checkpoint's config (its base model's name, say)."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("failing") / "run"
    shutil.copytree(folder, run)
    shutil.rmtree(run / "checkpoint-2")
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    model.config = replace(model.config, base_model_name_or_path="moved/base", ema_alpha=0.25)
    config, before = model.config, {key: value.clone() for key, value in model.state_dict().items()}
    handle = fail_in_layer(model, 1, after_calls=0)
    try:
        with pytest.raises(InjectedFailure):
            train(model, None, samples, None, run, TrainingRecipe(steps=2, batch_size=2, save_every=1), resume=True)
    finally:
        handle.remove()
    assert model.config == config
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize(("architecture", "seed"), [("llama", 5), ("qwen2", 0)], ids=["other-weights", "other-arch"])
def test_resume_refuses_another_base_model(tmp_path_factory, two_checkpoints, architecture, seed):
    """A run resumed on another base of the same shape (another checkpoint or fine-tune of the architecture) trained
    the adapter on it without a word; one of another architecture was refused only once training began, as an
    adapter "made for None"."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("rebased") / "run"
    shutil.copytree(folder, run)
    model = CCMForCausalLM.from_base(tiny_base(architecture, seed=seed), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"checkpoint-2 was trained with other settings \(another base model \(its"):
        train(model, None, samples, None, run, TrainingRecipe(steps=2, batch_size=2, save_every=1), resume=True)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A run of 6 steps with dropout and evaluation, its final adapter, and how many tensor operations it ran."""
    samples = [recall_sample(random.Random(seed)) for seed in range(8)]
    recipe = TrainingRecipe(steps=6, batch_size=2, save_every=2, eval_every=3, learning_rate=1e-2)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())  # dropout on: the RNG state must come back
    folder = tmp_path_factory.mktemp("uninterrupted")
    operations = count_operations(lambda: train(model, None, samples, samples[:2], folder / "run", recipe))
    return samples, recipe, model.adapter_tensors(), operations


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(when=st.floats(0.05, 0.95), failure=st.sampled_from(["interrupt", "injected"]))
def test_a_run_killed_anywhere_resumes_to_the_adapter_of_the_uninterrupted_run(
    tmp_path_factory, uninterrupted, when, failure
):
    """Killed in a step, an evaluation or a checkpoint's save, a run leaves no checkpoint that resume takes for
    complete: resumed (past a checkpoint cut short), it ends bit for bit where the uninterrupted run did, dropout and
    batch order included (the same operations on the same CPU)."""
    samples, recipe, expected, operations = uninterrupted
    run = tmp_path_factory.mktemp("killed") / "run"
    with pytest.raises((KeyboardInterrupt, InjectedFailure)), FailAt(int(when * operations), FAILURES[failure]):
        train(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()), None, samples, samples[:2], run, recipe)
    if not list(run.glob("checkpoint-*/trainer_state.json")):
        return  # killed before the first checkpoint was whole: nothing to resume
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    train(model, None, samples, samples[:2], run, recipe, resume=True)
    for name, tensor in model.adapter_tensors().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("step", [3, 4, 5])
def test_a_run_interrupted_between_optimizer_and_scheduler_resumes_without_repeating_or_skipping_a_step(
    tmp_path, uninterrupted, step
):
    """Ctrl-C right after the optimizer wrote step `step`'s weights, before the scheduler, the step counter and that
    step's save (checkpoints every 2 steps): no checkpoint holds a half-applied step, and the model is given back as
    it came; resumed, the run ends bit for bit where the uninterrupted one did."""
    samples, recipe, expected, _ = uninterrupted
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    before = model.adapter_tensors()
    steps = itertools.count(1)

    def interrupt(*_: object) -> None:
        if next(steps) == step:
            raise KeyboardInterrupt

    handle = register_optimizer_step_post_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(model, None, samples, samples[:2], tmp_path / "run", recipe)
    finally:
        handle.remove()
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.adapter_tensors().items())
    saved = sorted(int(path.parent.name.split("-")[1]) for path in (tmp_path / "run").glob("*/trainer_state.json"))
    assert saved == list(range(2, step, 2))
    train(model, None, samples, samples[:2], tmp_path / "run", recipe, resume=True)
    for name, tensor in model.adapter_tensors().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_run_stopped_at_a_step_resumes_to_the_adapter_of_the_uninterrupted_run(tmp_path, uninterrupted):
    """`stop_at_step` ends a run inside its schedule, with a checkpoint and the adapter of that step saved even
    off the save interval; started again with the same stop it ends where it is, and resumed without one it ends bit
    for bit where the uninterrupted run did (learning rate of the whole schedule, dropout and batch order)."""
    samples, recipe, expected, _ = uninterrupted
    run = tmp_path / "run"
    stopped = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    assert train(stopped, None, samples, samples[:2], run, recipe, stop_at_step=3).state.global_step == 3
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    at_three = stopped.adapter_tensors()
    assert any(not torch.equal(tensor, expected[name]) for name, tensor in at_three.items())
    saved = CCMForCausalLM.from_pretrained(run, base_model=tiny_base("llama")).adapter_tensors()
    assert all(torch.equal(tensor, at_three[name]) for name, tensor in saved.items())
    again = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    assert train(again, None, samples, samples[:2], run, recipe, resume=True, stop_at_step=3).state.global_step == 3
    assert all(torch.equal(tensor, at_three[name]) for name, tensor in again.adapter_tensors().items())
    resumed = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    assert train(resumed, None, samples, samples[:2], run, recipe, resume=True).state.global_step == 6
    assert all(torch.equal(tensor, expected[name]) for name, tensor in resumed.adapter_tensors().items())


@pytest.mark.parametrize("stop_at_step", [0, 7, -1, 2.0, True])
def test_stop_at_step_outside_the_schedule_is_refused_before_anything_runs(tmp_path, stop_at_step):
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    before = model.adapter_tensors()
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    with pytest.raises(ValueError, match=r"stop_at_step .* must be a step of the schedule, 1\.\.6"):
        train(model, None, samples, None, tmp_path / "run", TrainingRecipe(steps=6), stop_at_step=stop_at_step)
    assert not (tmp_path / "run").exists()
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.adapter_tensors().items())


def test_a_finished_run_resumed_ends_where_it_is(tmp_path):
    """The Trainer asks whether to stop only after a step: a finished run started again with --resume made one more
    step past its schedule's end at each start (checkpoint-7, checkpoint-8), from the second on with the learning
    rate rising again, and saved that adapter as the run's."""
    samples = [recall_sample(random.Random(seed)) for seed in range(8)]  # four steps an epoch: the run ends in epoch 2
    recipe = TrainingRecipe(steps=6, batch_size=2, save_every=1, learning_rate=1e-2)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    train(model, None, samples, None, tmp_path, recipe)
    expected = model.adapter_tensors()
    for _ in range(2):
        resumed = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
        assert train(resumed, None, samples, None, tmp_path, recipe, resume=True).state.global_step == 6
        assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-6"]
        assert all(torch.equal(tensor, expected[name]) for name, tensor in resumed.adapter_tensors().items())


def test_resume_passes_over_a_checkpoint_whose_save_was_cut_short(tmp_path_factory, two_checkpoints, caplog):
    """A run killed while saving a checkpoint (before its trainer_state.json, which the Trainer writes last) left a
    folder that the Trainer took for the last checkpoint, failing on a bare FileNotFoundError, and that resume then
    refused until someone deleted it: a preempted job restarted with --resume failed at every restart."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("cut") / "run"
    shutil.copytree(folder, run)
    for name in ("trainer_state.json", "rng_state.pth"):  # killed while writing the RNG state
        (run / "checkpoint-2" / name).unlink()
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=1)
    assert train(model, None, samples, None, run, recipe, resume=True).state.global_step == 2
    assert "checkpoint-2 was cut short while saving (no trainer_state.json): resuming from" in caplog.text
    expected, resumed = (load_file(path / "adapter_model.safetensors") for path in (folder, run))
    assert all(torch.equal(tensor, expected[name]) for name, tensor in resumed.items())
    assert (run / "checkpoint-2" / "trainer_state.json").is_file()  # saved again, whole
    for checkpoint in run.glob("checkpoint-*"):  # only saves cut short: nothing to resume, and the fix
        (checkpoint / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"holds only checkpoints whose save was cut short .*delete its checkpoint-"):
        train(model, None, samples, None, run, recipe, resume=True)


@pytest.mark.parametrize(
    ("supervision", "unlabelled", "message"),
    [
        ("output", OnlineSample([[11, 41], [12, 42]], [QUERY]), " has no token to learn from: no output."),
        ("output", OnlineSample([[11, 41]], [QUERY], []), " has no token to learn from: no output."),
        ("dense", OnlineSample([[11, 41]], [QUERY]), " has no token to learn from: no output and no context after"),
        # Read by the collator, which named either list's sample `samples[3]`.
        ("output", OnlineSample([[11, VOCAB]], [QUERY], [41]), f".contexts[0] holds the token id {VOCAB}, outside"),
        ("output", OnlineSample([[]], [QUERY], [41]), ".contexts[0] is empty"),
        ("output", {"contexts": [[11]], "input": [QUERY], "output": [41]}, " is a dict, not an OnlineSample"),
    ],
)
@pytest.mark.parametrize("where", ["train", "eval"])
def test_train_refuses_a_bad_sample_naming_its_list_before_the_first_step(
    tmp_path, supervision, unlabelled, message, where
):
    """A batch drawn from output-less samples had no loss, and the Trainer failed with `TypeError: unsupported
    operand type(s) for /: 'NoneType' and 'int'` at that step; a sample the collator refused was `samples[3]` in
    either list. The refusal names the list and leaves the model as it was."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    before = model.comp_embeddings.detach().clone()
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    bad = [*samples[:3], unlabelled]
    train_samples, eval_samples = (bad, None) if where == "train" else (samples, bad)
    recipe = TrainingRecipe(
        steps=2, batch_size=2, eval_every=1, save_every=1, supervision=supervision, gradient_checkpointing=True
    )
    error = TypeError if isinstance(unlabelled, dict) else ValueError
    with pytest.raises(error, match=rf"^{where}_samples\[3\]{re.escape(message)}"):
        train(model, None, train_samples, eval_samples, tmp_path / "out", recipe)
    assert torch.equal(before, model.comp_embeddings) and not (tmp_path / "out").exists()
    assert not model.base_model.is_activation_checkpointing  # it was switched on before the samples were read
    dense = OnlineSample([[11, 41], [12, 42]], [QUERY])  # dense supervision learns from its second context
    assert CCMDataCollator(model, supervision="dense").supervised_tokens(dense) == 1


@pytest.mark.parametrize("where", ["train", "eval"])
@pytest.mark.parametrize("form", ["generator", "iterator", "one sample", "dict"])
def test_train_refuses_samples_that_are_not_a_list_naming_the_fix(tmp_path, where, form):
    """eval_samples given as a generator was read up by the checks, and the run evaluated nothing without a word; one
    sample without its list failed with "object of type 'OnlineSample' has no len()"."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    samples = [recall_sample(random.Random(seed)) for seed in range(2)]
    given = {
        "generator": (sample for sample in samples),
        "iterator": iter(samples),
        "one sample": samples[0],
        "dict": {"contexts": [[11]], "input": [QUERY], "output": [41]},
    }[form]
    train_samples, eval_samples = (given, None) if where == "train" else (samples, given)
    with pytest.raises(TypeError, match=rf"^{where}_samples is a \w+, not a list of samples; give a list of Online"):
        train(model, None, train_samples, eval_samples, tmp_path / "out", TrainingRecipe(steps=1, batch_size=1))
    assert not (tmp_path / "out").exists()


def _step_gradients(trainer: CCMTrainer, samples: list, cuts: list[int]) -> dict[str, torch.Tensor | None]:
    """The adapter's gradients after one optimizer step of `trainer` over `samples`, fed as the batches that `cuts`
    (indices) split them into, each accumulated by the Trainer's own `training_step`."""
    model, collate = trainer.model, trainer.data_collator
    model.zero_grad(set_to_none=True)
    batches = [collate(samples[start:end]) for start, end in itertools.pairwise([0, *cuts, len(samples)])]
    items = sum(int((batch["labels"] != -100).sum()) for batch in batches)  # what the Trainer counts
    for batch in batches:
        trainer.training_step(model, batch, torch.tensor(items))
    return {name: parameter.grad for name, parameter in model.named_parameters() if parameter.requires_grad}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=5),
    cut=st.integers(1, 4),
    distill_weight=st.sampled_from([0.0, 1.0]),
    streams=st.booleans(),
)
def test_gradient_accumulation_gives_the_update_of_one_batch(tmp_path, seeds, cut, distill_weight, streams):
    """The distillation KL was averaged per accumulated batch while the NLL beside it is summed over the labels of
    the whole step: gradient accumulation over N batches weighed the KL N times as much as one batch of them all."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))).train()
    if streams:
        streaming = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4, max_memory_tokens=4)
        samples = [random.Random(seed).choices(range(3, VOCAB), k=19) for seed in seeds]
        collate = StreamCollator(streaming, model.vocabulary_size)
    else:
        streaming = None
        # Outputs and contexts of several lengths: batches are padded differently when cut.
        samples = [
            replace(sample, output=sample.output * random.Random(seed).randint(1, 3))
            for sample, seed in ((recall_sample(random.Random(seed)), seed) for seed in seeds)
        ]
        collate = CCMDataCollator(model)
    args = TrainingArguments(tmp_path, use_cpu=True, report_to="none", remove_unused_columns=False)
    trainer = CCMTrainer(model=model, args=args, train_dataset=samples, data_collator=collate)
    trainer.distill_weight, trainer.streaming, trainer.stream_piece = distill_weight, streaming, 4
    whole = _step_gradients(trainer, samples, [])
    accumulated = _step_gradients(trainer, samples, [min(cut, len(samples) - 1)])
    for name, gradient in whole.items():  # None: a LoRA that feeds nothing (the last layer's <COMP> queries)
        assert (gradient is None) == (accumulated[name] is None), name
        assert gradient is None or torch.allclose(accumulated[name], gradient, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("name", ["rng_state.pth", "ccm_config.json"])
def test_resume_refuses_a_checkpoint_file_that_is_a_pipe(tmp_path_factory, two_checkpoints, name):
    """A named pipe among a checkpoint's files was opened as a file: the resumed run waited for good for a writer
    (here one comes, and its bytes were read as the file's)."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(folder, run)
    path = run / "checkpoint-2" / name
    content = path.read_text(errors="replace")
    path.unlink()
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    recipe = TrainingRecipe(steps=3, batch_size=2, save_every=1)
    with (
        pipe_feeding(path, content),
        pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a regular file \(a folder, a pipe or a dev"),
    ):
        train(model, None, samples, None, run, recipe, resume=True)


def test_a_run_resumed_in_a_later_epoch_ends_as_the_uninterrupted_run(tmp_path):
    """Length-grouped batches were drawn from one generator, advanced by each pass: a run resumed in its second epoch
    drew the first epoch's order again, trained on other batches than the run it continued and ended elsewhere."""
    samples = [OnlineSample([[11 + i, 41] * (1 + i)], [QUERY], [41 + i]) for i in range(8)]  # four batches an epoch
    recipe = TrainingRecipe(steps=8, batch_size=2, save_every=5, learning_rate=1e-2)
    whole = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    train(whole, None, samples, None, tmp_path / "whole", recipe)
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-5", tmp_path / "resumed" / "checkpoint-5")  # in epoch 2
    resumed = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    assert train(resumed, None, samples, None, tmp_path / "resumed", recipe, resume=True).state.global_step == 8
    expected = whole.adapter_tensors()
    for name, tensor in resumed.adapter_tensors().items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name


@pytest.mark.parametrize("streams", [False, True])
def test_a_cache_made_before_training_is_refused_after_it(tmp_path, streams):
    """The Trainer's fused AdamW writes the weights without counting the writes in their version counters, by which
    the model knows when to hash its adapter again: a cache made before train() was taken as the trained adapter's,
    and one made after carried the old adapter's digest, so the trained adapter, loaded from its files, refused it."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    context = torch.tensor([[11, 41, 12]])
    before = model.new_cache()
    model.compress(before, context)
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=2, learning_rate=1e-2)
    if streams:
        recipe = replace(recipe, streaming=StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4))
        samples = [random.Random(seed).choices(range(3, VOCAB), k=14) for seed in range(4)]
    else:
        samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    train(model, None, samples, None, tmp_path / "out", recipe)
    with pytest.raises(ValueError, match=r"belongs to another model or adapter .*adapter_sha256"):
        model.compress(before, context)
    after = model.new_cache()
    model.compress(after, context)
    after.save(tmp_path / "memory.safetensors")
    trained = CCMForCausalLM.from_pretrained(tmp_path / "out", base_model=tiny_base("llama"))
    loaded = CompressedMemoryCache.load(tmp_path / "memory.safetensors", trained)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, after.layers, strict=True))


def test_a_new_run_into_the_folder_of_an_earlier_one_is_refused(tmp_path_factory, two_checkpoints):
    """A run started anew beside an earlier run's checkpoints wrote its own among them; cut short and resumed, it
    went on from the earlier run's last checkpoint (the highest step wins), or ended at once on it and saved that
    run's adapter as its own."""
    folder, samples = two_checkpoints
    run = tmp_path_factory.mktemp("again") / "run"
    shutil.copytree(folder, run)
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    message = r"run holds the checkpoints of an earlier run \(.*checkpoint-2\); continue that run with resume=True"
    with pytest.raises(ValueError, match=message):
        train(model, None, samples, None, run, TrainingRecipe(steps=1, batch_size=2, save_every=1))
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize(
    "recipe",
    [
        TrainingRecipe(steps=2, batch_size=2),
        TrainingRecipe(steps=2, batch_size=2, group_by_length=False),
        TrainingRecipe(steps=2, batch_size=2, streaming=StreamingConfig(window_tokens=8, compress_chunk=4)),
    ],
    ids=["grouped", "shuffled", "streams"],
)
def test_train_refuses_no_samples_before_any_work(tmp_path, recipe):
    """No training samples ran no step and saved the untrained adapter as the result (length-grouped batches), or
    failed on torch's `num_samples should be a positive integer value` or on `got lengths []`."""
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    with pytest.raises(ValueError, match=r"^train_samples is empty; give at least one sample to train on\.$"):
        train(model, None, [], None, tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("at_labels", [False, True])
@pytest.mark.parametrize("items", [None, 4])
def test_a_batch_with_nothing_to_predict_has_a_loss_and_gradients_of_zero(at_labels, items):
    # Empty outputs, one-token contexts (dense supervision labels none of their tokens): a mean over no labels was NaN.
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    samples = [OnlineSample([[5], [6]], [7], []), OnlineSample([[8]], [9], [])]
    batch = CCMDataCollator(model, supervision="dense")(samples)
    assert (batch["labels"] == -100).all()
    extra = {} if items is None else {"num_items_in_batch": items}
    out = model(**batch, logits_at_labels=at_labels, **extra)
    positions = predicting_positions(batch["labels"]) if at_labels else None
    loss = out.loss + distillation_loss(model, batch, out.logits, positions=positions, num_items_in_batch=items)
    assert loss.item() == 0.0
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is None or not parameter.grad.any(), name


def test_train_with_a_pad_token_the_model_cannot_embed(tmp_path):
    """A tokenizer whose pad token was added past the model's embeddings (Llama's `add_special_tokens({"pad_token":
    "[PAD]"})` without resizing them) made train() refuse its own 'pad_token_id' before the first step, a setting the
    caller never gave. Padding is masked: it trains as with a tokenizer without a pad token."""
    tokenizer = load_tokenizer("default")
    base = tiny_llama_for(tokenizer)
    added, none = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    added.add_special_tokens({"pad_token": "[PAD]"})
    none.pad_token = None
    samples = [OnlineSample([f"My code is {n}.", "Fine."], "My code is", f" {n}") for n in (7, 12345, 9)]
    recipe = TrainingRecipe(steps=1, batch_size=3, save_every=1)
    adapters = []
    for padded in (added, none):
        model = randomize_adapter(CCMForCausalLM.from_base(copy.deepcopy(base), CCMConfig(lora_dropout=0.0)))
        train(model, padded, samples, None, tmp_path / str(len(adapters)), recipe)
        adapters.append(model.comp_embeddings.detach().clone())
    assert torch.equal(*adapters)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(unfrozen=st.sets(st.integers(0, 1000), min_size=1, max_size=4), everything=st.booleans())
def test_train_refuses_base_weights_that_require_grad(tmp_path_factory, unfrozen, everything):
    """After `model.requires_grad_(True)` the Trainer's optimizer trained the base model too, and the adapter saved
    without it computed something else once loaded."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    base = [(name, p) for name, p in model.named_parameters() if name != "comp_embeddings" and ".lora_" not in name]
    if everything:
        model.requires_grad_(True)
    for index in unfrozen:
        base[index % len(base)][1].requires_grad_(True)
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    output_dir = tmp_path_factory.mktemp("run") / "out"
    samples = [recall_sample(random.Random(seed)) for seed in range(4)]
    recipe = TrainingRecipe(steps=2, batch_size=2, save_every=2)
    with pytest.raises(ValueError, match=r"weights of the base model require grad .* Freeze them first"):
        train(model, None, samples, None, output_dir, recipe)
    assert {name: parameter.requires_grad for name, parameter in model.named_parameters()} == flags
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    assert not output_dir.exists()
    for name, parameter in model.named_parameters():  # the fix the error names
        parameter.requires_grad_(name == "comp_embeddings" or ".lora_" in name)
    train(model, None, samples, None, output_dir, recipe)
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items() if key in dict(base))
