"""Sinusoidal positional encoding (seed values) and learned position embeddings."""

import keras
import numpy as np
import pytest

from helpers import assert_config_round_trip, to_np
from keras_tfm import PositionEmbedding, SinusoidalPositionalEncoding
from keras_tfm.masks import keras_mask


def encode(length, width, start_index=0, dtype="float32"):
    layer = SinusoidalPositionalEncoding(dtype=dtype)
    return to_np(layer(np.zeros((1, length, width), dtype), start_index=start_index))[0]


def test_seed_values_d4():
    # Seed 000: with d = 4, p<1> ≈ (0.84, 0.54, 0.01, 1.00) and p<3> ≈ (0.14, -0.99, 0.03, 1.00).
    pe = encode(4, 4)
    np.testing.assert_allclose(pe[1], [0.84, 0.54, 0.01, 1.00], atol=5e-3)
    np.testing.assert_allclose(pe[3], [0.14, -0.99, 0.03, 1.00], atol=5e-3)
    np.testing.assert_allclose(pe[0], [0.0, 1.0, 0.0, 1.0], atol=1e-7)


def test_seed_values_d512():
    # Seed 000: for d = 512, pos = 1: P(1,0) = sin 1, P(1,1) = cos 1,
    # P(1,2) = sin(1 / 10000^(2/512)), P(1,3) = cos(1 / 10000^(2/512)).
    pe = encode(2, 512)
    angle = 1.0 / 10000 ** (2 / 512)
    np.testing.assert_allclose(pe[1, :4], [np.sin(1), np.cos(1), np.sin(angle), np.cos(angle)],
                               atol=1e-6)


def test_matches_numpy_formula_any_length():
    length, width = 300, 10  # no fixed maximum length
    pos = np.arange(length)[:, None]
    i = np.arange(width // 2)[None, :]
    angles = pos / 10000 ** (2 * i / width)
    expected = np.zeros((length, width))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angles), np.cos(angles)
    np.testing.assert_allclose(encode(length, width), expected, atol=2e-5)


def test_adds_to_inputs_and_start_index_chunks_equal_full():
    x = np.random.default_rng(0).normal(size=(2, 12, 6)).astype("float32")
    layer = SinusoidalPositionalEncoding()
    full = to_np(layer(x))
    np.testing.assert_allclose(full - x, np.broadcast_to(encode(12, 6), x.shape), atol=1e-6)
    chunks = [to_np(layer(x[:, s:s + 4], start_index=s)) for s in (0, 4, 8)]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), full, atol=1e-6)
    # start_index as a tensor (as in cached decoding)
    step = to_np(layer(x[:, 7:8], start_index=keras.ops.convert_to_tensor(7)))
    np.testing.assert_allclose(step, full[:, 7:8], atol=1e-6)


def test_odd_width_is_supported():
    # Width 5: pairs i = 0, 1 as usual, the last channel is the sine of pair i = 2.
    pe = encode(5, 5)
    pos = np.arange(5)
    for i in range(3):
        np.testing.assert_allclose(pe[:, 2 * i], np.sin(pos / 10000 ** (2 * i / 5)), atol=1e-6)
    for i in range(2):
        np.testing.assert_allclose(pe[:, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 5)), atol=1e-6)


def test_float16_stays_close_to_float32_at_position_4000():
    pe32 = encode(1, 64, start_index=4000)
    keras.config.set_dtype_policy("mixed_float16")
    layer = SinusoidalPositionalEncoding()
    out = layer(np.zeros((1, 1, 64), "float32"), start_index=4000)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    np.testing.assert_allclose(to_np(out)[0].astype("float32"), pe32, atol=1e-2)


def test_keras_mask_passes_through():
    tokens = np.array([[3, 4, 0, 0]])
    emb = keras.layers.Embedding(10, 4, mask_zero=True)
    symbolic = SinusoidalPositionalEncoding()(emb(keras.Input((None,), dtype="int32")))
    assert symbolic._keras_mask is not None
    eager = SinusoidalPositionalEncoding()(emb(tokens))
    np.testing.assert_array_equal(to_np(keras_mask(eager)), tokens != 0)


def test_sinusoidal_config_round_trip():
    layer = SinusoidalPositionalEncoding(max_wavelength=500.0)
    clone = assert_config_round_trip(layer)
    assert clone.max_wavelength == 500.0
    with pytest.raises(ValueError, match="max_wavelength"):
        SinusoidalPositionalEncoding(max_wavelength=0)


def test_position_embedding_adds_table_slice():
    layer = PositionEmbedding(sequence_length=8)
    x = np.random.default_rng(1).normal(size=(2, 5, 4)).astype("float32")
    out = to_np(layer(x))
    table = to_np(layer.position_embeddings)
    np.testing.assert_allclose(out, x + table[None, :5], atol=1e-6)
    shifted = to_np(layer(x[:, :3], start_index=5))
    np.testing.assert_allclose(shifted, x[:, :3] + table[None, 5:8], atol=1e-6)
    assert_config_round_trip(layer)


def test_position_embedding_too_long_is_a_clear_error():
    layer = PositionEmbedding(sequence_length=4)
    with pytest.raises(ValueError, match="sequence_length=4.*length 5"):
        layer(np.zeros((1, 5, 2), "float32"))
    with pytest.raises(ValueError, match="start_index=2"):
        layer(np.zeros((1, 3, 2), "float32"), start_index=2)
    with pytest.raises(ValueError, match="sequence_length"):
        PositionEmbedding(sequence_length=0)
    with pytest.raises(ValueError, match="rank 3"):
        PositionEmbedding(sequence_length=4)(np.zeros((1, 5), "float32"))


def np_marian_table(n_pos, dim):
    """MarianMT's table, written as transformers writes it (sines first, then cosines)."""
    angles = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
                       for pos in range(n_pos)])
    sentinel = dim // 2 + dim % 2
    out = np.empty((n_pos, dim))
    out[:, :sentinel] = np.sin(angles[:, 0::2])
    out[:, sentinel:] = np.cos(angles[:, 1::2])
    return out


@pytest.mark.parametrize("width", [8, 7])
def test_halves_layout_is_marians_table(width):
    layer = SinusoidalPositionalEncoding(layout="halves")
    out = to_np(layer(np.zeros((1, 50, width), "float32")))[0]
    np.testing.assert_allclose(out, np_marian_table(50, width), atol=2e-5)
    # The same numbers as the interleaved layout, in another channel order.
    interleaved = to_np(SinusoidalPositionalEncoding()(np.zeros((1, 50, width), "float32")))[0]
    order = list(range(0, width, 2)) + list(range(1, width, 2))
    np.testing.assert_allclose(out, interleaved[:, order], atol=1e-6)
    chunk = to_np(layer(np.zeros((1, 5, width), "float32"), start_index=45))[0]
    np.testing.assert_allclose(chunk, out[45:], atol=1e-5)
    clone = assert_config_round_trip(layer)
    assert clone.layout == "halves"
    with pytest.raises(ValueError, match="layout.*'sideways'"):
        SinusoidalPositionalEncoding(layout="sideways")


def test_embedding_pad_id_layout_and_reverse_bias():
    from keras_tfm import TokenAndPositionEmbedding
    from keras_tfm.masks import keras_mask as mask_of

    layer = TokenAndPositionEmbedding(12, 8, pad_id=11, positional_layout="halves",
                                      reverse_bias=True, scale=False)
    tokens = np.array([[3, 4, 11, 11]])
    out = layer(tokens)
    np.testing.assert_array_equal(to_np(mask_of(out)), [[True, True, False, False]])
    table = to_np(layer.token_embedding.embeddings)
    np.testing.assert_allclose(to_np(out)[0], table[tokens[0]] + np_marian_table(4, 8), atol=1e-5)
    layer.logits_bias.assign(np.arange(12, dtype="float32"))
    hidden = np.random.default_rng(0).normal(size=(1, 2, 8)).astype("float32")
    np.testing.assert_allclose(to_np(layer(hidden, reverse=True)),
                               hidden @ table.T + np.arange(12), atol=1e-5)
    assert_config_round_trip(layer)
    with pytest.raises(ValueError, match=r"pad_id.*\[0, 12\).*pad_id=12"):
        TokenAndPositionEmbedding(12, 8, pad_id=12)
    with pytest.raises(ValueError, match="positional_layout"):
        TokenAndPositionEmbedding(12, 8, positional_layout="odd")
