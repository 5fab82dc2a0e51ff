"""Timing shared by every benchmark: a warm-up, then the cases interleaved round by round.

Every case runs once untimed, then each round times every case once, in turn, with `time.perf_counter` (a
case faster than `min_run_time` repeats until that much time has passed, and its mean counts). A slow spell
of a noisy machine then hits every case of a round alike: a ratio is the median over rounds of the two cases'
times in the same round. (`torch.utils.benchmark.Timer.blocked_autorange` runs a case once more per
measurement to size its blocks, which doubles the cost of the multi-second turns measured here on 2 cores.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one case, one value per round."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    def ratio_to(self, baseline: Timing) -> float:
        """This case's time over `baseline`'s, taken within each round, then the median over rounds."""
        return statistics.median(mine / theirs for mine, theirs in zip(self.rounds, baseline.rounds, strict=True))


def _seconds_per_call(run: Callable[[], object], min_run_time: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_run_time:
            return elapsed / calls


def time_cases(cases: Mapping[str, Callable[[], object]], rounds: int, min_run_time: float = 0.05) -> dict[str, Timing]:
    """Time every case (a callable that starts from the same state each call): one warm-up call each, then
    `rounds` interleaved rounds."""
    for run in cases.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            times[name].append(_seconds_per_call(run, min_run_time))
    return {name: Timing(tuple(values)) for name, values in times.items()}
