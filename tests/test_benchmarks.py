"""The benchmark harness counts what it claims (no timing here: speed is measured in benchmarks/)."""

import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import train_throughput as tt  # noqa: E402

TINY = dict(d_model=16, num_heads=2, ff_dim=32, layers=2, length=6, batch=4, vocab=30,
            warmup=1, steps=1, repeats=1, dropout=0.1)


def test_matmul_flops_by_hand():
    # base: per token, encoder layer 4d² + 2·d·ff + attention 2·S·d; decoder layer 6d² (q, o,
    # self k/v) + 2d² (cross k, v) + 2·d·ff + attention 2·(T + S)·d; logits d·V; x 2 for FLOPs.
    b, s, d, f, v = 16, 64, 512, 2048, 1000
    encoder = 4 * d * d + 2 * d * f + 2 * s * d
    decoder = 8 * d * d + 2 * d * f + 2 * (s + s) * d
    expected = 2 * b * s * (2 * encoder + 2 * decoder + d * v)
    total, shapes = tt.matmul_flops(tt.CONFIGS["base"])
    assert total == expected
    assert round(3 * total / 1e9, 1) == 95.8  # the README's GFLOP per training step
    assert (1024, 512, 2048, 1, 2 * 1024 * 512 * 2048) in shapes


def test_batches_are_padded_and_shifted():
    src, dec_in, tgt = tt.make_batches(TINY)
    n = tt.POOL * TINY["batch"]
    assert src.shape == dec_in.shape == tgt.shape == (n, TINY["length"])
    for tokens in (src, np.concatenate([dec_in, tgt[:, -1:]], axis=1)):
        lengths = (tokens != 0).sum(1)
        assert lengths.min() >= tokens.shape[1] // 2 and len(set(lengths)) > 1
        # right padding: no real token after a pad
        assert all((row[np.argmin(row != 0):] == 0).all() for row in tokens if (row == 0).any())
    np.testing.assert_array_equal(dec_in[:, 1:], tgt[:, :-1])  # targets = inputs shifted by one


def test_keras_tfm_and_the_keras_mha_model_are_the_same_size():
    tfm, mha = tt.build_keras_tfm(TINY), tt.build_keras_mha(TINY)
    assert tfm.count_params() == mha.count_params()
    src, dec_in, _ = tt.make_batches(TINY)
    assert tfm([src[:2], dec_in[:2]]).shape == mha([src[:2], dec_in[:2]]).shape == (2, 6, 30)


def test_tensorflow_gets_the_same_batches_without_autotuning():
    # tf.data works under every Keras backend, so this runs in each of the three processes.
    src, dec_in, tgt = (a[:10] for a in tt.make_batches(TINY))
    dataset = tt.unautotuned_dataset([src, dec_in], tgt, batch_size=4)
    assert dataset.options().autotune.enabled is False
    batches = list(dataset.as_numpy_iterator())
    assert [len(y) for _, y in batches] == [4, 4, 2]
    for i, ((s, d), y) in enumerate(batches):
        rows = slice(4 * i, 4 * i + 4)
        np.testing.assert_array_equal(s, src[rows])
        np.testing.assert_array_equal(d, dec_in[rows])
        np.testing.assert_array_equal(y, tgt[rows])


def test_the_first_call_after_every_build_is_not_timed(monkeypatch):
    """One untimed round once all models are built (under TensorFlow the first call of every
    model but the last built ran 2-4x slower), then the repeats in turns. A fake clock: each
    runner's call takes 100 s the first time and 1 s after."""
    clock, calls = [0.0], {"a": [], "b": []}
    monkeypatch.setattr(tt, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def runner(name):
        def run(offset):
            clock[0] += 100.0 if not calls[name] else 1.0
            calls[name].append(offset)
        return run

    cfg = dict(TINY, steps=2, repeats=3)
    medians, samples = tt.time_interleaved({"a": runner("a"), "b": runner("b")}, cfg)
    assert calls == {"a": [0, 0, 1, 2], "b": [0, 0, 1, 2]}
    assert samples == {"a": [0.5] * 3, "b": [0.5] * 3} and medians == {"a": 0.5, "b": 0.5}


def test_the_per_round_ratio_pairs_each_round():
    """Round r: the faster peer's time over keras_tfm's, then the median; by hand. A slow spell
    in round 3 slows every model of it (and the ratio of the medians says 0.90x)."""
    times = {"keras_tfm": [1.0, 2.0, 3.0], "keras_hub": [1.5, 1.8, 6.0],
             "keras_mha": [1.2, 3.0, 3.3], "torch_native": [0.1, 0.1, 0.1]}
    assert np.isclose(tt.paired_ratio(times), 1.1)  # median of 1.2, 0.9 and 1.1
    assert np.isclose(tt.paired_ratio(times, peers=("keras_hub",)), 1.5)  # 1.5, 0.9, 2.0
    assert tt.paired_ratio({"keras_tfm": [1.0]}) is None


def test_report_remakes_the_attention_and_dropout_tables(tmp_path):
    import json

    import report

    attention = {"backend": "torch", "date": "2026-01-02", "device": "NVIDIA X", "rows": [
        {"length": 64, "variant": "keras_tfm_fused", "ms": 2.0, "peak_bytes": 3 * 2**20},
        {"length": 64, "variant": "keras_tfm_explicit", "ms": 4.0, "peak_bytes": 5 * 2**20},
        {"length": 64, "variant": "keras_mha", "ms": 2.5, "peak_bytes": None}]}
    dropout = {"backend": "jax", "date": "2026-01-03",  # no device: an older CPU file
               "rows": [{"shape": [4, 8], "keras_us": 1500.0, "keras_tfm_us": 500.0}]}
    for name, r in (("attention_gpu_torch.json", attention), ("dropout_jax.json", dropout)):
        (tmp_path / name).write_text(json.dumps(r))
    rows = report.attention_table(str(tmp_path)).splitlines()
    assert rows[2] == ("| torch | NVIDIA X, 2026-01-02 | float32 | 64 | 2.0 | 4.0 | 2.5 | "
                       "3 / 5 / – | 0.50 | 0.80 |")
    rows = report.dropout_table(str(tmp_path)).splitlines()
    assert rows[2] == "| jax | cpu, 2026-01-03 | (4, 8) | 1,500 | 500 | 3.00× |"
    assert len(rows) == 3
