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
    rows = json.loads(Path(path).read_text())["results"]
    # Each adapter's row of each sample set, so that the samples pair up whatever order the rows were written in
    # (an adapter added with --add-to comes after every row of the report).
    found: dict[str, dict] = {suffix: {} for suffix in (first, second)}
    for row in rows:
        for suffix in (first, second):
            if row["method"].startswith("ccm") and row["method"].endswith(suffix):
                key = (row["task"], row["wordings"], row["steps"])
                if key in found[suffix]:
                    sys.exit(f"{path}: two adapters end with {suffix!r} at {key}; give more of its name.")
                found[suffix][key] = row
    if found[first].keys() != found[second].keys():
        sys.exit(f"{path}: {first} and {second} were not scored on the same sample sets; pool only files of both.")
    for key, row in found[first].items():
        other = found[second][key]
        if (row["samples"], row.get("samples_digest")) != (other["samples"], other.get("samples_digest")):
            sys.exit(f"{path}: {first} and {second} scored other samples at {key}.")
        for suffix, scored in ((first, row), (second, other)):
            into = pooled.setdefault(suffix, {**scored, "per_sample": []})
            if scored["metric"] != into["metric"]:
                sys.exit(f"{path}: {key} is scored by {scored['metric']}, not {into['metric']}; pool one metric.")
            into["per_sample"] = into["per_sample"] + scored["per_sample"]
difference = paired_difference(pooled[first], pooled[second])
samples = len(pooled[first]["per_sample"])
print(f"{samples} samples: {difference_text(difference, pooled[second]['metric'])}")
