"""`python -m benchmarks`: run the benchmarks side by side, print the tables, and write `benchmarks.json`, one
plot per benchmark and `summary.md` under `--output-dir`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers

from benchmarks import latency, memory, overhead, throughput, training_speed
from benchmarks.profiling import profile_training, profile_turn
from benchmarks.report import markdown, plot, print_tables, tables, targets
from benchmarks.workload import Subject, Workload, load_subject
from transformers_ccm.embedded import DEFAULT_MODEL


@dataclass(frozen=True)
class Settings:
    """How much each benchmark measures."""

    memory_steps: int = 64
    latency_steps: tuple[int, ...] = (1, 4, 16, 64)
    throughput_step: int = 16
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    training_steps: tuple[int, ...] = (4, 16)
    training_batch: int = 1
    overhead_step: int = 16
    kv_budget_mib: float = 128.0
    rounds: int = 3
    min_run_time: float = 0.05


QUICK = Settings(
    memory_steps=8,
    latency_steps=(1, 4),
    throughput_step=4,
    batch_sizes=(1, 2),
    training_steps=(2, 4),
    training_batch=2,
    overhead_step=4,
    kv_budget_mib=1.0,
    rounds=2,
    min_run_time=0.01,
)

Runner = Callable[[Subject, Workload, Settings, argparse.Namespace], dict[str, Any]]
RUNNERS: dict[str, Runner] = {
    "memory": lambda subject, workload, s, args: memory.run(subject, workload, s.memory_steps),
    "latency": lambda subject, workload, s, args: latency.run(
        subject, workload, s.latency_steps, ("dialogue", "context"), s.rounds, s.min_run_time
    ),
    "throughput": lambda subject, workload, s, args: throughput.run(
        subject,
        workload,
        s.throughput_step,
        s.batch_sizes,
        int((args.kv_budget_mib or s.kv_budget_mib) * 2**20),
        s.rounds,
        s.min_run_time,
    ),
    "training": lambda subject, workload, s, args: training_speed.run(
        subject, workload, s.training_steps, s.training_batch, s.rounds, s.min_run_time
    ),
    "overhead": lambda subject, workload, s, args: overhead.run(
        subject, workload, s.overhead_step, s.rounds, s.min_run_time
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'default' (SmolLM2-135M-Instruct, embedded), a path or Hub id, or a config.json (random weights)",
    )
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=None,
        help="CCM adapters (folder, Hub id or ccm:<name>); default: the shipped ones for the default model, "
        "fresh concat and merge adapters for any other",
    )
    parser.add_argument("--benchmarks", nargs="+", choices=list(RUNNERS), default=list(RUNNERS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: few time steps, small batches, 2 rounds")
    parser.add_argument(
        "--kv-budget-mib", type=float, default=None, help="KV budget for the largest batch (default: 128, quick: 1)"
    )
    parser.add_argument("--context-tokens", type=int, default=Workload.context_tokens)
    parser.add_argument("--input-tokens", type=int, default=Workload.input_tokens)
    parser.add_argument("--new-tokens", type=int, default=Workload.new_tokens)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output-dir", default="docs/performance")
    return parser


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            cpu = next((line.split(":", 1)[1].strip() for line in file if line.startswith("model name")), cpu)
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def profiles(subject: Subject, workload: Workload, settings: Settings, found: list[dict[str, Any]]) -> list[Any]:
    """Where the time goes in the first missed latency target and the first missed training target."""
    missed = [t for t in found if not t["met"] and "method" in t]
    latency_miss = next((t for t in missed if "kind" in t), None)
    training_miss = next((t for t in missed if "training" in t), None)
    result = []
    if latency_miss:
        result.append(
            profile_turn(subject, workload, latency_miss["method"], latency_miss["step"], latency_miss["kind"])
        )
    if training_miss:
        result.append(
            profile_training(subject, workload, training_miss["method"], training_miss["step"], settings.training_batch)
        )
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    settings = QUICK if args.quick else Settings()
    workload = Workload(args.context_tokens, args.input_tokens, args.new_tokens)
    results: dict[str, Any] = {
        "machine": machine(),
        "command": shlex.join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)]),
        "settings": asdict(settings),
        "workload": asdict(workload),
    }
    subject = load_subject(args.model, args.adapters)
    results["model"] = subject.name
    results["num_comp_tokens"] = {name: model.config.num_comp_tokens for name, model in subject.ccm.items()}
    for name in args.benchmarks:
        started = time.perf_counter()
        results[name] = RUNNERS[name](subject, workload, settings, args)
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    results["targets"] = targets(results)
    results["profiles"] = profiles(subject, workload, settings, results["targets"])
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "benchmarks.json"), "w", encoding="utf-8") as file:
        json.dump(results, file, indent=1)
    found = tables(results)
    images = plot(results, args.output_dir)
    with open(os.path.join(args.output_dir, "summary.md"), "w", encoding="utf-8") as file:
        file.write(markdown(results, found, images))
    print_tables(found)
    print(f"wrote benchmarks.json, summary.md and {', '.join(images)} to {args.output_dir}")
    return results


if __name__ == "__main__":
    main()
