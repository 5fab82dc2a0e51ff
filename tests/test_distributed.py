"""Multi-process training: two CPU processes (gloo) under torchrun keep identical adapters, and only the main
process writes files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed_training import EVAL_SAMPLES
from tiny_models import tiny_base, tiny_llama_for
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.identity import adapter_digest
from transformers_ccm.training import train

TESTS = Path(__file__).parent


def _torchrun(*arguments: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGUMENTS` on CPU (gloo), with the tests and the package importable."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "src")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *arguments]
    result = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("mode", ["plain", "checkpointing"])
def test_two_processes_train_one_adapter_and_only_the_main_one_writes(tmp_path, mode):
    output, report = tmp_path / "adapter", tmp_path / "report"
    report.mkdir()
    _torchrun(str(TESTS / "distributed_training.py"), str(output), str(report), mode)
    ranks = [json.loads((report / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert ranks[0]["adapter"] == ranks[1]["adapter"]  # though each process saw other samples
    assert ranks[1]["written"] == []
    assert [rank["on_disk"] for rank in ranks] == [True, True]  # no process returns before the adapter is written
    assert str(output) in ranks[0]["written"] and any("checkpoint-" in folder for folder in ranks[0]["written"])

    saved = CCMForCausalLM.from_pretrained(output, base_model=tiny_base("llama"))
    tensors = sorted((name, tensor.detach()) for name, tensor in saved.adapter_tensors().items())
    assert adapter_digest(tensors) == ranks[0]["adapter"]
    halfway = CCMForCausalLM.from_pretrained(output / "checkpoint-2", base_model=tiny_base("llama"))
    assert not torch.equal(saved.comp_embeddings, halfway.comp_embeddings)  # it trained
    # The loss of every process's share of the labels, over the labels of both, was not multiplied back by the
    # number of processes: the logged losses and the gradients came out halved.
    with torch.no_grad():
        expected = saved.eval()(**CCMDataCollator(saved)(EVAL_SAMPLES)).loss.item()
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"] == [pytest.approx(expected, rel=1e-5)]


def test_ccm_train_under_torchrun_ends_cleanly_on_every_process(tmp_path):
    """The command as docs/training.md launches it: both processes exit 0 (the process group is closed before
    exit), and the one that writes the adapter says where it went."""
    tokenizer = load_tokenizer("default")
    tiny_llama_for(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    output = tmp_path / "adapter"
    training = ["--task", "icl", "--steps", "2", "--batch-size", "2", "--eval-every", "2", "--eval-samples", "2"]
    model = ["--model", str(tmp_path / "model"), "--output-dir", str(output)]
    result = _torchrun("-m", "transformers_ccm.cli", "train", *model, *training)
    assert result.stdout.count(f"adapter saved to {output}") == 1
    assert CCMForCausalLM.from_pretrained(output, base_model=tiny_llama_for(tokenizer)).config.update == "concat"


@pytest.mark.parametrize("engine", ["FSDP", "DEEPSPEED"])
def test_sharded_launches_are_refused_before_any_work(tmp_path, monkeypatch, engine):
    monkeypatch.setenv(f"ACCELERATE_USE_{engine}", "true")
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig())
    with pytest.raises(ValueError, match=rf"runs with DDP, not {engine}.*torchrun --nproc_per_node"):
        train(model, None, [OnlineSample([[5, 6]], [7], [8])], None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
