"""Scaled dot-product attention, MultiHeadSelfAttention and CrossAttention."""

import keras
import numpy as np
import pytest
import torch

from helpers import copy_attention_to_torch, np_attention, np_mha, run_layer_test, run_mixed_precision_test, to_np
from keras_tfm import (CrossAttention, MultiHeadSelfAttention,
                       scaled_dot_product_attention)
from keras_tfm.masks import keras_mask


def random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def padding(lengths, total):
    return np.arange(total)[None, :] < np.asarray(lengths)[:, None]


# --- the attention function -------------------------------------------------------------

@pytest.mark.parametrize("fused", [None, False])
def test_sdpa_matches_numpy_reference(fused):
    q, k, v = random((2, 4, 3, 8), 1), random((2, 6, 3, 8), 2), random((2, 6, 3, 5), 3)
    mask = padding([6, 3], 6)[:, None, :] & np.ones((2, 4, 6), bool)
    for m in (None, mask):
        expected, weights = np_attention(q, k, v, m)
        out = scaled_dot_product_attention(q, k, v, mask=m, fused=fused)
        np.testing.assert_allclose(to_np(out), expected, atol=1e-5)
    out, w = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    np.testing.assert_allclose(to_np(w), weights, atol=1e-6)


@pytest.mark.parametrize("fused", [None, False])
def test_causal_argument_equals_the_causal_mask(fused):
    # `causal=True` alone (the kernel's own causal masking on the fused path) and with a
    # padding mask (merged with the causal mask) against the masks built by hand.
    q, k, v = random((2, 5, 2, 8), 7), random((2, 5, 2, 8), 8), random((2, 5, 2, 8), 9)
    causal = np.tril(np.ones((5, 5), bool))[None]
    pad = padding([5, 0], 5)[:, None, :]  # second sequence fully padded: zeros
    for mask, expected_mask in ((None, causal), (pad, causal & pad)):
        out = to_np(scaled_dot_product_attention(q, k, v, mask=mask, causal=True, fused=fused))
        expected, _ = np_attention(q, k, v, expected_mask)
        np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_array_equal(out[1], 0.0)


def test_fused_and_explicit_paths_agree_with_masks():
    q, k, v = random((3, 5, 2, 8), 4), random((3, 5, 2, 8), 5), random((3, 5, 2, 8), 6)
    causal = np.tril(np.ones((5, 5), bool))
    mask = causal[None] & padding([5, 2, 0], 5)[:, None, :]  # third row fully padded
    fused = to_np(scaled_dot_product_attention(q, k, v, mask=mask))
    explicit = to_np(scaled_dot_product_attention(q, k, v, mask=mask, fused=False))
    np.testing.assert_allclose(fused, explicit, atol=1e-5)
    assert np.isfinite(fused).all() and np.isfinite(explicit).all()
    np.testing.assert_array_equal(fused[2], 0.0)
    np.testing.assert_array_equal(explicit[2], 0.0)


@pytest.mark.parametrize("queries", [1, 4])
def test_keys_heads_first_give_the_same_attention(queries):
    # The caches' layout (B, H, S, d): same outputs and weights as (B, S, H, d), on both paths,
    # with a padding mask that leaves the last row no key.
    q, k, v = random((3, queries, 2, 8), 10), random((3, 6, 2, 8), 11), random((3, 6, 2, 8), 12)
    mask = np.broadcast_to(padding([6, 3, 0], 6)[:, None, :], (3, queries, 6))
    k_first, v_first = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    for m in (None, mask):
        expected, weights = np_attention(q, k, v, m)
        for fused in (None, False):
            out = scaled_dot_product_attention(q, k_first, v_first, mask=m, fused=fused,
                                               heads_first=True)
            np.testing.assert_allclose(to_np(out), expected, atol=1e-5)
    out, w = scaled_dot_product_attention(q, k_first, v_first, mask=mask, return_weights=True,
                                          heads_first=True)
    np.testing.assert_allclose(to_np(w), weights, atol=1e-6)
    np.testing.assert_array_equal(to_np(out)[2], 0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_keys_heads_first_in_half_precision_are_as_accurate_as_the_fused_path(dtype):
    # A cached step (one query over 129 keys): its scores are summed in float32 as the fused
    # path's are, not rounded to the half-precision dtype first (which doubled the error).
    q, k, v = random((4, 1, 8, 64), 13) * 2, random((4, 129, 8, 64), 14) * 2, random(
        (4, 129, 8, 64), 15)
    expected, _ = np_attention(q, k, v)
    half = [keras.ops.cast(x, dtype) for x in (q, k, v, k.transpose(0, 2, 1, 3),
                                               v.transpose(0, 2, 1, 3))]
    fused = to_np(keras.ops.cast(scaled_dot_product_attention(*half[:3]), "float32"))
    first = to_np(keras.ops.cast(scaled_dot_product_attention(half[0], *half[3:],
                                                              heads_first=True), "float32"))
    assert np.abs(first - expected).mean() <= 1.1 * np.abs(fused - expected).mean()


def test_rows_with_no_allowed_key_are_zero_on_both_paths():
    # Left padding under a causal mask: query 0 may only see key 0, which is padding.
    q, k, v = random((1, 3, 2, 4), 7), random((1, 3, 2, 4), 8), random((1, 3, 2, 4), 9)
    mask = np.tril(np.ones((3, 3), bool))[None] & np.array([[False, True, True]])[:, None, :]
    for fused in (None, False):
        out = to_np(scaled_dot_product_attention(q, k, v, mask=mask, fused=fused))
        np.testing.assert_array_equal(out[0, 0], 0.0)
        assert np.abs(out[0, 1:]).sum() > 0
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    np.testing.assert_array_equal(to_np(weights)[0, :, 0], 0.0)
    np.testing.assert_allclose(to_np(weights)[0, :, 1:].sum(-1), 1.0, atol=1e-6)


# --- MultiHeadSelfAttention ---------------------------------------------------------------

def test_self_attention_matches_numpy_with_its_own_weights():
    x = random((2, 5, 12))
    layer = MultiHeadSelfAttention(num_heads=3)
    np.testing.assert_allclose(to_np(layer(x)), np_mha(layer, x, x), atol=1e-5)
    pad = padding([5, 3], 5)
    causal = np.tril(np.ones((5, 5), bool))
    expected = np_mha(layer, x, x, pad[:, None, :] & causal[None])
    got = layer(x, attention_mask=causal, mask=pad)
    np.testing.assert_allclose(to_np(got), expected, atol=1e-5)
    causal_layer = MultiHeadSelfAttention(num_heads=3, causal=True)
    causal_layer(x)
    causal_layer.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_np(causal_layer(x, mask=pad)), expected, atol=1e-5)


def test_key_dim_and_value_dim():
    x = random((2, 4, 8))
    layer = MultiHeadSelfAttention(num_heads=2, key_dim=3, value_dim=5)
    out, scores = layer(x, return_attention_scores=True)
    assert tuple(out.shape) == (2, 4, 8) and tuple(scores.shape) == (2, 2, 4, 4)
    assert tuple(layer.query_dense.kernel.shape) == (8, 2, 3)
    assert tuple(layer.value_dense.kernel.shape) == (8, 2, 5)
    np.testing.assert_allclose(to_np(out), np_mha(layer, x, x), atol=1e-5)
    # default key_dim = d_model // num_heads: one projection per head
    default = MultiHeadSelfAttention(num_heads=4)
    default(x)
    assert tuple(default.key_dense.kernel.shape) == (8, 4, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_equals_torch_multihead_attention(causal):
    d_model, heads, length = 16, 4, 6
    x = random((3, length, d_model), 11)
    pad = padding([6, 4, 1], length)
    layer = MultiHeadSelfAttention(num_heads=heads, causal=causal)
    ours = to_np(layer(x, mask=pad))
    mha = torch.nn.MultiheadAttention(d_model, heads, batch_first=True, dtype=torch.float64)
    copy_attention_to_torch(layer, mha)
    attn_mask = None
    if causal:  # torch: True = NOT allowed
        attn_mask = torch.from_numpy(~np.tril(np.ones((length, length), bool)))
    xt = torch.from_numpy(x.astype("float64"))
    expected, _ = mha(xt, xt, xt, key_padding_mask=torch.from_numpy(~pad), attn_mask=attn_mask,
                      need_weights=False)
    np.testing.assert_allclose(ours, expected.detach().numpy(), atol=1e-5)


def test_causal_leak_future_tokens_change_no_earlier_output():
    x = random((2, 7, 8), 12)
    changed = x.copy()
    changed[:, 4:] = random((2, 3, 8), 13)
    layer = MultiHeadSelfAttention(num_heads=2, causal=True)
    for scores in (False, True):  # fused and explicit paths
        a = layer(x, return_attention_scores=scores)
        b = layer(changed, return_attention_scores=scores)
        a, b = (a[0], b[0]) if scores else (a, b)
        np.testing.assert_allclose(to_np(a)[:, :4], to_np(b)[:, :4], atol=1e-6)
        assert not np.allclose(to_np(a)[:, 4:], to_np(b)[:, 4:])


def test_padding_leak_padded_tokens_change_no_real_output():
    x = random((2, 6, 8), 14)
    pad = padding([4, 2], 6)
    changed = np.where(pad[..., None], x, random((2, 6, 8), 15))
    layer = MultiHeadSelfAttention(num_heads=2)
    for scores in (False, True):
        a = layer(x, mask=pad, return_attention_scores=scores)
        b = layer(changed, mask=pad, return_attention_scores=scores)
        a, b = (a[0], b[0]) if scores else (a, b)
        np.testing.assert_allclose(to_np(a)[pad], to_np(b)[pad], atol=1e-6)
        assert np.isfinite(to_np(a)).all()


def test_fully_padded_sequence_gives_zeros_no_nan():
    x = random((2, 4, 8), 16)
    pad = padding([4, 0], 4)
    layer = MultiHeadSelfAttention(num_heads=2, use_bias=False)
    fused = to_np(layer(x, mask=pad))
    explicit, scores = layer(x, mask=pad, return_attention_scores=True)
    for out in (fused, to_np(explicit)):
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(to_np(scores)[1], 0.0)


def test_keras_mask_from_embedding_is_the_padding_mask_and_propagates():
    tokens = np.array([[4, 2, 7, 0, 0], [1, 0, 0, 0, 0]])
    inputs = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    layer = MultiHeadSelfAttention(num_heads=2)
    outputs = layer(embedded)
    assert outputs._keras_mask is not None
    model = keras.Model(inputs, outputs)
    x = to_np(model.layers[1](tokens))
    np.testing.assert_allclose(to_np(model(tokens)), np_mha(layer, x, x, (tokens != 0)[:, None]),
                               atol=1e-5)
    # eager: the mask reaches the output, also alongside an explicit attention_mask tensor
    eager = layer(model.layers[1](tokens), attention_mask=np.ones((5, 5), bool))
    np.testing.assert_array_equal(to_np(keras_mask(eager)), tokens != 0)
    np.testing.assert_allclose(to_np(eager), np_mha(layer, x, x, (tokens != 0)[:, None]),
                               atol=1e-5)


def _make_self_attention():
    return MultiHeadSelfAttention(num_heads=2, dropout=0.1, causal=True,
                                  kernel_initializer="he_normal")


def test_self_attention_layer_contract():
    run_layer_test(_make_self_attention, lambda layer, x: layer(x), [random((4, 5, 8))],
                   expected_shape=(4, 5, 8))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_self_attention_mixed_precision(policy):
    pad = padding([5, 3, 1, 0], 5)
    run_mixed_precision_test(_make_self_attention, lambda layer, x: layer(x, attention_mask=pad[:, None]),
                             [random((4, 5, 8))], policy)


def test_symbolic_scores_shape():
    x = keras.Input((5, 8))
    out, scores = MultiHeadSelfAttention(num_heads=2)(x, return_attention_scores=True)
    assert tuple(out.shape) == (None, 5, 8)
    assert tuple(scores.shape) == (None, 2, 5, 5)


def test_attention_dropout_uses_explicit_path_and_only_in_training():
    x = random((2, 5, 8))
    layer = MultiHeadSelfAttention(num_heads=2, dropout=0.5)
    inference = to_np(layer(x, training=False))
    np.testing.assert_allclose(inference, np_mha(layer, x, x), atol=1e-5)
    assert not np.allclose(to_np(layer(x, training=True)), inference)


def test_self_attention_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by num_heads=4"):
        MultiHeadSelfAttention(num_heads=4)(random((1, 2, 10)))
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadSelfAttention(num_heads=0)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"dropout.*\[0, 1\)"):
            MultiHeadSelfAttention(num_heads=2, dropout=bad)
    with pytest.raises(ValueError, match=r"inputs.*rank 3.*\(2, 8\)"):
        MultiHeadSelfAttention(num_heads=2)(random((2, 8)))
    layer = MultiHeadSelfAttention(num_heads=2)
    with pytest.raises(ValueError, match=r"attention_mask.*does not broadcast.*\(2, 4, 4\)"):
        layer(random((2, 4, 8)), attention_mask=np.ones((2, 4, 3), bool))
    with pytest.raises(ValueError, match="key_dim"):
        MultiHeadSelfAttention(num_heads=2, key_dim=0)


# --- CrossAttention -----------------------------------------------------------------------

def test_cross_attention_matches_numpy_with_context_padding():
    query, context = random((2, 3, 8), 20), random((2, 7, 6), 21)
    pad = padding([7, 2], 7)
    layer = CrossAttention(num_heads=2)
    out, scores = layer(query, context, context_mask=pad, return_attention_scores=True)
    assert tuple(out.shape) == (2, 3, 8) and tuple(scores.shape) == (2, 2, 3, 7)
    np.testing.assert_allclose(to_np(out), np_mha(layer, query, context, pad[:, None]), atol=1e-5)
    fused = layer(query, context, context_mask=pad)
    np.testing.assert_allclose(to_np(fused), to_np(out), atol=1e-5)
    np.testing.assert_array_equal(to_np(scores)[1, :, :, 2:], 0.0)


def test_cross_attention_masks_in_the_functional_api():
    q_in, c_in = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
    q_emb = keras.layers.Embedding(10, 8, mask_zero=True)
    c_emb = keras.layers.Embedding(10, 8, mask_zero=True)
    layer = CrossAttention(num_heads=2)
    out, scores = layer(q_emb(q_in), c_emb(c_in), return_attention_scores=True)
    assert out._keras_mask is not None
    model = keras.Model([q_in, c_in], [out, scores])
    q_tok = np.array([[1, 2, 0], [3, 0, 0]])
    c_tok = np.array([[5, 6, 7, 8, 0, 0], [9, 0, 0, 0, 0, 0]])
    got, got_scores = model([q_tok, c_tok])
    expected = np_mha(layer, to_np(q_emb(q_tok)), to_np(c_emb(c_tok)), (c_tok != 0)[:, None])
    np.testing.assert_allclose(to_np(got), expected, atol=1e-5)
    assert tuple(got_scores.shape) == (2, 2, 3, 6)
    eager = layer(q_emb(q_tok), c_emb(c_tok))
    np.testing.assert_array_equal(to_np(keras_mask(eager)), q_tok != 0)


def test_cross_attention_symbolic_and_eager_scores_shapes():
    q, c = keras.Input((3, 8)), keras.Input((7, 6))
    layer = CrossAttention(num_heads=2)
    out, scores = layer(q, c, return_attention_scores=True)
    assert tuple(out.shape) == (None, 3, 8) and tuple(scores.shape) == (None, 2, 3, 7)
    _, eager_scores = layer(random((4, 3, 8)), random((4, 7, 6)), return_attention_scores=True)
    assert tuple(eager_scores.shape) == (4, 2, 3, 7)


def test_cross_attention_padding_leak():
    query, context = random((2, 3, 8), 22), random((2, 5, 8), 23)
    pad = padding([3, 5], 5)
    changed = np.where(pad[..., None], context, random((2, 5, 8), 24))
    layer = CrossAttention(num_heads=2)
    for scores in (False, True):
        a = layer(query, context, context_mask=pad, return_attention_scores=scores)
        b = layer(query, changed, context_mask=pad, return_attention_scores=scores)
        a, b = (a[0], b[0]) if scores else (a, b)
        np.testing.assert_allclose(to_np(a), to_np(b), atol=1e-6)


def test_cross_attention_layer_contract():
    run_layer_test(lambda: CrossAttention(num_heads=2, dropout=0.1), lambda layer, q, c: layer(q, c),
                   [random((4, 3, 8)), random((4, 6, 4))], expected_shape=(4, 3, 8))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_cross_attention_mixed_precision(policy):
    run_mixed_precision_test(lambda: CrossAttention(num_heads=2), lambda layer, q, c: layer(q, c),
                             [random((4, 3, 8)), random((4, 6, 4))], policy)


def test_cross_attention_errors():
    layer = CrossAttention(num_heads=2)
    with pytest.raises(ValueError, match="same batch size"):
        layer(random((2, 3, 8)), random((3, 4, 8)))
    with pytest.raises(ValueError, match=r"context.*rank 3"):
        CrossAttention(num_heads=2)(random((2, 3, 8)), random((2, 8)))
    with pytest.raises(ValueError, match="d_model=6 is not divisible by num_heads=4"):
        CrossAttention(num_heads=4)(random((2, 3, 6)), random((2, 4, 8)))
    with pytest.raises(ValueError, match=r"does not broadcast.*\(2, 3, 4\)"):
        layer(random((2, 3, 8)), random((2, 4, 8)), attention_mask=np.ones((3, 3), bool))
