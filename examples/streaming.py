"""Streaming: an endless generation in bounded KV memory, CCM against StreamingLLM at the same size.

A streaming cache holds `[sink | memory | window]`; whatever overflows the window is compressed into a
few memory slots (CCM) or dropped (StreamingLLM, `compress=False`). Both hold at most the same number of
positions however long the stream runs. On the embedded model with the shipped streaming adapter, compare
their perplexity with `ccm stream-eval` (docs/streaming.md). Last, two streams whose replies end at different
times: each takes its own reply only, as if it had generated alone.

    python examples/streaming.py
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria

from quick_tour import build_model
from transformers_ccm import StreamingConfig


class FirstRowStopsAt(StoppingCriteria):
    """Stops the first row once the sequences are `length` tokens long, as an EOS would; the others run on."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[0] = input_ids.shape[1] >= self.length
        return done


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
    # Rows of a batch whose replies end at different times: each stream takes its own reply, not the padding
    # generate() adds after it, and holds what it would hold generating alone.
    cache = model.new_cache(batch_size=2, streaming=ccm)
    first_row_stops = FirstRowStopsAt(prompt.shape[1] + 50)
    # min_new_tokens keeps EOS away: only the criterion ends the first row.
    model.generate(
        prompt, past_key_values=cache, max_new_tokens=300, min_new_tokens=300, stopping_criteria=[first_row_stops]
    )
    print(
        f"replies of 50 and 300 tokens: streams took {cache.history_tokens.tolist()} tokens and hold "
        f"{cache.kv_lengths.tolist()} positions"
    )


if __name__ == "__main__":
    main()
