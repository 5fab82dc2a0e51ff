import runpy
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_quick_tour_runs_and_learns(capsys):
    runpy.run_path(str(EXAMPLES / "quick_tour.py"), run_name="__main__")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    with_memory, without = (float(word.rstrip(",")) for word in last.split() if word[0].isdigit())
    assert with_memory < 0.3 * without, last
