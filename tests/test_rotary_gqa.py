"""Rotary positions (RotaryEmbedding and the attention option) and grouped-query attention."""

import keras
import numpy as np
import pytest
import torch

from helpers import (assert_config_round_trip, np_attention, np_dense, run_layer_test,
                     run_mixed_precision_test, to_np)
from keras_tfm import CrossAttention, MultiHeadSelfAttention, RotaryEmbedding
from keras_tfm.attention import cache_keys_values


def random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def np_rotary(x, start_index=0, interleaved=False, base=10000.0):
    """NumPy RoPE of (B, T, H, d): pair i rotated by position · base^(-2i/d)."""
    d = x.shape[-1]
    positions = start_index + np.arange(x.shape[1], dtype="float64")
    angles = positions[:, None] * base ** (-2.0 * np.arange(d // 2) / d)
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    x = x.astype("float64")
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :d // 2], out[..., d // 2:] = ra, rb
    return out


# --- RotaryEmbedding ------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("start_index", [0, 7])
def test_rotary_matches_numpy_formula(interleaved, start_index):
    x = random((2, 5, 3, 8))
    layer = RotaryEmbedding(max_wavelength=500.0, interleaved=interleaved)
    got = to_np(layer(x, start_index=start_index))
    np.testing.assert_allclose(got, np_rotary(x, start_index, interleaved, 500.0), atol=1e-5)
    # the two layouts differ, and position 0 is the identity
    other = np_rotary(x, start_index, not interleaved, 500.0)
    assert np.abs(got - other).max() > 1e-2
    np.testing.assert_allclose(to_np(layer(x))[:, 0], x[:, 0], atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_scores_depend_only_on_relative_position(interleaved):
    layer = RotaryEmbedding(interleaved=interleaved)
    q, k = random((1, 1, 1, 16), 1), random((1, 1, 1, 16), 2)

    def score(m, n):
        return float((to_np(layer(q, start_index=m)) * to_np(layer(k, start_index=n))).sum())

    for m, n in [(3, 1), (10, 5), (40, 12)]:
        np.testing.assert_allclose(score(m, n), score(m - n, 0), rtol=1e-4, atol=1e-4)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3  # the score does depend on m − n


def test_rotary_half_layout_equals_transformers_apply_rotary_pos_emb():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, rope_theta=10000.0)
    q, k = random((2, 6, 2, 16), 3), random((2, 6, 2, 16), 4)
    positions = torch.arange(4, 10)[None].expand(2, -1)
    tq, tk = (torch.from_numpy(a).transpose(1, 2) for a in (q, k))  # (B, H, T, d)
    cos, sin = LlamaRotaryEmbedding(config)(tq, positions)
    ref_q, ref_k = apply_rotary_pos_emb(tq, tk, cos, sin)
    layer = RotaryEmbedding()
    np.testing.assert_allclose(to_np(layer(q, start_index=4)), ref_q.transpose(1, 2).numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(to_np(layer(k, start_index=4)), ref_k.transpose(1, 2).numpy(),
                               atol=1e-5)


def test_rotary_contract_precision_and_errors():
    layer = RotaryEmbedding(max_wavelength=100.0, interleaved=True)
    assert_config_round_trip(layer)
    x = random((1, 3, 2, 4))
    half = RotaryEmbedding(max_wavelength=100.0, interleaved=True, dtype="mixed_float16")
    out = half(x.astype("float16"), start_index=2)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    np.testing.assert_allclose(to_np(out), np_rotary(x, 2, True, 100.0), atol=2e-3)
    with pytest.raises(ValueError, match="head size must be even; received head size 5"):
        layer(random((1, 3, 2, 5)))
    with pytest.raises(ValueError, match="rank 4"):
        layer(random((1, 3, 4)))
    with pytest.raises(ValueError, match="max_wavelength"):
        RotaryEmbedding(max_wavelength=0.0)
    with pytest.raises(ValueError, match="even head size; received key_dim=3"):
        MultiHeadSelfAttention(num_heads=2, key_dim=3, rotary=True)(random((1, 4, 8)))


# --- rotary in self-attention -----------------------------------------------------------------

def np_rotary_mha(layer, x, mask=None, interleaved=False):
    q = np_rotary(np_dense(x, layer.query_dense), interleaved=interleaved)
    k = np_rotary(np_dense(x, layer.key_dense), interleaved=interleaved)
    v = np_dense(x, layer.value_dense)
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    return np_dense(np_attention(q, k, v, mask)[0], layer.output_dense)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_self_attention_matches_numpy(interleaved):
    x = random((2, 5, 16))
    layer = MultiHeadSelfAttention(num_heads=4, causal=True, rotary=True,
                                   rotary_interleaved=interleaved)
    causal = np.tril(np.ones((5, 5), bool))[None]
    np.testing.assert_allclose(to_np(layer(x)), np_rotary_mha(layer, x, causal, interleaved),
                               atol=1e-5)


def test_rotary_gqa_cache_equals_full_pass_at_the_right_offset():
    x = random((2, 7, 16))
    layer = MultiHeadSelfAttention(num_heads=4, num_key_value_heads=2, causal=True, rotary=True)
    full = to_np(layer(x))
    cache = np.zeros((2, 2, 2, 7, 4), "float32")  # (B, 2, kv heads, L, d)
    # prefill 4 tokens in one call, then one token a step
    out, cache = layer(x[:, :4], cache=cache, cache_update_index=0)
    outs = [to_np(out)]
    for i in range(4, 7):
        out, cache = layer(x[:, i:i + 1], cache=cache, cache_update_index=i)
        outs.append(to_np(out))
    assert tuple(cache.shape) == (2, 2, 2, 7, 4)
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)
    # the cache holds the rotated keys
    keys = np_rotary(np_dense(x, layer.key_dense))
    np.testing.assert_allclose(to_np(cache)[:, 0], keys.transpose(0, 2, 1, 3), atol=1e-5)


def test_cache_as_keys_values_pair_equals_stacked_and_masks_unfilled_positions():
    """A `(keys, values)` pair cache (generation's form) gives the outputs of the full pass
    and of the stacked cache, and comes back a pair holding the stacked cache's keys and
    values. Its unfilled positions hold noise, which the causal mask must keep out (a leak
    would change the prefill's and the steps' outputs)."""
    x = random((2, 7, 16))
    layer = MultiHeadSelfAttention(num_heads=4, num_key_value_heads=2, causal=True, rotary=True)
    full = to_np(layer(x))
    noise = random((2, 2, 2, 7, 4), seed=1) * 10  # (B, 2, kv heads, L, d)
    stacked, pair = noise, (noise[:, 0], noise[:, 1])
    outs = {"stacked": [], "pair": []}
    for name in outs:
        cache = stacked if name == "stacked" else pair
        out, cache = layer(x[:, :4], cache=cache, cache_update_index=0)
        outs[name].append(to_np(out))
        for i in range(4, 7):
            out, cache = layer(x[:, i:i + 1], cache=cache, cache_update_index=i)
            outs[name].append(to_np(out))
        if name == "stacked":
            stacked = to_np(cache)
        else:
            pair = cache
    assert isinstance(pair, tuple) and len(pair) == 2
    assert all(tuple(part.shape) == (2, 2, 7, 4) for part in pair)
    np.testing.assert_allclose(np.concatenate(outs["pair"], 1), full, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(outs["stacked"], 1), full, atol=1e-5)
    for got, want in zip(pair, (stacked[:, 0], stacked[:, 1])):
        np.testing.assert_allclose(to_np(got), want, atol=1e-6)
    # symbolic: the cache's spec in the form given
    spec = layer.compute_output_spec(keras.KerasTensor((2, 1, 16)),
                                     cache=tuple(keras.KerasTensor((2, 2, 7, 4)) for _ in "kv"),
                                     cache_update_index=3)
    assert tuple(spec[0].shape) == (2, 1, 16)
    assert isinstance(spec[1], tuple) and [tuple(p.shape) for p in spec[1]] == [(2, 2, 7, 4)] * 2


# --- grouped-query attention --------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_matches_numpy_reference_and_torch_sdpa(kv_heads):
    x, context = random((2, 5, 16), 5), random((2, 6, 16), 6)
    pad = np.arange(6)[None] < np.array([[6], [3]])
    layer = CrossAttention(num_heads=4, num_key_value_heads=kv_heads)
    got = to_np(layer(x, context, context_mask=pad))
    assert tuple(layer.key_dense.kernel.shape) == (16, kv_heads, 4)
    assert tuple(layer.value_dense.kernel.shape) == (16, kv_heads, 4)
    assert tuple(layer.query_dense.kernel.shape) == (16, 4, 4)
    q, k, v = (np_dense(a, d) for a, d in ((x, layer.query_dense), (context, layer.key_dense),
                                           (context, layer.value_dense)))
    group = 4 // kv_heads
    mask = np.broadcast_to(pad[:, None], (2, 5, 6))
    attended, _ = np_attention(q, np.repeat(k, group, 2), np.repeat(v, group, 2), mask)
    np.testing.assert_allclose(got, np_dense(attended, layer.output_dense), atol=1e-5)
    # torch's own grouped-query attention on the same projections
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
                  for a in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(mask.copy())[:, None], enable_gqa=True)
    np.testing.assert_allclose(np_dense(ref.transpose(1, 2).numpy(), layer.output_dense), got,
                               atol=1e-5)


def test_gqa_cache_shapes_and_context_cache():
    x = random((2, 3, 16))
    cross = CrossAttention(num_heads=4, num_key_value_heads=2)
    cross(x, x)
    assert tuple(cross.compute_context_cache(x).shape) == (2, 2, 2, 3, 4)
    np.testing.assert_allclose(to_np(cross(x, context_cache=cross.compute_context_cache(x))),
                               to_np(cross(x, x)), atol=1e-6)
    keys, values = cache_keys_values(cross.compute_context_cache(x))  # the split form
    assert tuple(keys.shape) == tuple(values.shape) == (2, 2, 3, 4)
    np.testing.assert_allclose(to_np(cross(x, context_cache=(keys, values))),
                               to_np(cross(x, x)), atol=1e-6)


def test_gqa_fully_masked_rows_are_zero_and_finite():
    x = random((2, 4, 16))
    pad = np.array([[True] * 4, [False] * 4])
    layer = MultiHeadSelfAttention(num_heads=4, num_key_value_heads=1, rotary=True)
    for fused in (True, False):  # return_attention_scores takes the explicit path
        out = layer(x, mask=pad, return_attention_scores=not fused)
        out = to_np(out if fused else out[0])
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out[1], np_dense(np.zeros((1, 4, 4, 4)), layer.output_dense)[0],
                                   atol=1e-6)


def test_gqa_errors_name_both_values():
    with pytest.raises(ValueError, match="num_heads=6, num_key_value_heads=4"):
        MultiHeadSelfAttention(num_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_heads=4, num_key_value_heads=3"):
        CrossAttention(num_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=0"):
        MultiHeadSelfAttention(num_heads=4, num_key_value_heads=0)


def _make_rotary_gqa():
    return MultiHeadSelfAttention(num_heads=4, num_key_value_heads=2, causal=True, rotary=True,
                                  rotary_max_wavelength=500.0, dropout=0.1)


def test_rotary_gqa_layer_contract():
    run_layer_test(_make_rotary_gqa, lambda layer, x: layer(x), [random((4, 5, 16))],
                   expected_shape=(4, 5, 16))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_rotary_gqa_mixed_precision(policy):
    pad = np.arange(5)[None] < np.array([[5], [3], [1], [0]])
    run_mixed_precision_test(_make_rotary_gqa,
                             lambda layer, x: layer(x, attention_mask=pad[:, None]),
                             [random((4, 5, 16))], policy)


def test_rotary_gqa_keras_file_round_trip(tmp_path):
    inputs = keras.Input((None, 16))
    outputs = _make_rotary_gqa()(inputs)
    model = keras.Model(inputs, outputs)
    x = random((2, 6, 16))
    path = str(tmp_path / "attention.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(restored(x)), to_np(model(x)), atol=1e-6)
    layer = restored.layers[-1]
    assert (layer.num_key_value_heads, layer.rotary, layer.rotary_max_wavelength) == (2, True,
                                                                                       500.0)


def _make_gqa_cross():
    return CrossAttention(num_heads=4, num_key_value_heads=1, dropout=0.1)


def test_gqa_cross_attention_contract_and_mixed_precision():
    run_layer_test(_make_gqa_cross, lambda layer, q, c: layer(q, c),
                   [random((3, 4, 16)), random((3, 6, 16))], expected_shape=(3, 4, 16))
    run_mixed_precision_test(_make_gqa_cross, lambda layer, q, c: layer(q, c),
                             [random((3, 4, 16)), random((3, 6, 16))], "mixed_bfloat16")
