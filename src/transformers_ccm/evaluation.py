"""Evaluation of online tasks: no context, full context and CCM, at given time steps.

Accuracy follows the MetaICL protocol (the choice with the highest mean log-likelihood per token wins; when k
choices tie for the highest, the answer among them earns 1/k, as a random pick among them would); perplexity is
over the output tokens. Every method scores the same samples; the KV memory it needs is reported in tokens
(context part and peak) and bytes. Every score comes with a 95% interval: Wilson's for accuracy, a bootstrap over
samples for perplexity; gain recovered and the difference between two adapters get a paired bootstrap (the methods
share their samples, so one resample of samples re-scores all of them).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.data import (
    OnlineSample,
    check_position_limit,
    check_sample,
    padding_id,
    sample_entries,
    token_ids,
)
from transformers_ccm.extras import figure
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.validation import finite_number, first_repeated, positive_int

METHODS = ("no_context", "full_context", "ccm")
METRICS = ("accuracy", "perplexity")
Z_95 = 1.959963984540054  # the standard normal quantile of 0.975
BOOTSTRAP_RESAMPLES = 2000
Row = dict[str, Any]  # one result or summary row, as eval.json stores it


@dataclass
class MethodScore:
    """One method at one time step, with a 95% interval `[low, high]` of its value."""

    method: str
    steps: int
    metric: str
    value: float
    low: float
    high: float
    context_kv_tokens: float  # mean KV slots that hold the context (tokens, or <COMP> slots for CCM)
    # the most KV slots any sample needed: context (none for no context) + input + output; for CCM also memory +
    # context + <COMP> block while compressing, which a long context makes the peak
    peak_kv_tokens: int
    # the bytes of those slots at their peak, as the cache holds them (`memory_slot_bytes`): merge and EMA memory in
    # half precision also holds its float32 running average
    peak_kv_bytes: int
    samples: int
    # per sample (numerator, denominator) of the value: (credit, 1) for accuracy (1 right, 0 wrong, 1/k when the
    # answer ties with k - 1 other choices for the best score), (output NLL, output tokens) for perplexity; kept so
    # that intervals and paired comparisons can be recomputed from eval.json
    per_sample: list[tuple[float, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def wilson_interval(correct: float, total: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson's score interval of an accuracy `correct / total` (sound near 0 and 1, and for small totals);
    `correct` may hold fractional credit of tied choices."""
    if total <= 0:
        raise ValueError(f"An interval needs at least one sample, got total={total}.")
    share = correct / total
    centre = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    # The interval always holds the share (its bound is exactly 0 at none right, 1 at all right); rounding left 0 or
    # 1 a hair outside it (a high of 0.9999999999999999 below a value of 1).
    return max(0.0, min(share, centre - half)), min(1.0, max(share, centre + half))


# The most sample indices drawn at once for the bootstrap (32 MB, and twice that gathered): all its resamples at once
# took 48 bytes per resample and sample, which a report of a million per-sample scores (6 MB of JSON, given to
# `ccm eval --add-to`) turned into 100 GB.
_MOST_DRAWN = 1 << 22


def _resample_blocks(count: int, seed: int) -> Iterator[torch.Tensor]:
    """`BOOTSTRAP_RESAMPLES` rows of `count` sample indices drawn with replacement, the same for the same count and
    seed: a block of rows at a time, each of at most `_MOST_DRAWN` indices (or one row), from one generator in order."""
    generator = torch.Generator().manual_seed(seed)
    rows = max(1, _MOST_DRAWN // max(count, 1))
    for start in range(0, BOOTSTRAP_RESAMPLES, rows):
        yield torch.randint(count, (min(rows, BOOTSTRAP_RESAMPLES - start), count), generator=generator)


def _resampled_scores(tables: Sequence[Sequence[Sequence[float]]], metric: str, seed: int) -> list[torch.Tensor]:
    """`_log_score` of each of `tables` (per-sample scores of the same samples) over the resamples of
    `_resample_blocks(len(tables[0]), seed)`, the same for all of them (a paired bootstrap)."""
    converted = [torch.tensor(table, dtype=torch.float64) for table in tables]
    scores: list[list[torch.Tensor]] = [[] for _ in tables]
    for index in _resample_blocks(len(tables[0]), seed):
        for score, table in zip(scores, converted, strict=True):
            score.append(_log_score(table, metric, index))
    return [torch.cat(score) for score in scores]


def _log_score(
    per_sample: Sequence[Sequence[float]] | torch.Tensor, metric: str, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Accuracy, or minus the log-perplexity, of the samples `index` (`(..., n)`; all when None): higher is
    better, and gains are measured on this scale."""
    table = torch.as_tensor(per_sample, dtype=torch.float64)
    if index is not None:
        table = table[index]
    ratio = table[..., 0].sum(-1) / table[..., 1].sum(-1)
    return ratio if metric == "accuracy" else -ratio


def _metric_value(per_sample: Sequence[Sequence[float]], metric: str) -> float:
    """The accuracy or perplexity of all the samples, as a report gives it."""
    score = _log_score(per_sample, metric).item()
    return score if metric == "accuracy" else math.exp(-score)


def value_interval(per_sample: Sequence[Sequence[float]], metric: str) -> tuple[float, float]:
    """The 95% interval of an accuracy (Wilson) or a perplexity (percentile bootstrap over samples)."""
    if metric == "accuracy":
        return wilson_interval(sum(c for c, _ in per_sample), len(per_sample))
    log_perplexity = -_resampled_scores([per_sample], metric, seed=0)[0]
    low, high = torch.quantile(log_perplexity, torch.tensor([0.025, 0.975], dtype=torch.float64)).exp().tolist()
    return low, high


def kv_bytes_per_token(model: CCMForCausalLM) -> int:
    """Bytes of keys and values one token (or memory slot) takes over all layers."""
    config = model.base_model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # the base model's dtype, which keys and values take (<COMP> embeddings are cast to it, whatever theirs)
    return 2 * config.num_hidden_layers * heads * head_dim * model.dtype.itemsize


def memory_slot_bytes(model: CCMForCausalLM) -> int:
    """Bytes one memory slot takes over all layers, as `CompressedMemoryCache.memory_bytes()` counts them: its keys
    and values, and for merge or EMA memory in half precision their float32 running average beside them."""
    per_token = kv_bytes_per_token(model)
    if model.config.update == "concat" or model.dtype == torch.float32:
        return per_token
    return per_token + per_token * torch.float32.itemsize // model.dtype.itemsize


def _right_pad(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    return ids, mask


def _target_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, starts: list[int], ends: list[int]
) -> list[torch.Tensor]:
    """Per row, the log-probabilities of tokens `ids[start:end]`, each predicted from the position before.

    `logits` `(batch, kept, vocab)` are those of the last `kept` positions of `ids` `(batch, seq)`."""
    offset = ids.shape[1] - logits.shape[1]
    log_probs = logits.float().log_softmax(-1)
    targets = ids.to(log_probs.device)
    return [
        log_probs[row, start - 1 - offset : end - 1 - offset].gather(-1, targets[row, start:end, None])[:, 0]
        for row, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


_WITHOUT_TOKENIZER = "give score_samples a tokenizer, or pass token ids"


def check_samples(
    model: CCMForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    samples: Sequence[OnlineSample],
    method: str,
    metric: str,
) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Raise, naming the sample (`samples[i]`), unless `method` can score every one of `samples` by `metric`; return
    the token ids of each sample's contexts and of its input. `score_samples` runs it before anything is scored, and
    `ccm eval` on every sample set before any is: full context checks the longest prompts of all methods, "ccm" that
    memory can run each piece of a sample (a context, the input and an answer) within the model's positions."""
    # Every id is checked against the vocabulary before anything runs (the plain-prompt methods bypass the checks of
    # compress and the online forward).
    vocabulary = model.vocabulary_size
    most = getattr(model.base_model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    for i, sample in enumerate(samples):
        check_sample(sample, f"samples[{i}]")
    histories = [
        [
            token_ids(c, tokenizer, f"samples[{i}].contexts[{j}]", True, vocabulary, _WITHOUT_TOKENIZER)
            for j, c in enumerate(sample_entries(s.contexts, f"samples[{i}].contexts"))
        ]
        for i, s in enumerate(samples)
    ]
    questions = [
        token_ids(s.input, tokenizer, f"samples[{i}].input", True, vocabulary, _WITHOUT_TOKENIZER)
        for i, s in enumerate(samples)
    ]
    for i, sample in enumerate(samples):
        candidates = [
            token_ids(tokens, tokenizer, f"samples[{i}].output or choices", True, vocabulary, _WITHOUT_TOKENIZER)
            for tokens in (
                sample.output,
                *(sample_entries(sample.choices, f"samples[{i}].choices") if sample.choices is not None else ()),
            )
            if tokens is not None
        ]
        if not questions[i]:
            raise ValueError(
                f"samples[{i}].input is empty: no position would predict the output's first token; give the input."
            )
        # The answer is found among the choices by its tokens once a batch has run: a missing output or choice list
        # failed there with "[...] is not in list" or a TypeError, after the batches before it had been scored.
        if metric == "accuracy" and (sample.output is None or candidates[0] not in candidates[1:]):
            raise ValueError(
                f"samples[{i}] has no output among its choices: accuracy picks the best of the choices, one of which "
                "must be the output; list the output in its choices, or score the sample by perplexity."
            )
        if metric == "accuracy" and not all(candidates):  # the output is one of the choices
            raise ValueError(f"samples[{i}] has an empty choice, which has no token to score; list non-empty choices.")
        # Two choices of the same tokens always tie: the answer listed twice would earn half credit when it wins.
        twice = first_repeated(tuple(tokens) for tokens in candidates[1:]) if metric == "accuracy" else None
        if twice is not None:
            raise ValueError(
                f"samples[{i}] lists the choice {list(twice)!r:.80} (token ids) more than once; list each choice once."
            )
        if metric == "perplexity" and not (sample.output is not None and candidates[0]):
            raise ValueError(
                f"samples[{i}].output is empty: perplexity needs at least one token of it to score; give the reference "
                "text."
            )
        # A model with learned absolute positions (GPT-2) failed inside its embedding on a longer row; memory takes
        # the positions of the history it holds, as the plain prompt does.
        history = sum(map(len, histories[i])) if method != "no_context" else 0
        longest = max(map(len, candidates), default=0)
        check_position_limit(history + len(questions[i]) + longest, model.absolute_position_limit, f"samples[{i}]")
        if method == "ccm" and most is not None:
            _check_memory_pieces(histories[i], len(questions[i]) + longest, most, model.config.num_comp_tokens, i)
    return histories, questions


def _check_memory_pieces(contexts: list[list[int]], answer: int, most: int, comp: int, index: int) -> None:
    """Raise, naming `samples[index]`, unless memory can run each piece of it within a model's `most` positions: each
    context with its `comp` <COMP> tokens in one forward, and the input with its longest answer (`answer` tokens) in
    another. Positions are re-based between pieces, not within one: a longer piece failed inside compress() once every
    baseline had been scored."""
    longest = max(range(len(contexts)), key=lambda j: len(contexts[j]), default=None)
    if longest is not None and len(contexts[longest]) + comp > most:
        raise ValueError(
            f"samples[{index}].contexts[{longest}] holds {len(contexts[longest])} tokens, which with its {comp} <COMP> "
            f"tokens pass the model's {most} positions (memory compresses a context in one forward); split it into "
            f"contexts of at most {most - comp} tokens."
        )
    if answer > most:
        raise ValueError(
            f"samples[{index}]: its input and longest output or choice hold {answer} tokens, past the model's {most} "
            "positions (memory runs them in one forward after its history); shorten them."
        )


@torch.no_grad()
def score_samples(
    model: CCMForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    samples: Sequence[OnlineSample],
    method: str,
    metric: str,
    batch_size: int = 16,
) -> MethodScore:
    """Score `samples` (all with the same number of contexts) with one method; `tokenizer` reads samples written as
    text (None where every sample is token ids).

    `"no_context"` and `"full_context"` read the history (or nothing) as a plain prompt: a compression adapter
    (conditional LoRA) never acts on plain tokens, so that is its base model; an adapter with
    `conditional_lora=False` acts everywhere, so a full-context fine-tuned adapter scores as itself.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if metric not in METRICS:  # any other name was scored as perplexity and reported under that name
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}.")
    if not samples:
        raise ValueError("score_samples got no samples.")
    if not positive_int(batch_size):  # below 0 no batch ran, and every sample scored 0 of 0: a value of NaN
        raise ValueError(f"batch_size must be a positive integer (samples scored at once), got {batch_size!r}.")
    # Scored in batches of similar length (less padding), reported in the order given.
    per_sample: list[tuple[float, int]] = [(0.0, 0)] * len(samples)
    context_tokens, peak, peak_bytes = 0, 0, 0
    per_token, per_slot = kv_bytes_per_token(model), memory_slot_bytes(model)
    histories, questions = check_samples(model, tokenizer, samples, method, metric)
    pad = padding_id(tokenizer, model.vocabulary_size)
    order = sorted(range(len(samples)), key=lambda i: sum(map(len, histories[i])) + len(questions[i]))
    for begin in range(0, len(samples), batch_size):
        indices = order[begin : begin + batch_size]
        batch = [samples[index] for index in indices]
        contexts = [histories[index] for index in indices]
        inputs = [questions[index] for index in indices]
        outputs = [token_ids(s.output, tokenizer, "an output", empty_ok=True) for s in batch]
        if metric == "accuracy":
            candidates = [[token_ids(c, tokenizer, "a choice", empty_ok=True) for c in s.choices or ()] for s in batch]
            answers = [options.index(output) for options, output in zip(candidates, outputs, strict=True)]
        else:
            candidates = [[output] for output in outputs]
        cache = None
        if method == "ccm":
            cache = model.new_cache(len(batch))
            for step in range(max(len(c) for c in contexts)):
                ids, mask = _right_pad([c[step] if step < len(c) else [pad] for c in contexts], pad)
                present = torch.tensor([step < len(c) for c in contexts])
                # The compression forward holds a row's memory, its context and the <COMP> block at once.
                held = cache.memory_mask.sum(-1).tolist()
                for row, c in enumerate(contexts):
                    if step < len(c):
                        new = len(c[step]) + model.config.num_comp_tokens
                        peak = max(peak, held[row] + new)
                        peak_bytes = max(peak_bytes, held[row] * per_slot + new * per_token)
                model.compress(
                    cache, ids.to(model.device), attention_mask=(mask.bool() & present[:, None]).to(model.device)
                )
        memory = [int(cache.memory_mask[row].sum()) if cache is not None else 0 for row in range(len(batch))]
        scores: list[list[float]] = [[] for _ in batch]
        prefixes = [
            ([t for context in contexts[row] for t in context] if method == "full_context" else []) + inputs[row]
            for row in range(len(batch))
        ]
        for choice in range(max(len(c) for c in candidates)):
            # A sample with fewer choices than others in its batch runs its first again; that score is dropped.
            picked = [options[choice] if choice < len(options) else options[0] for options in candidates]
            rows = [prefixes[row] + picked[row] for row in range(len(batch))]
            ids, mask = _right_pad(rows, pad)
            # Only the positions that predict a candidate token need the LM head (rows are right-padded).
            keep = ids.shape[1] - min(map(len, prefixes)) + 1
            if method == "ccm":
                logits = model(
                    input_ids=ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    past_key_values=cache.copy(),
                    logits_to_keep=keep,
                ).logits
            else:
                with model.reading_plain_prompt():
                    logits = model.base_model(
                        input_ids=ids.to(model.device), attention_mask=mask.to(model.device), logits_to_keep=keep
                    ).logits
            targets = _target_log_probs(
                logits,
                ids,
                [len(p) for p in prefixes],
                [len(p) + len(picked[r]) for r, p in enumerate(prefixes)],
            )
            for row, target in enumerate(targets):
                if choice >= len(candidates[row]):
                    continue
                scores[row].append(target.mean().item())
                if metric == "perplexity":
                    per_sample[indices[row]] = (-target.sum().item(), target.numel())
                peak = max(peak, memory[row] + len(rows[row]))  # full context: rows hold the contexts
                peak_bytes = max(peak_bytes, memory[row] * per_slot + len(rows[row]) * per_token)
        for row in range(len(batch)):
            context_tokens += memory[row] + (sum(map(len, contexts[row])) if method == "full_context" else 0)
            if metric == "accuracy":
                # A tie went to the first choice listed: a model that scores every choice alike was right whenever
                # the answer came first.
                best = max(scores[row])
                winners = [index for index, score in enumerate(scores[row]) if score == best]
                per_sample[indices[row]] = (1 / len(winners) if answers[row] in winners else 0.0, 1)
    low, high = value_interval(per_sample, metric)
    return MethodScore(
        method=method,
        steps=len(samples[0].contexts),
        metric=metric,
        value=_metric_value(per_sample, metric),
        low=low,
        high=high,
        context_kv_tokens=context_tokens / len(samples),
        peak_kv_tokens=peak,
        peak_kv_bytes=peak_bytes,
        samples=len(samples),
        per_sample=per_sample,
    )


def gain_recovered(no_context: float, full_context: float, ccm: float, metric: str) -> float:
    """The share of full context's gain over no context that CCM keeps (on log-perplexity for perplexity); NaN
    where full context does not beat no context: there is no gain to recover, and the ratio of a loss would read
    as CCM recovering what it lost (CCM below no context over a negative gain gives a positive share)."""
    if metric == "perplexity":
        no_context, full_context, ccm = (-math.log(v) for v in (no_context, full_context, ccm))
    gain = full_context - no_context
    return (ccm - no_context) / gain if gain > 0 else float("nan")


def gain_recovered_interval(
    no_context: Sequence[Sequence[float]],
    full_context: Sequence[Sequence[float]],
    ccm: Sequence[Sequence[float]],
    metric: str,
) -> tuple[float, float]:
    """95% paired-bootstrap interval of `gain_recovered` from the three methods' `per_sample` scores on the
    same samples, over the resamples where full context beats no context (NaN, NaN when the samples, or most
    resamples, show no gain to recover)."""
    if not len(no_context) == len(full_context) == len(ccm):
        raise ValueError(
            f"Gain recovered compares methods on the same samples; got {len(no_context)}, {len(full_context)} "
            f"and {len(ccm)} samples."
        )
    if _log_score(full_context, metric) <= _log_score(no_context, metric):
        return float("nan"), float("nan")
    no, full, compressed = _resampled_scores([no_context, full_context, ccm], metric, seed=1)
    gains = ((compressed - no) / (full - no))[full > no]
    if gains.numel() < BOOTSTRAP_RESAMPLES // 2:
        return float("nan"), float("nan")
    low, high = torch.quantile(gains, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def difference_interval(
    first: Sequence[Sequence[float]], second: Sequence[Sequence[float]], metric: str
) -> tuple[float, float]:
    """95% paired-bootstrap interval of `second`'s score minus `first`'s, from their `per_sample` scores on the
    same samples: in accuracy, or in minus the log-perplexity (so above 0 means `second` is better)."""
    if len(first) != len(second):
        raise ValueError(
            f"A paired difference compares methods on the same samples; got {len(first)} and {len(second)} samples."
        )
    first_scores, second_scores = _resampled_scores([first, second], metric, seed=2)
    differences = second_scores - first_scores
    low, high = torch.quantile(differences, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def paired_difference(first: Row, second: Row) -> Row:
    """`second` against `first` (result rows, such as `MethodScore.to_dict()`, on the same samples): the method
    compared with, the difference of their scores as `difference_interval` measures it, and its 95% interval
    (what `difference_text` writes)."""
    metric = str(second["metric"])
    difference = (_log_score(second["per_sample"], metric) - _log_score(first["per_sample"], metric)).item()
    interval = difference_interval(first["per_sample"], second["per_sample"], metric)
    return {"method": first["method"], "value": difference, "interval": list(interval)}


FINETUNED = "full_context_finetuned"  # a full-context adapter (conditional_lora=False), the paper's upper bound
WORDING_ORDER = ("seen", "unseen", "all", "own")  # "own": samples from a JSONL file of your own


def _gain(no_context: Row, full_context: Row, ccm: Row) -> Row:
    """Gain recovered with its 95% interval, from three result rows on the same samples."""
    metric = str(ccm["metric"])
    value = gain_recovered(no_context["value"], full_context["value"], ccm["value"], metric)
    interval = gain_recovered_interval(no_context["per_sample"], full_context["per_sample"], ccm["per_sample"], metric)
    return {"value": value, "interval": list(interval)}


def _check_row(row: object, number: int) -> None:
    """Raise unless `row`, result `number` (from 0), holds every field `markdown` and `plot` read, of its type and in
    its range, its value that of its per-sample scores: a report edited or damaged by hand (a NaN, a count past its
    samples, a value of another run) was joined with new scores and failed only in the table, once every adapter
    had run, or was carried into it."""
    if not isinstance(row, dict):
        raise ValueError(f"result {number} is a {type(row).__name__}, not an object")
    where = f"result {number} ({row.get('task')!r}, {row.get('method')!r})"
    text = ("task", "wordings", "method")
    missing = [key for key in (*text, "metric", *MethodScore.__dataclass_fields__) if key not in row]
    if missing:
        raise ValueError(f"{where} has no {missing}")
    wrong = {
        "a non-empty string": [key for key in text if not (isinstance(row[key], str) and row[key])],
        "an integer >= 1": [
            key for key in ("steps", "samples", "peak_kv_tokens", "peak_kv_bytes") if not positive_int(row[key])
        ],
        "a finite number": [
            key for key in ("value", "low", "high", "context_kv_tokens") if not finite_number(row[key])
        ],
    }
    if any(wrong.values()):
        raise ValueError(
            f"{where}: " + "; ".join(f"{keys} must each be {kind}" for kind, keys in wrong.items() if keys)
        )
    metric, values = row["metric"], row["per_sample"]
    if metric not in METRICS or row["wordings"] not in WORDING_ORDER:
        raise ValueError(
            f"{where}: metric {metric!r} or wordings {row['wordings']!r} is none of {METRICS + WORDING_ORDER}"
        )
    if not isinstance(values, list) or len(values) != row["samples"]:
        count = len(values) if isinstance(values, list) else f"a {type(values).__name__} of"
        raise ValueError(f"{where}: samples is {row['samples']} but it holds {count} per-sample values")
    # (credit, 1) per sample for accuracy, (output NLL, output tokens) for perplexity, as `MethodScore` holds them
    if not all(
        isinstance(pair, (list, tuple))
        and len(pair) == 2
        and finite_number(pair[0])
        and positive_int(pair[1])
        and (0 <= pair[0] <= 1 and pair[1] == 1 if metric == "accuracy" else pair[0] >= 0)
        for pair in values
    ):
        raise ValueError(
            f"{where}: per_sample must hold pairs of "
            + ("(credit in [0, 1], 1)" if metric == "accuracy" else "(output NLL >= 0, output tokens >= 1)")
        )
    value = _metric_value(values, metric)
    if not math.isclose(row["value"], value, rel_tol=1e-9):
        raise ValueError(f"{where}: value {row['value']!r} is not that of its per_sample, {value!r}")
    if not (row["low"] <= row["high"] and row["context_kv_tokens"] >= 0):
        raise ValueError(f"{where}: low {row['low']!r} is above high {row['high']!r}, or context_kv_tokens is below 0")


def _check_paired(results: Sequence[Row]) -> None:
    """Raise unless the rows of each task, wording set and time step score one method each, on the same samples
    (count, metric and, where rows carry one, samples digest): gains and paired differences pair them sample by
    sample, and a row of other samples (two reports joined by hand) was paired all the same."""
    sets: dict[tuple[str, str, int], list[Row]] = {}
    for row in results:
        sets.setdefault((str(row["task"]), str(row["wordings"]), int(row["steps"])), []).append(row)
    for (task, wordings, steps), rows in sets.items():
        methods = [str(row["method"]) for row in rows]
        twice = sorted(method for method, count in Counter(methods).items() if count > 1)
        scored = {(row["samples"], row["metric"]) for row in rows}
        digests = {row["samples_digest"] for row in rows if "samples_digest" in row}
        where = f"{task} ({wordings}, t={steps})"
        if twice:
            raise ValueError(f"{where} holds {twice} more than once; keep one row per method.")
        if len(scored) > 1 or len(digests) > 1:
            raise ValueError(
                f"{where}: its methods were scored on different samples (samples and metric {sorted(scored, key=str)}, "
                f"{len(digests)} sample digests), and are compared sample by sample; join only reports of the same "
                "samples."
            )


def summarize(results: Sequence[Row]) -> list[Row]:
    """Per task, wording set and CCM method, at the task's largest time step: the scores with their 95%
    intervals, the gain recovered against the base model with full context and, when scored, against the
    fine-tuned full-context adapter, the KV memory ratio and, for every CCM method after the first one scored,
    its paired difference from that first one (`versus_first`)."""
    for number, row in enumerate(results):
        _check_row(row, number)
    _check_paired(results)
    rows: list[Row] = []
    # Gathered in one pass: a search of all the rows for each group's took minutes on a report of 100,000 groups.
    grouped: dict[tuple[str, str], list[Row]] = {}
    for r in results:
        grouped.setdefault((str(r["task"]), str(r["wordings"])), []).append(r)
    for task, wordings in sorted(grouped, key=lambda g: (g[0], WORDING_ORDER.index(g[1]))):
        group = grouped[(task, wordings)]
        steps = max(int(r["steps"]) for r in group)
        at = {str(r["method"]): r for r in group if r["steps"] == steps}
        # A set without its baselines or a CCM method (rows left out of a report) raised KeyError or StopIteration.
        first = next((result for method, result in at.items() if method.startswith("ccm")), None)
        if "no_context" not in at or "full_context" not in at or first is None:
            raise ValueError(
                f"{task} ({wordings}, t={steps}) holds the methods {sorted(at)}; a summary compares a CCM method with "
                "no_context and full_context on the same samples: keep all three rows."
            )
        no, full, tuned = at["no_context"], at["full_context"], at.get(FINETUNED)
        for method, result in sorted(at.items()):
            if not method.startswith("ccm"):
                continue
            rows.append(
                {
                    "task": task,
                    "wordings": wordings,
                    "steps": steps,
                    "method": method,
                    "metric": result["metric"],
                    "samples": result["samples"],
                    "no_context": no["value"],
                    "full_context": full["value"],
                    FINETUNED: None if tuned is None else tuned["value"],
                    "ccm": result["value"],
                    "ccm_interval": [result["low"], result["high"]],
                    "gain_recovered": _gain(no, full, result),
                    "gain_recovered_finetuned": None if tuned is None else _gain(no, tuned, result),
                    "context_memory_ratio": float(result["context_kv_tokens"]) / float(full["context_kv_tokens"]),
                    "versus_first": None if result is first else paired_difference(first, result),
                }
            )
    return rows


def report_json(results: Sequence[Row], summary: Sequence[Row]) -> str:
    """eval.json: `{"results": [...], "summary": [...]}`, one result per line (each carries its per-sample
    scores), the summary indented. Strict JSON: a value that is not a number (a gain recovered where full context
    gains nothing) is written as null, which every JSON reader takes, where `NaN` is Python's alone."""
    rows = ",\n".join(json.dumps(_finite_or_null(row), allow_nan=False) for row in results)
    summary_text = json.dumps(_finite_or_null(summary), indent=2, allow_nan=False)
    return f'{{"results": [\n{rows}\n],\n"summary": {summary_text}}}\n'


def _finite_or_null(value: Any) -> Any:
    """`value` with every float that is NaN or infinite, at any depth of its lists and dicts, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def plot(results: Sequence[Row], path: str) -> None:
    """Performance (with 95% intervals, seen wordings solid, unseen dashed) and context KV memory over time
    steps, per task (like the paper's Fig. 4 and 9)."""
    tasks = sorted({str(r["task"]) for r in results})
    methods = sorted({str(r["method"]) for r in results})
    colors = {method: f"C{index}" for index, method in enumerate(methods)}
    drawing = figure(figsize=(4.6 * len(tasks), 6.8))
    axes = drawing.subplots(2, len(tasks), squeeze=False)
    for column, task in enumerate(tasks):
        task_results = [r for r in results if r["task"] == task]
        for method, wordings in sorted({(str(r["method"]), str(r["wordings"])) for r in task_results}):
            points = sorted(
                ((int(r["steps"]), r) for r in task_results if r["method"] == method and r["wordings"] == wordings),
                key=lambda point: point[0],
            )
            steps = [s for s, _ in points]
            style = {"color": colors[method], "linestyle": "--" if wordings == "unseen" else "-", "marker": "o"}
            top = axes[0][column]
            top.plot(steps, [float(r["value"]) for _, r in points], label=f"{method} ({wordings})", **style)
            low, high = [float(r["low"]) for _, r in points], [float(r["high"]) for _, r in points]
            top.fill_between(steps, low, high, color=colors[method], alpha=0.12)
            if wordings != "unseen":  # the memory a method holds does not depend on the wording
                axes[1][column].plot(steps, [float(r["context_kv_tokens"]) for _, r in points], label=method, **style)
        metric = str(task_results[0]["metric"])
        axes[0][column].set_title(task)
        axes[0][column].set_ylabel(f"{metric} (95% interval shaded)")
        if metric == "perplexity":  # no context sits an order of magnitude above the rest
            axes[0][column].set_yscale("log")
        axes[1][column].set_ylabel("context KV length (tokens or slots)")
        axes[1][column].set_xlabel("time step t")
        for row in axes:
            row[column].set_xscale("log", base=2)
            row[column].grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    drawing.tight_layout()
    drawing.savefig(path, dpi=120)


def _with_interval(value: float, interval: Sequence[float]) -> str:
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def gain_text(gain: Row | None) -> str:
    """A summary row's gain recovered as "62% [48%, 75%]" ("-" when not measured, "n/a" with the reason when
    there is no gain, the value alone when most resamples show none)."""
    if gain is None:
        return "-"
    if not _is_number(gain["value"]):
        return "n/a (full context does not beat no context: no gain to recover)"
    low, high = gain["interval"]
    if not (_is_number(low) and _is_number(high)):
        return f"{gain['value']:.0%} [no interval: full context beats no context in under half the resamples]"
    return f"{gain['value']:.0%} [{low:.0%}, {high:.0%}]"


def _is_number(value: float | None) -> bool:
    """Whether `value` is a finite number (eval.json writes the others as null)."""
    return value is not None and math.isfinite(value)


def difference_text(difference: Row | None, metric: str) -> str:
    """A summary row's `versus_first` as "+0.094 [+0.021, +0.167] accuracy" or "x0.85 [0.80, 0.91] perplexity"
    (the ratio of perplexities, below 1 when better), with the method compared with; "-" when there is none."""
    if difference is None:
        return "-"
    low, high = difference["interval"]
    if metric == "accuracy":
        text = f"{difference['value']:+.3f} [{low:+.3f}, {high:+.3f}] accuracy"
    else:  # the difference is in minus the log-perplexity
        text = f"x{math.exp(-difference['value']):.2f} [{math.exp(-high):.2f}, {math.exp(-low):.2f}] perplexity"
    return f"{text} vs {difference['method']}"


def markdown(results: Sequence[Row], summary: Sequence[Row]) -> str:
    """The summary at the largest time step, then every time step, as Markdown tables with 95% intervals."""
    lines = [
        "| task | wordings | method | metric | no context | full context (base) | full context (fine-tuned) | "
        "CCM [95% CI] | gain recovered vs base | vs fine-tuned | context memory vs full | "
        "paired difference from the first adapter [95% CI] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary:
        tuned = row[FINETUNED]
        lines.append(
            f"| {row['task']} (t={row['steps']}) | {row['wordings']} | {row['method']} | {row['metric']} | "
            f"{row['no_context']:.3f} | {row['full_context']:.3f} | {'-' if tuned is None else f'{tuned:.3f}'} | "
            f"{_with_interval(row['ccm'], row['ccm_interval'])} | "
            f"{gain_text(row['gain_recovered'])} | {gain_text(row['gain_recovered_finetuned'])} | "
            f"{row['context_memory_ratio']:.3f} | {difference_text(row['versus_first'], row['metric'])} |"
        )
    lines += [
        "",
        "| task | wordings | t | method | metric | value [95% CI] | samples | context KV (tokens or slots) "
        "| peak KV (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['task']} | {r['wordings']} | {r['steps']} | {r['method']} | {r['metric']} | "
            f"{_with_interval(float(r['value']), [float(r['low']), float(r['high'])])} | {r['samples']} | "
            f"{float(r['context_kv_tokens']):.1f} | {int(r['peak_kv_bytes']) / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"
