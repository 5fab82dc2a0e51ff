"""`TrainingRecipe.precision` / `ccm train --precision`: bf16 autocast on CPU (student and distillation teacher alike),
fp32 and auto unchanged, unknown values and devices without bf16 refused."""

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import randomize_adapter, tiny_base, tiny_full_context_baseline
from transformers_ccm import CCMConfig, CCMForCausalLM, OnlineSample
from transformers_ccm.cli import build_parser, main
from transformers_ccm.streaming import StreamingConfig
from transformers_ccm.training import PRECISIONS, TrainingRecipe, cpu_has_bf16, train

QUERY, KEYS, LABELS = 5, range(10, 30), range(40, 56)
SMALL = StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
REFUSAL = "precision='bf16' on CPU needs bf16 instructions"


def recall_sample(rng: random.Random) -> OnlineSample:
    contexts = [[rng.choice(KEYS), rng.choice(LABELS)] for _ in range(rng.randint(1, 3))]
    return OnlineSample(contexts, [QUERY], [contexts[-1][1]])


def student_and_teacher() -> tuple[CCMForCausalLM, CCMForCausalLM]:
    return (
        randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))),
        tiny_full_context_baseline(seed=3),
    )


def record_autocast(model: CCMForCausalLM) -> list[torch.dtype | None]:
    """Per forward of `model`'s base model: the CPU autocast dtype it ran under, None without autocast."""
    seen: list[torch.dtype | None] = []

    def hook(*_: object) -> None:
        enabled = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if enabled else None)

    model.base_model.register_forward_pre_hook(hook)
    return seen


def losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_bf16_trains_student_and_teacher_under_autocast_or_is_refused(tmp_path):
    model, teacher = student_and_teacher()
    student_dtypes, teacher_dtypes = record_autocast(model), record_autocast(teacher)
    recipe = TrainingRecipe(steps=2, batch_size=4, save_every=2, log_every=1, distill_weight=1.0, precision="bf16")
    samples = [recall_sample(random.Random(i)) for i in range(8)]
    if not cpu_has_bf16():  # the refusal is what this machine can check
        with pytest.raises(ValueError, match=rf"{REFUSAL}.*Train with precision='fp32'"):
            train(model, None, samples, None, tmp_path / "out", recipe, teacher=teacher)
        assert not (tmp_path / "out").exists()
        return
    trainer = train(model, None, samples, None, tmp_path / "out", recipe, teacher=teacher)
    assert trainer.args.bf16 and len(losses(trainer)) == 2 and all(math.isfinite(loss) for loss in losses(trainer))
    # Both forwards of every step, the teacher's included, ran under bf16 autocast.
    assert student_dtypes == [torch.bfloat16] * 2 and teacher_dtypes == [torch.bfloat16] * 2
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    saved = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert saved and all(tensor.dtype == torch.float32 for tensor in saved.values())
    loaded = CCMForCausalLM.from_pretrained(tmp_path / "out", base_model=tiny_base("llama"))
    assert loaded.dtype == torch.float32 and loaded.comp_embeddings.dtype == torch.float32
    assert torch.equal(loaded.comp_embeddings, model.comp_embeddings.detach())
    # The model comes back without the training run's autocast: its forward is the class's, in fp32.
    ids, model = torch.tensor([[QUERY, 11, 41]]), model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=model.new_cache(1)).logits
        plain = type(model).forward(model, input_ids=ids, past_key_values=model.new_cache(1)).logits
    assert student_dtypes[2:] == [None, None] and logits.dtype == torch.float32 and torch.equal(logits, plain)


def test_bf16_training_on_streams_runs_the_teacher_under_autocast_or_is_refused(tmp_path):
    model, teacher = student_and_teacher()
    student_dtypes, teacher_dtypes = record_autocast(model), record_autocast(teacher)
    recipe = TrainingRecipe(
        steps=1, batch_size=2, save_every=1, log_every=1, distill_weight=1.0, streaming=SMALL, precision="bf16"
    )
    streams = [[1, 1, *range(10, 27)] for _ in range(2)]
    if not cpu_has_bf16():
        with pytest.raises(ValueError, match=REFUSAL):
            train(model, None, streams, None, tmp_path / "out", recipe, teacher=teacher)
        return
    trainer = train(model, None, streams, None, tmp_path / "out", recipe, teacher=teacher)
    assert all(math.isfinite(loss) for loss in losses(trainer))
    # The warm-up forward and every piece of the stream, then the teacher reading it whole.
    assert set(student_dtypes) == {torch.bfloat16} and len(student_dtypes) > 1
    assert teacher_dtypes == [torch.bfloat16]


def test_fp32_and_auto_train_alike_on_cpu_without_autocast(tmp_path):
    runs = {}
    for precision in ("fp32", "auto"):
        model, teacher = student_and_teacher()
        student_dtypes, teacher_dtypes = record_autocast(model), record_autocast(teacher)
        recipe = TrainingRecipe(
            steps=2, batch_size=4, save_every=2, log_every=1, distill_weight=1.0, precision=precision
        )
        samples = [recall_sample(random.Random(i)) for i in range(8)]
        trainer = train(model, None, samples, None, tmp_path / precision, recipe, teacher=teacher)
        assert not trainer.args.bf16 and student_dtypes == teacher_dtypes == [None, None]
        runs[precision] = losses(trainer), model.comp_embeddings.detach().clone()
    assert len(runs["fp32"][0]) == 2 and all(math.isfinite(loss) for loss in runs["fp32"][0])
    assert runs["fp32"][0] == runs["auto"][0]
    assert torch.equal(runs["fp32"][1], runs["auto"][1])


@pytest.mark.parametrize("precision", ["fp16", "BF16", ""])
def test_an_unknown_precision_is_refused_before_any_work(tmp_path, precision):
    model, _ = student_and_teacher()
    recipe = TrainingRecipe(steps=1, batch_size=2, precision=precision)
    with pytest.raises(ValueError, match=rf"Unknown precision '{precision}'.*one of 'auto', 'bf16', 'fp32'"):
        train(model, None, [recall_sample(random.Random(0))] * 2, None, tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()


def test_cli_passes_precision_to_the_recipe(tmp_path, capsys, tiny_model):
    parser = build_parser()
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    assert next(a for a in train_parser._actions if a.dest == "precision").choices == list(PRECISIONS)
    assert parser.parse_args(["train", "--output-dir", "x"]).precision == "auto"
    assert parser.parse_args(["train", "--output-dir", "x", "--precision", "bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--output-dir", "x", "--precision", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err

    def eval_loss(precision: str) -> float:
        """The held-out loss after one step of `ccm train --precision precision` (from its checkpoint)."""
        output = tmp_path / precision
        arguments = ["train", "--model", tiny_model, "--steps", "1", "--batch-size", "2", "--eval-every", "1"]
        main([*arguments, "--eval-samples", "2", "--output-dir", str(output), "--precision", precision])
        state = json.loads((output / "checkpoint-1" / "trainer_state.json").read_text())
        return next(row["eval_loss"] for row in state["log_history"] if "eval_loss" in row)

    fp32 = eval_loss("fp32")
    if not cpu_has_bf16():
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            eval_loss("bf16")
        assert exit_info.value.code == 2 and REFUSAL in capsys.readouterr().err
        return
    bf16 = eval_loss("bf16")
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=1e-2), (bf16, fp32)  # bf16 reached the recipe


def test_precision_benchmark_trains_both_copies_side_by_side(tiny_model):
    from benchmarks import train_precision

    report = train_precision.run(tiny_model, steps=2, batch_size=2, distill_weights=[1.0], seed=0)
    assert [row["distill_weight"] for row in report["rows"]] == [1.0]
    for row in report["rows"]:
        assert len(row["shapes"]) == 2 and row["fp32_over_bf16"] > 0
        for precision in ("fp32", "bf16"):
            assert len(row[precision]["seconds"]) == len(row[precision]["loss"]) == 2
        # The same weights and batch at the first step: the losses differ by rounding only.
        assert row["bf16"]["loss"][0] == pytest.approx(row["fp32"]["loss"][0], abs=1e-2)
        assert row["bf16"]["loss"][0] != row["fp32"]["loss"][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_adapter_of_a_half_precision_base_is_float32_and_every_weight_trains(tmp_path, dtype):
    """On a bfloat16 (or float16) base the adapter was built in that dtype, and an optimizer step below half the
    spacing of its values (1e-4 on a bfloat16 weight of 0.3, spaced 2e-3) was rounded away: most of it never moved."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama").to(dtype), CCMConfig(lora_dropout=0.0)))
    adapter = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert model.dtype == dtype and {parameter.dtype for parameter in adapter.values()} == {torch.float32}
    before = {name: parameter.detach().clone() for name, parameter in adapter.items()}
    recipe = TrainingRecipe(steps=2, batch_size=4, save_every=2, log_every=1, learning_rate=1e-4, precision="fp32")
    train(model, None, [recall_sample(random.Random(i)) for i in range(8)], None, tmp_path / "out", recipe)
    # Every element of every weight that reaches the loss moved: all but the last layer's <COMP> queries and
    # attention outputs, which nothing reads.
    unread = ("layers.1.self_attn.q_proj.", "layers.1.self_attn.o_proj.")
    assert all(bool((adapter[name] != before[name]).all()) for name in adapter if not any(u in name for u in unread))
    saved = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert saved and all(tensor.dtype == torch.float32 for tensor in saved.values())
    # The memory is kept in the base model's dtype, whatever the adapter's.
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[QUERY, 11, 41]]))
    assert cache.layers[0].keys.dtype == dtype and cache.memory_bytes() > 0


def test_a_second_bf16_run_on_the_same_model_trains_under_autocast_again(tmp_path):
    """accelerate marks the model it prepared and leaves a marked model as it is: a second run on the model trained
    in fp32, without the autocast the recipe asked for."""
    model, _ = student_and_teacher()
    student_dtypes = record_autocast(model)
    recipe = TrainingRecipe(steps=1, batch_size=2, save_every=1, precision="bf16")
    samples = [recall_sample(random.Random(i)) for i in range(4)]
    if not cpu_has_bf16():
        with pytest.raises(ValueError, match=REFUSAL):
            train(model, None, samples, None, tmp_path / "first", recipe)
        return
    for run in ("first", "second"):
        student_dtypes.clear()
        train(model, None, samples, None, tmp_path / run, recipe)
        assert student_dtypes == [torch.bfloat16], run
