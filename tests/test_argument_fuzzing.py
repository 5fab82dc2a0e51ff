"""Odd but plausible arguments to the public calls: each call either gives the result of the canonical call (a
LongTensor of ids) or refuses with a ValueError/TypeError naming the argument, leaving the cache as it was."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, StoppingCriteria

from fault_injection import assert_same, snapshot
from tiny_models import VOCAB, tiny_base, tiny_ccm
from transformers_ccm import CCMDataCollator, CCMForCausalLM, CompressedMemoryCache, OnlineSample

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])

# Ways a caller may hold the ids `(batch, len)` long.
ID_VARIANTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "long": lambda ids: ids,
    "list": lambda ids: ids.tolist(),
    "numpy": lambda ids: ids.numpy(),
    "int32": lambda ids: ids.int(),
    "int16": lambda ids: ids.short(),
    "int8": lambda ids: ids.to(torch.int8),
    "uint8": lambda ids: ids.to(torch.uint8),
    "float": lambda ids: ids.float(),
    "bool": lambda ids: ids.bool(),
    "meta": lambda ids: ids.to("meta"),
    "non-contiguous": lambda ids: torch.stack([ids, ids], dim=-1)[..., 0],
    "transposed view": lambda ids: ids.t().contiguous().t(),
    "requires grad": lambda ids: ids.float().requires_grad_(),
    "0-d": lambda ids: ids[0, 0],
    "no rows": lambda ids: ids[:0],
    "no columns": lambda ids: ids[:, :0],
    "negative": lambda ids: ids - 6,
    "past the vocabulary": lambda ids: ids + VOCAB,
    "huge": lambda ids: ids + 2**62,
    "None inside": lambda ids: [[None, *row[1:]] for row in ids.tolist()],
}


def _compress(model: Any, cache: CompressedMemoryCache, ids: Any) -> Any:
    model.compress(cache, ids)


def _generate(model: Any, cache: CompressedMemoryCache, ids: Any) -> Any:
    return model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)


def _forward(model: Any, cache: CompressedMemoryCache, ids: Any) -> Any:
    return model(input_ids=ids, past_key_values=cache).logits


CALLS = {"compress": _compress, "generate": _generate, "forward": _forward}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=st.sampled_from(sorted(CALLS)), variant=st.sampled_from(sorted(ID_VARIANTS)))
def test_token_ids_in_any_form_give_the_canonical_result_or_a_named_refusal(call: str, variant: str) -> None:
    model = tiny_ccm("llama")
    canonical = model.new_cache(2)
    model.compress(canonical, torch.tensor([[3, 4, 5], [6, 7, 8]]))
    cache = canonical.copy()
    want = CALLS[call](model, canonical, IDS)
    before = snapshot(cache)
    try:
        got = CALLS[call](model, cache, ID_VARIANTS[variant](IDS))
    except (ValueError, TypeError) as error:
        argument = "context_ids" if call == "compress" else "input_ids"
        assert argument in str(error), str(error)
        assert_same(snapshot(cache), before)
        return
    assert variant not in ("float", "bool", "meta", "negative", "past the vocabulary", "huge", "None inside")
    if want is not None:
        assert torch.equal(got, want)
    assert_same(snapshot(cache), snapshot(canonical))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_training_forward_refuses_narrow_integer_ids_naming_the_cast(dtype: torch.dtype) -> None:
    model = tiny_ccm("llama")
    ids = IDS.to(dtype)
    batch = {
        "segment_ids": torch.zeros_like(IDS),
        "comp_mask": torch.zeros_like(IDS, dtype=torch.bool),
        "position_ids": torch.arange(4).expand(2, 4),
    }
    with pytest.raises(ValueError, match=r"input_ids must hold .* torch.int64 .* input_ids.long\(\)"):
        model(input_ids=ids, **batch)


def test_inputs_embeds_on_the_meta_device_are_refused_naming_them() -> None:
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, IDS)
    before = snapshot(cache)
    embeds = torch.zeros(2, 3, 32, device="meta")
    with pytest.raises(ValueError, match="inputs_embeds is on the meta device"):
        model(inputs_embeds=embeds, past_key_values=cache)
    assert_same(snapshot(cache), before)


class _StepLimit(StoppingCriteria):
    """Fails a generation that runs past `steps` steps (one that was asked for 2 tokens, or never stops)."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.left -= 1
        if self.left < 0:
            raise AssertionError("generate() ran past every length it was given")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["max_new_tokens", "max_length", "min_new_tokens", "min_length"]),
    value=st.sampled_from([float("nan"), float("inf"), 2.0, "2", True, torch.tensor(2.0), torch.tensor(True)]),
    in_config=st.booleans(),
)
def test_generation_lengths_that_are_no_whole_number_are_refused(name: str, value: Any, in_config: bool) -> None:
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, IDS)
    before = snapshot(cache)
    setting: dict[str, Any] = {name: value}
    if in_config:
        config = GenerationConfig(max_new_tokens=2, do_sample=False)
        setattr(config, name, value)  # as a loaded generation_config.json may hold it
        setting = {"generation_config": config}
    limit = {} if name == "max_new_tokens" else {"max_new_tokens": 2}
    with pytest.raises(ValueError, match=f"{name} must be a whole number of tokens"):
        model.generate(IDS, past_key_values=cache, stopping_criteria=[_StepLimit(50)], **limit, **setting)
    assert_same(snapshot(cache), before)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from([np.int64, np.int32, torch.tensor, lambda n: torch.tensor(n, dtype=torch.int32)]),
    length=st.integers(1, 3),
    in_config=st.booleans(),
)
def test_generation_lengths_as_numpy_integers_or_integer_tensors_equal_ints(
    kind: Callable[[int], Any], length: int, in_config: bool
) -> None:
    """transformers takes any integer `operator.index` does: a 0-d integer tensor (a count computed with torch) was
    refused as no whole number, though it generated as the int does before the check."""
    model = tiny_ccm("llama")
    caches = [model.new_cache(2) for _ in range(2)]
    setting: dict[str, Any] = {"max_new_tokens": kind(length)}
    if in_config:
        setting = {"generation_config": GenerationConfig(do_sample=False, **setting)}
    got = model.generate(IDS, past_key_values=caches[0], do_sample=False, **setting)
    want = model.generate(IDS, past_key_values=caches[1], max_new_tokens=length, do_sample=False)
    assert torch.equal(got, want)


LABEL_VARIANTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "long": lambda labels: labels,
    "ignored": lambda labels: labels.masked_fill(labels > 7, -100),
    "list": lambda labels: labels.tolist(),
    "int32": lambda labels: labels.int(),
    "float": lambda labels: labels.float(),
    "meta": lambda labels: labels.to("meta"),
    "past the vocabulary": lambda labels: labels + VOCAB,
    "negative": lambda labels: labels - 20,
    "one short": lambda labels: labels[:, :-1],
    "one row": lambda labels: labels[:1],
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(sorted(LABEL_VARIANTS)), online=st.booleans())
def test_labels_in_any_form_give_the_canonical_loss_or_a_named_refusal(variant: str, online: bool) -> None:
    model = tiny_ccm("llama")
    batch: dict[str, Any] = {
        "segment_ids": torch.zeros_like(IDS),
        "comp_mask": torch.zeros_like(IDS, dtype=torch.bool),
        "position_ids": torch.arange(4).expand(2, 4),
    }
    canonical = model.new_cache(2)
    model.compress(canonical, IDS)
    cache = canonical.copy()
    if online:
        batch = {"past_key_values": canonical}
    labels = LABEL_VARIANTS[variant](IDS)
    want = model(input_ids=IDS, labels=LABEL_VARIANTS["ignored" if variant == "ignored" else "long"](IDS), **batch)
    before = snapshot(cache)
    if online:
        batch = {"past_key_values": cache}
    try:
        got = model(input_ids=IDS, labels=labels, **batch)
    except (ValueError, TypeError) as error:
        assert "labels" in str(error), str(error)
        assert_same(snapshot(cache), before)
        return
    assert variant in ("long", "ignored")
    assert torch.equal(got.loss, want.loss)


@pytest.mark.parametrize("model", [None, "llama", 3, torch.zeros(1)])
def test_loading_a_memory_for_something_other_than_a_model_is_refused_naming_it(model: Any, tmp_path: Any) -> None:
    ccm = tiny_ccm("llama")
    cache = ccm.new_cache(2)
    ccm.compress(cache, IDS)
    cache.save(tmp_path / "memory.safetensors")
    with pytest.raises(TypeError, match=r"pass that CCMForCausalLM \(or its cache_spec\(\)\) as model"):
        CompressedMemoryCache.load(tmp_path / "memory.safetensors", model)
    loaded = CompressedMemoryCache.load(tmp_path / "memory.safetensors", ccm.cache_spec())
    assert_same(snapshot(loaded), snapshot(cache))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["", None, 5, b"adapter"]), what=st.sampled_from(["adapter", "memory"]))
def test_a_save_to_an_empty_or_non_path_writes_nothing_and_names_the_argument(path: Any, what: str) -> None:
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, IDS)
    name = "save_directory" if what == "adapter" else "path"
    # In a folder of its own: an empty path named the current folder, and the save wrote its files there. (Not
    # contextlib.chdir: Python 3.11+, and the package supports 3.10.)
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        with pytest.raises((ValueError, TypeError), match=f"{name} (is empty|must be a path)"):
            model.save_pretrained(path) if what == "adapter" else cache.save(path)
        assert os.listdir(".") == []


BATCH_VARIANTS: dict[str, Callable[[dict[str, torch.Tensor]], dict[str, Any]]] = {
    "as collated": lambda batch: batch,
    "comp_mask long": lambda batch: {**batch, "comp_mask": batch["comp_mask"].long()},
    "comp_mask int8": lambda batch: {**batch, "comp_mask": batch["comp_mask"].to(torch.int8)},
    "comp_mask float": lambda batch: {**batch, "comp_mask": batch["comp_mask"].float()},
    "comp_mask of 2": lambda batch: {**batch, "comp_mask": batch["comp_mask"].long() * 2},
    "comp_mask requiring grad": lambda batch: {**batch, "comp_mask": batch["comp_mask"].float().requires_grad_()},
    "comp_mask non-contiguous": lambda batch: {
        **batch,
        "comp_mask": torch.stack([batch["comp_mask"]] * 2, dim=-1)[..., 0],
    },
    "no rows": lambda batch: {key: value[:0] for key, value in batch.items()},
    "no positions": lambda batch: {key: value[:, :0] for key, value in batch.items()},
    "input_ids int32": lambda batch: {**batch, "input_ids": batch["input_ids"].int()},
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(sorted(BATCH_VARIANTS)))
def test_a_training_batch_in_any_form_gives_the_canonical_loss_or_a_named_refusal(variant: str) -> None:
    model = tiny_ccm("llama")
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [8, 9], [10, 11]), OnlineSample([[5, 6]], [8], [10])])
    want = model(**batch).loss
    try:
        got = model(**BATCH_VARIANTS[variant](batch)).loss
    except (ValueError, TypeError) as error:
        assert re.search(r"comp_mask|input_ids", str(error)), str(error)
        return
    assert variant in ("as collated", "comp_mask non-contiguous", "input_ids int32")
    assert torch.equal(got, want)


@pytest.mark.parametrize("call", ["batch_select_indices", "reorder_cache"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_row_indices_on_the_meta_device_are_refused_leaving_the_cache(call: str, dtype: torch.dtype) -> None:
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, IDS)
    before = snapshot(cache)
    indices = torch.tensor([1, 0] if dtype == torch.int64 else [True, False], device="meta")
    with pytest.raises((ValueError, TypeError), match=rf"cache.{call}\(\)"):
        getattr(cache, call)(indices)
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("field", ["contexts", "input", "output"])
def test_sample_ids_on_the_meta_device_are_refused_naming_the_sample(field: str) -> None:
    ids = torch.tensor([5, 6], device="meta")
    fields: dict[str, Any] = {"contexts": [[5, 6]], "input": [7], "output": [8]}
    fields[field] = [ids] if field == "contexts" else ids
    with pytest.raises(ValueError, match=rf"samples\[0\]\.{field}.* meta device"):
        CCMDataCollator(tiny_ccm("llama"))([OnlineSample(**fields)])


FLAGS = [
    ("load_adapter", "resize_comp_tokens"),
    ("load_adapter", "extend_targets"),
    ("load_adapter", "local_files_only"),
    ("from_pretrained", "local_files_only"),
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loading_flag=st.sampled_from(FLAGS), value=st.sampled_from(["no", "false", "True", 0, 1, None, 1.0]))
def test_loading_flags_that_are_not_booleans_are_refused_leaving_the_model(
    loading_flag: tuple[str, str], value: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    loading, flag = loading_flag
    model = tiny_ccm("llama")
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    signature = model.memory_signature()
    with pytest.raises(ValueError, match=f"{flag} must be True or False, got {value!r}"):
        if loading == "load_adapter":
            model.load_adapter(folder, **{flag: value})
        else:
            CCMForCausalLM.from_pretrained(folder, base_model=tiny_base("llama"), **{flag: value})
    assert model.memory_signature() == signature
