"""Online inference through CompressedMemoryCache: equal to the parallel forward, generate(), folding, batching."""

import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria
from transformers.generation.streamers import BaseStreamer

from fault_injection import assert_same, snapshot
from tiny_models import ARCHITECTURES, VOCAB, InjectedFailure, randomize_adapter, tiny_base, tiny_ccm
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample, StreamingConfig

TOLERANCE = 1e-4
tokens = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5)


def pad(rows, side, value=0):
    """Pad lists of ids to a (batch, len) tensor and its mask."""
    length = max(len(row) for row in rows)
    ids, mask = [], []
    for row in rows:
        fill = [value] * (length - len(row))
        ids.append(fill + row if side == "left" else row + fill)
        ones, zeros = [1] * len(row), [0] * (length - len(row))
        mask.append(zeros + ones if side == "left" else ones + zeros)
    return torch.tensor(ids), torch.tensor(mask)


def online_logits(model, samples, side="left"):
    """Compress every sample's contexts into one batched cache (rows without a j-th context skip step j),
    then run I(t) O(t). Returns per-row logits of the real I/O tokens."""
    cache = model.new_cache(len(samples))
    for step in range(max(len(s.contexts) for s in samples)):
        contexts = [list(s.contexts[step]) if step < len(s.contexts) else [] for s in samples]
        ids, mask = pad(contexts, side)
        model.compress(cache, ids, attention_mask=mask)
    ios = [[*s.input, *s.output] for s in samples]
    ids, mask = pad(ios, side)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    return [logits[row][mask[row].bool()] for row in range(len(samples))]


def parallel_logits(model, samples):
    batch = CCMDataCollator(model)(samples)
    with torch.no_grad():
        logits = model(**batch).logits
    rows = []
    for row, sample in enumerate(samples):
        end = int((batch["segment_ids"][row] > 0).sum())
        rows.append(logits[row, end - len(sample.input) - len(sample.output) : end])
    return rows


samples_strategy = st.lists(
    st.builds(
        OnlineSample,
        contexts=st.lists(tokens, min_size=1, max_size=8),
        input=tokens,
        output=st.lists(st.integers(3, VOCAB - 1), max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy, side=st.sampled_from(["left", "right"]))
def test_online_equals_parallel(architecture, update, samples, side):
    model = tiny_ccm(architecture, update=update, num_comp_tokens=2, ema_alpha=0.3)
    for row, (online, parallel) in enumerate(
        zip(online_logits(model, samples, side), parallel_logits(model, samples), strict=True)
    ):
        difference = (online - parallel).abs().max().item()
        assert difference <= TOLERANCE, f"row {row}: max |online - parallel| = {difference:.2e}"


@settings(max_examples=10, deadline=None)
@given(samples=samples_strategy, cap=st.integers(2, 7))
def test_capped_concat_online_equals_parallel(samples, cap):
    model = tiny_ccm("qwen2", num_comp_tokens=2, max_memory_tokens=cap)
    for online, parallel in zip(online_logits(model, samples), parallel_logits(model, samples), strict=True):
        assert (online - parallel).abs().max() <= TOLERANCE


@pytest.mark.parametrize("update", ["concat", "merge"])
@pytest.mark.parametrize("architecture", ["llama", "gemma3", "gpt-neox", "gpt2"])
def test_greedy_generate_equals_teacher_forced_parallel(architecture, update):
    assert_greedy_generate_equals_parallel(tiny_ccm(architecture, update=update), [[5, 6, 7], [8, 9], [40, 41, 42]])


def assert_greedy_generate_equals_parallel(
    model: CCMForCausalLM, contexts: list[list[int]], prompt: tuple[int, ...] = (20, 21), steps: int = 8
) -> None:
    """Greedy `generate()` after compressing `contexts` picks, at every step, the argmax of the parallel forward
    teacher-forced on the tokens generated so far."""
    cache = model.new_cache()
    for context in contexts:
        model.compress(cache, torch.tensor([context]))
    generated = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=steps, do_sample=False)
    expected = list(prompt)
    for _ in range(steps):
        logits = parallel_logits(model, [OnlineSample(contexts, list(prompt), expected[len(prompt) :])])[0]
        expected.append(int(logits[-1].argmax()))
    assert generated[0].tolist() == expected


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_the_cache_argument_under_either_name(architecture):
    """transformers 5.24 calls the cache argument `cache`; `past_key_values` stays accepted. Both names give the
    same tokens and the same memory, no deprecation warning is raised, and both at once are refused."""
    model = tiny_ccm(architecture)
    prompt = torch.tensor([[20, 21]])
    runs = []
    for name in ("cache", "past_key_values"):
        cache = model.new_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model.compress(cache, torch.tensor([[5, 6, 7]]))
            sequence = model.generate(prompt, max_new_tokens=4, do_sample=False, **{name: cache})
            model.compress(cache)
            logits = model(input_ids=prompt, **{name: cache}).logits
        runs.append((sequence, logits, cache))
    (sequence_a, logits_a, cache_a), (sequence_b, logits_b, cache_b) = runs
    assert torch.equal(sequence_a, sequence_b) and torch.equal(logits_a, logits_b)
    assert cache_a.memory_length == cache_b.memory_length == 2 * model.config.num_comp_tokens
    for a, b in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    keys = [layer.keys.clone() for layer in cache_a.layers]
    with pytest.raises(TypeError, match="Give the cache once"):
        model.generate(prompt, cache=cache_a, past_key_values=cache_a, max_new_tokens=2)
    with pytest.raises(TypeError, match="Give the cache once"):
        model(input_ids=prompt, cache=cache_a, past_key_values=cache_a)
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, cache_a.layers, strict=True))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(tokens, min_size=1, max_size=2),
    beams=st.sampled_from([1, 3]),
    stream=st.booleans(),
    with_ids=st.booleans(),
)
def test_generate_from_inputs_embeds_equals_generate_from_input_ids(prompts, beams, stream, with_ids):
    """transformers' `generate(inputs_embeds=...)` of a decoder-only model: the same tokens (without the prompt's,
    unless its input_ids are given too) and the same turn in the cache as from the prompt's ids."""
    model = tiny_ccm("llama")
    if stream:  # a stream's rows are of one length
        prompts = [prompt[: min(map(len, prompts))] for prompt in prompts]
    ids, mask = pad(prompts, "left")
    runs = []
    for embedded in (False, True):
        cache = model.new_cache(len(prompts), streaming=StreamingConfig(8, 2, 4, 4) if stream else None)
        if not stream:
            model.compress(cache, torch.tensor([[5, 6, 7]] * len(prompts)))
        prompt = {"inputs_embeds": model.get_input_embeddings()(ids)} if embedded else {}
        if not embedded or with_ids:
            prompt["input_ids"] = ids
        sequences = model.generate(
            **prompt, attention_mask=mask, cache=cache, max_new_tokens=4, num_beams=beams, do_sample=False
        )
        if not stream:
            model.compress(cache)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[8, 9]] * len(prompts)), cache=cache).logits
        runs.append((sequences, logits))
    (from_ids, logits), (from_embeds, embeds_logits) = runs
    assert torch.equal(from_embeds, from_ids if with_ids else from_ids[:, ids.shape[1] :])
    torch.testing.assert_close(embeds_logits, logits, rtol=0, atol=1e-6)


def test_generate_refuses_inputs_embeds_of_another_length_than_its_input_ids():
    model = tiny_ccm("llama")
    cache = model.new_cache()
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    embeds = model.get_input_embeddings()(torch.tensor([[8, 9, 10]]))
    with pytest.raises(ValueError, match="input_ids has 2 tokens but inputs_embeds 3"):
        model.generate(torch.tensor([[8, 9]]), inputs_embeds=embeds, cache=cache, max_new_tokens=2)
    assert not cache.has_unfolded_turn and cache.memory_length == model.config.num_comp_tokens


class TokenCounter:
    """Counts the token positions the model's first decoder layer processes."""

    def __init__(self, model):
        layer = next(
            m for name, m in model.base_model.named_modules() if name.endswith("layers.0") or name.endswith("h.0")
        )
        self.count = 0
        self.handle = layer.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.count += args[0].shape[1]


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_folding_a_turn_equals_compressing_it_and_runs_only_comp(update):
    model = tiny_ccm("llama", update=update, ema_alpha=0.3)
    n = model.config.num_comp_tokens
    folded, recompressed = model.new_cache(), model.new_cache()
    for cache in (folded, recompressed):
        model.compress(cache, torch.tensor([[5, 6, 7]]))
    prompt = torch.tensor([[20, 21, 22]])
    sequence = model.generate(prompt, past_key_values=folded, max_new_tokens=6, do_sample=False)
    assert folded.turn_length == 3 + 5  # the last generated token has no keys/values yet

    counter = TokenCounter(model)
    model.compress(folded)
    counter.handle.remove()
    assert counter.count == n + 1  # <COMP> and the pending last token, never the turn

    model.compress(recompressed, sequence)
    assert folded.memory_length == recompressed.memory_length
    assert torch.equal(folded.next_position, recompressed.next_position)
    for a, b in zip(folded.layers, recompressed.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)


def test_folding_with_feedback_appends_it_to_the_turn():
    model = tiny_ccm("llama")
    folded, recompressed = model.new_cache(), model.new_cache()
    sequence = model.generate(torch.tensor([[20, 21]]), past_key_values=folded, max_new_tokens=4, do_sample=False)
    model.compress(folded, torch.tensor([[70, 71]]))  # c(t) = input + output + feedback
    model.compress(recompressed, torch.cat([sequence, torch.tensor([[70, 71]])], dim=1))
    for a, b in zip(folded.layers, recompressed.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_a_forward_after_generate_follows_the_last_generated_token(update):
    """generate() leaves its last token without keys/values for compress() to fold; an online forward ran its new
    tokens without it (they did not attend to it) and the fold put it after them. The turn is input, output, then
    the forward's tokens, as if they had been given at once."""
    model = tiny_ccm("llama", update=update)
    online, at_once = model.new_cache(), model.new_cache()
    for cache in (online, at_once):
        model.compress(cache, torch.tensor([[5, 6, 7]]))
    sequence = model.generate(torch.tensor([[20, 21]]), past_key_values=online, max_new_tokens=2, do_sample=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[30, 31]]), past_key_values=online).logits
        expected = model(input_ids=torch.cat([sequence, torch.tensor([[30, 31]])], 1), past_key_values=at_once).logits
    torch.testing.assert_close(logits, expected[:, -2:], atol=1e-5, rtol=0)
    model.compress(online)
    model.compress(at_once)
    for a, b in zip(online.layers, at_once.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)


def test_rows_stop_at_their_own_eos():
    model = tiny_ccm("llama")
    prompt = torch.tensor([[20, 21], [30, 31]])
    free = model.generate(prompt, past_key_values=model.new_cache(2), max_new_tokens=6, do_sample=False)
    eos = int(free[0, 4])  # row 0 produces it at its third step; make it the EOS
    assert eos not in free[1, 2:].tolist()
    cache = model.new_cache(2)
    sequences = model.generate(
        prompt, past_key_values=cache, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    assert sequences[0, 5:].tolist() == [0] * 3
    model.compress(cache)
    alone = model.new_cache(1)
    model.compress(alone, sequences[:1, :5])  # the row's real turn: prompt and output up to its EOS
    assert int(cache.next_position[0]) == int(alone.next_position[0]) == 5
    for a, b in zip(cache.layers, alone.layers, strict=True):
        torch.testing.assert_close(a.keys[:1], b.keys, atol=1e-5, rtol=0)


def _history(model, contexts, batch_size=1, masks=None):
    cache = model.new_cache(batch_size)
    for index, context in enumerate(contexts):
        model.compress(
            cache, torch.tensor(context), attention_mask=None if masks is None else torch.tensor(masks[index])
        )
    return cache


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_batched_users_equal_users_alone(update):
    model = tiny_ccm("qwen3", update=update)
    # user 0: two contexts; user 1: one context, at another step, left-padded
    cache = _history(
        model, [[[0, 5, 6, 7], [10, 11, 12, 13]], [[8, 9], [0, 0]]], 2, [[[0, 1, 1, 1], [1] * 4], [[1, 1], [0, 0]]]
    )
    prompt, mask = torch.tensor([[20, 21, 22], [0, 0, 23]]), torch.tensor([[1, 1, 1], [0, 0, 1]])
    batched = model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
    alone0 = model.generate(
        prompt[:1], past_key_values=_history(model, [[[5, 6, 7]], [[8, 9]]]), max_new_tokens=6, do_sample=False
    )
    alone1 = model.generate(
        prompt[1:, 2:], past_key_values=_history(model, [[[10, 11, 12, 13]]]), max_new_tokens=6, do_sample=False
    )
    assert batched[0].tolist() == alone0[0].tolist()
    assert batched[1, 2:].tolist() == alone1[0].tolist()


def test_beam_search_on_batched_users_equals_each_alone():
    model = tiny_ccm("llama", update="merge")
    cache = _history(model, [[[5, 6, 7], [10, 11, 12]]], 2)
    prompt = torch.tensor([[20, 21], [0, 22]])
    mask = torch.tensor([[1, 1], [0, 1]])
    batched = model.generate(
        prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=5, num_beams=3, do_sample=False
    )
    alone0 = model.generate(
        prompt[:1], past_key_values=_history(model, [[[5, 6, 7]]]), max_new_tokens=5, num_beams=3, do_sample=False
    )
    alone1 = model.generate(
        prompt[1:, 1:],
        past_key_values=_history(model, [[[10, 11, 12]]]),
        max_new_tokens=5,
        num_beams=3,
        do_sample=False,
    )
    assert batched[0].tolist() == alone0[0].tolist()
    assert batched[1, 1:].tolist() == alone1[0].tolist()
    # the returned beam's turn is in the cache, ready to fold
    model.compress(cache)
    assert cache.steps.tolist() == [2, 2]


def test_empty_memory_generates_as_the_base_model():
    model = tiny_ccm("gemma3")
    base = tiny_base("gemma3")
    prompt = torch.tensor([[0, 20, 21, 22], [30, 31, 32, 33]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    expected = base.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got = model.generate(
        prompt, attention_mask=mask, past_key_values=model.new_cache(2), max_new_tokens=6, do_sample=False
    )
    assert torch.equal(got, expected)
    assert model.base_model.get_output_embeddings().weight.shape[0] == VOCAB  # no <COMP> in the vocabulary


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.tokens.append("end")


def test_sampling_with_a_streamer():
    model = tiny_ccm("llama")
    cache = _history(model, [[[5, 6, 7]]])
    streamer = Collect()
    torch.manual_seed(0)
    out = model.generate(
        torch.tensor([[20, 21]]), past_key_values=cache, max_new_tokens=5, do_sample=True, top_k=10, streamer=streamer
    )
    assert streamer.tokens == [*out[0].tolist(), "end"]


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_memory_growth_follows_the_rule(update):
    model = tiny_ccm("llama", update=update)
    n = model.config.num_comp_tokens
    cache = model.new_cache(2)
    layers, heads, head_dim = 2, 2, 8
    for step in range(1, 6):
        model.compress(cache, torch.tensor([[5, 6, 7], [8, 9, 10]]))
        expected = n * step if update == "concat" else n
        assert cache.memory_length == expected
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert cache.memory_bytes() == held == 2 * layers * 2 * heads * expected * head_dim * 4
        assert cache.turn_length == 0


def test_capped_memory_evicts_oldest():
    model = tiny_ccm("llama", max_memory_tokens=5)
    cache = model.new_cache()
    kept = []
    for step in range(4):
        model.compress(cache, torch.tensor([[5 + step, 6, 7]]))
        kept.append(cache.layers[0].keys[0, :, -2:].clone())
        assert cache.memory_length == min(2 * (step + 1), 5)
    newest = torch.cat(kept[-2:], dim=1)
    assert torch.equal(cache.layers[0].keys[0, :, 1:], newest)  # the oldest slots left first


@pytest.mark.parametrize("update", ["concat", "merge"])
def test_row_with_empty_mask_keeps_its_memory(update):
    model = tiny_ccm("llama", update=update)
    cache = _history(model, [[[5, 6, 7], [8, 9, 10]]], 2)
    before = [layer.keys[1].clone() for layer in cache.layers]
    model.compress(cache, torch.tensor([[11, 12], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]))
    assert cache.steps.tolist() == [2, 1]
    for layer, old in zip(cache.layers, before, strict=True):
        row = layer.keys[1][:, cache.memory_mask[1]]
        assert torch.equal(row, old[:, : row.shape[1]] if update == "concat" else old)


def _folded_rows(model, cache, sequences, real_lengths):
    """Fold the cache's turn and check each row's memory against compressing the row's real turn alone."""
    model.compress(cache)
    for row, length in enumerate(real_lengths):
        alone = model.new_cache()
        model.compress(alone, sequences[row : row + 1, :length])
        assert int(cache.next_position[row]) == int(alone.next_position[0])
        for layer, single in zip(cache.layers, alone.layers, strict=True):
            torch.testing.assert_close(layer.keys[row : row + 1], single.keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_use_cache_false_generates_as_the_base_model_and_leaves_the_turn_once(architecture):
    """With use_cache=False (given, or saved in the base's generation_config) the memory is still in the cache:
    every step re-fed the whole sequence into it, so the turn held each token many times and the tokens differed
    from the base model's."""
    model = tiny_ccm(architecture)
    base = tiny_base(architecture)
    prompt, mask = torch.tensor([[0, 20, 21], [30, 31, 32]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    expected = base.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for settings_ in ({"use_cache": False}, {"generation_config": GenerationConfig(use_cache=False)}):
        cache = model.new_cache(2)
        got = model.generate(
            prompt,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            **settings_,
        )
        assert torch.equal(got, expected)
        assert cache.turn_length == 3 + 4
        model.compress(cache)
        assert cache.next_position.tolist() == [2 + 5, 3 + 5]


def test_settings_saved_on_the_base_model_apply_beside_a_generation_config():
    """A GenerationConfig given to generate() takes what it leaves unset from the base model's generation_config, as
    transformers does: a saved num_beams failed with a batch-size error, a saved eos left the padding after it in the
    turn to fold."""
    base = tiny_base("llama")
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    prompt = torch.tensor([[20, 21], [30, 31]])
    free = model.generate(prompt, past_key_values=model.new_cache(2), max_new_tokens=6, do_sample=False)
    eos = int(free[0, 3])  # row 0 produces it at its second step
    assert eos not in free[1, 2:].tolist()
    for saved in (model.base_model.generation_config, base.generation_config):
        saved.update(num_beams=3, eos_token_id=eos, pad_token_id=0)
    expected = base.generate(prompt, generation_config=GenerationConfig(max_new_tokens=6))
    cache = model.new_cache(2)
    got = model.generate(prompt, past_key_values=cache, generation_config=GenerationConfig(max_new_tokens=6))
    assert torch.equal(got, expected)
    real = [int((row == eos).nonzero()[0]) + 1 if eos in row.tolist() else len(row) for row in got]
    assert real[0] < got.shape[1]
    _folded_rows(model, cache, got, real)


class StopRowAfter(StoppingCriteria):
    """Stops one row once it generated `count` tokens after a prompt of `prompt_length`."""

    def __init__(self, row, count, prompt_length):
        self.row, self.count, self.prompt_length = row, count, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] - self.prompt_length >= self.count
        return done


def test_rows_a_stopping_criterion_stops_early_fold_no_padding():
    """transformers pads a row that a stopping criterion (or a stop string) finished, as after an EOS; that padding
    was folded into the row's memory as if it had been said."""
    model = tiny_ccm("llama")
    prompt = torch.tensor([[20, 21], [30, 31]])
    cache = model.new_cache(2)
    sequences = model.generate(
        prompt,
        past_key_values=cache,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([StopRowAfter(row=0, count=2, prompt_length=2)]),
    )
    assert sequences[0, 4:].tolist() == [0] * 4 and 0 not in sequences[1].tolist()
    _folded_rows(model, cache, sequences, [4, 8])


class StopAfter(StoppingCriteria):
    """Stops row r (each of its beams) once it generated `counts[r]` tokens (None: never); raises `InjectedFailure`
    at reply length `fail_at`."""

    def __init__(self, counts, prompt_length, fail_at=None):
        self.counts, self.prompt_length, self.fail_at = counts, prompt_length, fail_at

    def __call__(self, input_ids, scores, **kwargs):
        generated = input_ids.shape[1] - self.prompt_length
        if generated == self.fail_at:
            raise InjectedFailure(f"stopping criterion at reply length {generated}")
        done = torch.tensor([count is not None and generated >= count for count in self.counts])
        return done.repeat_interleave(input_ids.shape[0] // len(self.counts))  # beam search asks for every beam


@functools.cache
def _model_without_special_tokens():
    """A tiny CCM model whose base saves no EOS and no pad token: each call sets its own."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    model.base_model.generation_config.update(eos_token_id=None, pad_token_id=None)
    return model


_PROMPTS = torch.tensor([[20, 21], [30, 31], [40, 41]])
_CONTEXTS = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
_NEW = 5


def _generate_after_context(model, rows, eos, pad, counts, beams, fail_at=None):
    """A cache of `rows` users that folded their context, and generate()'s call on it: (cache, call)."""
    cache = model.new_cache(len(rows))
    model.compress(cache, _CONTEXTS[rows])
    config = GenerationConfig(max_new_tokens=_NEW, do_sample=False, num_beams=beams, eos_token_id=eos, pad_token_id=pad)
    stopping = StoppingCriteriaList([StopAfter(counts, _PROMPTS.shape[1], fail_at)])
    return cache, lambda: model.generate(
        _PROMPTS[rows], past_key_values=cache, generation_config=config, stopping_criteria=stopping
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_row_of_a_batch_folds_the_reply_it_gets_alone(data):
    """Rows of a batch that finish at different times (an EOS, a stopping criterion, max_new_tokens) fold the reply
    each user gets generating alone, greedy or with beam search: a row a criterion stopped folded one padding EOS
    when no pad token was set (or the tokens generated after it when no EOS was), and a reply ending with the pad id
    lost those tokens."""
    model = _model_without_special_tokens()
    batch = data.draw(st.integers(1, 3), label="batch")
    rows = list(range(batch))
    free = model.generate(_PROMPTS[rows], past_key_values=model.new_cache(batch), max_new_tokens=_NEW)[:, 2:]
    produced = st.tuples(st.integers(0, batch - 1), st.integers(0, _NEW - 1)).map(lambda at: int(free[at]))
    eos = data.draw(st.none() | produced, label="eos")
    pad = data.draw(st.none() | st.just(eos) | produced, label="pad")
    counts = data.draw(st.lists(st.none() | st.integers(1, _NEW), min_size=batch, max_size=batch), label="counts")
    beams = data.draw(st.sampled_from([1, 2]), label="beams")
    fail_at = data.draw(st.none() | st.integers(1, _NEW), label="fail_at")
    cache, call = _generate_after_context(model, rows, eos, pad, counts, beams, fail_at)
    before = snapshot(cache)
    try:
        sequences = call()[:, _PROMPTS.shape[1] :]
    except InjectedFailure:
        assert_same(snapshot(cache), before)
        return
    model.compress(cache)
    for row in rows:
        alone, call = _generate_after_context(model, [row], eos, pad, [counts[row]], beams)
        reply = call()[0, _PROMPTS.shape[1] :]
        assert sequences[row, : len(reply)].tolist() == reply.tolist()
        model.compress(alone)
        assert int(cache.next_position[row]) == int(alone.next_position[0]), f"row {row}"
        for layer, single in zip(cache.layers, alone.layers, strict=True):
            torch.testing.assert_close(layer.keys[row : row + 1], single.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[row : row + 1], single.values, atol=1e-5, rtol=0)


class EndsAt(EosTokenCriteria):
    """transformers' EOS criterion under a class of the caller's own (one that logs each stop, say)."""


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_stopping_criterion_with_an_eos_id_pads_the_rows_it_stopped_as_in_transformers(data):
    """transformers pads a finished row with pad_token_id when any stopping criterion has an `eos_token_id` (an EOS
    criterion of the caller's own class, too); generate() hid such a criterion inside the one that records when each
    row stopped, so the rows it stopped went on generating tokens. They are now padded as transformers' own
    EosTokenCriteria pads them, and fold the same replies."""
    model = _model_without_special_tokens()
    batch = data.draw(st.integers(2, 3), label="batch")
    rows = list(range(batch))
    cache = model.new_cache(batch)
    model.compress(cache, _CONTEXTS[rows])
    free = model.generate(_PROMPTS[rows], past_key_values=cache, max_new_tokens=_NEW)[:, 2:]
    at = data.draw(st.tuples(st.integers(0, batch - 1), st.integers(0, _NEW - 2)), label="stop at")
    eos = int(free[at])
    got = []
    for criterion in (EndsAt(eos), EosTokenCriteria(eos)):
        cache = model.new_cache(batch)
        model.compress(cache, _CONTEXTS[rows])
        sequences = model.generate(
            _PROMPTS[rows],
            past_key_values=cache,
            max_new_tokens=_NEW,
            pad_token_id=1,
            stopping_criteria=StoppingCriteriaList([criterion]),
        )
        model.compress(cache)
        got.append((sequences, snapshot(cache)))
    assert_same(got[0], got[1])


def _forward_inputs(model, path):
    """The inputs of each path of `CCMForCausalLM.forward`: a training batch, an online turn, a stream in pieces."""
    ids = torch.arange(3, 30)[None]
    if path == "training":
        return {**CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [10, 11], [12, 13])]), "logits_at_labels": True}
    if path == "online":
        return {"input_ids": ids, "labels": ids, "past_key_values": _history(model, [[[5, 6, 7]]])}
    streaming = StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
    return {"input_ids": ids, "labels": ids, "past_key_values": model.new_cache(streaming=streaming)}


@pytest.mark.parametrize("path", ["training", "online", "stream"])
def test_return_dict_false_gives_the_outputs_as_a_tuple(path):
    """`return_dict=False` asks for a tuple, as from a transformers model: the training forward with logits_at_labels
    and an input that a stream runs in pieces failed with an AttributeError."""
    model = tiny_ccm("llama")
    with torch.no_grad():
        expected = model(**_forward_inputs(model, path)).to_tuple()
        got = model(**_forward_inputs(model, path), return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(expected)
    for value, want in zip(got, expected, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(value, want, atol=0, rtol=0)
        else:
            assert type(value) is type(want)


def test_the_models_generation_config_is_the_one_generate_starts_from():
    """`model.generation_config` failed with an AttributeError, and one assigned to it was ignored: generate() kept
    the base model's settings (20 tokens instead of 3 here)."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig()))
    base = tiny_base("llama")
    model.generation_config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0)
    base.generation_config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert model.base_model.generation_config is model.generation_config
    model.generation_config.max_new_tokens = base.generation_config.max_new_tokens = 2
    prompt = torch.tensor([[20, 21, 22]])
    got = model.generate(prompt, past_key_values=model.new_cache())
    assert got.shape == (1, 5) and torch.equal(got, base.generate(prompt))


ASSISTED = {
    "assistant_model": lambda: {"assistant_model": tiny_base("llama")},
    "a CCM assistant": lambda: {"assistant_model": tiny_ccm("llama", update="merge")},
    "prompt_lookup_num_tokens": lambda: {"prompt_lookup_num_tokens": 2},
}


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("option", sorted(ASSISTED))
def test_assisted_generation_is_refused_naming_its_options(option, batch_size):
    """Assisted generation crops the drafts it rejects from the cache, which a CompressedMemoryCache cannot do: a batch
    of two was refused as if one row would do, one row then by a message naming no option, and a CCM assistant
    failed with an AttributeError."""
    model = tiny_ccm("llama")
    cache = _history(model, [[[5, 6, 7]] * batch_size], batch_size)
    before = cache.copy()
    with pytest.raises(ValueError, match=r"\(assistant_model, prompt_lookup_num_tokens, assistant_early_exit\)"):
        model.generate(
            torch.tensor([[20, 21]] * batch_size), past_key_values=cache, max_new_tokens=3, **ASSISTED[option]()
        )
    assert cache.turn_length == 0 and torch.equal(cache.layers[0].keys, before.layers[0].keys)


@pytest.mark.parametrize("given", ["segment_ids", "comp_mask", "position_ids", "logits_at_labels"])
def test_training_arguments_beside_a_cache_are_refused(given):
    """The online forward ignored the training batch's segment_ids, comp_mask and position_ids (its ids, <COMP>
    placeholders included, then ran as a turn) and logits_at_labels (all logits came back)."""
    model = tiny_ccm("llama")
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [10, 11], [12, 13])])
    cache = _history(model, [[[5, 6, 7]]])
    value = True if given == "logits_at_labels" else batch[given]
    with pytest.raises(ValueError, match=f"{given} belong to the training forward"):
        model(input_ids=batch["input_ids"], labels=batch["labels"], past_key_values=cache, **{given: value})
    assert cache.turn_length == 0


def test_a_cache_implementation_saved_on_the_base_model_is_overridden_and_a_given_one_refused():
    """A base model whose saved generation_config names a cache_implementation ("static", say) could not generate at
    all: transformers refused it beside the CompressedMemoryCache that every CCM generate() passes."""
    base = tiny_base("llama")
    expected = base.generate(torch.tensor([[20, 21]]), max_new_tokens=4, do_sample=False)
    base.generation_config.cache_implementation = "static"
    model = randomize_adapter(CCMForCausalLM.from_base(base, CCMConfig()))
    for settings_ in ({}, {"generation_config": GenerationConfig(max_new_tokens=4, do_sample=False)}):
        got = model.generate(torch.tensor([[20, 21]]), past_key_values=model.new_cache(), max_new_tokens=4, **settings_)
        assert torch.equal(got, expected)
    cache = model.new_cache()
    for asked in (
        {"cache_implementation": "dynamic"},
        {"generation_config": GenerationConfig(cache_implementation="static")},
    ):
        with pytest.raises(ValueError, match=r"cache_implementation=.* asks generate\(\) to build a cache of its own"):
            model.generate(torch.tensor([[20, 21]]), past_key_values=cache, max_new_tokens=2, **asked)
        assert not cache.has_unfolded_turn


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["online", "stream"]),
    length=st.integers(1, 27),
    labelled=st.lists(st.integers(0, 26), max_size=3),
    items=st.sampled_from([None, 3]),
)
def test_online_loss_is_zero_without_labels_and_counts_num_items_in_batch(path, length, labelled, items):
    """Labels all -100 (or one token, which predicts nothing) gave a NaN loss, as the training forward did before; a
    stream in pieces ignored num_items_in_batch. The loss is the NLL summed over the labelled tokens, divided by
    num_items_in_batch or by their count (0 over none), on the graph of the logits."""
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama"), CCMConfig(lora_dropout=0.0)))
    inputs = _forward_inputs(model, path)
    ids = inputs["input_ids"][:, :length]
    labels = torch.full_like(ids, -100)
    for position in labelled:
        labels[0, position % length] = ids[0, position % length]
    extra = {} if items is None else {"num_items_in_batch": items}
    out = model(input_ids=ids, labels=labels, past_key_values=inputs["past_key_values"], **extra)
    targets = labels[0, 1:]
    count = int((targets != -100).sum())
    total = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), targets, reduction="sum")
    expected = total / (items if items is not None else max(count, 1))
    assert not out.loss.isnan()
    torch.testing.assert_close(out.loss, expected)
    assert out.loss.requires_grad == out.logits.requires_grad  # on the logits' graph, as a loss with labels is
    if count == 0:
        assert out.loss.item() == 0.0
