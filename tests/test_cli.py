"""The ccm command end to end on a tiny model that shares the embedded model's tokenizer."""

import argparse
import functools
import io
import itertools
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_files import file_size_limit, open_files_limit, run_python
from tiny_models import tiny_ccm, tiny_full_context_baseline
from transformers_ccm import CCMConfig, CCMForCausalLM, memory_file
from transformers_ccm import cli as cli_module
from transformers_ccm.cli import main


@contextmanager
def refused_by_the_system(capsys, message):
    """Within the context, `ccm` ends with status 1 (the system refused its work) and `message` on its error output."""
    with pytest.raises(SystemExit) as exit_info:
        yield
    assert exit_info.value.code == 1 and message in capsys.readouterr().err


def train(model, output, steps, *extra):
    main(
        [
            "train",
            "--model",
            model,
            "--task",
            "mixture",
            "--steps",
            str(steps),
            "--batch-size",
            "2",
            "--eval-every",
            "2",
            "--eval-samples",
            "2",
            "--output-dir",
            str(output),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("adapter")
    train(tiny_model, output, 3)
    return str(output)


def test_train_writes_an_adapter_with_checkpoints(adapter):
    config = json.loads(Path(adapter, "ccm_config.json").read_text())
    assert config["update"] == "concat" and "mixture" in config["trained_on"]
    assert Path(adapter, "README.md").read_text().count("built-in task 'mixture'") == 1
    assert {p.name for p in Path(adapter).glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-3"}


def test_train_resumes(tiny_model, adapter, capsys):
    train(tiny_model, adapter, 4, "--resume")
    out = capsys.readouterr().out
    assert "adapter saved" in out
    assert (Path(adapter) / "checkpoint-4").is_dir()


@pytest.mark.parametrize("writing", ["optimizer", "trainer state"])
def test_a_full_disk_while_train_saves_a_checkpoint_is_named_and_resume_goes_on(
    tiny_model, tmp_path, monkeypatch, capsys, writing
):
    """torch.save's writer reports a full disk as a RuntimeError naming neither file nor cause ("unexpected pos 20288
    vs 20180"), which ended `ccm train` with a traceback: the checkpoint is named, and --resume goes on from the last
    one saved whole once there is room. A trainer_state.json cut by the full disk (it marks a checkpoint whole) made
    --resume refuse the run until the checkpoint was deleted."""
    from transformers import Trainer, TrainerState

    holder, name = (
        (Trainer, "_save_optimizer_and_scheduler") if writing == "optimizer" else (TrainerState, "save_to_json")
    )
    write, calls = getattr(holder, name), itertools.count()

    def second_onto_a_full_disk(*args):  # the real writer; the disk is full at the second checkpoint
        with file_size_limit(0) if next(calls) == 1 else nullcontext():
            write(*args)

    monkeypatch.setattr(holder, name, second_onto_a_full_disk)
    with refused_by_the_system(capsys, f"could not write the checkpoint {tmp_path / 'run' / 'checkpoint-2'} ("):
        train(tiny_model, tmp_path / "run", 3, "--eval-every", "1")
    assert not (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").exists()  # cut short: skipped on resume
    monkeypatch.undo()
    train(tiny_model, tmp_path / "run", 3, "--eval-every", "1", "--resume")
    assert "adapter saved to" in capsys.readouterr().out


def test_train_stops_at_a_step_of_its_schedule_and_resumes_the_rest(tiny_model, tmp_path, capsys):
    train(tiny_model, tmp_path / "run", 4, "--stop-at-step", "3")
    assert f"adapter saved to {tmp_path / 'run'} (step 3 of 4; --resume trains the rest)" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "run").glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-3"}
    train(tiny_model, tmp_path / "run", 4, "--resume")
    assert "(step" not in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "run").glob("checkpoint-*")} == {"checkpoint-3", "checkpoint-4"}
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--model",
                str(tmp_path / "no-model"),
                "--output-dir",
                str(tmp_path / "new"),
                "--stop-at-step",
                "301",
            ]
        )
    assert exit_info.value.code == 2
    assert "must be a step of the schedule, 1..300 (--steps)" in capsys.readouterr().err


def test_train_continues_an_adapter_with_its_structure(tiny_model, adapter, tmp_path, capsys):
    from safetensors.torch import load_file

    merge = tmp_path / "merge"
    first_stage = CCMConfig(num_comp_tokens=3, update="merge", trained_on="my chats")
    CCMForCausalLM.from_base(tiny_model, first_stage).save_pretrained(merge)
    train(tiny_model, tmp_path / "continued", 1, "--init-adapter", str(merge), "--learning-rate", "0")
    assert "its structure is kept (--update merge, --num-comp-tokens 3" in capsys.readouterr().out
    config = json.loads((tmp_path / "continued" / "ccm_config.json").read_text())
    assert (config["update"], config["num_comp_tokens"]) == ("merge", 3)
    assert config["trained_on"] == "my chats, then transformers-ccm built-in task 'mixture'"
    before, after = (
        load_file(merge / "adapter_model.safetensors"),
        load_file(tmp_path / "continued" / "adapter_model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(SystemExit, match="pass --method ccm"):
        train(tiny_model, tmp_path / "refused", 1, "--init-adapter", adapter, "--method", "full-context")
    assert not (tmp_path / "refused").exists()


def test_train_continues_an_adapter_with_more_comp_tokens(tiny_model, tmp_path, capsys):
    from safetensors.torch import load_file

    single = tmp_path / "single"
    CCMForCausalLM.from_base(tiny_model, CCMConfig(num_comp_tokens=1)).save_pretrained(single)
    out = tmp_path / "grown"
    train(tiny_model, out, 1, "--init-adapter", str(single), "--num-comp-tokens", "3", "--learning-rate", "0")
    assert "except --num-comp-tokens 3" in capsys.readouterr().out
    assert json.loads((out / "ccm_config.json").read_text())["num_comp_tokens"] == 3
    before, after = load_file(single / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert torch.equal(after["ccm.comp_embeddings"], before["ccm.comp_embeddings"].expand(3, -1))
    assert all(torch.equal(before[name], after[name]) for name in before if name != "ccm.comp_embeddings")


def test_train_refuses_more_comp_tokens_than_the_continued_adapters_cap_naming_the_flags(tmp_path, capsys):
    """--num-comp-tokens past the concat cap of the --init-adapter was refused with CCMConfig's own words (its
    max_memory_tokens "must be None or an integer >= num_comp_tokens"), which named neither flag nor the fix, after the
    command had announced the resize; refused now before it, with both flags and the most it takes."""
    tiny_ccm("llama", max_memory_tokens=3).save_pretrained(tmp_path / "capped")
    with pytest.raises(SystemExit) as exit_info:
        train(
            str(tmp_path / "no-model"),
            tmp_path / "run",
            1,
            "--init-adapter",
            str(tmp_path / "capped"),
            "--num-comp-tokens",
            "4",
        )
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"ccm train: error: --init-adapter {tmp_path / 'capped'} caps concat memory at 3 slots, fewer than one context "
        "of --num-comp-tokens 4; pass --num-comp-tokens 3 or fewer.\n"
    )
    assert "except --num-comp-tokens" not in captured.out and not (tmp_path / "run").exists()


def test_train_continuing_an_ema_adapter_says_the_ema_alpha_it_keeps(tmp_path, capsys):
    """The EMA coefficient is part of the update rule an --init-adapter keeps: a --ema-alpha given was ignored, and the
    notice of what is kept named the update rule without it."""
    tiny_ccm("llama", update="ema", ema_alpha=0.25).save_pretrained(tmp_path / "ema")
    asked = CCMConfig(update="ema", ema_alpha=0.9, trained_on="mine")
    config = cli_module._initial_adapter_config(str(tmp_path / "ema"), asked, None, None)
    assert (config.update, config.ema_alpha) == ("ema", 0.25)
    assert capsys.readouterr().out == (
        f"continuing {tmp_path / 'ema'}: its structure is kept (--update ema, --ema-alpha 0.25, --num-comp-tokens 2, "
        "--lora-r 8)\n"
    )


def test_train_continues_an_adapter_with_more_lora_targets(tiny_model, tmp_path, capsys):
    from safetensors.torch import load_file

    attention = tmp_path / "attention"
    CCMForCausalLM.from_base(tiny_model, CCMConfig()).save_pretrained(attention)
    out = tmp_path / "with-mlp"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    train(tiny_model, out, 1, "--init-adapter", str(attention), "--target-modules", *targets, "--learning-rate", "0")
    assert "except --target-modules q_proj" in capsys.readouterr().out
    assert json.loads((out / "ccm_config.json").read_text())["target_modules"] == targets
    before, after = load_file(attention / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)
    added = [name for name in after.keys() - before.keys() if "lora_B" in name]
    assert {name.split(".")[-3] for name in added} == {"gate_proj", "up_proj", "down_proj"}
    assert all(not after[name].any() for name in added)
    CCMForCausalLM.from_pretrained(out, base_model=tiny_model)  # loads as saved


def test_train_on_a_jsonl_file(tiny_model, tmp_path):
    from transformers_ccm.tasks import make_samples, save_jsonl

    save_jsonl(make_samples("icl", "train", 6), tmp_path / "mine.jsonl")
    main(
        [
            "train",
            "--model",
            tiny_model,
            "--task",
            str(tmp_path / "mine.jsonl"),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--update",
            "merge",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert json.loads((tmp_path / "out" / "ccm_config.json").read_text())["trained_on"] == "mine.jsonl"


def test_train_with_no_eval_samples_draws_and_evaluates_none(tiny_model, tmp_path):
    """--eval-samples 0 ("0: no evaluation") evaluated a JSONL --eval-task file whole, and drew a text task's held-out
    streams, refusing a --stream-chunks that only the training text holds (the held-out text is shorter)."""
    from transformers_ccm.tasks import make_samples, save_jsonl

    save_jsonl(make_samples("icl", "train", 2), tmp_path / "mine.jsonl")
    save_jsonl(make_samples("icl", "test", 2), tmp_path / "held-out.jsonl")
    task = ["--task", str(tmp_path / "mine.jsonl"), "--eval-task", str(tmp_path / "held-out.jsonl")]
    sizes = ["--steps", "2", "--batch-size", "1", "--eval-every", "1", "--eval-samples", "0"]
    main(["train", "--model", tiny_model, *task, *sizes, "--output-dir", str(tmp_path / "out")])
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert not any("eval_loss" in entry for entry in state["log_history"])


@pytest.mark.parametrize(
    ("eval_task", "message"),
    [
        ("icll", "Unknown task 'icll'"),
        ("icl:2,chats:1", "Unknown task 'chats'"),
        ("held-out", "Unknown task 'held-out'"),
    ],
)
def test_train_with_no_eval_samples_still_refuses_an_unknown_eval_task(tmp_path, capsys, eval_task, message):
    """Nothing is drawn with --eval-samples 0, but a misspelt task (or a file that is not there) is refused before
    the model loads, as it is with samples to draw."""
    arguments = ["train", "--model", str(tmp_path / "no-model"), "--task", "icl", "--eval-task", eval_task]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--eval-samples", "0", "--steps", "1", "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_eval_writes_json_and_plot(tiny_model, adapter, tmp_path, capsys):
    full_context = tmp_path / "full-context"
    CCMForCausalLM.from_base(tiny_model, CCMConfig(conditional_lora=False)).save_pretrained(full_context)
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--tasks", "icl", "dialogue"]
    arguments += ["--steps", "1", "2", "--samples", "3", "--output-dir", str(tmp_path)]
    main([*arguments, "--full-context-adapter", str(full_context)])
    report = json.loads((tmp_path / "eval.json").read_text())
    methods = {(r["task"], r["wordings"], r["steps"], r["method"]) for r in report["results"]}
    assert methods == {
        (t, w, s, m)
        for t in ("icl", "dialogue")
        for w in ("seen", "unseen")
        for s in (1, 2)
        for m in ("no_context", "full_context", "full_context_finetuned", "ccm-concat")
    }
    assert all(r["low"] <= r["value"] <= r["high"] and len(r["per_sample"]) == 3 for r in report["results"])
    assert {(row["task"], row["wordings"]) for row in report["summary"]} == {
        (t, w) for t in ("icl", "dialogue") for w in ("seen", "unseen")
    }
    assert all(row["gain_recovered_finetuned"] is not None for row in report["summary"])
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    assert "| icl (t=2) | unseen | ccm-concat | accuracy |" in (tmp_path / "eval.md").read_text()
    out = capsys.readouterr().out
    assert "gain recovered" in out and "of the fine-tuned full-context gain" in out
    with pytest.raises(SystemExit):
        main([*arguments, "--full-context-adapter", adapter])
    assert "is a compression adapter (conditional_lora=True)" in capsys.readouterr().err


def test_chat_from_a_script_keeps_memory_between_runs(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    memory = tmp_path / "user.safetensors"
    arguments = [
        "chat",
        "--model",
        tiny_model,
        "--adapter",
        adapter,
        "--memory-file",
        str(memory),
        "--max-new-tokens",
        "4",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ann.\nWhat is my name?\n"))
    main(arguments)
    out = capsys.readouterr().out
    assert out.count("assistant:") == 2 and "[memory: 4 slots" in out and memory.is_file()
    monkeypatch.setattr("sys.stdin", io.StringIO("Still there?\n"))
    main(arguments)
    out = capsys.readouterr().out
    assert "memory loaded from" in out and ": 4 slots)" in out and "[memory: 6 slots" in out


def test_demo_runs_by_itself(tiny_model, adapter, capsys):
    main(["demo", "--model", tiny_model, "--adapter", adapter, "--turns", "3", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert out.count("you: ") == 3 and out.count("full context would hold") == 3


@pytest.mark.parametrize(
    ("command", "arguments", "message"),
    [
        ("demo", ["--turns", "-6"], "--turns must be at least 1, got -6"),  # ran the first two turns of eight
        ("demo", ["--turns", "0"], "--turns must be at least 1, got 0"),  # ran nothing
        ("demo", ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),  # failed at the first turn
        ("chat", ["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1, got -1"),
    ],
)
def test_chat_and_demo_refuse_counts_below_one_before_the_model_loads(
    tmp_path, capsys, monkeypatch, command, arguments, message
):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ann.\n"))
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", str(tmp_path / "no-model"), "--adapter", str(tmp_path / "no-adapter"), *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_chat_with_its_input_closed_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """`ccm chat <&-` (Python's sys.stdin is None then) failed once the model had loaded, on "'NoneType' object is
    not iterable"."""
    monkeypatch.setattr("sys.stdin", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--model", str(tmp_path / "no-model"), "--adapter", str(tmp_path / "no-adapter")])
    assert exit_info.value.code == 2 and "the standard input is closed" in capsys.readouterr().err


def test_demo_shows_the_full_context_baseline(tiny_model, adapter, capsys):
    main(
        ["demo", "--model", tiny_model, "--adapter", adapter, "--turns", "2", "--max-new-tokens", "4", "--full-context"]
    )
    out = capsys.readouterr().out
    assert "alone, with the whole conversation" in out and out.count("you: ") == 2
    counts = [int(n) for n in re.findall(r"\[full context: (\d+) tokens\]", out)]
    assert len(counts) == 2 and 0 < counts[0] < counts[1]


def test_cli_errors_are_clear(tiny_model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", tiny_model, "--task", "qa", "--steps", "1", "--output-dir", "/tmp/none"])
    assert exit_info.value.code == 2 and "Unknown task 'qa'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--gradient-accumulation", "--eval-every"])
def test_train_refuses_a_count_of_zero_before_the_model_loads(tmp_path, capsys, flag):
    """--steps 0 trained for an epoch and wrote an adapter; --gradient-accumulation 0 divided by zero. The error names
    the flag, not the TrainingRecipe field it sets."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), flag, "0"])
    assert exit_info.value.code == 2 and f"{flag} must be a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64])
def test_train_refuses_a_seed_out_of_range_naming_the_flag(tmp_path, capsys, seed):
    """A seed past 64 bits failed in torch.manual_seed with "Overflow when unpacking long long", naming no flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "no-model", "--output-dir", str(tmp_path / "out"), "--seed", str(seed)])
    assert exit_info.value.code == 2
    assert f"--seed must be an integer in 0..{2**32 - 1}, got {seed}." in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


TEXT_TRAINING = "--task text-varied --compress-chunk 16 --steps 2 --batch-size 2 --eval-every 2 --eval-samples 2"
STREAM_EVAL = "--tokens 300 --window-tokens 40 --sink-tokens 2 --compress-chunk 16 --max-memory-tokens 4 --bucket 100"


def stream_eval(model: str, adapter: Path, output: Path, *extra: str) -> dict:
    """Run `ccm stream-eval` on the tiny model with small sizes; returns its report."""
    arguments = ["--model", model, "--adapter", str(adapter), "--output-dir", str(output), *STREAM_EVAL.split()]
    main(["stream-eval", *arguments, *extra])
    return json.loads((output / "stream_eval.json").read_text())


def test_train_on_long_text_then_stream_eval(tiny_model, tmp_path, capsys):
    main(["train", "--model", tiny_model, "--output-dir", str(tmp_path / "stream"), *TEXT_TRAINING.split()])
    assert (
        "built-in task 'text-varied'" in json.loads((tmp_path / "stream" / "ccm_config.json").read_text())["trained_on"]
    )
    adapter = str(tmp_path / "stream")
    report = stream_eval(tiny_model, tmp_path / "stream", tmp_path / "results")
    assert report["tokens"] == 300 and set(report["methods"]) == {"ccm-concat", "streaming_llm"}
    for result in report["methods"].values():
        assert result["max_kv_length"] == 46 and result["peak_kv_held"] <= 46
        assert max(result["kv_held"]) <= 46 and len(result["token_nll"]) == 299
        assert len(result["bucket_perplexity"]) == 3 and result["perplexity"] > 1
    assert report["methods"]["streaming_llm"]["streaming"]["window_tokens"] == 44
    assert report["methods"]["streaming_llm"]["peak_kv_held"] == 46
    assert (tmp_path / "results" / "stream_eval.png").stat().st_size > 10_000
    assert "streaming_llm" in capsys.readouterr().out
    story = tmp_path / "story.txt"
    story.write_text("Once upon a time a lighthouse keeper counted ships at night. " * 40, encoding="utf-8")
    arguments = ["--text-file", str(story), "--output-dir", str(tmp_path / "story"), *STREAM_EVAL.split()]
    main(["stream-eval", "--model", tiny_model, "--adapter", adapter, *arguments])
    report = json.loads((tmp_path / "story" / "stream_eval.json").read_text())
    assert report["text"] == str(story) and report["tokens"] == 300
    with pytest.raises(SystemExit):
        main(["stream-eval", "--model", tiny_model, "--adapter", adapter, "--text-file", str(tmp_path / "none.txt")])
    assert "is not a file" in capsys.readouterr().err


def test_stream_eval_refuses_an_adapter_acting_everywhere_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Its StreamingLLM baseline turns the adapter off, which a LoRA at every position cannot be on a stream: the run
    failed only once CCM's stream was scored, blaming an adapter_disabled() context it never entered."""
    monkeypatch.chdir(tmp_path)
    tiny_full_context_baseline(seed=1).save_pretrained(tmp_path / "full")
    with pytest.raises(SystemExit) as exit_info:
        main(["stream-eval", "--model", "no-model", "--adapter", "full", "--output-dir", "out", *STREAM_EVAL.split()])
    assert exit_info.value.code == 2
    assert "acts at every position (conditional_lora=False)" in capsys.readouterr().err
    assert not Path("out").exists()


def test_stream_eval_refuses_a_cap_above_the_adapters_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The stream's cap (8 unless given) was used whatever the adapter's: its memory held more slots than the adapter
    was made to read."""
    monkeypatch.chdir(tmp_path)
    tiny_ccm("llama", max_memory_tokens=3).save_pretrained(tmp_path / "capped")
    with pytest.raises(SystemExit) as exit_info:
        main(["stream-eval", "--model", "no-model", "--adapter", "capped", "--output-dir", "out", *STREAM_EVAL.split()])
    assert exit_info.value.code == 2
    assert "StreamingConfig.max_memory_tokens (4) exceeds the adapter's CCMConfig.max_memory_tokens (3)" in (
        capsys.readouterr().err
    )
    assert not Path("out").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tokens", "-5"], "--tokens must be at least 2"),  # sliced the last 5 tokens off the text
        (["--tokens", "1"], "--tokens must be at least 2"),
        (["--piece", "0"], "--piece must be at least 1"),  # range() arg 3 must not be zero
        (["--piece", "-3"], "--piece must be at least 1"),  # max() arg is an empty sequence
        (["--bucket", "0"], "--bucket must be at least 1"),  # raised once both streams were scored
        (["--text-file", "binary.dat"], "binary.dat is not UTF-8 text"),
    ],
)
def test_stream_eval_refuses_bad_arguments_before_the_model_loads(tmp_path, capsys, monkeypatch, arguments, message):
    monkeypatch.chdir(tmp_path)
    Path("binary.dat").write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(SystemExit) as exit_info:
        main(["stream-eval", "--model", "no-model", "--adapter", "no-adapter", "--output-dir", "out", *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not Path("out").exists()


def test_stream_eval_of_a_text_shorter_than_its_budget(tiny_model, adapter, tmp_path, capsys):
    """A stream that ends before the KV budget fills raised ZeroDivisionError; an empty text raised a message about
    tensor shapes."""
    short, empty = tmp_path / "short.txt", tmp_path / "empty.txt"
    short.write_text("A short note, far shorter than the window.", encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    report = stream_eval(tiny_model, adapter, tmp_path / "short", "--text-file", str(short))
    assert 2 <= report["tokens"] < 46 and all(
        result["perplexity_after_budget"] is None and result["perplexity"] > 1 for result in report["methods"].values()
    )
    assert "none (the stream is not longer than the KV budget)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        stream_eval(tiny_model, adapter, tmp_path / "empty", "--text-file", str(empty))
    assert exit_info.value.code == 2 and "holds 0 token(s); a stream needs 2 or more" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()


def test_stream_eval_reads_a_text_file_with_a_byte_order_mark_as_its_text(tiny_model, adapter, tmp_path, capsys):
    """The mark some editors write at the start of a UTF-8 file was streamed and scored as tokens of the text."""
    text = "Zoë's café opened at dawn; the baker counted loaves. " * 6
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    reports = [stream_eval(tiny_model, adapter, tmp_path / f.stem, "--text-file", str(f)) for f in (plain, marked)]
    first, second = ({key: value for key, value in r.items() if key != "text"} for r in reports)  # "text": the path
    assert first == second
    capsys.readouterr()


PIECES_OF_TEXT = ["the ", "café ", "\r\n", "  ", "1234567", "日本語", "🙂", "a" * 300, "Zoë,", "\t", ".\n\n"]
PIECES_OF_TEXT += ["<|im_end|>"]  # a special token's text, which the file's tokens hold as that token


@settings(max_examples=25, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES_OF_TEXT), max_size=600),
    tokens=st.one_of(st.none(), st.integers(2, 700)),
    mark=st.booleans(),
)
def test_a_stream_of_a_files_first_tokens_is_those_of_the_whole_file(tokenizer, pieces, tokens, mark):
    """`ccm stream-eval --tokens N` tokenized the whole file before keeping its first N tokens: a corpus of gigabytes
    for a stream of thousands. It reads prefixes now, as long as those tokens need, and they are the same tokens,
    characters of several bytes and a byte-order mark cut or not."""
    from transformers_ccm.cli import _file_prefix, _leading_ids, _string_prefix

    text = "".join(pieces)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "text.txt"
        path.write_bytes(("\ufeff" if mark else "").encode() + text.encode())
        assert _leading_ids(tokenizer, functools.partial(_file_prefix, str(path)), tokens) == expected
    assert _leading_ids(tokenizer, functools.partial(_string_prefix, text), tokens) == expected


def test_a_stream_of_a_files_first_tokens_reads_no_further_than_they_need(tokenizer, tmp_path):
    """Bytes that are not UTF-8 a hundred kilobytes past the first 300 tokens: a stream of those tokens never reads
    them."""
    from transformers_ccm.cli import _file_prefix, _leading_ids

    text = "The keeper counted ships at night, and wrote each one down. " * 2_000
    (tmp_path / "corpus.txt").write_bytes(text.encode() + bytes(range(128, 256)))
    read = functools.partial(_file_prefix, str(tmp_path / "corpus.txt"))
    assert _leading_ids(tokenizer, read, 300) == tokenizer(text, add_special_tokens=False)["input_ids"][:300]
    with pytest.raises(ValueError, match=r"corpus\.txt is not UTF-8 text"):
        _leading_ids(tokenizer, read, None)


@pytest.mark.parametrize("tokens", [10**12, 2**61])
def test_a_stream_longer_than_its_file_reads_the_file_whole(tokenizer, tmp_path, tokens):
    """`ccm stream-eval --tokens 1000000000000` asked `read` for 8 TB of a small file, set aside before a byte was
    read: a MemoryError (an OverflowError for 2**61 tokens) where a stream of the whole file was due."""
    from transformers_ccm.cli import _file_prefix, _first_prefix, _leading_ids

    text = "The keeper counted ships at night. " * 20
    (tmp_path / "short.txt").write_text(text, encoding="utf-8")
    read = functools.partial(_file_prefix, str(tmp_path / "short.txt"))
    assert read(_first_prefix(tokens)) == (text, True)
    assert _leading_ids(tokenizer, read, tokens) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_stream_eval_streams_a_text_file_with_its_own_line_ends(tiny_model, adapter, tmp_path, capsys):
    """A file with Windows line ends ("\r\n") was streamed with "\n" in their place: another text than the file's,
    of other tokens (180 scored for the 200 of this one)."""
    from transformers_ccm.embedded import load_tokenizer

    text = "line one\r\nline two\rline three\n" * 20
    (tmp_path / "windows.txt").write_bytes(text.encode())
    report = stream_eval(tiny_model, adapter, tmp_path / "out", "--text-file", str(tmp_path / "windows.txt"))
    assert report["tokens"] == len(load_tokenizer("default")(text, add_special_tokens=False)["input_ids"])
    capsys.readouterr()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tasks", "icl", "--steps", "0"], "--steps takes time steps of at least 1"),  # ZeroDivisionError at the end
        (["--tasks", "icl", "--steps", "1", "-2"], "--steps takes time steps of at least 1"),
        (["--tasks", "icl", "--samples", "0"], "--samples must be at least 1, got 0"),
        (["--tasks", "icl", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # range() arg 3
        (["--tasks", "no-contexts.jsonl"], "no-contexts.jsonl:3 has no contexts"),
        # Scored as nan, then 'Data cannot be log-scaled' in the plot, once every model had run.
        (["--tasks", "empty-output.jsonl"], "empty-output.jsonl:3 has an empty 'output'"),
        (["--tasks", "no-output.jsonl"], "no-output.jsonl:3 has no 'output'; every sample to score needs one"),
        # Scored by perplexity, the choices of every other sample ignored.
        (["--tasks", "some-choices.jsonl"], "some-choices.jsonl:1 lists no choices, while some-choices.jsonl:3 does"),
        # Each scored again, every row written twice into eval.json.
        (["--tasks", "icl", "icl"], "--tasks names a task more than once: ['icl', 'icl']"),
        (["--tasks", "icl", "--steps", "1", "2", "1"], "--steps names a time step more than once: [1, 2, 1]"),
        (
            ["--tasks", "empty-output.jsonl", "icl", "./empty-output.jsonl"],
            "names one file twice, as empty-output.jsonl ",
        ),
        (["--tasks", "link.jsonl", "no-contexts.jsonl"], "as link.jsonl and as no-contexts.jsonl; name it once."),
    ],
)
def test_eval_refuses_counts_below_one_before_the_model_loads(tmp_path, capsys, monkeypatch, arguments, message):
    monkeypatch.chdir(tmp_path)
    # A blank line between the samples: an error names the file's line, not the sample's place among the samples.
    good = '{"contexts": ["Ann likes tea."], "input": "Ann likes", "output": " tea"}\n\n'
    Path("no-contexts.jsonl").write_text(good + '{"contexts": [], "input": "Bob likes", "output": " coffee"}\n')
    Path("empty-output.jsonl").write_text(good + '{"contexts": ["Bob."], "input": "Bob likes", "output": ""}')
    Path("no-output.jsonl").write_text(good + '{"contexts": ["Bob likes coffee."], "input": "Bob likes"}\n')
    Path("link.jsonl").symlink_to("no-contexts.jsonl")
    choices = (
        '{"contexts": ["Bob likes coffee."], "input": "Bob likes", "output": " coffee", "choices": [" tea", " coffee"]}'
    )
    Path("some-choices.jsonl").write_text(good + choices)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", "no-model", "--adapters", "no-adapter", "--output-dir", "out", *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not Path("out").exists()


def test_chat_refuses_an_unwritable_memory_file_before_any_work(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # The superuser writes into read-only folders; /sys refuses everyone.
    unwritable = locked if not os.access(locked, os.W_OK) else Path("/sys")
    os.mkfifo(tmp_path / "pipe")  # a save renamed a file over it, after the first turn had run
    (tmp_path / "afile").write_text("the user's")  # "create it first" could not be done
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    for path, message in (
        (unwritable / "user.safetensors", "cannot be written"),
        (tmp_path / "missing" / "user.safetensors", "does not exist; create it first"),
        (tmp_path / "afile" / "user.safetensors", f"{tmp_path / 'afile'} is a file, not a folder; give a path in a"),
        (tmp_path, "is a folder"),
        (tmp_path / "pipe", "is not a regular file (a device or a pipe)"),
    ):
        with pytest.raises(SystemExit):
            main(["chat", "--model", tiny_model, "--adapter", adapter, "--memory-file", str(path)])
        captured = capsys.readouterr()
        assert message in captured.err and "assistant:" not in captured.out


def test_chat_at_the_limit_of_open_files_says_so_not_to_choose_another_place(tmp_path, monkeypatch, capsys):
    # Imported by ccm chat and ccm eval first: their files would not open at the limit.
    import transformers_ccm.chat
    import transformers_ccm.evaluation  # noqa: F401

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    memory = tmp_path / "user.safetensors"
    for command in (["chat", "--memory-file", str(memory)], ["eval", "--output-dir", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_info, open_files_limit(0):
            main(command)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert "cannot be written ([Errno 24] Too many open files" in error
        assert error.endswith("this process has too many files open: close some, or raise its limit (ulimit -n).\n")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_keeps_the_previous_memory_file(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    memory = tmp_path / "user.safetensors"
    arguments = ["chat", "--model", tiny_model, "--adapter", adapter, "--memory-file", str(memory)]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ann.\n"))
    main([*arguments, "--max-new-tokens", "2"])
    before = memory.read_bytes()

    save_file = memory_file.save_file

    def onto_a_full_disk(*args, **kwargs):  # the real writer, on a disk with no room left (`ulimit -f 0`)
        with file_size_limit(0):
            return save_file(*args, **kwargs)

    monkeypatch.setattr(memory_file, "save_file", onto_a_full_disk)
    monkeypatch.setattr("sys.stdin", io.StringIO("Still there?\nAnd now?\n"))
    main([*arguments, "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert captured.out.count("assistant:") == 3 and "File too large" in captured.err
    assert memory.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["user.safetensors"]


def test_a_memory_file_replaced_by_a_pipe_between_turns_keeps_the_chat_and_its_memory_going(
    tiny_model, adapter, tmp_path, monkeypatch, capsys
):
    """The save's refusal of a pipe in the file's place (a ValueError) ended the chat, its memory unsaved."""
    memory = tmp_path / "user.safetensors"

    def messages():
        yield "Hi, I am Ann.\n"
        memory.unlink()  # another process puts a pipe where the memory file was
        os.mkfifo(memory)
        yield "Still there?\n"

    monkeypatch.setattr("sys.stdin", messages())
    main(["chat", "--model", tiny_model, "--adapter", adapter, "--memory-file", str(memory), "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert captured.out.count("assistant:") == 2
    assert captured.err.endswith(
        f"ccm chat: could not save the memory to {memory} ({memory} is not a regular file (a device, a pipe or a "
        "socket); give the path of a file, or move it away to save a file there.); it is kept for the next turn.\n"
    )
    assert stat.S_ISFIFO(os.lstat(memory).st_mode) and [path.name for path in tmp_path.iterdir()] == [memory.name]


# Run in a process of its own: a limit of the address space would fail whatever else the test runner allocates.
_CHAT_UNDER_A_MEMORY_LIMIT = """
import io, os, resource, sys
from transformers_ccm import CompressedMemoryCache
from transformers_ccm.cli import main

load = CompressedMemoryCache.load.__func__


def under_a_memory_limit(cls, path, model):  # the real load, as the process's limit (ulimit -v) is nearly reached
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (used + os.path.getsize(path) // 2, resource.RLIM_INFINITY))
    try:
        return load(cls, path, model)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


CompressedMemoryCache.load = classmethod(under_a_memory_limit)
sys.stdin = io.StringIO("Hi\\n")
main(["chat", "--model", sys.argv[1], "--adapter", sys.argv[2], "--memory-file", sys.argv[3]])
"""


@pytest.mark.slow  # a new process: its imports and model load take about 10 s
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the address space used from /proc")
def test_a_memory_file_too_large_for_the_memory_left_ends_the_chat_with_the_error_not_a_traceback(
    tiny_model, adapter, tmp_path
):
    model = CCMForCausalLM.from_pretrained(adapter, base_model=tiny_model)
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    cache.save(tmp_path / "one.safetensors")
    with safe_open(tmp_path / "one.safetensors", framework="pt") as file:
        metadata = file.metadata()
    # The same user 2^17 times over: 64 MiB, more than glibc takes from memory freed before (the model's load freed
    # some) rather than from a new mapping, which the limit refuses.
    rows = {
        name: value.repeat(2**17, *[1] * (value.dim() - 1))
        for name, value in load_file(tmp_path / "one.safetensors").items()
    }
    memory = tmp_path / "users.safetensors"
    save_file(rows, memory, metadata)
    before = memory.read_bytes()
    result = run_python(_CHAT_UNDER_A_MEMORY_LIMIT, tiny_model, adapter, str(memory))
    assert result.returncode == 1, result.stderr
    assert result.stderr.endswith(
        f"ccm chat: error: Not enough memory to read the memory file {memory}, which is read whole; free some memory "
        "(or raise this process's limit, ulimit -v), then load it again: the file was not judged.\n"
    ), result.stderr
    assert memory.read_bytes() == before


def test_eval_scores_your_own_jsonl_files_by_number_of_contexts(tiny_model, adapter, tmp_path, capsys):
    from transformers_ccm.tasks import make_samples, save_jsonl

    choices, text = tmp_path / "choices.jsonl", tmp_path / "text.jsonl"
    save_jsonl([*make_samples("icl", "test", 3, steps=1), *make_samples("icl", "test", 2, steps=2)], choices)
    save_jsonl(make_samples("dialogue", "test", 2, steps=2), text)
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "out")]
    main([*arguments, "--tasks", str(choices), str(text)])
    results = json.loads((tmp_path / "out" / "eval.json").read_text())["results"]
    scored = {(r["task"], r["wordings"], r["steps"], r["metric"], len(r["per_sample"])) for r in results}
    assert scored == {
        (str(choices), "own", 1, "accuracy", 3),
        (str(choices), "own", 2, "accuracy", 2),
        (str(text), "own", 2, "perplexity", 2),
    }
    assert {r["method"] for r in results} == {"no_context", "full_context", "ccm-concat"}

    no_output = tmp_path / "no_output.jsonl"
    no_output.write_text(json.dumps({"contexts": ["a"], "input": "b"}) + "\n")
    for tasks, message in (
        ([str(choices), "--steps", "3"], r"has no sample with \[3\] contexts; it has samples with \[1, 2\]"),
        ([str(no_output)], f"{no_output}:1 has no 'output'; every sample to score needs one"),
        (["nonsense"], "built-in tasks .* or JSONL files; got 'nonsense'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*arguments, "--tasks", *tasks])
        assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_eval_checks_every_sample_set_before_scoring_any(tiny_model, adapter, tmp_path, capsys):
    """A sample the model cannot take in a later set (a token id past the vocabulary) failed once the sets before it
    had been scored, named by its place in its set alone (`samples[1]`, counted among the samples with as many
    contexts), not by its file and line as `ccm train` names it; blank lines, Windows line ends and a byte-order
    mark are no samples and still count as lines."""
    own = tmp_path / "own.jsonl"
    rows = [(["a b"], "x"), (["a", "b"], "x"), (["a b c"], "x"), (["a", [10**9]], "y")]
    lines = [json.dumps({"contexts": c, "input": "q", "output": o}) for c, o in rows]
    own.write_bytes(("\ufeff" + "\r\n\r\n".join(lines)).encode())  # the bad sample on line 7, without a line end
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--tasks", "icl", str(own), "--steps", "1", "2", "--samples", "2"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and not (tmp_path / "out").exists()
    assert f"{own}:7: contexts[1] holds the token id 1000000000, outside the model's vocabulary" in captured.err


@pytest.mark.parametrize(
    ("contexts", "question", "message"),
    [
        ([[5], [5] * 2047], [6], ":2: contexts[1] holds 2047 tokens, which with its 2 <COMP> tokens pass the model's"),
        ([[5]], [6] * 2048, ":2: its input and longest output or choice hold 2049 tokens, past the model's 2048"),
    ],
)
def test_eval_refuses_a_piece_memory_cannot_run_before_scoring_any(
    tiny_model, adapter, tmp_path, capsys, contexts, question, message
):
    """A context too long to compress with its <COMP> tokens within the model's positions (an input and answer too
    long to run after memory) fit the full-context check of a rotary model: it failed inside compress() once both
    baselines had been scored, naming neither the file nor the line."""
    own = tmp_path / "own.jsonl"
    fits = {"contexts": [[5], [5]], "input": [6], "output": [7]}
    own.write_text(json.dumps(fits) + "\n" + json.dumps({"contexts": contexts, "input": question, "output": [7]}))
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--tasks", str(own)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and not (tmp_path / "out").exists()
    assert f"{own}{message}" in captured.err


def test_eval_checks_the_pieces_of_every_adapters_memory_before_scoring_any(tiny_model, adapter, tmp_path, capsys):
    """A context that fits the first adapter's 2 <COMP> tokens within the model's 2048 positions but not a later
    adapter's 4 was checked against the first adapter alone: it failed inside the later one's compress(), once the
    baselines and the first adapter had been scored, naming `samples[0]` rather than the file and line."""
    more_slots = tmp_path / "four-slots"
    CCMForCausalLM.from_base(tiny_model, CCMConfig(num_comp_tokens=4)).save_pretrained(more_slots)
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"contexts": [[5] * 2045], "input": [6], "output": [7]}) + "\n")
    arguments = ["eval", "--model", tiny_model, "--tasks", str(own), "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--adapters", adapter, str(more_slots)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and not (tmp_path / "out").exists()
    assert f"{own}:1: contexts[0] holds 2045 tokens, which with its 4 <COMP> tokens pass the model's" in captured.err


def test_eval_keeps_two_adapters_with_the_same_update_rule(tiny_model, adapter, tmp_path, capsys):
    second = tmp_path / "second"
    shutil.copytree(adapter, second, ignore=shutil.ignore_patterns("checkpoint-*"))
    arguments = ["eval", "--model", tiny_model, "--device", "cpu", "--tasks", "icl", "--steps", "1", "--samples", "2"]
    main([*arguments, "--adapters", adapter, str(second), "--output-dir", str(tmp_path / "out")])
    methods = {row["method"] for row in json.loads((tmp_path / "out" / "eval.json").read_text())["results"]}
    assert methods == {"no_context", "full_context", f"ccm-concat:{adapter}", f"ccm-concat:{second}"}
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--adapters", adapter, adapter, "--output-dir", str(tmp_path / "again")])
    assert exit_info.value.code == 2
    assert "--adapters names an adapter more than once" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_eval_adds_an_adapter_to_an_earlier_report(tiny_model, adapter, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    arguments = ["eval", "--model", tiny_model, "--tasks", "icl", "--steps", "1", "2", "--samples", "3", "--seed", "4"]
    main([*arguments, "--adapters", adapter, "--output-dir", str(tmp_path / "first")])
    adding = ["--add-to", str(tmp_path / "first"), "--output-dir", str(tmp_path / "added")]
    main(["eval", "--model", tiny_model, "--seed", "4", "--adapters", str(copy), *adding])
    first, added = (json.loads((tmp_path / name / "eval.json").read_text()) for name in ("first", "added"))
    assert added["results"][: len(first["results"])] == first["results"]  # the earlier rows, baselines included
    new = added["results"][len(first["results"]) :]
    assert {r["method"] for r in new} == {f"ccm-concat:{copy}"}
    # A copy of the first adapter, on the same samples: the same scores.
    key = ("task", "wordings", "steps", "per_sample")
    assert [[r[k] for k in key] for r in new] == [
        [r[k] for k in key] for r in first["results"] if r["method"] == "ccm-concat"
    ]
    assert all(row["versus_first"] is not None for row in added["summary"] if row["method"] != "ccm-concat")
    # A report written before rows carried their samples' digest: the samples are checked by scoring no context again.
    older = tmp_path / "older"
    older.mkdir()
    stripped = [{k: v for k, v in row.items() if k != "samples_digest"} for row in first["results"]]
    (older / "eval.json").write_text(json.dumps({"results": stripped}))
    adding = ["--add-to", str(older), "--output-dir", str(tmp_path / "added-older")]
    main(["eval", "--model", tiny_model, "--seed", "4", "--adapters", str(copy), *adding])
    again = json.loads((tmp_path / "added-older" / "eval.json").read_text())["results"]
    assert [r["per_sample"] for r in again[len(stripped) :]] == [r["per_sample"] for r in new]
    capsys.readouterr()

    report = ["eval", "--model", tiny_model, "--adapters", str(copy), "--output-dir", str(tmp_path / "x")]
    (tmp_path / "crafted").mkdir()
    (tmp_path / "crafted" / "eval.json").write_text('{"results": [{"task": "icl"}]}')
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "eval.json").write_text("[" * 100_000 + "]" * 100_000)
    for extra, message in (
        (["--add-to", str(tmp_path / "first")], "drawn again gives other samples than its report"),  # seed 0, not 4
        (["--seed", "4", "--add-to", str(tmp_path / "added")], "already holds"),
        (["--add-to", str(tmp_path / "missing")], "no eval.json there"),
        (["--add-to", str(tmp_path / "crafted")], "is not a ccm eval report"),
        (["--add-to", str(tmp_path / "deep")], "is nested too deeply to be read as JSON"),
        (["--add-to", str(tmp_path / "first"), "--full-context-adapter", adapter], "drop --full-context-adapter"),
        (["--add-to", str(tmp_path / "first"), "--samples", "3", "--steps", "1"], "drop --steps --samples"),
        (["--add-to", str(tmp_path / "first"), "--tasks", "icl"], "drop --tasks"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*report, *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _report_rows(
    methods: Sequence[str] = ("no_context", "full_context", "ccm-concat"), **changes: object
) -> list[dict]:
    """Rows of a one-sample-set `ccm eval` report (icl, seen, t=2, 3 samples), with `changes` in every row."""
    row = dict(task="icl", wordings="seen", steps=2, samples=3, metric="accuracy", value=1.0, low=0.4, high=1.0)
    row |= dict(context_kv_tokens=40.0, peak_kv_tokens=60, peak_kv_bytes=600, per_sample=[[1.0, 1]] * 3)
    return [{**row, "method": method, **changes} for method in methods]


def _add_to_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: object, arguments: list[str]) -> str:
    """What `ccm eval ARGUMENTS --add-to` a report of `rows` prints, refusing it (exit code 2)."""
    (tmp_path / "report").mkdir(exist_ok=True)
    (tmp_path / "report" / "eval.json").write_text(json.dumps({"results": rows}))
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--add-to", str(tmp_path / "report")])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"samples": 50}, "samples is 50 but it holds 3 per-sample values"),
        ({"samples": -1}, "['samples'] must each be an integer >= 1"),
        ({"steps": 0}, "['steps'] must each be an integer >= 1"),
        ({"steps": 400}, "400 contexts per sample, 40.0 full-context tokens"),
        ({"context_kv_tokens": 0}, "ZeroDivisionError"),
        ({"context_kv_tokens": 70.0}, "2 contexts per sample, 70.0 full-context tokens, of at most 60"),
        ({"peak_kv_tokens": 1.5}, "['peak_kv_tokens'] must each be an integer >= 1"),
        # Each field of each row, of its type and in its range: a NaN or a value edited by hand was joined with the
        # new scores, and a row's value of another kind failed only in the table, once every adapter had run.
        ({"value": float("nan")}, "['value'] must each be a finite number"),
        ({"value": 0.5}, "value 0.5 is not that of its per_sample, 1.0"),
        ({"low": None, "steps": "2"}, "['steps'] must each be an integer >= 1; ['low'] must each be a finite"),
        ({"per_sample": [[1.0, 1, 0]] * 3}, "per_sample must hold pairs of (credit in [0, 1], 1)"),
        ({"per_sample": [[2.0, 1]] * 3}, "per_sample must hold pairs of (credit in [0, 1], 1)"),
        ({"metric": "recall"}, "metric 'recall' or wordings 'seen' is none of ('accuracy', 'perplexity', 'seen',"),
        ({"wordings": "heard"}, "metric 'accuracy' or wordings 'heard' is none of"),
        ({"peak_kv_bytes": None, "method": None}, "['method'] must each be a non-empty string; ['peak_kv_bytes']"),
        ({"wordings": "seen", "high": "1.0"}, "['high'] must each be a finite number"),
    ],
)
def test_eval_add_to_refuses_a_damaged_report_before_drawing_samples(tmp_path, capsys, changes, problem):
    """A report's counts are checked against what it holds: a count of a billion samples (or a million contexts)
    used to be drawn as it said, and a zero full-context size raised ZeroDivisionError."""
    arguments = ["eval", "--adapters", str(tmp_path / "none"), "--output-dir", str(tmp_path / "out")]
    error = _add_to_error(tmp_path, capsys, _report_rows(**changes), arguments)
    assert "is not a ccm eval report" in error and problem in error


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        # A set without its CCM row, or its baselines, raised StopIteration or KeyError as a traceback.
        (_report_rows(["no_context", "full_context"]), "holds the methods ['full_context', 'no_context']; a summary"),
        (_report_rows(["full_context", "ccm-concat"]), "holds the methods ['ccm-concat', 'full_context']; a summary"),
        # A row below the largest time step, which the summary does not read, failed only in the table.
        ([*_report_rows(steps=1, peak_kv_bytes="600"), *_report_rows()], "result 0 ('icl', 'no_context'): ['peak_kv"),
        ([*_report_rows()[:2], {"method": "ccm-concat"}], "result 2 (None, 'ccm-concat') has no ['task', 'wordings'"),
        ({"a": _report_rows()}, "its results are a dict, not a list of rows"),
    ],
)
def test_eval_add_to_refuses_a_report_missing_rows_or_fields_before_the_model_loads(tmp_path, capsys, rows, problem):
    arguments = ["eval", "--adapters", str(tmp_path / "none"), "--output-dir", str(tmp_path / "out")]
    error = _add_to_error(tmp_path, capsys, rows, arguments)
    assert "is not a ccm eval report" in error and problem in error
    assert "score anew without --add-to" in error and not (tmp_path / "out").exists()


def test_a_report_written_into_its_own_add_to_folder_survives_a_failed_write(
    tiny_model, adapter, tmp_path, monkeypatch, capsys
):
    """Each file of a report is replaced in one step: a disk that fills up midway keeps the earlier report."""
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    report = tmp_path / "report"
    scoring = ["eval", "--model", tiny_model, "--output-dir", str(report), "--adapters"]
    main([*scoring, adapter, "--tasks", "icl", "--steps", "1", "--samples", "2"])
    before = {path.name: path.read_bytes() for path in report.iterdir()}
    replace_files = cli_module.replace_files

    def onto_a_full_disk(writes):  # the real writers, with room for 1000 bytes per file (`ulimit -f`)
        with file_size_limit(1000):
            replace_files(writes)

    monkeypatch.setattr(cli_module, "replace_files", onto_a_full_disk)
    refusal = (
        f"could not write the report into {report} ([Errno 27] Cannot save {report / 'eval.json'} (File too large); "
        "the file is larger than the file system or this process's file size limit (ulimit -f) allows: raise the "
        "limit or choose another disk, then save again. Nothing there was replaced.)"
    )
    with refused_by_the_system(capsys, refusal):
        main([*scoring, str(copy), "--add-to", str(report)])
    assert {path.name: path.read_bytes() for path in report.iterdir()} == before
    monkeypatch.undo()
    main([*scoring, str(copy), "--add-to", str(report)])
    methods = {row["method"] for row in json.loads((report / "eval.json").read_text())["results"]}
    assert f"ccm-concat:{copy}" in methods and sorted(path.name for path in report.iterdir()) == sorted(before)
    capsys.readouterr()


def test_a_report_whose_files_fail_to_rename_keeps_every_file_of_the_earlier_report(
    tiny_model, adapter, tmp_path, capsys
):
    """The files of a report were renamed into place one after another: a rename that failed left the new
    stream_eval.json beside the earlier plot. Every rename of the swap fails once in turn here."""
    report = tmp_path / "report"
    stream_eval(tiny_model, adapter, report, "--tokens", "40")
    before = {path.name: path.read_bytes() for path in report.iterdir()}
    rename = os.replace
    for k in range(3):  # the plot moved aside, the plot moved in, the report moved in
        calls = itertools.count()

        def failing_rename(*args, k=k, calls=calls):
            if next(calls) == k:
                raise OSError(5, "Input/output error (injected)")
            return rename(*args)

        with patch.object(os, "replace", failing_rename), refused_by_the_system(capsys, "injected"):
            stream_eval(tiny_model, adapter, report, "--tokens", "60")
        assert {path.name: path.read_bytes() for path in report.iterdir()} == before
    assert stream_eval(tiny_model, adapter, report, "--tokens", "60")["tokens"] == 60
    capsys.readouterr()


def test_eval_add_to_refuses_full_contexts_past_the_models_positions_before_drawing(
    tiny_model, adapter, tmp_path, capsys
):
    """A report claiming ten million contexts per sample, its full context as many tokens and more: consistent in
    itself, it was drawn again for hours; the base model (2048 positions) never ran a prompt of that length."""
    rows = _report_rows(steps=10**7, context_kv_tokens=2e7, peak_kv_tokens=3 * 10**7)
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "out")]
    error = _add_to_error(tmp_path, capsys, rows, arguments)
    assert "icl (seen, t=10000000) held full contexts of 30000000 tokens" in error
    assert "past the 2048 positions of the base model" in error and not (tmp_path / "out").exists()


def test_eval_adds_an_adapter_to_a_report_of_a_file_whose_full_contexts_pass_the_models_positions(
    tiny_model, adapter, tmp_path, capsys
):
    """ccm eval scores a file's full contexts past a rotary model's positions (2048 here); --add-to refused the report
    it wrote, asking for the --model of that report, which was this one. A file's samples are read from it, so the
    report's counts draw nothing."""
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"contexts": [[5] * 1100, [9] * 1100], "input": [6], "output": [7, 8]}) + "\n")
    arguments = ["eval", "--model", tiny_model, "--output-dir"]
    main([*arguments, str(tmp_path / "first"), "--adapters", adapter, "--tasks", str(own)])
    second = tmp_path / "second"
    CCMForCausalLM.from_base(tiny_model, CCMConfig(num_comp_tokens=1)).save_pretrained(second)
    main([*arguments, str(tmp_path / "joint"), "--adapters", str(second), "--add-to", str(tmp_path / "first")])
    rows = json.loads((tmp_path / "joint" / "eval.json").read_text())["results"]
    assert [(row["method"], row["peak_kv_tokens"]) for row in rows if row["method"] != "no_context"] == [
        ("full_context", 2203),  # the whole history, input and output as one prompt
        ("ccm-concat", 1104),  # a context with the memory and <COMP> tokens of the adapter's 2 slots
        (f"ccm-concat:{second}", 1102),
    ]


def test_eval_add_to_refuses_sample_sets_ccm_eval_never_scores_before_scoring(tiny_model, adapter, tmp_path, capsys):
    """A set of a report edited by hand that ccm eval never draws (a built-in task's samples as a file's own, a task
    scored by another metric, a task that is none) was left out of the new adapter's scores without a word, or scored
    by another metric than its baselines once every other set had run."""
    samples = tmp_path / "own.jsonl"
    samples.write_text(json.dumps({"contexts": ["a"], "input": "b", "output": "c"}) + "\n")
    arguments = ["eval", "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "out")]
    for changes, problem in (
        ({"wordings": "own"}, "icl (own, t=2, accuracy) is not a sample set ccm eval scores (icl at t=2: seen by"),
        (
            {"task": "dialogue"},
            "dialogue (seen, t=2, accuracy) is not a sample set ccm eval scores (dialogue at t=2: seen by perplexity",
        ),
        (
            {"task": str(samples)},
            f"{samples} (seen, t=2, accuracy) cannot be drawn again ({samples} has no sample with [2]",
        ),
        ({"task": "nonsense"}, "nonsense (seen, t=2, accuracy) cannot be drawn again (--tasks takes built-in tasks"),
    ):
        error = _add_to_error(tmp_path, capsys, _report_rows(**changes), arguments)
        assert problem in error and "score every adapter anew without --add-to" in error
    assert not (tmp_path / "out").exists()


def test_eval_add_to_refuses_a_report_whose_rows_hold_other_samples(tmp_path, capsys):
    """A report joined by hand from two runs (its adapter's row of other samples): the new adapter was paired with
    rows it shares no sample with."""
    rows = _report_rows(samples_digest="0123456789abcdef")
    rows[-1]["samples_digest"] = "fedcba9876543210"
    arguments = ["eval", "--adapters", str(tmp_path / "none"), "--output-dir", str(tmp_path / "out")]
    error = _add_to_error(tmp_path, capsys, rows, arguments)
    assert "icl (seen, t=2): its methods were scored on different samples" in error


def test_train_the_full_context_baseline(tiny_model, tmp_path, capsys):
    train(tiny_model, tmp_path / "full", 2, "--method", "full-context", "--supervision", "dense")
    config = json.loads((tmp_path / "full" / "ccm_config.json").read_text())
    assert config["conditional_lora"] is False
    assert config["trained_on"] == "fine-tuned full-context baseline on transformers-ccm built-in task 'mixture'"
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", tiny_model, "--adapters", str(tmp_path / "full"), "--tasks", "icl", "--samples", "2"])
    assert exit_info.value.code == 2 and "pass it as --full-context-adapter" in capsys.readouterr().err
    demo = ["demo", "--model", tiny_model, "--adapter", str(tmp_path / "full"), "--turns", "1", "--max-new-tokens", "2"]
    main([*demo, "--full-context"])
    assert "with its LoRA, with the whole conversation" in capsys.readouterr().out
    for refused, fix in ((demo, "run it with --full-context"), (["chat", *demo[1:5]], "chat with a compression")):
        with pytest.raises(SystemExit) as exit_info:
            main(refused)
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and "fine-tuned full-context baseline" in error and fix in error


def test_train_distils_from_a_full_context_baseline(tiny_model, adapter, tmp_path, capsys):
    train(tiny_model, tmp_path / "full", 1, "--method", "full-context")
    distil = ["--init-adapter", adapter, "--distill-weight", "1", "--distill-teacher"]
    train(tiny_model, tmp_path / "student", 2, *distil, str(tmp_path / "full"))
    trained_on = json.loads((tmp_path / "student" / "ccm_config.json").read_text())["trained_on"]
    assert trained_on.endswith(f"then transformers-ccm built-in task 'mixture', distilled from {tmp_path / 'full'}")
    with pytest.raises(SystemExit) as exit_info:
        train(tiny_model, tmp_path / "refused", 1, *distil, adapter)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--distill-teacher {adapter} is a compression adapter" in error
    assert not (tmp_path / "refused").exists()


def test_device_auto_picks_a_gpu_only_when_there_is_one():
    from transformers_ccm.cli import _device

    assert _device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert _device("cuda:1") == "cuda:1" and _device("cpu") == "cpu"


def test_train_refuses_a_compress_chunk_that_leaves_no_window(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--model",
                tiny_model,
                "--output-dir",
                str(tmp_path / "a"),
                "--task",
                "text",
                "--compress-chunk",
                "148",
            ]
        )
    assert "--compress-chunk 148 leaves no window; use one below 148" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_train_on_streams(tiny_model, tmp_path):
    main(
        [
            "train",
            "--model",
            tiny_model,
            "--output-dir",
            str(tmp_path / "stream"),
            *[
                "--task",
                "text-varied",
                "--compress-chunk",
                "16",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--eval-every",
                "1",
                "--eval-samples",
                "2",
            ],
            "--supervision",
            "stream",
            "--stream-chunks",
            "2",
            "--distill-weight",
            "1",
        ]
    )
    assert (tmp_path / "stream" / "adapter_model.safetensors").is_file()
    state = json.loads(next((tmp_path / "stream").glob("checkpoint-*/trainer_state.json")).read_text())
    assert any("eval_loss" in entry for entry in state["log_history"])
    for schedule in ("--keep-window-full", "--no-keep-window-full"):
        report = stream_eval(tiny_model, tmp_path / "stream", tmp_path / schedule, schedule)
        assert report["streaming"]["keep_window_full"] is (schedule == "--keep-window-full")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("--task icl --supervision stream", "--supervision stream trains on long text; --task and --eval-task must be"),
        ("--task text --supervision stream --stream-chunks 0", "--stream-chunks must be at least 1, got 0"),
    ],
)
def test_train_refuses_streams_of_other_tasks(tiny_model, tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit):
        main(["train", "--model", tiny_model, "--output-dir", str(tmp_path / "a"), *arguments.split()])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--task", "icl", "--steps", "1"],
        ["eval", "--adapters", "no-adapter", "--tasks", "icl", "--steps", "1", "--samples", "1"],
        ["stream-eval", "--adapter", "no-adapter"],
    ],
)
def test_an_output_dir_that_cannot_be_a_folder_is_refused_before_the_model_loads(tmp_path, capsys, command):
    """A file there, or a folder that cannot be written, failed with a traceback (FileExistsError) when the results
    were written: for eval and stream-eval, after every model had run."""
    taken = tmp_path / "report.json"
    taken.write_text("kept")
    for output, message in (
        (taken, f"{taken} is a file"),
        (taken / "inside", f"{taken} is a file"),
        (Path("/sys/ccm-output"), "cannot be written"),  # /sys refuses everyone, the superuser too
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([command[0], "--model", str(tmp_path / "no-model"), "--output-dir", str(output), *command[1:]])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert taken.read_text() == "kept"


def test_train_reads_its_jsonl_files_before_the_model_loads(tiny_model, tmp_path, capsys, monkeypatch):
    """A bad --task or --eval-task file was read only once the model had loaded (20 s for the embedded one), and a
    folder failed with an IsADirectoryError traceback; a folder named like a built-in task was read as a file."""
    monkeypatch.chdir(tmp_path)
    Path("bad.jsonl").write_text('{"contexts": ["c"], "input": "q", "output": "a"}\n{"contexts": ["c"], "input": 5}\n')
    Path("folder.jsonl").mkdir()
    for arguments, message in (
        (["--task", "bad.jsonl"], "bad.jsonl:2: 'input' must be a string"),
        (["--task", "icl", "--eval-task", "bad.jsonl"], "bad.jsonl:2: 'input' must be a string"),
        (["--task", "folder.jsonl"], "folder.jsonl is not a regular file (a folder, a pipe or a device); give a J"),
        (["--task", "missing.jsonl"], "missing.jsonl cannot be read (No such file or directory)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--model", "no-model", "--output-dir", "out", "--steps", "1", *arguments])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
        assert not Path("out").exists()
    Path("icl").mkdir()
    main(["train", "--model", tiny_model, "--task", "icl", "--steps", "1", "--batch-size", "1", "--output-dir", "out"])
    trained_on = json.loads(Path("out", "ccm_config.json").read_text())["trained_on"]
    assert trained_on == "transformers-ccm built-in task 'icl'"


@pytest.mark.parametrize("name", ["icl", "mixture", "icl:1,dialogue:1", "text"])
def test_a_built_in_tasks_name_means_the_task_whatever_files_the_folder_holds(tmp_path, capsys, monkeypatch, name):
    """A file in the working folder named like a built-in task was read in its place, by ccm train and ccm eval:
    the same command scored or trained on other samples in another folder. A path names the file."""
    from transformers_ccm.cli import _evaluation_sets, _is_file, _load_samples
    from transformers_ccm.tasks import load_jsonl, load_jsonl_rows, make_samples, save_jsonl

    monkeypatch.chdir(tmp_path)
    save_jsonl(make_samples("dialogue", "test", 2, steps=1), name)
    wanted = argparse.Namespace(samples=2, seed=0, steps=[1])
    by_path = _evaluation_sets(f"./{name}", wanted, None)
    assert [(w, t, samples, lines) for w, t, samples, _, lines in by_path] == [("own", 1, load_jsonl(name), [1, 2])]
    assert _load_samples(f"./{name}", "train", 2, 0, lambda: None, 4) == load_jsonl_rows(name)
    if name == "text":  # cut from the Python reference with the model's tokenizer (seconds to load and cut)
        assert not _is_file(name)
        return
    assert _load_samples(name, "train", 2, 0, lambda: None, 4) == (make_samples(name, "train", 2), None)
    if name == "icl":
        assert [(w, samples) for w, _, samples, _, _ in _evaluation_sets(name, wanted, None)] == [
            ("seen", make_samples("icl", "test", 2, steps=1, wordings="seen")),
            ("unseen", make_samples("icl", "test", 2, steps=1, wordings="unseen")),
        ]
        return
    with pytest.raises(SystemExit) as exit_info:  # ccm eval scores no mixture, even where a file has its name
        main(["eval", "--model", "no-model", "--adapters", "no-adapter", "--output-dir", "out", "--tasks", name])
    assert exit_info.value.code == 2
    assert f"got {name!r} (for the file {name}, write ./{name})" in capsys.readouterr().err
    assert not Path("out").exists()


def test_train_names_the_file_and_line_of_a_sample_the_model_refuses(tiny_model, tmp_path, capsys, monkeypatch):
    """What only the model can check (ids past its vocabulary, nothing to learn from) was refused as `train_samples[2]`
    or `samples[2]`: an index among the file's samples, from 0, not its line (blank lines are skipped)."""
    monkeypatch.chdir(tmp_path)
    good = '{"contexts": ["Ann likes tea."], "input": "Ann likes", "output": " tea"}\n'
    Path("empty.jsonl").write_text(f'{good}\n{good}{{"contexts": ["Bob."], "input": "Bob likes", "output": ""}}\n')
    Path("ids.jsonl").write_text(f'{good}\n{good}{{"contexts": [[99999999]], "input": "Bob likes", "output": " x"}}\n')
    for arguments, message in (
        (["--task", "empty.jsonl"], "empty.jsonl:4 has no token to learn from: no output. Give every sample an output"),
        (["--task", "ids.jsonl"], "ids.jsonl:4: contexts[0] holds the token id 99999999, outside the model's vocab"),
        (["--task", "icl", "--eval-task", "ids.jsonl"], "ids.jsonl:4: contexts[0] holds the token id 99999999"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--model", tiny_model, "--output-dir", "out", "--steps", "1", *arguments])
        assert exit_info.value.code == 2 and f"ccm train: error: {message}" in capsys.readouterr().err
        assert not Path("out").exists()


def test_chat_goes_on_after_a_message_it_cannot_answer(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    """A message longer than the model's positions allow ended the whole chat with 'ccm chat: error: ...'; the
    message is refused, the memory (and its file) stay as they were, and the next message is answered."""
    memory = tmp_path / "user.safetensors"
    arguments = ["chat", "--model", tiny_model, "--adapter", adapter, "--memory-file", str(memory)]
    too_long = "word " * 2100  # the tiny model has 2048 positions
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Hi, I am Ann.\n{too_long}\nWhat is my name?\n"))
    main([*arguments, "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert captured.out.count("assistant:") == 2 and "[memory: 4 slots" in captured.out
    assert "ccm chat: that message was not answered (A prompt of 2" in captured.err
    assert "the memory is as it was" in captured.err


@pytest.mark.parametrize("supervision", ["output", "stream"])
@pytest.mark.parametrize("chunk", ["0", "-5"])
def test_train_refuses_a_compress_chunk_below_one_before_the_model_loads(tmp_path, capsys, supervision, chunk):
    """Text samples were cut into empty contexts ('samples[0].contexts[0] is empty') and streams 'never compress' (a
    chunk of 0 tokens), each said only once the model had loaded, and without naming --compress-chunk."""
    arguments = ["--task", "text", "--supervision", supervision, "--compress-chunk", chunk, "--steps", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), *arguments])
    assert exit_info.value.code == 2 and f"--compress-chunk must be at least 1, got {chunk}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--compress-chunk", "200"], "window_tokens (148) is smaller than compress_chunk (200)"),
        (["--num-comp-tokens", "9"], "max_memory_tokens (8) cannot hold one compressed chunk (9 <COMP> slots)"),
        (["--window-tokens", "8", "--compress-chunk", "16"], "window_tokens (8) is smaller than compress_chunk (16)"),
        (["--sink-tokens", "-1"], "sink_tokens must be an integer >= 0, got -1"),
        (["--max-memory-tokens", "1"], "max_memory_tokens (1) cannot hold one compressed chunk (2 <COMP> slots)"),
    ],
)
def test_train_on_streams_refuses_bad_sizes_before_the_model_loads(tmp_path, capsys, arguments, message):
    """The streaming sizes were checked only at the first step, once the model had loaded and the output folder was
    made."""
    arguments = ["--task", "text", "--supervision", "stream", "--steps", "1", *arguments]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_on_streams_of_the_sizes_stream_eval_takes(tiny_model, tmp_path, capsys):
    """`ccm train --supervision stream` trained with a sink of 4 and a window of 148 whatever budget its adapter would
    stream with: the sizes of `ccm stream-eval` are its flags too, recorded in the run and kept by a resumed one."""
    sizes = ["--window-tokens", "40", "--sink-tokens", "2", "--compress-chunk", "16", "--max-memory-tokens", "4"]
    arguments = ["train", "--model", tiny_model, "--task", "text", "--supervision", "stream", "--stream-chunks", "2"]
    arguments += ["--batch-size", "2", "--eval-samples", "0", "--output-dir", str(tmp_path / "run"), *sizes]
    main([*arguments, "--steps", "1"])
    settings = json.loads((tmp_path / "run" / "checkpoint-1" / "ccm_training.json").read_text())
    assert settings["stream_length"] == 2 + 40 + 2 * 16 + 1
    assert {key: settings["streaming"][key] for key in ("window_tokens", "sink_tokens", "max_memory_tokens")} == {
        "window_tokens": 40,
        "sink_tokens": 2,
        "max_memory_tokens": 4,
    }
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--steps", "2", "--resume", "--max-memory-tokens", "6"])
    assert exit_info.value.code == 2 and "--max-memory-tokens" in capsys.readouterr().err
    main([*arguments, "--steps", "2", "--resume"])
    assert (tmp_path / "run" / "checkpoint-2" / "ccm_training.json").is_file()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--window-tokens", "8", "--compress-chunk", "16"], "window_tokens (8) is smaller than compress_chunk (16)"),
        (["--sink-tokens", "-1"], "sink_tokens must be an integer >= 0, got -1"),
        (["--max-memory-tokens", "1"], "max_memory_tokens (1) cannot hold one compressed chunk (2 <COMP> slots)"),
    ],
)
def test_stream_eval_refuses_bad_sizes_before_the_model_loads(adapter, tmp_path, capsys, arguments, message):
    """The streaming sizes were checked only once the model (20 s for the embedded one) had loaded."""
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "stream-eval",
                "--model",
                str(tmp_path / "no-model"),
                "--adapter",
                adapter,
                "--output-dir",
                str(tmp_path),
                *arguments,
            ]
        )
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_model_or_adapter_path_that_is_no_folder_is_named(tiny_model, tmp_path, capsys):
    """A --model path that does not exist failed with a traceback (OSError: Repo id must be in the form ...); a file
    given as --model failed with 'config file ... is not a valid JSON file', and as an adapter went to the Hub."""
    afile = tmp_path / "notes.txt"
    afile.write_text("not a model")
    missing = tmp_path / "missing"
    for command, message in (
        (["train", "--model", str(missing), "--task", "icl"], f"{missing} is neither a local folder nor a valid Hub"),
        (["train", "--model", str(afile), "--task", "icl"], f"{afile} is a file, not a folder"),
        (["eval", "--model", tiny_model, "--adapters", str(afile)], f"{afile} is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--output-dir", str(tmp_path / "out"), "--steps", "1"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("--update ema --ema-alpha 0", "ccm train: error: --ema-alpha must be a number in (0, 1], got 0.0.\n"),
        ("--update ema --ema-alpha nan", "ccm train: error: --ema-alpha must be a number in (0, 1], got nan.\n"),
        ("--ema-alpha 1.5", "ccm train: error: --ema-alpha must be a number in (0, 1], got 1.5.\n"),
        ("--num-comp-tokens 0", "ccm train: error: --num-comp-tokens must be a positive integer, got 0.\n"),
        ("--lora-r -2", "ccm train: error: --lora-r must be a positive integer, got -2.\n"),
    ],
)
def test_train_refuses_adapter_settings_naming_their_flags(tmp_path, capsys, arguments, message):
    """A bad --ema-alpha, --num-comp-tokens or --lora-r was refused in CCMConfig's words ("CCMConfig.ema_alpha must
    be ..."), which named no flag of the command."""
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), *arguments.split()]
        )
    assert exit_info.value.code == 2 and capsys.readouterr().err == message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # Drawn as no sample: the run went without evaluation, without a word.
        ("--eval-samples -3", "--eval-samples must be at least 0 (0: no evaluation), got -3"),
        # The Trainer's seed for numpy failed once the model had loaded.
        ("--seed -1", "--seed must be an integer in 0..4294967295, got -1"),
        ("--distill-teacher some-teacher", "distill_weight is 0, so it would never be asked"),
        ("--method full-context --distill-weight 1", "layout='full_context' trains the fine-tuned full-context"),
        ("--task text --supervision stream --method full-context", "Training on streams needs a compression adapter"),
        ("--task text --supervision stream --gradient-checkpointing", "Gradient checkpointing does not apply"),
    ],
)
def test_train_refuses_conflicting_flags_before_the_model_loads(tmp_path, capsys, arguments, message):
    """Each was refused by train() only once the model (and a teacher) had loaded."""
    output = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", output, *arguments.split()])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_checks_what_it_resumes_before_the_model_loads(adapter, tmp_path, capsys):
    """--resume into a folder without checkpoints, or of another adapter, was refused once the model had loaded; one
    with another learning rate went on with the checkpoint's."""
    run = tmp_path / "run"
    shutil.copytree(adapter, run)
    for output, arguments, message in (
        (tmp_path / "fresh", [], "holds no checkpoint to resume from; train without --resume"),
        (run, ["--update", "merge"], "holds another adapter (update: checkpoint 'concat' vs model 'merge')"),
        (
            run,
            ["--task", "people"],
            'was trained on "transformers-ccm built-in task \'mixture\'", and this run trains on "transformers-ccm '
            "built-in task 'people'\"",
        ),
        (
            run,
            ["--batch-size", "2", "--learning-rate", "0.5", "--seed", "1"],
            "trained with other settings (--learning-rate: checkpoint 0.001 vs this run 0.5, --seed: checkpoint 0 "
            "vs this run 1); resume with the settings of the run that wrote it",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(output), "--resume", *arguments])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()


def test_train_refuses_to_start_anew_beside_the_checkpoints_of_another_run_before_the_model_loads(
    adapter, tmp_path, capsys
):
    """Without --resume, a run into a folder of an earlier run's checkpoints wrote its own among them, and a --resume
    after it was cut short went on from the earlier run's."""
    run = tmp_path / "run"
    shutil.copytree(adapter, run)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(run)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "holds the checkpoints of an earlier run" in error and "--resume" in error


@pytest.mark.parametrize("command", ["eval", "stream-eval", "chat", "demo"])
def test_a_device_that_is_not_here_is_refused_before_the_model_loads(tmp_path, capsys, command):
    """A misspelt --device failed with torch's RuntimeError traceback, and a GPU that is not there with 'Torch not
    compiled with CUDA enabled' (or an invalid device ordinal), each once the model had loaded."""
    output = ["--output-dir", str(tmp_path)] if command in ("eval", "stream-eval") else []
    missing_gpu = f"cuda:{torch.cuda.device_count()}"
    for device, message in (("gpu0", "--device gpu0 is not a device"), (missing_gpu, f"--device {missing_gpu}: ")):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--model", str(tmp_path / "no-model"), "--device", device, *output])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_eval_refuses_adapters_and_reports_on_another_base_model(tiny_model, adapter, tmp_path, capsys):
    """An adapter on another base model (same shape, other weights) was scored against the baselines of the first
    adapter's base, in one run or added to a report with --add-to: gains measured against a model it never ran on."""
    from tiny_models import tiny_llama_for
    from transformers_ccm.embedded import load_tokenizer

    other_base = tmp_path / "other-base"
    tokenizer = load_tokenizer("default")
    tiny_llama_for(tokenizer, seed=1).save_pretrained(other_base)
    tokenizer.save_pretrained(other_base)
    other = tmp_path / "other"
    shutil.copytree(adapter, other, ignore=shutil.ignore_patterns("checkpoint-*"))
    config = json.loads((other / "ccm_config.json").read_text())
    (other / "ccm_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(other_base)}))
    (other / "ccm_manifest.json").unlink()  # edited on purpose: the manifest no longer records the files
    scoring = ["eval", "--tasks", "icl", "--steps", "1", "--samples", "2"]
    with pytest.raises(SystemExit) as exit_info:
        main([*scoring, "--adapters", adapter, str(other), "--output-dir", str(tmp_path / "both")])
    assert exit_info.value.code == 2 and f"[{str(other)!r}] run on another base model" in capsys.readouterr().err
    full_context = tmp_path / "full-context"
    CCMForCausalLM.from_base(str(other_base), CCMConfig(conditional_lora=False)).save_pretrained(full_context)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *scoring,
                "--adapters",
                adapter,
                "--full-context-adapter",
                str(full_context),
                "--output-dir",
                str(tmp_path / "both"),
            ]
        )
    assert exit_info.value.code == 2 and "runs on another base model than --adapters" in capsys.readouterr().err
    assert not (tmp_path / "both").exists()

    main([*scoring, "--model", tiny_model, "--adapters", adapter, "--output-dir", str(tmp_path / "report")])
    rows = json.loads((tmp_path / "report" / "eval.json").read_text())["results"]
    older = tmp_path / "older"  # a report written before rows carried their digests
    older.mkdir()
    stripped = [{k: v for k, v in row.items() if k not in ("samples_digest", "base_fingerprint")} for row in rows]
    (older / "eval.json").write_text(json.dumps({"results": stripped}))
    capsys.readouterr()
    adding = ["eval", "--model", str(other_base), "--adapters", str(other), "--output-dir", str(tmp_path / "added")]
    for report, message in (("report", "its baselines were scored on another base model"), (older, "drawn again")):
        with pytest.raises(SystemExit) as exit_info:
            main([*adding, "--add-to", str(tmp_path / report)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "added").exists()


def test_a_report_whose_plot_fails_keeps_every_file_of_the_earlier_report(
    tiny_model, adapter, tmp_path, monkeypatch, capsys
):
    """The files of a report were replaced one after another: a plot that failed (matplotlib missing, a full disk)
    left the new eval.json (or stream_eval.json) beside the earlier report's table and plot."""
    from matplotlib.figure import Figure

    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    report = tmp_path / "report"
    scoring = ["eval", "--model", tiny_model, "--output-dir", str(report), "--adapters"]
    main([*scoring, adapter, "--tasks", "icl", "--steps", "1", "--samples", "2"])
    streams = tmp_path / "streams"
    stream_eval(tiny_model, adapter, streams, "--tokens", "40")
    before = {path: path.read_bytes() for folder in (report, streams) for path in folder.iterdir()}

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with refused_by_the_system(capsys, "No space left"):
        main([*scoring, str(copy), "--add-to", str(report)])
    with refused_by_the_system(capsys, "No space left"):
        stream_eval(tiny_model, adapter, streams, "--tokens", "60")
    assert {path: path.read_bytes() for folder in (report, streams) for path in folder.iterdir()} == before
    capsys.readouterr()


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--adapters", "no-adapter", "--tasks", "icl", "--steps", "1", "--samples", "1"],
        ["stream-eval", "--adapter", "no-adapter"],
    ],
)
def test_eval_without_matplotlib_fails_before_the_model_loads(tmp_path, monkeypatch, command):
    """The plot, drawn last, found matplotlib missing only once every model had run (hours at t = 16)."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it fails, as where it is missing
    with pytest.raises(ImportError, match="Plotting needs the package 'matplotlib'"):
        main([command[0], "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "out"), *command[1:]])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("encoding", "typed", "byte"),
    [("utf-8", "café".encode("latin-1"), "0xe9"), ("ascii", "café".encode(), "0xc3")],  # PYTHONIOENCODING=ascii
)
def test_chat_goes_on_after_a_line_not_in_the_inputs_encoding(
    tiny_model, adapter, tmp_path, monkeypatch, capsys, encoding, typed, byte
):
    """Bytes that are not UTF-8 on the input ended the whole chat with "ccm chat: error: 'utf-8' codec can't
    decode byte 0xff" (before the lines around them were answered); that line is refused, and the others answered.
    The refusal names the input's encoding: under PYTHONIOENCODING=ascii, it told to type UTF-8 text again, which is
    what the terminal had sent."""
    memory = tmp_path / "user.safetensors"
    arguments = ["chat", "--model", tiny_model, "--adapter", adapter, "--memory-file", str(memory)]
    lines = b"Hi, I am Ann.\n" + typed + b" au lait\nWhat is my name?\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(lines), encoding=encoding))
    main([*arguments, "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert captured.out.count("assistant:") == 2 and "[memory: 4 slots" in captured.out
    assert f"that message was not answered (byte {byte} at character 3 is not {encoding} text" in captured.err


def test_ctrl_c_during_a_reply_undoes_the_turn_and_the_chat_goes_on(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    """Ctrl-C while a reply was being written (a long one, say) ended `ccm chat` with a traceback; the turn is undone,
    and the chat goes on as if the interrupted message had never been typed."""
    from transformers_ccm.chat import ChatSession

    reply = ChatSession._reply

    def interrupted_at_stop(self, input_ids, model, cache):
        result = reply(self, input_ids, model, cache)  # the reply is in the memory as a turn not yet folded
        if "Stop" in self.tokenizer.decode(input_ids):
            raise KeyboardInterrupt
        return result

    clean, interrupted = tmp_path / "clean.safetensors", tmp_path / "interrupted.safetensors"
    arguments = ["chat", "--model", tiny_model, "--adapter", adapter, "--max-new-tokens", "3", "--memory-file"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ann.\nWhat is my name?\n"))
    main([*arguments, str(clean)])
    expected = capsys.readouterr().out
    monkeypatch.setattr(ChatSession, "_reply", interrupted_at_stop)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ann.\nStop writing.\nWhat is my name?\n"))
    main([*arguments, str(interrupted)])
    captured = capsys.readouterr()
    assert captured.out == expected.replace(str(clean), str(interrupted))
    assert "ccm chat: interrupted; that message was not answered; the memory is as it was." in captured.err
    assert interrupted.read_bytes() == clean.read_bytes()


def test_ctrl_c_while_waiting_for_a_message_ends_the_chat_quietly(tiny_model, adapter, tmp_path, monkeypatch, capsys):
    """Ctrl-C while `ccm chat` waited for a message ended it with a traceback; it ends with a line that says so and
    the exit status of an interrupt, the memory file holding the answered turns."""
    memory = tmp_path / "user.safetensors"

    def typed():
        yield "Hi, I am Ann.\n"
        raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", typed())
    arguments = ["--adapter", adapter, "--max-new-tokens", "2", "--memory-file", str(memory)]
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--model", tiny_model, *arguments])
    captured = capsys.readouterr()
    assert exit_info.value.code == 130 and captured.err.splitlines()[-1] == "ccm chat: interrupted"
    assert captured.out.count("assistant:") == 1 and "[memory: 2 slots" in captured.out and memory.is_file()


@pytest.mark.parametrize("command", ["chat", "demo"])
def test_a_character_the_output_cannot_encode_is_written_escaped(tiny_model, adapter, tmp_path, monkeypatch, command):
    """On an output whose encoding lacks a character (a Windows code page, a pipe under PYTHONIOENCODING=ascii), a
    message or reply with it ended the conversation with "'ascii' codec can't encode character": `ccm chat` after the
    turn was folded and before the memory file was saved. The character is written escaped, and the chat goes on."""
    shown = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", shown)
    arguments = ["--model", tiny_model, "--adapter", adapter, "--max-new-tokens", "2"]
    if command == "chat":
        monkeypatch.setattr("sys.stdin", io.StringIO("Je suis Zoé.\nWhat is my name?\n"))
        arguments += ["--memory-file", str(tmp_path / "user.safetensors")]
    else:
        monkeypatch.setattr("transformers_ccm.cli.DEMO_FACTS", {"name": "Zoé", "job": "astronomer", "friend": "Zoë"})
        arguments += ["--turns", "2"]
    main([command, *arguments])
    shown.flush()
    out = shown.buffer.getvalue().decode("ascii")
    assert "I'm Zo\\xe9" in out or "suis Zo\\xe9." in out
    assert out.count("assistant:") == 2 and "[memory: 4 slots" in out


@pytest.mark.parametrize("command", ["demo", "eval"])
def test_output_into_a_closed_pipe_ends_quietly_with_status_1(
    tiny_model, adapter, tmp_path, monkeypatch, capsys, command
):
    """`ccm demo | head -2`: the reader gone, the next line written ended the command with a BrokenPipeError traceback
    (and Python's "Exception ignored" at exit). It ends quietly with status 1, as Python documents for SIGPIPE, and
    `ccm eval` leaves its earlier report as it was."""
    report = tmp_path / "report"
    arguments = ["--model", tiny_model, "--max-new-tokens", "2"] if command == "demo" else ["--model", tiny_model]
    if command == "eval":
        arguments = [*arguments, "--adapters", adapter, "--tasks", "icl", "--steps", "1", "--samples", "2"]
        main(["eval", *arguments, "--output-dir", str(report)])
        arguments += ["--output-dir", str(report), "--seed", "1"]
    else:
        arguments += ["--adapter", adapter]
    before = _contents(report) if command == "eval" else None
    read, write = os.pipe()
    os.close(read)  # as `head` does once it has its lines
    closed = io.TextIOWrapper(io.FileIO(write, "w"), encoding="utf-8")
    monkeypatch.setattr("sys.stdout", closed)
    with pytest.raises(SystemExit) as exit_info:
        main([command, *arguments])
    assert exit_info.value.code == 1 and "Traceback" not in capsys.readouterr().err
    closed.write("what is left at exit\n")
    closed.flush()  # as Python does at exit: it no longer fails
    assert (_contents(report) if command == "eval" else None) == before


def _contents(folder):
    return {path.name: path.read_bytes() for path in Path(folder).iterdir()}
