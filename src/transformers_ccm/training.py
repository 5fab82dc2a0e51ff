"""Training a compression adapter with the transformers `Trainer`.

`CCMTrainer` checkpoints only the adapter (PEFT format, a few MB) and resumes from it; `train` wires a
model, samples and the paper's recipe (Tables 10-11, scaled to a small machine) together.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import platform
import random
import re
import shutil
import traceback
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.trainer import SCALER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from transformers_ccm.config import CCMConfig
from transformers_ccm.data import (
    CCMDataCollator,
    Layout,
    OnlineSample,
    Supervision,
    padding_id,
    predicting_positions,
)
from transformers_ccm.distillation import distillation_loss
from transformers_ccm.files import raise_if_short_of, replace_file, short_of
from transformers_ccm.hub import VERIFIED_FILES, check_flags, read_adapter
from transformers_ccm.json_reading import parse_json_object
from transformers_ccm.modeling import CCMForCausalLM
from transformers_ccm.modes import modes_kept
from transformers_ccm.stream_training import StreamCollator, stream_loss
from transformers_ccm.streaming import StreamingConfig
from transformers_ccm.validation import check_setting, finite_number, is_int, number, positive_int

logger = logging.getLogger(__name__)

# "auto": bf16 on a GPU that supports it, fp32 on CPU; "bf16": bf16 autocast (mixed precision: the weights, the
# gradients and the optimizer state stay fp32) on a GPU or a CPU with bf16 instructions; "fp32": no autocast.
Precision = Literal["auto", "bf16", "fp32"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
# Batches on a GPU are padded to a multiple of this many positions (the block size of the compiled block-sparse
# attention, which then compiles for a few lengths only); on CPU they are not.
GPU_PAD_MULTIPLE = 128
# The largest seed the Trainer can take (numpy's generator takes 32-bit seeds).
MAX_SEED = 2**32 - 1


class SimilarLengthSampler(torch.utils.data.Sampler[int]):
    """Sample indices in batches of samples of similar length: shuffled, sorted by length within groups of
    `group` batches, cut into batches of `batch_size`, and the batches shuffled, the one holding the longest sample
    first (a run that runs out of memory does so at its first step) and the one short batch, if any, last. Unlike
    transformers' `LengthGroupedSampler`, whose batches run from long to short within each group, no stretch of a run
    sees only short or long samples.

    The indices come out as one stream, which the DataLoader cuts into batches of the per-device batch size (a
    divisor of `batch_size`) and accelerate deals out to the processes in turn: every batch but the last is one
    piece of one of these batches. Under DDP every process draws the same stream (the seed is shared), and
    accelerate's even batches give each process as many batches, the last round filled from the stream's start."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, group: int = 50) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.group = group
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        """Draw the batches of pass `epoch` (the Trainer sets it before each epoch, as torch's `DistributedSampler`
        takes it)."""
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """One pass: the batches, each a list of sample indices, drawn anew for each epoch."""
        # Seeded by the epoch, not advanced pass by pass: a run resumed in a later epoch starts a fresh sampler,
        # which must draw the batches that the run it continues drew there.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        shuffled = torch.randperm(len(self.lengths), generator=generator).tolist()
        span = self.group * self.batch_size
        groups = [shuffled[start : start + span] for start in range(0, len(shuffled), span)]
        if len(groups) > 1 and len(groups[-1]) < self.batch_size:
            # A last group smaller than a batch joins the one before: the short batch then holds the shortest samples
            # of a group, never the longest sample, which must come first.
            groups[-2:] = [groups[-2] + groups[-1]]
        batches = []
        for members in groups:
            by_length = sorted(members, key=self.lengths.__getitem__, reverse=True)
            batches += [by_length[i : i + self.batch_size] for i in range(0, len(by_length), self.batch_size)]
        # The short batch (the last one cut) goes last: in the middle it shifted the DataLoader's cuts of every batch
        # after it, each then straddling two batches of unlike lengths.
        short = [batches.pop()] if batches and len(batches[-1]) < self.batch_size else []
        if not batches:
            return short
        order = torch.randperm(len(batches), generator=generator).tolist()
        longest = max(range(len(batches)), key=lambda index: self.lengths[batches[index][0]])
        order.remove(longest)
        return [batches[index] for index in [longest, *order]] + short

    def __iter__(self) -> Iterator[int]:
        return (index for batch in self.batches() for index in batch)


class CCMTrainer(Trainer):
    """A `Trainer` whose checkpoints hold the adapter files, never the base weights; its loss adds
    `distill_weight` times the self-distillation loss (see `distillation.py`) when that is positive. With
    `streaming` set, batches are streams and the loss is `stream_training.stream_loss`."""

    distill_weight: float = 0.0
    distill_temperature: float = 1.0
    # None: the student's own base model with the adapter off; kept off `self.model`, which the Trainer wraps.
    distill_teacher: CCMForCausalLM | None = None
    streaming: StreamingConfig | None = None
    stream_piece: int = 16
    # Set: each training sample's length in positions, and batches are drawn length-grouped.
    sample_lengths: list[int] | None = None
    # Set: the run's settings (`_run_settings`), written into each checkpoint for `check_resume` to compare.
    run_settings: dict[str, Any] | None = None
    # Set: this run ends after that step of its schedule, with a checkpoint there (`train(stop_at_step=...)`).
    stop_at_step: int | None = None

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        if self.sample_lengths is None:
            return super()._get_train_sampler(train_dataset)
        # A batch pads its rows to a similar length instead of to the longest sample of a shuffled mixture. Its own
        # seed: a resumed run draws the same batches whatever else used the global RNG.
        return SimilarLengthSampler(
            self.sample_lengths,
            self.args.train_batch_size * self.args.gradient_accumulation_steps,
            seed=self.args.data_seed or self.args.seed,
        )

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        # trainer_state.json, written last, marks a checkpoint whole (`_resumed_checkpoint`): written in one rename, so
        # that a kill or a full disk while writing it leaves none, not a cut one that refused every --resume until
        # someone deleted the checkpoint.
        with _attribute_kept(self.state, "save_to_json"):
            self.state.save_to_json = partial(_save_state_whole, self.state)
            try:
                super()._save_checkpoint(model, trial)
            except (RuntimeError, OSError) as error:
                # torch.save's writer (the optimizer's state, the schedule's, the random generators') reports a write
                # the file system refused (a full disk, a file size limit) as a RuntimeError that names neither the
                # file nor the cause ("unexpected pos 20288 vs 20180"), which ended `ccm train` with a traceback.
                written_by_torch = (
                    traceback.extract_tb(error.__traceback__)[-1].filename == torch.serialization.__file__
                )
                if isinstance(error, RuntimeError) and not written_by_torch:
                    raise
                output_dir = self._get_output_dir(trial)
                checkpoint = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
                # The checkpoint cut short took room on a disk that had none left, and stayed: --resume skipped it,
                # a run started anew refused it, and with no whole checkpoint before it the fix was to find and delete
                # it. One whole (a failure after its state was written) stays.
                if self.args.should_save and not os.path.exists(os.path.join(checkpoint, TRAINER_STATE_NAME)):
                    shutil.rmtree(checkpoint, ignore_errors=True)
                # Out of file descriptors, not of room: making room on the disk would not help.
                fix = short_of(error) or "is the disk full? Make room"
                resume = "resume (ccm train --resume, resume=True) from"
                then = f"{resume} the last checkpoint saved whole"
                with suppress(OSError):  # the folder cannot be listed now (no descriptor left): said as above
                    last = _resumed_checkpoint(output_dir)
                    then = f"{resume} {last}" if last else "train again (no checkpoint was saved whole)"
                raise OSError(f"could not write the checkpoint {checkpoint} ({error}): {fix}, then {then}.") from error

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        if not self.args.should_save:  # one process writes; every process holds the same adapter
            return
        output_dir = output_dir or self.args.output_dir
        self.model.save_pretrained(output_dir)
        if self.run_settings is not None:
            text = json.dumps(self.run_settings, indent=2)
            replace_file(os.path.join(output_dir, RUN_SETTINGS_NAME), lambda path: Path(path).write_text(text))

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The model's loss, with the LM head run only where a label is predicted (training needs no other
        logits)."""
        if self.streaming is not None:
            # accelerate runs only the trained model's forward under the mixed-precision autocast; the teacher's
            # forward (and every piece's, already autocast) runs under the same autocast here.
            with self.accelerator.autocast():
                loss = stream_loss(
                    self.accelerator.unwrap_model(model),
                    inputs,
                    self.streaming,
                    self.stream_piece,
                    self.distill_weight if model.training else 0.0,
                    self.distill_temperature,
                    num_items_in_batch,
                    self.distill_teacher,
                )
            loss = self._scaled_for_processes(loss, num_items_in_batch)
            return (loss, {"loss": loss}) if return_outputs else loss
        outputs = model(**inputs, logits_at_labels=True, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss
        if self.distill_weight and model.training:
            positions = predicting_positions(inputs["labels"])
            unwrapped = self.accelerator.unwrap_model(model)
            # The teacher is not the module accelerate wrapped: its forward runs under the same autocast here.
            with self.accelerator.autocast():
                distilled = distillation_loss(
                    unwrapped,
                    inputs,
                    outputs.logits,
                    self.distill_temperature,
                    positions,
                    self.distill_teacher,
                    num_items_in_batch,
                )
            loss = loss + self.distill_weight * distilled
        loss = self._scaled_for_processes(loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _scaled_for_processes(self, loss: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
        """`loss`, normalized by `num_items_in_batch`, as `Trainer.compute_loss` scales it: with
        `average_tokens_across_devices` (the default) that count holds the labels of every process, and DDP averages
        the processes' gradients (and the Trainer their logged losses), so each process's share of the sum is
        multiplied by the number of processes; else the loss, the eval loss and the gradients were that many times
        too small."""
        if not self.args.average_tokens_across_devices or num_items_in_batch is None:
            return loss
        processes = self.accelerator.num_processes // self.get_tp_size()
        return loss * (processes if self.args.n_gpu <= 1 else self.args.n_gpu)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if created:
            optimizer.register_step_post_hook(_count_parameter_writes)
        return optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        (model or self.model).load_adapter(resume_from_checkpoint)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # The Trainer asks whether to stop only after a step: a run resumed at its last step (a finished run started
        # again) made one more step past the schedule's end at each start, writing checkpoint-<steps + 1>, and from
        # the second on with the learning rate rising again. It ends where it is, as a run of that length does.
        if self.state.global_step >= min(self.state.max_steps, self.stop_at_step or self.state.max_steps):
            self.control.should_training_stop = True
            return
        super()._run_epoch(*args, **kwargs)


class _StopAtStep(TrainerCallback):
    """Ends a run after step `step` of its schedule and saves a checkpoint there, so that a machine lent for a
    limited time trains the same steps as the whole schedule would, and `resume=True` goes on from there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.global_step >= self.step:
            control.should_save = control.should_training_stop = True
        return control


def _count_parameter_writes(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step hook: count the step's writes in every parameter's version counter. A fused optimizer (torch's
    `AdamW(fused=True)`, the Trainer's default) writes the weights without counting, and the model hashes its
    adapter again for its memory signature only when a counter moved: caches made before training were accepted
    after it, and ones made after carried the old adapter's digest."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            torch.autograd.graph.increment_version(parameter)


@dataclass
class TrainingRecipe:
    """Defaults follow the paper (cosine schedule, warm-up, LoRA on attention), scaled to a CPU: fewer and
    smaller steps, so a higher learning rate."""

    steps: int = 300
    batch_size: int = 8
    gradient_accumulation: int = 1
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    eval_every: int = 50
    save_every: int = 50
    log_every: int = 10
    seed: int = 0
    gradient_checkpointing: bool = False
    # "auto": bf16 on a GPU that supports it, fp32 on CPU (as before the option existed); "bf16": mixed precision
    # on a GPU or on a CPU with bf16 instructions (about 1.5x faster there, docs/training.md); "fp32": never autocast.
    precision: Precision = "auto"
    supervision: Supervision = "output"
    distill_weight: float = 0.0
    distill_temperature: float = 1.0
    layout: Layout = "ccm"
    # Set: train on streams (token-id sequences of one length) through a streaming cache of these sizes, as
    # `stream_training` describes, fed `stream_piece` tokens per forward; `supervision` and `layout` then do not
    # apply.
    streaming: StreamingConfig | None = None
    stream_piece: int = 16
    # Draw batches of samples of similar length: a shuffled mixture pads its rows to about twice the positions
    # (docs/training.md). Off: batches in shuffled order, as before the option existed.
    group_by_length: bool = True
    # None: GPU_PAD_MULTIPLE on a GPU, no extra padding on CPU.
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        # The Trainer reads steps <= 0 as "epochs instead" (3 of them), gradient_accumulation=0 divides by zero and
        # eval_every/save_every=0 fall back silently: refuse such values before any model work, naming the setting.
        for name in ("steps", "batch_size", "gradient_accumulation", "eval_every", "save_every", "log_every"):
            _check_recipe(getattr(self, name), name, "a positive integer", positive_int)
        _check_recipe(self.stream_piece, "stream_piece", "a positive integer", positive_int)
        _check_recipe(
            self.warmup_ratio, "warmup_ratio", "a number in [0, 1]", lambda v: finite_number(v) and 0 <= v <= 1
        )
        for name in ("learning_rate", "weight_decay", "distill_weight"):  # a rate of 0 runs the loop, weights kept
            _check_recipe(getattr(self, name), name, "a number >= 0", lambda v: finite_number(v) and v >= 0)
        _check_recipe(
            self.distill_temperature, "distill_temperature", "a positive number", lambda v: finite_number(v) and v > 0
        )
        # The Trainer seeds numpy with it, which takes 0 .. 2**32 - 1 and failed only once the model was set up.
        _check_recipe(self.seed, "seed", f"an integer in 0..{MAX_SEED}", lambda v: is_int(v) and 0 <= v <= MAX_SEED)
        if self.pad_to_multiple_of is not None:
            _check_recipe(self.pad_to_multiple_of, "pad_to_multiple_of", "None or a positive integer", positive_int)
        # Read as truth values: gradient_checkpointing="false" (a value from a config file) turned checkpointing on,
        # and group_by_length=None turned grouping off, without a word.
        for name in ("gradient_checkpointing", "group_by_length"):
            _check_recipe(getattr(self, name), name, "True or False", lambda v: isinstance(v, bool))


_check_recipe = partial(check_setting, "TrainingRecipe")


@contextmanager
def _caller_generators_kept() -> Iterator[None]:
    """Within the context, anything may seed and draw from the global generators (Python's, numpy's, torch's on the
    CPU and on every GPU); each gets its state back when it ends, also on an error."""
    on_gpu = torch.cuda.is_available()
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if on_gpu else []
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if on_gpu:
            torch.cuda.set_rng_state_all(gpus)


def train(
    model: CCMForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    train_samples: Sequence[OnlineSample] | Sequence[Sequence[int]],
    eval_samples: Sequence[OnlineSample] | Sequence[Sequence[int]] | None,
    output_dir: str | os.PathLike[str],
    recipe: TrainingRecipe | None = None,
    resume: bool = False,
    teacher: CCMForCausalLM | None = None,
    stop_at_step: int | None = None,
) -> CCMTrainer:
    """Train `model`'s adapter on `train_samples`, evaluating the loss on `eval_samples` as it goes.

    `model` itself is trained: it returns holding the final adapter, on the device it trained on (the GPU, if any, as
    with the `Trainer`), every module in the training mode it had. Checkpoints go to `output_dir/checkpoint-*` and the
    final adapter to `output_dir`; `resume=True` continues from the last checkpoint. `recipe.precision` picks bf16 mixed
    precision or fp32 (by default bf16 on a GPU, fp32 on CPU). Under `accelerate launch` or `torchrun` (DDP) every
    process trains the same adapter, only the main process writes files, and every process returns once the final
    adapter is written (call `torch.distributed.destroy_process_group()` before the script exits). `tokenizer` is needed
    for samples given as text (and gives the padding id); None for token ids. With `recipe.streaming`, samples are
    streams: token-id sequences of one length. `teacher` (with `recipe.distill_weight > 0`) replaces the base model as
    the distillation teacher: e.g. the fine-tuned full-context baseline of the same base model, which reads the plain
    history with its LoRA on; it runs in evaluation mode (its modules get their own modes back after the run) and
    without gradients (its `requires_grad` flags stay as they are), and is moved to `model`'s device, where it stays.
    `stop_at_step` ends this run after that step of the `recipe.steps` schedule (learning rate included), with a
    checkpoint and the adapter of that step saved; `resume=True` later goes on with the rest of the schedule. The run
    draws its randomness from `recipe.seed`; the global generators (Python's, numpy's, torch's) are the caller's again
    when it returns or fails. On a CPU the run uses torch's deterministic algorithms (warn-only), so that one seed
    trains one adapter bit for bit, unless the caller set `torch.use_deterministic_algorithms` already.
    """
    _refuse_sharded_launch()
    _refuse_disabled_gradients()
    _refuse_trainable_base(model)
    _check_sample_list(train_samples, "train_samples")
    if eval_samples is not None:
        _check_sample_list(eval_samples, "eval_samples")
    if len(train_samples) == 0:  # the Trainer ran no step and the untrained adapter was saved as the result
        raise ValueError("train_samples is empty; give at least one sample to train on.")
    recipe = recipe or TrainingRecipe()
    check_flags(resume=resume)  # resume="no" is truthy: it went on from the checkpoint it said not to
    check_stop_at_step(stop_at_step, recipe)
    on_gpu = torch.cuda.is_available()
    bf16 = _uses_bf16(recipe.precision, on_gpu)
    check_training_setup(recipe, model.config.conditional_lora, teacher=teacher is not None)
    stream_length: int | None = None
    streams: StreamCollator | None = None
    if recipe.streaming is not None:
        # The sizes against this model's adapter and positions (and rotary embeddings): they failed at the first step.
        model.new_cache(streaming=recipe.streaming)
        # Every stream read now: one of another length, or with other ids, failed at the step that drew it. Their
        # length is the run's: a resumed run compares it with its checkpoint's.
        streams = StreamCollator(recipe.streaming, model.vocabulary_size)
        train_samples = streams.checked(train_samples, "train_samples")
        if eval_samples:
            eval_samples = streams.checked(eval_samples, "eval_samples")
        stream_length = len(train_samples[0])
    if teacher is not None:
        _check_teacher(model, teacher)
    base_fingerprint = model.memory_signature()["base_fingerprint"]
    if resume:
        check_resume(output_dir, model.config, recipe, base_fingerprint, stream_length)
    else:
        check_fresh_start(output_dir)
    args = TrainingArguments(
        output_dir=os.fspath(output_dir),
        max_steps=recipe.steps,
        per_device_train_batch_size=recipe.batch_size,
        per_device_eval_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation,
        learning_rate=recipe.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, round(recipe.warmup_ratio * recipe.steps)),
        weight_decay=recipe.weight_decay,
        eval_strategy="steps" if eval_samples else "no",
        eval_steps=recipe.eval_every,
        save_strategy="steps",
        save_steps=recipe.save_every,
        save_total_limit=2,
        logging_steps=recipe.log_every,
        bf16=bf16,
        use_cpu=not on_gpu,
        remove_unused_columns=False,
        prediction_loss_only=True,
        label_names=["labels"],
        report_to="none",
        seed=recipe.seed,
        dataloader_num_workers=0,
    )
    collator = (
        streams
        if streams is not None
        else CCMDataCollator(
            model,
            tokenizer=tokenizer,
            pad_token_id=padding_id(tokenizer, model.vocabulary_size),
            supervision=recipe.supervision,
            layout=recipe.layout,
            pad_to_multiple_of=recipe.pad_to_multiple_of or (GPU_PAD_MULTIPLE if on_gpu else None),
        )
    )
    sample_lengths = None
    if isinstance(collator, CCMDataCollator):
        # Tokenized once here rather than at every batch; the lengths come from the same ids. Every sample is read
        # now, so a bad one (an id outside the vocabulary, nothing to learn from) is refused before the first step.
        train_samples = collator.tokenized(train_samples, "train_samples")
        _check_supervised(collator, train_samples, "train_samples")
        if eval_samples:
            eval_samples = collator.tokenized(eval_samples, "eval_samples")
            _check_supervised(collator, eval_samples, "eval_samples")
        if recipe.group_by_length:
            sample_lengths = [
                collator.sequence_length(sample, index, "train_samples") for index, sample in enumerate(train_samples)
            ]
    checkpoint = _resumed_checkpoint(output_dir) if resume else None
    last = get_last_checkpoint(os.fspath(output_dir)) if resume else None
    if checkpoint != last:
        logger.warning("%s was cut short while saving (no %s): resuming from %s.", last, TRAINER_STATE_NAME, checkpoint)
    # The Trainer seeds the global generators with the run's seed: the caller's were reseeded by every run, and
    # whatever the caller drew afterwards (sampled replies, say) was the same for every seed it had set. Taken once the
    # arguments have set this process's GPU, so that reading the GPUs' generators sets up no other one.
    # The Trainer also sets `use_cache=False` on the model's config, for good: a new attribute of a CCMConfig.
    with _caller_generators_kept(), _attribute_kept(model.config, "use_cache"):
        trainer = CCMTrainer(
            model=model,
            args=args,
            train_dataset=list(train_samples),
            eval_dataset=list(eval_samples) if eval_samples else None,
            data_collator=collator,
            callbacks=None if stop_at_step is None else [_StopAtStep(stop_at_step)],
        )
        trainer.sample_lengths, trainer.stop_at_step = sample_lengths, stop_at_step
        trainer.run_settings = {
            **_run_settings(recipe, model.config, stream_length),
            BASE_FINGERPRINT: base_fingerprint,
        }
        trainer.distill_weight, trainer.distill_temperature = recipe.distill_weight, recipe.distill_temperature
        if teacher is not None:
            trainer.distill_teacher = teacher.to(trainer.args.device)
        trainer.streaming, trainer.stream_piece = recipe.streaming, recipe.stream_piece
        _run(trainer, model, teacher, recipe.gradient_checkpointing, checkpoint, output_dir)
    return trainer


def _save_state_whole(state: TrainerState, path: str) -> None:
    """Write `state` as trainer_state.json at `path` in one rename."""
    replace_file(path, partial(TrainerState.save_to_json, state))


def _run(
    trainer: CCMTrainer,
    model: CCMForCausalLM,
    teacher: CCMForCausalLM | None,
    gradient_checkpointing: bool,
    checkpoint: str | None,
    output_dir: str | os.PathLike[str],
) -> None:
    """Train `model` with `trainer` (from `checkpoint`, if any) and save its adapter to `output_dir`, giving back
    what the run changes for its own sake only; a failed run gives the model back as it came."""
    adapter, config = _trainable_state(model), model.config
    try:
        try:
            # The Trainer switches the whole model to training mode and leaves it there: every module gets its own
            # mode back, also when a step fails, so that dropout does not make every later compress and generate
            # random, and a module the caller kept in another mode than the model's stays in it.
            with (
                modes_kept(model),
                _deterministic_for_the_run(trainer.args.device),
                _evaluating_for_the_run(teacher),
                _checkpointing_for_the_run(model, gradient_checkpointing),
                # accelerate marks the model it prepared, and skips any model so marked: a second run on the same
                # model trained without the first run's mixed-precision autocast (bf16 became fp32 without a word).
                _attribute_kept(model, "_is_accelerate_prepared"),
            ):
                trainer.train(resume_from_checkpoint=checkpoint)
        finally:
            # accelerate wraps the model's forward in the mixed-precision autocast: the caller gets the model back
            # running as it was built (bf16 stays a choice of the training run, not of every later forward).
            trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
        if trainer.is_world_process_zero():
            model.save_pretrained(output_dir)
    except BaseException:
        # A failed run (an out-of-memory error, an interrupt, a full disk) gives the adapter back as it came, not with
        # the gradients of a backward or the weights of the steps it made: its checkpoints (the last step's always
        # among them) hold what it trained, and `resume=True` goes on from there. A resumed one loaded the
        # checkpoint's config with its adapter (its base model's name, say), which goes back too.
        _restore_trainable_state(adapter)
        model.config = config
        raise
    trainer.accelerator.wait_for_everyone()  # every process returns with the final adapter on disk


@contextmanager
def _attribute_kept(holder: object, name: str) -> Iterator[None]:
    """Within the context, anything may set the attribute `name` of `holder`; it gets its own value back (or none)
    when it ends, also on an error."""
    attributes = vars(holder)
    had, value = name in attributes, attributes.get(name)
    try:
        yield
    finally:
        if had:
            attributes[name] = value
        else:
            attributes.pop(name, None)


@contextmanager
def _deterministic_for_the_run(device: torch.device) -> Iterator[None]:
    """Within the context, on a CPU, torch runs its deterministic algorithms; the caller's setting comes back when it
    ends, also on an error. A gradient gathered from repeated indices (a mixture-of-experts layer sending each token
    to 3 or more experts, as Qwen2-MoE and gpt-oss do) was summed by racing threads once a batch passed about 32k
    elements, so two runs from one seed trained two adapters. Warn-only: the setting is the process's, and an
    operation without a deterministic algorithm (`Tensor.put_`, in code another thread runs meanwhile, say) warns
    instead of failing. A caller's own setting is left as it is, and so is a GPU's, where torch's deterministic mode
    refuses matrix products without CUBLAS_WORKSPACE_CONFIG."""
    if device.type != "cpu" or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextmanager
def _evaluating_for_the_run(teacher: CCMForCausalLM | None) -> Iterator[None]:
    """Within the context, the distillation `teacher` (if any) is in evaluation mode, which `plain_prompt_logits` then
    need not switch at every step; each of its modules gets its own mode back when it ends. Its weights need no
    freezing: it runs without gradients. Frozen for good, a teacher trained next (the fine-tuned baseline trained on)
    failed on a bare RuntimeError, with no gradient to take."""
    if teacher is None:
        yield
        return
    with modes_kept(teacher):
        teacher.eval()
        yield


@contextmanager
def _checkpointing_for_the_run(model: CCMForCausalLM, asked: bool) -> Iterator[None]:
    """Within the context, with `asked`, `model` recomputes its activations during backward; one that kept them
    before keeps them again when it ends, also on an error. Left on, the run's checkpointing (and the embeddings'
    require-grads hook it registers) stayed with the model served or trained on; one already on is left as the caller
    set it (its `every_n_layers`, say)."""
    if not asked or model.is_activation_checkpointing:
        yield
        return
    model.activation_checkpointing_enable()
    try:
        yield
    finally:
        model.activation_checkpointing_disable()


def check_stop_at_step(stop_at_step: int | None, recipe: TrainingRecipe) -> None:
    """Raise unless `stop_at_step` is None or a step of `recipe`'s schedule."""
    if stop_at_step is not None and not (positive_int(stop_at_step) and stop_at_step <= recipe.steps):
        raise ValueError(
            f"stop_at_step (ccm train --stop-at-step) must be a step of the schedule, 1..{recipe.steps} "
            f"(TrainingRecipe.steps), or None to train it to the end; got {stop_at_step!r}."
        )


def _trainable_state(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None]]:
    """Every parameter an optimizer may change (those that require grad), with copies of its value and gradient."""
    return [
        (parameter, parameter.detach().clone(), None if parameter.grad is None else parameter.grad.detach().clone())
        for parameter in model.parameters()
        if parameter.requires_grad
    ]


def _restore_trainable_state(state: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None]]) -> None:
    """Put back the values and gradients `_trainable_state` copied."""
    with torch.no_grad():
        for parameter, value, gradient in state:
            parameter.copy_(value)
            parameter.grad = gradient


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware, where bf16 autocast beats fp32: AVX512-BF16 or AMX on x86, the
    BF16 extension on ARM (oneDNN's own check, `torch.ops.mkldnn._is_mkldnn_bf16_supported`, which on x86 also
    accepts plain AVX512, where bf16 is only emulated)."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return True


def _uses_bf16(precision: str, on_gpu: bool) -> bool:
    """Whether training under `precision` runs bf16 autocast, on a GPU (`on_gpu`) or the CPU; raise for an unknown
    precision, or for "bf16" on a device without bf16."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"Unknown precision {precision!r}: TrainingRecipe.precision (ccm train --precision) is one of "
            f"{', '.join(repr(name) for name in PRECISIONS)}."
        )
    if precision == "fp32":
        return False
    if precision == "auto":  # CPU stays fp32, as before the option existed, so that earlier runs reproduce
        return on_gpu and torch.cuda.is_bf16_supported()
    if on_gpu and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision='bf16' needs a GPU with bf16 support, and {torch.cuda.get_device_name()} has none; train with "
            "precision='fp32' (ccm train --precision fp32)."
        )
    if not on_gpu and not cpu_has_bf16():
        raise ValueError(
            f"precision='bf16' on CPU needs bf16 instructions (AVX512-BF16 or AMX on x86, BF16 on ARM), and this CPU "
            f"({platform.processor() or platform.machine()}) has none: bf16 would be emulated, slower than fp32. "
            "Train with precision='fp32' (ccm train --precision fp32)."
        )
    return True


def _refuse_sharded_launch() -> None:
    """Raise, before any work, under `accelerate launch` with FSDP or DeepSpeed (accelerate says so through the
    environment of every process)."""
    sharded = [name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"]
    if sharded:
        raise ValueError(
            f"ccm training runs with DDP, not {' or '.join(sharded)}: the adapter is a few MB and the base model is "
            "frozen, so sharding saves little, and PEFT's frozen base would need FSDP's use_orig_params. Launch "
            "with `accelerate launch --multi_gpu ...` or `torchrun --nproc_per_node N ...` instead."
        )


def _refuse_disabled_gradients() -> None:
    """Raise, before any work, inside `torch.no_grad()` or `torch.inference_mode()`: the Trainer then ran the first
    step's forward without a graph, and failed at its backward on a bare RuntimeError ("element 0 of tensors does not
    require grad"), with the output folder made."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        context = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise ValueError(
            f"train() was called inside {context}, where no gradient can be taken; call it outside that context (or "
            "within torch.enable_grad() and torch.inference_mode(False))."
        )


def _refuse_trainable_base(model: CCMForCausalLM) -> None:
    """Raise, before any work, if a weight of the base model requires grad (`model.requires_grad_(True)`, say): the
    Trainer's optimizer then trained it, and the adapter saved without it computed something else once loaded."""
    trainable = [name for name, parameter in model._weights()["base"] if parameter.requires_grad]
    if trainable:
        raise ValueError(
            f"{len(trainable)} weights of the base model require grad ({', '.join(trainable[:3])}"
            f"{' ...' if len(trainable) > 3 else ''}), but train() trains the adapter alone (the LoRA and the <COMP> "
            "embeddings), the only weights it saves. Freeze them first: for name, parameter in "
            "model.named_parameters(): parameter.requires_grad_(name == 'comp_embeddings' or '.lora_' in name)."
        )


def _check_sample_list(samples: Any, name: str) -> None:
    """Raise a TypeError naming `name` unless `samples` is a list of samples (anything with a length and indexing:
    a tuple, a 2-D tensor of streams). A generator was read once to check it and once to tokenize it, so eval_samples
    given as one evaluated nothing, without a word; one sample without its list failed on `len()`."""
    listed = hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
    if not listed or isinstance(samples, (OnlineSample, str, bytes, Mapping)):
        raise TypeError(
            f"{name} is a {type(samples).__name__}, not a list of samples; give a list of OnlineSample (of token-id "
            "lists with recipe.streaming): [sample] for one, list(...) of a generator."
        )


def _check_supervised(collator: CCMDataCollator, samples: Sequence[OnlineSample], name: str) -> None:
    """Raise a ValueError naming the first sample with no label: a batch of such samples has no loss, which the
    Trainer met with a TypeError (`None / int`) at whichever step drew one."""
    for index, sample in enumerate(samples):
        if not collator.supervised_tokens(sample, index, name):
            dense = " and no context after the first to supervise" if collator.supervision == "dense" else ""
            # An output of whitespace or zero-width characters, which a BERT-style tokenizer drops, was "no output".
            text = isinstance(sample.output, str) and sample.output
            output = f"the tokenizer reads its output {sample.output!r:.60} as no token" if text else "no output"
            raise ValueError(
                f"{name}[{index}] has no token to learn from: {output}{dense}. Give every sample an output "
                "(the text the model should produce after the input), or leave it out."
            )


# What the Trainer writes into every checkpoint besides the adapter, and needs to go on as the run went: without the
# optimizer or the scheduler it silently starts both anew (a fresh Adam state, a second warm-up).
CHECKPOINT_STATE = (TRAINER_STATE_NAME, "optimizer.pt", "scheduler.pt")
# The settings a resumed run must share with its checkpoint: the adapter's structure and how its memory is made.
RESUMED_SETTINGS = (
    "update",
    "max_memory_tokens",
    "num_comp_tokens",
    "conditional_lora",
    "r",
    "lora_alpha",
    "target_modules",
)


# The recipe settings a resumed run must share with its checkpoint: what it learns from, in what order, and the
# optimizer it continues. The Trainer took the learning rate and weight decay from the saved optimizer without a word;
# another batch size, accumulation, seed or grouping skipped other samples than the run had trained on. Precision,
# gradient checkpointing, padding and the eval, save and log intervals change neither, and may change; so may `steps`,
# to go on past the end of a run (its schedule then stretches to the new length).
RESUMED_RECIPE = (
    "batch_size",
    "gradient_accumulation",
    "learning_rate",
    "warmup_ratio",
    "weight_decay",
    "seed",
    "group_by_length",
    "supervision",
    "layout",
    "distill_weight",
    "distill_temperature",
    "streaming",
    "stream_piece",
)
_CHECKPOINT_FOLDER = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
# Each checkpoint's record of its run's settings (checkpoints written before it have none, and are not compared).
RUN_SETTINGS_NAME = "ccm_training.json"
# Its entry for the base model's weights (`memory_signature()["base_fingerprint"]`): a run resumed on another base of
# the same shape (another checkpoint or fine-tune of the architecture) went on training the adapter on it.
BASE_FINGERPRINT = "base_fingerprint"
# Its entry for the length of a stream run's samples (`ccm train --stream-chunks`): a run resumed with longer streams
# went on training through more compressions per sample, on other stretches of the text, without a word.
STREAM_LENGTH = "stream_length"


def _run_settings(recipe: TrainingRecipe, config: CCMConfig, stream_length: int | None = None) -> dict[str, Any]:
    """The settings of `recipe` in `RESUMED_RECIPE` for an adapter of `config`, the number of processes (each
    draws its share of every batch) and, given, the length of the streams trained on, as JSON values."""
    settings = {name: getattr(recipe, name) for name in RESUMED_RECIPE}
    # The stream's cap as it streams (the adapter's where None): checkpoints record the cap they trained with.
    settings["streaming"] = None if recipe.streaming is None else asdict(recipe.streaming.for_adapter(config))
    if stream_length is not None:
        settings[STREAM_LENGTH] = stream_length
    settings["processes"] = int(os.environ.get("WORLD_SIZE", "1"))
    return json.loads(json.dumps(settings))


def check_resume(
    output_dir: str | os.PathLike[str],
    config: CCMConfig,
    recipe: TrainingRecipe | None = None,
    base_fingerprint: str | None = None,
    stream_length: int | None = None,
) -> None:
    """Raise a ValueError naming the folder or file unless `output_dir` holds a checkpoint that `resume=True` can
    continue with a model of `config` and, given, `recipe`, a base model of `base_fingerprint` and streams of
    `stream_length` tokens (settings only: `ccm train --resume` asks before any model loads). A checkpoint
    incomplete or damaged (a run killed while writing it, a full disk) made the Trainer load its adapter into the
    model, then fail on the rest with a bare `OSError` or `JSONDecodeError` that named no file; one of another
    adapter gave it another update rule, and one trained on other samples (`trained_on`) the new ones, without a
    word."""
    checkpoint = _resumed_checkpoint(output_dir)
    if checkpoint is None:
        last = get_last_checkpoint(os.fspath(output_dir)) if os.path.isdir(output_dir) else None
        if last is not None:
            raise ValueError(
                f"{os.fspath(output_dir)} holds only checkpoints whose save was cut short (no {TRAINER_STATE_NAME}, "
                f"as in {last}); delete its checkpoint-* folders and train anew without --resume (resume=False)."
            )
        raise ValueError(
            f"{os.fspath(output_dir)} holds no checkpoint to resume from; train without --resume (resume=False), or "
            "give the output folder of the run to continue."
        )
    fix = f"delete {checkpoint} to resume from the checkpoint before it, or train anew without resuming."
    expected = (*VERIFIED_FILES, *CHECKPOINT_STATE)
    missing = [name for name in expected if not os.path.lexists(os.path.join(checkpoint, name))]
    if missing:
        raise ValueError(f"{checkpoint} is incomplete: it has no {', '.join(missing)}; {fix}")
    for name in expected:
        _check_regular_file(os.path.join(checkpoint, name), fix)
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    with open(state, "rb") as file:
        _check_trainer_state(parse_json_object(file.read(), state, fix), state, checkpoint, fix)
    try:  # the adapter the Trainer loads first, whose reader's own fix (save it again) fits no checkpoint
        saved, _ = read_adapter(Path(checkpoint))
    except (ValueError, OSError) as error:
        if short_of(error) is not None:  # the process's want, not the checkpoint's
            raise
        raise ValueError(f"{checkpoint} holds a damaged adapter ({error}); {fix}") from None
    settings = [*RESUMED_SETTINGS, *(("ema_alpha",) if config.update == "ema" else ())]
    different = [name for name in settings if getattr(saved, name) != getattr(config, name)]
    if different:
        details = ", ".join(f"{n}: checkpoint {getattr(saved, n)!r} vs model {getattr(config, n)!r}" for n in different)
        raise ValueError(
            f"{checkpoint} holds another adapter ({details}); build the model as the run that wrote it did (ccm train: "
            "the same --update, --ema-alpha, --num-comp-tokens, --lora-r, --target-modules and --method), or train "
            "anew into another output folder."
        )
    if saved.trained_on != config.trained_on:
        # Another task went on from the checkpoint's step and data order without a word, and the final adapter's card
        # named the new task alone.
        raise ValueError(
            f"{checkpoint} was trained on {_named(saved.trained_on)}, and this run trains on "
            f"{_named(config.trained_on)}; resume with the samples of the run that wrote it (ccm train: the same "
            f"--task and --trained-on), or train its adapter on to the new samples in another output folder (ccm "
            f"train --init-adapter {checkpoint})."
        )
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith((".pt", ".pth")):
            _check_pickled_state(os.path.join(checkpoint, name), fix)
    if recipe is not None:
        _check_run_settings(checkpoint, recipe, config, base_fingerprint, fix, stream_length)


def _resumed_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint `resume=True` continues from: the last one in `output_dir` whose save was not cut short, or
    None. The Trainer writes trainer_state.json last, so a folder without it is a save that a kill or a full disk
    ended; the Trainer took it for the last checkpoint, and a preempted run restarted with --resume was refused until
    someone deleted it."""
    folder = os.fspath(output_dir)
    if not os.path.isdir(folder):
        return None
    steps = [
        (int(found[1]), name)
        for name in os.listdir(folder)
        if (found := _CHECKPOINT_FOLDER.fullmatch(name)) and os.path.isdir(os.path.join(folder, name))
    ]
    for _, name in sorted(steps, reverse=True):
        if os.path.isfile(os.path.join(folder, name, TRAINER_STATE_NAME)):
            return os.path.join(folder, name)
    return None


def _check_run_settings(
    checkpoint: str,
    recipe: TrainingRecipe,
    config: CCMConfig,
    base_fingerprint: str | None,
    fix: str,
    stream_length: int | None = None,
) -> None:
    """Raise a ValueError naming each setting of `recipe` for an adapter of `config` (and the base model, given its
    fingerprint, and the streams' length, given) that differs from the one `checkpoint` was trained with."""
    path = os.path.join(checkpoint, RUN_SETTINGS_NAME)
    if not os.path.isfile(path):
        return
    with open(path, "rb") as file:
        saved = parse_json_object(file.read(), path, fix)
    ours = _run_settings(recipe, config, stream_length)
    ours |= {BASE_FINGERPRINT: base_fingerprint} if base_fingerprint else {}
    # A checkpoint written before the streams' length was recorded is not compared on it.
    different = [n for n in ours if saved.get(n) != ours[n] and (n != STREAM_LENGTH or n in saved)]
    named = {"processes": "the number of processes", STREAM_LENGTH: "the streams' length (ccm train --stream-chunks)"}
    if different:
        details = ", ".join(
            "another base model (its weights differ: ccm train --model)"
            if n == BASE_FINGERPRINT
            else f"{named.get(n, f'TrainingRecipe.{n}')}: checkpoint {saved.get(n)!r} vs this run {ours[n]!r}"
            for n in different
        )
        raise ValueError(
            f"{checkpoint} was trained with other settings ({details}); resume with the settings of the run that "
            f"wrote it, or train its adapter on with the new ones, optimizer and schedule anew, in another output "
            f"folder (ccm train --init-adapter {checkpoint})."
        )


# What each field of trainer_state.json that a resumed run reads must hold. A hand-edited or crafted file's other
# values failed deep in the Trainer on a bare TypeError or KeyError (some only at the first save, steps later), or ran
# on: a negative step wrote checkpoint--1 and checkpoint--2, a huge one ended the run at once and saved the
# checkpoint's adapter as trained.
_STATE_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "epoch": ("a number", finite_number),
    "train_batch_size": ("a positive integer or null", lambda v: v is None or positive_int(v)),
    "num_input_tokens_seen": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "total_flos": ("a number", finite_number),
    "log_history": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v)),
    "best_metric": ("a number or null", lambda v: v is None or number(v)),
    "best_global_step": ("an integer >= 0 or null", lambda v: v is None or (is_int(v) and v >= 0)),
    "best_model_checkpoint": ("a string or null", lambda v: v is None or isinstance(v, str)),
    # The Trainer writes each stateful callback's entry back at every save, and fails there on a missing one.
    "stateful_callbacks": (
        "an object with a TrainerControl object",
        lambda v: isinstance(v, dict) and isinstance(v.get("TrainerControl"), dict),
    ),
}


def _check_trainer_state(state: dict[str, Any], path: str, checkpoint: str, fix: str) -> None:
    """Raise a ValueError naming `path` and the field unless `state` (its content) is what the Trainer writes: the
    fields it knows, of their types, and the step of the folder's name."""
    unknown = sorted(set(state) - {field.name for field in fields(TrainerState)})
    if unknown:
        raise ValueError(f"{path} holds fields no Trainer writes ({', '.join(unknown)}); {fix}")
    step = int(os.path.basename(checkpoint).rpartition("-")[2])
    if not is_int(state.get("global_step")) or state["global_step"] != step:
        raise ValueError(
            f"{path} holds global_step={state.get('global_step')!r}, not its folder's step (the integer {step}); {fix}"
        )
    for name, (allowed, ok) in _STATE_FIELDS.items():
        if name in state and not ok(state[name]):
            raise ValueError(f"{path} holds {name}={state[name]!r}, not {allowed}; {fix}")


def _check_regular_file(path: str, fix: str) -> None:
    """Raise a ValueError naming `path` unless it is a regular file: a pipe among a checkpoint's files blocked the
    resumed run for good, waiting for a writer."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file (a folder, a pipe or a device); {fix}")


def _check_pickled_state(path: str, fix: str) -> None:
    """Raise a ValueError naming `path` unless it is a whole `torch.save` archive that the Trainer can load on resume:
    tensors and plain data only. The Trainer loads it with `weights_only=True`, which refuses a crafted file's
    objects without running their code, but with a bare `UnpicklingError` that advises loading it unrestricted, once
    the checkpoint's adapter is in the model; here it is refused first, and never unpickled but by that loader."""
    if os.path.basename(path) == SCALER_NAME:
        # The loss scaler of fp16 training, which ccm never runs: the Trainer, holding no scaler, failed on a bare
        # AttributeError.
        raise ValueError(f"{path} is the loss scaler of an fp16 run, which no ccm training run writes; {fix}")
    _check_regular_file(path, fix)
    # torch.save writes a zip archive: its checksums tell a truncated or damaged file before unpickling it.
    try:
        with zipfile.ZipFile(path) as archive:
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise_if_short_of(error, path)
        raise ValueError(f"{path} is damaged ({error}); {fix}") from None
    if bad_member is not None:
        raise ValueError(f"{path} is damaged ({bad_member} fails its checksum); {fix}")
    try:
        with safe_globals():  # the numpy types of the RNG state, allowed as the Trainer allows them
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        held = f" ({found[1]})" if found else ""
        raise ValueError(
            f"{path} holds an object other than tensors and plain data{held}, which no training checkpoint does: a "
            f"crafted or foreign file, left unloaded; {fix}"
        ) from None
    except (RuntimeError, EOFError) as error:  # an archive whose pickle or records are not torch.save's
        raise ValueError(f"{path} is damaged ({error}); {fix}") from None


def _named(trained_on: str | None) -> str:
    """An adapter's `trained_on` as a message says it."""
    return f'"{trained_on}"' if trained_on else "samples it does not name"


def check_fresh_start(output_dir: str | os.PathLike[str]) -> None:
    """Raise a ValueError naming the checkpoint unless `output_dir` holds none, for a run that starts anew
    (`ccm train` without `--resume` asks before any model loads). A new run there wrote its checkpoints among the
    earlier run's, and `resume=True` after it was cut short continued the earlier run's last checkpoint (the highest
    step wins), or ended at once on it, saving its adapter as the new run's."""
    checkpoint = get_last_checkpoint(os.fspath(output_dir)) if os.path.isdir(output_dir) else None
    if checkpoint is not None:
        raise ValueError(
            f"{os.fspath(output_dir)} holds the checkpoints of an earlier run ({checkpoint}); continue that run with "
            "resume=True (ccm train --resume), or train anew into another output folder (or delete its checkpoint-* "
            "folders)."
        )


def check_training_setup(recipe: TrainingRecipe, conditional_lora: bool, teacher: bool = False) -> None:
    """Raise a ValueError unless `recipe` can train an adapter with `conditional_lora` (given a distillation
    `teacher` or not). Settings only, no model: `ccm train` asks before any model loads."""
    if teacher and not recipe.distill_weight:
        raise ValueError(
            "A distillation teacher was given, but distill_weight is 0, so it would never be asked; set "
            "distill_weight > 0 (ccm train --distill-weight 1) or train without a teacher."
        )
    if recipe.layout == "full_context" and (conditional_lora or recipe.distill_weight):
        raise ValueError(
            "layout='full_context' trains the fine-tuned full-context baseline: a LoRA at every position "
            "(build the model with transformers_ccm.baseline.full_context_config(config)) and no distillation "
            f"(got conditional_lora={conditional_lora}, distill_weight={recipe.distill_weight})."
        )
    if recipe.streaming is None:
        return
    if not isinstance(recipe.streaming, StreamingConfig):
        raise TypeError(f"TrainingRecipe.streaming must be a StreamingConfig (or None), got {recipe.streaming!r}.")
    if not recipe.streaming.compress:
        # No <COMP> token would run: the adapter takes no part in the loss, and its backward failed inside torch.
        raise ValueError(
            "Training on streams needs StreamingConfig(compress=True): a stream that only drops its oldest tokens "
            "(StreamingLLM) never runs the adapter, so there is nothing to train."
        )
    if recipe.layout != "ccm" or not conditional_lora:
        raise ValueError(
            "Training on streams needs a compression adapter (conditional_lora=True, layout='ccm'); the fine-tuned "
            "full-context baseline has no memory to stream."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "Training on streams runs in one process: each step runs many forwards through one cache before its "
            "backward, which DDP's gradient synchronisation does not follow. Launch it without accelerate/torchrun "
            "(one GPU), or train the parallel layout (--supervision dense) on several."
        )
    if recipe.gradient_checkpointing:
        raise ValueError(
            "Gradient checkpointing does not apply to training on streams: each piece's forward keeps a cache, "
            "which checkpointed layers do not fill. Train without it, or with shorter streams."
        )


def _check_teacher(model: CCMForCausalLM, teacher: CCMForCausalLM) -> None:
    """Raise unless `teacher` can teach `model`: another model, with a LoRA that reads plain prompts (a compression
    adapter's is off there), on the same base weights (the teacher's logits are compared with the student's token by
    token)."""
    if teacher is model:
        raise ValueError(
            "The teacher is the model being trained; leave teacher=None to distill from its own base model."
        )
    if teacher.config.conditional_lora:
        raise ValueError(
            "The distillation teacher is a compression adapter (conditional_lora=True): it reads the plain history "
            "with its adapter off, as its base model, so it would teach what teacher=None does. Give a fine-tuned "
            "full-context baseline (conditional_lora=False, ccm train --method full-context), or leave teacher=None "
            "to distil from the base model."
        )
    if teacher.config.base_model_shape != model.config.base_model_shape:
        raise ValueError(
            f"The distillation teacher was made for {teacher.config.base_model_name_or_path}, not for the base of "
            f"the model being trained ({model.config.base_model_name_or_path}); give an adapter of the same base."
        )
    # Same shapes, other weights (another checkpoint or fine-tune of the architecture, another tokenizer behind the
    # same vocabulary size): its logits are those of another model, and the KL distilled nonsense without a word.
    if teacher.memory_signature()["base_fingerprint"] != model.memory_signature()["base_fingerprint"]:
        raise ValueError(
            f"The distillation teacher runs on other base weights ({teacher.config.base_model_name_or_path}, "
            f"{teacher.dtype}) than the model being trained ({model.config.base_model_name_or_path}, {model.dtype}): "
            "the shapes match, the weights or their dtype do not. Give an adapter loaded onto the same base model "
            "(ccm train: the same --model for both)."
        )
