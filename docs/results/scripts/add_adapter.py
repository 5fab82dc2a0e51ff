"""Score one more adapter on the samples of an earlier `ccm eval` and write the joint report, paired against the
first adapter there, without scoring the baselines again:
python docs/results/scripts/add_adapter.py EVAL_DIR ADAPTER OUT_DIR [SEED].

The samples are drawn again as `ccm eval` drew them (same task, wording set, time step, count and seed); the
no-context baseline is scored again as a check that they are the same samples."""

import argparse
import json
import sys
from pathlib import Path

import torch

from transformers_ccm.cli import _evaluation_sets, _load_ccm
from transformers_ccm.evaluation import markdown, plot, report_json, score_samples, summarize

folder, adapter, output = sys.argv[1:4]
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
results = json.loads(Path(folder, "eval.json").read_text())["results"]
model, tokenizer = _load_ccm(adapter, "default", "cpu")
name = f"ccm-{model.config.update}:{adapter}"
added = []
for row in (r for r in results if r["method"] == "no_context"):
    args = argparse.Namespace(samples=row["samples"], seed=seed, steps=[row["steps"]])
    (samples,) = [s for w, _, s, _ in _evaluation_sets(row["task"], args) if w == row["wordings"]]
    check = score_samples(model, tokenizer, samples, "no_context", row["metric"])
    again = torch.tensor(check.to_dict()["per_sample"], dtype=torch.float64)
    stored = torch.tensor(row["per_sample"], dtype=torch.float64)
    if again.shape != stored.shape or not torch.allclose(again, stored, rtol=1e-4):
        raise SystemExit(f"{row['task']} {row['wordings']} t={row['steps']}: not the samples of {folder}.")
    score = score_samples(model, tokenizer, samples, "ccm", row["metric"])
    added.append({"task": row["task"], "wordings": row["wordings"], **score.to_dict(), "method": name})
    print(f"{row['task']} {row['wordings']} t={row['steps']}: {score.value:.3f}", flush=True)
results += added
summary = summarize(results)
Path(output).mkdir(parents=True, exist_ok=True)
Path(output, "eval.json").write_text(report_json(results, summary))
plot(results, str(Path(output, "eval.png")))
Path(output, "eval.md").write_text(markdown(results, summary))
print(Path(output, "eval.md").read_text())
