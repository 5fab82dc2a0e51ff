"""A model and its caches sent to another process (a worker of a process pool): they run there as here."""

from __future__ import annotations

import copy
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tiny_models import tiny_ccm
from transformers_ccm import CCMForCausalLM, CompressedMemoryCache, StreamingConfig


def _next_turn(model: CCMForCausalLM, cache: CompressedMemoryCache) -> list[list[list[float]]]:
    """Fold the turn held, compress a context and run two tokens on `cache`: their logits `(1, 2, vocab)`."""
    if cache.has_unfolded_turn:
        model.compress(cache)
    model.compress(cache, torch.tensor([[15, 16]]))
    return model(input_ids=torch.tensor([[8, 9]]), past_key_values=cache).logits.tolist()


def _stream_on(model: CCMForCausalLM, cache: CompressedMemoryCache) -> list[list[list[float]]]:
    """Feed `cache` (a stream) more tokens than its window holds: their logits `(1, 12, vocab)`."""
    return model(input_ids=torch.arange(30, 42)[None], past_key_values=cache).logits.tolist()


# Not "fork": a process forked after torch's OpenMP threads have run can hang in its first parallel op (torch's
# multiprocessing notes), which a test suite's earlier tests make likely on any machine with more than one core.
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_model_and_its_cache_sent_to_a_new_process_run_there_as_here(start, streaming):
    """A model unpickled in a process that had not wrapped one (a spawned worker, torch.load) failed its first call
    with a KeyError: CCM's attention was registered with transformers only in the process that wrapped the model."""
    model = tiny_ccm("phi3", update="ema")
    if streaming:
        cache = model.new_cache(1, StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4))
        model(input_ids=torch.arange(3, 17)[None], past_key_values=cache)
        run = _stream_on
    else:
        cache = model.new_cache()
        model.compress(cache, torch.tensor([[5, 6, 7]]))
        model.generate(torch.tensor([[10, 11]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
        run = _next_turn
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(start)) as pool:
        there = pool.submit(run, model, cache).result()
    assert there == run(model, copy.deepcopy(cache))
