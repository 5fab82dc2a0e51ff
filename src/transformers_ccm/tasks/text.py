"""Long general text for streaming: the Python language reference that ships with every Python.

`pydoc_data.topics` (the text behind `help("if")`, `help("assignment")`, ...) is real English prose with
code, about 110k SmolLM2 tokens in all. Topics are split by identity (a hash of their name, as the word
lists are); a text that several names share is held out if any of them is, so the held-out stream is text
training never saw.
"""

from __future__ import annotations

import random
from pydoc_data.topics import topics

from transformers_ccm.data import OnlineSample, Tokenizer
from transformers_ccm.tasks.vocabulary import SPLITS, Split, in_test_split


def long_text(split: Split) -> str:
    """The topics of `split`, in name order, one after another."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    held_out = {topics[name].strip() for name in topics if in_test_split(name)}
    texts = dict.fromkeys(topics[name].strip() for name in sorted(topics))
    return "\n\n".join(text for text in texts if (text in held_out) == (split == "test"))


def stream_samples(
    tokenizer: Tokenizer,
    split: Split,
    count: int,
    seed: int = 0,
    chunk: int = 64,
    max_chunks: int = 4,
    max_window: int = 84,
    output: int = 64,
) -> list[OnlineSample]:
    """Samples laid out as a stream sees them: `1..max_chunks` compressed chunks of `chunk` tokens, then up to
    `max_window` tokens kept as they are (the input), then `output` tokens to predict, cut from `long_text`."""
    ids = tokenizer(long_text(split), add_special_tokens=False)["input_ids"]
    rng = random.Random(f"text:{split}:{seed}")
    samples = []
    for _ in range(count):
        chunks, window = rng.randint(1, max_chunks), rng.randint(1, max_window)
        length = chunks * chunk + window + output
        if length > len(ids):
            raise ValueError(f"The {split} text has {len(ids)} tokens, fewer than a sample needs ({length}).")
        start = rng.randrange(len(ids) - length + 1)
        contexts = [ids[start + j * chunk : start + (j + 1) * chunk] for j in range(chunks)]
        middle = start + chunks * chunk
        samples.append(
            OnlineSample(contexts, ids[middle : middle + window], ids[middle + window : middle + window + output])
        )
    return samples
