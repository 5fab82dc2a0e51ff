"""Streaming: an endless generation in bounded KV memory, CCM against StreamingLLM at the same size.

A streaming cache holds `[sink | memory | window]`; whatever overflows the window is compressed into a
few memory slots (CCM) or dropped (StreamingLLM, `compress=False`). Both hold at most the same number of
positions however long the stream runs. On the embedded model with the shipped streaming adapter, compare
their perplexity with `ccm stream-eval` (docs/streaming.md).

    python examples/streaming.py
"""

from __future__ import annotations

import torch

from quick_tour import build_model
from transformers_ccm import StreamingConfig


def main() -> None:
    model = build_model(update="concat").eval()  # untrained here: this shows the memory, not the quality
    ccm = StreamingConfig(window_tokens=148, sink_tokens=4, compress_chunk=32, max_memory_tokens=8)
    settings = {"CCM-concat": ccm, "StreamingLLM": ccm.same_size_baseline(model.config)}
    prompt = torch.randint(3, 97, (2, 10))  # two streams in one batch
    for name, streaming in settings.items():
        cache = model.new_cache(batch_size=2, streaming=streaming)
        held = []
        hook = model.base_model.register_forward_hook(lambda *_, cache=cache, held=held: held.append(cache.kv_length))
        model.generate(prompt, past_key_values=cache, max_new_tokens=2000, min_new_tokens=2000, do_sample=False)
        hook.remove()
        print(
            f"{name:12s} budget {streaming.max_kv_length(model.config)} positions: held at most {max(held)} over "
            f"{cache.turn_tokens} tokens ({cache.memory_length} memory slots, {int(cache.steps[0])} chunks "
            f"compressed), {cache.memory_bytes() / 1024:.0f} KiB"
        )


if __name__ == "__main__":
    main()
