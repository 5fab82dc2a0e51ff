"""Run by tests/test_distributed.py under torchrun: train a tiny adapter on every process, then report, per
rank, a hash of the adapter it holds, every folder it wrote an adapter to, whether the final adapter was on disk
when `train` returned, and the loss of the final evaluation (on `EVAL_SAMPLES`, the same on every process); then
close the process group, as a torchrun script must."""

from __future__ import annotations

import json
import os
import random
import sys

import torch

from tiny_models import tiny_base
from transformers_ccm import CCMConfig, CCMForCausalLM, OnlineSample
from transformers_ccm.identity import adapter_digest
from transformers_ccm.training import TrainingRecipe, train

# One label each, so that every process's batch of two holds as many labels as the other's.
EVAL_SAMPLES = [OnlineSample([[11 + i, 41 + i], [12 + i, 42 + i]], [5, 6], [43 + i]) for i in range(4)]


def main(output: str, report: str, gradient_checkpointing: bool) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0))
    written: list[str] = []
    save = model.save_pretrained
    model.save_pretrained = lambda folder: (written.append(os.fspath(folder)), save(folder))[1]
    rng = random.Random(rank)  # each process sees other samples; DDP must still keep the weights equal
    samples = [
        OnlineSample([[rng.randrange(3, 90) for _ in range(3)] for _ in range(2)], [5, 6], [rng.randrange(3, 90)])
        for _ in range(16)
    ]
    recipe = TrainingRecipe(
        steps=4, batch_size=2, save_every=2, eval_every=4, gradient_checkpointing=gradient_checkpointing
    )
    trainer = train(model, None, samples, EVAL_SAMPLES, output, recipe)
    adapter_on_disk = os.path.exists(os.path.join(output, "adapter_config.json"))
    tensors = sorted((name, tensor.detach()) for name, tensor in model.adapter_tensors().items())
    world = torch.distributed.get_world_size()
    torch.distributed.destroy_process_group()
    report_row = {
        "adapter": adapter_digest(tensors),
        "written": written,
        "world_size": world,
        "on_disk": adapter_on_disk,
        "eval_loss": [row["eval_loss"] for row in trainer.state.log_history if "eval_loss" in row],
    }
    with open(os.path.join(report, f"rank{rank}.json"), "w") as file:
        json.dump(report_row, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "checkpointing")
