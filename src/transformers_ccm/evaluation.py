"""Evaluation of online tasks: no context, full context and CCM, at given time steps.

Accuracy follows the MetaICL protocol (the choice with the highest mean log-likelihood per token wins);
perplexity is over the output tokens. Every method scores the same samples; the KV memory it needs is
reported in tokens (context part and peak) and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from transformers_ccm.data import OnlineSample
from transformers_ccm.extras import pyplot
from transformers_ccm.modeling import CCMForCausalLM

METHODS = ("no_context", "full_context", "ccm")


@dataclass
class MethodScore:
    """One method at one time step."""

    method: str
    steps: int
    metric: str
    value: float
    context_kv_tokens: float  # mean KV slots that hold the context (tokens, or <COMP> slots for CCM)
    peak_kv_tokens: int  # the most KV slots any sample needed (context + input + output)
    peak_kv_bytes: int
    samples: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def kv_bytes_per_token(model: CCMForCausalLM) -> int:
    """Bytes of keys and values one token (or memory slot) takes over all layers."""
    config = model.base_model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * model.comp_embeddings.element_size()


def _ids(tokenizer: PreTrainedTokenizerBase, text: object) -> list[int]:
    if isinstance(text, str):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [int(t) for t in text]  # type: ignore[union-attr]


def _right_pad(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    return ids, mask


def _target_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, starts: list[int], ends: list[int]
) -> list[torch.Tensor]:
    """Per row, the log-probabilities of tokens `ids[start:end]`, each predicted from the position before."""
    log_probs = logits.float().log_softmax(-1)
    return [
        log_probs[row, start - 1 : end - 1].gather(-1, ids[row, start:end, None].to(log_probs.device))[:, 0]
        for row, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


@torch.no_grad()
def score_samples(
    model: CCMForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[OnlineSample],
    method: str,
    metric: str,
    batch_size: int = 16,
) -> MethodScore:
    """Score `samples` (all with the same number of contexts) with one method."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    correct, log_prob_sum, token_count = 0, 0.0, 0
    context_tokens, peak = 0, 0
    for begin in range(0, len(samples), batch_size):
        batch = samples[begin : begin + batch_size]
        contexts = [[_ids(tokenizer, c) for c in s.contexts] for s in batch]
        inputs = [_ids(tokenizer, s.input) for s in batch]
        if metric == "accuracy":
            candidates = [[_ids(tokenizer, c) for c in s.choices or ()] for s in batch]
            answers = [options.index(_ids(tokenizer, s.output)) for options, s in zip(candidates, batch, strict=True)]
        else:
            candidates = [[_ids(tokenizer, s.output)] for s in batch]
        cache = None
        if method == "ccm":
            cache = model.new_cache(len(batch))
            for step in range(max(len(c) for c in contexts)):
                ids, mask = _right_pad([c[step] if step < len(c) else [pad] for c in contexts], pad)
                present = torch.tensor([step < len(c) for c in contexts])
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
            rows = [prefixes[row] + candidates[row][choice] for row in range(len(batch))]
            ids, mask = _right_pad(rows, pad)
            if method == "ccm":
                logits = model(
                    input_ids=ids.to(model.device), attention_mask=mask.to(model.device), past_key_values=cache.copy()
                ).logits
            else:
                with model.adapter_disabled():
                    logits = model.base_model(
                        input_ids=ids.to(model.device), attention_mask=mask.to(model.device)
                    ).logits
            targets = _target_log_probs(
                logits,
                ids,
                [len(p) for p in prefixes],
                [len(p) + len(candidates[r][choice]) for r, p in enumerate(prefixes)],
            )
            for row, target in enumerate(targets):
                scores[row].append(target.mean().item())
                if metric == "perplexity":
                    log_prob_sum += target.sum().item()
                    token_count += target.numel()
                peak = max(peak, memory[row] + len(rows[row]))  # full context: rows hold the contexts
        for row in range(len(batch)):
            context_tokens += memory[row] + (sum(map(len, contexts[row])) if method == "full_context" else 0)
            if metric == "accuracy":
                correct += int(max(range(len(scores[row])), key=scores[row].__getitem__) == answers[row])
    value = correct / len(samples) if metric == "accuracy" else math.exp(-log_prob_sum / token_count)
    return MethodScore(
        method=method,
        steps=len(samples[0].contexts),
        metric=metric,
        value=value,
        context_kv_tokens=context_tokens / len(samples),
        peak_kv_tokens=peak,
        peak_kv_bytes=peak * kv_bytes_per_token(model),
        samples=len(samples),
    )


def gain_recovered(no_context: float, full_context: float, ccm: float, metric: str) -> float:
    """The share of full context's gain over no context that CCM keeps (on log-perplexity for perplexity)."""
    if metric == "perplexity":
        no_context, full_context, ccm = (-math.log(v) for v in (no_context, full_context, ccm))
    gain = full_context - no_context
    return (ccm - no_context) / gain if gain else float("nan")


def summarize(results: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """Per task and CCM method, at the task's largest time step: score, gain recovered, KV memory ratio."""
    rows = []
    for task in sorted({str(r["task"]) for r in results}):
        task_results = [r for r in results if r["task"] == task]
        steps = max(int(r["steps"]) for r in task_results)
        at = {str(r["method"]): r for r in task_results if r["steps"] == steps}
        no, full = at["no_context"], at["full_context"]
        for method, result in sorted(at.items()):
            if not method.startswith("ccm"):
                continue
            rows.append(
                {
                    "task": task,
                    "steps": steps,
                    "method": method,
                    "metric": result["metric"],
                    "no_context": no["value"],
                    "full_context": full["value"],
                    "ccm": result["value"],
                    "gain_recovered": gain_recovered(
                        float(no["value"]), float(full["value"]), float(result["value"]), str(result["metric"])
                    ),
                    "context_memory_ratio": float(result["context_kv_tokens"]) / float(full["context_kv_tokens"]),
                }
            )
    return rows


def plot(results: Sequence[dict[str, object]], path: str) -> None:
    """Performance and context KV memory over time steps, per task (like the paper's Fig. 4 and 9)."""
    plt = pyplot()

    tasks = sorted({str(r["task"]) for r in results})
    figure, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 6.4), squeeze=False)
    for column, task in enumerate(tasks):
        task_results = [r for r in results if r["task"] == task]
        for method in sorted({str(r["method"]) for r in task_results}):
            points = sorted((int(r["steps"]), r) for r in task_results if r["method"] == method)
            steps = [s for s, _ in points]
            axes[0][column].plot(steps, [float(r["value"]) for _, r in points], marker="o", label=method)
            axes[1][column].plot(steps, [float(r["context_kv_tokens"]) for _, r in points], marker="o", label=method)
        metric = str(task_results[0]["metric"])
        axes[0][column].set_title(task)
        axes[0][column].set_ylabel(metric)
        axes[1][column].set_ylabel("context KV length (tokens or slots)")
        axes[1][column].set_xlabel("time step t")
        for row in axes:
            row[column].set_xscale("log", base=2)
            row[column].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(results: Sequence[dict[str, object]], summary: Sequence[dict[str, object]]) -> str:
    """The summary at the largest time step, then every time step, as Markdown tables."""
    lines = [
        "| task | method | metric | no context | full context | CCM | gain recovered | context memory vs full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary:
        lines.append(
            f"| {row['task']} (t={row['steps']}) | {row['method']} | {row['metric']} | {row['no_context']:.3f} | "
            f"{row['full_context']:.3f} | {row['ccm']:.3f} | {row['gain_recovered']:.0%} | "
            f"{row['context_memory_ratio']:.3f} |"
        )
    lines += [
        "",
        "| task | t | method | metric | value | context KV (tokens or slots) | peak KV (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['task']} | {r['steps']} | {r['method']} | {r['metric']} | {float(r['value']):.3f} | "
            f"{float(r['context_kv_tokens']):.1f} | {int(r['peak_kv_bytes']) / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"
