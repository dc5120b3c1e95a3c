"""benchmarks/decode_peers.py on its tiny shape: each cell counts the tokens it claims, and
transformers, CTranslate2 and keras_tfm (this process's backend) decode the same greedy tokens
from the same MarianMT weights (no timing here: speed is measured in benchmarks/)."""

import os
import sys

import keras
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import decode_peers as dp  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("marian")
    dp.write_model(str(path), dp.SHAPES["small"])
    dp.convert_ctranslate2(str(path), str(path / "ct2"))
    return str(path)


def test_engines_count_their_tokens_and_agree(model_dir):
    names = ["transformers", "ctranslate2-float32", f"keras_tfm-{keras.backend.backend()}"]
    results = dp.run_engines(names, model_dir, os.path.join(model_dir, "ct2"), stream=3,
                             repeats=2)
    for result in results.values():
        cells = result["cells"]
        assert list(cells) == ([dp.STREAM, dp.STREAM16] + [name for name, _, _ in dp.CELLS]
                               + [dp.LONG_CELL])
        for stream in (dp.STREAM, dp.STREAM16):
            assert cells[stream]["new_tokens"] == 3 * dp.NEW_TOKENS  # forced: 32 each
        for name, batch, _ in dp.CELLS:
            assert cells[name]["new_tokens"] == batch * dp.NEW_TOKENS
            assert len(cells[name]["seconds"]) == 2 and cells[name]["tokens_per_s"] > 0
        assert cells[dp.LONG_CELL]["new_tokens"] == dp.LONG
        assert all(len(result["linearity_seconds"][str(n)]) == dp.LINEAR_REPEATS
                   for n in (dp.NEW_TOKENS, dp.LONG))
        assert dp.linearity(result) > 0
    keras_cells = results[names[-1]]["cells"]
    assert all(keras_cells[name]["matmul_floor_s"] > 0 for name, _, _ in dp.CELLS)
    assert "seconds ÷ matmul floor" in dp.table(results)
    assert f"{dp.LONG} ÷ {dp.NEW_TOKENS} new tokens" in dp.table(results)
    check = dp.agreement(results)
    assert {name: c["equal_rows"] for name, c in check.items()} == dict.fromkeys(names, 16)
    # The check is not trivial: the rows differ and vary along the way.
    assert check["transformers"]["distinct_rows"] >= 10
    assert min(check["transformers"]["distinct_tokens_per_row"]) >= 5


def test_an_engine_that_fails_raises_its_error_in_the_parent(model_dir, tmp_path):
    """A task that fails in an engine's process, and an engine that cannot load, raise in the
    parent with the child's traceback (not a bare EOFError)."""
    engine = dp.Engine("ctranslate2-float32", model_dir, os.path.join(model_dir, "ct2"))
    try:
        with pytest.raises(RuntimeError, match="ctranslate2-float32 failed in 'timed'"):
            engine("timed", [[10 ** 6]], 1)  # an id outside the vocabulary
        assert engine("greedy", [[5, 6, 0]])  # and it still answers
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="failed in 'loading'(.|\n)*Error"):
        dp.Engine("ctranslate2-float32", model_dir, str(tmp_path / "no_model"))


def test_a_keras_engine_on_cuda_computes_there_or_refuses(model_dir):
    """`--device cuda` without a GPU is an error, not a CPU run reported as a GPU's."""
    backend = keras.backend.backend()
    name, ct2_dir = f"keras_tfm-{backend}", os.path.join(model_dir, "ct2")
    if dp.per_backend.device_name() != "cpu":
        translate, _ = dp.make_engine(name, model_dir, ct2_dir, device="cuda")
        assert len(translate([[5, 6, dp.EOS]], 1, True)[0]) == dp.NEW_TOKENS
    else:
        with pytest.raises(RuntimeError, match=f"{name}: no GPU here for --device cuda"):
            dp.make_engine(name, model_dir, ct2_dir, device="cuda")


def test_ratios_table_and_plot(tmp_path):
    fake = {name: {"cells": {"a": {"tokens_per_s": speed}, "b": {"tokens_per_s": 2 * speed}}}
            for name, speed in (("transformers", 100.0), ("ctranslate2-float32", 200.0),
                                ("keras_tfm-jax", 300.0))}
    assert dp.ratios(fake) == {"keras_tfm-jax / transformers": {"a": 3.0, "b": 3.0},
                               "keras_tfm-jax / ctranslate2-float32": {"a": 1.5, "b": 1.5}}
    table = dp.table(fake)
    assert "| b | 200 | 400 | 600 |" in table
    assert "| keras_tfm-jax / transformers | 3.00× | 3.00× |" in table
    dp.plot(fake, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
