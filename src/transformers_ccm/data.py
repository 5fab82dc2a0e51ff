"""Online samples and the collator that lays them out for the parallel training forward."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from numbers import Integral
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.config import CCMConfig
from transformers_ccm.masks import sample_layout
from transformers_ccm.validation import check_setting, is_int, positive_int
from transformers_ccm.wrapping import uniform_rotation_positions

if TYPE_CHECKING:
    from transformers_ccm.modeling import CCMForCausalLM

Tokens = Sequence[int] | torch.Tensor | str

IGNORE_INDEX = -100


def predicting_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions `(n,)` whose next token has a label in some row of `labels` `(batch, len)`: position p
    predicts the label at p + 1, so the LM head (and distillation) need run only there."""
    return (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(-1)


class Tokenizer(Protocol):
    """What reads a string field: called with one string, it returns its ids under "input_ids" (a transformers
    tokenizer, or a function of one string)."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...


# A tokenizer's remedy in the error for a string without one: the collator's, unless a caller names its own.
_GIVE_COLLATOR_A_TOKENIZER = "give CCMDataCollator a tokenizer, or pass token ids"


def token_ids(
    tokens: Tokens,
    tokenizer: Tokenizer | None,
    where: str,
    empty_ok: bool = False,
    vocabulary: int | None = None,
    without_tokenizer: str = _GIVE_COLLATOR_A_TOKENIZER,
) -> list[int]:
    """`tokens` as a list of ids (strings through `tokenizer`, without special tokens); `where` names them in
    errors, `without_tokenizer` the fix for a string given without a tokenizer. With `vocabulary` (the model's number
    of embeddings), ids must be below it."""
    if isinstance(tokens, str):
        if tokenizer is None:
            raise ValueError(f"{where} is a string; {without_tokenizer}.")
        ids = list(tokenizer(tokens, add_special_tokens=False)["input_ids"])
    elif isinstance(tokens, (bytes, bytearray)):
        # A sequence of ints to Python (and to a type checker, `Sequence[int]`): text read in binary mode was taken
        # for token ids, its byte values, without a word.
        raise ValueError(
            f"{where} is {type(tokens).__name__}, neither a string nor token ids; decode text to a string "
            "(data.decode('utf-8')), or pass byte values meant as token ids as list(data)."
        )
    else:
        # Checked, not cast: int(5.7) would silently train on another token, and -1 or an id past the vocabulary
        # would fail inside the embedding with torch's IndexError.
        if isinstance(tokens, torch.Tensor):
            # One row, as a tokenizer's return_tensors="pt" gives it; the rows of a batch were run together as one.
            if tokens.dim() != 1 and not (tokens.dim() == 2 and tokens.shape[0] == 1):
                raise ValueError(
                    f"{where} is a tensor of shape {tuple(tokens.shape)}; give one sequence of token ids: shape (n,) "
                    "or (1, n)."
                )
            if tokens.is_meta:  # holds no ids to read
                raise ValueError(f"{where} is a tensor on the meta device, which holds no values; pass its token ids.")
            integral = not tokens.is_floating_point() and not tokens.is_complex() and tokens.dtype != torch.bool
            ids = tokens.reshape(-1).tolist()
        elif not isinstance(tokens, Iterable) or isinstance(tokens, (set, frozenset, Mapping)):
            # A lone id or None failed with "'int' object is not iterable"; a set gave its ids in any order.
            raise ValueError(
                f"{where} must be a string or a sequence of token ids, got {type(tokens).__name__} {tokens!r:.80}."
            )
        else:
            ids = list(tokens)
            integral = all(isinstance(token, Integral) and not isinstance(token, bool) for token in ids)
        if not integral:
            raise ValueError(f"{where} must hold integer token ids (or be a string), got {tokens!r:.80}.")
        ids = [int(token) for token in ids]
    # Ids from a tokenizer too: another model's may give ids past this one's vocabulary. Without one, ids must fit the
    # batch's int64 tensors (a larger one failed there with "Overflow when unpacking long long", naming no sample).
    end = vocabulary if vocabulary is not None else 2**63
    wrong = [token for token in ids if not 0 <= token < end]
    if wrong:
        limit = f"0..{vocabulary - 1}" if vocabulary is not None else "ids 0..2**63 - 1, int64"
        raise ValueError(
            f"{where} holds the token id {wrong[0]}, outside the model's vocabulary ({limit}); tokenize with "
            "this model's tokenizer."
        )
    if not ids and not empty_ok:
        # A text the tokenizer reads as nothing (a BERT-style tokenizer drops control and zero-width characters) is not
        # what the user calls empty.
        text = isinstance(tokens, str) and tokens
        what = f"is the text {tokens!r:.60}, which the tokenizer reads as no token" if text else "is empty"
        raise ValueError(f"{where} {what}: every context and every input needs at least one token.")
    return ids


def padding_id(tokenizer: Any, vocabulary: int) -> int:
    """The id written at padding positions for a model of `vocabulary` embeddings: `tokenizer`'s pad token where the
    model can embed it, else 0 (also without a tokenizer or pad token). Padding is embedded, then masked, so any id the
    model embeds gives the same outputs; a pad token added to the tokenizer past the model's embeddings (Llama's
    `add_special_tokens({"pad_token": "[PAD]"})` without resizing them) failed inside the embedding."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if is_int(pad) and 0 <= pad < vocabulary else 0


def check_sample(sample: Any, where: str) -> None:
    """Raise a TypeError naming `where` unless `sample` is an `OnlineSample` (a dict of its fields failed with an
    AttributeError)."""
    if not isinstance(sample, OnlineSample):
        raise TypeError(
            f"{where} is a {type(sample).__name__}, not an OnlineSample; build it with OnlineSample(contexts, input, "
            "output) (a JSONL file: transformers_ccm.tasks.load_jsonl)."
        )


def sample_entries(value: Any, where: str) -> list[Tokens]:
    """A sample's `contexts` or `choices` as a list, one entry (a string or token ids) each; raise a ValueError naming
    `where` unless it is such a list. One string or one list of ids (an entry without its list) was read as one entry
    per character or per id, and an unordered collection gave its entries in any order."""
    if isinstance(value, str) or (isinstance(value, torch.Tensor) and value.dim() != 2):
        raise ValueError(
            f"{where} is a single {type(value).__name__}; give a list, each entry a string or token ids (e.g. [text] "
            "for one)."
        )
    if not isinstance(value, Iterable) or isinstance(value, (set, frozenset, Mapping)):
        raise ValueError(f"{where} must be a list, each entry a string or token ids; got {type(value).__name__}.")
    items = list(value)
    if any(isinstance(item, Integral) for item in items):
        raise ValueError(
            f"{where} holds token ids, not a list of them; give a list of token-id lists, e.g. [[5, 6, 7]] for one."
        )
    return items


def check_position_limit(positions: int, limit: int | None, where: str) -> None:
    """Raise a ValueError naming `where` if `positions` positions (0 .. positions - 1) pass a model's `limit` learned
    absolute positions (`CCMForCausalLM.absolute_position_limit`; None: no limit)."""
    if limit is not None and positions > limit:
        raise ValueError(
            f"{where} reaches position {positions - 1}, past the model's {limit} learned absolute positions; shorten "
            "its contexts, input or output."
        )


@dataclass
class OnlineSample:
    """One online-inference example at time step `t = len(contexts)`.

    `contexts[j]` is `c(j+1)` (for a dialogue: the previous turn), `input` is `I(t)` and `output` is `O(t)`;
    each is a list of token ids, a tensor of shape `(n,)` or `(1, n)`, or a string (then the collator needs a
    tokenizer). `contexts` (and `choices`) is a list of them, even for one: `[text]`, never `text`.
    `output=None` gives a sample to score or evaluate, with no loss. `choices` (one of them the output) are
    the candidates of a multiple-choice evaluation; training ignores them.
    """

    contexts: Sequence[Tokens]
    input: Tokens
    output: Tokens | None = None
    choices: Sequence[Tokens] | None = None


Supervision = Literal["output", "dense"]
SUPERVISION: tuple[str, ...] = ("output", "dense")
Layout = Literal["ccm", "full_context"]
LAYOUTS: tuple[str, ...] = ("ccm", "full_context")


class CCMDataCollator:
    """Turns `OnlineSample`s into one right-padded batch `[c(1) <COMP> ... c(t) <COMP> I(t) O(t)]`.

    The batch holds `input_ids`, `segment_ids`, `comp_mask`, `position_ids` (all `(batch, seq)`) and, when
    any sample has an output (or with dense supervision, a second context), `labels` (-100 where no loss
    applies). Ids at `<COMP>` and padding positions are `pad_token_id`: no output depends on them.

    Args:
        tokenizer: reads the samples' string fields (a transformers tokenizer, or any `Tokenizer`: a function of one
            string that returns its ids under "input_ids"); None: samples of token ids only.
        pad_token_id: the id written there, one the model can embed (padding positions are embedded, then masked);
            None (a tokenizer without a pad token): 0.
        supervision: `"output"` (the paper): next-token loss on `O(t)` only. `"dense"`: also on every token of
            every context `c(j)`, `j >= 2`, but its first, which in the parallel forward see only `Mem(j-1)` and
            the context itself, so the memory is trained to predict what comes next (AutoCompressors,
            Activation Beacon). A context's first token has no label: nothing of its own segment precedes it.
        layout: `"ccm"` (above), or `"full_context"`: each sample as one plain prompt `[c(1) ... c(t) I(t) O(t)]`
            (one segment, no `<COMP>`, ordinary positions) with the same labels as `"ccm"`, for the fine-tuned
            full-context baseline (`transformers_ccm.baseline`).
        pad_to_multiple_of: right-pad every batch to a multiple of this many positions, so a compiled attention
            kernel sees a few sequence lengths instead of one per batch. None: pad to the longest sample.
    """

    def __init__(
        self,
        model: CCMForCausalLM | CCMConfig,
        tokenizer: Tokenizer | None = None,
        pad_token_id: int | None = 0,
        supervision: Supervision = "output",
        layout: Layout = "ccm",
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if pad_to_multiple_of is not None:  # a float or a bool failed only at the first batch, inside the padding
            check_setting(
                "CCMDataCollator", pad_to_multiple_of, "pad_to_multiple_of", "a positive integer, or None", positive_int
            )
        if supervision not in SUPERVISION:
            raise ValueError(f"supervision must be one of {SUPERVISION}, got {supervision!r}.")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
        self.config = model if isinstance(model, CCMConfig) else model.config
        # Known from a model: ids outside its vocabulary are refused when a sample is read, naming the sample.
        self.vocabulary: int | None = getattr(model, "vocabulary_size", None)
        pad_token_id = 0 if pad_token_id is None else pad_token_id
        vocabulary = self.vocabulary
        allowed = "an integer >= 0" if vocabulary is None else f"an integer in 0..{vocabulary - 1} (the vocabulary)"
        check_setting(
            "CCMDataCollator",
            pad_token_id,
            "pad_token_id",
            f"{allowed}, or None",
            lambda v: is_int(v) and v >= 0 and (vocabulary is None or v < vocabulary),
        )
        # Known from a model with learned absolute positions: a longer sample is refused when read, not inside the
        # embedding at whichever training step draws it.
        self.position_limit: int | None = getattr(model, "absolute_position_limit", None)
        # Known from a model whose rotary embedding sets its frequencies by a forward's last position (dynamic NTK,
        # LongRoPE): a longer sample is refused when read, as the CCM forward would not compute what inference does.
        base_model = getattr(model, "base_model", None)
        self.rotation_limit = None if base_model is None else uniform_rotation_positions(base_model)
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.supervision = supervision
        self.layout = layout
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[OnlineSample]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("CCMDataCollator got an empty list of samples.")
        rows = [self._row(index, sample) for index, sample in enumerate(samples)]
        length = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            key: torch.tensor([row[key] + [fill] * (length - len(row[key])) for row in rows], dtype=dtype)
            for key, fill, dtype in (
                ("input_ids", self.pad_token_id, torch.long),
                ("segment_ids", 0, torch.long),
                ("comp_mask", False, torch.bool),
                ("position_ids", 0, torch.long),
                ("labels", IGNORE_INDEX, torch.long),
            )
        }
        if (batch["labels"] == IGNORE_INDEX).all() and all(sample.output is None for sample in samples):
            del batch["labels"]
        return batch

    def tokenized(self, samples: Sequence[OnlineSample], name: str = "samples") -> list[OnlineSample]:
        """`samples` with their contexts, inputs and outputs as token ids (from one batched call of a transformers
        tokenizer, or one call per string of any other `Tokenizer`): batches of them skip tokenization. Without a
        tokenizer, strings stay (collating them then names the problem). Errors name a sample as `name[index]`."""
        for index, sample in enumerate(samples):
            check_sample(sample, f"{name}[{index}]")
        contexts = [sample_entries(s.contexts, f"{name}[{index}].contexts") for index, s in enumerate(samples)]
        strings = list(
            dict.fromkeys(
                text
                for sample, entries in zip(samples, contexts, strict=True)
                for text in (*entries, sample.input, sample.output)
                if isinstance(text, str)
            )
        )
        if not strings or self.tokenizer is None:
            return list(samples)
        if isinstance(self.tokenizer, PreTrainedTokenizerBase):  # one call: a fast tokenizer reads the batch at once
            read = self.tokenizer(strings, add_special_tokens=False)["input_ids"]
        else:  # a `Tokenizer` of one string, as collating calls it: given the list, it failed inside or read one text
            read = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in strings]
        ids = dict(zip(strings, read, strict=True))

        def as_ids(tokens: Tokens) -> Tokens:
            # A text read as no token stays text, for the error that names it to quote it (not to call it empty).
            return list(ids[tokens]) if isinstance(tokens, str) and ids[tokens] else tokens

        return [
            replace(
                sample,
                contexts=[as_ids(context) for context in entries],
                input=as_ids(sample.input),
                output=None if sample.output is None else as_ids(sample.output),
            )
            for sample, entries in zip(samples, contexts, strict=True)
        ]

    def sequence_length(self, sample: OnlineSample, index: int = 0, name: str = "samples") -> int:
        """The positions `sample` (`name[index]`, for errors) takes in a batch before padding."""
        contexts, inputs, outputs = self._token_lists(index, sample, name)
        comp = 0 if self.layout == "full_context" else self.config.num_comp_tokens
        return sum(len(context) + comp for context in contexts) + len(inputs) + len(outputs)

    def supervised_tokens(self, sample: OnlineSample, index: int = 0, name: str = "samples") -> int:
        """How many tokens of `sample` (`name[index]`, for errors) get a label: its output, and with dense
        supervision every context's tokens after its first from the second context on."""
        contexts, _, outputs = self._token_lists(index, sample, name)
        dense = sum(len(context) - 1 for context in contexts[1:]) if self.supervision == "dense" else 0
        return len(outputs) + dense

    def _token_lists(
        self, index: int, sample: OnlineSample, name: str = "samples"
    ) -> tuple[list[list[int]], list[int], list[int]]:
        """The token ids of the sample's contexts, input and output (none without an output); errors name the sample
        `name[index]` (train() has two lists of them)."""
        where = f"{name}[{index}]"
        check_sample(sample, where)
        vocabulary = self.vocabulary
        contexts = [
            token_ids(context, self.tokenizer, f"{where}.contexts[{j}]", vocabulary=vocabulary)
            for j, context in enumerate(sample_entries(sample.contexts, f"{where}.contexts"))
        ]
        inputs = token_ids(sample.input, self.tokenizer, f"{where}.input", vocabulary=vocabulary)
        outputs = (
            []
            if sample.output is None
            else token_ids(sample.output, self.tokenizer, f"{where}.output", empty_ok=True, vocabulary=vocabulary)
        )
        # Ordinary tokens are numbered consecutively; the <COMP> block after the last context follows its end.
        context_tokens = sum(map(len, contexts))
        comp = self.config.num_comp_tokens if contexts and self.layout == "ccm" else 0
        positions = max(context_tokens + len(inputs) + len(outputs), context_tokens + comp)
        check_position_limit(positions, self.position_limit, where)
        if self.layout == "ccm" and self.rotation_limit is not None and positions > self.rotation_limit:
            # One forward over the whole sample rotated every position with the rescaled (dynamic NTK) or long
            # (LongRoPE) frequencies of its length, where inference compresses each context in a forward of its own,
            # with the original ones: the adapter was trained on, and its loss measured on, another computation.
            raise ValueError(
                f"{where} reaches position {positions - 1}, past the model's original context of "
                f"{self.rotation_limit} positions, beyond which its rotary embedding rotates every position of a "
                "forward with other frequencies than inference compresses each context with; shorten its contexts, "
                "input or output, or split it into samples of fewer contexts."
            )
        return contexts, inputs, outputs

    def _row(self, index: int, sample: OnlineSample) -> dict[str, list[Any]]:
        n = self.config.num_comp_tokens
        contexts, inputs, outputs = self._token_lists(index, sample)
        layout = sample_layout([len(c) for c in contexts], len(inputs) + len(outputs), n)
        input_ids: list[int] = []
        labels: list[int] = []
        for step, context in enumerate(contexts, start=1):
            input_ids += context + [self.pad_token_id] * n
            supervised = self.supervision == "dense" and step >= 2
            labels += [IGNORE_INDEX, *context[1:]] if supervised else [IGNORE_INDEX] * len(context)
            labels += [IGNORE_INDEX] * n
        input_ids += inputs + outputs
        labels += [IGNORE_INDEX] * len(inputs) + outputs
        if self.layout == "full_context":
            # Same tokens and labels, without the <COMP> blocks: the ordinary positions are already consecutive.
            ordinary = [not comp for comp in layout.comp_mask]
            input_ids = [token for token, keep in zip(input_ids, ordinary, strict=True) if keep]
            labels = [label for label, keep in zip(labels, ordinary, strict=True) if keep]
            layout = sample_layout([], len(input_ids), n)
        return {
            "input_ids": input_ids,
            "segment_ids": layout.segment_ids,
            "comp_mask": layout.comp_mask,
            "position_ids": layout.position_ids,
            "labels": labels,
        }
