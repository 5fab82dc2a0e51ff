"""Distillation from full context: a model reading the whole history as a plain prompt is the teacher of the
memory.

At every supervised position of a `CCMDataCollator` batch the student (the CCM forward, which sees only memory)
is pulled towards the teacher's next-token distribution over `[c(1) ... c(t) I(t) O(t)]` without `<COMP>`
tokens, run without gradients in the same step, as kvpress's RestoreKV and KV-Distill train. By default the
teacher is the student's own base model with the adapter off (self-distillation); a fine-tuned full-context
baseline (`conditional_lora=False`, its LoRA on) is a stronger one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformers_ccm.data import IGNORE_INDEX
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.modes import evaluating


def plain_history(batch: dict[str, torch.Tensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's input: each row's ordinary tokens in order (no `<COMP>`, no padding), right-padded.

    Returns:
        input_ids `(batch, len)` and `index` `(batch, seq)`: where each token of the CCM sequence sits in
        the plain one (-1 at `<COMP>` and padding).
    """
    ordinary = ~batch["comp_mask"] & (batch["segment_ids"] > 0)
    index = torch.where(ordinary, ordinary.long().cumsum(dim=1) - 1, -1)
    length = int(ordinary.sum(dim=1).max())
    input_ids = torch.full((ordinary.shape[0], length), pad_token_id, dtype=torch.long, device=ordinary.device)
    rows = torch.arange(ordinary.shape[0], device=ordinary.device)[:, None].expand_as(index)
    input_ids[rows[ordinary], index[ordinary]] = batch["input_ids"][ordinary]
    return input_ids, index


def distillation_loss(
    model: CCMForCausalLM,
    batch: dict[str, torch.Tensor],
    student_logits: torch.Tensor,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
    teacher: CCMForCausalLM | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """KL(teacher || student) summed over the positions that predict a label and divided by `num_items_in_batch`
    (when given: the labels of every batch of the optimizer step, as the NLL is), else their mean; scaled by
    `temperature**2`.

    Args:
        batch: a `CCMDataCollator` batch with `labels`.
        student_logits: `(batch, seq, vocab)` logits of the CCM forward on `batch`, or `(batch, k, vocab)` at the
            sequence positions `positions` `(k,)` (what `model(..., logits_at_labels=True)` returns).
        teacher: the model whose reading of the plain history is the target; None: `model`'s base model.
        num_items_in_batch: the Trainer's count of labels over the gradient-accumulated batches.
    """
    _check_student_logits(batch, student_logits, positions)
    columns = torch.arange(batch["labels"].shape[1], device=student_logits.device) if positions is None else positions
    next_label = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)[:, columns]
    supervised = next_label != IGNORE_INDEX
    teacher_ids, index = plain_history(batch)
    rows = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(supervised)
    # The vocabulary projection is only paid where some row is supervised.
    kept, column_in_kept = torch.unique(index[:, columns][supervised], return_inverse=True)
    target = teacher_logits(model, teacher, teacher_ids, kept)[rows[supervised], column_in_kept]
    return kl_to_teacher(student_logits[supervised], target, temperature, num_items_in_batch)


def _check_student_logits(
    batch: dict[str, torch.Tensor], student_logits: torch.Tensor, positions: torch.Tensor | None
) -> None:
    """Raise a ValueError unless `batch` has labels and `student_logits` has a row per sample and a column per
    position of `positions` (all of the sequence when None): other logits failed on a bare IndexError of a mask."""
    if "labels" not in batch:
        raise ValueError(
            "The batch has no labels, so no position to distil: collate samples with outputs (or, with "
            "supervision='dense', a second context) with CCMDataCollator."
        )
    rows, length = batch["labels"].shape
    expected = (rows, length if positions is None else positions.numel())
    if student_logits.dim() != 3 or tuple(student_logits.shape[:2]) != expected:
        raise ValueError(
            f"student_logits of shape {tuple(student_logits.shape)} do not fit the batch, whose (samples, positions) "
            f"are {expected}: pass the logits of model(**batch) with positions=None, or those of model(**batch, "
            "logits_at_labels=True) with positions=predicting_positions(batch['labels'])."
        )


def teacher_logits(
    model: CCMForCausalLM,
    teacher: CCMForCausalLM | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distillation target for `model`: `plain_prompt_logits` of `teacher`, or without one of `model`'s base
    model (its adapter off, also where an unconditional LoRA would read a plain prompt with it)."""
    if teacher is not None:
        return plain_prompt_logits(teacher, input_ids, positions)
    # An unconditional LoRA (conditional_lora=False) reads a plain prompt with its LoRA on: the teacher was the
    # student itself, a target that moved with every step, not the base model the docs promise.
    with model.adapter_disabled():
        return plain_prompt_logits(model, input_ids, positions)


def plain_prompt_logits(
    teacher: CCMForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits of `teacher` reading `input_ids` `(batch, len)` as a plain prompt (no `<COMP>` tokens, see
    `CCMForCausalLM.reading_plain_prompt`), without gradients and without dropout: `(batch, k, vocab)` at the sorted
    sequence positions `positions` `(k,)`, or `(batch, len, vocab)` at all of them."""
    # The teacher is often the student's own base model, in training mode: its dropout (GPT-2's 0.1, say) drew another
    # target at every step instead of the base model's prediction.
    with torch.no_grad(), evaluating(teacher), teacher.reading_plain_prompt():
        return teacher.base_model(input_ids=input_ids, logits_to_keep=0 if positions is None else positions).logits


def kl_to_teacher(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """KL(teacher || student) over positions `(positions, vocab)`, scaled by `temperature**2`: summed and divided by
    `num_items_in_batch` when given, else the mean over the positions (0 over none).

    The Trainer sums the losses of the batches it accumulates (they are normalized by the labels of all of them):
    a mean per batch would weigh the KL `gradient_accumulation` times more than the NLL beside it."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    total = F.kl_div(student, teacher, log_target=True, reduction="sum") * temperature**2
    # A mean over no position (a batch without labels) was NaN; the KL of no position is 0.
    return total / (num_items_in_batch if num_items_in_batch is not None else max(student_logits.shape[0], 1))
