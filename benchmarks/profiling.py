"""Where the time goes, to explain a missed target: torch.profiler's operators for the slower case and the
case it is compared with, and cProfile's cumulative time of transformers-ccm's own functions (hooks, masks,
checks), which no operator shows. Each case runs once, after the benchmarks ran the same code."""

from __future__ import annotations

import cProfile
import os
import pstats
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import transformers_ccm
from benchmarks.training_speed import make_samples, training_cases
from benchmarks.workload import NO_CONTEXT, Subject, TurnKind, Workload, build_states, turn_cases

PACKAGE = os.path.dirname(transformers_ccm.__file__)


def _run_profiled(run: Callable[[], object], python: bool) -> tuple[dict[str, tuple[float, int]], Any]:
    """Self CPU milliseconds and calls of every operator in one call of `run` (and, with `python`, cProfile's
    statistics of the same call)."""
    python_profiler = cProfile.Profile() if python else None
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        if python_profiler:
            python_profiler.enable()
        run()
        if python_profiler:
            python_profiler.disable()
    operators = {event.key: (event.self_cpu_time_total / 1e3, event.count) for event in profiler.key_averages()}
    return operators, python_profiler and pstats.Stats(python_profiler).stats  # type: ignore[attr-defined]


def _own_functions(stats: dict[Any, Any]) -> tuple[float, list[dict[str, Any]]]:
    """The call's wall milliseconds and transformers-ccm's functions in it, by cumulative time."""
    total = max(cumulative for _, _, _, cumulative, _ in stats.values()) * 1e3
    own = [
        {"function": f"{os.path.relpath(file, PACKAGE)}:{function}", "calls": calls, "cumulative_ms": cumulative * 1e3}
        for (file, _, function), (_, calls, _, cumulative, _) in stats.items()
        if file.startswith(PACKAGE)
    ]
    return total, sorted(own, key=lambda row: -row["cumulative_ms"])


def compare(cases: Mapping[str, Callable[[], object]], focus: str, baseline: str, top: int = 12) -> dict[str, Any]:
    """The `top` operators of `focus` by self CPU time, each with `baseline`'s time, and `focus`'s own functions."""
    mine, stats = _run_profiled(cases[focus], python=True)
    theirs, _ = _run_profiled(cases[baseline], python=False)
    wall_ms, own = _own_functions(stats)
    return {
        "focus": focus,
        "baseline": baseline,
        "self_cpu_ms": {focus: sum(ms for ms, _ in mine.values()), baseline: sum(ms for ms, _ in theirs.values())},
        "operators": [
            {
                "operator": key,
                "self_ms": mine[key][0],
                "calls": mine[key][1],
                "baseline_self_ms": theirs.get(key, (0.0, 0))[0],
                "baseline_calls": theirs.get(key, (0.0, 0))[1],
            }
            for key in sorted(mine, key=lambda key: -mine[key][0])[:top]
        ],
        "cprofile_wall_ms": wall_ms,
        "own_functions": own[:top],
        "threads": torch.get_num_threads(),
    }


def profile_turn(subject: Subject, workload: Workload, method: str, step: int, kind: TurnKind) -> dict[str, Any]:
    """A `method` turn against the no-context turn."""
    cases = turn_cases(subject, workload, build_states(subject, workload, [step], kind), step, 1, [NO_CONTEXT, method])
    return {"title": f"{method}, {kind} turn at t={step}", **compare(cases, method, NO_CONTEXT)}


def profile_training(subject: Subject, workload: Workload, method: str, step: int, batch_size: int) -> dict[str, Any]:
    """The parallel training step against the recurrent one."""
    samples = make_samples(workload, subject.vocab_size, step, batch_size)
    cases = training_cases(subject.ccm[method], samples)
    found = compare(cases, "parallel", "recurrent")
    subject.ccm[method].zero_grad(set_to_none=True)
    return {"title": f"{method} training step at t={step}, batch {batch_size}", **found}
