"""FeedForward, TokenAndPositionEmbedding, TransformerEncoderBlock and TransformerDecoderBlock."""

import keras
import numpy as np
import pytest
import torch

from helpers import (assert_config_round_trip, run_layer_test, run_mixed_precision_test, to_np,
                     torch_block_from)
from keras_tfm import (FeedForward, TokenAndPositionEmbedding, TransformerDecoderBlock,
                       TransformerEncoderBlock)
from keras_tfm.masks import keras_mask
from keras_tfm.positional import sinusoidal_encoding


def random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def padding(lengths, total):
    return np.arange(total)[None, :] < np.asarray(lengths)[:, None]


# --- FeedForward --------------------------------------------------------------------------

def test_feed_forward_formula_and_position_wise():
    x = random((2, 4, 6))
    layer = FeedForward(ff_dim=10)
    out = to_np(layer(x))
    w1, b1 = to_np(layer.intermediate_dense.kernel), to_np(layer.intermediate_dense.bias)
    w2, b2 = to_np(layer.output_dense.kernel), to_np(layer.output_dense.bias)
    np.testing.assert_allclose(out, np.maximum(x @ w1 + b1, 0) @ w2 + b2, atol=1e-5)
    assert out.shape == x.shape  # output width = input width
    # The same weights at every position: a position alone gives the same vector.
    np.testing.assert_allclose(to_np(layer(x[:, 2:3]))[:, 0], out[:, 2], atol=1e-6)


def test_feed_forward_contract_and_errors():
    run_layer_test(lambda: FeedForward(ff_dim=16, activation="gelu", dropout=0.1),
                   lambda layer, x: layer(x), [random((3, 4, 8))], expected_shape=(3, 4, 8))
    with pytest.raises(ValueError, match="ff_dim"):
        FeedForward(ff_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        FeedForward(ff_dim=4, dropout=1.5)


# --- TokenAndPositionEmbedding ------------------------------------------------------------

def test_token_and_position_embedding_scales_and_adds_positions():
    tokens = np.array([[3, 1, 4, 0], [5, 9, 0, 0]])
    layer = TokenAndPositionEmbedding(vocab_size=10, d_model=8)
    out = layer(tokens)
    table = to_np(layer.token_embedding.embeddings)
    expected = table[tokens] * np.sqrt(8) + to_np(sinusoidal_encoding(4, 8))[None]
    np.testing.assert_allclose(to_np(out), expected, atol=1e-5)
    np.testing.assert_array_equal(to_np(keras_mask(out)), tokens != 0)  # the padding mask
    unscaled = TokenAndPositionEmbedding(10, 8, scale=False, mask_zero=False)
    out = unscaled(tokens)
    assert keras_mask(out) is None
    expected = to_np(unscaled.token_embedding.embeddings)[tokens] + to_np(
        sinusoidal_encoding(4, 8))[None]
    np.testing.assert_allclose(to_np(out), expected, atol=1e-5)


def test_learned_positions_and_errors():
    layer = TokenAndPositionEmbedding(10, 8, max_length=6, positional="learned")
    tokens = np.array([[1, 2, 3]])
    out = to_np(layer(tokens, start_index=2))
    expected = to_np(layer.token_embedding.embeddings)[tokens] * np.sqrt(8) + to_np(
        layer.position.position_embeddings)[None, 2:5]
    np.testing.assert_allclose(out, expected, atol=1e-5)
    assert_config_round_trip(layer)
    with pytest.raises(ValueError, match="max_length.*required"):
        TokenAndPositionEmbedding(10, 8, positional="learned")
    with pytest.raises(ValueError, match="positional.*'rotary'"):
        TokenAndPositionEmbedding(10, 8, positional="rotary")


def test_reverse_projects_with_the_transposed_embedding():
    layer = TokenAndPositionEmbedding(10, 4)
    layer(np.array([[1]]))
    hidden = random((2, 3, 4))
    np.testing.assert_allclose(to_np(layer(hidden, reverse=True)),
                               hidden @ to_np(layer.token_embedding.embeddings).T, atol=1e-5)


# --- Encoder and decoder blocks against torch.nn ------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_equals_torch_encoder_layer(norm_first):
    d_model, length = 16, 6
    x = random((3, length, d_model), 1)
    pad = padding([6, 4, 2], length)
    block = TransformerEncoderBlock(num_heads=4, ff_dim=32, dropout=0.0, norm_first=norm_first)
    ours = to_np(block(x, mask=pad))
    ref = torch_block_from(block, d_model)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x.astype("float64")),
                       src_key_padding_mask=torch.from_numpy(~pad)).numpy()
    # torch's fast path may zero padded rows; compare the real positions.
    np.testing.assert_allclose(ours[pad], expected[pad], atol=1e-5)
    # with an explicit causal attention mask too
    causal = np.tril(np.ones((length, length), bool))
    ours = to_np(block(x, attention_mask=causal, mask=pad))
    with torch.no_grad():
        expected = ref(torch.from_numpy(x.astype("float64")),
                       src_mask=torch.from_numpy(~causal),
                       src_key_padding_mask=torch.from_numpy(~pad)).numpy()
    np.testing.assert_allclose(ours[pad], expected[pad], atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_equals_torch_decoder_layer(norm_first):
    d_model, tgt_len, src_len = 16, 5, 7
    y, memory = random((3, tgt_len, d_model), 2), random((3, src_len, d_model), 3)
    tgt_pad, src_pad = padding([5, 3, 1], tgt_len), padding([7, 2, 5], src_len)
    block = TransformerDecoderBlock(num_heads=4, ff_dim=32, dropout=0.0, norm_first=norm_first)
    ours = to_np(block(y, memory, inputs_mask=tgt_pad, encoder_outputs_mask=src_pad))
    ref = torch_block_from(block, d_model, decoder=True)
    causal = ~np.tril(np.ones((tgt_len, tgt_len), bool))  # torch: True = blocked
    with torch.no_grad():
        expected = ref(torch.from_numpy(y.astype("float64")),
                       torch.from_numpy(memory.astype("float64")),
                       tgt_mask=torch.from_numpy(causal),
                       tgt_key_padding_mask=torch.from_numpy(~tgt_pad),
                       memory_key_padding_mask=torch.from_numpy(~src_pad)).numpy()
    np.testing.assert_allclose(ours[tgt_pad], expected[tgt_pad], atol=1e-5)


def test_blocks_take_keras_masks_in_the_functional_api():
    src = keras.Input((None,), dtype="int32")
    tgt = keras.Input((None,), dtype="int32")
    enc_emb, dec_emb = TokenAndPositionEmbedding(20, 8), TokenAndPositionEmbedding(20, 8)
    encoder = TransformerEncoderBlock(2, 16, dropout=0.0)
    decoder = TransformerDecoderBlock(2, 16, dropout=0.0)
    memory = encoder(enc_emb(src))
    out = decoder(dec_emb(tgt), memory)
    assert out._keras_mask is not None
    model = keras.Model([src, tgt], out)
    src_tok = np.array([[1, 2, 3, 0], [4, 0, 0, 0]])
    tgt_tok = np.array([[5, 6, 0], [7, 8, 9]])
    got = to_np(model([src_tok, tgt_tok]))
    mem = encoder(enc_emb(src_tok), mask=src_tok != 0)
    expected = decoder(dec_emb(tgt_tok), mem, inputs_mask=tgt_tok != 0,
                       encoder_outputs_mask=src_tok != 0)
    np.testing.assert_allclose(got, to_np(expected), atol=1e-5)
    unmasked = decoder(dec_emb(tgt_tok), encoder(enc_emb(src_tok), mask=np.ones((2, 4), bool)),
                       inputs_mask=tgt_tok != 0, encoder_outputs_mask=np.ones((2, 4), bool))
    assert not np.allclose(got, to_np(unmasked), atol=1e-4)  # the masks did something


def test_decoder_block_is_causal_and_ignores_source_padding():
    y, memory = random((2, 6, 8), 4), random((2, 5, 8), 5)
    src_pad = padding([5, 3], 5)
    block = TransformerDecoderBlock(2, 16, dropout=0.0)
    base = to_np(block(y, memory, encoder_outputs_mask=src_pad))
    future = y.copy()
    future[:, 3:] = random((2, 3, 8), 6)
    np.testing.assert_allclose(to_np(block(future, memory, encoder_outputs_mask=src_pad))[:, :3],
                               base[:, :3], atol=1e-6)
    padded = np.where(src_pad[..., None], memory, random((2, 5, 8), 7))
    np.testing.assert_allclose(to_np(block(y, padded, encoder_outputs_mask=src_pad)), base,
                               atol=1e-6)


def _encoder():
    return TransformerEncoderBlock(num_heads=2, ff_dim=16, dropout=0.1, norm_first=True)


def _decoder():
    return TransformerDecoderBlock(num_heads=2, ff_dim=16, dropout=0.1, attention_dropout=0.0,
                                   activation_dropout=0.2, activation="gelu")


def test_encoder_block_contract():
    run_layer_test(_encoder, lambda layer, x: layer(x), [random((3, 5, 8))],
                   expected_shape=(3, 5, 8))


def test_decoder_block_contract():
    run_layer_test(_decoder, lambda layer, y, m: layer(y, m), [random((3, 4, 8)), random((3, 6, 8))],
                   expected_shape=(3, 4, 8))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_encoder_block_mixed_precision(policy):
    run_mixed_precision_test(_encoder, lambda layer, x: layer(x), [random((3, 5, 8))], policy)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_decoder_block_mixed_precision(policy):
    run_mixed_precision_test(_decoder, lambda layer, y, m: layer(y, m),
                             [random((3, 4, 8)), random((3, 6, 8))], policy)


def test_block_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by num_heads=4"):
        TransformerEncoderBlock(num_heads=4, ff_dim=8)(random((1, 3, 10)))
    with pytest.raises(ValueError, match=r"decoder width \(8\).*encoder output width \(12\)"):
        TransformerDecoderBlock(num_heads=2, ff_dim=8)(random((1, 3, 8)), random((1, 4, 12)))
    with pytest.raises(ValueError, match="attention_dropout"):
        TransformerEncoderBlock(num_heads=2, ff_dim=8, attention_dropout=-1)
    with pytest.raises(ValueError, match="activation_dropout"):
        TransformerEncoderBlock(num_heads=2, ff_dim=8, activation_dropout=1.5)
    with pytest.raises(ValueError, match="rank 3"):
        TransformerEncoderBlock(num_heads=2, ff_dim=8)(random((3, 8)))


def test_dropout_rates_reach_each_sublayer():
    block = _decoder()
    block(random((2, 4, 8)), random((2, 6, 8)))
    assert block.self_attention.dropout == 0.0 and block.cross_attention.dropout == 0.0
    assert block.feed_forward.dropout == 0.2
    assert block.self_attention_dropout.rate == 0.1 and block.feed_forward_dropout.rate == 0.1
    encoder = _encoder()
    encoder(random((2, 4, 8)))
    assert encoder.self_attention.dropout == 0.1 and encoder.feed_forward.dropout == 0.1
