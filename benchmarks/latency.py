"""Latency of one online turn against the time step, for no context, full context and CCM, as ratios to no
context taken within each round. Two kinds of turn: a new context arrives (compressed by CCM, appended by full
context), or the last turn is folded (the `ccm chat` loop); then 16 tokens are generated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.timing import time_cases
from benchmarks.workload import NO_CONTEXT, Subject, TurnKind, Workload, build_states, turn_cases


def run(
    subject: Subject,
    workload: Workload,
    steps: Sequence[int],
    kinds: Sequence[TurnKind],
    rounds: int,
    min_run_time: float,
) -> dict[str, Any]:
    """One row per kind, time step and method: median seconds per turn and ratio to no context."""
    rows = []
    for kind in kinds:
        states = build_states(subject, workload, steps, kind)
        for step in steps:
            timings = time_cases(turn_cases(subject, workload, states, step, batch=1), rounds, min_run_time)
            for method, timing in timings.items():
                rows.append(
                    {
                        "kind": kind,
                        "step": step,
                        "method": method,
                        "seconds": timing.median,
                        "ratio_to_no_context": timing.ratio_to(timings[NO_CONTEXT]),
                        "rounds": list(timing.rounds),
                    }
                )
    return {"rows": rows, "new_tokens": workload.new_tokens}
