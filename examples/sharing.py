"""Sharing an adapter: save it in PEFT format, load it back, and see the same answers; then load it into a
model with more `<COMP>` tokens, or with a LoRA on its MLP too, to go on training it with more memory slots per
context or more adapted modules.

    python examples/sharing.py

`model.push_to_hub("me/my-ccm-adapter")` uploads the same files to the Hub (it needs a token and network).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from quick_tour import QUERY, build_base, build_model, train
from transformers_ccm import CCMConfig, CCMForCausalLM


def answer(model: CCMForCausalLM) -> int:
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[12, 52]]))
    return int(model.generate(torch.tensor([[QUERY]]), past_key_values=cache, max_new_tokens=1)[0, -1])


def main() -> None:
    model = build_model(update="merge")
    train(model, steps=200, log_every=0)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            print(f"{path.name:28s} {path.stat().st_size:>8,d} bytes")
        # The tour's base model exists only in memory, so it is passed in; a saved or Hub base model is
        # found from ccm_config.json instead.
        loaded = CCMForCausalLM.from_pretrained(folder, base_model=build_base())
        # Four slots per context instead of two: the saved <COMP> embeddings, then copies of the last one.
        grown = CCMForCausalLM.from_base(build_base(), CCMConfig(num_comp_tokens=4, update="merge", lora_dropout=0.0))
        grown.load_adapter(folder, resize_comp_tokens=True)
        # A LoRA on the MLP projections as well: the saved layers, and the added ones at zero.
        mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        wider = CCMForCausalLM.from_base(build_base(), CCMConfig(update="merge", target_modules=mlp, lora_dropout=0.0))
        wider.load_adapter(folder, extend_targets=True)
    print(f"answer before saving: {answer(model)}, after loading: {answer(loaded.eval())} (expected 52)")
    print(f"with {grown.config.num_comp_tokens} <COMP> tokens, before any training: {answer(grown.eval())}")
    print(f"with a LoRA on the MLP too, before any training: {answer(wider.eval())}")


if __name__ == "__main__":
    main()
