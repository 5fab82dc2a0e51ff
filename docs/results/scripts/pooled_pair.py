"""Paired difference of SECOND against FIRST pooled over the samples of several eval.json files that score both
adapters (e.g. two draws of one probe), with `ccm eval`'s 95% paired bootstrap:
python docs/results/scripts/pooled_pair.py FIRST SECOND EVAL_JSON [EVAL_JSON ...]."""

import json
import sys
from pathlib import Path

from transformers_ccm.evaluation import difference_text, paired_difference

first, second, *paths = sys.argv[1:]
pooled: dict[str, dict] = {}
for path in paths:
    for row in json.loads(Path(path).read_text())["results"]:
        for suffix in (first, second):
            if row["method"].endswith(suffix):
                into = pooled.setdefault(suffix, {**row, "per_sample": []})
                into["per_sample"] = into["per_sample"] + row["per_sample"]
difference = paired_difference(pooled[first], pooled[second])
samples = len(pooled[first]["per_sample"])
print(f"{samples} samples: {difference_text(difference, pooled[second]['metric'])}")
