"""Training on the stream itself: each sample runs through a streaming cache exactly as `ccm stream-eval` runs it.

The parallel layout (`CCMDataCollator`) compresses each chunk seeing only the memory before it, with no sink
tokens and positions that never move. A stream differs on all three: it holds `[sink | memory | window]`
at positions reassigned at every step, and a chunk's keys were computed while it sat in a full window. Here a
sample, a stretch of text, runs in pieces of `piece` tokens from its first token (as `ccm stream-eval --piece` feeds
them; the pieces that only fill the sink and window run without gradients), compressing whenever the window must
make room. Gradients flow through every compression of the stretch (the memory the last piece reads depends on all
of them) into the `<COMP>` embeddings and the LoRA. The loss is next-token NLL on every token after the first
compression, and optionally KL to the base model reading the whole stretch as plain text (the teacher that forgets
nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from transformers_ccm.data import IGNORE_INDEX, token_ids
from transformers_ccm.distillation import kl_to_teacher, teacher_logits
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.streaming import StreamingConfig
from transformers_ccm.validation import positive_int


def tokens_before_compression(streaming: StreamingConfig) -> int:
    """Tokens a fresh stream takes before its first compression (the sink and a full window)."""
    return streaming.sink_tokens + streaming.window_tokens


class StreamCollator:
    """Stacks streams of one length into `input_ids` and `labels` `(batch, length)`; labels are -100 up to and
    including the first token after the sink and window fill, whose prediction no memory has yet touched. With
    `vocabulary` (the model's number of embeddings), ids must be below it."""

    def __init__(self, streaming: StreamingConfig, vocabulary: int | None = None) -> None:
        self.streaming = streaming
        self.vocabulary = vocabulary

    def checked(self, streams: Sequence[Sequence[int]], name: str = "streams") -> list[list[int]]:
        """`streams` (named `name` in errors) as lists of token ids; raise a ValueError unless they are integer ids
        of the vocabulary, of one length long enough to compress."""
        # Streams are never tokenized here (train() gives its tokenizer to samples only): a text names that fix.
        fix = "a stream is token ids: tokenize its text first (tokenizer(text, add_special_tokens=False)['input_ids'])"
        rows = [
            token_ids(stream, None, f"{name}[{i}]", vocabulary=self.vocabulary, without_tokenizer=fix)
            for i, stream in enumerate(streams)
        ]
        lengths = {len(row) for row in rows}
        if len(lengths) != 1:
            raise ValueError(f"Stream samples must all have one length, got lengths {sorted(lengths)}.")
        length, warm = lengths.pop(), tokens_before_compression(self.streaming)
        if length < warm + 2:
            raise ValueError(
                f"Stream samples of {length} tokens never compress: the sink and window take {warm}; give samples of "
                f"at least {warm + 2} tokens (a few chunks of {self.streaming.compress_chunk} more teach the memory)."
            )
        return rows

    def __call__(self, streams: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        warm = tokens_before_compression(self.streaming)
        # Checked, not cast: torch.tensor(..., dtype=torch.long) turns 5.7 into token 5 without a word.
        input_ids = torch.tensor(self.checked(streams), dtype=torch.long)
        labels = input_ids.clone()
        labels[:, : warm + 1] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


def stream_loss(
    model: CCMForCausalLM,
    batch: dict[str, torch.Tensor],
    streaming: StreamingConfig,
    piece: int = 16,
    distill_weight: float = 0.0,
    temperature: float = 1.0,
    num_items_in_batch: torch.Tensor | int | None = None,
    teacher: CCMForCausalLM | None = None,
) -> torch.Tensor:
    """NLL (summed over `num_items_in_batch` labels when given, else the mean) of every labelled token of a
    `StreamCollator` batch, streamed through a fresh cache `piece` tokens per forward from the first token (as
    `stream_evaluation.stream_nll` streams it), plus `distill_weight` times KL(teacher over the whole stretch ||
    streamed model) at the same positions, normalized alike; the teacher is `teacher` reading plain text, by
    default `model`'s base model (see `distillation`)."""
    # 0 failed on a modulo by zero, a negative piece on an empty torch.cat, and True streamed as pieces of 1.
    if not positive_int(piece):
        raise ValueError(
            f"piece (TrainingRecipe.stream_piece, ccm train --stream-piece) must be a positive integer, got {piece!r}."
        )
    input_ids, labels = batch["input_ids"], batch["labels"]
    warm = tokens_before_compression(streaming)
    cache = model.new_cache(input_ids.shape[0], streaming=streaming)
    cache._keeps_graph = True  # the loss of each piece reaches the compressions of the pieces before
    # The pieces are `stream_nll`'s: `piece` tokens from the stream's first, the last one taking the final token (it
    # predicts nothing) along where it falls in it. Begun right after the fill (152 tokens by default, 9.5 pieces of
    # 16) and stopped short of the final token, they made room, and compressed, at other tokens than stream-eval does:
    # the loss was not the perplexity it measures. The piece that completes the fill also predicts unlabelled tokens.
    start = warm - warm % piece
    if start:
        with torch.no_grad():  # nothing of the adapter runs before the first compression
            model(input_ids=input_ids[:, :start], past_key_values=cache, logits_to_keep=1)
    length = input_ids.shape[1]
    pieces = [input_ids[:, first : first + piece] for first in range(start, length - 1, piece)]
    every = torch.cat([model(input_ids=tokens, past_key_values=cache).logits for tokens in pieces], dim=1)
    logits = every[:, warm - start : length - 1 - start].float()
    targets = labels[:, warm + 1 :]
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    loss = nll / (num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum())
    if distill_weight:
        streamed = torch.arange(warm, length - 1, device=input_ids.device)
        target = teacher_logits(model, teacher, input_ids, streamed)
        supervised = targets != IGNORE_INDEX
        loss = loss + distill_weight * kl_to_teacher(
            logits[supervised], target[supervised], temperature, num_items_in_batch
        )
    return loss
