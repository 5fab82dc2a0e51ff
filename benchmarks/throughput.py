"""Batched throughput at one time step (the paper's Table 1: MetaICL at t = 16): samples per second of a turn
(take in a new context, generate 16 tokens) for full context and CCM, at fixed batch sizes and at the largest
batch whose KV memory fits a budget, found from one user's measured peak and verified by running it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.timing import Timing, time_cases
from benchmarks.workload import FULL_CONTEXT, PeakKV, Subject, Workload, build_states, turn_cases


def peak_bytes(subject: Subject, turn: Callable[[], object]) -> int:
    """The most KV bytes held at the end of any forward of one call of `turn`."""
    with PeakKV(subject.modules()) as peak:
        turn()
    return peak.bytes


def _rows(batches: dict[str, int], timings: dict[str, Timing], label: str) -> list[dict[str, Any]]:
    full = timings[FULL_CONTEXT]
    return [
        {
            "batch": label,
            "method": method,
            "batch_size": batches[method],
            "seconds": timing.median,
            "samples_per_second": batches[method] / timing.median,
            # (B / time) over full context's (B_full / time_full), within each round
            "vs_full_context": full.ratio_to(timing) * batches[method] / batches[FULL_CONTEXT],
            "rounds": list(timing.rounds),
        }
        for method, timing in timings.items()
    ]


def run(
    subject: Subject,
    workload: Workload,
    step: int,
    batch_sizes: Sequence[int],
    kv_budget: int,
    rounds: int,
    min_run_time: float,
) -> dict[str, Any]:
    """Samples per second per method and batch size, the largest batch for `kv_budget` bytes, and its check."""
    states = build_states(subject, workload, [step], "context")
    methods = [FULL_CONTEXT, *subject.ccm]
    single = turn_cases(subject, workload, states, step, 1, methods)
    per_user = {method: peak_bytes(subject, turn) for method, turn in single.items()}
    largest = {method: kv_budget // per_user[method] for method in methods}
    if not all(largest.values()):
        raise ValueError(f"A KV budget of {kv_budget} bytes does not hold one user of every method: {per_user}.")
    rows = []
    for batch in batch_sizes:
        cases = turn_cases(subject, workload, states, step, batch, methods)
        rows += _rows(dict.fromkeys(methods, batch), time_cases(cases, rounds, min_run_time), str(batch))
    cases = {
        method: turn_cases(subject, workload, states, step, largest[method], [method])[method] for method in methods
    }
    measured = {method: peak_bytes(subject, turn) for method, turn in cases.items()}
    rows += _rows(largest, time_cases(cases, rounds, min_run_time), "largest")
    return {
        "step": step,
        "kv_budget": kv_budget,
        "peak_bytes_per_user": per_user,
        "largest_batch": largest,
        "largest_batch_peak_bytes": measured,
        "rows": rows,
    }
