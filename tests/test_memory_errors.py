"""Persistence of a user's memory and the errors that protect it."""

import pytest
import torch

from tiny_models import randomize_adapter, tiny_base, tiny_ccm
from transformers_ccm import CCMConfig, CCMForCausalLM, CompressedMemoryCache


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
