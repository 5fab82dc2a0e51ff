"""Built-in online tasks mirroring the paper's applications, and the JSONL format for your own.

Every family is deterministic by seed and split by identity: test tasks, users and dialogues are built
from word-list items that training never sees. Every family is written in many wordings; some wordings are
held out of training and appear only in the test split (`wordings="unseen"`).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.chat_template import TurnFormat
from transformers_ccm.data import OnlineSample, Tokens, check_sample, sample_entries, token_ids
from transformers_ccm.files import replace_file
from transformers_ccm.json_reading import parse_json, read_regular_file
from transformers_ccm.tasks import dialogue, document, grouping, icl, people, personalization
from transformers_ccm.tasks.vocabulary import SPLITS, Split
from transformers_ccm.tasks.wordings import (
    WORDING_SETS,
    Built,
    TaskSample,
    WordingSet,
    chat_format,
    check_wording_set,
    select,
)
from transformers_ccm.validation import check_sample_count, first_repeated, positive_int

# (rng, split, time steps, wording, the turns chat wordings are written in) -> a sample and its items
Generator = Callable[[random.Random, Split, int, Any, TurnFormat], Built]

TASKS: dict[str, Generator] = {
    "icl": icl.icl_sample,
    "personalization": personalization.personalization_sample,
    "dialogue": dialogue.dialogue_sample,
    "chat": dialogue.dialogue_sample,
    "document": document.document_sample,
    "people": people.people_sample,
    "grouping": grouping.grouping_sample,
}
WORDINGS: dict[str, Sequence[Any]] = {
    "icl": icl.WORDINGS,
    "personalization": personalization.WORDINGS,
    "dialogue": dialogue.WORDINGS,
    "chat": dialogue.CHAT_WORDINGS,
    "document": document.WORDINGS,
    "people": people.WORDINGS,
    "grouping": grouping.WORDINGS,
}
# How each family is scored, and the time steps the paper reports for it.
METRIC = {
    "icl": "accuracy",
    "personalization": "accuracy",
    "dialogue": "perplexity",
    "chat": "perplexity",
    "document": "perplexity",
    "people": "accuracy",
    "grouping": "accuracy",
}
EVAL_STEPS = {
    "icl": (1, 2, 4, 8, 16),
    "personalization": (1, 2, 4, 8, 16),
    "dialogue": (1, 2, 4, 8, 12),
    "chat": (1, 2, 4, 8),
    "document": (1, 2, 4, 8),
    "people": (1, 2, 4, 8),
    "grouping": (1, 2, 4, 8, 16),
}
MAX_STEPS = {"icl": 16, "personalization": 16, "dialogue": 12, "chat": 8, "document": 8, "people": 8, "grouping": 16}
MIXTURE = "mixture"
# The families "mixture" takes in turn: the paper's applications and general text. Later families join weighted
# mixtures by name ("people:1,dialogue:2"), so that "mixture" keeps giving the samples it always gave.
MIXTURE_FAMILIES = ("icl", "personalization", "dialogue", "chat", "document")


def mixture_weights(task: str) -> dict[str, int]:
    """How many samples of each family come in turn in `task`: a family alone, "mixture" (every family once),
    or a weighted mixture written "icl:3,dialogue:1" (three ICL samples, then one dialogue, and again)."""
    if task == MIXTURE:
        return dict.fromkeys(MIXTURE_FAMILIES, 1)
    if ":" not in task:
        return {_check_task(task): 1}
    weights: dict[str, int] = {}
    for part in task.split(","):
        family, _, weight = (word.strip() for word in part.partition(":"))
        if not weight.isdigit() or int(weight) < 1 or family in weights:
            raise ValueError(
                f"Cannot read the mixture {task!r} at {part!r}: write each family once with a positive whole "
                'weight, such as "icl:3,personalization:1,dialogue:1".'
            )
        weights[_check_task(family)] = int(weight)
    return weights


def wording_ids(task: str, wordings: WordingSet = "all") -> list[str]:
    """The ids of the wordings of `task` (a family or a mixture of them) in the set `wordings`."""
    families = list(mixture_weights(task))
    return [
        w.id
        for family in families
        for w in WORDINGS[family]
        if wordings == "all" or w.held_out == (wordings == "unseen")
    ]


def has_unseen_wordings(task: str) -> bool:
    """Whether some wordings of `task` are held out of training."""
    return bool(wording_ids(task, "unseen"))


def make_task_samples(
    task: str,
    split: Split,
    count: int,
    seed: int = 0,
    steps: int | None = None,
    wordings: WordingSet | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[TaskSample]:
    """`count` samples of a built-in task (a family of `TASKS`, "mixture" of the first five, or a
    weighted mixture such as "icl:3,dialogue:1"; see `mixture_weights`), each with its wording id and the
    word-list items it uses.

    With `steps=None` each sample has a random number of contexts (1 to the family's maximum); otherwise
    exactly `steps`. `wordings` picks the surface forms: "seen" (the default for training; the only set
    training accepts), "unseen" (held out of training) or "all" (the default for the test split). A mixture
    asking for unseen wordings draws from the families that have some.

    Chat wordings are written in the chat template of `tokenizer` (the model's, as `ccm chat` talks to it), and in
    ChatML (SmolLM2's template) without a tokenizer or a template `ccm chat` can use (`wordings.chat_format`);
    only those turns differ between tokenizers. The same arguments always give the same samples.
    """
    weights = mixture_weights(task)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    # `ccm eval --steps` refuses these; from Python a float failed inside `range` with a bare TypeError, and 0 or -1
    # gave samples of no context (of one, for dialogue) rather than the time step asked for.
    check_sample_count(count)
    if steps is not None and not positive_int(steps):
        raise ValueError(f"steps must be a positive integer (contexts per sample) or None, got {steps!r}.")
    which = check_wording_set(split, wordings)
    if len(weights) > 1 and which == "unseen":
        weights = {family: weight for family, weight in weights.items() if has_unseen_wordings(family)}
    families = [family for family, weight in weights.items() for _ in range(weight)]
    pools = {family: select(family, WORDINGS[family], which) for family in weights}
    chat = chat_format(tokenizer)
    rng = random.Random(f"{task}:{split}:{seed}:{steps}:{which}")
    samples = []
    for index in range(count):
        family = families[index % len(families)]
        sample_steps = steps if steps is not None else rng.randint(1, MAX_STEPS[family])
        wording = rng.choice(pools[family])
        sample, items = TASKS[family](rng, split, sample_steps, wording, chat)
        samples.append(TaskSample(sample, family, wording.id, wording.held_out, items))
    return samples


def make_samples(
    task: str,
    split: Split,
    count: int,
    seed: int = 0,
    steps: int | None = None,
    wordings: WordingSet | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[OnlineSample]:
    """The samples of `make_task_samples` without their provenance."""
    return [built.sample for built in make_task_samples(task, split, count, seed, steps, wordings, tokenizer)]


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(
            f"Unknown task {task!r}; choose one of {[*TASKS, MIXTURE]}, a weighted mixture such as "
            '"icl:3,dialogue:1", or pass a JSONL file.'
        )
    return task


def save_jsonl(samples: Iterable[OnlineSample], path: str | os.PathLike[str]) -> None:
    """Write samples as JSON lines `{"contexts": [...], "input": ..., "output": ..., "choices": [...]}`. The file
    is replaced whole: `samples` that fail part way (a generator that raises) keep the file that was there. A pipe or
    a device (`/dev/stdout`) is written to as it is."""

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as file:
            for index, sample in enumerate(samples):
                where = f"samples[{index}]"
                check_sample(sample, where)
                record = {
                    "contexts": _entries_as_json(sample.contexts, f"{where}.contexts"),
                    "input": _as_json(sample.input, f"{where}.input"),
                    "output": None if sample.output is None else _as_json(sample.output, f"{where}.output"),
                }
                if sample.choices is not None:
                    record["choices"] = _entries_as_json(sample.choices, f"{where}.choices")
                file.write(json.dumps(record, ensure_ascii=False) + "\n")

    # A pipe or a device takes a stream; so does /dev/stdout redirected to a file, which a rename would unlink.
    if os.path.abspath(path).startswith("/dev/") or (os.path.exists(path) and not os.path.isfile(path)):
        write(os.fspath(path))
    else:
        replace_file(path, write)


def _as_json(tokens: Tokens, where: str) -> str | list[int]:
    """A sample's field as a JSONL line holds it: a string, or its token ids as a list (a tensor or NumPy ids, which an
    `OnlineSample` may hold, failed in `json.dumps` with "Object of type Tensor is not JSON serializable")."""
    return tokens if isinstance(tokens, str) else token_ids(tokens, None, where, empty_ok=True)


def _entries_as_json(entries: object, where: str) -> list[str | list[int]]:
    """A sample's `contexts` or `choices` (`where`) as a JSONL line holds them."""
    return [_as_json(entry, f"{where}[{j}]") for j, entry in enumerate(sample_entries(entries, where))]


def load_jsonl(path: str | os.PathLike[str]) -> list[OnlineSample]:
    """Read samples written by `save_jsonl` (or by hand): one JSON object per line, strings or token ids."""
    return load_jsonl_rows(path)[0]


def load_jsonl_rows(path: str | os.PathLike[str]) -> tuple[list[OnlineSample], list[int]]:
    """`load_jsonl(path)` and the line number (from 1) of each sample in the file, to name a sample that a model
    refuses by its line: blank lines are skipped."""
    samples, rows = [], []
    # A pipe or a device is refused, not read: it blocked until a writer came, and /dev/zero filled the memory.
    content = read_regular_file(path, "give a JSONL file of samples.")
    try:  # a byte-order mark, as some editors write one, is not part of the first line
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error}); save it as UTF-8.") from None
    # Lines end at "\n", "\r\n" or "\r", which a JSON string cannot hold unescaped; splitlines() also split at U+2028,
    # U+2029 and U+0085, which JSON strings may hold as they are, and save_jsonl writes them so.
    for number, line in enumerate(re.split(r"\r\n?|\n", text), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path}:{number}", "write one JSON object per line.")
        if not isinstance(record, dict) or "contexts" not in record or "input" not in record:
            raise ValueError(f"{path}:{number} needs an object with 'contexts' (a list) and 'input'.")
        if not isinstance(record["contexts"], list):
            raise ValueError(f"{path}:{number}: 'contexts' must be a list, got {type(record['contexts']).__name__}.")
        unknown = sorted(set(record) - {"contexts", "input", "output", "choices"})
        if unknown:
            raise ValueError(f"{path}:{number} has unknown fields {unknown}.")
        _check_record(record, f"{path}:{number}")
        samples.append(OnlineSample(record["contexts"], record["input"], record.get("output"), record.get("choices")))
        rows.append(number)
    if not samples:
        raise ValueError(f"{path} holds no samples.")
    return samples, rows


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
    # Token-id lists as tuples, to be hashed; the one listed twice is named as the line gives it.
    repeated = first_repeated(choice if isinstance(choice, str) else tuple(choice) for choice in choices)
    if repeated is not None:
        shown = repeated if isinstance(repeated, str) else list(repeated)
        raise ValueError(f"{where}: the choice {shown!r:.40} is listed twice; list each choice once.")


__all__ = [
    "EVAL_STEPS",
    "METRIC",
    "MIXTURE",
    "TASKS",
    "WORDINGS",
    "WORDING_SETS",
    "TaskSample",
    "has_unseen_wordings",
    "load_jsonl",
    "make_samples",
    "make_task_samples",
    "mixture_weights",
    "save_jsonl",
    "wording_ids",
]
