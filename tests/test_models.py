"""build_language_model and build_encoder: a transformers Llama oracle, masks, training, saving."""

import keras
import numpy as np
import pytest
import torch

from helpers import jit_options, llama_and_language_model, to_np
from keras_tfm import (LanguageModel, MaskedSparseCategoricalCrossentropy, build_encoder,
                       build_language_model)


def tokens(batch, length, vocab=64, seed=0, low=3):
    return np.random.default_rng(seed).integers(low, vocab, (batch, length)).astype("int32")


def small_lm(**kwargs):
    kwargs = dict(d_model=32, num_heads=4, ff_dim=64, num_layers=2) | kwargs
    return build_language_model(64, **kwargs)


def test_language_model_equals_transformers_llama():
    llama, lm = llama_and_language_model()
    x = tokens(3, 11, seed=1)
    with torch.no_grad():
        expected = llama(torch.from_numpy(x).long()).logits.numpy()
    np.testing.assert_allclose(to_np(lm(x)), expected, atol=1e-4)
    assert np.abs(expected).max() > 0.1  # the logits are not trivially small


@pytest.mark.parametrize("positional", ["rotary", "sinusoidal", "learned"])
def test_language_model_is_causal_and_ignores_padding(positional):
    lm = small_lm(positional=positional, max_length=16, num_key_value_heads=2)
    x = tokens(2, 9, seed=2)
    base = to_np(lm(x))
    future = x.copy()
    future[:, 5:] = tokens(2, 4, seed=3)
    np.testing.assert_allclose(to_np(lm(future))[:, :5], base[:, :5], atol=1e-5)
    assert np.abs(to_np(lm(future))[:, 5:] - base[:, 5:]).max() > 1e-4
    # right padding (pad id 0) leaves the real positions as they are
    padded = np.concatenate([x, np.zeros((2, 4), "int32")], axis=1)
    np.testing.assert_allclose(to_np(lm(padded))[:, :9], base, atol=1e-5)
    # a padding id inside a sequence is masked as a key (which causality alone would not
    # hide from the later positions): its embedding row is invisible to every other position
    holed = x.copy()
    holed[:, 3] = 0
    before = to_np(lm(holed))
    table = lm.get_layer("token_embedding").embeddings
    value = to_np(table)
    value[0] += np.random.default_rng(4).normal(size=value.shape[1])  # a norm hides constants
    table.assign(value)
    after = to_np(lm(holed))
    np.testing.assert_allclose(np.delete(after, 3, axis=1), np.delete(before, 3, axis=1),
                               atol=1e-5)
    assert np.abs(after[:, 3] - before[:, 3]).max() > 1e-4
    assert np.isfinite(to_np(lm(np.zeros((1, 4), "int32")))).all()


def test_language_model_trains_with_fit_on_next_tokens():
    lm = small_lm(dropout=0.1)
    lm.compile(optimizer=keras.optimizers.Adam(3e-3),
               loss=MaskedSparseCategoricalCrossentropy(), **jit_options())
    # a counting language: each token is the previous one plus one (mod 60, ids 3..62)
    starts = np.random.default_rng(0).integers(0, 60, 256)
    data = (3 + (starts[:, None] + np.arange(13)[None]) % 60).astype("int32")
    data[::3, 9:] = 0  # some rows padded
    history = lm.fit(data[:, :-1], data[:, 1:], batch_size=32, epochs=6, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]


def test_language_model_keras_file_keeps_config_weights_and_special_ids(tmp_path):
    lm = small_lm(num_key_value_heads=1, normalization="rms_norm", gated_feed_forward=True,
                  activation="silu", pad_id=0, end_id=2, start_id=1)
    x = tokens(2, 6)
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, LanguageModel)
    assert restored.special_ids == {"pad_id": 0, "end_id": 2, "start_id": 1}
    assert restored.get_config() == lm.get_config()
    np.testing.assert_allclose(to_np(restored(x)), to_np(lm(x)), atol=1e-6)
    clone = LanguageModel.from_config(lm.get_config())
    assert clone.count_params() == lm.count_params()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_language_model_and_encoder_mixed_precision(policy):
    keras.config.set_dtype_policy(policy)
    try:
        x = tokens(2, 6)
        x[1, 3:] = 0
        for model in (small_lm(num_key_value_heads=2, normalization="rms_norm"),
                      build_encoder(64, d_model=32, num_heads=4, ff_dim=64, num_layers=1,
                                    num_classes=2)):
            out = model(x)
            assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
            assert np.isfinite(to_np(keras.ops.cast(out, "float32"))).all()
            assert all(keras.backend.standardize_dtype(w.dtype) == "float32"
                       for w in model.weights)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_encoder_classifier_pools_real_tokens_only(pooling):
    encoder = build_encoder(64, d_model=32, num_heads=4, ff_dim=64, num_layers=2, num_classes=3,
                            pooling=pooling, dropout=0.0)
    x = tokens(2, 7, seed=4)
    logits = to_np(encoder(x))
    assert logits.shape == (2, 3)
    padded = np.concatenate([x, np.zeros((2, 5), "int32")], axis=1)
    np.testing.assert_allclose(to_np(encoder(padded)), logits, atol=1e-5)
    # bidirectional: the first position sees the last token
    features = build_encoder(64, d_model=32, num_heads=4, ff_dim=64, num_layers=1, dropout=0.0)
    changed = x.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 61 + 3
    assert to_np(features(x)).shape == (2, 7, 32)
    assert np.abs(to_np(features(changed))[:, 0] - to_np(features(x))[:, 0]).max() > 1e-4


def test_encoder_keras_file_round_trip(tmp_path):
    encoder = build_encoder(64, d_model=32, num_heads=4, ff_dim=64, num_layers=1, num_classes=2,
                            positional="rotary", num_key_value_heads=2, norm_first=True,
                            pad_id=5)
    x = tokens(2, 6)
    x[0, 4:] = 5
    path = str(tmp_path / "encoder.keras")
    encoder.save(path)
    restored = keras.saving.load_model(path)
    assert restored.special_ids == {"pad_id": 5}
    np.testing.assert_allclose(to_np(restored(x)), to_np(encoder(x)), atol=1e-6)
    # pad id 5 is padding: the padded row equals its unpadded part
    np.testing.assert_allclose(to_np(encoder(x[:1, :4]))[0], to_np(encoder(x))[0], atol=1e-5)


def test_model_errors_name_the_values():
    with pytest.raises(ValueError, match="positional='alibi'"):
        small_lm(positional="alibi")
    with pytest.raises(ValueError, match="max_length=None"):
        small_lm(positional="learned")
    with pytest.raises(ValueError, match="num_heads=4, num_key_value_heads=3"):
        small_lm(num_key_value_heads=3)
    with pytest.raises(ValueError, match="end_id=64"):
        small_lm(end_id=64)
    with pytest.raises(ValueError, match="end_id=3 and pad_id=3"):
        small_lm(end_id=3, pad_id=3)
    with pytest.raises(ValueError, match="pooling='max'"):
        build_encoder(64, num_classes=2, pooling="max")


@pytest.mark.parametrize("kind", ["language_model", "encoder", "seq2seq"])
def test_dtype_policy_round_trips_and_quantized_models_reload(kind, tmp_path):
    import keras_tfm

    def build(**kwargs):
        if kind == "language_model":
            return small_lm(**kwargs)
        if kind == "encoder":
            return build_encoder(64, d_model=32, num_heads=4, ff_dim=64, num_layers=1,
                                 num_classes=3, **kwargs)
        return keras_tfm.build_transformer(64, 64, d_model=32, num_heads=4, ff_dim=64,
                                           num_encoder_layers=1, num_decoder_layers=1,
                                           **kwargs)

    def call(model):
        x = tokens(2, 5)
        return to_np(model([x, x]) if kind == "seq2seq" else model(x))

    # A policy given (or global when the model was built) is kept by the config.
    model = build(dtype="bfloat16")
    clone = type(model).from_config(model.get_config())
    assert {layer.dtype_policy.name for layer in clone.layers if layer.weights} == {"bfloat16"}
    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    keras.config.set_dtype_policy("float32")
    clone = type(model).from_config(model.get_config())
    assert {layer.dtype_policy.name for layer in clone.layers
            if layer.weights} == {"mixed_float16"}
    # Quantized, saved and loaded: the same outputs.
    model = build()
    model.quantize("int8")
    model.save(tmp_path / "q.keras")
    np.testing.assert_allclose(call(keras.models.load_model(tmp_path / "q.keras")), call(model),
                               atol=1e-6)


def test_an_id_outside_the_vocabulary_gives_nan_in_language_and_encoder_models():
    bad = tokens(2, 5)
    bad[1, 2] = 64
    for model in (small_lm(), build_encoder(64, d_model=32, num_heads=4, ff_dim=64,
                                            num_layers=1, num_classes=3)):
        out = to_np(model(bad))
        assert np.isnan(out[1]).any() and np.isfinite(out[0]).all()
