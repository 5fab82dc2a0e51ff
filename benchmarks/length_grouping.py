"""Length-grouped batches: `train()` on the same samples of a mixed task, batches drawn shuffled
(`TrainingRecipe(group_by_length=False)`) and length-grouped (the default), one run after the other from the
same fresh adapter. Prints the seconds per sample of each and their ratio, the positions each computes per
real token (padding included, in one more draw of each sampler over at least 100 batches of the task), the
mean training loss of both and, with `--eval-samples`, the loss each ends with on held-out samples.

    python -m benchmarks.length_grouping --steps 8 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM
from transformers_ccm.embedded import DEFAULT_MODEL, load_tokenizer
from transformers_ccm.tasks import make_samples
from transformers_ccm.training import GPU_PAD_MULTIPLE, Precision, SimilarLengthSampler, TrainingRecipe, train

MIXTURE = "people:3,icl:2,personalization:3,dialogue:2,chat:3"


def padded_positions(lengths: Sequence[int], batch_size: int, grouped: bool, multiple: int | None) -> int:
    """The positions one pass over samples of `lengths` computes, padding included, in batches drawn as
    `train()` draws them: shuffled, or by `SimilarLengthSampler`."""
    indices = (
        list(SimilarLengthSampler(lengths, batch_size, seed=0)) if grouped else torch.randperm(len(lengths)).tolist()
    )
    total = 0
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        longest = max(lengths[index] for index in batch)
        total += len(batch) * (-(-longest // multiple) * multiple if multiple else longest)
    return total


def run(
    model_name: str,
    task: str,
    steps: int,
    batch_size: int,
    precision: Precision,
    distill_weight: float,
    seed: int,
    eval_samples: int = 0,
) -> dict[str, Any]:
    """Both runs on `steps * batch_size` samples of `task`, each from the same fresh adapter; with `eval_samples`,
    each ends with the loss on that many held-out samples of the task."""
    tokenizer = load_tokenizer(model_name)
    samples = make_samples(task, "train", steps * batch_size, seed=seed)
    held_out = make_samples(task, "test", eval_samples, seed=seed) if eval_samples else None
    # Padding is counted over at least 100 batches: a long run draws from many groups of 50 batches.
    drawn = samples + make_samples(task, "train", max(0, 100 - steps) * batch_size, seed=seed + 1)
    collator = CCMDataCollator(CCMConfig(), tokenizer=tokenizer)
    lengths = [collator.sequence_length(sample) for sample in collator.tokenized(drawn)]
    multiple = GPU_PAD_MULTIPLE if torch.cuda.is_available() else None  # what `train()` pads to by default
    rows = {}
    for grouped in (False, True):
        torch.manual_seed(seed)
        model = CCMForCausalLM.from_base(model_name, CCMConfig())
        recipe = TrainingRecipe(
            steps=steps,
            batch_size=batch_size,
            save_every=steps,
            eval_every=steps,
            log_every=1,
            seed=seed,
            precision=precision,
            distill_weight=distill_weight,
            group_by_length=grouped,
        )
        with tempfile.TemporaryDirectory() as output_dir:
            history = train(model, tokenizer, samples, held_out, output_dir, recipe).state.log_history
        # The Trainer's runtime includes the held-out evaluation, which both runs share.
        evaluation = sum(entry["eval_runtime"] for entry in history if "eval_runtime" in entry)
        runtime = next(entry["train_runtime"] for entry in history if "train_runtime" in entry) - evaluation
        rows["grouped" if grouped else "shuffled"] = {
            "seconds_per_sample": runtime / len(samples),
            "positions_per_token": padded_positions(lengths, batch_size, grouped, multiple) / sum(lengths),
            "loss": [entry["loss"] for entry in history if "loss" in entry],
            "eval_loss": next((entry["eval_loss"] for entry in history if "eval_loss" in entry), None),
        }
    shuffled, grouped_row = rows["shuffled"], rows["grouped"]
    return {
        "task": task,
        "steps": steps,
        "batch_size": batch_size,
        "precision": precision,
        "distill_weight": distill_weight,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        **rows,
        "speedup": shuffled["seconds_per_sample"] / grouped_row["seconds_per_sample"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model name or path (default: the embedded one)")
    parser.add_argument("--task", default=MIXTURE, help="a built-in task or weighted mixture")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--distill-weight", type=float, default=1.0, help="distillation from the base model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=0, help="end each run with the loss on held-out samples")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    report = run(
        args.model,
        args.task,
        args.steps,
        args.batch_size,
        args.precision,
        args.distill_weight,
        args.seed,
        args.eval_samples,
    )
    print(
        f"{args.model} on {report['device']}, {args.steps} steps of batch {args.batch_size} of '{args.task}', "
        f"precision {args.precision}, distill-weight {args.distill_weight:g}, torch {torch.__version__}"
    )
    for name in ("shuffled", "grouped"):
        row = report[name]
        losses = sum(row["loss"]) / len(row["loss"])
        print(
            f"  {name:8s} {row['seconds_per_sample']:.3f} s/sample, {row['positions_per_token']:.2f} positions per "
            f"token; mean training loss {losses:.4f}"
            + ("" if row["eval_loss"] is None else f"; held-out loss {row['eval_loss']:.4f}")
        )
    print(f"  shuffled / grouped: {report['speedup']:.2f}x time per sample")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
