"""Average CCM adapters trained on from one adapter (a uniform "model soup"): the averaged LoRA update of every
module is exact, kept as one LoRA of the summed rank, and the <COMP> embeddings are averaged.
python docs/results/scripts/soup.py OUT ADAPTER ADAPTER [ADAPTER ...]"""

import sys
from dataclasses import replace

import torch
from peft import LoraConfig

from transformers_ccm.hub import COMP_EMBEDDINGS_KEY, read_adapter, resolve_adapter, save_adapter

out, *names = sys.argv[1:]
if len(names) < 2:
    sys.exit(__doc__)
folders = [resolve_adapter(name) for name in names]
read = [read_adapter(folder) for folder in folders]
configs = [config for config, _ in read]
first = configs[0]
same = ("update", "num_comp_tokens", "r", "lora_alpha", "target_modules", "base_model_name_or_path")
if any(getattr(config, key) != getattr(first, key) for config in configs for key in same):
    sys.exit(f"Only adapters alike in {same} can be averaged.")
count = len(names)
soup: dict[str, torch.Tensor] = {}
for key in read[0][1]:
    parts = [tensors[key] for _, tensors in read]
    if key == COMP_EMBEDDINGS_KEY:
        soup[key] = torch.stack(parts).mean(0)
    elif ".lora_A." in key:  # rank rows side by side: sum_i B_i A_i / n = [B_1 .. B_n] / n @ [A_1; ..; A_n]
        soup[key] = torch.cat(parts, dim=0)
    elif ".lora_B." in key:
        soup[key] = torch.cat(parts, dim=1) / count
    else:
        sys.exit(f"Unknown adapter weight {key}.")
# lora_alpha / r is the update's scale; both grow by `count` so the scale stays.
config = replace(
    first,
    r=first.r * count,
    lora_alpha=first.lora_alpha * count,
    trained_on=f"the average of {count} adapters ({', '.join(names)}); the first: {first.trained_on}",
)
lora_config = LoraConfig.from_pretrained(str(folders[0]))
lora_config.r, lora_config.lora_alpha = config.r, config.lora_alpha
save_adapter(out, config, lora_config, soup)
print(f"{out}: the average of {', '.join(names)} (rank {config.r})")
