"""build_transformer: structure, hand-built equivalence, leak tests and training."""

import keras
import numpy as np
import pytest

from helpers import jit_options, to_np
from keras_tfm import (MaskedAccuracy, MaskedSparseCategoricalCrossentropy, TokenAndPositionEmbedding,
                       TransformerDecoderBlock, TransformerEncoderBlock, TransformerSchedule,
                       build_transformer)
from reverse_task_data import reverse_task

SMALL = dict(d_model=16, num_heads=2, ff_dim=32, num_encoder_layers=2, num_decoder_layers=2)


def tokens(shape, vocab, seed=0, lengths=None):
    t = np.random.default_rng(seed).integers(3, vocab, shape).astype("int32")
    if lengths is not None:
        t[np.arange(shape[1])[None, :] >= np.asarray(lengths)[:, None]] = 0
    return t


def test_inputs_outputs_and_names_follow_the_seed_diagram():
    model = build_transformer(30, 40, **SMALL)
    assert [i.name for i in model.inputs] == ["encoder_tokens", "decoder_tokens"]
    out = model([tokens((2, 7), 30), tokens((2, 5), 40)])
    assert tuple(out.shape) == (2, 5, 40)  # S != T
    names = [layer.name for layer in model.layers]
    for name in ("encoder_embedding", "encoder_block_0", "encoder_block_1", "decoder_embedding",
                 "decoder_block_0", "decoder_block_1", "logits"):
        assert name in names
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    summary = "\n".join(lines)
    assert "TransformerEncoderBlock" in summary or "TransformerEncode" in summary
    assert "decoder_block_1" in summary


def test_pre_ln_model_ends_each_stack_with_a_norm():
    model = build_transformer(30, 40, norm_first=True, **SMALL)
    names = [layer.name for layer in model.layers]
    assert "encoder_norm" in names and "decoder_norm" in names
    assert model.get_layer("encoder_block_0").norm_first


def build_by_hand(src_vocab, tgt_vocab, d_model, num_heads, ff_dim, num_layers, dropout=0.1):
    """The README's hand-built model, layer for layer."""
    encoder_tokens = keras.Input((None,), dtype="int32", name="encoder_tokens")
    decoder_tokens = keras.Input((None,), dtype="int32", name="decoder_tokens")
    x = TokenAndPositionEmbedding(src_vocab, d_model, name="encoder_embedding")(encoder_tokens)
    x = keras.layers.Dropout(dropout)(x)
    for i in range(num_layers):
        x = TransformerEncoderBlock(num_heads, ff_dim, dropout=dropout,
                                    name=f"encoder_block_{i}")(x)
    y = TokenAndPositionEmbedding(tgt_vocab, d_model, name="decoder_embedding")(decoder_tokens)
    y = keras.layers.Dropout(dropout)(y)
    for i in range(num_layers):
        y = TransformerDecoderBlock(num_heads, ff_dim, dropout=dropout,
                                    name=f"decoder_block_{i}")(y, x)
    logits = keras.layers.Dense(tgt_vocab, name="logits")(y)
    return keras.Model([encoder_tokens, decoder_tokens], logits)


def test_hand_built_model_equals_build_transformer():
    model = build_transformer(30, 40, **SMALL)
    by_hand = build_by_hand(30, 40, 16, 2, 32, 2)
    by_hand.set_weights(model.get_weights())
    src = tokens((3, 6), 30, 1, lengths=[6, 4, 2])
    tgt = tokens((3, 5), 40, 2, lengths=[5, 5, 3])
    np.testing.assert_allclose(to_np(by_hand([src, tgt])), to_np(model([src, tgt])), atol=1e-5)
    assert [w.path for w in by_hand.weights] == [w.path for w in model.weights]


@pytest.mark.parametrize("norm_first", [False, True])
def test_leaks_later_decoder_tokens_and_padded_source(norm_first):
    model = build_transformer(30, 40, norm_first=norm_first, **SMALL)
    src = tokens((2, 6), 30, 3, lengths=[6, 3])
    tgt = tokens((2, 5), 40, 4)
    base = to_np(model([src, tgt]))
    later = tgt.copy()
    later[:, 3:] = tokens((2, 2), 40, 5)
    np.testing.assert_allclose(to_np(model([src, later]))[:, :3], base[:, :3], atol=1e-5)
    assert not np.allclose(to_np(model([src, later]))[:, 3:], base[:, 3:], atol=1e-5)
    # More padding after the source changes nothing.
    src_longer = np.concatenate([src, np.zeros((2, 3), "int32")], axis=1)
    np.testing.assert_allclose(to_np(model([src_longer, tgt])), base, atol=1e-5)


def test_padded_source_values_do_not_leak_through_the_encoder_output():
    # Garbage at the padded source positions (fed through the model's own layers with the
    # same padding mask) changes no logit.
    model = build_transformer(30, 40, **SMALL)
    src = tokens((2, 6), 30, 6, lengths=[4, 2])
    tgt = tokens((2, 5), 40, 7)
    base = to_np(model([src, tgt]))
    embedding = model.get_layer("encoder_embedding")
    x = to_np(embedding(src))
    garbage = np.where((src != 0)[..., None], x, 100.0 * np.random.default_rng(8).normal(size=x.shape))
    mask = src != 0
    h = garbage.astype("float32")
    for i in range(2):
        h = model.get_layer(f"encoder_block_{i}")(h, mask=mask)
    y = model.get_layer("decoder_embedding")(tgt)
    for i in range(2):
        y = model.get_layer(f"decoder_block_{i}")(y, h, inputs_mask=np.ones_like(tgt, bool),
                                                  encoder_outputs_mask=mask)
    np.testing.assert_allclose(to_np(model.get_layer("logits")(y)), base, atol=1e-4)


def test_tied_embeddings_share_the_target_matrix():
    model = build_transformer(30, 40, tie_embeddings=True, **SMALL)
    untied = build_transformer(30, 40, **SMALL)
    assert "logits" not in [layer.name for layer in model.layers]
    assert model.count_params() == untied.count_params() - (16 * 40 + 40)
    src, tgt = tokens((2, 6), 30, 9), tokens((2, 5), 40, 10)
    logits = to_np(model([src, tgt]))
    emb = model.get_layer("decoder_embedding")
    # logits = h Eᵀ with the decoder embedding's own matrix E (40 x 16)
    assert logits.shape == (2, 5, 40)
    table = to_np(emb.token_embedding.embeddings)
    hidden = np.linalg.lstsq(table, logits.reshape(-1, 40).T, rcond=None)[0].T
    np.testing.assert_allclose(hidden @ table.T, logits.reshape(-1, 40), atol=1e-3)


def test_fit_lowers_the_loss_on_a_reverse_task():
    src, dec_in, tgt = reverse_task(256, seed=0)
    model = build_transformer(12, 12, d_model=32, num_heads=4, ff_dim=64, num_encoder_layers=1,
                              num_decoder_layers=1, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(TransformerSchedule(32, warmup_steps=30,
                                                                      scale=0.5)),
                  loss=MaskedSparseCategoricalCrossentropy(), metrics=[MaskedAccuracy()],
                  **jit_options())
    history = model.fit([src, dec_in], tgt, batch_size=32, epochs=10, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert history.history["masked_accuracy"][-1] > 0.4


def test_model_errors():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by num_heads=4"):
        build_transformer(10, 10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="positional.*'alibi'"):
        build_transformer(10, 10, d_model=16, num_heads=2, positional="alibi")
    with pytest.raises(ValueError, match="max_length.*required"):
        build_transformer(10, 10, d_model=16, num_heads=2, positional="learned")
    with pytest.raises(ValueError, match="num_encoder_layers"):
        build_transformer(10, 10, d_model=16, num_heads=2, num_encoder_layers=0)
    model = build_transformer(10, 10, d_model=16, num_heads=2, ff_dim=8, num_encoder_layers=1,
                              num_decoder_layers=1, positional="learned", max_length=6)
    with pytest.raises(ValueError, match="sequence_length=6"):
        model([np.ones((1, 8), "int32"), np.ones((1, 3), "int32")])
