"""Tables, targets, plots and the Markdown summary of a benchmark run (its JSON results)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.workload import FULL_CONTEXT
from transformers_ccm.extras import figure

TARGET_STEP = 16


@dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |", "|" + " --- |" * len(self.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def mib(count: float) -> str:
    return f"{count / 2**20:.2f}"


def _at(steps: list[int]) -> int:
    """The time step targets are read at: 16, or the largest measured below it (short runs)."""
    return TARGET_STEP if TARGET_STEP in steps else max(s for s in steps if s <= TARGET_STEP)


# ----- targets --------------------------------------------------------------------------------------------
def _target(name: str, measured: str, met: bool, **where: Any) -> dict[str, Any]:
    return {"target": name, "measured": measured, "met": met, **where}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it is met."""
    found = []
    if "latency" in results:
        rows = results["latency"]["rows"]
        steps = sorted({row["step"] for row in rows})
        at = _at(steps)
        for kind in dict.fromkeys(row["kind"] for row in rows):
            ratio = {(r["method"], r["step"]): r["ratio_to_no_context"] for r in rows if r["kind"] == kind}
            for method, limit in (("ccm-merge", 1.1), ("ccm-concat", 1.3)):
                if (method, at) in ratio:
                    value = ratio[method, at]
                    found.append(
                        _target(
                            f"{method} latency at t={at} ({kind} turn) <= {limit}x no context",
                            f"{value:.2f}x",
                            value <= limit,
                            method=method,
                            step=at,
                            kind=kind,
                        )
                    )
            full = [ratio[FULL_CONTEXT, step] for step in steps]
            found.append(
                _target(
                    f"full-context latency ratio grows with t ({kind} turn)",
                    " → ".join(f"{value:.2f}x" for value in full),
                    full[-1] > full[0],
                )
            )
    if "memory" in results:
        memory = results["memory"]
        at = memory["ratio_step"]
        for method, limit in (("ccm-concat", 1 / 5), ("ccm-merge", 1 / 20)):
            if method in memory["ratio_to_full"]:
                value = memory["ratio_to_full"][method]
                found.append(
                    _target(
                        f"{method} KV memory at t={at} <= 1/{round(1 / limit)} of full context",
                        f"{value:.4f}",
                        value <= limit,
                    )
                )
    if "training" in results:
        rows = results["training"]["rows"]
        at = _at(sorted({row["step"] for row in rows}))
        for row in rows:
            if row["step"] == at:
                found.append(
                    _target(
                        f"{row['method']} parallel training >= 5x recurrent samples/s at t={at}",
                        f"{row['speedup']:.2f}x",
                        row["speedup"] >= 5,
                        method=row["method"],
                        step=at,
                        training=True,
                    )
                )
    return found


# ----- tables ---------------------------------------------------------------------------------------------
def _memory_tables(memory: dict[str, Any]) -> list[Table]:
    steps = [s for s in (1, 4, 16, 64) if s in memory["steps"]]
    rows = [
        [
            method,
            *(mib(values[step - 1]) for step in steps),
            f"{memory['slope_slots'][method]:.2f}",
            str(memory["expected_slots_per_step"][method]),
            f"{memory['ratio_to_full'][method]:.4f}",
        ]
        for method, values in memory["bytes"].items()
    ]
    measured = Table(
        f"KV memory held (MiB), measured; one slot = {memory['bytes_per_slot'] / 1024:.1f} KiB",
        [
            "method",
            *(f"t={s}" for s in steps),
            "growth per step (slots, fitted)",
            "Table 3 growth",
            f"vs full at t={memory['ratio_step']}",
        ],
        rows,
    )
    llama = memory["llama_7b"]
    big = [s for s in (16, 64) if s in llama["steps"]]
    paper = Table(
        f"LLaMA-7B from its config (meta device, fp16, <COMP> length 8): {llama['bytes_per_slot'] / 2**20:.2f} MiB "
        "per slot",
        ["method", "KV length at t=16", "paper Table 1", *(f"MiB at t={s}" for s in big)],
        [
            [
                method,
                str(llama["kv_length_at_16"][method]),
                str(llama["paper_kv_length_at_16"][method]),
                *(mib(llama["bytes"][method][llama["steps"].index(s)]) for s in big),
            ]
            for method in llama["bytes"]
        ],
    )
    return [measured, paper]


def _latency_tables(latency: dict[str, Any]) -> list[Table]:
    rows = latency["rows"]
    steps = sorted({row["step"] for row in rows})
    tables = []
    for kind in dict.fromkeys(row["kind"] for row in rows):
        cell = {(r["method"], r["step"]): r for r in rows if r["kind"] == kind}
        methods = list(dict.fromkeys(r["method"] for r in rows if r["kind"] == kind))
        title = "a new context is compressed / appended" if kind == "context" else "the last turn is folded"
        tables.append(
            Table(
                f"Latency per turn ({kind}: {title}, then {latency['new_tokens']} tokens generated): median seconds "
                "(ratio to no context)",
                ["method", *(f"t={s}" for s in steps)],
                [
                    [
                        method,
                        *(
                            f"{cell[method, s]['seconds']:.3f} ({cell[method, s]['ratio_to_no_context']:.2f}x)"
                            for s in steps
                        ),
                    ]
                    for method in methods
                ],
            )
        )
    return tables


def _throughput_tables(throughput: dict[str, Any]) -> list[Table]:
    rows = throughput["rows"]
    labels = list(dict.fromkeys(row["batch"] for row in rows))
    cell = {(r["method"], r["batch"]): r for r in rows}
    methods = list(dict.fromkeys(row["method"] for row in rows))
    budget = throughput["kv_budget"]
    speed = Table(
        f"Throughput at t={throughput['step']}: samples/s (vs full context at the same batch; largest batch for a "
        f"{mib(budget)} MiB KV budget)",
        ["method", *(f"batch {label}" for label in labels)],
        [
            [
                method,
                *(
                    f"{cell[method, label]['samples_per_second']:.2f} ({cell[method, label]['vs_full_context']:.1f}x)"
                    + (f", B={cell[method, label]['batch_size']}" if label == "largest" else "")
                    for label in labels
                ),
            ]
            for method in methods
        ],
    )
    check = Table(
        "Largest batch for the KV budget, verified by running it",
        ["method", "peak KV per user (MiB)", "largest batch B", "measured peak at B (MiB)", "(B+1) users (MiB)"],
        [
            [
                method,
                mib(per_user),
                str(throughput["largest_batch"][method]),
                mib(throughput["largest_batch_peak_bytes"][method]),
                mib((throughput["largest_batch"][method] + 1) * per_user),
            ]
            for method, per_user in throughput["peak_bytes_per_user"].items()
        ],
    )
    return [speed, check]


def _training_tables(training: dict[str, Any]) -> list[Table]:
    return [
        Table(
            f"Training speed, forward+backward, batch {training['batch_size']}: samples/s",
            ["method", "t", "tokens", "parallel", "recurrent", "speed-up", "labels-only head", "|loss difference|"],
            [
                [
                    r["method"],
                    str(r["step"]),
                    str(r["sequence_tokens"]),
                    f"{r['parallel_samples_per_second']:.2f}",
                    f"{r['recurrent_samples_per_second']:.2f}",
                    f"{r['speedup']:.2f}x",
                    f"{r['labels_only_speedup']:.2f}x ({r['labels_only_over_recurrent']:.2f}x)",
                    f"{abs(r['parallel_loss'] - r['recurrent_loss']):.1e}",
                ]
                for r in training["rows"]
            ],
        )
    ]


def _flops_rows(rows: list[dict[str, Any]], paper: dict[int, int] | None) -> list[list[str]]:
    return [
        [
            r.get("method", "LLaMA-7B"),
            str(r["num_comp_tokens"]),
            f"{r['compression_factor']:.1f}x",
            f"{r['overhead_flops'] / 1e9:.2f}",
            f"{r['saved_flops_per_token'] / 1e6:.2f}",
            str(r["threshold_tokens"]),
            str(paper[r["num_comp_tokens"]]) if paper else "",
        ]
        for r in rows
    ]


def _overhead_tables(overhead: dict[str, Any]) -> list[Table]:
    fold = Table(
        f"Folding a generated turn against re-encoding it (t={overhead['rows'][0]['step']})",
        ["method", "fold (ms)", "tokens run", "re-encode (ms)", "tokens run", "re-encode / fold"],
        [
            [
                r["method"],
                f"{r['fold_seconds'] * 1e3:.1f}",
                str(r["fold_tokens"]),
                f"{r['re_encode_seconds'] * 1e3:.1f}",
                str(r["re_encode_tokens"]),
                f"{r['re_encode_over_fold']:.2f}x",
            ]
            for r in overhead["rows"]
        ],
    )
    headers = [
        "model",
        "<COMP> length",
        "compression",
        "overhead (GFLOPs)",
        "saved per token (MFLOPs)",
        "threshold (tokens)",
    ]
    flops = Table(
        f"Table 16 FLOPs, this model (contexts of {overhead['context_tokens']} tokens)",
        headers,
        [row[:-1] for row in _flops_rows(overhead["flops"], None)],
    )
    paper = {int(n): value for n, value in overhead["paper_thresholds"].items()}
    llama = Table(
        "Table 16 FLOPs, LLaMA-7B (contexts of 50 tokens)",
        [*headers, "paper"],
        _flops_rows(overhead["llama_7b_flops"], paper),
    )
    return [fold, flops, llama]


TABLES: dict[str, Callable[[dict[str, Any]], list[Table]]] = {
    "memory": _memory_tables,
    "latency": _latency_tables,
    "throughput": _throughput_tables,
    "training": _training_tables,
    "overhead": _overhead_tables,
}


def tables(results: dict[str, Any]) -> list[Table]:
    """Every table of the run, the targets first."""
    found = [
        Table(
            "Targets",
            ["target", "measured", "met"],
            [[t["target"], t["measured"], "yes" if t["met"] else "**no**"] for t in results["targets"]],
        )
    ]
    for name, make in TABLES.items():
        if name in results:
            found += make(results[name])
    for profile in results.get("profiles", []):
        found += profile_tables(profile)
    return found


def profile_tables(profile: dict[str, Any]) -> list[Table]:
    focus, baseline, total = profile["focus"], profile["baseline"], profile["self_cpu_ms"]
    operators = Table(
        f"torch.profiler, {profile['title']}: top operators by self CPU time ({focus}: {total[focus]:.0f} ms, "
        f"{baseline}: {total[baseline]:.0f} ms in all)",
        ["operator", "self ms", "calls", f"{baseline} self ms", f"{baseline} calls"],
        [
            [
                r["operator"],
                f"{r['self_ms']:.1f}",
                str(r["calls"]),
                f"{r['baseline_self_ms']:.1f}",
                str(r["baseline_calls"]),
            ]
            for r in profile["operators"]
        ],
    )
    own = Table(
        f"cProfile, {profile['title']}: transformers-ccm functions by cumulative time "
        f"({focus}: {profile['cprofile_wall_ms']:.0f} ms under cProfile)",
        ["function", "calls", "cumulative ms"],
        [[r["function"], str(r["calls"]), f"{r['cumulative_ms']:.1f}"] for r in profile["own_functions"]],
    )
    return [operators, own]


def print_tables(found: list[Table]) -> None:
    """Print with rich when it is installed, else as plain Markdown."""
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        for table in found:
            print(table.markdown())
        return
    console = Console()
    for table in found:
        rich_table = RichTable(*table.headers, title=table.title, title_justify="left")
        for row in table.rows:
            rich_table.add_row(*(cell.replace("**", "") for cell in row))
        console.print(rich_table)


# ----- plots ----------------------------------------------------------------------------------------------
def plot(results: dict[str, Any], output_dir: str) -> list[str]:
    """One PNG per benchmark that ran; returns the file names."""
    written = []

    def save(drawing: Any, name: str) -> None:
        drawing.tight_layout()
        drawing.savefig(os.path.join(output_dir, name), dpi=110)
        written.append(name)

    if "memory" in results:
        memory = results["memory"]
        drawing = figure(figsize=(10, 3.8))
        axes = drawing.subplots(1, 2)
        for axis, source, title in (
            (axes[0], memory, f"{results['model']} (measured)"),
            (axes[1], memory["llama_7b"], "LLaMA-7B fp16 (from its config)"),
        ):
            for method, values in source["bytes"].items():
                axis.plot(source["steps"], [v / 2**20 for v in values], label=method)
            axis.set(title=title, xlabel="time step t", ylabel="KV memory (MiB)", yscale="log")
            axis.grid(alpha=0.3)
        axes[0].legend()
        save(drawing, "memory.png")
    if "latency" in results:
        rows = results["latency"]["rows"]
        kinds = list(dict.fromkeys(row["kind"] for row in rows))
        drawing = figure(figsize=(5 * len(kinds), 3.8))
        axes = drawing.subplots(1, len(kinds), squeeze=False)
        for axis, kind in zip(axes[0], kinds, strict=True):
            for method in dict.fromkeys(r["method"] for r in rows):
                points = [
                    (r["step"], r["ratio_to_no_context"]) for r in rows if r["kind"] == kind and r["method"] == method
                ]
                axis.plot(*zip(*points, strict=True), marker="o", label=method)
            steps = sorted({r["step"] for r in rows})
            axis.set_xscale("log", base=2)
            axis.set_xticks(steps, [str(step) for step in steps])
            axis.set(title=f"{kind} turn", xlabel="time step t", ylabel="latency / no context")
            axis.grid(alpha=0.3)
        axes[0][0].legend()
        save(drawing, "latency.png")
    if "throughput" in results:
        rows = results["throughput"]["rows"]
        labels = list(dict.fromkeys(row["batch"] for row in rows))
        methods = list(dict.fromkeys(row["method"] for row in rows))
        drawing = figure(figsize=(6, 3.8))
        axis = drawing.subplots()
        width = 0.8 / len(methods)
        for index, method in enumerate(methods):
            values = [
                next(r["samples_per_second"] for r in rows if r["method"] == method and r["batch"] == label)
                for label in labels
            ]
            axis.bar([x + index * width for x in range(len(labels))], values, width, label=method)
        axis.set_xticks(
            [x + width * (len(methods) - 1) / 2 for x in range(len(labels))],
            [f"batch {b}" if b.isdigit() else "largest for budget" for b in labels],
        )
        axis.set(title=f"throughput at t={results['throughput']['step']}", ylabel="samples / s")
        axis.legend()
        save(drawing, "throughput.png")
    if "training" in results:
        rows = results["training"]["rows"]
        drawing = figure(figsize=(6, 3.8))
        axis = drawing.subplots()
        names = [f"{r['method']}\nt={r['step']}" for r in rows]
        axis.bar(
            [x - 0.2 for x in range(len(rows))], [r["parallel_samples_per_second"] for r in rows], 0.4, label="parallel"
        )
        axis.bar(
            [x + 0.2 for x in range(len(rows))],
            [r["recurrent_samples_per_second"] for r in rows],
            0.4,
            label="recurrent",
        )
        axis.set_xticks(range(len(rows)), names)
        axis.set(title="training forward+backward", ylabel="samples / s")
        axis.legend()
        save(drawing, "training.png")
    return written


# ----- Markdown -------------------------------------------------------------------------------------------
def markdown(results: dict[str, Any], found: list[Table], images: list[str]) -> str:
    machine = results["machine"]
    lines = [
        f"# Benchmarks: {results['model']}",
        "",
        f"- date: {machine['date']}; machine: {machine['cpu']}, {machine['cpu_count']} CPU cores, "
        f"{machine['threads']} torch threads, GPU: {machine['gpu']}; load average before the run: "
        f"{machine['load_average']}",
        f"- torch {machine['torch']}, transformers {machine['transformers']}; command: `{results['command']}`",
        f"- workload: contexts of {results['workload']['context_tokens']} tokens, inputs of "
        f"{results['workload']['input_tokens']}, {results['workload']['new_tokens']} new tokens per turn; "
        f"{results['settings']['rounds']} interleaved rounds per figure (medians)",
        "",
    ]
    for table in found:
        lines += [table.markdown()]
    lines += [f"![{image}]({image})" for image in images]
    return "\n".join(lines) + "\n"
