"""The examples run and show what they claim."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(EXAMPLES), *sys.path])


def test_quick_tour_runs_and_learns(capsys):
    runpy.run_path(str(EXAMPLES / "quick_tour.py"), run_name="__main__")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    with_memory, without = (float(word.rstrip(",")) for word in last.split() if word[0].isdigit())
    assert with_memory < 0.3 * without, last


def test_online_inference_answers_from_memory(capsys):
    runpy.run_path(str(EXAMPLES / "online_inference.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    answers = [line for line in lines if line.startswith("user ")]
    assert answers == ["user 0: last label 47, model answers 47", "user 1: last label 44, model answers 44"]
    assert lines[-1].endswith("memory equal: True")


def test_sharing_round_trip(capsys):
    runpy.run_path(str(EXAMPLES / "sharing.py"), run_name="__main__")
    *_, loaded, grown, wider = capsys.readouterr().out.strip().splitlines()
    assert loaded == "answer before saving: 52, after loading: 52 (expected 52)"
    assert grown == "with 4 <COMP> tokens, before any training: 52"  # copies of a slot keep the answer
    assert wider == "with a LoRA on the MLP too, before any training: 52"  # the added layers start at zero


def test_streaming_stays_within_the_budget(capsys):
    runpy.run_path(str(EXAMPLES / "streaming.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert lines[0].startswith("CCM-concat   budget 160 positions: held at most 160 over 2010 tokens (8 memory slots")
    assert lines[1].startswith("StreamingLLM budget 160 positions: held at most 160 over 2010 tokens (0 memory slots")
    # The row stopped first takes none of the padding after its reply.
    assert lines[2] == "replies of 50 and 300 tokens: streams took [60, 310] tokens and hold [60, 160] positions"


def test_serving_from_threads_matches_one_by_one(capsys):
    runpy.run_path(str(EXAMPLES / "serving.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert "same as one by one: True" in lines
    assert "memory unchanged: True" in lines
    assert lines[-1] == "another adapter refuses the memory: True"
    assert any(line.startswith("bad request refused: context_ids holds the token id 10000") for line in lines)


def test_training_data_mixes_families_by_weight_and_trains_on_streams(capsys):
    runpy.run_path(str(EXAMPLES / "training_data.py"), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("{")]
    assert "families: {'icl': 24, 'personalization': 8, 'dialogue': 8}" in lines
    assert sum(line.startswith("a varied ICL frame:") for line in lines) == 2
    assert sum(line.startswith("a varied profile:") for line in lines) == 1
    assert sum(line.startswith("who is who:") and "choices:" in line for line in lines) == 1
    mixture, distilled, streamed = (
        next(line for line in lines if line.startswith(start))
        for start in ("held-out loss at", "held-out loss distilled", "held-out streamed")
    )
    for losses in (mixture, distilled):
        at_6, at_12 = (float(word.rstrip(",")) for word in losses.split()[-2:])
        assert at_12 < at_6, losses
    at_2, at_4 = (float(word.rstrip(",")) for word in streamed.split()[-2:])
    assert at_4 < at_2, streamed
    compared = next(line for line in lines if line.startswith("held-out dialogue perplexity"))
    ratio, low, high = (float(word.strip("x[],")) for word in compared.split(": ")[1].split()[:3])
    assert low <= ratio <= high and compared.endswith("perplexity vs output-only"), compared
