"""Built-in online tasks mirroring the paper's applications, and the JSONL format for your own.

Every family is deterministic by seed and split by identity: test tasks, users and dialogues are built
from word-list items that training never sees.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from transformers_ccm.data import OnlineSample
from transformers_ccm.tasks.dialogue import dialogue_sample
from transformers_ccm.tasks.icl import icl_sample
from transformers_ccm.tasks.personalization import personalization_sample
from transformers_ccm.tasks.vocabulary import SPLITS, Split

Generator = Callable[[random.Random, Split, int], OnlineSample]

TASKS: dict[str, Generator] = {
    "icl": icl_sample,
    "personalization": personalization_sample,
    "dialogue": dialogue_sample,
}
# How each family is scored, and the time steps the paper reports for it.
METRIC = {"icl": "accuracy", "personalization": "accuracy", "dialogue": "perplexity"}
EVAL_STEPS = {"icl": (1, 2, 4, 8, 16), "personalization": (1, 2, 4, 8, 16), "dialogue": (1, 2, 4, 8, 12)}
MAX_STEPS = {"icl": 16, "personalization": 16, "dialogue": 12}
MIXTURE = "mixture"


def make_samples(task: str, split: Split, count: int, seed: int = 0, steps: int | None = None) -> list[OnlineSample]:
    """`count` samples of a built-in task ("icl", "personalization", "dialogue" or "mixture").

    With `steps=None` each sample has a random number of contexts (1 to the family's maximum); otherwise
    exactly `steps`. The same arguments always give the same samples.
    """
    if task != MIXTURE and task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose one of {[*TASKS, MIXTURE]} or pass a JSONL file.")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    rng = random.Random(f"{task}:{split}:{seed}:{steps}")
    samples = []
    for index in range(count):
        family = list(TASKS)[index % len(TASKS)] if task == MIXTURE else task
        sample_steps = steps if steps is not None else rng.randint(1, MAX_STEPS[family])
        samples.append(TASKS[family](rng, split, sample_steps))
    return samples


def save_jsonl(samples: Iterable[OnlineSample], path: str | os.PathLike[str]) -> None:
    """Write samples as JSON lines `{"contexts": [...], "input": ..., "output": ..., "choices": [...]}`."""
    with open(path, "w", encoding="utf-8") as file:
        for sample in samples:
            record = {"contexts": list(sample.contexts), "input": sample.input, "output": sample.output}
            if sample.choices is not None:
                record["choices"] = list(sample.choices)
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


def load_jsonl(path: str | os.PathLike[str]) -> list[OnlineSample]:
    """Read samples written by `save_jsonl` (or by hand): one JSON object per line, strings or token ids."""
    samples = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON ({error}).") from None
        if not isinstance(record, dict) or "contexts" not in record or "input" not in record:
            raise ValueError(f"{path}:{number} needs an object with 'contexts' (a list) and 'input'.")
        if not isinstance(record["contexts"], list):
            raise ValueError(f"{path}:{number}: 'contexts' must be a list, got {type(record['contexts']).__name__}.")
        unknown = sorted(set(record) - {"contexts", "input", "output", "choices"})
        if unknown:
            raise ValueError(f"{path}:{number} has unknown fields {unknown}.")
        _check_record(record, f"{path}:{number}")
        samples.append(OnlineSample(record["contexts"], record["input"], record.get("output"), record.get("choices")))
    if not samples:
        raise ValueError(f"{path} holds no samples.")
    return samples


_TOKENS = "a string or a list of token ids (integers >= 0)"


def _is_tokens(value: object, empty_ok: bool = False) -> bool:
    if isinstance(value, str):
        return empty_ok or bool(value)
    return (
        isinstance(value, list)
        and (empty_ok or bool(value))
        and all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in value)
    )


def _check_record(record: dict, where: str) -> None:
    """Raise, naming the line and the field, unless every field of a JSONL record has the expected form."""
    for index, context in enumerate(record["contexts"]):
        if not _is_tokens(context):
            raise ValueError(f"{where}: contexts[{index}] must be {_TOKENS}, not empty; got {context!r:.80}.")
    if not _is_tokens(record["input"]):
        raise ValueError(f"{where}: 'input' must be {_TOKENS}, not empty; got {record['input']!r:.80}.")
    output = record.get("output")
    if output is not None and not _is_tokens(output, empty_ok=True):
        raise ValueError(f"{where}: 'output' must be {_TOKENS} (or null); got {output!r:.80}.")
    choices = record.get("choices")
    if choices is None:
        return
    if not isinstance(choices, list) or not choices or not all(_is_tokens(choice) for choice in choices):
        raise ValueError(f"{where}: 'choices' must be a non-empty list of {_TOKENS}; got {choices!r:.80}.")
    if output is not None and output not in choices:
        raise ValueError(f"{where}: the output {output!r:.40} is not among the choices; add it to 'choices'.")


__all__ = ["EVAL_STEPS", "METRIC", "MIXTURE", "TASKS", "load_jsonl", "make_samples", "save_jsonl"]
