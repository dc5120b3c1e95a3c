"""Every mask rule of keras_tfm, in one place.

Convention: a mask is boolean and **True means "may attend" / "is a real token"** — the
convention of Keras (`Embedding(mask_zero=True)`), JAX and `scaled_dot_product_attention`.
The seeds draw them the other way round: their PAD mask is 1 at padding (convert it with
`from_pad_indicator`, or build ours from token ids with `padding_mask`); their causal mask is
additive, 0 on and below the diagonal and -inf above (ours, `causal_mask(T)`, is True exactly
where theirs is 0). Seed masks combine by union of the *blocked* positions, ours by AND of the
*allowed* ones (`merge_masks`): the same rule.

Non-boolean masks are accepted only as 0/1, checked where values are concrete (in a traced
graph a mask is read as `mask != 0`); a padding mask `(B, S)` goes to `mask=`, never to
`attention_mask`. A query row with no allowed key gives zeros (see `keras_tfm.attention`).
More: docs/masks.md."""

import keras
import numpy as np
from keras import ops

# Fill values for disallowed scores before the softmax: finite, so a row never becomes all -inf
# (NaN). float16 gets its own most negative value (-1e9 would overflow to -inf there); wider
# dtypes (the explicit attention path computes its softmax in float32) get -1e9.
MASK_FILL_VALUE_FLOAT16 = -65504.0
MASK_FILL_VALUE = -1e9


def padding_mask(token_ids, pad_id=0, keep_first=False):
    """Boolean padding mask of token ids: True for real tokens.

    Args:
        token_ids: int tensor of shape `(batch, length)`.
        pad_id: the id of the padding token.
        keep_first: count position 0 as a real token whatever its id: a decoder whose start
            token is the padding id (MarianMT) still attends to it.

    Returns:
        bool tensor of shape `(batch, length)`.

    Example:

    >>> padding_mask(np.array([[5, 7, 0, 0]]))  # doctest: +SKIP
    [[True, True, False, False]]
    """
    mask = ops.not_equal(token_ids, pad_id)
    if keep_first:
        mask = ops.concatenate([ops.ones_like(mask[:, :1]), mask[:, 1:]], axis=1)
    return mask


def ignored_target_id(ignore_class=0, pad_id=None):
    """The target id that the masked loss and accuracy skip: `pad_id` when given (a model's
    padding id, e.g. `model.special_ids["pad_id"]`), else `ignore_class`; both, different: a
    ValueError."""
    if pad_id is None:
        return ignore_class
    if ignore_class not in (0, None, pad_id):
        raise ValueError(f"Give the padding id once: received ignore_class={ignore_class!r} and "
                         f"pad_id={pad_id!r}.")
    return pad_id


def target_weights(y_true, ignore_class=0, sample_weight=None):
    """float32 weights `(B, T)` of target tokens: 1 for real tokens, 0 for `ignore_class`
    (None counts every token), times `sample_weight` (`(B,)` or `(B, T)`) if given. Used by the
    masked loss and accuracy."""
    if ignore_class is None:
        weights = ops.ones(ops.shape(y_true), "float32")
    else:
        weights = ops.cast(padding_mask(y_true, pad_id=ignore_class), "float32")
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, "float32")
        if len(sample_weight.shape) == 1:
            sample_weight = sample_weight[:, None]
        weights = weights * sample_weight
    return weights


def from_pad_indicator(pad_indicator):
    """Convert the seeds' PAD mask (1 = padding) to keras_tfm's (True = real token)."""
    return ops.logical_not(ops.cast(pad_indicator, "bool"))


def causal_mask(query_length, key_length=None, offset=None):
    """Boolean causal mask of shape `(query_length, key_length)`; True where attention is allowed.

    Query `i` sees keys `0 … offset + i`. By default `offset = key_length - query_length`, so the
    mask is bottom-right aligned: lower-triangular when the lengths are equal, and in cached
    decoding (a query shorter than the keys) the last query sees every key.

    Args:
        query_length: int (or scalar int tensor), T.
        key_length: int (or scalar int tensor), S. Defaults to `query_length`.
        offset: position of the first query among the keys (int or scalar int tensor), e.g. the
            cache index during cached decoding. Defaults to `key_length - query_length`.

    Returns:
        bool tensor of shape `(T, S)`.
    """
    if key_length is None:
        key_length = query_length
    if isinstance(query_length, int) and isinstance(key_length, int):
        if query_length < 1 or key_length < 1:
            raise ValueError(
                "causal_mask needs positive lengths; received "
                f"query_length={query_length}, key_length={key_length}."
            )
        if offset is None and query_length > key_length:
            raise ValueError(
                "A bottom-right aligned causal mask needs query_length <= key_length; received "
                f"query_length={query_length}, key_length={key_length}. Pass `offset` explicitly."
            )
    if offset is None:
        offset = key_length - query_length
    query_positions = ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32")
    key_positions = ops.arange(key_length, dtype="int32")
    return ops.greater_equal(query_positions[:, None], key_positions[None, :])


def _static_shape(x):
    return tuple(None if d is None else int(d) for d in x.shape)


def same_length(query, key):
    """Whether `query (B, T, ...)` and `key (B, S, ...)` are known to have `T == S` (a causal
    mask is then lower-triangular, top-left and bottom-right alike); False when unknown."""
    query_length, key_length = _static_shape(query)[1], _static_shape(key)[1]
    return query_length is not None and query_length == key_length


def _check_broadcast(name, shape, expected, axes="(batch, query length, key length)",
                     hint=""):
    """Check that `shape` broadcasts to `expected` (None = unknown, skipped); a rank-2 `shape`
    against `expected` of rank 3 is read as (query length, key length)."""
    if len(shape) == 2 and len(expected) == 3:
        compared = (1,) + tuple(shape)
        axes += "; a rank-2 mask is (query length, key length)"
    else:
        compared = shape
    if len(compared) != len(expected):
        raise ValueError(
            f"`{name}` must have rank {len(expected)}, i.e. shape {_fmt(expected)} {axes}; "
            f"received shape {_fmt(shape)}.{hint}"
        )
    for got, want in zip(compared, expected):
        if got is None or want is None or got == 1 or got == want:
            continue
        raise ValueError(
            f"`{name}` of shape {_fmt(shape)} does not broadcast to the attention shape "
            f"{_fmt(expected)} {axes}.{hint}"
        )


_PADDING_HINT = (
    "a (batch, key length) padding mask goes to the layers' `mask=` (`context_mask=` in "
    "CrossAttention, `inputs_mask=` / `encoder_outputs_mask=` in TransformerDecoderBlock), or "
    "comes from `mask_zero=True` in the embedding; in scaled_dot_product_attention it is "
    "`padding[:, None, :]`."
)
_CONVERT_HINT = (
    "Convert it first: an additive mask m (0 = allowed, -inf = blocked) is `m == 0`; the seeds' "
    "PAD mask (1 = padding) is `keras_tfm.masks.from_pad_indicator(m)`; " + _PADDING_HINT
)


def _concrete_values(x):
    """NumPy values of `x`, or None inside a traced graph (jit, tf.function, symbolic)."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple, bool, int, float)):
        return np.asarray(x)
    try:
        return np.asarray(ops.convert_to_numpy(x))
    except Exception:  # a tracer or a symbolic tensor: each backend raises its own error
        return None


def to_bool_mask(mask, name="mask"):
    """`mask` as a bool tensor, True = may attend.

    A bool mask passes unchanged. Any other dtype must hold only 0 and 1 (1 = may attend),
    checked where the values are concrete; in a traced graph it is cast (`!= 0`) unchecked.

    Raises:
        ValueError: for concrete values other than 0/1 (additive or negative masks), saying how
            to convert them.
    """
    dtype = mask.dtype if hasattr(mask, "dtype") else np.asarray(mask).dtype
    if keras.backend.standardize_dtype(dtype) == "bool":
        return ops.convert_to_tensor(mask)
    values = _concrete_values(mask)
    if values is not None and not np.isin(values, (0, 1)).all():
        odd = np.unique(values[~np.isin(values, (0, 1))])[:4].tolist()
        raise ValueError(
            f"`{name}` must be boolean (True = may attend) or hold only 0 and 1 (1 = may "
            f"attend); received dtype {values.dtype} with values {odd} (an additive or "
            f"negative mask?). {_CONVERT_HINT}"
        )
    return ops.cast(mask, "bool")


def check_attention_mask(mask, query, key):
    """Check a mask of `scaled_dot_product_attention`; return it as bool `(B|1, T|1, S|1)`.

    Args:
        mask: None, or bool / 0-1 `(B, T, S)` or `(T, S)` (or broadcasting to them).
        query: `(B, T, H, d)`; key: `(B, S, H, d)`; only their shapes are used.

    Raises:
        ValueError: when the mask is not 0/1 or does not broadcast to `(B, T, S)`, naming the
            shape that was passed.
    """
    if mask is None:
        return None
    mask = to_bool_mask(mask)
    expected = _static_shape(query)[:2] + _static_shape(key)[1:2]
    shape = _static_shape(mask)
    hint = " (" + _PADDING_HINT[0].upper() + _PADDING_HINT[1:-1] + ".)"
    _check_broadcast("mask", shape, expected, hint=hint)
    return mask[None] if len(shape) == 2 else mask


def _fmt(shape):
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def merge_masks(
    query,
    key,
    key_padding_mask=None,
    attention_mask=None,
    causal=False,
    causal_offset=None,
):
    """AND together the padding, causal and explicit masks of one attention call.

    Args:
        query: the queries, any tensor of shape `(B, T, ...)`; only its shape is used.
        key: the keys, any tensor of shape `(B, S, ...)`; only its shape is used.
        key_padding_mask: bool `(B, S)`, True for real key tokens (e.g. a Keras mask).
        attention_mask: bool (or 0/1) `(B, T, S)` or `(T, S)`, or anything broadcasting to
            `(B, T, S)`; True where attention is allowed.
        causal: whether to apply `causal_mask(T, S, causal_offset)`.
        causal_offset: see `causal_mask`.

    Returns:
        None when there is nothing to mask, else a bool tensor of rank 3 that broadcasts to
        `(B, T, S)`.

    Raises:
        ValueError: when a mask does not broadcast to `(B, T, S)`.
    """
    batch_size, query_length = _static_shape(query)[:2]
    key_length = _static_shape(key)[1]
    merged = None
    if key_padding_mask is not None:
        _check_broadcast("key padding mask", _static_shape(key_padding_mask),
                         (batch_size, key_length), "(batch, key length)")
        merged = to_bool_mask(key_padding_mask, "key padding mask")[:, None, :]
    if attention_mask is not None:
        shape = _static_shape(attention_mask)
        attention_mask = to_bool_mask(attention_mask, "attention_mask")
        if len(shape) == 2:
            padding_like = shape[0] == batch_size and shape[1] in (key_length, None)
            hint = (" It looks like a padding mask, not an `attention_mask`: "
                    + _PADDING_HINT) if padding_like else ""
            _check_broadcast("attention_mask", shape, (batch_size, query_length, key_length),
                             hint=hint)
            attention_mask = attention_mask[None]
        else:
            _check_broadcast("attention_mask", shape, (batch_size, query_length, key_length))
        merged = attention_mask if merged is None else ops.logical_and(merged, attention_mask)
    if causal:
        mask = causal_mask(ops.shape(query)[1], ops.shape(key)[1], causal_offset)[None]
        merged = mask if merged is None else ops.logical_and(merged, mask)
    return merged


def apply_to_scores(scores, mask):
    """Set disallowed attention scores to a large negative value that the scores' dtype holds
    (`MASK_FILL_VALUE_FLOAT16` for float16, `MASK_FILL_VALUE` otherwise); mask broadcasts."""
    dtype = keras.backend.standardize_dtype(scores.dtype)
    fill = MASK_FILL_VALUE_FLOAT16 if dtype == "float16" else MASK_FILL_VALUE
    return ops.where(mask, scores, ops.cast(fill, dtype))


def keras_mask(x):
    """The Keras mask attached to `x` (set by `Embedding(mask_zero=True)` and propagated), or None.

    Keras fills a layer's `mask` argument only when `call` gets a single tensor; a layer that
    also receives an `attention_mask` tensor reads the mask from its input here. Keras keeps no
    public accessor for it, hence the private import in this one place.
    """
    from keras.src.backend import get_keras_mask

    return get_keras_mask(x)
