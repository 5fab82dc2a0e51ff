"""The shipped adapters scored in float32 and in bfloat16 (as a GPU user runs them) on the same held-out samples:
python docs/results/scripts/precision.py ADAPTER TASK T COUNT (CCM only; both wording sets)."""

import sys

import torch

from transformers_ccm import CCMForCausalLM
from transformers_ccm.embedded import load_tokenizer
from transformers_ccm.evaluation import score_samples
from transformers_ccm.tasks import METRIC, make_samples

tokenizer = load_tokenizer("default")
adapter, task, steps, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for dtype in (torch.float32, torch.bfloat16):
    model = CCMForCausalLM.from_pretrained(adapter).eval().to(dtype)
    for wordings in ("seen", "unseen"):
        samples = make_samples(task, "test", count, seed=0, steps=steps, wordings=wordings)
        score = score_samples(model, tokenizer, samples, "ccm", METRIC[task])
        print(f"{adapter} {task} t={steps} {wordings} {dtype}: {score.metric} {score.value:.3f}", flush=True)
