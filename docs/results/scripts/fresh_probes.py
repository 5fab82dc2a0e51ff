"""Fresh samples of the two probes (seed 2027, 96 each) for a confirmatory check: docs/results/stage11/probes-2027/."""

import json
from pathlib import Path

source = Path("docs/results/probe/make_probes.py").read_text().split("\nfor name, probe in")[0]
namespace: dict = {}
exec(compile(source, "make_probes.py", "exec"), namespace)
out = Path("docs/results/stage11/probes-2027")
out.mkdir(parents=True, exist_ok=True)
for name in ("messages", "emails"):
    samples = namespace["records"](namespace[name.upper()], seed=2027, count=96)
    (out / f"{name}-t8.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    print(out / f"{name}-t8.jsonl", len(samples))
