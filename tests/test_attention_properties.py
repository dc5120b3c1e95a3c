"""Property test of scaled_dot_product_attention (hypothesis): random shapes, lengths, padding,
head counts, causality and both paths give finite outputs, fused == explicit == NumPy, nothing
leaks through a masked key, and rows with no allowed key are zero."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import np_attention, to_np
from keras_tfm import masks, scaled_dot_product_attention


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 3))
    key = draw(st.integers(1, 6))
    causal = draw(st.booleans())
    query = draw(st.integers(1, key)) if causal else draw(st.integers(1, 6))
    return dict(
        batch=batch, query=query, key=key, causal=causal,
        heads=draw(st.integers(1, 3)), width=draw(st.sampled_from([2, 4, 8])),
        # real keys per row; 0 = a fully padded row
        lengths=draw(st.lists(st.integers(0, key), min_size=batch, max_size=batch)),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@settings(max_examples=30, deadline=None)
@given(attention_cases())
def test_attention_properties(case):
    b, t, s, h, d = (case[k] for k in ("batch", "query", "key", "heads", "width"))
    rng = np.random.default_rng(case["seed"])
    q, k, v = (rng.normal(size=shape).astype("float32")
               for shape in ((b, t, h, d), (b, s, h, d), (b, s, h, d)))
    padding = np.arange(s)[None] < np.array(case["lengths"])[:, None]
    mask = masks.merge_masks(q, k, key_padding_mask=padding, causal=case["causal"])
    allowed = np.broadcast_to(to_np(mask), (b, t, s))

    def attend(q, k, v, fused):
        return to_np(scaled_dot_product_attention(q, k, v, mask=mask, fused=fused))

    fused, explicit = attend(q, k, v, None), attend(q, k, v, False)
    assert np.isfinite(fused).all() and np.isfinite(explicit).all()
    np.testing.assert_allclose(fused, explicit, atol=2e-5)
    np.testing.assert_allclose(explicit, np_attention(q, k, v, allowed)[0], atol=2e-5)
    empty = ~allowed.any(-1)  # (B, T): rows with no allowed key
    assert (fused[empty] == 0).all() and (explicit[empty] == 0).all()

    # No leak: new keys and values wherever a query may not look change nothing it sees.
    for j in range(s):
        blind = ~allowed[:, :, j]  # (B, T): queries that must not see key j
        if not blind.any():
            continue
        k2, v2 = k.copy(), v.copy()
        k2[:, j] += 5.0
        v2[:, j] -= 7.0
        for fused_path in (None, False):
            changed = attend(q, k2, v2, fused_path)
            np.testing.assert_allclose(changed[blind], explicit[blind], atol=2e-5)
