"""Training speed: CCM's parallel forward+backward over `[c(1) <COMP> ... c(t) <COMP> I O]` with the block
mask (with full logits, and with the LM head only where a label is predicted, as `train()` runs it) against a
recurrent implementation on the same samples, which compresses step by step with gradients through the memory,
as RMT and AutoCompressor train (the paper's Table 7). Both give the same loss; the run checks it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.timing import time_cases
from benchmarks.workload import Subject, Workload
from transformers_ccm import CCMDataCollator, CCMForCausalLM, OnlineSample
from transformers_ccm.data import IGNORE_INDEX
from transformers_ccm.masks import update_coefficient
from transformers_ccm.modeling import CACHE_ARGUMENT

KV = tuple[torch.Tensor, torch.Tensor]


def make_samples(workload: Workload, vocab_size: int, steps: int, count: int) -> list[OnlineSample]:
    """`count` samples of `steps` contexts, all of the workload's lengths (so batches need no padding)."""
    salt = 1_000 * (steps + 1)
    return [
        OnlineSample(
            contexts=[
                workload.tokens(vocab_size, workload.context_tokens, salt + 100 * i + j)[0] for j in range(steps)
            ],
            input=workload.tokens(vocab_size, workload.input_tokens, salt + 100 * i + 98)[0],
            output=workload.tokens(vocab_size, workload.new_tokens, salt + 100 * i + 99)[0],
        )
        for i in range(count)
    ]


def _stack(rows: Sequence[Any]) -> torch.Tensor:
    tensors = [torch.as_tensor(row) for row in rows]
    if len({tensor.shape for tensor in tensors}) != 1:
        raise ValueError("The recurrent implementation takes samples whose contexts and turns have equal lengths.")
    return torch.stack(tensors)


def _update(memory: list[KV], new: list[KV], step: int, model: CCMForCausalLM) -> list[KV]:
    """`Mem(step)` from `Mem(step - 1)` and the `<COMP>` keys/values `h(step)`, layer by layer."""
    if not memory:
        return new
    config = model.config
    if config.update == "concat":
        merged = [
            (torch.cat([mk, nk], 2), torch.cat([mv, nv], 2)) for (mk, mv), (nk, nv) in zip(memory, new, strict=True)
        ]
        cap = config.max_memory_tokens
        return merged if cap is None else [(k[:, :, -cap:], v[:, :, -cap:]) for k, v in merged]
    a = update_coefficient(step, config)
    return [((1 - a) * mk + a * nk, (1 - a) * mv + a * nv) for (mk, mv), (nk, nv) in zip(memory, new, strict=True)]


def recurrent_loss(model: CCMForCausalLM, samples: Sequence[OnlineSample]) -> torch.Tensor:
    """The training loss of `samples`, one forward per step: `c(j) <COMP>` attends to `Mem(j-1)` (a
    `DynamicCache` holding it), the `<COMP>` keys/values update the memory, and `I O` finally attends to
    `Mem(t)`. Positions follow the parallel layout; gradients flow through every memory."""
    base, n = model.base_model, model.config.num_comp_tokens
    batch, steps = len(samples), len(samples[0].contexts)
    memory: list[KV] = []
    position = 0
    for step in range(steps):
        context = _stack([sample.contexts[step] for sample in samples])
        ids = torch.cat([context, torch.zeros(batch, n, dtype=torch.long)], dim=1).to(model.device)
        is_comp = torch.zeros_like(ids, dtype=torch.bool)
        is_comp[:, -n:] = True
        cache = DynamicCache(ddp_cache_data=memory) if memory else DynamicCache(config=base.config)
        positions = torch.arange(position, position + ids.shape[1], device=model.device)[None].expand(batch, -1)
        with model.lora_at(is_comp):
            base(
                inputs_embeds=model.embed(ids, is_comp),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
            )
        new = [(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in cache.layers]
        memory = _update(memory, new, step + 1, model)
        position += context.shape[1]
    inputs, outputs = _stack([s.input for s in samples]), _stack([s.output for s in samples])
    ids = torch.cat([inputs, outputs], dim=1).to(model.device)
    labels = torch.cat([torch.full_like(inputs, IGNORE_INDEX), outputs], dim=1).to(model.device)
    positions = torch.arange(position, position + ids.shape[1], device=model.device)[None].expand(batch, -1)
    with model.lora_at(torch.zeros_like(ids, dtype=torch.bool)):
        return base(
            input_ids=ids,
            labels=labels,
            position_ids=positions,
            use_cache=True,
            **{CACHE_ARGUMENT: DynamicCache(ddp_cache_data=memory)},
        ).loss


def training_cases(model: CCMForCausalLM, samples: Sequence[OnlineSample]) -> dict[str, Callable[[], None]]:
    """One training step (forward and backward) on `samples`, parallel and recurrent."""
    batch = {key: value.to(model.device) for key, value in CCMDataCollator(model)(samples).items()}

    def parallel() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    def parallel_labels_only() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch, logits_at_labels=True).loss.backward()

    def recurrent() -> None:
        model.zero_grad(set_to_none=True)
        recurrent_loss(model, samples).backward()

    return {"parallel": parallel, "parallel_labels_only": parallel_labels_only, "recurrent": recurrent}


def run(
    subject: Subject,
    workload: Workload,
    steps: Sequence[int],
    batch_size: int,
    rounds: int,
    min_run_time: float,
) -> dict[str, Any]:
    """Per CCM model and time step: samples per second of both, the speed-up, and both losses."""
    rows = []
    for name, model in subject.ccm.items():
        for step in steps:
            samples = make_samples(workload, subject.vocab_size, step, batch_size)
            with torch.no_grad():
                parallel = model(**CCMDataCollator(model)(samples)).loss.item()
                recurrent = recurrent_loss(model, samples).item()
            timings = time_cases(training_cases(model, samples), rounds, min_run_time)
            model.zero_grad(set_to_none=True)
            rows.append(
                {
                    "method": name,
                    "step": step,
                    "sequence_tokens": step * (workload.context_tokens + model.config.num_comp_tokens)
                    + workload.input_tokens
                    + workload.new_tokens,
                    "parallel_samples_per_second": batch_size / timings["parallel"].median,
                    "recurrent_samples_per_second": batch_size / timings["recurrent"].median,
                    "speedup": timings["recurrent"].ratio_to(timings["parallel"]),
                    # What running the LM head only where a label is predicted buys (what `train()` does).
                    "labels_only_speedup": timings["parallel"].ratio_to(timings["parallel_labels_only"]),
                    "labels_only_over_recurrent": timings["recurrent"].ratio_to(timings["parallel_labels_only"]),
                    "parallel_loss": parallel,
                    "recurrent_loss": recurrent,
                    "rounds": {case: list(timing.rounds) for case, timing in timings.items()},
                }
            )
    return {"batch_size": batch_size, "rows": rows}
