"""Perplexity of a long stream in bounded memory: CCM against StreamingLLM at the same KV size (Fig. 7)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from transformers_ccm.config import CCMConfig
from transformers_ccm.extras import figure
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.streaming import StreamingConfig
from transformers_ccm.validation import is_int, positive_int


@dataclass
class StreamResult:
    """One method over one stream: the loss of every predicted token and the KV held after every forward."""

    method: str
    streaming: StreamingConfig
    max_kv_length: int
    token_nll: list[float]  # -log p(x_{i+1} | stream up to i), for i = 0 .. len - 2
    kv_held: list[int]  # positions held per layer after each forward (one forward per piece)
    piece: int

    def perplexity(self, start: int = 0) -> float:
        """Perplexity of the tokens predicted from position `start` on."""
        # A negative start counted from the end (a slice's), and True stood for 1, each giving another perplexity.
        if not is_int(start) or start < 0:
            raise ValueError(f"start must be a position of the stream, an integer >= 0, got {start!r}.")
        losses = self.token_nll[start:]
        if not losses:
            raise ValueError(
                f"The stream predicts {len(self.token_nll)} tokens, none from position {start} on; stream more tokens."
            )
        return math.exp(sum(losses) / len(losses))

    @property
    def perplexity_after_budget(self) -> float | None:
        """Perplexity once the KV budget is full (None for a stream no longer than the budget: the two methods then
        hold the same tokens)."""
        return self.perplexity(self.max_kv_length) if len(self.token_nll) > self.max_kv_length else None

    def to_dict(self, bucket: int) -> dict[str, object]:
        return {
            **asdict(self),
            "token_nll": [round(loss, 4) for loss in self.token_nll],
            "perplexity": self.perplexity(),
            "perplexity_after_budget": self.perplexity_after_budget,
            "peak_kv_held": max(self.kv_held),
            "bucket_perplexity": bucket_perplexity(self.token_nll, bucket),
        }


@torch.no_grad()
def stream_nll(
    model: CCMForCausalLM, ids: torch.Tensor, streaming: StreamingConfig, piece: int = 16, method: str = "ccm"
) -> StreamResult:
    """Feed `ids` `(len,)` through a fresh streaming cache `piece` tokens at a time and score every next token.

    With `streaming.compress=False` this is StreamingLLM, scored with the adapter off: the base model's own.
    """
    if not isinstance(streaming, StreamingConfig):  # None made a cache of compressed memory, which streams nothing
        raise TypeError(f"streaming must be a StreamingConfig, got {type(streaming).__name__}.")
    if ids.ndim != 1 or ids.shape[0] < 2:
        raise ValueError(f"ids must be one stream of at least 2 tokens, got shape {tuple(ids.shape)}.")
    # range() would refuse 0 with its own words, and a negative piece scores nothing at all.
    _check_positive(piece, "piece")
    check_scorable(model.config, streaming)
    cache = model.new_cache(1, streaming=streaming)
    ids = ids.to(model.device)
    token_nll: list[float] = []
    kv_held: list[int] = []
    with model.adapter_disabled() if not streaming.compress else contextlib.nullcontext():
        for start in range(0, ids.shape[0] - 1, piece):
            tokens = ids[start : start + piece]
            targets = ids[start + 1 : start + piece + 1]
            logits = model(input_ids=tokens[None], past_key_values=cache).logits[0, : targets.shape[0]].float()
            token_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="none").tolist()
            kv_held.append(cache.kv_length)
    assert cache.streaming is not None
    # The sizes the stream took (its memory cap resolved), as the report records them.
    streaming = cache.streaming
    return StreamResult(method, streaming, streaming.max_kv_length(model.config), token_nll, kv_held, piece)


def check_scorable(config: CCMConfig, streaming: StreamingConfig) -> None:
    """Raise unless `stream_nll` can score `streaming` with an adapter of `config`: StreamingLLM (no compression) is
    the base model's own, and a LoRA that acts at every position (`conditional_lora=False`) cannot be turned off on
    a stream it fills (its keys/values would be held under the adapter's signature)."""
    if not streaming.compress and not config.conditional_lora:
        raise ValueError(
            "StreamingLLM (a stream without compression) scores the base model alone, but this adapter's LoRA acts at "
            "every position (conditional_lora=False) and cannot be turned off on its stream; score it with a "
            "compression adapter (conditional_lora=True) of the same base model."
        )


def bucket_perplexity(token_nll: Sequence[float], bucket: int) -> list[float]:
    """Perplexity of consecutive buckets of `bucket` predicted tokens (the last one may be shorter)."""
    _check_positive(bucket, "bucket")
    return [
        math.exp(sum(token_nll[i : i + bucket]) / len(token_nll[i : i + bucket]))
        for i in range(0, len(token_nll), bucket)
    ]


def plot_stream(results: Sequence[StreamResult], bucket: int, path: str) -> None:
    """Perplexity per bucket over the stream, and the KV held, per method (like the paper's Fig. 7)."""
    drawing = figure(figsize=(7.5, 6.4))
    top, bottom = drawing.subplots(2, 1, sharex=True)
    for result in results:
        buckets = bucket_perplexity(result.token_nll, bucket)
        ends = [min((i + 1) * bucket, len(result.token_nll)) for i in range(len(buckets))]
        label = f"{result.method} (KV {result.max_kv_length}): ppl {result.perplexity():.2f}"
        top.plot(ends, buckets, marker=".", label=label)
        fed = [min((i + 1) * result.piece, len(result.token_nll) + 1) for i in range(len(result.kv_held))]
        bottom.plot(fed, result.kv_held, label=result.method)
    top.set_ylabel(f"perplexity per {bucket} tokens")
    top.legend(fontsize=8)
    bottom.set_ylabel("KV positions held per layer")
    bottom.set_xlabel("tokens streamed")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    drawing.tight_layout()
    drawing.savefig(path, dpi=120)


def _check_positive(value: object, name: str) -> None:
    """Raise a ValueError unless `value` is a positive integer (`ccm stream-eval --piece` / `--bucket`)."""
    if not positive_int(value):
        raise ValueError(f"{name} (ccm stream-eval --{name}) must be a positive integer, got {value!r}.")
