"""Decoder-only blocks (no cross-attention), the gated feed-forward and RMSNorm in the blocks."""

import keras
import numpy as np
import pytest
import torch

from helpers import (assert_config_round_trip, run_layer_test, run_mixed_precision_test, to_np,
                     torch_block_from)
from keras_tfm import FeedForward, TransformerDecoderBlock, TransformerEncoderBlock


def random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def np_silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("activation,fn", [("silu", np_silu), ("relu", lambda x: np.maximum(x, 0))])
def test_gated_feed_forward_formula(activation, fn):
    x = random((2, 4, 6))
    layer = FeedForward(ff_dim=10, activation=activation, gated=True, use_bias=False)
    out = to_np(layer(x))
    w1, v = to_np(layer.intermediate_dense.kernel), to_np(layer.up_dense.kernel)
    w2 = to_np(layer.output_dense.kernel)
    np.testing.assert_allclose(out, (fn(x @ w1) * (x @ v)) @ w2, atol=1e-5)
    assert layer.intermediate_dense.bias is None and len(layer.weights) == 3
    assert_config_round_trip(layer)


def test_gated_feed_forward_contract():
    run_layer_test(lambda: FeedForward(ff_dim=16, activation="gelu", gated=True, dropout=0.1),
                   lambda layer, x: layer(x), [random((3, 4, 8))], expected_shape=(3, 4, 8))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_only_block_equals_torch_causal_encoder_layer(norm_first):
    x = random((2, 6, 8))
    block = TransformerDecoderBlock(num_heads=2, ff_dim=16, dropout=0.0, norm_first=norm_first)
    out = to_np(block(x))
    assert block.cross_attention is None
    assert not any("cross" in w.path for w in block.weights)
    ref = torch_block_from(block, 8, decoder=False)  # self-attention + feed-forward only
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    expected = ref(torch.from_numpy(x.astype("float64")), src_mask=causal).detach().numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5)


def np_rms_norm(x, scale, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def test_rms_norm_option_is_keras_rms_normalization_with_the_epsilon():
    x = random((2, 5, 8))
    block = TransformerEncoderBlock(num_heads=2, ff_dim=16, dropout=0.0, norm_first=True,
                                    normalization="rms_norm", layer_norm_epsilon=1e-3)
    block(x)
    norm = block.self_attention_norm
    assert isinstance(norm, keras.layers.RMSNormalization) and norm.epsilon == 1e-3
    np.testing.assert_allclose(to_np(norm(x)), np_rms_norm(x, to_np(norm.scale), 1e-3),
                               atol=1e-5)
    # the default stays LayerNormalization
    default = TransformerEncoderBlock(num_heads=2, ff_dim=16)
    default(x)
    assert isinstance(default.feed_forward_norm, keras.layers.LayerNormalization)


def _llama_block():
    return TransformerDecoderBlock(num_heads=4, ff_dim=24, dropout=0.1, norm_first=True,
                                   num_key_value_heads=2, rotary=True, normalization="rms_norm",
                                   gated_feed_forward=True, activation="silu", use_bias=False)


def test_llama_style_block_is_causal_and_ignores_padding():
    x = random((2, 6, 16))
    pad = np.arange(6)[None] < np.array([[6], [4]])
    block = _llama_block()
    base = to_np(block(x, inputs_mask=pad))
    assert block.self_attention.key_dense.kernel.shape == (16, 2, 4)
    assert block.self_attention.rotary and block.feed_forward.gated
    future = x.copy()
    future[:, 3:] = random((2, 3, 16), 9)
    np.testing.assert_allclose(to_np(block(future, inputs_mask=pad))[:, :3], base[:, :3],
                               atol=1e-5)
    # A masked key that causality allows (row 1, position 1): changing it changes no other
    # position (right padding alone would be hidden by the causal mask anyway).
    holes = np.ones((2, 6), bool)
    holes[1, 1] = False
    base = to_np(block(x, inputs_mask=holes))
    changed = x.copy()
    changed[1, 1] = random((16,), 5)
    out = to_np(block(changed, inputs_mask=holes))
    np.testing.assert_allclose(np.delete(out[1], 1, axis=0), np.delete(base[1], 1, axis=0),
                               atol=1e-5)
    np.testing.assert_allclose(out[0], base[0], atol=1e-6)
    assert np.abs(out[1, 1] - base[1, 1]).max() > 1e-3  # its own query still reads it
    # a fully padded sequence stays finite
    out = to_np(block(x, inputs_mask=np.zeros((2, 6), bool)))
    assert np.isfinite(out).all()


@pytest.mark.parametrize("split", [False, True])
def test_llama_style_block_cache_equals_full_pass(split):
    x = random((2, 5, 16))
    block = _llama_block()
    full = to_np(block(x))
    cache = np.zeros((2, 2, 2, 5, 4), "float32")  # (B, 2, kv heads, L, d)
    if split:  # its (keys, values) pair, generation's form
        cache = (cache[:, 0], cache[:, 1])
    out, cache = block(x[:, :3], self_attention_cache=cache, self_attention_cache_update_index=0)
    outs = [to_np(out)]
    for i in (3, 4):
        out, cache = block(x[:, i:i + 1], self_attention_cache=cache,
                           self_attention_cache_update_index=i)
        outs.append(to_np(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)
    assert isinstance(cache, tuple) == split
    spec = block.compute_output_spec(keras.KerasTensor((2, 1, 16)), self_attention_cache=cache,
                                     self_attention_cache_update_index=4)
    assert tuple(spec[0].shape) == (2, 1, 16)
    assert isinstance(spec[1], tuple) == split


def test_llama_style_block_contract():
    run_layer_test(_llama_block, lambda layer, x: layer(x), [random((3, 5, 16))],
                   expected_shape=(3, 5, 16))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_llama_style_block_mixed_precision(policy):
    run_mixed_precision_test(_llama_block, lambda layer, x: layer(x), [random((3, 5, 16))],
                             policy)


def test_decoder_only_scores_and_symbolic_shapes():
    x = keras.Input((5, 16))
    out, scores = _llama_block()(x, return_attention_scores=True)
    assert tuple(out.shape) == (None, 5, 16) and tuple(scores.shape) == (None, 4, 5, 5)


def test_decoder_only_block_errors():
    block = TransformerDecoderBlock(num_heads=2, ff_dim=8)
    block(random((1, 3, 8)))
    with pytest.raises(ValueError, match="built without `encoder_outputs`"):
        block(random((1, 3, 8)), random((1, 4, 8)))
    with pytest.raises(ValueError, match="normalization='batch'"):
        TransformerDecoderBlock(num_heads=2, ff_dim=8, normalization="batch")
    with pytest.raises(ValueError, match="num_heads=4, num_key_value_heads=3"):
        TransformerDecoderBlock(num_heads=4, ff_dim=8, num_key_value_heads=3)
    with pytest.raises(ValueError, match="even head size; received key_dim=3"):
        TransformerEncoderBlock(num_heads=2, ff_dim=8, rotary=True)(random((1, 3, 6)))
