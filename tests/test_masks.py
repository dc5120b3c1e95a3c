"""keras_tfm.masks: padding, causal (bottom-right aligned, offset-aware) and merging."""

import numpy as np
import pytest
from keras import ops

from helpers import to_np
from keras_tfm import masks


def test_padding_mask_true_for_real_tokens():
    tokens = np.array([[5, 7, 0, 0], [3, 0, 0, 0], [1, 2, 3, 4]])
    expected = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
    got = to_np(masks.padding_mask(tokens))
    assert got.dtype == bool
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(to_np(masks.padding_mask(tokens + 1, pad_id=1)), expected)


def test_seed_pad_indicator_converts_to_our_convention():
    # Seed 000: three sequences padded to length 4, PAD mask 1 = padding.
    seed_pad_mask = np.array([[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
    ours = to_np(masks.from_pad_indicator(seed_pad_mask))
    np.testing.assert_array_equal(ours, seed_pad_mask == 0)


def test_causal_mask_is_the_seed_upper_triangular_mask():
    # Seed 000: 0 on and below the diagonal, -inf above; ours is True exactly where it is 0.
    seed = np.array([[0, -np.inf, -np.inf, -np.inf],
                     [0, 0, -np.inf, -np.inf],
                     [0, 0, 0, -np.inf],
                     [0, 0, 0, 0]])
    np.testing.assert_array_equal(to_np(masks.causal_mask(4)), seed == 0)


def test_causal_mask_bottom_right_aligned_when_query_shorter():
    got = to_np(masks.causal_mask(2, 5))
    # Query i sees keys 0 … S - T + i.
    np.testing.assert_array_equal(got, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # The last row of the full mask equals a one-query mask over the same keys.
    np.testing.assert_array_equal(to_np(masks.causal_mask(1, 5))[0], to_np(masks.causal_mask(5))[-1])


def test_causal_mask_offset_for_a_preallocated_cache():
    # A cache of 6 slots, query at position 2: sees keys 0, 1, 2 only (the rest is unfilled).
    got = to_np(masks.causal_mask(1, 6, offset=ops.convert_to_tensor(2)))
    np.testing.assert_array_equal(got, [[1, 1, 1, 0, 0, 0]])


def test_causal_mask_rejects_bad_lengths():
    with pytest.raises(ValueError, match="query_length=5, key_length=3"):
        masks.causal_mask(5, 3)
    with pytest.raises(ValueError, match="positive lengths"):
        masks.causal_mask(0)


def test_merge_masks_ands_padding_causal_and_explicit():
    query = np.zeros((2, 3, 4), "float32")
    padding = np.array([[1, 1, 0], [1, 1, 1]], bool)
    explicit = np.array([[1, 0, 1], [1, 1, 1], [1, 1, 1]], bool)
    merged = to_np(masks.merge_masks(query, query, key_padding_mask=padding,
                                     attention_mask=explicit, causal=True))
    causal = np.tril(np.ones((3, 3), bool))
    expected = padding[:, None, :] & explicit[None] & causal[None]
    np.testing.assert_array_equal(np.broadcast_to(merged, (2, 3, 3)), expected)
    assert masks.merge_masks(query, query) is None


def test_merge_masks_validates_shapes():
    query = np.zeros((2, 3, 4), "float32")
    key = np.zeros((2, 5, 4), "float32")
    with pytest.raises(ValueError, match=r"does not broadcast.*\(2, 3, 5\)"):
        masks.merge_masks(query, key, attention_mask=np.ones((2, 3, 4), bool))
    with pytest.raises(ValueError, match=r"key padding mask.*\(2, 4\)"):
        masks.merge_masks(query, key, key_padding_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="rank 3"):
        masks.merge_masks(query, key, attention_mask=np.ones((1, 2, 3, 5), bool))
    # Broadcastable shapes are accepted.
    merged = masks.merge_masks(query, key, attention_mask=np.ones((1, 3, 5), bool))
    assert tuple(merged.shape) == (1, 3, 5)


def test_mask_fill_value_fits_float16():
    assert np.isfinite(np.float16(masks.MASK_FILL_VALUE_FLOAT16))
    scores = ops.convert_to_tensor(np.array([[1.0, 2.0, 3.0]], "float16"))
    filled = to_np(masks.apply_to_scores(scores, np.array([[True, False, True]])))
    assert filled.dtype == np.float16 and np.isfinite(filled).all()
    weights = to_np(ops.softmax(ops.cast(filled, "float32")))
    assert weights[0, 1] == 0.0
    # float32 scores (the explicit path's softmax) get a fill far below any real score
    scores32 = ops.convert_to_tensor(np.array([[-1e5, 0.0]], "float32"))
    filled32 = to_np(masks.apply_to_scores(scores32, np.array([[True, False]])))
    assert filled32[0, 1] < -1e8 and to_np(ops.softmax(filled32))[0, 0] == 1.0


def test_padding_mask_with_a_start_token_that_is_the_padding_id():
    # MarianMT pads with its last id and starts the decoder from it: position 0 stays real.
    tokens = np.array([[9, 4, 5, 9], [9, 9, 9, 9]])
    np.testing.assert_array_equal(to_np(masks.padding_mask(tokens, pad_id=9, keep_first=True)),
                                  [[True, True, True, False], [True, False, False, False]])
    np.testing.assert_array_equal(to_np(masks.padding_mask(tokens, pad_id=9)),
                                  [[False, True, True, False], [False] * 4])


def test_the_ignored_target_id_is_the_padding_id_when_one_is_given():
    assert masks.ignored_target_id() == 0
    assert masks.ignored_target_id(pad_id=58100) == 58100
    assert masks.ignored_target_id(-100) == -100
    with pytest.raises(ValueError, match="ignore_class=-100 and pad_id=5"):
        masks.ignored_target_id(-100, pad_id=5)
