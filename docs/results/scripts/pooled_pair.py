"""Paired accuracy difference (SECOND - FIRST) pooled over several eval.json files of the same two adapters, with a
95% paired-bootstrap interval: python docs/results/scripts/pooled_pair.py FIRST SECOND EVAL_JSON [EVAL_JSON ...]."""

import json
import random
import sys
from pathlib import Path

first, second, *paths = sys.argv[1:]
diffs = []
for path in paths:
    rows = {r["method"]: r for r in json.loads(Path(path).read_text())["results"]}
    a = next(r for m, r in rows.items() if m.endswith(first))["per_sample"]
    b = next(r for m, r in rows.items() if m.endswith(second))["per_sample"]
    diffs += [y[0] - x[0] for x, y in zip(a, b, strict=True)]
rng = random.Random(0)
boots = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(10_000))
print(f"{len(diffs)} samples: {sum(diffs) / len(diffs):+.3f} [{boots[250]:+.3f}, {boots[9749]:+.3f}]")
