"""Online inference: several users, each with their own compressed memory, served in one batch.

Trains the quick tour's tiny adapter (a few seconds), then for two users at different time steps:
compress their contexts, generate the answers, fold the turns, and keep one user's memory in a file.

    python examples/online_inference.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from quick_tour import LABELS, QUERY, build_model, train
from transformers_ccm import CompressedMemoryCache


def main() -> None:
    model = build_model(update="concat")
    train(model, steps=200, log_every=0)

    # Two users: user 0 has told us three (key, label) pairs, user 1 only one.
    histories = [[[11, 41], [12, 52], [13, 47]], [[20, 44]]]
    cache = model.new_cache(batch_size=2)
    for step in range(3):
        contexts = [history[step] if step < len(history) else [0, 0] for history in histories]
        present = [[1, 1] if step < len(history) else [0, 0] for history in histories]
        # a row whose attention mask is all zeros keeps its memory unchanged
        model.compress(cache, torch.tensor(contexts), attention_mask=torch.tensor(present))
        tokens_seen = sum(2 * min(step + 1, len(h)) for h in histories)
        print(
            f"after step {step + 1}: memory slots {cache.memory_mask.sum(1).tolist()} per user, "
            f"{cache.memory_bytes()} bytes in all (full context would keep {tokens_seen} tokens)"
        )

    answers = model.generate(torch.tensor([[QUERY], [QUERY]]), past_key_values=cache, max_new_tokens=1, do_sample=False)
    for user, history in enumerate(histories):
        print(f"user {user}: last label {history[-1][1]}, model answers {int(answers[user, -1])}")
    assert all(int(answers[u, -1]) in LABELS for u in range(2))

    model.compress(cache)  # fold the turn just generated: only the <COMP> tokens (and the last token) run
    print(
        f"after folding the turn: memory slots {cache.memory_mask.sum(1).tolist()}, "
        f"{cache.turn_length} turn tokens held"
    )

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "users.safetensors"
        cache.save(path)
        restored = CompressedMemoryCache.load(path, model)
        print(
            f"saved and restored {path.stat().st_size} bytes; memory equal: "
            f"{all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, restored.layers, strict=True))}"
        )


if __name__ == "__main__":
    main()
