"""Persistence of a user's memory and the errors that protect it."""

import copy
import dataclasses
import functools
import io
import json
import os
import re
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteriaList
from transformers.utils.quantization_config import GgufConfig

from crafted_files import with_huge_tensor
from fault_injection import ValuesRead, paused_at
from test_online import StopAfter
from tiny_models import randomize_adapter, tiny_base, tiny_ccm
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache, StreamingConfig
from transformers_ccm.cache import CacheSpec
from transformers_ccm.memory_file import MEMORY_FORMAT, MEMORY_FORMAT_VERSION, _check_spans


def _filled(model, batch_size=2):
    cache = model.new_cache(batch_size)
    model.compress(cache, torch.tensor([[5, 6, 7]] * batch_size))
    model.compress(cache, torch.tensor([[8, 9, 0]] * batch_size), attention_mask=torch.tensor([[1, 1, 0]] * batch_size))
    return cache


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_save_load_round_trip_is_exact(tmp_path, update):
    model = tiny_ccm("llama", update=update)
    cache = _filled(model)
    cache.save(tmp_path / "user.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", model)
    for name in ("memory_mask", "next_position", "steps"):
        assert torch.equal(getattr(loaded, name), getattr(cache, name))
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    prompt = torch.tensor([[20, 21], [22, 23]])
    assert torch.equal(
        model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False),
        model.generate(prompt, past_key_values=loaded, max_new_tokens=4, do_sample=False),
    )


MEMORIES = {
    "concat": {"update": "concat"},
    "concat capped at 3": {"update": "concat", "max_memory_tokens": 3},
    "merge": {"update": "merge"},
    "ema": {"update": "ema"},
}


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    memory=st.sampled_from(sorted(MEMORIES)),
    calls=st.lists(st.tuples(st.lists(st.booleans(), min_size=3, max_size=3), st.booleans()), max_size=4),
)
def test_every_memory_the_model_makes_loads_back(tmp_path, memory, calls):
    """Whatever rows took part in each call (a context for some users only, a generated turn folded for all),
    the saved memory passes every check of `load` and comes back exact."""
    model = tiny_ccm("llama", **MEMORIES[memory])
    cache = model.new_cache(3)
    for rows, generate_first in calls:
        if generate_first:
            model.generate(torch.tensor([[20, 21]] * 3), past_key_values=cache, max_new_tokens=2, do_sample=False)
        if any(rows) or generate_first:
            model.compress(cache, torch.tensor([[5, 6]] * 3), attention_mask=torch.tensor([[r, r] for r in rows]))
    cache.save(tmp_path / "user.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", model)
    for name in ("memory_mask", "next_position", "steps"):
        assert torch.equal(getattr(loaded, name), getattr(cache, name))


def test_empty_cache_round_trip(tmp_path):
    model = tiny_ccm("llama")
    model.new_cache(3).save(tmp_path / "new.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "new.safetensors", model)
    assert loaded.batch_size == 3 and loaded.memory_length == 0


def test_saving_an_unfolded_turn_is_refused(tmp_path):
    model = tiny_ccm("llama")
    cache = _filled(model, 1)
    model.generate(torch.tensor([[20]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"unfolded turn; call model.compress\(cache\)"):
        cache.save(tmp_path / "user.safetensors")


def test_saving_to_a_folder_or_into_a_missing_folder_says_so(tmp_path):
    model = tiny_ccm("llama")
    cache = _filled(model, 1)
    with pytest.raises(IsADirectoryError, match="is a folder; save the memory to a file such as"):
        cache.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist; create it before saving"):
        cache.save(tmp_path / "missing" / "user.safetensors")
    assert list(tmp_path.iterdir()) == []
    # A file where the path has a folder: "create it" could not be done, and a load said the file was unreadable.
    (tmp_path / "afile").write_bytes(b"the user's")
    for path in (tmp_path / "afile" / "user.safetensors", tmp_path / "afile" / "deeper" / "user.safetensors"):
        with pytest.raises(NotADirectoryError) as refused:
            cache.save(path)
        assert str(refused.value) == (
            f"{path} is inside {tmp_path / 'afile'}, a file, not a folder; save the memory in a folder."
        )
        with pytest.raises(FileNotFoundError, match=rf"^No memory file at {re.escape(str(path))}\.$"):
            CompressedMemoryCache.load(path, model)
    assert (tmp_path / "afile").read_bytes() == b"the user's"
    (tmp_path / "afile").unlink()
    cache.save(tmp_path / "user.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", model)
    assert torch.equal(loaded.layers[0].keys, cache.layers[0].keys)


@functools.cache
def _spec(model: CCMForCausalLM) -> CacheSpec:
    return model.cache_spec()  # once: it hashes the adapter's weights


@functools.cache
def _saved_memory(model: CCMForCausalLM) -> bytes:
    """The bytes of a memory file of `model`'s."""
    with tempfile.TemporaryDirectory() as folder:
        _filled(model, 1).save(os.path.join(folder, "user.safetensors"))
        with open(os.path.join(folder, "user.safetensors"), "rb") as file:
            return file.read()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_a_memory_file_cut_at_any_byte_is_refused_naming_it(tmp_path, fraction):
    """A save or a copy cut short by the system (a full disk, a killed copy) leaves a file of any length: each is
    refused with a ValueError naming the file, before any cache is built. Half the cuts fall in its header."""
    model = tiny_ccm("llama")
    content = _saved_memory(model)
    header = 8 + int.from_bytes(content[:8], "little")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(content[: int(fraction * header) if fraction < 0.5 else int(fraction * len(content))])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))} is not a readable safetensors memory file \("):
        CompressedMemoryCache.load(cut, _spec(model))


def test_loading_into_another_adapter_or_model_fails(tmp_path):
    model = tiny_ccm("llama")
    _filled(model).save(tmp_path / "user.safetensors")
    other_adapter = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()), seed=7)
    with pytest.raises(ValueError, match="adapter_sha256"):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", other_adapter)
    with pytest.raises(ValueError, match="model_type: file 'llama' vs model 'qwen2'"):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", tiny_ccm("qwen2"))
    with pytest.raises(ValueError, match="update: file 'concat' vs model 'merge'"):
        CompressedMemoryCache.load(tmp_path / "user.safetensors", tiny_ccm("llama", update="merge"))


def test_a_memory_of_weights_read_from_a_gguf_file_loads_into_the_same_weights_read_otherwise(tmp_path):
    """transformers records the GGUF file a model was read from as its config's quantization_config, which a memory's
    signature held: a memory of the default model read from its GGUF file (every one made before its converted copy
    was kept, and any made where TRANSFORMERS_CCM_CACHE is empty) was refused by the same weights read from the copy,
    and the other way. Another quantization still tells models apart."""
    plain = tiny_ccm("llama")
    from_gguf = copy.deepcopy(plain)
    from_gguf.base_model.config.quantization_config = GgufConfig(gguf_file="model.Q4_1.gguf")
    path = tmp_path / "user.safetensors"
    for maker, reader in ((from_gguf, plain), (plain, from_gguf)):
        cache = _filled(maker)
        cache.save(path)
        loaded = CompressedMemoryCache.load(path, reader)
        for made, read in zip(cache.layers, loaded.layers, strict=True):
            assert torch.equal(made.keys, read.keys) and torch.equal(made.values, read.values)
    # A file that recorded the GGUF file the weights were read from (as every memory of the default model did before
    # its converted copy was kept) loads into them read either way.
    gguf = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf"}
    _rewrite(path, metadata=_header_edit(lambda h: h["signature"]["base_config"].update(quantization_config=gguf)))
    for reader in (plain, from_gguf):
        CompressedMemoryCache.load(path, reader)
    from_gguf.base_model.config.quantization_config = {"quant_method": "awq", "bits": 4}
    refused = r"base_config\.quantization_config: file None vs model \{'bits': 4, 'quant_method': 'awq'\}"
    with pytest.raises(ValueError, match=refused):
        CompressedMemoryCache.load(path, from_gguf)


def test_corrupt_or_foreign_files(tmp_path):
    model = tiny_ccm("llama")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="not a readable safetensors memory file"):
        CompressedMemoryCache.load(tmp_path / "garbage.safetensors", model)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a transformers-ccm memory"):
        CompressedMemoryCache.load(tmp_path / "other.safetensors", model)
    with pytest.raises(FileNotFoundError):
        CompressedMemoryCache.load(tmp_path / "missing.safetensors", model)


def test_a_folder_or_a_named_pipe_is_refused_as_no_memory_file(tmp_path):
    """A folder read as "No such device"; a named pipe blocked the load for ever, waiting for a writer."""
    model = tiny_ccm("llama")
    with pytest.raises(ValueError, match=r"is a folder, not a memory file; give the file that cache\.save\(\) wrote"):
        CompressedMemoryCache.load(tmp_path, model)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match=r"pipe is not a regular file, not a memory file"):
        CompressedMemoryCache.load(tmp_path / "pipe", model)


def test_a_memory_file_written_over_in_place_while_it_loads_is_refused(tmp_path):
    """A file written in place after its header was checked (here: another adapter's memory, of the same shapes) loaded
    as a mix: its first 8 KiB as the file read had buffered them, the rest the other adapter's keys/values, under the
    signature checked. The data is read again from the disk and must begin with the header checked."""
    model = tiny_ccm("llama")
    other = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()), seed=7)
    path, foreign = tmp_path / "user.safetensors", tmp_path / "other.safetensors"
    _filled(model, 8).save(path)
    _filled(other, 8).save(foreign)
    before = path.read_bytes()
    assert len(before) > io.DEFAULT_BUFFER_SIZE  # more than a buffered read takes at once
    spec = _spec(model)
    load = paused_at(_check_spans.__code__, lambda: CompressedMemoryCache.load(path, spec))
    # In place (not replaced, as save() does): the load's open file reads the new bytes.
    with load as got, open(path, "r+b") as file:
        file.write(foreign.read_bytes())
        file.truncate()
    assert got["outcome"] == ("error", (ValueError, f"{path} changed while it was read; load it again."))
    path.write_bytes(before)  # the file as it was loads
    loaded = CompressedMemoryCache.load(path, spec)
    assert torch.equal(loaded.layers[0].keys, _filled(model, 8).layers[0].keys)


def test_cache_used_with_another_model_fails():
    cache = _filled(tiny_ccm("llama"))
    with pytest.raises(ValueError, match="belongs to another model"):
        tiny_ccm("qwen3").compress(cache, torch.tensor([[5, 6], [7, 8]]))
    with pytest.raises(ValueError, match="belongs to another model"):
        tiny_ccm("llama", update="merge").generate(torch.tensor([[5], [6]]), past_key_values=cache, max_new_tokens=1)


def test_empty_context_and_nothing_to_fold():
    model = tiny_ccm("llama")
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match="context_ids is empty"):
        model.compress(cache, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="Nothing to compress"):
        model.compress(cache)
    with pytest.raises(ValueError, match="Nothing to compress"):
        model.compress(cache, torch.tensor([[5, 6]]), attention_mask=torch.tensor([[0, 0]]))


def test_an_attention_mask_without_context_ids_is_refused_not_ignored():
    """compress(cache, attention_mask=...) folded every row's turn, a row the mask left out (as padding) too."""
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, torch.tensor([[5, 6], [7, 8]]))
    model.generate(torch.tensor([[5], [6]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    turn = cache.turn_length
    with pytest.raises(ValueError, match=r"^compress\(\) got an attention_mask but no context_ids, whose padding"):
        model.compress(cache, attention_mask=torch.tensor([[1], [0]]))
    assert (cache.steps.tolist(), cache.turn_length) == ([1, 1], turn)
    model.compress(cache)
    assert (cache.steps.tolist(), cache.turn_length) == ([2, 2], 0)


def test_wrong_batch_size():
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="batch size 3 but the cache holds 2 rows"):
        model.compress(cache, torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 1 but the cache holds 2 rows"):
        model.generate(torch.tensor([[5]]), past_key_values=cache, max_new_tokens=1)
    with pytest.raises(ValueError, match="positive"):
        model.new_cache(0)


def test_generate_twice_without_folding_is_refused():
    model = tiny_ccm("llama")
    cache = model.new_cache()
    model.generate(torch.tensor([[5]]), past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="not folded"):
        model.generate(torch.tensor([[6]]), past_key_values=cache, max_new_tokens=2)


def test_mismatched_attention_mask():
    model = tiny_ccm("llama")
    with pytest.raises(ValueError, match="one mask entry per context token"):
        model.compress(model.new_cache(), torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1]]))


@pytest.mark.parametrize("mask", ["ab", [[1, 1], [1]], {"mask": 1}])
def test_an_attention_mask_that_is_no_tensor_of_zeros_and_ones_says_so(mask):
    """Text, ragged rows or a dict reached torch, whose error did not say what to pass; the cache keeps its memory."""
    model = tiny_ccm("llama")
    cache = _filled(model, 2)
    before = [layer.keys.clone() for layer in cache.layers]
    prompt = torch.tensor([[5, 6], [7, 8]])
    with pytest.raises(ValueError, match="attention_mask must be 1 \\(a token\\) or 0 \\(padding\\) per context token"):
        model.compress(cache, prompt, attention_mask=mask)
    with pytest.raises(ValueError, match="per prompt token"):
        model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=1)
    assert all(torch.equal(layer.keys, kept) for layer, kept in zip(cache.layers, before, strict=True))
    assert not cache.has_unfolded_turn


# ----- crafted files ---------------------------------------------------------------------------------------------
def _rewrite(path, tensors=None, metadata=None):
    """Write `path` again with tensors and/or header changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as file:
        original = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is no dict)
        header = file.metadata()
    save_file(tensors(original) if tensors else original, path, metadata(header) if metadata else header)


def _header_edit(edit):
    def metadata(header):
        content = json.loads(header[MEMORY_FORMAT])
        edit(content)
        return {MEMORY_FORMAT: json.dumps(content)}

    return metadata


def _with(name, value):
    return lambda tensors: {**tensors, name: value}


def _without(name):
    return lambda tensors: {key: value for key, value in tensors.items() if key != name}


CRAFTED = {
    "a missing tensor": ({"tensors": _without("layers.1.values")}, "'layers.1.values' is missing"),
    "a wrong dtype": ({"tensors": _with("steps", torch.zeros(2, dtype=torch.int32))}, "'steps' is torch.int32"),
    "a wrong shape": ({"tensors": _with("layers.0.keys", torch.zeros(2, 2, 3, 8))}, "expected torch.float32 of shape"),
    "values that are not finite": (
        {"tensors": _with("layers.0.values", torch.full((2, 2, 4, 8), float("nan")))},
        "not finite",
    ),
    "an extra tensor": ({"tensors": _with("layers.9.keys", torch.zeros(1))}, "unexpected tensors"),
    "a negative position": ({"tensors": _with("next_position", torch.tensor([-3, 2]))}, "must be >= 0"),
    "a negative re-basing": ({"tensors": _with("rebased", torch.tensor([0, -1]))}, "must be >= 0"),
    "a re-basing of another dtype": ({"tensors": _with("rebased", torch.zeros(2, dtype=torch.int32))}, "'rebased' is"),
    "a history that overflows": ({"tensors": _with("rebased", torch.tensor([2**63 - 1, 0]))}, "must be >= 0"),
    # One short of overflowing: the next turn wrapped the count to a negative one, which `save` wrote.
    "a history that a turn would overflow": (
        {"tensors": _with("rebased", torch.tensor([2**63 - 10, 0]))},
        "more than any memory does (4611686018427387904)",
    ),
    "a position past the model's": (
        {"tensors": _with("next_position", torch.tensor([2**62, 5]))},
        "'next_position' [4611686018427387904, 5] passes the model's 512 positions",
    ),
    "slots that no fold gives": (
        {"tensors": _with("memory_mask", torch.tensor([[True, True, False, False], [True, True, True, True]]))},
        "its rows own [2, 4] memory slots, which the contexts they folded ('steps' [2, 2]) cannot give",
    ),
    "a count of folds that overflows": (
        {"tensors": _with("steps", torch.tensor([2**62, 2]))},
        "('steps' [4611686018427387904, 2]) cannot give",
    ),
    "no positions": ({"tensors": _without("next_position")}, "'next_position' must be a non-empty 1-D tensor"),
    "no user": (
        {"tensors": lambda tensors: {name: tensor[:0] for name, tensor in tensors.items()}},
        "'next_position' must be a non-empty 1-D tensor",
    ),
    "a header that is not JSON": (
        {"metadata": lambda header: {MEMORY_FORMAT: "{nope"}},
        "its header is not valid JSON",
    ),
    "a header without signature": ({"metadata": _header_edit(lambda h: h.pop("signature"))}, "no signature"),
    "an unknown version": ({"metadata": _header_edit(lambda h: h.update(format_version="7"))}, "version '7'"),
    "a bad streaming header": (
        {"metadata": _header_edit(lambda h: h.update(streaming={"config": {"window": 3}}))},
        "streaming header is wrong",
    ),
    "a format version that is no string": (
        {"metadata": _header_edit(lambda h: h.update(format_version=2))},
        "its format_version is 2, not a version number written as '3' is",
    ),
    **{
        f"a format version written as {version!r}": (
            {"metadata": _header_edit(lambda h, version=version: h.update(format_version=version))},
            f"its format_version is {version!r}, not a version number",
        )
        for version in ["3.0", "03", " 3", "3\n", "", "III", "-3"]
    },
    "a header with an integer of 5000 digits": (
        {"metadata": lambda header: {MEMORY_FORMAT: '{"format_version": ' + "3" * 5000 + "}"}},
        "its header holds an integer of more than",
    ),
    "a header nested too deeply": (
        {"metadata": lambda header: {MEMORY_FORMAT: "[" * 100_000 + "]" * 100_000}},
        "its header is nested too deeply",
    ),
    "an average the model never writes": (
        {"tensors": _with("layers.0.accumulated_keys", torch.zeros(2, 2, 4, 8))},
        "unexpected tensors ['layers.0.accumulated_keys']",
    ),
    "another adapter's signature": (
        {"metadata": _header_edit(lambda h: h["signature"].update(adapter_sha256="0" * 64))},
        "adapter_sha256",
    ),
}


def test_a_header_of_many_keys_one_given_twice_is_refused_at_once(tmp_path):
    """The key given twice was searched for among the keys before each one: a header of 50,000 keys (800 KB) took
    15 s to be refused, one of 200,000 minutes, and a header may hold 100 MB. Found in one pass now
    (`validation.first_repeated`, whose pass `tests/test_tasks.py` counts)."""
    model = tiny_ccm("llama")
    path = tmp_path / "user.safetensors"
    _filled(model).save(path)
    keys = ", ".join(f'"k{index}": 0' for index in range(50_000))
    _rewrite(path, metadata=lambda header: {MEMORY_FORMAT: f'{{{keys}, "k0": 1}}'})
    with pytest.raises(ValueError, match="its header gives the key 'k0' twice in one object"):
        CompressedMemoryCache.load(path, model)


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_files_are_refused_with_a_value_error_that_names_the_problem(tmp_path, case):
    model = tiny_ccm("llama")
    path = tmp_path / "user.safetensors"
    _filled(model).save(path)
    edits, message = CRAFTED[case]
    _rewrite(path, **edits)
    with pytest.raises(ValueError, match=re.escape(message)):
        CompressedMemoryCache.load(path, model)


def _bf16_merge_caches():
    from transformers_ccm.streaming import StreamingConfig

    model = copy.deepcopy(tiny_ccm("llama", update="merge")).to(torch.bfloat16)
    memory = _filled(model)
    stream = model.new_cache(2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4))
    model(input_ids=torch.tensor([list(range(3, 23))] * 2), past_key_values=stream)
    return model, {"memory": memory, "stream": stream}


@pytest.mark.parametrize("kind", ["memory", "stream"])
def test_a_memory_that_is_not_its_float32_average_is_refused(tmp_path, kind):
    """bf16 merge memory is saved with its float32 average, and `load` rebuilds the memory from that average: a
    file whose memory says something else would be silently replaced, so it is refused."""
    model, caches = _bf16_merge_caches()
    path = tmp_path / "user.safetensors"
    caches[kind].save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    start = 2 if kind == "stream" else 0  # the memory follows the sink

    def edit(tensors):
        keys = tensors["layers.1.keys"].clone()
        keys[:, :, start] += 1
        return {**tensors, "layers.1.keys": keys}

    _rewrite(path, tensors=edit)
    with pytest.raises(ValueError, match=r"'layers\.1\.keys' is not its float32 average 'layers\.1\.accumulated_keys'"):
        CompressedMemoryCache.load(path, model)


def test_a_half_precision_merge_stream_whose_rows_did_not_all_compress_loads_back(tmp_path):
    """A row without memory keeps no average (zeros in the file), beside a row that compressed a chunk: the check that
    memory is its float32 average must pass it by, or the stream saved never loads."""
    model = copy.deepcopy(tiny_ccm("llama", update="merge")).to(torch.bfloat16)
    stream = model.new_cache(2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4))
    model(input_ids=torch.tensor([list(range(3, 9))] * 2), past_key_values=stream)
    stopping = StoppingCriteriaList([StopAfter([1, None], 2)])  # the first row's reply ends first
    model.generate(torch.tensor([[20, 21]] * 2), past_key_values=stream, max_new_tokens=6, stopping_criteria=stopping)
    assert stream.stream_lengths[:, 1].tolist() == [0, 2]  # memory in the second row only
    stream.save(tmp_path / "stream.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "stream.safetensors", model)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(stream.layers, loaded.layers, strict=True))


STREAM_HEADERS = {
    "a cap that is no integer": ({"max_memory_tokens": 4.5}, "max_memory_tokens must be a positive integer, got 4.5"),
    "a switch that is no bool": ({"compress": "no"}, "compress must be True or False, got 'no'"),
    "a size that is a bool": ({"window_tokens": True}, "window_tokens must be a positive integer, got True"),
}


@pytest.mark.parametrize("case", sorted(STREAM_HEADERS))
def test_streaming_headers_with_values_of_the_wrong_type_are_refused(tmp_path, case):
    """Sizes that would pass a comparison but fail (or mean something else) in a later forward."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama")
    cache = model.new_cache(
        streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    )
    model(input_ids=torch.tensor([list(range(3, 15))]), past_key_values=cache)
    path = tmp_path / "user.safetensors"
    cache.save(path)
    change, message = STREAM_HEADERS[case]
    _rewrite(path, metadata=_header_edit(lambda h: h["streaming"]["config"].update(change)))
    with pytest.raises(ValueError, match=re.escape(message)):
        CompressedMemoryCache.load(path, model)


def test_a_stream_file_holding_more_slots_than_its_adapter_cap_is_refused_for_what_it_is(tmp_path):
    """Streams once held up to 8 slots under an adapter capped at fewer; such a file was refused as invalid, told to
    "save the memory again", which writes the same memory again. The refusal says what the file holds."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama", max_memory_tokens=4)
    cache = model.new_cache(streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4))
    model(input_ids=torch.tensor([list(range(3, 40))]), past_key_values=cache)
    path = tmp_path / "user.safetensors"
    cache.save(path)
    CompressedMemoryCache.load(path, model)  # its own cap: loads
    _rewrite(path, metadata=_header_edit(lambda h: h["streaming"]["config"].update(max_memory_tokens=8)))
    written = path.read_bytes()
    with pytest.raises(ValueError, match=r"up to 8 slots, more than its adapter's CCMConfig\.max_memory_tokens \(4\)"):
        CompressedMemoryCache.load(path, model)
    assert path.read_bytes() == written


def test_a_half_precision_stream_loads_back_with_its_float32_keys_and_continues_as_it_would_have(tmp_path):
    """A bfloat16 stream moves its keys in float32 (`float_keys`): the file holds them, so that the stream loaded goes
    on exactly as the one saved; a file without them (an earlier release's) loads from its keys, and one whose keys
    are not their cast is refused."""
    model, caches = _bf16_merge_caches()
    stream, path = caches["stream"], tmp_path / "stream.safetensors"
    stream.save(path)
    loaded = CompressedMemoryCache.load(path, model)
    more = torch.tensor([list(range(30, 41))] * 2)
    logits = [model(input_ids=more, past_key_values=cache).logits for cache in (stream, loaded)]
    assert torch.equal(logits[0], logits[1])
    for saved, again in zip(stream.layers, loaded.layers, strict=True):
        assert torch.equal(saved.float_keys, again.float_keys) and torch.equal(saved.keys, again.keys)
    stream.save(path)
    _rewrite(path, tensors=_without("layers.1.float_keys"))
    earlier = CompressedMemoryCache.load(path, model)
    assert torch.equal(earlier.layers[1].float_keys, stream.layers[1].keys.float())
    stream.save(path)

    def edit(tensors):
        keys = tensors["layers.0.float_keys"].clone()
        keys[:, :, -1] += 1  # a window slot: the memory's average is checked first
        return {**tensors, "layers.0.float_keys": keys}

    _rewrite(path, tensors=edit)
    with pytest.raises(
        ValueError, match=r"'layers\.0\.keys' is not the cast of its float32 copy 'layers\.0\.float_keys'"
    ):
        CompressedMemoryCache.load(path, model)


def _without_sink(tensors):
    return {**tensors, **{name: t[:, :, 2:].contiguous() for name, t in tensors.items() if name.startswith("layers.")}}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    update=st.sampled_from(["concat", "merge", "ema"]),
    compress=st.booleans(),
    keep_window_full=st.booleans(),
    cap=st.integers(2, 5),
    pieces=st.lists(st.integers(1, 9), max_size=5),
)
def test_every_stream_the_model_makes_loads_back(tmp_path, update, compress, keep_window_full, cap, pieces):
    """The checks of a stream's layout refuse no stream the model leaves."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama", update=update)
    config = StreamingConfig(
        sink_tokens=3,
        window_tokens=8,
        compress_chunk=3,
        max_memory_tokens=cap,
        compress=compress,
        keep_window_full=keep_window_full,
    )
    stream = model.new_cache(2, streaming=config)
    for index, length in enumerate(pieces):
        model(input_ids=torch.tensor([[3 + (index + i) % 90 for i in range(length)]] * 2), past_key_values=stream)
    stream.save(tmp_path / "stream.safetensors")
    loaded = CompressedMemoryCache.load(tmp_path / "stream.safetensors", model)
    assert all(
        torch.equal(a.keys, b.keys) for a, b in zip(stream.layers, loaded.layers, strict=True) if a.is_initialized
    )


def _compressed_tokens_kept_by_the_paper_s_schedule(header):
    """A stream header whose window keeps a compressed token, under the schedule that drops them at once."""
    header["streaming"]["config"]["keep_window_full"] = False
    header["streaming"]["state"]["compressed_in_window"] = 1


CRAFTED_STREAMS = {
    "a row that compressed nothing, yet owns memory": (
        {"tensors": _with("steps", torch.tensor([2, 0]))},
        r"its rows own \[([24]), \1\] of \1 memory slots, which the chunks they compressed \('steps' \[2, 0\]\) cannot "
        r"give \((concat|merge), 2 per chunk",
    ),
    "no fold, yet memory": (
        {"tensors": _with("steps", torch.tensor([0, 0]))},
        r"its rows own \[([24]), \1\] of \1 memory slots, which the chunks they compressed \('steps' \[0, 0\]\) cannot "
        r"give \((concat|merge), 2 per chunk",
    ),
    "memory slots that no row owns": (
        {"tensors": lambda tensors: {**tensors, "memory_mask": torch.zeros_like(tensors["memory_mask"])}},
        r"its rows own \[0, 0\] of [24] memory slots",
    ),
    # Evicted without a compression of their own: tokens that no memory slot holds were dropped.
    "more compressed window tokens than one chunk": (
        {"metadata": _header_edit(lambda h: h["streaming"]["state"].update(compressed_in_window=5))},
        r"its window holds \[5, 5\] tokens already compressed, more than this stream leaves there \(\[4, 4\]\)",
    ),
    "compressed window tokens under the paper's schedule": (
        {"metadata": _header_edit(_compressed_tokens_kept_by_the_paper_s_schedule)},
        r"its window holds \[1, 1\] tokens already compressed, more than this stream leaves there \(\[0, 0\]\)",
    ),
    # Lengths within the keys held, past the stream's sizes: a window token taken for a sink one, a window of 9 of 8.
    "a sink longer than its size": (
        {"metadata": _header_edit(lambda h: h["streaming"]["state"].update(sink_length=3, window_length=7))},
        r"its streaming lengths \{'sink_length': 3, .* exceed the sizes \{",
    ),
    "a window longer than its size": (
        {
            "tensors": lambda tensors: {
                name: torch.cat([tensor, tensor[:, :, -1:]], dim=2) if name.startswith("layers.") else tensor
                for name, tensor in tensors.items()
            },
            "metadata": _header_edit(lambda h: h["streaming"]["state"].update(window_length=9)),
        },
        r"its streaming lengths \{.*'window_length': 9, .* exceed the sizes \{",
    ),
    # Loaded, then counted the stream's tokens in halves (or backwards, or failed at the next forward as text).
    **{
        f"a {what} that is {kind}": (
            {"metadata": _header_edit(lambda h, what=what, value=value: h["streaming"]["state"].update({what: value}))},
            rf"its streaming lengths \{{.*'{what}': {re.escape(repr(value))}.*\}} are not integers >= 0",
        )
        for what, kind, value in [
            ("turn_tokens", "no integer", 1.5),
            ("turn_tokens", "text", "16"),
            ("compressed_in_window", "negative", -1),
        ]
    },
    "a window before the sink is full": (
        {
            "tensors": _without_sink,
            "metadata": _header_edit(lambda h: h["streaming"]["state"].update(sink_length=0, compressed_in_window=0)),
        },
        r"its sink holds \[0, 0\] of 2 tokens, yet memory or window tokens follow it",
    ),
}


@pytest.mark.parametrize("update", ["concat", "merge"])
@pytest.mark.parametrize("case", sorted(CRAFTED_STREAMS))
def test_crafted_streams_are_refused_with_a_value_error_that_names_the_problem(tmp_path, update, case):
    """A stream's rows own the memory their compressions give, which follows a full sink: a file that says otherwise
    was loaded, and the next forward put new tokens in the sink behind the window, or restarted a merge average."""
    from transformers_ccm.streaming import StreamingConfig

    model = tiny_ccm("llama", update=update)
    stream = model.new_cache(
        2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    )
    model(input_ids=torch.tensor([list(range(3, 19))] * 2), past_key_values=stream)
    path = tmp_path / "stream.safetensors"
    stream.save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    edits, message = CRAFTED_STREAMS[case]
    _rewrite(path, **edits)
    with pytest.raises(ValueError, match=message):
        CompressedMemoryCache.load(path, model)


def test_a_stream_that_never_compresses_yet_counts_compressions_is_refused(tmp_path):
    """A StreamingLLM stream (compress=False) holds no memory and compresses nothing: a file that counts compressed
    chunks was loaded as it was."""
    model = tiny_ccm("llama")
    stream = model.new_cache(2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress=False))
    model(input_ids=torch.tensor([list(range(3, 19))] * 2), past_key_values=stream)
    path = tmp_path / "stream.safetensors"
    stream.save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    _rewrite(path, tensors=_with("steps", torch.tensor([1, 0])))
    refused = re.escape("own [0, 0] of 0 memory slots, which the chunks they compressed ('steps' [1, 0]) cannot give")
    with pytest.raises(ValueError, match=refused):
        CompressedMemoryCache.load(path, model)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_a_count_of_folds_stays_within_the_bound(tmp_path, update, streaming):
    """A count of folds past any memory's loaded where a concat cap or merge/EMA memory kept it from showing in the
    slots: from 2**63 - 1 the next fold wrapped it to a negative count (merge then kept that fold's keys/values alone),
    and the memory saved after it never loaded. Files past the bound are refused; a fold at it keeps the count."""
    model = tiny_ccm("llama", update=update, **({"max_memory_tokens": 4} if update == "concat" else {}))
    if streaming:
        cache = model.new_cache(
            2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
        )
        model(input_ids=torch.tensor([list(range(3, 19))] * 2), past_key_values=cache)
    else:
        cache = _filled(model)
    path = tmp_path / "user.safetensors"
    cache.save(path)
    for steps in (2**62 + 1, 2**63 - 1):
        _rewrite(path, tensors=_with("steps", torch.tensor([2, steps])))
        with pytest.raises(
            ValueError, match=re.escape(f"its rows folded [2, {steps}] contexts ('steps'), more than any")
        ):
            CompressedMemoryCache.load(path, model)
    _rewrite(path, tensors=_with("steps", torch.tensor([2**62, 2**62])))
    loaded = CompressedMemoryCache.load(path, model)
    slots = slice(loaded.sink_length, loaded.sink_length + loaded.memory_length)  # a stream's follow its sink
    memory = [layer.keys[:, :, slots].clone() for layer in loaded.layers]
    if streaming:
        model(input_ids=torch.tensor([list(range(20, 30))] * 2), past_key_values=loaded)
    else:
        model.compress(loaded, torch.tensor([[5], [6]]))
    assert loaded.steps.tolist() == [2**62, 2**62]
    if update == "merge":  # a mean of 2**62 + 1 contexts: the newest weighs nothing
        for layer, before in zip(loaded.layers, memory, strict=True):
            torch.testing.assert_close(layer.keys[:, :, slots], before, atol=1e-6, rtol=0)
    loaded.save(path)
    assert CompressedMemoryCache.load(path, model).steps.tolist() == [2**62, 2**62]


def _lengths_edit(edit):
    """A `_rewrite` tensors edit of a stream's per-row lengths `(batch, 4)`."""
    return lambda tensors: {**tensors, "stream_lengths": edit(tensors["stream_lengths"].clone())}


def _set(row, column, value):
    def edit(lengths):
        lengths[row, column] = value
        return lengths

    return edit


CRAFTED_ROW_LENGTHS = {
    "a row longer than the header says": (_lengths_edit(_set(1, 2, 9)), "are not those its header gives"),
    "a negative length": (_lengths_edit(_set(0, 2, -1)), "are not those its header gives"),
    "memory that the row owns no slot of": (
        _lengths_edit(lambda lengths: _set(0, 2, lengths[0, 2] - 2)(_set(0, 1, 2)(lengths))),
        "are not its first ones",
    ),
    "lengths of another batch size": (
        _lengths_edit(lambda lengths: lengths[:1]),
        r"'stream_lengths' is torch.int64 of shape \(1, 4\), expected torch.int64 of shape \(2, 4\)",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED_ROW_LENGTHS))
def test_crafted_lengths_of_a_stream_s_rows_are_refused(tmp_path, case):
    """A stream whose rows differ (one's generate() reply ended first) saves each row's lengths; a file whose lengths
    disagree with its header, its memory or its batch is refused."""
    model = tiny_ccm("llama")
    stream = model.new_cache(
        2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    )
    model(input_ids=torch.tensor([list(range(3, 7))] * 2), past_key_values=stream)
    stopping = StoppingCriteriaList([StopAfter([1, None], 2)])
    model.generate(torch.tensor([[20, 21]] * 2), past_key_values=stream, max_new_tokens=3, stopping_criteria=stopping)
    assert stream.kv_lengths.tolist()[0] < stream.kv_lengths.tolist()[1]
    path = tmp_path / "stream.safetensors"
    stream.save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    edit, message = CRAFTED_ROW_LENGTHS[case]
    _rewrite(path, tensors=edit)
    with pytest.raises(ValueError, match=message):
        CompressedMemoryCache.load(path, model)


def test_a_row_whose_window_holds_fewer_tokens_than_it_counts_compressed_is_refused(tmp_path):
    """Each row's window tokens already compressed (`keep_window_full`) are among those it holds: a row counting more
    loaded, and its next forward evicted tokens it did not hold."""
    model = tiny_ccm("llama")
    stream = model.new_cache(
        2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    )
    model(input_ids=torch.tensor([list(range(3, 17))] * 2), past_key_values=stream)
    stopping = StoppingCriteriaList([StopAfter([1, None], 2)])  # rows of different lengths: each row's are saved
    model.generate(torch.tensor([[20, 21]] * 2), past_key_values=stream, max_new_tokens=3, stopping_criteria=stopping)
    assert stream.stream_lengths.tolist() == [[2, 4, 8, 1], [2, 4, 8, 3]]
    path = tmp_path / "stream.safetensors"
    stream.save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    _rewrite(path, tensors=_lengths_edit(_set(0, 2, 2)))  # the first row's window: 2 tokens, 1 compressed
    CompressedMemoryCache.load(path, model)
    _rewrite(path, tensors=_lengths_edit(_set(0, 3, 3)))  # 3 compressed
    with pytest.raises(ValueError, match=re.escape("compressed, more than the [2, 8] tokens it holds")):
        CompressedMemoryCache.load(path, model)


def _one_more_slot(tensors):
    """A memory's tensors with one more memory slot, owned by no row."""
    tensors = {**tensors, "memory_mask": torch.cat([tensors["memory_mask"], tensors["memory_mask"][:, :1] & False], 1)}
    return {
        name: torch.cat([tensor, tensor[:, :, :1] * 0], dim=2) if name.startswith("layers.") else tensor
        for name, tensor in tensors.items()
    }


def _one_empty_slot(tensors):
    """A memory's tensors as a memory of one slot, owned by no row, that folded nothing."""
    tensors = {**tensors, "memory_mask": tensors["memory_mask"][:, :1] & False, "steps": tensors["steps"] * 0}
    return {
        name: tensor[:, :, :1].contiguous() if name.startswith("layers.") else tensor
        for name, tensor in tensors.items()
    }


WIDE_MEMORIES = {
    "merge of 5 slots": (
        {"update": "merge"},
        lambda tensors: {
            **tensors,
            **{f"layers.{i}.{name}": torch.zeros(2, 2, 5, 8) for i in range(2) for name in ("keys", "values")},
            "memory_mask": torch.ones(2, 5, dtype=torch.bool),
        },
        r"holds 5 memory slots, more than this adapter's memory can \(2\)",
    ),
    # A slot that no row owns: within the rows' counts, past the memory's width.
    "concat capped at 3, of 4 slots": (
        {"max_memory_tokens": 3},
        _one_more_slot,
        r"holds 4 memory slots, more than this adapter's memory can \(3\)",
    ),
    "merge of 1 slot": ({"update": "merge"}, _one_empty_slot, r"holds 1 memory slots, where merge memory holds 0 or 2"),
}


@pytest.mark.parametrize("case", sorted(WIDE_MEMORIES))
def test_memory_wider_than_its_adapter_s_is_refused(tmp_path, case):
    settings_, edit, message = WIDE_MEMORIES[case]
    model = tiny_ccm("llama", **settings_)
    path = tmp_path / "user.safetensors"
    _filled(model).save(path)
    CompressedMemoryCache.load(path, model)  # as saved, it loads
    _rewrite(path, tensors=edit)
    with pytest.raises(ValueError, match=message):
        CompressedMemoryCache.load(path, model)


def test_files_of_format_version_1_still_load(tmp_path, caplog):
    model = tiny_ccm("llama", update="merge")
    cache = _filled(model)
    path = tmp_path / "user.safetensors"
    cache.save(path)
    signature = {key: value for key, value in model.memory_signature().items() if key != "base_fingerprint"}
    _rewrite(
        path,
        metadata=lambda header: {
            "format": MEMORY_FORMAT,
            "format_version": "1",
            "signature": json.dumps(signature, sort_keys=True),
        },
    )
    loaded = CompressedMemoryCache.load(path, model)
    assert "did not record base_fingerprint, lora_scaling" in caplog.text
    assert torch.equal(loaded.layers[0].keys, cache.layers[0].keys)
    model.compress(loaded, torch.tensor([[5, 6], [7, 8]]))
    model.compress(cache, torch.tensor([[5, 6], [7, 8]]))
    assert torch.equal(loaded.layers[1].values, cache.layers[1].values)


def _as_version_2(header):
    """The header as version 2 wrote it: without the LoRA scaling, the gate and the base config."""
    unrecorded = ("lora_scaling", "conditional_lora", "base_config")
    signature = {key: value for key, value in header["signature"].items() if key not in unrecorded}
    header.update(format_version="2", signature=signature)


def test_files_of_format_version_2_load_and_name_what_they_could_not_check(tmp_path, caplog):
    """Version 2 did not record the LoRA scaling, the gate or the base config: its files load where everything they
    recorded matches, with a warning that says what went unchecked."""
    model = tiny_ccm("llama", update="merge")
    cache = _filled(model)
    path = tmp_path / "user.safetensors"
    cache.save(path)
    _rewrite(path, metadata=_header_edit(_as_version_2))
    loaded = CompressedMemoryCache.load(path, model)
    assert "version 2, which did not record lora_scaling, conditional_lora, base_config" in caplog.text
    model.compress(loaded, torch.tensor([[5, 6], [7, 8]]))
    model.compress(cache, torch.tensor([[5, 6], [7, 8]]))
    assert torch.equal(loaded.layers[1].values, cache.layers[1].values)
    loaded.save(path)  # written again in the current version, with the full signature
    assert json.loads(_header(path))["format_version"] == MEMORY_FORMAT_VERSION


def test_files_of_format_version_2_of_another_adapter_are_refused(tmp_path):
    cache = _filled(tiny_ccm("llama", update="merge"))
    path = tmp_path / "user.safetensors"
    cache.save(path)
    _rewrite(path, metadata=_header_edit(_as_version_2))
    other = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(update="merge")), seed=7)
    with pytest.raises(ValueError, match=r"was made by another model or adapter \(adapter_sha256"):
        CompressedMemoryCache.load(path, other)


def _header(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as file:
        return file.metadata()[MEMORY_FORMAT]


@pytest.mark.parametrize("update", ["concat", "merge"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_memory_loaded_for_another_device_holds_every_tensor_there(tmp_path, update, streaming):
    """`load` moved the memory and the rows' slots, positions and counts to the model's device but left the rest of
    the row state (the turn's mask, the pending token) where a new cache makes it, on the CPU: the first compress or
    generate of a memory loaded for a GPU model failed on tensors of two devices. The meta device stands in for
    another device here."""
    model = tiny_ccm("llama", update=update)
    cache = _filled(model)
    if streaming:
        cache = model.new_cache(2, streaming=StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4))
        model(input_ids=torch.tensor([list(range(3, 23))] * 2), past_key_values=cache)
    cache.save(tmp_path / "user.safetensors")
    elsewhere = dataclasses.replace(model.cache_spec(), device=torch.device("meta"))
    loaded = CompressedMemoryCache.load(tmp_path / "user.safetensors", elsewhere)
    rows = {field.name: getattr(loaded.rows, field.name) for field in dataclasses.fields(loaded.rows)}
    layers = {
        f"layers.{index}.{name}": tensor
        for index, layer in enumerate(loaded.layers)
        for name, tensor in layer.held().items()
    }
    assert {name: tensor.device.type for name, tensor in {**rows, **layers}.items()} == dict.fromkeys(
        {**rows, **layers}, "meta"
    )


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_a_turn_of_padding_alone_is_folded(tmp_path, update):
    """batch_select_indices kept only a row whose turn was padding: compress() found 'nothing to compress', while
    generate() and save() asked for that very compress(): the cache was stuck until a new context was compressed."""
    model = tiny_ccm("llama", update=update)
    cache = model.new_cache(2)
    model.compress(cache, torch.tensor([[5, 6], [7, 8]]))
    model(
        input_ids=torch.tensor([[9, 10], [11, 12]]),
        attention_mask=torch.tensor([[1, 1], [0, 0]]),
        past_key_values=cache,
    )
    cache.batch_select_indices(torch.tensor([1]))
    expected = model.new_cache(1)
    model.compress(expected, torch.tensor([[7, 8]]))
    assert cache.has_unfolded_turn
    model.compress(cache)
    assert not cache.has_unfolded_turn
    for got, want in zip(cache.layers, expected.layers, strict=True):
        torch.testing.assert_close(got.memory(), want.memory(), rtol=0, atol=0)
    assert cache.steps.tolist() == expected.steps.tolist() == [1]
    assert cache.next_position.tolist() == expected.next_position.tolist()
    cache.save(tmp_path / "memory.safetensors")
    reply = model.generate(torch.tensor([[13]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    again = model.generate(torch.tensor([[13]]), past_key_values=expected, max_new_tokens=2, do_sample=False)
    assert torch.equal(reply, again)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rebased=st.lists(
        # Small counts, those about the bound, and those a few tokens short of int64's limit.
        st.integers(0, 2**20) | st.integers(2**62 - 64, 2**62 + 64) | st.integers(2**63 - 64, 2**63 - 1),
        min_size=2,
        max_size=2,
    )
)
def test_a_memory_that_loads_keeps_a_true_count_of_its_history_through_later_turns(tmp_path, rebased):
    """A count of re-based tokens just short of int64's limit loaded, the next turn wrapped the history to a
    negative count, and `save` wrote a file that `load` refused. A file past the bound is refused, and so is a turn
    that would take a memory past it."""
    model = tiny_ccm("llama")
    path = tmp_path / "user.safetensors"
    _filled(model).save(path)
    _rewrite(path, tensors=_with("rebased", torch.tensor(rebased)))
    try:
        cache = CompressedMemoryCache.load(path, model)
    except ValueError as error:
        assert str(path) in str(error)
        return
    assert (cache.history_tokens - cache.next_position).tolist() == rebased  # the count the file holds, not 0
    before = cache.history_tokens.clone()
    try:
        model.compress(cache, torch.tensor([[5, 6, 7, 8]] * 2))
    except ValueError as error:  # refused only at the bound, and then the memory is as it was
        assert "more would pass the most a memory counts" in str(error)
        assert torch.equal(cache.history_tokens, before)
    else:
        assert bool((cache.history_tokens > before).all())
    cache.save(path)
    assert torch.equal(CompressedMemoryCache.load(path, model).history_tokens, cache.history_tokens)


_STREAM = StreamingConfig(window_tokens=9, sink_tokens=2, compress_chunk=3, max_memory_tokens=2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    counted=st.integers(0, 2**20) | st.integers(2**62 - 40, 2**62),
    pieces=st.lists(st.integers(1, _STREAM.max_forward_tokens), min_size=1, max_size=5),
)
def test_a_stream_keeps_a_true_count_of_its_history_within_the_bound(tmp_path, counted, pieces):
    """A stream added the tokens it was fed to its count without the bound that a turn keeps: a stream loaded just
    below it went past it, and `save` wrote a file that `load` refused. The forwards keep the bound without reading
    the count from the device."""
    model = tiny_ccm("llama")
    path = tmp_path / "stream.safetensors"
    cache = model.new_cache(streaming=_STREAM)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 90, (1, 12)), past_key_values=cache)
    cache.save(path)
    _rewrite(path, tensors=_with("next_position", torch.tensor([counted])))
    cache = CompressedMemoryCache.load(path, model)
    reads = _count_device_reads(cache)
    for width in pieces:
        before = cache.history_tokens.clone()
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(3, 90, (1, width)), past_key_values=cache)
        except ValueError as error:  # refused only at the bound, and then the stream is as it was
            assert "more would pass the most a memory counts" in str(error)
            assert before + width > 2**62 and torch.equal(cache.history_tokens, before)
        else:
            assert torch.equal(cache.history_tokens, before + width)
    if counted < 2**61:  # far from the bound, the count set by the file is read once (and whether input is padded)
        assert all(count <= (2 if index == 0 else 1) for index, (_, count) in enumerate(reads)), reads
    cache.save(path)
    assert torch.equal(CompressedMemoryCache.load(path, model).history_tokens, cache.history_tokens)


@settings(max_examples=12, deadline=None)
@given(
    contexts=st.lists(st.integers(2, 6), min_size=1, max_size=3),
    prompt=st.integers(2, 5),
    batch=st.integers(1, 2),
    crafted=st.sampled_from(["rows replaced", "counter changed in place"]),
)
def test_a_turn_s_forwards_keep_the_history_bound_without_reading_the_device(contexts, prompt, batch, crafted):
    """Every forward read the rows' history counts from the device (a synchronisation on a GPU) to check them against
    the most a memory counts. The bound is kept as forwards add tokens; counts set otherwise are read, and refused
    past it."""
    model = tiny_ccm("llama")
    cache = model.new_cache(batch)
    reads = _count_device_reads(cache)
    for length in contexts:
        model.compress(cache, torch.randint(3, 90, (batch, length)))
    model.generate(torch.randint(3, 90, (batch, prompt)), past_key_values=cache, max_new_tokens=3, do_sample=False)
    model.compress(cache)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 90, (batch, prompt)), past_key_values=cache)
    # A single token's forward reads whether it may go without an attention mask, and nothing else.
    assert reads and all(count == (1 if width == 1 else 0) for width, count in reads), reads
    if crafted == "rows replaced":
        cache.rows = dataclasses.replace(cache.rows, rebased=torch.full((batch,), 2**62 - 1))
    else:
        cache.rows.rebased.add_(2**62 - 1)
    before = cache.history_tokens.clone()
    with pytest.raises(ValueError, match="more would pass the most a memory counts"):
        model.compress(cache, torch.tensor([[5, 6]] * batch))
    assert torch.equal(cache.history_tokens, before)


_SIGNATURE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.just("x" * 100_000),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.just("k" * 100_000), inner, max_size=3)
    ),
    max_leaves=8,
) | st.builds(lambda count: {f"entry{index}": index for index in range(count)}, st.integers(0, 50_000))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(["lora_scaling", "conditional_lora", "base_config", "base_fingerprint"]),
    value=_SIGNATURE_VALUES,
)
def test_any_value_in_a_signature_field_is_refused_in_a_message_of_a_few_lines(tmp_path, field, value):
    """A signature of tens of thousands of entries, or of one huge string, was named in full: a message of
    megabytes, in every log that recorded it."""
    model = tiny_ccm("llama")
    path = tmp_path / "user.safetensors"
    _filled(model).save(path)
    own = json.loads(_header(path))["signature"][field]
    _rewrite(path, metadata=_header_edit(lambda header: header["signature"].update({field: value})))
    if value == own:  # `true` for True, 2 for 2.0: the same value in JSON
        CompressedMemoryCache.load(path, model)
        return
    with pytest.raises(ValueError, match=re.escape(f"{path} was made by another model or adapter ({field}")) as error:
        CompressedMemoryCache.load(path, model)
    assert len(str(error.value)) < 20_000  # 32 differences, each name and value cut at 100 characters


def _count_device_reads(cache: CompressedMemoryCache) -> list[tuple[int, int]]:
    """The width of each forward's new tokens and the values `cache.prepare_forward` read from the device for it,
    appended as forwards run."""
    prepare, reads = cache.prepare_forward, []

    def counted(new_mask: torch.Tensor, sdpa: bool) -> tuple[torch.Tensor, object]:
        with ValuesRead() as values:
            prepared = prepare(new_mask, sdpa)
        reads.append((new_mask.shape[1], values.count))
        return prepared

    cache.prepare_forward = counted
    return reads


@pytest.mark.parametrize("other", [True, False])
def test_a_file_declaring_a_huge_tensor_is_refused_from_its_header(tmp_path, other):
    """Every tensor was read before the signature and shapes were checked: a file of another model, or one whose
    header declares a tensor far larger than the memory, was read whole (here 1 TiB, which no allocation can hold)
    before its refusal."""
    model = tiny_ccm("llama")
    _filled(tiny_ccm("qwen2") if other else model).save(tmp_path / "user.safetensors")
    expected = "model_type: file 'qwen2' vs model 'llama'" if other else "'layers.0.keys' is torch.float32 of shape"
    keys = model.cache_spec()
    shape = (2, keys.kv_heads, 2**40 // (4 * 2 * keys.kv_heads * keys.head_dim), keys.head_dim)
    with_huge_tensor(tmp_path / "user.safetensors", tmp_path / "huge.safetensors", "layers.0.keys", shape)
    assert os.path.getsize(tmp_path / "huge.safetensors") > 2**40
    with pytest.raises(ValueError, match=re.escape(expected)):
        CompressedMemoryCache.load(tmp_path / "huge.safetensors", model)


def _with_hole(source, target, where):
    """Write `target`: the safetensors file `source` with a 1 TiB hole (no disk) after its data ("end"), or before
    the data of its last tensor, whose offsets then point past the hole ("gap")."""
    raw = source.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    last = max((key for key in header if key != "__metadata__"), key=lambda key: header[key]["data_offsets"])
    start, end = header[last]["data_offsets"]
    if where == "gap":
        header[last]["data_offsets"] = [start + 2**40, end + 2**40]
    text = json.dumps(header).encode()
    data = raw[8 + length :]
    with open(target, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text + data[:start])
        file.truncate(file.tell() + 2**40)
        file.seek(0, os.SEEK_END)
        file.write(data[start:])


@pytest.mark.parametrize(
    ("where", "message"),
    [("end", "its header declares 1060 bytes of data, the file holds 1099511628836"), ("gap", "begins at byte")],
)
def test_a_file_larger_than_its_header_declares_is_refused_before_its_data_is_read(tmp_path, where, message):
    """The whole file was read once its header passed, and safetensors refused bytes its tensors do not cover only
    then: a valid memory with 1 TiB more (after its data, or between two tensors' data) was read into memory."""
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, torch.tensor([[5, 6, 7]] * 2))
    cache.save(tmp_path / "user.safetensors")
    _with_hole(tmp_path / "user.safetensors", tmp_path / "holed.safetensors", where)
    assert os.path.getsize(tmp_path / "holed.safetensors") > 2**40
    with pytest.raises(ValueError, match=re.escape(message)):
        CompressedMemoryCache.load(tmp_path / "holed.safetensors", model)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda entry: entry.update(data_offsets=[-8, 8]), "data_offsets [-8, 8] are not two whole numbers"),
        (lambda entry: entry.update(data_offsets=[8, 0]), "data_offsets [8, 0] are not two whole numbers"),
        (lambda entry: entry.update(data_offsets="0:8"), "data_offsets '0:8' are not two whole numbers"),
        (lambda entry: entry.update(data_offsets=[0, 8, 16]), "are not two whole numbers"),
        (lambda entry: entry.update(data_offsets=[0, 2**70]), "begins at byte"),
    ],
)
def test_crafted_data_offsets_are_refused_from_the_header(tmp_path, edit, message):
    """Offsets are checked against the dtypes and shapes, so the file reads no more than the memory it declares."""
    model, path, _ = _saved_memory_with_header(tmp_path, lambda header: edit(header["next_position"]))
    with pytest.raises(ValueError, match=re.escape(message)):
        CompressedMemoryCache.load(path, model)


@pytest.mark.parametrize(
    "edit",
    [
        lambda header: header["__metadata__"].update({MEMORY_FORMAT: 3}),
        lambda header: header.update(__metadata__=[MEMORY_FORMAT]),
    ],
    ids=["a value that is no text", "a list"],
)
def test_safetensors_metadata_that_is_no_map_of_strings_is_refused(tmp_path, edit):
    """safetensors' metadata maps names to strings: anything else failed inside the reading of the memory's header."""
    model, path, _ = _saved_memory_with_header(tmp_path, edit)
    refused = re.escape("is not a readable safetensors memory file (its metadata is not a map of strings)")
    with pytest.raises(ValueError, match=refused):
        CompressedMemoryCache.load(path, model)


def test_a_header_longer_than_safetensors_writes_is_refused_before_it_is_read(tmp_path):
    """A header of more than 100 MB is none that safetensors wrote, and reading it would take that memory: the file
    (a hole, taking no disk) is refused from its first 8 bytes."""
    path, size = tmp_path / "huge.safetensors", 100_000_001
    with open(path, "wb") as file:
        file.write(size.to_bytes(8, "little"))
        file.truncate(8 + size + 8)
    with pytest.raises(ValueError, match=re.escape(f"begins with no safetensors header length: {size} bytes")):
        CompressedMemoryCache.load(path, tiny_ccm("llama"))


def _saved_memory_with_header(tmp_path, edit):
    """A tiny Llama's saved memory of two rows, its safetensors header changed in place by `edit(header)`: the model,
    the file and the header written."""
    model = tiny_ccm("llama")
    cache = model.new_cache(2)
    model.compress(cache, torch.tensor([[5, 6, 7]] * 2))
    path = tmp_path / "user.safetensors"
    cache.save(path)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    return model, path, header


def test_data_offsets_that_move_the_border_between_two_tensors_are_refused(tmp_path):
    """Offsets that still cover the data, in order, can give one tensor bytes of the next: each tensor's range must
    be the size its dtype and shape take."""

    def in_file_order(header):
        return sorted((key for key in header if key != "__metadata__"), key=lambda key: header[key]["data_offsets"])

    def move_border(header):
        first, second = in_file_order(header)[:2]
        header[first]["data_offsets"][1] += 8
        header[second]["data_offsets"][0] += 8

    model, path, header = _saved_memory_with_header(tmp_path, move_border)
    first = in_file_order(header)[0]
    with pytest.raises(ValueError, match=f"its header gives '{first}' .* bytes of data, its dtype and shape take"):
        CompressedMemoryCache.load(path, model)
