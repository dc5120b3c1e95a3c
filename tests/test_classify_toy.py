"""The encoder-only example (examples/classify_toy.py): its labels and its --quick run."""

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import classify_toy  # noqa: E402


def test_label_depends_on_word_order():
    assert classify_toy.label(["c", "a", "b"]) == 1
    assert classify_toy.label(["c", "b", "a"]) == 0
    assert classify_toy.label(["a", "c"]) == 1 and classify_toy.label(["c", "3"]) == 0
    tokens, labels = classify_toy.make_dataset(400, seed=1)
    assert tokens.shape == (400, 22) and 0.3 < labels.mean() < 0.7  # balanced enough


def test_quick_run_trains_saves_and_reloads(tmp_path, capsys):
    result = classify_toy.main(["--quick", "--output-dir", str(tmp_path)])
    assert "held-out accuracy" in capsys.readouterr().out
    assert (tmp_path / "toy_classifier.keras").exists()
    assert result["reloaded_same"]  # (a quick run is too short to assert an accuracy)
