"""The `ccm` command: train, eval, stream-eval, chat and demo."""

from __future__ import annotations

import argparse
import codecs
import functools
import io
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from transformers_ccm.config import UPDATE_RULES, CCMConfig
from transformers_ccm.embedded import DEFAULT_MODEL
from transformers_ccm.extras import figure
from transformers_ccm.files import made_folder, nearest_existing, replace_files, short_of

if TYPE_CHECKING:
    from pathlib import Path

    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from transformers_ccm.cache import CompressedMemoryCache
    from transformers_ccm.chat import TurnReport
    from transformers_ccm.data import OnlineSample
    from transformers_ccm.modeling import CCMForCausalLM
    from transformers_ccm.streaming import StreamingConfig

    # What `ccm eval` scores at once: (task, wording set, time step, samples, metric, the line of each sample in
    # the task's JSONL file or None).
    SampleSet = tuple[str, str, int, list[OnlineSample], str, list[int] | None]


# Commands import torch and transformers inside their handlers, so that `ccm --help` answers at once.

_EVAL_TASKS = ["icl", "personalization", "dialogue"]
_EVAL_SAMPLES = 200


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="base model: 'default' (SmolLM2-135M-Instruct, embedded), a local path or a Hub id",
    )


def _add_keep_window_full(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-window-full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="streams (stream-eval, train --supervision stream): a compressed chunk stays in the window until new "
        "tokens push it out, so the KV budget stays full; --no-keep-window-full drops it at once (the paper)",
    )


def _add_stream_sizes(parser: argparse.ArgumentParser) -> None:
    """The sizes of a streaming cache besides its chunk: `ccm stream-eval` streams with them and `ccm train
    --supervision stream` trains with them (a text task's samples span their window too)."""
    parser.add_argument("--window-tokens", type=int, default=148, help="streams: recent tokens kept as they are")
    parser.add_argument("--sink-tokens", type=int, default=4, help="streams: first tokens kept for ever")
    parser.add_argument(
        "--max-memory-tokens",
        type=int,
        default=None,
        help="streams: concat memory cap, oldest evicted first (default: 8, or the adapter's own cap where it has one)",
    )


def _streaming_config(args: argparse.Namespace) -> StreamingConfig:
    """The streaming sizes of `_add_stream_sizes`, `--compress-chunk` and `--keep-window-full` (unchecked:
    `StreamingConfig.validate` checks them against the adapter)."""
    from transformers_ccm.streaming import StreamingConfig

    return StreamingConfig(
        window_tokens=args.window_tokens,
        sink_tokens=args.sink_tokens,
        compress_chunk=args.compress_chunk,
        max_memory_tokens=args.max_memory_tokens,
        keep_window_full=args.keep_window_full,
    )


# The `ccm train` flag that sets each TrainingRecipe field a user can get wrong.
_RECIPE_FLAGS = {
    "steps": "--steps",
    "batch_size": "--batch-size",
    "gradient_accumulation": "--gradient-accumulation",
    "learning_rate": "--learning-rate",
    "eval_every": "--eval-every",
    "save_every": "--eval-every",
    "seed": "--seed",
    "distill_weight": "--distill-weight",
    "stream_piece": "--stream-piece",
    "group_by_length": "--group-by-length",
    "supervision": "--supervision",
    "layout": "--method",
    "streaming": (
        "--supervision stream, --compress-chunk, --keep-window-full, --window-tokens, --sink-tokens or "
        "--max-memory-tokens"
    ),
}


# The `ccm train` flag that sets each CCMConfig field of a new adapter.
_CONFIG_FLAGS = {
    "num_comp_tokens": "--num-comp-tokens",
    "update": "--update",
    "ema_alpha": "--ema-alpha",
    "r": "--lora-r",
    "target_modules": "--target-modules",
}


def _in_flags(error: ValueError) -> ValueError:
    """`error` in the words of `ccm train`: each TrainingRecipe or CCMConfig field it names as the flag that sets it."""
    flags = {"TrainingRecipe": _RECIPE_FLAGS, "CCMConfig": _CONFIG_FLAGS}
    return ValueError(re.sub(r"(TrainingRecipe|CCMConfig)\.(\w+)", lambda m: flags[m[1]].get(m[2], m[0]), str(error)))


def _in_file_rows(error: ValueError, rows: dict[str, tuple[str | None, list[int] | None]]) -> ValueError:
    """`error` in the words of `ccm train` or `ccm eval`: a sample it names as `name[i]` (`train_samples[i]`,
    `samples[i]`) by the file and line it was read from, where `rows[name]` gives that file and its samples' lines
    (None for a built-in task); other errors as they are."""
    match = re.match(r"(\w+)\[(\d+)\](\.?)", str(error))
    path, lines = rows.get(match[1], (None, None)) if match else (None, None)
    if match is None or lines is None:
        return error
    # `train_samples[3].input holds ...` as `mine.jsonl:5: input holds ...`, as load_jsonl names a bad field.
    where = f"{path}:{lines[int(match[2])]}{': ' if match[3] else ''}"
    return ValueError(where + str(error)[match.end() :])


def _is_file(task: str) -> bool:
    """Whether `--task`/`--tasks` names a JSONL file of the user's samples rather than a built-in task. A built-in
    task's name (a mixture's too) always means the task, in `ccm train` and `ccm eval` alike, whatever files the
    working folder holds; a file of that name is given as a path (`./icl`)."""
    from transformers_ccm.tasks import mixture_weights
    from transformers_ccm.tasks.text import TEXT_TASKS

    if task in TEXT_TASKS:
        return False
    try:
        mixture_weights(task)
    except ValueError:  # not a task: a file (a folder named `x.jsonl` is refused as one, not taken for a task)
        return task.endswith(".jsonl") or os.path.isfile(task)
    return False


def _load_samples(
    task: str,
    split: str,
    count: int,
    seed: int,
    tokenizer: Callable[[], PreTrainedTokenizerBase],
    stream_sizes: StreamingConfig,
    stream_length: int | None = None,
) -> tuple[list[OnlineSample] | list[list[int]], list[int] | None]:
    """Samples of `task`; with `stream_length`, streams of that many tokens (text tasks only). `tokenizer()` gives
    the tokenizer, called for built-in tasks only (not for a JSONL file). A text task's samples are cut for
    `stream_sizes`. With them, the line of each sample in a JSONL file (None for a built-in task)."""
    from transformers_ccm.tasks import load_jsonl_rows, make_samples, mixture_weights
    from transformers_ccm.tasks.text import TEXT_TASKS, stream_samples, text_streams

    if stream_length is not None and task not in TEXT_TASKS:
        raise ValueError(
            f"--supervision stream trains on long text; --task and --eval-task must be one of {list(TEXT_TASKS)}, "
            f"got {task!r}."
        )
    if _is_file(task):
        return load_jsonl_rows(task)
    if task in TEXT_TASKS:
        # After a compression the window holds `window_tokens - compress_chunk` tokens; samples span the same.
        chunk = stream_sizes.compress_chunk
        window = stream_sizes.window_tokens - chunk
        if window < 1:
            raise ValueError(
                f"--compress-chunk {chunk} leaves no window; use one below {stream_sizes.window_tokens}, or a larger "
                "--window-tokens."
            )
        if stream_length is not None:
            return text_streams(tokenizer(), split, count, stream_length, seed=seed, sources=TEXT_TASKS[task]), None
        samples = stream_samples(
            tokenizer(), split, count, seed=seed, chunk=chunk, max_window=window, sources=TEXT_TASKS[task]
        )
        return samples, None
    try:
        mixture_weights(task)  # an unknown task is refused before the tokenizer loads
    except ValueError as error:  # the tasks module knows nothing of the long-text tasks ccm train takes too
        texts = " or ".join(TEXT_TASKS)
        raise ValueError(f"{error} ccm train also takes {texts} (long text, for streaming).") from None
    # Chat wordings in the model's chat template, as `ccm chat` talks to it.
    return make_samples(task, split, count, seed=seed, tokenizer=tokenizer()), None


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from transformers_ccm.baseline import full_context_config
    from transformers_ccm.embedded import load_tokenizer
    from transformers_ccm.modeling import CCMForCausalLM
    from transformers_ccm.stream_training import tokens_before_compression
    from transformers_ccm.tasks import mixture_weights
    from transformers_ccm.tasks.text import TEXT_TASKS
    from transformers_ccm.training import (
        TrainingRecipe,
        check_fresh_start,
        check_resume,
        check_stop_at_step,
        check_training_setup,
        train,
    )

    _check_counts(args, ["stream_chunks", "stream_piece", "compress_chunk"])
    if args.eval_samples < 0:  # drawn as no sample at all: the run went without evaluation, without a word
        raise ValueError(f"--eval-samples must be at least 0 (0: no evaluation), got {args.eval_samples}.")
    _check_output_dir(args.output_dir)
    stream_sizes = _streaming_config(args)
    streaming = stream_sizes if args.supervision == "stream" else None
    # Each stream ends `--stream-chunks` compressions after the sink and window fill; one more token is a target.
    stream_length = (
        None
        if streaming is None
        else tokens_before_compression(streaming) + args.stream_chunks * args.compress_chunk + 1
    )
    # Built first: a bad --steps, --batch-size or --learning-rate is refused before the model loads.
    try:
        recipe = TrainingRecipe(
            steps=args.steps,
            batch_size=args.batch_size,
            gradient_accumulation=args.gradient_accumulation,
            learning_rate=args.learning_rate,
            eval_every=args.eval_every,
            save_every=args.eval_every,
            seed=args.seed,
            gradient_checkpointing=args.gradient_checkpointing,
            group_by_length=args.group_by_length,
            precision=args.precision,
            supervision="output" if streaming is not None else args.supervision,
            distill_weight=args.distill_weight,
            layout="full_context" if args.method == "full-context" else "ccm",
            streaming=streaming,
            stream_piece=args.stream_piece,
        )
    except ValueError as error:  # in the command's words: the flag, not the TrainingRecipe field it sets
        raise _in_flags(error) from None
    torch.manual_seed(args.seed)  # once the recipe has checked it: torch named no flag for a seed past 64 bits
    try:
        config = CCMConfig(
            num_comp_tokens=CCMConfig.num_comp_tokens if args.num_comp_tokens is None else args.num_comp_tokens,
            update=args.update,
            ema_alpha=args.ema_alpha,
            r=args.lora_r,
            target_modules=args.target_modules,
            trained_on=args.trained_on
            or (
                f"transformers-ccm built-in task '{args.task}'"
                if not _is_file(args.task)
                else os.path.basename(args.task)
            ),
        )
    except ValueError as error:  # in the command's words: `--ema-alpha 0` was refused as CCMConfig.ema_alpha
        raise _in_flags(error) from None
    if args.method == "full-context":
        config = full_context_config(config)
    if args.distill_teacher:
        config = replace(config, trained_on=f"{config.trained_on}, distilled from {args.distill_teacher}")
    if args.init_adapter:
        config = _initial_adapter_config(args.init_adapter, config, args.num_comp_tokens, args.target_modules)
    check_training_setup(recipe, config.conditional_lora, teacher=bool(args.distill_teacher))
    try:
        check_stop_at_step(args.stop_at_step, recipe)
    except ValueError as error:
        raise _in_flags(error) from None
    if streaming is not None:  # the sizes against the adapter's settings before the model loads (its positions after)
        streaming.validate(config, None)
    if args.resume:
        try:
            check_resume(args.output_dir, config, recipe, stream_length=stream_length)
        except ValueError as error:
            raise _in_flags(error) from None
    else:
        check_fresh_start(args.output_dir)
    # The samples before the model, JSONL files first: a bad one is refused before the tokenizer or any model loads.
    # The tokenizer loads once: built-in tasks write their chat turns in its template, text tasks are cut with it.
    tokenizer = functools.cache(functools.partial(load_tokenizer, args.model))
    # A JSONL training file has no held-out split of its own.
    eval_task = args.eval_task or (None if _is_file(args.task) else args.task)
    wanted = {"train": (args.task, args.steps * args.batch_size * args.gradient_accumulation)}
    # --eval-samples 0 draws nothing: a JSONL file was evaluated whole, and a text task's held-out text, shorter than
    # the training text, refused streams (--stream-chunks) that the training text holds, in a run without evaluation.
    if eval_task and args.eval_samples:
        wanted["test"] = (eval_task, args.eval_samples)
    elif eval_task and not _is_file(eval_task) and eval_task not in TEXT_TASKS:
        mixture_weights(eval_task)  # nothing is drawn, but a misspelt task is refused as when samples are
    drawn = {
        split: _load_samples(task, split, count, args.seed, tokenizer, stream_sizes, stream_length)
        for split, (task, count) in sorted(wanted.items(), key=lambda item: not _is_file(item[1][0]))
    }
    (train_samples, train_rows), (eval_samples, eval_rows) = drawn["train"], drawn.get("test", (None, None))
    model = CCMForCausalLM.from_base(args.model, config)
    if args.init_adapter:
        model.load_adapter(args.init_adapter, resize_comp_tokens=True, extend_targets=True)
        model.config = replace(model.config, trained_on=config.trained_on)
    teacher = None
    if args.distill_teacher:
        teacher = _load_full_context(args.distill_teacher, args.model, model, "--distill-teacher")
    model.print_trainable_parameters()
    try:
        trainer = train(
            model,
            tokenizer(),
            train_samples,
            eval_samples,
            args.output_dir,
            recipe,
            resume=args.resume,
            teacher=teacher,
            stop_at_step=args.stop_at_step,
        )
    except ValueError as error:
        rows = {"train_samples": (args.task, train_rows), "eval_samples": (eval_task, eval_rows)}
        raise _in_file_rows(error, rows) from None
    wrote_adapter = trainer.is_world_process_zero()  # the process that wrote it says where; read before teardown
    if torch.distributed.is_initialized():
        # Under torchrun/accelerate a process that exits with its process group alive can abort in gloo's or
        # NCCL's teardown (SIGABRT, "terminate called without an active exception"), failing the launch.
        torch.distributed.destroy_process_group()
    if wrote_adapter:
        step = trainer.state.global_step
        stopped = f" (step {step} of {args.steps}; --resume trains the rest)" if step < args.steps else ""
        print(f"adapter saved to {args.output_dir}{stopped}")


def _initial_adapter_config(
    adapter: str, requested: CCMConfig, num_comp_tokens: int | None, target_modules: list[str] | None
) -> CCMConfig:
    """The structure of the adapter that `ccm train --init-adapter` continues, with the requested card text,
    `num_comp_tokens` `<COMP>` tokens and LoRA `target_modules` where given."""
    from transformers_ccm.hub import check_cap_holds_resize, read_adapter, resolve_adapter

    config, _ = read_adapter(resolve_adapter(adapter))
    if config.conditional_lora != requested.conditional_lora:
        kind, asked, method = ("CCM", "the full-context baseline", "ccm")
        if not config.conditional_lora:
            kind, asked, method = ("full-context", "CCM", "full-context")
        raise SystemExit(
            f"--init-adapter {adapter} is a {kind} adapter, but --method asks for {asked}; pass --method {method}."
        )
    # The EMA coefficient is part of the update rule it keeps: a --ema-alpha given was ignored without a word.
    alpha = (("--ema-alpha", "ema_alpha"),) if config.update == "ema" else ()
    kept = ", ".join(
        f"{flag} {getattr(config, name)}"
        for flag, name in (("--update", "update"), *alpha, ("--num-comp-tokens", "num_comp_tokens"), ("--lora-r", "r"))
    )
    print(f"continuing {adapter}: its structure is kept ({kept})")
    if num_comp_tokens is not None and num_comp_tokens != config.num_comp_tokens:
        # Before the resize is announced: the adapter's cap refused it with CCMConfig's words, naming no flag.
        check_cap_holds_resize(
            config,
            num_comp_tokens,
            f"--init-adapter {adapter}",
            f"--num-comp-tokens {num_comp_tokens}",
            "pass --num-comp-tokens {cap} or fewer",
        )
        kept_embeddings = (
            "its <COMP> embeddings are kept, and extra ones start as copies of its last"
            if num_comp_tokens > config.num_comp_tokens
            else f"its first {num_comp_tokens} <COMP> embeddings are kept"
        )
        print(f"  except --num-comp-tokens {num_comp_tokens}: {kept_embeddings}")
        config = replace(config, num_comp_tokens=num_comp_tokens)
    if target_modules is not None and target_modules != config.target_modules:
        print(f"  except --target-modules {' '.join(target_modules)}: LoRA layers it lacks start at zero")
        config = replace(config, target_modules=target_modules)
    # The card tells the adapter's whole training, earlier stages first.
    trained_on = f"{config.trained_on}, then {requested.trained_on}" if config.trained_on else requested.trained_on
    return replace(config, trained_on=trained_on, base_model_shape=None)


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="where the model runs: 'auto' (the first CUDA GPU if there is one, else the CPU), 'cpu', 'cuda:1', ...",
    )


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _check_device(name: str) -> None:
    """Raise before any model loads unless `--device` names a device this machine has (torch said so only when the
    loaded model moved there)."""
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name} is not a device; give auto, cpu, cuda or cuda:<index>.") from None
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count or (device.index is not None and device.index >= count):
        raise ValueError(f"--device {name}: this machine has {count} CUDA GPU(s); give another one, cpu or auto.")


def _load_ccm(adapter: str, model_name: str, device: str = "auto") -> tuple[CCMForCausalLM, PreTrainedTokenizerBase]:
    from transformers_ccm.embedded import load_tokenizer, resolve_name
    from transformers_ccm.hub import read_adapter, resolve_adapter
    from transformers_ccm.modeling import CCMForCausalLM

    config, _ = read_adapter(resolve_adapter(adapter))
    base = None if model_name == DEFAULT_MODEL and config.base_model_name_or_path else model_name
    model = CCMForCausalLM.from_pretrained(adapter, base_model=base).eval().to(_device(device))
    return model, load_tokenizer(resolve_name(base or config.base_model_name_or_path))


def _refuse_baselines(models: dict[str, CCMForCausalLM], fix: str) -> None:
    """Raise if any of `models` (by adapter name) is a fine-tuned full-context baseline, where memory is needed."""
    from transformers_ccm.baseline import is_full_context_baseline

    baselines = [adapter for adapter, model in models.items() if is_full_context_baseline(model.config)]
    if baselines:
        raise ValueError(
            f"{baselines} hold a fine-tuned full-context baseline, which reads the history as a prompt and keeps no "
            f"compressed memory; {fix}."
        )


def _evaluation_sets(
    task: str, args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[str, int, list[OnlineSample], str, list[int] | None]]:
    """What `ccm eval` scores for `task`, as (wording set, time step, samples, metric, lines): a built-in task per
    wording set and time step, its chat wordings in `tokenizer`'s chat template, with no lines; a JSONL file as
    `_file_sets` gives it."""
    from transformers_ccm.tasks import EVAL_STEPS, METRIC, has_unseen_wordings, make_samples

    if _is_file(task):
        return _file_sets(task, args)
    _check_eval_task(task)
    return [
        (
            wordings,
            t,
            make_samples(task, "test", args.samples, seed=args.seed, steps=t, wordings=wordings, tokenizer=tokenizer),
            METRIC[task],
            None,
        )
        for wordings in (("seen", "unseen") if has_unseen_wordings(task) else ("seen",))
        for t in args.steps or EVAL_STEPS[task]
    ]


def _check_eval_task(task: str) -> None:
    """Raise unless `task`, not a file, is a built-in task `ccm eval` scores."""
    from transformers_ccm.tasks import TASKS

    if task not in TASKS:
        # A mixture's name means the mixture, which ccm eval does not score, even where a file has that name.
        file = f" (for the file {task}, write ./{task})" if os.path.isfile(task) else ""
        raise ValueError(f"--tasks takes built-in tasks {sorted(TASKS)} or JSONL files; got {task!r}{file}.")


def _file_sets(task: str, args: argparse.Namespace) -> list[tuple[str, int, list[OnlineSample], str, list[int]]]:
    """What `ccm eval` scores of the JSONL file `task`, as (wording set "own", time step, samples, metric, the line of
    each sample): its samples grouped by their number of contexts, by accuracy where every sample lists its choices,
    by perplexity where none does."""
    from transformers_ccm.tasks import load_jsonl_rows

    own, rows = load_jsonl_rows(task)
    numbered = list(zip(rows, own, strict=True))
    no_output = next((row for row, sample in numbered if sample.output is None), None)
    if no_output is not None:
        raise ValueError(
            f"{task}:{no_output} has no 'output'; every sample to score needs one (the reference answer or text)."
        )
    empty = next((row for row, sample in numbered if not sample.output), None)
    if empty is not None:
        raise ValueError(
            f"{task}:{empty} has an empty 'output'; scoring needs at least one token of the reference answer or text."
        )
    # A file whose samples list choices but for one was scored by perplexity whole, every choice ignored.
    listed = [row for row, sample in numbered if sample.choices]
    if listed and len(listed) < len(own):
        unlisted = next(row for row, sample in numbered if not sample.choices)
        raise ValueError(
            f"{task}:{unlisted} lists no choices, while {task}:{listed[0]} does; a file is scored by accuracy "
            "when every sample lists its choices, by perplexity when none does: list them on every line or on "
            "none, or give the two kinds as two files."
        )
    metric = "accuracy" if listed else "perplexity"
    lengths = sorted({len(sample.contexts) for sample in own})
    if lengths[0] == 0:
        row = next(row for row, sample in numbered if not sample.contexts)
        raise ValueError(
            f"{task}:{row} has no contexts; scoring compares memory with the full context, so every sample "
            "needs at least one."
        )
    chosen = sorted(set(args.steps or lengths))
    missing = [t for t in chosen if t not in lengths]
    if missing:
        raise ValueError(f"{task} has no sample with {missing} contexts; it has samples with {lengths}.")
    sets = []
    for t in chosen:
        picked = [(row, sample) for row, sample in numbered if len(sample.contexts) == t][: args.samples]
        sets.append(("own", t, [sample for _, sample in picked], metric, [row for row, _ in picked]))
    return sets


# (task, wording set, time step, count, longest full-context prompt in tokens, metric) of a report's sample set
Drawn = tuple[str, str, int, int, int, str]


def _earlier_report(folder: str) -> tuple[list[dict], list[Drawn]]:
    """The result rows of the `ccm eval` report in `folder` and what its sample sets drew, checked, for
    `ccm eval --add-to`."""
    from pathlib import Path

    from transformers_ccm.evaluation import summarize
    from transformers_ccm.json_reading import parse_json

    path = Path(folder, "eval.json")
    if not path.is_file():
        raise ValueError(f"--add-to {folder}: no eval.json there; give the --output-dir of an earlier ccm eval.")
    try:
        rows = parse_json(path.read_bytes(), str(path), "score anew without --add-to.")["results"]
        if not isinstance(rows, list):  # a dict's rows were its keys
            raise TypeError(f"its results are a {type(rows).__name__}, not a list of rows")
        summarize(rows)  # checks every field the joint report reads, in every row
        held = {(r["task"], r["wordings"], r["steps"]): r for r in rows if r["method"] == "full_context"}
        drawn = [
            _drawn(r, held.get((r["task"], r["wordings"], r["steps"]))) for r in rows if r["method"] == "no_context"
        ]
    except (ValueError, KeyError, TypeError, IndexError, ArithmeticError) as error:
        raise ValueError(
            f"--add-to {folder}: {path} is not a ccm eval report ({error!r}); give the --output-dir of an earlier ccm "
            "eval, or score anew without --add-to."
        ) from None
    if not drawn:
        raise ValueError(f"--add-to {folder}: {path} holds no scored samples; run ccm eval without --add-to.")
    return rows, drawn


def _draw_again(
    drawn: list[Drawn], model: CCMForCausalLM, tokenizer: PreTrainedTokenizerBase, seed: int, folder: str
) -> list[SampleSet]:
    """The sample sets of a report (`drawn` as `_earlier_report` gives them), drawn again as its run drew them
    (same task, wording set, time step and count, with `seed`), once a built-in task's full-context prompts were
    found to fit `model`'s positions: a report claiming ten million contexts per sample (and as many tokens) was drawn
    for hours before anything could tell it apart from the real one."""
    config = model.base_model.config.get_text_config(decoder=True)
    limit = model.absolute_position_limit or getattr(config, "max_position_embeddings", None)
    # ccm eval ran each full-context prompt whole through the base, at positions 0 .. its length - 1. A file's samples
    # are read from it, no more than it holds, whatever its report claims: only a built-in task's are drawn by the
    # report's counts. The report of a file whose full contexts pass a rotary model's positions, which ccm eval scores,
    # was refused here, asking for another --model than the one that wrote it.
    for task, wordings, steps, _, peak, _ in drawn:
        if limit is not None and peak > limit and not _is_file(task):
            raise ValueError(
                f"--add-to {folder}: {task} ({wordings}, t={steps}) held full contexts of {peak} tokens, past the "
                f"{limit} positions of the base model that --adapters run on; give the --model of that report, or "
                "score every adapter anew without --add-to."
            )
    sample_sets = []
    for task, wordings, steps, count, _, metric in drawn:
        where = f"--add-to {folder}: {task} ({wordings}, t={steps}, {metric})"
        again = argparse.Namespace(samples=count, seed=seed, steps=[steps])
        try:
            drawable = _evaluation_sets(task, again, tokenizer)
        except ValueError as error:  # a task that is no more (a file moved), or never was
            raise ValueError(
                f"{where} cannot be drawn again ({error}); score every adapter anew without --add-to."
            ) from None
        found = [(task, *sample_set) for sample_set in drawable if sample_set[0] == wordings]
        # A set ccm eval never draws (a file's samples as "seen", unseen wordings of a task without any, another
        # metric) was left unscored, or scored by another metric than its baselines, without a word.
        if [sample_set[4] for sample_set in found] != [metric]:
            scored = ", ".join(f"{sample_set[0]} by {sample_set[3]}" for sample_set in drawable)
            raise ValueError(
                f"{where} is not a sample set ccm eval scores ({task} at t={steps}: {scored}); score every adapter "
                "anew without --add-to."
            )
        sample_sets += found
    return sample_sets


def _drawn(row: dict, full_context: dict | None) -> Drawn:
    """(task, wording set, time step, count, full-context peak, metric) of a report's no-context row, whose sample set's
    full-context row is `full_context`. The count must be that of its per-sample values, and the time step at least
    1 and at most the context tokens per sample (every context has one), themselves at most the full-context peak (a
    prompt holds its contexts), so that a damaged report cannot have samples drawn by the billion, or with a million
    contexts each; `_draw_again` holds that peak to the model's positions."""
    steps, count = row["steps"], row["samples"]  # integers >= 1, the count of its per-sample values (`summarize`)
    if full_context is None:
        raise ValueError(f"{row['task']} row: its samples have no full-context row")
    context_tokens, peak = full_context["context_kv_tokens"], full_context["peak_kv_tokens"]
    if not steps <= context_tokens <= peak:
        raise ValueError(
            f"{row['task']} row: {steps} contexts per sample, {context_tokens} full-context tokens, of at most {peak}"
        )
    return row["task"], row["wordings"], steps, count, peak, row["metric"]


def _samples_digest(samples: list[OnlineSample]) -> str:
    """A short fingerprint of `samples`, stored in each `ccm eval` row so that `--add-to` can tell them again."""
    import hashlib
    import json
    from dataclasses import asdict

    return hashlib.sha256(json.dumps([asdict(sample) for sample in samples]).encode()).hexdigest()[:16]


def _check_same_samples(
    rows: list[dict],
    sample_set: SampleSet,
    base: str,
    no_context: Callable[[SampleSet], list[tuple[float, int]]],
    folder: str,
) -> None:
    """Raise unless `sample_set`, drawn anew, holds the samples of its no-context row in `rows` and that row was
    scored on the base model whose fingerprint is `base`: by their digests, or in reports written before rows had a
    samples digest, by the no-context scores `no_context(sample_set)` computes again (they depend on both). Rows
    with a samples digest but no fingerprint are taken on their digest: scores computed again on another device
    may differ by a near tie, and refuse the right base."""
    import torch

    task, wordings, steps, samples, _, _ = sample_set
    stored = next(
        r
        for r in rows
        if (r["task"], r["wordings"], int(r["steps"]), r["method"]) == (task, wordings, steps, "no_context")
    )
    # The new adapters are compared with the report's baselines: those of another base model would give them a
    # gain recovered and paired differences measured against a model they never ran on.
    if stored.get("base_fingerprint", base) != base:
        raise ValueError(
            f"--add-to {folder}: its baselines were scored on another base model than the one --adapters run on "
            "here; give the --model of that report, or score every adapter anew without --add-to."
        )
    if "samples_digest" in stored:
        same = stored["samples_digest"] == _samples_digest(samples)
    else:
        before = torch.tensor(stored["per_sample"], dtype=torch.float64)
        again = torch.tensor(no_context(sample_set), dtype=torch.float64)
        same = before.shape == again.shape and torch.allclose(before, again, rtol=1e-4)
    if not same:
        raise ValueError(
            f"--add-to {folder}: {task} ({wordings}, t={steps}) drawn again gives other samples than its report, or "
            "its baselines were scored on another base model (another --seed or --model, or the task or its file "
            "changed since); score every adapter anew without --add-to."
        )


def cmd_eval(args: argparse.Namespace) -> None:
    from pathlib import Path

    from transformers_ccm.evaluation import (
        FINETUNED,
        check_samples,
        difference_text,
        gain_text,
        markdown,
        plot,
        report_json,
        score_samples,
        summarize,
    )

    _check_device(args.device)
    # A task or time step named twice was scored twice, and written twice into the report.
    for flag, listed, what in (
        ("adapters", args.adapters, "an adapter"),
        ("tasks", args.tasks, "a task"),
        ("steps", args.steps, "a time step"),
    ):
        if listed is not None and len(set(listed)) != len(listed):
            raise ValueError(f"--{flag} names {what} more than once: {listed}.")
    # So was a file named in two ways (mine.jsonl, ./mine.jsonl, its absolute path or a link to it).
    files = [task for task in args.tasks or () if _is_file(task)]
    again = next(
        ((a, b) for i, b in enumerate(files) for a in files[:i] if os.path.realpath(a) == os.path.realpath(b)), None
    )
    if again is not None:
        raise ValueError(f"--tasks names one file twice, as {again[0]} and as {again[1]}; name it once.")
    # Before any model loads: --batch-size 0 failed in range(), --samples 0 as "no samples", and --steps 0 (no
    # memory, no full context to compare with) only once every sample was scored, dividing by zero in the summary.
    _check_counts(args, ["samples", "batch_size"])
    if args.steps is not None and min(args.steps) < 1:
        raise ValueError(f"--steps takes time steps of at least 1 (contexts per sample), got {args.steps}.")
    if args.add_to and args.full_context_adapter:
        raise ValueError(
            "--add-to keeps the baselines of its report; drop --full-context-adapter, or score it without --add-to."
        )
    drawing = [f"--{name}" for name in ("tasks", "steps", "samples") if getattr(args, name) is not None]
    if args.add_to and drawing:
        raise ValueError(
            f"--add-to scores the tasks, time steps and samples of its report; drop {' '.join(drawing)}, or score "
            "them without --add-to."
        )
    _check_output_dir(args.output_dir)
    # The report's plot is drawn last: without matplotlib, fail now rather than once every model has run.
    figure()
    results: list[dict] = []
    file_sets: dict[str, list] = {}  # JSONL files read once, before any model loads, as a bad one is refused
    if args.add_to:
        results, drawn = _earlier_report(args.add_to)
    else:
        defaults = {"tasks": _EVAL_TASKS, "samples": _EVAL_SAMPLES}
        args = argparse.Namespace(**{**vars(args), **{k: v for k, v in defaults.items() if getattr(args, k) is None}})
        for task in args.tasks:
            if _is_file(task):
                file_sets[task] = _file_sets(task, args)
            else:
                _check_eval_task(task)
    loaded = [(adapter, *_load_ccm(adapter, args.model, args.device)) for adapter in args.adapters]
    _refuse_baselines(
        {adapter: model for adapter, model, _ in loaded}, "pass it as --full-context-adapter, the upper bound"
    )
    # Every adapter is compared with the baselines of the first one's base model (and scored with its tokenizer).
    bases = {adapter: model.memory_signature()["base_fingerprint"] for adapter, model, _ in loaded}
    base = bases[args.adapters[0]]  # every row's, once the checks pass
    others = [adapter for adapter, fingerprint in bases.items() if fingerprint != base]
    if others:
        raise ValueError(
            f"--adapters {others} run on another base model than {args.adapters[0]} (without --model, each loads "
            "the base it names); their scores and gains would be measured against another model's baselines: "
            "evaluate them in separate runs."
        )
    rules = [model.config.update for _, model, _ in loaded]
    # Adapters are named by their update rule, and by the adapter too where two share a rule or join a report.
    models = {
        f"ccm-{rule}" if rules.count(rule) == 1 and not args.add_to else f"ccm-{rule}:{adapter}": model
        for (adapter, model, _), rule in zip(loaded, rules, strict=True)
    }
    scored = sorted(set(models) & {str(row["method"]) for row in results})
    if scored:
        raise ValueError(
            f"--add-to {args.add_to} already holds {scored}; their scores are there (a copy under another path "
            "scores anew)."
        )
    tokenizer = loaded[0][2]
    reference = next(iter(models.values()))
    # Drawn once the tokenizer is known: chat wordings are written in its chat template, as the model was trained.
    if args.add_to:
        sample_sets = _draw_again(drawn, reference, tokenizer, args.seed, args.add_to)
    else:
        sample_sets = [
            (task, *sample_set)
            for task in args.tasks
            for sample_set in file_sets.get(task) or _evaluation_sets(task, args, tokenizer)
        ]
    # Every set before any is scored: a sample the model cannot take (a token id past its vocabulary, a prompt past its
    # positions) failed once the sets before it had been scored, named by its place in its set alone.
    for task, wordings, steps, samples, metric, lines in sample_sets:
        try:
            # The longest prompts of all methods, and the pieces each adapter's memory runs: adapters differ in their
            # <COMP> count, and a context that fit the first one's failed inside a later one's compress(), once the
            # baselines and the adapters before it had been scored.
            for checked, method in [(reference, "full_context"), *((model, "ccm") for model in models.values())]:
                check_samples(checked, tokenizer, samples, method, metric)
        except ValueError as error:
            if lines is not None:  # a sample of a file, by its line, as ccm train names it
                raise _in_file_rows(error, {"samples": (task, lines)}) from None
            raise ValueError(f"{task} ({wordings}, t={steps}): {error}") from None
    baselines = (
        [] if args.add_to else [("no_context", reference, "no_context"), ("full_context", reference, "full_context")]
    )
    if args.full_context_adapter:
        tuned = _load_full_context(args.full_context_adapter, args.model, reference)
        if tuned.memory_signature()["base_fingerprint"] != base:  # the same shape, other weights
            raise ValueError(
                f"--full-context-adapter {args.full_context_adapter} runs on another base model than --adapters (each "
                "loads the base it names); give one trained on their base, or name that base with --model."
            )
        baselines.append((FINETUNED, tuned, "full_context"))
    added = []

    def no_context_scores(sample_set: SampleSet) -> list[tuple[float, int]]:
        _, _, _, samples, metric, _ = sample_set
        score = score_samples(reference, tokenizer, samples, "no_context", metric, batch_size=args.batch_size)
        return score.per_sample

    for sample_set in sample_sets:
        task, wordings, steps, samples, metric, _ = sample_set
        if args.add_to:
            _check_same_samples(results, sample_set, base, no_context_scores, args.add_to)
        digest = _samples_digest(samples)
        for name, model, method in [*baselines, *((name, model, "ccm") for name, model in models.items())]:
            score = score_samples(model, tokenizer, samples, method, metric, batch_size=args.batch_size)
            added.append(
                {
                    "task": task,
                    "wordings": wordings,
                    **score.to_dict(),
                    "method": name,
                    "samples_digest": digest,
                    "base_fingerprint": base,
                }
            )
            print(
                f"{task:16s} {wordings:6s} t={steps:<3d} {name:22s} {score.metric} {score.value:8.3f} "
                f"[{score.low:.3f}, {score.high:.3f}]  context KV {score.context_kv_tokens:7.1f}  "
                f"peak KV {score.peak_kv_bytes / 2**20:7.2f} MiB",
                flush=True,
            )
    results += added
    output = Path(args.output_dir)
    summary = summarize(results)
    report, table = report_json(results, summary), markdown(results, summary)
    # The files replaced together: --output-dir may be the --add-to folder, whose report must survive a failure.
    _write_report(
        output,
        {
            "eval.json": lambda path: Path(path).write_text(report),
            "eval.png": lambda path: plot(results, path),
            "eval.md": lambda path: Path(path).write_text(table),
        },
    )
    print("\nat the largest time step (95% intervals):")
    for row in summary:
        tuned = row["gain_recovered_finetuned"]
        versus_tuned = "" if tuned is None else f", {gain_text(tuned)} of the fine-tuned full-context gain"
        versus_first = row["versus_first"]
        paired = "" if versus_first is None else f"  {difference_text(versus_first, row['metric'])}"
        print(
            f"{row['task']:16s} {row['wordings']:6s} {row['method']:11s} {row['samples']} samples, {row['metric']} "
            f"no {row['no_context']:.3f}  full {row['full_context']:.3f}  ccm {row['ccm']:.3f} "
            f"[{row['ccm_interval'][0]:.3f}, {row['ccm_interval'][1]:.3f}]  "
            f"gain recovered {gain_text(row['gain_recovered'])}{versus_tuned}  "
            f"memory {row['context_memory_ratio']:.3f} of full context{paired}"
        )
    print(f"wrote {output / 'eval.json'}, {output / 'eval.md'} and {output / 'eval.png'}")


def _load_full_context(
    adapter: str, model_name: str, reference: CCMForCausalLM, flag: str = "--full-context-adapter"
) -> CCMForCausalLM:
    """A full-context fine-tuned adapter (`conditional_lora=False`), given as `flag`, for the same base as the
    compression adapter `reference`."""
    model, _ = _load_ccm(adapter, model_name, str(reference.device))
    if model.config.conditional_lora:
        raise ValueError(
            f"{flag} {adapter} is a compression adapter (conditional_lora=True); give one trained with the whole "
            "history as plain prompt (conditional_lora=False, ccm train --method full-context)."
        )
    if model.config.base_model_shape != reference.config.base_model_shape:
        raise ValueError(
            f"{flag} {adapter} was made for {model.config.base_model_name_or_path}, not for the base of the "
            f"compression adapters ({reference.config.base_model_name_or_path})."
        )
    return model


def cmd_stream_eval(args: argparse.Namespace) -> None:
    import json
    import platform
    from dataclasses import asdict
    from pathlib import Path

    import torch

    from transformers_ccm.hub import read_adapter, resolve_adapter
    from transformers_ccm.stream_evaluation import check_scorable, plot_stream, stream_nll
    from transformers_ccm.tasks.text import long_text

    # Checked before the model loads: a slice by a negative --tokens dropped the end of the text, and a bad --bucket
    # failed only after both streams were scored.
    for name in ("piece", "bucket"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.tokens is not None and args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2 (one token predicts the next), got {args.tokens}.")
    _check_device(args.device)
    _check_output_dir(args.output_dir)
    # The report's plot is drawn last: without matplotlib, fail now rather than once every model has run.
    figure()
    if args.text_file and not os.path.isfile(args.text_file):
        raise FileNotFoundError(f"--text-file {args.text_file} is not a file.")
    if args.text_file is None:
        read = functools.partial(_string_prefix, long_text("test"))
    else:
        read = functools.partial(_file_prefix, args.text_file)
    # Kept for `_leading_ids`, whose first read it is: the whole file, without --tokens, was read and decoded twice.
    read = functools.lru_cache(maxsize=1)(read)
    read(None if args.tokens is None else _first_prefix(args.tokens))  # not UTF-8: refused before the model loads
    ccm = _streaming_config(args)
    # The sizes against the adapter's own settings before its model loads; the model's positions once it has. The
    # baseline too: it failed only once CCM's stream was scored.
    adapter_config = read_adapter(resolve_adapter(args.adapter))[0]
    ccm.validate(adapter_config, None)
    check_scorable(adapter_config, ccm.same_size_baseline(adapter_config))
    model, tokenizer = _load_ccm(args.adapter, args.model, args.device)
    ids = torch.tensor(_leading_ids(tokenizer, read, args.tokens), dtype=torch.long)
    if ids.shape[0] < 2:
        raise ValueError(
            f"--text-file {args.text_file} holds {ids.shape[0]} token(s); a stream needs 2 or more: give a longer text."
        )
    methods = {f"ccm-{model.config.update}": ccm, "streaming_llm": ccm.same_size_baseline(model.config)}
    results = []
    for method, streaming in methods.items():
        result = stream_nll(model, ids, streaming, piece=args.piece, method=method)
        results.append(result)
        after = result.perplexity_after_budget
        print(
            f"{method:14s} KV {result.max_kv_length} (peak held {max(result.kv_held)})  perplexity "
            f"{result.perplexity():.3f}  after the first {result.max_kv_length} tokens "
            + ("none (the stream is not longer than the KV budget)" if after is None else f"{after:.3f}"),
            flush=True,
        )
    output = Path(args.output_dir)
    report = {
        "text": args.text_file or f"held-out Python reference topics (pydoc_data, Python {platform.python_version()})",
        "tokens": int(ids.shape[0]),
        "adapter": args.adapter,
        "streaming": asdict(ccm.for_adapter(model.config)),  # its memory cap as it streamed
        "methods": {result.method: result.to_dict(args.bucket) for result in results},
    }
    _write_report(
        output,
        {
            "stream_eval.json": lambda path: Path(path).write_text(json.dumps(report, indent=1) + "\n"),
            "stream_eval.png": lambda path: plot_stream(results, args.bucket, path),
        },
    )
    print(f"wrote {output / 'stream_eval.json'} and {output / 'stream_eval.png'}")


def _file_prefix(path: str, size: int | None) -> tuple[str, bool]:
    r"""The text of the first `size` bytes of the UTF-8 file at `path` (all of it for None; a character cut at the end
    left out) and whether that is the whole file. A byte-order mark, as some editors write one, is not part of the
    text (it was streamed and scored); line ends are, as the file has them (`read_text` turned "\r\n" into "\n",
    another stream than the file's)."""
    with open(path, "rb") as file:
        if size is None:
            data = file.read()
        else:
            # A byte more tells whether the file goes on. Read in pieces: `read(n)` sets n bytes aside first, which
            # for `--tokens 1000000000000` failed with a MemoryError (an OverflowError past 2**63 bytes).
            data = bytearray()
            while len(data) <= size and (piece := file.read(min(size + 1 - len(data), _READ_PIECE))):
                data += piece
    whole = size is None or len(data) <= size
    try:
        return codecs.getincrementaldecoder("utf-8-sig")().decode(data[:size], final=whole), whole
    except UnicodeDecodeError as error:
        raise ValueError(f"--text-file {path} is not UTF-8 text ({error}); give a UTF-8 text file.") from None


# The most `_file_prefix` reads at once.
_READ_PIECE = 1 << 24


def _string_prefix(text: str, size: int | None) -> tuple[str, bool]:
    """`_file_prefix` for a text in memory (`size` characters)."""
    return (text, True) if size is None or size >= len(text) else (text[:size], False)


def _first_prefix(tokens: int) -> int:
    """How much of a text `_leading_ids` reads first for `tokens` tokens: a few times what English takes (about 4
    bytes a token)."""
    return 8 * tokens + 4096


def _leading_ids(
    tokenizer: PreTrainedTokenizerBase, read: Callable[[int | None], tuple[str, bool]], tokens: int | None
) -> list[int]:
    """The ids of the first `tokens` tokens of the text that `read(size)` gives a prefix of (`_file_prefix`), all of
    them for None. A long file is not tokenized whole (a corpus of gigabytes held its ids in memory for a stream of
    thousands): prefixes twice as long each time, until two of them agree on those ids and go on well past them, so
    the token that a prefix's end cuts lies past them too."""
    if tokens is None:
        return tokenizer(read(None)[0], add_special_tokens=False)["input_ids"]
    size, earlier = _first_prefix(tokens), None
    while True:
        text, whole = read(size)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if whole:
            return ids[:tokens]
        leading = ids[:tokens] if len(ids) >= tokens + _PAST_THE_CUT else None
        if leading is not None and leading == earlier:
            return leading
        earlier, size = leading, 2 * size


# How many tokens past the stream's last one a prefix must reach before its ids are compared.
_PAST_THE_CUT = 64


def _write_report(folder: Path, writes: dict[str, Callable[[str], object]]) -> None:
    """Replace the report files named by `writes` in `folder` (see `replace_files`): all of them, or none where a write
    fails, which raises an OSError that names the folder (a full disk failed deep in the plot's writer, naming none)."""
    try:
        with made_folder(folder, "choose another --output-dir."):
            replace_files({folder / name: write for name, write in writes.items()})
    except OSError as error:
        raise OSError(f"could not write the report into {folder} ({error})") from error


def _write_any_character() -> None:
    """Write characters the output's encoding lacks (a Windows code page, a pipe under PYTHONIOENCODING=ascii) as
    escapes: a strict encoder raised from a message's echo or a reply, and ended the conversation mid-turn."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def _print_turn(report: TurnReport) -> None:
    print(f"assistant: {report.reply}")
    print(
        f"  [memory: {report.memory_slots} slots, {report.memory_bytes / 1024:.1f} KiB | full context would hold "
        f"{report.full_context_tokens} tokens, {report.full_context_bytes / 1024:.1f} KiB]",
        flush=True,
    )


def _check_counts(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Raise, before any model loads, unless each of `names` (flags of `args`, None meaning "unset") is at least 1:
    a negative --turns sliced turns off the end of the script, and --max-new-tokens 0 failed only at the first turn."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")


def cmd_chat(args: argparse.Namespace) -> None:
    from transformers_ccm.cache import CompressedMemoryCache
    from transformers_ccm.chat import ChatSession

    _check_device(args.device)
    _check_counts(args, ["max_new_tokens"])
    if sys.stdin is None:  # started with its input closed (`<&-`): the loop failed on "'NoneType' is not iterable"
        raise ValueError(
            "the standard input is closed, and the messages are read from it; give them on a terminal, a pipe or a "
            "file (ccm chat < messages.txt)."
        )
    if args.memory_file:
        _check_writable(args.memory_file)
    adapter = args.adapter or f"ccm:smollm2-{args.update}"
    model, tokenizer = _load_ccm(adapter, args.model, args.device)
    _refuse_baselines({adapter: model}, "chat with a compression adapter")
    cache = None
    if args.memory_file and os.path.exists(args.memory_file):
        cache = CompressedMemoryCache.load(args.memory_file, model)
        print(f"(memory loaded from {args.memory_file}: {cache.memory_length} slots)")
    session = ChatSession(model, tokenizer, cache, max_new_tokens=args.max_new_tokens)
    _write_any_character()
    print("Type a message (an empty line or Ctrl-D ends).", flush=True)
    encoding = None
    if isinstance(sys.stdin, io.TextIOWrapper):
        # Bytes not of the input's encoding become lone surrogates, refused below for that message alone; a strict
        # decoder raised from the loop itself and ended the chat.
        sys.stdin.reconfigure(errors="surrogateescape")
        encoding = sys.stdin.encoding
    for line in sys.stdin:
        message = line.strip()
        if not message or message in ("exit", "quit"):
            break
        # Named here with the input's encoding: the session's refusal told to type UTF-8 text again, which is what a
        # terminal under PYTHONIOENCODING=ascii had sent.
        escaped = re.search("[\udc80-\udcff]", message) if encoding else None
        if escaped:
            print(
                f"ccm chat: that message was not answered (byte 0x{ord(escaped[0]) - 0xDC00:02x} at character "
                f"{escaped.start()} is not {encoding} text, the input's encoding as the locale or PYTHONIOENCODING "
                f"sets it; type it again in {encoding}, or set PYTHONIOENCODING to the terminal's encoding); the "
                "memory is as it was.",
                file=sys.stderr,
            )
            continue
        try:
            report = session.turn(message)
        except ValueError as error:  # a message the model cannot take: a failed turn leaves the memory as it was
            print(f"ccm chat: that message was not answered ({error}); the memory is as it was.", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops a reply (a long one, say), not the chat; the turn was undone
            print("ccm chat: interrupted; that message was not answered; the memory is as it was.", file=sys.stderr)
            continue
        print(f"you: {message}")  # once answered: a message refused as not being text could not be printed either
        _print_turn(report)
        if args.memory_file:
            _save_memory(session.cache, args.memory_file)


def _check_writable(path: str) -> None:
    """Raise before any model work if the memory file could not be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--memory-file {path} is a folder; give a file path such as {path}/user.safetensors.")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"--memory-file {path} is not a regular file (a device or a pipe); give a file path.")
    existing = nearest_existing(folder)
    if not os.path.isdir(existing):  # "create it" cannot be done: no folder can be made inside a file
        raise ValueError(f"--memory-file {path}: {existing} is a file, not a folder; give a path in a folder.")
    if not os.path.isdir(folder):
        raise ValueError(f"--memory-file {path}: the folder {folder} does not exist; create it first.")
    try:  # a real write: permissions alone do not tell (read-only file systems, the superuser)
        tempfile.NamedTemporaryFile(dir=folder).close()
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is read-only")
    except OSError as error:  # of a place, or of the process (no descriptor left), which another place would not fix
        fix = short_of(error) or "choose a writable place"
        raise ValueError(f"--memory-file {path} cannot be written ({error}); {fix}.") from None


def _check_output_dir(path: str) -> None:
    """Raise before any model work unless `--output-dir` is, or can become, a folder that can be written: a file
    there (or above it) failed only when the results were written, after every model had run."""
    existing = nearest_existing(path)  # the folder is made later; its nearest existing parent must take it
    if not os.path.isdir(existing):
        raise ValueError(f"--output-dir {path}: {existing} is a file, not a folder; choose another --output-dir.")
    try:  # a real write: permissions alone do not tell (read-only file systems, the superuser)
        tempfile.NamedTemporaryFile(dir=existing).close()
    except OSError as error:
        fix = short_of(error) or "choose a writable place"
        raise ValueError(f"--output-dir {path} cannot be written ({error}); {fix}.") from None


def _save_memory(cache: CompressedMemoryCache, path: str) -> None:
    """Replace the memory file in one step (a failed save keeps the previous file); on failure, say so and keep
    the conversation going with the memory in hand."""
    try:
        cache.save(path)
    # ValueError: a pipe or a device put in the file's place since the last turn, which ended the chat, the
    # conversation unsaved.
    except (OSError, ValueError) as error:
        print(
            f"ccm chat: could not save the memory to {path} ({error}); it is kept for the next turn.", file=sys.stderr
        )


# Names and a job from the test split of the word lists: training never saw them.
DEMO_FACTS = {"name": "Isabel", "job": "astronomer", "friend": "George"}


def demo_script(name: str, job: str, friend: str) -> list[str]:
    """A natural conversation, worded unlike the training tasks: the user mentions their name, job and a friend
    among small talk, then asks about each (the last three messages: name, job, friend)."""
    from transformers_ccm.tasks.vocabulary import with_article

    return [
        f"Hey there! I'm {name}. I just got back from a long trip and I'm exhausted.",
        "Do you have any tips for getting over jet lag?",
        f"Thanks! Work starts again tomorrow. I'm {with_article(job)}, so it will be a busy week.",
        "What's a good book for a rainy evening?",
        f"Sounds great. My friend {friend} recommended something similar last month.",
        "Quick check: what's my name?",
        "And what is my job?",
        "Who is the friend I mentioned?",
    ]


def cmd_demo(args: argparse.Namespace) -> None:
    from transformers_ccm.chat import ChatSession, FullContextChat

    _check_device(args.device)
    _check_counts(args, ["max_new_tokens", "turns"])
    adapter = args.adapter or f"ccm:smollm2-{args.update}"
    model, tokenizer = _load_ccm(adapter, args.model, args.device)
    script = demo_script(**DEMO_FACTS)[: args.turns]
    _write_any_character()
    if args.full_context:
        reader = "with its LoRA" if not model.config.conditional_lora else "alone"
        print(f"{model.config.base_model_name_or_path} {reader}, with the whole conversation as its prompt:\n")
        baseline = FullContextChat(model, tokenizer, max_new_tokens=args.max_new_tokens)
        for message in script:
            reply = baseline.turn(message)
            print(f"you: {message}\nassistant: {reply}\n  [full context: {baseline.history_tokens} tokens]")
        return
    _refuse_baselines({adapter: model}, "run it with --full-context, or give a compression adapter")
    print(
        f"CCM-{model.config.update} on {model.config.base_model_name_or_path}: every turn is folded into "
        f"{model.config.num_comp_tokens} memory slot(s) per layer; the turns themselves are not kept.\n"
    )
    session = ChatSession(model, tokenizer, max_new_tokens=args.max_new_tokens)
    for message in script:
        print(f"you: {message}")
        _print_turn(session.turn(message))


class _ShowDefaults(argparse.HelpFormatter):
    """`--help` that gives each option's default (the docs state them: 300 steps of 8 at 1e-3, ...), unless it has
    none (None, or off for a switch) or its help already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS  # not 0
        if unset or not action.option_strings or "default" in text:
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ccm", description="Compressed Context Memory for transformers models.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a compression adapter", formatter_class=_ShowDefaults)
    _add_model(train)
    train.add_argument(
        "--task",
        default="mixture",
        help="icl | personalization | dialogue | chat | document | people | grouping | mixture (the first five) | a "
        "weighted mixture such as icl:3,dialogue:1 | text (the Python reference, for streaming) | text-varied (the "
        "reference and the standard library's docstrings, for streaming) | or a JSONL file (./icl for a file named "
        "like a task)",
    )
    train.add_argument(
        "--compress-chunk",
        type=int,
        default=32,
        help="text tasks: tokens per compressed chunk, as `ccm stream-eval --compress-chunk` will stream them",
    )
    train.add_argument("--eval-task", default=None, help="held-out samples (a task name or JSONL) for the eval loss")
    train.add_argument("--update", choices=UPDATE_RULES, default="concat", help="how a compression enters memory")
    train.add_argument(
        "--num-comp-tokens",
        type=int,
        default=None,
        help=f"<COMP> tokens (memory slots) per context (default {CCMConfig.num_comp_tokens}; with --init-adapter, its "
        "own count, and a different one here resizes it)",
    )
    train.add_argument("--ema-alpha", type=float, default=0.5, help="--update ema: the weight of a new compression")
    train.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    train.add_argument(
        "--target-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="modules that get the LoRA, by name (e.g. q_proj k_proj v_proj o_proj gate_proj up_proj down_proj); "
        "default: every projection of each attention layer. With --init-adapter, its targets and more: the added "
        "ones start at zero, so training starts from the adapter as it was",
    )
    train.add_argument("--steps", type=int, default=300, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=8, help="samples per step (per process)")
    train.add_argument("--gradient-accumulation", type=int, default=1, help="batches per optimizer step")
    train.add_argument("--learning-rate", type=float, default=1e-3, help="peak of the cosine schedule")
    train.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses and checkpoints")
    train.add_argument(
        "--eval-samples",
        type=int,
        default=48,
        help="held-out samples for the eval loss (a JSONL --eval-task: all of its own; 0: no evaluation)",
    )
    train.add_argument("--seed", type=int, default=0, help="the samples drawn, the initialisation and the batch order")
    train.add_argument("--trained-on", default=None, help="what the model card says it was trained on")
    train.add_argument("--output-dir", required=True, help="where checkpoints and the final adapter go")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    train.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        metavar="N",
        help="end this run after step N of the --steps schedule (its learning rate included), saving a checkpoint "
        "and the adapter there; --resume later trains the rest (for machines lent for a limited time)",
    )
    train.add_argument(
        "--init-adapter",
        default=None,
        help="start from this adapter (a folder, Hub id or ccm:name) instead of a fresh one; its update rule and "
        "LoRA shape are kept (--update, --ema-alpha and --lora-r are ignored), and its <COMP> count and LoRA targets "
        "unless --num-comp-tokens or --target-modules asks for others",
    )
    train.add_argument(
        "--method",
        choices=["ccm", "full-context"],
        default="ccm",
        help="a compression adapter, or the fine-tuned full-context baseline: the same LoRA at every position, "
        "trained on the same samples with the whole history as a plain prompt",
    )
    train.add_argument(
        "--supervision",
        choices=["output", "dense", "stream"],
        default="output",
        help="loss on the outputs only (the paper), or also on every later context given the memory before it, or "
        "(text tasks) on every token of streams run through a streaming cache as `ccm stream-eval` runs them",
    )
    _add_keep_window_full(train)
    _add_stream_sizes(train)
    train.add_argument(
        "--stream-chunks",
        type=int,
        default=8,
        help="--supervision stream: compressions per sample after its sink and window fill (its length)",
    )
    train.add_argument(
        "--stream-piece",
        type=int,
        default=16,
        help="--supervision stream: tokens fed per forward, as `ccm stream-eval --piece` feeds them",
    )
    train.add_argument(
        "--distill-weight",
        type=float,
        default=0.0,
        help="add this times KL(teacher with the full history || CCM) at the supervised positions",
    )
    train.add_argument(
        "--distill-teacher",
        default=None,
        help="the --distill-weight teacher: a fine-tuned full-context baseline of the same base model (e.g. "
        "ccm:smollm2-full-context), read with its LoRA on (default: the base model)",
    )
    train.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward (less memory)"
    )
    train.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch samples of similar length (about half the padded positions of a shuffled mixture); "
        "--no-group-by-length: shuffled batches",
    )
    train.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="bf16 mixed precision (fp32 weights, bf16 autocast) is ~1.5x faster on CPUs with AVX512-BF16/AMX, "
        "fp32 on others (refused there); auto = bf16 on a GPU, fp32 on CPU",
    )
    train.set_defaults(handler=cmd_train)

    evaluate = commands.add_parser(
        "eval", help="accuracy / perplexity and KV memory over time steps", formatter_class=_ShowDefaults
    )
    _add_model(evaluate)
    _add_device(evaluate)
    evaluate.add_argument(
        "--adapters",
        nargs="+",
        default=["ccm:smollm2-concat", "ccm:smollm2-merge"],
        help="compression adapters to score (folders, Hub ids or ccm:<name>)",
    )
    evaluate.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help=f"default: {' '.join(_EVAL_TASKS)}; also: chat (long replies), document (general text), people (who is "
        "who among several people), grouping (ICL in open forms), or JSONL files of your own samples (./icl for a "
        "file named like a task)",
    )
    evaluate.add_argument(
        "--steps", nargs="+", type=int, default=None, help="time steps (default: the paper's; a file: all it has)"
    )
    evaluate.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"held-out samples per task, wording set (seen, unseen) and time step (default: {_EVAL_SAMPLES})",
    )
    evaluate.add_argument(
        "--full-context-adapter",
        default=None,
        help="a full-context fine-tuned adapter (conditional_lora=False): the paper's upper bound, scored with the "
        "whole history as plain prompt",
    )
    evaluate.add_argument(
        "--add-to",
        default=None,
        metavar="DIR",
        help="score only --adapters, on the tasks, time steps and samples of the earlier ccm eval report in DIR "
        "(drawn again with --seed and checked), and write the joint report, its baselines and adapters kept, to "
        "--output-dir",
    )
    evaluate.add_argument("--batch-size", type=int, default=16, help="samples scored at once")
    evaluate.add_argument("--seed", type=int, default=0, help="which held-out samples are drawn")
    evaluate.add_argument("--output-dir", default="docs/results", help="where eval.json, eval.md and eval.png go")
    evaluate.set_defaults(handler=cmd_eval)

    stream = commands.add_parser(
        "stream-eval", help="perplexity of a long stream: CCM vs StreamingLLM, same KV", formatter_class=_ShowDefaults
    )
    _add_model(stream)
    _add_device(stream)
    stream.add_argument("--adapter", default="ccm:smollm2-stream", help="a folder, Hub id or ccm:<name>")
    stream.add_argument("--text-file", default=None, help="a UTF-8 text file to stream (default: the held-out text)")
    stream.add_argument("--tokens", type=int, default=None, help="stream length (default: the whole text)")
    stream.add_argument("--piece", type=int, default=16, help="tokens fed per forward")
    _add_stream_sizes(stream)
    stream.add_argument("--compress-chunk", type=int, default=32, help="tokens compressed at once")
    _add_keep_window_full(stream)
    stream.add_argument("--bucket", type=int, default=1024, help="tokens per point of the perplexity plot")
    stream.add_argument(
        "--output-dir", default="docs/results/streaming", help="where stream_eval.json and stream_eval.png go"
    )
    stream.set_defaults(handler=cmd_stream_eval)

    for name, handler, text in (
        ("chat", cmd_chat, "talk with memory"),
        ("demo", cmd_demo, "a scripted chat that asks what it was told"),
    ):
        sub = commands.add_parser(name, help=text, formatter_class=_ShowDefaults)
        _add_model(sub)
        _add_device(sub)
        sub.add_argument("--update", choices=["concat", "merge"], default="concat", help="which shipped adapter")
        sub.add_argument("--adapter", default=None, help="an adapter folder, Hub id or ccm:<name> instead")
        sub.add_argument("--max-new-tokens", type=int, default=64, help="the longest reply, in tokens")
        if name == "chat":
            sub.add_argument("--memory-file", default=None, help="keep this user's memory between runs")
        else:
            sub.add_argument("--turns", type=int, default=None, help="stop after this many turns (default: all)")
            sub.add_argument(
                "--full-context",
                action="store_true",
                help="run the script with the whole conversation as its prompt (what compression is compared "
                "against): the base model alone, or with the LoRA of a fine-tuned full-context baseline --adapter",
            )
        sub.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
        if sys.stdout is not None:  # the last lines now, not at exit: a reader gone by then is caught below
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader of the output left (`ccm demo | head -2`): stop without a traceback, as Python documents it for
        # SIGPIPE, with what is left of the output sent where flushing it at exit cannot fail again ("Exception
        # ignored ... BrokenPipeError").
        if sys.stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"ccm {args.command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    # The system refused the work (a full disk, a folder made read-only meanwhile, a memory limit as a file was read).
    except (OSError, MemoryError) as error:
        print(f"ccm {args.command}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: the status a shell expects of an interrupted command, not a traceback
        print(f"ccm {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
