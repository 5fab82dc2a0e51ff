"""Evaluation statistics (intervals, gain recovered, seen and unseen wordings) on real scoring of tiny models."""

import copy
import io
import json
import math
import random
import re
import runpy
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from tiny_models import randomize_adapter, tiny_llama_for
from transformers_ccm import CCMConfig, CCMForCausalLM, OnlineSample, StreamingConfig
from transformers_ccm.cli import _samples_digest
from transformers_ccm.evaluation import (
    BOOTSTRAP_RESAMPLES,
    FINETUNED,
    MethodScore,
    _resample_blocks,
    difference_interval,
    difference_text,
    gain_recovered,
    gain_recovered_interval,
    gain_text,
    kv_bytes_per_token,
    markdown,
    memory_slot_bytes,
    paired_difference,
    plot,
    report_json,
    score_samples,
    summarize,
    value_interval,
    wilson_interval,
)
from transformers_ccm.tasks import METRIC, make_samples


def _resamples(count: int, seed: int = 0) -> torch.Tensor:
    """`(BOOTSTRAP_RESAMPLES, count)`: every resample the bootstrap draws, at once."""
    return torch.cat(list(_resample_blocks(count, seed)))


def _model(tokenizer, seed: int, **config) -> CCMForCausalLM:
    base = tiny_llama_for(tokenizer)  # the same base for every adapter
    model = CCMForCausalLM.from_base(base, CCMConfig(**config))
    return randomize_adapter(model, seed=seed)


@pytest.fixture(scope="module")
def ccm(tokenizer):
    return _model(tokenizer, seed=1, num_comp_tokens=1)


def test_wilson_interval_known_values_and_bounds():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    with pytest.raises(ValueError, match="at least one sample"):
        wilson_interval(0, 0)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 5000), data=st.data())
def test_wilson_interval_matches_the_roots_of_its_quadratic(total, data):
    """Wilson's interval is where `(share - p)^2 <= z^2 p (1 - p) / total`: the roots of a quadratic in p, computed
    here apart, at any (also fractional) credit; it holds the share itself, exactly 0 at none and 1 at all right
    (rounding gave 0.9999999999999999 above a share of 1, and 8.7e-19 below a share of 0)."""
    correct = data.draw(st.one_of(st.sampled_from([0, total]), st.integers(0, total), st.floats(0, total)))
    z = NormalDist().inv_cdf(0.975)
    share, a = correct / total, 1 + z * z / total
    b = 2 * share + z * z / total
    root = math.sqrt(b * b - 4 * a * share * share)
    low, high = wilson_interval(correct, total)
    assert (low, high) == pytest.approx(((b - root) / (2 * a), (b + root) / (2 * a)), abs=1e-12)
    assert 0 <= low <= share <= high <= 1
    assert (low == 0 or correct > 0) and (high == 1 or correct < total)


@pytest.mark.parametrize("share", [0.1, 0.5, 0.83])
def test_wilson_interval_contains_the_share_and_shrinks_with_n(share):
    widths = []
    for total in (20, 200, 2000):
        low, high = wilson_interval(round(share * total), total)
        assert low <= round(share * total) / total <= high
        widths.append(high - low)
    assert widths[0] > 2 * widths[1] > 4 * widths[2]  # about 1 / sqrt(n)


def _perplexity_scores(count: int, seed: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    scores = []
    for _ in range(count):
        tokens = rng.randint(3, 12)
        scores.append((sum(rng.expovariate(0.5) for _ in range(tokens)), tokens))
    return scores


def test_perplexity_bootstrap_contains_the_value_and_shrinks_with_n():
    widths = []
    for count in (25, 400):
        scores = _perplexity_scores(count, seed=count)
        value = math.exp(sum(n for n, _ in scores) / sum(t for _, t in scores))
        low, high = value_interval(scores, "perplexity")
        assert low < value < high
        widths.append(high - low)
        assert value_interval(scores, "perplexity") == (low, high)  # deterministic
    assert widths[0] > 2.5 * widths[1]


def test_gain_recovered_interval_is_paired():
    """CCM halfway between no and full context on every sample: the interval is tight around 50%."""
    rng = random.Random(0)
    no = [(rng.uniform(2, 4) * 5, 5) for _ in range(60)]
    full = [(n - 5 * rng.uniform(0.5, 1.5), t) for n, t in no]
    half = [((a + b) / 2, t) for (a, t), (b, _) in zip(no, full, strict=True)]
    low, high = gain_recovered_interval(no, full, half, "perplexity")
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    noisy = [(n + rng.uniform(-3, 3), t) for n, t in half]
    value = gain_recovered(
        *(math.exp(sum(n for n, _ in s) / sum(t for _, t in s)) for s in (no, full, noisy)), "perplexity"
    )
    low, high = gain_recovered_interval(no, full, noisy, "perplexity")
    assert low < value < high and high - low < 0.5
    with pytest.raises(ValueError, match="same samples"):
        gain_recovered_interval(no, full, noisy[:-1], "perplexity")


def test_difference_interval_is_paired():
    """A second adapter a fixed 0.1 nats per token better on every sample: tight around 0.1, though the samples
    themselves vary far more than that; the same scores differ by exactly 0."""
    rng = random.Random(0)
    first = [(rng.uniform(1, 5) * 8, 8) for _ in range(50)]
    better = [(nll - 0.1 * tokens, tokens) for nll, tokens in first]
    low, high = difference_interval(first, better, "perplexity")
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)
    assert difference_interval(first, first, "perplexity") == (0.0, 0.0)
    noisy = [(nll + rng.uniform(-4, 4), tokens) for nll, tokens in better]
    low, high = difference_interval(first, noisy, "perplexity")
    point = (sum(n for n, _ in first) - sum(n for n, _ in noisy)) / sum(t for _, t in first)
    assert low < point < high and high - low < 0.3
    right, wrong = [(1.0, 1)] * 30 + [(0.0, 1)] * 10, [(0.0, 1)] * 40
    low, high = difference_interval(wrong, right, "accuracy")
    assert 0 < low <= 0.75 <= high < 1
    text = difference_text({"method": "ccm-merge:old", "value": 0.1, "interval": [0.05, 0.15]}, "perplexity")
    assert text == "x0.90 [0.86, 0.95] perplexity vs ccm-merge:old" and difference_text(None, "accuracy") == "-"
    with pytest.raises(ValueError, match="same samples"):
        difference_interval(first, better[:-1], "perplexity")


def _percentiles(statistic: np.ndarray) -> tuple[float, float]:
    return tuple(np.percentile(statistic, [2.5, 97.5]).tolist())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        # NLLs in steps of 2^-10 nats: every sum is exact, in any order, so that numpy and torch see the same ties
        st.tuples(*[st.integers(0, 30 * 1024).map(lambda nll: nll / 1024)] * 3, st.integers(1, 9)),
        min_size=1,
        max_size=40,
    ),
    share=st.floats(-2, 2),
)
def test_bootstrap_intervals_match_a_numpy_reference(rows, share):
    """Perplexity, gain recovered and paired differences, recomputed per resample in numpy (token-weighted: total
    NLL over total tokens) on `ccm eval`'s resamples, and their percentiles; CCM a fixed share of the way from no to
    full context on every sample (negative: below no context) recovers exactly that share in every resample."""
    no, full, ccm = ([(row[column], row[3]) for row in rows] for column in range(3))
    table = {name: np.array(scores) for name, scores in (("no", no), ("full", full), ("ccm", ccm))}

    def log_score(name: str, index: np.ndarray) -> np.ndarray:  # minus the log-perplexity of each resample
        return -table[name][index, 0].sum(-1) / table[name][index, 1].sum(-1)

    everything = np.arange(len(rows))
    value = math.exp(-log_score("ccm", everything))
    assert value == pytest.approx(math.exp(sum(n for n, _ in ccm) / sum(t for _, t in ccm)))
    low, high = value_interval(ccm, "perplexity")
    assert (low, high) == pytest.approx(np.exp(_percentiles(-log_score("ccm", _resamples(len(rows)).numpy()))))
    index = _resamples(len(rows), seed=2).numpy()
    assert difference_interval(no, ccm, "perplexity") == pytest.approx(
        _percentiles(log_score("ccm", index) - log_score("no", index)), abs=1e-12
    )
    index = _resamples(len(rows), seed=1).numpy()
    gain = log_score("full", index) - log_score("no", index)
    beats = log_score("full", everything) > log_score("no", everything)
    # no interval where full context gains nothing on the samples, or in most resamples
    measured = beats and (gain > 0).sum() >= BOOTSTRAP_RESAMPLES // 2
    expected = (float("nan"),) * 2
    if measured:
        expected = _percentiles((log_score("ccm", index) - log_score("no", index))[gain > 0] / gain[gain > 0])
    assert gain_recovered_interval(no, full, ccm, "perplexity") == pytest.approx(expected, nan_ok=True)
    between = [(a + share * (b - a), t) for (a, t), (b, _) in zip(no, full, strict=True)]
    low, high = gain_recovered_interval(no, full, between, "perplexity")
    assert measured == (not math.isnan(low))
    if measured:
        assert low == pytest.approx(share, abs=1e-9) and high == pytest.approx(share, abs=1e-9)
    values = [math.exp(-log_score(name, everything)) for name in ("no", "full")]
    values.append(math.exp(sum(n for n, _ in between) / sum(t for _, t in between)))
    if beats:
        # the values are perplexities: their logarithms come back within rounding, which the gain divides
        whole = log_score("full", everything) - log_score("no", everything)
        assert gain_recovered(*values, "perplexity") == pytest.approx(share, abs=1e-12 / whole)
    else:  # full context gains nothing over no context: nothing to recover
        assert math.isnan(gain_recovered(*values, "perplexity"))


def _pooled_pair(*arguments: str) -> subprocess.CompletedProcess:
    """The script run as `python pooled_pair.py ARGUMENTS` would run it, in this process (a new one spent seconds
    importing torch): its exit status, output and error output."""
    script = str(Path(__file__).parents[1] / "docs" / "results" / "scripts" / "pooled_pair.py")
    output, error = io.StringIO(), io.StringIO()
    status = 0
    with patch.object(sys, "argv", [script, *arguments]), redirect_stdout(output), redirect_stderr(error):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:  # sys.exit(message) writes the message and ends with status 1, as Python does
            status = 1 if isinstance(stop.code, str) else int(stop.code or 0)
            print(stop.code if isinstance(stop.code, str) else "", file=sys.stderr, end="")
    return subprocess.CompletedProcess([script, *arguments], status, output.getvalue(), error.getvalue())


def test_pooled_pair_pairs_each_sample_set_whatever_the_order_of_its_rows(tmp_path):
    """docs/results/scripts/pooled_pair.py: an adapter's rows written in another order of sample sets (one added
    with --add-to after a report of two wording sets, say) were concatenated as they came, pairing the samples of
    one set with those of another."""
    rng = random.Random(0)
    scores = {}
    for wordings in ("seen", "unseen"):
        first = [(rng.uniform(5, 40), rng.randint(4, 12)) for _ in range(30)]
        scores[wordings] = first, [(nll - 0.2 * tokens + rng.uniform(-1, 1), tokens) for nll, tokens in first]

    def row(wordings: str, method: str, metric: str = "perplexity") -> dict:
        per_sample = scores[wordings][method == "ccm-concat:b"]
        return dict(task="dialogue", wordings=wordings, steps=4, method=method, metric=metric, samples=30) | {
            "per_sample": per_sample
        }

    rows = [row("seen", "ccm-concat:a"), row("unseen", "ccm-concat:a")]
    rows += [row("unseen", "ccm-concat:b"), row("seen", "ccm-concat:b")]
    (tmp_path / "eval.json").write_text(json.dumps({"results": rows}))
    first, second = ([*scores["seen"][side], *scores["unseen"][side]] for side in (0, 1))
    expected = paired_difference({"method": "ccm-concat:a", "per_sample": first}, {**rows[-1], "per_sample": second})
    run = _pooled_pair("a", "b", str(tmp_path / "eval.json"))
    assert run.stdout == f"60 samples: {difference_text(expected, 'perplexity')}\n"
    mixed = [rows[0], rows[-1], row("unseen", "ccm-concat:a", "accuracy"), row("unseen", "ccm-concat:b", "accuracy")]
    (tmp_path / "mixed.json").write_text(json.dumps({"results": mixed}))
    run = _pooled_pair("a", "b", str(tmp_path / "mixed.json"))
    assert run.returncode == 1 and "is scored by accuracy, not perplexity; pool one metric" in run.stderr
    (tmp_path / "one.json").write_text(json.dumps({"results": rows[:3]}))
    run = _pooled_pair("a", "b", str(tmp_path / "one.json"))
    assert run.returncode == 1 and "were not scored on the same sample sets" in run.stderr


def test_no_gain_to_recover_gives_no_interval():
    no = [(1.0, 1)] * 10 + [(0.0, 1)] * 10
    full = no[::-1]  # other samples right, the same accuracy
    assert math.isnan(gain_recovered(0.5, 0.5, 0.6, "accuracy"))
    assert all(math.isnan(bound) for bound in gain_recovered_interval(no, full, no, "accuracy"))
    no_gain = "n/a (full context does not beat no context: no gain to recover)"
    assert gain_text({"value": float("nan"), "interval": [0.2, 0.4]}) == no_gain
    assert gain_text({"value": None, "interval": [None, None]}) == no_gain  # as eval.json stores it
    assert gain_text({"value": 0.25, "interval": [0.1, 0.4]}) == "25% [10%, 40%]" and gain_text(None) == "-"


def test_a_full_context_loss_is_no_gain_to_recover():
    """Full context below no context: CCM further below read as a positive share of the "gain" (here 50%)."""
    assert math.isnan(gain_recovered(0.5, 0.4, 0.45, "accuracy"))
    assert math.isnan(gain_recovered(10.0, 12.0, 11.0, "perplexity"))
    no = [(1.0, 1)] * 10 + [(0.0, 1)] * 10
    worse = no[2:] + [(0.0, 1)] * 2
    assert all(math.isnan(bound) for bound in gain_recovered_interval(no, worse, no, "accuracy"))


def test_a_gain_without_an_interval_prints_no_nan():
    """Full context beats no context on the samples but in under half of the resamples (`gain_recovered_interval`
    gives NaN, eval.json null): the interval printed as "[nan%, nan%]"."""
    expected = "30% [no interval: full context beats no context in under half the resamples]"
    assert gain_text({"value": 0.3, "interval": [float("nan"), float("nan")]}) == expected
    assert gain_text({"value": 0.3, "interval": [None, None]}) == expected


@pytest.fixture(scope="module")
def indifferent(tokenizer) -> CCMForCausalLM:
    """An adapter whose base model gives every token the same probability (a zero LM head): it scores every
    choice alike, under every method."""
    model = _model(tokenizer, seed=1, num_comp_tokens=1)
    with torch.no_grad():
        model.base_model.get_output_embeddings().weight.zero_()
    return model


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    answer=st.integers(0, 3),
    method=st.sampled_from(["no_context", "full_context", "ccm"]),
)
def test_choices_tied_for_the_best_score_share_the_credit(indifferent, tokenizer, lengths, answer, method):
    """A tie went to the first choice: a model that knows nothing scored 100% wherever the answer was listed first
    (and 0% elsewhere). Tied choices share the credit, as a random pick among them would: 1/k of k."""
    choices = [[10 + index] * length for index, length in enumerate(lengths)]
    answer %= len(choices)
    samples = [OnlineSample([[5, 6], [7]], [8], choices[answer], choices=choices)] * 2
    score = score_samples(indifferent, tokenizer, samples, method, "accuracy")
    assert score.per_sample == [(1 / len(choices), 1)] * 2
    assert score.value == pytest.approx(1 / len(choices))
    assert (score.low, score.high) == pytest.approx(wilson_interval(2 / len(choices), 2))


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_a_choice_listed_twice_is_refused(ccm, tokenizer, method):
    """Its copies always tie: the answer listed twice earned half credit when it won."""
    twice = OnlineSample([[5, 6]], [7], [8, 9], choices=[[8, 9], [10], [8, 9]])
    with pytest.raises(ValueError, match=r"samples\[1\] lists the choice \[8, 9\] \(token ids\) more than once"):
        score_samples(ccm, tokenizer, [OnlineSample([[5]], [7], [8], choices=[[8], [9]]), twice], method, "accuracy")


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_samples_of_ids_score_without_a_tokenizer_and_text_without_one_names_score_samples(ccm, tokenizer, method):
    """Token ids need no tokenizer; text without one named `CCMDataCollator`'s fix, which score_samples never takes."""
    ids = [OnlineSample([[5, 6], [7]], [7], [8], choices=[[8], [9]])]
    assert score_samples(ccm, None, ids, method, "accuracy") == score_samples(ccm, tokenizer, ids, method, "accuracy")
    texts = {"contexts[0]": OnlineSample(["a"], [7], [8], [[8], [9]]), "input": replace(ids[0], input="b")}
    for where, text in texts.items():
        with pytest.raises(ValueError, match=rf"samples\[0\]\.{re.escape(where)} is a string; give score_samples a "):
            score_samples(ccm, None, [text], method, "accuracy")


def test_an_unknown_metric_is_refused(ccm, tokenizer):
    """It was scored as perplexity and reported under its own name ("acc": 1.7)."""
    with pytest.raises(ValueError, match=r"metric must be one of \('accuracy', 'perplexity'\), got 'acc'"):
        score_samples(ccm, tokenizer, [OnlineSample([[5]], [7], [8], choices=[[8], [9]])], "ccm", "acc")


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_a_batch_size_that_is_no_positive_integer_is_refused(ccm, tokenizer, batch_size):
    """-1 ran no batch and scored every sample 0 of 0 (perplexity NaN, accuracy 0); 0 and 2.5 failed inside range()."""
    with pytest.raises(ValueError, match=rf"batch_size must be a positive integer .*got {batch_size!r}"):
        score_samples(ccm, tokenizer, [OnlineSample([[5]], [7], [8])], "ccm", "perplexity", batch_size=batch_size)


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_contexts_or_choices_without_their_list_are_refused(ccm, tokenizer, method):
    """One string as the contexts (or the choices) was read as one context (or choice) per character."""
    good = OnlineSample(["Ann likes tea."], "Ann likes", "a", choices=["a", "b"])
    for bad, field in (
        (OnlineSample("Ann likes tea.", "Ann likes", "a", choices=["a", "b"]), "contexts"),
        (OnlineSample(["Ann likes tea."], "Ann likes", "a", choices="ab"), "choices"),
    ):
        with pytest.raises(ValueError, match=rf"samples\[1\].{field} is a single str; give a list"):
            score_samples(ccm, tokenizer, [good, bad], method, "accuracy")
    with pytest.raises(TypeError, match=r"samples\[0\] is a dict, not an OnlineSample"):
        score_samples(ccm, tokenizer, [{"contexts": [], "input": "a", "output": "b"}], method, "perplexity")


@pytest.mark.parametrize("task", ["icl", "dialogue"])
def test_scores_carry_intervals_and_per_sample_values(ccm, tokenizer, task):
    samples = make_samples(task, "test", 12, seed=0, steps=2)
    metric = METRIC[task]
    for method in ("no_context", "full_context", "ccm"):
        score = score_samples(ccm, tokenizer, samples, method, metric, batch_size=5)
        assert score.samples == len(score.per_sample) == 12
        assert score.low <= score.value <= score.high
        total = sum(n for n, _ in score.per_sample) / sum(t for _, t in score.per_sample)
        assert score.value == pytest.approx(total if metric == "accuracy" else math.exp(total))
        assert score.to_dict()["per_sample"] == score.per_sample


@pytest.mark.parametrize("method", ["full_context", "ccm"])
def test_per_sample_values_follow_the_order_given(ccm, tokenizer, method):
    """Samples are scored in batches of similar length; each value still lands at its sample's place."""
    samples = make_samples("dialogue", "test", 9, seed=2, steps=2)
    forward = score_samples(ccm, tokenizer, samples, method, "perplexity", batch_size=4).per_sample
    backward = score_samples(ccm, tokenizer, samples[::-1], method, "perplexity", batch_size=4).per_sample
    alone = [score_samples(ccm, tokenizer, [sample], method, "perplexity").per_sample[0] for sample in samples]
    assert len({tokens for _, tokens in alone}) > 1  # samples that tell apart a misplaced value
    for values in (forward, backward[::-1]):
        assert [tokens for _, tokens in values] == [tokens for _, tokens in alone]
        assert [nll for nll, _ in values] == pytest.approx([nll for nll, _ in alone], rel=1e-4)


def test_samples_with_different_numbers_of_choices_score_as_they_do_alone(ccm, tokenizer):
    """A batch may mix samples with 2, 3 and 4 choices (grouping, or a JSONL file): each scores as alone."""
    samples = make_samples("grouping", "test", 8, seed=0, steps=2)
    assert len({len(s.choices) for s in samples}) >= 2
    for method in ("no_context", "full_context", "ccm"):
        together = score_samples(ccm, tokenizer, samples, method, "accuracy", batch_size=8).per_sample
        alone = score_samples(ccm, tokenizer, samples, method, "accuracy", batch_size=1).per_sample
        assert together == alone


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_ids_outside_the_vocabulary_are_refused_naming_the_sample(ccm, tokenizer, method):
    """A JSONL file of ids for another tokenizer: the plain-prompt methods failed with torch's IndexError."""
    vocabulary = ccm.vocabulary_size
    good = OnlineSample([[5, 6]], [7], [8], choices=[[8], [9]])
    for bad, where in (
        (OnlineSample([[5, vocabulary]], [7], [8], choices=[[8], [9]]), r"samples\[1\].contexts\[0\]"),
        (OnlineSample([[5, 6]], [7], [8], choices=[[8], [vocabulary]]), r"samples\[1\].output or choices"),
    ):
        with pytest.raises(ValueError, match=rf"{where} holds the token id {vocabulary}, outside"):
            score_samples(ccm, tokenizer, [good, bad], method, "accuracy")


def test_full_context_reads_plain_text_with_the_adapter_only_when_unconditional(tokenizer):
    samples = make_samples("dialogue", "test", 6, seed=1, steps=2)

    def full_context(model):
        return score_samples(model, tokenizer, samples, "full_context", "perplexity").per_sample

    # a compression adapter never acts on plain tokens: its full-context score is the base model's
    assert full_context(_model(tokenizer, seed=1)) == full_context(_model(tokenizer, seed=2))
    tuned, other = _model(tokenizer, seed=1, conditional_lora=False), _model(tokenizer, seed=2, conditional_lora=False)
    assert full_context(tuned) != full_context(other) != full_context(_model(tokenizer, seed=1))


def test_summary_reports_seen_and_unseen_wordings_against_both_baselines(ccm, tokenizer, tmp_path):
    tuned = _model(tokenizer, seed=3, conditional_lora=False)
    other = _model(tokenizer, seed=4, num_comp_tokens=1)
    results = []
    for wordings in ("seen", "unseen"):
        for steps in (1, 2):
            samples = make_samples("personalization", "test", 10, seed=0, steps=steps, wordings=wordings)
            for name, model, method in (
                ("no_context", ccm, "no_context"),
                ("full_context", ccm, "full_context"),
                (FINETUNED, tuned, "full_context"),
                ("ccm-concat:b", other, "ccm"),  # scored first: the one the other is compared with
                ("ccm-concat:a", ccm, "ccm"),
            ):
                score = score_samples(model, tokenizer, samples, method, "accuracy")
                results.append({"task": "personalization", "wordings": wordings, **score.to_dict(), "method": name})
    summary = summarize(results)
    assert [(row["wordings"], row["steps"], row["method"]) for row in summary] == [
        ("seen", 2, "ccm-concat:a"),
        ("seen", 2, "ccm-concat:b"),
        ("unseen", 2, "ccm-concat:a"),
        ("unseen", 2, "ccm-concat:b"),
    ]
    for row in summary:
        if row["method"] == "ccm-concat:b":
            assert row["versus_first"] is None
            continue
        versus = row["versus_first"]
        assert versus["method"] == "ccm-concat:b" and versus["interval"][0] <= versus["value"] <= versus["interval"][1]
        first = next(r for r in summary if r["wordings"] == row["wordings"] and r["method"] == "ccm-concat:b")
        assert versus["value"] == pytest.approx(row["ccm"] - first["ccm"])
    for row in summary:
        assert row["ccm_interval"][0] <= row["ccm"] <= row["ccm_interval"][1]
        assert row[FINETUNED] is not None and set(row["gain_recovered_finetuned"]) == {"value", "interval"}
        assert set(row["gain_recovered"]) == {"value", "interval"} and len(row["gain_recovered"]["interval"]) == 2
    # The report is the rows as they are, but strict JSON: null where a value is not a number.
    written = json.loads(report_json(results, summary), parse_constant=pytest.fail)
    assert written == json.loads(json.dumps({"results": results, "summary": summary}), parse_constant=lambda _: None)
    no_gain = [{**summary[0], "gain_recovered": {"value": float("nan"), "interval": [float("nan"), float("inf")]}}]
    strict = json.loads(report_json(results, no_gain), parse_constant=pytest.fail)
    assert strict["summary"][0]["gain_recovered"] == {"value": None, "interval": [None, None]}
    table = markdown(results, summary)
    assert "| personalization (t=2) | seen | ccm-concat:a |" in table
    assert "| personalization (t=2) | unseen | ccm-concat:b |" in table
    assert "accuracy vs ccm-concat:b |" in table
    assert "| personalization | unseen | 1 | full_context_finetuned | accuracy |" in table
    plot(results, str(tmp_path / "eval.png"))
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    without_tuned = summarize([r for r in results if r["method"] != FINETUNED])
    assert all(row[FINETUNED] is None and row["gain_recovered_finetuned"] is None for row in without_tuned)
    assert "| - | " in markdown(results, without_tuned)


@settings(max_examples=6, deadline=None)
@given(
    update=st.sampled_from(["concat", "merge"]),
    batch_size=st.integers(1, 5),
    method=st.sampled_from(["no_context", "full_context", "ccm"]),
)
def test_peak_kv_is_the_most_any_forward_held(tokenizer, update, batch_size, method):
    """The peak KV a method reports is the longest key/value length any forward of a sample left in its cache,
    measured on the cache of each sample scored alone: for CCM the compression of a long context (memory, context
    and <COMP> block at once) was left out, and a dialogue's peak read 33 slots where 50 were held."""
    model = _model(tokenizer, seed=1, num_comp_tokens=2, update=update)
    samples = make_samples("dialogue", "test", 5, seed=0, steps=3)
    held: list[int] = []
    hook = model.base_model.register_forward_hook(
        lambda _, __, out: held.append(out.past_key_values.layers[0].keys.shape[-2])
    )
    alone = []
    for sample in samples:
        held.clear()
        score_samples(model, tokenizer, [sample], method, "perplexity")
        alone.append(max(held))
    hook.remove()
    score = score_samples(model, tokenizer, samples, method, "perplexity", batch_size=batch_size)
    assert score.peak_kv_tokens == max(alone)
    assert score.peak_kv_bytes == max(alone) * kv_bytes_per_token(model)


@settings(max_examples=8, deadline=None)
@given(
    update=st.sampled_from(["concat", "merge", "ema"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    batch_size=st.integers(1, 5),
)
def test_peak_kv_bytes_are_the_most_any_forward_held(tokenizer, update, dtype, batch_size):
    """Peak bytes were the peak slots times the bytes of a token's keys and values: merge and EMA memory in bfloat16
    also holds its float32 running average (`memory_bytes()` counts it), which was left out."""
    model = _model(tokenizer, seed=1, num_comp_tokens=2, update=update).to(dtype)
    samples = make_samples("dialogue", "test", 5, seed=0, steps=3)
    held: list[int] = []

    def measure(_, __, out):
        tensors = []
        for layer in out.past_key_values.layers:
            tensors += [layer.keys, layer.values]
            average = getattr(layer, "accumulated", None)
            if average is not None and average[0].dtype != layer.keys.dtype:  # not the memory itself
                tensors += average
        held.append(sum(tensor.nbytes for tensor in tensors))

    hook = model.base_model.register_forward_hook(measure)
    alone = []
    for sample in samples:
        held.clear()
        score_samples(model, tokenizer, [sample], "ccm", "perplexity")
        alone.append(max(held))
    hook.remove()
    assert score_samples(model, tokenizer, samples, "ccm", "perplexity", batch_size).peak_kv_bytes == max(alone)
    cache = model.new_cache(1)
    model.compress(cache, torch.tensor([[5, 6, 7]]))
    assert cache.memory_bytes() == cache.memory_length * memory_slot_bytes(model)


def test_plots_leave_matplotlib_as_the_caller_set_it(tmp_path):
    """`plot` and `plot_stream` switched the process's matplotlib backend to Agg: a notebook's or an interactive
    window's `plt.show()` showed nothing afterwards. They draw without pyplot, whose figures stay the caller's."""
    import matplotlib
    import matplotlib.pyplot as plt

    from transformers_ccm.stream_evaluation import StreamResult, plot_stream

    backend = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        own = plt.figure()
        rows = [
            {"task": "icl", "method": method, "wordings": "seen", "steps": steps, "metric": "accuracy", "value": 0.5,
             "low": 0.4, "high": 0.6, "context_kv_tokens": float(steps)}
            for method in ("ccm-concat", "full_context") for steps in (1, 2)
        ]  # fmt: skip
        plot(rows, str(tmp_path / "eval.png"))
        streaming = StreamingConfig(sink_tokens=2, window_tokens=8, compress_chunk=4, max_memory_tokens=4)
        streamed = StreamResult("ccm", streaming, 14, [1.0, 2.0, 1.5, 0.5], [3, 6, 8], 2)
        plot_stream([streamed], 2, str(tmp_path / "stream.png"))
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [own.number] and plt.gcf() is own
    finally:
        plt.close("all")
        matplotlib.use(backend)
    for name in ("eval.png", "stream.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name


@pytest.mark.parametrize("cast", ["model", "base model"])
def test_kv_bytes_per_token_are_those_a_forward_keeps(tokenizer, cast):
    """The bytes one token's keys and values take, measured on the cache of a forward: with the base model cast
    to bfloat16 alone (the <COMP> embeddings stay float32, and are cast at each use), they were counted twice over."""
    model = _model(tokenizer, seed=1)
    (model if cast == "model" else model.base_model).to(torch.bfloat16)
    with torch.no_grad():
        cache = model.base_model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
    kept = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_bytes_per_token(model) * 3 == kept


def test_summary_refuses_rows_of_other_samples(ccm, tokenizer):
    """Gain recovered and paired differences pair the rows of a sample set sample by sample: a row of other samples
    (of the same count, from another report joined by hand) was paired all the same, as was a row twice."""
    drawn = [make_samples("icl", "test", 6, seed=seed, steps=1) for seed in (0, 1)]

    def row(method: str, name: str, samples: list, metric: str = "accuracy") -> dict:
        score = score_samples(ccm, tokenizer, samples, method, metric).to_dict()
        return {"task": "icl", "wordings": "seen", **score, "method": name, "samples_digest": _samples_digest(samples)}

    baselines = [row("no_context", "no_context", drawn[0]), row("full_context", "full_context", drawn[0])]
    assert len(summarize([*baselines, row("ccm", "ccm-concat", drawn[0])])) == 1
    for other, problem in (
        (row("ccm", "ccm-concat", drawn[1]), "2 sample digests"),
        (row("ccm", "ccm-concat", drawn[0][:5]), "(5, 'accuracy'), (6, 'accuracy')"),
        (row("ccm", "ccm-concat", drawn[0], "perplexity"), "(6, 'accuracy'), (6, 'perplexity')"),
        (baselines[1], "['full_context'] more than once"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            summarize([*baselines, row("ccm", "ccm-merge", drawn[0]), other])


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_rows_past_learned_absolute_positions_are_refused_before_scoring(tokenizer, method):
    """GPT-2 has 512 learned positions (the tiny one): a longer plain prompt failed inside the embedding with torch's
    IndexError, and a longer memory with an online error only once the samples before it were scored."""
    from tiny_models import tiny_ccm

    gpt2 = tiny_ccm("gpt2", num_comp_tokens=1)
    history = 0 if method == "no_context" else 300
    fits = OnlineSample([[5] * 300], [6] * (400 - history), [7] * 112, choices=[[7] * 112, [8]])  # 512 positions
    too_long = OnlineSample([[5] * 300], [6] * (400 - history), [7], choices=[[7], [8] * 113])
    score_samples(gpt2, tokenizer, [fits], method, "accuracy")
    with pytest.raises(ValueError, match=r"samples\[1\] reaches position 512, past the model's 512 learned absolute"):
        score_samples(gpt2, tokenizer, [fits, too_long], method, "accuracy")


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_an_empty_output_to_score_by_perplexity_is_refused_naming_the_sample(ccm, tokenizer, method):
    """It scored as nan (no token), and every interval of its sample set with it."""
    samples = [OnlineSample(["Ann likes tea."], "Ann likes", " tea"), OnlineSample(["Bob is here."], "Bob", "")]
    with pytest.raises(ValueError, match=r"samples\[1\].output is empty: perplexity needs at least one token"):
        score_samples(ccm, tokenizer, samples, method, "perplexity")


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_an_empty_choice_or_input_is_refused_naming_the_sample(ccm, tokenizer, method):
    """An empty choice scored nan (the mean of no token), and nan won or lost the argmax by its place in the list;
    an empty input failed with torch's size error under no_context and ccm (no position predicts the output)."""
    good = OnlineSample([[5, 6]], [7], [8, 9], choices=[[8, 9], [10]])
    empty_choice = OnlineSample([[5, 6]], [7], [8, 9], choices=[[], [8, 9]])
    with pytest.raises(ValueError, match=r"samples\[1\] has an empty choice"):
        score_samples(ccm, tokenizer, [good, empty_choice], method, "accuracy")
    for metric in ("accuracy", "perplexity"):
        with pytest.raises(ValueError, match=r"samples\[1\].input is empty"):
            score_samples(
                ccm, tokenizer, [good, OnlineSample([[5, 6]], [], [8, 9], choices=[[8, 9], [10]])], method, metric
            )


@pytest.mark.parametrize("method", ["no_context", "full_context", "ccm"])
def test_a_sample_without_its_output_among_its_choices_is_refused_before_scoring(ccm, tokenizer, method):
    """Accuracy found the answer among the choices only once a batch had run: no choices or an output outside them
    failed with "[8] is not in list", no output with a TypeError, after the batches before had been scored."""
    good = OnlineSample([[5, 6]], [7], [8], choices=[[8], [10]])
    for bad in (
        OnlineSample([[5, 6]], [7], [8]),
        OnlineSample([[5, 6]], [7], [8], choices=[[9], [10]]),
        OnlineSample([[5, 6]], [7], None, choices=[[8], [10]]),
    ):
        with pytest.raises(ValueError, match=r"samples\[2\] has no output among its choices"):
            score_samples(ccm, tokenizer, [good, good, bad], method, "accuracy", batch_size=1)


def test_a_pad_token_the_model_cannot_embed_scores_as_any_other(ccm, tokenizer):
    """A pad token added to the tokenizer past the model's embeddings (Llama's `add_special_tokens({"pad_token":
    "[PAD]"})` without resizing them) failed every batch: with torch's IndexError, or for `ccm` as context ids 'outside
    the model's vocabulary' that no context held. Padding is masked: every method scores as with no pad token."""
    added, none = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    added.add_special_tokens({"pad_token": "[PAD]"})
    none.pad_token = None
    assert added.pad_token_id == ccm.vocabulary_size and none.pad_token_id is None
    samples = make_samples("dialogue", "test", 4, seed=2, steps=2)
    assert len({len(tokenizer(s.input)["input_ids"]) for s in samples}) > 1  # rows that get padded
    for method in ("no_context", "full_context", "ccm"):
        scores = [
            score_samples(ccm, padded, samples, method, "perplexity", batch_size=4).per_sample
            for padded in (added, none)
        ]
        assert scores[0] == scores[1]


@settings(max_examples=15)
@given(
    metric=st.sampled_from(["accuracy", "perplexity"]),
    scores=st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 50), st.integers(1, 40)), min_size=1, max_size=8
    ),
    field=st.sampled_from(["task", "method", "metric", "value", "high", "samples", "peak_kv_tokens", "per_sample"]),
    damage=st.sampled_from([None, "missing", float("nan"), [[1.0]], True]),
)
def test_a_report_reads_back_as_written_and_refuses_any_damaged_field(metric, scores, field, damage):
    """Every report `report_json` writes is summarized again when read back (as `ccm eval --add-to` reads it), its
    values those of its per-sample scores after the trip through JSON; a field removed, or replaced by a value of
    another kind, is refused naming the row, where the table failed once every adapter had run."""
    per_sample = [(credit, 1) if metric == "accuracy" else (nll, tokens) for credit, nll, tokens in scores]
    total = sum(value for value, _ in per_sample) / sum(count for _, count in per_sample)
    low, high = value_interval(per_sample, metric)
    rows = [
        MethodScore(
            method,
            2,
            metric,
            total if metric == "accuracy" else math.exp(total),
            low,
            high,
            9.0,
            40,
            400,
            len(per_sample),
            per_sample,
        ).to_dict()
        | {"task": "icl", "wordings": "seen", "method": method}
        for method in ("no_context", "full_context", "ccm-concat")
    ]
    written = json.loads(report_json(rows, summarize(rows)))
    read_back = written["results"]
    assert json.loads(report_json(read_back, summarize(read_back))) == written
    if damage == "missing":
        del read_back[2][field]
    else:
        read_back[2][field] = damage
    with pytest.raises(ValueError, match=r"^result 2 \("):
        summarize(read_back)


def _scored_row(task: str, method: str, per_sample: list[list[float]]) -> dict:
    """A result row of `per_sample` accuracy credits, as eval.json holds one."""
    value = sum(credit for credit, _ in per_sample) / len(per_sample)
    return {
        "task": task,
        "wordings": "seen",
        "method": method,
        "metric": "accuracy",
        "steps": 1,
        "value": value,
        "low": 0.0,
        "high": 1.0,
        "context_kv_tokens": 1.0,
        "peak_kv_tokens": 1,
        "peak_kv_bytes": 1,
        "samples": len(per_sample),
        "per_sample": per_sample,
    }


def test_the_bootstrap_draws_its_resamples_as_one_draw_does():
    """Drawn a block at a time, the resamples are still those one draw of them all gives: intervals stay those that
    earlier reports hold."""
    for count in (1, 5000):  # one block; several (4 M indices each)
        drawn = torch.randint(count, (BOOTSTRAP_RESAMPLES, count), generator=torch.Generator().manual_seed(3))
        assert torch.equal(_resamples(count, seed=3), drawn)


def test_bootstrap_intervals_of_many_samples_take_little_memory():
    """The bootstrap drew all its 2000 resamples at once and gathered their scores, 48 bytes per resample and sample:
    40,000 per-sample scores took 1.3 GB at once, and a report of a million of them (6 MB of JSON, given to
    `ccm eval --add-to`) 100 GB, which ended the process. Drawn a block at a time, no allocation passes 128 MB."""
    scores = [[float(index % 7), 1 + index % 3] for index in range(40_000)]
    expected = math.exp(sum(nll for nll, _ in scores) / sum(tokens for _, tokens in scores))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        low, high = value_interval(scores, "perplexity")
    assert low < expected < high
    assert max(event.cpu_memory_usage for event in profiled.events()) < 128 << 20


def test_a_report_of_many_methods_in_one_sample_set_is_checked_in_one_pass():
    """Each method of a sample set was counted among all of them: a report of 30,000 (6 MB) took 15 s to be refused
    for the one listed twice."""
    rows = [_scored_row("icl", method, [[1, 1]]) for method in ("no_context", "full_context")]
    rows += [_scored_row("icl", f"ccm-{index}", [[1, 1]]) for index in range(30_000)] + [rows[0]]
    with pytest.raises(ValueError, match=re.escape("holds ['no_context'] more than once")):
        summarize(rows)


class _CountedText(str):
    """A task name that counts how often it is compared."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedText.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_summary_gathers_each_sample_set_s_rows_in_one_pass():
    """Each sample set's rows were searched for among all the rows: a report of 100,000 sets (25 MB) took hours."""
    rows = [
        _scored_row(_CountedText(f"icl{index}"), method, [[credit, 1]])
        for index in range(500)
        for method, credit in (("no_context", 0), ("full_context", 1), ("ccm-concat", 1))
    ]
    _CountedText.compared = 0
    assert len(summarize(rows)) == 500
    assert _CountedText.compared <= 2 * len(rows)  # a search of all the rows for each set: 750,000
