"""Paired difference of two adapters scored in one eval.json (the second against the first), e.g. stage 10 with
two <COMP> tokens against stage 10 with one: python docs/results/scripts/paired_pair.py EVAL_JSON FIRST SECOND."""

import json
import sys
from pathlib import Path

from transformers_ccm.evaluation import difference_text, summarize

path, first, second = sys.argv[1:4]
results = json.loads(Path(path).read_text())["results"]
keep = [r for r in results if not r["method"].startswith("ccm") or r["method"].endswith(first)]
keep += [r for r in results if r["method"].endswith(second)]
for row in summarize(keep):
    if row["versus_first"] is not None:
        print(
            f"{row['task']:15s} {row['wordings']:6s} {row['method']:34s} {row['ccm']:.3f}  "
            f"{difference_text(row['versus_first'], row['metric'])} against {first}"
        )
