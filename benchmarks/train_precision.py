"""Training precision on CPU: the training step of `train()` on the embedded model, in fp32 and under bf16
autocast (`TrainingRecipe(precision="bf16")`, `ccm train --precision bf16`), without and with distillation.

Two copies of the model with the same fresh adapter train side by side on the same batches of the built-in
"mixture" task (through `CCMDataCollator`), one step of each in turn (the order alternating from step to step),
so that a slow spell of a shared machine hits both alike. A step is what `CCMTrainer` runs: the forward with
the LM head at the labels, under bf16 the same autocast accelerate puts around it (the distillation teacher,
here the base model, too), the backward, gradient clipping at 1 and AdamW (fp32 weights and optimizer state
either way). Prints seconds per step of each (wall-clock and this process's CPU time), their ratio (taken within
each step, then the median over steps) and the loss of every step of both.

    python -m benchmarks.train_precision --steps 3 --batch-size 8
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import Timing
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM
from transformers_ccm.data import predicting_positions
from transformers_ccm.distillation import distillation_loss
from transformers_ccm.embedded import DEFAULT_MODEL, load_tokenizer
from transformers_ccm.tasks import make_samples
from transformers_ccm.training import Precision, cpu_has_bf16

COMPARED: tuple[Precision, ...] = ("fp32", "bf16")


def train_step(
    model: CCMForCausalLM,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    precision: Precision,
    distill_weight: float,
) -> float:
    """One optimisation step as `CCMTrainer` runs it; returns the loss."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        outputs = model(**batch, logits_at_labels=True)
        loss = outputs.loss.float()
        if distill_weight:
            positions = predicting_positions(batch["labels"])
            loss = loss + distill_weight * distillation_loss(model, batch, outputs.logits.float(), 1.0, positions)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(model_name: str, steps: int, batch_size: int, distill_weights: Sequence[float], seed: int) -> dict[str, Any]:
    """Per distillation weight: `steps` steps of an fp32 and a bf16 copy of the same fresh adapter, side by side."""
    tokenizer = load_tokenizer(model_name)
    samples = make_samples("mixture", "train", steps * batch_size, seed=seed)
    rows = []
    for distill_weight in distill_weights:
        models, optimizers = {}, {}
        for precision in COMPARED:
            torch.manual_seed(seed)  # the same <COMP> initialisation in both copies
            models[precision] = CCMForCausalLM.from_base(model_name, CCMConfig()).train()
            trainable = [p for p in models[precision].parameters() if p.requires_grad]
            optimizers[precision] = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
        collate = CCMDataCollator(models["fp32"], tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
        record: dict[str, dict[str, list[float]]] = {
            p: {"seconds": [], "cpu_seconds": [], "loss": []} for p in COMPARED
        }
        shapes = []
        for step in range(steps):
            batch = collate(samples[step * batch_size : (step + 1) * batch_size])
            shapes.append(list(batch["input_ids"].shape))
            for precision in COMPARED if step % 2 == 0 else COMPARED[::-1]:
                torch.manual_seed(seed + step)  # the same LoRA dropout in both copies
                wall, cpu = time.perf_counter(), time.process_time()
                loss = train_step(models[precision], optimizers[precision], batch, precision, distill_weight)
                record[precision]["seconds"].append(time.perf_counter() - wall)
                record[precision]["cpu_seconds"].append(time.process_time() - cpu)
                record[precision]["loss"].append(loss)
        del models, optimizers
        gc.collect()
        wall = {p: Timing(tuple(record[p]["seconds"])) for p in COMPARED}
        cpu = {p: Timing(tuple(record[p]["cpu_seconds"])) for p in COMPARED}
        rows.append(
            {
                "distill_weight": distill_weight,
                "shapes": shapes,
                "fp32_s_per_step": wall["fp32"].median,
                "bf16_s_per_step": wall["bf16"].median,
                "fp32_over_bf16": wall["fp32"].ratio_to(wall["bf16"]),
                "fp32_cpu_s_per_step": cpu["fp32"].median,
                "bf16_cpu_s_per_step": cpu["bf16"].median,
                "fp32_over_bf16_cpu": cpu["fp32"].ratio_to(cpu["bf16"]),
                **record,
            }
        )
    return {"steps": steps, "batch_size": batch_size, "rows": rows}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model name or path (default: the embedded one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--distill-weights", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_has_bf16():
        raise SystemExit("This CPU has no bf16 instructions (AVX512-BF16/AMX): train in fp32 there.")
    capabilities = torch.cpu.get_capabilities()
    machine = capabilities.get("cpu_name") or platform.processor() or platform.machine()
    print(
        f"{args.model}: {args.steps} steps of batch {args.batch_size} ('mixture' samples) per precision, "
        f"{torch.get_num_threads()} threads, {machine} (avx512_bf16 {capabilities.get('avx512_bf16')}, "
        f"amx_bf16 {capabilities.get('amx_bf16')}), torch {torch.__version__}",
        flush=True,
    )
    report = run(args.model, args.steps, args.batch_size, args.distill_weights, args.seed)
    report["machine"] = machine
    report["torch_threads"] = torch.get_num_threads()
    for row in report["rows"]:
        print(
            f"distill-weight {row['distill_weight']:g}: fp32 {row['fp32_s_per_step']:.2f} s/step  "
            f"bf16 {row['bf16_s_per_step']:.2f} s/step  fp32/bf16 {row['fp32_over_bf16']:.2f}x  (CPU time: fp32 "
            f"{row['fp32_cpu_s_per_step']:.2f} s/step, bf16 {row['bf16_cpu_s_per_step']:.2f} s/step, "
            f"fp32/bf16 {row['fp32_over_bf16_cpu']:.2f}x)"
        )
        fp32, bf16 = row["fp32"], row["bf16"]
        per_step = zip(row["shapes"], fp32["seconds"], fp32["loss"], bf16["seconds"], bf16["loss"], strict=True)
        for step, (shape, fp32_s, fp32_loss, bf16_s, bf16_loss) in enumerate(per_step, 1):
            print(
                f"  step {step} {tuple(shape)}: fp32 {fp32_s:6.2f} s loss {fp32_loss:.4f} | "
                f"bf16 {bf16_s:6.2f} s loss {bf16_loss:.4f} | loss difference {bf16_loss - fp32_loss:+.4f}"
            )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
