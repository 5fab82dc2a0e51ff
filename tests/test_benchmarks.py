"""Smoke runs of every benchmark on a tiny random Llama, asserting what each one measures."""

import json

import pytest
import torch

from benchmarks import latency, memory, overhead, throughput, training_speed
from benchmarks.__main__ import main
from benchmarks.report import markdown, plot, tables, targets
from benchmarks.timing import Timing, time_cases
from benchmarks.workload import FULL_CONTEXT, NO_CONTEXT, Subject, Workload, cache_bytes
from tiny_models import tiny_base, tiny_ccm
from transformers_ccm import CCMDataCollator

WORKLOAD = Workload(context_tokens=6, input_tokens=4, new_tokens=4)
N_COMP = 2
PER_SLOT = 2 * 2 * 2 * 8 * 4  # layers x (keys, values) x KV heads x head_dim x fp32 bytes
FAST = {"rounds": 1, "min_run_time": 0.0}
MEMORY_STEPS, LATENCY_STEPS, THROUGHPUT_STEP, BUDGET = 6, [1, 3], 3, 64 * 1024


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two torch threads on two busy cores stall each other; these models are tiny."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def subject():
    return Subject(
        "tiny-llama",
        tiny_base("llama"),
        {f"ccm-{u}": tiny_ccm("llama", update=u, num_comp_tokens=N_COMP) for u in ("concat", "merge")},
    )


@pytest.fixture(scope="module")
def results(subject):
    """One smoke run of every benchmark."""
    return {
        "model": "tiny-llama",
        "memory": memory.run(subject, WORKLOAD, MEMORY_STEPS),
        "latency": latency.run(subject, WORKLOAD, LATENCY_STEPS, ("dialogue", "context"), **FAST),
        "throughput": throughput.run(subject, WORKLOAD, THROUGHPUT_STEP, [1, 2], BUDGET, **FAST),
        "training": training_speed.run(subject, WORKLOAD, [2, 3], batch_size=2, **FAST),
        "overhead": overhead.run(subject, WORKLOAD, 3, **FAST),
    }


def test_timing_warms_up_then_interleaves_rounds_and_takes_ratios_within_them():
    calls = []
    timings = time_cases({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, min_run_time=0)
    assert calls == ["a", "b"] * 4  # one warm-up, then three rounds
    assert all(len(timing.rounds) == 3 for timing in timings.values())
    # a slow spell in round 3 hits both cases: the in-round ratio ignores it
    assert Timing((1.0, 2.0, 10.0)).ratio_to(Timing((1.0, 1.0, 5.0))) == 2.0


def test_memory_growth_is_measured_from_the_tensors(subject, results):
    steps, found = MEMORY_STEPS, results["memory"]
    assert subject.bytes_per_token == found["bytes_per_slot"] == PER_SLOT
    held = found["bytes"]
    assert held[FULL_CONTEXT] == [t * WORKLOAD.context_tokens * PER_SLOT for t in range(1, steps + 1)]
    assert held["ccm-concat"] == [t * N_COMP * PER_SLOT for t in range(1, steps + 1)]
    assert held["ccm-merge"] == [N_COMP * PER_SLOT] * steps  # flat over t
    assert found["slope_bytes"][FULL_CONTEXT] == pytest.approx(WORKLOAD.context_tokens * PER_SLOT)
    assert found["slope_bytes"]["ccm-concat"] == pytest.approx(N_COMP * PER_SLOT)
    assert found["slope_bytes"]["ccm-merge"] == pytest.approx(0, abs=1e-9)
    assert found["slope_slots"] == pytest.approx(found["expected_slots_per_step"])
    llama = found["llama_7b"]
    assert llama["bytes_per_slot"] == 32 * 2 * 32 * 128 * 2  # fp16
    assert (
        llama["kv_length_at_16"]
        == llama["paper_kv_length_at_16"]
        == {
            FULL_CONTEXT: 800,
            "ccm-concat": 128,
            "ccm-merge": 8,
        }
    )


def test_cache_bytes_equals_the_memory_held(subject):
    model = subject.ccm["ccm-concat"]
    cache = model.new_cache(3)
    for step in range(1, 4):
        model.compress(cache, WORKLOAD.step(subject.vocab_size, "context", step).repeat(3, 1))
    assert cache_bytes(cache) == cache.memory_bytes() == 3 * 3 * N_COMP * PER_SLOT


def test_latency_ratios_are_taken_against_no_context(results):
    steps, rows = LATENCY_STEPS, results["latency"]["rows"]
    assert {(r["kind"], r["step"], r["method"]) for r in rows} == {
        (kind, step, method)
        for kind in ("dialogue", "context")
        for step in steps
        for method in (NO_CONTEXT, FULL_CONTEXT, "ccm-concat", "ccm-merge")
    }
    for row in rows:
        assert row["seconds"] > 0
        if row["method"] == NO_CONTEXT:
            assert row["ratio_to_no_context"] == 1


def test_largest_batch_for_the_budget_runs_and_one_more_would_not_fit(results):
    step, budget, found = THROUGHPUT_STEP, BUDGET, results["throughput"]
    per_user = found["peak_bytes_per_user"]
    # A turn's peak KV: full context holds the history, the new context, the input and all new tokens but the
    # last; CCM holds its memory with either the new context and <COMP> (compressing) or the turn (generating).
    context, answer = WORKLOAD.context_tokens, WORKLOAD.input_tokens + WORKLOAD.new_tokens - 1
    assert per_user[FULL_CONTEXT] == (step * context + answer) * PER_SLOT
    concat = max((step - 1) * N_COMP + context + N_COMP, step * N_COMP + answer)
    assert per_user["ccm-concat"] == concat * PER_SLOT
    assert per_user["ccm-merge"] == max(N_COMP + context + N_COMP, N_COMP + answer) * PER_SLOT
    for method, largest in found["largest_batch"].items():
        assert found["largest_batch_peak_bytes"][method] == largest * per_user[method] <= budget
        assert (largest + 1) * per_user[method] > budget
    assert found["largest_batch"]["ccm-merge"] > found["largest_batch"][FULL_CONTEXT]
    for row in found["rows"]:
        assert row["samples_per_second"] == pytest.approx(row["batch_size"] / row["seconds"])


def test_recurrent_and_parallel_training_compute_the_same_loss(subject, results):
    found = results["training"]
    assert len(found["rows"]) == 4
    for row in found["rows"]:
        assert abs(row["parallel_loss"] - row["recurrent_loss"]) <= 1e-4
        assert row["parallel_samples_per_second"] > 0 and row["recurrent_samples_per_second"] > 0
    assert all(p.grad is None for model in subject.ccm.values() for p in model.parameters())


def test_recurrent_loss_gradients_equal_the_parallel_ones(subject):
    model = subject.ccm["ccm-merge"]
    samples = training_speed.make_samples(WORKLOAD, subject.vocab_size, 3, 2)
    training_speed.recurrent_loss(model, samples).backward()
    recurrent = model.comp_embeddings.grad.clone()
    model.zero_grad(set_to_none=True)
    model(**CCMDataCollator(model)(samples)).loss.backward()
    torch.testing.assert_close(recurrent, model.comp_embeddings.grad, atol=1e-6, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_overhead_reproduces_table_16_and_folds_fewer_tokens(results):
    found = results["overhead"]
    assert {r["num_comp_tokens"]: r["threshold_tokens"] for r in found["llama_7b_flops"]} == found["paper_thresholds"]
    for row in found["rows"]:
        assert row["fold_tokens"] == N_COMP + 1
        assert row["re_encode_tokens"] == WORKLOAD.input_tokens + WORKLOAD.new_tokens + N_COMP


def test_report_from_all_benchmarks(results, tmp_path):
    results = results | {
        "machine": {key: "?" for key in ("date", "cpu", "cpu_count", "threads", "gpu", "load_average")}
        | {"torch": "?", "transformers": "?"},
        "command": "pytest",
        "workload": vars(WORKLOAD),
        "settings": FAST,
    }
    results["targets"] = targets(results)
    assert {t["target"].split()[0] for t in results["targets"]} >= {"ccm-merge", "ccm-concat", "full-context"}
    found = tables(results)
    assert found[0].title == "Targets"
    images = plot(results, str(tmp_path))
    assert images == ["memory.png", "latency.png", "throughput.png", "training.png"]
    text = markdown(results, found, images)
    assert "| ccm-merge |" in text and "![latency.png](latency.png)" in text


def test_command_line_on_a_config(tmp_path, capsys):
    tiny_base("llama").config.save_pretrained(tmp_path / "model")
    output = tmp_path / "out"
    main(
        [
            "--model",
            str(tmp_path / "model" / "config.json"),
            "--quick",
            "--benchmarks",
            "memory",
            "--output-dir",
            str(output),
        ]
    )
    written = json.loads((output / "benchmarks.json").read_text())
    assert written["model"] == "config.json"
    assert written["memory"]["slope_slots"]["ccm-merge"] == pytest.approx(0, abs=1e-9)
    assert (output / "summary.md").is_file() and (output / "memory.png").is_file()
    assert "KV memory held" in capsys.readouterr().out


@pytest.mark.parametrize("architecture", ["llama", "llama-eager"])
def test_decode_step_compares_equal_kv_and_equal_outputs(architecture):
    from benchmarks import decode_step

    model = tiny_ccm(architecture)
    cases = decode_step.step_cases(model, kv_length=24)
    with torch.no_grad():
        assert torch.allclose(cases["dynamic_cache"](), cases["ccm"](), atol=1e-5)
        report = decode_step.run(model, [8, 24], **FAST)
    assert [row["kv_length"] for row in report["steps"]] == [8, 24]
    assert all(row["ratio"] > 0 for row in report["steps"])
