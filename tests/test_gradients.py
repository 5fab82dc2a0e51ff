"""Training optimises what inference runs: the parallel forward's loss has the gradients, with respect to every
trainable weight (LoRA A/B, `<COMP>` embeddings), of the same loss computed on the online path.

Equal logits at one point (test_parallel_forward, test_online) do not make equal gradients: a detach, a memory average
computed without a graph, or a position or mask that depends on the weights in one path only would train another
function than the one inference runs. The models run in float64, where both paths agree to float noise (the losses
are taken in float32 by transformers, and merge/EMA weights are float32 in both paths), far below the gradients
(1e-2 to 1e-1).
"""

import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

from ccm_reference import _cache_of, _run, lora_off, reference_memory
from test_online import pad
from tiny_models import _COMMON, VOCAB, randomize_adapter, tiny_base
from transformers_ccm import CCMConfig, CCMDataCollator, CCMForCausalLM, OnlineSample, StreamingConfig
from transformers_ccm.data import IGNORE_INDEX, predicting_positions
from transformers_ccm.distillation import distillation_loss
from transformers_ccm.stream_training import StreamCollator, stream_loss

GRADIENT_TOLERANCE = 1e-6
LOSS_TOLERANCE = 5e-6  # transformers takes the NLL in float32: a few float32 steps (5e-7) of a loss near 5

# `compress()` runs under torch.no_grad() (inference keeps no graph); its undecorated body is the same code, with one.
compress_with_graph = CCMForCausalLM.compress.__wrapped__

# Sliding layers with a window shorter than the segments (every layer for Mistral, one of two for Gemma 3).
_WINDOWED = {
    "mistral-window": lambda: MistralConfig(**_COMMON, sliding_window=4),
    "gemma3-window": lambda: Gemma3TextConfig(
        **_COMMON, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
}
ARCHITECTURES = ("llama", "qwen2", "gpt2", *_WINDOWED)


@functools.cache
def float64_ccm(architecture: str, **config: object) -> CCMForCausalLM:
    """A tiny CCM model in float64 with a random adapter and no dropout (tests must not change it)."""
    if architecture in _WINDOWED:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(_WINDOWED[architecture](), attn_implementation="sdpa").eval()
    else:
        base = tiny_base(architecture)
    model = CCMForCausalLM.from_base(base.to(torch.float64), CCMConfig(lora_dropout=0.0, **config))
    return randomize_adapter(model)


def trainable(model: CCMForCausalLM) -> dict[str, torch.nn.Parameter]:
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def gradients(model: CCMForCausalLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d every trainable weight (zeros where the loss does not reach it)."""
    weights = trainable(model)
    found = torch.autograd.grad(loss, list(weights.values()), allow_unused=True)
    return {
        name: torch.zeros_like(weight) if grad is None else grad
        for (name, weight), grad in zip(weights.items(), found, strict=True)
    }


def assert_same_gradients(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    tolerance: float = GRADIENT_TOLERANCE,
    nonzero: bool = True,
) -> None:
    """`actual` equals `expected` to `tolerance`, each weight's; with `nonzero`, they are not all (close to) zero."""
    assert actual.keys() == expected.keys()
    assert not nonzero or max(grad.abs().max() for grad in expected.values()) > 100 * tolerance
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], atol=tolerance, rtol=0, msg=name)


def assert_same_loss_gradients(
    model: CCMForCausalLM, loss: torch.Tensor, expected: torch.Tensor, tolerance: float = GRADIENT_TOLERANCE
) -> None:
    """`loss` has the gradients of `expected`, an online-path loss of random samples: all zero where no supervised
    token follows a context (a row with contexts but no output beside a row without contexts), and where no row has a
    context the online loss has no graph at all (no `<COMP>` ran)."""
    if not expected.requires_grad:
        assert all(grad.abs().max() == 0 for grad in gradients(model, loss).values())
        return
    assert_same_gradients(gradients(model, loss), gradients(model, expected), tolerance, nonzero=False)


class Prediction(NamedTuple):
    logits: torch.Tensor  # `(vocab,)`, with a graph
    target: int  # the token they predict
    row: int  # the sample's
    place: int  # of the predicting token in its sample's plain history (contexts, input, output)


def online_predictions(model: CCMForCausalLM, samples: list[OnlineSample], side: str, dense: bool) -> list[Prediction]:
    """The online path with a graph, one padded batch of users (`side`-padded): a prediction per supervised token, by
    sample. `dense`: a context c(j), j >= 2, is run as a turn on Mem(j-1) (its logits predict its next tokens) and then
    folded, as inference folds a turn; otherwise it is compressed."""
    predictions: dict[int, list[Prediction]] = {row: [] for row in range(len(samples))}

    def supervise(logits: torch.Tensor, mask: torch.Tensor, rows: list[list[int]], first: int, start: list[int]):
        for row, tokens in enumerate(rows):
            real = logits[row][mask[row].bool()]  # the row's tokens in order, whatever the padding side
            for k in range(first, len(tokens) - 1):
                predictions[row].append(Prediction(real[k], tokens[k + 1], row, start[row] + k))

    cache = model.new_cache(len(samples))
    start = [0] * len(samples)
    for step in range(max(len(sample.contexts) for sample in samples)):
        contexts = [list(s.contexts[step]) if step < len(s.contexts) else [] for s in samples]
        ids, mask = pad(contexts, side)
        if dense and step:
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
            supervise(logits, mask, contexts, 0, start)
            compress_with_graph(model, cache)
        else:
            compress_with_graph(model, cache, ids, attention_mask=mask)
        start = [offset + len(context) for offset, context in zip(start, contexts, strict=True)]
    ios = [[*s.input, *s.output] for s in samples]
    ids, mask = pad(ios, side)
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    for row, sample in enumerate(samples):  # the input's tokens predict nothing but the output's first
        io = ios[row]
        real = logits[row][mask[row].bool()]
        for k in range(len(sample.input) - 1, len(io) - 1):
            predictions[row].append(Prediction(real[k], io[k + 1], row, start[row] + k))
    return [prediction for row in range(len(samples)) for prediction in predictions[row]]


def nll(predictions: list[Prediction]) -> torch.Tensor:
    """The mean next-token NLL of `predictions` (at least one)."""
    return F.cross_entropy(torch.stack([p.logits for p in predictions]), torch.tensor([p.target for p in predictions]))


tokens = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6)
samples_strategy = st.lists(
    st.builds(
        OnlineSample,
        contexts=st.lists(tokens, min_size=0, max_size=4),
        input=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4),
        output=st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    architecture=st.sampled_from(ARCHITECTURES),
    update=st.sampled_from(["concat", "merge", "ema"]),
    n=st.integers(1, 3),
    samples=samples_strategy,
    supervision=st.sampled_from(["output", "dense"]),
    side=st.sampled_from(["left", "right"]),
    extra=st.sampled_from([None, 0, 1, 3]),
)
def test_parallel_loss_and_gradients_equal_the_online_path(architecture, update, n, samples, supervision, side, extra):
    # Concat memory only takes a cap (of at least one <COMP> block; its oldest slots are evicted, part of a block too).
    cap = None if extra is None or update != "concat" else n + extra
    model = float64_ccm(architecture, update=update, num_comp_tokens=n, ema_alpha=0.3, max_memory_tokens=cap)
    batch = CCMDataCollator(model, supervision=supervision)(samples)
    parallel = model(**batch).loss
    predictions = online_predictions(model, samples, side, dense=supervision == "dense")
    if not predictions:  # nothing to predict: a loss of 0 that trains nothing
        assert parallel == 0
        assert all(grad.abs().max() == 0 for grad in gradients(model, parallel).values())
        return
    online = nll(predictions)
    torch.testing.assert_close(parallel, online.to(parallel.dtype), atol=LOSS_TOLERANCE, rtol=0)
    assert_same_loss_gradients(model, parallel, online)


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
def test_parallel_gradients_equal_a_plain_step_by_step_reference(update):
    """Against `ccm_reference`, which uses none of the package's masks, positions, cache or memory code: the base model,
    PEFT's LoRA switched per forward, a DynamicCache holding the memory, with a graph throughout."""
    model = float64_ccm("llama", update=update, num_comp_tokens=2, ema_alpha=0.3)
    samples = [
        OnlineSample([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [20, 21], [30, 31, 32]),
        OnlineSample([[40]], [22], [33, 34]),
    ]
    parallel = model(**CCMDataCollator(model)(samples)).loss
    predictions = []
    for row, sample in enumerate(samples):
        memory, position = reference_memory(model, sample.contexts)
        with lora_off(model):
            logits = _run(model, _cache_of(model, memory), position, ids=[*sample.input, *sample.output])
        predictions += [
            Prediction(logits[len(sample.input) - 1 + k], token, row, position + len(sample.input) - 1 + k)
            for k, token in enumerate(sample.output)
        ]
    expected = nll(predictions)
    torch.testing.assert_close(parallel, expected.to(parallel.dtype), atol=LOSS_TOLERANCE, rtol=0)
    assert_same_gradients(gradients(model, parallel), gradients(model, expected))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    update=st.sampled_from(["concat", "merge", "ema"]),
    samples=samples_strategy,
    supervision=st.sampled_from(["output", "dense"]),
    temperature=st.sampled_from([1.0, 2.0]),
    at_labels=st.booleans(),
    conditional=st.booleans(),
)
def test_distillation_gradients_equal_an_explicit_kl_on_the_online_path(
    update, samples, supervision, temperature, at_labels, conditional
):
    """The student's gradient is that of KL(base model reading the plain history || online memory), written out at
    every supervised position; the teacher (the base model, adapter off, also for the unconditional ablation whose
    LoRA would read a plain prompt) gives none."""
    model = float64_ccm("llama", update=update, num_comp_tokens=2, ema_alpha=0.3, conditional_lora=conditional)
    batch = CCMDataCollator(model, supervision=supervision)(samples)
    positions = predicting_positions(batch["labels"]) if at_labels else None
    student = model(**batch, logits_at_labels=at_labels).logits
    loss = distillation_loss(model, batch, student, temperature, positions)
    predictions = online_predictions(model, samples, "right", dense=supervision == "dense")
    if not predictions:
        assert loss == 0
        return
    histories = [[t for c in s.contexts for t in c] + [*s.input, *s.output] for s in samples]
    with torch.no_grad(), model.adapter_disabled():  # the base model alone reads each plain history
        plain = [model.base_model(input_ids=torch.tensor([history])).logits[0] for history in histories]
    teacher = torch.stack([plain[p.row][p.place] for p in predictions])
    student_log = F.log_softmax(torch.stack([p.logits for p in predictions]) / temperature, dim=-1)
    teacher_log = F.log_softmax(teacher / temperature, dim=-1)
    expected = (teacher_log.exp() * (teacher_log - student_log)).sum() / len(predictions) * temperature**2
    # The KL is taken in float32 (`kl_to_teacher`), a sum of 97 terms then multiplied by temperature**2; its gradients
    # (1e-3 to 1e-1) are those of float32 softmaxes, exact to a few float32 steps of them.
    torch.testing.assert_close(loss, expected.to(loss.dtype), atol=1e-5, rtol=0)
    assert_same_loss_gradients(model, loss, expected, tolerance=1e-7)


def last_layer_query_and_output(model: CCMForCausalLM, name: str) -> bool:
    """Whether `name` is a LoRA weight of the last decoder layer's query or output projection."""
    last = model.base_model.config.num_hidden_layers - 1
    return f"layers.{last}.self_attn.q_proj." in name or f"layers.{last}.self_attn.o_proj." in name


@pytest.mark.parametrize("architecture", ["llama", "phi3"])
@pytest.mark.parametrize("supervision", ["output", "dense"])
def test_the_lora_learns_only_through_the_comp_positions(architecture, supervision):
    """The conditional LoRA acts at `<COMP>` positions only, whose keys/values are the memory and whose own outputs
    predict nothing: the last layer's query and output projections there change only those outputs, so their LoRA gets
    exactly no gradient (Phi-3: the query rows of its fused qkv projection), every other LoRA weight and every `<COMP>`
    embedding some, and the frozen base none. A batch without contexts trains nothing at all."""
    model = float64_ccm(architecture, update="merge", num_comp_tokens=2)
    samples = [OnlineSample([[5, 6, 7], [8, 9]], [20, 21], [30, 31]), OnlineSample([[40, 41]], [22], [33])]
    batch = CCMDataCollator(model, supervision=supervision)(samples)
    last = model.base_model.config.num_hidden_layers - 1
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            assert parameter.grad is None, name
        elif last_layer_query_and_output(model, name):
            assert parameter.grad.abs().max() == 0, name
        elif architecture == "phi3" and f"layers.{last}.self_attn.qkv_proj.lora_B" in name:
            queries = model.base_model.config.num_attention_heads * 8  # head_dim: hidden 32 / 4 heads
            assert parameter.grad[:queries].abs().max() == 0, name
            assert parameter.grad[queries:].abs().amax(dim=1).min() > 0, name
        else:
            assert parameter.grad.abs().amax(dim=-1).min() > 0, name  # every row of it (every <COMP> embedding)
    model.zero_grad(set_to_none=True)
    empty = CCMDataCollator(model, supervision=supervision)([OnlineSample([], [20, 21], [30, 31])])
    model(**empty).loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_an_unconditional_lora_learns_at_every_position():
    """The ablation's LoRA acts on the input and output tokens too: the last layer's query and output projections
    then get gradient (the contrast that keeps the test above from passing on a LoRA that never runs)."""
    model = float64_ccm("llama", update="merge", num_comp_tokens=2, conditional_lora=False)
    batch = CCMDataCollator(model)([OnlineSample([[5, 6, 7]], [20, 21], [30, 31])])
    found = gradients(model, model(**batch).loss)
    assert all(grad.abs().max() > 0 for name, grad in found.items() if last_layer_query_and_output(model, name))


def expected_labels(sample: OnlineSample, n: int, dense: bool) -> list[int]:
    """The labels of `sample`, written out: the output, and with dense supervision every context from the second on
    but its first token; nothing on the first context, the input, or a `<COMP>` position."""
    labels: list[int] = []
    for step, context in enumerate(sample.contexts):
        labels += [IGNORE_INDEX, *context[1:]] if dense and step else [IGNORE_INDEX] * len(context)
        labels += [IGNORE_INDEX] * n
    return labels + [IGNORE_INDEX] * len(sample.input) + list(sample.output)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy, supervision=st.sampled_from(["output", "dense"]), junk=st.integers(3, VOCAB - 1))
def test_padding_comp_ids_and_row_order_change_neither_loss_nor_gradients(samples, supervision, junk):
    model = float64_ccm("llama", update="ema", num_comp_tokens=2, ema_alpha=0.3)
    dense = supervision == "dense"
    batch = CCMDataCollator(model, supervision=supervision)(samples)
    for row, sample in enumerate(samples):
        labels = expected_labels(sample, 2, dense)
        assert batch["labels"][row].tolist() == labels + [IGNORE_INDEX] * (batch["labels"].shape[1] - len(labels))
    output = model(**batch)
    if not (batch["labels"] != IGNORE_INDEX).any():
        return
    expected = gradients(model, output.loss)
    # Other ids at padding and <COMP> positions, and more padding: the same loss and gradients.
    other = CCMDataCollator(model, supervision=supervision, pad_token_id=junk, pad_to_multiple_of=8)(samples)
    loss = model(**other).loss
    torch.testing.assert_close(loss, output.loss, atol=LOSS_TOLERANCE, rtol=0)
    for name, grad in gradients(model, loss).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-12, rtol=0, msg=name)
    # The rows in reverse order: each row's logits move with it, the loss and gradients (sums) stay.
    reversed_batch = CCMDataCollator(model, supervision=supervision)(samples[::-1])
    reversed_output = model(**reversed_batch)
    torch.testing.assert_close(reversed_output.logits, output.logits.flip(0), atol=1e-12, rtol=0)
    torch.testing.assert_close(reversed_output.loss, output.loss, atol=LOSS_TOLERANCE, rtol=0)
    for name, grad in gradients(model, reversed_output.loss).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_changes_no_gradient(reentrant):
    """In training mode, LoRA dropout on: the recomputation during backward gates the LoRA (a LoRA on the MLP too,
    which reentrant checkpointing refuses) and draws the dropout as the forward did."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", *([] if reentrant else ["up_proj"])]
    config = CCMConfig(update="merge", num_comp_tokens=2, lora_dropout=0.2, target_modules=targets)
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama").to(torch.float64), config)).train()
    batch = CCMDataCollator(model, supervision="dense")(
        [OnlineSample([[5, 6, 7], [8, 9, 10]], [20, 21], [30, 31]), OnlineSample([[40, 41]], [22], [33])]
    )
    torch.manual_seed(0)
    expected = backward_gradients(model, batch)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    torch.manual_seed(0)
    found = backward_gradients(model, batch)  # reentrant checkpointing takes no torch.autograd.grad
    assert_same_gradients(found, expected, tolerance=1e-12)


def backward_gradients(model: CCMForCausalLM, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients `loss.backward()` leaves on the trainable weights of `model` for the loss of `batch`."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    found = {name: weight.grad for name, weight in trainable(model).items()}
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("update", ["concat", "merge", "ema"])
@pytest.mark.parametrize("keep_window_full", [True, False])
def test_stream_loss_gradients_are_its_derivative_through_every_compression(update, keep_window_full):
    """Training on streams runs the streaming cache itself, with a graph through each compression of the stretch
    (every later piece reads the memory they made): the gradient along a random direction of all trainable weights
    is the loss's central difference along it. A graph cut anywhere (a memory moved, averaged or evicted without one)
    would leave out that compression's part of it."""
    config = CCMConfig(update=update, num_comp_tokens=2, ema_alpha=0.3, lora_dropout=0.0)
    model = randomize_adapter(CCMForCausalLM.from_base(tiny_base("llama").to(torch.float64), config))
    streaming = StreamingConfig(window_tokens=8, sink_tokens=2, compress_chunk=4, keep_window_full=keep_window_full)
    streams = torch.randint(3, VOCAB, (2, 36), generator=torch.Generator().manual_seed(0)).tolist()
    batch = StreamCollator(streaming)(streams)
    weights = list(trainable(model).values())
    generator = torch.Generator().manual_seed(1)
    direction = [torch.randn(weight.shape, generator=generator, dtype=weight.dtype) for weight in weights]
    found = torch.autograd.grad(stream_loss(model, batch, streaming, piece=3), weights, allow_unused=True)
    along = sum(float((grad * step).sum()) for grad, step in zip(found, direction, strict=True) if grad is not None)
    kept = [weight.detach().clone() for weight in weights]
    losses = []
    eps = 1e-3  # the loss is taken in float32: a smaller step would measure its rounding
    with torch.no_grad():
        for sign in (1, -1):
            for weight, start, step in zip(weights, kept, direction, strict=True):
                weight.copy_(start + sign * eps * step)
            losses.append(float(stream_loss(model, batch, streaming, piece=3)))
    norm = sum(float(grad.square().sum()) for grad in found if grad is not None) ** 0.5
    # `along` is a draw of N(0, norm**2): the difference is measured against that spread, not against its value. It is
    # 1e-3 of it (the step's curvature, the float32 loss); a compression's part cut off the graph misses by half of it.
    assert abs(along - (losses[0] - losses[1]) / (2 * eps)) <= 1e-2 * norm
