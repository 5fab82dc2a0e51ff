"""Serving: one model, many users, several threads; a failed call changes nothing; memories know their model.

Trains the quick tour's tiny adapter (a few seconds), then serves eight users from four threads (each user
with their own cache), checks the answers against serving them one after another, shows that a bad request
leaves the user's memory byte for byte as it was, and that another adapter refuses the memory.

    python examples/serving.py
"""

from __future__ import annotations

import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quick_tour import KEYS, LABELS, QUERY, build_model, train
from transformers_ccm import CCMForCausalLM, CompressedMemoryCache


def serve(model: CCMForCausalLM, history: list[list[int]]) -> tuple[int, CompressedMemoryCache]:
    """One user's session: compress what they said, answer the query, fold the turn into memory."""
    cache = model.new_cache()
    for context in history:
        model.compress(cache, torch.tensor([context]))
    answer = model.generate(torch.tensor([[QUERY]]), past_key_values=cache, max_new_tokens=1, do_sample=False)
    model.compress(cache)
    return int(answer[0, -1]), cache


def main() -> None:
    model = build_model(update="concat")
    train(model, steps=200, log_every=0)
    rng = random.Random(0)
    histories = [[[rng.choice(KEYS), rng.choice(LABELS)] for _ in range(rng.randint(1, 4))] for _ in range(8)]

    one_by_one = [serve(model, history)[0] for history in histories]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = [answer for answer, _ in pool.map(lambda history: serve(model, history), histories)]
    print(f"answers from 4 threads: {concurrent}")
    print(f"same as one by one: {concurrent == one_by_one}")

    _, cache = serve(model, histories[0])
    with tempfile.TemporaryDirectory() as folder:
        before, after = Path(folder) / "before.safetensors", Path(folder) / "after.safetensors"
        cache.save(before)
        try:
            model.compress(cache, torch.tensor([[12, 10_000]]))  # an id outside the vocabulary
        except ValueError as error:
            print(f"bad request refused: {error}")
        cache.save(after)
        print(f"memory unchanged: {before.read_bytes() == after.read_bytes()}")

        other = build_model(update="concat")  # another adapter for the same base model
        try:
            CompressedMemoryCache.load(before, other)
        except ValueError as error:
            print(f"another adapter refuses the memory: {'adapter_sha256' in str(error)}")


if __name__ == "__main__":
    main()
