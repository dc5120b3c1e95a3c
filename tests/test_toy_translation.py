"""The toy translation data (seed 003) and the demo's --quick run."""

import os
import sys

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import toy_data  # noqa: E402
import toy_translation  # noqa: E402


def test_target_follows_the_seed_rules():
    # reverse, capitalise letters, digit d -> 10 - d, first Y token depends on the last X token
    assert toy_data.translate(["a", "3", "b", "8"]) == ["2", "2", "B", "7", "A"]
    assert toy_data.translate(["c", "5"]) == ["5", "5", "C"]
    assert len(toy_data.SOURCE_WORDS) == 7
    assert any(w.isdigit() for w in toy_data.SOURCE_WORDS)
    assert any(w.isalpha() for w in toy_data.SOURCE_WORDS)
    assert "0" not in "".join(toy_data.SOURCE_WORDS)


def test_dataset_is_seeded_padded_and_consistent():
    source, target = toy_data.make_dataset(200, seed=3)
    again, _ = toy_data.make_dataset(200, seed=3)
    np.testing.assert_array_equal(source, again)
    assert source.shape == (200, toy_data.SOURCE_LENGTH)
    assert target.shape == (200, toy_data.TARGET_LENGTH)
    assert (source[:, 0] == toy_data.SOS).all() and (target[:, 0] == toy_data.SOS).all()
    lengths = (source != toy_data.PAD).sum(1) - 2
    assert lengths.min() >= toy_data.MIN_LENGTH and lengths.max() <= toy_data.MAX_LENGTH
    assert len(set(lengths)) > 5  # random lengths
    for s, t in zip(source, target):
        words = toy_data.decode(s, toy_data.SOURCE_VOCAB)
        assert toy_data.decode(t) == toy_data.translate(words)
        assert t[len(words) + 2] == toy_data.EOS  # <SOS> y (len + 1 words) <EOS>
    # different probabilities per word
    counts = np.bincount(source[source > toy_data.EOS].ravel(), minlength=10)[3:]
    assert counts.max() > 2 * counts.min()


def test_quick_run_trains_saves_reloads_and_decodes(tmp_path, capsys):
    result = toy_translation.main(["--quick", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "exact-sequence accuracy" in out and "token accuracy" in out
    assert "samples (source | expected | predicted)" in out
    assert (tmp_path / "toy_translation.keras").exists()
    assert result["reloaded_same"]
    assert 0.0 <= result["token_accuracy"] <= 1.0
    assert (tmp_path / "cross_attention.png").stat().st_size > 1000
