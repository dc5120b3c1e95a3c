"""keras_tfm.distribution: the layout map, the batch check, and each backend's own engine
(JAX keras.distribution, TensorFlow MirroredStrategy, torch DistributedDataParallel) on two
devices, in subprocesses that fix the device count before the backend is imported."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_tfm
from keras_tfm.distribution import check_batch_size, get_layout_map, num_replicas
from keras_tfm.dropout import effective_rate

from helpers import BACKEND

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mesh(names=("batch", "model")):
    return keras.distribution.DeviceMesh((1, 2), names, devices=["cpu:0", "cpu:1"])


def expected_axes(path):
    """The layout the issue asks for, written out per weight (None: replicated)."""
    *_, layer, weight = path.split("/")
    if weight == "kernel" and layer in ("query", "key", "value"):
        return (None, "model", None)  # (d_model, heads, head_dim): split over heads
    if weight == "kernel" and layer == "attention_output":
        return ("model", None, None)  # (heads, head_dim, d_model): split over its input
    if weight == "kernel" and layer == "intermediate_dense":
        return (None, "model")  # (d_model, ff): split over the ff units
    if weight == "kernel" and layer == "output_dense":
        return ("model", None)  # (ff, d_model): split over its input
    if weight == "embeddings" and layer in ("token_embedding", "position_embedding"):
        return (None, "model")  # (vocab | length, d_model): split over the width
    if weight == "kernel" and layer == "logits":
        return ("model", None)  # (d_model, vocab): split over its input
    return None


def keras_tfm_models():
    small = dict(d_model=8, num_heads=2, ff_dim=16, num_encoder_layers=2, num_decoder_layers=2)
    yield keras_tfm.build_transformer(11, 13, **small)
    yield keras_tfm.build_transformer(11, 13, norm_first=True, positional="learned",
                                      max_length=9, tie_embeddings=True, name="tied", **small)
    # Stand-alone layers with their default names, and blocks a user named.
    tokens = keras.Input((None,), dtype="int32")
    x = keras_tfm.TokenAndPositionEmbedding(11, 8, positional="learned", max_length=9)(tokens)
    x = x + keras_tfm.TokenAndPositionEmbedding(11, 8, positional="learned",
                                                max_length=9)(tokens)
    x = keras_tfm.MultiHeadSelfAttention(2, 4)(x)
    x = keras_tfm.MultiHeadSelfAttention(2, 4)(x)
    x = keras_tfm.CrossAttention(2, 4)(x, x)
    x = keras_tfm.CrossAttention(2, 4)(x, x)
    x = keras_tfm.FeedForward(16)(x)
    x = keras_tfm.FeedForward(16)(x)
    x = keras_tfm.PositionEmbedding(9)(x)
    x = keras_tfm.TransformerEncoderBlock(2, 16, name="my_encoder")(x)
    x = keras_tfm.TransformerDecoderBlock(2, 16, name="my_decoder")(x, x)
    yield keras.Model(tokens, x, name="loose_layers")


def test_layout_map_covers_every_keras_tfm_weight():
    layout_map = get_layout_map(mesh())
    paths = [v.path for m in keras_tfm_models() for v in m.weights]
    assert len(paths) > 150
    for path in paths:
        layout = layout_map[path]  # raises if two patterns match one path
        expected = expected_axes(path)
        assert (None if layout is None else tuple(layout.axes)) == expected, path
        # Every kernel and embedding table is split, every bias and norm replicated.
        assert (expected is not None) == path.endswith(("kernel", "embeddings")), path
    assert any("multi_head_self_attention_1/" in p for p in paths)
    assert any("cross_attention_1/query" in p for p in paths)
    assert any("feed_forward_1/" in p for p in paths)
    assert any(p.startswith("my_decoder/cross_attention/") for p in paths)


def test_layout_map_leaves_other_weights_alone():
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(11, 8)(tokens)
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(x, x)
    x = keras.layers.Dense(16, name="dense")(x)
    x = keras.layers.Dense(8, name="my_logits")(x)
    x = keras.layers.LayerNormalization()(x)
    model = keras.Model(tokens, x)
    layout_map = get_layout_map(mesh())
    assert len(model.weights) == 15
    for v in model.weights:
        assert layout_map[v.path] is None, v.path
    # Keras matches with re.fullmatch: a pattern must not reach into longer names.
    # The patterns are names: a Dense named "logits" is the output projection to them.
    assert layout_map["head/logits/kernel"].axes == ("model", None)
    for path in ("encoder_block_0/self_attention/query/kernel_extra",
                 "my_self_attention/query/kernel", "xlogits/kernel",
                 "encoder_block_0/self_attention/query/bias",
                 "encoder_embedding/token_embedding/embeddings/moment"):
        assert layout_map[path] is None, path


def test_layout_map_names_its_axes_and_checks_them():
    layout_map = get_layout_map(mesh(("data", "tensor")), model_dim="tensor", data_dim="data")
    assert layout_map["decoder_block_3/feed_forward/output_dense/kernel"].axes == ("tensor",
                                                                                   None)
    with pytest.raises(ValueError, match="model_dim='model' is not an axis"):
        get_layout_map(mesh(("data", "tensor")))
    with pytest.raises(ValueError, match="data_dim='batch' is not an axis"):
        get_layout_map(mesh(("data", "model")))
    with pytest.raises(ValueError, match="must differ"):
        get_layout_map(mesh(), model_dim="batch", data_dim="batch")
    with pytest.raises(TypeError, match="DeviceMesh"):
        get_layout_map(("batch", "model"))


def test_check_batch_size_names_the_fix():
    assert num_replicas() == 1  # no distribution in effect
    assert check_batch_size(7, 23) == 1
    assert check_batch_size(64, 1000, replicas=4) == 4  # last batch 40 = 4 x 10
    with pytest.raises(ValueError, match="batch_size=6 does not split across 4"):
        check_batch_size(6, replicas=4)
    with pytest.raises(ValueError, match=re.escape("last batch of 43") + ".*drop 3 sample.*"
                       "pass the first 1064.*add 1"):
        check_batch_size(64, 1024 + 43, replicas=4)


def run_checked(args, tmp_path):
    env = dict(os.environ, KERAS_BACKEND=BACKEND)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_backend_engine_trains_on_two_devices(tmp_path):
    """The backend's own engine, two devices, against the same run on one device."""
    run_checked([os.path.join(HERE, "distribution_worker.py"), str(tmp_path)], tmp_path)
    r = json.loads((tmp_path / "result.json").read_text())
    close = dict(rtol=0, atol=1e-4)
    if BACKEND == "jax":
        assert r["devices"] == 2
        # DataParallel: the same loss curve and outputs; weights replicated; batch split in 2.
        np.testing.assert_allclose(r["dp_losses"], r["single_losses"], **close)
        assert r["dp_output_gap"] < 1e-4
        assert r["dp_specs"] == ["[None, None, None]", "[None, None]", "[None]"]
        assert r["dp_replicas"] == 2
        # ModelParallel with our layout map: each kernel really split in 2, nothing else.
        for path, spec in r["mp_specs"].items():
            axes = expected_axes(path) or (None,) * len(r["shapes"][path])
            assert tuple(spec) == axes, path
            halved = [n // 2 if a == "model" else n for n, a in zip(r["shapes"][path], axes)]
            assert r["mp_shard_shapes"][path] == halved, path
        # 4 embedding tables, 6 kernels per encoder block, 10 per decoder block, the logits.
        assert sum(expected_axes(p) is not None for p in r["mp_specs"]) == 21
        owned = 0
        for path, spec in r["mp_optimizer_specs"].items():  # Adam moments follow their weight
            weight = re.sub(r"^adam(_\d+)?/|_(momentum|velocity)$", "", path)
            owner = [p for p in r["mp_specs"] if p.replace("/", "_") == weight]
            if owner:
                assert spec == r["mp_specs"][owner[0]], path
                owned += 1
        assert owned == 2 * len(r["mp_specs"])  # a momentum and a velocity for every weight
        np.testing.assert_allclose(r["mp_losses"], r["reference_losses"], **close)
        assert r["mp_before_gap"] < 1e-4 and r["mp_after_gap"] < 1e-4
        # Saved under ModelParallel, reloaded without a distribution: one device, same outputs.
        assert r["reloaded_gap"] < 1e-5 and r["reloaded_devices"] == ["cpu:0"]
        # Uneven batches: our check says so up front; JAX itself stops at the batch.
        assert r["dp_batch_error"].startswith("ValueError: batch_size=5 does not split across 2")
        assert "last batch of 13" in r["dp_last_batch_error"]
        assert r["jax_batch_error"].startswith("IndivisibleError")
    elif BACKEND == "tensorflow":
        assert r["replicas"] == 2
        assert r["variable_types"] == ["MirroredVariable"]
        assert r["variable_devices"] == ["device:CPU:0", "device:CPU:1"]
        # Equal tokens per replica: the same curve as one device (the loss is scaled by
        # 1 / replicas as Keras's own losses are; unscaled it came out twice as large).
        np.testing.assert_allclose(r["mirrored_losses"], r["single_losses"], **close)
        assert r["output_gap"] < 1e-4
        assert np.isfinite(r["ragged_losses"]).all()
        assert r["ragged_losses"][-1] < r["ragged_losses"][0]
        assert r["batch_error"].startswith("ValueError: batch_size=5 does not split across 2")
        assert r["tf_batch_error"].startswith("InvalidArgumentError")
        # With dropout: it trains, and each replica's Dropout runs the split draws (their
        # rate, and their scale, 7e-6 from Keras's dropout's).
        assert np.isfinite(r["dropout_losses"]).all()
        assert r["dropout_losses"][-1] < r["dropout_losses"][0]
        p = effective_rate(0.1)
        assert len(r["replica_drop_fractions"]) == 2
        for fraction, scales in zip(r["replica_drop_fractions"], r["replica_scales"]):
            assert abs(fraction - p) < 0.005
            np.testing.assert_allclose(scales, [1 / (1 - p)], rtol=1e-6)
    else:
        assert r["ddp_flags"] == [True, True] and r["num_weights"] == 46
        np.testing.assert_allclose(r["ddp_losses"], r["single_losses"], rtol=0, atol=1e-5)
        assert r["ranks_gap"] == 0.0  # DDP keeps the replicas identical
        assert r["single_gap"] < 1e-5  # averaged gradients = the full batch's gradient


def test_distributed_training_example_quick(tmp_path):
    out = run_checked([os.path.join(ROOT, "examples", "distributed_training.py"), "--quick",
                       "--output-dir", str(tmp_path)], tmp_path)
    engines = {"jax": ["DataParallel over 2", "ModelParallel on a (1, 2) mesh"],
               "tensorflow": ["MirroredStrategy over 2"],
               "torch": ["DistributedDataParallel over 2"]}[BACKEND]
    for engine in ["one ", *engines]:
        assert re.search(rf"^{re.escape(engine)}.*replicas \d  loss per epoch \d", out, re.M), out
    gaps = [float(g) for g in re.findall(r"largest loss difference from one device (\S+)", out)]
    assert len(gaps) == len(engines) and max(gaps) < 5e-3, out
    saved = {"jax": "model_parallel.keras", "tensorflow": None, "torch": "ddp.keras"}[BACKEND]
    if saved:
        reloaded = keras.models.load_model(tmp_path / saved, compile=False)
        assert reloaded.get_layer("logits").kernel.shape[0] == 32  # --quick's d_model
    if BACKEND == "jax":
        gap = float(re.search(r"max logit difference (\S+)", out).group(1))
        assert gap < 1e-5
